//! The login phase (RFC 7143, sections 6 and 13) as a sans-IO state machine.
//!
//! [`Login`] produces each Login Request ([`Login::request`]) and consumes each Login
//! Response ([`Login::on_response`]) until the session reaches full feature phase with the
//! negotiated parameters ([`Negotiated`]). It goes through the security stage with
//! `AuthMethod=None` (no CHAP), then the operational stage, where it offers the "best known
//! methods" settings: immediate data, no initial R2T, large bursts and receive segments, no
//! digests. Responses that continue the text (C bit) or stay in a stage (T bit clear) are
//! answered with empty requests, as section 6.2 asks.

use crate::pdu::{Bhs, Seq, Stage, TargetPdu};

/// What this initiator asks for in the operational stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoginParams {
    /// InitiatorName (an IQN).
    pub initiator_name: String,
    /// TargetName (an IQN).
    pub target_name: String,
    /// ISID: distinct per session of one initiator, or a new login reinstates the old one.
    pub isid: [u8; 6],
    /// The largest data segment this initiator receives (declared).
    pub max_recv_data_segment_length: u32,
    /// FirstBurstLength offered.
    pub first_burst_length: u32,
    /// MaxBurstLength offered.
    pub max_burst_length: u32,
}

/// The session's operational parameters after login.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Negotiated {
    /// Largest data segment the target receives: each Data-Out and immediate data segment
    /// is at most this long.
    pub max_send_segment: u32,
    /// Largest data segment this initiator receives (its own declaration).
    pub max_recv_segment: u32,
    /// FirstBurstLength: unsolicited data (immediate plus Data-Out before any R2T).
    pub first_burst_length: u32,
    /// MaxBurstLength: the largest solicited sequence.
    pub max_burst_length: u32,
    /// ImmediateData=Yes.
    pub immediate_data: bool,
    /// InitialR2T=Yes: no unsolicited Data-Out PDUs.
    pub initial_r2t: bool,
    /// TSIH the target gave the session.
    pub tsih: u16,
    /// CmdSN of the first command after login.
    pub cmd_sn: u32,
    /// ExpStatSN of the first command after login.
    pub exp_stat_sn: u32,
    /// ExpCmdSN and MaxCmdSN of the last response.
    pub window: Seq,
}

/// Why a login failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoginError {
    /// The target answered with a non-zero Status-Class.
    #[error("login refused by the target: {}", status_text(*class, *detail))]
    Refused {
        /// Status-Class.
        class: u8,
        /// Status-Detail.
        detail: u8,
    },
    /// The target asked for something this initiator does not do.
    #[error("login negotiation: {0}")]
    Negotiation(String),
    /// The target broke the login protocol.
    #[error("login protocol error: {0}")]
    Protocol(String),
}

/// Status-Class and Status-Detail of a Login Response in words (section 11.13.5).
pub fn status_text(class: u8, detail: u8) -> String {
    let what = match (class, detail) {
        (1, _) => "the target redirects to another address (not followed)",
        (2, 0x00) => "initiator error",
        (2, 0x01) => "authentication failure",
        (2, 0x02) => "authorization failure (this initiator is not allowed)",
        (2, 0x03) => "target not found (no target of that name)",
        (2, 0x04) => "target removed",
        (2, 0x05) => "unsupported version",
        (2, 0x06) => "too many connections",
        (2, 0x07) => "missing parameter",
        (2, 0x08) => "cannot include the connection in the session",
        (2, 0x09) => "session type not supported",
        (2, 0x0a) => "session does not exist",
        (2, 0x0b) => "invalid request during login",
        (3, 0x00) => "target error",
        (3, 0x01) => "service unavailable",
        (3, 0x02) => "out of resources",
        _ => "unknown status",
    };
    format!("{what} (status class {class:#04x}, detail {detail:#04x})")
}

/// Where the login stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Sending the stage's keys (none sent yet in this stage).
    Fresh(Stage),
    /// Keys sent; waiting or continuing in the stage.
    Sent(Stage),
    /// In full feature phase.
    Done,
}

/// The login state machine (see the module docs).
#[derive(Debug, Clone)]
pub struct Login {
    params: LoginParams,
    state: State,
    cmd_sn: u32,
    exp_stat_sn: u32,
    tsih: u16,
    /// Text of the current response, across PDUs with the C bit.
    partial: Vec<u8>,
    /// Keys the target declared or answered, in order.
    answers: Vec<(String, String)>,
    window: Seq,
}

