//! Stream marks: how far a stream got, read by the host with one load instead of a driver call.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use cudarc::driver::sys;

use crate::context::GpuContext;
use crate::driver::check;
use crate::error::{GpuError, GpuResult};
use crate::memory::PinnedBuffer;
use crate::stream::GpuStream;

/// A word of mapped pinned memory that a stream writes when it gets there
/// (`cuStreamWriteValue32` with its default memory barrier: the work enqueued before the write
/// has finished and its writes are visible). [`enqueue`](Self::enqueue) hands out increasing
/// tickets; [`passed`](Self::passed) tells with one load whether the stream has written a
/// ticket, where polling an event costs two driver calls (the context's bind and the query)
/// each time.
///
/// A mark sees progress, not errors: a stream whose work failed never writes its ticket, so a
/// caller that waits long checks the stream ([`GpuStream::is_idle`]) now and then. Dropped with
/// a write still pending, the mark waits for its stream first.
pub struct StreamMark {
    word: PinnedBuffer,
    /// Device address of the word.
    dev: u64,
    /// The last ticket handed out (0: none yet).
    last: u32,
    /// The stream of the last write, while it may be pending.
    stream: Option<GpuStream>,
}

impl std::fmt::Debug for StreamMark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamMark")
            .field("last", &self.last)
            .field("seen", &self.seen())
            .finish()
    }
}

impl GpuContext {
    /// A new mark (a small mapped pinned allocation), no ticket handed out yet.
    pub fn new_mark(&self) -> GpuResult<StreamMark> {
        let word = self.alloc_pinned_mapped(64)?;
        let dev = word.mapped_device_ptr().ok_or(GpuError::Driver {
            call: "cuMemHostGetDevicePointer",
            code: 0,
            name: String::from("CUDA_SUCCESS"),
            description: String::from("mapped pinned memory without a device address"),
        })?;
        Ok(StreamMark {
            word,
            dev,
            last: 0,
            stream: None,
        })
    }
}

impl StreamMark {
    fn word(&self) -> &AtomicU32 {
        // SAFETY: the allocation is live as long as `self`, page-aligned and at least 64 bytes
        // long (zeroed when allocated); the host only reads it, and only through this atomic,
        // while the GPU writes it (a 4-byte aligned write, atomic on the bus).
        unsafe { AtomicU32::from_ptr(self.word.addr_at(0).cast::<u32>()) }
    }

    /// The last ticket the stream wrote.
    fn seen(&self) -> u32 {
        self.word().load(Ordering::Acquire)
    }

    /// Enqueues on `stream` the write of the next ticket and returns it.
    pub fn enqueue(&mut self, stream: &GpuStream) -> GpuResult<u32> {
        if !Arc::ptr_eq(stream.ctx(), &self.word.ctx) {
            return Err(GpuError::ContextMismatch);
        }
        stream.ctx().bind()?;
        let ticket = self.last.wrapping_add(1);
        // SAFETY: the stream is alive; `dev` is the device address of this mark's mapped
        // allocation, which outlives the write (dropping the mark waits for the stream while
        // a ticket is pending); flags 0 is the default write with a memory barrier.
        let rc = unsafe { sys::cuStreamWriteValue32_v2(stream.handle().raw, self.dev, ticket, 0) };
        check(rc, "cuStreamWriteValue32")?;
        self.last = ticket;
        self.stream = Some(stream.clone());
        Ok(ticket)
    }

    /// Whether the stream has written `ticket` (or a later one). One load, no driver call.
    pub fn passed(&self, ticket: u32) -> bool {
        reached(self.seen(), ticket)
    }

    /// Whether the stream has written the last ticket handed out (true when none was).
    pub fn passed_last(&self) -> bool {
        self.passed(self.last)
    }

    /// Checks the stream of the last ticket for an error without waiting: `Ok(true)` once it
    /// has passed, the stream's error if its work failed.
    pub fn check(&self) -> GpuResult<bool> {
        if self.passed_last() {
            return Ok(true);
        }
        match &self.stream {
            Some(s) => s.is_idle(),
            None => Ok(true),
        }
    }

    /// Blocks until the stream has written the last ticket (it waits for the whole stream).
    pub fn wait(&self) -> GpuResult<()> {
        if self.passed_last() {
            return Ok(());
        }
        if let Some(s) = &self.stream {
            s.synchronize()?;
        }
        Ok(())
    }
}

/// Whether a stream that wrote `seen` has written `ticket`. Tickets wrap: `seen` is at or past
/// `ticket` when it is less than half the range ahead of it.
fn reached(seen: u32, ticket: u32) -> bool {
    seen.wrapping_sub(ticket) < 1 << 31
}

impl Drop for StreamMark {
    fn drop(&mut self) {
        // The memory is freed after this: the stream must no longer write it.
        let _ = self.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::reached;

    #[test]
    fn tickets_are_reached_in_order_across_the_wrap() {
        // Nothing written yet (0): the first ticket, 1, is not reached.
        assert!(!reached(0, 1));
        assert!(reached(1, 1) && reached(5, 1) && !reached(4, 5));
        // Around the wrap: u32::MAX, then 0, then 1.
        assert!(!reached(u32::MAX - 1, u32::MAX));
        assert!(reached(u32::MAX, u32::MAX));
        assert!(!reached(u32::MAX, 0) && !reached(u32::MAX, 1));
        assert!(reached(0, u32::MAX) && reached(1, u32::MAX) && reached(1, 0));
    }
}
