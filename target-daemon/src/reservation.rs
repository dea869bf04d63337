//! NVMe reservations of one namespace (NVMe Base 2.0, section 8.19): registrations, the
//! reservation and its holder, and which commands each host may run.
//!
//! A pure state machine with no I/O: the I/O queues hand it the host identifier of the
//! controller that sent a Reservation Register, Acquire, Release or Report command with the
//! command's fields and data, and get a status back. Registrations belong to the 128-bit host
//! identifier, not to a controller: every controller a host opens on the subsystem shares them.
//! [`Reservations`] is the pure state machine (no locks, no files); [`Shared`] is what a
//! namespace holds: the state behind a lock, a lock-free "no reservation" fast path for I/O,
//! and Persist Through Power Loss (the state saved atomically in the target's `state_dir`).

use std::fmt::Write as _;

use nvme_spec::Status;
use nvme_spec::status::generic;

/// A 128-bit host identifier (the HOSTID of the Connect data).
pub type HostId = [u8; 16];

pub use nvme_spec::status::generic::RESERVATION_CONFLICT;

/// Reservation capabilities (RESCAP) of Identify Namespace: Persist Through Power Loss (bit 0,
/// left out without a state directory), the six reservation types (bits 1..6) and Ignore
/// Existing Key as NVMe 1.3 defines it (bit 7: IEKEY applies to Register; Acquire and Release
/// with it are refused with Invalid Field).
pub const RESCAP: u8 = 0xFF;

/// Reservation types (NVMe Base 2.0, Figure 562).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ResvType {
    /// Write Exclusive.
    WriteExclusive = 1,
    /// Exclusive Access.
    ExclusiveAccess = 2,
    /// Write Exclusive - Registrants Only.
    WriteExclusiveRegistrantsOnly = 3,
    /// Exclusive Access - Registrants Only.
    ExclusiveAccessRegistrantsOnly = 4,
    /// Write Exclusive - All Registrants.
    WriteExclusiveAllRegistrants = 5,
    /// Exclusive Access - All Registrants.
    ExclusiveAccessAllRegistrants = 6,
}

impl ResvType {
    /// Every type, in code order.
    pub const ALL: [ResvType; 6] = [
        ResvType::WriteExclusive,
        ResvType::ExclusiveAccess,
        ResvType::WriteExclusiveRegistrantsOnly,
        ResvType::ExclusiveAccessRegistrantsOnly,
        ResvType::WriteExclusiveAllRegistrants,
        ResvType::ExclusiveAccessAllRegistrants,
    ];

    /// The type with code `v` (RTYPE), if any.
    pub fn from_code(v: u8) -> Option<Self> {
        Self::ALL.get(usize::from(v).checked_sub(1)?).copied()
    }

    /// Its RTYPE code.
    pub fn code(self) -> u8 {
        self as u8
    }

    /// Whether every registrant holds the reservation.
    pub fn all_registrants(self) -> bool {
        matches!(
            self,
            ResvType::WriteExclusiveAllRegistrants | ResvType::ExclusiveAccessAllRegistrants
        )
    }

    /// Whether registrants that do not hold the reservation still have access.
    fn registrants_have_access(self) -> bool {
        !matches!(self, ResvType::WriteExclusive | ResvType::ExclusiveAccess)
    }

    /// Whether reads are restricted (Exclusive Access types).
    fn exclusive_access(self) -> bool {
        matches!(
            self,
            ResvType::ExclusiveAccess
                | ResvType::ExclusiveAccessRegistrantsOnly
                | ResvType::ExclusiveAccessAllRegistrants
        )
    }
}

/// What a command does to the medium, for the reservation check (NVMe Base 2.0, Figure 565).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Read, Compare, Verify.
    Read,
    /// Write, Write Zeroes, Write Uncorrectable, Dataset Management, Flush.
    Write,
}

/// Reservation Register action (RREGA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegisterAction {
    /// Register the new key.
    Register,
    /// Unregister.
    Unregister,
    /// Replace the key with the new one.
    Replace,
}

/// Change Persist Through Power Loss State (CPTPL).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cptpl {
    /// No change.
    Keep,
    /// Reservations are released and registrants cleared on power loss.
    Clear,
    /// Reservations and registrants persist across power loss.
    Set,
}

/// Reservation Acquire action (RACQA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcquireAction {
    /// Acquire.
    Acquire,
    /// Preempt.
    Preempt,
    /// Preempt and Abort.
    PreemptAndAbort,
}

/// Reservation Release action (RRELA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseAction {
    /// Release.
    Release,
    /// Clear.
    Clear,
}

/// One of the four reservation commands, decoded from CDW10 and its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResvCommand {
    /// Reservation Register.
    Register {
        /// The action.
        action: RegisterAction,
        /// Ignore Existing Key.
        iekey: bool,
        /// Change to the Persist Through Power Loss State.
        cptpl: Cptpl,
        /// Current reservation key.
        crkey: u64,
        /// New reservation key.
        nrkey: u64,
    },
    /// Reservation Acquire.
    Acquire {
        /// The action.
        action: AcquireAction,
        /// Ignore Existing Key.
        iekey: bool,
        /// Reservation type.
        rtype: ResvType,
        /// Current reservation key.
        crkey: u64,
        /// Preempt reservation key.
        prkey: u64,
    },
    /// Reservation Release.
    Release {
        /// The action.
        action: ReleaseAction,
        /// Ignore Existing Key.
        iekey: bool,
        /// Reservation type.
        rtype: u8,
        /// Current reservation key.
        crkey: u64,
    },
}

