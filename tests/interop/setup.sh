#!/usr/bin/env bash
# Prepares the QEMU guest used by the interop tests (Linux kernel NVMe-oF host/target and
# Soft-RoCE as real peers). Idempotent: a second run only checks that everything is in place.
#
#   tests/interop/setup.sh [--with-k612] [--with-rocksdb] [--refresh-kernel] [--rebuild]
#
#   --with-rocksdb    also build the rocksdb segment (guest.sh --with-rocksdb): RocksDB's
#                     db_bench (rocksdb-tools) and open-iscsi's iscsid and iscsiadm
#   --with-avahi      also pack avahi-daemon, avahi-browse and dbus-daemon (guest.sh --with-avahi;
#                     installs Debian's avahi-daemon and avahi-utils here)
#   --with-k612       also prepare the Linux 6.12 guest (guest.sh --kernel 612): Debian trixie's
#                     linux-image-6.12.*+deb13-amd64, nvme-cli 2.13 and tlshd (ktls-utils) with
#                     trixie's libraries, fetched through a private apt configuration
#   --refresh-kernel  pick the kernel packages again (the newest linux-image-6.1.*-amd64 that apt
#                     offers; with --with-k612 also the newest 6.12 kernel and trixie userland)
#                     instead of reusing the cached ones
#   --rebuild         rebuild every initramfs segment even when its inputs did not change
#
# Environment:
#   INTEROP_CACHE       cache directory (default: tests/interop/.cache)
#   INTEROP_KERNEL_PKG  exact kernel package to use (e.g. linux-image-6.1.0-56-amd64-unsigned)
#
# Result (paths recorded in $INTEROP_CACHE/guest.env, read by guest.sh):
#   kernel/<kver>/              the kernel package, its vmlinuz and config, and the vmlinux
#                               extracted from vmlinuz (booted directly through PVH)
#   initrd/base.cpio.zst        busybox, /init, kernel modules (tests/interop/modules.list)
#   initrd/nvme.cpio.zst        nvme-cli and its shared libraries
#   initrd/fio.cpio.zst         fio and its shared libraries (large; only for --with-fio)
#   initrd/avahi.cpio.zst       with --with-avahi: avahi-daemon, avahi-browse, dbus-daemon
#   initrd/rdma.cpio.zst        iproute2's rdma, libibverbs + rxe provider, verbs/rdmacm tools
#   initrd/ext4.cpio.zst        mke2fs and e2fsck (e2fsprogs) and their shared libraries
#   initrd/rocksdb.cpio.zst     with --with-rocksdb: db_bench, iscsid, iscsiadm, iscsistart,
#                               /etc/iscsi/iscsid.conf and their shared libraries
#   k612/kernel/<kver>/         with --with-k612: trixie's 6.12 kernel package, vmlinuz, config,
#                               vmlinux; k612/debs/ the trixie userland packages, k612/apt/ the
#                               private apt configuration and lists
#   initrd/base-612.cpio.zst    busybox, /init, 6.12 modules (modules.list + modules-612.list)
#   initrd/nvme-612.cpio.zst    trixie's nvme-cli and tlshd, /etc/tlshd.conf, trixie's libraries
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${INTEROP_CACHE:-$HERE/.cache}
REFRESH_KERNEL=0
REBUILD=0
WITH_K612=0
WITH_ROCKSDB=0
WITH_AVAHI=0

while [[ $# -gt 0 ]]; do
    case "$1" in
    --with-k612) WITH_K612=1 ;;
    --with-rocksdb) WITH_ROCKSDB=1 ;;
    --with-avahi) WITH_AVAHI=1 ;;
    --refresh-kernel) REFRESH_KERNEL=1 ;;
    --rebuild) REBUILD=1 ;;
    -h | --help)
        awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"
        exit 0
        ;;
    *)
        echo "setup.sh: unknown argument: $1" >&2
        exit 2
        ;;
    esac
    shift
done

log() { echo "setup: $*" >&2; }
die() {
    echo "setup: error: $*" >&2
    exit 1
}

