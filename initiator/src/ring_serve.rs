//! The queue task's side of GPU request rings (see [`crate::ring_proxy`]): the rings a task
//! serves, how it takes their requests and completes them, and when it checks them
//! ([`RingPacer`]).

use std::sync::Arc;
use std::time::Duration;

use gpu_ring::{DataMode, HostRing, PushItem, Read};
use nvme_spec::command::build;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::Error;
use crate::error::{STATUS_INTERNAL, ring_status};
use crate::queue_core::{DataDir, Request, Retry, RingDone, RingSlot};
use crate::registered::{Direct, RegionMem};

/// Requests taken from one ring per wake-up of its queue task, at most.
pub const RING_BATCH: usize = 64;
/// The first step of the idle ladder.
const FIRST_STEP: Duration = Duration::from_micros(50);
/// The longest step of the idle ladder.
const LAST_STEP: Duration = Duration::from_millis(1);

/// What a queue task does about its rings next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RingWait {
    /// No ring attached.
    Nothing,
    /// Poll again without sleeping (a ring is active).
    Poll,
    /// Check the rings at this time at the latest.
    At(Instant),
}

/// When a queue task checks its rings (see the module documentation). Sans-IO: the caller
/// passes the time.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RingPacer {
    window: Duration,
    last_active: Option<Instant>,
    step: Duration,
    next_check: Option<Instant>,
}

impl RingPacer {
    /// A pacer that keeps polling for `window` after the last activity (a request taken or a
    /// completion written: a thread whose read completed often submits the next at once).
    pub fn new(window: Duration) -> Self {
        RingPacer {
            window,
            last_active: None,
            step: FIRST_STEP,
            next_check: None,
        }
    }

    fn hot(&self, now: Instant) -> bool {
        self.last_active
            .is_some_and(|t| now.saturating_duration_since(t) < self.window)
    }

    /// Notes activity at `now`: a request taken or a completion written.
    pub fn active(&mut self, now: Instant) {
        self.last_active = Some(now);
        self.step = FIRST_STEP;
        self.next_check = None;
    }

    /// Notes that the rings were checked at `now` and whether a request was taken.
    pub fn polled(&mut self, now: Instant, took: bool) {
        if took {
            self.active(now);
            return;
        }
        if self.hot(now) {
            return;
        }
        self.next_check = Some(now + self.step);
        self.step = (self.step * 2).min(LAST_STEP);
    }

    /// What to do at `now`.
    pub fn wait(&self, now: Instant) -> RingWait {
        if self.hot(now) {
            return RingWait::Poll;
        }
        RingWait::At(self.next_check.unwrap_or(now))
    }
}

/// How a queue task hands push-mode completions to the device: the push kernel on a stream
/// of the task's own (see `ring_proxy`).
pub(crate) trait PushPath: Send {
    /// Enqueues the data copies and completion words of `items` of ring `ring` (its index in
    /// its set). On an error nothing of the batch runs.
    fn push(&mut self, ring: u32, items: &[PushItem]) -> Result<(), String>;
}

/// A ring attached to a queue task.
struct Entry {
    /// The attachment it belongs to.
    id: u64,
    ring: HostRing,
    /// Time allowed for each of its reads.
    timeout: Duration,
    /// No more requests are taken; dropped once nothing is in flight.
    detaching: bool,
    /// Push mode: reads that ended successfully, waiting for the batch's push.
    pending: Vec<PushItem>,
    /// NVMe/RDMA: the ring's data areas registered with the queue's protection domain (a
    /// read's keyed SGL names its slot there); None over NVMe/TCP (reads are received into
    /// the lent slot).
    region: Option<Arc<RegionMem>>,
}

/// Rings handed to a queue task by one attachment.
pub(crate) struct RingGrant {
    pub(crate) id: u64,
    pub(crate) rings: Vec<HostRing>,
    /// NVMe/RDMA: each ring's registered data areas, in the order of `rings` (empty over
    /// NVMe/TCP).
    pub(crate) regions: Vec<Arc<RegionMem>>,
    pub(crate) timeout: Duration,
    /// The push path for the attachment's push-mode rings.
    pub(crate) push: Option<Box<dyn PushPath>>,
}

