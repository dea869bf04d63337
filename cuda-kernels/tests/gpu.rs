//! Kernel tests. `nvrtc_*` tests need only libnvrtc; `gpu_*` tests need a CUDA driver and a GPU.
//! Each prints `SKIP <name>: skipped: ...` and passes when what it needs is missing (set
//! NVMEOF_GPU_REQUIRE=1 to make that a failure).

use gpu::{CodeTarget, GpuContext, GpuError, compile, ptx_isa_version, test_support::should_skip};
use nvmeof_cuda_kernels::checksum::{checksum, checksum_finalize};
use nvmeof_cuda_kernels::pattern::{pattern_vec, verify_pattern};
use nvmeof_cuda_kernels::ring;
use nvmeof_cuda_kernels::{
    ByteRange, CHUNK_SIZE, KernelError, KernelWorkspace, NvmfKernels, PatternRegion, ScatterCopy,
    scatter_source, verify_source,
};

struct Gpu {
    ctx: GpuContext,
    kernels: NvmfKernels,
    ws: KernelWorkspace,
}

fn setup(name: &str) -> Option<Gpu> {
    let ctx = match GpuContext::new(0) {
        Ok(ctx) => ctx,
        Err(e) if should_skip(name, &e) => return None,
        Err(e) => panic!("{name}: cannot open GPU 0: {e}"),
    };
    let kernels = match NvmfKernels::load(&ctx) {
        Ok(k) => k,
        Err(KernelError::Gpu(e)) if should_skip(name, &e) => return None,
        Err(e) => panic!("{name}: loading kernels failed: {e}"),
    };
    let stream = ctx.new_stream().unwrap();
    let ws = KernelWorkspace::new(&stream).unwrap();
    Some(Gpu { ctx, kernels, ws })
}

#[test]
fn nvrtc_compiles_both_kernels() {
    let name = "nvrtc_compiles_both_kernels";
    let archs = match gpu::nvrtc_supported_archs() {
        Ok(a) => a,
        Err(e) if should_skip(name, &e) => return,
        Err(e) => panic!("{e}"),
    };
    let version = gpu::nvrtc_version().unwrap();
    println!("NVRTC {version:?}, architectures {archs:?}");
    assert!(archs.contains(&90), "NVRTC without sm_90: {archs:?}");
    for (src, file) in [
        (scatter_source(), "nvmf_scatter.cu"),
        (verify_source(), "nvmf_verify.cu"),
    ] {
        let cubin = compile(&src, file, CodeTarget::Cubin { arch: 90 }, &["-lineinfo"])
            .unwrap_or_else(|e| panic!("{file} sm_90: {e}"));
        assert!(cubin.image_len() > 0 && cubin.ptx().is_none());
        let ptx = compile(&src, file, CodeTarget::Ptx { arch: 90 }, &[])
            .unwrap_or_else(|e| panic!("{file} compute_90: {e}"));
        let text = ptx.ptx().unwrap();
        let isa = ptx_isa_version(text).unwrap();
        println!(
            "{file}: sm_90 CUBIN {} bytes, compute_90 PTX {} bytes, PTX ISA {}.{}{}",
            cubin.image_len(),
            ptx.image_len(),
            isa.0,
            isa.1,
            if cubin.log().is_empty() {
                String::new()
            } else {
                format!(", log: {}", cubin.log())
            }
        );
        for k in [
            "nvmf_scatter",
            "nvmf_fill_pattern",
            "nvmf_verify_pattern",
            "nvmf_checksum",
        ] {
            if src.contains(&format!("void {k}(")) {
                assert!(text.contains(&format!(".entry {k}(")), "{k} missing in PTX");
            }
        }
        if version == (13, 0) {
            // What CUDA 13.0 drivers (580) accept.
            assert_eq!(isa, (9, 0));
        }
    }
    assert!(matches!(
        compile(
            "__global__ void broken( {",
            "broken.cu",
            CodeTarget::Ptx { arch: 90 },
            &[]
        ),
        Err(GpuError::Compile { .. })
    ));
}

