"""nvmeof.torch against a real nvmeof-targetd, with PyTorch on the CPU."""

import os
import pickle
import signal
import socket as so
import subprocess
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

import nvmeof  # noqa: E402
import nvmeof.torch as nt  # noqa: E402

from conftest import ROOT, free_port  # noqa: E402

RS = 4096
BASE = 8 << 20  # the upper half of the 16 MiB test namespace
N = 96


@pytest.fixture(scope="module")
def records(spec):
    """N distinct random records written at BASE; returns them as an (N, RS) array."""
    data = np.frombuffer(os.urandom(N * RS), dtype=np.uint8).reshape(N, RS).copy()
    data[:, :4] = np.arange(N, dtype="<u4").view(np.uint8).reshape(N, 4)  # all distinct
    with spec.connect() as c:
        c.namespace(1).write(data, BASE)
    return data


def ds_of(spec, **kw):
    kw.setdefault("offset", BASE)
    return nt.RecordDataset(spec, RS, kw.pop("count", N), **kw)


def test_indexing(spec, records):
    ds = ds_of(spec)
    assert len(ds) == N
    r = ds[0]
    assert isinstance(r, torch.Tensor) and r.dtype == torch.uint8 and r.shape == (RS,)
    assert r.numpy().tobytes() == records[0].tobytes()
    assert ds[N - 1].numpy().tobytes() == records[N - 1].tobytes()
    assert ds[-1].numpy().tobytes() == records[N - 1].tobytes()
    assert ds[np.int64(7)].numpy().tobytes() == records[7].tobytes()
    assert ds[torch.tensor(9)].numpy().tobytes() == records[9].tobytes()
    with pytest.raises(IndexError, match="out of range"):
        ds[N]
    with pytest.raises(IndexError, match="out of range"):
        ds[-N - 1]
    with pytest.raises(TypeError, match="integers"):
        ds["3"]
    with pytest.raises(TypeError, match="integers"):
        ds[1.0]
    ds.close()
    ds.close()
    assert ds[1].numpy().tobytes() == records[1].tobytes()  # connects again
    ds.close()


def test_count_defaults_to_what_fits(spec, records):
    ds = nt.RecordDataset(spec, RS, offset=BASE)
    assert len(ds) == (16 << 20) // RS - BASE // RS
    assert ds[len(ds) - 1].shape == (RS,)
    ds.close()


