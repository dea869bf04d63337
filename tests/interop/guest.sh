#!/usr/bin/env bash
# Runs a script inside the interop test guest: Debian's 6.1 kernel (NVMe-oF host and target,
# Soft-RoCE) booted by QEMU TCG into a busybox initramfs, or with --kernel 612 Debian trixie's
# 6.12 kernel (adds NVMe in-band authentication and NVMe/TCP TLS) with trixie's nvme-cli and
# tlshd. Prepare it once with setup.sh (setup.sh --with-k612 for the 6.12 guest).
#
# Usage:
#   guest.sh run   [OPTIONS] SCRIPT
#       Boots the guest, runs SCRIPT as /test.sh (busybox sh), streams the console to stdout and
#       to the log file, and exits with the script's exit code (from the "GUEST-EXIT <code>"
#       console marker). Exit 124: timeout; 125: kernel panic; 126: the guest ended without the
#       marker; 2: usage or setup error. A kernel panic before /test.sh started is booted
#       again (three boots in all; see retry_boot), in start mode too.
#   guest.sh start --ready-marker STRING [OPTIONS] SCRIPT
#       Boots the guest in the background and returns once STRING appeared on its console.
#       Prints the pid file path on stdout (the file holds QEMU's pid). The console goes to the
#       log file only. Exits non-zero (and stops the guest) if the marker does not appear.
#   guest.sh stop [--grace SECS] PIDFILE
#       Asks the guest script to finish (SIGTERM to /test.sh through a control serial port),
#       waits up to SECS (default 30) for the guest to power off, then exits with the script's
#       exit code. If the guest does not end in time QEMU is killed and the exit code is 124.
#   guest.sh free-port
#       Prints a TCP port that is free on 127.0.0.1 (for --hostfwd).
#
# Options (run and start):
#   --kernel 61|612               guest kernel (default 61, or $INTEROP_GUEST_KERNEL): 612 boots
#                                 trixie's 6.12 with nvme-cli 2.13 and tlshd (setup.sh --with-k612)
#   --hostfwd HOSTPORT:GUESTPORT  forward 127.0.0.1:HOSTPORT on the host to the guest's
#                                 GUESTPORT (TCP; repeatable)
#   --env NAME=VALUE              variable for the guest script (repeatable; written to /env)
#   --add HOSTPATH[:GUESTPATH]    copy a file into the guest (repeatable)
#   --add-bin HOSTPATH[:GUESTPATH]  copy an executable and its shared libraries (repeatable)
#   --with-fio                    include fio (large initramfs segment)
#   --with-rdma                   include rdma (iproute2), libibverbs + rxe, verbs/rdmacm tools
#   --with-ext4                   include mke2fs and e2fsck (the ext4 module is always packed)
#   --with-rocksdb                include RocksDB's db_bench and open-iscsi's iscsid, iscsiadm
#                                 (setup.sh --with-rocksdb)
#   --with-avahi                  include avahi-daemon, avahi-browse, dbus-daemon (setup.sh --with-avahi)
#   --no-nvme-cli                 leave nvme-cli out
#   --timeout SECS                run: whole run (default 600); start: until the marker (300)
#   --mem MB                      guest memory (default 1024)
#   --smp N                       guest CPUs (default 2)
#   --log FILE                    console log (default .cache/logs/NAME-TIMESTAMP.log)
#   --pidfile FILE                start: pid file (default: LOG with .pid instead of .log)
#   --ready-marker STRING         start: console text that means "ready"
#   --kernel-log                  show all kernel messages on the console (loglevel=7)
#   --append ARGS                 extra kernel command line arguments
#   --qemu-arg ARG                extra QEMU argument (repeatable)
#   --nvme-disk FILE              attach an emulated NVMe PCIe controller backed by FILE (raw;
#                                 repeatable); switches to q35 with an emulated Intel IOMMU
#                                 (intel_iommu=on) so the guest can hand it to vfio-pci
#   --fail-on-kernel-trace        fail when the guest kernel logged an oops/WARN/BUG trace
#   --accel tcg|kvm               accelerator (default tcg, or $INTEROP_ACCEL)
#   --verbose                     start: copy the console to stderr while waiting
#
# Guest environment: /etc/nvme/hostnqn and /etc/nvme/hostid are generated at boot (override
# with --env GUEST_HOSTNQN=... / GUEST_HOSTID=...); helper functions are in
# /usr/lib/interop/interop.sh. The guest is 10.0.2.15/24 and reaches the host's loopback at
# 10.0.2.2 only (QEMU user-mode networking; no default route, IPv6 off).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${INTEROP_CACHE:-$HERE/.cache}