#[test]
fn nvrtc_compiles_ring_header() {
    let name = "nvrtc_compiles_ring_header";
    if let Err(e) = gpu::nvrtc_supported_archs() {
        if should_skip(name, &e) {
            return;
        }
        panic!("{e}");
    }
    let example = ring::header_example();
    for (src, file, entries) in [
        (
            example.as_str(),
            "nvmf_gpu_example.cu",
            &["read_blocks"][..],
        ),
        (ring::PUSH_CU, "nvmf_ring_push.cu", &["nvmf_ring_push"][..]),
    ] {
        for target in [CodeTarget::Cubin { arch: 90 }, CodeTarget::Ptx { arch: 90 }] {
            let image = ring::compile_with_ring_header(src, file, target, &["-lineinfo"])
                .unwrap_or_else(|e| panic!("{file} {target:?}: {e}"));
            assert!(image.image_len() > 0);
            if let Some(ptx) = image.ptx() {
                for k in entries {
                    assert!(ptx.contains(&format!(".entry {k}(")), "{k} missing in PTX");
                }
                // The protocol's memory operations are the system-scope ones.
                assert!(
                    ptx.contains("st.relaxed.sys"),
                    "{file}: no system-scope store"
                );
                if file == "nvmf_gpu_example.cu" {
                    assert!(ptx.contains("ld.acquire.sys"), "{file}: no acquire load");
                    assert!(ptx.contains("%globaltimer"), "no %globaltimer");
                    assert!(ptx.contains("%smid"), "no %smid");
                    assert!(ptx.contains("atom.global.add.u64") || ptx.contains("atom.add.u64"));
                }
            }
            println!("{file} {target:?}: {} bytes", image.image_len());
        }
    }
    // The header alone (no kernel) and twice (include guard) compiles too.
    let twice = format!("#include \"{0}\"\n#include \"{0}\"\n", ring::HEADER_NAME);
    ring::compile_with_ring_header(&twice, "twice.cu", CodeTarget::Ptx { arch: 90 }, &[])
        .unwrap_or_else(|e| panic!("header twice: {e}"));
}

#[test]
fn gpu_kernels_load_as_cubin_and_as_ptx() {
    let name = "gpu_kernels_load_as_cubin_and_as_ptx";
    let Some(mut g) = setup(name) else { return };
    println!("default build: {:?}", g.kernels.build_info());
    let arch = g.ctx.info().arch();
    let ptx = NvmfKernels::load_for(&g.ctx, CodeTarget::Ptx { arch }).unwrap();
    println!("PTX build (driver JIT): {:?}", ptx.build_info());
    // The PTX-built kernels work too.
    let mut staging = g.ctx.alloc(8192).unwrap();
    staging.copy_from_host(&pattern_vec(1, 4096, 8192)).unwrap();
    let mut dst = g.ctx.alloc_zeroed(8200).unwrap();
    let copies = [
        ScatterCopy {
            src_offset: 0,
            dst_offset: 4101,
            len: 4096,
        },
        ScatterCopy {
            src_offset: 4096,
            dst_offset: 3,
            len: 4096,
        },
    ];
    ptx.scatter(
        &mut g.ws,
        &staging.as_slice(),
        &mut dst.as_slice_mut(),
        &copies,
    )
    .unwrap();
    let regions = [
        PatternRegion {
            offset: 4101,
            ns_offset: 4096,
            len: 4096,
        },
        PatternRegion {
            offset: 3,
            ns_offset: 8192,
            len: 4096,
        },
    ];
    let report = ptx
        .verify_pattern(&mut g.ws, &dst.as_slice(), &regions, 1)
        .unwrap();
    assert!(report.is_ok(), "{report:?}");
}

/// Scatters `count` blocks of `size` bytes from a staging buffer to shuffled destinations, with
/// the source and destination offsets congruent to `src_mod` / `dst_mod` modulo 16, then checks
/// the result on the GPU (verify kernel) and on the host (every byte, gaps included).
fn scatter_case(g: &mut Gpu, size: u64, count: u64, src_mod: u64, dst_mod: u64) {
    const SEED: u64 = 0xC0FF_EE00_D15E_A5E5;
    const GAP_BYTE: u8 = 0xA5;
    let src_stride = size + 16;
    let dst_stride = size + 32;
    let ns_of = |i: u64| (i * 7 + 3) * size;
    let mut staging_host = vec![0u8; (count * src_stride + 16) as usize];
    let mut copies = Vec::new();
    let mut regions = Vec::new();
    for i in 0..count {
        let src_offset = i * src_stride + src_mod;
        staging_host[src_offset as usize..(src_offset + size) as usize]
            .copy_from_slice(&pattern_vec(SEED, ns_of(i), size as usize));
        let slot = count - 1 - i; // reverse order
        let dst_offset = slot * dst_stride + dst_mod;
        copies.push(ScatterCopy {
            src_offset,
            dst_offset,
            len: size,
        });
        regions.push(PatternRegion {
            offset: dst_offset,
            ns_offset: ns_of(i),
            len: size,
        });
    }
    let mut staging = g.ctx.alloc(staging_host.len()).unwrap();
    staging.copy_from_host(&staging_host).unwrap();
    let dst_len = (count * dst_stride + 16) as usize;
    let mut dst = g.ctx.alloc(dst_len).unwrap();
    dst.as_slice_mut().fill(GAP_BYTE).unwrap();

    g.kernels
        .scatter(
            &mut g.ws,
            &staging.as_slice(),
            &mut dst.as_slice_mut(),
            &copies,
        )
        .unwrap();
    let report = g
        .kernels
        .verify_pattern(&mut g.ws, &dst.as_slice(), &regions, SEED)
        .unwrap();
    assert!(
        report.is_ok(),
        "size {size} src%16={src_mod} dst%16={dst_mod}: GPU verify {report:?}"
    );

    let host = dst.to_vec().unwrap();
    let mut expected_owner = vec![usize::MAX; dst_len];
    for (i, r) in regions.iter().enumerate() {
        let got = &host[r.offset as usize..(r.offset + r.len) as usize];
        let cpu = verify_pattern(SEED, r.ns_offset, got);
        assert!(
            cpu.is_ok(),
            "size {size} src%16={src_mod} dst%16={dst_mod} block {i}: CPU verify {cpu:?}"
        );
        expected_owner[r.offset as usize..(r.offset + r.len) as usize].fill(i);
    }
    let stray = host
        .iter()
        .zip(&expected_owner)
        .position(|(&b, &o)| o == usize::MAX && b != GAP_BYTE);
    assert_eq!(stray, None, "byte written outside every destination");
}

