#!/bin/sh
# RocksDB's db_bench on ext4 over up to three block devices of one guest, the application level
# of the direct-attached / NVMe-oF / iSCSI comparison (guest.sh --with-ext4 --with-rocksdb):
#
#   das    the guest's local virtual disk: the first virtio-blk disk (/dev/vda), given by
#          guest.sh --qemu-arg -drive ... --qemu-arg -device virtio-blk-pci,...
#   of     the kernel NVMe/TCP host connected to TARGET_ADDR:TARGET_PORT, subsystem TARGET_NQN,
#          namespace 1 (our target on the host: 10.0.2.2 is the host's 127.0.0.1)
#   iscsi  the kernel iSCSI initiator (iscsid + iscsiadm, iscsi_tcp) logged in to
#          ISCSI_ADDR:ISCSI_PORT, target ISCSI_IQN, LUN 1 (tgt on the host)
#
# For each column in COLUMNS and each value size in VALUE_SIZES: mke2fs -t ext4, mount, db_bench
# fillrandom of DB_NUM keys (DB_NUM_LARGE for values of 4 KiB and more), drop the page cache,
# then readrandomwriterandom with --readwritepercent=80 for DB_DURATION seconds on the same
# database, unmount. Reads and flush/compaction use O_DIRECT and the block cache is small
# (DB_CACHE_MB), so the reads reach the device instead of the guest's page cache.
#
# One line per phase, for the host to collect:
#   ROCKSDB-RESULT column=C value=V phase=fill ops=N
#   ROCKSDB-RESULT column=C value=V phase=mix ops=N read_p50_us=.. read_p99_us=.. write_p50_us=.. write_p99_us=..
#   ROCKSDB-PROBE column=C read_4k_qd1_us=N
# (ops: db_bench's ops/sec; the percentiles from its --histogram, in microseconds; the probe: the
# mean time of 2000 sequential 4 KiB O_DIRECT reads one at a time with dd, before mke2fs, to
# show each path's own latency). The script ends with "ROCKSDB-DONE" and exits 0 when every
# column ran.
#
# Environment (defaults): COLUMNS ("das of iscsi"), VALUE_SIZES ("800 10240"), DB_NUM (20000),
# DB_NUM_LARGE (DB_NUM / 8), DB_DURATION (30), DB_THREADS (4), DB_CACHE_MB (8), TARGET_ADDR
# and ISCSI_ADDR (10.0.2.2), TARGET_PORT (4420), TARGET_NQN, ISCSI_PORT (3260), ISCSI_IQN,
# NR_IO_QUEUES (the host's default), DB_EXTRA (more db_bench arguments for both phases).
. /usr/lib/interop/interop.sh

COLUMNS=${COLUMNS:-das of iscsi}
VALUE_SIZES=${VALUE_SIZES:-800 10240}
DB_NUM=${DB_NUM:-20000}
DB_NUM_LARGE=${DB_NUM_LARGE:-$((DB_NUM / 8))}
DB_DURATION=${DB_DURATION:-30}
DB_THREADS=${DB_THREADS:-4}
DB_CACHE_MB=${DB_CACHE_MB:-8}
TARGET_ADDR=${TARGET_ADDR:-10.0.2.2}
TARGET_PORT=${TARGET_PORT:-4420}
ISCSI_ADDR=${ISCSI_ADDR:-10.0.2.2}
ISCSI_PORT=${ISCSI_PORT:-3260}
MNT=/mnt/db

step modprobe ext4
mkdir -p "$MNT"

# das_device: the first virtio-blk disk.
das_device() {
    modprobe virtio_blk
    i=0
    while [ $i -lt 100 ]; do
        for b in /sys/block/vd*; do
            [ -e "$b" ] && {
                echo "/dev/${b##*/}"
                return 0
            }
        done
        sleep 0.1
        i=$((i + 1))
    done
    return 1
}