# shellcheck source=lib/initramfs.sh
. "$HERE/lib/initramfs.sh"

T0=$(date +%s.%N)
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)

# ---------------------------------------------------------------------------------------------
# 1. Host packages
# ---------------------------------------------------------------------------------------------
PACKAGES=(
    qemu-system-x86 # qemu-system-x86_64 (TCG)
    busybox-static  # guest userland
    nvme-cli        # guest: nvme discover/connect/list/id-ctrl
    fio             # guest: data verification and throughput
    iproute2        # guest: rdma link
    ibverbs-providers
    ibverbs-utils
    rdmacm-utils
    cpio
    kmod # depmod / modprobe --show-depends on the host
    zstd
    python3   # host-side NVMe/TCP probes
    e2fsprogs # guest: mke2fs, e2fsck
)
# The rocksdb segment: db_bench, and open-iscsi's libraries (open-iscsi itself is only
# downloaded: installing it would bring udev and start iscsid on this machine).
[[ $WITH_ROCKSDB == 0 ]] || PACKAGES+=(rocksdb-tools libopeniscsiusr libisns0)
[[ $WITH_AVAHI == 0 ]] || PACKAGES+=(avahi-daemon avahi-utils dbus-daemon)
APT_UPDATED=0
apt_update() {
    if [[ $APT_UPDATED == 0 ]]; then
        log "apt-get update"
        apt-get update -qq >&2
        APT_UPDATED=1
    fi
}

missing=()
for p in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
        missing+=("$p")
    fi
