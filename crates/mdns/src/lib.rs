//! mDNS / DNS-SD (RFC 6762, RFC 6763) for NVMe-oF discovery controllers, as NVMe TP 8009
//! describes: a discovery controller is a DNS-SD service instance of type `_nvme-disc._tcp`
//! in the `local` domain, with a SRV record (host and port), an A record per address and a
//! TXT record with `nqn=` (the discovery subsystem NQN) and `p=` (the transport: `tcp`,
//! `tls` for TLS-only NVMe/TCP, `rdma`). Hosts find them by browsing, as Avahi's
//! `avahi-browse _nvme-disc._tcp` and nvme-stas's `stafd` do.
//!
//! [`Responder`] answers queries for the services it is given and announces them (and says
//! goodbye, TTL 0, when one goes or the responder stops); [`browse`] asks the link and
//! collects the answers. [`wire`] is the message format.

pub mod wire;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UdpSocket;
use tracing::debug;
use wire::{Message, Question, RData, Record, rtype};

/// The DNS-SD service type of NVMe-oF discovery controllers, with its domain.
pub const SERVICE_TYPE: &str = "_nvme-disc._tcp.local";
/// The name DNS-SD browsers ask to enumerate service types.
const SERVICE_TYPES: &str = "_services._dns-sd._udp.local";
/// The mDNS group and port.
pub const MDNS_GROUP: Ipv4Addr = Ipv4Addr::new(224, 0, 0, 251);
/// The mDNS port.
pub const MDNS_PORT: u16 = 5353;
/// TTL of host and SRV records (RFC 6762 recommends 120 s).
const HOST_TTL: u32 = 120;
/// TTL of the other records (RFC 6762 recommends 75 minutes).
const OTHER_TTL: u32 = 4500;
/// Largest message read or sent.
const MAX_MESSAGE: usize = 9000;

/// One advertised discovery controller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    /// Instance name (one DNS label, e.g. `nvmeof-host1-8009`).
    pub instance: String,
    /// Host name in `.local` (e.g. `nvmeof-host1.local`).
    pub host: String,
    /// Address the discovery controller listens on.
    pub addr: IpAddr,
    /// Its port.
    pub port: u16,
    /// TXT `key=value` pairs (`nqn`, `p`).
    pub txt: Vec<(String, String)>,
}

impl Service {
    /// The instance's full name (`INSTANCE._nvme-disc._tcp.local`).
    pub fn full_name(&self) -> String {
        format!("{}.{SERVICE_TYPE}", self.instance)
    }

    fn ptr(&self, ttl: u32) -> Record {
        Record {
            name: SERVICE_TYPE.into(),
            ttl,
            cache_flush: false,
            data: RData::Ptr(self.full_name()),
        }
    }

    fn srv_txt_addr(&self, ttl: Option<u32>) -> Vec<Record> {
        let rec = |name: String, t: u32, data| Record {
            name,
            ttl: ttl.unwrap_or(t),
            cache_flush: true,
            data,
        };
        let txt = self
            .txt
            .iter()
            .map(|(k, v)| format!("{k}={v}").into_bytes())
            .collect();
        vec![
            rec(
                self.full_name(),
                HOST_TTL,
                RData::Srv {
                    priority: 0,
                    weight: 0,
                    port: self.port,
                    target: self.host.clone(),
                },
            ),
            rec(self.full_name(), OTHER_TTL, RData::Txt(txt)),
            rec(
                self.host.clone(),
                HOST_TTL,
                match self.addr {
                    IpAddr::V4(a) => RData::A(a),
                    IpAddr::V6(a) => RData::Aaaa(a),
                },
            ),
        ]
    }
}

/// The records that answer `q` from `services` (answers, additional records).
fn answer(services: &[Service], q: &Question) -> (Vec<Record>, Vec<Record>) {
    let (mut ans, mut add) = (Vec::new(), Vec::new());
    let is = |n: &str| q.name.eq_ignore_ascii_case(n);
    let wants = |t: u16| q.qtype == t || q.qtype == rtype::ANY;
    if is(SERVICE_TYPES) && wants(rtype::PTR) && !services.is_empty() {
        ans.push(Record {
            name: SERVICE_TYPES.into(),
            ttl: OTHER_TTL,
            cache_flush: false,
            data: RData::Ptr(SERVICE_TYPE.into()),
        });
    }
    for s in services {
        if is(SERVICE_TYPE) && wants(rtype::PTR) {
            ans.push(s.ptr(OTHER_TTL));
            add.extend(s.srv_txt_addr(None));
        } else if is(&s.full_name()) {
            let recs = s.srv_txt_addr(None);
            for r in &recs[..2] {
                if wants(r.data.rtype()) {
                    ans.push(r.clone());
                }
            }
            add.push(recs[2].clone());
        } else if is(&s.host) && (wants(rtype::A) || wants(rtype::AAAA)) {
            let a = s.srv_txt_addr(None).swap_remove(2);
            if wants(a.data.rtype()) {
                ans.push(a);
            }
        }
    }
    ans.dedup();
    add.retain(|r| !ans.contains(r));
    add.dedup();
    (ans, add)
}

