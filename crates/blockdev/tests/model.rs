//! Every backend against a naive model: random sequences of reads, writes (some with Force
//! Unit Access), flushes, write zeroes and deallocates, some of them out of range. The volatile
//! cache is also checked for what its backend holds: everything after a Flush, FUA writes at
//! once.

mod common;

use blockdev::{
    Backend, BackendError, FileBackend, FileEngine, FileSpec, IoBuf, IoEngine, MemoryBackend,
    NullBackend, VolatileCache,
};
use common::{block_pattern, pattern_buf};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

#[derive(Debug, Clone)]
enum Cmd {
    Write {
        lba: u64,
        blocks: u64,
        seed: u8,
        fua: bool,
    },
    Read {
        lba: u64,
        blocks: u64,
    },
    Zeroes {
        lba: u64,
        blocks: u64,
    },
    Dealloc {
        lba: u64,
        blocks: u64,
    },
    Flush,
}

/// Commands whose LBAs reach a little past the end, so some are out of range.
fn cmds(num_blocks: u64, max_len: usize) -> impl Strategy<Value = Vec<Cmd>> {
    let lba = 0..num_blocks + 3;
    let cmd = prop_oneof![
        4 => (lba.clone(), 1u64..12, any::<u8>(), prop::bool::weighted(0.25))
            .prop_map(|(lba, blocks, seed, fua)| Cmd::Write { lba, blocks, seed, fua }),
        4 => (lba.clone(), 1u64..12).prop_map(|(lba, blocks)| Cmd::Read { lba, blocks }),
        2 => (lba.clone(), 0u64..24).prop_map(|(lba, blocks)| Cmd::Zeroes { lba, blocks }),
        2 => (lba, 0u64..24).prop_map(|(lba, blocks)| Cmd::Dealloc { lba, blocks }),
        1 => Just(Cmd::Flush),
    ];
    prop::collection::vec(cmd, 1..max_len)
}

/// What each block must read back as.
struct Model {
    block_size: usize,
    /// Current content of each block.
    blocks: Vec<Vec<u8>>,
    /// Deallocated since last written: may also read as zeros.
    maybe_zero: Vec<bool>,
    /// False for the null backend, which stores nothing.
    stores: bool,
}

impl Model {
    fn new(b: &impl Backend, stores: bool) -> Self {
        let bs = b.block_size() as usize;
        let n = b.num_blocks() as usize;
        Model {
            block_size: bs,
            blocks: vec![vec![0; bs]; n],
            maybe_zero: vec![false; n],
            stores,
        }
    }

    fn in_range(&self, lba: u64, blocks: u64) -> bool {
        lba + blocks <= self.blocks.len() as u64
    }
}

fn expect_range_error(
    res: Result<(), BackendError>,
    in_range: bool,
    what: &str,
) -> Result<bool, TestCaseError> {
    match (res, in_range) {
        (Ok(()), true) => Ok(true),
        (Err(BackendError::OutOfRange { .. }), false) => Ok(false),
        (other, _) => Err(TestCaseError::fail(format!(
            "{what}: in range {in_range}, got {other:?}"
        ))),
    }
}

async fn run(b: &impl Backend, model: &mut Model, cmds: &[Cmd]) -> Result<(), TestCaseError> {
    let bs = model.block_size;
    for cmd in cmds {
        match *cmd {
            Cmd::Write {
                lba,
                blocks,
                seed,
                fua,
            } => {
                let buf = pattern_buf(seed, lba, blocks, bs);
                let (res, back) = if fua {
                    b.write_fua(lba, buf).await
                } else {
                    b.write(lba, buf).await
                };
                prop_assert_eq!(back.len(), blocks as usize * bs);
                if expect_range_error(res, model.in_range(lba, blocks), "write")? && model.stores {
                    for i in 0..blocks {
                        let l = (lba + i) as usize;
                        model.blocks[l] = block_pattern(seed, lba + i, bs);
                        model.maybe_zero[l] = false;
                    }
                }
            }
            Cmd::Read { lba, blocks } => {
                let (res, buf) = b.read(lba, IoBuf::new(blocks as usize * bs)).await;
                if expect_range_error(res, model.in_range(lba, blocks), "read")? {
                    for i in 0..blocks as usize {
                        let l = lba as usize + i;
                        let got = &buf[i * bs..(i + 1) * bs];
                        let ok = got == &model.blocks[l][..]
                            || (model.maybe_zero[l] && got.iter().all(|&x| x == 0));
                        prop_assert!(ok, "block {} differs from the model", l);
                    }
                }
            }
            Cmd::Zeroes { lba, blocks } => {
                let res = b.write_zeroes(lba, blocks).await;
                if expect_range_error(res, model.in_range(lba, blocks), "write zeroes")?
                    && model.stores
                {
                    for l in lba..lba + blocks {
                        model.blocks[l as usize].fill(0);
                        model.maybe_zero[l as usize] = false;
                    }
                }
            }
            Cmd::Dealloc { lba, blocks } => {
                let res = b.deallocate(lba, blocks).await;
                if expect_range_error(res, model.in_range(lba, blocks), "deallocate")?
                    && model.stores
                {
                    for l in lba..lba + blocks {
                        if b.deallocate_reads_zeroes() {
                            model.blocks[l as usize].fill(0);
                        } else {
                            model.maybe_zero[l as usize] = true;
                        }
                    }
                }
            }
            Cmd::Flush => b
                .flush()
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?,
        }
    }
    // Finally every block must match.
    let n = model.blocks.len() as u64;
    let (res, buf) = b.read(0, IoBuf::new(n as usize * bs)).await;
    res.map_err(|e| TestCaseError::fail(e.to_string()))?;
    for l in 0..n as usize {
        let got = &buf[l * bs..(l + 1) * bs];
        prop_assert!(
            got == &model.blocks[l][..] || (model.maybe_zero[l] && got.iter().all(|&x| x == 0)),
            "block {} differs from the model at the end",
            l
        );
    }
    Ok(())
}

