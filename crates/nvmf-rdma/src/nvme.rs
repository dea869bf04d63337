//! NVMe/RDMA connection parameters carried in RDMA-CM private data (NVMe over Fabrics 1.1,
//! section 7.3.1, Figures 52-55): validation of a host's request, and the accept and reject
//! records. No I/O here, so it is tested everywhere.

use nvme_spec::IntoBytes;
use nvme_spec::rdma::{CmAccept, CmReject, CmRequest, reject};
use zerocopy::FromBytes;
use zerocopy::little_endian::U16;

/// What a target allows on its queues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueLimits {
    /// Largest admin queue, in entries.
    pub max_admin_depth: u16,
    /// Largest I/O queue, in entries.
    pub max_io_depth: u16,
    /// Largest I/O queue ID.
    pub max_qid: u16,
}

/// A validated connection request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueRequest {
    /// Queue ID (0 = admin).
    pub qid: u16,
    /// Submission queue entries the host may have outstanding (HSQSIZE + 1): the number of
    /// receive buffers the target must keep posted.
    pub depth: u16,
    /// Receive buffers the host keeps posted for completions (HRQSIZE).
    pub host_recv: u16,
    /// Controller ID the host names (0xFFFF on the admin queue).
    pub cntlid: u16,
}

/// Validates the private data of an NVMe/RDMA connection request. The error is the reject
/// status to answer with ([`nvme_spec::rdma::reject`]).
///
/// RoCE and InfiniBand deliver 56 bytes of private data; only the first 32 are the NVMe
/// record, so anything shorter than 32 bytes is refused and anything longer is accepted.
pub fn parse_request(private_data: &[u8], limits: &QueueLimits) -> Result<QueueRequest, u16> {
    let Some(raw) = private_data.get(..size_of::<CmRequest>()) else {
        return Err(reject::INVALID_LENGTH);
    };
    let Ok(req) = CmRequest::read_from_bytes(raw) else {
        return Err(reject::INVALID_LENGTH);
    };
    if req.recfmt.get() != 0 {
        return Err(reject::INVALID_RECFMT);
    }
    let qid = req.qid.get();
    if qid > limits.max_qid {
        return Err(reject::INVALID_QID);
    }
    let max = if qid == 0 {
        limits.max_admin_depth
    } else {
        limits.max_io_depth
    };
    // HSQSIZE is 0's based; an NVMe queue has at least two entries.
    let depth = u32::from(req.hsqsize.get()) + 1;
    if depth < 2 || depth > u32::from(max) {
        return Err(reject::INVALID_HSQSIZE);
    }
    let depth = depth as u16;
    // The host must be able to receive a completion for every command it may send.
    let host_recv = req.hrqsize.get();
    if host_recv < depth {
        return Err(reject::INVALID_HRQSIZE);
    }
    Ok(QueueRequest {
        qid,
        depth,
        host_recv,
        cntlid: req.cntlid.get(),
    })
}

/// Chooses how many RDMA READs the target keeps in flight (its ORD): what the host allows
/// (its IRD, the request's initiator depth as seen by the target) within what the device can
/// issue. A host that allows none is refused with INVALID_IRD: writes could not be fetched.
pub fn negotiate_ord(host_ird: u8, device_max_init_rd_atom: u8) -> Result<u8, u16> {
    match host_ird.min(device_max_init_rd_atom.max(1)) {
        0 => Err(reject::INVALID_IRD),
        n => Ok(n),
    }
}

/// The RDMA_CM_ACCEPT record: `crqsize` receive buffers are posted for commands.
pub fn accept_data(crqsize: u16) -> [u8; 32] {
    let a = CmAccept {
        recfmt: U16::new(0),
        crqsize: U16::new(crqsize),
        ..Default::default()
    };
    let mut out = [0u8; 32];
    out.copy_from_slice(a.as_bytes());
    out
}

/// The RDMA_CM_REJECT record with `status`.
pub fn reject_data(status: u16) -> [u8; 4] {
    let r = CmReject {
        recfmt: U16::new(0),
        status: U16::new(status),
    };
    let mut out = [0u8; 4];
    out.copy_from_slice(r.as_bytes());
    out
}

/// The RDMA_CM_REQUEST record a host sends (0's based `hsqsize`, `hrqsize` buffers).
pub fn request_data(qid: u16, hsqsize: u16, hrqsize: u16, cntlid: u16) -> [u8; 32] {
    let r = CmRequest {
        recfmt: U16::new(0),
        qid: U16::new(qid),
        hrqsize: U16::new(hrqsize),
        hsqsize: U16::new(hsqsize),
        cntlid: U16::new(cntlid),
        ..Default::default()
    };
    let mut out = [0u8; 32];
    out.copy_from_slice(r.as_bytes());
    out
}

/// The controller receive queue size of an accept record (None if it is not one).
pub fn parse_accept(private_data: &[u8]) -> Option<u16> {
    let a = CmAccept::read_from_bytes(private_data.get(..size_of::<CmAccept>())?).ok()?;
    (a.recfmt.get() == 0).then(|| a.crqsize.get())
}

