//! GPU request rings served by the queue tasks: the proxy between rings that GPU threads
//! fill (`nvmeof-gpu-ring`) and the controller's I/O queues.
//!
//! [`Controller::attach_gpu_rings`] hands every ring of a [`RingSet`] to one I/O queue task
//! (round robin over the queues). That task owns the ring ([`HostRing`]) from then on; no
//! other thread touches it and nothing is locked per request:
//!
//! - each wake-up of the task takes up to [`RING_BATCH`] ready requests per ring, as many as
//!   free command identifiers allow (identifiers are taken from the queue's free list with
//!   one lock per batch). Requests beyond that stay in the ring: the GPU sees backpressure as
//!   latency, never a lost request;
//! - the ring checks each request (namespace bound to the ring, LBA range, size) when it is
//!   taken and completes a bad one at once with an NVMe status; a valid one becomes a Read on
//!   the queue's connection whose data lands straight in the request's data slot, with no
//!   allocation and no copy: over NVMe/TCP it is received from the socket into the lent slot
//!   (`SlotBuf::Ring`); over NVMe/RDMA the command's keyed SGL names the slot inside the
//!   ring's data areas, which attaching registered once with the protection domain the
//!   controller's queues share, and the target RDMA WRITEs the data there. The target's
//!   completion arrives after its data (reliable-connection ordering), so the completion word
//!   is written after the data is in place, as over TCP. A read whose deadline passes has its
//!   queue pair destroyed before its slot is completed, so a late RDMA WRITE cannot reach a
//!   slot the device has moved on from. The registration belongs to the protection domain the
//!   controller's queues share, which a reconnect through the same RDMA device keeps; should
//!   the controller come back through another device, the rings' reads complete with Internal
//!   Error and the rings must be attached again;
//! - the whole batch leaves with one write (the task's flush at the top of its loop);
//! - when a read ends, the task writes the slot's completion word with the NVMe status of
//!   the completion, or with a status standing for the error ([`ring_status`]);
//! - a lost connection is handled as for any read: reads in flight are sent again on the
//!   next connection, so the GPU sees only latency.
//!
//! Push mode ([`DataMode::Push`], feature `gpu`): each queue task that serves push rings has a
//! push path of its own (`nvmeof_cuda_kernels::ring::RingPush` and a CUDA stream; the push
//! kernel is compiled once per attachment). The successful reads that ended in one wake-up
//! leave as one push per ring: one host-to-device copy of the span of the slots, then the push
//! kernel, which copies each slot to its destination and stores its completion word. Reads that
//! ended with an error status are published by the task at once. A push that cannot be
//! enqueued completes its reads with Internal Error, published by the task. The push kernel
//! needs room on the GPU to run next to the kernels that wait on the rings.
//!
//! Polling (`RingPacer`): the task checks its rings at every wake-up. While a ring is active
//! the task keeps polling it without sleeping for the ring poll window
//! (`ConnectOptions::ring_poll`, 1 ms by default) after the last request taken or completion
//! written (a thread whose read completed usually submits the next after copying and using
//! the data, tens of microseconds later); after that it checks the
//! rings on a timer ladder, 50 µs doubling to 1 ms, so an idle ring costs about a thousand
//! checks a second and no spinning. (The tokio timer has a 1 ms granularity, so on a tokio
//! runtime the steps below 1 ms round up to it: the first request after an idle period waits
//! at most about 1 ms for the task.)
//!
//! [`Controller::attach_gpu_rings_n`] attaches only the next `n` rings of a set, so one set
//! can be split among several controllers (each serving a contiguous share of its rings).
//!
//! Dropping the [`AttachedRings`] handle (or [`AttachedRings::detach`]) detaches the rings:
//! their tasks stop taking requests, let the reads in flight end (completing their slots) and
//! only then drop the rings. Dropping a ring closes it: requests left in it are never taken,
//! and the device side's submits and waits on it return `CLOSED`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use gpu_ring::{DataMode, HostRing, RingSet};
use tokio::sync::oneshot;

use crate::queue::QueueCtl;
use crate::registered::{RegionMem, register_ring};
use crate::ring_serve::{PushPath, RingGrant};
use crate::{Controller, Error};

/// GPU request rings attached to a controller's I/O queues (see
/// [`Controller::attach_gpu_rings`]). Dropping it detaches them: each queue task stops taking
/// requests from its rings, lets the reads in flight end (their slots complete) and then
/// drops the rings; [`detach`](Self::detach) does the same and waits for it.
pub struct AttachedRings {
    ctrl: Controller,
    id: u64,
    /// The I/O queues holding the rings (indices into the controller's queues).
    queues: Vec<usize>,
    rings: usize,
    detached: bool,
}