/// The Reservation Notification log page types (NVMe Base 2.0, Figure 294).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Notice {
    /// The host's registration was removed by another host's preempt or clear.
    RegistrationPreempted = 1,
    /// The reservation was released.
    ReservationReleased = 2,
    /// The reservation was preempted.
    ReservationPreempted = 3,
}

/// What a successful command changed, for the caller: notices owed to other hosts and
/// whether the state to persist changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Notices owed to other hosts.
    pub notices: Vec<(HostId, Notice)>,
    /// The hosts a Preempt and Abort preempted. Their commands admitted before it run to
    /// completion (commands on this target complete promptly); every later one is checked
    /// against the new state.
    pub aborted: Vec<HostId>,
    /// Whether the state changed.
    pub changed: bool,
}

/// A host identifier in hexadecimal, as logs and the state file write it.
pub fn hex(h: &HostId) -> String {
    h.iter().map(|b| format!("{b:02x}")).collect()
}

fn conflict() -> Status {
    Status::generic(RESERVATION_CONFLICT).with_dnr()
}

fn invalid_field() -> Status {
    Status::generic(generic::INVALID_FIELD).with_dnr()
}

/// Decodes CDW10 of a Reservation Register, Acquire or Release command (`opcode`) and its
/// data (16 bytes: CRKEY then NRKEY/PRKEY; 8 for Release: CRKEY).
pub fn decode(opcode: u8, cdw10: u32, data: &[u8]) -> Result<ResvCommand, Status> {
    let key = |i: usize| -> Result<u64, Status> {
        let b = data.get(i * 8..i * 8 + 8).ok_or_else(invalid_field)?;
        Ok(u64::from_le_bytes(
            b.try_into().map_err(|_| invalid_field())?,
        ))
    };
    let action = cdw10 & 0x7;
    let iekey = cdw10 & (1 << 3) != 0;
    let rtype = ((cdw10 >> 8) & 0xFF) as u8;
    match opcode {
        nvme_spec::opcode::io::RESERVATION_REGISTER => Ok(ResvCommand::Register {
            action: match action {
                0 => RegisterAction::Register,
                1 => RegisterAction::Unregister,
                2 => RegisterAction::Replace,
                _ => return Err(invalid_field()),
            },
            iekey,
            cptpl: match cdw10 >> 30 {
                0 => Cptpl::Keep,
                2 => Cptpl::Clear,
                3 => Cptpl::Set,
                _ => return Err(invalid_field()),
            },
            crkey: key(0)?,
            nrkey: key(1)?,
        }),
        nvme_spec::opcode::io::RESERVATION_ACQUIRE => Ok(ResvCommand::Acquire {
            action: match action {
                0 => AcquireAction::Acquire,
                1 => AcquireAction::Preempt,
                2 => AcquireAction::PreemptAndAbort,
                _ => return Err(invalid_field()),
            },
            iekey,
            rtype: ResvType::from_code(rtype).ok_or_else(invalid_field)?,
            crkey: key(0)?,
            prkey: key(1)?,
        }),
        nvme_spec::opcode::io::RESERVATION_RELEASE => Ok(ResvCommand::Release {
            action: match action {
                0 => ReleaseAction::Release,
                1 => ReleaseAction::Clear,
                _ => return Err(invalid_field()),
            },
            iekey,
            rtype,
            crkey: key(0)?,
        }),
        _ => Err(Status::generic(generic::INVALID_OPCODE).with_dnr()),
    }
}

/// The reservation state of one namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reservations {
    /// Registrants in registration order, with their keys.
    registrants: Vec<(HostId, u64)>,
    /// The reservation: its type and the host that acquired it (for the All Registrants
    /// types every registrant holds it; the host named is one of them).
    reservation: Option<(ResvType, HostId)>,
    /// Generation (PRGEN), counting registrations, preempts and clears.
    generation: u32,
    /// Persist Through Power Loss State.
    ptpl: bool,
}

impl Reservations {
    /// The key `host` is registered with.
    pub fn key_of(&self, host: &HostId) -> Option<u64> {
        self.registrants
            .iter()
            .find(|(h, _)| h == host)
            .map(|&(_, k)| k)
    }

    /// The reservation's type and the host that acquired it.
    pub fn reservation(&self) -> Option<(ResvType, HostId)> {
        self.reservation
    }

    /// Whether Persist Through Power Loss is on.
    pub fn ptpl(&self) -> bool {
        self.ptpl
    }

