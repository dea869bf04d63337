//! Establishing a controller's association, first and after each connection loss: the
//! admin queue (its connection, Fabrics Connect and authentication, enabling the controller,
//! Identify Controller, Keep Alive timer, asynchronous event configuration, Number of
//! Queues), then every I/O queue in parallel (each its own connection, Fabrics Connect and
//! authentication). What it finds out becomes the [`ControllerInfo`]; the links it opens are
//! handed to the queue tasks by the controller.

use std::time::Duration;

use nvme_spec::command::{build, cns};
use nvme_spec::fabrics::{Cc, property};
use nvme_spec::identify::{
    IdentifyController, OAES_ANA_CHANGE, OAES_NS_ATTRIBUTE, SGLS_KEYED, cntrltype,
};
use nvme_spec::{FromBytes, features};
use tokio::task::JoinSet;
use tracing::debug;

use crate::admin::{self, Admin};
use crate::info::{ControllerInfo, fill_from_identify};
use crate::link::Link;
use crate::rdma::SharedPd;
use crate::setup::{QueueSpec, SetupConn};
use crate::{ConnectOptions, Error};

/// Entries of the admin queue.
pub(crate) const ADMIN_QUEUE_ENTRIES: u16 = 32;
/// Transfer limit used when the controller reports none (MDTS 0).
const DEFAULT_MAX_TRANSFER: u64 = 1 << 20;

/// The result of setting up an association.
pub(crate) struct Established {
    /// The admin queue's link.
    pub admin: Link,
    /// The I/O queues' links, queue 1 first.
    pub ios: Vec<Link>,
    /// The highest I/O queue ID granted (queue pairs use those past the shared queues).
    pub max_qid: u16,
    /// What the controller reported.
    pub info: ControllerInfo,
    /// Its Identify Controller data.
    pub identify: Box<IdentifyController>,
    /// The active namespace IDs.
    pub active_ns: Vec<u32>,
}

