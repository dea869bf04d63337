"""PyTorch datasets over fixed-size records stored on an NVMe-oF namespace.

- :class:`RecordDataset`: map-style, record ``i`` is the ``record_size`` bytes at
  ``offset + i * record_size``. ``__getitems__`` reads a whole DataLoader batch with one
  ``Namespace.read_records`` call (runs of consecutive records become one command each), and
  :func:`collate` keeps that batch one tensor.
- :class:`ShardIterable`: iterable, the records split into contiguous shards, one per
  DataLoader worker (``torch.utils.data.get_worker_info()``), read ``records_per_read`` at a
  time with one command each.

Both return ``torch.uint8`` tensors of ``record_size`` bytes (batches: ``(n, record_size)``),
on the CPU or on ``device``.

Processes: a dataset holds only what is needed to connect (a picklable :class:`nvmeof.Spec`,
or an nvmeof-initd attachment name) and opens the namespace the first time it reads in a
process. A DataLoader worker, forked or spawned, therefore connects its own controller; a
controller inherited through ``fork`` is never used.
"""

from __future__ import annotations

import operator
import os
from typing import Any, Iterator, List, Optional, Sequence, Union

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

try:  # torch >= 1.11
    from torch.utils.data import default_collate as _default_collate
except ImportError:  # pragma: no cover
    from torch.utils.data.dataloader import default_collate as _default_collate

import nvmeof

__all__ = ["RecordDataset", "ShardIterable", "RecordBatch", "collate"]

Source = Union["nvmeof.Spec", "nvmeof.Namespace", str]
"""Where the records are: a Spec (connects to namespace ``nsid``), a Namespace of a controller
connected with ``connect`` (its ``controller.spec`` reconnects in other processes), or the name
of an nvmeof-initd attachment (``nvmeof.attach`` in each process)."""

_GPU_DESTINATIONS = nvmeof.GPU_DESTINATIONS


