//! mDNS advertisement of the discovery controller (`[discovery] mdns = true`): each address
//! that serves discovery is a DNS-SD instance of `_nvme-disc._tcp` (NVMe TP 8009) with TXT
//! `nqn=nqn.2014-08.org.nvmexpress.discovery` and `p=tcp` (`p=tls` for a listener that
//! requires TLS, `p=rdma` for NVMe/RDMA). The dedicated discovery listeners are advertised;
//! without any, the I/O listeners (which answer discovery too). A wildcard listener is
//! advertised with the address multicast leaves this machine from; loopback ones are not
//! advertised. Listeners added or removed while running are announced or withdrawn (a
//! goodbye, TTL 0) within a second, and all are withdrawn at shutdown.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use nvme_spec::fabrics::DISCOVERY_NQN;
use nvmeof_mdns::{MDNS_GROUP, MDNS_PORT, Responder, Service};
use tracing::{info, warn};

use crate::config::Transport;
use crate::target::Target;

/// How often the listeners are compared with what is advertised.
const POLL: Duration = Duration::from_secs(1);

/// The running advertisement.
pub struct Advertiser {
    responder: Responder,
    poll: tokio::task::JoinHandle<()>,
}

/// One DNS label from `s`: letters, digits and dashes.
fn label(s: &str) -> String {
    let l: String = s
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(40)
        .collect();
    l.trim_matches('-').to_string()
}

fn hostname() -> String {
    let h = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    match label(h.trim()) {
        h if h.is_empty() => "target".into(),
        h => h,
    }
}

/// The IPv4 address multicast leaves this machine from (no packet is sent).
fn outward_v4() -> Option<IpAddr> {
    let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).ok()?;
    s.connect(SocketAddr::from((MDNS_GROUP, MDNS_PORT))).ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_unspecified()).then_some(ip)
}

/// The services that describe the discovery listeners of `target` now.
pub fn services(target: &Target, host: &str) -> Vec<Service> {
    let l = target.listeners();
    let listeners = if l.discovery.is_empty() {
        &l.io
    } else {
        &l.discovery
    };
    let mut out: Vec<Service> = Vec::new();
    for a in listeners {
        let ip = match a.addr.ip() {
            ip if ip.is_unspecified() => match outward_v4() {
                Some(ip) => ip,
                None => continue,
            },
            ip if ip.is_loopback() => continue,
            ip => ip,
        };
        let p = match a.transport {
            Transport::Rdma => "rdma",
            Transport::Tcp if target.requires_tls(a) => "tls",
            Transport::Tcp => "tcp",
        };
        let at = label(&ip.to_string());
        let s = Service {
            instance: format!("nvmeof-{host}-{at}-{}", a.addr.port()),
            host: format!("nvmeof-{host}-{at}.local"),
            addr: ip,
            port: a.addr.port(),
            txt: vec![("nqn".into(), DISCOVERY_NQN.into()), ("p".into(), p.into())],
        };
        if !out.iter().any(|o| o.instance == s.instance) {
            out.push(s);
        }
    }
    out
}

impl Advertiser {
    /// Starts advertising the discovery listeners of `target`. Without multicast (no
    /// interface, port 5353 not shared) it warns in one line and returns `None`: the
    /// target runs all the same.
    pub async fn start(target: Arc<Target>) -> Option<Advertiser> {
        let host = hostname();
        let now = services(&target, &host);
        let responder = match Responder::start(now.clone()).await {
            Ok(r) => r,
            Err(e) => {
                warn!(
                    "mDNS advertisement off: cannot use multicast on {MDNS_GROUP}:{MDNS_PORT}: {e}"
                );
                return None;
            }
        };
        for s in &now {
            info!(instance = %s.instance, addr = %s.addr, port = s.port, "advertising the discovery controller over mDNS (_nvme-disc._tcp)");
        }
        if now.is_empty() {
            warn!(
                "mDNS: no discovery listener to advertise (loopback listeners are not advertised)"
            );
        }
        let r = responder.handle();
        let poll = tokio::spawn(async move {
            loop {
                tokio::time::sleep(POLL).await;
                r.set_services(services(&target, &host));
            }
        });
        Some(Advertiser { responder, poll })
    }

    /// Withdraws every advertised listener (goodbye, TTL 0) and stops answering.
    pub async fn stop(self) {
        self.poll.abort();
        self.responder.stop().await;
    }
}
