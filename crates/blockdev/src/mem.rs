//! Sparse memory backend.
//!
//! The namespace is split into fixed-size chunks (power of two, 128 KiB by default). A chunk is
//! allocated (zero-filled) on the first write that touches it; chunks never written read as
//! zeros, so a 1 TiB namespace costs nothing until it is used. Write Zeroes and Deallocate free
//! every chunk they cover whole and zero the partial ones in place.
//!
//! Chunks live in hash maps split into 1024 shards by chunk index, each behind a lock of its
//! own on a cache line of its own. A read takes its shard's lock for reading (one atomic on a
//! line that threads reading that shard share, and nothing else written); a write takes it
//! for writing, so threads reading and writing chunks of different shards do not wait for each
//! other, and a write never tears a concurrent read.
//!
//! Chunks are shared buffers: [`MemoryBackend::read_shared`] hands out the chunks that hold a
//! range instead of copying them, so that a transport sends a read's data straight from the
//! namespace. A write or a zeroing that finds its chunk still held that way writes into a copy
//! (copy on write), so held data never changes.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::RwLock;

use crate::{Backend, BackendError, BufResult, IoBuf, check_range, check_transfer};

/// The chunk size [`MemoryBackend::new`] uses.
pub const DEFAULT_CHUNK_SIZE: usize = 128 * 1024;

const SHARDS: usize = 1024;

/// Hasher for chunk indices: a multiplicative mix, plenty for integer keys.
#[derive(Default)]
struct ChunkHasher(u64);

