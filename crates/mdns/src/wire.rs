//! The DNS message format (RFC 1035) as mDNS uses it (RFC 6762): header, questions and
//! resource records of the types DNS-SD needs (PTR, SRV, TXT, A, AAAA). Parsing takes any
//! bytes: a malformed message is an error, never a panic, and compressed names are followed
//! backwards only, so a pointer loop ends.

use std::net::{Ipv4Addr, Ipv6Addr};

/// Record types.
pub mod rtype {
    /// IPv4 address.
    pub const A: u16 = 1;
    /// Domain name pointer.
    pub const PTR: u16 = 12;
    /// Text strings.
    pub const TXT: u16 = 16;
    /// IPv6 address.
    pub const AAAA: u16 = 28;
    /// Service location.
    pub const SRV: u16 = 33;
    /// Any type (questions only).
    pub const ANY: u16 = 255;
}

const CLASS_IN: u16 = 1;
/// The top bit of a question's class: the asker prefers a unicast answer.
const UNICAST_RESPONSE: u16 = 0x8000;
/// The top bit of a record's class: the record replaces the cached ones of its name and type.
const CACHE_FLUSH: u16 = 0x8000;
/// Longest name, in bytes on the wire.
const MAX_NAME: usize = 255;

/// Why a message did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The message ends inside a field.
    #[error("DNS message truncated")]
    Truncated,
    /// A name is longer than 255 bytes, has a label over 63 bytes, or a compression
    /// pointer that does not point backwards.
    #[error("bad DNS name")]
    BadName,
    /// A record's data does not match its type.
    #[error("bad DNS record data")]
    BadRecord,
}

/// A question.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Question {
    /// Name asked about (labels joined by dots, no trailing dot).
    pub name: String,
    /// Record type asked for.
    pub qtype: u16,
    /// The asker prefers a unicast answer (the QU bit).
    pub unicast: bool,
}

/// The data of a record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RData {
    /// IPv4 address.
    A(Ipv4Addr),
    /// IPv6 address.
    Aaaa(Ipv6Addr),
    /// A name (DNS-SD: a service instance of a service type).
    Ptr(String),
    /// Service location.
    Srv {
        /// Priority.
        priority: u16,
        /// Weight.
        weight: u16,
        /// Port.
        port: u16,
        /// Host name.
        target: String,
    },
    /// Text strings (DNS-SD: `key=value` pairs).
    Txt(Vec<Vec<u8>>),
    /// Another type, kept as bytes.
    Other(u16, Vec<u8>),
}

impl RData {
    /// The record type.
    pub fn rtype(&self) -> u16 {
        match self {
            RData::A(_) => rtype::A,
            RData::Aaaa(_) => rtype::AAAA,
            RData::Ptr(_) => rtype::PTR,
            RData::Srv { .. } => rtype::SRV,
            RData::Txt(_) => rtype::TXT,
            RData::Other(t, _) => *t,
        }
    }
}

/// A resource record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Owner name.
    pub name: String,
    /// Seconds it may be cached (0: goodbye, forget it).
    pub ttl: u32,
    /// The cache-flush bit: this record replaces cached ones of its name and type.
    pub cache_flush: bool,
    /// Its data.
    pub data: RData,
}

