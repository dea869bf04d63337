//! A volatile write cache in front of any backend, for testing what survives a crash.
//!
//! [`VolatileCache`] keeps written blocks in process memory until a Flush or a write with
//! Force Unit Access makes them durable, the way a drive's DRAM cache does: killing the process
//! (SIGKILL) then loses every write not made durable, as a power cut would. It is selected with
//! `file:PATH,volatile_cache=SIZE` or `bdev:PATH,volatile_cache=SIZE` and is a testing feature:
//! real deployments never want it.
//!
//! - A plain write goes to the cache (one copy per block). Reads see the newest data: the
//!   backend's, with cached blocks laid over it.
//! - A write with FUA goes straight to the backend as a durable write, replacing the cached
//!   copies of its blocks.
//! - Flush writes every cached block back (contiguous blocks together) and then flushes the
//!   backend.
//! - The cache holds at most `SIZE` bytes of blocks. A write that finds it full first writes
//!   back the oldest blocks (a real cache may evict: that only makes more data survive); a
//!   write larger than the whole cache goes straight to the backend, not durably.
//! - Write Zeroes and Deallocate go to the backend and drop the cached copies of their blocks.
//!
//! Everything that writes to the backend (write-back, FUA, zeroing) takes one asynchronous
//! lock, so the backend sees writes to a block in the order the cache did. A cached block is
//! dropped only after the backend holds its data (or newer), so at every moment a block's newest
//! completed data is in the cache or, if not cached, in the backend.

use std::collections::BTreeMap;
use std::collections::btree_map::Entry as MapEntry;
use std::ops::Range;

use parking_lot::Mutex;

use crate::{Backend, BackendError, BufResult, IoBuf, check_range, check_transfer};

/// Most blocks written back by one backend write.
const MAX_RUN_BYTES: usize = 1 << 20;

/// A cached block.
struct Cached {
    /// When it was last written (orders eviction and tells rewrites apart).
    seq: u64,
    data: Box<[u8]>,
}

#[derive(Default)]
struct State {
    /// Cached blocks by LBA.
    blocks: BTreeMap<u64, Cached>,
    /// LBA of each cached block by `seq`, oldest first.
    by_age: BTreeMap<u64, u64>,
    /// The `seq` of the next write.
    next_seq: u64,
}

impl State {
    fn insert(&mut self, lba: u64, data: &[u8]) {
        let seq = self.next_seq;
        self.next_seq += 1;
        match self.blocks.entry(lba) {
            MapEntry::Occupied(mut e) => {
                let c = e.get_mut();
                self.by_age.remove(&c.seq);
                c.seq = seq;
                c.data.copy_from_slice(data);
            }
            MapEntry::Vacant(e) => {
                e.insert(Cached {
                    seq,
                    data: data.into(),
                });
            }
        }
        self.by_age.insert(seq, lba);
    }

    fn remove(&mut self, lba: u64) {
        if let Some(c) = self.blocks.remove(&lba) {
            self.by_age.remove(&c.seq);
        }
    }

    /// Drops the blocks of `range` last written before `seq`.
    fn remove_older(&mut self, range: Range<u64>, seq: u64) {
        let stale: Vec<u64> = self
            .blocks
            .range(range)
            .filter(|(_, c)| c.seq < seq)
            .map(|(&lba, _)| lba)
            .collect();
        for lba in stale {
            self.remove(lba);
        }
    }

    /// Whether `blocks` blocks from `lba` fit without writing anything back.
    fn fits(&self, lba: u64, blocks: u64, capacity: usize) -> bool {
        let new = (lba..lba + blocks)
            .filter(|l| !self.blocks.contains_key(l))
            .count();
        self.blocks.len() + new <= capacity
    }
}

/// Contiguous cached blocks copied out for writing back.
struct Run {
    lba: u64,
    buf: IoBuf,
    /// The `seq` of each block when it was copied.
    seqs: Vec<u64>,
}

/// A backend with a volatile write cache of bounded size in front of it (see the module docs).
pub struct VolatileCache<B> {
    inner: B,
    /// Capacity in blocks.
    capacity: usize,
    state: Mutex<State>,
    /// Held by everything that writes to `inner`.
    writeback: tokio::sync::Mutex<()>,
}