die() {
    echo "guest.sh: error: $*" >&2
    exit 2
}
say() { echo "guest.sh: $*" >&2; }
usage() {
    awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"
    exit "${1:-2}"
}

# shellcheck source=lib/initramfs.sh
. "$HERE/lib/initramfs.sh"

# Per-run directory removed when guest.sh exits (cleared once a background guest owns it).
CLEANUP_DIR=""
trap 'if [[ -n $CLEANUP_DIR ]]; then rm -rf "$CLEANUP_DIR"; fi' EXIT

load_setup() {
    [[ -f $CACHE/guest.env ]] || die "guest not prepared: run tests/interop/setup.sh first"
    # shellcheck disable=SC1091
    . "$CACHE/guest.env"
    [[ -f $INTEROP_KERNEL_IMAGE ]] || die "missing $INTEROP_KERNEL_IMAGE: run tests/interop/setup.sh"
    [[ -f $INTEROP_INITRD_DIR/base.cpio.zst ]] || die "missing base initramfs: run tests/interop/setup.sh"
}

# The exit code from the last "GUEST-EXIT <code>" marker of a console log, or nothing.
guest_exit_code() {
    grep -a -o 'GUEST-EXIT [0-9]\+' "$1" 2>/dev/null | tail -n 1 | cut -d' ' -f2 || true
}

is_qemu_pid() {
    [[ -n ${1:-} && -r /proc/$1/cmdline ]] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -q qemu-system
}

cmd_free_port() {
    python3 -c 'import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])'
}

