#!/usr/bin/env python3
"""G6: memory an NVMe/TCP target spends per idle connection.

Opens N controllers (admin queue: ICReq, Fabrics Connect; then one I/O queue each) against a
target on this machine, leaves them idle, and reports the growth of the target's resident set
(VmRSS from /proc) per connection. Works against any NVMe/TCP target whose PID is given.

    benches/scripts/idle-connections.py --pid $(pidof nvmeof-targetd) [--addr 127.0.0.1:4420]
        [--nqn NQN] [--controllers 32 | --count N] [--half-open N] [--sources K]
        [--check-host] [--kato-ms MS]

At scale (--count 100000), spread the connections over K loopback source addresses
(127.0.0.1 .. 127.0.0.K: one address has about 28,000 ephemeral ports), raise the target's
open files limit and its connection limits (--max-connections, --max-connections-per-listener),
and give a KATO long enough to finish (--kato-ms 600000). The script raises its own open files
limit. --check-host then reads 4 KiB from namespace 1 on a fresh controller while every
connection stays open: the target still serves a correct host.

Keep alive: connections ask for a 120 s KATO and send nothing, so measure within that time.
With --half-open N it opens N connections that send an ICReq and then nothing (never a
Connect) instead, and reports what each costs until the target's handshake timeout (5 s by
default) closes them: measure within that time (--settle 1).
"""
import argparse
import itertools
import resource
import socket
import struct
import time
import uuid

DEFAULT_NQN = "nqn.2026-11.io.nvmeof-direct:default"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:" + str(uuid.uuid4())


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def recv_exact(s, n):
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise RuntimeError("connection closed by the target")
        out += chunk
    return out


SOURCES = itertools.cycle([None])
KATO_MS = 120_000


def connect(addr):
    src = next(SOURCES)
    if src is None:
        return socket.create_connection(addr, timeout=10)
    return socket.create_connection(addr, timeout=10, source_address=(src, 0))


def open_queue(addr, nqn, qid, cntlid, hostid):
    s = connect(addr)
    # ICReq: common header (type 0, hlen 128, plen 128), pfv 0, hpda 0, no digests, maxr2t 0.
    icreq = struct.pack("<BBBBIHBBI", 0x00, 0, 128, 0, 128, 0, 0, 0, 0).ljust(128, b"\0")
    s.sendall(icreq)
    icresp = recv_exact(s, 128)
    if icresp[0] != 0x01:
        raise RuntimeError(f"expected ICResp, got PDU type {icresp[0]:#x}")
    # Fabrics Connect (opcode 0x7f, fctype 0x01) with 1024 bytes of in-capsule data.
    sqe = bytearray(64)
    sqe[0] = 0x7F
    sqe[1] = 0x40  # PSDT: SGL
    struct.pack_into("<H", sqe, 2, 1)  # command id
    # SGL: data block, offset subtype (in-capsule), length 1024.
    struct.pack_into("<QI", sqe, 24, 0, 1024)
    sqe[39] = 0x01
    sqe[4] = 0x01  # fctype Connect
    struct.pack_into("<HH", sqe, 40, 0, qid)  # recfmt, qid
    struct.pack_into("<H", sqe, 44, 31)  # sqsize (0's based)
    struct.pack_into("<I", sqe, 48, KATO_MS if qid == 0 else 0)  # kato ms
    data = bytearray(1024)
    data[0:16] = hostid
    struct.pack_into("<H", data, 16, cntlid)
    data[256:256 + len(nqn)] = nqn.encode()
    data[512:512 + len(HOSTNQN)] = HOSTNQN.encode()
    hdr = struct.pack("<BBBBI", 0x04, 0, 72, 72, 72 + 1024)
    s.sendall(hdr + bytes(sqe) + bytes(data))
    resp = recv_exact(s, 24)
    cqe = resp[8:24]
    dw0 = struct.unpack_from("<I", cqe, 0)[0]
    status = struct.unpack_from("<H", cqe, 14)[0] >> 1
    if status != 0:
        raise RuntimeError(f"Connect qid {qid} failed: status {status:#x}")
    return s, dw0 & 0xFFFF


def enable(s):
    """Property Set CC (EN, IOSQES 6, IOCQES 4), then Number of Queues: as a host does."""
    sqe = bytearray(64)
    sqe[0] = 0x7F
    sqe[1] = 0x40
    struct.pack_into("<H", sqe, 2, 2)
    sqe[4] = 0x00  # fctype Property Set
    sqe[40] = 0  # 4-byte property
    struct.pack_into("<IQ", sqe, 44, 0x14, 0x00460001)
    s.sendall(struct.pack("<BBBBI", 0x04, 0, 72, 0, 72) + bytes(sqe))
    cqe = recv_exact(s, 24)[8:24]
    if struct.unpack_from("<H", cqe, 14)[0] >> 1:
        raise RuntimeError("Property Set CC failed")
    time.sleep(0.01)
    # Set Features Number of Queues: one I/O queue pair (0's based counts in CDW11).
    sqe = bytearray(64)
    sqe[0] = 0x09
    struct.pack_into("<H", sqe, 2, 3)
    struct.pack_into("<II", sqe, 40, 0x07, 0)
    s.sendall(struct.pack("<BBBBI", 0x04, 0, 72, 0, 72) + bytes(sqe))
    cqe = recv_exact(s, 24)[8:24]
    if struct.unpack_from("<H", cqe, 14)[0] >> 1:
        raise RuntimeError("Set Features Number of Queues failed")