impl<B: Backend> VolatileCache<B> {
    /// Puts a cache of `size` bytes (rounded down to whole blocks, at least one) in front of
    /// `inner`.
    pub fn new(inner: B, size: u64) -> Result<Self, BackendError> {
        let capacity = size / u64::from(inner.block_size());
        if capacity == 0 {
            return Err(BackendError::Config(format!(
                "volatile_cache={size} holds no whole block of {} bytes",
                inner.block_size()
            )));
        }
        Ok(VolatileCache {
            inner,
            capacity: usize::try_from(capacity).unwrap_or(usize::MAX),
            state: Mutex::new(State::default()),
            writeback: tokio::sync::Mutex::new(()),
        })
    }

    /// The backend behind the cache.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// The capacity in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity as u64 * u64::from(self.inner.block_size())
    }

    /// The number of blocks cached and not yet written back.
    pub fn cached_blocks(&self) -> usize {
        self.state.lock().blocks.len()
    }

    fn bs(&self) -> usize {
        self.inner.block_size() as usize
    }

    /// Copies the cached blocks among `lbas` (ascending) into runs of contiguous blocks.
    fn copy_runs(&self, lbas: &[u64]) -> Vec<Run> {
        let bs = self.bs();
        let max_blocks = (MAX_RUN_BYTES / bs).max(1);
        let st = self.state.lock();
        let mut spans: Vec<(u64, usize)> = Vec::new();
        for &lba in lbas.iter().filter(|l| st.blocks.contains_key(l)) {
            match spans.last_mut() {
                Some((start, n)) if *start + *n as u64 == lba && *n < max_blocks => *n += 1,
                _ => spans.push((lba, 1)),
            }
        }
        spans
            .into_iter()
            .map(|(lba, n)| {
                let mut buf = IoBuf::new(n * bs);
                let mut seqs = Vec::with_capacity(n);
                for (i, dst) in buf.chunks_mut(bs).enumerate() {
                    let c = &st.blocks[&(lba + i as u64)];
                    dst.copy_from_slice(&c.data);
                    seqs.push(c.seq);
                }
                Run { lba, buf, seqs }
            })
            .collect()
    }

    /// Writes the cached blocks among `lbas` (ascending) back, dropping each from the cache
    /// unless it was rewritten meanwhile. The caller holds `writeback`.
    async fn write_back(&self, lbas: &[u64]) -> Result<(), BackendError> {
        for run in self.copy_runs(lbas) {
            let (res, _) = self.inner.write(run.lba, run.buf).await;
            res?;
            let mut st = self.state.lock();
            for (i, seq) in run.seqs.into_iter().enumerate() {
                let lba = run.lba + i as u64;
                if st.blocks.get(&lba).is_some_and(|c| c.seq == seq) {
                    st.remove(lba);
                }
            }
        }
        Ok(())
    }

    /// Writes back the oldest blocks until `blocks` blocks from `lba` fit (an eighth of the
    /// cache at least, so a full cache is not written back one block per write).
    async fn evict(&self, lba: u64, blocks: u64) -> Result<(), BackendError> {
        let _wb = self.writeback.lock().await;
        let mut victims: Vec<u64> = {
            let st = self.state.lock();
            if st.fits(lba, blocks, self.capacity) {
                return Ok(());
            }
            let n = (blocks as usize).max(self.capacity / 8);
            st.by_age.values().take(n).copied().collect()
        };
        victims.sort_unstable();
        self.write_back(&victims).await
    }

    /// Runs an operation on the backend that replaces `range` (a write past the cache, Write
    /// Zeroes, Deallocate), then drops the cached blocks it superseded.
    async fn bypass<T>(
        &self,
        range: Range<u64>,
        op: impl Future<Output = (Result<(), BackendError>, T)>,
    ) -> (Result<(), BackendError>, T) {
        let _wb = self.writeback.lock().await;
        let seq = self.state.lock().next_seq;
        let (res, out) = op.await;
        if res.is_ok() {
            self.state.lock().remove_older(range, seq);
        }
        (res, out)
    }
}

impl<B: std::fmt::Debug> std::fmt::Debug for VolatileCache<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VolatileCache")
            .field("inner", &self.inner)
            .field("capacity_blocks", &self.capacity)
            .finish()
    }
}

impl<B: Backend> Backend for VolatileCache<B> {
    fn block_size(&self) -> u32 {
        self.inner.block_size()
    }

    fn num_blocks(&self) -> u64 {
        self.inner.num_blocks()
    }

    fn volatile_write_cache(&self) -> bool {
        true
    }