class _Records:
    """What both datasets share: the source, the record geometry, and one namespace per
    process."""

    def __init__(
        self,
        source: Source,
        record_size: int,
        count: Optional[int],
        nsid: int,
        offset: int,
        device: Union[str, torch.device],
        socket: Optional[str],
    ) -> None:
        record_size = operator.index(record_size)
        offset = operator.index(offset)
        if record_size <= 0:
            raise ValueError(f"record_size must be positive, not {record_size}")
        if offset < 0:
            raise ValueError(f"offset must not be negative, not {offset}")
        if count is not None:
            count = operator.index(count)
            if count < 0:
                raise ValueError(f"count must not be negative, not {count}")
        self._ns: Optional[nvmeof.Namespace] = None
        self._pid: Optional[int] = None
        self._owned = False
        if isinstance(source, nvmeof.Namespace):
            spec = source.controller.spec
            if spec is None:
                raise ValueError(
                    "this Namespace belongs to an nvmeof-initd attachment, which a worker "
                    "process cannot reopen from it: pass the attachment's name instead")
            # Used as it is in this process; other processes connect with its spec.
            self._ns, self._pid = source, os.getpid()
            nsid = source.nsid
            source = spec
        elif not isinstance(source, (nvmeof.Spec, str)):
            raise TypeError(
                "source must be an nvmeof.Spec, an nvmeof.Namespace or an attachment name, "
                f"not {type(source).__name__}")
        self.source: Union[nvmeof.Spec, str] = source
        self.nsid = int(nsid)
        self.socket = socket
        self.record_size = record_size
        self.offset = offset
        self.device = torch.device(device)
        self._count = count
        self._checked = False

    # Pickling (spawned workers) carries the parameters, never a connection.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_ns=None, _pid=None, _owned=False)
        return state

    def namespace(self) -> nvmeof.Namespace:
        """The namespace, opened in this process on first use (a forked child opens its own)."""
        pid = os.getpid()
        if self._ns is None or self._pid != pid:
            if isinstance(self.source, str):
                ns = nvmeof.attach(self.source, socket=self.socket)
            else:
                ns = self.source.connect().namespace(self.nsid)
            # An inherited namespace of the parent is dropped here; in a child that leaves
            # the parent's connection alone.
            self._ns, self._pid, self._owned, self._checked = ns, pid, True, False
        if not self._checked:
            self._check(self._ns)
        return self._ns

    def _check(self, ns: nvmeof.Namespace) -> None:
        bs = ns.block_size
        if self.record_size % bs or self.offset % bs:
            raise ValueError(
                f"record_size {self.record_size} and offset {self.offset} must be multiples of "
                f"the namespace's block size {bs}")
        room = max(0, ns.size - self.offset) // self.record_size
        if self._count is None:
            self._count = room
        elif self._count > room:
            raise ValueError(
                f"{self._count} records of {self.record_size} bytes from offset {self.offset} "
                f"do not fit in the namespace ({ns.size} bytes, room for {room})")
        self._checked = True

    def __len__(self) -> int:
        if self._count is None:
            self.namespace()
        return self._count

    def close(self) -> None:
        """Disconnects the controller this process opened (a Namespace passed in is left
        open). The next read connects again."""
        ns, owned, pid = self._ns, self._owned, self._pid
        self._ns, self._pid, self._owned = None, None, False
        if ns is not None and owned and pid == os.getpid():
            ns.controller.close()

    def _read(self, ns: nvmeof.Namespace, shape: Sequence[int],
              offsets: List[int]) -> torch.Tensor:
        """Reads the records at namespace byte ``offsets`` into the rows of a new uint8 tensor
        of ``shape`` on the dataset's device, with one call."""
        rs = self.record_size
        if self.device.type == "cpu" or (self.device.type == "cuda" and _GPU_DESTINATIONS):
            # CUDA tensors lend their memory through __cuda_array_interface__.
            out = torch.empty(tuple(shape), dtype=torch.uint8, device=self.device)
        else:
            # Pinned, so that the copy to the device below is asynchronous.
            out = torch.empty(tuple(shape), dtype=torch.uint8,
                              pin_memory=self.device.type == "cuda")
        rows = out.view(-1, rs)
        if out.device.type == "cpu":
            rows = rows.numpy()  # CPU tensors lend their memory through NumPy's buffer
        ns.read_records(offsets, rs, rows)
        if out.device != self.device:
            out = out.to(self.device, non_blocking=True)
        return out


class RecordBatch(list):
    """The records of one ``__getitems__`` call: a list of ``(record_size,)`` tensors, as
    DataLoader's ``collate_fn`` expects, which are rows of one ``(n, record_size)`` tensor,
    ``.tensor``. :func:`collate` returns that tensor instead of stacking the rows."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(tensor.unbind(0))
        self.tensor = tensor


def collate(batch: Any) -> Any:
    """A ``collate_fn`` for ``DataLoader``: the tensor of a :class:`RecordBatch` as it is (no
    copy), anything else through PyTorch's default collate."""
    if isinstance(batch, RecordBatch):
        return batch.tensor
    return _default_collate(batch)