/// The rings a queue task serves.
pub(crate) struct RingTable {
    entries: Vec<Option<Entry>>,
    /// Callers waiting for an attachment's rings to be let go.
    waiters: Vec<(u64, oneshot::Sender<()>)>,
    pacer: RingPacer,
    /// Where the next poll starts (rings take turns at free identifiers).
    next: usize,
    /// Scratch: requests taken from a ring.
    reads: Vec<Read>,
    /// Push paths by attachment.
    pushers: Vec<(u64, Box<dyn PushPath>)>,
    /// A ring whose data areas are device memory was attached (its completions need a flush).
    device_data: bool,
    /// Scratch of [`RingTable::complete_all`]: rings flushed for the batch, and whether the
    /// flush worked.
    flushed: Vec<(u16, bool)>,
}

impl RingTable {
    /// An empty table whose rings stay polled for `window` after activity.
    pub fn new(window: Duration) -> Self {
        RingTable {
            entries: Vec::new(),
            waiters: Vec::new(),
            pacer: RingPacer::new(window),
            next: 0,
            reads: Vec::with_capacity(RING_BATCH),
            pushers: Vec::new(),
            device_data: false,
            flushed: Vec::new(),
        }
    }

    /// Whether no ring is attached.
    pub fn is_empty(&self) -> bool {
        self.entries.iter().all(Option::is_none)
    }

    /// What to do about the rings at `now`.
    pub fn wait(&self, now: Instant) -> RingWait {
        if self.is_empty() {
            RingWait::Nothing
        } else {
            self.pacer.wait(now)
        }
    }

    /// Adds the rings of an attachment.
    pub fn attach(&mut self, grant: RingGrant) {
        if let Some(p) = grant.push {
            self.pushers.push((grant.id, p));
        }
        let mut regions = grant.regions.into_iter();
        for ring in grant.rings {
            let region = regions.next();
            self.device_data |= region.as_ref().is_some_and(|r| r.is_device());
            let pending = match ring.mode() {
                DataMode::Push => Vec::with_capacity(ring.slots() as usize),
                DataMode::Pull | DataMode::Device => Vec::new(),
            };
            let e = Entry {
                id: grant.id,
                ring,
                timeout: grant.timeout,
                detaching: false,
                pending,
                region,
            };
            match self.entries.iter_mut().find(|e| e.is_none()) {
                Some(free) => *free = Some(e),
                None => self.entries.push(Some(e)),
            }
        }
        self.pacer.active(Instant::now());
    }

    /// Stops taking requests from attachment `id`'s rings; `done` is answered once they are
    /// let go.
    pub fn detach(&mut self, id: u64, done: Option<oneshot::Sender<()>>) {
        for e in self.entries.iter_mut().flatten() {
            if e.id == id {
                e.detaching = true;
            }
        }
        if let Some(tx) = done {
            self.waiters.push((id, tx));
        }
        self.reap();
    }

    /// Drops the detached rings with nothing in flight and answers who waits for them.
    pub fn reap(&mut self) {
        for slot in &mut self.entries {
            if slot
                .as_ref()
                .is_some_and(|e| e.detaching && e.ring.in_flight() == 0)
            {
                *slot = None;
            }
        }
        let entries = &self.entries;
        let mut i = 0;
        while i < self.pushers.len() {
            let id = self.pushers[i].0;
            if entries.iter().flatten().any(|e| e.id == id) {
                i += 1;
            } else {
                let (_, p) = self.pushers.swap_remove(i);
                // Freeing device memory may wait for the whole device, including kernels
                // that wait on other rings this task serves: let another thread do it.
                let _ = std::thread::Builder::new()
                    .name("nvmeof-ring-push-drop".into())
                    .spawn(move || drop(p));
            }
        }
        let mut i = 0;
        while i < self.waiters.len() {
            let id = self.waiters[i].0;
            if entries.iter().flatten().any(|e| e.id == id) {
                i += 1;
            } else {
                let (_, tx) = self.waiters.swap_remove(i);
                let _ = tx.send(());
            }
        }
    }

