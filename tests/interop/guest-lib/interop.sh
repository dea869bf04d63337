# Shell helpers for interop guest scripts (busybox sh). guest.sh packs this file into every
# guest as /usr/lib/interop/interop.sh; scripts load it with:
#     . /usr/lib/interop/interop.sh
#
# Conventions: functions print what they do, and call fail (exit 1) on errors, so a script reads
# as a list of steps. Kernel target configuration goes through configfs (/sys/kernel/config/nvmet).

NVMET_CFS=/sys/kernel/config/nvmet

# Seconds since boot (two decimals).
uptime_s() { cut -d' ' -f1 /proc/uptime; }

log() { echo "[$(uptime_s)] $*"; }

fail() {
    echo "FAIL: $*"
    exit 1
}

# step CMD ARGS...: prints and runs a command; fails the script if it fails.
step() {
    echo "+ $*"
    "$@" || fail "'$*' exited with $?"
}

# expect_contains TEXT NEEDLE WHAT: fails unless TEXT contains NEEDLE.
expect_contains() {
    case "$1" in
    *"$2"*) ;;
    *) fail "$3: '$2' not found" ;;
    esac
}

# ---------------------------------------------------------------------------------------------
# Kernel target (nvmet)
# ---------------------------------------------------------------------------------------------

# nvmet_backing KIND SIZE_MB INDEX: creates a RAM-backed device or file for namespace INDEX
# (1-based) and prints its path. KIND: file (tmpfs file, needs buffered_io), brd (/dev/ramN,
# all of the same size; loaded on first use), null_blk (memory-backed nullb via configfs).
nvmet_backing() {
    kind=$1
    size_mb=$2
    idx=$3
    case "$kind" in
    file)
        mkdir -p /run/nvmet
        f=/run/nvmet/ns$idx.img
        truncate -s "${size_mb}M" "$f" || fail "cannot create $f"
        echo "$f"
        ;;
    brd)
        if [ ! -b /dev/ram0 ]; then
            modprobe brd rd_nr="${NVMET_NS_COUNT:-1}" rd_size=$((size_mb * 1024)) max_part=0 ||
                fail "modprobe brd failed"
        fi
        dev=/dev/ram$((idx - 1))
        [ -b "$dev" ] || fail "$dev does not exist"
        echo "$dev"
        ;;
    null_blk)
        grep -q '^null_blk ' /proc/modules || modprobe null_blk nr_devices=0 ||
            fail "modprobe null_blk failed"
        d=/sys/kernel/config/nullb/nullb$idx
        mkdir "$d" || fail "cannot create $d"
        echo "$size_mb" >"$d/size"
        echo 1 >"$d/memory_backed"
        echo 512 >"$d/blocksize"
        echo 1 >"$d/power" || fail "cannot power on nullb$idx"
        dev=/dev/nullb$idx
        i=0
        while [ ! -b "$dev" ] && [ $i -lt 50 ]; do
            sleep 0.1
            i=$((i + 1))
        done
        [ -b "$dev" ] || fail "$dev did not appear"
        echo "$dev"
        ;;
    *) fail "unknown backing kind '$kind' (file, brd, null_blk)" ;;
    esac
}