impl Hasher for ChunkHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (n ^ (n >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type ChunkMap = HashMap<u64, Arc<[u8]>, BuildHasherDefault<ChunkHasher>>;

/// A range of a shared buffer that holds part of a read's data ([`MemoryBackend::read_shared`]).
pub type SharedPiece = (Arc<[u8]>, Range<usize>);

/// Length of the shared zero buffer that holes in a namespace read as.
const ZEROS_LEN: usize = 1 << 20;

/// Appends pieces of a shared zero buffer adding up to `len` bytes.
pub(crate) fn shared_zeros(mut len: usize, out: &mut Vec<SharedPiece>) {
    static ZEROS: OnceLock<Arc<[u8]>> = OnceLock::new();
    let zeros = ZEROS.get_or_init(|| vec![0u8; ZEROS_LEN].into());
    while len > 0 {
        let n = len.min(ZEROS_LEN);
        out.push((Arc::clone(zeros), 0..n));
        len -= n;
    }
}

/// One shard of the chunk map, alone on its cache lines (two, for the adjacent-line
/// prefetcher), so that threads using neighbouring shards do not share a line.
#[derive(Default)]
#[repr(align(128))]
struct Shard(RwLock<ChunkMap>);

/// A sparse in-memory namespace. Volatile: contents are lost when it is dropped.
pub struct MemoryBackend {
    block_size: u32,
    num_blocks: u64,
    chunk_shift: u32,
    shards: Box<[Shard]>,
    allocated: AtomicUsize,
}

/// One piece of a byte range that lies inside a single chunk.
struct Piece {
    chunk: u64,
    offset: usize,
    len: usize,
}

impl MemoryBackend {
    /// Creates a namespace of `size` bytes with `block_size`-byte blocks and
    /// [`DEFAULT_CHUNK_SIZE`] chunks.
    pub fn new(size: u64, block_size: u32) -> Result<Self, BackendError> {
        Self::with_chunk_size(size, block_size, DEFAULT_CHUNK_SIZE)
    }

    /// Creates a namespace with a given chunk size: a power of two from 4 KiB to 16 MiB and
    /// at least the block size.
    pub fn with_chunk_size(
        size: u64,
        block_size: u32,
        chunk_size: usize,
    ) -> Result<Self, BackendError> {
        crate::validate_block_size(block_size).map_err(|e| BackendError::Config(e.to_string()))?;
        if size == 0 || size % u64::from(block_size) != 0 {
            return Err(BackendError::Config(format!(
                "size {size} is not a non-zero multiple of the block size {block_size}"
            )));
        }
        if !chunk_size.is_power_of_two()
            || !(4096..=16 << 20).contains(&chunk_size)
            || chunk_size < block_size as usize
        {
            return Err(BackendError::Config(format!(
                "invalid chunk size {chunk_size}"
            )));
        }
        Ok(MemoryBackend {
            block_size,
            num_blocks: size / u64::from(block_size),
            chunk_shift: chunk_size.trailing_zeros(),
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            allocated: AtomicUsize::new(0),
        })
    }

    /// The chunk size in bytes.
    pub fn chunk_size(&self) -> usize {
        1 << self.chunk_shift
    }

    /// The number of chunks currently allocated.
    pub fn allocated_chunks(&self) -> usize {
        self.allocated.load(Ordering::Relaxed)
    }

    /// The bytes of chunk memory currently allocated.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated_chunks() as u64 * self.chunk_size() as u64
    }

    /// Reads `out.len()` bytes starting at block `lba` into any slice, synchronously (memory
    /// never waits): lets a transport read straight into its send buffer.
    pub fn read_into(&self, lba: u64, out: &mut [u8]) -> Result<(), BackendError> {
        let offset = check_transfer(lba, out.len(), self.block_size, self.num_blocks)?;
        self.read_sync(offset, out);
        Ok(())
    }

    /// Appends to `out` the pieces of shared buffers that hold `len` bytes starting at block
    /// `lba`, in order, without copying them: chunks of the namespace, and a shared zero
    /// buffer for chunks never written. The data they hold does not change while they are
    /// held; later writes go to copies of the chunks.
    pub fn read_shared(
        &self,
        lba: u64,
        len: usize,
        out: &mut Vec<SharedPiece>,
    ) -> Result<(), BackendError> {
        let offset = check_transfer(lba, len, self.block_size, self.num_blocks)?;
        for p in self.pieces(offset, len as u64) {
            let chunk = self.shard(p.chunk).read().get(&p.chunk).map(Arc::clone);
            match chunk {
                Some(c) => out.push((c, p.offset..p.offset + p.len)),
                None => shared_zeros(p.len, out),
            }
        }
        Ok(())
    }

    fn shard(&self, chunk: u64) -> &RwLock<ChunkMap> {
        &self.shards[(chunk as usize) % SHARDS].0
    }

    /// Splits the byte range `[offset, offset + len)` at chunk boundaries.
    fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = Piece> + use<> {
        let chunk_size = 1u64 << self.chunk_shift;
        let shift = self.chunk_shift;
        let end = offset + len;
        let mut pos = offset;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let chunk = pos >> shift;
            let in_chunk = pos & (chunk_size - 1);
            let n = (chunk_size - in_chunk).min(end - pos);
            pos += n;
            Some(Piece {
                chunk,
                offset: in_chunk as usize,
                len: n as usize,
            })
        })
    }

    fn read_sync(&self, offset: u64, out: &mut [u8]) {
        let mut done = 0;
        for p in self.pieces(offset, out.len() as u64) {
            let dst = &mut out[done..done + p.len];
            let shard = self.shard(p.chunk).read();
            match shard.get(&p.chunk) {
                Some(chunk) => dst.copy_from_slice(&chunk[p.offset..p.offset + p.len]),
                None => dst.fill(0),
            }
            done += p.len;
        }
    }

    fn write_sync(&self, offset: u64, data: &[u8]) {
        let mut done = 0;
        for p in self.pieces(offset, data.len() as u64) {
            let src = &data[done..done + p.len];
            done += p.len;
            let mut shard = self.shard(p.chunk).write();
            let chunk = shard.entry(p.chunk).or_insert_with(|| {
                self.allocated.fetch_add(1, Ordering::Relaxed);
                std::iter::repeat_n(0u8, self.chunk_size()).collect()
            });
            Arc::make_mut(chunk)[p.offset..p.offset + p.len].copy_from_slice(src);
        }
    }

    fn zero_sync(&self, offset: u64, len: u64) {
        let chunk_size = self.chunk_size() as u64;
        let first_whole = offset.div_ceil(chunk_size);
        let end_whole = (offset + len) / chunk_size;
        let whole = end_whole.saturating_sub(first_whole);
        // For ranges spanning far more chunks than are allocated (a discard of the whole
        // namespace), visit the allocated chunks instead of every chunk index.
        if whole > 4 * self.allocated_chunks() as u64 + SHARDS as u64 {
            for shard in self.shards.iter() {
                let mut shard = shard.0.write();
                let before = shard.len();
                shard.retain(|&chunk, _| !(first_whole..end_whole).contains(&chunk));
                self.allocated
                    .fetch_sub(before - shard.len(), Ordering::Relaxed);
            }
            let head_end = (first_whole * chunk_size).min(offset + len);
            self.zero_pieces(offset, head_end - offset);
            let tail_start = (end_whole * chunk_size).max(head_end);
            self.zero_pieces(tail_start, offset + len - tail_start);
        } else {
            self.zero_pieces(offset, len);
        }
    }

    fn zero_pieces(&self, offset: u64, len: u64) {
        let chunk_size = self.chunk_size();
        for p in self.pieces(offset, len) {
            if p.len == chunk_size {
                if self.shard(p.chunk).write().remove(&p.chunk).is_some() {
                    self.allocated.fetch_sub(1, Ordering::Relaxed);
                }
            } else {
                let mut shard = self.shard(p.chunk).write();
                if let Some(chunk) = shard.get_mut(&p.chunk) {
                    Arc::make_mut(chunk)[p.offset..p.offset + p.len].fill(0);
                }
            }
        }
    }

    fn zero_range(&self, lba: u64, blocks: u64) -> Result<(), BackendError> {
        check_range(lba, blocks, self.num_blocks)?;
        let bs = u64::from(self.block_size);
        self.zero_sync(lba * bs, blocks * bs);
        Ok(())
    }
}

