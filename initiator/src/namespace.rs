//! I/O on a namespace: read, write, flush, write zeroes, deallocate.

use std::collections::VecDeque;
use std::sync::Arc;

use nvme_spec::command::build;
use nvme_spec::opcode::io;
use nvme_spec::{Cqe, Sqe};

use crate::buffer::{Lent, ReadDest, WriteSource, buffer_error};
use crate::queue::{DataDir, Pending, QueueHandle, Request, Retry};
use crate::registered::{Direct, RegionMem, check_range as check_buffer_range, split};
use crate::{Controller, Error, NamespaceInfo, RegisteredBuffer};

/// Largest number of logical blocks in one Read/Write (16-bit 0's based NLB).
pub(crate) const MAX_NLB: u64 = 65536;

/// A namespace of a connected controller. Cheap to clone; holds the controller open.
///
/// Transfers larger than the controller's maximum (MDTS) are split into several commands that
/// are in flight together on one queue, and reassembled in the caller's buffer. Writes up to
/// the in-capsule limit travel inside the command capsule; larger writes are sent when the
/// controller asks for the data (R2T).
#[derive(Clone, Debug)]
pub struct Namespace {
    ctrl: Controller,
    info: NamespaceInfo,
    shift: u32,
    queue: Option<usize>,
}

impl Namespace {
    pub(crate) fn new(ctrl: Controller, info: NamespaceInfo) -> Self {
        let shift = info.block_size.trailing_zeros();
        Namespace {
            ctrl,
            info,
            shift,
            queue: None,
        }
    }

    /// Namespace ID.
    pub fn nsid(&self) -> u32 {
        self.info.nsid
    }

    /// Logical block size in bytes.
    pub fn block_size(&self) -> u32 {
        self.info.block_size
    }

    /// Size in logical blocks (as of when this handle was made).
    pub fn num_blocks(&self) -> u64 {
        self.info.blocks
    }

    /// Size in bytes (as of when this handle was made).
    pub fn size_bytes(&self) -> u64 {
        self.info.size_bytes
    }

    /// What Identify Namespace reported.
    pub fn info(&self) -> &NamespaceInfo {
        &self.info
    }

    /// The controller.
    pub fn controller(&self) -> &Controller {
        &self.ctrl
    }

    /// A handle that sends every command to I/O queue `index` (modulo the number of queues),
    /// instead of the queue chosen by the controller's queue policy.
    pub fn on_queue(&self, index: usize) -> Namespace {
        Namespace {
            queue: Some(index),
            ..self.clone()
        }
    }

    fn queue(&self) -> Result<&QueueHandle, Error> {
        self.ctrl.io_queue(self.queue)
    }

    /// Largest transfer per command, in bytes (a whole number of blocks).
    pub(crate) fn max_chunk(&self) -> usize {
        let max = u64::from(self.ctrl.shared().info_max_transfer());
        let blocks = (max >> self.shift).clamp(1, MAX_NLB);
        (blocks << self.shift) as usize
    }

    pub(crate) fn check_len(&self, lba: u64, len: usize) -> Result<(), Error> {
        if len == 0 || len % self.info.block_size as usize != 0 {
            return Err(Error::InvalidArgument(format!(
                "transfer length {len} is not a non-zero multiple of the block size {}",
                self.info.block_size
            )));
        }
        check_range(lba, (len >> self.shift) as u64)
    }

    fn rw_request(&self, write: bool, lba: u64, len: usize) -> Request {
        self.request(write, lba, len, false)
    }

    /// A Read or Write; a write with `fua` asks for Force Unit Access.
    pub(crate) fn request(&self, write: bool, lba: u64, len: usize, fua: bool) -> Request {
        let nlb = (len >> self.shift) as u32;
        let timeouts = &self.ctrl.shared().opts.timeouts;
        let sqe = if fua {
            build::write_fua(0, self.info.nsid, lba, nlb)
        } else {
            build::read_write(write, 0, self.info.nsid, lba, nlb)
        };
        Request {
            sqe,
            dir: if write {
                DataDir::FromHost
            } else {
                DataDir::ToHost
            },
            len: len as u32,
            retry: if write { Retry::Write } else { Retry::Always },
            timeout: Some(timeouts.io),
        }
    }

