#!/bin/sh
# The Linux 6.12 kernel NVMe/TCP host against an nvmeof-targetd listener that requires TLS 1.3
# with a PSK (tls = "required", the host's tls_psk from `nvme gen-tls-key`). Run by
# tests/tests/kernel_host_tls.rs through tests/interop/guest.sh --kernel 612: the configured
# PSK goes into the .nvme keyring with `nvme check-tls-key --insert`, tlshd does the kernel's
# handshake, `nvme connect --tls` runs fio with verify over two I/O queues; a plain connect to
# the TLS listener and a TLS connect with another key under the same identity are refused.
#
# Environment: TARGET_PORT, TARGET_NQN, TLS_HOSTNQN, TLS_HOSTID, TLS_PSK, WRONG_PSK (required);
#   FIO_SIZE (default 2M).
. /usr/lib/interop/interop.sh

: "${TARGET_ADDR:=10.0.2.2}" "${FIO_SIZE:=2M}"
for v in TARGET_PORT TARGET_NQN TLS_HOSTNQN TLS_HOSTID TLS_PSK WRONG_PSK; do
    eval "[ -n \"\$$v\" ]" || fail "$v is required"
done
ARGS="-t tcp -a $TARGET_ADDR -s $TARGET_PORT -n $TARGET_NQN --hostnqn=$TLS_HOSTNQN --hostid=$TLS_HOSTID --nr-io-queues=2"

# insert KEY: puts the configured PSK's TLS PSK for the pair into the .nvme keyring.
insert() {
    step nvme check-tls-key --hostnqn="$TLS_HOSTNQN" --subsysnqn="$TARGET_NQN" --keydata="$1" --insert
    grep -F "$TARGET_NQN" /proc/keys || fail "the PSK is not in a keyring"
}

tlshd_start

insert "$TLS_PSK"

log "=== plain TCP to the TLS listener (must be refused)"
# shellcheck disable=SC2086
if nvme connect $ARGS; then
    fail "a plain connect to the TLS listener succeeded"
fi
[ -z "$(nvme_ctrl_for "$TARGET_NQN")" ] || fail "a controller is left after the refusal"
log "refused as expected: plain TCP"

log "=== TLS with the configured PSK"
# shellcheck disable=SC2086
step nvme connect $ARGS --tls
dev=$(nvme_wait_ns "$TARGET_NQN" 1) || fail "namespace 1 of $TARGET_NQN did not appear"
ctrl_dev=$(nvme_ctrl_for "$TARGET_NQN")
nq=$(cat "/sys/class/nvme/$ctrl_dev/queue_count")
[ "$nq" -eq 3 ] || fail "expected 2 I/O queues, found $((nq - 1))"
tls_key=$(cat "/sys/class/nvme/$ctrl_dev/tls_key" 2>/dev/null) || fail "$ctrl_dev has no tls_key"
[ -n "$tls_key" ] || fail "$ctrl_dev did not negotiate TLS"
log "$ctrl_dev uses TLS key $tls_key"
fio_verify "$dev" "$FIO_SIZE"
step nvme disconnect -n "$TARGET_NQN"
[ -z "$(nvme_ctrl_for "$TARGET_NQN")" ] || fail "controller still present after disconnect"

log "=== TLS with another PSK under the same identity (must be refused)"
insert "$WRONG_PSK"
# shellcheck disable=SC2086
if nvme connect $ARGS --tls; then
    fail "a TLS connect with the wrong PSK succeeded"
fi
[ -z "$(nvme_ctrl_for "$TARGET_NQN")" ] || fail "a controller is left after the refusal"
log "refused as expected: wrong PSK"

tlshd_stop
log "PASS: kernel host TLS against nvmeof-targetd"