impl std::fmt::Debug for AttachedRings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttachedRings")
            .field("rings", &self.rings)
            .field("queues", &self.queues)
            .finish()
    }
}

impl AttachedRings {
    /// Number of rings attached.
    pub fn rings(&self) -> usize {
        self.rings
    }

    /// The I/O queues serving the rings (indices, as for `Namespace::on_queue`).
    pub fn queues(&self) -> &[usize] {
        &self.queues
    }

    /// Detaches the rings and waits until every queue task has let its rings go (the reads
    /// in flight ended and their completion words are written).
    pub async fn detach(mut self) {
        self.detached = true;
        let mut waits = Vec::with_capacity(self.queues.len());
        for &q in &self.queues {
            let (tx, rx) = oneshot::channel();
            self.ctrl.shared().io[q].control(QueueCtl::DetachRings {
                id: self.id,
                done: Some(tx),
            });
            waits.push(rx);
        }
        for rx in waits {
            // An error: the task ended, and its rings with it.
            let _ = rx.await;
        }
    }
}

impl Drop for AttachedRings {
    fn drop(&mut self) {
        if self.detached {
            return;
        }
        for &q in &self.queues {
            self.ctrl.shared().io[q].control(QueueCtl::DetachRings {
                id: self.id,
                done: None,
            });
        }
    }
}

static NEXT_ATTACHMENT: AtomicU64 = AtomicU64::new(1);

impl Controller {
    /// Attaches the host sides of the rings of `set` (all it still holds) to this
    /// controller's I/O queues, round robin: from now on the queue tasks take the requests
    /// GPU threads put in the rings and serve them as reads (see the `ring_proxy` section of
    /// the crate documentation).
    ///
    /// Checked first: over NVMe/RDMA the controller's queues must share a protection domain
    /// (else [`Error::Unsupported`]); push mode needs a set
    /// made on a GPU ([`RingSet::new_gpu`], else [`Error::InvalidArgument`]) and the `gpu`
    /// feature (else [`Error::Unsupported`]), and its push kernel is compiled here
    /// ([`Error::Gpu`] when that fails); up to this point a refused set keeps its rings. Then
    /// a data slot must fit in one command (the controller's maximum transfer) and every
    /// namespace bound to a ring must be active here with the bound block size and at least
    /// the bound number of blocks, and over NVMe/RDMA each ring's data areas are registered
    /// with the protection domain (a failed registration is an RDMA error); on those errors
    /// the rings are dropped unattached.
    ///
    /// The same as [`Controller::attach_gpu_rings_n`] with `usize::MAX` (every ring left).
    pub async fn attach_gpu_rings(&self, set: &mut RingSet) -> Result<AttachedRings, Error> {
        self.attach_gpu_rings_n(set, usize::MAX).await
    }