/// A response announcing `services` (or, with `ttl` 0, saying goodbye to them).
fn announcement(services: &[Service], ttl: Option<u32>) -> Message {
    let mut m = Message {
        response: true,
        ..Default::default()
    };
    for s in services {
        m.answers.push(s.ptr(ttl.unwrap_or(OTHER_TTL)));
        m.answers.extend(s.srv_txt_addr(ttl));
    }
    m
}

/// The multicast socket: port 5353 shared with other responders (Avahi), the group joined
/// on the interfaces of `addrs` (and on the default one).
fn mdns_socket(addrs: &[Ipv4Addr]) -> std::io::Result<UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
    s.set_reuse_address(true)?;
    s.set_reuse_port(true)?;
    s.set_multicast_ttl_v4(255)?;
    s.set_multicast_loop_v4(true)?;
    s.set_nonblocking(true)?;
    s.bind(&SocketAddr::from((Ipv4Addr::UNSPECIFIED, MDNS_PORT)).into())?;
    let mut joined = false;
    let mut last = None;
    for a in addrs.iter().chain([&Ipv4Addr::UNSPECIFIED]) {
        match s.join_multicast_v4(&MDNS_GROUP, a) {
            Ok(()) => joined = true,
            Err(e) => last = Some(e),
        }
    }
    if !joined {
        return Err(last.unwrap_or_else(|| std::io::Error::other("no interface")));
    }
    UdpSocket::from_std(s.into())
}

/// Answers mDNS queries for a changing set of services, announcing each when it comes and
/// saying goodbye (TTL 0) when it goes or the responder stops.
pub struct Responder {
    services: tokio::sync::watch::Sender<Vec<Service>>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Responder {
    /// Binds the mDNS socket, announces `services` and answers queries until stopped.
    pub async fn start(services: Vec<Service>) -> std::io::Result<Responder> {
        let v4: Vec<Ipv4Addr> = services
            .iter()
            .filter_map(|s| match s.addr {
                IpAddr::V4(a) if !a.is_loopback() => Some(a),
                _ => None,
            })
            .collect();
        let socket = Arc::new(mdns_socket(&v4)?);
        let (tx, rx) = tokio::sync::watch::channel(services);
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(serve(socket, rx, stopped));
        Ok(Responder {
            services: tx,
            stop,
            task,
        })
    }

    /// Replaces the advertised services: new ones are announced, removed ones get a goodbye.
    pub fn set_services(&self, services: Vec<Service>) {
        set(&self.services, services);
    }

    /// A handle that changes the advertised services from elsewhere.
    pub fn handle(&self) -> ResponderHandle {
        ResponderHandle(self.services.clone())
    }

    /// Says goodbye for every service and stops answering.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

fn set(tx: &tokio::sync::watch::Sender<Vec<Service>>, services: Vec<Service>) {
    tx.send_if_modified(|cur| {
        let changed = *cur != services;
        *cur = services;
        changed
    });
}

/// Changes the services of a [`Responder`] (see [`Responder::handle`]).
#[derive(Clone)]
pub struct ResponderHandle(tokio::sync::watch::Sender<Vec<Service>>);

impl ResponderHandle {
    /// As [`Responder::set_services`].
    pub fn set_services(&self, services: Vec<Service>) {
        set(&self.0, services);
    }
}

async fn send(socket: &UdpSocket, m: &Message, to: SocketAddr) {
    if let Err(e) = socket.send_to(&m.encode(), to).await {
        debug!(error = %e, %to, "mDNS send failed");
    }
}

async fn serve(
    socket: Arc<UdpSocket>,
    mut rx: tokio::sync::watch::Receiver<Vec<Service>>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let group = SocketAddr::V4(SocketAddrV4::new(MDNS_GROUP, MDNS_PORT));
    let mut current: Vec<Service> = rx.borrow_and_update().clone();
    // Announced twice, a second apart (RFC 6762 section 8.3).
    let mut announcements = 2u8;
    let mut next = tokio::time::Instant::now();
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(next), if announcements > 0 => {
                if !current.is_empty() {
                    send(&socket, &announcement(&current, None), group).await;
                }
                announcements -= 1;
                next = tokio::time::Instant::now() + Duration::from_secs(1);
            }
            _ = &mut stopped => {
                if !current.is_empty() {
                    send(&socket, &announcement(&current, Some(0)), group).await;
                }
                return;
            }
            changed = rx.changed() => {
                let new = match changed {
                    Ok(()) => rx.borrow_and_update().clone(),
                    Err(_) => Vec::new(),
                };
                let gone: Vec<Service> = current.iter().filter(|s| !new.contains(s)).cloned().collect();
                if !gone.is_empty() {
                    send(&socket, &announcement(&gone, Some(0)), group).await;
                }
                let added = new.iter().any(|s| !current.contains(s));
                current = new;
                if changed.is_err() {
                    return;
                }
                if added {
                    announcements = 2;
                    next = tokio::time::Instant::now();
                }
            }
            r = socket.recv_from(&mut buf) => {
                let Ok((n, from)) = r else { continue };
                let Ok(q) = Message::parse(&buf[..n]) else { continue };
                if q.response || q.questions.is_empty() {
                    continue;
                }
                let mut resp = Message { response: true, ..Default::default() };
                for question in &q.questions {
                    let (a, add) = answer(&current, question);
                    resp.answers.extend(a);
                    resp.additional.extend(add);
                }
                if resp.answers.is_empty() {
                    continue;
                }
                if from.port() != MDNS_PORT {
                    // A one-shot (legacy unicast) query: answered to its sender, with its ID
                    // and questions, without cache-flush bits and with short TTLs.
                    resp.id = q.id;
                    resp.questions = q.questions.clone();
                    for r in resp.answers.iter_mut().chain(resp.additional.iter_mut()) {
                        r.cache_flush = false;
                        r.ttl = r.ttl.min(10);
                    }
                    send(&socket, &resp, from).await;
                } else {
                    send(&socket, &resp, group).await;
                }
            }
        }
    }
}

