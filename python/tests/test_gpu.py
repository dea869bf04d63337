"""Reads into CUDA memory (PyTorch CUDA tensors, CuPy arrays) against a real nvmeof-targetd.

Skipped where PyTorch has no CUDA device; the CuPy tests also where CuPy is missing. Run on a
GPU machine with python/tests/run-gpu.sh.
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device for PyTorch", allow_module_level=True)

import nvmeof  # noqa: E402
import nvmeof.torch as nt  # noqa: E402

MiB = 1 << 20


def put(ns, offset, size):
    data = os.urandom(size)
    ns.write(data, offset)
    return data


def host(t):
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def test_read_into_torch_tensors(ns):
    data = put(ns, 0, 4 * MiB + 8192)  # larger than a staging slot (1 MiB)
    t = torch.zeros(len(data), dtype=torch.uint8, device="cuda")
    assert ns.read_into(t, 0) == len(data)
    assert host(t) == data
    f = torch.zeros((4, 1024), dtype=torch.float32, device="cuda")  # 16 KiB, any item type
    ns.read_into(f, 4096)
    assert host(f) == data[4096:4096 + 16384]
    big = torch.zeros(3 * 8192, dtype=torch.uint8, device="cuda")
    ns.read_into(big[8192:16384], 0)  # a contiguous view at an offset
    assert host(big[8192:16384]) == data[:8192]
    assert not big[:8192].any() and not big[16384:].any()
    with pytest.raises(ValueError, match="contiguous"):
        ns.read_into(torch.zeros((4096, 2), dtype=torch.uint8, device="cuda")[:, 0], 0)
    with pytest.raises(ValueError, match="multiples of the block size"):
        ns.read_into(torch.zeros(100, dtype=torch.uint8, device="cuda"), 0)


def test_read_batch_into_cuda_and_host(ns):
    bs = 4096
    data = put(ns, 8 * MiB, 64 * bs)
    rows = torch.zeros((64, bs), dtype=torch.uint8, device="cuda")
    ns.read_batch([(8 * MiB + i * bs, bs, rows[i]) for i in range(64)])
    assert host(rows) == data
    mixed_host = bytearray(bs)
    mixed_dev = torch.zeros(2 * bs, dtype=torch.uint8, device="cuda")
    ns.read_batch([(8 * MiB, bs, mixed_host), (8 * MiB + bs, 2 * bs, mixed_dev)])
    assert bytes(mixed_host) == data[:bs] and host(mixed_dev) == data[bs:3 * bs]
    with pytest.raises(ValueError, match="overlap"):
        ns.read_batch([(0, bs, rows[0]), (bs, bs, rows[0])])


def test_read_records_into_cuda(ns):
    bs = 4096
    data = put(ns, 8 * MiB, 64 * bs)
    rows = torch.zeros((64, bs), dtype=torch.uint8, device="cuda")
    order = np.random.default_rng(3).permutation(64)
    assert ns.read_records(order.astype(np.uint64) * bs + 8 * MiB, bs, rows) == 64 * bs
    got = host(rows)
    assert all(got[k * bs:(k + 1) * bs] == data[i * bs:(i + 1) * bs]
               for k, i in enumerate(order))
    with pytest.raises(ValueError, match="fewer than"):
        ns.read_records([0, bs], bs, rows[0])


def test_waits_for_the_producers_stream(ns):
    """Work queued on the caller's stream before the read (a slow kernel, then a fill) ends
    before the read writes: the read's data is what remains."""
    data = put(ns, 12 * MiB, MiB)
    t = torch.zeros(MiB, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)  # a few hundred ms of GPU time
        t.fill_(7)
        ns.read_into(t, 12 * MiB)
    s.synchronize()
    assert host(t) == data


class OnlyDLPack:
    def __init__(self, t):
        self.t = t

    def __dlpack__(self, *args, **kw):
        return self.t.__dlpack__(*args, **kw)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


class OnlyCai:
    def __init__(self, t):
        self.__cuda_array_interface__ = t.__cuda_array_interface__


def test_dlpack_and_cai_v2(ns):
    data = put(ns, 0, 65536)
    t = torch.zeros(65536, dtype=torch.uint8, device="cuda")
    ns.read_into(OnlyDLPack(t), 0)
    assert host(t) == data
    t.zero_()
    ns.read_into(OnlyCai(t), 0)
    assert host(t) == data


def test_record_dataset_on_cuda(spec, ns):
    data = put(ns, 0, 32 * 4096)
    want = np.frombuffer(data, dtype=np.uint8).reshape(32, 4096)
    ds = nt.RecordDataset(spec, 4096, 32, device="cuda")
    r = ds[5]
    assert r.is_cuda and host(r) == want[5].tobytes()
    b = ds.__getitems__([3, 4, 5, 9])
    assert b.tensor.is_cuda and host(b.tensor) == want[[3, 4, 5, 9]].tobytes()
    from torch.utils.data import DataLoader
    got = torch.cat(list(DataLoader(ds, batch_size=8, collate_fn=nt.collate)))
    assert got.is_cuda and host(got) == data
    shards = nt.ShardIterable(spec, 4096, 32, records_per_read=5, device="cuda")
    assert b"".join(host(x) for x in shards) == data
    ds.close()
    shards.close()


cupy = None
try:
    import cupy  # noqa: F811