#[test]
fn gpu_scatter_sizes_aligned_and_unaligned() {
    let Some(mut g) = setup("gpu_scatter_sizes_aligned_and_unaligned") else {
        return;
    };
    // (source offset mod 16, destination offset mod 16): vector path, 4-byte path, funnel-shift
    // path, equally misaligned.
    let alignments = [(0, 0), (4, 0), (3, 7), (5, 5), (1, 15)];
    for (size, count) in [
        (512u64, 16u64),
        (4096, 16),
        (128 * 1024, 8),
        (1 << 20, 4),
        (16 << 20, 2),
    ] {
        for &(s, d) in &alignments {
            scatter_case(&mut g, size, count, s, d);
        }
        println!("scatter {size} B x {count}: ok for (src%16, dst%16) in {alignments:?}");
    }
}

#[test]
fn gpu_scatter_many_blocks_and_throughput() {
    let Some(mut g) = setup("gpu_scatter_many_blocks_and_throughput") else {
        return;
    };
    const SEED: u64 = 77;
    for (block, count, shuffled) in [
        (4096u64, 4096u64, true),
        (4096, 4096, false),
        (512, 8192, true),
        (512, 8192, false),
        (16 << 20, 4, true),
    ] {
        let total = block * count;
        let mut staging = g.ctx.alloc(total as usize).unwrap();
        let fill = [PatternRegion {
            offset: 0,
            ns_offset: 0,
            len: total,
        }];
        g.kernels
            .fill_pattern(&mut g.ws, &mut staging.as_slice_mut(), &fill, SEED)
            .unwrap();
        // Destination slot of block i: in order, or a fixed permutation (odd multiplier,
        // power-of-two count); every block 3 bytes off alignment.
        let stride = block + 8;
        let mut dst = g.ctx.alloc((count * stride + 8) as usize).unwrap();
        let perm = |i: u64| {
            if shuffled {
                (i * 2_654_435_761) % count
            } else {
                i
            }
        };
        let mut copies = Vec::new();
        let mut regions = Vec::new();
        for i in 0..count {
            let slot = perm(i);
            copies.push(ScatterCopy {
                src_offset: i * block,
                dst_offset: slot * stride + 3,
                len: block,
            });
            regions.push(PatternRegion {
                offset: slot * stride + 3,
                ns_offset: i * block,
                len: block,
            });
        }
        let stream = g.ws.stream().clone();
        // Warm-up, then timed back-to-back calls (host validation, work-list upload and the
        // kernel all count: the GPU idles while the host prepares the next call).
        g.kernels
            .scatter(
                &mut g.ws,
                &staging.as_slice(),
                &mut dst.as_slice_mut(),
                &copies,
            )
            .unwrap();
        g.ws.synchronize().unwrap();
        const ITERS: u32 = 20;
        let wall = std::time::Instant::now();
        let start = stream.record_event().unwrap();
        for _ in 0..ITERS {
            g.kernels
                .scatter(
                    &mut g.ws,
                    &staging.as_slice(),
                    &mut dst.as_slice_mut(),
                    &copies,
                )
                .unwrap();
        }
        let end = stream.record_event().unwrap();
        end.synchronize().unwrap();
        let wall_ms = wall.elapsed().as_secs_f64() * 1e3 / f64::from(ITERS);
        let ms = f64::from(start.elapsed_ms(&end).unwrap()) / f64::from(ITERS);
        let report = g
            .kernels
            .verify_pattern(&mut g.ws, &dst.as_slice(), &regions, SEED)
            .unwrap();
        assert!(report.is_ok(), "{block} x {count}: {report:?}");
        println!(
            "scatter {count} x {block} B ({} MiB) to unaligned {} offsets: {ms:.3} ms per call on the stream ({:.1} GB/s copied), {wall_ms:.3} ms per call on the host",
            total >> 20,
            if shuffled { "shuffled" } else { "ascending" },
            total as f64 / (ms * 1e6)
        );
    }
}

