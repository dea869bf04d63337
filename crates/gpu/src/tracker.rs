//! Per-allocation tracking of enqueued GPU work, so memory is never freed or handed to the host
//! while a stream still uses it.
//!
//! Every asynchronous operation records, for each allocation it touches, an event on the stream
//! it was enqueued on (one reusable event per allocation and stream). Freeing an allocation or
//! giving the host a reference into pinned memory first waits for those events. Work on
//! different streams stays concurrent: nothing here orders streams against each other except the
//! blocking helpers, which wait for everything recorded.

use cudarc::driver::sys;
use parking_lot::Mutex;

use crate::driver::check;
use crate::error::GpuResult;
use crate::stream::StreamHandle;

/// Entries beyond this count trigger pruning of completed events from retired streams.
const PRUNE_AT: usize = 8;

struct TrackedUse {
    stream_id: u64,
    event: sys::CUevent,
}

/// Events marking the last enqueued use of one allocation on each stream.
pub(crate) struct UseTracker {
    entries: Mutex<Vec<TrackedUse>>,
}

// SAFETY: the contained `CUevent`s are driver handles usable from any thread; all access goes
// through the mutex.
unsafe impl Send for UseTracker {}
// SAFETY: as above; shared access is serialised by the mutex.
unsafe impl Sync for UseTracker {}

impl UseTracker {
    pub(crate) fn new() -> Self {
        UseTracker {
            entries: Mutex::new(Vec::new()),
        }
    }

    /// Records that work just enqueued on `stream` uses the allocation.
    ///
    /// The owning context must be current on the calling thread.
    pub(crate) fn record(&self, stream: StreamHandle) -> GpuResult<()> {
        let mut entries = self.entries.lock();
        if let Some(entry) = entries.iter().find(|e| e.stream_id == stream.id) {
            // SAFETY: the event is owned by this tracker and alive; the stream is alive for the
            // duration of the call (the caller holds it).
            let rc = unsafe { sys::cuEventRecord(entry.event, stream.raw) };
            return check(rc, "cuEventRecord");
        }
        if entries.len() >= PRUNE_AT {
            entries.retain(|e| {
                // SAFETY: the event is owned by this tracker and alive.
                let done =
                    unsafe { sys::cuEventQuery(e.event) } == sys::cudaError_enum::CUDA_SUCCESS;
                if done {
                    // SAFETY: the event has completed and is removed from the list, so it is
                    // never used again.
                    let _ = unsafe { sys::cuEventDestroy_v2(e.event) };
                }
                !done
            });
        }
        let mut event: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: the context is current (caller's contract); valid out-pointer.
        let rc = unsafe { sys::cuEventCreate(&mut event, flags) };
        check(rc, "cuEventCreate")?;
        // SAFETY: the event was just created; the stream is alive.
        let rc = unsafe { sys::cuEventRecord(event, stream.raw) };
        if let Err(e) = check(rc, "cuEventRecord") {
            // SAFETY: the event was created above and is not stored anywhere.
            let _ = unsafe { sys::cuEventDestroy_v2(event) };
            return Err(e);
        }
        entries.push(TrackedUse {
            stream_id: stream.id,
            event,
        });
        Ok(())
    }

    /// Blocks the calling thread until every recorded use has completed.
    pub(crate) fn wait_host(&self) -> GpuResult<()> {
        let entries = self.entries.lock();
        for entry in entries.iter() {
            // SAFETY: the event is owned by this tracker and alive.
            let rc = unsafe { sys::cuEventSynchronize(entry.event) };
            check(rc, "cuEventSynchronize")?;
        }
        Ok(())
    }

    /// Makes `stream` wait (on the device) for recorded uses on other streams.
    pub(crate) fn order_before(&self, stream: StreamHandle) -> GpuResult<()> {
        let entries = self.entries.lock();
        for entry in entries.iter().filter(|e| e.stream_id != stream.id) {
            // SAFETY: the event is alive and the stream is alive for the call; flags 0 is the
            // default wait.
            let rc = unsafe { sys::cuStreamWaitEvent(stream.raw, entry.event, 0) };
            check(rc, "cuStreamWaitEvent")?;
        }
        Ok(())
    }

    /// Destroys the events. Owners call this from their `Drop`, after waiting, while their
    /// context is still alive (the context may be destroyed right after, when the owner's last
    /// reference to it goes).
    pub(crate) fn release(&mut self) {
        for entry in self.entries.get_mut().drain(..) {
            // SAFETY: the tracker owns its events; they are removed from the list, so none is
            // used again.
            let _ = unsafe { sys::cuEventDestroy_v2(entry.event) };
        }
    }
}

impl Drop for UseTracker {
    fn drop(&mut self) {
        // Normally already empty (owners call `release`); this only covers owners that never
        // got as far as their own `Drop`.
        self.release();
    }
}