# nvmet_subsystem NQN [HOSTNQN...]: creates a subsystem. Without host NQNs any host may connect.
nvmet_subsystem() {
    nqn=$1
    shift
    s=$NVMET_CFS/subsystems/$nqn
    mkdir "$s" || fail "cannot create subsystem $nqn"
    [ -z "${NVMET_MODEL:-}" ] || echo "$NVMET_MODEL" >"$s/attr_model"
    [ -z "${NVMET_SERIAL:-}" ] || echo "$NVMET_SERIAL" >"$s/attr_serial"
    if [ $# -eq 0 ]; then
        echo 1 >"$s/attr_allow_any_host"
    else
        echo 0 >"$s/attr_allow_any_host"
        for h in "$@"; do
            mkdir -p "$NVMET_CFS/hosts/$h"
            ln -s "$NVMET_CFS/hosts/$h" "$s/allowed_hosts/$h" || fail "cannot allow host $h"
        done
    fi
}

# nvmet_namespace NQN NSID PATH: adds and enables a namespace (buffered I/O for regular files).
nvmet_namespace() {
    n=$NVMET_CFS/subsystems/$1/namespaces/$2
    mkdir "$n" || fail "cannot create namespace $2 of $1"
    echo "$3" >"$n/device_path"
    if [ -f "$3" ] && [ -e "$n/buffered_io" ]; then
        echo 1 >"$n/buffered_io"
    fi
    echo 1 >"$n/enable" || fail "cannot enable namespace $2 ($3)"
}

# nvmet_port PORTID TRTYPE TRADDR TRSVCID: creates a port (tcp or rdma, IPv4).
nvmet_port() {
    p=$NVMET_CFS/ports/$1
    mkdir "$p" || fail "cannot create port $1"
    echo "$2" >"$p/addr_trtype"
    echo ipv4 >"$p/addr_adrfam"
    echo "$3" >"$p/addr_traddr"
    echo "$4" >"$p/addr_trsvcid"
    [ -z "${NVMET_INLINE_DATA_SIZE:-}" ] || echo "$NVMET_INLINE_DATA_SIZE" >"$p/param_inline_data_size"
}

# nvmet_link PORTID NQN: exposes a subsystem on a port (this starts the listener).
nvmet_link() {
    ln -s "$NVMET_CFS/subsystems/$2" "$NVMET_CFS/ports/$1/subsystems/$2" ||
        fail "cannot link $2 to port $1 (is the address/port in use?)"
}

# nvmet_from_env: configures one subsystem on one port from these variables:
#   NVMET_TRTYPE      tcp (default) or rdma
#   NVMET_TRADDR      listen address (default 0.0.0.0 for tcp, the eth0 address for rdma)
#   NVMET_PORT        service id (default 4420)
#   NVMET_NQN         subsystem NQN (default nqn.2014-08.org.nvmexpress:nvmf-interop)
#   NVMET_NS_COUNT    namespaces (default 1), NSIDs 1..N
#   NVMET_NS_SIZE_MB  size of each namespace (default 64)
#   NVMET_BACKEND     file (default), brd or null_blk
#   NVMET_ALLOW_HOSTS space-separated host NQNs (default: any host)
#   NVMET_MODEL, NVMET_SERIAL, NVMET_INLINE_DATA_SIZE  optional attributes
nvmet_from_env() {
    : "${NVMET_TRTYPE:=tcp}" "${NVMET_PORT:=4420}" "${NVMET_NS_COUNT:=1}" "${NVMET_NS_SIZE_MB:=64}"
    : "${NVMET_NQN:=nqn.2014-08.org.nvmexpress:nvmf-interop}" "${NVMET_BACKEND:=file}"
    if [ -z "${NVMET_TRADDR:-}" ]; then
        if [ "$NVMET_TRTYPE" = rdma ]; then NVMET_TRADDR=${GUEST_IP:-10.0.2.15}; else NVMET_TRADDR=0.0.0.0; fi
    fi
    case "$NVMET_TRTYPE" in
    tcp) grep -q '^nvmet_tcp ' /proc/modules || step modprobe nvmet_tcp ;;
    rdma) grep -q '^nvmet_rdma ' /proc/modules || step modprobe nvmet_rdma ;;
    *) fail "NVMET_TRTYPE must be tcp or rdma" ;;
    esac
    log "nvmet: $NVMET_TRTYPE $NVMET_TRADDR:$NVMET_PORT $NVMET_NQN, $NVMET_NS_COUNT x ${NVMET_NS_SIZE_MB} MiB ($NVMET_BACKEND)"
    # shellcheck disable=SC2086
    nvmet_subsystem "$NVMET_NQN" ${NVMET_ALLOW_HOSTS:-}
    i=1
    while [ "$i" -le "$NVMET_NS_COUNT" ]; do
        path=$(nvmet_backing "$NVMET_BACKEND" "$NVMET_NS_SIZE_MB" "$i") || exit 1
        nvmet_namespace "$NVMET_NQN" "$i" "$path"
        i=$((i + 1))
    done
    nvmet_port 1 "$NVMET_TRTYPE" "$NVMET_TRADDR" "$NVMET_PORT"
    nvmet_link 1 "$NVMET_NQN"
}