/// What to do after a Login Response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoginStep {
    /// Send [`Login::request`] next.
    Send,
    /// Full feature phase: the session may carry commands.
    Done(Negotiated),
}

/// The Initiator Task Tag of every login PDU.
pub const LOGIN_ITT: u32 = 0;

impl Login {
    /// A login of a new session (TSIH 0) with `params`, starting at CmdSN `cmd_sn`.
    pub fn new(params: LoginParams, cmd_sn: u32) -> Login {
        Login {
            params,
            state: State::Fresh(Stage::Security),
            cmd_sn,
            exp_stat_sn: 0,
            tsih: 0,
            partial: Vec::new(),
            answers: Vec::new(),
            window: Seq::default(),
        }
    }

    /// The keys this initiator sends in `stage`.
    fn keys(&self, stage: Stage) -> Vec<(&'static str, String)> {
        let p = &self.params;
        match stage {
            Stage::Security => vec![
                ("InitiatorName", p.initiator_name.clone()),
                ("SessionType", "Normal".into()),
                ("TargetName", p.target_name.clone()),
                ("AuthMethod", "None".into()),
            ],
            Stage::Operational => vec![
                ("HeaderDigest", "None".into()),
                ("DataDigest", "None".into()),
                ("MaxConnections", "1".into()),
                ("InitialR2T", "No".into()),
                ("ImmediateData", "Yes".into()),
                (
                    "MaxRecvDataSegmentLength",
                    p.max_recv_data_segment_length.to_string(),
                ),
                ("MaxBurstLength", p.max_burst_length.to_string()),
                ("FirstBurstLength", p.first_burst_length.to_string()),
                ("DefaultTime2Wait", "0".into()),
                ("DefaultTime2Retain", "0".into()),
                ("MaxOutstandingR2T", "1".into()),
                ("DataPDUInOrder", "Yes".into()),
                ("DataSequenceInOrder", "Yes".into()),
                ("ErrorRecoveryLevel", "0".into()),
            ],
            Stage::FullFeature => Vec::new(),
        }
    }

    /// The next Login Request: its header and data segment (unpadded).
    pub fn request(&mut self) -> (Bhs, Vec<u8>) {
        let (stage, data) = match self.state {
            State::Fresh(stage) => {
                self.state = State::Sent(stage);
                (stage, encode_text(&self.keys(stage)))
            }
            State::Sent(stage) => (stage, Vec::new()),
            State::Done => (Stage::FullFeature, Vec::new()),
        };
        let next = match stage {
            Stage::Security => Stage::Operational,
            _ => Stage::FullFeature,
        };
        // While the target's text continues, the request must not transit (section 6.2).
        let transit = self.partial.is_empty();
        let h = Bhs::login_request(
            self.params.isid,
            self.tsih,
            LOGIN_ITT,
            0,
            self.cmd_sn,
            self.exp_stat_sn,
            stage,
            next,
            transit,
            data.len(),
        );
        (h, data)
    }

