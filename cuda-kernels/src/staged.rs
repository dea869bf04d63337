//! Scatters that read their source in place: blocks in mapped pinned host memory, read by the
//! scatter kernel over the bus, with the plan in mapped memory too. A batch costs one launch
//! and one stream mark: no copy to the device, no plan upload, no per-buffer tracking, and the
//! host sees the batch done with a load, not a driver call. The blocks are either packed into
//! the stage beside the plan ([`NvmfKernels::scatter_staged`]) or parts of one mapped
//! allocation that the host received them into ([`NvmfKernels::scatter_chunks`]), which saves
//! the packing copy.

use gpu::{DeviceSliceMut, GpuStream, HostPinned, LaunchArgs, PinnedChunk, StreamMark};

use crate::error::KernelError;
use crate::kernels::NvmfKernels;
use crate::plan::{CHUNK_SIZE, ScatterCopy, WORK_ITEM_SIZE, WorkPlan, validate_scatter};

/// Alignment of the plan inside a stage (the kernel reads 8-byte fields).
const PLAN_ALIGN: usize = 64;

/// Mapped pinned host memory that [`NvmfKernels::scatter_staged`] reads in place: a data area
/// the host packs blocks into, room for the plan of up to [`copies`](Self::copies) copies,
/// and the [`StreamMark`] its stream writes once the kernel that last read it has run.
///
/// The host reaches the bytes only while no kernel reads them: `scatter_staged` takes the
/// stage by value and hands back a [`StageFlight`], which returns the stage once its kernel
/// has finished.
pub struct MappedStage {
    host: HostPinned,
    /// Device address of byte 0.
    ptr: u64,
    data: usize,
    copies: usize,
    /// Written after each kernel: its last ticket passed, the last kernel has run.
    mark: StreamMark,
    /// Whether a kernel enqueued on it may still read it (its ticket not seen).
    in_flight: bool,
    /// Looks at an unfinished flight since the stream was last checked for errors.
    looks: u32,
}

/// Looks at an unfinished batch between checks of its stream for errors (a failed kernel
/// never lets the mark pass).
const LOOKS_PER_CHECK: u32 = 256;

impl std::fmt::Debug for MappedStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedStage")
            .field("data", &self.data)
            .field("copies", &self.copies)
            .finish()
    }
}

impl MappedStage {
    fn plan_at(&self) -> usize {
        self.data.next_multiple_of(PLAN_ALIGN)
    }

    /// Copies one batch may hold.
    pub fn copies(&self) -> usize {
        self.copies
    }

    /// The data area, for the host to pack blocks into.
    pub fn data_mut(&mut self) -> &mut [u8] {
        &mut self.host.as_mut_slice()[..self.data]
    }
}

/// A batch [`NvmfKernels::scatter_staged`] did not enqueue: why, and the stage back (no
/// kernel reads it).
#[derive(Debug)]
pub struct StageRefused {
    /// Why.
    pub error: KernelError,
    /// The stage, the host's again.
    pub stage: MappedStage,
}

impl Drop for MappedStage {
    fn drop(&mut self) {
        if self.in_flight {
            // The memory is freed after this: the kernel must no longer read it.
            let _ = self.mark.wait();
        }
    }
}

/// A [`MappedStage`] whose scatter is enqueued: the stage comes back through
/// [`finish`](Self::finish). Dropped unfinished, it waits for the kernel first.
#[derive(Debug)]
pub struct StageFlight {
    stage: MappedStage,
}

impl StageFlight {
    /// Whether the kernel reading the stage has finished (does not block; a load, and a look
    /// at the stream for errors every 256 calls).
    pub fn is_done(&mut self) -> Result<bool, KernelError> {
        let s = &mut self.stage;
        if s.in_flight {
            if s.mark.passed_last() {
                s.in_flight = false;
            } else {
                s.looks += 1;
                if s.looks >= LOOKS_PER_CHECK {
                    s.looks = 0;
                    s.in_flight = !s.mark.check()?;
                }
            }
        }
        Ok(!s.in_flight)
    }

