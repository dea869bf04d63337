//! The discovery service: the discovery log page (log 0x70) a discovery controller returns.

use std::net::{IpAddr, SocketAddr};

use nvme_spec::IntoBytes;
use nvme_spec::fabrics::DISCOVERY_NQN;
use nvme_spec::identify::{put_ascii_padded, put_nul_padded};
use nvme_spec::log::{
    DiscoveryLogEntry, DiscoveryLogHeader, adrfam, subtype, tcp_sectype, treq, trtype,
};

use crate::config::{ListenAddr, Transport};
use crate::target::Target;

/// Admin submission queue size advertised in discovery entries.
pub const DISCOVERY_ASQSZ: u16 = 32;

fn entry(
    listener: &ListenAddr,
    portid: u16,
    local: SocketAddr,
    nqn: &str,
    sub: u8,
    tls: bool,
) -> DiscoveryLogEntry {
    let mut e = DiscoveryLogEntry::zeroed();
    e.trtype = match listener.transport {
        Transport::Tcp => trtype::TCP,
        Transport::Rdma => trtype::RDMA,
    };
    // A wildcard listener is reported with the address the host reached us on.
    let ip: IpAddr = if listener.addr.ip().is_unspecified() {
        local.ip()
    } else {
        listener.addr.ip()
    };
    e.adrfam = if ip.is_ipv4() {
        adrfam::IPV4
    } else {
        adrfam::IPV6
    };
    e.subtype = sub;
    let secure = if tls {
        e.tsas[0] = tcp_sectype::TLS13;
        treq::SECURE_CHANNEL_REQUIRED
    } else {
        // As the Linux target says of a port without TLS: nvme-cli's connect-all (libnvme
        // 1.3) asks the kernel for TLS on an entry that says "not required", which kernels
        // without NVMe/TCP TLS refuse.
        treq::SECURE_CHANNEL_NOT_SPECIFIED
    };
    e.treq = secure | treq::SQ_FLOW_CONTROL_DISABLE;
    e.portid.set(portid);
    e.cntlid.set(0xFFFF);
    e.asqsz.set(DISCOVERY_ASQSZ);
    put_ascii_padded(&mut e.trsvcid, &listener.addr.port().to_string());
    put_ascii_padded(&mut e.traddr, &ip.to_string());
    put_nul_padded(&mut e.subnqn, nqn);
    if listener.transport == Transport::Rdma {
        e.tsas[0] = 1; // RDMA QP type: reliable connected
        e.tsas[1] = 1; // RDMA provider type: not specified
        e.tsas[2] = 1; // RDMA connection management: RDMA_CM
    }
    e
}

/// Builds the whole discovery log page for `hostnqn`, as seen from the local address `local`:
/// every subsystem the host may connect to on every I/O listener it may use (TLS listeners
/// for hosts with a TLS PSK, plain ones for the others), then the discovery service
/// itself on every listener, then a referral to each other discovery controller configured
/// (`[discovery] referrals`). Entries of TLS listeners say that a secure channel is required
/// and that it is TLS 1.3; others say nothing of a secure channel.
pub fn log_page(target: &Target, hostnqn: &str, local: SocketAddr) -> Vec<u8> {
    let mut entries: Vec<DiscoveryLogEntry> = Vec::new();
    let listeners = target.listeners();
    let subsystems = target.subsystems();
    for (i, l) in listeners.io.iter().enumerate() {
        let portid = i as u16 + 1;
        for s in subsystems.values() {
            // A host with a TLS PSK connects over TLS listeners only, others over plain ones.
            let tls = target.requires_tls(l);
            if s.host_allowed(hostnqn) && tls == s.has_tls_psk(hostnqn) {
                entries.push(entry(l, portid, local, &s.nqn, subtype::NVME, tls));
            }
        }
    }
    let all = listeners.io.iter().chain(&listeners.discovery);
    let mut ports = 0;
    for (i, l) in all.enumerate() {
        ports = i as u16 + 1;
        entries.push(entry(
            l,
            ports,
            local,
            DISCOVERY_NQN,
            subtype::CURRENT_DISCOVERY,
            target.requires_tls(l),
        ));
    }
    for (i, r) in target.referrals().iter().enumerate() {
        let portid = ports.saturating_add(i as u16 + 1);
        entries.push(entry(
            r,
            portid,
            local,
            DISCOVERY_NQN,
            subtype::DISCOVERY_REFERRAL,
            false,
        ));
    }
    let mut hdr = DiscoveryLogHeader::zeroed();
    hdr.genctr.set(target.discovery_genctr());
    hdr.numrec.set(entries.len() as u64);
    let mut page = Vec::with_capacity(1024 * (entries.len() + 1));
    page.extend_from_slice(hdr.as_bytes());
    for e in &entries {
        page.extend_from_slice(e.as_bytes());
    }
    page
}