/// Sets up the whole association: admin queue (Connect, enable, Identify, queues), then the
/// I/O queues. `want_io` is the number of I/O queues to ask for.
pub(crate) async fn establish(
    opts: &ConnectOptions,
    want_io: u16,
    pd: &SharedPd,
) -> Result<Established, Error> {
    let t = &opts.timeouts;
    let digests = (opts.header_digest, opts.data_digest);
    let tls = crate::tcp::tls_context(opts)?;
    let kato_ms = opts.kato.as_millis().min(u128::from(u32::MAX)) as u32;
    let mut sq_flow_off = opts.disable_sq_flow_control;
    let (mut admin, cntlid) = loop {
        let admin_queue = QueueSpec {
            qid: 0,
            cntlid: 0xFFFF,
            depth: ADMIN_QUEUE_ENTRIES,
            in_capsule: 0,
            sq_flow_off,
        };
        let mut admin = SetupConn::open(
            &opts.addr,
            admin_queue,
            digests,
            t.connect,
            t.admin,
            pd,
            tls.as_ref(),
        )
        .await?;
        let connected = admin
            .connect(kato_ms, &opts.subnqn, &opts.host, opts.dhchap.as_ref())
            .await;
        match connected {
            Ok(cntlid) => break (admin, cntlid),
            // A controller that cannot disable SQ flow control refuses the attribute with a
            // Connect status; a new connection asks without it.
            Err(e @ Error::Status { .. }) if sq_flow_off => {
                debug!(error = %e, "Connect asking to disable SQ flow control refused; connecting with it");
                sq_flow_off = false;
            }
            Err(e) => return Err(e),
        }
    };
    let cap = admin.property_get(property::CAP, true).await?;
    let cap_to_ms = ((cap >> 24) & 0xFF) as u32 * 500;
    let cc = admin.property_get(property::CC, false).await? as u32;
    if !Cc(cc).enabled() {
        admin::enable(&mut admin, cap_to_ms, Duration::from_millis(500)).await?;
    }
    let vs = admin.property_get(property::VS, false).await? as u32;
    let raw = admin.identify(cns::CONTROLLER, 0).await?;
    let id = IdentifyController::read_from_bytes(&raw)
        .map_err(|_| Error::Refused("short Identify Controller data".into()))?;
    if id.cntlid.get() != cntlid {
        return Err(Error::Refused(format!(
            "Identify Controller reports controller ID {} but Connect returned {cntlid}",
            id.cntlid.get()
        )));
    }
    if id.cntrltype == cntrltype::DISCOVERY {
        return Err(Error::Refused(format!(
            "{} is a discovery controller, not an I/O controller",
            opts.subnqn
        )));
    }
    if id.icdoff.get() != 0 {
        return Err(Error::Refused(format!(
            "in-capsule data offset {} is not supported",
            id.icdoff.get()
        )));
    }
    if id.sgls.get() & 0b11 == 0 {
        return Err(Error::Refused(
            "the controller does not support SGLs".into(),
        ));
    }
    if id.kas.get() == 0 && kato_ms != 0 {
        return Err(Error::Refused(
            "the controller does not support Keep Alive (KAS = 0)".into(),
        ));
    }
    let subnqn = nvme_spec::identify::get_trimmed(&id.subnqn);
    if !subnqn.is_empty() && subnqn != opts.subnqn {
        return Err(Error::Refused(format!(
            "the controller belongs to {subnqn}, not {}",
            opts.subnqn
        )));
    }
    // The keep alive timeout actually in force.
    let kato_ms = match admin
        .command(build::get_features(0, features::KEEP_ALIVE_TIMER), &[], 0)
        .await
    {
        Ok((cqe, _)) => cqe.dw0.get(),
        Err(_) => kato_ms,
    };
    let notices = id.oaes.get() & (OAES_NS_ATTRIBUTE | OAES_ANA_CHANGE);
    if notices != 0 {
        if let Err(e) = admin
            .set_features(features::ASYNC_EVENT_CONFIG, notices)
            .await
        {
            debug!(error = %e, "cannot enable namespace attribute and ANA change notices");
        }
    }
    // Queue IDs past the shared I/O queues are kept for queue pairs.
    let ask = want_io.saturating_add(opts.queue_pairs).min(u16::MAX - 1);
    let granted_all = if ask == 0 {
        0
    } else {
        let n = u32::from(ask - 1);
        let dw0 = admin
            .set_features(features::NUMBER_OF_QUEUES, n | (n << 16))
            .await?;
        let nsqa = dw0 & 0xFFFF;
        let ncqa = dw0 >> 16;
        (nsqa.min(ncqa) + 1).min(u32::from(ask)) as u16
    };
    let granted = granted_all.min(want_io);
    let active_ns = {
        let raw = admin.identify(cns::ACTIVE_NS_LIST, 0).await?;
        nvme_spec::identify::decode_ns_list(&raw)
    };
    let mqe = (cap & 0xFFFF) as u32 + 1;
    let depth = u32::from(opts.queue_depth).min(mqe).max(2) as u16;
    let mpsmin = 4096u64 << ((cap >> 48) & 0xF);
    let mdts_bytes = (id.mdts != 0).then(|| mpsmin << id.mdts.min(20));
    let mut max_transfer = mdts_bytes.unwrap_or(DEFAULT_MAX_TRANSFER);
    if let Some(m) = opts.max_transfer {
        max_transfer = max_transfer.min(u64::from(m));
    }
    let limits = admin.link.limits();
    if let Some(m) = limits.max_transfer {
        max_transfer = max_transfer.min(m);
    }
    let max_transfer = max_transfer.min(u64::from(u32::MAX)) as u32;
    let ioccsz = id.ioccsz.get();
    let mut icd = if ioccsz >= 4 {
        (ioccsz.saturating_mul(16) - 64).min(1 << 20)
    } else {
        0
    };
    if let Some(m) = limits.max_in_capsule {
        icd = icd.min(m);
    }
    if limits.needs_keyed_sgls && id.sgls.get() & SGLS_KEYED == 0 {
        return Err(Error::Refused(
            "the controller does not support keyed SGL data blocks, which NVMe/RDMA needs".into(),
        ));
    }
    let mut info = ControllerInfo {
        addr: opts.addr.to_string(),
        subnqn: String::new(),
        hostnqn: opts.host.hostnqn.clone(),
        hostid: opts.host.hostid_string(),
        cntlid,
        model: String::new(),
        serial: String::new(),
        firmware: String::new(),
        version: crate::info::version_string(vs),
        controller_type: String::new(),
        mdts_bytes,
        max_transfer_bytes: max_transfer,
        in_capsule_data_bytes: icd,
        io_queues: granted,
        queue_depth: depth,
        max_queue_entries: mqe,
        kato_ms,
        header_digest: admin.params.digests.header,
        data_digest: admin.params.digests.data,
        sq_flow_control: !sq_flow_off,
        nn: 0,
        write_zeroes: false,
        dataset_management: false,
        volatile_write_cache: false,
    };
    fill_from_identify(&mut info, &id);

    let mut set: JoinSet<Result<(u16, Link), Error>> = JoinSet::new();
    for qid in 1..=granted {
        let opts = opts.clone();
        let pd = pd.clone();
        set.spawn(async move {
            let spec = QueueSpec {
                qid,
                cntlid,
                depth,
                in_capsule: icd as usize,
                sq_flow_off,
            };
            Ok((qid, open_io_queue(&opts, &pd, spec).await?))
        });
    }
    let mut ios: Vec<Option<Link>> = (0..granted).map(|_| None).collect();
    while let Some(r) = set.join_next().await {
        let (qid, live) = r.map_err(|e| {
            Error::lost(
                &opts.addr.to_string(),
                format!("I/O queue set-up task failed: {e}"),
            )
        })??;
        ios[usize::from(qid) - 1] = Some(live);
    }
    let ios = ios.into_iter().flatten().collect();
    Ok(Established {
        admin: admin.into_link(limits.admin_in_capsule),
        ios,
        max_qid: granted_all,
        info,
        identify: Box::new(id),
        active_ns,
    })
}

/// Opens I/O queue `spec.qid` of controller `spec.cntlid`: its connection (with TLS when the
/// options ask for it) and its Fabrics Connect (and authentication), on the current runtime.
pub(crate) async fn open_io_queue(
    opts: &ConnectOptions,
    pd: &SharedPd,
    spec: QueueSpec,
) -> Result<Link, Error> {
    let t = &opts.timeouts;
    let tls = crate::tcp::tls_context(opts)?;
    let digests = (opts.header_digest, opts.data_digest);
    let mut q = SetupConn::open(
        &opts.addr,
        spec,
        digests,
        t.connect,
        t.admin,
        pd,
        tls.as_ref(),
    )
    .await?;
    q.connect(0, &opts.subnqn, &opts.host, opts.dhchap.as_ref())
        .await?;
    Ok(q.into_link(spec.in_capsule))
}
