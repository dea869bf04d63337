"""The extension module of nvmeof (re-exported by the package): NVMe-over-Fabrics namespaces
from Python, through the nvmeof-direct initiator.

Offsets and lengths are in bytes and must be multiples of the namespace's block size.
Blocking calls release the GIL. Blocking reads into host memory run on a run-to-completion
queue pair that the calling thread drives (``queue_pairs`` of ``connect``), or through the
controller's shared queues when no queue pair is free. A Controller belongs to the process that connected it: in a
forked child, connect again (``Spec`` is picklable; ``spec.connect()`` in each worker).
"""

import asyncio
from types import TracebackType
from typing import Any, Optional, Protocol, Sequence, Tuple, Union

from collections.abc import Buffer

class CudaArray(Protocol):
    """CUDA device memory described by ``__cuda_array_interface__`` (CuPy, Numba, PyTorch)."""
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...

class DLPackArray(Protocol):
    """An array exported through DLPack (``__dlpack__`` / ``__dlpack_device__``)."""
    def __dlpack__(self, *, stream: Optional[int] = None) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...

Destination = Union[Buffer, CudaArray, DLPackArray]
"""Where a read may land: a writable C-contiguous buffer (bytearray, memoryview, NumPy array),
or C-contiguous CUDA device memory (a torch CUDA tensor, a CuPy array)."""

DEFAULT_SUBNQN: str
"""The subsystem nvmeof-targetd serves when started with no arguments."""

GPU_DESTINATIONS: bool
"""True: reads accept CUDA device memory (the CUDA driver is loaded on first use)."""

NVMF_GPU_CUH: str
"""The source of ``nvmf_gpu.cuh``, the device side of GPU-issued reads."""

class Error(Exception):
    """Base class of every nvmeof error (also: a closed controller, use after fork)."""

class NvmeError(Error):
    """A command completed with an NVMe error status."""
    sct: int
    """Status code type."""
    sc: int
    """Status code."""
    dnr: bool
    """Do Not Retry."""

class ConnectionError(Error):
    """The connection failed, was lost, or timed out."""

class Spec:
    """Connection parameters; picklable. ``connect()`` opens a Controller in this process."""
    traddr: str
    trsvcid: int
    subnqn: str
    hostnqn: Optional[str]
    queues: Optional[int]
    timeout: float
    transport: str
    queue_pairs: int
    """I/O queue IDs kept for run-to-completion queue pairs (see ``connect``)."""
    def __init__(
        self,
        traddr: str,
        trsvcid: int = 4420,
        subnqn: str = ...,
        hostnqn: Optional[str] = None,
        queues: Optional[int] = None,
        dhchap_key: Optional[str] = None,
        timeout: float = 10.0,
        transport: str = "tcp",
        tls_key: Optional[str] = None,
        queue_pairs: int = 1,
    ) -> None: ...
    def connect(self) -> Controller: ...

class Namespace:
    """A namespace: block I/O addressed in bytes."""
    nsid: int
    size: int
    """Size in bytes."""
    block_size: int
    blocks: int
    uuid: Optional[str]
    eui64: Optional[str]
    nguid: Optional[str]
    controller: Controller
    def read_into(self, buffer: Destination, offset: int) -> int:
        """Reads len(buffer) bytes at offset into a writable, C-contiguous buffer
        (bytearray, memoryview, NumPy array) or CUDA array (``__cuda_array_interface__``
        v3, whose stream is waited for, or DLPack on a CUDA device). Returns when the data is
        in place. TypeError: not a buffer or read-only; ValueError: not contiguous, unaligned,
        or outside the namespace; Error: CUDA memory given where no CUDA driver is."""
    def pread(self, size: int, offset: int) -> bytes:
        """Reads size bytes at offset."""
    def write(self, data: Buffer, offset: int) -> int:
        """Writes the bytes of a C-contiguous buffer at offset."""
    def flush(self) -> None:
        """Flushes the volatile write cache."""
    def read_batch(self, reads: Sequence[Tuple[int, int, Destination]]) -> None:
        """Reads each (offset, length, dest): all submitted, then all awaited. Each dest is
        writable with at least length bytes; dests must not overlap. CUDA dests (all on one
        device) are received into pinned memory and copied to the device. Every read is
        checked before any I/O; the first error raises once every read has ended."""
    def read_records(
        self, offsets: Union[Buffer, Sequence[int]], size: int, dest: Destination
    ) -> int:
        """Reads record i (``size`` bytes at byte ``offsets[i]``) into bytes
        ``i * size .. (i + 1) * size`` of ``dest``, all at once, without a Python object per
        record. ``offsets``: a C-contiguous buffer of 64-bit integers (NumPy uint64 or int64
        array) or a sequence of ints; ``dest``: one writable buffer or CUDA array of at least
        ``len(offsets) * size`` bytes. Records adjacent on the namespace are read with one
        command. Returns ``len(offsets) * size``. Checked as read_batch is."""

    # asyncio: each call checks its arguments at once (raising as the blocking call does),
    # starts the I/O on the controller's runtime and returns a future of the running loop.
    # Cancelling the future aborts the I/O; closing the controller ends the calls in flight
    # (each completes or fails with Error).
    # Host buffers only (CUDA memory: use the blocking calls). RuntimeError without a loop.
    def read_into_async(self, buffer: Buffer, offset: int) -> asyncio.Future[int]:
        """asyncio form of read_into."""
    def read_batch_async(
        self, reads: Sequence[Tuple[int, int, Buffer]]
    ) -> asyncio.Future[None]:
        """asyncio form of read_batch."""
    def pread_async(self, size: int, offset: int) -> asyncio.Future[bytes]:
        """asyncio form of pread."""
    def write_async(self, data: Buffer, offset: int) -> asyncio.Future[int]:
        """asyncio form of write."""
    def flush_async(self) -> asyncio.Future[None]:
        """asyncio form of flush."""