/// A discovery controller found by [`browse`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// Instance name.
    pub instance: String,
    /// Host name.
    pub host: String,
    /// Its addresses.
    pub addrs: Vec<IpAddr>,
    /// Its port.
    pub port: u16,
    /// TXT `key=value` pairs, keys lowercased.
    pub txt: BTreeMap<String, String>,
}

impl Found {
    /// The transport its TXT record names (`p`; `tcp` when absent).
    pub fn transport(&self) -> &str {
        self.txt.get("p").map_or("tcp", String::as_str)
    }
}

/// Resolves what `records` say about the instances of [`SERVICE_TYPE`].
pub fn resolve(records: &[Record]) -> Vec<Found> {
    let mut found: Vec<Found> = Vec::new();
    let instances = records.iter().filter_map(|r| match &r.data {
        RData::Ptr(p) if r.name.eq_ignore_ascii_case(SERVICE_TYPE) && r.ttl > 0 => Some(p),
        _ => None,
    });
    for inst in instances {
        if found.iter().any(|f| f.instance.eq_ignore_ascii_case(inst)) {
            continue;
        }
        let of = |r: &&Record| r.name.eq_ignore_ascii_case(inst);
        let Some((host, port)) = records.iter().filter(of).find_map(|r| match &r.data {
            RData::Srv { port, target, .. } => Some((target.clone(), *port)),
            _ => None,
        }) else {
            continue;
        };
        let txt = records
            .iter()
            .filter(of)
            .find_map(|r| match &r.data {
                RData::Txt(s) => Some(wire::txt_pairs(s).into_iter().collect()),
                _ => None,
            })
            .unwrap_or_default();
        let mut addrs: Vec<IpAddr> = records
            .iter()
            .filter(|r| r.name.eq_ignore_ascii_case(&host))
            .filter_map(|r| match r.data {
                RData::A(a) => Some(IpAddr::V4(a)),
                RData::Aaaa(a) => Some(IpAddr::V6(a)),
                _ => None,
            })
            .collect();
        addrs.dedup();
        let instance = inst
            .strip_suffix(&format!(".{SERVICE_TYPE}"))
            .unwrap_or(inst)
            .to_string();
        found.push(Found {
            instance,
            host,
            addrs,
            port,
            txt,
        });
    }
    found
}