class RecordDataset(_Records, Dataset):
    """Map-style dataset of ``count`` records of ``record_size`` bytes from byte ``offset`` of
    namespace ``nsid`` (``count=None``: as many as fit; asking for it connects in this
    process). ``record_size`` and ``offset`` must be multiples of the block size.

    ``ds[i]`` is a ``torch.uint8`` tensor of ``record_size`` bytes on ``device``; negative
    indices count from the end; others outside ``range(len(ds))`` raise IndexError.
    ``ds.__getitems__(indices)`` (what DataLoader calls for a batch) reads every record of the
    batch with one ``read_records`` call and returns a :class:`RecordBatch`; give the
    DataLoader ``collate_fn=nvmeof.torch.collate`` to get it as one ``(n, record_size)``
    tensor without a copy.

    ``device="cuda"``: records are read into CUDA tensors directly (``nvmeof.GPU_DESTINATIONS``);
    other devices get pinned CPU memory copied with ``.to(device, non_blocking=True)``. CUDA
    cannot be used in forked DataLoader workers: for throughput use
    ``multiprocessing_context="spawn"`` with ``device="cuda"`` (each worker delivers CUDA
    tensors); forked workers need ``device="cpu"`` and ``pin_memory=True``, whose single
    pin-memory thread then copies every batch.
    """

    def __init__(
        self,
        source: Source,
        record_size: int,
        count: Optional[int] = None,
        *,
        nsid: int = 1,
        offset: int = 0,
        device: Union[str, torch.device] = "cpu",
        socket: Optional[str] = None,
    ) -> None:
        _Records.__init__(self, source, record_size, count, nsid, offset, device, socket)

    def _index(self, index: Any, n: int) -> int:
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(
                f"record indices are integers, not {type(index).__name__}") from None
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"record {i} out of range: the dataset has {n} records")
        return j

    def __getitem__(self, index: Any) -> torch.Tensor:
        ns = self.namespace()
        i = self._index(index, len(self))
        rs = self.record_size
        return self._read(ns, (rs,), [self.offset + i * rs])

    def __getitems__(self, indices: Sequence[Any]) -> RecordBatch:
        ns = self.namespace()
        n = len(self)
        idx = [self._index(i, n) for i in indices]
        rs = self.record_size
        if not idx:
            return RecordBatch(torch.empty((0, rs), dtype=torch.uint8, device=self.device))
        # One call; runs of consecutive records become one command each.
        offsets = [self.offset + i * rs for i in idx]
        return RecordBatch(self._read(ns, (len(idx), rs), offsets))


class ShardIterable(_Records, IterableDataset):
    """Iterable dataset over records ``start .. stop`` (default: all ``count`` of them), split
    into contiguous shards: DataLoader worker ``w`` of ``W`` reads shard ``w``
    (:meth:`shard`), ``records_per_read`` records per command, and yields them one by one
    as ``(record_size,)`` ``torch.uint8`` tensors on ``device``, in order. Across the workers
    every record is read exactly once. Outside a DataLoader worker the whole range is one
    shard.
    """

    def __init__(
        self,
        source: Source,
        record_size: int,
        count: Optional[int] = None,
        *,
        start: int = 0,
        stop: Optional[int] = None,
        records_per_read: int = 64,
        nsid: int = 1,
        offset: int = 0,
        device: Union[str, torch.device] = "cpu",
        socket: Optional[str] = None,
    ) -> None:
        _Records.__init__(self, source, record_size, count, nsid, offset, device, socket)
        self.start = operator.index(start)
        self.stop = None if stop is None else operator.index(stop)
        self.records_per_read = operator.index(records_per_read)
        if self.records_per_read <= 0:
            raise ValueError("records_per_read must be positive")
        if self.start < 0 or (self.stop is not None and self.stop < self.start):
            raise ValueError(f"bad record range {self.start}..{self.stop}")

    def _range(self) -> range:
        n = len(self)
        stop = n if self.stop is None else self.stop
        if stop > n:
            raise ValueError(f"stop {stop} is past the {n} records")
        return range(min(self.start, stop), stop)

    def shard(self, worker: int, workers: int) -> range:
        """The records worker ``worker`` of ``workers`` reads: contiguous, sizes differing by
        at most one, together covering the range exactly once."""
        if not 0 <= worker < workers:
            raise ValueError(f"worker {worker} of {workers}")
        r = self._range()
        n = len(r)
        return range(r.start + n * worker // workers, r.start + n * (worker + 1) // workers)

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        w, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        ns = self.namespace()
        rs = self.record_size
        r = self.shard(w, workers)
        for first in range(r.start, r.stop, self.records_per_read):
            k = min(self.records_per_read, r.stop - first)
            chunk = self._read(ns, (k, rs), [self.offset + (first + j) * rs for j in range(k)])
            yield from chunk.unbind(0)