/// A DNS message.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Message {
    /// Message ID (0 in multicast mDNS; a legacy unicast answer echoes the query's).
    pub id: u16,
    /// A response (else a query).
    pub response: bool,
    /// Questions.
    pub questions: Vec<Question>,
    /// Answers.
    pub answers: Vec<Record>,
    /// Authority records (a probe's proposed records).
    pub authority: Vec<Record>,
    /// Additional records.
    pub additional: Vec<Record>,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], WireError> {
        let end = self.pos.checked_add(n).ok_or(WireError::Truncated)?;
        let s = self.buf.get(self.pos..end).ok_or(WireError::Truncated)?;
        self.pos = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, WireError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A possibly compressed name at the current position.
    fn name(&mut self) -> Result<String, WireError> {
        let mut labels: Vec<String> = Vec::new();
        let mut pos = self.pos;
        let mut jumped = false;
        let mut wire_len = 0usize;
        loop {
            let len = *self.buf.get(pos).ok_or(WireError::Truncated)? as usize;
            match len & 0xC0 {
                0x00 if len == 0 => {
                    if !jumped {
                        self.pos = pos + 1;
                    }
                    return Ok(labels.join("."));
                }
                0x00 => {
                    let label = self
                        .buf
                        .get(pos + 1..pos + 1 + len)
                        .ok_or(WireError::Truncated)?;
                    wire_len += len + 1;
                    if wire_len > MAX_NAME {
                        return Err(WireError::BadName);
                    }
                    labels.push(String::from_utf8_lossy(label).into_owned());
                    pos += 1 + len;
                }
                0xC0 => {
                    let lo = *self.buf.get(pos + 1).ok_or(WireError::Truncated)? as usize;
                    let target = ((len & 0x3F) << 8) | lo;
                    // Backwards only: every jump lands before the last, so jumps end.
                    if target >= pos {
                        return Err(WireError::BadName);
                    }
                    if !jumped {
                        self.pos = pos + 2;
                        jumped = true;
                    }
                    pos = target;
                }
                _ => return Err(WireError::BadName),
            }
        }
    }

    fn question(&mut self) -> Result<Question, WireError> {
        let name = self.name()?;
        let qtype = self.u16()?;
        let class = self.u16()?;
        Ok(Question {
            name,
            qtype,
            unicast: class & UNICAST_RESPONSE != 0,
        })
    }

    fn record(&mut self) -> Result<Record, WireError> {
        let name = self.name()?;
        let rtype = self.u16()?;
        let class = self.u16()?;
        let ttl = self.u32()?;
        let len = self.u16()? as usize;
        let start = self.pos;
        let end = start.checked_add(len).ok_or(WireError::Truncated)?;
        if end > self.buf.len() {
            return Err(WireError::Truncated);
        }
        let data = match rtype {
            rtype::A => {
                let b: [u8; 4] = self
                    .take(len)?
                    .try_into()
                    .map_err(|_| WireError::BadRecord)?;
                RData::A(Ipv4Addr::from(b))
            }
            rtype::AAAA => {
                let b: [u8; 16] = self
                    .take(len)?
                    .try_into()
                    .map_err(|_| WireError::BadRecord)?;
                RData::Aaaa(Ipv6Addr::from(b))
            }
            rtype::PTR => RData::Ptr(self.name()?),
            rtype::SRV => RData::Srv {
                priority: self.u16()?,
                weight: self.u16()?,
                port: self.u16()?,
                target: self.name()?,
            },
            rtype::TXT => {
                let mut strings = Vec::new();
                while self.pos < end {
                    let n = self.u8()? as usize;
                    strings.push(self.take(n)?.to_vec());
                }
                RData::Txt(strings)
            }
            other => RData::Other(other, self.take(len)?.to_vec()),
        };
        if self.pos != end {
            return Err(WireError::BadRecord);
        }
        Ok(Record {
            name,
            ttl,
            cache_flush: class & CACHE_FLUSH != 0,
            data,
        })
    }
}

fn put_name(out: &mut Vec<u8>, name: &str) {
    for label in name.split('.').filter(|l| !l.is_empty()) {
        let b = &label.as_bytes()[..label.len().min(63)];
        out.push(b.len() as u8);
        out.extend_from_slice(b);
    }
    out.push(0);
}

