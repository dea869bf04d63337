//! Limits on what one peer can make the daemon do: rate-limited logging of per-connection
//! events, token buckets for the authentication work each host NQN and each source
//! address may cause, and the bounded pool of threads that authentication work runs on
//! ([`AuthWork`]).
//!
//! Logging: every per-connection event (a Connect accepted or refused, an authentication
//! that succeeded, failed or was refused, a connection closed for an error, a TLS
//! handshake that failed) belongs to a [`LogKind`]. Of each kind at most [`LOG_BURST`]
//! lines are written per [`LOG_INTERVAL`]; the rest are counted, and once the interval is
//! over one line says how many were suppressed:
//!
//! ```text
//! WARN similar log lines suppressed event="connect refused" suppressed=5120 interval_s=10
//! ```
//!
//! The totals per kind are the metrics endpoint's `nvmeof_log_lines_suppressed_total`.
//! Use [`log_limited!`](crate::log_limited) at the call site.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tracing::warn;

use crate::config::TargetSettings;

/// The interval of the log limits.
pub const LOG_INTERVAL: Duration = Duration::from_secs(10);
/// Lines of one kind written per [`LOG_INTERVAL`]; more are counted and summed up.
pub const LOG_BURST: u64 = 20;

/// The kinds of per-connection events, each with its own log limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogKind {
    /// A controller or discovery controller connected, or disconnected in order.
    Connect,
    /// A Fabrics Connect refused (unknown subsystem, host not allowed, invalid parameter).
    ConnectRefused,
    /// A queue authenticated.
    AuthSucceeded,
    /// An authentication failed or was refused (over budget).
    AuthFailed,
    /// A connection closed for a protocol error, a transport error or a TermReq.
    ConnectionError,
    /// A TLS handshake failed or timed out.
    Tls,
    /// An NVMe/RDMA connection rejected, or a resource a connection needed was missing.
    Transport,
}

impl LogKind {
    /// Every kind, in the order of their index.
    pub const ALL: [LogKind; 7] = [
        LogKind::Connect,
        LogKind::ConnectRefused,
        LogKind::AuthSucceeded,
        LogKind::AuthFailed,
        LogKind::ConnectionError,
        LogKind::Tls,
        LogKind::Transport,
    ];

    fn index(self) -> usize {
        self as usize
    }

    /// The kind's name, as the log and the metrics label write it.
    pub fn name(self) -> &'static str {
        match self {
            LogKind::Connect => "connect",
            LogKind::ConnectRefused => "connect refused",
            LogKind::AuthSucceeded => "authenticated",
            LogKind::AuthFailed => "authentication failed",
            LogKind::ConnectionError => "connection error",
            LogKind::Tls => "tls",
            LogKind::Transport => "transport",
        }
    }
}

#[derive(Debug, Default)]
struct Window {
    start: Option<Instant>,
    logged: u64,
    suppressed: u64,
}

/// Log limits per [`LogKind`] (see the module documentation). The daemon uses one,
/// [`LOG_LIMITS`].
#[derive(Debug)]
pub struct LogLimiter {
    windows: [Mutex<Window>; LogKind::ALL.len()],
    suppressed_total: [AtomicU64; LogKind::ALL.len()],
}

impl Default for LogLimiter {
    fn default() -> Self {
        Self::new()
    }
}

/// The daemon's log limits.
pub static LOG_LIMITS: LogLimiter = LogLimiter::new();

impl LogLimiter {
    /// Limits with nothing logged yet.
    pub const fn new() -> Self {
        LogLimiter {
            windows: [const {
                parking_lot::const_mutex(Window {
                    start: None,
                    logged: 0,
                    suppressed: 0,
                })
            }; LogKind::ALL.len()],
            suppressed_total: [const { AtomicU64::new(0) }; LogKind::ALL.len()],
        }
    }

    /// Whether a line of `kind` may be written now; counts it as suppressed if not. Starting
    /// a new interval first writes the summary line of the previous one.
    pub fn allow(&self, kind: LogKind) -> bool {
        self.allow_at(kind, Instant::now())
    }

    fn allow_at(&self, kind: LogKind, now: Instant) -> bool {
        let mut w = self.windows[kind.index()].lock();
        if w.start
            .is_none_or(|s| now.saturating_duration_since(s) >= LOG_INTERVAL)
        {
            summarize(kind, &mut w);
            *w = Window {
                start: Some(now),
                logged: 0,
                suppressed: 0,
            };
        }
        if w.logged < LOG_BURST {
            w.logged += 1;
            return true;
        }
        w.suppressed += 1;
        self.suppressed_total[kind.index()].fetch_add(1, Ordering::Relaxed);
        false
    }

    /// Writes the summary line of every interval that is over (`all`: of every interval,
    /// over or not, as at shutdown).
    pub fn flush(&self, all: bool) {
        let now = Instant::now();
        for kind in LogKind::ALL {
            let mut w = self.windows[kind.index()].lock();
            let over = w
                .start
                .is_some_and(|s| now.saturating_duration_since(s) >= LOG_INTERVAL);
            if all || over {
                summarize(kind, &mut w);
            }
        }
    }

