#!/bin/sh
# The Linux kernel NVMe/TCP host (nvme-cli) follows the discovery referrals of nvmeof-targetd:
# `nvme discover` lists the referral entry, `nvme connect-all` reads the referred discovery
# controller too and connects to the subsystems of both targets. Run by
# tests/tests/kernel_host_referrals.rs through tests/interop/guest.sh.
#
# Environment (required): TARGET_ADDR (an address of the host both targets listen on),
# PORT_A, NQN_A (the target asked first; it refers to the other), PORT_B, NQN_B.
. /usr/lib/interop/interop.sh

for v in TARGET_ADDR PORT_A NQN_A PORT_B NQN_B; do
    eval "[ -n \"\$$v\" ]" || fail "$v is required"
done

# The guest routes to 10.0.2.2 only: the targets' address goes through QEMU's NAT as well.
step ip route add "$TARGET_ADDR/32" via 10.0.2.2 dev eth0

out=$(nvme discover -t tcp -a "$TARGET_ADDR" -s "$PORT_A") || fail "nvme discover failed: $out"
echo "$out"
expect_contains "$out" "subnqn:  $NQN_A" "discovery log of the first target"
expect_contains "$out" "subtype: discovery subsystem referral" "referral entry"
expect_contains "$out" "trsvcid: $PORT_B" "referral entry's port"

step nvme connect-all -t tcp -a "$TARGET_ADDR" -s "$PORT_A"
nvme_wait_ns "$NQN_A" 1 >/dev/null || fail "no namespace of $NQN_A after connect-all"
nvme_wait_ns "$NQN_B" 1 >/dev/null || fail "no namespace of $NQN_B: the referral was not followed"
out=$(nvme list-subsys) || fail "nvme list-subsys failed"
echo "$out"
expect_contains "$out" "$NQN_A" "list-subsys"
expect_contains "$out" "$NQN_B" "list-subsys"
step nvme disconnect-all
echo "PASS: kernel host follows referrals"
