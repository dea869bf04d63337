//! Discovery: ask a discovery controller which subsystems a host may connect to, and where.

use nvme_spec::FromBytes;
use nvme_spec::command::{cns, log_id};
use nvme_spec::fabrics::{Cc, DISCOVERY_NQN, property};
use nvme_spec::identify::{IdentifyController, get_trimmed};
use nvme_spec::log::{DiscoveryLogEntry, DiscoveryLogHeader, adrfam, subtype, trtype};
use serde::{Deserialize, Serialize};
use tracing::debug;

use crate::admin::{self, Admin};
use crate::setup::{QueueSpec, SetupConn};
use crate::{DiscoveryOptions, Error};

/// Size of the header and of each entry of the discovery log page.
const RECORD: u32 = 1024;
/// Largest Get Log Page transfer used.
const MAX_CHUNK: u32 = 64 * 1024;
/// Records accepted at most (a sanity bound against a corrupt NUMREC).
const MAX_RECORDS: u64 = 16 * 1024;

/// One entry of the discovery log (NVMe-oF 1.1, Figure 39).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiscoveryEntry {
    /// Transport type (3 = TCP, 1 = RDMA).
    pub trtype: u8,
    /// Address family (1 = IPv4, 2 = IPv6).
    pub adrfam: u8,
    /// Subsystem type (2 = NVM subsystem, 3 = current discovery subsystem, 1 = referral).
    pub subtype: u8,
    /// Transport requirements.
    pub treq: u8,
    /// Port ID.
    pub portid: u16,
    /// Controller ID (0xFFFF: dynamic).
    pub cntlid: u16,
    /// Admin max submission queue size.
    pub asqsz: u16,
    /// Entry flags.
    pub eflags: u16,
    /// Transport service ID (the port, as text).
    pub trsvcid: String,
    /// Transport address.
    pub traddr: String,
    /// Subsystem NQN.
    pub subnqn: String,
    /// The RDMA transport specific address subtype (entries with trtype RDMA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma: Option<RdmaTsas>,
    /// The NVMe/TCP security type of the transport specific address subtype (entries with
    /// trtype TCP): 0 none, 2 TLS 1.3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_sectype: Option<u8>,
}

/// The transport specific address subtype of an RDMA entry (NVMe-oF 1.1, Figure 41).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaTsas {
    /// RDMA QP service type (1 = reliable connected, 2 = reliable datagram).
    pub qptype: u8,
    /// RDMA provider type (1 = not specified, 2 = InfiniBand, 3 = RoCE, 4 = RoCE v2,
    /// 5 = iWARP).
    pub prtype: u8,
    /// RDMA connection management service (1 = RDMA-CM).
    pub cms: u8,
    /// InfiniBand partition key.
    pub pkey: u16,
}

impl RdmaTsas {
    /// The QP service type as nvme-cli names it.
    pub fn qptype_name(&self) -> &'static str {
        match self.qptype {
            1 => "connected",
            2 => "datagram",
            _ => "unrecognized",
        }
    }

    /// The provider type as nvme-cli names it.
    pub fn prtype_name(&self) -> &'static str {
        match self.prtype {
            1 => "not specified",
            2 => "infiniband",
            3 => "roce",
            4 => "roce-v2",
            5 => "iwarp",
            _ => "unrecognized",
        }
    }

    /// The connection management service as nvme-cli names it.
    pub fn cms_name(&self) -> &'static str {
        match self.cms {
            1 => "rdma-cm",
            _ => "unrecognized",
        }
    }
}

impl DiscoveryEntry {
    fn from_raw(e: &DiscoveryLogEntry) -> Self {
        DiscoveryEntry {
            trtype: e.trtype,
            adrfam: e.adrfam,
            subtype: e.subtype,
            treq: e.treq,
            portid: e.portid.get(),
            cntlid: e.cntlid.get(),
            asqsz: e.asqsz.get(),
            eflags: e.eflags.get(),
            trsvcid: get_trimmed(&e.trsvcid),
            traddr: get_trimmed(&e.traddr),
            subnqn: get_trimmed(&e.subnqn),
            rdma: (e.trtype == trtype::RDMA).then(|| RdmaTsas {
                qptype: e.tsas[0],
                prtype: e.tsas[1],
                cms: e.tsas[2],
                pkey: u16::from_le_bytes([e.tsas[8], e.tsas[9]]),
            }),
            tcp_sectype: (e.trtype == trtype::TCP).then_some(e.tsas[0]),
        }
    }

