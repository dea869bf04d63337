#!/bin/sh
# The nvmeof-direct initiator over NVMe/RDMA (Soft-RoCE rxe0 on eth0), against two real
# targets in the guest, one after the other:
#   1. the Linux kernel target (nvmet-rdma, brd namespace), then
#   2. nvmeof-targetd listening on rdma://GUEST_IP:OUR_PORT (memory namespace).
# Against each: `nvmeof discover -t rdma` (RDMA discovery entry fields), `connect`, `id-ctrl`,
# `id-ns`,
# the verify example (concurrent writes on every I/O queue, a transfer above MDTS, in-capsule
# writes, everything read back and compared, queue counters checked; a transfer above MDTS
# written from and read back into memory registered once with the controller's protection
# domain, the counters showing that no command of it used a slot buffer, and a read into it
# dropped in flight keeping it busy until its commands end; GPU request rings driven by the
# CPU stand-in, each ring read landing in its registered slot by RDMA WRITE; a run-to-completion
# queue pair whose command buffers are registered once, not per command), and a CLI write + read
# of a random file compared with cmp. Against the kernel target, the port's subsystem link is
# then removed and restored while the verify example keeps reads going: the initiator must
# notice, reconnect and complete the reads (a queue pair opened before the break too, on its
# own new connection). nvmeof-targetd is stopped (SIGSTOP) with a read in
# flight: the read must time out, and the initiator reconnect once it continues. Run by tests/tests/initiator_rdma.rs; by hand:
#   cargo build -p nvmeof-initiator --bins --example verify && cargo build -p nvmeof-target --bins
#   tests/interop/guest.sh run --with-rdma --add-bin target/debug/nvmeof:/usr/bin/nvmeof \
#       --add-bin target/debug/examples/verify:/usr/bin/nvmeof-verify \
#       --add-bin target/debug/nvmeof-targetd:/usr/bin/nvmeof-targetd tests/guest/initiator-rdma.sh
#
# With /usr/bin/nvmeof-initd present, an attachment (`nvmeof attach -t rdma`, `list`, `read
# NAME`, `detach`) is checked against each target; with /usr/bin/nvmeof-bench present, its
# --quick job also runs in modes rdma and tcp against nvmeof-targetd (reads verified).
#
# With AUTH_NQN, AUTH_HOSTID, AUTH_KEY and AUTH_CTRL_KEY, nvmeof-targetd also requires that host to
# authenticate both ways (DH-HMAC-CHAP): `nvmeof probe` with the secrets over NVMe/RDMA, then a
# wrong secret refused in one line.
#
# Environment: QUEUES (3), KERNEL_PORT (4420), OUR_PORT (4421), CLI_MB (3), AUTH_* (above).
# shellcheck source=../interop/guest-lib/interop.sh
. /usr/lib/interop/interop.sh

: "${QUEUES:=3}" "${KERNEL_PORT:=4420}" "${OUR_PORT:=4421}" "${CLI_MB:=3}"
KNQN=nqn.2014-08.org.nvmexpress:nvmeof-direct-initiator-rdma
ONQN=nqn.2026-11.io.nvmeof-direct:initiator-rdma
NVMEOF=/usr/bin/nvmeof
VERIFY=/usr/bin/nvmeof-verify
TARGETD=/usr/bin/nvmeof-targetd
BENCH=/usr/bin/nvmeof-bench
INITD=/usr/bin/nvmeof-initd
addr=${GUEST_IP:-10.0.2.15}
tlog=/tmp/nvmeof-targetd.log

for b in "$NVMEOF" "$VERIFY" "$TARGETD"; do
    [ -x "$b" ] || fail "$b missing (guest.sh --add-bin)"
done
command -v rdma >/dev/null || fail "rdma tool missing (guest.sh --with-rdma)"

# Without an RDMA device the initiator must say so in one line.
out=$("$NVMEOF" discover -t rdma -a "$addr" -s "$KERNEL_PORT" 2>&1) && fail "discover without RDMA succeeded: $out"
echo "$out"
expect_contains "$out" "NVMe/RDMA" "error without an RDMA device"
[ "$(echo "$out" | wc -l)" -eq 1 ] || fail "the error is not one line: $out"

step modprobe crc32_generic
step modprobe rdma_rxe
step modprobe ib_uverbs
step modprobe rdma_ucm
step rdma link add rxe0 type rxe netdev eth0
i=0
until rdma link show rxe0/1 | grep -q 'state ACTIVE'; do
    i=$((i + 1))
    [ $i -lt 50 ] || fail "rxe0/1 did not become ACTIVE: $(rdma link show rxe0/1)"
    sleep 0.1
