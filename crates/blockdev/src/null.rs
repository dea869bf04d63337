//! Null backend: reads return zeros, writes are discarded.
//!
//! It checks ranges and lengths like every backend but stores nothing, so it measures the
//! transport and the target's command path without any storage cost.

use crate::{Backend, BackendError, BufResult, IoBuf, check_range, check_transfer};

/// A backend that stores nothing.
#[derive(Debug)]
pub struct NullBackend {
    block_size: u32,
    num_blocks: u64,
}

impl NullBackend {
    /// Creates a null namespace of `size` bytes with `block_size`-byte blocks.
    pub fn new(size: u64, block_size: u32) -> Result<Self, BackendError> {
        crate::validate_block_size(block_size).map_err(|e| BackendError::Config(e.to_string()))?;
        if size == 0 || size % u64::from(block_size) != 0 {
            return Err(BackendError::Config(format!(
                "size {size} is not a non-zero multiple of the block size {block_size}"
            )));
        }
        Ok(NullBackend {
            block_size,
            num_blocks: size / u64::from(block_size),
        })
    }

    /// Fills `out` with zeros after checking the range, like a read of `out.len()` bytes at
    /// block `lba`.
    pub fn read_into(&self, lba: u64, out: &mut [u8]) -> Result<(), BackendError> {
        check_transfer(lba, out.len(), self.block_size, self.num_blocks)?;
        out.fill(0);
        Ok(())
    }

    /// Appends pieces of a shared zero buffer adding up to `len` bytes after checking the
    /// range, like [`MemoryBackend::read_shared`](crate::MemoryBackend::read_shared).
    pub fn read_shared(
        &self,
        lba: u64,
        len: usize,
        out: &mut Vec<crate::SharedPiece>,
    ) -> Result<(), BackendError> {
        check_transfer(lba, len, self.block_size, self.num_blocks)?;
        crate::mem::shared_zeros(len, out);
        Ok(())
    }
}

impl Backend for NullBackend {
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
        let r = check_transfer(lba, buf.len(), self.block_size, self.num_blocks).map(|_| ());
        (r, buf)
    }

    async fn flush(&self) -> Result<(), BackendError> {
        Ok(())
    }

    async fn write_zeroes(&self, lba: u64, blocks: u64) -> Result<(), BackendError> {
        check_range(lba, blocks, self.num_blocks)
    }

    async fn deallocate(&self, lba: u64, blocks: u64) -> Result<(), BackendError> {
        check_range(lba, blocks, self.num_blocks)
    }
}
