"""A training-style loop over records stored on an NVMe-oF namespace.

Start a target and write a dataset to it with the CLI (here: 4096 records of 4 KiB of random
bytes), then train on it:

    nvmeof-targetd &                                  # 1 GiB memory namespace on 127.0.0.1:4420
    head -c 16M /dev/urandom > records.bin
    nvmeof write -a 127.0.0.1 -n nqn.2026-11.io.nvmeof-direct:default --data records.bin
    python train_loop.py --records 4096 --record-size 4096

A DataLoader with two worker processes (each connects its own controller) reads shuffled
batches through nvmeof.torch.RecordDataset, one read_batch submission per batch. The model is
a linear layer that learns to predict each record's mean byte value from its bytes as floats;
the loss printed per epoch falls.
"""

import argparse
import time

import torch
from torch.utils.data import DataLoader

import nvmeof
import nvmeof.torch as nt


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--addr", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4420)
    p.add_argument("--nqn", default=nvmeof.DEFAULT_SUBNQN)
    p.add_argument("--nsid", type=int, default=1)
    p.add_argument("--record-size", type=int, default=4096)
    p.add_argument("--records", type=int, default=4096)
    p.add_argument("--offset", type=int, default=0, help="byte offset of the first record")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()

    spec = nvmeof.Spec(a.addr, a.port, a.nqn, queues=1)
    # Records stay on the CPU in the workers (CUDA does not survive fork); the DataLoader pins
    # them and the loop moves each batch to the device.
    ds = nt.RecordDataset(spec, a.record_size, a.records, nsid=a.nsid, offset=a.offset)
    dl = DataLoader(ds, batch_size=a.batch, shuffle=True, num_workers=a.workers,
                    collate_fn=nt.collate, pin_memory=a.device.startswith("cuda"),
                    drop_last=True)

    dev = torch.device(a.device)
    model = torch.nn.Linear(a.record_size, 1).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(a.epochs):
        t0, total, batches, nbytes = time.perf_counter(), 0.0, 0, 0
        for raw in dl:
            raw = raw.to(dev, non_blocking=True)
            x = raw.float() / 255.0                      # (batch, record_size)
            y = x.mean(dim=1, keepdim=True)              # what the layer should learn
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            batches += 1
            nbytes += raw.numel()
        dt = time.perf_counter() - t0
        print(f"epoch {epoch}: loss {total / max(batches, 1):.6f}, {batches} batches, "
              f"{nbytes / dt / 1e6:.1f} MB/s")


if __name__ == "__main__":
    main()
