#!/usr/bin/env bash
# End-to-end checks of the interop harness with kernel peers only (no project code involved):
#
#   harness    guest.sh reports the script's exit code, a timeout (124) and a kernel panic (125)
#   loopback   kernel NVMe/TCP target + kernel host in one guest: discover, connect, list,
#              id-ctrl, fio verify, disconnect; without and with header+data digests
#   icreq      guest as background target behind hostfwd; the host sends ICReq (with and
#              without digests) and checks the ICResp; guest.sh stop
#   two-guests kernel host in one guest -> host 127.0.0.1 -> hostfwd -> kernel target in another
#              guest (the path the project's target tests use, with the kernel in both roles)
#   soft-roce  rdma_rxe, `rdma link add`, ibv_devinfo, rping, NVMe/RDMA host<->target over rxe
#   nvme-pcie  QEMU's emulated NVMe PCIe controller: nvme driver, then vfio-pci behind a vIOMMU
#   k612       the 6.12 guest: kernel target + kernel host with DH-HMAC-CHAP (wrong keys
#              refused), then TLS 1.3 through tlshd (plain TCP refused); skipped unless the
#              6.12 guest is prepared (setup.sh --with-k612)
#
#   tests/interop/selftest.sh [NAME...]     (default: all; run setup.sh first)
# shellcheck disable=SC2317  # test functions are called through "$t"
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
G=$HERE/guest.sh
S=$HERE/guest-scripts
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

declare -a RESULTS=()
FAILED=0

# check NAME EXPECTED_RC CMD...: runs CMD, compares its exit code, records the duration.
check() {
    local name=$1 want=$2 t0 rc
    shift 2
    echo "=== $name" >&2
    t0=$SECONDS
    "$@"
    rc=$?
    if [[ $rc == "$want" ]]; then
        RESULTS+=("PASS  $name ($((SECONDS - t0)) s)")
    else
        RESULTS+=("FAIL  $name: exit code $rc, expected $want ($((SECONDS - t0)) s)")
        FAILED=1
    fi
}

harness() {
    printf 'echo "exit code test"\nexit 7\n' >"$TMP/exit7.sh"
    printf 'echo "sleeping past the timeout"\nsleep 600\n' >"$TMP/hang.sh"
    printf 'echo c >/proc/sysrq-trigger\nsleep 30\n' >"$TMP/panic.sh"
    cat >"$TMP/env.sh" <<'SCRIPT'
[ "$A" = 'x y' ] && [ "$B" = "it's \$HOME" ] || { echo "env: A=$A B=$B"; exit 1; }
SCRIPT
    # Routing only: lookups, no packets sent.
    cat >"$TMP/routes.sh" <<'SCRIPT'
r=$(ip route)
echo "routes: $r"
[ "$(echo "$r" | tr -s ' ' | sed 's/ *$//')" = "10.0.2.2 dev eth0 scope link" ] || exit 1
ip route get 10.0.2.2 || exit 1
! ip route get 10.0.2.3 2>/dev/null || exit 1
! ip route get 192.0.2.1 2>/dev/null || exit 1
grep -q ' 10.0.2.15/24 ' /proc/net/fib_trie 2>/dev/null || ip addr show eth0 | grep -q 'inet 10.0.2.15/24' || exit 1
[ -s /etc/nvme/hostnqn ] && [ -s /etc/nvme/hostid ] || exit 1
grep -q "^nqn.2014-08.org.nvmexpress:uuid:$(cat /etc/nvme/hostid)$" /etc/nvme/hostnqn || exit 1
SCRIPT
    check "harness: guest routes and NVMe host identity" 0 "$G" run --no-nvme-cli "$TMP/routes.sh"
    check "harness: exit code" 7 "$G" run --no-nvme-cli "$TMP/exit7.sh"
    check "harness: --env quoting" 0 "$G" run --no-nvme-cli --env "A=x y" --env "B=it's \$HOME" "$TMP/env.sh"
    check "harness: timeout" 124 "$G" run --no-nvme-cli --timeout 15 "$TMP/hang.sh"
    check "harness: kernel panic" 125 "$G" run --no-nvme-cli "$TMP/panic.sh"
}

