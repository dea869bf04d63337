#!/usr/bin/env python3
"""A correct host's read latency while other connections flood the target with AUTH_Negotiate.

A correct host (an allowed host NQN without a key) reads 4 KiB at queue depth 1 from an I/O
queue, first alone, then while FLOODERS processes, each on its own admin queue of a host
NQN that has a DH-HMAC-CHAP key, send AUTH_Negotiate (SHA-256, ffdhe8192 only) and read the
answer over and over without ever replying (reconnecting when the handshake timeout closes
the connection): every Challenge costs the target one ffdhe8192 key pair. Prints the host's latency percentiles in both phases and what the flooders got
(Challenges, Failure1 refusals).

    benches/scripts/auth-flood.py --addr 127.0.0.1:4420 --nqn NQN --host GOOD_NQN \\
        --flood-host KEYED_NQN [--flooders 2] [--reads 5000]

The target's namespace 1 must have 4096-byte blocks.
"""
import argparse
import multiprocessing as mp
import socket
import struct
import time
import uuid


def recv_exact(s, n):
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise RuntimeError("connection closed by the target")
        out += chunk
    return bytes(out)


def recv_pdu(s):
    hdr = recv_exact(s, 8)
    plen = struct.unpack_from("<I", hdr, 4)[0]
    return hdr[0], hdr + recv_exact(s, plen - 8)


def command(s, sqe, icd=b""):
    """Sends a capsule; returns (status, data received before the CapsuleResp)."""
    hlen = 72
    s.sendall(struct.pack("<BBBBI", 0x04, 0, hlen, hlen if icd else 0, hlen + len(icd))
              + bytes(sqe) + icd)
    data = b""
    while True:
        kind, pdu = recv_pdu(s)
        if kind == 0x07:  # C2HData: header 24 bytes, data after PDO
            pdo = pdu[3]
            data += pdu[pdo:]
        elif kind == 0x05:  # CapsuleResp
            cqe = pdu[8:24]
            return struct.unpack_from("<H", cqe, 14)[0] >> 1, data
        else:
            raise RuntimeError(f"unexpected PDU type {kind:#x}")