    /// Writes the due summary lines every [`LOG_INTERVAL`]; never returns.
    pub async fn report(&self) {
        let mut tick = tokio::time::interval(LOG_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.flush(false);
        }
    }

    /// Lines suppressed so far, per kind.
    pub fn suppressed(&self) -> Vec<(LogKind, u64)> {
        LogKind::ALL
            .iter()
            .map(|k| (*k, self.suppressed_total[k.index()].load(Ordering::Relaxed)))
            .collect()
    }
}

fn summarize(kind: LogKind, w: &mut Window) {
    if w.suppressed > 0 {
        warn!(
            event = kind.name(),
            suppressed = w.suppressed,
            interval_s = LOG_INTERVAL.as_secs(),
            "similar log lines suppressed"
        );
        w.suppressed = 0;
    }
}

/// Writes a log line of a [`LogKind`] within its limit:
/// `log_limited!(LogKind::Tls, warn!(%peer, "..."))`.
#[macro_export]
macro_rules! log_limited {
    ($kind:expr, $log:expr) => {
        if $crate::ratelimit::LOG_LIMITS.allow($kind) {
            $log;
        }
    };
}

/// A token bucket: `burst` tokens at most, refilled at `rate` per second.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn level(&self, rate: f64, burst: f64, now: Instant) -> f64 {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        (self.tokens + dt * rate).min(burst)
    }
}

/// Most keys a budget tracks; past that, keys whose bucket is full are forgotten (a full
/// bucket is what a new key gets anyway), and if none is, new keys are refused.
const MAX_KEYS: usize = 16384;

/// Token buckets by key, with bounded memory.
#[derive(Debug)]
struct Buckets<K> {
    map: HashMap<K, Bucket>,
}

impl<K: Hash + Eq + Clone> Buckets<K> {
    fn level(&mut self, key: &K, rate: f64, burst: f64, now: Instant) -> Option<f64> {
        if let Some(b) = self.map.get(key) {
            return Some(b.level(rate, burst, now));
        }
        if self.map.len() >= MAX_KEYS {
            self.map.retain(|_, b| b.level(rate, burst, now) < burst);
            if self.map.len() >= MAX_KEYS {
                return None;
            }
        }
        Some(burst)
    }

    fn set(&mut self, key: K, tokens: f64, now: Instant) {
        self.map.insert(key, Bucket { tokens, at: now });
    }
}

/// Which budget an authentication was refused by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OverBudget {
    /// The host NQN's.
    Host,
    /// The source address's.
    Source,
}

impl OverBudget {
    /// The reason, as the log and the metrics label write it.
    pub fn reason(self) -> &'static str {
        match self {
            OverBudget::Host => "host_over_budget",
            OverBudget::Source => "source_over_budget",
        }
    }
}

/// The budget of DH-HMAC-CHAP transactions with a Diffie-Hellman exchange (each costs two
/// modular exponentiations on the target: the Challenge's key pair and the shared secret):
/// `burst` at once and `rate` per second afterwards, per host NQN and per source address.
/// A rate of 0 means no limit.
#[derive(Debug)]
pub struct AuthBudget {
    rate: f64,
    burst: f64,
    state: Mutex<(Buckets<String>, Buckets<IpAddr>)>,
}

impl AuthBudget {
    /// A budget of `rate` transactions per second after a burst of `burst` (at least 1).
    pub fn new(rate: u32, burst: u32) -> Self {
        AuthBudget {
            rate: f64::from(rate),
            burst: f64::from(burst.max(1)),
            state: Mutex::new((
                Buckets {
                    map: HashMap::new(),
                },
                Buckets {
                    map: HashMap::new(),
                },
            )),
        }
    }

    /// Takes one transaction from `hostnqn`'s and `source`'s budgets, or neither when either
    /// is spent.
    pub fn take(&self, hostnqn: &str, source: IpAddr) -> Result<(), OverBudget> {
        self.take_at(hostnqn, source, Instant::now())
    }

    fn take_at(&self, hostnqn: &str, source: IpAddr, now: Instant) -> Result<(), OverBudget> {
        if self.rate <= 0.0 {
            return Ok(());
        }
        let (rate, burst) = (self.rate, self.burst);
        let mut st = self.state.lock();
        let (hosts, sources) = &mut *st;
        let host = hosts.level(&hostnqn.to_string(), rate, burst, now);
        let src = sources.level(&source, rate, burst, now);
        match (host, src) {
            (Some(h), _) if h < 1.0 => Err(OverBudget::Host),
            (None, _) => Err(OverBudget::Host),
            (_, Some(s)) if s < 1.0 => Err(OverBudget::Source),
            (_, None) => Err(OverBudget::Source),
            (Some(h), Some(s)) => {
                hosts.set(hostnqn.to_string(), h - 1.0, now);
                sources.set(source, s - 1.0, now);
                Ok(())
            }
        }
    }
}

/// Authentication Sends waiting for a pool thread; more are refused.
pub const AUTH_QUEUE: usize = 32;

pub(crate) type Job = Box<dyn FnOnce() + Send>;