#[test]
fn gpu_verify_detects_corruption() {
    let Some(mut g) = setup("gpu_verify_detects_corruption") else {
        return;
    };
    const SEED: u64 = 5;
    let len = (1u64 << 20) + 100;
    let mut buf = g.ctx.alloc_zeroed(len as usize + 16).unwrap();
    // Region A: buffer offset 3, namespace offset 4096*5+1: device address and namespace offset
    // differ modulo 8 (byte path). Region B: offset 9 mod 8 == ns 1 mod 8 (word path).
    let a = PatternRegion {
        offset: 3,
        ns_offset: 4096 * 5 + 1,
        len: 1 << 19,
    };
    let b = PatternRegion {
        offset: 3 + (1 << 19) + 6,
        ns_offset: 1 << 30 | 1,
        len: len - (1 << 19) - 6,
    };
    assert_ne!(a.offset % 8, a.ns_offset % 8);
    assert_eq!(b.offset % 8, b.ns_offset % 8);
    g.kernels
        .fill_pattern(&mut g.ws, &mut buf.as_slice_mut(), &[a, b], SEED)
        .unwrap();
    let clean = g
        .kernels
        .verify_pattern(&mut g.ws, &buf.as_slice(), &[a, b], SEED)
        .unwrap();
    assert!(clean.is_ok(), "{clean:?}");

    let flips = [
        a.offset + 100,
        a.offset + a.len - 1,
        b.offset + 5000,
        b.offset + b.len - 1,
    ];
    for &at in &flips {
        let mut one = buf.slice_mut(at as usize..at as usize + 1).unwrap();
        let old = one.as_slice().to_vec().unwrap()[0];
        one.copy_from_host(&[old ^ 0x81]).unwrap();
    }
    let report = g
        .kernels
        .verify_pattern(&mut g.ws, &buf.as_slice(), &[a, b], SEED)
        .unwrap();
    assert_eq!(report.mismatched_bytes, 4, "{report:?}");
    assert_eq!(report.first_mismatch, Some(a.offset + 100));
    let only_b = g
        .kernels
        .verify_pattern(&mut g.ws, &buf.as_slice(), &[b], SEED)
        .unwrap();
    assert_eq!(only_b.mismatched_bytes, 2);
    assert_eq!(only_b.first_mismatch, Some(b.offset + 5000));
    // The CPU verifier agrees.
    let host = buf.to_vec().unwrap();
    let cpu = verify_pattern(
        SEED,
        b.ns_offset,
        &host[b.offset as usize..(b.offset + b.len) as usize],
    );
    assert_eq!(cpu.mismatched_bytes, 2);
    assert_eq!(cpu.first_mismatch, Some(5000));
    // Wrong seed / shifted namespace offset: nearly everything mismatches.
    let wrong = g
        .kernels
        .verify_pattern(&mut g.ws, &buf.as_slice(), &[a], SEED + 1)
        .unwrap();
    assert!(wrong.mismatched_bytes > a.len * 9 / 10, "{wrong:?}");
    let shifted = PatternRegion {
        ns_offset: a.ns_offset + 512,
        ..a
    };
    let wrong = g
        .kernels
        .verify_pattern(&mut g.ws, &buf.as_slice(), &[shifted], SEED)
        .unwrap();
    assert!(wrong.mismatched_bytes > a.len * 9 / 10, "{wrong:?}");
}

