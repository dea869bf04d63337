"""NVMe-over-Fabrics namespaces from Python, through the nvmeof-direct initiator.

Offsets and lengths are in bytes and must be multiples of the namespace's block size.
Blocking calls release the GIL. A Controller belongs to the process that connected it: in a
forked child, connect again (``Spec`` is picklable; ``spec.connect()`` in each worker).

``nvmeof.torch`` (imported on its own, it needs PyTorch) has datasets for data loaders.
"""

import atexit
import functools
import os
import shutil
import tempfile

from ._nvmeof import (
    DEFAULT_SUBNQN,
    GPU_DESTINATIONS,
    NVMF_GPU_CUH,
    ConnectionError,
    Controller,
    Error,
    GpuRings,
    Namespace,
    NvmeError,
    Spec,
    attach,
    connect,
)

__all__ = [
    "DEFAULT_SUBNQN",
    "GPU_DESTINATIONS",
    "NVMF_GPU_CUH",
    "ConnectionError",
    "Controller",
    "Error",
    "GpuRings",
    "Namespace",
    "NvmeError",
    "Spec",
    "attach",
    "connect",
    "include_dir",
]


@functools.cache
def include_dir() -> str:
    """A directory holding ``nvmf_gpu.cuh``, the device side of GPU-issued reads.

    Pass it to NVRTC, e.g. ``cupy.RawKernel(src, name, options=("-I" + nvmeof.include_dir(),))``
    for a kernel that includes ``"nvmf_gpu.cuh"`` and reads through ``Controller.gpu_rings()``.
    The header is written once per process into a private temporary directory, removed at exit.
    """
    d = tempfile.mkdtemp(prefix="nvmeof-include-")
    atexit.register(shutil.rmtree, d, True)
    with open(os.path.join(d, "nvmf_gpu.cuh"), "w", encoding="utf-8") as f:
        f.write(NVMF_GPU_CUH)
    return d
