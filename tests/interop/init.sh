#!/bin/sh
# /init of the interop test guest (busybox sh, PID 1).
#
# Mounts the pseudo file systems, loads the boot modules, configures eth0 for QEMU user-mode
# networking, generates the NVMe host identity, runs /test.sh with the variables from /env,
# prints "GUEST-EXIT <code>" on the console and powers the machine off.
# tests/interop/setup.sh packs this file into the base initramfs; guest.sh adds /test.sh and /env.

export PATH=/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root
umask 022

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
exec </dev/console >/dev/console 2>&1
mkdir -p /dev/pts /dev/shm /run /tmp /root /var/run /etc/nvme
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp

log() { echo "init: $*"; }

poweroff_now() {
    sync
    poweroff -f
    # Fallback if ACPI power-off is not available.
    echo o >/proc/sysrq-trigger
    sleep 5
}

finish() {
    printf '\nGUEST-EXIT %s\n' "$1"
    poweroff_now
}

# Boot modules, in dependency order computed when the initramfs was built.
KVER=$(uname -r)
if [ -f /etc/interop/modules.boot ]; then
    while read -r mod; do
        [ -n "$mod" ] || continue
        name=${mod##*/}
        name=${name%.ko}
        name=$(echo "$name" | tr - _)
        grep -q "^$name " /proc/modules && continue
        insmod "/lib/modules/$KVER/$mod" || log "insmod $mod failed"
    done </etc/interop/modules.boot
fi
if ! grep -q configfs /proc/mounts; then
    mount -t configfs configfs /sys/kernel/config || log "configfs mount failed"
fi

# Variables for the test script (written by guest.sh, already shell-quoted).
if [ -f /env ]; then
    set -a
    # shellcheck disable=SC1091
    . /env
    set +a
fi

# Fixed by QEMU user-mode networking; exported for the test script.
export GUEST_IP=10.0.2.15
hostname "${GUEST_HOSTNAME:-nvmf-guest}"
ip link set lo up

# QEMU user-mode networking: the guest is 10.0.2.15/24, the host's loopback is 10.0.2.2.
# The only route is a host route to 10.0.2.2 (no default route, not even the /24 one), so
# traffic to any other address (including slirp's DNS at 10.0.2.3) fails locally instead of
# leaving through QEMU's NAT.
i=0
while [ ! -e /sys/class/net/eth0 ] && [ $i -lt 100 ]; do
    sleep 0.05
    i=$((i + 1))
done
if [ -e /sys/class/net/eth0 ]; then
    ip addr add "$GUEST_IP/24" dev eth0
    ip link set eth0 up
    ip route del 10.0.2.0/24 dev eth0 2>/dev/null
    ip route add 10.0.2.2/32 dev eth0
else
    log "eth0 did not appear (virtio_net not loaded?)"
fi

# NVMe host identity: generated per boot unless given.
if [ -n "${GUEST_HOSTID:-}" ]; then
    hostid=$GUEST_HOSTID
else
    hostid=$(cat /proc/sys/kernel/random/uuid)
fi
echo "${GUEST_HOSTNQN:-nqn.2014-08.org.nvmexpress:uuid:$hostid}" >/etc/nvme/hostnqn
echo "$hostid" >/etc/nvme/hostid

if [ ! -f /test.sh ]; then
    log "no /test.sh in the initramfs"
    finish 127
fi

cd /root || cd /
# Control channel (background mode): a line "stop" on the second serial port sends SIGTERM to
# the test script, which may trap it to clean up and report. Started before the script so that
# a stop request sent right after the script's ready marker is not lost.
if [ "${GUEST_CONTROL:-0}" = 1 ] && [ -c /dev/ttyS1 ]; then
    (
        stty -F /dev/ttyS1 raw -echo 2>/dev/null
        while read -r line; do
            case "$line" in
            stop*)
                log "stop requested"
                : >/run/stop-requested
                n=0
                while [ ! -s /run/test.pid ] && [ $n -lt 100 ]; do
                    sleep 0.05
                    n=$((n + 1))
                done
                kill -TERM "$(cat /run/test.pid)" 2>/dev/null
                ;;
            esac
        done </dev/ttyS1
    ) &
    ctl_pid=$!
fi

boot_lines=$(dmesg | wc -l)
log "running /test.sh (kernel $KVER, uptime $(cut -d' ' -f1 /proc/uptime) s)"
sh /test.sh </dev/null &
test_pid=$!
echo "$test_pid" >/run/test.pid

wait "$test_pid"
code=$?
[ -n "${ctl_pid:-}" ] && kill "$ctl_pid" 2>/dev/null

# Kernel stack traces (oops, WARN, BUG, stalls) are reported; the host decides whether they fail.
traces=$(dmesg | grep -c -E 'Call Trace:|Oops|BUG:|WARNING:')
if [ "$traces" -gt 0 ]; then
    echo "init: kernel log has $traces trace/warning lines:"
    dmesg | grep -B 5 -A 30 -E 'Call Trace:|Oops|BUG:|WARNING:' | head -n 200
    printf '\nGUEST-KERNEL-TRACE %s\n' "$traces"
fi
if [ "$code" -ne 0 ]; then
    echo "init: /test.sh exited with $code; kernel messages since it started (last 60):"
    dmesg | tail -n +$((boot_lines + 1)) | tail -n 60
fi
finish "$code"