#[test]
fn gpu_fill_and_checksum_match_cpu() {
    let Some(mut g) = setup("gpu_fill_and_checksum_match_cpu") else {
        return;
    };
    const SEED: u64 = 0xDEAD_BEEF;
    let size = (3u64 << 20) + 77;
    let mut buf = g.ctx.alloc_zeroed(size as usize).unwrap();
    let regions = [
        PatternRegion {
            offset: 1,
            ns_offset: 7,
            len: 100,
        },
        PatternRegion {
            offset: 200,
            ns_offset: 512 * 1000,
            len: CHUNK_SIZE * 3 + 5,
        },
        PatternRegion {
            offset: 200 + CHUNK_SIZE * 3 + 5 + 11,
            ns_offset: 12_345,
            len: 2 << 20,
        },
    ];
    g.kernels
        .fill_pattern(&mut g.ws, &mut buf.as_slice_mut(), &regions, SEED)
        .unwrap();
    let host = buf.to_vec().unwrap();
    let mut expected = vec![0u8; size as usize];
    for r in &regions {
        expected[r.offset as usize..(r.offset + r.len) as usize].copy_from_slice(&pattern_vec(
            SEED,
            r.ns_offset,
            r.len as usize,
        ));
    }
    assert!(host == expected, "GPU fill differs from the CPU pattern");

    let ranges = [
        ByteRange { offset: 0, len: 0 },
        ByteRange { offset: 1, len: 1 },
        ByteRange { offset: 3, len: 13 },
        ByteRange {
            offset: 8,
            len: 4096,
        },
        ByteRange {
            offset: 5,
            len: CHUNK_SIZE * 2 + 3,
        },
        ByteRange {
            offset: 0,
            len: size,
        },
        ByteRange {
            offset: 200,
            len: size - 200,
        },
    ];
    let gpu_sums = g
        .kernels
        .checksums(&mut g.ws, &buf.as_slice(), &ranges)
        .unwrap();
    for (r, &got) in ranges.iter().zip(&gpu_sums) {
        let want = checksum(&host[r.offset as usize..(r.offset + r.len) as usize]);
        assert_eq!(got, want, "checksum of {r:?}");
    }
    assert_eq!(gpu_sums[0], checksum_finalize(0, 0));
    // Many small ranges at once (more outputs than the initial result buffer holds).
    let many: Vec<ByteRange> = (0..2000)
        .map(|i| ByteRange {
            offset: i * 1000 + (i % 7),
            len: 512 + (i % 13),
        })
        .collect();
    let sums = g
        .kernels
        .checksums(&mut g.ws, &buf.as_slice(), &many)
        .unwrap();
    for (r, &got) in many.iter().zip(&sums) {
        assert_eq!(
            got,
            checksum(&host[r.offset as usize..(r.offset + r.len) as usize])
        );
    }
}

#[test]
fn gpu_kernel_wrappers_reject_bad_input() {
    let Some(mut g) = setup("gpu_kernel_wrappers_reject_bad_input") else {
        return;
    };
    let staging = g.ctx.alloc(4096).unwrap();
    let mut dst = g.ctx.alloc_zeroed(4096).unwrap();
    let oob = [ScatterCopy {
        src_offset: 0,
        dst_offset: 1,
        len: 4096,
    }];
    assert!(matches!(
        g.kernels.scatter(
            &mut g.ws,
            &staging.as_slice(),
            &mut dst.as_slice_mut(),
            &oob
        ),
        Err(KernelError::DestinationOutOfBounds { index: 0, .. })
    ));
    let overlap = [
        ScatterCopy {
            src_offset: 0,
            dst_offset: 0,
            len: 100,
        },
        ScatterCopy {
            src_offset: 0,
            dst_offset: 99,
            len: 100,
        },
    ];
    assert!(matches!(
        g.kernels.scatter(
            &mut g.ws,
            &staging.as_slice(),
            &mut dst.as_slice_mut(),
            &overlap
        ),
        Err(KernelError::OverlappingWrites { .. })
    ));
    // Nothing was written by the rejected calls.
    g.ws.synchronize().unwrap();
    assert!(dst.to_vec().unwrap().iter().all(|&b| b == 0));
    let region = [PatternRegion {
        offset: 4000,
        ns_offset: 0,
        len: 100,
    }];
    assert!(matches!(
        g.kernels
            .verify_pattern(&mut g.ws, &dst.as_slice(), &region, 1),
        Err(KernelError::RegionOutOfBounds { .. })
    ));
    // Empty work is fine.
    let report = g
        .kernels
        .verify_pattern(&mut g.ws, &dst.as_slice(), &[], 1)
        .unwrap();
    assert!(report.is_ok());
    g.kernels
        .scatter(&mut g.ws, &staging.as_slice(), &mut dst.as_slice_mut(), &[])
        .unwrap();
}

