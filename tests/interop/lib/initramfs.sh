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

# add_with_libs STAGING PATH [GUESTPATH]: copies an executable or library and the shared
# libraries it needs. Without SYSROOT, PATH is a file of this host and its libraries are those
# ldd resolves here (the guest runs the same Debian release). With SYSROOT set (packages of
# another release extracted there), PATH is taken under SYSROOT and resolved by that release's
# own dynamic loader; a library that is not found under SYSROOT is an error.
add_with_libs() {
    local st=$1 f=$2 dst=${3:-$2} src=${SYSROOT:-}$2 line lib guest libs
    [[ -e $src ]] || die "$src not found"
    add_file "$st" "$src" "$dst"
    if [[ -n ${SYSROOT:-} ]]; then
        local multiarch=$SYSROOT/usr/lib/x86_64-linux-gnu
        libs=$("$multiarch/ld-linux-x86-64.so.2" --library-path "$multiarch" --list "$src" 2>&1) ||
            die "$f: $libs"
    else
        libs=$(ldd "$src" 2>/dev/null || true)
    fi
    while read -r line; do
        guest=""
        case "$line" in
        *"not found"*) die "$f: unresolved library: $line" ;;
        /*" => /"*) # the program interpreter, as the program names it, and where it was found
            guest=${line%% => *}
            lib=${line#* => }
            ;;
        *"=> /"*) lib=${line#*=> } ;;
        /*) lib=$line ;;
        *) continue ;;
        esac
        lib=${lib%% (*}
        if [[ -n ${SYSROOT:-} ]]; then
            [[ $lib == "$SYSROOT"/* ]] || die "$f: $lib is not under $SYSROOT (a package is missing)"
            lib=${lib#"$SYSROOT"}
        fi
        guest=${guest:-$lib}
        [[ -e $st$(guest_path "$guest") ]] || add_file "$st" "${SYSROOT:-}$lib" "$guest"
    done <<<"$libs"
}

# write_cpio STAGING: writes a newc cpio archive of STAGING, owned by root, to stdout.
write_cpio() {
    (cd "$1" && find . -mindepth 1 | sed 's|^\./||' | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet)
}
