#!/bin/sh
# Avahi sees the mDNS advertisement of nvmeof-targetd: dbus-daemon and avahi-daemon run in the
# guest next to nvmeof-targetd (`[discovery] mdns = true`); `avahi-browse -rtp _nvme-disc._tcp`
# resolves the discovery listener with its TXT keys (nqn=, p=), `nvmeof discover --mdns` reads
# it, and once the target stops (goodbye, TTL 0) Avahi no longer lists it. Run by
# tests/tests/mdns.rs through tests/interop/guest.sh --with-avahi, with nvmeof-targetd and
# nvmeof added by --add-bin.
. /usr/lib/interop/interop.sh

DPORT=8009
DISC_NQN=nqn.2014-08.org.nvmexpress.discovery
NQN=nqn.2026-11.io.nvmeof-direct:mdns-guest

# Multicast leaves through eth0 (the guest routes to 10.0.2.2 only).
step ip route add 224.0.0.0/4 dev eth0

mkdir -p /run/dbus /run/avahi-daemon
# avahi-daemon looks its user up even when it keeps root.
echo 'avahi:x:104:108::/run/avahi-daemon:/bin/false' >>/etc/passwd
echo 'avahi:x:108:' >>/etc/group
cat >/tmp/dbus.conf <<'CONF'
<busconfig>
  <type>system</type>
  <listen>unix:path=/run/dbus/system_bus_socket</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_destination="*"/>
    <allow receive_sender="*"/>
  </policy>
</busconfig>
CONF
step dbus-daemon --config-file=/tmp/dbus.conf --fork --nopidfile
cat >/tmp/avahi.conf <<'CONF'
[server]
use-ipv4=yes
use-ipv6=no
allow-interfaces=eth0
[publish]
publish-workstation=no
CONF
avahi-daemon -f /tmp/avahi.conf --no-drop-root --no-chroot --no-rlimits >/tmp/avahi.log 2>&1 &
i=0
until grep -q "Server startup complete" /tmp/avahi.log; do
    [ $i -lt 100 ] || { cat /tmp/avahi.log; fail "avahi-daemon did not start"; }
    sleep 0.2
    i=$((i + 1))
done

cat >/tmp/target.toml <<CONF
[[listener]]
address = "tcp://0.0.0.0:4420"

[discovery]
listen = ["tcp://0.0.0.0:$DPORT"]
mdns = true

[[subsystem]]
nqn = "$NQN"
allow_any_host = true

[[subsystem.namespace]]
backend = "mem:1M"
CONF
nvmeof-targetd --config /tmp/target.toml --control-socket /tmp/ctl.sock >/tmp/target.log 2>&1 &
tpid=$!
i=0
until grep -q "nvmeof-targetd ready" /tmp/target.log || [ $i -ge 100 ]; do
    sleep 0.2
    i=$((i + 1))
done
grep -E "mDNS|ready" /tmp/target.log

# Resolved by Avahi: instance, host, address, port and TXT keys.
i=0
while :; do
    out=$(avahi-browse -rtp _nvme-disc._tcp 2>&1)
    case "$out" in *"=;eth0;IPv4;"*";$DPORT;"*) break ;; esac
    [ $i -lt 10 ] || { echo "$out"; fail "avahi-browse did not resolve the discovery listener"; }
    sleep 1
    i=$((i + 1))
done
echo "$out"
expect_contains "$out" "\"nqn=$DISC_NQN\"" "TXT nqn"
expect_contains "$out" "\"p=tcp\"" "TXT p"
expect_contains "$out" ";$GUEST_IP;$DPORT;" "address and port"

out=$(nvmeof discover --mdns --hostnqn nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000aa --state-dir /tmp/cli 2>&1) ||
    { echo "$out"; fail "nvmeof discover --mdns failed"; }
echo "$out" | grep -E "^Discovery controller|subnqn"
expect_contains "$out" "subnqn:  $NQN" "nvmeof discover --mdns"

# Stopped, the target says goodbye: Avahi forgets the service.
step kill -TERM "$tpid"
wait "$tpid"
i=0
while avahi-browse -tp _nvme-disc._tcp 2>&1 | grep -q "nvmeof-"; do
    [ $i -lt 10 ] || fail "avahi-browse still lists the service after the target stopped"
    sleep 1
    i=$((i + 1))
done
grep -E "mDNS|shutdown complete" /tmp/target.log
echo "PASS: avahi sees the mDNS advertisement"