    /// The transport of the entry, if this initiator speaks it.
    pub fn transport(&self) -> Option<crate::Transport> {
        match self.trtype {
            trtype::TCP => Some(crate::Transport::Tcp),
            trtype::RDMA => Some(crate::Transport::Rdma),
            _ => None,
        }
    }

    /// The address to connect to for this entry (None for another transport or a port that
    /// is not a number).
    pub fn target_addr(&self) -> Option<crate::TargetAddr> {
        Some(
            crate::TargetAddr::new(self.traddr.clone(), self.port()?)
                .with_transport(self.transport()?),
        )
    }

    /// The transport type as nvme-cli names it.
    pub fn trtype_name(&self) -> &'static str {
        match self.trtype {
            trtype::RDMA => "rdma",
            trtype::FC => "fc",
            trtype::TCP => "tcp",
            254 => "loop",
            _ => "unrecognized",
        }
    }

    /// The address family as nvme-cli names it.
    pub fn adrfam_name(&self) -> &'static str {
        match self.adrfam {
            adrfam::IPV4 => "ipv4",
            adrfam::IPV6 => "ipv6",
            3 => "infiniband",
            4 => "fibre-channel",
            254 => "loop",
            _ => "unrecognized",
        }
    }

    /// The subsystem type as nvme-cli names it.
    pub fn subtype_name(&self) -> &'static str {
        match self.subtype {
            subtype::DISCOVERY_REFERRAL => "discovery subsystem referral",
            subtype::NVME => "nvme subsystem",
            subtype::CURRENT_DISCOVERY => "current discovery subsystem",
            _ => "unrecognized",
        }
    }

    /// The secure channel requirement as nvme-cli names it.
    pub fn treq_name(&self) -> String {
        let sc = match self.treq & 0b11 {
            0 => "not specified",
            1 => "required",
            2 => "not required",
            _ => "reserved",
        };
        if self.treq & 0b100 != 0 {
            format!("{sc}, sq flow control disable supported")
        } else {
            sc.to_string()
        }
    }

    /// The port number, if the service ID is a number.
    pub fn port(&self) -> Option<u16> {
        self.trsvcid.parse().ok()
    }
}

/// A consistent copy of the discovery log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiscoveryLog {
    /// Generation counter of the log that was read.
    pub genctr: u64,
    /// The entries.
    pub entries: Vec<DiscoveryEntry>,
}

/// Connects to the discovery controller at `opts.addr`, reads the whole discovery log
/// (header, then the entries in chunks by log page offset, then the header again, retrying
/// when the generation counter changed in between), and disconnects.
pub async fn discover(opts: &DiscoveryOptions) -> Result<DiscoveryLog, Error> {
    let t = &opts.timeouts;
    let digests = (opts.header_digest, opts.data_digest);
    let spec = QueueSpec {
        qid: 0,
        cntlid: 0xFFFF,
        depth: 32,
        in_capsule: 0,
        sq_flow_off: false,
    };
    let mut c = SetupConn::open(
        &opts.addr,
        spec,
        digests,
        t.connect,
        t.admin,
        &crate::rdma::SharedPd::default(),
        None,
    )
    .await?;
    c.connect(0, DISCOVERY_NQN, &opts.host, None).await?;
    let cap = c.property_get(property::CAP, true).await?;
    let cap_to_ms = ((cap >> 24) & 0xFF) as u32 * 500;
    let cc = c.property_get(property::CC, false).await? as u32;
    if !Cc(cc).enabled() {
        admin::enable(&mut c, cap_to_ms, std::time::Duration::from_millis(500)).await?;
    }
    let raw = c.identify(cns::CONTROLLER, 0).await?;
    let id = IdentifyController::read_from_bytes(&raw)
        .map_err(|_| Error::Refused("short Identify Controller data".into()))?;
    let mpsmin = 4096u64 << ((cap >> 48) & 0xF);
    let mut chunk = MAX_CHUNK;
    if id.mdts != 0 {
        chunk = chunk.min((mpsmin << id.mdts.min(20)).min(u64::from(MAX_CHUNK)) as u32);
    }
    let chunk = (chunk / RECORD).max(1) * RECORD;
    let log = read_log(&mut c, chunk, opts.max_attempts.max(1)).await;
    if let Err(e) = admin::shutdown(&mut c, t.shutdown).await {
        debug!(error = %e, "discovery controller shutdown incomplete");
    }
    log
}