    /// The generation counter.
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// Whether `host` holds the reservation.
    pub fn holds(&self, host: &HostId) -> bool {
        match self.reservation {
            Some((t, _)) if t.all_registrants() => self.key_of(host).is_some(),
            Some((_, h)) => h == *host,
            None => false,
        }
    }

    /// Whether `host` may run a command of kind `access`: Ok, or Reservation Conflict.
    pub fn check(&self, host: &HostId, access: Access) -> Result<(), Status> {
        let Some((t, _)) = self.reservation else {
            return Ok(());
        };
        if access == Access::Read && !t.exclusive_access() {
            return Ok(());
        }
        if self.holds(host) || (t.registrants_have_access() && self.key_of(host).is_some()) {
            return Ok(());
        }
        Err(conflict())
    }

    /// Runs a Register, Acquire or Release command of `host`.
    pub fn apply(&mut self, host: &HostId, cmd: ResvCommand) -> Result<Outcome, Status> {
        match cmd {
            ResvCommand::Register {
                action,
                iekey,
                cptpl,
                crkey,
                nrkey,
            } => self.register(host, action, iekey, cptpl, crkey, nrkey),
            ResvCommand::Acquire {
                action,
                iekey,
                rtype,
                crkey,
                prkey,
            } => self.acquire(host, action, iekey, rtype, crkey, prkey),
            ResvCommand::Release {
                action,
                iekey,
                rtype,
                crkey,
            } => self.release(host, action, iekey, rtype, crkey),
        }
    }

    /// The key check every command but Register makes: Reservation Conflict unless `host`
    /// is registered with `crkey` (or `iekey` says to ignore it).
    fn registered_with(&self, host: &HostId, iekey: bool, crkey: u64) -> Result<u64, Status> {
        match self.key_of(host) {
            Some(k) if iekey || k == crkey => Ok(k),
            _ => Err(conflict()),
        }
    }

    fn register(
        &mut self,
        host: &HostId,
        action: RegisterAction,
        iekey: bool,
        cptpl: Cptpl,
        crkey: u64,
        nrkey: u64,
    ) -> Result<Outcome, Status> {
        let mut out = Outcome::default();
        match action {
            RegisterAction::Register => match self.key_of(host) {
                Some(k) if k == nrkey => {}
                Some(_) => return Err(conflict()),
                None => self.registrants.push((*host, nrkey)),
            },
            RegisterAction::Unregister => {
                self.registered_with(host, iekey, crkey)?;
                self.unregister(host, &mut out);
            }
            RegisterAction::Replace => {
                self.registered_with(host, iekey, crkey)?;
                if let Some(r) = self.registrants.iter_mut().find(|(h, _)| h == host) {
                    r.1 = nrkey;
                }
            }
        }
        // Every successful Register counts, even one that changes nothing (as Linux nvmet).
        self.generation = self.generation.wrapping_add(1);
        out.changed = true;
        let ptpl = match cptpl {
            Cptpl::Keep => self.ptpl,
            Cptpl::Clear => false,
            Cptpl::Set => true,
        };
        self.ptpl = ptpl;
        Ok(out)
    }

    /// Removes `host`'s registration, releasing the reservation when it held it alone (the
    /// last registrant of an All Registrants reservation counts as alone).
    fn unregister(&mut self, host: &HostId, out: &mut Outcome) {
        let was_holder = self.holds(host);
        self.registrants.retain(|(h, _)| h != host);
        let Some((t, acquirer)) = self.reservation else {
            return;
        };
        if t.all_registrants() {
            if self.registrants.is_empty() {
                self.reservation = None;
            } else if acquirer == *host {
                self.reservation = Some((t, self.registrants[0].0));
            }
        } else if was_holder {
            self.reservation = None;
            if t.registrants_have_access() {
                self.notify_others(host, Notice::ReservationReleased, out);
            }
        }
    }

    fn notify_others(&self, host: &HostId, notice: Notice, out: &mut Outcome) {
        out.notices.extend(
            self.registrants
                .iter()
                .filter(|(h, _)| h != host)
                .map(|&(h, _)| (h, notice)),
        );
    }