    /// Consumes a Login Response: its header and data segment.
    pub fn on_response(&mut self, h: &Bhs, data: &[u8]) -> Result<LoginStep, LoginError> {
        let pdu =
            TargetPdu::parse(h, usize::MAX).map_err(|e| LoginError::Protocol(e.to_string()))?;
        let TargetPdu::LoginResponse {
            transit,
            cont,
            csg,
            nsg,
            tsih,
            status_class,
            status_detail,
            seq,
        } = pdu
        else {
            return Err(LoginError::Protocol(format!(
                "expected a Login Response, got opcode {:#04x}",
                h.op()
            )));
        };
        if status_class != 0 {
            return Err(LoginError::Refused {
                class: status_class,
                detail: status_detail,
            });
        }
        let State::Sent(stage) = self.state else {
            return Err(LoginError::Protocol(
                "a Login Response nobody asked for".into(),
            ));
        };
        if csg != stage {
            return Err(LoginError::Protocol(format!(
                "response in stage {csg:?} to a request in stage {stage:?}"
            )));
        }
        if h.itt.get() != LOGIN_ITT {
            return Err(LoginError::Protocol(
                "Login Response with a foreign ITT".into(),
            ));
        }
        self.exp_stat_sn = seq.stat_sn.wrapping_add(1);
        self.window = seq;
        self.tsih = tsih;
        self.partial.extend_from_slice(data);
        if cont {
            if transit {
                return Err(LoginError::Protocol("both T and C set".into()));
            }
            if self.partial.len() > 64 * 1024 {
                return Err(LoginError::Protocol("login text beyond 64 KiB".into()));
            }
            return Ok(LoginStep::Send);
        }
        let text = std::mem::take(&mut self.partial);
        for (k, v) in decode_text(&text)? {
            self.check_answer(&k, &v)?;
            self.answers.push((k, v));
        }
        if !transit {
            return Ok(LoginStep::Send);
        }
        match nsg {
            Stage::FullFeature => {
                // From the security stage straight to full feature: the defaults apply.
                self.state = State::Done;
                Ok(LoginStep::Done(self.negotiated()?))
            }
            Stage::Operational if stage == Stage::Security => {
                self.state = State::Fresh(Stage::Operational);
                Ok(LoginStep::Send)
            }
            other => Err(LoginError::Protocol(format!(
                "transit from {stage:?} to {other:?}"
            ))),
        }
    }

    fn check_answer(&self, k: &str, v: &str) -> Result<(), LoginError> {
        match (k, v) {
            ("AuthMethod", m) if m != "None" => Err(LoginError::Negotiation(format!(
                "the target requires authentication ({m}); this initiator logs in without"
            ))),
            ("HeaderDigest" | "DataDigest", d) if d != "None" => Err(LoginError::Negotiation(
                format!("the target insists on {k}={d}; this initiator sends no digests"),
            )),
            ("TargetAddress", a) => Err(LoginError::Negotiation(format!(
                "the target redirects to {a} (not followed)"
            ))),
            _ => Ok(()),
        }
    }