fn header(raw: &[u8]) -> Result<DiscoveryLogHeader, Error> {
    DiscoveryLogHeader::read_from_prefix(raw)
        .map(|(h, _)| h)
        .map_err(|_| Error::Refused("short discovery log header".into()))
}

async fn read_log(c: &mut SetupConn, chunk: u32, attempts: u32) -> Result<DiscoveryLog, Error> {
    for _ in 0..attempts {
        let hdr = header(&c.get_log_page(log_id::DISCOVERY, 0, RECORD, 0).await?)?;
        let genctr = hdr.genctr.get();
        let numrec = hdr.numrec.get();
        if numrec > MAX_RECORDS {
            return Err(Error::Refused(format!(
                "the discovery log claims {numrec} records"
            )));
        }
        let total = numrec * u64::from(RECORD);
        let mut entries = Vec::with_capacity(numrec as usize);
        let mut off = 0u64;
        while off < total {
            let n = (total - off).min(u64::from(chunk)) as u32;
            let data = c
                .get_log_page(log_id::DISCOVERY, 0, n, u64::from(RECORD) + off)
                .await?;
            for rec in data.chunks_exact(RECORD as usize) {
                if let Ok(e) = DiscoveryLogEntry::read_from_bytes(rec) {
                    entries.push(DiscoveryEntry::from_raw(&e));
                }
            }
            off += u64::from(n);
        }
        let again = header(&c.get_log_page(log_id::DISCOVERY, 0, RECORD, 0).await?)?;
        if again.genctr.get() == genctr {
            return Ok(DiscoveryLog { genctr, entries });
        }
        debug!(
            before = genctr,
            after = again.genctr.get(),
            "discovery log changed while reading; reading it again"
        );
    }
    Err(Error::Refused(format!(
        "the discovery log changed during each of {attempts} attempts to read it"
    )))
}

/// Referral levels followed at most by default: the discovery controller asked first is level
/// 0, one it refers to level 1, and so on.
pub const DEFAULT_REFERRAL_DEPTH: u32 = 4;
/// Discovery controllers read at most in one walk, however many referrals they list.
pub const MAX_REFERRALS: usize = 256;

/// The walk through discovery referrals: which discovery controller to read next. Each
/// address is read once (a referral back to one read already, or listed by two controllers,
/// is not followed again), no deeper than the depth limit and no more than [`MAX_REFERRALS`]
/// controllers, so a loop or a long chain of referrals ends.
#[derive(Debug)]
pub struct ReferralWalk {
    queue: std::collections::VecDeque<(crate::TargetAddr, u32)>,
    seen: std::collections::HashSet<crate::TargetAddr>,
    max_depth: u32,
}

/// The same address however the IP address is spelled (`::1` and `0:0::1`).
fn canonical(addr: &crate::TargetAddr) -> crate::TargetAddr {
    let mut a = addr.clone();
    if let Ok(ip) = a.host.parse::<std::net::IpAddr>() {
        a.host = ip.to_string();
    }
    a
}

impl ReferralWalk {
    /// A walk that starts at `start` (level 0) and follows referrals down to `max_depth`.
    pub fn new(start: crate::TargetAddr, max_depth: u32) -> Self {
        Self::from_many([start], max_depth)
    }