except ImportError:  # the CuPy tests skip
    pass


@pytest.mark.skipif(cupy is None, reason="CuPy is not installed")
def test_read_into_cupy_arrays(ns):
    data = put(ns, 0, 2 * MiB)
    a = cupy.zeros(2 * MiB, dtype=cupy.uint8)
    ns.read_into(a, 0)
    assert cupy.asnumpy(a).tobytes() == data
    f = cupy.zeros((8, 512), dtype=cupy.float64)
    ns.read_into(f, 0)
    assert cupy.asnumpy(f).tobytes() == data[:32768]
    rows = cupy.zeros((16, 4096), dtype=cupy.uint8)
    ns.read_batch([(i * 4096, 4096, rows[i]) for i in range(16)])
    assert cupy.asnumpy(rows).tobytes() == data[:16 * 4096]
    with pytest.raises(ValueError, match="contiguous"):
        ns.read_into(cupy.zeros((4096, 2), dtype=cupy.uint8)[:, 0], 0)


@pytest.mark.skipif(cupy is None, reason="CuPy is not installed")
def test_cupy_stream_is_honoured(ns):
    """CuPy's __cuda_array_interface__ (v3) names its current stream: work queued there
    first (a slow kernel, then a fill) ends before the read writes."""
    data = put(ns, 4 * MiB, MiB)
    a = cupy.zeros(MiB, dtype=cupy.uint8)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        with torch.cuda.stream(torch.cuda.ExternalStream(s.ptr)):
            torch.cuda._sleep(200_000_000)
        a.fill(7)
        assert a.__cuda_array_interface__.get("stream") == s.ptr
        ns.read_into(a, 4 * MiB)
    s.synchronize()
    assert cupy.asnumpy(a).tobytes() == data


READ_BLOCKS = r"""
#include "nvmf_gpu.cuh"

// Thread i reads `blocks` blocks at first_lba + i * blocks of ring namespace `ns` into
// out[i * bytes ...]; statuses[i] gets the NVMe status.
extern "C" __global__ void read_blocks(const unsigned char* rings, unsigned char* out,
                                       unsigned int* statuses, unsigned int n,
                                       unsigned int ns, unsigned long long first_lba,
                                       unsigned int blocks, unsigned int bytes) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    const struct nvmf_gpu_ring* ring = nvmf_gpu_ring_for_warp((const struct nvmf_gpu_ring*)rings);
    statuses[i] = nvmf_gpu_read_warp(ring, ns, first_lba + (unsigned long long)i * blocks, blocks,
                                     out + (unsigned long long)i * bytes, bytes, 5000000000ULL);
}
"""


@pytest.mark.skipif(cupy is None, reason="CuPy is not installed")
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_gpu_issued_reads_from_a_cupy_kernel(ctrl, ns, mode):
    """GPU threads of a CuPy RawKernel read 4 KiB blocks themselves through the controller's
    rings; an out-of-range read gets LBA Out of Range; closed rings refuse."""
    n, bs = 1024, 4096
    data = put(ns, 0, n * bs)
    kernel = cupy.RawKernel(READ_BLOCKS, "read_blocks",
                            options=("-I" + nvmeof.include_dir(),))
    with ctrl.gpu_rings([ns.nsid], rings=2, slots=512, mode=mode) as rings:
        assert (rings.nrings, rings.slots, rings.slot_bytes, rings.nsids) == (2, 512, 4096,
                                                                              [ns.nsid])
        table = cupy.asarray(rings)
        assert table.nbytes == rings.table_len and table.data.ptr == rings.table_ptr
        out = cupy.zeros(n * bs, dtype=cupy.uint8)
        st = cupy.full(n, 0xFFFF, dtype=cupy.uint32)
        blocks = bs // ns.block_size
        kernel(((n + 127) // 128,), (128,),
               (table, out, st, cupy.uint32(n), cupy.uint32(0), cupy.uint64(0),
                cupy.uint32(blocks), cupy.uint32(bs)))
        cupy.cuda.Device().synchronize()
        assert not cupy.asnumpy(st).any()
        assert cupy.asnumpy(out).tobytes() == data
        # The last block's neighbour lies past the end: the host answers LBA Out of Range
        # (0x0080) without sending anything.
        last = ns.size // ns.block_size - blocks
        kernel((1,), (2,), (table, out, st, cupy.uint32(2), cupy.uint32(0), cupy.uint64(last),
                            cupy.uint32(blocks), cupy.uint32(bs)))
        cupy.cuda.Device().synchronize()
        assert list(cupy.asnumpy(st[:2])) == [0, 0x0080]
    assert rings.closed
    with pytest.raises(nvmeof.Error, match="closed"):
        rings.table_ptr
    rings.close()  # twice is harmless


@pytest.mark.skipif(cupy is None, reason="CuPy is not installed")
def test_gpu_rings_bad_arguments(ctrl, ns):
    with pytest.raises(ValueError, match="mode"):
        ctrl.gpu_rings([ns.nsid], mode="sideways")
    with pytest.raises(ValueError, match="slots"):
        ctrl.gpu_rings([ns.nsid], slots=100)
    with pytest.raises(nvmeof.NvmeError):
        ctrl.gpu_rings([77])
    with pytest.raises(ValueError, match="namespace"):
        ctrl.gpu_rings([])
