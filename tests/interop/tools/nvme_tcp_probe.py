#!/usr/bin/env python3
"""Checks that an NVMe/TCP endpoint answers an ICReq with a valid ICResp.

    nvme_tcp_probe.py [--host 127.0.0.1] --port PORT [--hdr-digest] [--data-digest]
                      [--timeout SECS] [--retry-for SECS]

Sends one 128-byte ICReq (NVMe/TCP transport spec, PDU type 0x00) and validates the ICResp the
way the Linux host does: type 0x01, hlen 128, plen 128, pfv 0, cpda 0, digest bits equal to
the request, maxh2cdata >= 4096 and a multiple of 4. Prints the decoded fields; exits 0 when
valid, 1 when not, 2 when no connection/answer could be had.
"""

import argparse
import socket
import struct
import sys
import time

ICREQ = 0x00
ICRESP = 0x01
HDGST = 0x01
DDGST = 0x02


def icreq(hdr_digest: bool, data_digest: bool) -> bytes:
    dgst = (HDGST if hdr_digest else 0) | (DDGST if data_digest else 0)
    # common header: type, flags, hlen, pdo, plen
    ch = struct.pack("<BBBBI", ICREQ, 0, 128, 0, 128)
    # pfv (u16), hpda (u8), dgst (u8), maxr2t (u32, 0's based)
    body = struct.pack("<HBBI", 0, 0, dgst, 0)
    pdu = ch + body + bytes(128 - len(ch) - len(body))
    assert len(pdu) == 128
    return pdu


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def probe(host: str, port: int, hdr: bool, data: bool, timeout: float) -> bytes:
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(icreq(hdr, data))
        return recv_exact(sock, 128)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--hdr-digest", action="store_true")
    ap.add_argument("--data-digest", action="store_true")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--retry-for", type=float, default=0.0,
                    help="keep retrying connection failures and empty answers this long")
    args = ap.parse_args()

    deadline = time.monotonic() + args.retry_for
    while True:
        try:
            resp = probe(args.host, args.port, args.hdr_digest, args.data_digest, args.timeout)
            if len(resp) == 128 or time.monotonic() >= deadline:
                break
            err = f"short answer ({len(resp)} bytes)"
        except OSError as e:
            err = str(e)
            resp = None
            if time.monotonic() >= deadline:
                break
        print(f"probe: {err}; retrying", file=sys.stderr)
        time.sleep(0.5)

    if resp is None:
        print(f"FAIL: {args.host}:{args.port}: {err}")
        return 2
    if len(resp) < 8:
        print(f"FAIL: {args.host}:{args.port}: connection closed after {len(resp)} bytes "
              "(nothing listening in the guest?)")
        return 2

    ptype, flags, hlen, pdo, plen = struct.unpack_from("<BBBBI", resp, 0)
    problems = []
    if ptype != ICRESP:
        problems.append(f"pdu type 0x{ptype:02x}, expected 0x01 (ICResp)")
    if len(resp) != 128:
        problems.append(f"only {len(resp)} of 128 bytes received")
    fields = {"type": ptype, "flags": flags, "hlen": hlen, "pdo": pdo, "plen": plen}
    if len(resp) == 128:
        pfv, cpda, dgst, maxh2cdata = struct.unpack_from("<HBBI", resp, 8)
        fields.update(pfv=pfv, cpda=cpda, dgst=dgst, maxh2cdata=maxh2cdata)
        want = (HDGST if args.hdr_digest else 0) | (DDGST if args.data_digest else 0)
        if hlen != 128:
            problems.append(f"hlen {hlen}, expected 128")
        if plen != 128:
            problems.append(f"plen {plen}, expected 128")
        if pfv != 0:
            problems.append(f"pfv {pfv}, expected 0")
        if cpda != 0:
            problems.append(f"cpda {cpda}, the Linux host accepts only 0")
        if dgst != want:
            problems.append(f"digest bits {dgst:#x}, requested {want:#x}")
        if maxh2cdata < 4096 or maxh2cdata % 4:
            problems.append(f"maxh2cdata {maxh2cdata} is < 4096 or not a multiple of 4")
    print("ICResp " + " ".join(f"{k}={v}" for k, v in fields.items()))
    if problems:
        for p in problems:
            print(f"FAIL: {p}")
        return 1
    print(f"OK: {args.host}:{args.port} answered ICReq with a valid ICResp")
    return 0


if __name__ == "__main__":
    sys.exit(main())