    /// Notes completions written at `now` (the rings stay polled for the window).
    pub fn completed(&mut self, now: Instant) {
        self.pacer.active(now);
    }

    /// Writes the completion words of the ring reads that ended ([`RingTable::complete`]).
    /// Rings whose data areas are device memory get the NIC's writes flushed first, once per
    /// ring with reads in `done`, so that a thread that sees a completion word sees the data
    /// (a failed flush completes the ring's successful reads with Internal Error).
    pub fn complete_all(&mut self, done: &[RingDone]) {
        self.flushed.clear();
        if self.device_data {
            for d in done {
                let ring = d.origin.ring;
                if self.flushed.iter().any(|&(r, _)| r == ring) {
                    continue;
                }
                let Some(Some(e)) = self.entries.get(usize::from(ring)) else {
                    continue;
                };
                let Some(region) = e.region.as_ref().filter(|r| r.is_device()) else {
                    continue;
                };
                let ok = match region.flush() {
                    Ok(()) => true,
                    Err(err) => {
                        tracing::warn!(
                            ring = e.ring.index(),
                            "GPU ring reads completed with Internal Error: {err}"
                        );
                        false
                    }
                };
                self.flushed.push((ring, ok));
            }
        }
        for d in done {
            let failed = self
                .flushed
                .iter()
                .any(|&(r, ok)| r == d.origin.ring && !ok);
            let status = if failed && d.status == 0 {
                STATUS_INTERNAL
            } else {
                d.status
            };
            self.complete(d.origin, status);
        }
    }

    /// Writes the completion word of a ring read that ended; in push mode a successful read
    /// joins its ring's next push instead ([`RingTable::push_pending`]).
    pub fn complete(&mut self, origin: RingSlot, status: u16) {
        if let Some(Some(e)) = self.entries.get_mut(usize::from(origin.ring)) {
            if e.ring.mode() == DataMode::Push && status == 0 {
                e.pending.extend(e.ring.complete_push(origin.slot, status));
            } else {
                e.ring.complete(origin.slot, status);
            }
        }
    }

    /// Pushes the successful push-mode reads completed since the last call: one push (one
    /// host-to-device copy and one kernel) per ring. A push that cannot be enqueued fails its
    /// reads with Internal Error, published from the host.
    pub fn push_pending(&mut self) {
        for e in self.entries.iter_mut().flatten() {
            if e.pending.is_empty() {
                continue;
            }
            let res = match self.pushers.iter_mut().find(|p| p.0 == e.id) {
                Some((_, p)) => p.push(e.ring.index(), &e.pending),
                None => Err("no push path for this ring".into()),
            };
            if let Err(msg) = res {
                tracing::warn!(
                    ring = e.ring.index(),
                    reads = e.pending.len(),
                    "GPU ring push failed, reads completed with Internal Error: {msg}"
                );
                for item in &e.pending {
                    e.ring.fail_push(item, STATUS_INTERNAL);
                }
            }
            e.pending.clear();
        }
    }