#[test]
fn gpu_scatter_exact_fit_edges() {
    let Some(mut g) = setup("gpu_scatter_exact_fit_edges") else {
        return;
    };
    // Odd block lengths, sources and destinations that end exactly at the end of their
    // (exact-size) allocations, views that start at unaligned offsets: the kernel must read and
    // write only inside its buffers (run under compute-sanitizer memcheck to see that).
    for lens in [
        vec![1u64, 15, 16, 17, 19, 20, 21, 31, 32, 33, 35, 36, 37],
        vec![4099, 4099, 4099],
        vec![8192 * 3 + 5, 1, 8191],
    ] {
        let total: u64 = lens.iter().sum();
        for src_skip in [0u64, 1, 2, 3, 4, 5] {
            let data = pattern_vec(11, 0, (total + src_skip) as usize);
            let mut staging = g.ctx.alloc((total + src_skip) as usize).unwrap();
            staging.copy_from_host(&data).unwrap();
            let src = staging.slice(src_skip as usize..).unwrap();
            let dst_skip = 7u64;
            let mut dst = g.ctx.alloc((total + dst_skip) as usize).unwrap();
            dst.as_slice_mut().fill(0).unwrap();
            let mut dst_view = dst.slice_mut(dst_skip as usize..).unwrap();
            // Blocks land in reverse order, packed; the last source block ends at the end of
            // the allocation, the first destination block ends at the end of the other.
            let mut copies = Vec::new();
            let mut src_off = 0;
            let mut dst_end = total;
            for &len in &lens {
                dst_end -= len;
                copies.push(ScatterCopy {
                    src_offset: src_off,
                    dst_offset: dst_end,
                    len,
                });
                src_off += len;
            }
            g.kernels
                .scatter(&mut g.ws, &src, &mut dst_view, &copies)
                .unwrap();
            g.ws.synchronize().unwrap();
            let host = dst.to_vec().unwrap();
            assert!(host[..dst_skip as usize].iter().all(|&b| b == 0));
            for c in &copies {
                let want = &data[(src_skip + c.src_offset) as usize..][..c.len as usize];
                let got = &host[(dst_skip + c.dst_offset) as usize..][..c.len as usize];
                assert!(
                    want == got,
                    "lens {lens:?} src_skip {src_skip}: copy {c:?} differs"
                );
            }
        }
    }
}

#[test]
fn gpu_scatter_two_streams_one_destination() {
    let Some(g) = setup("gpu_scatter_two_streams_one_destination") else {
        return;
    };
    const SEED: u64 = 21;
    const BLOCK: u64 = 4096;
    const COUNT: u64 = 1024;
    let half = BLOCK * COUNT;
    let mut staging = g.ctx.alloc((2 * half) as usize).unwrap();
    staging
        .copy_from_host(&pattern_vec(SEED, 0, (2 * half) as usize))
        .unwrap();
    let mut dst = g.ctx.alloc((2 * half + 2) as usize).unwrap();
    let streams = [g.ctx.new_stream().unwrap(), g.ctx.new_stream().unwrap()];
    let mut workspaces = [
        KernelWorkspace::new(&streams[0]).unwrap(),
        KernelWorkspace::new(&streams[1]).unwrap(),
    ];
    {
        let whole = dst.slice_mut(1..(2 * half + 1) as usize).unwrap();
        let (left, right) = whole.split_at_mut(half as usize).unwrap();
        for (k, (mut view, ws)) in [left, right].into_iter().zip(&mut workspaces).enumerate() {
            // Each stream reverses the order of its half's blocks.
            let copies: Vec<ScatterCopy> = (0..COUNT)
                .map(|i| ScatterCopy {
                    src_offset: k as u64 * half + i * BLOCK,
                    dst_offset: (COUNT - 1 - i) * BLOCK,
                    len: BLOCK,
                })
                .collect();
            g.kernels
                .scatter(ws, &staging.as_slice(), &mut view, &copies)
                .unwrap();
        }
    }
    for ws in &workspaces {
        ws.synchronize().unwrap();
    }
    let regions: Vec<PatternRegion> = (0..2 * COUNT)
        .map(|j| {
            let (k, i) = (j / COUNT, j % COUNT);
            PatternRegion {
                offset: 1 + k * half + (COUNT - 1 - i) * BLOCK,
                ns_offset: k * half + i * BLOCK,
                len: BLOCK,
            }
        })
        .collect();
    let mut ws = KernelWorkspace::new(&streams[0]).unwrap();
    let report = g
        .kernels
        .verify_pattern(&mut ws, &dst.as_slice(), &regions, SEED)
        .unwrap();
    assert!(report.is_ok(), "{report:?}");
}