    /// Attaches the next `n` rings of `set` not attached yet (fewer when fewer are left; see
    /// [`RingSet::take_host_rings_n`]) to this controller's I/O queues, round robin, with the
    /// checks and errors of [`Controller::attach_gpu_rings`]. Calls in turn on several
    /// controllers split one set among them: each serves a contiguous share of the rings
    /// (ring `i` of the set keeps its index, so a kernel can tell from the ring which
    /// controller serves it). Every ring is bound to the same namespace table, which must
    /// hold on each controller; `n = 0` is [`Error::InvalidArgument`].
    pub async fn attach_gpu_rings_n(
        &self,
        set: &mut RingSet,
        n: usize,
    ) -> Result<AttachedRings, Error> {
        let shared = self.shared();
        // NVMe/RDMA: the rings' data areas are registered with the queues' protection domain.
        let pd = self.rdma_pd()?;
        if pd.is_none() && !shared.limits.lends_buffers {
            return Err(Error::Unsupported(
                "this transport cannot receive read data into the rings' slots".into(),
            ));
        }
        if set.config().mode == DataMode::Device && pd.is_none() {
            return Err(Error::Unsupported(
                "rings whose data areas are device memory (DataMode::Device) are written by the NIC: NVMe/RDMA only (over NVMe/TCP use pull or push mode)".into(),
            ));
        }
        let nq = self.io_queue_count();
        if nq == 0 {
            return Err(Error::InvalidArgument(
                "the controller has no I/O queues".into(),
            ));
        }
        if n == 0 {
            return Err(Error::InvalidArgument(
                "attach at least one ring (n = 0)".into(),
            ));
        }
        // One push path per queue that gets a ring (push mode only), set up before any ring
        // is taken from the set.
        let mut pushers = match set.config().mode {
            DataMode::Pull | DataMode::Device => Vec::new(),
            DataMode::Push => push_paths(set, nq.min(n.min(set.rings_left())).max(1))?,
        };
        let rings = set.take_host_rings_n(n);
        if rings.is_empty() {
            return Err(Error::InvalidArgument(
                "the ring set has no rings left to attach".into(),
            ));
        }
        let max = shared.info_max_transfer();
        for ring in &rings {
            if ring.slot_bytes() > max {
                return Err(Error::InvalidArgument(format!(
                    "ring slots of {} bytes exceed the controller's largest transfer ({max} bytes)",
                    ring.slot_bytes()
                )));
            }
            for b in ring.namespaces() {
                let info = self.namespace_info(b.nsid).await?;
                if info.block_size != b.block_size || info.blocks < b.blocks {
                    return Err(Error::InvalidArgument(format!(
                        "ring binds namespace {} as {} blocks of {} bytes; the controller has {} blocks of {} bytes",
                        b.nsid, b.blocks, b.block_size, info.blocks, info.block_size
                    )));
                }
            }
        }
        let mut regions = match &pd {
            Some(pd) => rings
                .iter()
                .map(|r| register_ring(pd, r))
                .collect::<Result<Vec<_>, _>>()?,
            None => Vec::new(),
        }
        .into_iter();
        let id = NEXT_ATTACHMENT.fetch_add(1, Ordering::Relaxed);
        let count = rings.len();
        let mut per_queue: Vec<(Vec<HostRing>, Vec<Arc<RegionMem>>)> =
            (0..nq).map(|_| Default::default()).collect();
        for (i, ring) in rings.into_iter().enumerate() {
            let q = &mut per_queue[i % nq];
            q.0.push(ring);
            q.1.extend(regions.next());
        }
        let timeout = shared.opts.timeouts.io;
        let mut queues = Vec::new();
        pushers.reverse();
        for (q, (rings, regions)) in per_queue.into_iter().enumerate() {
            if rings.is_empty() {
                continue;
            }
            let push = pushers.pop();
            shared.io[q].control(QueueCtl::AttachRings(RingGrant {
                id,
                rings,
                regions,
                timeout,
                push,
            }));
            queues.push(q);
        }
        Ok(AttachedRings {
            ctrl: self.clone(),
            id,
            queues,
            rings: count,
            detached: false,
        })
    }
}

/// Push paths for `n` queue tasks: the push kernel compiled once, then one `RingPush` (its own
/// staging and item buffers, sized for the whole set) and one stream per task.
#[cfg(feature = "gpu")]
fn push_paths(set: &RingSet, n: usize) -> Result<Vec<Box<dyn PushPath>>, Error> {
    use nvmeof_cuda_kernels::ring::RingPush;
    let Some(src) = set.push_source() else {
        return Err(Error::InvalidArgument(
            "push mode needs a ring set on a GPU (RingSet::new_gpu)".into(),
        ));
    };
    let gpu = |e: &dyn std::fmt::Display| Error::Gpu(format!("ring push path: {e}"));
    let ctx = src.table().context();
    let mut first = RingPush::load(&ctx).map_err(|e| gpu(&e))?;
    first.reserve(set).map_err(|e| gpu(&e))?;
    let mut pushes = Vec::with_capacity(n);
    for _ in 1..n {
        pushes.push(first.fork().map_err(|e| gpu(&e))?);
    }
    pushes.push(first);
    pushes
        .into_iter()
        .map(|push| {
            let stream = ctx.new_stream().map_err(|e| gpu(&e))?;
            Ok(Box::new(GpuPush {
                push,
                stream,
                src: src.clone(),
            }) as Box<dyn PushPath>)
        })
        .collect()
}

#[cfg(not(feature = "gpu"))]
fn push_paths(_set: &RingSet, _n: usize) -> Result<Vec<Box<dyn PushPath>>, Error> {
    Err(Error::Unsupported(
        "GPU request rings in push mode need the initiator's `gpu` feature (the push kernel)"
            .into(),
    ))
}

/// A queue task's push path: the push kernel's buffers and a stream of its own.
#[cfg(feature = "gpu")]
struct GpuPush {
    push: nvmeof_cuda_kernels::ring::RingPush,
    stream: crate::gpu::cuda::GpuStream,
    src: gpu_ring::PushSource,
}

#[cfg(feature = "gpu")]
impl PushPath for GpuPush {
    fn push(&mut self, ring: u32, items: &[gpu_ring::PushItem]) -> Result<(), String> {
        self.push
            .push(&self.stream, &self.src, ring, items)
            .map_err(|e| e.to_string())
    }
}