def half_open(addr):
    """A connection that sends an ICReq, reads the ICResp, and stalls."""
    s = connect(addr)
    s.sendall(struct.pack("<BBBBIHBBI", 0x00, 0, 128, 0, 128, 0, 0, 0, 0).ljust(128, b"\0"))
    if recv_exact(s, 128)[0] != 0x01:
        raise RuntimeError("expected ICResp")
    return s


def read_4k(io):
    """Reads 4 KiB from namespace 1 (which must have 4096-byte blocks) on an I/O queue;
    returns the completion status (0: success) and the data bytes received."""
    sqe = bytearray(64)
    sqe[0] = 0x02  # Read
    sqe[1] = 0x40  # PSDT: SGL
    struct.pack_into("<HI", sqe, 2, 7, 1)  # command id, NSID 1
    struct.pack_into("<QI", sqe, 24, 0, 4096)  # SGL: transport data block, 4096 bytes
    sqe[39] = 0x5A
    io.sendall(struct.pack("<BBBBI", 0x04, 0, 72, 0, 72) + bytes(sqe))
    got = 0
    while True:
        hdr = recv_exact(io, 8)
        plen = struct.unpack_from("<I", hdr, 4)[0]
        body = recv_exact(io, plen - 8)
        if hdr[0] == 0x07:  # C2HData: the payload starts at PDO
            got += plen - hdr[3]
        elif hdr[0] == 0x05:  # CapsuleResp
            return struct.unpack_from("<H", body, 14)[0] >> 1, got
        else:
            raise RuntimeError(f"unexpected PDU type {hdr[0]:#x}")


def main():
    global SOURCES, KATO_MS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pid", type=int, required=True, help="the target's process ID")
    ap.add_argument("--addr", default="127.0.0.1:4420")
    ap.add_argument("--nqn", default=DEFAULT_NQN)
    ap.add_argument("--controllers", type=int, default=32,
                    help="controllers to open, each an admin and an I/O queue (default 32)")
    ap.add_argument("--count", type=int, default=0,
                    help="connections to open (controllers = COUNT / 2); overrides --controllers")
    ap.add_argument("--sources", type=int, default=0,
                    help="spread connections over 127.0.0.1 .. 127.0.0.SOURCES (default: any)")
    ap.add_argument("--kato-ms", type=int, default=120_000, help="keep alive timeout asked for")
    ap.add_argument("--check-host", action="store_true",
                    help="then read 4 KiB on a fresh controller with every connection open")
    ap.add_argument("--half-open", type=int, default=0,
                    help="open this many connections that stop after the ICReq instead")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds to wait before reading RSS")
    a = ap.parse_args()
    if a.count:
        a.controllers = a.count // 2
    if a.sources:
        SOURCES = itertools.cycle([f"127.0.0.{i}" for i in range(1, a.sources + 1)])
    KATO_MS = a.kato_ms
    want = max(a.controllers * 2, a.half_open) + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(hard, want)))
        except (ValueError, OSError) as e:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            print(f"cannot raise the open files limit to {want} ({e}): at most {hard} files")
    host, port = a.addr.rsplit(":", 1)
    addr = (host, int(port))
    before = rss_kib(a.pid)
    conns = []
    hostid = uuid.uuid4().bytes
    for _ in range(a.half_open):
        conns.append(half_open(addr))
    started = time.monotonic()
    try:
        for i in range(0 if a.half_open else a.controllers):
            admin, cntlid = open_queue(addr, a.nqn, 0, 0xFFFF, hostid)
            enable(admin)
            io, _ = open_queue(addr, a.nqn, 1, cntlid, hostid)
            conns += [admin, io]
            if (i + 1) % 10000 == 0:
                print(f"{len(conns)} connections after {time.monotonic() - started:.0f} s, "
                      f"target rss {rss_kib(a.pid)} KiB", flush=True)
    except (OSError, RuntimeError) as e:
        print(f"stopped after {len(conns)} connections: {e}")
    time.sleep(a.settle)
    after = rss_kib(a.pid)
    n = len(conns)
    print(f"connections {n}  rss before {before} KiB  after {after} KiB  "
          f"per connection {(after - before) / max(n, 1):.1f} KiB")
    if a.check_host:
        admin, cntlid = open_queue(addr, a.nqn, 0, 0xFFFF, hostid)
        enable(admin)
        io, _ = open_queue(addr, a.nqn, 1, cntlid, hostid)
        status, got = read_4k(io)
        print(f"correct host with {n} connections open: read status {status:#x}, {got} bytes")
        admin.close()
        io.close()
    for c in conns:
        c.close()


if __name__ == "__main__":
    main()