    pub(crate) fn plain_request(&self, sqe: Sqe, retry: Retry) -> Request {
        Request {
            sqe,
            dir: DataDir::None,
            len: 0,
            retry,
            timeout: Some(self.ctrl.shared().opts.timeouts.io),
        }
    }

    /// Number of commands of one transfer kept in flight together.
    fn window(q: &QueueHandle) -> usize {
        (q.window() / 2).clamp(1, 32)
    }

    /// Reads `buf.len()` bytes (a multiple of the block size) starting at block `lba`.
    pub async fn read(&self, lba: u64, buf: &mut [u8]) -> Result<(), Error> {
        self.read_into(lba, buf).await
    }

    /// Reads `dest.len()` bytes starting at block `lba` into any [`ReadDest`].
    pub async fn read_into<D: ReadDest + ?Sized>(
        &self,
        lba: u64,
        dest: &mut D,
    ) -> Result<(), Error> {
        let total = dest.len();
        self.check_len(lba, total)?;
        let q = self.queue()?;
        if total > self.max_chunk() {
            // The commands in flight of a split read live on the heap: the future of every
            // read stays small (a caller's future is moved into place by copying).
            let window = Self::window(q);
            return Box::pin(self.read_pieces(q, &mut [(lba, dest)], window)).await;
        }
        let req = self.rw_request(false, lba, total);
        let lend = self.ctrl.shared().limits.lends_buffers;
        let Some(buf) = lend_buffer(lend, dest, 0, total)? else {
            let (_, r) = q
                .execute(req, |_| Ok(()), |d: &[u8]| dest.write_at(0, d))
                .await?;
            return r.map_err(buffer_error);
        };
        let mut p = q.start_lent(req, buf).await?;
        let result = p.wait().await.and_then(|cqe| check("Read", &cqe));
        if let Some(buf) = p.take_lent() {
            dest.take_back(0, total, buf, result.is_ok())
                .map_err(buffer_error)?;
        }
        result
    }