    /// The stage again, once its kernel has finished (waits for it if need be).
    pub fn finish(mut self) -> Result<MappedStage, KernelError> {
        if self.stage.in_flight {
            self.stage.mark.wait()?;
            self.stage.in_flight = false;
        }
        Ok(self.stage)
    }
}

/// A batch [`NvmfKernels::scatter_chunks`] did not enqueue: why, and the stage and chunks
/// back (no kernel reads them).
#[derive(Debug)]
pub struct ChunksRefused {
    /// Why.
    pub error: KernelError,
    /// The stage, the host's again.
    pub stage: MappedStage,
    /// The chunks, the host's again, in the order given.
    pub chunks: Vec<PinnedChunk>,
}

/// Chunks whose scatter is enqueued, with the stage holding its plan: both come back through
/// [`finish`](Self::finish). Dropped unfinished, it waits for the kernel before the chunks go.
#[derive(Debug)]
pub struct ChunkFlight {
    // Dropped first: waits for the kernel before the chunks can free their memory.
    flight: StageFlight,
    chunks: Vec<PinnedChunk>,
}

impl ChunkFlight {
    /// Whether the kernel reading the chunks has finished (does not block; see
    /// [`StageFlight::is_done`]).
    pub fn is_done(&mut self) -> Result<bool, KernelError> {
        self.flight.is_done()
    }

    /// The stage and the chunks (in the order given) again, once the kernel has finished
    /// (waits for it if need be). On an error the chunks are dropped (once nothing reads
    /// them): the stream failed and their data never reached the destination.
    pub fn finish(self) -> Result<(MappedStage, Vec<PinnedChunk>), KernelError> {
        let ChunkFlight { flight, chunks } = self;
        Ok((flight.finish()?, chunks))
    }
}

impl NvmfKernels {
    /// A stage of `data` bytes (mapped pinned memory) whose batches hold up to `copies`
    /// copies.
    pub fn new_stage(&self, data: usize, copies: usize) -> Result<MappedStage, KernelError> {
        let copies = copies.max(1);
        let room = copies
            .checked_mul(WORK_ITEM_SIZE)
            .and_then(|r| r.checked_add(data.next_multiple_of(PLAN_ALIGN)))
            .ok_or(KernelError::PlanTooLarge)?;
        let buf = self.context().alloc_pinned_mapped(room)?;
        let ptr = buf.mapped_device_ptr().ok_or(KernelError::NotMapped)?;
        Ok(MappedStage {
            host: buf.into_host()?,
            ptr,
            data,
            copies,
            mark: self.context().new_mark()?,
            in_flight: false,
            looks: 0,
        })
    }

    /// Enqueues on `stream` the copies of bytes of `stage`'s data area (read in place over
    /// the bus) to their offsets in `dst`, validated first like [`scatter`](Self::scatter).
    /// The stage is in flight until the kernel has run; on an error it is handed back with
    /// nothing reading it.
    pub fn scatter_staged(
        &self,
        stream: &GpuStream,
        stage: MappedStage,
        dst: &mut DeviceSliceMut<'_>,
        copies: &[ScatterCopy],
    ) -> Result<StageFlight, Box<StageRefused>> {
        let src = (stage.ptr, stage.data as u64);
        self.enqueue_staged(stream, stage, src, dst, copies)
    }