/// The threads that run Diffie-Hellman work, started at the first job.
pub(crate) struct AuthPool {
    workers: usize,
    tx: std::sync::OnceLock<mpsc::SyncSender<Job>>,
}

impl AuthPool {
    fn sender(&self) -> &mpsc::SyncSender<Job> {
        self.tx.get_or_init(|| {
            let (tx, rx) = mpsc::sync_channel::<Job>(AUTH_QUEUE);
            let rx = Arc::new(Mutex::new(rx));
            for i in 0..self.workers {
                let rx = Arc::clone(&rx);
                let spawned = std::thread::Builder::new()
                    .name(format!("nvmeof-auth-{i}"))
                    .spawn(move || {
                        loop {
                            let job = rx.lock().recv();
                            match job {
                                Ok(job) => job(),
                                Err(_) => return,
                            }
                        }
                    });
                if let Err(e) = spawned {
                    warn!(error = %e, "cannot start an authentication thread");
                }
            }
            tx
        })
    }

    /// Queues `job`; false when the queue is full.
    pub(crate) fn try_run(&self, job: Job) -> bool {
        self.sender().try_send(job).is_ok()
    }
}

/// Where authentication's Diffie-Hellman work runs ([`AUTH_QUEUE`] jobs queued at most, on
/// one thread per four cores, at least one), and its budgets per host NQN and source address.
pub struct AuthWork {
    pub(crate) pool: AuthPool,
    /// The budgets of AUTH_Negotiates with a Diffie-Hellman exchange.
    pub budget: AuthBudget,
}

impl std::fmt::Debug for AuthWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthWork")
            .field("workers", &self.pool.workers)
            .field("budget", &self.budget)
            .finish()
    }
}

impl AuthWork {
    /// The pool and budgets for `settings` (`auth_rate`, `auth_burst`).
    pub fn new(settings: &TargetSettings) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        AuthWork {
            pool: AuthPool {
                workers: (cores / 4).max(1),
                tx: std::sync::OnceLock::new(),
            },
            budget: AuthBudget::new(settings.auth_rate, settings.auth_burst),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_limits_write_a_burst_then_count_and_sum_up() {
        let l = LogLimiter::new();
        let t0 = Instant::now();
        let kind = LogKind::ConnectRefused;
        let allowed = (0..100).filter(|_| l.allow_at(kind, t0)).count();
        assert_eq!(allowed as u64, LOG_BURST);
        assert!(l.allow_at(LogKind::Tls, t0), "kinds are apart");
        let total = |l: &LogLimiter| l.suppressed()[kind.index()].1;
        assert_eq!(total(&l), 100 - LOG_BURST);
        assert_eq!(
            l.windows[kind.index()].lock().suppressed,
            100 - LOG_BURST,
            "pending summary"
        );
        // The next interval starts with the summary and a fresh burst.
        assert!(l.allow_at(kind, t0 + LOG_INTERVAL));
        assert_eq!(l.windows[kind.index()].lock().suppressed, 0);
        assert_eq!(total(&l), 100 - LOG_BURST, "the total never goes back");
    }

    #[test]
    fn budgets_per_host_and_per_source_refill_at_their_rate() {
        let b = AuthBudget::new(2, 3);
        let (a, c): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let t0 = Instant::now();
        for _ in 0..3 {
            assert_eq!(b.take_at("nqn.h1", a, t0), Ok(()));
        }
        assert_eq!(b.take_at("nqn.h1", c, t0), Err(OverBudget::Host));
        assert_eq!(b.take_at("nqn.h2", a, t0), Err(OverBudget::Source));
        // Another host from another address is unaffected.
        assert_eq!(b.take_at("nqn.h2", c, t0), Ok(()));
        // Half a second refills one token at 2 per second.
        let t1 = t0 + Duration::from_millis(500);
        assert_eq!(b.take_at("nqn.h1", a, t1), Ok(()));
        assert_eq!(b.take_at("nqn.h1", a, t1), Err(OverBudget::Host));
        // A refusal takes nothing from the other budget.
        assert_eq!(b.take_at("nqn.h3", a, t0 + Duration::from_secs(10)), Ok(()));
        // Rate 0: no limit.
        let free = AuthBudget::new(0, 1);
        assert!((0..100).all(|_| free.take_at("nqn.h1", a, t0).is_ok()));
    }

    #[test]
    fn budgets_keep_a_bounded_number_of_keys() {
        let b = AuthBudget::new(1, 1);
        let t0 = Instant::now();
        for i in 0..MAX_KEYS as u32 {
            let ip = IpAddr::from(i.to_be_bytes());
            assert!(b.take_at(&format!("nqn.h{i}"), ip, t0).is_ok());
        }
        let ip: IpAddr = "10.9.9.9".parse().unwrap();
        assert!(b.take_at("nqn.new", ip, t0).is_err(), "full of spent keys");
        // Once the old buckets are full again they are forgotten.
        assert!(
            b.take_at("nqn.new", ip, t0 + Duration::from_secs(2))
                .is_ok()
        );
        assert!(b.state.lock().0.map.len() <= MAX_KEYS);
    }
}
