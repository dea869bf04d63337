"""Batched 4 KiB random reads from Python: IOPS and IOPS per process CPU-second.

    taskset -c 8 python bench_batch.py --port 4422 --nqn NQN --batch 128 --seconds 4

Each call reads --batch random records and waits for all of them, so --batch is the queue
depth seen by the target (at most the queue's depth). --form records (default) calls
``Namespace.read_records`` with a NumPy array of offsets into one (batch, bs) array;
--form batch calls ``Namespace.read_batch`` with an (offset, length, row) tuple per read.
Blocking reads run on a run-to-completion queue pair driven by this thread
(--queue-pairs 1, the default); --queue-pairs 0 sends them through the shared queues.
"""

import argparse
import random
import time

import numpy as np

import nvmeof


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--addr", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4420)
    p.add_argument("--nqn", default=nvmeof.DEFAULT_SUBNQN)
    p.add_argument("--nsid", type=int, default=1)
    p.add_argument("--queues", type=int, default=1)
    p.add_argument("--queue-pairs", type=int, default=1)
    p.add_argument("--form", choices=("records", "batch"), default="records")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--bs", type=int, default=4096)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--warmup", type=float, default=1.0)
    a = p.parse_args()

    with nvmeof.connect(a.addr, a.port, a.nqn, queues=a.queues,
                        queue_pairs=a.queue_pairs) as ctrl:
        ns = ctrl.namespace(a.nsid)
        slots = ns.size // a.bs
        dest = np.empty((a.batch, a.bs), dtype=np.uint8)
        rng = random.Random(1)
        gen = np.random.default_rng(1)

        if a.form == "records":
            def one_batch():
                offsets = gen.integers(0, slots, a.batch, dtype=np.uint64) * np.uint64(a.bs)
                ns.read_records(offsets, a.bs, dest)
        else:
            def one_batch():
                ns.read_batch([(rng.randrange(slots) * a.bs, a.bs, dest[i])
                               for i in range(a.batch)])

        end = time.monotonic() + a.warmup
        while time.monotonic() < end:
            one_batch()
        n = 0
        t0, c0 = time.monotonic(), time.process_time()
        end = t0 + a.seconds
        while time.monotonic() < end:
            one_batch()
            n += a.batch
        wall, cpu = time.monotonic() - t0, time.process_time() - c0
        print(f"{n / wall:,.0f} IOPS, {cpu / wall:.2f} cores, {n / cpu:,.0f} IOPS per CPU-second "
              f"({a.form}, batch {a.batch}, {a.bs} B, {a.queues} queue(s), "
              f"{a.queue_pairs} queue pair(s))")


if __name__ == "__main__":
    main()
