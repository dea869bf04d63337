#!/usr/bin/env bash
# Study 1 at the application level: RocksDB's db_bench (800 B and 10 KiB values; fillrandom,
# then readrandomwriterandom with 80% reads) on ext4 in the interop QEMU guest, over three
# block devices of one boot:
#
#   DAS    the guest's local virtual disk: QEMU virtio-blk-pci on a RAM file (/dev/shm)
#   oF     the guest kernel's NVMe/TCP host -> nvmeof-targetd on this machine (mem: namespace)
#   iSCSI  the guest kernel's iSCSI initiator (open-iscsi) -> Debian's tgt on this machine
#          (RAM file in /dev/shm, backing store rdwr), tuned as the load generator's iscsi mode
#          tunes it: ImmediateData=Yes, InitialR2T=No, 256 KiB MaxRecv/MaxXmitDataSegmentLength
#          and FirstBurstLength, 1 MiB MaxBurstLength, no digests, MaxQueueCmd 128
#
# All three are backed by this machine's RAM, so the columns differ only in the path: virtio
# vs NVMe/TCP through our target vs iSCSI through tgt (both through QEMU's user-mode network,
# guest 10.0.2.2 = this machine's 127.0.0.1). Prints one table per value size with the oF/DAS
# and iSCSI/DAS ratios, and keeps the guest's console and the result lines in --out.
#
# Usage:
#   benches/scripts/study1-rocksdb.sh [OPTIONS]
#
# Options (defaults in brackets):
#   --accel tcg|kvm     QEMU accelerator [tcg]; under tcg the guest's CPU is emulated and the
#                       figures are the emulation's shape, not the storage paths' speed
#   --smp N             guest CPUs [2]          --mem MB      guest memory [1024]
#   --disk-mb MB        size of each of the three devices, at least 128 [1024]
#   --num N             keys for 800 B values [20000]
#   --num-large N       keys for 10 KiB values [num / 8]
#   --duration S        seconds of readrandomwriterandom per value size and column [30]
#   --threads N         db_bench threads in the mixed phase [4]
#   --values "V..."     value sizes in bytes ["800 10240"]
#   --columns "C..."    of das, of, iscsi ["das of iscsi"]
#   --targetd PATH      nvmeof-targetd binary [target/release/nvmeof-targetd]
#   --reactors N        nvmeof-targetd --reactors [its default]
#   --target-cpus LIST  pin nvmeof-targetd and tgtd to these CPUs (taskset -c) [unpinned]
#   --timeout S         guest run limit [3600]
#   --out DIR           console log and result lines [benches/results/study1-rocksdb-<date>]
#
# Needs: the guest prepared by tests/interop/setup.sh --with-rocksdb (add --with-k612 where the
# 6.12 guest is wanted too: setup.sh records only the guests it was asked for), tgt (tgtd,
# tgtadm), a release nvmeof-targetd (cargo build --release --bin nvmeof-targetd).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
GUEST_SH=$ROOT/tests/interop/guest.sh

ACCEL=tcg SMP=2 MEM=1024 DISK_MB=1024 NUM=20000 NUM_LARGE="" DURATION=30 THREADS=4
VALUES="800 10240" COLUMNS="das of iscsi" TARGETD=$ROOT/target/release/nvmeof-targetd
REACTORS="" TARGET_CPUS="" TIMEOUT=3600 OUT=""

die() {
    echo "study1-rocksdb: error: $*" >&2
    exit 2
}
say() { echo "study1-rocksdb: $*" >&2; }

while [[ $# -gt 0 ]]; do
    case "$1" in
    --accel) ACCEL=${2:?} ;;
    --smp) SMP=${2:?} ;;
    --mem) MEM=${2:?} ;;
    --disk-mb) DISK_MB=${2:?} ;;
    --num) NUM=${2:?} ;;
    --num-large) NUM_LARGE=${2:?} ;;
    --duration) DURATION=${2:?} ;;
    --threads) THREADS=${2:?} ;;
    --values) VALUES=${2:?} ;;
    --columns) COLUMNS=${2:?} ;;
    --targetd) TARGETD=${2:?} ;;
    --reactors) REACTORS=${2:?} ;;
    --target-cpus) TARGET_CPUS=${2:?} ;;
    --timeout) TIMEOUT=${2:?} ;;
    --out) OUT=${2:?} ;;
    -h | --help)
        awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"
        exit 0
        ;;
    *) die "unknown argument $1 (--help)" ;;
    esac
    shift 2
done
[[ -n $NUM_LARGE ]] || NUM_LARGE=$((NUM / 8))
for n in "$SMP" "$MEM" "$DISK_MB" "$NUM" "$NUM_LARGE" "$DURATION" "$THREADS" "$TIMEOUT"; do
    [[ $n =~ ^[0-9]+$ ]] || die "expected a number, got '$n'"
done
# RocksDB preallocates its write-ahead log at 1.1 x the 64 MiB write buffer: on a smaller file
# system that fails and db_bench (Debian's is built with assertions) aborts when it closes.
((DISK_MB >= 128)) || die "--disk-mb must be at least 128 (RocksDB preallocates ~70 MiB of log)"
for c in $COLUMNS; do
    [[ $c == das || $c == of || $c == iscsi ]] || die "unknown column $c (das, of, iscsi)"