done
log "rxe0 ACTIVE on eth0 ($addr)"

# Nothing listens on this port: a one-line error, not a hang.
out=$("$NVMEOF" discover -t rdma -a "$addr" -s 4999 2>&1) && fail "discover with no listener succeeded: $out"
echo "$out"
[ "$(echo "$out" | wc -l)" -eq 1 ] || fail "the error is not one line: $out"
expect_contains "$out" "rdma://$addr:4999" "error with no listener"
expect_contains "$out" "does an NVMe/RDMA target listen there?" "error with no listener"

step dd if=/dev/urandom of=/tmp/pattern bs=1M count="$CLI_MB"

# check_target NAME PORT NQN: the whole initiator sequence against one target.
check_target() {
    name=$1
    port=$2
    nqn=$3
    fab="-t rdma -a $addr --trsvcid $port"
    log "=== $name: discovery"
    # shellcheck disable=SC2086
    out=$("$NVMEOF" discover $fab 2>&1) || fail "$name: nvmeof discover -t rdma failed: $out"
    echo "$out"
    expect_contains "$out" "trtype:  rdma" "$name discovery log"
    expect_contains "$out" "subnqn:  $nqn" "$name discovery log"
    expect_contains "$out" "traddr:  $addr" "$name discovery log"
    expect_contains "$out" "trsvcid: $port" "$name discovery log"
    expect_contains "$out" "rdma_qptype: connected" "$name discovery log"
    expect_contains "$out" "rdma_cms:    rdma-cm" "$name discovery log"

    log "=== $name: connect, id-ctrl, id-ns"
    # shellcheck disable=SC2086
    out=$("$NVMEOF" probe $fab -n "$nqn" -i 2 -o json 2>&1) || fail "$name: connect failed: $out"
    expect_contains "$out" "rdma://$addr:$port" "$name connect"
    # shellcheck disable=SC2086
    out=$("$NVMEOF" id-ctrl $fab -n "$nqn" -o json 2>&1) || fail "$name: id-ctrl failed: $out"
    expect_contains "$out" "$nqn" "$name id-ctrl"
    # shellcheck disable=SC2086
    out=$("$NVMEOF" id-ns $fab -n "$nqn" --namespace-id 1 -o json 2>&1) || fail "$name: id-ns failed: $out"
    bs=$(echo "$out" | sed -n 's/.*"block_size": *\([0-9]*\).*/\1/p')
    [ -n "$bs" ] || fail "$name: no block size in id-ns: $out"
    log "$name: block size $bs"

    log "=== $name: verify ($QUEUES I/O queues)"
    out=$("$VERIFY" "rdma://$addr:$port" "$nqn" 1 "$QUEUES" 2>&1) || fail "$name: verify failed: $out"
    echo "$out"
    expect_contains "$out" "VERIFY PASS transport=rdma queues=$QUEUES" "$name verify"
    # Registered memory: every command of that phase named the caller's buffer (no slot copy).
    expect_contains "$out" "VERIFY REGISTERED transport=rdma registered=yes" "$name registered memory"
    expect_contains "$out" "slot_commands=0" "$name registered memory"
    expect_contains "$out" "VERIFY REGISTERED-CANCELLED" "$name registered memory, dropped read"
    # A run-to-completion queue pair: its command buffers are registered once, not per command.
    expect_contains "$out" "VERIFY QUEUE-PAIR transport=rdma" "$name queue pair"
    # GPU request rings (CPU stand-in): every ring read named its registered slot.
    expect_contains "$out" "VERIFY RINGS transport=rdma" "$name GPU request rings"

    log "=== $name: CLI write and read of $CLI_MB MiB"
    count=$((CLI_MB * 1048576 / bs))
    start=$((8 * 1048576 / bs))
    # shellcheck disable=SC2086
    step "$NVMEOF" write $fab -n "$nqn" --namespace-id 1 -i 2 --start-block "$start" --data /tmp/pattern --flush
    # shellcheck disable=SC2086
    step "$NVMEOF" read $fab -n "$nqn" --namespace-id 1 -i 2 --start-block "$start" --blocks "$count" --data /tmp/readback
    cmp /tmp/pattern /tmp/readback || fail "$name: $CLI_MB MiB read back differently"
    rm -f /tmp/readback

    if [ -x "$INITD" ]; then
        log "=== $name: an nvmeof-initd attachment over rdma"
        rm -rf /tmp/initd
        mkdir -p /tmp/initd
        NVMEOF_INITD_SOCKET=/tmp/initd/sock "$INITD" --state-dir /tmp/initd/state >/tmp/initd/log 2>&1 &
        ipid=$!
        i=0
        until [ -S /tmp/initd/sock ]; do
            i=$((i + 1))
            [ $i -lt 300 ] || fail "nvmeof-initd did not start: $(cat /tmp/initd/log)"
            sleep 0.1
        done
        # shellcheck disable=SC2086
        step "$NVMEOF" attach rdma0 --socket /tmp/initd/sock $fab -n "$nqn" --namespace-id 1
        out=$("$NVMEOF" list --socket /tmp/initd/sock 2>&1) || fail "$name: nvmeof list failed: $out"
        echo "$out"
        expect_contains "$out" "rdma0" "$name nvmeof list"
        expect_contains "$out" "connected" "$name nvmeof list"
        step "$NVMEOF" read rdma0 --socket /tmp/initd/sock --start-block "$start" \
            --blocks "$count" --data /tmp/readback
        cmp /tmp/pattern /tmp/readback || fail "$name: the attachment read back differently"
        rm -f /tmp/readback
        step "$NVMEOF" detach rdma0 --socket /tmp/initd/sock
        kill -TERM "$ipid"
        wait "$ipid" || fail "nvmeof-initd exited with $?: $(cat /tmp/initd/log)"
    fi
    log "$name: PASS"
}

