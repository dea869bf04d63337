"""Loopback TCP into GPU memory, the most a staged NVMe/TCP read path can move.

    python3 benches/scripts/tcp-gpu-ceiling.py [STREAMS] [SECONDS]

STREAMS sender/receiver process pairs (default 8) move 1 MiB messages over 127.0.0.1, senders
pinned to cores [0, STREAMS), receivers to [STREAMS, 2*STREAMS), as the raw loopback ceiling
does. Two rows: `host`, each receiver reads into plain memory; `gpu`, each receiver reads into
pinned host memory (two 1 MiB buffers used in turn) and copies every message to device memory
with an asynchronous copy, waiting (without spinning) for a buffer's previous copy before it
reads into it again. The `gpu` row is what loopback TCP plus one copy to the GPU per byte can
move with these cores: no NVMe/TCP, no PDU parsing. Needs CuPy for the `gpu` row.
"""
import multiprocessing as mp
import os
import socket
import sys
import time

MSG = 1 << 20


def sender(port, cpu, secs):
    os.sched_setaffinity(0, {cpu})
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(os.urandom(MSG)))
    end = time.time() + secs
    while time.time() < end:
        s.sendall(buf)
    s.close()


def receiver(ls, cpu, q, gpu):
    os.sched_setaffinity(0, {cpu})
    if gpu:
        import cupy
        import numpy

        cupy.cuda.Device(0).use()
        pinned = [cupy.cuda.alloc_pinned_memory(MSG) for _ in range(2)]
        host = [numpy.frombuffer(p, dtype=numpy.uint8, count=MSG) for p in pinned]
        dev = cupy.empty(MSG, dtype=cupy.uint8)
        stream = cupy.cuda.Stream(non_blocking=True)
        events = [None, None]
        bufs = [memoryview(h) for h in host]
    else:
        bufs = [memoryview(bytearray(MSG)) for _ in range(2)]
    c, _ = ls.accept()
    n, t0, i = 0, None, 0
    while True:
        if gpu and events[i] is not None:
            events[i].synchronize()
        got = 0
        while got < MSG:
            k = c.recv_into(bufs[i][got:])
            if not k:
                break
            if t0 is None:
                t0 = time.time()
            got += k
        n += got
        if got < MSG:
            break
        if gpu:
            cupy.cuda.runtime.memcpyAsync(
                dev.data.ptr, host[i].ctypes.data, MSG, 1, stream.ptr
            )
            events[i] = cupy.cuda.Event(block=True, disable_timing=True)
            events[i].record(stream)
        i ^= 1
    q.put((n, time.time() - t0))


def run(n, secs, gpu):
    q = mp.Queue()
    procs = []
    for i in range(n):
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        port = ls.getsockname()[1]
        r = mp.Process(target=receiver, args=(ls, n + i, q, gpu))
        r.start()
        s = mp.Process(target=sender, args=(port, i, secs))
        s.start()
        procs += [r, s]
    res = [q.get() for _ in range(n)]
    for p in procs:
        p.join()
    total = sum(b for b, _ in res)
    dt = max(t for _, t in res)
    where = "gpu" if gpu else "host"
    print(
        f"{where}: loopback TCP, {n} stream(s), senders on cores 0-{n - 1}, "
        f"receivers on {n}-{2 * n - 1}: {total / dt / 1e9:.1f} GB/s",
        flush=True,
    )


if __name__ == "__main__":
    mp.set_start_method("spawn")
    streams = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 4
    run(streams, seconds, False)
    run(streams, seconds, True)
