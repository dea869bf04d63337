//! An iSCSI session over one TCP connection, on tokio.
//!
//! [`Session::connect`] opens the connection and logs in ([`crate::login`]); then any number
//! of tasks issue commands concurrently ([`Session::read`], [`Session::write`],
//! [`Session::command`]). A reader task owns the receiving half: it places Data-In straight
//! into the command's buffer, answers R2Ts with Data-Out and the target's pings with NOP-Out,
//! and completes each command with its SCSI Response (or a Data-In with status). Senders
//! share the sending half behind an async mutex, which also orders CmdSN on the wire; a
//! command waits while the target's command window (MaxCmdSN) is closed.
//!
//! Nothing waits forever: connect and login have a deadline, every command has one, and a
//! command that misses it ends the session (error recovery level 0: the connection is
//! dropped and every command in flight fails with the reason), as does a protocol error or a
//! dropped connection.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Notify, oneshot};
use tokio::task::AbortHandle;

use crate::login::{Login, LoginError, LoginParams, LoginStep, Negotiated};
use crate::pdu::{
    BHS_LEN, Bhs, DataDir, PduError, RESERVED_TAG, TargetPdu, encode_lun, flags, padded, sn_le,
};
use crate::scsi::{self, Capacity, Sense};

/// Errors of a session and its commands.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The TCP connection could not be opened.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// `HOST:PORT`.
        addr: String,
        /// The cause.
        source: std::io::Error,
    },
    /// Login failed.
    #[error("{addr}: {source}")]
    Login {
        /// `HOST:PORT`.
        addr: String,
        /// The cause.
        source: LoginError,
    },
    /// Something did not happen in time.
    #[error("{what} timed out after {secs} s")]
    Timeout {
        /// What was waited for.
        what: String,
        /// The deadline in seconds.
        secs: u64,
    },
    /// The connection is gone; every command in flight fails with this.
    #[error("connection to {addr} lost: {reason}")]
    ConnectionLost {
        /// `HOST:PORT`.
        addr: String,
        /// Why.
        reason: String,
    },
    /// The logical unit does not exist.
    #[error("LUN {lun} does not exist on target {target}")]
    NoSuchLun {
        /// The LUN.
        lun: u16,
        /// The target name.
        target: String,
    },
    /// The command ended with a SCSI status other than GOOD.
    #[error("SCSI status {} ({status:#04x}){}", scsi::status_name(*status), match sense {
        Some(s) => format!(": {s}"),
        None => String::new(),
    })]
    Scsi {
        /// The status byte.
        status: u8,
        /// Decoded sense data, when the target sent any.
        sense: Option<Sense>,
    },
    /// The target could not complete the command (iSCSI Response not "completed at target").
    #[error("target failure (iSCSI response {0:#04x})")]
    TargetFailure(u8),
    /// The target rejected the command's PDU.
    #[error("the target rejected the command (reason {0:#04x})")]
    Rejected(u8),
    /// The command moved fewer bytes than asked.
    #[error("short transfer: {got} of {want} bytes")]
    Short {
        /// Bytes moved.
        got: usize,
        /// Bytes asked for.
        want: usize,
    },
    /// A bad argument (buffer length, LBA range).
    #[error("{0}")]
    Invalid(String),
}

/// How to reach and log in to a target.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// `HOST:PORT` of the portal.
    pub addr: String,
    /// InitiatorName (an IQN).
    pub initiator_name: String,
    /// TargetName (an IQN).
    pub target_name: String,
    /// The largest data segment this initiator receives.
    pub max_recv_data_segment_length: u32,
    /// FirstBurstLength to offer.
    pub first_burst_length: u32,
    /// MaxBurstLength to offer.
    pub max_burst_length: u32,
    /// Deadline of connect plus login.
    pub login_timeout: Duration,
    /// Deadline of each command.
    pub command_timeout: Duration,
}

/// The InitiatorName used unless told otherwise.
pub const DEFAULT_INITIATOR_NAME: &str = "iqn.2026-11.io.nvmeof-direct:initiator";