/// Asks the link for [`SERVICE_TYPE`] instances (one-shot queries from an ephemeral port,
/// which responders answer directly) and returns those resolved within `wait`: each with
/// its host, addresses, port and TXT pairs. Instances whose records were incomplete are
/// asked about once more.
pub async fn browse(wait: Duration) -> std::io::Result<Vec<Found>> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
    s.set_multicast_ttl_v4(255)?;
    s.set_multicast_loop_v4(true)?;
    s.set_nonblocking(true)?;
    s.bind(&SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)).into())?;
    let socket = UdpSocket::from_std(s.into())?;
    let group = SocketAddr::V4(SocketAddrV4::new(MDNS_GROUP, MDNS_PORT));
    let query = |questions: Vec<(String, u16)>| Message {
        id: 0x4e56,
        questions: questions
            .into_iter()
            .map(|(name, qtype)| Question {
                name,
                qtype,
                unicast: true,
            })
            .collect(),
        ..Default::default()
    };
    let mut records: Vec<Record> = Vec::new();
    let half = wait / 2;
    socket
        .send_to(
            &query(vec![(SERVICE_TYPE.into(), rtype::PTR)]).encode(),
            group,
        )
        .await?;
    collect(&socket, half, &mut records).await;
    // What is missing: SRV and TXT of instances, addresses of hosts.
    let mut more = Vec::new();
    for r in &records {
        if let RData::Ptr(inst) = &r.data {
            let has_srv = records
                .iter()
                .any(|x| x.name.eq_ignore_ascii_case(inst) && x.data.rtype() == rtype::SRV);
            if !has_srv {
                more.push((inst.clone(), rtype::ANY));
            }
        }
    }
    for f in resolve(&records) {
        if f.addrs.is_empty() {
            more.push((f.host.clone(), rtype::A));
        }
    }
    if !more.is_empty() {
        more.truncate(32);
        socket.send_to(&query(more).encode(), group).await?;
        collect(&socket, half, &mut records).await;
    }
    Ok(resolve(&records))
}

async fn collect(socket: &UdpSocket, wait: Duration, records: &mut Vec<Record>) {
    let deadline = tokio::time::Instant::now() + wait;
    let mut buf = vec![0u8; MAX_MESSAGE];
    while let Ok(Ok((n, _))) = tokio::time::timeout_at(deadline, socket.recv_from(&mut buf)).await {
        if let Ok(m) = Message::parse(&buf[..n])
            && m.response
        {
            for r in m.answers.into_iter().chain(m.additional) {
                if records.len() < 4096 && !records.contains(&r) {
                    records.push(r);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(port: u16) -> Service {
        Service {
            instance: format!("nvmeof-h-{port}"),
            host: "nvmeof-h.local".into(),
            addr: IpAddr::V4(Ipv4Addr::new(192, 0, 2, 9)),
            port,
            txt: vec![
                ("nqn".into(), "nqn.2014-08.org.nvmexpress.discovery".into()),
                ("p".into(), "tcp".into()),
            ],
        }
    }

    #[test]
    fn a_browse_query_is_answered_with_everything_needed_to_connect() {
        let services = [service(8009), service(8010)];
        let q = Question {
            name: "_NVME-disc._tcp.local".into(),
            qtype: rtype::PTR,
            unicast: true,
        };
        let (ans, add) = answer(&services, &q);
        assert_eq!(ans.len(), 2);
        let all: Vec<Record> = ans.into_iter().chain(add).collect();
        let found = resolve(&all);
        assert_eq!(found.len(), 2);
        assert_eq!(found[0].instance, "nvmeof-h-8009");
        assert_eq!(found[0].port, 8009);
        assert_eq!(
            found[0].addrs,
            vec![IpAddr::V4(Ipv4Addr::new(192, 0, 2, 9))]
        );
        assert_eq!(found[0].transport(), "tcp");
        assert_eq!(
            found[0].txt.get("nqn").map(String::as_str),
            Some("nqn.2014-08.org.nvmexpress.discovery")
        );
        // Other names and types are not ours to answer.
        let other = Question {
            name: "_http._tcp.local".into(),
            qtype: rtype::PTR,
            unicast: false,
        };
        assert!(answer(&services, &other).0.is_empty());
        let host_aaaa = Question {
            name: "nvmeof-h.local".into(),
            qtype: rtype::AAAA,
            unicast: false,
        };
        assert!(answer(&services, &host_aaaa).0.is_empty());
        let enumerate = Question {
            name: SERVICE_TYPES.into(),
            qtype: rtype::PTR,
            unicast: false,
        };
        assert_eq!(answer(&services, &enumerate).0.len(), 1);
    }

    #[test]
    fn a_goodbye_takes_the_service_away() {
        let s = [service(8009)];
        let bye = announcement(&s, Some(0));
        assert!(bye.answers.iter().all(|r| r.ttl == 0));
        assert!(resolve(&bye.answers).is_empty());
        let hello = Message::parse(&announcement(&s, None).encode()).unwrap();
        assert_eq!(resolve(&hello.answers).len(), 1);
    }
}