    /// A walk that starts at each of `starts` (all level 0; the same address once).
    pub fn from_many(starts: impl IntoIterator<Item = crate::TargetAddr>, max_depth: u32) -> Self {
        let mut w = ReferralWalk {
            queue: Default::default(),
            seen: Default::default(),
            max_depth,
        };
        for s in starts {
            w.push(s, 0);
        }
        w
    }

    fn push(&mut self, addr: crate::TargetAddr, depth: u32) {
        if depth <= self.max_depth
            && self.seen.len() < MAX_REFERRALS
            && self.seen.insert(canonical(&addr))
        {
            self.queue.push_back((addr, depth));
        }
    }

    /// The next discovery controller to read and its level, or `None` when the walk is over.
    pub fn next_controller(&mut self) -> Option<(crate::TargetAddr, u32)> {
        self.queue.pop_front()
    }

    /// Takes in the log read at level `depth`: its referrals (of a transport this initiator
    /// speaks) are read next, those not read or queued already.
    pub fn read(&mut self, depth: u32, log: &DiscoveryLog) {
        for e in &log.entries {
            if e.subtype == subtype::DISCOVERY_REFERRAL
                && let Some(a) = e.target_addr()
            {
                self.push(a, depth + 1);
            }
        }
    }
}

/// One discovery controller read (or not) while following referrals.
#[derive(Debug)]
pub struct ReferredLog {
    /// Its address.
    pub addr: crate::TargetAddr,
    /// Its level: 0 for the one asked first, 1 for one it refers to, and so on.
    pub depth: u32,
    /// Its log, or why it could not be read (the walk goes on with the others).
    pub log: Result<DiscoveryLog, Error>,
}

/// Reads the discovery log at `opts.addr` ([`discover`]) and, following its referral entries,
/// those of the discovery controllers it refers to, down to `max_depth` levels (see
/// [`ReferralWalk`]). The first controller that cannot be read ends the walk with its error;
/// a referred one that cannot be read is reported in its [`ReferredLog`].
pub async fn discover_referrals(
    opts: &DiscoveryOptions,
    max_depth: u32,
) -> Result<Vec<ReferredLog>, Error> {
    let mut logs = discover_all(opts, [opts.addr.clone()], max_depth).await;
    if let Some(ReferredLog { log: Err(e), .. }) = logs.first_mut() {
        return Err(e.clone());
    }
    Ok(logs)
}