log "=== kernel nvmet-rdma target on $addr:$KERNEL_PORT"
NVMET_TRTYPE=rdma NVMET_TRADDR=$addr NVMET_PORT=$KERNEL_PORT NVMET_NQN=$KNQN \
    NVMET_NS_SIZE_MB=32 NVMET_BACKEND=brd NVMET_MODEL=interop-nvmet-rdma nvmet_from_env
check_target "kernel nvmet-rdma" "$KERNEL_PORT" "$KNQN"

log "=== kernel nvmet-rdma: the port goes away with reads in flight, then comes back"
"$VERIFY" "rdma://$addr:$KERNEL_PORT" "$KNQN" 1 2 reconnect >/tmp/verify.log 2>&1 &
vpid=$!
i=0
until grep -q "VERIFY WAITING-FOR-RECONNECT" /tmp/verify.log; do
    i=$((i + 1))
    kill -0 "$vpid" 2>/dev/null || {
        cat /tmp/verify.log
        fail "verify exited before the reconnect phase"
    }
    [ $i -lt 1200 ] || fail "verify did not reach the reconnect phase"
    sleep 0.1
done
step rm "$NVMET_CFS/ports/1/subsystems/$KNQN"
sleep 2
step ln -s "$NVMET_CFS/subsystems/$KNQN" "$NVMET_CFS/ports/1/subsystems/$KNQN"
wait "$vpid"
rc=$?
cat /tmp/verify.log
[ "$rc" -eq 0 ] || fail "verify across the reconnect failed ($rc)"
expect_contains "$(cat /tmp/verify.log)" "VERIFY RECONNECTED reconnects=" "verify across the reconnect"
expect_contains "$(cat /tmp/verify.log)" "VERIFY REGISTERED-ACROSS-RECONNECT" "registered memory across the reconnect"
expect_contains "$(cat /tmp/verify.log)" "VERIFY QUEUE-PAIR-ACROSS-RECONNECT" "queue pair across the reconnect"
nvmet_clear
log "PASS: initiator over NVMe/RDMA against the kernel nvmet-rdma target"

log "=== nvmeof-targetd on rdma://$addr:$OUR_PORT"
# Any host, and with AUTH_NQN/AUTH_KEY/AUTH_CTRL_KEY given one that must authenticate both ways.
cat >/tmp/targetd.toml <<EOF
[target]
reactors = 2
[[listener]]
address = "rdma://$addr:$OUR_PORT"
[[listener]]
address = "tcp://$addr:$OUR_PORT"
[[subsystem]]
nqn = "$ONQN"
allow_any_host = true
[[subsystem.namespace]]
backend = "mem:32M"
EOF
if [ -n "${AUTH_KEY:-}" ]; then
    printf '[[subsystem.host]]\nnqn = "%s"\ndhchap_key = "%s"\ndhchap_ctrl_key = "%s"\n' \
        "$AUTH_NQN" "$AUTH_KEY" "$AUTH_CTRL_KEY" >>/tmp/targetd.toml