    /// Polls the rings once at `now`: for each ring that takes requests, `tags` gives up to
    /// `max` command identifiers (returning fewer, or none when the queue has none free) and
    /// gets back those left unused; `start` starts each valid request with its identifier
    /// (and, over NVMe/RDMA, the registered memory of its slot for the keyed SGL).
    /// When `failed` is set the queue cannot send anything: requests are taken without
    /// identifiers and completed at once with the status of that error. Returns the requests
    /// taken (valid or not).
    pub fn poll(
        &mut self,
        now: Instant,
        failed: Option<&Error>,
        tags: &mut dyn TagSource,
        start: &mut dyn FnMut(u16, Request, gpu_ring::SlotData, Option<Direct>, RingSlot),
    ) -> usize {
        let n = self.entries.len();
        let mut taken = 0;
        for k in 0..n {
            let idx = (self.next + k) % n;
            let Some(e) = self.entries[idx].as_mut().filter(|e| !e.detaching) else {
                continue;
            };
            self.reads.clear();
            if let Some(err) = failed {
                taken += e.ring.poll(RING_BATCH, &mut self.reads);
                let status = ring_status(&Err(err.clone()));
                for r in self.reads.drain(..) {
                    e.ring.complete(r.slot, status);
                }
                continue;
            }
            // Command identifiers cost a lock to take and give back: only for a ring with a
            // request waiting.
            if !e.ring.ready() {
                continue;
            }
            let got = tags.take(RING_BATCH);
            if got.is_empty() {
                break;
            }
            let have = got.len();
            taken += e.ring.poll(have, &mut self.reads);
            let used = self.reads.len();
            for (i, r) in self.reads.drain(..).enumerate() {
                let tag = got[i];
                let req = Request {
                    sqe: build::read_write(false, 0, r.nsid, r.lba, r.nblocks),
                    dir: DataDir::ToHost,
                    len: r.bytes as u32,
                    retry: Retry::Always,
                    timeout: Some(e.timeout),
                };
                let direct = e.region.as_ref().map(|mem| Direct {
                    mem: Arc::clone(mem),
                    offset: e.ring.data_offset(r.slot),
                });
                let data = e.ring.lend(r.slot);
                let origin = RingSlot {
                    ring: idx as u16,
                    slot: r.slot,
                };
                start(tag, req, data, direct, origin);
            }
            tags.give_back(used);
        }
        self.next = self.next.wrapping_add(1);
        self.pacer.polled(now, taken > 0);
        taken
    }
}

/// Free command identifiers of a queue, lent to [`RingTable::poll`].
pub(crate) trait TagSource {
    /// Takes up to `max` free identifiers (fewer when the queue has fewer free).
    fn take(&mut self, max: usize) -> &[u16];
    /// Returns the identifiers of the last [`take`](Self::take) from index `used` on.
    fn give_back(&mut self, used: usize);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn pacer_polls_while_active_then_climbs_the_ladder() {
        let t0 = Instant::now();
        let mut p = RingPacer::new(us(50));
        p.polled(t0, true);
        assert_eq!(p.wait(t0 + us(10)), RingWait::Poll);
        // Nothing taken inside the window: keep polling.
        p.polled(t0 + us(20), false);
        assert_eq!(p.wait(t0 + us(20)), RingWait::Poll);
        // Past the window: 50 µs, 100, 200, 400, 800, then 1 ms steps.
        let mut now = t0 + us(60);
        let mut steps = Vec::new();
        for _ in 0..8 {
            p.polled(now, false);
            let RingWait::At(at) = p.wait(now) else {
                panic!("expected a timed check");
            };
            steps.push((at - now).as_micros());
            now = at;
        }
        assert_eq!(steps, [50, 100, 200, 400, 800, 1000, 1000, 1000]);
        // A completion written keeps the rings polled too.
        p.active(now);
        assert_eq!(p.wait(now + us(49)), RingWait::Poll);
        // A request resets the ladder.
        p.polled(now, true);
        assert_eq!(p.wait(now), RingWait::Poll);
        p.polled(now + us(100), false);
        assert_eq!(p.wait(now + us(100)), RingWait::At(now + us(150)));
    }

    /// Batches a [`Recorder`] was given: (ring, items).
    type Batches = std::sync::Arc<std::sync::Mutex<Vec<(u32, Vec<PushItem>)>>>;

    /// Records the batches it is given, or fails every push.
    struct Recorder {
        batches: Batches,
        fail: bool,
    }

    impl PushPath for Recorder {
        fn push(&mut self, ring: u32, items: &[PushItem]) -> Result<(), String> {
            if self.fail {
                return Err("no device".into());
            }
            self.batches.lock().unwrap().push((ring, items.to_vec()));
            Ok(())
        }
    }

    struct Tags(Vec<u16>, u16);

    impl TagSource for Tags {
        fn take(&mut self, max: usize) -> &[u16] {
            self.0 = (self.1..self.1 + max as u16).collect();
            &self.0
        }