impl std::fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("block_size", &self.block_size)
            .field("num_blocks", &self.num_blocks)
            .field("chunk_size", &self.chunk_size())
            .field("allocated_chunks", &self.allocated_chunks())
            .finish()
    }
}

impl Backend for MemoryBackend {
    fn block_size(&self) -> u32 {
        self.block_size
    }

    fn num_blocks(&self) -> u64 {
        self.num_blocks
    }

    fn volatile_write_cache(&self) -> bool {
        false
    }

    fn deallocate_reads_zeroes(&self) -> bool {
        true
    }

    async fn read(&self, lba: u64, mut buf: IoBuf) -> BufResult {
        let r = self.read_into(lba, &mut buf);
        (r, buf)
    }

    async fn write(&self, lba: u64, buf: IoBuf) -> BufResult {
        match check_transfer(lba, buf.len(), self.block_size, self.num_blocks) {
            Ok(offset) => {
                self.write_sync(offset, &buf);
                (Ok(()), buf)
            }
            Err(e) => (Err(e), buf),
        }
    }

    async fn flush(&self) -> Result<(), BackendError> {
        Ok(())
    }

    async fn write_zeroes(&self, lba: u64, blocks: u64) -> Result<(), BackendError> {
        self.zero_range(lba, blocks)
    }