impl SessionConfig {
    /// A configuration with the "best known methods" values: 256 KiB receive segments and
    /// first burst, 1 MiB bursts, 10 s to log in, 30 s per command.
    pub fn new(addr: impl Into<String>, target_name: impl Into<String>) -> SessionConfig {
        SessionConfig {
            addr: addr.into(),
            initiator_name: DEFAULT_INITIATOR_NAME.into(),
            target_name: target_name.into(),
            max_recv_data_segment_length: 256 * 1024,
            first_burst_length: 256 * 1024,
            max_burst_length: 1 << 20,
            login_timeout: Duration::from_secs(10),
            command_timeout: Duration::from_secs(30),
        }
    }
}

/// A logical unit reached through a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lun {
    /// The LUN number.
    pub number: u16,
    /// Its size.
    pub capacity: Capacity,
}

/// The data of a command in flight.
enum Data {
    /// Where Data-In lands.
    In(Vec<u8>),
    /// What Data-Out carries (shared with the sender until it has gone).
    Out(Arc<Vec<u8>>),
    /// No data.
    None,
}

impl Data {
    fn into_vec(self) -> Vec<u8> {
        match self {
            Data::In(v) => v,
            Data::Out(a) => Arc::try_unwrap(a).unwrap_or_else(|a| (*a).clone()),
            Data::None => Vec::new(),
        }
    }
}

/// A command's result: bytes moved, and its buffer back.
type Outcome = (Result<usize, Error>, Data);

struct Pending {
    lun: [u8; 8],
    data: Data,
    expected: usize,
    received: usize,
    done: oneshot::Sender<Outcome>,
}

struct Writer {
    stream: BufWriter<OwnedWriteHalf>,
    cmd_sn: u32,
}

impl Writer {
    async fn pdu(&mut self, h: &Bhs, data: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(&h.to_bytes()).await?;
        if !data.is_empty() {
            self.stream.write_all(data).await?;
            let pad = padded(data.len()) - data.len();
            if pad > 0 {
                self.stream.write_all(&[0u8; 3][..pad]).await?;
            }
        }
        Ok(())
    }
}

struct Inner {
    addr: String,
    target_name: String,
    neg: Negotiated,
    command_timeout: Duration,
    writer: tokio::sync::Mutex<Writer>,
    pending: parking_lot::Mutex<HashMap<u32, Pending>>,
    logout: parking_lot::Mutex<Option<oneshot::Sender<u8>>>,
    next_itt: AtomicU32,
    exp_stat_sn: AtomicU32,
    max_cmd_sn: AtomicU32,
    window: Notify,
    dead: parking_lot::Mutex<Option<String>>,
    reader: parking_lot::Mutex<Option<AbortHandle>>,
}

/// An iSCSI session (see the module docs). Dropping it drops the connection.
pub struct Session {
    inner: Arc<Inner>,
}

/// Distinguishes the sessions of this process in their ISIDs.
static SESSIONS: AtomicU32 = AtomicU32::new(0);

fn isid() -> [u8; 6] {
    // Type "Random" (0b10), then the process ID and a per-process counter: distinct per
    // session, so a new login never reinstates another session of this initiator.
    let pid = std::process::id();
    let n = SESSIONS.fetch_add(1, Ordering::Relaxed);
    [
        0x80,
        (pid >> 8) as u8,
        pid as u8,
        (n >> 16) as u8,
        (n >> 8) as u8,
        n as u8,
    ]
}

/// Reads one PDU during login: its header and data segment.
async fn read_login_pdu(s: &mut TcpStream) -> Result<(Bhs, Vec<u8>), LoginError> {
    let io = |e: std::io::Error| LoginError::Protocol(format!("connection: {e}"));
    let mut hdr = [0u8; BHS_LEN];
    s.read_exact(&mut hdr).await.map_err(io)?;
    let h = Bhs::read_from(&hdr);
    const LOGIN_MAX: usize = 64 * 1024;
    if h.data_len() > LOGIN_MAX {
        return Err(LoginError::Protocol(format!(
            "login PDU with {} bytes of data",
            h.data_len()
        )));
    }
    let mut skip = vec![0u8; h.ahs_len()];
    s.read_exact(&mut skip).await.map_err(io)?;
    let mut data = vec![0u8; padded(h.data_len())];
    s.read_exact(&mut data).await.map_err(io)?;
    data.truncate(h.data_len());
    Ok((h, data))
}