fi
chmod 600 /tmp/targetd.toml
NVMEOF_LOG=${NVMEOF_LOG:-debug} "$TARGETD" --config /tmp/targetd.toml >"$tlog" 2>&1 &
tpid=$!
i=0
until grep -q "nvmeof-targetd ready" "$tlog"; do
    i=$((i + 1))
    kill -0 "$tpid" 2>/dev/null || {
        cat "$tlog"
        fail "nvmeof-targetd exited during start"
    }
    [ $i -lt 300 ] || fail "nvmeof-targetd did not become ready"
    sleep 0.1
done
check_target "nvmeof-targetd" "$OUR_PORT" "$ONQN"

if [ -n "${AUTH_KEY:-}" ]; then
    # Authentication Send data travels by RDMA READ of the host's buffer, Receive data by RDMA
    # WRITE, on the admin queue and each I/O queue.
    log "=== nvmeof-targetd: DH-HMAC-CHAP over NVMe/RDMA"
    afab="-t rdma -a $addr -s $OUR_PORT -n $ONQN -q $AUTH_NQN -I $AUTH_HOSTID"
    # shellcheck disable=SC2086
    step "$NVMEOF" probe $afab -i 2 --dhchap-secret "$AUTH_KEY" --dhchap-ctrl-secret "$AUTH_CTRL_KEY"
    # shellcheck disable=SC2086
    out=$("$NVMEOF" probe $afab --dhchap-secret "$AUTH_CTRL_KEY" 2>&1) && fail "a wrong key connected: $out"
    echo "$out"
    [ "$(echo "$out" | wc -l)" -eq 1 ] || fail "the error is not one line: $out"
    expect_contains "$out" "authentication of queue 0 failed" "wrong key over NVMe/RDMA"
    log "PASS: DH-HMAC-CHAP over NVMe/RDMA"
fi

log "=== nvmeof-targetd: the target stops answering (SIGSTOP) with a read in flight"
rm -f /tmp/target-stopped
"$VERIFY" "rdma://$addr:$OUR_PORT" "$ONQN" 1 2 stall /tmp/target-stopped >/tmp/verify.log 2>&1 &
vpid=$!
i=0
until grep -q "VERIFY WAITING-FOR-STALL" /tmp/verify.log; do
    i=$((i + 1))
    kill -0 "$vpid" 2>/dev/null || {
        cat /tmp/verify.log
        fail "verify exited before the stall phase"
    }
    [ $i -lt 1200 ] || fail "verify did not reach the stall phase"
    sleep 0.1
done
kill -STOP "$tpid"
touch /tmp/target-stopped
log "nvmeof-targetd stopped"
sleep 15
kill -CONT "$tpid"
log "nvmeof-targetd continued"
wait "$vpid"
rc=$?
cat /tmp/verify.log
[ "$rc" -eq 0 ] || fail "verify across the stall failed ($rc)"
expect_contains "$(cat /tmp/verify.log)" "VERIFY STALL-RECOVERED" "verify across the stall"
expect_contains "$(cat /tmp/verify.log)" "VERIFY REGISTERED-TIMEOUT-RELEASED" "registered read across the stall"
expect_contains "$(cat /tmp/verify.log)" "VERIFY QUEUE-PAIR-ACROSS-RECONNECT" "queue pair across the stall"
if [ -x "$BENCH" ]; then
    # The load generator's rdma mode beside its tcp mode, same target and namespace, reads
    # verified after --prefill (a target at an address is not written without it).
    # Soft-RoCE under emulation: this shows the path works, not its speed.
    log "=== nvmeof-targetd: nvmeof-bench --quick, modes rdma and tcp"
    out=$("$BENCH" --quick --modes "rdma=$addr:$OUR_PORT,tcp=$addr:$OUR_PORT" --nqn "$ONQN" \
        --prefill --size 8M --runtime 1s --ramp-time 0s 2>&1) || fail "nvmeof-bench failed: $out"
    echo "$out" | grep -E '^\|'
    expect_contains "$out" "| rdma@$addr:$OUR_PORT |" "nvmeof-bench rdma mode"
    log "PASS: nvmeof-bench rdma mode"
fi
kill -TERM "$tpid"
wait "$tpid"
rc=$?
echo "----- nvmeof-targetd log -----"
cat "$tlog"
echo "----- end of nvmeof-targetd log -----"
[ "$rc" -eq 0 ] || fail "nvmeof-targetd exited with $rc"
log "PASS: initiator over NVMe/RDMA against nvmeof-targetd"

step rdma link delete rxe0
log "PASS: nvmeof-direct initiator over NVMe/RDMA"