    /// Reads many ranges at once: each `(lba, dest)` reads `dest.len()` bytes (a non-zero
    /// multiple of the block size) starting at block `lba`. The commands are in flight
    /// together on one queue, as many as it has free slots (ranges above the controller's
    /// maximum transfer are split), and this one future waits for them, oldest first. Every
    /// range is checked before any command is sent. On the first failure the reads not yet
    /// ended are abandoned and the error is returned; the destinations of reads that did not
    /// end hold unspecified bytes.
    ///
    /// A batch of small reads costs less this way than a [`read_into`](Self::read_into)
    /// future per read joined together (`futures::future::try_join_all` and the like): no
    /// allocation or wake-up per read, and each command is looked at when it is the oldest
    /// left, usually once.
    pub async fn read_many<'b, D: ReadDest + ?Sized + 'b>(
        &self,
        reads: impl IntoIterator<Item = (u64, &'b mut D)>,
    ) -> Result<(), Error> {
        let mut reads: Vec<(u64, &'b mut D)> = reads.into_iter().collect();
        self.read_all(&mut reads).await
    }

    /// [`read_many`](Self::read_many) of a slice of ranges.
    pub(crate) async fn read_all<D: ReadDest + ?Sized>(
        &self,
        reads: &mut [(u64, &mut D)],
    ) -> Result<(), Error> {
        for (lba, dest) in reads.iter() {
            self.check_len(*lba, dest.len())?;
        }
        let q = self.queue()?;
        self.read_pieces(q, reads, q.slots()).await
    }

    /// Reads the checked ranges `reads` in commands of at most [`max_chunk`](Self::max_chunk)
    /// bytes, up to `window` of them in flight. A command waits for a slot only when none of
    /// the caller's is in flight: the slots it holds are looked at (and given back) first.
    async fn read_pieces<D: ReadDest + ?Sized>(
        &self,
        q: &QueueHandle,
        reads: &mut [(u64, &mut D)],
        window: usize,
    ) -> Result<(), Error> {
        let max = self.max_chunk();
        let lend = self.ctrl.shared().limits.lends_buffers;
        // (range, offset in it, length, command), oldest first.
        let commands: usize = reads.iter().map(|(_, d)| d.len().div_ceil(max)).sum();
        let mut inflight: VecDeque<(usize, usize, usize, Pending<'_>)> =
            VecDeque::with_capacity(window.min(commands));
        // The next command: range `i` from byte `off`.
        let (mut i, mut off) = (0usize, 0usize);
        loop {
            if i < reads.len() && inflight.len() < window {
                let (lba, dest) = &mut reads[i];
                let len = dest.len();
                let n = max.min(len - off);
                let req = self.rw_request(false, *lba + (off >> self.shift) as u64, n);
                let lend_one = || lend_buffer(lend, &mut **dest, off, n);
                let started = if inflight.is_empty() {
                    Some(q.start_read(req, lend_one).await)
                } else {
                    q.try_start_read(req, lend_one)
                };
                if let Some(p) = started {
                    inflight.push_back((i, off, n, p?));
                    off += n;
                    if off == len {
                        (i, off) = (i + 1, 0);
                    }
                    continue;
                }
            }
            let Some((r, o, n, mut p)) = inflight.pop_front() else {
                return Ok(());
            };
            let dest = &mut *reads[r].1;
            let result = p.wait().await.and_then(|cqe| check("Read", &cqe));
            if let Some(buf) = p.take_lent() {
                dest.take_back(o, n, buf, result.is_ok())
                    .map_err(buffer_error)?;
                result?;
            } else {
                result?;
                p.with_data(n, |d| dest.write_at(o, d))
                    .map_err(buffer_error)?;
            }
        }
    }

    /// Writes `buf` (a multiple of the block size) starting at block `lba`.
    ///
    /// If a write of a split transfer fails, the others may still have been applied.
    pub async fn write(&self, lba: u64, buf: &[u8]) -> Result<(), Error> {
        self.write_from(lba, buf).await
    }

    /// Writes `buf` like [`write`](Namespace::write) with Force Unit Access: each command
    /// completes only once its data is durable on the target, as if a Flush had followed it,
    /// without flushing anything else. Use it for commit records; [`flush`](Namespace::flush)
    /// makes every earlier write durable at once.
    pub async fn write_fua(&self, lba: u64, buf: &[u8]) -> Result<(), Error> {
        self.write_with(lba, buf, true).await
    }

    /// Writes the whole of any [`WriteSource`] starting at block `lba`.
    pub async fn write_from<S: WriteSource + ?Sized>(
        &self,
        lba: u64,
        src: &S,
    ) -> Result<(), Error> {
        self.write_with(lba, src, false).await
    }

    async fn write_with<S: WriteSource + ?Sized>(
        &self,
        lba: u64,
        src: &S,
        fua: bool,
    ) -> Result<(), Error> {
        let total = src.len();
        self.check_len(lba, total)?;
        let q = self.queue()?;
        let max = self.max_chunk();
        let fill = |off: usize| move |b: &mut [u8]| src.read_at(off, b).map_err(buffer_error);
        if total <= max {
            let req = self.request(true, lba, total, fua);
            q.execute(req, fill(0), |_| ()).await?;
            return Ok(());
        }
        let window = Self::window(q);
        let mut inflight: VecDeque<Pending<'_>> = VecDeque::with_capacity(window);
        let mut off = 0usize;
        while off < total || !inflight.is_empty() {
            if off < total && inflight.len() < window {
                let n = max.min(total - off);
                let req = self.request(true, lba + (off >> self.shift) as u64, n, fua);
                inflight.push_back(q.start(req, fill(off)).await?);
                off += n;
                continue;
            }
            let Some(mut p) = inflight.pop_front() else {
                break;
            };
            let cqe = p.wait().await?;
            check("Write", &cqe)?;
        }
        Ok(())
    }

    /// Reads `len` bytes starting at block `lba` into `buf` at byte `offset`.
    ///
    /// Over NVMe/RDMA the target RDMA WRITEs the data straight into the registered buffer
    /// (keyed SGLs that name it; no slot buffer, no copy); transfers above the largest command
    /// are split into several commands into the same buffer. Over NVMe/TCP this is an ordinary
    /// read into the buffer's bytes.
    pub async fn read_registered(
        &self,
        lba: u64,
        buf: &mut RegisteredBuffer,
        offset: usize,
        len: usize,
    ) -> Result<(), Error> {
        check_buffer_range(buf.len(), offset, len)?;
        match buf.target() {
            Ok(mem) => self.direct(false, lba, mem, offset, len).await,
            Err(bytes) => self.read(lba, &mut bytes[offset..offset + len]).await,
        }
    }

    /// Writes `len` bytes of `buf` from byte `offset`, starting at block `lba`.
    ///
    /// Over NVMe/RDMA the target RDMA READs the data straight from the registered buffer
    /// (never in the capsule, whatever the size). Over NVMe/TCP this is an ordinary write.
    pub async fn write_registered(
        &self,
        lba: u64,
        buf: &mut RegisteredBuffer,
        offset: usize,
        len: usize,
    ) -> Result<(), Error> {
        check_buffer_range(buf.len(), offset, len)?;
        match buf.target() {
            Ok(mem) => self.direct(true, lba, mem, offset, len).await,
            Err(bytes) => self.write(lba, &bytes[offset..offset + len]).await,
        }
    }

    /// Reads `len` bytes starting at block `lba` into registered GPU memory at byte `offset`:
    /// the NIC writes the data into device memory (GPUDirect RDMA). When the call returns the
    /// RDMA writes are ordered before later GPU work (`cuFlushGPUDirectRDMAWrites`).
    #[cfg(feature = "gpu")]
    pub async fn read_registered_gpu(
        &self,
        lba: u64,
        buf: &mut crate::RegisteredGpuBuffer,
        offset: usize,
        len: usize,
    ) -> Result<(), Error> {
        check_buffer_range(buf.len(), offset, len)?;
        self.direct(false, lba, buf.mem(), offset, len).await?;
        buf.flush()
    }

    /// Writes `len` bytes of registered GPU memory from byte `offset`, starting at block
    /// `lba`: the NIC reads them from device memory. Finish the GPU work that produces them
    /// first.
    #[cfg(feature = "gpu")]
    pub async fn write_registered_gpu(
        &self,
        lba: u64,
        buf: &mut crate::RegisteredGpuBuffer,
        offset: usize,
        len: usize,
    ) -> Result<(), Error> {
        check_buffer_range(buf.len(), offset, len)?;
        self.direct(true, lba, buf.mem(), offset, len).await
    }

    /// Moves `len` bytes between blocks from `lba` and registered memory from `offset`, in
    /// commands of at most the largest transfer, several in flight.
    async fn direct(
        &self,
        write: bool,
        lba: u64,
        mem: &Arc<RegionMem>,
        offset: usize,
        len: usize,
    ) -> Result<(), Error> {
        self.check_len(lba, len)?;
        let q = self.queue()?;
        let window = Self::window(q);
        let name = if write { "Write" } else { "Read" };
        let mut inflight: VecDeque<Pending<'_>> = VecDeque::with_capacity(window);
        for (off, n) in split(len, self.max_chunk()) {
            if inflight.len() >= window {
                if let Some(mut p) = inflight.pop_front() {
                    check(name, &p.wait().await?)?;
                }
            }
            let req = self.rw_request(write, lba + (off >> self.shift) as u64, n);
            let direct = Direct {
                mem: Arc::clone(mem),
                offset: offset + off,
            };
            inflight.push_back(q.start_direct(req, direct).await?);
        }
        while let Some(mut p) = inflight.pop_front() {
            check(name, &p.wait().await?)?;
        }
        Ok(())
    }

    /// Flush: makes data written to this namespace durable.
    pub async fn flush(&self) -> Result<(), Error> {
        let q = self.queue()?;
        let req = self.plain_request(build::flush(0, self.info.nsid), Retry::Always);
        q.execute(req, |_| Ok(()), |_| ()).await.map(|_| ())
    }

    /// Write Zeroes of `blocks` blocks starting at `lba` (several commands when more than
    /// 65536 blocks). Fails with [`Error::InvalidArgument`] when the controller does not
    /// support Write Zeroes.
    pub async fn write_zeroes(&self, lba: u64, blocks: u64) -> Result<(), Error> {
        if !self.ctrl.shared().info_flag(|i| i.write_zeroes) {
            return Err(Error::InvalidArgument(
                "the controller does not support Write Zeroes".into(),
            ));
        }
        self.per_range(lba, blocks, MAX_NLB, |lba, n| {
            build::write_zeroes(0, self.info.nsid, lba, n as u32, false)
        })
        .await
    }

    /// Deallocates (discards, trims) `blocks` blocks starting at `lba` with Dataset
    /// Management. Fails with [`Error::InvalidArgument`] when the controller does not support
    /// it.
    pub async fn deallocate(&self, lba: u64, blocks: u64) -> Result<(), Error> {
        check_range(lba, blocks)?;
        let mut ranges = Vec::new();
        let (mut l, mut left) = (lba, blocks);
        while left > 0 {
            let n = left.min(u64::from(u32::MAX)) as u32;
            ranges.push((l, n));
            l += u64::from(n);
            left -= u64::from(n);
        }
        self.deallocate_ranges(&ranges).await
    }

    /// Deallocates several `(lba, blocks)` ranges (up to 256 per command).
    pub async fn deallocate_ranges(&self, ranges: &[(u64, u32)]) -> Result<(), Error> {
        if !self.ctrl.shared().info_flag(|i| i.dataset_management) {
            return Err(Error::InvalidArgument(
                "the controller does not support Dataset Management".into(),
            ));
        }
        if ranges.is_empty() {
            return Err(Error::InvalidArgument("no range to deallocate".into()));
        }
        let q = self.queue()?;
        for chunk in ranges.chunks(256) {
            let len = chunk.len() * 16;
            let req = Request {
                sqe: build::deallocate(0, self.info.nsid, chunk.len() as u16),
                dir: DataDir::FromHost,
                len: len as u32,
                retry: Retry::Write,
                timeout: Some(self.ctrl.shared().opts.timeouts.io),
            };
            let fill = |b: &mut [u8]| {
                for (slot, &(lba, n)) in b.chunks_exact_mut(16).zip(chunk) {
                    slot[0..4].fill(0);
                    slot[4..8].copy_from_slice(&n.to_le_bytes());
                    slot[8..16].copy_from_slice(&lba.to_le_bytes());
                }
                Ok(())
            };
            q.execute(req, fill, |_| ()).await?;
        }
        Ok(())
    }

    /// Runs a reservation command carrying `keys` (little-endian, one after the other).
    async fn reservation(&self, opcode: u8, cdw10: u32, keys: &[u64]) -> Result<(), Error> {
        let q = self.queue()?;
        let req = Request {
            sqe: build::reservation(opcode, 0, self.info.nsid, cdw10),
            dir: DataDir::FromHost,
            len: (keys.len() * 8) as u32,
            retry: Retry::Never,
            timeout: Some(self.ctrl.shared().opts.timeouts.io),
        };
        let fill = |b: &mut [u8]| {
            for (slot, k) in b.chunks_exact_mut(8).zip(keys) {
                slot.copy_from_slice(&k.to_le_bytes());
            }
            Ok(())
        };
        q.execute(req, fill, |_| ()).await.map(|_| ())
    }

    /// Reservation Register: registers `nrkey` ([`ResvRegister::Register`]), unregisters, or
    /// replaces the key with `nrkey`; `crkey` is the current key, unchecked when `iekey`.
    /// `cptpl` changes Persist Through Power Loss (0 no change, 2 off, 3 on).
    pub async fn resv_register(
        &self,
        action: ResvRegister,
        crkey: u64,
        nrkey: u64,
        iekey: bool,
        cptpl: u8,
    ) -> Result<(), Error> {
        if cptpl > 3 {
            return Err(Error::InvalidArgument(format!("cptpl {cptpl} is not 0..3")));
        }
        let cdw10 = action as u32 | u32::from(iekey) << 3 | u32::from(cptpl) << 30;
        self.reservation(io::RESERVATION_REGISTER, cdw10, &[crkey, nrkey])
            .await
    }

    /// Reservation Acquire of type `rtype` (1..6) with the current key `crkey`: acquires,
    /// or preempts (and aborts) the registrants with key `prkey`.
    pub async fn resv_acquire(
        &self,
        action: ResvAcquire,
        rtype: u8,
        crkey: u64,
        prkey: u64,
        iekey: bool,
    ) -> Result<(), Error> {
        let cdw10 = action as u32 | u32::from(iekey) << 3 | u32::from(rtype) << 8;
        self.reservation(io::RESERVATION_ACQUIRE, cdw10, &[crkey, prkey])
            .await
    }

    /// Reservation Release of the reservation of type `rtype` held with key `crkey`, or
    /// Clear of every registration and the reservation.
    pub async fn resv_release(
        &self,
        action: ResvRelease,
        rtype: u8,
        crkey: u64,
        iekey: bool,
    ) -> Result<(), Error> {
        let cdw10 = action as u32 | u32::from(iekey) << 3 | u32::from(rtype) << 8;
        self.reservation(io::RESERVATION_RELEASE, cdw10, &[crkey])
            .await
    }

    /// Reservation Report: the namespace's registrants and reservation. `eds` asks for the
    /// extended data structure (128-bit host identifiers), which NVMe over Fabrics
    /// controllers require; without it they answer Host Identifier Inconsistent Format.
    pub async fn resv_report(&self, eds: bool) -> Result<ReservationStatus, Error> {
        let q = self.queue()?;
        let len = 4096u32;
        let req = Request {
            sqe: build::reservation_report(0, self.info.nsid, len, eds),
            dir: DataDir::ToHost,
            len,
            retry: Retry::Always,
            timeout: Some(self.ctrl.shared().opts.timeouts.io),
        };
        let (_, status) = q
            .execute(req, |_| Ok(()), |d: &[u8]| ReservationStatus::parse(d, eds))
            .await?;
        Ok(status)
    }

    /// Sends one command per `per`-block piece of a range, several in flight.
    async fn per_range<F>(&self, lba: u64, blocks: u64, per: u64, sqe: F) -> Result<(), Error>
    where
        F: Fn(u64, u64) -> Sqe,
    {
        if blocks == 0 {
            return Err(Error::InvalidArgument("the block count is 0".into()));
        }
        check_range(lba, blocks)?;
        let q = self.queue()?;
        let window = Self::window(q);
        let mut inflight: VecDeque<Pending<'_>> = VecDeque::with_capacity(window.min(8));
        let mut done = 0u64;
        while done < blocks || !inflight.is_empty() {
            if done < blocks && inflight.len() < window {
                let n = per.min(blocks - done);
                let req = self.plain_request(sqe(lba + done, n), Retry::Write);
                inflight.push_back(q.start(req, |_| Ok(())).await?);
                done += n;
                continue;
            }
            let Some(mut p) = inflight.pop_front() else {
                break;
            };
            let cqe = p.wait().await?;
            check("Write Zeroes", &cqe)?;
        }
        Ok(())
    }
}

/// Rejects a range whose end does not fit in 64 bits (the controller checks the rest).
fn check_range(lba: u64, blocks: u64) -> Result<(), Error> {
    match lba.checked_add(blocks) {
        Some(_) => Ok(()),
        None => Err(Error::InvalidArgument(format!(
            "block range {lba} + {blocks} overflows"
        ))),
    }
}

/// The buffer `dest` lends for bytes `off..off + n` of a read (`None` when `lend` is off, or
/// it lends none); one too short to be of use goes back, and the data goes to the queue's
/// buffer instead.
fn lend_buffer<D: ReadDest + ?Sized>(
    lend: bool,
    dest: &mut D,
    off: usize,
    n: usize,
) -> Result<Option<Lent>, Error> {
    if !lend {
        return Ok(None);
    }
    match dest.lend(off, n) {
        Some(short) if short.bytes().len() < n => {
            dest.take_back(off, n, short, false).map_err(buffer_error)?;
            Ok(None)
        }
        lent => Ok(lent),
    }
}

fn check(command: &'static str, cqe: &Cqe) -> Result<(), Error> {
    let st = cqe.status();
    if st.is_success() {
        Ok(())
    } else {
        Err(Error::status_of(command, st))
    }
}

/// Namespace handles (here rather than in `controller` so that the controller does not
/// depend on the namespace API built on it).
impl Controller {
    /// A handle for I/O on namespace `nsid` (its geometry is read with Identify Namespace).
    pub async fn namespace(&self, nsid: u32) -> Result<Namespace, Error> {
        let info = self.namespace_info(nsid).await?;
        Ok(Namespace::new(self.clone(), info))
    }

    /// Handles for every active namespace.
    pub async fn namespaces(&self) -> Result<Vec<Namespace>, Error> {
        let mut out = Vec::new();
        for nsid in self.namespace_ids() {
            out.push(self.namespace(nsid).await?);
        }
        Ok(out)
    }

    /// A handle for namespace `nsid` with a given block size and size, without asking the
    /// controller (for namespaces known from elsewhere). The controller still checks every
    /// command.
    pub fn namespace_unchecked(
        &self,
        nsid: u32,
        block_size: u32,
        blocks: u64,
    ) -> Result<Namespace, Error> {
        if !block_size.is_power_of_two() || block_size < 512 {
            return Err(Error::InvalidArgument(format!(
                "block size {block_size} is not a power of two of at least 512"
            )));
        }
        Ok(Namespace::new(
            self.clone(),
            NamespaceInfo {
                nsid,
                blocks,
                capacity_blocks: blocks,
                utilization_blocks: blocks,
                block_size,
                size_bytes: blocks.saturating_mul(u64::from(block_size)),
                metadata_size: 0,
                nguid: String::new(),
                eui64: String::new(),
                uuid: None,
            },
        ))
    }
}

/// Reservation Register actions (RREGA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResvRegister {
    /// Register a key.
    Register = 0,
    /// Unregister.
    Unregister = 1,
    /// Replace the key.
    Replace = 2,
}

/// Reservation Acquire actions (RACQA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResvAcquire {
    /// Acquire the reservation.
    Acquire = 0,
    /// Preempt the registrants with a key.
    Preempt = 1,
    /// Preempt and abort their commands.
    PreemptAndAbort = 2,
}

/// Reservation Release actions (RRELA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResvRelease {
    /// Release the reservation.
    Release = 0,
    /// Clear every registration and the reservation.
    Clear = 1,
}