done
[[ -n $OUT ]] || OUT=$ROOT/benches/results/study1-rocksdb-$(date -u +%Y%m%d-%H%M%S)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

PIDS=()
FILES=()
cleanup() {
    local p i
    # tgtd ignores SIGTERM while it serves a target: KILL what is still there after 2 s.
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for ((i = 0; i < 20; i++)); do
        kill -0 "${PIDS[@]}" 2>/dev/null || break
        sleep 0.1
    done
    for p in "${PIDS[@]}"; do
        kill -KILL "$p" 2>/dev/null || true
        wait "$p" 2>/dev/null || true
    done
    rm -f "${FILES[@]}"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { "$GUEST_SH" free-port; }
# pinned CMD...: runs CMD in place of the (background) shell that calls it, so that $! is CMD.
pinned() {
    if [[ -n $TARGET_CPUS ]]; then exec taskset -c "$TARGET_CPUS" "$@"; else exec "$@"; fi
}
wait_listening() {
    local port=$1 pid=$2 what=$3 i
    for ((i = 0; i < 100; i++)); do
        kill -0 "$pid" 2>/dev/null || die "$what exited at start (see $OUT/$what.log)"
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then return 0; fi
        sleep 0.1
    done
    die "$what is not listening on 127.0.0.1:$port after 10 s"
}
# ram_file NAME: a sparse file of --disk-mb in /dev/shm, in $RAM_FILE (removed at exit).
ram_file() {
    RAM_FILE=$(mktemp "/dev/shm/study1-rocksdb-$1.XXXXXX")
    FILES+=("$RAM_FILE")
    truncate -s "${DISK_MB}M" "$RAM_FILE"
}

GUEST_ARGS=(run --with-ext4 --with-rocksdb --accel "$ACCEL" --smp "$SMP" --mem "$MEM"
    --timeout "$TIMEOUT" --log "$OUT/console.log"
    --env "COLUMNS=$COLUMNS" --env "VALUE_SIZES=$VALUES" --env "DB_NUM=$NUM"
    --env "DB_NUM_LARGE=$NUM_LARGE" --env "DB_DURATION=$DURATION" --env "DB_THREADS=$THREADS")

if [[ " $COLUMNS " == *" das "* ]]; then
    ram_file das
    das=$RAM_FILE
    # virtio-blk on a RAM file through the host page cache (tmpfs has no O_DIRECT), threads for
    # the I/O as QEMU does by default.
    GUEST_ARGS+=(--qemu-arg -drive --qemu-arg "file=$das,if=none,id=das0,format=raw,cache=writeback,aio=threads"
        --qemu-arg -device --qemu-arg "virtio-blk-pci,drive=das0")
fi

if [[ " $COLUMNS " == *" of "* ]]; then
    [[ -x $TARGETD ]] || die "$TARGETD not found (cargo build --release --bin nvmeof-targetd, or --targetd)"
    nqn=nqn.2026-11.io.nvmeof-direct:study1-rocksdb
    port=$(free_port)
    args=(--listen "tcp://127.0.0.1:$port" -n "$nqn" --namespace "mem:${DISK_MB}M")
    [[ -z $REACTORS ]] || args+=(--reactors "$REACTORS")
    pinned "$TARGETD" "${args[@]}" >"$OUT/nvmeof-targetd.log" 2>&1 &
    PIDS+=($!)
    wait_listening "$port" "$!" nvmeof-targetd
    say "nvmeof-targetd on 127.0.0.1:$port ($nqn, mem:${DISK_MB}M)"
    GUEST_ARGS+=(--env "TARGET_PORT=$port" --env "TARGET_NQN=$nqn")
fi

if [[ " $COLUMNS " == *" iscsi "* ]]; then
    command -v tgtd >/dev/null || [[ -x /usr/sbin/tgtd ]] || die "tgtd not found: apt-get install tgt"
    PATH=$PATH:/usr/sbin
    iqn=iqn.2026-11.io.nvmeof-direct:study1-rocksdb
    ram_file iscsi
    lun=$RAM_FILE
    port=$(free_port)
    # A control port of its own (another tgtd may hold the default one).
    ctl=$((20000 + $$ % 10000))
    pinned tgtd -f -C "$ctl" --iscsi "portal=127.0.0.1:$port" >"$OUT/tgtd.log" 2>&1 &
    PIDS+=($!)
    wait_listening "$port" "$!" tgtd
    tgtadm_() { tgtadm -C "$ctl" --lld iscsi "$@" >>"$OUT/tgtd.log" 2>&1 || die "tgtadm $* failed (see $OUT/tgtd.log)"; }
    tgtadm_ --mode target --op new --tid 1 -T "$iqn"
    tgtadm_ --mode logicalunit --op new --tid 1 --lun 1 -b "$lun" --bstype rdwr --blocksize 512
    tgtadm_ --mode target --op bind --tid 1 -I ALL
    for kv in ImmediateData=Yes InitialR2T=No MaxRecvDataSegmentLength=262144 \
        MaxXmitDataSegmentLength=262144 FirstBurstLength=262144 MaxBurstLength=1048576 \
        HeaderDigest=None DataDigest=None MaxQueueCmd=128; do
        tgtadm_ --mode target --op update --tid 1 --name "${kv%%=*}" --value "${kv#*=}"
    done
    say "tgtd on 127.0.0.1:$port ($iqn, LUN 1: ${DISK_MB} MiB in /dev/shm)"
    GUEST_ARGS+=(--env "ISCSI_PORT=$port" --env "ISCSI_IQN=$iqn")
fi

say "guest: $ACCEL, $SMP CPUs, $MEM MB; columns: $COLUMNS; values: $VALUES; keys $NUM/$NUM_LARGE; ${DURATION}s mixed"
rc=0
"$GUEST_SH" "${GUEST_ARGS[@]}" "$ROOT/tests/interop/guest-scripts/rocksdb-bench.sh" >"$OUT/guest.out" 2>&1 || rc=$?
grep -a '^ROCKSDB-RESULT\|^ROCKSDB-PROBE' "$OUT/console.log" | tr -d '\r' >"$OUT/results.txt" || true
if [[ $rc != 0 ]]; then
    tail -n 40 "$OUT/guest.out" >&2
    die "the guest run failed ($rc); console: $OUT/console.log"
fi

{
    echo "# db_bench on ext4 in the QEMU guest ($ACCEL, $SMP vCPUs, $MEM MB), $(date -u +%F)"
    [[ $ACCEL == kvm ]] || echo "# TCG: the guest CPU is emulated; the shape of the comparison, not the paths' speed"
    echo "# fillrandom: 1 thread; mix: readrandomwriterandom 80/20, $THREADS threads, $DURATION s;" \
        "keys: $NUM (800 B) / $NUM_LARGE (>= 4 KiB); O_DIRECT reads, 8 MiB block cache"
    awk -v cols="$COLUMNS" '
        $1 == "ROCKSDB-PROBE" {
            for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
            probe[f["column"]] = f["read_4k_qd1_us"]
            delete f
            next
        }
        {
            for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
            k = f["value"] SUBSEP f["phase"] SUBSEP f["column"]
            v[k, "ops"] = f["ops"]
            if (f["phase"] == "mix") {
                v[k, "read_p50_us"] = f["read_p50_us"]; v[k, "read_p99_us"] = f["read_p99_us"]
                v[k, "write_p50_us"] = f["write_p50_us"]; v[k, "write_p99_us"] = f["write_p99_us"]
            }
            if (!(f["value"] in seen)) { seen[f["value"]] = 1; order[++nv] = f["value"] }
            delete f
        }
        function cell(x) { return x == "" ? "-" : x }
        function ratio(a, b) { return (a == "" || b == "" || b + 0 == 0) ? "-" : sprintf("%.2f", a / b) }
        END {
            n = split(cols, c, " ")
            hdr = "| value | metric |"
            sep = "|---|---|"
            for (j = 1; j <= n; j++) { hdr = hdr " " (c[j] == "of" ? "oF" : c[j] == "das" ? "DAS" : "iSCSI") " |"; sep = sep "---|" }
            if (index(" " cols " ", " das ")) {
                if (index(" " cols " ", " of ")) { hdr = hdr " oF/DAS |"; sep = sep "---|" }
                if (index(" " cols " ", " iscsi ")) { hdr = hdr " iSCSI/DAS |"; sep = sep "---|" }
            }
            print hdr; print sep
            split("fill:ops mix:ops mix:read_p50_us mix:read_p99_us mix:write_p50_us mix:write_p99_us", m, " ")
            split("fill ops/s|80/20 ops/s|read p50 us|read p99 us|write p50 us|write p99 us", name, "|")
            for (a = 1; a <= nv; a++) for (b = 1; b <= 6; b++) {
                split(m[b], pm, ":")
                line = "| " order[a] " B | " name[b] " |"
                for (j = 1; j <= n; j++) line = line " " cell(v[order[a], pm[1], c[j], pm[2]]) " |"
                d = v[order[a], pm[1], "das", pm[2]]
                if (index(" " cols " ", " das ")) {
                    if (index(" " cols " ", " of ")) line = line " " ratio(v[order[a], pm[1], "of", pm[2]], d) " |"
                    if (index(" " cols " ", " iscsi ")) line = line " " ratio(v[order[a], pm[1], "iscsi", pm[2]], d) " |"
                }
                print line
            }
            line = "| - | 4 KiB O_DIRECT read QD1 us (dd) |"
            for (j = 1; j <= n; j++) line = line " " cell(probe[c[j]]) " |"
            if (index(" " cols " ", " das ")) {
                if (index(" " cols " ", " of ")) line = line " " ratio(probe["of"], probe["das"]) " |"
                if (index(" " cols " ", " iscsi ")) line = line " " ratio(probe["iscsi"], probe["das"]) " |"
            }
            print line
        }' "$OUT/results.txt"
} | tee "$OUT/table.md"
say "console, result lines and table in $OUT"
