"""GPU-issued random reads from a CuPy kernel: every GPU thread reads blocks itself.

The controller's I/O queues serve request rings (``Controller.gpu_rings``); a CuPy
``RawKernel`` that includes ``nvmf_gpu.cuh`` puts reads into them and waits for the data. The
script first writes the namespace's first ``--region`` bytes so that every block starts with
its own LBA, then runs the kernel for ``--seconds``: each thread reads random blocks and checks
each one's first word. It prints reads per second, bytes per second and any failures.

    nvmeof-targetd --listen tcp://127.0.0.1:4420 -n nqn.2026-11.io.example:gpu \\
        --namespace mem:1G,bs=512 --allow-any-host
    taskset -c 8-15 python3 gpu_issue.py --port 4420 --nqn nqn.2026-11.io.example:gpu --bs 512

Needs CuPy and a CUDA device of compute capability 7.0 or newer.
"""

import argparse
import time

import cupy
import numpy as np

import nvmeof

KERNEL = r"""
#include "nvmf_gpu.cuh"

__device__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// For `duration_ns` (on %globaltimer), each thread reads random `bytes`-sized blocks of ring
// namespace 0 below `region_blocks` into its own slot of `out` and checks that the first word
// is the read's LBA. counts[i]: reads done; bad[0]: failed reads; bad[1]: wrong data.
extern "C" __global__ void random_reads(const unsigned char* rings, unsigned char* out,
                                        unsigned long long* counts, unsigned int* bad,
                                        unsigned long long region_blocks, unsigned int blocks,
                                        unsigned int bytes, unsigned long long duration_ns,
                                        unsigned long long seed) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    const struct nvmf_gpu_ring* ring = nvmf_gpu_ring_for_warp((const struct nvmf_gpu_ring*)rings);
    unsigned long long x = seed ^ (0x9E3779B97F4A7C15ULL * (i + 1));
    unsigned char* dst = out + (unsigned long long)i * bytes;
    unsigned long long n = 0;
    unsigned int lanes = __activemask();
    unsigned long long deadline = now_ns() + duration_ns;
    // The warp's first lane decides for all (every lane of a warp-collective read takes part).
    while (__shfl_sync(lanes, now_ns() < deadline, __ffs(lanes) - 1)) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        unsigned long long lba = (x % (region_blocks / blocks)) * blocks;
        unsigned int st = nvmf_gpu_read_warp(ring, 0, lba, blocks, dst, bytes, 1000000000ULL);
        if (st != 0) {
            atomicAdd(&bad[0], 1u);
        } else if (*(const unsigned long long*)dst != lba) {
            atomicAdd(&bad[1], 1u);
        }
        n++;
    }
    counts[i] = n;
}
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--addr", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4420)
    p.add_argument("--nqn", default=nvmeof.DEFAULT_SUBNQN)
    p.add_argument("--nsid", type=int, default=1)
    p.add_argument("--bs", type=int, default=512, help="bytes per read")
    p.add_argument("--threads", type=int, default=1024, help="GPU threads, each one read at a time")
    p.add_argument("--rings", type=int, default=8)
    p.add_argument("--queues", type=int, default=8, help="I/O queues of the controller")
    p.add_argument("--region", type=int, default=1 << 30, help="bytes read at random")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--mode", default="pull", choices=["pull", "push"])
    a = p.parse_args()

    ctrl = nvmeof.connect(a.addr, a.port, a.nqn, queues=a.queues)
    ns = ctrl.namespace(a.nsid)
    lb = ns.block_size
    blocks = a.bs // lb
    region = min(a.region, ns.size) // a.bs * a.bs
    # Every block starts with its LBA (written 4 MiB at a time).
    chunk = 4 << 20
    for off in range(0, region, chunk):
        n = min(chunk, region - off) // lb
        buf = np.zeros((n, lb // 8), dtype=np.uint64)
        buf[:, 0] = np.arange(off // lb, off // lb + n, dtype=np.uint64)
        ns.write(buf.tobytes(), off)

    kernel = cupy.RawKernel(KERNEL, "random_reads", options=("-I" + nvmeof.include_dir(),))
    slots = 1 << max(5, (2 * a.threads // a.rings - 1).bit_length())
    with ctrl.gpu_rings([a.nsid], rings=a.rings, slots=min(slots, 4096), slot_bytes=max(a.bs, 512),
                        mode=a.mode) as rings:
        table = cupy.asarray(rings)
        out = cupy.zeros(a.threads * a.bs, dtype=cupy.uint8)
        counts = cupy.zeros(a.threads, dtype=cupy.uint64)
        bad = cupy.zeros(2, dtype=cupy.uint32)
        threads_per_block = min(a.threads, 128)
        grid = (a.threads + threads_per_block - 1) // threads_per_block
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        begin.record()
        kernel((grid,), (threads_per_block,),
               (table, out, counts, bad, cupy.uint64(region // lb), cupy.uint32(blocks),
                cupy.uint32(a.bs), cupy.uint64(int(a.seconds * 1e9)),
                cupy.uint64(0x5EED)))
        end.record()
        # Sleep through the run instead of spinning in the synchronize below: the controller's
        # threads that serve the rings need these cores.
        time.sleep(a.seconds)
        end.synchronize()
        secs = cupy.cuda.get_elapsed_time(begin, end) / 1e3
        reads = int(counts.sum())
        failed, wrong = (int(x) for x in cupy.asnumpy(bad))
    ctrl.close()
    print(f"{reads / secs / 1e6:.2f} M reads/s  {reads * a.bs / secs / 1e9:.2f} GB/s  "
          f"({reads} reads of {a.bs} B in {secs:.2f} s by {a.threads} GPU threads over "
          f"{a.rings} rings, {a.mode} mode; failed {failed}, wrong data {wrong})")
    if failed or wrong:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
