#!/usr/bin/env python3
"""Which side of a QD1 NVMe/TCP flow holds each read, from packet timestamps.

Captures, for SECONDS, the TCP segments with a payload to and from PORT on a loopback (or any)
interface, with the kernel's transmit timestamp of each (an AF_PACKET socket with a filter
that keeps only outgoing segments of that port: no tcpdump or perf needed, root only). Then,
for every command -> answer -> next command sequence with no segment missing in between,
splits the round trip into

  target: the command's segment leaves the host -> the answer's first segment leaves the target
  host:   the answer's last segment leaves the target -> the next command's segment leaves the host

and prints the median, p90 and p99 of each, and how many segments without data (acknowledgements)
each side sent per command. Run it while one QD1 client reads (one queue, one
command in flight): with deeper queues the pairs interleave and the split means nothing.

  python3 qd1-wire.py PORT [SECONDS] [IFACE]     # default 3 s on lo

Both sides' times include their wake-up, the system calls and the kernel's TCP work up to the
transmit; the loopback's delivery to the peer is counted in the sender's send system call,
so it falls between a segment's timestamp and the peer's receive.
"""

import ctypes
import socket
import struct
import sys
import time

ETH_P_ALL = 0x0003
SO_ATTACH_FILTER = 26
SO_TIMESTAMPNS = 35
PACKET_OUTGOING = 4


def port_filter(port):
    """Classic BPF: outgoing IPv4 TCP segments, unfragmented, with source or destination
    `port`; the first 128 bytes of each."""
    drop, accept = 13, 14
    prog = [
        (0x20, 0, 0, 0xFFFFF004),  # ld pkttype
        (0x15, 0, drop - 2, PACKET_OUTGOING),
        (0x28, 0, 0, 12),  # ldh ethertype
        (0x15, 0, drop - 4, 0x0800),
        (0x30, 0, 0, 23),  # ldb ip protocol
        (0x15, 0, drop - 6, 6),
        (0x28, 0, 0, 20),  # ldh fragment offset
        (0x45, drop - 8, 0, 0x1FFF),
        (0xB1, 0, 0, 14),  # ldx 4 * (ip[0] & 0xf)
        (0x48, 0, 0, 14),  # ldh tcp source port
        (0x15, accept - 11, 0, port),
        (0x48, 0, 0, 16),  # ldh tcp destination port
        (0x15, accept - 13, drop - 13, port),
        (0x06, 0, 0, 0),  # drop
        (0x06, 0, 0, 128),  # accept 128 bytes
    ]
    code = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(code)
    fprog = struct.pack("HL", len(prog), ctypes.addressof(buf))
    return buf, fprog


def capture(port, seconds, iface):
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    program, fprog = port_filter(port)
    s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
    del program  # the kernel copied it
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    s.bind((iface, 0))
    s.settimeout(0.2)
    # Segments queued before the filter was attached may be of any kind: each is checked.
    end = time.monotonic() + seconds
    out = []
    acks = [0, 0]  # segments without payload: from the target, from the host
    anc = socket.CMSG_SPACE(16)
    while time.monotonic() < end:
        try:
            data, cmsgs, _, _ = s.recvmsg(128, anc)
        except socket.timeout:
            continue
        ts = None
        for level, kind, cdata in cmsgs:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                sec, nsec = struct.unpack("qq", cdata[:16])
                ts = sec * 1_000_000_000 + nsec
        if ts is None or len(data) < 14 + 20 + 20:
            continue
        ip = data[14:]
        if ip[0] >> 4 != 4 or ip[9] != 6:
            continue
        ihl = (ip[0] & 0xF) * 4
        total = struct.unpack("!H", ip[2:4])[0]
        tcp = ip[ihl:]
        dport, seq = struct.unpack("!HI", tcp[2:8])
        doff = (tcp[12] >> 4) * 4
        payload = total - ihl - doff
        if payload <= 0:
            acks[dport == port] += 1
            continue
        out.append((ts, dport == port, seq, payload))
    return out, acks


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]


def split(segments):
    """(target, host) time pairs in µs from command/answer/command sequences with no gap in
    either direction's sequence numbers."""
    # Merge consecutive segments of one direction that continue each other (an answer may
    # leave in more than one segment).
    runs = []
    for ts, to_target, seq, n in segments:
        if runs and runs[-1][0] == to_target and runs[-1][4] == seq:
            r = runs[-1]
            runs[-1] = (to_target, r[1], ts, r[3], seq + n)
        else:
            runs.append((to_target, ts, ts, seq, seq + n))
    target, host = [], []
    for a, b, c in zip(runs, runs[1:], runs[2:]):
        if not (a[0] and not b[0] and c[0]):
            continue
        if c[3] != a[4]:
            continue  # a command between them was not captured
        target.append((b[1] - a[2]) / 1000)
        host.append((c[1] - b[2]) / 1000)
    return target, host


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    port = int(sys.argv[1])
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 3.0
    iface = sys.argv[3] if len(sys.argv) > 3 else "lo"
    segs, acks = capture(port, seconds, iface)
    target, host = split(segs)
    if not target:
        sys.exit(f"no command/answer/command sequence among {len(segs)} segments")
    rtt = [t + h for t, h in zip(target, host)]
    commands = sum(1 for s in segs if s[1])
    print(
        f"{len(segs)} segments with data, {len(target)} round trips; segments without data "
        f"per command: from the host {acks[1] / max(commands, 1):.2f}, from the target "
        f"{acks[0] / max(commands, 1):.2f}"
    )
    for name, xs in (("target", target), ("host", host), ("round trip", rtt)):
        print(
            f"  {name:<11} p50 {pct(xs, 0.5):6.2f}  p90 {pct(xs, 0.9):6.2f}  "
            f"p99 {pct(xs, 0.99):6.2f} us"
        )


if __name__ == "__main__":
    main()
