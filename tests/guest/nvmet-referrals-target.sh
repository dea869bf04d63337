#!/bin/sh
# The Linux kernel NVMe/TCP target (nvmet) with discovery referrals, for an initiator outside
# the guest (tests/tests/kernel_target_referrals.rs): subsystem NQN_A on port 1 (4420) and
# NQN_B on port 2 (4421); port 1 refers to 127.0.0.1:FWD_B and port 2 back to 127.0.0.1:FWD_A
# (the host's forwards to 4420 and 4421: a referral loop, as the host sees it). Prints
# NVMET-READY and serves until `guest.sh stop`.
. /usr/lib/interop/interop.sh

for v in NQN_A NQN_B FWD_A FWD_B; do
    eval "[ -n \"\$$v\" ]" || fail "$v is required"
done
grep -q '^nvmet_tcp ' /proc/modules || step modprobe nvmet_tcp
i=1
for nqn in "$NQN_A" "$NQN_B"; do
    nvmet_subsystem "$nqn"
    nvmet_namespace "$nqn" 1 "$(nvmet_backing file 8 "$i")"
    nvmet_port "$i" tcp 0.0.0.0 $((4419 + i))
    nvmet_link "$i" "$nqn"
    i=$((i + 1))
done

# nvmet_referral PORTID NAME TRADDR TRSVCID: a referral entry in the port's discovery log.
nvmet_referral() {
    r=$NVMET_CFS/ports/$1/referrals/$2
    mkdir "$r" || fail "cannot create referral $2 of port $1"
    echo tcp >"$r/addr_trtype"
    echo ipv4 >"$r/addr_adrfam"
    echo "$3" >"$r/addr_traddr"
    echo "$4" >"$r/addr_trsvcid"
    echo 1 >"$r/enable" || fail "cannot enable referral $2"
}
nvmet_referral 1 to-b 127.0.0.1 "$FWD_B"
nvmet_referral 2 to-a 127.0.0.1 "$FWD_A"
serve_until_stop NVMET-READY
nvmet_clear
log "target stopped"