#[test]
fn gpu_scatter_staged_reads_mapped_memory_in_place() {
    let Some(g) = setup("gpu_scatter_staged_reads_mapped_memory_in_place") else {
        return;
    };
    let stream = g.ctx.new_stream().unwrap();
    let bs = 4096u64 + 3;
    let buffers = 64u64;
    let mut dst = g.ctx.alloc((bs * buffers) as usize).unwrap();
    dst.as_slice_mut().fill(0).unwrap();
    // Two stages used in turn, three rounds each: a stage comes back only after its kernel,
    // and what a later round packs never shows in an earlier round's destinations.
    let mut free = vec![
        g.kernels
            .new_stage((bs * buffers) as usize, buffers as usize)
            .unwrap(),
        g.kernels
            .new_stage((bs * buffers) as usize, buffers as usize)
            .unwrap(),
    ];
    let mut expect = vec![None; buffers as usize];
    let mut flights = Vec::new();
    for round in 0..6u64 {
        let mut stage = free.pop().unwrap_or_else(|| {
            let f: nvmeof_cuda_kernels::StageFlight = flights.remove(0);
            f.finish().unwrap()
        });
        // This round's buffers, packed in a shuffled order.
        let ids: Vec<u64> = (0..buffers / 2)
            .map(|k| (k * 37 + round * 5) % buffers)
            .collect();
        let mut copies = Vec::new();
        for (k, &id) in ids.iter().enumerate() {
            let ns = (round * 1000 + id) * bs;
            let at = k * bs as usize;
            stage.data_mut()[at..at + bs as usize].copy_from_slice(&pattern_vec(
                5,
                ns,
                bs as usize,
            ));
            copies.push(ScatterCopy {
                src_offset: at as u64,
                dst_offset: id * bs,
                len: bs,
            });
            expect[id as usize] = Some(ns);
        }
        let flight = g
            .kernels
            .scatter_staged(&stream, stage, &mut dst.as_slice_mut(), &copies)
            .map_err(|r| r.error)
            .unwrap();
        flights.push(flight);
    }
    for mut f in flights {
        while !f.is_done().unwrap() {
            std::thread::yield_now();
        }
        let stage = f.finish().unwrap();
        assert_eq!(stage.copies(), buffers as usize);
    }
    let regions: Vec<PatternRegion> = expect
        .iter()
        .enumerate()
        .filter_map(|(id, ns)| {
            ns.map(|ns| PatternRegion {
                offset: id as u64 * bs,
                ns_offset: ns,
                len: bs,
            })
        })
        .collect();
    let host = dst.to_vec().unwrap();
    for r in &regions {
        let got = &host[r.offset as usize..][..r.len as usize];
        assert!(
            verify_pattern(5, r.ns_offset, got).is_ok(),
            "buffer at {} holds the wrong round's block",
            r.offset
        );
    }

    // Bad batches come back with the stage and nothing enqueued.
    let stage = g.kernels.new_stage(1024, 2).unwrap();
    let too_many = vec![
        ScatterCopy {
            src_offset: 0,
            dst_offset: 0,
            len: 1,
        };
        3
    ];
    let r = g
        .kernels
        .scatter_staged(&stream, stage, &mut dst.as_slice_mut(), &too_many)
        .unwrap_err();
    let (e, stage) = (r.error, r.stage);
    assert!(
        matches!(e, KernelError::StageFull { copies: 3, room: 2 }),
        "{e}"
    );
    let outside = [ScatterCopy {
        src_offset: 1000,
        dst_offset: 0,
        len: 100,
    }];
    let e = g
        .kernels
        .scatter_staged(&stream, stage, &mut dst.as_slice_mut(), &outside)
        .unwrap_err()
        .error;
    assert!(matches!(e, KernelError::SourceOutOfBounds { .. }), "{e}");
}

