#!/bin/sh
# ext4 on a namespace of nvmeof-targetd survives power cuts: the kernel host formats the
# namespace, then in each round writes files, fsyncs each one and prints a record of every fsync
# that returned (`FSYNCED ROUND NAME MD5`). The test (tests/tests/kernel_host.rs) kills the
# daemon with SIGKILL at a point of its choosing; with a `volatile_cache` namespace that loses
# every write not made durable by a Flush or a FUA write, like a disk losing power. The host then
# abandons the disk: the controller is removed once ctrl-loss-tmo expires, the filesystem is
# lazily unmounted, and `HOST-ABANDONED ROUND` tells the test to restart the daemon. The guest
# connects a fresh controller, replays the journal (mount + umount), runs `e2fsck -fn` (must be
# clean), mounts again and lists every file with its checksum (`FOUND ROUND NAME MD5`); the test
# checks that every file whose fsync returned, in this round or an earlier one, is there with its
# recorded checksum. `RECOVERED ROUND` ends a round; after ROUNDS rounds the guest disconnects.
#
# Environment: TARGET_PORT, TARGET_NQN (required); ROUNDS (default 3); MAX_FILES per round
# (default 400: the round fails if the daemon was not killed by then).
. /usr/lib/interop/interop.sh

: "${TARGET_ADDR:=10.0.2.2}"
: "${ROUNDS:=3}"
: "${MAX_FILES:=400}"
[ -n "$TARGET_PORT" ] && [ -n "$TARGET_NQN" ] || fail "TARGET_PORT and TARGET_NQN are required"

# Kernel messages (I/O errors, ext4 journal aborts) would split the record lines on the console;
# the new ones are printed in blocks between steps instead (dmesg is left intact for /init).
echo 1 >/proc/sys/kernel/printk
kmsg_seen=$(dmesg | wc -l)
kmsg() {
    dmesg >/tmp/kmsg
    tail -n +$((kmsg_seen + 1)) /tmp/kmsg | sed 's/^/kmsg: /'
    kmsg_seen=$(wc -l </tmp/kmsg)
}

# busybox sh runs its own applets first (it has a mke2fs): e2fsprogs by full path.
mnt=/mnt/fs
mkdir -p "$mnt"
step modprobe ext4

# connect: a controller that gives up 3 s after losing its target, so that the host abandons
# the disk instead of waiting for it; retried until the (restarted) daemon answers.
connect() {
    i=0
    until nvme connect -t tcp -a "$TARGET_ADDR" -s "$TARGET_PORT" -n "$TARGET_NQN" \
        --reconnect-delay=1 --ctrl-loss-tmo=3 --keep-alive-tmo=5 >/tmp/connect.out 2>&1; do
        i=$((i + 1))
        [ $i -lt 120 ] || fail "cannot connect to $TARGET_NQN: $(cat /tmp/connect.out)"
        sleep 1
    done
    dev=$(nvme_wait_ns "$TARGET_NQN" 1) || fail "namespace 1 of $TARGET_NQN did not appear"
    ctrl=$(nvme_ctrl_for "$TARGET_NQN")
    log "connected: $ctrl, $dev"
}

# workload ROUND: new files of 4-64 KiB of random data, each written and fsynced with its
# directory, plus a file that is never fsynced; stops at the first error (the daemon is gone).
workload() {
    n=0
    while [ $n -lt "$MAX_FILES" ]; do
        n=$((n + 1))
        name=r$1-f$n
        blocks=$((($(od -An -N1 -tu1 /dev/urandom) % 16) + 1))
        dd if=/dev/urandom of=/tmp/data bs=4k count=$blocks 2>/dev/null || fail "dd urandom"
        sum=$(md5sum </tmp/data | cut -d' ' -f1)
        dd if=/tmp/data of="$mnt/data/$name" bs=4k conv=fsync 2>/dev/null || return 0
        sync "$mnt/data" 2>/dev/null || return 0
        echo "FSYNCED $1 $name $sum"
        dd if=/dev/urandom of="$mnt/scratch/$name" bs=4k count=2 2>/dev/null || return 0
    done
    fail "round $1: $MAX_FILES files written and the daemon is still serving"
}

# abandon ROUND: wait for the host to drop the controller, then unmount what is left.
abandon() {
    i=0
    while [ -e "/sys/class/nvme/$ctrl" ]; do
        i=$((i + 1))
        [ $i -lt 600 ] || fail "controller $ctrl was not removed after the daemon went away"
        sleep 0.2
    done
    umount -l "$mnt" || fail "umount -l $mnt"
    kmsg
    log "controller $ctrl removed, filesystem detached"
    echo "HOST-ABANDONED $1"
}

# recover ROUND: fresh controller, journal replay, fsck, and the list of files.
recover() {
    connect
    step mount -t ext4 "$dev" "$mnt"
    step umount "$mnt"
    echo "+ e2fsck -fn $dev"
    /usr/sbin/e2fsck -fn "$dev" >/tmp/fsck.out 2>&1
    rc=$?
    sed 's/^/e2fsck: /' /tmp/fsck.out
    [ $rc -eq 0 ] || fail "round $1: e2fsck -fn exited with $rc after the journal replay"
    echo "FSCK-CLEAN $1"
    step mount -t ext4 "$dev" "$mnt"
    for f in "$mnt"/data/*; do
        [ -f "$f" ] || continue
        echo "FOUND $1 ${f##*/} $(md5sum <"$f" | cut -d' ' -f1)"
    done
    kmsg
    echo "RECOVERED $1"
}

connect
step /usr/sbin/mke2fs -t ext4 -q -F "$dev"
step mount -t ext4 "$dev" "$mnt"
mkdir -p "$mnt/data" "$mnt/scratch" && sync "$mnt" "$mnt/data" "$mnt/scratch" ||
    fail "cannot create directories"
round=1
while :; do
    # Files from earlier rounds are kept; the scratch files are not checked.
    echo "WORKLOAD-START $round"
    workload $round
    log "round $round: an fsync failed (the daemon is gone)"
    abandon $round
    recover $round
    [ $round -lt "$ROUNDS" ] || break
    round=$((round + 1))
done
step umount "$mnt"
step nvme disconnect -n "$TARGET_NQN"
log "PASS: ext4 consistent and every fsynced file intact after $ROUNDS power cuts"
