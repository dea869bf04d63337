"""NVMe-over-Fabrics namespaces from Python, through the nvmeof-direct initiator.

Offsets and lengths are in bytes and must be multiples of the namespace's block size.
Blocking calls release the GIL. A Controller belongs to the process that connected it: in a
forked child, connect again (``Spec`` is picklable; ``spec.connect()`` in each worker).

``nvmeof.torch`` (imported on its own, it needs PyTorch) has datasets for data loaders.
"""

from ._nvmeof import (
    DEFAULT_SUBNQN,
    GPU_DESTINATIONS,
    ConnectionError,
    Controller,
    Error,
    Namespace,
    NvmeError,
    Spec,
    attach,
    connect,
)

__all__ = [
    "DEFAULT_SUBNQN",
    "GPU_DESTINATIONS",
    "ConnectionError",
    "Controller",
    "Error",
    "Namespace",
    "NvmeError",
    "Spec",
    "attach",
    "connect",
]