async fn login(stream: &mut TcpStream, cfg: &SessionConfig) -> Result<Negotiated, LoginError> {
    let mut l = Login::new(
        LoginParams {
            initiator_name: cfg.initiator_name.clone(),
            target_name: cfg.target_name.clone(),
            isid: isid(),
            max_recv_data_segment_length: cfg.max_recv_data_segment_length,
            first_burst_length: cfg.first_burst_length,
            max_burst_length: cfg.max_burst_length,
        },
        1,
    );
    // A login takes a few round trips; a target that keeps talking is cut off.
    for _ in 0..16 {
        let (h, data) = l.request();
        let mut out = h.to_bytes().to_vec();
        out.extend_from_slice(&data);
        out.resize(BHS_LEN + padded(data.len()), 0);
        stream
            .write_all(&out)
            .await
            .map_err(|e| LoginError::Protocol(format!("connection: {e}")))?;
        let (rh, rdata) = read_login_pdu(stream).await?;
        if let LoginStep::Done(n) = l.on_response(&rh, &rdata)? {
            return Ok(n);
        }
    }
    Err(LoginError::Protocol(
        "login did not finish in 16 exchanges".into(),
    ))
}

impl Session {
    /// Connects to the portal and logs in to the target, within the login deadline.
    pub async fn connect(cfg: &SessionConfig) -> Result<Session, Error> {
        let secs = cfg.login_timeout.as_secs().max(1);
        let timeout = |what: &str| Error::Timeout {
            what: format!("{what} {}", cfg.addr),
            secs,
        };
        let mut stream = tokio::time::timeout(cfg.login_timeout, TcpStream::connect(&cfg.addr))
            .await
            .map_err(|_| timeout("connect to"))?
            .map_err(|source| Error::Connect {
                addr: cfg.addr.clone(),
                source,
            })?;
        let _ = stream.set_nodelay(true);
        let neg = tokio::time::timeout(cfg.login_timeout, login(&mut stream, cfg))
            .await
            .map_err(|_| timeout("login to"))?
            .map_err(|source| Error::Login {
                addr: cfg.addr.clone(),
                source,
            })?;
        let (rd, wr) = stream.into_split();
        let inner = Arc::new(Inner {
            addr: cfg.addr.clone(),
            target_name: cfg.target_name.clone(),
            neg,
            command_timeout: cfg.command_timeout,
            writer: tokio::sync::Mutex::new(Writer {
                stream: BufWriter::with_capacity(64 * 1024, wr),
                cmd_sn: neg.cmd_sn,
            }),
            pending: parking_lot::Mutex::new(HashMap::new()),
            logout: parking_lot::Mutex::new(None),
            next_itt: AtomicU32::new(1),
            exp_stat_sn: AtomicU32::new(neg.exp_stat_sn),
            max_cmd_sn: AtomicU32::new(neg.window.max_cmd_sn),
            window: Notify::new(),
            dead: parking_lot::Mutex::new(None),
            reader: parking_lot::Mutex::new(None),
        });
        let task = tokio::spawn(reader(
            Arc::clone(&inner),
            BufReader::with_capacity(512 * 1024, rd),
        ));
        *inner.reader.lock() = Some(task.abort_handle());
        Ok(Session { inner })
    }

    /// The parameters the login settled on.
    pub fn negotiated(&self) -> &Negotiated {
        &self.inner.neg
    }

