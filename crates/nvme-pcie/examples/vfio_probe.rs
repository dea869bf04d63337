//! Drives a real NVMe controller bound to `vfio-pci` end to end with [`VfioNvme`]:
//! bring-up, Identify, a read of data written earlier by someone else (`--expect FILE` at
//! LBA 0), writes and reads on two I/O queue pairs (one page, two pages, a PRP list, a
//! transfer at MDTS), queue wrap, and a clean shutdown.
//! What it wrote is also saved to `--saved FILE` so that another driver (the kernel's) can
//! read it back and compare once the device is rebound.
//!
//! ```text
//! vfio_probe /sys/bus/pci/devices/0000:00:04.0 --expect /tmp/pattern --saved /tmp/ours \
//!     --offset 1048576
//! ```
//!
//! Prints `PROBE ...` lines and `PROBE PASS` at the end; exits non-zero with one line on
//! stderr on any failure. Run by `tests/interop/guest-scripts/nvme-pcie-vfio.sh`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use nvme_pcie::vfio::VfioNvme;
use nvme_pcie::{Completion, Config, Controller, DmaBuf, IoQueuePair, Namespace};

struct Args {
    device: PathBuf,
    expect: Option<PathBuf>,
    saved: Option<PathBuf>,
    offset: u64,
}

fn args() -> anyhow::Result<Args> {
    let mut it = std::env::args().skip(1);
    let mut a = Args {
        device: it
            .next()
            .context(
                "usage: vfio_probe SYSFS_DEVICE [--expect FILE] [--saved FILE] [--offset BYTES]",
            )?
            .into(),
        expect: None,
        saved: None,
        offset: 1 << 20,
    };
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--expect" => a.expect = Some(value.into()),
            "--saved" => a.saved = Some(value.into()),
            "--offset" => a.offset = value.parse().context("--offset takes bytes")?,
            _ => bail!("unknown option {flag}"),
        }
    }
    Ok(a)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Polls `q` until `n` completions arrived, or fails after 30 s (timeouts and resets are
/// the driver's job: `check` runs on the way).
fn reap(q: &mut IoQueuePair, n: usize) -> anyhow::Result<Vec<Completion>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        if q.poll(64, |c| out.push(c)) == 0 {
            let now = Instant::now();
            ensure!(
                now < deadline,
                "qid {}: {} of {n} completions after 30 s",
                q.qid(),
                out.len()
            );
            q.check(now);
            std::hint::spin_loop();
        }
    }
    Ok(out)
}

/// Reads `len` bytes at byte offset `at` of `ns` in transfers of at most `max` bytes.
fn read_range(
    c: &Controller,
    q: &mut IoQueuePair,
    ns: &Namespace,
    at: u64,
    len: usize,
    max: usize,
) -> anyhow::Result<Vec<u8>> {
    let bs = ns.block_size as usize;
    let mut data = vec![0u8; len];
    for (i, chunk) in data.chunks_mut(max).enumerate() {
        let buf = c.alloc(chunk.len())?;
        let slba = (at as usize + i * max) / bs;
        q.read(ns, slba as u64, (chunk.len() / bs) as u32, buf, i as u64)
            .map_err(|r| r.error)?;
        q.ring();
        let done = reap(q, 1)?.pop().context("no completion")?;
        done.result.context("read")?;
        done.buf.context("buffer not returned")?.read(0, chunk)?;
    }
    Ok(data)
}

/// One transfer: `len` bytes at byte offset `at`.
struct Io {
    at: u64,
    len: usize,
}

/// Writes every `ios` entry (all queued, one doorbell, then reaped), then reads each back
/// into a fresh buffer and compares. Returns the bytes written per entry.
fn write_read(
    c: &Controller,
    q: &mut IoQueuePair,
    ns: &Namespace,
    ios: &[Io],
    seed: u64,
) -> anyhow::Result<Vec<Vec<u8>>> {
    let bs = ns.block_size as usize;
    let data: Vec<Vec<u8>> = ios
        .iter()
        .enumerate()
        .map(|(i, io)| pattern(seed + i as u64, io.len))
        .collect();
    let bufs = |fill: bool| -> anyhow::Result<Vec<DmaBuf>> {
        ios.iter()
            .zip(&data)
            .map(|(io, d)| {
                let b = c.alloc(io.len)?;
                if fill {
                    b.write(0, d)?;
                }
                Ok(b)
            })
            .collect()
    };
    for write in [true, false] {
        for (i, (buf, io)) in bufs(write)?.into_iter().zip(ios).enumerate() {
            let nlb = (io.len / bs) as u32;
            let slba = io.at / bs as u64;
            let r = if write {
                q.write(ns, slba, nlb, buf, i as u64)
            } else {
                q.read(ns, slba, nlb, buf, i as u64)
            };
            r.map_err(|r| r.error).with_context(|| {
                format!(
                    "submitting {} of {} bytes",
                    if write { "write" } else { "read" },
                    io.len
                )
            })?;
            // Keep within the queue depth: ring and reap once it is full.
            if q.outstanding() + 1 >= q.depth() {
                q.ring();
                check_all(reap(q, q.outstanding())?, write, ios, &data)?;
            }
        }
        q.ring();
        check_all(reap(q, q.outstanding())?, write, ios, &data)?;
    }
    Ok(data)
}