    fn answer(&self, key: &str) -> Option<&str> {
        self.answers
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn number(&self, key: &str, offered: u32, default: u32) -> Result<u32, LoginError> {
        match self.answer(key) {
            None | Some("Irrelevant" | "NotUnderstood" | "Reject") => Ok(offered.min(default)),
            Some(v) => v
                .parse::<u32>()
                .ok()
                .filter(|n| *n >= 512 && *n <= 0xff_ffff)
                .map(|n| n.min(offered))
                .ok_or_else(|| {
                    LoginError::Negotiation(format!("{key}={v} is not in 512..=16777215"))
                }),
        }
    }

    fn boolean(
        &self,
        key: &str,
        offered: bool,
        default: bool,
        and: bool,
    ) -> Result<bool, LoginError> {
        let theirs = match self.answer(key) {
            None | Some("Irrelevant" | "NotUnderstood" | "Reject") => default,
            Some("Yes") => true,
            Some("No") => false,
            Some(v) => {
                return Err(LoginError::Negotiation(format!(
                    "{key}={v} is not Yes or No"
                )));
            }
        };
        Ok(if and {
            offered && theirs
        } else {
            offered || theirs
        })
    }

    fn negotiated(&self) -> Result<Negotiated, LoginError> {
        let p = &self.params;
        // MaxRecvDataSegmentLength is declarative: the target's value bounds what we send;
        // undeclared, it is 8192 (section 13.12).
        let max_send_segment = match self.answer("MaxRecvDataSegmentLength") {
            None => 8192,
            Some(v) => v
                .parse::<u32>()
                .ok()
                .filter(|n| (512..=0xff_ffff).contains(n))
                .ok_or_else(|| {
                    LoginError::Negotiation(format!("MaxRecvDataSegmentLength={v} is out of range"))
                })?,
        };
        let max_burst_length = self.number("MaxBurstLength", p.max_burst_length, 262_144)?;
        let first_burst_length = self
            .number("FirstBurstLength", p.first_burst_length, 65_536)?
            .min(max_burst_length);
        Ok(Negotiated {
            max_send_segment,
            max_recv_segment: p.max_recv_data_segment_length,
            first_burst_length,
            max_burst_length,
            // ImmediateData is an AND (default Yes), InitialR2T an OR (default Yes).
            immediate_data: self.boolean("ImmediateData", true, true, true)?,
            initial_r2t: self.boolean("InitialR2T", false, true, false)?,
            tsih: self.tsih,
            cmd_sn: self.cmd_sn,
            exp_stat_sn: self.exp_stat_sn,
            window: self.window,
        })
    }
}

/// `key=value\0` pairs (section 6.1).
pub fn encode_text(keys: &[(&str, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in keys {
        out.extend_from_slice(k.as_bytes());
        out.push(b'=');
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

/// Parses `key=value\0` pairs; a missing `=` or non-UTF-8 text is a protocol error.
pub fn decode_text(data: &[u8]) -> Result<Vec<(String, String)>, LoginError> {
    let mut out = Vec::new();
    for item in data.split(|&b| b == 0).filter(|s| !s.is_empty()) {
        let s = std::str::from_utf8(item)
            .map_err(|_| LoginError::Protocol("login text is not UTF-8".into()))?;
        let (k, v) = s
            .split_once('=')
            .ok_or_else(|| LoginError::Protocol(format!("login text item {s:?} has no '='")))?;
        out.push((k.to_string(), v.to_string()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pdu::BHS_LEN;

    fn params() -> LoginParams {
        LoginParams {
            initiator_name: "iqn.2026-11.io.example:host".into(),
            target_name: "iqn.2026-11.io.example:disk".into(),
            isid: [0x80, 0, 0, 0, 0, 1],
            max_recv_data_segment_length: 262_144,
            first_burst_length: 262_144,
            max_burst_length: 1 << 20,
        }
    }

    /// A Login Response header.
    fn response(transit: bool, cont: bool, csg: u8, nsg: u8, class: u8, stat_sn: u32) -> Bhs {
        let mut b = [0u8; BHS_LEN];
        b[0] = 0x23;
        b[1] = (u8::from(transit) << 7) | (u8::from(cont) << 6) | (csg << 2) | nsg;
        b[14..16].copy_from_slice(&9u16.to_be_bytes());
        b[24..28].copy_from_slice(&stat_sn.to_be_bytes());
        b[28..32].copy_from_slice(&1u32.to_be_bytes());
        b[32..36].copy_from_slice(&64u32.to_be_bytes());
        b[36] = class;
        b[37] = if class == 0 { 0 } else { 3 };
        Bhs::read_from(&b)
    }

    fn text(keys: &[(&str, &str)]) -> Vec<u8> {
        encode_text(
            &keys
                .iter()
                .map(|(k, v)| (*k, v.to_string()))
                .collect::<Vec<_>>(),
        )
    }

    #[test]
    fn security_then_operational_then_full_feature() {
        let mut l = Login::new(params(), 1);
        let (h, data) = l.request();
        assert_eq!(h.flags, 0x81, "CSG security, NSG operational, T");
        let keys = decode_text(&data).unwrap();
        assert!(keys.contains(&("AuthMethod".into(), "None".into())));
        assert!(keys.contains(&("TargetName".into(), "iqn.2026-11.io.example:disk".into())));
        let step = l
            .on_response(
                &response(true, false, 0, 1, 0, 7),
                &text(&[("AuthMethod", "None")]),
            )
            .unwrap();
        assert_eq!(step, LoginStep::Send);
        let (h, data) = l.request();
        assert_eq!(h.flags, 0x87);
        assert_eq!(h.word28.get(), 8, "ExpStatSN follows the response's StatSN");
        assert_eq!(&h.lun[6..8], &9u16.to_be_bytes(), "TSIH echoed");
        let keys = decode_text(&data).unwrap();
        assert!(keys.contains(&("ImmediateData".into(), "Yes".into())));
        assert!(keys.contains(&("InitialR2T".into(), "No".into())));
        let answer = text(&[
            ("HeaderDigest", "None"),
            ("DataDigest", "None"),
            ("InitialR2T", "No"),
            ("ImmediateData", "Yes"),
            ("MaxRecvDataSegmentLength", "65536"),
            ("MaxBurstLength", "262144"),
            ("FirstBurstLength", "524288"),
        ]);
        let LoginStep::Done(n) = l
            .on_response(&response(true, false, 1, 3, 0, 8), &answer)
            .unwrap()
        else {
            panic!("not done");
        };
        assert_eq!(n.max_send_segment, 65_536);
        assert_eq!(n.max_burst_length, 262_144);
        assert_eq!(
            n.first_burst_length, 262_144,
            "min of offer and answer, at most the burst"
        );
        assert!(n.immediate_data && !n.initial_r2t);
        assert_eq!((n.tsih, n.exp_stat_sn, n.window.max_cmd_sn), (9, 9, 64));
    }

    #[test]
    fn defaults_apply_when_the_target_declares_little() {
        let mut l = Login::new(params(), 1);
        l.request();
        l.on_response(&response(true, false, 0, 1, 0, 0), &[])
            .unwrap();
        l.request();
        let answer = text(&[("InitialR2T", "Yes"), ("ImmediateData", "No")]);
        let LoginStep::Done(n) = l
            .on_response(&response(true, false, 1, 3, 0, 1), &answer)
            .unwrap()
        else {
            panic!("not done");
        };
        assert_eq!(n.max_send_segment, 8192);
        assert_eq!(n.first_burst_length, 65_536);
        assert!(!n.immediate_data && n.initial_r2t);
    }

    #[test]
    fn continued_text_and_staying_in_a_stage() {
        let mut l = Login::new(params(), 1);
        l.request();
        // The target splits its answer (C) and then stays in the stage (no T).
        let step = l
            .on_response(&response(false, true, 0, 0, 0, 0), b"AuthMeth")
            .unwrap();
        assert_eq!(step, LoginStep::Send);
        let (h, data) = l.request();
        assert!(data.is_empty());
        assert_eq!(h.flags & 0x80, 0, "no transit while the text continues");
        assert_eq!(
            l.on_response(&response(false, false, 0, 0, 0, 1), b"od=None\0")
                .unwrap(),
            LoginStep::Send
        );
        let (h, data) = l.request();
        assert!(data.is_empty(), "keys are sent once per stage");
        assert_eq!(h.flags, 0x81);
        l.on_response(&response(true, false, 0, 1, 0, 2), &[])
            .unwrap();
        let (_, data) = l.request();
        assert!(!data.is_empty(), "operational keys go out");
        assert!(matches!(
            l.on_response(&response(true, false, 1, 3, 0, 3), &[])
                .unwrap(),
            LoginStep::Done(_)
        ));
    }

    #[test]
    fn refusals_and_violations_are_errors() {
        let mut l = Login::new(params(), 1);
        l.request();
        let e = l
            .on_response(&response(false, false, 0, 0, 2, 0), &[])
            .unwrap_err();
        assert!(e.to_string().contains("target not found"), "{e}");
        for (data, needle) in [
            (text(&[("AuthMethod", "CHAP")]), "requires authentication"),
            (text(&[("HeaderDigest", "CRC32C")]), "digests"),
            (b"novalue\0".to_vec(), "no '='"),
            (vec![0xff, b'=', b'1', 0], "UTF-8"),
        ] {
            let mut l = Login::new(params(), 1);
            l.request();
            let e = l
                .on_response(&response(true, false, 0, 1, 0, 0), &data)
                .unwrap_err();
            assert!(e.to_string().contains(needle), "{e}");
        }
        // Wrong stage, wrong opcode, a bad number, transit backwards.
        let mut l = Login::new(params(), 1);
        l.request();
        assert!(
            l.on_response(&response(true, false, 1, 3, 0, 0), &[])
                .is_err()
        );
        let mut l = Login::new(params(), 1);
        l.request();
        let mut nop = response(true, false, 0, 1, 0, 0);
        nop.opcode = 0x20;
        assert!(l.on_response(&nop, &[]).is_err());
        let mut l = Login::new(params(), 1);
        l.request();
        l.on_response(&response(true, false, 0, 1, 0, 0), &[])
            .unwrap();
        l.request();
        let bad = text(&[("MaxRecvDataSegmentLength", "12")]);
        assert!(
            l.on_response(&response(true, false, 1, 3, 0, 1), &bad)
                .is_err()
        );
        let mut l = Login::new(params(), 1);
        l.request();
        l.on_response(&response(true, false, 0, 1, 0, 0), &[])
            .unwrap();
        l.request();
        assert!(
            l.on_response(&response(true, false, 1, 0, 0, 1), &[])
                .is_err()
        );
        // A response when none is awaited.
        let mut l = Login::new(params(), 1);
        assert!(
            l.on_response(&response(true, false, 0, 1, 0, 0), &[])
                .is_err()
        );
    }
}