    fn acquire(
        &mut self,
        host: &HostId,
        action: AcquireAction,
        iekey: bool,
        rtype: ResvType,
        crkey: u64,
        prkey: u64,
    ) -> Result<Outcome, Status> {
        // Ignore Existing Key is for Register only (as Linux nvmet answers).
        if iekey {
            return Err(invalid_field());
        }
        self.registered_with(host, false, crkey)?;
        let mut out = Outcome::default();
        if action == AcquireAction::Acquire {
            return match self.reservation {
                None => {
                    self.reservation = Some((rtype, *host));
                    out.changed = true;
                    Ok(out)
                }
                Some((t, _)) if t == rtype && self.holds(host) => Ok(out),
                Some(_) => Err(conflict()),
            };
        }
        let preempted = |s: &Self| -> Vec<HostId> {
            s.registrants
                .iter()
                .filter(|&&(h, k)| k == prkey && h != *host)
                .map(|&(h, _)| h)
                .collect()
        };
        let mut released = false;
        let mut victims = match self.reservation {
            // An All Registrants reservation with PRKEY zero: every other registrant goes and
            // this host takes a reservation of the new type.
            Some((t, _)) if t.all_registrants() && prkey == 0 => {
                let others: Vec<HostId> = self
                    .registrants
                    .iter()
                    .filter(|(h, _)| h != host)
                    .map(|&(h, _)| h)
                    .collect();
                self.reservation = Some((rtype, *host));
                others
            }
            // The holder preempting itself changes the type only.
            Some((t, holder)) if !t.all_registrants() && holder == *host => {
                self.reservation = Some((rtype, *host));
                released = t != rtype;
                Vec::new()
            }
            // The holder's key: its registrants go and this host holds the new reservation.
            Some((t, holder)) if !t.all_registrants() && self.key_of(&holder) == Some(prkey) => {
                let victims = preempted(self);
                self.reservation = Some((rtype, *host));
                released = t != rtype;
                victims
            }
            Some(_) if prkey == 0 => return Err(invalid_field()),
            // No reservation, or another key: only the registrations with that key go.
            _ => {
                let victims = preempted(self);
                if victims.is_empty() {
                    return Err(conflict());
                }
                victims
            }
        };
        victims.sort_unstable();
        victims.dedup();
        for v in &victims {
            self.unregister(v, &mut out);
            out.notices.retain(|(h, _)| h != v);
        }
        out.notices
            .extend(victims.iter().map(|&v| (v, Notice::RegistrationPreempted)));
        if released {
            self.notify_others(host, Notice::ReservationReleased, &mut out);
        }
        if action == AcquireAction::PreemptAndAbort {
            out.aborted = victims;
        }
        self.generation = self.generation.wrapping_add(1);
        out.changed = true;
        Ok(out)
    }

    fn release(
        &mut self,
        host: &HostId,
        action: ReleaseAction,
        iekey: bool,
        rtype: u8,
        crkey: u64,
    ) -> Result<Outcome, Status> {
        if iekey {
            return Err(invalid_field());
        }
        self.registered_with(host, false, crkey)?;
        let mut out = Outcome::default();
        match action {
            ReleaseAction::Release => {
                let Some((t, _)) = self.reservation else {
                    return Ok(out);
                };
                if !self.holds(host) {
                    return Ok(out);
                }
                if t.code() != rtype {
                    return Err(invalid_field());
                }
                self.reservation = None;
                if t.registrants_have_access() {
                    self.notify_others(host, Notice::ReservationReleased, &mut out);
                }
                out.changed = true;
            }
            ReleaseAction::Clear => {
                self.notify_others(host, Notice::ReservationPreempted, &mut out);
                self.registrants.clear();
                self.reservation = None;
                self.generation = self.generation.wrapping_add(1);
                out.changed = true;
            }
        }
        Ok(out)
    }

    /// The Reservation Status data structure (NVMe Base 2.0, Figures 568-571) for a host
    /// whose buffer holds `room` bytes. Fabrics hosts have 128-bit host identifiers, so only
    /// the extended structure (`eds`) is given: without it, Host Identifier Inconsistent
    /// Format, as the specification requires.
    pub fn report(&self, eds: bool, room: usize) -> Result<Vec<u8>, Status> {
        if !eds {
            return Err(Status::generic(generic::HOST_ID_INCONSISTENT).with_dnr());
        }
        if room < 64 {
            return Err(invalid_field());
        }
        let mut out = vec![0u8; 64 + 64 * self.registrants.len()];
        out[0..4].copy_from_slice(&self.generation.to_le_bytes());
        out[4] = self.reservation.map_or(0, |(t, _)| t.code());
        let regctl = u16::try_from(self.registrants.len()).unwrap_or(u16::MAX);
        out[5..7].copy_from_slice(&regctl.to_le_bytes());
        out[9] = u8::from(self.ptpl);
        for (i, (host, key)) in self.registrants.iter().enumerate() {
            let e = &mut out[64 + 64 * i..128 + 64 * i];
            // Dynamic controllers: the controller ID is FFFFh.
            e[0..2].copy_from_slice(&0xFFFFu16.to_le_bytes());
            e[2] = u8::from(self.holds(host));
            e[8..16].copy_from_slice(&key.to_le_bytes());
            e[16..32].copy_from_slice(host);
        }
        out.truncate(room);
        Ok(out)
    }

    /// The state as text to persist (one line per fact).
    pub fn encode(&self) -> String {
        let mut s = format!("nvmeof-reservations 1\ngeneration {}\n", self.generation);
        for (h, k) in &self.registrants {
            let _ = writeln!(s, "registrant {} {k:016x}", hex(h));
        }
        if let Some((t, h)) = self.reservation {
            let _ = writeln!(s, "reservation {} {}", t.code(), hex(&h));
        }
        if self.ptpl {
            s.push_str("ptpl 1\n");
        }
        s
    }