/// One registrant of a [`ReservationStatus`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registrant {
    /// Controller ID (FFFFh: any of the host's controllers).
    pub cntlid: u16,
    /// Whether the registrant holds the reservation.
    pub holds: bool,
    /// Its reservation key.
    pub rkey: u64,
    /// Its host identifier (8 bytes in the non-extended structure).
    pub hostid: Vec<u8>,
}

/// The Reservation Status data structure (NVMe Base 2.0, Figures 568-571).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReservationStatus {
    /// Generation.
    pub generation: u32,
    /// Reservation type (0: none).
    pub rtype: u8,
    /// Persist Through Power Loss State.
    pub ptpl: bool,
    /// Registrants.
    pub registrants: Vec<Registrant>,
}

impl ReservationStatus {
    /// Parses the structure (extended when `eds`); registrants beyond the data are left out.
    pub fn parse(d: &[u8], eds: bool) -> Self {
        let u16_at = |o: usize| {
            d.get(o..o + 2)
                .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]))
        };
        let u64_at = |o: usize| {
            d.get(o..o + 8)
                .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
        };
        let regctl = usize::from(u16_at(5));
        let (head, size) = if eds { (64, 64) } else { (24, 24) };
        let registrants = (0..regctl)
            .map(|i| head + i * size)
            .take_while(|&o| o + size <= d.len())
            .map(|o| Registrant {
                cntlid: u16_at(o),
                holds: d[o + 2] & 1 != 0,
                rkey: if eds { u64_at(o + 8) } else { u64_at(o + 16) },
                hostid: if eds {
                    d[o + 16..o + 32].to_vec()
                } else {
                    d[o + 8..o + 16].to_vec()
                },
            })
            .collect();
        ReservationStatus {
            generation: d
                .get(0..4)
                .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            rtype: d.get(4).copied().unwrap_or(0),
            ptpl: d.get(9).is_some_and(|b| b & 1 != 0),
            registrants,
        }
    }
}