# ---------------------------------------------------------------------------------------------
# run / start
# ---------------------------------------------------------------------------------------------
cmd_boot() {
    local mode=$1
    shift
    local script="" marker="" log="" pidfile="" timeout="" mem=1024 smp=2 loglevel=4
    local with_fio=0 with_rdma=0 with_ext4=0 with_rocksdb=0 with_nvme=1 fail_on_trace=0 verbose=0
    local with_avahi=0
    local accel=${INTEROP_ACCEL:-tcg} append="" kernel=${INTEROP_GUEST_KERNEL:-61}
    local -a hostfwds=() envs=() adds=() addbins=() qemu_extra=() nvme_disks=()

    while [[ $# -gt 0 ]]; do
        case "$1" in
        --hostfwd) hostfwds+=("${2:?--hostfwd needs HOSTPORT:GUESTPORT}"); shift ;;
        --env) envs+=("${2:?--env needs NAME=VALUE}"); shift ;;
        --add) adds+=("${2:?--add needs a path}"); shift ;;
        --add-bin) addbins+=("${2:?--add-bin needs a path}"); shift ;;
        --kernel) kernel=${2:?--kernel needs 61 or 612}; shift ;;
        --with-fio) with_fio=1 ;;
        --with-rdma) with_rdma=1 ;;
        --with-ext4) with_ext4=1 ;;
        --with-rocksdb) with_rocksdb=1 ;;
        --with-avahi) with_avahi=1 ;;
        --no-nvme-cli) with_nvme=0 ;;
        --timeout) timeout=${2:?}; shift ;;
        --mem) mem=${2:?}; shift ;;
        --smp) smp=${2:?}; shift ;;
        --log) log=${2:?}; shift ;;
        --pidfile) pidfile=${2:?}; shift ;;
        --ready-marker) marker=${2:?}; shift ;;
        --kernel-log) loglevel=7 ;;
        --append) append="$append ${2:?}"; shift ;;
        --qemu-arg) qemu_extra+=("${2:?}"); shift ;;
        --nvme-disk) nvme_disks+=("${2:?--nvme-disk needs a file}"); shift ;;
        --fail-on-kernel-trace) fail_on_trace=1 ;;
        --accel) accel=${2:?}; shift ;;
        --verbose) verbose=1 ;;
        -h | --help) usage 0 ;;
        -*) die "unknown option $1" ;;
        *)
            [[ -z $script ]] || die "more than one script given ($script, $1)"
            script=$1
            ;;
        esac
        shift
    done
    [[ -n $script ]] || die "no guest script given"
    [[ -f $script ]] || die "guest script $script not found"
    [[ $mode == run || -n $marker ]] || die "start needs --ready-marker STRING"
    [[ $mem =~ ^[0-9]+$ && $smp =~ ^[0-9]+$ ]] || die "--mem and --smp take numbers"
    case "$accel" in tcg) accel_arg="tcg,thread=multi" ;; kvm) accel_arg=kvm ;; *) die "--accel tcg|kvm" ;; esac
    if [[ -z $timeout ]]; then
        if [[ $mode == run ]]; then timeout=600; else timeout=300; fi
    fi
    [[ $timeout =~ ^[0-9]+$ ]] || die "--timeout takes seconds"
    load_setup
    # The kernel's image and version, and its base and nvme-cli segments.
    local kimage=$INTEROP_KERNEL_IMAGE kver=$INTEROP_KVER base=base nvme=nvme setup_flag=""
    case "$kernel" in
    61) ;;
    612)
        [[ -n ${INTEROP_K612_KERNEL_IMAGE:-} && -f ${INTEROP_K612_KERNEL_IMAGE:-} ]] ||
            die "the 6.12 guest is not prepared: run tests/interop/setup.sh --with-k612"
        kimage=$INTEROP_K612_KERNEL_IMAGE kver=$INTEROP_K612_KVER base=base-612 nvme=nvme-612
        setup_flag=" --with-k612"
        ;;
    *) die "--kernel 61|612 (got '$kernel')" ;;
    esac
    local seg
    for seg in $base:1 $nvme:$with_nvme fio:$with_fio rdma:$with_rdma ext4:$with_ext4; do
        [[ ${seg#*:} == 0 || -f $INTEROP_INITRD_DIR/${seg%:*}.cpio.zst ]] ||
            die "missing ${seg%:*} initramfs segment: run tests/interop/setup.sh$setup_flag"
    done
    [[ $with_rocksdb == 0 || -f $INTEROP_INITRD_DIR/rocksdb.cpio.zst ]] ||
        die "missing rocksdb initramfs segment: run tests/interop/setup.sh --with-rocksdb"

    local name stamp rundir
    name=$(basename "$script" .sh)
    stamp=$(date +%Y%m%d-%H%M%S)
    mkdir -p "$CACHE/logs" "$CACHE/run"
    [[ -n $log ]] || log=$CACHE/logs/$name-$stamp-$$.log
    mkdir -p "$(dirname "$log")"
    log=$(cd "$(dirname "$log")" && pwd)/$(basename "$log")
    rundir=$(mktemp -d "$CACHE/run/$name.XXXXXX")
    CLEANUP_DIR=$rundir
    # Keep the newest 200 default logs.
    find "$CACHE/logs" -maxdepth 1 -name '*.log' -printf '%T@ %p\n' 2>/dev/null | sort -rn |
        tail -n +201 | cut -d' ' -f2- | xargs -r rm -f

    # Per-run initramfs segment: /test.sh, /env, guest helpers, added files.
    local st=$rundir/staging item src dst kv
    mkdir -p "$st/usr/lib/interop"
    install -m 0755 "$script" "$st/test.sh"
    cp "$HERE"/guest-lib/*.sh "$st/usr/lib/interop/"
    {
        echo "# generated by guest.sh"
        [[ $mode == start ]] && echo "GUEST_CONTROL=1"
        for kv in "${envs[@]}"; do
            [[ $kv == *=* ]] || die "--env $kv: expected NAME=VALUE"
            local k=${kv%%=*} v=${kv#*=}
            [[ $k =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "--env $kv: bad variable name"
            printf "%s='%s'\n" "$k" "${v//\'/\'\\\'\'}"
        done
    } >"$st/env"
    for item in "${adds[@]}"; do
        src=${item%%:*}
        dst=${item#*:}
        [[ $item == *:* ]] || dst=$src
        [[ -e $src ]] || die "--add $src: not found"
        add_file "$st" "$src" "$dst"
    done
    for item in "${addbins[@]}"; do
        src=${item%%:*}
        dst=${item#*:}
        [[ $item == *:* ]] || dst=$src
        add_with_libs "$st" "$src" "$dst"
        # Debug builds are mostly debug info (over 100 MB each): the guest holds its whole
        # initramfs in RAM, so only the code goes in.
        if command -v strip >/dev/null; then
            strip --strip-debug "$st$(guest_path "$dst")" 2>/dev/null || true
        fi
    done
    # On the 6.12 guest the nvme segment's trixie libraries must win over this machine's copies
    # that --add-bin brings along (this segment comes last); programs built here run on them.
    if [[ $kernel == 612 && $with_nvme == 1 && -f $INTEROP_INITRD_DIR/$nvme.libs ]]; then
        local lib
        while read -r lib; do
            rm -f "${st:?}/$lib"
        done <"$INTEROP_INITRD_DIR/$nvme.libs"
    fi
    local initrd=$rundir/initrd
    {
        cat "$INTEROP_INITRD_DIR/$base.cpio.zst"
        [[ $with_fio == 0 ]] || cat "$INTEROP_INITRD_DIR/fio.cpio.zst"
        [[ $with_rdma == 0 ]] || cat "$INTEROP_INITRD_DIR/rdma.cpio.zst"
        [[ $with_ext4 == 0 ]] || cat "$INTEROP_INITRD_DIR/ext4.cpio.zst"
        [[ $with_rocksdb == 0 ]] || cat "$INTEROP_INITRD_DIR/rocksdb.cpio.zst"
        [[ $with_avahi == 0 ]] || cat "$INTEROP_INITRD_DIR/avahi.cpio.zst" ||
            die "--with-avahi: no avahi segment (run tests/interop/setup.sh --with-avahi)"
        # Last: on the 6.12 guest its trixie libraries (glibc included) replace the bookworm
        # copies that the segments above carry; bookworm's programs run on them as well.
        [[ $with_nvme == 0 ]] || cat "$INTEROP_INITRD_DIR/$nvme.cpio.zst"
        write_cpio "$st"
    } >"$initrd"
    rm -rf "$st"

    # Network: QEMU user-mode only; forwarded ports listen on the host's 127.0.0.1.
    local netdev="user,id=net0,ipv6=off" fwd
    for fwd in "${hostfwds[@]}"; do
        [[ $fwd =~ ^[0-9]+:[0-9]+$ ]] || die "--hostfwd $fwd: expected HOSTPORT:GUESTPORT"
        netdev="$netdev,hostfwd=tcp:127.0.0.1:${fwd%%:*}-:${fwd##*:}"
    done

    # Emulated NVMe PCIe controllers behind an emulated IOMMU (for vfio-pci in the guest).
    local -a nvme_args=()
    if [[ ${#nvme_disks[@]} -gt 0 ]]; then
        nvme_args+=(-machine q35 -device intel-iommu)
        append="$append intel_iommu=on"
        local i=0 disk
        for disk in "${nvme_disks[@]}"; do
            [[ -f $disk ]] || die "--nvme-disk $disk: not a file"
            [[ $disk != *,* ]] || die "--nvme-disk $disk: commas are not allowed in the path"
            nvme_args+=(-drive "file=$disk,if=none,id=nvm$i,format=raw")
            nvme_args+=(-device "nvme,serial=nvmeof-interop-$i,drive=nvm$i")
            i=$((i + 1))
        done
    fi

    local cmdline="console=ttyS0,115200 rdinit=/init panic=-1 loglevel=$loglevel"
    cmdline="$cmdline ipv6.disable=1 mitigations=off tsc=reliable no_timer_check$append"

    local -a qemu=(
        qemu-system-x86_64
        -accel "$accel_arg" -cpu max -smp "$smp" -m "$mem"
        -nodefaults -display none -no-reboot
        -kernel "$kimage" -initrd "$initrd" -append "$cmdline"
        -netdev "$netdev" -device "virtio-net-pci,netdev=net0,romfile="
        "${nvme_args[@]}"
    )

    if [[ $mode == run ]]; then
        local attempt=1 rc qpid runlog=$log
        while :; do
            say "booting $kver (TCG) with $(basename "$script"); console log: $runlog"
            rc=0
            timeout --kill-after=10 "$timeout" "${qemu[@]}" \
                -chardev "stdio,id=con0,signal=on,logfile=$runlog" -serial chardev:con0 \
                "${qemu_extra[@]}" </dev/null &
            qpid=$!
            # If this script is interrupted, take the guest down with it.
            # shellcheck disable=SC2064
            trap "kill -TERM $qpid 2>/dev/null; wait $qpid 2>/dev/null || true; rm -rf '$rundir'; exit 130" INT TERM HUP
            wait "$qpid" || rc=$?
            trap - INT TERM HUP
            retry_boot "$runlog" "$attempt" || break
            attempt=$((attempt + 1))
            runlog=${log%.log}-boot$attempt.log
        done
        rm -rf "$rundir"
        finish_run "$runlog" "$rc" "$timeout" "$fail_on_trace"
        return $?
    fi

    # Background mode: console to the log file, a control serial port, QEMU daemonized.
    [[ -n $pidfile ]] || pidfile=${log%.log}.pid
    mkdir -p "$(dirname "$pidfile")"
    pidfile=$(cd "$(dirname "$pidfile")" && pwd)/$(basename "$pidfile")
    mkfifo "$rundir/ctl.in" "$rundir/ctl.out"
    local attempt=1 pid why tail_pid deadline started=$SECONDS firstlog=$log
    while :; do
        rm -f "$pidfile"
        cat >"$pidfile.state" <<EOF
LOG=$log
RUNDIR=$rundir
EOF
        say "starting $kver (TCG) with $(basename "$script") in the background; console log: $log"
        if ! "${qemu[@]}" -chardev "file,id=con0,path=$log" -serial chardev:con0 \
            -chardev "pipe,id=ctl0,path=$rundir/ctl" -serial chardev:ctl0 \
            -daemonize -pidfile "$pidfile" "${qemu_extra[@]}" </dev/null >"$rundir/qemu.out" 2>&1; then
            cat "$rundir/qemu.out" >&2
            rm -rf "$rundir" "$pidfile.state"
            die "QEMU did not start"
        fi
        pid=$(cat "$pidfile")
        echo "PID=$pid" >>"$pidfile.state"

        tail_pid=""
        if [[ $verbose == 1 ]]; then
            tail -n +1 -f "$log" >&2 &
            tail_pid=$!
        fi
        deadline=$((SECONDS + timeout)) why=""
        while :; do
            if grep -a -q -F -- "$marker" "$log"; then
                break
            fi
            if grep -a -q 'Kernel panic - not syncing' "$log"; then
                why="kernel panic"
                break
            fi
            if ! is_qemu_pid "$pid"; then
                why="the guest ended before the ready marker (exit code $(guest_exit_code "$log"))"
                break
            fi
            if [[ -n $(guest_exit_code "$log") ]]; then
                why="guest script exited with $(guest_exit_code "$log") before the ready marker"
                break
            fi
            if ((SECONDS >= deadline)); then
                why="ready marker '$marker' not seen within $timeout s"
                break
            fi
            sleep 0.2
        done
        [[ -z $tail_pid ]] || kill "$tail_pid" 2>/dev/null || true
        [[ -n $why ]] || break
        if is_qemu_pid "$pid"; then
            kill "$pid" 2>/dev/null || true
            local n=0
            while is_qemu_pid "$pid" && ((n < 50)); do
                sleep 0.1
                n=$((n + 1))
            done
        fi
        if retry_boot "$log" "$attempt"; then
            attempt=$((attempt + 1))
            log=${firstlog%.log}-boot$attempt.log
            continue
        fi
        say "start failed: $why; last console lines:"
        tail -n 40 "$log" >&2 || true
        rm -rf "$rundir"
        rm -f "$pidfile" "$pidfile.state"
        return 1
    done
    # QEMU has loaded the initramfs into guest memory; the file is no longer needed. The rest
    # of the run directory (control FIFOs) belongs to the guest until `stop`.
    rm -f "$initrd"
    CLEANUP_DIR=""
    say "guest ready (QEMU pid $pid, $((SECONDS - started)) s)"
    echo "$pidfile"
}

# Guest boots that may be tried again: QEMU TCG with several vCPUs can hand a vCPU stale code
# while the kernel patches its own text (jump labels, static calls), which ends in an "int3"
# oops and a panic. A panic before /test.sh started touched nothing outside the guest, so such
# a boot is tried again (three boots in all). Returns 0 if the boot in LOG is to be tried again.
BOOT_ATTEMPTS=3
retry_boot() {
    local log=$1 attempt=$2
    grep -a -q 'Kernel panic - not syncing' "$log" || return 1
    ! grep -a -q 'init: running /test.sh' "$log" || return 1
    ((attempt < BOOT_ATTEMPTS)) || return 1
    say "the guest kernel panicked while booting, before /test.sh started (log: $log);" \
        "booting again ($((attempt + 1)) of $BOOT_ATTEMPTS)"
    grep -a -B 2 -A 2 'Oops\|Kernel panic - not syncing' "$log" | head -n 12 >&2 || true
    return 0
}

# Decides the exit code of a foreground run from the console log and the QEMU status.
finish_run() {
    local log=$1 rc=$2 timeout=$3 fail_on_trace=$4 code
    code=$(guest_exit_code "$log")
    if [[ $rc == 124 || $rc == 137 ]] && [[ -z $code ]]; then
        say "FAILED: timeout: the guest did not finish within $timeout s (log: $log)"
        return 124
    fi
    if grep -a -q 'Kernel panic - not syncing' "$log"; then
        say "FAILED: guest kernel panic (log: $log)"
        grep -a -A 3 'Kernel panic - not syncing' "$log" | head -n 8 >&2
        return 125
    fi
    if [[ -z $code ]]; then
        say "FAILED: the guest ended without a GUEST-EXIT marker (QEMU status $rc; log: $log)"
        return 126
    fi
    local traces
    traces=$(grep -a -o 'GUEST-KERNEL-TRACE [0-9]\+' "$log" | tail -n 1 | cut -d' ' -f2 || true)
    if [[ -n $traces ]]; then
        say "warning: the guest kernel logged $traces trace/warning lines (see $log)"
        if [[ $fail_on_trace == 1 && $code == 0 ]]; then
            say "FAILED: kernel traces with --fail-on-kernel-trace"
            return 1
        fi
    fi
    if [[ $code == 0 ]]; then
        say "guest script passed"
    else
        say "FAILED: guest script exited with $code (log: $log)"
    fi
    return "$code"
}

# ---------------------------------------------------------------------------------------------
# stop
# ---------------------------------------------------------------------------------------------
cmd_stop() {
    local grace=30 pidfile=""
    while [[ $# -gt 0 ]]; do
        case "$1" in
        --grace) grace=${2:?}; shift ;;
        -h | --help) usage 0 ;;
        -*) die "unknown option $1" ;;
        *) pidfile=$1 ;;
        esac
        shift
    done
    [[ -n $pidfile ]] || die "stop needs the pid file printed by start"
    [[ -f $pidfile.state ]] || die "$pidfile.state not found (not started by guest.sh start?)"
    local LOG="" RUNDIR="" PID=""
    # shellcheck disable=SC1090
    . "$pidfile.state"
    [[ -n $PID ]] || PID=$(cat "$pidfile" 2>/dev/null || true)

    if is_qemu_pid "$PID"; then
        # "stop" on the control port: /init sends SIGTERM to the guest script.
        # shellcheck disable=SC2016
        timeout 5 sh -c 'printf "stop\n" >"$1"' _ "$RUNDIR/ctl.in" || true
        local deadline=$((SECONDS + grace))
        while is_qemu_pid "$PID" && ((SECONDS < deadline)); do
            sleep 0.2
        done
    fi
    local forced=0
    if is_qemu_pid "$PID"; then
        forced=1
        say "the guest did not power off within $grace s; killing QEMU $PID"
        kill "$PID" 2>/dev/null || true
        sleep 2
        ! is_qemu_pid "$PID" || kill -9 "$PID" 2>/dev/null || true
    fi
    rm -rf "$RUNDIR"
    rm -f "$pidfile" "$pidfile.state"
    if [[ $forced == 1 ]]; then
        return 124
    fi
    finish_run "$LOG" 0 "$grace" 0
}

[[ $# -gt 0 ]] || usage 2
sub=$1
shift
case "$sub" in
run) cmd_boot run "$@" ;;
start) cmd_boot start "$@" ;;
stop) cmd_stop "$@" ;;
free-port) cmd_free_port ;;
-h | --help | help) usage 0 ;;
*) die "unknown command $sub (run, start, stop, free-port)" ;;
esac
