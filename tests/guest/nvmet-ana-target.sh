#!/bin/sh
# The Linux kernel NVMe/TCP target (nvmet) serving one subsystem on two ports in different ANA
# states, for our initiator's multipath outside the guest (tests/tests/kernel_target_ana.rs):
# port 1 (4420) optimized, port 2 (4421) non-optimized (ANA group 1 on each port). Prints
# NVMET-READY. Once the host has a controller on each port, port 1 is made inaccessible
# (ANA-INACCESSIBLE); once the host connects a third controller (its sign that it saw the
# change), port 1 is optimized again (ANA-OPTIMIZED). Then serves until `guest.sh stop`.
#
# Environment: NVMET_NQN.
. /usr/lib/interop/interop.sh

[ -n "$NVMET_NQN" ] || fail "NVMET_NQN is required"
grep -q '^nvmet_tcp ' /proc/modules || step modprobe nvmet_tcp

nvmet_subsystem "$NVMET_NQN"
nvmet_namespace "$NVMET_NQN" 1 "$(nvmet_backing file 32 1)"
nvmet_port 1 tcp 0.0.0.0 4420
nvmet_port 2 tcp 0.0.0.0 4421
ana_state() {
    echo "$2" >"$NVMET_CFS/ports/$1/ana_groups/1/ana_state" ||
        fail "cannot set port $1's ANA group 1 $2"
    log "port $1: ANA group 1 $(cat "$NVMET_CFS/ports/$1/ana_groups/1/ana_state")"
}
ana_state 2 non-optimized
nvmet_link 1 "$NVMET_NQN"
nvmet_link 2 "$NVMET_NQN"

# The I/O controllers created for the subsystem so far (the kernel logs each).
controllers() { dmesg | grep -ci "controller [0-9]* for subsystem $NVMET_NQN"; }
wait_controllers() {
    i=0
    while [ "$(controllers)" -lt "$1" ]; do
        i=$((i + 1))
        [ "$i" -lt 3000 ] || fail "the host did not connect $1 controllers"
        sleep 0.2
    done
}

echo NVMET-READY
wait_controllers 2
ana_state 1 inaccessible
echo ANA-INACCESSIBLE
wait_controllers 3
ana_state 1 optimized
echo ANA-OPTIMIZED
serve_until_stop NVMET-SERVING

echo "--- target log"
dmesg | grep -E 'nvmet|nvme' || true
nvmet_clear
log "target stopped"