    /// Enqueues on `stream` one kernel that copies each of `chunks` (parts of one mapped
    /// allocation, [`HostPinned::into_chunks`], read in place over the bus) whole to its offset
    /// in `dst_offsets`, with `stage` (any data area; a stage of `new_stage(0, copies)` is
    /// enough) holding the plan. The chunks and the stage are in flight until the kernel has
    /// run ([`ChunkFlight::finish`] hands them back); on an error they are handed back with
    /// nothing reading them.
    pub fn scatter_chunks(
        &self,
        stream: &GpuStream,
        stage: MappedStage,
        chunks: Vec<PinnedChunk>,
        dst: &mut DeviceSliceMut<'_>,
        dst_offsets: &[u64],
    ) -> Result<ChunkFlight, Box<ChunksRefused>> {
        let refused = |error, stage, chunks| {
            Err(Box::new(ChunksRefused {
                error,
                stage,
                chunks,
            }))
        };
        if chunks.len() != dst_offsets.len() {
            let e = KernelError::ChunkCount {
                chunks: chunks.len(),
                offsets: dst_offsets.len(),
            };
            return refused(e, stage, chunks);
        }
        // No chunks: nothing to read, only the mark.
        let src = match chunks.first() {
            None => (0, 0),
            Some(first) => {
                let Some(base) = first.mapped_device_ptr() else {
                    return refused(KernelError::NotMapped, stage, chunks);
                };
                if !chunks.iter().all(|c| c.same_region(first)) {
                    return refused(KernelError::ChunksOfSeveralRegions, stage, chunks);
                }
                (base, first.region_len() as u64)
            }
        };
        let copies: Vec<ScatterCopy> = chunks
            .iter()
            .zip(dst_offsets)
            .map(|(c, &dst_offset)| ScatterCopy {
                src_offset: c.offset() as u64,
                dst_offset,
                len: c.len() as u64,
            })
            .collect();
        match self.enqueue_staged(stream, stage, src, dst, &copies) {
            Ok(flight) => Ok(ChunkFlight { flight, chunks }),
            Err(r) => refused(r.error, r.stage, chunks),
        }
    }

    /// Enqueues the scatter of `copies` from mapped memory at device address `src.0` of
    /// `src.1` bytes, with the plan in `stage`, and the stage's mark after it.
    fn enqueue_staged(
        &self,
        stream: &GpuStream,
        mut stage: MappedStage,
        (src_ptr, src_len): (u64, u64),
        dst: &mut DeviceSliceMut<'_>,
        copies: &[ScatterCopy],
    ) -> Result<StageFlight, Box<StageRefused>> {
        let refused = |error, stage| Err(Box::new(StageRefused { error, stage }));
        let plan = match self.encode_staged(stream, &mut stage, src_len, dst, copies) {
            Ok(p) => p,
            Err(e) => return refused(e, stage),
        };
        if !plan.is_empty() {
            let plan_at = stage.plan_at() as u64;
            let mut args = LaunchArgs::new();
            args.u64(src_ptr)
                .u64(src_len)
                .buffer_mut(dst)
                .u64(stage.ptr + plan_at)
                .u64(plan.encoded_len() as u64)
                .u64(plan.total_chunks())
                .u64(CHUNK_SIZE);
            if let Err(e) = self
                .scatter
                .launch(stream, &self.config(plan.total_chunks()), &args)
            {
                return refused(e.into(), stage);
            }
        }
        if let Err(e) = stage.mark.enqueue(stream) {
            // The kernel may be enqueued: let it finish before the host has the stage again.
            let _ = stream.synchronize();
            return refused(e.into(), stage);
        }
        stage.in_flight = true;
        stage.looks = 0;
        Ok(StageFlight { stage })
    }

    /// Checks the batch and writes its plan into the stage.
    fn encode_staged(
        &self,
        stream: &GpuStream,
        stage: &mut MappedStage,
        src_len: u64,
        dst: &DeviceSliceMut<'_>,
        copies: &[ScatterCopy],
    ) -> Result<WorkPlan, KernelError> {
        if !stream.context().same_as(self.context()) {
            return Err(gpu::GpuError::ContextMismatch.into());
        }
        if copies.len() > stage.copies {
            return Err(KernelError::StageFull {
                copies: copies.len(),
                room: stage.copies,
            });
        }
        validate_scatter(src_len, dst.len() as u64, copies)?;
        let plan = WorkPlan::new(
            copies.iter().map(|c| (c.src_offset, c.dst_offset, c.len)),
            CHUNK_SIZE,
        )?;
        let at = stage.plan_at();
        plan.encode_into(&mut stage.host.as_mut_slice()[at..])?;
        Ok(plan)
    }
}