fn put_record(out: &mut Vec<u8>, r: &Record) {
    put_name(out, &r.name);
    out.extend_from_slice(&r.data.rtype().to_be_bytes());
    let class = CLASS_IN | if r.cache_flush { CACHE_FLUSH } else { 0 };
    out.extend_from_slice(&class.to_be_bytes());
    out.extend_from_slice(&r.ttl.to_be_bytes());
    let len_at = out.len();
    out.extend_from_slice(&[0, 0]);
    match &r.data {
        RData::A(a) => out.extend_from_slice(&a.octets()),
        RData::Aaaa(a) => out.extend_from_slice(&a.octets()),
        RData::Ptr(n) => put_name(out, n),
        RData::Srv {
            priority,
            weight,
            port,
            target,
        } => {
            for v in [priority, weight, port] {
                out.extend_from_slice(&v.to_be_bytes());
            }
            put_name(out, target);
        }
        RData::Txt(strings) => {
            for s in strings {
                let s = &s[..s.len().min(255)];
                out.push(s.len() as u8);
                out.extend_from_slice(s);
            }
            if strings.is_empty() {
                out.push(0);
            }
        }
        RData::Other(_, b) => out.extend_from_slice(b),
    }
    let len = (out.len() - len_at - 2) as u16;
    out[len_at..len_at + 2].copy_from_slice(&len.to_be_bytes());
}

impl Message {
    /// Parses a message; anything after the records is ignored.
    pub fn parse(buf: &[u8]) -> Result<Message, WireError> {
        let mut r = Reader { buf, pos: 0 };
        let id = r.u16()?;
        let flags = r.u16()?;
        let counts = [r.u16()?, r.u16()?, r.u16()?, r.u16()?];
        let mut m = Message {
            id,
            response: flags & 0x8000 != 0,
            ..Default::default()
        };
        // Each question takes at least 5 bytes and each record 11: counts that could not
        // fit the message end it as truncated before anything large is allocated.
        for _ in 0..counts[0] {
            m.questions.push(r.question()?);
        }
        for (n, list) in
            counts[1..]
                .iter()
                .zip([&mut m.answers, &mut m.authority, &mut m.additional])
        {
            for _ in 0..*n {
                list.push(r.record()?);
            }
        }
        Ok(m)
    }

    /// The message on the wire (names uncompressed).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(512);
        out.extend_from_slice(&self.id.to_be_bytes());
        // A response is authoritative (AA), as mDNS responders answer.
        let flags: u16 = if self.response { 0x8400 } else { 0 };
        out.extend_from_slice(&flags.to_be_bytes());
        for n in [
            self.questions.len(),
            self.answers.len(),
            self.authority.len(),
            self.additional.len(),
        ] {
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        for q in &self.questions {
            put_name(&mut out, &q.name);
            out.extend_from_slice(&q.qtype.to_be_bytes());
            let class = CLASS_IN | if q.unicast { UNICAST_RESPONSE } else { 0 };
            out.extend_from_slice(&class.to_be_bytes());
        }
        for r in self
            .answers
            .iter()
            .chain(&self.authority)
            .chain(&self.additional)
        {
            put_record(&mut out, r);
        }
        out
    }
}

