#!/usr/bin/env bash
# Prepares the QEMU guest used by the interop tests (Linux kernel NVMe-oF host/target and
# Soft-RoCE as real peers). Idempotent: a second run only checks that everything is in place.
#
#   tests/interop/setup.sh [--refresh-kernel] [--rebuild]
#
#   --refresh-kernel  pick the kernel package again (the newest linux-image-6.1.*-amd64 that apt
#                     offers) instead of reusing the cached one
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
#   initrd/rdma.cpio.zst        iproute2's rdma, libibverbs + rxe provider, verbs/rdmacm tools
#   initrd/ext4.cpio.zst        mke2fs and e2fsck (e2fsprogs) and their shared libraries
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${INTEROP_CACHE:-$HERE/.cache}
REFRESH_KERNEL=0
REBUILD=0

while [[ $# -gt 0 ]]; do
    case "$1" in
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
# 2. Guest kernel: Debian linux-image-6.1.*-amd64 (unsigned flavour when offered)
# ---------------------------------------------------------------------------------------------
KDIR=$CACHE/kernel
mkdir -p "$KDIR"

# Newest package among those matching the regex that has an install candidate.
pick_kernel_pkg() {
    local re=$1 p cand
    for p in $(apt-cache search --names-only "$re" 2>/dev/null | awk '{print $1}' | sort -rV); do
        cand=$(apt-cache policy "$p" 2>/dev/null | awk '/Candidate:/ {print $2}')
        if [[ -n $cand && $cand != "(none)" ]]; then
            echo "$p"
            return 0
        fi
    done
    return 1
}

# Cached per kernel (kernel/<kver>/): PACKAGE, kernel.deb, vmlinuz, config, vmlinux. The module
# tree (root/) is extracted from kernel.deb only while the base segment is being built.
KVER=""
if [[ $REFRESH_KERNEL == 0 && -f $KDIR/CURRENT ]]; then
    KVER=$(cat "$KDIR/CURRENT")
    if [[ -n ${INTEROP_KERNEL_PKG:-} && $(cat "$KDIR/$KVER/PACKAGE" 2>/dev/null) != "$INTEROP_KERNEL_PKG" ]]; then
        KVER=""
    fi
    for f in PACKAGE kernel.deb vmlinuz config; do
        [[ -n $KVER ]] || break
        if [[ ! -f $KDIR/$KVER/$f ]]; then
            log "cached kernel $KVER is incomplete ($f); fetching again"
            KVER=""
            break
        fi
    done
fi

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
    KVER=${pkg#linux-image-}
    KVER=${KVER%-unsigned}
    log "kernel package: $pkg (kernel $KVER)"
    tmp=$KDIR/$KVER.tmp
    rm -rf "$tmp" "${KDIR:?}/$KVER"
    mkdir -p "$tmp/download"
    (cd "$tmp/download" && apt-get download -qq -o APT::Sandbox::User=root "$pkg" >&2) ||
        die "apt-get download $pkg failed"
    mv "$tmp"/download/*.deb "$tmp/kernel.deb"
    rmdir "$tmp/download"
    dpkg-deb --fsys-tarfile "$tmp/kernel.deb" |
        tar -x -C "$tmp" --wildcards "./boot/vmlinuz-$KVER" "./boot/config-$KVER" ||
        die "$pkg has no boot/vmlinuz-$KVER or boot/config-$KVER"
    mv "$tmp/boot/vmlinuz-$KVER" "$tmp/vmlinuz"
    mv "$tmp/boot/config-$KVER" "$tmp/config"
    rmdir "$tmp/boot"
    echo "$pkg" >"$tmp/PACKAGE"
    mv "$tmp" "$KDIR/$KVER"
    echo "$KVER" >"$KDIR/CURRENT"
    # Other kernels are of no further use.
    for old in "$KDIR"/*/; do
        old=${old%/}
        [[ $(basename "$old") == "$KVER" ]] || rm -rf "$old"
    done
fi
KPKG=$(cat "$KDIR/$KVER/PACKAGE")
KROOT=$KDIR/$KVER/root
log "kernel $KVER ($KPKG)"

# extract_kernel_tree: the package's files with modules.dep, at $KROOT (removed at the end).
extract_kernel_tree() {
    if [[ ! -f $KROOT/lib/modules/$KVER/modules.dep ]]; then
        rm -rf "$KROOT"
        mkdir -p "$KROOT"
        dpkg-deb -x "$KDIR/$KVER/kernel.deb" "$KROOT"
        depmod -b "$KROOT" "$KVER"
    fi
}

# Uncompressed ELF vmlinux for QEMU's PVH boot (the kernel has CONFIG_PVH): skips SeaBIOS's
# real-mode loader and the in-guest xz decompression, which takes ~4 s under TCG.
VMLINUX=$KDIR/$KVER/vmlinux
if [[ ! -f $VMLINUX ]] && grep -q '^CONFIG_PVH=y' "$KDIR/$KVER/config"; then
    if python3 - "$KDIR/$KVER/vmlinuz" "$VMLINUX.tmp" <<'PY'
import lzma
import sys

data = open(sys.argv[1], "rb").read()
start = data.find(b"\xfd7zXZ\x00")
if start < 0:
    sys.exit("no xz payload in the bzImage")
elf = lzma.LZMADecompressor().decompress(data[start:])
if elf[:4] != b"\x7fELF":
    sys.exit("xz payload is not an ELF image")
open(sys.argv[2], "wb").write(elf)
PY
    then
        mv "$VMLINUX.tmp" "$VMLINUX"
    else
        rm -f "$VMLINUX.tmp"
        log "could not extract vmlinux; guest.sh will boot the bzImage (slower)"
    fi
fi
if [[ -f $VMLINUX ]]; then
    KERNEL_IMAGE=$VMLINUX
else
    KERNEL_IMAGE=$KDIR/$KVER/vmlinuz
fi

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
MODLIST=$HERE/modules.list
base_hash=$(
    {
        echo "kernel=$KPKG $KVER"
        pkg_versions busybox-static kmod
        sha256sum "$HERE/init.sh" "$MODLIST" "${BASH_SOURCE[0]}" "$HERE/lib/initramfs.sh" | cut -d' ' -f1
    } | sha256sum | cut -d' ' -f1
)
if up_to_date base "$base_hash"; then
    log "base.cpio.zst is up to date"
else
    extract_kernel_tree
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
    mroot=$st/usr/lib/modules/$KVER
    mkdir -p "$mroot"
    : >"$st/etc/interop/modules.boot"
    declare -A seen=()
    while read -r name flag _; do
        name=${name%%#*}
        [[ -n $name ]] || continue
        optional=0
        if [[ $name == \?* ]]; then
            optional=1
            name=${name#\?}
        fi
        if ! deps=$(modprobe -d "$KROOT" -S "$KVER" --show-depends "$name" 2>/dev/null); then
            [[ $optional == 1 ]] && {
                log "optional module $name not in $KVER; skipped"
                continue
            }
            die "module $name not found in kernel $KVER"
        fi
        while read -r kind path _; do
            [[ $kind == insmod ]] || continue
            rel=${path#"$KROOT"/lib/modules/"$KVER"/}
            if [[ -z ${seen[$rel]:-} ]]; then
                mkdir -p "$mroot/$(dirname "$rel")"
                cp "$path" "$mroot/$rel"
                seen[$rel]=1
            fi
            if [[ $flag == boot ]] && ! grep -qxF "$rel" "$st/etc/interop/modules.boot"; then
                echo "$rel" >>"$st/etc/interop/modules.boot"
            fi
        done <<<"$deps"
    done < <(sed 's/#.*//' "$MODLIST")
    for f in modules.builtin modules.builtin.modinfo modules.order; do
        [[ -f $KROOT/lib/modules/$KVER/$f ]] && cp "$KROOT/lib/modules/$KVER/$f" "$mroot/"
    done
    depmod -b "$st" "$KVER"
    log "packed ${#seen[@]} kernel modules ($(du -sh "$mroot" | cut -f1)), $(wc -l <"$st/etc/interop/modules.boot") loaded at boot"
    pack "$st" base "$base_hash"
fi

# --- tool segments: nvme-cli, fio, rdma, ext4 ------------------------------------------------------
build_tool_segment() {
    local name=$1 pkgs=$2 files=$3 extra=${4:-} hash st
    hash=$(
        {
            # shellcheck disable=SC2086
            pkg_versions $pkgs
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
        add_file "$st" "$f"
    done
    pack "$st" "$name" "$hash"
}

# glibc dlopen()s libgcc_s for thread exit/cancellation; ldd does not list it.
LIBGCC_S=$(ldconfig -p | awk '/libgcc_s.so.1 .*x86-64/ {print $NF; exit}')
[[ -n $LIBGCC_S ]] || die "libgcc_s.so.1 not found"
build_tool_segment nvme "nvme-cli libnvme1 libc6 libgcc-s1" "/usr/sbin/nvme $LIBGCC_S"
build_tool_segment fio "fio libc6 libgcc-s1" "/usr/bin/fio $LIBGCC_S"
rxe=(/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so)
RXE_PROVIDER=${rxe[0]}
[[ -f $RXE_PROVIDER ]] || die "rxe verbs provider not found (ibverbs-providers)"
build_tool_segment rdma "libgcc-s1 iproute2 libibverbs1 librdmacm1 ibverbs-providers ibverbs-utils rdmacm-utils libc6" \
    "/usr/bin/rdma /usr/bin/ibv_devices /usr/bin/ibv_devinfo /usr/bin/ibv_rc_pingpong /usr/bin/rping /usr/bin/ucmatose $RXE_PROVIDER $LIBGCC_S" \
    "/etc/libibverbs.d/rxe.driver"
build_tool_segment ext4 "e2fsprogs libext2fs2 libcom-err2 libblkid1 libuuid1 libc6" \
    "/sbin/mke2fs /sbin/e2fsck" "/etc/mke2fs.conf"

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
mv "$CACHE/guest.env.tmp" "$CACHE/guest.env"
rm -rf "$CACHE"/staging.* "$KROOT"
log "ready in $(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s: $CACHE/guest.env"