        fn give_back(&mut self, used: usize) {
            self.1 += used as u16;
            self.0.clear();
        }
    }

    /// A table serving one push-mode stand-in ring whose push path records (or fails) batches.
    fn push_table(fail: bool) -> (gpu_ring::RingSet, RingTable, Batches) {
        use gpu_ring::{NsBinding, RingConfig, RingSet};
        let ns = NsBinding {
            nsid: 1,
            block_size: 512,
            blocks: 1024,
        };
        let cfg = RingConfig {
            slots: 8,
            slot_bytes: 4096,
            mode: DataMode::Push,
        };
        let mut set = RingSet::new_host(1, cfg, &[ns]).unwrap();
        let batches = std::sync::Arc::default();
        let mut table = RingTable::new(Duration::ZERO);
        table.attach(RingGrant {
            id: 7,
            rings: set.take_host_rings(),
            regions: Vec::new(),
            timeout: Duration::from_secs(1),
            push: Some(Box::new(Recorder {
                batches: std::sync::Arc::clone(&batches),
                fail,
            })),
        });
        (set, table, batches)
    }

    fn take_all(table: &mut RingTable) -> Vec<RingSlot> {
        let mut origins = Vec::new();
        let mut tags = Tags(Vec::new(), 0);
        table.poll(Instant::now(), None, &mut tags, &mut |_, _, _, _, o| {
            origins.push(o)
        });
        origins
    }

    #[test]
    fn push_mode_reads_leave_in_one_push_per_ring_and_errors_do_not_wait() {
        let (set, mut table, batches) = push_table(false);
        let dev = set.standin_rings().remove(0);
        let tickets: Vec<_> = (0..3)
            .map(|i| dev.submit(0, i * 8, 8, 0x1000 * i))
            .collect();
        let origins = take_all(&mut table);
        assert_eq!(origins.len(), 3);
        table.complete(origins[0], 0);
        table.complete(origins[2], 0);
        // An error status is published by the host at once, with no push.
        table.complete(origins[1], 0x80);
        assert!(dev.test(&tickets[1]));
        assert!(!dev.test(&tickets[0]) && !dev.test(&tickets[2]));
        table.push_pending();
        let got = batches.lock().unwrap().clone();
        assert_eq!(got.len(), 1, "one push for the ring");
        let (ring, items) = &got[0];
        assert_eq!(*ring, 0);
        assert_eq!(
            items.iter().map(|i| (i.slot, i.bytes)).collect::<Vec<_>>(),
            [(origins[0].slot, 4096), (origins[2].slot, 4096)]
        );
        // The words wait for the device's push; the stand-in's push kernel stores them.
        assert!(!dev.test(&tickets[0]));
        for item in items {
            assert!(dev.push(item, |_, b| assert_eq!(b.len(), 4096)));
        }
        let mut buf = [0u8; 0];
        for t in tickets {
            let want = if t.value() == 1 { 0x80 } else { 0 };
            assert_eq!(dev.wait(t, Duration::from_secs(1), &mut buf), want);
        }
        // Nothing left to push.
        table.push_pending();
        assert_eq!(batches.lock().unwrap().len(), 1);
    }

    #[test]
    fn a_push_that_fails_completes_its_reads_with_internal_error() {
        let (set, mut table, _) = push_table(true);
        let dev = set.standin_rings().remove(0);
        let t = dev.submit(0, 0, 1, 0);
        let origins = take_all(&mut table);
        table.complete(origins[0], 0);
        table.push_pending();
        let mut buf = [0u8; 0];
        assert_eq!(
            dev.wait(t, Duration::from_secs(1), &mut buf),
            STATUS_INTERNAL
        );
    }

    #[test]
    fn pacer_without_a_window_never_spins() {
        let t0 = Instant::now();
        let mut p = RingPacer::new(Duration::ZERO);
        p.polled(t0, true);
        assert_eq!(p.wait(t0), RingWait::At(t0));
        p.polled(t0, false);
        assert_eq!(p.wait(t0), RingWait::At(t0 + us(50)));
    }
}