    async fn deallocate(&self, lba: u64, blocks: u64) -> Result<(), BackendError> {
        self.zero_range(lba, blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_split_at_chunk_boundaries() {
        let m = MemoryBackend::with_chunk_size(1 << 20, 512, 4096).unwrap();
        let v: Vec<_> = m
            .pieces(4000, 5000)
            .map(|p| (p.chunk, p.offset, p.len))
            .collect();
        assert_eq!(v, vec![(0, 4000, 96), (1, 0, 4096), (2, 0, 808)]);
        assert_eq!(m.pieces(0, 0).count(), 0);
    }

    #[test]
    fn config_errors() {
        assert!(MemoryBackend::new(0, 512).is_err());
        assert!(MemoryBackend::new(1000, 512).is_err());
        assert!(MemoryBackend::new(1 << 20, 1000).is_err());
        assert!(MemoryBackend::with_chunk_size(1 << 20, 512, 3000).is_err());
        assert!(MemoryBackend::with_chunk_size(1 << 20, 8192, 4096).is_err());
        assert!(MemoryBackend::with_chunk_size(1 << 20, 512, 32 << 20).is_err());
    }

    #[test]
    fn partial_zero_keeps_chunk_whole_zero_frees() {
        let m = MemoryBackend::with_chunk_size(1 << 20, 512, 4096).unwrap();
        m.write_sync(0, &[0xAB; 8192]);
        assert_eq!(m.allocated_chunks(), 2);
        m.zero_sync(512, 512);
        assert_eq!(m.allocated_chunks(), 2);
        let mut out = vec![0u8; 8192];
        m.read_sync(0, &mut out);
        assert!(out[..512].iter().all(|&b| b == 0xAB));
        assert!(out[512..1024].iter().all(|&b| b == 0));
        assert!(out[1024..].iter().all(|&b| b == 0xAB));
        m.zero_sync(0, 4096 + 512);
        assert_eq!(m.allocated_chunks(), 1);
        m.read_sync(0, &mut out);
        assert!(out[..4096 + 512].iter().all(|&b| b == 0));
        assert!(out[4096 + 512..].iter().all(|&b| b == 0xAB));
    }

    #[test]
    fn shared_reads_hold_their_data_across_writes() {
        let m = MemoryBackend::with_chunk_size(1 << 20, 512, 4096).unwrap();
        m.write_sync(4096, &[0xAB; 4096]);
        let mut held = Vec::new();
        // Half of the hole in chunk 0, all of chunk 1, the start of the hole in chunk 2.
        m.read_shared(4, 7168, &mut held).unwrap();
        let flat = |pieces: &[SharedPiece]| -> Vec<u8> {
            pieces
                .iter()
                .flat_map(|(d, r)| d[r.clone()].to_vec())
                .collect()
        };
        let mut want = vec![0u8; 2048];
        want.extend([0xAB; 4096]);
        want.extend([0; 1024]);
        assert_eq!(flat(&held), want);
        // Writes and zeroing while the pieces are held change the namespace, not them.
        m.write_sync(4096, &[0xCD; 512]);
        m.zero_sync(4096 + 512, 512);
        assert_eq!(flat(&held), want);
        let mut now = vec![0u8; 4096];
        m.read_sync(4096, &mut now);
        assert!(now[..512].iter().all(|&b| b == 0xCD));
        assert!(now[512..1024].iter().all(|&b| b == 0));
        assert!(now[1024..].iter().all(|&b| b == 0xAB));
        assert_eq!(m.allocated_chunks(), 1);
        // Out of range: refused, nothing appended.
        held.clear();
        assert!(m.read_shared(2047, 1024, &mut held).is_err());
        assert!(held.is_empty());
    }

    #[test]
    fn huge_zero_range_scans_allocated_chunks() {
        let m = MemoryBackend::with_chunk_size(1 << 40, 512, 4096).unwrap();
        let mut out = vec![0u8; 8192];
        // Chunks 0 and 1 (partly written), one in the middle, the last one.
        m.write_sync(1024, &[1; 7168]);
        m.write_sync(1 << 39, &[2; 4096]);
        m.write_sync((1 << 40) - 4096, &[3; 4096]);
        assert_eq!(m.allocated_chunks(), 4);
        // Zero from the middle of chunk 0 to the middle of the last chunk.
        m.zero_sync(2048, (1 << 40) - 2048 - 2048);
        assert_eq!(
            m.allocated_chunks(),
            2,
            "the partial head and tail chunks stay"
        );
        m.read_sync(0, &mut out);
        assert!(out[1024..2048].iter().all(|&b| b == 1));
        assert!(out[..1024].iter().all(|&b| b == 0));
        assert!(out[2048..].iter().all(|&b| b == 0));
        m.read_sync((1 << 40) - 4096, &mut out[..4096]);
        assert!(out[..2048].iter().all(|&b| b == 0));
        assert!(out[2048..4096].iter().all(|&b| b == 3));
        m.read_sync(1 << 39, &mut out[..4096]);
        assert!(out[..4096].iter().all(|&b| b == 0));
        // The whole namespace: everything goes.
        m.zero_sync(0, 1 << 40);
        assert_eq!(m.allocated_chunks(), 0);
    }
}