    /// Parses [`encode`](Self::encode)'s text; a line it does not know is an error.
    pub fn decode(text: &str) -> Result<Self, String> {
        let host = |s: &str| -> Result<HostId, String> {
            let mut h = [0u8; 16];
            if s.len() != 32 {
                return Err(format!("bad host identifier {s:?}"));
            }
            for (i, b) in h.iter_mut().enumerate() {
                *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16)
                    .map_err(|_| format!("bad host identifier {s:?}"))?;
            }
            Ok(h)
        };
        let mut r = Reservations::default();
        let mut lines = text.lines();
        if lines.next() != Some("nvmeof-reservations 1") {
            return Err("not a reservation state file".into());
        }
        for line in lines {
            let w: Vec<&str> = line.split_whitespace().collect();
            match w.as_slice() {
                ["generation", g] => r.generation = g.parse().map_err(|_| format!("{line:?}"))?,
                ["registrant", h, k] => r.registrants.push((
                    host(h)?,
                    u64::from_str_radix(k, 16).map_err(|_| format!("bad key in {line:?}"))?,
                )),
                ["reservation", t, h] => {
                    let t = t
                        .parse()
                        .ok()
                        .and_then(ResvType::from_code)
                        .ok_or_else(|| format!("bad type in {line:?}"))?;
                    r.reservation = Some((t, host(h)?));
                }
                ["ptpl", "1"] => r.ptpl = true,
                [] => {}
                _ => return Err(format!("unknown line {line:?}")),
            }
        }
        Ok(r)
    }
}

/// The reservations of one namespace as its I/O queues share them: the state machine behind
/// a lock, a flag read without the lock on every I/O command (set only while a reservation
/// is held, so commands of namespaces without one never take the lock), and the file that
/// keeps the state when Persist Through Power Loss is on.
#[derive(Debug, Default)]
pub struct Shared {
    state: parking_lot::Mutex<Reservations>,
    reserved: std::sync::atomic::AtomicBool,
    file: std::sync::OnceLock<Option<std::path::PathBuf>>,
}

impl Shared {
    /// Binds the namespace to its state file in `dir` (named after `nguid`), loading the
    /// state saved there; the first call wins, later ones do nothing. Without a directory,
    /// Persist Through Power Loss cannot be turned on.
    pub fn bind(&self, dir: Option<&std::path::Path>, nguid: &[u8; 16]) {
        self.file.get_or_init(|| {
            let dir = dir?;
            let path = dir.join(format!("reservations-{}", hex(nguid)));
            match std::fs::read_to_string(&path) {
                Ok(text) => match Reservations::decode(&text) {
                    Ok(r) => {
                        tracing::info!(file = %path.display(), registrants = r.registrants.len(), "reservations restored");
                        self.reserved.store(r.reservation.is_some(), std::sync::atomic::Ordering::Release);
                        *self.state.lock() = r;
                    }
                    Err(e) => tracing::warn!(file = %path.display(), error = %e, "reservation state ignored"),
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(file = %path.display(), error = %e, "reservation state unreadable"),
            }
            Some(path)
        });
    }

    /// Whether the state can persist (a state directory is configured): RESCAP's PTPL bit.
    pub fn can_persist(&self) -> bool {
        self.file.get().is_some_and(Option::is_some)
    }

    /// The check of an I/O command of `host` that does `access`: Reservation Conflict when
    /// the reservation forbids it.
    #[inline]
    pub fn check(&self, host: &HostId, access: Access) -> Result<(), Status> {
        if !self.reserved.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(());
        }
        self.state.lock().check(host, access)
    }

    /// Runs a Register, Acquire or Release command (`opcode`, `cdw10`, `data`) of `host`,
    /// saving the state when it persists.
    pub fn apply(
        &self,
        host: &HostId,
        opcode: u8,
        cdw10: u32,
        data: &[u8],
    ) -> Result<Outcome, Status> {
        let cmd = decode(opcode, cdw10, data)?;
        if let ResvCommand::Register {
            cptpl: Cptpl::Set, ..
        } = cmd
        {
            if !self.can_persist() {
                return Err(invalid_field());
            }
        }
        let mut st = self.state.lock();
        let before = st.ptpl;
        let out = st.apply(host, cmd)?;
        self.reserved.store(
            st.reservation.is_some(),
            std::sync::atomic::Ordering::Release,
        );
        if out.changed && (st.ptpl || before) {
            self.persist(&st)?;
        }
        Ok(out)
    }

    /// Set Features Reservation Persistence: turns Persist Through Power Loss on or off.
    pub fn set_ptpl(&self, on: bool) -> Result<(), Status> {
        if on && !self.can_persist() {
            return Err(invalid_field());
        }
        let mut st = self.state.lock();
        if st.ptpl == on {
            return Ok(());
        }
        st.ptpl = on;
        self.persist(&st)
    }

    fn persist(&self, st: &Reservations) -> Result<(), Status> {
        if let Some(Some(path)) = self.file.get() {
            let saved = if st.ptpl {
                save(path, &st.encode())
            } else {
                remove(path)
            };
            if let Err(e) = saved {
                tracing::warn!(file = %path.display(), error = %e, "reservation state not saved");
                return Err(Status::generic(generic::INTERNAL_ERROR));
            }
        }
        Ok(())
    }