    /// Checks that LUN `number` exists and reads its capacity (a UNIT ATTENTION, as after a
    /// target reset, is retried).
    pub async fn open_lun(&self, number: u16) -> Result<Lun, Error> {
        let mut attempts = 0;
        loop {
            let buf = vec![0u8; scsi::READ_CAPACITY16_LEN];
            let (r, buf) = self
                .command(number, scsi::read_capacity16(), DataDir::In, buf)
                .await;
            match r {
                Ok(n) => {
                    let capacity = Capacity::parse16(&buf[..n]).ok_or_else(|| {
                        Error::Invalid(format!(
                            "LUN {number}: READ CAPACITY(16) returned unusable data"
                        ))
                    })?;
                    return Ok(Lun { number, capacity });
                }
                Err(Error::Scsi { sense: Some(s), .. }) if s.no_such_lun() => {
                    return Err(Error::NoSuchLun {
                        lun: number,
                        target: self.inner.target_name.clone(),
                    });
                }
                Err(Error::Scsi { sense: Some(s), .. })
                    if s.key == scsi::SENSE_UNIT_ATTENTION && attempts < 3 =>
                {
                    attempts += 1
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn check_io(lun: &Lun, lba: u64, len: usize) -> Result<u32, Error> {
        let bs = lun.capacity.block_size as usize;
        if len == 0 || len % bs != 0 {
            return Err(Error::Invalid(format!(
                "a transfer of {len} bytes is not a whole number of {bs}-byte blocks"
            )));
        }
        let blocks = (len / bs) as u64;
        if lba
            .checked_add(blocks)
            .is_none_or(|end| end > lun.capacity.blocks)
        {
            return Err(Error::Invalid(format!(
                "blocks {lba}..+{blocks} are beyond LUN {}'s {} blocks",
                lun.number, lun.capacity.blocks
            )));
        }
        u32::try_from(blocks).map_err(|_| Error::Invalid("transfer too large".into()))
    }

    /// Reads `buf.len()` bytes at block `lba` of `lun` (READ(16)) into `buf`, and gives the
    /// buffer back.
    pub async fn read(&self, lun: &Lun, lba: u64, buf: Vec<u8>) -> (Result<(), Error>, Vec<u8>) {
        let want = buf.len();
        let blocks = match Self::check_io(lun, lba, want) {
            Ok(b) => b,
            Err(e) => return (Err(e), buf),
        };
        let (r, buf) = self
            .command(lun.number, scsi::read16(lba, blocks), DataDir::In, buf)
            .await;
        (
            r.and_then(|got| {
                if got == want {
                    Ok(())
                } else {
                    Err(Error::Short { got, want })
                }
            }),
            buf,
        )
    }

    /// Writes `buf` at block `lba` of `lun` (WRITE(16)), and gives the buffer back.
    pub async fn write(&self, lun: &Lun, lba: u64, buf: Vec<u8>) -> (Result<(), Error>, Vec<u8>) {
        let blocks = match Self::check_io(lun, lba, buf.len()) {
            Ok(b) => b,
            Err(e) => return (Err(e), buf),
        };
        let (r, buf) = self
            .command(lun.number, scsi::write16(lba, blocks), DataDir::Out, buf)
            .await;
        (r.map(|_| ()), buf)
    }

    /// Runs one SCSI command on LUN `lun`: `buf` is where Data-In lands (its length is the
    /// expected transfer) or what Data-Out carries. Returns the bytes moved and the buffer.
    pub async fn command(
        &self,
        lun: u16,
        cdb: [u8; 16],
        dir: DataDir,
        buf: Vec<u8>,
    ) -> (Result<usize, Error>, Vec<u8>) {
        let inner = &self.inner;
        let len = buf.len();
        if let Some(e) = inner.gone() {
            return (Err(e), buf);
        }
        let lun = encode_lun(lun);
        let itt = inner.itt();
        let (tx, rx) = oneshot::channel();
        let (data, out) = match dir {
            DataDir::In => (Data::In(buf), None),
            DataDir::Out => {
                let a = Arc::new(buf);
                (Data::Out(Arc::clone(&a)), Some(a))
            }
            DataDir::None => (Data::None, None),
        };
        inner.pending.lock().insert(
            itt,
            Pending {
                lun,
                data,
                expected: len,
                received: 0,
                done: tx,
            },
        );
        let sent = inner
            .send_command(itt, lun, &cdb, dir, len, out.as_deref())
            .await;
        drop(out);
        if let Err(e) = sent {
            let data = inner.pending.lock().remove(&itt).map(|p| p.data);
            return (Err(e), data.map_or_else(|| vec![0; len], Data::into_vec));
        }
        match tokio::time::timeout(inner.command_timeout, rx).await {
            Ok(Ok((r, data))) => (r, data.into_vec()),
            Ok(Err(_)) => (
                Err(inner.gone().unwrap_or_else(|| Error::ConnectionLost {
                    addr: inner.addr.clone(),
                    reason: "the command was dropped".into(),
                })),
                vec![0; len],
            ),
            Err(_) => {
                let secs = inner.command_timeout.as_secs();
                inner.fail(format!("a command took longer than {secs} s"));
                (
                    Err(Error::Timeout {
                        what: format!("SCSI command {:#04x} to {}", cdb[0], inner.addr),
                        secs,
                    }),
                    vec![0; len],
                )
            }
        }
    }

    /// Logs out (waiting a few seconds for the target's answer) and closes the connection.
    pub async fn logout(self) -> Result<(), Error> {
        let inner = &self.inner;
        if let Some(e) = inner.gone() {
            return Err(e);
        }
        let (tx, rx) = oneshot::channel();
        *inner.logout.lock() = Some(tx);
        let itt = inner.itt();
        {
            let mut w = inner.writer.lock().await;
            let h =
                Bhs::logout_request(itt, 0, w.cmd_sn, inner.exp_stat_sn.load(Ordering::Acquire));
            let r = async {
                w.pdu(&h, &[]).await?;
                w.stream.flush().await
            }
            .await;
            if let Err(e) = r {
                return Err(inner.io_error(e));
            }
        }
        let r = match tokio::time::timeout(Duration::from_secs(5), rx).await {
            Ok(Ok(0)) => Ok(()),
            Ok(Ok(code)) => Err(Error::Invalid(format!(
                "logout answered with response {code}"
            ))),
            Ok(Err(_)) => Err(inner
                .gone()
                .unwrap_or_else(|| Error::Invalid("no logout response".into()))),
            Err(_) => Err(Error::Timeout {
                what: format!("logout from {}", inner.addr),
                secs: 5,
            }),
        };
        inner.fail("logged out".into());
        r
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.inner.fail("the session was closed".into());
    }
}

impl Inner {
    fn itt(&self) -> u32 {
        loop {
            let t = self.next_itt.fetch_add(1, Ordering::Relaxed);
            if t != RESERVED_TAG && t != crate::login::LOGIN_ITT {
                return t;
            }
        }
    }

    fn gone(&self) -> Option<Error> {
        self.dead
            .lock()
            .as_ref()
            .map(|reason| Error::ConnectionLost {
                addr: self.addr.clone(),
                reason: reason.clone(),
            })
    }

    fn io_error(&self, e: std::io::Error) -> Error {
        self.fail(format!("send: {e}"));
        self.gone().unwrap_or_else(|| Error::Invalid(e.to_string()))
    }

    /// Ends the session: the reader stops and every command in flight fails with `reason`.
    fn fail(&self, reason: String) {
        {
            let mut d = self.dead.lock();
            if d.is_none() {
                *d = Some(reason);
            }
        }
        if let Some(a) = self.reader.lock().take() {
            a.abort();
        }
        let drained: Vec<Pending> = self.pending.lock().drain().map(|(_, p)| p).collect();
        for p in drained {
            let e = self
                .gone()
                .unwrap_or_else(|| Error::Invalid("closed".into()));
            let _ = p.done.send((Err(e), p.data));
        }
        self.logout.lock().take();
        self.window.notify_waiters();
    }

    /// Sends a SCSI Command with its immediate data and any unsolicited Data-Out, once the
    /// command window is open.
    async fn send_command(
        &self,
        itt: u32,
        lun: [u8; 8],
        cdb: &[u8; 16],
        dir: DataDir,
        len: usize,
        out: Option<&Vec<u8>>,
    ) -> Result<(), Error> {
        let mut w = loop {
            let wait = self.window.notified();
            tokio::pin!(wait);
            wait.as_mut().enable();
            let w = self.writer.lock().await;
            if let Some(e) = self.gone() {
                return Err(e);
            }
            if sn_le(w.cmd_sn, self.max_cmd_sn.load(Ordering::Acquire)) {
                break w;
            }
            drop(w);
            if tokio::time::timeout(self.command_timeout, wait)
                .await
                .is_err()
            {
                let secs = self.command_timeout.as_secs();
                self.fail(format!("the command window stayed closed for {secs} s"));
                return Err(Error::Timeout {
                    what: format!("a command slot on {}", self.addr),
                    secs,
                });
            }
        };
        let n = &self.neg;
        let data: &[u8] = out.map_or(&[], |v| v.as_slice());
        let unsolicited = if dir == DataDir::Out {
            len.min(n.first_burst_length as usize)
        } else {
            0
        };
        let seg = n.max_send_segment as usize;
        let immediate = if n.immediate_data {
            unsolicited.min(seg)
        } else {
            0
        };
        let data_outs = !n.initial_r2t && unsolicited > immediate;
        let cmd_sn = w.cmd_sn;
        w.cmd_sn = cmd_sn.wrapping_add(1);
        let exp = self.exp_stat_sn.load(Ordering::Acquire);
        let h = Bhs::scsi_command(
            lun, itt, cmd_sn, exp, cdb, dir, len as u32, immediate, !data_outs,
        );
        let r = async {
            w.pdu(&h, &data[..immediate]).await?;
            if data_outs {
                let mut off = immediate;
                let mut data_sn = 0;
                while off < unsolicited {
                    let n = seg.min(unsolicited - off);
                    let d = Bhs::data_out(
                        lun,
                        itt,
                        RESERVED_TAG,
                        exp,
                        data_sn,
                        off as u32,
                        n,
                        off + n == unsolicited,
                    );
                    w.pdu(&d, &data[off..off + n]).await?;
                    off += n;
                    data_sn += 1;
                }
            }
            w.stream.flush().await
        }
        .await;
        r.map_err(|e| self.io_error(e))
    }

    /// Takes the sequence numbers of a target PDU into account.
    fn saw(&self, seq: &crate::pdu::Seq, status: bool) {
        if status {
            self.exp_stat_sn
                .store(seq.stat_sn.wrapping_add(1), Ordering::Release);
        }
        // MaxCmdSN counts only when the window it gives is valid (MaxCmdSN >= ExpCmdSN - 1).
        if sn_le(seq.exp_cmd_sn.wrapping_sub(1), seq.max_cmd_sn) {
            let old = self.max_cmd_sn.load(Ordering::Acquire);
            if sn_le(old, seq.max_cmd_sn) && old != seq.max_cmd_sn {
                self.max_cmd_sn.store(seq.max_cmd_sn, Ordering::Release);
                self.window.notify_waiters();
            }
        }
    }

    fn complete(&self, itt: u32, r: Result<usize, Error>) {
        if let Some(p) = self.pending.lock().remove(&itt) {
            let _ = p.done.send((r, p.data));
        }
    }
}

/// Why the reader stopped.
enum Stop {
    Io(std::io::Error),
    Protocol(String),
}

impl From<std::io::Error> for Stop {
    fn from(e: std::io::Error) -> Self {
        Stop::Io(e)
    }
}

impl From<PduError> for Stop {
    fn from(e: PduError) -> Self {
        Stop::Protocol(e.to_string())
    }
}

async fn reader(inner: Arc<Inner>, mut rd: BufReader<OwnedReadHalf>) {
    let reason = match read_loop(&inner, &mut rd).await {
        Stop::Io(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            "the target closed the connection".to_string()
        }
        Stop::Io(e) => format!("receive: {e}"),
        Stop::Protocol(m) => format!("protocol error: {m}"),
    };
    // fail() aborts this task's handle: take it first so the cleanup below runs to the end.
    inner.reader.lock().take();
    inner.fail(reason);
}

async fn skip(rd: &mut BufReader<OwnedReadHalf>, mut n: usize) -> std::io::Result<()> {
    let mut scratch = [0u8; 512];
    while n > 0 {
        let k = n.min(scratch.len());
        rd.read_exact(&mut scratch[..k]).await?;
        n -= k;
    }
    Ok(())
}

async fn read_segment(rd: &mut BufReader<OwnedReadHalf>, len: usize) -> std::io::Result<Vec<u8>> {
    let mut v = vec![0u8; padded(len)];
    rd.read_exact(&mut v).await?;
    v.truncate(len);
    Ok(v)
}

async fn read_loop(inner: &Arc<Inner>, rd: &mut BufReader<OwnedReadHalf>) -> Stop {
    match read_pdus(inner, rd).await {
        Ok(never) => match never {},
        Err(s) => s,
    }
}

/// Receives and handles PDUs until the connection fails.
async fn read_pdus(
    inner: &Arc<Inner>,
    rd: &mut BufReader<OwnedReadHalf>,
) -> Result<std::convert::Infallible, Stop> {
    let max = inner.neg.max_recv_segment as usize;
    loop {
        let mut hdr = [0u8; BHS_LEN];
        rd.read_exact(&mut hdr).await?;
        let h = Bhs::read_from(&hdr);
        let pdu = TargetPdu::parse(&h, max)?;
        skip(rd, h.ahs_len()).await?;
        let len = h.data_len();
        match pdu {
            TargetPdu::DataIn {
                itt,
                flags: f,
                status,
                offset,
                residual,
                seq,
            } => {
                let has_status = f & flags::STATUS != 0;
                inner.saw(&seq, has_status);
                let taken = inner.pending.lock().remove(&itt);
                let Some(mut p) = taken else {
                    // A command that already ended (timed out): its data is dropped.
                    skip(rd, padded(len)).await?;
                    continue;
                };
                let Data::In(buf) = &mut p.data else {
                    return Err(Stop::Protocol(format!(
                        "Data-In for a command without read data (ITT {itt:#x})"
                    )));
                };
                let off = offset as usize;
                let Some(dst) = off.checked_add(len).and_then(|end| buf.get_mut(off..end)) else {
                    return Err(Stop::Protocol(format!(
                        "Data-In of {len} bytes at offset {off} beyond the {} byte buffer",
                        buf.len()
                    )));
                };
                rd.read_exact(dst).await?;
                skip(rd, padded(len) - len).await?;
                p.received += len;
                if has_status {
                    let r = if status != scsi::STATUS_GOOD {
                        Err(Error::Scsi {
                            status,
                            sense: None,
                        })
                    } else if f & flags::UNDERFLOW != 0 {
                        Ok(p.expected.saturating_sub(residual as usize))
                    } else {
                        Ok(p.received.min(p.expected))
                    };
                    let _ = p.done.send((r, p.data));
                } else {
                    inner.pending.lock().insert(itt, p);
                }
            }
            TargetPdu::ScsiResponse {
                itt,
                response,
                status,
                flags: f,
                residual,
                seq,
            } => {
                inner.saw(&seq, true);
                let seg = read_segment(rd, len).await?;
                let moved = {
                    let pending = inner.pending.lock();
                    pending.get(&itt).map(|p| match p.data {
                        Data::In(_) => p.received,
                        _ if f & flags::UNDERFLOW != 0 => {
                            p.expected.saturating_sub(residual as usize)
                        }
                        _ => p.expected,
                    })
                };
                let r = if response != 0 {
                    Err(Error::TargetFailure(response))
                } else if status != scsi::STATUS_GOOD {
                    Err(Error::Scsi {
                        status,
                        sense: Sense::from_segment(&seg),
                    })
                } else {
                    Ok(moved.unwrap_or(0))
                };
                inner.complete(itt, r);
            }
            TargetPdu::R2t {
                itt,
                ttt,
                offset,
                length,
                seq,
            } => {
                inner.saw(&seq, false);
                skip(rd, padded(len)).await?;
                let found = inner.pending.lock().get(&itt).and_then(|p| match &p.data {
                    Data::Out(a) => Some((Arc::clone(a), p.lun)),
                    _ => None,
                });
                let Some((data, lun)) = found else {
                    return Err(Stop::Protocol(format!(
                        "R2T for no write in flight (ITT {itt:#x})"
                    )));
                };
                let (off, n) = (offset as usize, length as usize);
                if n == 0 || off.checked_add(n).is_none_or(|end| end > data.len()) {
                    return Err(Stop::Protocol(format!(
                        "R2T for {n} bytes at offset {off} of a {} byte write",
                        data.len()
                    )));
                }
                // Sent by a task of its own: the reader never waits for the sending half,
                // so a target that stops reading while its sends to us are blocked cannot
                // stall both directions.
                let inner = Arc::clone(inner);
                tokio::spawn(async move {
                    let mut w = inner.writer.lock().await;
                    let seg = inner.neg.max_send_segment as usize;
                    let exp = inner.exp_stat_sn.load(Ordering::Acquire);
                    let r = async {
                        let mut at = off;
                        let mut data_sn = 0;
                        while at < off + n {
                            let k = seg.min(off + n - at);
                            let last = at + k == off + n;
                            let d = Bhs::data_out(lun, itt, ttt, exp, data_sn, at as u32, k, last);
                            w.pdu(&d, &data[at..at + k]).await?;
                            at += k;
                            data_sn += 1;
                        }
                        w.stream.flush().await
                    }
                    .await;
                    drop(w);
                    drop(data);
                    if let Err(e) = r {
                        inner.io_error(e);
                    }
                });
            }
            TargetPdu::NopIn { itt, ttt, seq } => {
                inner.saw(&seq, itt != RESERVED_TAG);
                let ping = read_segment(rd, len).await?;
                if ttt != RESERVED_TAG {
                    // Answered from a task of its own, as Data-Out is (see R2T).
                    let inner = Arc::clone(inner);
                    tokio::spawn(async move {
                        let mut w = inner.writer.lock().await;
                        let exp = inner.exp_stat_sn.load(Ordering::Acquire);
                        let h = Bhs::nop_out(RESERVED_TAG, ttt, w.cmd_sn, exp, ping.len());
                        let r = async {
                            w.pdu(&h, &ping).await?;
                            w.stream.flush().await
                        }
                        .await;
                        drop(w);
                        if let Err(e) = r {
                            inner.io_error(e);
                        }
                    });
                }
            }
            TargetPdu::Reject { reason, seq } => {
                inner.saw(&seq, true);
                let seg = read_segment(rd, len).await?;
                let itt = seg
                    .get(16..20)
                    .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
                match itt {
                    Some(itt) if inner.pending.lock().contains_key(&itt) => {
                        inner.complete(itt, Err(Error::Rejected(reason)));
                    }
                    _ => {
                        return Err(Stop::Protocol(format!(
                            "the target rejected a PDU (reason {reason:#04x})"
                        )));
                    }
                }
            }
            TargetPdu::AsyncMessage { event, seq } => {
                inner.saw(&seq, true);
                skip(rd, padded(len)).await?;
                match event {
                    0 | 255 => {}
                    1 => return Err(Stop::Protocol("the target asked to log out".into())),
                    2 | 3 => {
                        return Err(Stop::Protocol(
                            "the target is dropping the connection".into(),
                        ));
                    }
                    e => {
                        return Err(Stop::Protocol(format!(
                            "asynchronous event {e} is not handled"
                        )));
                    }
                }
            }
            TargetPdu::LogoutResponse { response, seq } => {
                inner.saw(&seq, true);
                skip(rd, padded(len)).await?;
                if let Some(tx) = inner.logout.lock().take() {
                    let _ = tx.send(response);
                }
            }
            TargetPdu::LoginResponse { .. } | TargetPdu::TextResponse { .. } => {
                return Err(Stop::Protocol(format!(
                    "unexpected opcode {:#04x} in full feature phase",
                    h.op()
                )));
            }
        }
    }
}