fn check_all(
    done: Vec<Completion>,
    write: bool,
    ios: &[Io],
    data: &[Vec<u8>],
) -> anyhow::Result<()> {
    for d in done {
        let i = d.tag as usize;
        d.result.with_context(|| {
            format!(
                "{} {i} ({} bytes)",
                if write { "write" } else { "read" },
                ios[i].len
            )
        })?;
        if !write {
            let buf = d.buf.context("buffer not returned")?;
            let mut got = vec![0u8; ios[i].len];
            buf.read(0, &mut got)?;
            ensure!(
                got == data[i],
                "read {i} ({} bytes at {}) differs from what was written",
                ios[i].len,
                ios[i].at
            );
        }
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("vfio_probe: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let a = args()?;
    let dev = VfioNvme::open(&a.device)?;
    let ranges = dev.iova_ranges()?;
    let ranges_text: Vec<String> = ranges
        .iter()
        .map(|(s, e)| format!("{s:#x}-{e:#x}"))
        .collect();
    println!("PROBE IOVA-RANGES {}", ranges_text.join(" "));
    let arena_size = 16 << 20;
    let iova_base = dev.arena_iova(arena_size)?;
    let config = Config {
        io_queues: 2,
        // Small queues so that the runs below wrap them several times.
        io_queue_size: 8,
        arena_size,
        iova_base,
        ..Config::default()
    };
    let c = Controller::new(Arc::new(dev), config)?;
    let info = c.info().clone();
    println!(
        "PROBE IDENTIFY vid={:#06x} sn={:?} mn={:?} fr={:?} ver={:#x} page={} max_transfer={} io_queues={} iova_base={iova_base:#x}",
        info.vid,
        info.serial,
        info.model,
        info.firmware,
        info.version,
        info.page_size,
        info.max_transfer,
        info.io_queues
    );
    let ns = *c.namespaces().first().context("no active namespace")?;
    println!(
        "PROBE NAMESPACE nsid={} block_size={} blocks={}",
        ns.nsid, ns.block_size, ns.blocks
    );
    let max = usize::try_from(info.max_transfer)?;
    let bs = ns.block_size as usize;
    ensure!(
        max >= 4 * 4096 && max % bs == 0,
        "max transfer {max} too small"
    );
    let mut q1 = c.create_io_queue()?;
    let mut q2 = c.create_io_queue()?;
    println!(
        "PROBE QUEUES qid={} qid={} depth={}",
        q1.qid(),
        q2.qid(),
        q1.depth()
    );

    if let Some(path) = &a.expect {
        let want = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let got = read_range(&c, &mut q1, &ns, 0, want.len(), max)?;
        ensure!(got == want, "data at LBA 0 differs from {}", path.display());
        println!("PROBE EXPECTED-DATA bytes={}", want.len());
    }

    // Queue 1: every PRP shape (one page, PRP2 as a page, a PRP list, MDTS).
    let base = a.offset;
    let mut ios = Vec::new();
    let mut at = base;
    for len in [4096, 8192, 12288, bs, 65536, max, max] {
        ios.push(Io { at, len });
        at += len as u64;
    }
    ensure!(at / bs as u64 <= ns.blocks, "namespace too small");
    let first = write_read(&c, &mut q1, &ns, &ios, 1)?;
    println!(
        "PROBE PRP-SHAPES qid={} commands={} max_transfer={max}",
        q1.qid(),
        ios.len() * 2
    );

    // Queue 2: many small transfers through an 8-entry queue (several laps).
    let mut ios2 = Vec::new();
    for i in 0..40u64 {
        ios2.push(Io {
            at: at + i * 8192,
            len: 8192,
        });
    }
    let end = at + 40 * 8192;
    ensure!(end / bs as u64 <= ns.blocks, "namespace too small");
    let second = write_read(&c, &mut q2, &ns, &ios2, 100)?;
    println!(
        "PROBE WRAP qid={} commands={} depth={}",
        q2.qid(),
        ios2.len() * 2,
        q2.depth()
    );

    // Cross-check: queue 2 reads what queue 1 wrote.
    let again = read_range(&c, &mut q2, &ns, base, (at - base) as usize, max)?;
    ensure!(
        again == first.concat(),
        "queue {} read back different data than queue {} wrote",
        q2.qid(),
        q1.qid()
    );
    println!("PROBE CROSS-QUEUE bytes={}", again.len());

    if let Some(path) = &a.saved {
        let mut all = first.concat();
        all.extend(second.concat());
        std::fs::write(path, &all).with_context(|| format!("writing {}", path.display()))?;
        println!("PROBE SAVED offset={base} bytes={}", all.len());
    }
    drop((q1, q2));
    // The last handle: CC.SHN and wait for CSTS.SHST.
    drop(c);
    println!("PROBE PASS");
    Ok(())
}
