#!/bin/sh
# The Linux kernel NVMe/TCP host against an nvmeof-targetd subsystem that requires DH-HMAC-CHAP
# for some hosts ([[subsystem.host]] tables). Run by tests/tests/kernel_host_auth.rs through
# tests/interop/guest.sh: with the 6.12 guest (nvme-cli passes --dhchap-secret and
# --dhchap-ctrl-secret, the kernel authenticates the admin queue and each I/O queue) and with
# the 6.1 guest (built without NVMe authentication: it must be refused cleanly).
#
# Environment: TARGET_PORT, TARGET_NQN (required);
#   AUTH_OK      space-separated NQN|HOSTID|KEY|CTRLKEY: connect (2 I/O queues), fio verify,
#                disconnect (CTRLKEY "-": one-way authentication);
#   AUTH_REFUSED space-separated NQN|HOSTID|KEY|CTRLKEY that nvme connect must fail for (KEY
#                "-": no secret given);
#   REAUTH       1: after the first AUTH_OK connect, ask for re-authentication through sysfs;
#   PLAIN        1: finally connect as the guest's own host NQN (no authentication), fio verify;
#   FIO_SIZE     per connection (default 2M).
. /usr/lib/interop/interop.sh

: "${TARGET_ADDR:=10.0.2.2}" "${FIO_SIZE:=2M}"
[ -n "$TARGET_PORT" ] && [ -n "$TARGET_NQN" ] || fail "TARGET_PORT and TARGET_NQN are required"

# connect_args NQN HOSTID KEY CTRLKEY: sets "$@" for nvme connect.
connect_args() {
    nqn=$1 id=$2 key=$3 ctrl=$4
    set -- -t tcp -a "$TARGET_ADDR" -s "$TARGET_PORT" -n "$TARGET_NQN" --nr-io-queues=2 \
        --hostnqn="$nqn" --hostid="$id"
    [ "$key" = - ] || set -- "$@" --dhchap-secret="$key"
    [ "$ctrl" = - ] || set -- "$@" --dhchap-ctrl-secret="$ctrl"
    ARGS="$*"
}

split() { echo "$1" | tr '|' ' '; }

for c in $AUTH_REFUSED; do
    # shellcheck disable=SC2046
    connect_args $(split "$c")
    log "=== refused: $nqn (secret: $( [ "$key" = - ] && echo none || echo given ), controller secret: $( [ "$ctrl" = - ] && echo none || echo given ))"
    # shellcheck disable=SC2086
    if nvme connect $ARGS; then
        fail "nvme connect as $nqn succeeded; it must be refused"
    fi
    [ -z "$(nvme_ctrl_for "$TARGET_NQN")" ] || fail "a controller is left after the refusal"
    log "refused as expected"
done

first=1
for c in $AUTH_OK; do
    # shellcheck disable=SC2046
    connect_args $(split "$c")
    log "=== authenticated: $nqn (controller secret: $( [ "$ctrl" = - ] && echo none || echo given ))"
    # shellcheck disable=SC2086
    step nvme connect $ARGS
    dev=$(nvme_wait_ns "$TARGET_NQN" 1) || fail "namespace 1 of $TARGET_NQN did not appear"
    ctrl_dev=$(nvme_ctrl_for "$TARGET_NQN")
    nq=$(cat "/sys/class/nvme/$ctrl_dev/queue_count")
    [ "$nq" -eq 3 ] || fail "expected 2 I/O queues, found $((nq - 1))"
    fio_verify "$dev" "$FIO_SIZE"
    if [ "$first" = 1 ] && [ "${REAUTH:-0}" = 1 ]; then
        log "=== re-authentication of $ctrl_dev"
        echo "$key" >"/sys/class/nvme/$ctrl_dev/dhchap_secret" || fail "cannot write dhchap_secret"
        sleep 3
        dd if="$dev" of=/dev/null bs=4096 count=64 iflag=direct 2>/dev/null ||
            fail "reads fail after re-authentication"
        log "REAUTH done"
    fi
    first=0
    step nvme disconnect -n "$TARGET_NQN"
    [ -z "$(nvme_ctrl_for "$TARGET_NQN")" ] || fail "controller still present after disconnect"
done

if [ "${PLAIN:-0}" = 1 ]; then
    log "=== a host without authentication ($(cat /etc/nvme/hostnqn))"
    step nvme connect -t tcp -a "$TARGET_ADDR" -s "$TARGET_PORT" -n "$TARGET_NQN" --nr-io-queues=2
    dev=$(nvme_wait_ns "$TARGET_NQN" 1) || fail "namespace 1 of $TARGET_NQN did not appear"
    fio_verify "$dev" "$FIO_SIZE"
    step nvme disconnect -n "$TARGET_NQN"
fi
log "PASS: kernel host DH-HMAC-CHAP against nvmeof-targetd"