/// The status of a reject record (None if it is not one).
pub fn parse_reject(private_data: &[u8]) -> Option<u16> {
    let r = CmReject::read_from_bytes(private_data.get(..size_of::<CmReject>())?).ok()?;
    (r.recfmt.get() == 0).then(|| r.status.get())
}

/// A readable reason for a reject status.
pub fn reject_reason(status: u16) -> &'static str {
    match status {
        reject::INVALID_LENGTH => "invalid private data length",
        reject::INVALID_RECFMT => "invalid record format",
        reject::INVALID_QID => "invalid queue ID",
        reject::INVALID_HSQSIZE => "invalid host send queue size",
        reject::INVALID_HRQSIZE => "invalid host receive queue size",
        reject::NO_RESOURCES => "no resources",
        reject::INVALID_IRD => "invalid IRD",
        reject::INVALID_ORD => "invalid ORD",
        _ => "unknown reject status",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: QueueLimits = QueueLimits {
        max_admin_depth: 32,
        max_io_depth: 128,
        max_qid: 8,
    };

    fn req(qid: u16, hsqsize: u16, hrqsize: u16) -> Vec<u8> {
        // RoCE delivers 56 bytes: the record plus zero padding.
        let mut v = request_data(qid, hsqsize, hrqsize, 0xFFFF).to_vec();
        v.resize(56, 0);
        v
    }

    #[test]
    fn linux_admin_and_io_requests_are_accepted() {
        // The Linux host: admin hsqsize 31, hrqsize 32; I/O hsqsize 127, hrqsize 128.
        let a = parse_request(&req(0, 31, 32), &LIMITS).unwrap();
        assert_eq!(
            a,
            QueueRequest {
                qid: 0,
                depth: 32,
                host_recv: 32,
                cntlid: 0xFFFF
            }
        );
        let io = parse_request(&req(3, 127, 128), &LIMITS).unwrap();
        assert_eq!((io.qid, io.depth, io.host_recv), (3, 128, 128));
        // Exactly 32 bytes is enough.
        assert!(parse_request(&request_data(1, 15, 16, 1), &LIMITS).is_ok());
    }

    #[test]
    fn each_invalid_field_gets_its_reject_code() {
        assert_eq!(parse_request(&[], &LIMITS), Err(reject::INVALID_LENGTH));
        assert_eq!(
            parse_request(&req(0, 31, 32)[..31], &LIMITS),
            Err(reject::INVALID_LENGTH)
        );
        let mut bad_fmt = req(0, 31, 32);
        bad_fmt[0] = 1;
        assert_eq!(
            parse_request(&bad_fmt, &LIMITS),
            Err(reject::INVALID_RECFMT)
        );
        assert_eq!(
            parse_request(&req(9, 31, 32), &LIMITS),
            Err(reject::INVALID_QID)
        );
        // Admin queue larger than allowed; I/O queue larger than allowed; single-entry queue.
        assert_eq!(
            parse_request(&req(0, 32, 33), &LIMITS),
            Err(reject::INVALID_HSQSIZE)
        );
        assert_eq!(
            parse_request(&req(1, 128, 129), &LIMITS),
            Err(reject::INVALID_HSQSIZE)
        );
        assert_eq!(
            parse_request(&req(1, 0, 1), &LIMITS),
            Err(reject::INVALID_HSQSIZE)
        );
        assert_eq!(
            parse_request(&req(1, u16::MAX, u16::MAX), &LIMITS),
            Err(reject::INVALID_HSQSIZE)
        );
        // Fewer host receive buffers than commands it may send.
        assert_eq!(
            parse_request(&req(1, 63, 63), &LIMITS),
            Err(reject::INVALID_HRQSIZE)
        );
        assert!(parse_request(&req(1, 63, 64), &LIMITS).is_ok());
    }

    #[test]
    fn ord_is_bounded_by_host_and_device() {
        assert_eq!(negotiate_ord(16, 128), Ok(16));
        assert_eq!(negotiate_ord(128, 16), Ok(16));
        assert_eq!(negotiate_ord(0, 16), Err(reject::INVALID_IRD));
        // A device reporting 0 still issues one read at a time.
        assert_eq!(negotiate_ord(4, 0), Ok(1));
    }

    #[test]
    fn records_round_trip() {
        let a = accept_data(128);
        assert_eq!(&a[..4], &[0, 0, 128, 0]);
        assert_eq!(parse_accept(&a), Some(128));
        let r = reject_data(reject::INVALID_HRQSIZE);
        assert_eq!(r, [0, 0, 5, 0]);
        assert_eq!(parse_reject(&r), Some(reject::INVALID_HRQSIZE));
        assert_eq!(parse_reject(&[0, 0, 5]), None);
        assert_eq!(reject_reason(reject::NO_RESOURCES), "no resources");
    }
}