class Controller:
    """A connection to one controller. A context manager: leaving it closes."""
    spec: Optional[Spec]
    """None for an nvmeof-initd attachment."""
    closed: bool
    namespaces: list[Namespace]
    """The active namespaces."""
    def namespace(self, nsid: int) -> Namespace:
        """NvmeError for an inactive nsid."""
    def gpu_rings(
        self,
        nsids: Optional[list[int]] = None,
        rings: Optional[int] = None,
        slots: int = 256,
        slot_bytes: Optional[int] = None,
        mode: str = "pull",
        device: int = 0,
    ) -> GpuRings:
        """Request rings through which GPU threads issue their own reads of ``nsids``
        (default: every active namespace; ring namespace index i reads nsids[i]), served by
        this controller's I/O queues. ``rings`` defaults to one per I/O queue; ``slots`` is a
        power of two; ``slot_bytes`` (the largest read of one request) defaults to the first
        namespace's block size, at least 4096; ``mode`` is "pull" or "push"."""
    def close(self) -> None:
        """Disconnects; later calls raise Error. Closing twice is harmless."""
    def __enter__(self) -> Controller: ...
    def __exit__(
        self,
        t: Optional[type[BaseException]],
        v: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

class GpuRings:
    """Request rings for GPU-issued reads (``Controller.gpu_rings``). Kernels include
    ``nvmf_gpu.cuh`` (``nvmeof.include_dir()``) and take the descriptor table, which this
    object exposes through ``__cuda_array_interface__`` (``cupy.asarray(rings)``). A context
    manager: leaving it closes."""
    nrings: int
    slots: int
    slot_bytes: int
    nsids: list[int]
    device: int
    table_ptr: int
    """Device address of ``struct nvmf_gpu_ring[nrings]``; Error once closed."""
    table_len: int
    closed: bool
    __cuda_array_interface__: dict[str, Any]
    def close(self) -> None:
        """Detaches the rings (reads in flight end first) and frees them; no kernel may use
        them any more. Closing twice is harmless."""
    def __enter__(self) -> GpuRings: ...
    def __exit__(
        self,
        t: Optional[type[BaseException]],
        v: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

def connect(
    traddr: str,
    trsvcid: int = 4420,
    subnqn: str = ...,
    hostnqn: Optional[str] = None,
    queues: Optional[int] = None,
    dhchap_key: Optional[str] = None,
    timeout: float = 10.0,
    transport: str = "tcp",
    tls_key: Optional[str] = None,
    queue_pairs: int = 1,
) -> Controller:
    """Connects to an NVMe-oF subsystem (transport "tcp" or "rdma"). ``tls_key``: an
    NVMe/TCP TLS configured PSK (``NVMeTLSkey-1:01:...:``) for TLS 1.3.

    ``queue_pairs``: I/O queue IDs kept (on top of ``queues``) for run-to-completion queue
    pairs. A blocking read into host memory (``read_into``, ``pread``, ``read_batch``,
    ``read_records``) takes a free queue pair of its namespace for the duration of the call
    (opening its connection on first use) and drives it on the calling thread, with no hop
    to the controller's I/O threads; when none is free it goes through the shared queues
    (as every call does with ``queue_pairs=0``). The default, 1, serves one reading thread
    per process (a DataLoader worker); give one per thread that reads at once. A kept queue
    ID costs nothing until a read uses it, and the target grants the shared queues first."""

def attach(name: str, socket: Optional[str] = None) -> Namespace:
    """Opens the namespace of nvmeof-initd attachment ``name`` (as the nvmeof CLI resolves a
    NAME): the daemon gives the parameters, this process connects its own controller.
    ``socket`` defaults to $NVMEOF_INITD_SOCKET or the daemon's default socket."""