#[test]
fn gpu_scatter_chunks_reads_the_parts_received_into_in_place() {
    let Some(g) = setup("gpu_scatter_chunks_reads_the_parts_received_into_in_place") else {
        return;
    };
    let stream = g.ctx.new_stream().unwrap();
    let bs = 4096usize + 3;
    let buffers = 64usize;
    let mut dst = g.ctx.alloc(bs * buffers).unwrap();
    dst.as_slice_mut().fill(0).unwrap();
    // One part per buffer of one mapped allocation, each always scattered to its buffer's
    // place; every round, the parts not in flight are written while the others are read.
    let region = g.ctx.alloc_pinned_mapped(bs * buffers).unwrap();
    let mut parts: Vec<Option<gpu::PinnedChunk>> = region
        .into_host()
        .unwrap()
        .into_chunks(bs)
        .unwrap()
        .into_iter()
        .map(Some)
        .collect();
    let mut stages = vec![
        g.kernels.new_stage(0, buffers).unwrap(),
        g.kernels.new_stage(0, buffers).unwrap(),
    ];
    let mut expect = vec![None; buffers];
    let mut flights: Vec<(nvmeof_cuda_kernels::ChunkFlight, Vec<usize>)> = Vec::new();
    for round in 0..6usize {
        let stage = match stages.pop() {
            Some(s) => s,
            None => {
                let (f, ids) = flights.remove(0);
                let (stage, back) = f.finish().unwrap();
                for (id, c) in ids.into_iter().zip(back) {
                    assert_eq!(c.offset(), id * bs, "a part came back to the wrong buffer");
                    parts[id] = Some(c);
                }
                stage
            }
        };
        // This round's buffers, among those not in flight, in a shuffled order.
        let ids: Vec<usize> = (0..buffers)
            .map(|k| (k * 37 + round * 5) % buffers)
            .filter(|&id| parts[id].is_some())
            .take(buffers / 4)
            .collect();
        let mut chunks = Vec::new();
        let mut offsets = Vec::new();
        for &id in &ids {
            let ns = ((round * 1000 + id) * bs) as u64;
            let mut c = parts[id].take().unwrap();
            c.as_mut_slice().copy_from_slice(&pattern_vec(5, ns, bs));
            chunks.push(c);
            offsets.push((id * bs) as u64);
            expect[id] = Some(ns);
        }
        let flight = g
            .kernels
            .scatter_chunks(&stream, stage, chunks, &mut dst.as_slice_mut(), &offsets)
            .map_err(|r| r.error)
            .unwrap();
        flights.push((flight, ids));
    }
    for (mut f, _) in flights {
        while !f.is_done().unwrap() {
            std::thread::yield_now();
        }
        let (stage, _) = f.finish().unwrap();
        assert_eq!(stage.copies(), buffers);
    }
    let host = dst.to_vec().unwrap();
    for (id, ns) in expect.iter().enumerate() {
        let got = &host[id * bs..][..bs];
        match ns {
            Some(ns) => assert!(
                verify_pattern(5, *ns, got).is_ok(),
                "buffer {id} holds the wrong round's block"
            ),
            None => assert!(got.iter().all(|&b| b == 0), "buffer {id} written"),
        }
    }

    // Bad batches come back with the stage and the chunks, nothing enqueued.
    let two = g
        .ctx
        .alloc_pinned_mapped(2 * bs)
        .unwrap()
        .into_host()
        .unwrap()
        .into_chunks(bs)
        .unwrap();
    let stage = g.kernels.new_stage(0, 1).unwrap();
    let r = g
        .kernels
        .scatter_chunks(
            &stream,
            stage,
            two,
            &mut dst.as_slice_mut(),
            &[0, bs as u64],
        )
        .unwrap_err();
    assert!(
        matches!(r.error, KernelError::StageFull { copies: 2, room: 1 }),
        "{}",
        r.error
    );
    let (stage, mut two) = (r.stage, r.chunks);
    assert_eq!(two.len(), 2);
    let r = g
        .kernels
        .scatter_chunks(&stream, stage, two, &mut dst.as_slice_mut(), &[0])
        .unwrap_err();
    assert!(
        matches!(
            r.error,
            KernelError::ChunkCount {
                chunks: 2,
                offsets: 1
            }
        ),
        "{}",
        r.error
    );
    let (stage, back) = (r.stage, r.chunks);
    two = back;
    let other = g
        .ctx
        .alloc_pinned_mapped(bs)
        .unwrap()
        .into_host()
        .unwrap()
        .into_chunks(bs)
        .unwrap();
    let mixed = vec![two.pop().unwrap(), other.into_iter().next().unwrap()];
    let r = g
        .kernels
        .scatter_chunks(&stream, stage, mixed, &mut dst.as_slice_mut(), &[0, 0])
        .unwrap_err();
    assert!(
        matches!(r.error, KernelError::ChunksOfSeveralRegions),
        "{}",
        r.error
    );
    let plain = g
        .ctx
        .alloc_pinned(bs)
        .unwrap()
        .into_host()
        .unwrap()
        .into_chunks(bs)
        .unwrap();
    let r = g
        .kernels
        .scatter_chunks(&stream, r.stage, plain, &mut dst.as_slice_mut(), &[0])
        .unwrap_err();
    assert!(matches!(r.error, KernelError::NotMapped), "{}", r.error);
    let r = g
        .kernels
        .scatter_chunks(
            &stream,
            r.stage,
            two,
            &mut dst.as_slice_mut(),
            &[bs as u64 * buffers as u64],
        )
        .unwrap_err();
    assert!(
        matches!(r.error, KernelError::DestinationOutOfBounds { .. }),
        "{}",
        r.error
    );
}
