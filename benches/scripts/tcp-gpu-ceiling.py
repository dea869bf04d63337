"""Loopback TCP into GPU memory, the most a staged NVMe/TCP read path can move.

    python3 benches/scripts/tcp-gpu-ceiling.py [STREAMS] [SECONDS] [--why]

STREAMS sender/receiver process pairs (default 8) move 1 MiB messages over 127.0.0.1, senders
pinned to cores [0, STREAMS), receivers to [STREAMS, 2*STREAMS), as the raw loopback ceiling
does. Two rows: `host`, each receiver reads into plain memory; `gpu`, each receiver reads into
pinned host memory (two 1 MiB buffers used in turn) and copies every message to device memory
with an asynchronous copy, waiting (without spinning) for a buffer's previous copy before it
reads into it again. The `gpu` row is what loopback TCP plus one copy to the GPU per byte can
move with these cores: no NVMe/TCP, no PDU parsing. Needs CuPy for the `gpu` row.

With `--why`, rows that take the `gpu` row apart: `pinned`, received into the pinned buffers
with no copy; `gpu-other`, the same copies and waits as `gpu` but each copies another pinned
buffer (the GPU's copy engine reads as much, just not the bytes the receiver wrote); and
`host+copier`, the `host` row while one more process copies a 1 GiB pinned buffer to the GPU
without pause (its rate printed beside); `lag`, the `gpu` row with four buffers in turn, each
MiB copied only once LAG more MiB (2) have been received after it.
"""
import multiprocessing as mp
import os
import socket
import sys
import time

MSG = 1 << 20
# How many messages the `lag` row receives after one before copying it to the GPU.
LAG = 2


def sender(port, cpu, secs):
    os.sched_setaffinity(0, {cpu})
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(os.urandom(MSG)))
    end = time.time() + secs
    while time.time() < end:
        s.sendall(buf)
    s.close()


def receiver(ls, cpu, q, gpu, what="gpu"):
    os.sched_setaffinity(0, {cpu})
    lag = LAG if what == "lag" else 0
    nbuf = lag + 2
    if gpu:
        import cupy
        import numpy

        cupy.cuda.Device(0).use()
        pinned = [cupy.cuda.alloc_pinned_memory(MSG) for _ in range(nbuf)]
        host = [numpy.frombuffer(p, dtype=numpy.uint8, count=MSG) for p in pinned]
        dev = cupy.empty(MSG, dtype=cupy.uint8)
        stream = cupy.cuda.Stream(non_blocking=True)
        events = [None] * nbuf
        bufs = [memoryview(h) for h in host]
        other = host
        if what == "gpu-other":
            other = [
                numpy.frombuffer(cupy.cuda.alloc_pinned_memory(MSG), dtype=numpy.uint8, count=MSG)
                for _ in range(nbuf)
            ]
    else:
        bufs = [memoryview(bytearray(MSG)) for _ in range(nbuf)]
    c, _ = ls.accept()
    n, t0, i = 0, None, 0
    while True:
        if gpu and events[i] is not None:
            events[i].synchronize()
            events[i] = None
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
        # With a lag, the message received `lag` messages ago is copied.
        j = (i - lag) % nbuf
        if gpu and what != "pinned" and n > lag * MSG:
            cupy.cuda.runtime.memcpyAsync(
                dev.data.ptr, other[j].ctypes.data, MSG, 1, stream.ptr
            )
            events[j] = cupy.cuda.Event(block=True, disable_timing=True)
            events[j].record(stream)
        i = (i + 1) % nbuf
    q.put((n, time.time() - t0))


def copier(cpu, secs, q, ready):
    """Copies a 1 GiB pinned buffer to the GPU, 64 MiB at a time, for `secs` seconds."""
    os.sched_setaffinity(0, {cpu})
    import cupy
    import numpy

    cupy.cuda.Device(0).use()
    total, chunk = 1 << 30, 64 << 20
    src = numpy.frombuffer(cupy.cuda.alloc_pinned_memory(total), dtype=numpy.uint8, count=total)
    src[:] = 1
    dev = cupy.empty(chunk, dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    ready.set()
    moved, off, t0 = 0, 0, time.time()
    while time.time() < t0 + secs:
        for _ in range(8):
            cupy.cuda.runtime.memcpyAsync(dev.data.ptr, src.ctypes.data + off, chunk, 1, stream.ptr)
            moved += chunk
            off = (off + chunk) % total
        done = cupy.cuda.Event(block=True, disable_timing=True)
        done.record(stream)
        done.synchronize()
    q.put(moved / (time.time() - t0) / 1e9)


def run(n, secs, gpu, what=None):
    what = what or ("gpu" if gpu else "host")
    q = mp.Queue()
    procs = []
    side = None
    if what == "host+copier":
        cq, ready = mp.Queue(), mp.Event()
        # On the last receiver's core: it mostly waits for its copies.
        side = mp.Process(target=copier, args=(2 * n - 1, secs + 1.5, cq, ready))
        side.start()
        ready.wait()
    for i in range(n):
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        port = ls.getsockname()[1]
        r = mp.Process(target=receiver, args=(ls, n + i, q, gpu, what))
        r.start()
        s = mp.Process(target=sender, args=(port, i, secs))
        s.start()
        procs += [r, s]
    res = [q.get() for _ in range(n)]
    for p in procs:
        p.join()
    total = sum(b for b, _ in res)
    dt = max(t for _, t in res)
    extra = ""
    if side is not None:
        extra = f" (the copier moved {cq.get():.1f} GB/s to the GPU meanwhile)"
        side.join()
    print(
        f"{what}: loopback TCP, {n} stream(s), senders on cores 0-{n - 1}, "
        f"receivers on {n}-{2 * n - 1}: {total / dt / 1e9:.1f} GB/s{extra}",
        flush=True,
    )


if __name__ == "__main__":
    mp.set_start_method("spawn")
    args = [a for a in sys.argv[1:] if a != "--why"]
    streams = int(args[0]) if args else 8
    seconds = float(args[1]) if len(args) > 1 else 4
    run(streams, seconds, False)
    run(streams, seconds, True)
    if "--why" in sys.argv[1:]:
        run(streams, seconds, True, "pinned")
        run(streams, seconds, True, "gpu-other")
        run(streams, seconds, False, "host+copier")
        run(streams, seconds, True, "lag")
