#!/bin/sh
# Linux 6.12 guest only (guest.sh --kernel 612): the kernel NVMe/TCP target and the kernel
# NVMe/TCP host of the same guest, over 127.0.0.1, with the security features 6.1 lacks.
#
# 1. DH-HMAC-CHAP: nvmet requires bidirectional authentication of this host (keys from
#    `nvme gen-dhchap-key`, set in configfs); `nvme connect --dhchap-secret --dhchap-ctrl-secret`
#    authenticates and moves data; a wrong host key, a wrong controller key and no key at all are
#    refused.
# 2. TLS 1.3 with a retained PSK: `nvme gen-tls-key`, `nvme check-tls-key --insert` puts it in
#    the .nvme keyring, tlshd does the kernel's handshakes (both ends), the nvmet port requires
#    TLS (addr_tsas tls1.3); `nvme connect --tls` moves data, a plain connect is refused.
#
#   tests/interop/guest.sh run --kernel 612 tests/interop/guest-scripts/nvmet-tcp-auth-tls.sh
#
# Environment (optional): NVMET_PORT (default 4420; TLS uses NVMET_PORT + 1), NVMET_NQN.
# shellcheck source=../guest-lib/interop.sh
. /usr/lib/interop/interop.sh

: "${NVMET_PORT:=4420}" "${NVMET_NQN:=nqn.2014-08.org.nvmexpress:nvmf-interop-auth}"
ADDR=127.0.0.1
TLS_PORT=$((NVMET_PORT + 1))
TLS_NQN=$NVMET_NQN-tls
HOSTNQN=$(cat /etc/nvme/hostnqn)

# connect_and_check NQN PORT WHAT [nvme connect options...]: connects, writes 1 MiB through
# the namespace and reads it back, prints the controller name in CTRL.
connect_and_check() {
    nqn=$1 port=$2 what=$3
    shift 3
    step nvme connect -t tcp -a "$ADDR" -s "$port" -n "$nqn" "$@"
    dev=$(nvme_wait_ns "$nqn" 1) || fail "$what: namespace 1 of $nqn did not appear"
    CTRL=$(nvme_ctrl_for "$nqn")
    [ -n "$CTRL" ] || fail "$what: no controller for $nqn"
    head -c 1048576 /dev/urandom >/tmp/pattern
    dd if=/tmp/pattern of="$dev" bs=64k oflag=direct 2>/dev/null || fail "$what: write to $dev failed"
    dd if="$dev" of=/tmp/readback bs=64k count=16 iflag=direct 2>/dev/null || fail "$what: read of $dev failed"
    cmp /tmp/pattern /tmp/readback || fail "$what: data read back differs from what was written"
    log "$what: $CTRL ($dev) wrote and read back 1 MiB"
}

disconnect() {
    step nvme disconnect -n "$1"
    [ -z "$(nvme_ctrl_for "$1")" ] || fail "controller of $1 still present after disconnect"
}

# refused NQN PORT WHAT KMSG [nvme connect options...]: the connect must fail, leave no
# controller and make the kernel log KMSG (empty: anything).
refused() {
    nqn=$1 port=$2 what=$3 want=$4
    shift 4
    echo "+ nvme connect -t tcp -a $ADDR -s $port -n $nqn $* (must be refused: $what)"
    mark=$(dmesg | wc -l)
    if out=$(nvme connect -t tcp -a "$ADDR" -s "$port" -n "$nqn" "$@" 2>&1); then
        echo "$out"
        fail "$what: connect succeeded"
    fi
    echo "$out"
    kmsg=$(dmesg | tail -n +$((mark + 1)))
    echo "$kmsg" | sed 's/^/  kmsg: /'
    expect_contains "$kmsg" "$want" "$what: kernel log"
    [ -z "$(nvme_ctrl_for "$nqn")" ] || fail "$what: a controller for $nqn is present"
    log "refused as expected: $what"
}

# ---------------------------------------------------------------------------------------------
# 1. DH-HMAC-CHAP
# ---------------------------------------------------------------------------------------------
log "=== DH-HMAC-CHAP"
host_key=$(nvme gen-dhchap-key --hmac=1 --nqn="$HOSTNQN") || fail "nvme gen-dhchap-key failed"
ctrl_key=$(nvme gen-dhchap-key --hmac=1 --nqn="$NVMET_NQN") || fail "nvme gen-dhchap-key failed"
wrong_key=$(nvme gen-dhchap-key --hmac=1 --nqn="$HOSTNQN") || fail "nvme gen-dhchap-key failed"
for k in "$host_key" "$ctrl_key" "$wrong_key"; do
    expect_contains "$k" "DHHC-1:01:" "gen-dhchap-key output"
