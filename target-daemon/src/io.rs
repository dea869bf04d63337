//! Execution of validated data-plane requests against namespace backends.

use blockdev::{AnyBackend, Backend, BackendError, IoBuf, StatusHint};
use nvme_spec::Status;
use nvme_spec::status::{generic, media};
use tracing::warn;

use crate::controller::Controller;
use crate::queue::{IoOp, IoRequest};

/// Maps a backend error to the NVMe status the host sees.
pub fn backend_status(e: &BackendError) -> Status {
    match e.status_hint() {
        StatusHint::LbaOutOfRange => Status::generic(generic::LBA_OUT_OF_RANGE).with_dnr(),
        StatusHint::InvalidField => Status::generic(generic::INVALID_FIELD).with_dnr(),
        StatusHint::CapacityExceeded => Status::generic(generic::CAPACITY_EXCEEDED).with_dnr(),
        StatusHint::WriteProtected => {
            Status::generic(generic::NAMESPACE_WRITE_PROTECTED).with_dnr()
        }
        StatusHint::WriteFault => Status::media(media::WRITE_FAULT),
        StatusHint::UnrecoveredReadError => Status::media(media::UNRECOVERED_READ_ERROR),
        StatusHint::InternalError => Status::generic(generic::INTERNAL_ERROR),
    }
}

/// Whether a backend completes every call without waiting (memory, null): its requests run
/// inline, with no task per command.
pub(crate) fn never_waits(backend: &AnyBackend) -> bool {
    matches!(backend, AnyBackend::Memory(_) | AnyBackend::Null(_))
}

/// Reads block `lba` onwards into `out` from a backend that never waits, without a staging
/// buffer; None, doing nothing, for other backends.
pub(crate) fn read_now(
    backend: &AnyBackend,
    lba: u64,
    out: &mut [u8],
) -> Option<Result<(), BackendError>> {
    match backend {
        AnyBackend::Memory(m) => Some(m.read_into(lba, out)),
        AnyBackend::Null(n) => Some(n.read_into(lba, out)),
        AnyBackend::File(_) | AnyBackend::Cached(_) | AnyBackend::Pcie(_) => None,
    }
}

/// Appends the shared pieces of memory that hold `len` bytes from block `lba` of a memory
/// or null namespace (sent without a copy: [`blockdev::MemoryBackend::read_shared`]); None,
/// doing nothing, for other backends.
pub(crate) fn read_shared(
    backend: &AnyBackend,
    lba: u64,
    len: usize,
    out: &mut Vec<blockdev::SharedPiece>,
) -> Option<Result<(), BackendError>> {
    match backend {
        AnyBackend::Memory(m) => Some(m.read_shared(lba, len, out)),
        AnyBackend::Null(n) => Some(n.read_shared(lba, len, out)),
        AnyBackend::File(_) | AnyBackend::Cached(_) | AnyBackend::Pcie(_) => None,
    }
}

/// The status of a backend operation's outcome; failures of the medium are counted and logged.
pub(crate) fn status_of(ctrl: &Controller, r: Result<(), BackendError>) -> Status {
    match r {
        Ok(()) => Status::SUCCESS,
        Err(e) => {
            let s = backend_status(&e);
            if s.sct == nvme_spec::status::sct::MEDIA || s.sc == generic::INTERNAL_ERROR {
                ctrl.counters.media_error();
                warn!(cntlid = ctrl.cntlid, hostnqn = %ctrl.hostnqn, error = %e, status = %s, "I/O failed");
            }
            s
        }
    }
}

