"""Records into CUDA tensors through a PyTorch DataLoader: GB/s landed in GPU memory.

    # NVMe/TCP through nvmeof.torch.RecordDataset (the namespace holds the records)
    taskset -c 8-15 python3 bench_loader.py nvmeof --port 4420 --nqn NQN --workers 8
    # the same records from a local file with plain PyTorch (the direct-attached row)
    taskset -c 8-15 python3 bench_loader.py file --path records.bin --workers 8

Both read shuffled batches of --batch records of --record-size bytes (default 128 KiB) and
move every batch into a CUDA tensor; the figure counts bytes landed in GPU memory between the
end of the warm-up and the last batch (after a device synchronize).

--workers 0 reads in this process: ``nvmeof`` straight into CUDA tensors
(``device="cuda"``), ``file`` into pinned memory then ``.cuda()``. With --workers N > 0 each
DataLoader worker reads into CPU tensors (``nvmeof``: its own controller, connected in the
worker) and the DataLoader pins them (``pin_memory=True``); this process copies each batch to
the GPU. --spawn starts the workers with ``spawn`` and has them deliver CUDA tensors (``nvmeof``
reads straight into them, ``file`` reads into pinned memory and copies), which reach this
process through CUDA IPC: the form that scales, since no copy is left to this process.

``file`` reads each record with ``os.preadv`` into the batch's row, the way a plain
map-style Dataset over a file of records would.
"""

import argparse
import os
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


class FileRecords(Dataset):
    """Records of a local file, one ``os.preadv`` per record into a batch's row."""

    def __init__(self, path, record_size, count, pin, cuda):
        self.path, self.record_size, self.count, self.pin = path, record_size, count, pin
        self.cuda = cuda
        self.fd = None

    def __len__(self):
        return self.count

    def __getitems__(self, indices):
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDONLY)
        rs = self.record_size
        out = torch.empty((len(indices), rs), dtype=torch.uint8, pin_memory=self.pin)
        rows = out.numpy()
        for j, i in enumerate(indices):
            if os.preadv(self.fd, [rows[j]], i * rs) != rs:
                raise IOError(f"short read of record {i}")
        return out.to("cuda", non_blocking=True) if self.cuda else out


def first(batch):
    return batch


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", choices=("nvmeof", "file"))
    p.add_argument("--addr", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4420)
    p.add_argument("--nqn", default=None)
    p.add_argument("--nsid", type=int, default=1)
    p.add_argument("--queues", type=int, default=1, help="I/O queues per controller")
    p.add_argument("--path", help="file of records (file)")
    p.add_argument("--record-size", type=int, default=128 << 10)
    p.add_argument("--records", type=int, default=None,
                   help="records to use (default: as many as the namespace or file holds)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--prefetch", type=int, default=4, help="batches in flight per worker")
    p.add_argument("--spawn", action="store_true",
                   help="spawned workers deliver CUDA tensors")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=2.0)
    a = p.parse_args()

    dev = torch.device("cuda")
    torch.cuda.init()
    rs = a.record_size
    if a.source == "file":
        if not a.path:
            p.error("file needs --path")
        count = a.records or os.path.getsize(a.path) // rs
        ds = FileRecords(a.path, rs, count, pin=a.workers == 0 or a.spawn,
                         cuda=a.spawn and a.workers > 0)
        collate = first
        kw = {}
    else:
        import nvmeof
        import nvmeof.torch as nt

        nqn = a.nqn or nvmeof.DEFAULT_SUBNQN
        spec = nvmeof.Spec(a.addr, a.port, nqn, queues=a.queues)
        direct = a.workers == 0 or a.spawn
        ds = nt.RecordDataset(spec, rs, a.records, nsid=a.nsid,
                              device="cuda" if direct else "cpu")
        count = len(ds)
        collate = nt.collate
        kw = {}
    if a.spawn and a.workers > 0:
        kw["multiprocessing_context"] = "spawn"
    if a.workers > 0:
        kw.update(num_workers=a.workers, prefetch_factor=a.prefetch,
                  persistent_workers=True, pin_memory=not a.spawn)
    # Batches are sampled at random from the whole set, for as long as the run lasts.
    sampler = torch.utils.data.RandomSampler(range(count), replacement=True,
                                             num_samples=1 << 40)
    dl = DataLoader(ds, batch_size=a.batch, sampler=sampler, collate_fn=collate, **kw)

    it = iter(dl)
    t_end_warm = time.monotonic() + a.warmup
    while time.monotonic() < t_end_warm:
        next(it).to(dev, non_blocking=True)
    torch.cuda.synchronize()
    nbytes, batches = 0, 0
    t0, c0 = time.monotonic(), time.process_time()
    end = t0 + a.seconds
    sink = torch.zeros(1, dtype=torch.int64, device=dev)
    while time.monotonic() < end:
        b = next(it).to(dev, non_blocking=True)
        # Touch one byte per record on the device so each batch is used where it landed.
        sink += b[:, 0].sum()
        nbytes += b.numel()
        batches += 1
    torch.cuda.synchronize()
    dt = time.monotonic() - t0
    cpu = time.process_time() - c0
    print(f"{a.source} record {rs} B batch {a.batch} workers {a.workers}"
          f"{' spawn' if a.spawn else ''}: {nbytes / dt / 1e9:.2f} GB/s, "
          f"{batches * a.batch / dt:.0f} records/s, {batches} batches in {dt:.2f} s, "
          f"main process CPU {cpu / dt:.2f} cores")
    del it
    np.asarray(sink.cpu())


if __name__ == "__main__":
    main()
