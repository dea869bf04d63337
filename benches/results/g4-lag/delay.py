"""Loopback TCP into pinned buffers (8 streams, 1 MiB messages, senders on CPUs 0-7, receivers
on 8-15), each message copied to the GPU only after LAG more messages were received, and
optionally a cache hint over each message right after it was received (libflush.so, flush.c).

    python3 delay.py HOW:LAG[,HOW:LAG...]    HOW: none, demote, flushopt, wb
"""
import importlib
import multiprocessing as mp, os, socket, sys, time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../scripts"))
sender = importlib.import_module("tcp-gpu-ceiling").sender
MSG = 1 << 20

def receiver(ls, cpu, q, delay, msg, how):
    os.sched_setaffinity(0, {cpu})
    import ctypes
    lib = ctypes.CDLL(os.path.join(os.path.dirname(os.path.abspath(__file__)), "libflush.so"))
    fl = getattr(lib, how) if how != "none" else None
    import cupy, numpy
    cupy.cuda.Device(0).use()
    nb = delay + 2
    pinned = [cupy.cuda.alloc_pinned_memory(msg) for _ in range(nb)]
    host = [numpy.frombuffer(p, dtype=numpy.uint8, count=msg) for p in pinned]
    dev = cupy.empty(msg, dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    events = [None] * nb
    bufs = [memoryview(h) for h in host]
    c, _ = ls.accept()
    n, t0, i = 0, None, 0
    while True:
        if events[i] is not None:
            events[i].synchronize(); events[i] = None
        got = 0
        while got < msg:
            k = c.recv_into(bufs[i][got:])
            if not k: break
            if t0 is None: t0 = time.time()
            got += k
        n += got
        if got < msg: break
        if fl is not None:
            fl(ctypes.c_void_p(host[i].ctypes.data), ctypes.c_size_t(msg))
        j = (i - delay) % nb  # copy the buffer received `delay` messages ago
        if delay == 0 or n >= (delay + 1) * msg:
            cupy.cuda.runtime.memcpyAsync(dev.data.ptr, host[j].ctypes.data, msg, 1, stream.ptr)
            ev = cupy.cuda.Event(block=True, disable_timing=True); ev.record(stream)
            events[j] = ev
        i = (i + 1) % nb
    q.put((n, time.time() - t0))

def run(n, secs, delay, msg, how):
    q = mp.Queue(); procs = []
    for i in range(n):
        ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(1)
        port = ls.getsockname()[1]
        r = mp.Process(target=receiver, args=(ls, n + i, q, delay, msg, how)); r.start()
        s = mp.Process(target=sender, args=(port, i, secs)); s.start()
        procs += [r, s]
    res = [q.get() for _ in range(n)]
    for p in procs: p.join()
    total = sum(b for b, _ in res); dt = max(t for _, t in res)
    print(f"{how} delay {delay} msg {msg>>10} KiB: {total/dt/1e9:.1f} GB/s", flush=True)

if __name__ == "__main__":
    mp.set_start_method("spawn")
    for spec in sys.argv[1].split(","):
        how, d = spec.split(":")
        run(8, 4, int(d), MSG, how)