done
log "host key $host_key, controller key $ctrl_key"

nvmet_subsystem "$NVMET_NQN" "$HOSTNQN"
h=$NVMET_CFS/hosts/$HOSTNQN
echo "$host_key" >"$h/dhchap_key" || fail "cannot set dhchap_key"
echo "$ctrl_key" >"$h/dhchap_ctrl_key" || fail "cannot set dhchap_ctrl_key"
echo "hmac(sha256)" >"$h/dhchap_hash" || fail "cannot set dhchap_hash"
echo ffdhe2048 >"$h/dhchap_dhgroup" || fail "cannot set dhchap_dhgroup"
nvmet_namespace "$NVMET_NQN" 1 "$(nvmet_backing file 16 1)"
nvmet_port 1 tcp "$ADDR" "$NVMET_PORT"
nvmet_link 1 "$NVMET_NQN"

dmesg_mark=$(dmesg | wc -l)
connect_and_check "$NVMET_NQN" "$NVMET_PORT" "DH-HMAC-CHAP" \
    --dhchap-secret="$host_key" --dhchap-ctrl-secret="$ctrl_key"
kmsg=$(dmesg | tail -n +$((dmesg_mark + 1)))
echo "$kmsg" | grep -i 'authenticated'
expect_contains "$kmsg" "qid 0: authenticated with hash hmac(sha256) dhgroup ffdhe2048" "host kernel log"
expect_contains "$kmsg" "qid 0: controller authenticated" "host kernel log"
disconnect "$NVMET_NQN"

# The target rejects the host's response, the host rejects the controller's.
refused "$NVMET_NQN" "$NVMET_PORT" "wrong host key" "qid 0 host response mismatch" \
    --dhchap-secret="$wrong_key" --dhchap-ctrl-secret="$ctrl_key"
refused "$NVMET_NQN" "$NVMET_PORT" "wrong controller key" "qid 0: controller authentication failed" \
    --dhchap-secret="$host_key" --dhchap-ctrl-secret="$wrong_key"
# The controller requires authentication and the host has no secret (ENOKEY).
refused "$NVMET_NQN" "$NVMET_PORT" "no key" "qid 0: no key"
log "PASS: DH-HMAC-CHAP between the kernel host and the kernel target"

# ---------------------------------------------------------------------------------------------
# 2. TLS
# ---------------------------------------------------------------------------------------------
log "=== TLS"
out=$(nvme gen-tls-key --hmac=1 --hostnqn="$HOSTNQN" --subsysnqn="$TLS_NQN") ||
    fail "nvme gen-tls-key failed"
psk=$(echo "$out" | grep -o 'NVMeTLSkey-1:01:[^ ]*:' | head -n 1)
[ -n "$psk" ] || fail "no NVMeTLSkey-1:01 key in gen-tls-key's output: $out"
step nvme check-tls-key --hostnqn="$HOSTNQN" --subsysnqn="$TLS_NQN" --keydata="$psk" --insert
keys=$(grep -F "$TLS_NQN" /proc/keys) || fail "the PSK is not in a keyring: $(cat /proc/keys)"
echo "$keys"

tlshd_start

nvmet_subsystem "$TLS_NQN"
nvmet_namespace "$TLS_NQN" 1 "$(nvmet_backing file 16 2)"
nvmet_port 2 tcp "$ADDR" "$TLS_PORT"
echo tls1.3 >"$NVMET_CFS/ports/2/addr_tsas" || fail "cannot require TLS 1.3 on port 2"
log "port 2: addr_tsas $(cat "$NVMET_CFS/ports/2/addr_tsas"), addr_treq $(cat "$NVMET_CFS/ports/2/addr_treq")"
nvmet_link 2 "$TLS_NQN"

# The target hands the connection to tlshd, whose handshake fails on the ICReq, and closes it.
refused "$TLS_NQN" "$TLS_PORT" "plain TCP to a port that requires TLS" "failed to receive icresp"
connect_and_check "$TLS_NQN" "$TLS_PORT" "TLS" --tls
tls_key=$(cat "/sys/class/nvme/$CTRL/tls_key" 2>/dev/null) || fail "$CTRL has no tls_key attribute"
log "$CTRL uses TLS key $tls_key"
[ -n "$tls_key" ] || fail "$CTRL did not negotiate TLS"
disconnect "$TLS_NQN"

tlshd_stop
nvmet_clear
log "PASS: TLS between the kernel host and the kernel target"