/// The `key=value` pairs of TXT strings (keys lowercased; a string without `=` is a key
/// with an empty value).
pub fn txt_pairs(strings: &[Vec<u8>]) -> Vec<(String, String)> {
    strings
        .iter()
        .filter(|s| !s.is_empty())
        .map(|s| {
            let s = String::from_utf8_lossy(s);
            match s.split_once('=') {
                Some((k, v)) => (k.to_ascii_lowercase(), v.to_string()),
                None => (s.to_ascii_lowercase(), String::new()),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Message {
        Message {
            id: 7,
            response: true,
            questions: vec![Question {
                name: "_nvme-disc._tcp.local".into(),
                qtype: rtype::PTR,
                unicast: true,
            }],
            answers: vec![Record {
                name: "_nvme-disc._tcp.local".into(),
                ttl: 4500,
                cache_flush: false,
                data: RData::Ptr("nvmeof-host-8009._nvme-disc._tcp.local".into()),
            }],
            authority: vec![],
            additional: vec![
                Record {
                    name: "nvmeof-host-8009._nvme-disc._tcp.local".into(),
                    ttl: 120,
                    cache_flush: true,
                    data: RData::Srv {
                        priority: 0,
                        weight: 0,
                        port: 8009,
                        target: "nvmeof-host.local".into(),
                    },
                },
                Record {
                    name: "nvmeof-host-8009._nvme-disc._tcp.local".into(),
                    ttl: 4500,
                    cache_flush: true,
                    data: RData::Txt(vec![
                        b"nqn=nqn.2014-08.org.nvmexpress.discovery".to_vec(),
                        b"p=tcp".to_vec(),
                    ]),
                },
                Record {
                    name: "nvmeof-host.local".into(),
                    ttl: 120,
                    cache_flush: true,
                    data: RData::A(Ipv4Addr::new(192, 0, 2, 1)),
                },
                Record {
                    name: "nvmeof-host.local".into(),
                    ttl: 120,
                    cache_flush: true,
                    data: RData::Aaaa(Ipv6Addr::LOCALHOST),
                },
            ],
        }
    }

    #[test]
    fn a_message_encodes_and_parses_back() {
        let m = sample();
        let wire = m.encode();
        assert_eq!(Message::parse(&wire).unwrap(), m);
        // Every shorter prefix is truncated, never a panic.
        for n in 0..wire.len() {
            assert!(Message::parse(&wire[..n]).is_err(), "prefix {n}");
        }
        let txt = match &m.additional[1].data {
            RData::Txt(s) => txt_pairs(s),
            _ => unreachable!(),
        };
        assert_eq!(
            txt,
            vec![
                ("nqn".into(), "nqn.2014-08.org.nvmexpress.discovery".into()),
                ("p".into(), "tcp".into())
            ]
        );
    }

    #[test]
    fn compressed_names_are_followed_backwards_only() {
        // A query for a.local, then a PTR answer whose name points at it (offset 12).
        let mut q = vec![0, 0, 0x84, 0, 0, 1, 0, 1, 0, 0, 0, 0];
        q.extend_from_slice(b"\x01a\x05local\x00\x00\x0c\x00\x01");
        q.extend_from_slice(&[0xC0, 12, 0, 12, 0, 1, 0, 0, 0, 10, 0, 4]);
        q.extend_from_slice(&[1, b'b', 0xC0, 14]);
        let m = Message::parse(&q).unwrap();
        assert_eq!(m.answers[0].name, "a.local");
        assert_eq!(m.answers[0].data, RData::Ptr("b.local".into()));
        // A pointer to itself, or forwards: refused.
        let mut bad = vec![0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0];
        bad.extend_from_slice(&[0xC0, 12, 0, 12, 0, 1]);
        assert_eq!(Message::parse(&bad), Err(WireError::BadName));
        let mut fwd = vec![0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0];
        fwd.extend_from_slice(&[0xC0, 20, 0, 12, 0, 1, 0, 0, 0]);
        assert_eq!(Message::parse(&fwd), Err(WireError::BadName));
        // Reserved label bits, a record whose data overruns its length, huge counts.
        let mut reserved = vec![0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0];
        reserved.extend_from_slice(&[0x80, 0, 0, 12, 0, 1]);
        assert_eq!(Message::parse(&reserved), Err(WireError::BadName));
        let huge = [0, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF];
        assert_eq!(Message::parse(&huge), Err(WireError::Truncated));
        let mut a5 = vec![0, 0, 0x84, 0, 0, 0, 0, 1, 0, 0, 0, 0];
        a5.extend_from_slice(&[1, b'x', 0, 0, 1, 0, 1, 0, 0, 0, 10, 0, 5, 1, 2, 3, 4, 5]);
        assert_eq!(Message::parse(&a5), Err(WireError::BadRecord));
    }

    proptest! {
        #[test]
        fn any_bytes_parse_or_fail_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = Message::parse(&bytes);
        }

        #[test]
        fn a_mutated_message_parses_or_fails_without_panicking(
            at in 0usize..400, byte in any::<u8>()
        ) {
            let mut wire = sample().encode();
            let n = wire.len();
            wire[at % n] = byte;
            let _ = Message::parse(&wire);
        }
    }
}