    fn deallocate_reads_zeroes(&self) -> bool {
        self.inner.deallocate_reads_zeroes()
    }

    async fn read(&self, lba: u64, buf: IoBuf) -> BufResult {
        let blocks = match check_transfer(lba, buf.len(), self.block_size(), self.num_blocks()) {
            Ok(_) => (buf.len() / self.bs()) as u64,
            Err(e) => return (Err(e), buf),
        };
        let bs = self.bs();
        // Copied before the backend is read: a block written back meanwhile still reads as
        // what the cache held. A read the cache holds whole is served under the lock.
        let cached: Vec<(usize, Box<[u8]>)> = {
            let st = self.state.lock();
            let hits = st.blocks.range(lba..lba + blocks);
            if hits.clone().count() as u64 == blocks {
                let mut buf = buf;
                for (dst, (_, c)) in buf.chunks_mut(bs).zip(hits) {
                    dst.copy_from_slice(&c.data);
                }
                return (Ok(()), buf);
            }
            hits.map(|(&l, c)| ((l - lba) as usize, c.data.clone()))
                .collect()
        };
        let (res, mut buf) = self.inner.read(lba, buf).await;
        if res.is_ok() {
            for (i, data) in cached {
                buf[i * bs..(i + 1) * bs].copy_from_slice(&data);
            }
        }
        (res, buf)
    }

    async fn write(&self, lba: u64, buf: IoBuf) -> BufResult {
        let bs = self.bs();
        let blocks = match check_transfer(lba, buf.len(), self.block_size(), self.num_blocks()) {
            Ok(_) => (buf.len() / bs) as u64,
            Err(e) => return (Err(e), buf),
        };
        if blocks as usize > self.capacity {
            return self
                .bypass(lba..lba + blocks, self.inner.write(lba, buf))
                .await;
        }
        loop {
            {
                let mut st = self.state.lock();
                if st.fits(lba, blocks, self.capacity) {
                    for (i, data) in buf.chunks(bs).enumerate() {
                        st.insert(lba + i as u64, data);
                    }
                    return (Ok(()), buf);
                }
            }
            if let Err(e) = self.evict(lba, blocks).await {
                return (Err(e), buf);
            }
        }
    }

    async fn write_fua(&self, lba: u64, buf: IoBuf) -> BufResult {
        let blocks = match check_transfer(lba, buf.len(), self.block_size(), self.num_blocks()) {
            Ok(_) => (buf.len() / self.bs()) as u64,
            Err(e) => return (Err(e), buf),
        };
        self.bypass(lba..lba + blocks, self.inner.write_fua(lba, buf))
            .await
    }

    async fn flush(&self) -> Result<(), BackendError> {
        let _wb = self.writeback.lock().await;
        let all: Vec<u64> = self.state.lock().blocks.keys().copied().collect();
        self.write_back(&all).await?;
        self.inner.flush().await
    }

    async fn write_zeroes(&self, lba: u64, blocks: u64) -> Result<(), BackendError> {
        check_range(lba, blocks, self.num_blocks())?;
        let op = async { (self.inner.write_zeroes(lba, blocks).await, ()) };
        self.bypass(lba..lba + blocks, op).await.0
    }

    async fn deallocate(&self, lba: u64, blocks: u64) -> Result<(), BackendError> {
        check_range(lba, blocks, self.num_blocks())?;
        let op = async { (self.inner.deallocate(lba, blocks).await, ()) };
        self.bypass(lba..lba + blocks, op).await.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryBackend;

    const BS: usize = 512;

    /// A cache of `cache_blocks` blocks over a 64-block memory namespace.
    fn cache(cache_blocks: u64) -> VolatileCache<MemoryBackend> {
        let inner = MemoryBackend::new(64 * BS as u64, BS as u32).unwrap();
        VolatileCache::new(inner, cache_blocks * BS as u64).unwrap()
    }

    fn filled(byte: u8, blocks: usize) -> IoBuf {
        let mut b = IoBuf::new(blocks * BS);
        b.fill(byte);
        b
    }

    fn run<F: Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    }

    /// The first byte of each of `blocks` blocks from `lba`, as read through `b`.
    async fn bytes(b: &impl Backend, lba: u64, blocks: usize) -> Vec<u8> {
        let (res, buf) = b.read(lba, IoBuf::new(blocks * BS)).await;
        res.unwrap();
        buf.chunks(BS)
            .map(|c| {
                assert!(c.iter().all(|&x| x == c[0]), "a block is torn");
                c[0]
            })
            .collect()
    }