of_device() {
    [ -n "${TARGET_NQN:-}" ] || fail "TARGET_NQN is not set"
    set -- -t tcp -a "$TARGET_ADDR" -s "$TARGET_PORT" -n "$TARGET_NQN"
    [ -z "${NR_IO_QUEUES:-}" ] || set -- "$@" --nr-io-queues="$NR_IO_QUEUES"
    nvme connect "$@" >&2 || return 1
    nvme_wait_ns "$TARGET_NQN" 1 30
}

of_release() {
    nvme disconnect -n "$TARGET_NQN" >&2
}

iscsi_device() {
    [ -n "${ISCSI_IQN:-}" ] || fail "ISCSI_IQN is not set"
    modprobe iscsi_tcp && modprobe sd_mod || return 1
    mkdir -p /etc/iscsi /var/lib/iscsi /run/lock/iscsi
    echo "InitiatorName=iqn.2005-03.org.open-iscsi:$(hostname)" >/etc/iscsi/initiatorname.iscsi
    if [ ! -e /run/iscsid.pid ]; then
        iscsid >&2 || return 1
        sleep 1
    fi
    portal=$ISCSI_ADDR:$ISCSI_PORT
    # SendTargets answers with the portal as tgt sees it (the host's 127.0.0.1): the node
    # record is made for the address this guest reaches it at.
    iscsiadm -m discovery -t sendtargets -p "$portal" -o nonpersistent >&2 || return 1
    iscsiadm -m node -o new -T "$ISCSI_IQN" -p "$portal" >&2 || return 1
    # The initiator's side of the tuning the target has (tgt's ImmediateData, InitialR2T,
    # segment and burst sizes): the session takes the smaller of each pair.
    for kv in node.session.iscsi.ImmediateData=Yes node.session.iscsi.InitialR2T=No \
        node.conn[0].iscsi.MaxRecvDataSegmentLength=262144 \
        node.session.iscsi.FirstBurstLength=262144 node.session.iscsi.MaxBurstLength=1048576 \
        node.session.cmds_max=1024 node.session.queue_depth=128; do
        iscsiadm -m node -T "$ISCSI_IQN" -p "$portal" -o update -n "${kv%%=*}" -v "${kv#*=}" >&2 ||
            return 1
    done
    iscsiadm -m node -T "$ISCSI_IQN" -p "$portal" --login >&2 || return 1
    iscsiadm -m session -P 2 2>&1 | grep -E 'ImmediateData|InitialR2T|MaxRecvDataSegmentLength|FirstBurstLength|MaxBurstLength|Digest' >&2
    # LUN 1 of the session: /sys/class/scsi_disk/H:C:T:1/device/block/sdX
    i=0
    while [ $i -lt 300 ]; do
        for d in /sys/class/scsi_disk/*:1; do
            for b in "$d"/device/block/sd*; do
                if [ -e "$b" ] && [ -b "/dev/${b##*/}" ]; then
                    echo "/dev/${b##*/}"
                    return 0
                fi
            done
        done
        sleep 0.1
        i=$((i + 1))
    done
    return 1
}

iscsi_release() {
    iscsiadm -m node -T "$ISCSI_IQN" -p "$ISCSI_ADDR:$ISCSI_PORT" --logout >&2
}

# pct FILE SECTION P: percentile P (P50, P99) of the "Microseconds per SECTION:" histogram.
pct() {
    awk -v sec="Microseconds per $2:" -v p="$3:" '
        $0 == sec { on = 1; next }
        on && /^Percentiles:/ { for (i = 1; i < NF; i++) if ($i == p) { print $(i + 1); exit } }
        on && /^Microseconds per/ { on = 0 }
    ' "$1"
}

# ops FILE BENCH: db_bench's ops/sec for BENCH.
ops() {
    awk -v b="$2" '$1 == b && $2 == ":" { for (i = 3; i < NF; i++) if ($(i + 1) ~ /^ops\/sec/) { print $i; exit } }' "$1"
}