/// Runs `req`. `buf` holds the data of a write (or the Dataset Management range list) and is
/// the destination of a read; it is handed back with the status.
pub async fn execute(ctrl: &Controller, req: &IoRequest, buf: IoBuf) -> (Status, IoBuf) {
    let c = &ctrl.counters;
    let Some(ns) = &req.ns else {
        // Flush of every namespace (NSID FFFFFFFFh).
        let mut status = Status::SUCCESS;
        if let Some(s) = ctrl.subsystem() {
            for ns in s.namespaces().values() {
                let st = status_of(ctrl, ns.backend.flush().await);
                if !st.is_success() {
                    status = st;
                }
            }
        }
        return (status, buf);
    };
    match req.op {
        IoOp::Read { lba, len } => {
            let (r, buf) = ns.backend.read(lba, buf).await;
            c.read(len as u64);
            (status_of(ctrl, r), buf)
        }
        IoOp::Write { lba, len, fua, .. } => {
            let (r, buf) = if fua {
                ns.backend.write_fua(lba, buf).await
            } else {
                ns.backend.write(lba, buf).await
            };
            c.write(len as u64);
            (status_of(ctrl, r), buf)
        }
        IoOp::Flush => (status_of(ctrl, ns.backend.flush().await), buf),
        IoOp::WriteZeroes {
            lba,
            nlb,
            deallocate,
            fua,
        } => {
            let mut r = if deallocate && ns.backend.deallocate_reads_zeroes() {
                ns.backend.deallocate(lba, u64::from(nlb)).await
            } else {
                ns.backend.write_zeroes(lba, u64::from(nlb)).await
            };
            // Zeroing has no per-call durability flag (fallocate): FUA is a flush after it.
            if fua && r.is_ok() {
                r = ns.backend.flush().await;
            }
            (status_of(ctrl, r), buf)
        }
        IoOp::Dsm {
            ranges, deallocate, ..
        } => {
            if !deallocate {
                return (Status::SUCCESS, buf);
            }
            let parsed = match parse_ranges(&buf, usize::from(ranges), ns.blocks) {
                Ok(p) => p,
                Err(st) => return (st, buf),
            };
            for (slba, nlb) in parsed {
                if nlb == 0 {
                    continue;
                }
                let st = status_of(ctrl, ns.backend.deallocate(slba, nlb).await);
                if !st.is_success() {
                    return (st, buf);
                }
            }
            (Status::SUCCESS, buf)
        }
        IoOp::Reservation {
            opcode, cdw10, len, ..
        } => {
            let data = buf.get(..len).unwrap_or(&[]);
            let status = match ns.reservations.apply(&ctrl.hostid, opcode, cdw10, data) {
                Ok(out) => {
                    if !out.aborted.is_empty() {
                        let hosts: Vec<String> =
                            out.aborted.iter().map(crate::reservation::hex).collect();
                        tracing::info!(cntlid = ctrl.cntlid, hostnqn = %ctrl.hostnqn, nsid = ns.nsid, preempted = ?hosts, "reservation preempted and aborted");
                    }
                    if let Some(s) = ctrl.subsystem() {
                        s.reservation_notices(ns.nsid, &out);
                    }
                    Status::SUCCESS
                }
                Err(s) => s,
            };
            (status, buf)
        }
        IoOp::ReservationReport { len, eds } => {
            let mut buf = buf;
            match ns.reservations.report(eds, len) {
                Ok(report) => {
                    buf.fill(0);
                    buf[..report.len()].copy_from_slice(&report);
                    (Status::SUCCESS, buf)
                }
                Err(s) => (s, buf),
            }
        }
    }
}

/// Parses Dataset Management ranges (NVM Command Set 1.0, Figure 41), checking each against the
/// namespace size before any is acted on.
fn parse_ranges(list: &[u8], ranges: usize, blocks: u64) -> Result<Vec<(u64, u64)>, Status> {
    let mut parsed = Vec::with_capacity(ranges);
    for r in list.chunks_exact(16).take(ranges) {
        let nlb = u64::from(u32::from_le_bytes([r[4], r[5], r[6], r[7]]));
        let slba = u64::from_le_bytes([r[8], r[9], r[10], r[11], r[12], r[13], r[14], r[15]]);
        match slba.checked_add(nlb) {
            Some(end) if end <= blocks => parsed.push((slba, nlb)),
            _ => return Err(Status::generic(generic::LBA_OUT_OF_RANGE).with_dnr()),
        }
    }
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dsm_ranges() {
        let mut list = vec![0u8; 32];
        list[4..8].copy_from_slice(&8u32.to_le_bytes());
        list[8..16].copy_from_slice(&100u64.to_le_bytes());
        list[20..24].copy_from_slice(&1u32.to_le_bytes());
        list[24..32].copy_from_slice(&107u64.to_le_bytes());
        assert_eq!(
            parse_ranges(&list, 2, 108).unwrap(),
            vec![(100, 8), (107, 1)]
        );
        assert_eq!(
            parse_ranges(&list, 2, 107).unwrap_err(),
            Status::generic(generic::LBA_OUT_OF_RANGE).with_dnr()
        );
    }
}