    async fn write(b: &impl Backend, lba: u64, byte: u8, blocks: usize) {
        b.write(lba, filled(byte, blocks)).await.0.unwrap();
    }

    #[test]
    fn plain_writes_stay_cached_until_a_flush() {
        run(async {
            let c = cache(16);
            write(&c, 2, 7, 3).await;
            assert_eq!(bytes(&c, 1, 5).await, [0, 7, 7, 7, 0]);
            assert_eq!(bytes(c.inner(), 1, 5).await, [0, 0, 0, 0, 0]);
            assert_eq!(c.cached_blocks(), 3);
            c.flush().await.unwrap();
            assert_eq!(c.cached_blocks(), 0);
            assert_eq!(bytes(c.inner(), 1, 5).await, [0, 7, 7, 7, 0]);
            assert!(c.volatile_write_cache());
        });
    }

    #[test]
    fn fua_writes_reach_the_backend_and_replace_cached_copies() {
        run(async {
            let c = cache(16);
            write(&c, 0, 1, 4).await;
            c.write_fua(1, filled(2, 2)).await.0.unwrap();
            assert_eq!(bytes(&c, 0, 4).await, [1, 2, 2, 1]);
            assert_eq!(bytes(c.inner(), 0, 4).await, [0, 2, 2, 0]);
            assert_eq!(c.cached_blocks(), 2);
            // The older cached copies of blocks 1-2 must not be written back over the FUA data.
            c.flush().await.unwrap();
            assert_eq!(bytes(c.inner(), 0, 4).await, [1, 2, 2, 1]);
        });
    }

    #[test]
    fn a_full_cache_writes_back_its_oldest_blocks() {
        run(async {
            let c = cache(8);
            for lba in 0..20u64 {
                write(&c, lba, lba as u8 + 1, 1).await;
                assert!(c.cached_blocks() <= 8);
            }
            let all: Vec<u8> = (1..=20).collect();
            assert_eq!(bytes(&c, 0, 20).await, all);
            let inner = bytes(c.inner(), 0, 20).await;
            // The oldest went back, the newest are only in the cache.
            assert_eq!(inner[0], 1);
            assert_eq!(inner[19], 0);
            assert_eq!(inner.iter().filter(|&&b| b == 0).count(), c.cached_blocks());
            // A rewrite of a cached block takes no room.
            let before = c.cached_blocks();
            write(&c, 19, 99, 1).await;
            assert_eq!(c.cached_blocks(), before);
            c.flush().await.unwrap();
            let mut want = all;
            want[19] = 99;
            assert_eq!(bytes(c.inner(), 0, 20).await, want);
        });
    }

    #[test]
    fn a_write_larger_than_the_cache_bypasses_it() {
        run(async {
            let c = cache(4);
            write(&c, 0, 1, 2).await;
            write(&c, 1, 2, 6).await;
            assert_eq!(bytes(&c, 0, 8).await, [1, 2, 2, 2, 2, 2, 2, 0]);
            assert_eq!(bytes(c.inner(), 0, 8).await, [0, 2, 2, 2, 2, 2, 2, 0]);
            assert_eq!(c.cached_blocks(), 1);
        });
    }

    #[test]
    fn zeroes_and_deallocate_drop_cached_copies() {
        run(async {
            let c = cache(16);
            c.inner().write(0, filled(5, 8)).await.0.unwrap();
            write(&c, 0, 6, 8).await;
            c.write_zeroes(1, 2).await.unwrap();
            c.deallocate(5, 2).await.unwrap();
            assert_eq!(bytes(&c, 0, 8).await, [6, 0, 0, 6, 6, 0, 0, 6]);
            c.flush().await.unwrap();
            assert_eq!(bytes(c.inner(), 0, 8).await, [6, 0, 0, 6, 6, 0, 0, 6]);
            assert!(matches!(
                c.write_zeroes(60, 5).await,
                Err(BackendError::OutOfRange { .. })
            ));
        });
    }

    #[test]
    fn a_cache_must_hold_a_block() {
        let inner = MemoryBackend::new(1 << 20, 4096).unwrap();
        assert!(matches!(
            VolatileCache::new(inner, 2048),
            Err(BackendError::Config(_))
        ));
    }
}