# probe COLUMN DEV: the path's QD1 read latency (/proc/uptime's 10 ms resolution over 2000 reads).
probe() {
    t0=$(uptime_s)
    dd if="$2" of=/dev/null bs=4096 count=2000 iflag=direct 2>/dev/null || return 1
    t1=$(uptime_s)
    echo "ROCKSDB-PROBE column=$1 read_4k_qd1_us=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.0f", (b - a) * 1e6 / 2000 }')"
}

# bench COLUMN DEV VALUE
bench() {
    col=$1 dev=$2 value=$3
    num=$DB_NUM
    [ "$value" -lt 4096 ] || num=$DB_NUM_LARGE
    /usr/sbin/mke2fs -q -F -t ext4 -E lazy_itable_init=0,lazy_journal_init=0 "$dev" || return 1
    mount -t ext4 "$dev" "$MNT" || return 1
    # shellcheck disable=SC2086
    set -- --db="$MNT/rocksdb" --wal_dir="$MNT/rocksdb" --num="$num" --value_size="$value" \
        --key_size=16 --compression_type=none --cache_size=$((DB_CACHE_MB * 1048576)) \
        --use_direct_reads=true --use_direct_io_for_flush_and_compaction=true \
        --histogram=1 --statistics=0 --seed=1 ${DB_EXTRA:-}
    log "$col value=$value: fillrandom of $num keys on $dev"
    db_bench "$@" --benchmarks=fillrandom --threads=1 >/tmp/fill.out 2>&1 || {
        grep -v '^(' /tmp/fill.out | tail -n 30
        umount "$MNT"
        return 1
    }
    grep -E '^fillrandom' /tmp/fill.out
    echo "ROCKSDB-RESULT column=$col value=$value phase=fill ops=$(ops /tmp/fill.out fillrandom)"
    sync
    echo 3 >/proc/sys/vm/drop_caches
    log "$col value=$value: readrandomwriterandom 80/20, $DB_THREADS threads, $DB_DURATION s"
    db_bench "$@" --use_existing_db=1 --benchmarks=readrandomwriterandom --readwritepercent=80 \
        --threads="$DB_THREADS" --duration="$DB_DURATION" >/tmp/mix.out 2>&1 || {
        grep -v '^(' /tmp/mix.out | tail -n 30
        umount "$MNT"
        return 1
    }
    grep -E '^readrandomwriterandom' /tmp/mix.out
    echo "ROCKSDB-RESULT column=$col value=$value phase=mix ops=$(ops /tmp/mix.out readrandomwriterandom)" \
        "read_p50_us=$(pct /tmp/mix.out read P50) read_p99_us=$(pct /tmp/mix.out read P99)" \
        "write_p50_us=$(pct /tmp/mix.out write P50) write_p99_us=$(pct /tmp/mix.out write P99)"
    umount "$MNT"
}

failed=""
for col in $COLUMNS; do
    case "$col" in
    das) dev=$(das_device) || dev="" ;;
    of) dev=$(of_device) || dev="" ;;
    iscsi) dev=$(iscsi_device) || dev="" ;;
    *) fail "unknown column $col (das, of, iscsi)" ;;
    esac
    if [ -z "$dev" ]; then
        log "FAIL: no block device for column $col"
        failed="$failed $col"
        continue
    fi
    log "column $col: $dev ($(($(cat "/sys/class/block/${dev#/dev/}/size") / 2048)) MiB)"
    probe "$col" "$dev" || log "dd on $dev failed"
    for value in $VALUE_SIZES; do
        bench "$col" "$dev" "$value" || {
            log "FAIL: db_bench on column $col, value $value"
            failed="$failed $col"
        }
    done
    case "$col" in
    of) of_release ;;
    iscsi) iscsi_release ;;
    esac
done
[ -z "$failed" ] || fail "columns that failed:$failed"
echo "ROCKSDB-DONE"