done
if [[ ${#missing[@]} -gt 0 ]]; then
    [[ $(id -u) == 0 ]] || die "packages missing (${missing[*]}); run as root to install them"
    apt_update
    log "installing: ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 not found after install"

# ---------------------------------------------------------------------------------------------
# 2. Guest kernels: Debian linux-image-6.1.*-amd64 (unsigned flavour when offered) and, with
#    --with-k612, trixie's linux-image-6.12.*+deb13-amd64
# ---------------------------------------------------------------------------------------------

# pick_kernel_pkg REGEX [APT OPTIONS...]: the newest package matching REGEX that has an install
# candidate.
pick_kernel_pkg() {
    local re=$1 p cand
    shift
    for p in $(apt-cache "$@" search --names-only "$re" 2>/dev/null | awk '{print $1}' | sort -rV); do
        cand=$(apt-cache "$@" policy "$p" 2>/dev/null | awk '/Candidate:/ {print $2}')
        if [[ -n $cand && $cand != "(none)" ]]; then
            echo "$p"
            return 0
        fi
    done
    return 1
}

# Each kernel is cached in KDIR/<kver>/: PACKAGE, kernel.deb, vmlinuz, config, vmlinux. The
# module tree (root/) is extracted from kernel.deb only while its base segment is being built.

# cached_kernel KDIR [PACKAGE]: prints the cached kernel version of KDIR when it is complete
# (and built from PACKAGE, if given), nothing otherwise.
cached_kernel() {
    local kdir=$1 want=${2:-} kver f
    [[ $REFRESH_KERNEL == 0 && -f $kdir/CURRENT ]] || return 0
    kver=$(cat "$kdir/CURRENT")
    [[ -z $want || $(cat "$kdir/$kver/PACKAGE" 2>/dev/null) == "$want" ]] || return 0
    for f in PACKAGE kernel.deb vmlinuz config; do
        if [[ ! -f $kdir/$kver/$f ]]; then
            log "cached kernel $kver is incomplete ($f); fetching again"
            return 0
        fi
    done
    echo "$kver"
}

# fetch_kernel KDIR PACKAGE [APT OPTIONS...]: downloads PACKAGE (apt checks its hash against the
# signed package lists) into KDIR/<kver>/, makes it KDIR's current kernel and removes the others.
fetch_kernel() {
    local kdir=$1 pkg=$2 kver tmp old
    shift 2
    kver=${pkg#linux-image-}
    kver=${kver%-unsigned}
    log "kernel package: $pkg (kernel $kver)"
    tmp=$kdir/$kver.tmp
    rm -rf "$tmp" "${kdir:?}/$kver"
    mkdir -p "$tmp/download"
    (cd "$tmp/download" && apt-get "$@" download -qq -o APT::Sandbox::User=root "$pkg" >&2) ||
        die "apt-get download $pkg failed"
    mv "$tmp"/download/*.deb "$tmp/kernel.deb"
    rmdir "$tmp/download"
    dpkg-deb --fsys-tarfile "$tmp/kernel.deb" |
        tar -x -C "$tmp" --wildcards "./boot/vmlinuz-$kver" "./boot/config-$kver" ||
        die "$pkg has no boot/vmlinuz-$kver or boot/config-$kver"
    mv "$tmp/boot/vmlinuz-$kver" "$tmp/vmlinuz"
    mv "$tmp/boot/config-$kver" "$tmp/config"
    rmdir "$tmp/boot"
    echo "$pkg" >"$tmp/PACKAGE"
    mv "$tmp" "$kdir/$kver"
    echo "$kver" >"$kdir/CURRENT"
    # Other kernels are of no further use.
    for old in "$kdir"/*/; do
        old=${old%/}
        [[ $(basename "$old") == "$kver" ]] || rm -rf "$old"
    done
}

# kernel_image KDIR/KVER: prints the image QEMU boots. An uncompressed ELF vmlinux for QEMU's PVH
# boot (the kernel has CONFIG_PVH) skips SeaBIOS's real-mode loader and the in-guest xz
# decompression, which takes ~4 s under TCG; the bzImage is the fallback.
kernel_image() {
    local d=$1
    if [[ ! -f $d/vmlinux ]] && grep -q '^CONFIG_PVH=y' "$d/config"; then
        if python3 - "$d/vmlinuz" "$d/vmlinux.tmp" <<'PY'
import lzma
import subprocess
import sys

# The bzImage's payload: xz (bookworm) or zstd (trixie).
data = open(sys.argv[1], "rb").read()
xz = data.find(b"\xfd7zXZ\x00")
zst = data.find(b"\x28\xb5\x2f\xfd")
if xz >= 0:
    elf = lzma.LZMADecompressor().decompress(data[xz:])
elif zst >= 0:
    # zstd stops with an error at the bytes after the frame; what it wrote before is the image.
    elf = subprocess.run(["zstd", "-dcq"], input=data[zst:], capture_output=True).stdout
else:
    sys.exit("no xz or zstd payload in the bzImage")
if elf[:4] != b"\x7fELF":
    sys.exit("the bzImage payload is not an ELF image")
open(sys.argv[2], "wb").write(elf)
PY
        then
            mv "$d/vmlinux.tmp" "$d/vmlinux"
        else
            rm -f "$d/vmlinux.tmp"
            log "could not extract vmlinux from $d/vmlinuz; guest.sh will boot the bzImage (slower)"
        fi
    fi
    if [[ -f $d/vmlinux ]]; then echo "$d/vmlinux"; else echo "$d/vmlinuz"; fi
}

KDIR=$CACHE/kernel
mkdir -p "$KDIR"
KVER=$(cached_kernel "$KDIR" "${INTEROP_KERNEL_PKG:-}")
if [[ -z $KVER ]]; then
    pkg=${INTEROP_KERNEL_PKG:-}
    if [[ -z $pkg ]]; then
        unsigned_re='^linux-image-6\.1\.0-[0-9]+-amd64-unsigned$'
        signed_re='^linux-image-6\.1\.0-[0-9]+-amd64$'
        pkg=$(pick_kernel_pkg "$unsigned_re" || pick_kernel_pkg "$signed_re" || true)
        if [[ -z $pkg ]]; then
            apt_update
            pkg=$(pick_kernel_pkg "$unsigned_re" || pick_kernel_pkg "$signed_re" || true)
        fi
        [[ -n $pkg ]] || die "apt offers no linux-image-6.1.0-*-amd64 package"
    fi
    fetch_kernel "$KDIR" "$pkg"
    KVER=$(cat "$KDIR/CURRENT")
fi
KPKG=$(cat "$KDIR/$KVER/PACKAGE")
log "kernel $KVER ($KPKG)"
KERNEL_IMAGE=$(kernel_image "$KDIR/$KVER")

# --- trixie: kernel 6.12, nvme-cli 2.13, tlshd ----------------------------------------------
# A private apt configuration names the trixie suite; the machine's own sources, lists and
# preferences are not touched. apt verifies the lists against the Debian archive keyring and
# every downloaded .deb against the hashes in those lists.
K612_DIR=$CACHE/k612
TRIXIE_APT=()
trixie_update() {
    local a=$K612_DIR/apt
    mkdir -p "$a/lists/partial" "$a/cache/archives/partial" "$a/empty"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" >"$a/sources.list"
    : >"$a/status"
    TRIXIE_APT=(
        -o "Dir::Etc::SourceList=$a/sources.list" -o "Dir::Etc::SourceParts=$a/empty"
        -o "Dir::Etc::Preferences=$a/empty/none" -o "Dir::Etc::PreferencesParts=$a/empty"
        -o "Dir::State::Lists=$a/lists" -o "Dir::State::Status=$a/status" -o "Dir::Cache=$a/cache"
        -o "Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false"
        -o "Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled=false"
        -o "Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false"
    )
    if [[ $REFRESH_KERNEL == 1 || ! -f $a/UPDATED ]]; then
        log "apt-get update (trixie, private lists in $a)"
        apt-get "${TRIXIE_APT[@]}" update -qq >&2 || die "apt-get update of the trixie lists failed"
        : >"$a/UPDATED"
    fi
}
# Userland from trixie: the tools and every library package their dependencies reach.
TRIXIE_TOOLS="nvme-cli ktls-utils"
trixie_packages() {
    local direct
    # shellcheck disable=SC2086
    direct=$(apt-cache "${TRIXIE_APT[@]}" depends --no-recommends --no-suggests --no-conflicts \
        --no-breaks --no-replaces --no-enhances $TRIXIE_TOOLS | awk '$1 == "Depends:" && $2 ~ /^z?lib/ {print $2}' | sort -u)
    # shellcheck disable=SC2086
    {
        echo $TRIXIE_TOOLS | tr ' ' '\n'
        apt-cache "${TRIXIE_APT[@]}" depends --recurse --no-recommends --no-suggests --no-conflicts \
            --no-breaks --no-replaces --no-enhances $direct | grep -E '^z?lib'
    } | sort -u
}

K612_KVER=""
if [[ $WITH_K612 == 1 ]]; then
    [[ $(id -u) == 0 ]] || die "--with-k612 runs apt-get: run as root"
    mkdir -p "$K612_DIR/kernel"
    K612_KVER=$(cached_kernel "$K612_DIR/kernel")
    if [[ -z $K612_KVER ]]; then
        trixie_update
        pkg=$(pick_kernel_pkg '^linux-image-6\.12\.[0-9]+\+deb13-amd64-unsigned$' "${TRIXIE_APT[@]}" ||
            pick_kernel_pkg '^linux-image-6\.12\.[0-9]+\+deb13-amd64$' "${TRIXIE_APT[@]}" || true)
        [[ -n $pkg ]] || die "trixie offers no linux-image-6.12.*+deb13-amd64 package"
        fetch_kernel "$K612_DIR/kernel" "$pkg" "${TRIXIE_APT[@]}"
        K612_KVER=$(cat "$K612_DIR/kernel/CURRENT")
    fi
    K612_KPKG=$(cat "$K612_DIR/kernel/$K612_KVER/PACKAGE")
    log "kernel $K612_KVER ($K612_KPKG)"
    K612_IMAGE=$(kernel_image "$K612_DIR/kernel/$K612_KVER")
    # The userland .debs, kept until --refresh-kernel.
    if [[ $REFRESH_KERNEL == 1 || ! -f $K612_DIR/debs/PACKAGES ]]; then
        trixie_update
        rm -rf "$K612_DIR/debs"
        mkdir -p "$K612_DIR/debs.tmp"
        mapfile -t pkgs < <(trixie_packages)
        log "downloading from trixie: ${pkgs[*]}"
        (cd "$K612_DIR/debs.tmp" && apt-get "${TRIXIE_APT[@]}" download -qq -o APT::Sandbox::User=root "${pkgs[@]}" >&2) ||
            die "apt-get download from trixie failed"
        (cd "$K612_DIR/debs.tmp" && ls -- *.deb) >"$K612_DIR/debs.tmp/PACKAGES"
        mv "$K612_DIR/debs.tmp" "$K612_DIR/debs"
    fi
fi

# extract_kernel_tree KDIR/KVER KVER: the package's files with modules.dep, at KDIR/KVER/root
# (removed at the end). Merged-/usr packages (trixie) keep their modules in usr/lib/modules:
# /lib links there so that kmod finds them.
extract_kernel_tree() {
    local root=$1/root kver=$2
    if [[ ! -f $root/lib/modules/$kver/modules.dep ]]; then
        rm -rf "$root"
        mkdir -p "$root"
        dpkg-deb -x "$1/kernel.deb" "$root"
        [[ -e $root/lib || ! -d $root/usr/lib/modules ]] || ln -s usr/lib "$root/lib"
        depmod -b "$root" "$kver"
    fi
}

# ---------------------------------------------------------------------------------------------
# 3. Initramfs segments
# ---------------------------------------------------------------------------------------------
IDIR=$CACHE/initrd
mkdir -p "$IDIR"
ZSTD_LEVEL=${INTEROP_ZSTD_LEVEL:-9}

pkg_versions() {
    dpkg-query -W -f='${Package}=${Version}\n' "$@" 2>/dev/null
}

# up_to_date NAME HASH: true when the segment exists and was built from the same inputs.
up_to_date() {
    [[ $REBUILD == 0 && -f $IDIR/$1.cpio.zst && -f $IDIR/$1.inputs && $(cat "$IDIR/$1.inputs") == "$2" ]]
}

# pack STAGING NAME HASH: writes a newc cpio archive, owned by root, compressed with zstd.
pack() {
    local st=$1 name=$2 hash=$3
    # The list of its libraries: guest.sh keeps per-run copies of them out of the 6.12 guest.
    (cd "$st" && find usr/lib usr/lib64 -mindepth 1 ! -type d 2>/dev/null | LC_ALL=C sort) >"$IDIR/$name.libs"
    write_cpio "$st" | zstd -q -T0 "-$ZSTD_LEVEL" -f -o "$IDIR/$name.cpio.zst.tmp"
    # Zero padding to a 512-byte boundary: the kernel skips zeros between concatenated
    # segments, and an uncompressed cpio segment that follows must start 4-byte aligned.
    local size
    size=$(stat -c %s "$IDIR/$name.cpio.zst.tmp")
    truncate -s $(((size + 511) / 512 * 512)) "$IDIR/$name.cpio.zst.tmp"
    mv "$IDIR/$name.cpio.zst.tmp" "$IDIR/$name.cpio.zst"
    echo "$hash" >"$IDIR/$name.inputs"
    rm -rf "$st"
    log "built $name.cpio.zst ($(du -h "$IDIR/$name.cpio.zst" | cut -f1))"
}

new_staging() {
    local st
    st=$(mktemp -d "$CACHE/staging.XXXXXX")
    mkdir -p "$st/usr/bin" "$st/usr/sbin" "$st/usr/lib" "$st/usr/lib64"
    echo "$st"
}

# --- base: busybox, /init, modules -----------------------------------------------------------
# build_base NAME KDIR/KVER KVER MODLIST...: the base segment for one kernel, with the modules
# named in the lists and their dependencies, uncompressed (busybox's insmod loads plain .ko).
build_base() {
    local name=$1 kd=$2 kver=$3 hash st
    shift 3
    local kroot=$kd/root
    hash=$(
        {
            echo "kernel=$(cat "$kd/PACKAGE") $kver"
            pkg_versions busybox-static kmod
            sha256sum "$HERE/init.sh" "$@" "${BASH_SOURCE[0]}" "$HERE/lib/initramfs.sh" | cut -d' ' -f1
        } | sha256sum | cut -d' ' -f1
    )
    if up_to_date "$name" "$hash"; then
        log "$name.cpio.zst is up to date"
        return
    fi
    extract_kernel_tree "$kd" "$kver"
    st=$(new_staging)
    ln -s usr/lib "$st/lib"
    ln -s usr/lib64 "$st/lib64"
    ln -s usr/bin "$st/bin"
    ln -s usr/sbin "$st/sbin"
    mkdir -p "$st"/{dev,proc,sys,run,tmp,root,mnt,etc/interop,etc/nvme,var}
    ln -s ../run "$st/var/run"
    if [[ $(id -u) == 0 ]]; then
        mknod "$st/dev/console" c 5 1
        mknod "$st/dev/null" c 1 3
    fi
    local busybox_bin applet dst
    busybox_bin=$(command -v busybox)
    "$busybox_bin" --list-full >/dev/null 2>&1 || die "$busybox_bin is not a static busybox"
    cp "$busybox_bin" "$st/usr/bin/busybox"
    for applet in $("$busybox_bin" --list-full); do
        dst=$(guest_path "/$applet")
        [[ -e $st$dst || -L $st$dst ]] || ln -s /usr/bin/busybox "$st$dst"
    done
    install -m 0755 "$HERE/init.sh" "$st/init"
    printf 'root:x:0:0:root:/root:/bin/sh\n' >"$st/etc/passwd"
    printf 'root:x:0:\n' >"$st/etc/group"
    printf '127.0.0.1 localhost\n10.0.2.2 host\n' >"$st/etc/hosts"

    # Kernel modules and their dependencies, in load order.
    local mroot=$st/usr/lib/modules/$kver boot=$st/etc/interop/modules.boot
    local mname flag optional deps kind path rel f
    mkdir -p "$mroot"
    : >"$boot"
    local -A seen=()
    while read -r mname flag _; do
        [[ -n $mname ]] || continue
        optional=0
        if [[ $mname == \?* ]]; then
            optional=1
            mname=${mname#\?}
        fi
        if ! deps=$(modprobe -d "$kroot" -S "$kver" --show-depends "$mname" 2>/dev/null); then
            [[ $optional == 1 ]] && {
                log "optional module $mname not in $kver; skipped"
                continue
            }
            die "module $mname not found in kernel $kver"
        fi
        while read -r kind path _; do
            [[ $kind == insmod ]] || continue
            rel=${path#"$kroot"/lib/modules/"$kver"/}
            rel=${rel%.xz}
            rel=${rel%.zst}
            if [[ -z ${seen[$rel]:-} ]]; then
                mkdir -p "$mroot/$(dirname "$rel")"
                case "$path" in
                *.xz) xz -dc "$path" ;;
                *.zst) zstd -q -dc "$path" ;;
                *) cat "$path" ;;
                esac >"$mroot/$rel" || die "cannot unpack $path"
                seen[$rel]=1
            fi
            if [[ $flag == boot ]] && ! grep -qxF "$rel" "$boot"; then
                echo "$rel" >>"$boot"
            fi
        done <<<"$deps"
    done < <(sed 's/#.*//' "$@")
    for f in modules.builtin modules.builtin.modinfo modules.order; do
        [[ -f $kroot/lib/modules/$kver/$f ]] && cp "$kroot/lib/modules/$kver/$f" "$mroot/"
    done
    depmod -b "$st" "$kver"
    log "packed ${#seen[@]} kernel modules for $kver ($(du -sh "$mroot" | cut -f1)), $(wc -l <"$boot") loaded at boot"
    pack "$st" "$name" "$hash"
}

MODLIST=$HERE/modules.list
build_base base "$KDIR/$KVER" "$KVER" "$MODLIST"
if [[ $WITH_K612 == 1 ]]; then
    build_base base-612 "$K612_DIR/kernel/$K612_KVER" "$K612_KVER" "$MODLIST" "$HERE/modules-612.list"
fi

# --- tool segments: nvme-cli, fio, rdma, ext4 ------------------------------------------------------
# build_tool_segment NAME VERSIONS FILES [EXTRA]: FILES with their shared libraries, EXTRA as
# they are; VERSIONS (the packages they come from) decide whether the segment is rebuilt.
build_tool_segment() {
    local name=$1 versions=$2 files=$3 extra=${4:-} hash st
    hash=$(
        {
            echo "$versions"
            echo "$files $extra"
            sha256sum "${BASH_SOURCE[0]}" "$HERE/lib/initramfs.sh" | cut -d' ' -f1
        } | sha256sum | cut -d' ' -f1
    )
    if up_to_date "$name" "$hash"; then
        log "$name.cpio.zst is up to date"
        return
    fi
    st=$(new_staging)
    local f
    for f in $files; do
        add_with_libs "$st" "$f"
    done
    for f in $extra; do
        add_file "$st" "${SYSROOT:-}$f" "$f"
    done
    pack "$st" "$name" "$hash"
}

# glibc dlopen()s libgcc_s for thread exit/cancellation; ldd does not list it. awk reads the whole
# list: leaving early would kill ldconfig with SIGPIPE, which pipefail turns into a failure.
LIBGCC_S=$(ldconfig -p | awk '/libgcc_s.so.1 .*x86-64/ && !found { print $NF; found = 1 }')
[[ -n $LIBGCC_S ]] || die "libgcc_s.so.1 not found"
build_tool_segment nvme "$(pkg_versions nvme-cli libnvme1 libc6 libgcc-s1)" "/usr/sbin/nvme $LIBGCC_S"
build_tool_segment fio "$(pkg_versions fio libc6 libgcc-s1)" "/usr/bin/fio $LIBGCC_S"
rxe=(/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so)
RXE_PROVIDER=${rxe[0]}
[[ -f $RXE_PROVIDER ]] || die "rxe verbs provider not found (ibverbs-providers)"
build_tool_segment rdma "$(pkg_versions libgcc-s1 iproute2 libibverbs1 librdmacm1 ibverbs-providers ibverbs-utils rdmacm-utils libc6)" \
    "/usr/bin/rdma /usr/bin/ibv_devices /usr/bin/ibv_devinfo /usr/bin/ibv_rc_pingpong /usr/bin/rping /usr/bin/ucmatose $RXE_PROVIDER $LIBGCC_S" \
    "/etc/libibverbs.d/rxe.driver"
build_tool_segment ext4 "$(pkg_versions e2fsprogs libext2fs2 libcom-err2 libblkid1 libuuid1 libc6)" \
    "/sbin/mke2fs /sbin/e2fsck" "/etc/mke2fs.conf"

# rocksdb: db_bench (rocksdb-tools) and the kernel iSCSI initiator's user space from open-iscsi,
# whose .deb is downloaded (apt checks its hash against the signed lists) and extracted, not
# installed.
if [[ $WITH_ROCKSDB == 1 ]]; then
    oi_ver=$(apt-cache policy open-iscsi 2>/dev/null | awk '/Candidate:/ {print $2}')
    [[ -n $oi_ver && $oi_ver != "(none)" ]] || {
        apt_update
        oi_ver=$(apt-cache policy open-iscsi 2>/dev/null | awk '/Candidate:/ {print $2}')
    }
    [[ -n $oi_ver && $oi_ver != "(none)" ]] || die "apt offers no open-iscsi package"
    OI_DIR=$CACHE/open-iscsi
    if [[ $(cat "$OI_DIR/VERSION" 2>/dev/null) != "$oi_ver" ]]; then
        rm -rf "$OI_DIR"
        mkdir -p "$OI_DIR.tmp"
        (cd "$OI_DIR.tmp" && apt-get download -qq -o APT::Sandbox::User=root "open-iscsi=$oi_ver" >&2) ||
            die "apt-get download open-iscsi failed"
        mv "$OI_DIR.tmp"/open-iscsi_*.deb "$OI_DIR.tmp/open-iscsi.deb"
        echo "$oi_ver" >"$OI_DIR.tmp/VERSION"
        mv "$OI_DIR.tmp" "$OI_DIR"
    fi
    # The open-iscsi programs run on this machine's libraries (libopeniscsiusr, libisns0,
    # installed above), like db_bench.
    oi_root=$OI_DIR/root
    rm -rf "$oi_root"
    dpkg-deb -x "$OI_DIR/open-iscsi.deb" "$oi_root"
    hash=$(
        {
            pkg_versions rocksdb-tools librocksdb7.8 libopeniscsiusr libisns0 libc6 libgcc-s1
            echo "open-iscsi=$oi_ver"
            sha256sum "${BASH_SOURCE[0]}" "$HERE/lib/initramfs.sh" | cut -d' ' -f1
        } | sha256sum | cut -d' ' -f1
    )
    if up_to_date rocksdb "$hash"; then
        log "rocksdb.cpio.zst is up to date"
    else
        st=$(new_staging)
        add_with_libs "$st" /usr/bin/db_bench
        add_with_libs "$st" "$LIBGCC_S"
        for f in iscsid iscsiadm iscsistart iscsi-iname; do
            add_with_libs "$st" "$oi_root/sbin/$f" "/usr/sbin/$f"
        done
        add_file "$st" "$oi_root/etc/iscsi/iscsid.conf" /etc/iscsi/iscsid.conf
        pack "$st" rocksdb "$hash"
    fi
    rm -rf "$oi_root"
fi

# avahi: the mDNS responder and browser with the system bus they talk over. The guest script
# writes their configuration (tests/guest/avahi-browse.sh): no users, no chroot.
if [[ $WITH_AVAHI == 1 ]]; then
    build_tool_segment avahi "$(pkg_versions avahi-daemon avahi-utils dbus-daemon libavahi-core7 libavahi-client3 libdbus-1-3 libc6)" \
        "/usr/sbin/avahi-daemon /usr/bin/avahi-browse /usr/bin/dbus-daemon $LIBGCC_S"
fi

# nvme-612: trixie's nvme-cli and tlshd with trixie's libraries, resolved inside the extracted
# packages (SYSROOT) by trixie's own dynamic loader.
if [[ $WITH_K612 == 1 ]]; then
    SYSROOT=$K612_DIR/root
    rm -rf "$SYSROOT"
    mkdir -p "$SYSROOT"
    for deb in "$K612_DIR"/debs/*.deb; do
        dpkg-deb -x "$deb" "$SYSROOT"
    done
    build_tool_segment nvme-612 "$(cat "$K612_DIR/debs/PACKAGES")" \
        "/usr/sbin/nvme /usr/sbin/tlshd /usr/lib/x86_64-linux-gnu/libgcc_s.so.1" "/etc/tlshd.conf"
    rm -rf "$SYSROOT"
    SYSROOT=""
fi

# ---------------------------------------------------------------------------------------------
# 4. Record what guest.sh needs
# ---------------------------------------------------------------------------------------------
cat >"$CACHE/guest.env.tmp" <<EOF
# Written by tests/interop/setup.sh; read by tests/interop/guest.sh.
INTEROP_KVER=$KVER
INTEROP_KERNEL_PKG=$KPKG
INTEROP_KERNEL_IMAGE=$KERNEL_IMAGE
INTEROP_INITRD_DIR=$IDIR
EOF
if [[ $WITH_K612 == 1 ]]; then
    cat >>"$CACHE/guest.env.tmp" <<EOF
INTEROP_K612_KVER=$K612_KVER
INTEROP_K612_KERNEL_PKG=$K612_KPKG
INTEROP_K612_KERNEL_IMAGE=$K612_IMAGE
EOF
fi
mv "$CACHE/guest.env.tmp" "$CACHE/guest.env"
rm -rf "$CACHE"/staging.* "$KDIR/$KVER/root" ${K612_KVER:+"$K612_DIR/kernel/$K612_KVER/root"}
log "ready in $(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s: $CACHE/guest.env"