loopback() {
    check "loopback: kernel nvmet-tcp <-> kernel host, fio verify, digests" 0 \
        "$G" run --with-fio --env NVMET_PORT=4420 --env NVMET_NQN=nqn.2014-08.org.nvmexpress:selftest \
        "$S/nvmet-tcp-loopback.sh"
}

icreq_case() {
    local port pidfile rc=0
    port=$("$G" free-port) || return 2
    pidfile=$("$G" start --ready-marker NVMET-READY --hostfwd "$port:4420" \
        --env NVMET_NQN=nqn.2014-08.org.nvmexpress:icreq --log "$TMP/icreq.log" \
        "$S/nvmet-target.sh") || return 1
    python3 "$HERE/tools/nvme_tcp_probe.py" --port "$port" || rc=1
    python3 "$HERE/tools/nvme_tcp_probe.py" --port "$port" --hdr-digest --data-digest || rc=1
    "$G" stop "$pidfile" || rc=1
    return "$rc"
}

icreq() {
    check "icreq: guest target behind hostfwd answers ICReq" 0 icreq_case
}

two_guests_case() {
    local port pidfile rc=0 nqn=nqn.2014-08.org.nvmexpress:two-guests
    port=$("$G" free-port) || return 2
    pidfile=$("$G" start --ready-marker NVMET-READY --hostfwd "$port:4420" \
        --env NVMET_NQN="$nqn" --env NVMET_BACKEND=brd --log "$TMP/target.log" \
        "$S/nvmet-target.sh") || return 1
    "$G" run --with-fio --env TARGET_PORT="$port" --env TARGET_NQN="$nqn" --env DIGESTS=both \
        "$S/kernel-host-tcp.sh" || rc=1
    "$G" stop "$pidfile" || rc=1
    grep -a 'nvmet: creating nvm controller' "$TMP/target.log" || rc=1
    return "$rc"
}

two_guests() {
    check "two-guests: kernel host -> hostfwd -> kernel target" 0 two_guests_case
}

soft_roce() {
    check "soft-roce: rxe, rdma link, rping, NVMe/RDMA fio verify" 0 \
        "$G" run --with-rdma --with-fio "$S/soft-roce.sh"
}

nvme_pcie() {
    truncate -s 64M "$TMP/nvme.img"
    check "nvme-pcie: emulated controller, nvme driver, vfio-pci" 0 \
        "$G" run --nvme-disk "$TMP/nvme.img" "$S/nvme-pcie-vfio.sh"
}

k612() {
    if ! grep -q '^INTEROP_K612_KERNEL_IMAGE=' "${INTEROP_CACHE:-$HERE/.cache}/guest.env" 2>/dev/null; then
        RESULTS+=("SKIP  k612: the 6.12 guest is not prepared (setup.sh --with-k612)")
        return
    fi
    check "k612: DH-HMAC-CHAP and TLS, kernel host <-> kernel target" 0 \
        "$G" run --kernel 612 --fail-on-kernel-trace "$S/nvmet-tcp-auth-tls.sh"
}

ALL=(harness loopback icreq two_guests soft_roce nvme_pcie k612)
if [[ $# -gt 0 ]]; then
    SEL=("${@//-/_}")
else
    SEL=("${ALL[@]}")
fi
T0=$SECONDS
for t in "${SEL[@]}"; do
    if [[ " ${ALL[*]} " != *" $t "* ]]; then
        echo "selftest: unknown test $t (${ALL[*]})" >&2
        exit 2
    fi
    "$t"
done

echo
echo "interop selftest ($((SECONDS - T0)) s):"
printf '  %s\n' "${RESULTS[@]}"
exit $FAILED
