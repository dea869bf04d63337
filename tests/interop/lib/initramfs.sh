# shellcheck shell=bash
# Helpers shared by setup.sh and guest.sh to fill an initramfs staging directory.
# Sourced by bash; callers define die().

# Guest paths use a merged /usr: /lib, /lib64, /bin and /sbin are symlinks into /usr, so files
# are always stored under /usr and never replace those symlinks when archives are concatenated.
guest_path() {
    case "$1" in
    /lib/* | /lib64/* | /bin/* | /sbin/*) echo "/usr$1" ;;
    *) echo "$1" ;;
    esac
}

# add_file STAGING HOSTPATH [GUESTPATH]: copies a file, following symlinks.
add_file() {
    local st=$1 src=$2 dst=${3:-$2}
    dst=$(guest_path "$dst")
    mkdir -p "$st$(dirname "$dst")"
    cp -L --preserve=mode "$src" "$st$dst"
}

# add_with_libs STAGING HOSTPATH [GUESTPATH]: copies an executable or library and the shared
# libraries it needs (as resolved by ldd on this host; the guest runs the same Debian release).
add_with_libs() {
    local st=$1 f=$2 dst=${3:-$2} line lib
    [[ -e $f ]] || die "$f not found"
    add_file "$st" "$f" "$dst"
    while read -r line; do
        case "$line" in
        *"not found"*) die "$f: unresolved library: $line" ;;
        *"=> /"*) lib=${line#*=> } ;;
        /*) lib=$line ;;
        *) continue ;;
        esac
        lib=${lib%% (*}
        [[ -e $st$(guest_path "$lib") ]] || add_file "$st" "$lib"
    done < <(ldd "$f" 2>/dev/null || true)
}

# write_cpio STAGING: writes a newc cpio archive of STAGING, owned by root, to stdout.
write_cpio() {
    (cd "$1" && find . -mindepth 1 | sed 's|^\./||' | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet)
}