def test_geometry_errors(spec, ns):
    with pytest.raises(ValueError, match="block size"):
        len(nt.RecordDataset(spec, 1000))
    with pytest.raises(ValueError, match="block size"):
        nt.RecordDataset(spec, RS, 4, offset=100)[0]
    with pytest.raises(ValueError, match="do not fit"):
        nt.RecordDataset(spec, RS, (16 << 20) // RS + 1)[0]
    with pytest.raises(ValueError, match="positive"):
        nt.RecordDataset(spec, 0)
    with pytest.raises(ValueError, match="negative"):
        nt.RecordDataset(spec, RS, -1)
    with pytest.raises(TypeError, match="source"):
        nt.RecordDataset(b"127.0.0.1", RS)
    # A Namespace is used as it is in this process.
    ds = nt.RecordDataset(ns, RS, 4, offset=BASE)
    assert ds.namespace() is ns
    assert ds.source.subnqn == ns.controller.spec.subnqn
    ds.close()
    assert not ns.controller.closed  # not ours to close


class Counting:
    """A Namespace stand-in that counts the calls made to it."""

    def __init__(self, ns):
        self.ns, self.calls = ns, []

    def __getattr__(self, name):
        return getattr(self.ns, name)

    def read_into(self, buf, off):
        self.calls.append(("read_into", 1))
        return self.ns.read_into(buf, off)

    def read_batch(self, reads):
        self.calls.append(("read_batch", len(reads)))
        return self.ns.read_batch(reads)

    def read_records(self, offsets, size, dest):
        self.calls.append(("read_records", len(offsets)))
        return self.ns.read_records(offsets, size, dest)


def test_getitems_is_one_submission(spec, records):
    ds = ds_of(spec)
    counting = Counting(ds.namespace())
    ds._ns = counting
    idx = [5, 1, 2, 3, 40, -1, 0]
    b = ds.__getitems__(idx)
    # One read_records call (which reads the run 1, 2, 3 with one command).
    assert counting.calls == [("read_records", 7)]
    assert isinstance(b, nt.RecordBatch) and len(b) == len(idx)
    assert b.tensor.shape == (len(idx), RS)
    want = records[[i % N for i in idx]]
    assert b.tensor.numpy().tobytes() == want.tobytes()
    assert all(b[k].numpy().tobytes() == want[k].tobytes() for k in range(len(idx)))
    assert nt.collate(b) is b.tensor
    # A run of consecutive records: one call too.
    counting.calls.clear()
    b = ds.__getitems__(range(10, 20))
    assert counting.calls == [("read_records", 10)]
    assert b.tensor.numpy().tobytes() == records[10:20].tobytes()
    # Nothing is read when an index is out of range.
    counting.calls.clear()
    with pytest.raises(IndexError):
        ds.__getitems__([1, N])
    assert counting.calls == []
    assert ds.__getitems__([]).tensor.shape == (0, RS)
    # collate falls back to PyTorch's for anything else.
    assert nt.collate([torch.zeros(2), torch.ones(2)]).shape == (2, 2)
    # Through a DataLoader: one submission per batch.
    counting.calls.clear()
    dl = DataLoader(ds, batch_size=12, shuffle=True, collate_fn=nt.collate)
    rows = torch.cat(list(dl)).numpy()
    assert len(counting.calls) == N // 12
    assert sorted(rows[:, :4].copy().view("<u4").ravel().tolist()) == list(range(N))
    ds._ns = counting.ns
    ds.close()


@pytest.mark.parametrize("collate", [nt.collate, None])
def test_dataloader_two_workers(spec, records, collate):
    ds = ds_of(spec)
    len(ds)  # connects in this process first: the workers must not use this controller
    kw = {"collate_fn": collate} if collate else {}
    dl = DataLoader(ds, batch_size=8, num_workers=2, **kw)
    got = [b for b in dl]
    assert all(b.shape == (8, RS) and b.dtype == torch.uint8 for b in got)
    assert torch.cat(got).numpy().tobytes() == records.tobytes()
    # Shuffled, the records come back each once.
    dl = DataLoader(ds, batch_size=16, num_workers=2, shuffle=True, collate_fn=nt.collate,
                    persistent_workers=False)
    rows = torch.cat(list(dl)).numpy()
    order = rows[:, :4].copy().view("<u4").ravel()
    assert sorted(order.tolist()) == list(range(N))
    assert all(rows[k].tobytes() == records[order[k]].tobytes() for k in range(N))
    assert ds[3].numpy().tobytes() == records[3].tobytes()  # this process's controller
    ds.close()


def test_dataloader_spawned_workers(spec, records):
    ds = ds_of(spec, count=32)
    ds[0]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._ns is None and len(clone) == 32
    dl = DataLoader(ds, batch_size=8, num_workers=1, collate_fn=nt.collate,
                    multiprocessing_context="spawn")
    assert torch.cat(list(dl)).numpy().tobytes() == records[:32].tobytes()
    ds.close()


def test_shard_ranges(spec, records):
    it = nt.ShardIterable(spec, RS, N, offset=BASE, start=3, stop=N - 2)
    for workers in (1, 2, 3, 7):
        shards = [it.shard(w, workers) for w in range(workers)]
        assert [i for s in shards for i in s] == list(range(3, N - 2))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
    with pytest.raises(ValueError):
        it.shard(2, 2)
    with pytest.raises(ValueError, match="stop"):
        nt.ShardIterable(spec, RS, N, offset=BASE, stop=N + 1).shard(0, 1)


def test_shard_iterable_two_workers(spec, records):
    it = nt.ShardIterable(spec, RS, N, offset=BASE, records_per_read=5)
    # In this process: one shard, in order.
    rows = [r.numpy().tobytes() for r in it]
    assert rows == [records[i].tobytes() for i in range(N)]
    dl = DataLoader(it, batch_size=None, num_workers=2)
    seen = []
    for r in dl:
        assert r.shape == (RS,) and r.dtype == torch.uint8
        i = int(r[:4].numpy().view("<u4")[0])
        assert r.numpy().tobytes() == records[i].tobytes()
        seen.append(i)
    assert sorted(seen) == list(range(N))  # every record exactly once across the workers
    # Batched by the DataLoader.
    dl = DataLoader(it, batch_size=10, num_workers=2)
    assert sum(len(b) for b in dl) == N
    it.close()


def _start_target(port, nqn, ctl):
    exe = os.environ.get("NVMEOF_TARGETD", str(ROOT / "target/debug/nvmeof-targetd"))
    p = subprocess.Popen([exe, "--listen", f"tcp://127.0.0.1:{port}", "-n", nqn,
                          "--namespace", "mem:4M", "--allow-any-host", "--control-socket", ctl],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        assert p.poll() is None, "nvmeof-targetd exited"
        try:
            so.create_connection(("127.0.0.1", port), timeout=1).close()
            return p
        except OSError:
            time.sleep(0.05)
    raise AssertionError("nvmeof-targetd did not listen")


def test_target_restart_mid_iteration(tmp_path):
    """What a restart does to a DataLoader: reads while the target is down fail with
    nvmeof.ConnectionError once the I/O timeout passes (the controller keeps reconnecting
    meanwhile); once the target is back the controller reconnects by itself and the same
    iterator reads again, now from the new target (whose memory namespace is empty)."""
    port, nqn = free_port(), "nqn.2026-11.io.nvmeof-direct:torch-restart"
    ctl = str(tmp_path / "c.sock")
    proc = _start_target(port, nqn, ctl)
    spec = nvmeof.Spec("127.0.0.1", port, nqn, queues=1, timeout=2)
    try:
        ns = spec.connect().namespace(1)
        data = np.full((64, RS), 0x5A, dtype=np.uint8)
        ns.write(data, 0)
        ds = nt.RecordDataset(ns, RS, 64)
        batches = iter(DataLoader(ds, batch_size=4, collate_fn=nt.collate))
        assert next(batches).numpy().tobytes() == data[:4].tobytes()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with pytest.raises(nvmeof.ConnectionError):
            next(batches)
        proc = _start_target(port, nqn, ctl)
        # Reconnecting takes up to the reconnect delay (doubling from 0.25 s while the
        # target was down); each read meanwhile ends with ConnectionError at its timeout.
        for _ in range(30):
            try:
                b = next(batches)
                break
            except nvmeof.ConnectionError:
                continue
        else:
            raise AssertionError("no read succeeded after the target came back")
        assert b.shape == (4, RS)
        assert not b.any()  # the new target's namespace
        ns.controller.close()
    finally:
        proc.terminate()
        proc.wait()