# nvmet_clear: removes every port, subsystem, namespace and host from configfs.
nvmet_clear() {
    for l in "$NVMET_CFS"/ports/*/subsystems/*; do [ -L "$l" ] && rm "$l"; done
    for l in "$NVMET_CFS"/ports/*/referrals/*; do [ -d "$l" ] && rmdir "$l"; done
    for p in "$NVMET_CFS"/ports/*; do [ -d "$p" ] && rmdir "$p"; done
    for s in "$NVMET_CFS"/subsystems/*; do
        [ -d "$s" ] || continue
        for l in "$s"/allowed_hosts/*; do [ -L "$l" ] && rm "$l"; done
        for n in "$s"/namespaces/*; do
            [ -d "$n" ] || continue
            echo 0 >"$n/enable"
            rmdir "$n"
        done
        rmdir "$s"
    done
    for h in "$NVMET_CFS"/hosts/*; do [ -d "$h" ] && rmdir "$h"; done
    for d in /sys/kernel/config/nullb/nullb*; do
        [ -d "$d" ] || continue
        echo 0 >"$d/power"
        rmdir "$d"
    done
    rm -rf /run/nvmet
    return 0
}

# serve_until_stop MARKER: prints MARKER (what `guest.sh start --ready-marker` waits for) and
# sleeps until guest.sh stop (SIGTERM). Returns 0 after the stop request.
serve_until_stop() {
    trap 'stop_requested=1; kill "$sleep_pid" 2>/dev/null' TERM
    stop_requested=0
    echo "$1"
    while [ "$stop_requested" = 0 ]; do
        sleep 3600 &
        sleep_pid=$!
        wait "$sleep_pid"
    done
    trap - TERM
    log "stop requested"
}

# ---------------------------------------------------------------------------------------------
# tlshd (the kernel's TLS handshake agent)
# ---------------------------------------------------------------------------------------------

# tlshd_start: writes /etc/tlshd.conf (PSKs from the .nvme keyring, each handshake's result
# logged), starts tlshd with its log in /tmp/tlshd.log and waits until it listens for the
# kernel's handshake requests: before that the kernel finds no handler and closes every TLS
# connection at once. Sets TLSHD_PID.
tlshd_start() {
    cat >/etc/tlshd.conf <<EOF
[debug]
loglevel=1
tls=0
nl=0

[authenticate]
keyrings=.nvme
EOF
    tlshd -s -c /etc/tlshd.conf >/tmp/tlshd.log 2>&1 &
    TLSHD_PID=$!
    tenths=0
    until tlshd_listening "$TLSHD_PID"; do
        kill -0 "$TLSHD_PID" 2>/dev/null || fail "tlshd exited: $(cat /tmp/tlshd.log)"
        [ "$tenths" -lt 1200 ] || fail "tlshd did not join the handshake group within 120 s"
        sleep 0.1
        tenths=$((tenths + 1))
    done
    log "tlshd ($TLSHD_PID) listens for handshake requests"
}

# tlshd_listening PID: true once one of PID's generic netlink sockets has joined a multicast
# group (tlshd joins only the handshake family's) according to /proc/net/netlink.
tlshd_listening() {
    for inode in $(ls -l "/proc/$1/fd" 2>/dev/null | sed -n 's/.*socket:\[\([0-9]*\)\].*/\1/p'); do
        awk -v inode="$inode" '$2 == 16 && $NF == inode && $4 !~ /^0+$/ { found = 1 }
            END { exit !found }' /proc/net/netlink && return 0
    done
    return 1
}