def open_queue(addr, nqn, hostnqn, qid, cntlid, hostid):
    s = socket.create_connection(addr, timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(struct.pack("<BBBBIHBBI", 0x00, 0, 128, 0, 128, 0, 0, 0, 0).ljust(128, b"\0"))
    if recv_exact(s, 128)[0] != 0x01:
        raise RuntimeError("expected ICResp")
    sqe = bytearray(64)
    sqe[0], sqe[1], sqe[4] = 0x7F, 0x40, 0x01
    struct.pack_into("<H", sqe, 2, 1)
    struct.pack_into("<QI", sqe, 24, 0, 1024)
    sqe[39] = 0x01
    struct.pack_into("<HHHBxI", sqe, 40, 0, qid, 31, 0, 120_000 if qid == 0 else 0)
    data = bytearray(1024)
    data[0:16] = hostid
    struct.pack_into("<H", data, 16, cntlid)
    data[256:256 + len(nqn)] = nqn.encode()
    data[512:512 + len(hostnqn)] = hostnqn.encode()
    status, _ = command(s, sqe, bytes(data))
    if status:
        raise RuntimeError(f"Connect qid {qid} failed: status {status:#x}")
    return s


def enable(s):
    sqe = bytearray(64)
    sqe[0], sqe[1], sqe[4] = 0x7F, 0x40, 0x00
    struct.pack_into("<H", sqe, 2, 2)
    struct.pack_into("<IQ", sqe, 44, 0x14, 0x00460001)
    if command(s, sqe)[0]:
        raise RuntimeError("Property Set CC failed")
    time.sleep(0.05)
    sqe = bytearray(64)
    sqe[0] = 0x09
    struct.pack_into("<H", sqe, 2, 3)
    struct.pack_into("<II", sqe, 40, 0x07, 0)
    if command(s, sqe)[0]:
        raise RuntimeError("Set Features Number of Queues failed")


def negotiate_msg(t_id):
    hdr = struct.pack("<BBxxHBB", 0x00, 0x00, t_id, 0, 1)
    desc = bytearray(64)
    desc[0], desc[2], desc[3] = 0x01, 1, 1
    desc[4] = 0x01  # SHA-256
    desc[4 + 30] = 0x05  # ffdhe8192
    return hdr + bytes(desc)


def auth_sqe(cid, send, length):
    sqe = bytearray(64)
    sqe[0], sqe[1] = 0x7F, 0x40
    struct.pack_into("<H", sqe, 2, cid)
    sqe[4] = 0x05 if send else 0x06
    sqe[40:44] = bytes([0, 0x01, 0x01, 0xE9])
    struct.pack_into("<I", sqe, 44, length)
    struct.pack_into("<QI", sqe, 24, 0, length)
    sqe[39] = 0x01 if send else 0x5A
    return sqe


def flooder(addr, nqn, hostnqn, stop, counts):
    """Negotiates over and over; reconnects when the target closes the connection (its
    handshake timeout runs until the queue authenticates, which it never does)."""
    s = None
    t_id = 0
    while not stop.is_set():
        t_id = (t_id + 1) & 0xFFFF
        msg = negotiate_msg(t_id)
        try:
            if s is None:
                s = open_queue(addr, nqn, hostnqn, 0, 0xFFFF, uuid.uuid4().bytes)
            command(s, auth_sqe(t_id, True, len(msg)), msg)
            status, data = command(s, auth_sqe(t_id, False, 4096))
        except (RuntimeError, OSError):
            if s is not None:
                s.close()
            s = None
            continue
        with counts.get_lock():
            if status == 0 and data[1:2] == b"\x01":
                counts[0] += 1
            elif status == 0 and data[1:2] == b"\xf1":
                counts[1] += 1
            else:
                counts[2] += 1


def read_latencies(io, n):
    sqe = bytearray(64)
    sqe[0], sqe[1] = 0x02, 0x40
    struct.pack_into("<I", sqe, 4, 1)
    struct.pack_into("<QI", sqe, 24, 0, 4096)
    sqe[39] = 0x5A
    out = []
    for i in range(n):
        struct.pack_into("<H", sqe, 2, i & 0xFFFF)
        struct.pack_into("<QI", sqe, 40, i % 1024, 0)
        t0 = time.perf_counter_ns()
        status, data = command(io, sqe)
        out.append(time.perf_counter_ns() - t0)
        if status or len(data) != 4096:
            raise RuntimeError(f"read failed: status {status:#x}, {len(data)} bytes")
    return sorted(out)


def pct(v, p):
    return v[min(len(v) - 1, int(len(v) * p / 100))] / 1e6


def report(name, v):
    print(f"{name:>10}: reads {len(v)}  p50 {pct(v, 50):.3f} ms  p99 {pct(v, 99):.3f} ms  "
          f"p99.9 {pct(v, 99.9):.3f} ms  max {v[-1] / 1e6:.3f} ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--addr", default="127.0.0.1:4420")
    ap.add_argument("--nqn", required=True)
    ap.add_argument("--host", required=True, help="the correct host's NQN (no key)")
    ap.add_argument("--flood-host", required=True, help="a host NQN that has a key")
    ap.add_argument("--flooders", type=int, default=2)
    ap.add_argument("--reads", type=int, default=5000)
    a = ap.parse_args()
    host, port = a.addr.rsplit(":", 1)
    addr = (host, int(port))
    hostid = uuid.uuid4().bytes
    admin = open_queue(addr, a.nqn, a.host, 0, 0xFFFF, hostid)
    enable(admin)
    # The controller ID is not needed by the target's checks beyond matching: ask for it.
    sqe = bytearray(64)
    sqe[0], sqe[1] = 0x06, 0x40
    struct.pack_into("<H", sqe, 2, 4)
    struct.pack_into("<QI", sqe, 24, 0, 4096)
    sqe[39] = 0x5A
    struct.pack_into("<I", sqe, 40, 1)
    status, ident = command(admin, sqe)
    if status:
        raise RuntimeError("Identify failed")
    cntlid = struct.unpack_from("<H", ident, 78)[0]
    io = open_queue(addr, a.nqn, a.host, 1, cntlid, hostid)
    read_latencies(io, 500)  # warm-up
    alone = read_latencies(io, a.reads)
    stop = mp.Event()
    counts = mp.Array("q", 3)
    procs = [mp.Process(target=flooder, args=(addr, a.nqn, a.flood_host, stop, counts))
             for _ in range(a.flooders)]
    for p in procs:
        p.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    flooded = read_latencies(io, a.reads)
    secs = time.monotonic() - t0
    stop.set()
    for p in procs:
        p.join(timeout=30)
    report("alone", alone)
    report("flooded", flooded)
    print(f"flood: {a.flooders} connections, {counts[0]} Challenges, {counts[1]} refusals "
          f"(Failure1), {counts[2]} other, over {secs + 1.0:.1f} s")
    print(f"p99 flooded / alone: {pct(flooded, 99) / pct(alone, 99):.2f}")


if __name__ == "__main__":
    main()
