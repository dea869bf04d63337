//! Per-allocation tracking of enqueued GPU work, so memory is never freed or handed to the host
//! while a stream still uses it.
//!
//! Every asynchronous operation records, for each allocation it touches, an event on the stream
//! it was enqueued on (one reusable event per allocation and stream; a batch of copies records
//! one event that all its allocations share). Freeing an allocation or
//! giving the host a reference into pinned memory first waits for those events. Work on
//! different streams stays concurrent: nothing here orders streams against each other except the
//! blocking helpers, which wait for everything recorded.

use std::sync::Arc;

use cudarc::driver::sys;
use parking_lot::Mutex;

use crate::driver::check;
use crate::error::GpuResult;
use crate::stream::StreamHandle;

/// Entries beyond this count trigger pruning of completed events from retired streams.
const PRUNE_AT: usize = 8;

/// A driver event held by one tracker entry or shared by the entries of every allocation one
/// batch touched; destroyed with its last holder.
pub(crate) struct TrackerEvent(sys::CUevent);

// SAFETY: a `CUevent` handle may be used from any thread; the wrapper only records, queries,
// waits on and destroys it.
unsafe impl Send for TrackerEvent {}
// SAFETY: as above; every driver call on the handle is thread-safe.
unsafe impl Sync for TrackerEvent {}

impl TrackerEvent {
    /// A new event (no timing) recorded on `stream`. The owning context must be current.
    pub(crate) fn recorded(stream: StreamHandle) -> GpuResult<Self> {
        let mut event: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: the context is current (caller's contract); valid out-pointer.
        let rc = unsafe { sys::cuEventCreate(&mut event, flags) };
        check(rc, "cuEventCreate")?;
        // From here on `Drop` destroys the event.
        let event = TrackerEvent(event);
        event.record(stream)?;
        Ok(event)
    }

    /// Records the event again on `stream`, after the work enqueued there so far.
    fn record(&self, stream: StreamHandle) -> GpuResult<()> {
        // SAFETY: the event is alive while `self` is; the stream is alive for the duration of
        // the call (the caller holds it).
        let rc = unsafe { sys::cuEventRecord(self.0, stream.raw) };
        check(rc, "cuEventRecord")
    }

    fn is_done(&self) -> bool {
        // SAFETY: the event is alive while `self` is.
        unsafe { sys::cuEventQuery(self.0) == sys::cudaError_enum::CUDA_SUCCESS }
    }
}

impl Drop for TrackerEvent {
    fn drop(&mut self) {
        // SAFETY: the last holder drops the event, so it is never used again; an event still
        // pending in a stream is released by the driver once it completes.
        let _ = unsafe { sys::cuEventDestroy_v2(self.0) };
    }
}

struct TrackedUse {
    stream_id: u64,
    event: Arc<TrackerEvent>,
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
            // A shared event moves later on the same stream: its other holders then wait for
            // a little more work than theirs, never less.
            return entry.event.record(stream);
        }
        Self::prune(&mut entries);
        let event = Arc::new(TrackerEvent::recorded(stream)?);
        entries.push(TrackedUse {
            stream_id: stream.id,
            event,
        });
        Ok(())
    }

    /// Records that work just enqueued on stream `stream_id` uses the allocation, marked by
    /// `event` (recorded on that stream after the work, and shared with the other allocations
    /// the work touched): no driver call.
    pub(crate) fn record_shared(&self, stream_id: u64, event: &Arc<TrackerEvent>) {
        let mut entries = self.entries.lock();
        if let Some(entry) = entries.iter_mut().find(|e| e.stream_id == stream_id) {
            entry.event = Arc::clone(event);
            return;
        }
        Self::prune(&mut entries);
        entries.push(TrackedUse {
            stream_id,
            event: Arc::clone(event),
        });
    }

    /// Drops completed entries once there are many (streams that retired).
    fn prune(entries: &mut Vec<TrackedUse>) {
        if entries.len() >= PRUNE_AT {
            entries.retain(|e| !e.event.is_done());
        }
    }

    /// Blocks the calling thread until every recorded use has completed.
    pub(crate) fn wait_host(&self) -> GpuResult<()> {
        let entries = self.entries.lock();
        for entry in entries.iter() {
            // SAFETY: the event is alive while the entry holds it.
            let rc = unsafe { sys::cuEventSynchronize(entry.event.0) };
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
            let rc = unsafe { sys::cuStreamWaitEvent(stream.raw, entry.event.0, 0) };
            check(rc, "cuStreamWaitEvent")?;
        }
        Ok(())
    }

    /// Destroys the events. Owners call this from their `Drop`, after waiting, while their
    /// context is still alive (the context may be destroyed right after, when the owner's last
    /// reference to it goes).
    pub(crate) fn release(&mut self) {
        // An event shared with other allocations lives on until its last holder lets go.
        self.entries.get_mut().clear();
    }
}

impl Drop for UseTracker {
    fn drop(&mut self) {
        // Normally already empty (owners call `release`); this only covers owners that never
        // got as far as their own `Drop`.
        self.release();
    }
}