    /// The Reservation Status data structure ([`Reservations::report`]).
    pub fn report(&self, eds: bool, room: usize) -> Result<Vec<u8>, Status> {
        self.state.lock().report(eds, room)
    }

    /// A copy of the state.
    pub fn snapshot(&self) -> Reservations {
        self.state.lock().clone()
    }
}

/// Writes `text` to `path` atomically: a temporary file beside it, synced, renamed over it,
/// and the directory synced.
fn save(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    sync_dir(path)
}

fn remove(path: &std::path::Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => sync_dir(path),
    }
}

fn sync_dir(path: &std::path::Path) -> std::io::Result<()> {
    match path.parent() {
        Some(dir) => std::fs::File::open(dir)?.sync_all(),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const A: HostId = [1; 16];
    const B: HostId = [2; 16];
    const C: HostId = [3; 16];

    fn reg(r: &mut Reservations, h: &HostId, key: u64) -> Result<Outcome, Status> {
        r.apply(
            h,
            ResvCommand::Register {
                action: RegisterAction::Register,
                iekey: false,
                cptpl: Cptpl::Keep,
                crkey: 0,
                nrkey: key,
            },
        )
    }

    fn acq(
        r: &mut Reservations,
        h: &HostId,
        action: AcquireAction,
        t: ResvType,
        crkey: u64,
        prkey: u64,
    ) -> Result<Outcome, Status> {
        r.apply(
            h,
            ResvCommand::Acquire {
                action,
                iekey: false,
                rtype: t,
                crkey,
                prkey,
            },
        )
    }

    fn is_conflict(r: Result<Outcome, Status>) -> bool {
        matches!(r, Err(s) if s.sc == RESERVATION_CONFLICT)
    }

    #[test]
    fn the_access_table_for_every_type() {
        // (type, registrant reads, registrant writes, other reads, other writes)
        let table = [
            (ResvType::WriteExclusive, true, false, true, false),
            (ResvType::ExclusiveAccess, false, false, false, false),
            (
                ResvType::WriteExclusiveRegistrantsOnly,
                true,
                true,
                true,
                false,
            ),
            (
                ResvType::ExclusiveAccessRegistrantsOnly,
                true,
                true,
                false,
                false,
            ),
            (
                ResvType::WriteExclusiveAllRegistrants,
                true,
                true,
                true,
                false,
            ),
            (
                ResvType::ExclusiveAccessAllRegistrants,
                true,
                true,
                false,
                false,
            ),
        ];
        for (t, rr, rw, or, ow) in table {
            let mut r = Reservations::default();
            reg(&mut r, &A, 1).unwrap();
            reg(&mut r, &B, 2).unwrap();
            acq(&mut r, &A, AcquireAction::Acquire, t, 1, 0).unwrap();
            assert!(r.check(&A, Access::Read).is_ok() && r.check(&A, Access::Write).is_ok());
            assert_eq!(r.check(&B, Access::Read).is_ok(), rr, "{t:?}");
            assert_eq!(r.check(&B, Access::Write).is_ok(), rw, "{t:?}");
            assert_eq!(r.check(&C, Access::Read).is_ok(), or, "{t:?}");
            assert_eq!(r.check(&C, Access::Write).is_ok(), ow, "{t:?}");
            let e = r.check(&C, Access::Write).unwrap_err();
            assert_eq!((e.sct, e.sc), (0, RESERVATION_CONFLICT));
        }
    }

    #[test]
    fn keys_are_checked_and_iekey_ignores_them() {
        let mut r = Reservations::default();
        reg(&mut r, &A, 7).unwrap();
        assert!(reg(&mut r, &A, 7).is_ok(), "the same key again succeeds");
        assert!(is_conflict(reg(&mut r, &A, 8)));
        let unreg = |iekey, crkey| ResvCommand::Register {
            action: RegisterAction::Unregister,
            iekey,
            cptpl: Cptpl::Keep,
            crkey,
            nrkey: 0,
        };
        assert!(is_conflict(r.apply(&A, unreg(false, 8))));
        assert!(is_conflict(r.apply(&B, unreg(true, 0))), "not registered");
        r.apply(&A, unreg(true, 0)).unwrap();
        assert_eq!(r.key_of(&A), None);
        // Acquire and Release refuse IEKEY.
        reg(&mut r, &A, 7).unwrap();
        let iekey_acquire = ResvCommand::Acquire {
            action: AcquireAction::Acquire,
            iekey: true,
            rtype: ResvType::WriteExclusive,
            crkey: 7,
            prkey: 0,
        };
        assert_eq!(
            r.apply(&A, iekey_acquire).unwrap_err().sc,
            generic::INVALID_FIELD
        );
        assert_eq!(r.generation(), 4);
    }

    #[test]
    fn preempt_and_abort_takes_the_reservation_and_names_the_victims() {
        let mut r = Reservations::default();
        reg(&mut r, &A, 1).unwrap();
        reg(&mut r, &B, 2).unwrap();
        acq(
            &mut r,
            &A,
            AcquireAction::Acquire,
            ResvType::ExclusiveAccess,
            1,
            0,
        )
        .unwrap();
        let out = acq(
            &mut r,
            &B,
            AcquireAction::PreemptAndAbort,
            ResvType::WriteExclusive,
            2,
            1,
        )
        .unwrap();
        assert_eq!(out.aborted, vec![A]);
        assert_eq!(out.notices, vec![(A, Notice::RegistrationPreempted)]);
        assert_eq!(r.reservation(), Some((ResvType::WriteExclusive, B)));
        assert_eq!(r.key_of(&A), None);
    }

    #[test]
    fn report_is_extended_only_and_truncated_to_the_buffer() {
        let mut r = Reservations::default();
        reg(&mut r, &A, 0x1122).unwrap();
        acq(
            &mut r,
            &A,
            AcquireAction::Acquire,
            ResvType::WriteExclusive,
            0x1122,
            0,
        )
        .unwrap();
        let e = r.report(false, 4096).unwrap_err();
        assert_eq!(e.sc, generic::HOST_ID_INCONSISTENT);
        let d = r.report(true, 4096).unwrap();
        assert_eq!(d.len(), 128);
        assert_eq!((d[4], d[5], d[64 + 2]), (1, 1, 1));
        assert_eq!(&d[64 + 8..64 + 16], &0x1122u64.to_le_bytes());
        assert_eq!(&d[64 + 16..64 + 32], &A);
        assert_eq!(r.report(true, 64).unwrap().len(), 64, "the header alone");
        assert_eq!(r.report(true, 60).unwrap_err().sc, generic::INVALID_FIELD);
    }

    #[test]
    fn the_saved_text_round_trips() {
        let mut r = Reservations::default();
        reg(&mut r, &A, 1).unwrap();
        reg(&mut r, &B, u64::MAX).unwrap();
        acq(
            &mut r,
            &B,
            AcquireAction::Acquire,
            ResvType::ExclusiveAccessAllRegistrants,
            u64::MAX,
            0,
        )
        .unwrap();
        r.ptpl = true;
        assert_eq!(Reservations::decode(&r.encode()), Ok(r));
        assert!(Reservations::decode("junk").is_err());
        assert!(Reservations::decode("nvmeof-reservations 1\nregistrant zz 1\n").is_err());
    }

    /// A simple model of the rules, written independently of the state machine: a map of
    /// keys, a holder set computed from the type.
    #[derive(Clone, Debug, Default)]
    struct Model {
        keys: std::collections::BTreeMap<u8, u64>,
        resv: Option<(u8, u8)>, // (type, acquirer)
    }

    impl Model {
        fn holder(&self, h: u8) -> bool {
            match self.resv {
                Some((t, _)) if t >= 5 => self.keys.contains_key(&h),
                Some((_, a)) => a == h,
                None => false,
            }
        }

        fn may(&self, h: u8, write: bool) -> bool {
            let Some((t, _)) = self.resv else { return true };
            let ea = t % 2 == 0;
            (!write && !ea) || self.holder(h) || (t >= 3 && self.keys.contains_key(&h))
        }

        fn drop_host(&mut self, h: u8) {
            let held_alone = self.resv.is_some_and(|(t, a)| t < 5 && a == h);
            self.keys.remove(&h);
            match self.resv {
                _ if held_alone => self.resv = None,
                Some((t, _)) if t >= 5 && self.keys.is_empty() => self.resv = None,
                Some((t, a)) if t >= 5 && a == h => {
                    self.resv = Some((t, *self.keys.keys().next().unwrap()));
                }
                _ => {}
            }
        }

        /// Ok(()) or Err(status code).
        fn step(&mut self, h: u8, op: &Op) -> Result<(), u8> {
            let keyed = |m: &Self, iekey: bool, crkey: u64| match m.keys.get(&h) {
                Some(&k) if iekey || k == crkey => Ok(()),
                _ => Err(RESERVATION_CONFLICT),
            };
            match *op {
                Op::Register(key) => match self.keys.get(&h) {
                    Some(&k) if k != key => Err(RESERVATION_CONFLICT),
                    Some(_) => Ok(()),
                    None => {
                        self.keys.insert(h, key);
                        Ok(())
                    }
                },
                Op::Unregister(iekey, crkey) => {
                    keyed(self, iekey, crkey)?;
                    self.drop_host(h);
                    Ok(())
                }
                Op::Replace(crkey, nrkey) => {
                    keyed(self, false, crkey)?;
                    self.keys.insert(h, nrkey);
                    Ok(())
                }
                Op::Acquire(t, crkey) => {
                    keyed(self, false, crkey)?;
                    match self.resv {
                        None => {
                            self.resv = Some((t, h));
                            Ok(())
                        }
                        Some((rt, _)) if rt == t && self.holder(h) => Ok(()),
                        Some(_) => Err(RESERVATION_CONFLICT),
                    }
                }
                Op::Preempt(t, crkey, prkey) => {
                    keyed(self, false, crkey)?;
                    let others = |m: &Self, all: bool| -> Vec<u8> {
                        m.keys
                            .iter()
                            .filter(|&(&o, &k)| o != h && (all || k == prkey))
                            .map(|(&o, _)| o)
                            .collect()
                    };
                    let (victims, take) = match self.resv {
                        Some((rt, _)) if rt >= 5 && prkey == 0 => (others(self, true), true),
                        Some((rt, a)) if rt < 5 && a == h => (Vec::new(), true),
                        Some((rt, a)) if rt < 5 && self.keys.get(&a) == Some(&prkey) => {
                            (others(self, false), true)
                        }
                        Some(_) if prkey == 0 => return Err(generic::INVALID_FIELD),
                        _ => {
                            let v = others(self, false);
                            if v.is_empty() {
                                return Err(RESERVATION_CONFLICT);
                            }
                            (v, false)
                        }
                    };
                    if take {
                        let keep = self.resv.is_some_and(|(rt, a)| a == h && rt == t);
                        if !keep {
                            self.resv = Some((t, h));
                        }
                    }
                    for v in victims {
                        self.drop_host(v);
                    }
                    Ok(())
                }
                Op::Release(t, crkey) => {
                    keyed(self, false, crkey)?;
                    match self.resv {
                        Some((rt, _)) if self.holder(h) => {
                            if rt != t {
                                return Err(generic::INVALID_FIELD);
                            }
                            self.resv = None;
                            Ok(())
                        }
                        _ => Ok(()),
                    }
                }
                Op::Clear(crkey) => {
                    keyed(self, false, crkey)?;
                    self.keys.clear();
                    self.resv = None;
                    Ok(())
                }
            }
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Register(u64),
        Unregister(bool, u64),
        Replace(u64, u64),
        Acquire(u8, u64),
        Preempt(u8, u64, u64),
        Release(u8, u64),
        Clear(u64),
    }

    fn command(op: &Op) -> ResvCommand {
        let t = |t: u8| ResvType::from_code(t).unwrap();
        match *op {
            Op::Register(k) => ResvCommand::Register {
                action: RegisterAction::Register,
                iekey: false,
                cptpl: Cptpl::Keep,
                crkey: 0,
                nrkey: k,
            },
            Op::Unregister(iekey, crkey) => ResvCommand::Register {
                action: RegisterAction::Unregister,
                iekey,
                cptpl: Cptpl::Keep,
                crkey,
                nrkey: 0,
            },
            Op::Replace(crkey, nrkey) => ResvCommand::Register {
                action: RegisterAction::Replace,
                iekey: false,
                cptpl: Cptpl::Keep,
                crkey,
                nrkey,
            },
            Op::Acquire(ty, crkey) => ResvCommand::Acquire {
                action: AcquireAction::Acquire,
                iekey: false,
                rtype: t(ty),
                crkey,
                prkey: 0,
            },
            Op::Preempt(ty, crkey, prkey) => ResvCommand::Acquire {
                action: AcquireAction::Preempt,
                iekey: false,
                rtype: t(ty),
                crkey,
                prkey,
            },
            Op::Release(ty, crkey) => ResvCommand::Release {
                action: ReleaseAction::Release,
                iekey: false,
                rtype: ty,
                crkey,
            },
            Op::Clear(crkey) => ResvCommand::Release {
                action: ReleaseAction::Clear,
                iekey: false,
                rtype: 0,
                crkey,
            },
        }
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few keys (0..3) so that keys collide and match often.
        let key = 0u64..3;
        let ty = 1u8..=6;
        prop_oneof![
            key.clone().prop_map(Op::Register),
            (any::<bool>(), key.clone()).prop_map(|(i, k)| Op::Unregister(i, k)),
            (key.clone(), key.clone()).prop_map(|(c, n)| Op::Replace(c, n)),
            (ty.clone(), key.clone()).prop_map(|(t, k)| Op::Acquire(t, k)),
            (ty.clone(), key.clone(), key.clone()).prop_map(|(t, c, p)| Op::Preempt(t, c, p)),
            (ty, key.clone()).prop_map(|(t, k)| Op::Release(t, k)),
            key.prop_map(Op::Clear),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn the_state_machine_follows_the_model(
            steps in proptest::collection::vec((0u8..3, op()), 1..40)
        ) {
            let host = |h: u8| [h + 1; 16];
            let mut r = Reservations::default();
            let mut m = Model::default();
            for (h, op) in &steps {
                let got = r.apply(&host(*h), command(op)).map(|_| ()).map_err(|s| s.sc);
                let want = m.step(*h, op);
                prop_assert_eq!(got, want, "{:?} by host {}", op, h);
                for o in 0u8..3 {
                    prop_assert_eq!(r.key_of(&host(o)), m.keys.get(&o).copied());
                    prop_assert_eq!(r.holds(&host(o)), m.holder(o));
                    for write in [false, true] {
                        let access = if write { Access::Write } else { Access::Read };
                        prop_assert_eq!(r.check(&host(o), access).is_ok(), m.may(o, write));
                    }
                }
                prop_assert_eq!(r.reservation().map(|(t, _)| t.code()), m.resv.map(|(t, _)| t));
                prop_assert_eq!(Reservations::decode(&r.encode()), Ok(r.clone()));
            }
        }
    }
}