fn check_memory(
    block_size: u32,
    blocks: u64,
    chunk: usize,
    cmds: &[Cmd],
) -> Result<(), TestCaseError> {
    let b =
        MemoryBackend::with_chunk_size(blocks * u64::from(block_size), block_size, chunk).unwrap();
    let mut model = Model::new(&b, true);
    common::current_thread().block_on(run(&b, &mut model, cmds))?;
    // Chunks fully zeroed or deallocated are freed: never more than the namespace holds.
    prop_assert!(b.allocated_bytes() <= blocks * u64::from(block_size));
    Ok(())
}

fn check_file(
    dir: &str,
    block_size: u32,
    blocks: u64,
    engine: IoEngine,
    multi_thread: bool,
    cmds: &[Cmd],
) -> Result<(), TestCaseError> {
    let Ok(tmp) = tempfile::tempdir_in(dir) else {
        // Directory absent on this machine (e.g. no /dev/shm).
        return Ok(());
    };
    let spec = FileSpec {
        create_size: Some(blocks * u64::from(block_size)),
        block_size: Some(block_size),
        engine,
        ..FileSpec::new(tmp.path().join("ns.img"))
    };
    let b = FileBackend::open(&spec).map_err(|e| TestCaseError::fail(e.to_string()))?;
    if engine == IoEngine::Blocking {
        prop_assert_eq!(b.engine(), FileEngine::Blocking);
    }
    prop_assert_eq!(b.num_blocks(), blocks);
    let mut model = Model::new(&b, true);
    let rt = if multi_thread {
        common::multi_thread(2)
    } else {
        common::current_thread()
    };
    rt.block_on(run(&b, &mut model, cmds))
}

/// Checks that `inner` holds what the model says for blocks `range`.
async fn holds(
    inner: &MemoryBackend,
    model: &Model,
    range: std::ops::Range<u64>,
) -> Result<(), TestCaseError> {
    let bs = model.block_size;
    let n = (range.end - range.start) as usize;
    let (res, buf) = inner.read(range.start, IoBuf::new(n * bs)).await;
    res.map_err(|e| TestCaseError::fail(e.to_string()))?;
    for (i, got) in buf.chunks(bs).enumerate() {
        let l = range.start as usize + i;
        prop_assert!(
            got == &model.blocks[l][..] || (model.maybe_zero[l] && got.iter().all(|&x| x == 0)),
            "block {} is not durable",
            l
        );
    }
    Ok(())
}

/// A volatile cache of `cache_blocks` blocks over a memory namespace: it reads like the model,
/// stays within its size, and its backend holds every block after a Flush and a FUA write's
/// blocks as soon as it completes.
fn check_cache(cache_blocks: u64, cmds: &[Cmd]) -> Result<(), TestCaseError> {
    let (bs, blocks) = (512u64, 64u64);
    let inner = MemoryBackend::with_chunk_size(blocks * bs, bs as u32, 4096).unwrap();
    let b = VolatileCache::new(inner, cache_blocks * bs).unwrap();
    let mut model = Model::new(&b, true);
    common::current_thread().block_on(async {
        for cmd in cmds {
            run(&b, &mut model, std::slice::from_ref(cmd)).await?;
            prop_assert!(b.cached_blocks() as u64 <= cache_blocks);
            match *cmd {
                Cmd::Flush => holds(b.inner(), &model, 0..blocks).await?,
                Cmd::Write {
                    lba,
                    blocks: n,
                    fua: true,
                    ..
                } if lba + n <= blocks => holds(b.inner(), &model, lba..lba + n).await?,
                _ => {}
            }
        }
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn volatile_cache_small(cmds in cmds(64, 60)) {
        check_cache(6, &cmds)?;
    }

    #[test]
    fn volatile_cache_roomy(cmds in cmds(64, 60)) {
        check_cache(64, &cmds)?;
    }

    #[test]
    fn memory_512_small_chunks(cmds in cmds(64, 60)) {
        check_memory(512, 64, 4096, &cmds)?;
    }

    #[test]
    fn memory_4096(cmds in cmds(32, 60)) {
        check_memory(4096, 32, 16384, &cmds)?;
    }

    #[test]
    fn null_reads_zeros(cmds in cmds(64, 60)) {
        let b = NullBackend::new(64 * 512, 512).unwrap();
        let mut model = Model::new(&b, false);
        common::current_thread().block_on(run(&b, &mut model, &cmds))?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn file_tmp_uring_512(cmds in cmds(64, 30)) {
        check_file("/tmp", 512, 64, IoEngine::Auto, false, &cmds)?;
    }

    #[test]
    fn file_tmp_uring_4096_multi_thread(cmds in cmds(32, 30)) {
        check_file("/tmp", 4096, 32, IoEngine::Auto, true, &cmds)?;
    }

    #[test]
    fn file_shm_uring_4096(cmds in cmds(32, 30)) {
        check_file("/dev/shm", 4096, 32, IoEngine::Auto, false, &cmds)?;
    }

    #[test]
    fn file_tmp_blocking_4096(cmds in cmds(32, 30)) {
        check_file("/tmp", 4096, 32, IoEngine::Blocking, false, &cmds)?;
    }
}