/// Reads the discovery logs at each of `starts` (found over mDNS, say) and follows their
/// referrals as [`discover_referrals`] does, each discovery controller once; one that cannot
/// be read is reported in its [`ReferredLog`] and the walk goes on.
pub async fn discover_all(
    opts: &DiscoveryOptions,
    starts: impl IntoIterator<Item = crate::TargetAddr>,
    max_depth: u32,
) -> Vec<ReferredLog> {
    let mut walk = ReferralWalk::from_many(starts, max_depth);
    let mut out = Vec::new();
    while let Some((addr, depth)) = walk.next_controller() {
        let mut o = opts.clone();
        o.addr = addr.clone();
        let log = discover(&o).await;
        match &log {
            Ok(l) => walk.read(depth, l),
            Err(e) => debug!(%addr, error = %e, "discovery controller unreadable"),
        }
        out.push(ReferredLog { addr, depth, log });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn referral(host: &str, port: u16) -> DiscoveryEntry {
        let mut raw = DiscoveryLogEntry::zeroed();
        raw.trtype = trtype::TCP;
        raw.adrfam = adrfam::IPV4;
        raw.subtype = subtype::DISCOVERY_REFERRAL;
        let port = port.to_string();
        raw.trsvcid[..port.len()].copy_from_slice(port.as_bytes());
        raw.traddr[..host.len()].copy_from_slice(host.as_bytes());
        DiscoveryEntry::from_raw(&raw)
    }

    /// Walks a graph of discovery controllers (by port on 192.0.2.1, each listing referrals
    /// to others) and returns the ports read, with their levels.
    fn walk(graph: &[(u16, &[u16])], max_depth: u32) -> Vec<(u16, u32)> {
        let mut w = ReferralWalk::new(crate::TargetAddr::new("192.0.2.1", graph[0].0), max_depth);
        let mut read = Vec::new();
        while let Some((a, depth)) = w.next_controller() {
            read.push((a.port, depth));
            let refs = graph
                .iter()
                .find(|(p, _)| *p == a.port)
                .map_or(&[][..], |g| g.1);
            let mut entries: Vec<DiscoveryEntry> =
                refs.iter().map(|p| referral("192.0.2.1", *p)).collect();
            // Not referrals: an NVM subsystem and the current discovery controller.
            let mut nvm = referral("192.0.2.1", 4420);
            nvm.subtype = subtype::NVME;
            let mut current = referral("192.0.2.1", 9999);
            current.subtype = subtype::CURRENT_DISCOVERY;
            entries.extend([nvm, current]);
            w.read(depth, &DiscoveryLog { genctr: 1, entries });
        }
        read
    }

    #[test]
    fn referrals_are_followed_once_each_and_loops_end() {
        // 1 -> 2 -> 3 -> 1 (a loop), 1 -> 3 too, 2 -> itself.
        let graph: &[(u16, &[u16])] = &[(1, &[2, 3]), (2, &[2, 3]), (3, &[1])];
        assert_eq!(walk(graph, 4), vec![(1, 0), (2, 1), (3, 1)]);
        // The same address spelled otherwise is the same controller.
        let mut w = ReferralWalk::new(crate::TargetAddr::new("::1", 1), 4);
        w.next_controller();
        let mut e = referral("0:0::1", 1);
        e.adrfam = adrfam::IPV6;
        w.read(
            0,
            &DiscoveryLog {
                genctr: 1,
                entries: vec![e],
            },
        );
        assert!(w.next_controller().is_none());
    }

    #[test]
    fn referrals_are_followed_down_to_the_depth_limit() {
        let chain: &[(u16, &[u16])] = &[(1, &[2]), (2, &[3]), (3, &[4]), (4, &[5]), (5, &[])];
        assert_eq!(walk(chain, 2), vec![(1, 0), (2, 1), (3, 2)]);
        assert_eq!(walk(chain, 0), vec![(1, 0)]);
        // A controller referring to very many others: the walk stops at MAX_REFERRALS.
        let many: Vec<u16> = (2..2000).collect();
        let fan: &[(u16, &[u16])] = &[(1, &many)];
        assert_eq!(walk(fan, 4).len(), MAX_REFERRALS);
    }

    #[test]
    fn rdma_entries_carry_their_transport_subtype() {
        let mut raw = DiscoveryLogEntry::zeroed();
        raw.trtype = trtype::RDMA;
        raw.adrfam = adrfam::IPV4;
        raw.trsvcid[..4].copy_from_slice(b"4420");
        raw.traddr[..9].copy_from_slice(b"192.0.2.1");
        raw.tsas[..3].copy_from_slice(&[1, 4, 1]);
        raw.tsas[8..10].copy_from_slice(&0xFFFFu16.to_le_bytes());
        let e = DiscoveryEntry::from_raw(&raw);
        let t = e.rdma.expect("RDMA subtype");
        assert_eq!(
            (t.qptype_name(), t.prtype_name(), t.cms_name(), t.pkey),
            ("connected", "roce-v2", "rdma-cm", 0xFFFF)
        );
        assert_eq!(
            e.target_addr(),
            Some(crate::TargetAddr::rdma("192.0.2.1", 4420))
        );
        raw.trtype = trtype::TCP;
        let e = DiscoveryEntry::from_raw(&raw);
        assert_eq!(e.rdma, None);
        assert_eq!(e.transport(), Some(crate::Transport::Tcp));
        raw.trtype = trtype::FC;
        assert_eq!(DiscoveryEntry::from_raw(&raw).target_addr(), None);
    }
}