# tlshd_stop: stops tlshd and prints its log.
tlshd_stop() {
    kill "$TLSHD_PID" 2>/dev/null
    wait "$TLSHD_PID" 2>/dev/null
    echo "--- tlshd log"
    sed 's/^/  /' /tmp/tlshd.log
}

# ---------------------------------------------------------------------------------------------
# Kernel host (nvme-cli)
# ---------------------------------------------------------------------------------------------

# nvme_ctrl_for NQN: prints the controller names (nvmeN) connected to subsystem NQN.
nvme_ctrl_for() {
    for c in /sys/class/nvme/nvme*; do
        [ -e "$c/subsysnqn" ] || continue
        [ "$(cat "$c/subsysnqn")" = "$1" ] && basename "$c"
    done
    return 0
}

# nvme_wait_ns NQN NSID [TIMEOUT_S]: waits for the block device of namespace NSID of subsystem
# NQN and prints it (/dev/nvmeXnY; the multipath head when CONFIG_NVME_MULTIPATH is on).
nvme_wait_ns() {
    i=0
    limit=$((${3:-20} * 10))
    while [ $i -lt "$limit" ]; do
        for s in /sys/class/nvme-subsystem/nvme-subsys* /sys/class/nvme/nvme*; do
            [ -e "$s/subsysnqn" ] || continue
            [ "$(cat "$s/subsysnqn")" = "$1" ] || continue
            for n in "$s"/nvme*n*; do
                [ -e "$n/nsid" ] || continue
                [ "$(cat "$n/nsid")" = "$2" ] || continue
                b=$(basename "$n")
                if [ -b "/dev/$b" ]; then
                    echo "/dev/$b"
                    return 0
                fi
            done
        done
        sleep 0.1
        i=$((i + 1))
    done
    return 1
}

# fio_verify DEV [SIZE]: random 4 KiB writes at queue depth 16, then reads everything back and
# checks the CRC32C written into each block. Fails the script on any mismatch or I/O error.
fio_verify() {
    command -v fio >/dev/null || fail "fio is not in this guest (guest.sh --with-fio)"
    echo "+ fio verify $1 (randwrite 4k, iodepth 16, ${2:-8M}, crc32c)"
    if ! out=$(fio --name=verify --filename="$1" --ioengine=libaio --direct=1 --rw=randwrite \
        --bs=4k --iodepth=16 --size="${2:-8M}" --verify=crc32c --do_verify=1 --verify_fatal=1 \
        --randrepeat=0 --group_reporting 2>&1); then
        echo "$out"
        fail "fio verify on $1 failed"
    fi
    echo "$out" | grep -E 'err=|^ +(read|write): IOPS|^ +(READ|WRITE):'
    expect_contains "$out" "err= 0" "fio result"
}

# fio_throughput DEV RW [SIZE] [BS] [IODEPTH]: sequential throughput, prints one summary line.
fio_throughput() {
    command -v fio >/dev/null || fail "fio is not in this guest (guest.sh --with-fio)"
    out=$(fio --name=bw --filename="$1" --ioengine=libaio --direct=1 --rw="$2" --bs="${4:-128k}" \
        --iodepth="${5:-8}" --size="${3:-32M}" --output-format=terse --terse-version=3) ||
        fail "fio $2 on $1 failed"
    # terse v3: field 7 = read KiB/s, field 48 = write KiB/s
    echo "$out" | awk -F';' -v rw="$2" -v dev="$1" -v bs="${4:-128k}" -v qd="${5:-8}" '{
        bw = (rw ~ /write/) ? $48 : $7
        printf "fio %s %s bs=%s iodepth=%s: %.1f MiB/s\n", rw, dev, bs, qd, bw / 1024 }'
}
