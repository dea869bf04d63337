//! Job files: what to run, in which modes, with which knobs.
//!
//! A job file is TOML with a `[global]` table of defaults and one `[[job]]` table per job.
//! The knobs carry fio's names (`rw`, `rwmixread`, `bs`, `iodepth`, `numjobs`, `runtime`,
//! `ramp_time`, `size`, `io_size`, `verify`). `rw`, `bs`, `iodepth`, `numjobs`, `queue_pairs`,
//! `targets`, `host_load`, `issue` and `ring_mode` also take a list: the job then expands into
//! one *point* per combination (a sweep), which is what latency-vs-load and scaling plots are
//! drawn from.
//!
//! ```toml
//! [global]
//! modes = ["das", "tcp"]     # das | tcp | tcp-bin | tcp=HOST:PORT | rdma | iscsi[=HOST:PORT]
//! backend = "mem:1G"         # the namespace kind, for DAS and for the target the load
//!                            # generator starts (tcp, tcp-bin); pcie:DOMAIN:BUS:DEV.FN drives
//!                            # a drive bound to vfio-pci (das and tcp share its controller)
//! runtime = "5s"
//! ramp_time = "1s"
//! verify = true
//!
//! [[job]]
//! name = "4k-randread"
//! rw = "randread"
//! bs = "4k"
//! iodepth = [1, 8, 32]       # three points
//! ```
//!
//! A job that reads prefills its region with the verify pattern first (`prefill = true`) on the
//! load generator's own storage (das, tcp, tcp-bin); a target given by address
//! (`tcp=HOST:PORT`, `rdma=HOST:PORT`, `--target`) is never written unless the job writes or
//! says `prefill = true`, and its reads are verified only after such a prefill.
//!
//! `api = "rtc"` runs a job's workers over the initiator's run-to-completion queue pairs (one
//! `QueuePair` per worker, namespace and queue the worker is given of `queue_pairs`, driven
//! by the worker) instead of the default `api = "async"` (`Namespace::read`/`write` on the
//! controller's shared queues); the das mode
//! ignores it, `dest = "gpu"` refuses it. A queue pair holds one command less than the
//! controller's queue size, and an `iodepth` above that runs at the queue pair's depth.
//! `issue = "gpu"` has GPU threads issue the reads (see [`Issue`]). `chase = true` (with `rw =
//! "randread"`) makes the reads a dependent pointer chase: each GPU thread's, or each CPU
//! worker buffer's, next LBA comes from the first word of its previous read. With `issue =
//! "cpu"` and `dest = "gpu"` that is a CPU round trip per hop: the data lands in GPU memory
//! and is copied back for the host to pick the next read. `ring_mode = "pull"` (default),
//! `"push"` or `"device"` (NVMe/RDMA only: the target writes into GPU memory) picks how a
//! GPU-issued read's data reaches its thread (see [`RingMode`]); a list
//! puts both side by side, and CPU-issued points are not repeated per mode.
//!
//! `namespaces = K` in `[global]` gives the target (and the das mode) `K` namespaces; in a job it
//! is how many of them the job reads (the first ones, at most the global `K`), so jobs of one
//! file can read fewer. `queue_pairs = Q` is the number of I/O queue pairs *per controller*. `targets = N` (default 1; a list sweeps it) starts `N`
//! instances of the target in the fabric modes that start their own (`tcp`, `tcp-bin`), standing
//! in for `N` drives: each its own listener (port), subsystem with the `K` namespaces and
//! backend instances (a `mem` backend: memory of its own). The target's reactors
//! (`target_reactors`, `0` counted as one per CPU of `target_cpus` or of the machine) are shared
//! out among the instances, at least one each, and a `target_cpus` list is split into `N`
//! contiguous parts, so the same cores serve the target whatever `N` is. The load generator
//! connects one controller per target, each with `Q` queue pairs (`N * Q` in all), and spreads
//! the reads over every namespace of every target: CPU workers take the `N * K` (target,
//! namespace) pairs in turn (prefill and verification cover all of them), and GPU-issued points
//! split their rings among the controllers, each serving a contiguous share. Results number
//! the namespaces target by target: index `t * K + k` is namespace `k` of target `t` (each entry
//! of a measurement's `namespaces` carries its `target` and `nsid`). A point runs after the
//! targets of its count are up: points are ordered target count by target count (the outermost
//! sweep), and the load generator restarts its targets, with fresh backends, when the count
//! changes. A target at an address is one target (`targets > 1` there is a job error), several
//! targets need a `mem` or `null` backend, and the das mode reads its `K` namespaces whatever
//! `targets` says.
//!
//! The `iscsi` mode starts Debian's tgt on this machine with a LUN per namespace of the
//! `backend`'s size (see [`crate::iscsi`]); `iscsi=HOST:PORT` reads the target `iqn` there,
//! LUNs from `lun` on. `queue_pairs` is the number of iSCSI sessions (one connection each),
//! `api`, `dest = "gpu"` and `issue = "gpu"` do not apply, and `targets` stays 1.
//!
//! Keys that describe the run as a whole (`modes`, `backend`, `nqn`, `hostnqn`, `iqn`, `lun`,
//! `target_reactors`, `target_poll_us`, `client_poll_us`, `sq_flow_control`, `repeat`, `target_cpus`, `client_cpus`, `load_cpus`, `description`)
//! are accepted only in `[global]`.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use blockdev::BackendSpec;
use serde::{Deserialize, Serialize};

/// The smallest block size a job may use, in bytes.
pub const MIN_BS: u64 = 512;
/// The largest block size a job may use, in bytes.
pub const MAX_BS: u64 = 1 << 20;
/// The largest queue depth per worker.
pub const MAX_IODEPTH: u32 = 4096;
/// The largest number of workers.
pub const MAX_NUMJOBS: u32 = 256;
/// The largest number of I/O queue pairs.
pub const MAX_QUEUE_PAIRS: u16 = 128;
/// The largest number of namespaces.
pub const MAX_NAMESPACES: u32 = 64;
/// The largest number of target instances a job may ask for (`targets`).
pub const MAX_TARGETS: u32 = 16;
/// The subsystem NQN of the target the load generator starts, and the one it asks a target at
/// an address for unless told otherwise: `nvmeof-targetd`'s own default, so a target started
/// with no arguments needs no `--nqn`.
pub const DEFAULT_NQN: &str = nvmeof_target::config::DEFAULT_NQN;
/// The target IQN of the iscsi modes unless the job or `--iqn` names another: the name of
/// the tgt target the load generator starts.
pub const DEFAULT_IQN: &str = "iqn.2026-11.io.nvmeof-direct:bench";
/// Seed of the verify pattern when a job names none.
pub const DEFAULT_SEED: u64 = 0x6e76_6d65_6f66_0001;
/// Measured duration when a job names neither `runtime` nor `io_size`.
pub const DEFAULT_RUNTIME: Duration = Duration::from_secs(10);

/// Errors in a job file or a command-line override.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The TOML did not parse or had an unknown key or a value of the wrong type.
    #[error("job file{}: {msg}", match (line, text) {
        (Some(l), Some(t)) => format!(", line {l} ({t})"),
        (Some(l), None) => format!(", line {l}"),
        _ => String::new(),
    })]
    Toml {
        /// The line (from 1) of the bad value, when known.
        line: Option<usize>,
        /// That line's text, trimmed.
        text: Option<String>,
        /// What is wrong, on one line.
        msg: String,
    },
    /// The file could not be read.
    #[error("cannot read job file {}: {msg}", path.display())]
    Read {
        /// The path.
        path: PathBuf,
        /// The cause.
        msg: String,
    },
    /// A value is outside its allowed range or malformed.
    #[error("{job}: {key}: {msg}")]
    Invalid {
        /// The job name (or `global`).
        job: String,
        /// The key.
        key: &'static str,
        /// What is wrong.
        msg: String,
    },
    /// The file defines no job.
    #[error("the job file defines no [[job]]")]
    NoJobs,
}

fn invalid(job: &str, key: &'static str, msg: impl Into<String>) -> JobError {
    JobError::Invalid {
        job: job.to_string(),
        key,
        msg: msg.into(),
    }
}

/// Checks that every value of `key` is in `1..=max`.
fn in_range<T: Copy + Into<u64> + fmt::Display>(
    job: &str,
    key: &'static str,
    values: &[T],
    max: T,
) -> Result<(), JobError> {
    match values
        .iter()
        .find(|&&v| v.into() == 0 || v.into() > max.into())
    {
        Some(v) => Err(invalid(job, key, format!("{v} not in 1..={max}"))),
        None => Ok(()),
    }
}

/// The I/O pattern, with fio's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Rw {
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Random reads.
    RandRead,
    /// Random writes.
    RandWrite,
    /// Random mixed reads and writes (`rwmixread` percent reads).
    RandRw,
    /// Sequential mixed reads and writes (`rwmixread` percent reads).
    #[serde(alias = "rw")]
    ReadWrite,
}

impl Rw {
    /// Whether offsets are random.
    pub fn is_random(self) -> bool {
        matches!(self, Rw::RandRead | Rw::RandWrite | Rw::RandRw)
    }

    /// Percent of I/Os that are reads, given the job's `rwmixread`.
    pub fn read_percent(self, rwmixread: u8) -> u8 {
        match self {
            Rw::Read | Rw::RandRead => 100,
            Rw::Write | Rw::RandWrite => 0,
            Rw::RandRw | Rw::ReadWrite => rwmixread.min(100),
        }
    }

    /// fio's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Rw::Read => "read",
            Rw::Write => "write",
            Rw::RandRead => "randread",
            Rw::RandWrite => "randwrite",
            Rw::RandRw => "randrw",
            Rw::ReadWrite => "readwrite",
        }
    }
}

impl fmt::Display for Rw {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Rw {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "read" => Ok(Rw::Read),
            "write" => Ok(Rw::Write),
            "randread" => Ok(Rw::RandRead),
            "randwrite" => Ok(Rw::RandWrite),
            "randrw" => Ok(Rw::RandRw),
            "readwrite" | "rw" => Ok(Rw::ReadWrite),
            _ => Err(format!(
                "unknown rw {s:?} (read, write, randread, randwrite, randrw, readwrite)"
            )),
        }
    }
}

/// Where read data goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Dest {
    /// Host memory.
    #[default]
    Host,
    /// GPU memory (GPU 0): every read lands in a device buffer through pinned staging and
    /// completes once the data is there; blocks up to 64 KiB of one worker leave for the GPU
    /// in batches (one scatter kernel each, reading the packed blocks in place, so NVRTC must
    /// be present). Reads
    /// only; without a CUDA driver each point fails with one line saying so.
    Gpu,
}

impl fmt::Display for Dest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dest::Host => "host",
            Dest::Gpu => "gpu",
        })
    }
}

/// The initiator API a fabric mode's workers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// `Namespace::read`/`write` futures on the controller's shared queues.
    #[default]
    Async,
    /// Run-to-completion `QueuePair`s driven by the worker: one per namespace and queue the
    /// worker is given of `queue_pairs` (at least one).
    Rtc,
}

/// Who issues the reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Issue {
    /// Host tasks (the workers), as for every other job.
    #[default]
    Cpu,
    /// GPU threads (GPU 0): a persistent CUDA kernel of `numjobs * iodepth` threads, each with
    /// one read in flight, issues the reads itself through GPU request rings that the I/O
    /// queues serve (`Controller::attach_gpu_rings`), checks every read on the GPU and times
    /// it with `%globaltimer`. Random reads over NVMe/TCP only; the data lands in GPU memory
    /// (`dest` does not apply). Without a CUDA driver each point fails with one line saying so.
    Gpu,
}

/// How the data of a GPU-issued read reaches the GPU thread (`ring_mode`, for `issue = "gpu"`
/// points; CPU-issued points ignore it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum RingMode {
    /// The read lands in the ring's pinned slot and the waiting warp copies it to its buffer.
    #[default]
    Pull,
    /// The queue task pushes each batch of completed slots to the GPU (one host-to-device copy
    /// and the push kernel, which also publishes the completions).
    Push,
    /// The rings' data areas are GPU memory that the target writes by RDMA (GPUDirect RDMA,
    /// `rdma=HOST:PORT` modes only); the waiting warp copies from device memory. Over NVMe/TCP
    /// such a point fails with the initiator's one-line error.
    Device,
}

impl fmt::Display for Issue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Issue::Cpu => "cpu",
            Issue::Gpu => "gpu",
        })
    }
}

/// Whether the host runs the built-in CPU and memory-bandwidth load during the measurement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum HostLoad {
    /// No extra load.
    #[default]
    Idle,
    /// `load_threads` threads copying through `load_mem` bytes of memory.
    Busy,
}

impl fmt::Display for HostLoad {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HostLoad::Idle => "idle",
            HostLoad::Busy => "busy",
        })
    }
}

/// How the `tcp` mode reaches a target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TcpTarget {
    /// Our target, started inside the load generator's process.
    InProcess,
    /// Our target binary (`nvmeof-targetd`), started as a separate process.
    Process(Option<PathBuf>),
    /// Any NVMe/TCP target already running at this address.
    Remote {
        /// `HOST:PORT`.
        addr: String,
    },
}

/// A way of reaching the storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// The backend directly, in-process, no network.
    Das,
    /// NVMe/TCP through the user-space initiator.
    Tcp(TcpTarget),
    /// NVMe/RDMA through the user-space initiator to a target at `addr` (without an address
    /// the mode is skipped, with one line saying why: no RDMA target is started in-process).
    Rdma {
        /// `HOST:PORT`, when given.
        addr: Option<String>,
    },
    /// iSCSI through the workspace's initiator (`iscsi-initiator`): to the target `iqn` at
    /// `addr`, or, without an address, to Debian's `tgt` (`tgtd`) that the load generator
    /// starts on this machine (see [`crate::iscsi`]).
    Iscsi {
        /// `HOST:PORT`, when given.
        addr: Option<String>,
    },
}

impl Mode {
    /// The short name used in reports: `das`, `tcp`, `tcp-bin`, `tcp@HOST:PORT`, `rdma`.
    pub fn label(&self) -> String {
        match self {
            Mode::Das => "das".into(),
            Mode::Tcp(TcpTarget::InProcess) => "tcp".into(),
            Mode::Tcp(TcpTarget::Process(_)) => "tcp-bin".into(),
            Mode::Tcp(TcpTarget::Remote { addr }) => format!("tcp@{addr}"),
            Mode::Rdma { addr: None } => "rdma".into(),
            Mode::Rdma { addr: Some(a) } => format!("rdma@{a}"),
            Mode::Iscsi { addr: None } => "iscsi".into(),
            Mode::Iscsi { addr: Some(a) } => format!("iscsi@{a}"),
        }
    }

    /// Whether this mode goes over a fabric.
    pub fn is_fabric(&self) -> bool {
        !matches!(self, Mode::Das)
    }

    /// Whether the storage is the load generator's own (the backend, or a target it starts),
    /// rather than a target given by address. Only its own storage is prefilled by default.
    pub fn owns_target(&self) -> bool {
        matches!(
            self,
            Mode::Das
                | Mode::Tcp(TcpTarget::InProcess | TcpTarget::Process(_))
                | Mode::Iscsi { addr: None }
        )
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

impl FromStr for Mode {
    type Err = String;

    /// `das`, `tcp`, `tcp-bin`, `tcp-bin=PATH`, `tcp=HOST:PORT`, `rdma`, `rdma=HOST:PORT`,
    /// `iscsi`, `iscsi=HOST:PORT`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, arg) = match s.split_once('=') {
            Some((k, a)) => (k.trim(), Some(a.trim())),
            None => (s.trim(), None),
        };
        let need_addr = |a: &str| -> Result<String, String> {
            match a.rsplit_once(':') {
                Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok() => Ok(a.to_string()),
                _ => Err(format!("mode {s:?}: expected HOST:PORT after '='")),
            }
        };
        match (kind, arg) {
            ("das", None) => Ok(Mode::Das),
            ("tcp", None) => Ok(Mode::Tcp(TcpTarget::InProcess)),
            ("tcp", Some(a)) => Ok(Mode::Tcp(TcpTarget::Remote {
                addr: need_addr(a)?,
            })),
            ("tcp-bin", None) => Ok(Mode::Tcp(TcpTarget::Process(None))),
            ("tcp-bin", Some(p)) if !p.is_empty() => {
                Ok(Mode::Tcp(TcpTarget::Process(Some(PathBuf::from(p)))))
            }
            ("rdma", None) => Ok(Mode::Rdma { addr: None }),
            ("rdma", Some(a)) => Ok(Mode::Rdma {
                addr: Some(need_addr(a)?),
            }),
            ("iscsi", None) => Ok(Mode::Iscsi { addr: None }),
            ("iscsi", Some(a)) => Ok(Mode::Iscsi {
                addr: Some(need_addr(a)?),
            }),
            _ => Err(format!(
                "unknown mode {s:?} (das, tcp, tcp-bin[=PATH], tcp=HOST:PORT, rdma[=HOST:PORT], \
                 iscsi[=HOST:PORT])"
            )),
        }
    }
}

/// A byte count written as a number or a string with a K/M/G suffix (powers of 1024).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bytes(pub u64);

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Bytes;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size in bytes, e.g. 4096, \"4k\" or \"1M\"")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Bytes, E> {
                Ok(Bytes(n))
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Bytes, E> {
                u64::try_from(n)
                    .map(Bytes)
                    .map_err(|_| E::custom(format!("invalid size {n}: negative")))
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Bytes, E> {
                blockdev::parse_size(s)
                    .map(Bytes)
                    .map_err(|e| E::custom(format!("invalid size {s:?}: {e}")))
            }
        }
        d.deserialize_any(V)
    }
}

/// A duration written as seconds (a number) or a string: `500ms`, `10s`, `2m`, `1h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dur(pub Duration);

/// Parses `500ms`, `10s`, `2m`, `1h`, `1.5s` or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("bad duration {s:?} (e.g. 500ms, 10s, 2m)"))?;
    let secs = match unit.trim() {
        "" | "s" | "sec" => n,
        "ms" => n / 1e3,
        "us" => n / 1e6,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("bad duration unit in {s:?} (ms, s, m, h)")),
    };
    if !secs.is_finite() || !(0.0..=1e7).contains(&secs) {
        return Err(format!("duration {s:?} out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Dur;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration, e.g. 10 (seconds), \"500ms\" or \"2m\"")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Dur, E> {
                self.visit_str(&n.to_string())
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Dur, E> {
                self.visit_str(&n.to_string())
            }
            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<Dur, E> {
                self.visit_str(&n.to_string())
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Dur, E> {
                parse_duration(s).map(Dur).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// One value or a list of values (a sweep). A bad value is reported with the value type's own
/// message (for enums: the bad value and the valid ones).
#[derive(Debug, Clone, PartialEq)]
pub enum OneOrMany<T> {
    /// A single value.
    One(T),
    /// A sweep over these values, in order.
    Many(Vec<T>),
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for OneOrMany<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::IntoDeserializer;
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for V<T> {
            type Value = OneOrMany<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a value or a list of values")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let mut v = Vec::new();
                while let Some(x) = seq.next_element()? {
                    v.push(x);
                }
                Ok(OneOrMany::Many(v))
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Self::Value, E> {
                T::deserialize(s.into_deserializer()).map(OneOrMany::One)
            }
            fn visit_string<E: serde::de::Error>(self, s: String) -> Result<Self::Value, E> {
                self.visit_str(&s)
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Self::Value, E> {
                T::deserialize(n.into_deserializer()).map(OneOrMany::One)
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Self::Value, E> {
                T::deserialize(n.into_deserializer()).map(OneOrMany::One)
            }
            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<Self::Value, E> {
                T::deserialize(n.into_deserializer()).map(OneOrMany::One)
            }
            fn visit_bool<E: serde::de::Error>(self, b: bool) -> Result<Self::Value, E> {
                T::deserialize(b.into_deserializer()).map(OneOrMany::One)
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

impl<T: Clone> OneOrMany<T> {
    fn to_vec(&self) -> Vec<T> {
        match self {
            OneOrMany::One(v) => vec![v.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

/// The keys of `[global]` and `[[job]]` tables. Every key is optional; a job's value wins over
/// the global one.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Section {
    /// Job name (jobs only).
    pub name: Option<String>,
    /// Free text describing the run or the job.
    pub description: Option<String>,
    /// Modes to run side by side (global only).
    pub modes: Option<Vec<String>>,
    /// Backend of each namespace (global only).
    pub backend: Option<BackendSpec>,
    /// Number of namespaces: in `[global]` those the target serves, in a job those it reads
    /// (the first ones, at most the global number).
    pub namespaces: Option<u32>,
    /// Subsystem NQN for `tcp=HOST:PORT` targets (global only).
    pub nqn: Option<String>,
    /// Host NQN the load generator connects with (global only).
    pub hostnqn: Option<String>,
    /// Target IQN of the iscsi modes (global only).
    pub iqn: Option<String>,
    /// First LUN the iscsi modes read (global only; the job's namespaces are this LUN and
    /// the ones after it).
    pub lun: Option<u16>,
    /// Reactor threads of the target the load generator starts (global only).
    pub target_reactors: Option<usize>,
    /// Busy-poll window of the started target's reactors, in microseconds (global only).
    pub target_poll_us: Option<u32>,
    /// Busy-poll window of the initiator's I/O queues, in microseconds (global only).
    pub client_poll_us: Option<u32>,
    /// Keep SQ flow control on at Connect instead of asking controllers to disable it, the
    /// initiator's default (global only).
    pub sq_flow_control: Option<bool>,
    /// Repeats of the whole run, for medians and spread (global only).
    pub repeat: Option<u32>,
    /// CPU list for the target's reactor threads or process, `taskset` syntax (global only).
    pub target_cpus: Option<String>,
    /// CPU list for the load generator's client threads (global only).
    pub client_cpus: Option<String>,
    /// CPU list for the busy-host load threads (global only).
    pub load_cpus: Option<String>,
    /// I/O pattern.
    pub rw: Option<OneOrMany<Rw>>,
    /// Percent reads of mixed patterns.
    pub rwmixread: Option<u8>,
    /// Block size.
    pub bs: Option<OneOrMany<Bytes>>,
    /// Outstanding I/Os per worker.
    pub iodepth: Option<OneOrMany<u32>>,
    /// Workers.
    pub numjobs: Option<OneOrMany<u32>>,
    /// I/O queue pairs of each fabric connection (workers are spread over them).
    pub queue_pairs: Option<OneOrMany<u16>>,
    /// Target instances the fabric modes start, one controller each (default 1).
    pub targets: Option<OneOrMany<u32>>,
    /// Measured duration.
    pub runtime: Option<Dur>,
    /// Warm-up before measuring.
    pub ramp_time: Option<Dur>,
    /// Region of each namespace the job touches, from offset 0.
    pub size: Option<Bytes>,
    /// Bytes to transfer (all workers together) when no `runtime` is given.
    pub io_size: Option<Bytes>,
    /// Check a seeded pattern on every read.
    pub verify: Option<bool>,
    /// Seed of the verify pattern.
    pub seed: Option<u64>,
    /// Write the pattern over the region before a job that reads (default: on for the load
    /// generator's own storage, off for a target given by address).
    pub prefill: Option<bool>,
    /// Destination of read data.
    pub dest: Option<Dest>,
    /// Initiator API of the fabric modes: `async` (default) or `rtc`.
    pub api: Option<Api>,
    /// Who issues the reads: host tasks or GPU threads.
    pub issue: Option<OneOrMany<Issue>>,
    /// Reads as a dependent pointer chase: each GPU thread's (or CPU worker buffer's) next LBA
    /// comes from the data of its previous read.
    pub chase: Option<bool>,
    /// Ring data mode of GPU-issued points (a list sweeps it).
    pub ring_mode: Option<OneOrMany<RingMode>>,
    /// Idle or busy host.
    pub host_load: Option<OneOrMany<HostLoad>>,
    /// Threads of the busy-host load.
    pub load_threads: Option<u32>,
    /// Memory the busy-host load copies through (all threads together).
    pub load_mem: Option<Bytes>,
    /// With `dest = "gpu"`, blocks over 64 KiB: how many bytes of a worker's other reads land
    /// before a read's copy to the GPU leaves (0, the default: at once).
    pub copy_lag: Option<Bytes>,
}

/// A parsed job file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobFile {
    /// Defaults for every job, and the run-wide keys.
    #[serde(default)]
    pub global: Section,
    /// The jobs, run in order.
    #[serde(default)]
    pub job: Vec<Section>,
}

impl JobFile {
    /// Parses a job file's text.
    pub fn parse(text: &str) -> Result<JobFile, JobError> {
        toml::from_str(text).map_err(|e| toml_error(text, &e))
    }

    /// Reads and parses a job file.
    pub fn load(path: &std::path::Path) -> Result<JobFile, JobError> {
        let text = std::fs::read_to_string(path).map_err(|e| JobError::Read {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        Self::parse(&text)
    }

    /// Keeps only the jobs named in `names`, in the file's order (`--jobs`). A name that no
    /// job has is an error, so that a typo does not run nothing.
    pub fn keep_jobs(&mut self, names: &[String]) -> Result<(), JobError> {
        if let Some(missing) = names
            .iter()
            .find(|n| !self.job.iter().any(|j| j.name.as_ref() == Some(*n)))
        {
            let have: Vec<&str> = self.job.iter().filter_map(|j| j.name.as_deref()).collect();
            return Err(invalid(
                "--jobs",
                "name",
                format!(
                    "no job is named {missing:?} (the file has: {})",
                    have.join(", ")
                ),
            ));
        }
        self.job
            .retain(|j| j.name.as_ref().is_some_and(|n| names.contains(n)));
        Ok(())
    }
}

/// A TOML error on one line: the line of the bad value and its text, and the message.
fn toml_error(text: &str, e: &toml::de::Error) -> JobError {
    let msg = e.message().split_whitespace().collect::<Vec<_>>().join(" ");
    let at = e.span().map(|s| s.start.min(text.len()));
    let line = at.map(|at| text[..at].matches('\n').count() + 1);
    let text = line
        .and_then(|l| text.lines().nth(l - 1))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(String::from);
    JobError::Toml { line, text, msg }
}

/// Settings given on the command line that replace the job file's.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// Replaces `modes`.
    pub modes: Option<Vec<Mode>>,
    /// Replaces `runtime` of every job.
    pub runtime: Option<Duration>,
    /// Replaces `ramp_time` of every job.
    pub ramp_time: Option<Duration>,
    /// Replaces `repeat`.
    pub repeat: Option<u32>,
    /// Replaces `verify` of every job.
    pub verify: Option<bool>,
    /// Replaces `prefill` of every job.
    pub prefill: Option<bool>,
    /// Replaces `hostnqn`.
    pub hostnqn: Option<String>,
    /// Replaces `backend`.
    pub backend: Option<BackendSpec>,
    /// Replaces `target_reactors`.
    pub target_reactors: Option<usize>,
    /// Replaces `target_poll_us`.
    pub target_poll_us: Option<u32>,
    /// Replaces `client_poll_us`.
    pub client_poll_us: Option<u32>,
    /// Replaces `sq_flow_control`.
    pub sq_flow_control: Option<bool>,
    /// Replaces `target_cpus`.
    pub target_cpus: Option<String>,
    /// Replaces `client_cpus`.
    pub client_cpus: Option<String>,
    /// Replaces `nqn`.
    pub nqn: Option<String>,
    /// Replaces `iqn`.
    pub iqn: Option<String>,
    /// Replaces `lun`.
    pub lun: Option<u16>,
    /// Makes plain `tcp` start this target binary as a process.
    pub target_bin: Option<PathBuf>,
    /// Makes plain `tcp` use the target at this `HOST:PORT`.
    pub target_addr: Option<String>,
    /// Replaces `host_load` of every job.
    pub host_load: Option<HostLoad>,
    /// Replaces `load_threads`.
    pub load_threads: Option<u32>,
    /// Replaces `size` of every job.
    pub size: Option<u64>,
    /// Process ID of the target at `target_addr` (its CPU time is measured).
    pub target_pid: Option<u32>,
}

/// One fully resolved measurement point: a job with one value per swept knob.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Point {
    /// The job's name.
    pub job: String,
    /// The job's description, if any.
    pub description: Option<String>,
    /// Which knobs the job sweeps (`iodepth`, `numjobs`, ...), for plots.
    pub sweep: Vec<String>,
    /// I/O pattern.
    pub rw: Rw,
    /// Percent reads.
    pub rwmixread: u8,
    /// Block size in bytes.
    pub bs: u64,
    /// Outstanding I/Os per worker.
    pub iodepth: u32,
    /// Workers.
    pub numjobs: u32,
    /// I/O queue pairs of each fabric connection (per controller).
    pub queue_pairs: u16,
    /// Target instances (one controller each) in the fabric modes that start their own.
    pub targets: u32,
    /// Namespaces of each target the point reads (the first ones).
    pub namespaces: u32,
    /// Measured duration (`None`: until `io_size` bytes are done).
    #[serde(with = "opt_secs")]
    pub runtime: Option<Duration>,
    /// Warm-up.
    #[serde(with = "secs")]
    pub ramp_time: Duration,
    /// Region per namespace in bytes (`None`: the whole namespace).
    pub size: Option<u64>,
    /// Bytes to transfer when there is no runtime.
    pub io_size: Option<u64>,
    /// Check every read against the pattern.
    pub verify: bool,
    /// Pattern seed.
    pub seed: u64,
    /// Prefill the region before reading (`None`: the mode decides, see
    /// [`Point::prefill_in`]).
    pub prefill: Option<bool>,
    /// Destination.
    pub dest: Dest,
    /// Initiator API of the fabric modes.
    pub api: Api,
    /// Who issues the reads.
    pub issue: Issue,
    /// Reads chase pointers (each LBA from the previous read's data).
    pub chase: bool,
    /// Ring data mode (GPU-issued points).
    #[serde(default)]
    pub ring_mode: RingMode,
    /// Idle or busy host.
    pub host_load: HostLoad,
    /// Busy-load threads.
    pub load_threads: u32,
    /// Busy-load memory in bytes.
    pub load_mem: u64,
    /// Bytes of a worker's other reads that land before a large read's copy to the GPU leaves
    /// (`dest = "gpu"`; 0: at once).
    #[serde(default)]
    pub copy_lag: u64,
}

impl Point {
    /// A short label: `randread 4k qd32 x1`, plus ` busy` on a busy host.
    pub fn label(&self) -> String {
        let mut s = format!(
            "{} {} qd{} x{}",
            self.rw,
            short_size(self.bs),
            self.iodepth,
            self.numjobs
        );
        if self.queue_pairs != 1 || self.sweep.iter().any(|k| k == "queue_pairs") {
            s.push_str(&format!(" qp{}", self.queue_pairs));
        }
        if self.targets != 1 || self.sweep.iter().any(|k| k == "targets") {
            s.push_str(&format!(" {}tgt", self.targets));
        }
        if matches!(self.rw, Rw::RandRw | Rw::ReadWrite) {
            s.push_str(&format!(" r{}%", self.rwmixread));
        }
        if self.api == Api::Rtc {
            s.push_str(" rtc");
        }
        match (self.issue, self.chase) {
            (Issue::Gpu, true) => s.push_str(" gpu-chase"),
            (Issue::Gpu, false) => s.push_str(" gpu-issued"),
            (Issue::Cpu, true) => s.push_str(" cpu-chase"),
            (Issue::Cpu, false) => {}
        }
        if self.issue == Issue::Cpu && self.dest == Dest::Gpu {
            s.push_str(" into-gpu");
            if self.copy_lag > 0 {
                s.push_str(&format!(" lag{}", short_size(self.copy_lag)));
            }
        }
        if self.issue == Issue::Gpu {
            match self.ring_mode {
                RingMode::Pull => {}
                RingMode::Push => s.push_str(" push"),
                RingMode::Device => s.push_str(" device"),
            }
        }
        if self.host_load == HostLoad::Busy {
            s.push_str(" busy");
        }
        s
    }

    /// Whether the job issues reads.
    pub fn reads(&self) -> bool {
        self.rw.read_percent(self.rwmixread) > 0
    }

    /// Whether the job issues writes.
    pub fn writes(&self) -> bool {
        self.rw.read_percent(self.rwmixread) < 100
    }

    /// Whether the region is prefilled before this point reads in `mode`: as the job says,
    /// else only on the load generator's own storage (a target given by address is never
    /// written unless the job asks for it).
    pub fn prefill_in(&self, mode: &Mode) -> bool {
        self.reads() && self.prefill.unwrap_or_else(|| mode.owns_target())
    }
}

/// `4k`, `128k`, `1m`, `512`: block sizes as fio prints them.
pub fn short_size(b: u64) -> String {
    if b >= 1 << 20 && b % (1 << 20) == 0 {
        format!("{}m", b >> 20)
    } else if b >= 1 << 10 && b % (1 << 10) == 0 {
        format!("{}k", b >> 10)
    } else {
        b.to_string()
    }
}

mod secs {
    use std::time::Duration;

    pub fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }
}

mod opt_secs {
    use std::time::Duration;

    pub fn serialize<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&d.as_secs_f64()),
            None => s.serialize_none(),
        }
    }
}

/// Everything a run needs: run-wide settings and the points to measure.
#[derive(Debug, Clone)]
pub struct Plan {
    /// What the run is (the job file's global description).
    pub description: Option<String>,
    /// Modes, run side by side for every point.
    pub modes: Vec<Mode>,
    /// The backend of each namespace (DAS, and the target the load generator starts).
    pub backend: BackendSpec,
    /// Namespaces.
    pub namespaces: u32,
    /// Subsystem NQN (remote targets; the started target uses [`DEFAULT_NQN`] unless set).
    pub nqn: String,
    /// Host NQN given by `--hostnqn` or the job file, used in every fabric mode.
    pub hostnqn: Option<String>,
    /// Target IQN of the iscsi modes ([`DEFAULT_IQN`] unless set; the tgt the load generator
    /// starts takes this name).
    pub iqn: String,
    /// First LUN of the iscsi modes (`None`: 1 on the tgt the load generator starts, where
    /// LUN 0 is tgt's controller, and 0 on a target at an address).
    pub lun: Option<u16>,
    /// The host identity of the fabric modes: the given `hostnqn`, else what the binary sets
    /// for targets given by address (the `nvmeof` CLI's identity, see
    /// [`crate::path::HostChoice::system`]); `None`: [`crate::path::BENCH_HOSTNQN`]. Targets the
    /// load generator starts allow any host and are reached with the given `hostnqn` or
    /// [`crate::path::BENCH_HOSTNQN`].
    pub host: Option<crate::path::HostChoice>,
    /// Modes asked for that cannot run (plain `rdma`: no target to reach), each with the
    /// reason; they are not in [`modes`](Self::modes).
    pub skipped: Vec<String>,
    /// Reactor threads of the target the load generator starts.
    pub target_reactors: usize,
    /// Busy-poll window of the started target's reactors, in microseconds (0: event-driven;
    /// default: the target's default).
    pub target_poll_us: u32,
    /// Busy-poll window of the initiator's I/O queues, in microseconds (0: event-driven;
    /// default: the initiator's default).
    pub client_poll_us: u32,
    /// SQ flow control kept on at Connect (default: off, as the initiator asks).
    pub sq_flow_control: bool,
    /// Repeats.
    pub repeat: u32,
    /// CPUs of the target.
    pub target_cpus: Option<String>,
    /// CPUs of the client threads.
    pub client_cpus: Option<String>,
    /// CPUs of the busy-host load.
    pub load_cpus: Option<String>,
    /// Process ID of a target at an address, for its CPU time.
    pub target_pid: Option<u32>,
    /// The points, in run order.
    pub points: Vec<Point>,
}

fn check_cpu_list(job: &str, key: &'static str, v: &Option<String>) -> Result<(), JobError> {
    if let Some(list) = v {
        crate::cpu::parse_cpu_list(list).map_err(|e| invalid(job, key, e.to_string()))?;
    }
    Ok(())
}

impl Plan {
    /// Resolves a job file and command-line overrides into a plan, checking every value.
    pub fn resolve(file: &JobFile, ov: &Overrides) -> Result<Plan, JobError> {
        let g = &file.global;
        if g.name.is_some() {
            return Err(invalid("global", "name", "names belong to [[job]] tables"));
        }
        if file.job.is_empty() {
            return Err(JobError::NoJobs);
        }
        let modes = match &ov.modes {
            Some(m) => m.clone(),
            None => match &g.modes {
                Some(list) => list
                    .iter()
                    .map(|s| s.parse::<Mode>().map_err(|e| invalid("global", "modes", e)))
                    .collect::<Result<Vec<_>, _>>()?,
                None => vec![Mode::Das, Mode::Tcp(TcpTarget::InProcess)],
            },
        };
        if modes.is_empty() {
            return Err(invalid("global", "modes", "at least one mode is needed"));
        }
        let modes: Vec<Mode> = modes
            .into_iter()
            .map(|m| match m {
                Mode::Tcp(TcpTarget::InProcess) => {
                    if let Some(addr) = &ov.target_addr {
                        Mode::Tcp(TcpTarget::Remote { addr: addr.clone() })
                    } else if let Some(bin) = &ov.target_bin {
                        Mode::Tcp(TcpTarget::Process(Some(bin.clone())))
                    } else {
                        Mode::Tcp(TcpTarget::InProcess)
                    }
                }
                Mode::Tcp(TcpTarget::Process(None)) if ov.target_bin.is_some() => {
                    Mode::Tcp(TcpTarget::Process(ov.target_bin.clone()))
                }
                other => other,
            })
            .collect();
        let mut labels: Vec<String> = modes.iter().map(Mode::label).collect();
        labels.sort();
        labels.dedup();
        if labels.len() != modes.len() {
            return Err(invalid("global", "modes", "a mode is listed twice"));
        }
        // Plain `rdma` names no target and the load generator starts none: its rows are left
        // out, with the reason in the report.
        let (skipped, modes): (Vec<Mode>, Vec<Mode>) = modes
            .into_iter()
            .partition(|m| matches!(m, Mode::Rdma { addr: None }));
        let skipped: Vec<String> = skipped
            .iter()
            .map(|m| format!("{m}: {}", crate::run::RDMA_UNAVAILABLE))
            .collect();
        if modes.is_empty() {
            return Err(invalid("global", "modes", crate::run::RDMA_UNAVAILABLE));
        }
        let backend =
            ov.backend
                .clone()
                .or_else(|| g.backend.clone())
                .unwrap_or(BackendSpec::Memory {
                    size: 1 << 30,
                    block_size: blockdev::DEFAULT_BLOCK_SIZE,
                });
        backend
            .validate()
            .map_err(|e| invalid("global", "backend", e.to_string()))?;
        let namespaces = g.namespaces.unwrap_or(1);
        if namespaces == 0 || namespaces > MAX_NAMESPACES {
            return Err(invalid(
                "global",
                "namespaces",
                format!("must be 1..={MAX_NAMESPACES}"),
            ));
        }
        if namespaces > 1
            && matches!(
                backend,
                BackendSpec::File(_) | BackendSpec::Bdev(_) | BackendSpec::Pcie { .. }
            )
        {
            return Err(invalid(
                "global",
                "namespaces",
                "several namespaces need a mem or null backend (one file or drive cannot back \
                 several)",
            ));
        }
        // One process at a time may hold a controller through VFIO: the das mode and the
        // in-process target share it, a target process cannot open it beside them.
        if matches!(backend, BackendSpec::Pcie { .. })
            && modes.contains(&Mode::Das)
            && modes
                .iter()
                .any(|m| matches!(m, Mode::Tcp(TcpTarget::Process(_))))
        {
            return Err(invalid(
                "global",
                "modes",
                "a pcie: backend serves das and tcp (in-process) together, or tcp-bin alone: \
                 only one process can hold the controller",
            ));
        }
        let target_reactors = ov.target_reactors.or(g.target_reactors).unwrap_or(1);
        if target_reactors > 256 {
            return Err(invalid("global", "target_reactors", "must be 0..=256"));
        }
        let target_poll_us = ov
            .target_poll_us
            .or(g.target_poll_us)
            .unwrap_or(nvmeof_target::config::DEFAULT_POLL_US);
        if target_poll_us > 1_000_000 {
            return Err(invalid("global", "target_poll_us", "must be 0..=1000000"));
        }
        let client_poll_us = ov
            .client_poll_us
            .or(g.client_poll_us)
            .unwrap_or(nvmeof_initiator::DEFAULT_BUSY_POLL.as_micros() as u32);
        if client_poll_us > 1_000_000 {
            return Err(invalid("global", "client_poll_us", "must be 0..=1000000"));
        }
        let sq_flow_control = ov.sq_flow_control.or(g.sq_flow_control).unwrap_or(false);
        let repeat = ov.repeat.or(g.repeat).unwrap_or(1);
        if repeat == 0 || repeat > 100 {
            return Err(invalid("global", "repeat", "must be 1..=100"));
        }
        let nqn = ov
            .nqn
            .clone()
            .or_else(|| g.nqn.clone())
            .unwrap_or_else(|| DEFAULT_NQN.to_string());
        if !nqn.starts_with("nqn.") || nqn.len() > 223 {
            return Err(invalid(
                "global",
                "nqn",
                "expected an NQN (nqn.YYYY-MM.reverse.domain:name, at most 223 bytes)",
            ));
        }
        let hostnqn = ov.hostnqn.clone().or_else(|| g.hostnqn.clone());
        if let Some(h) = &hostnqn {
            if !h.starts_with("nqn.") || h.len() > 223 {
                return Err(invalid(
                    "global",
                    "hostnqn",
                    "expected an NQN (nqn.YYYY-MM.reverse.domain:name, at most 223 bytes)",
                ));
            }
        }
        let host = match (&ov.hostnqn, &g.hostnqn) {
            (Some(h), _) => Some((h, "--hostnqn")),
            (None, Some(h)) => Some((h, "hostnqn in the job file")),
            (None, None) => None,
        }
        .map(|(h, source)| crate::path::HostChoice::given(h, source))
        .transpose()
        .map_err(|e| invalid("global", "hostnqn", e.to_string()))?;
        let iqn = ov
            .iqn
            .clone()
            .or_else(|| g.iqn.clone())
            .unwrap_or_else(|| DEFAULT_IQN.to_string());
        if !(iqn.starts_with("iqn.") || iqn.starts_with("eui.") || iqn.starts_with("naa."))
            || iqn.len() > 223
        {
            return Err(invalid(
                "global",
                "iqn",
                "expected an iSCSI name (iqn.YYYY-MM.reverse.domain:name, eui. or naa., at most \
                 223 bytes)",
            ));
        }
        let lun = ov.lun.or(g.lun);
        if let Some(l) = lun
            && (l > 16383 || u32::from(l) + namespaces > 16384)
        {
            return Err(invalid("global", "lun", "LUNs end at 16383"));
        }
        let target_cpus = ov.target_cpus.clone().or_else(|| g.target_cpus.clone());
        let client_cpus = ov.client_cpus.clone().or_else(|| g.client_cpus.clone());
        let load_cpus = g.load_cpus.clone();
        check_cpu_list("global", "target_cpus", &target_cpus)?;
        check_cpu_list("global", "client_cpus", &client_cpus)?;
        check_cpu_list("global", "load_cpus", &load_cpus)?;

        let mut points = Vec::new();
        let mut names = Vec::new();
        for (i, j) in file.job.iter().enumerate() {
            let name = j.name.clone().unwrap_or_else(|| format!("job{}", i + 1));
            if names.contains(&name) {
                return Err(invalid(&name, "name", "two jobs have this name"));
            }
            names.push(name.clone());
            for (key, set) in [
                ("modes", j.modes.is_some()),
                ("backend", j.backend.is_some()),
                ("nqn", j.nqn.is_some()),
                ("hostnqn", j.hostnqn.is_some()),
                ("iqn", j.iqn.is_some()),
                ("lun", j.lun.is_some()),
                ("target_reactors", j.target_reactors.is_some()),
                ("target_poll_us", j.target_poll_us.is_some()),
                ("client_poll_us", j.client_poll_us.is_some()),
                ("sq_flow_control", j.sq_flow_control.is_some()),
                ("repeat", j.repeat.is_some()),
                ("target_cpus", j.target_cpus.is_some()),
                ("client_cpus", j.client_cpus.is_some()),
                ("load_cpus", j.load_cpus.is_some()),
            ] {
                if set {
                    return Err(invalid(&name, key, "may only be set in [global]"));
                }
            }
            let job_points = expand(&name, g, j, ov)?;
            if job_points.iter().any(|p| p.targets > 1) {
                check_several_targets(&name, &modes, &backend)?;
            }
            points.extend(job_points);
        }
        Ok(Plan {
            description: g.description.clone(),
            modes,
            backend,
            namespaces,
            nqn,
            hostnqn,
            iqn,
            lun,
            host,
            skipped,
            target_reactors,
            target_poll_us,
            client_poll_us,
            sq_flow_control,
            repeat,
            target_cpus,
            client_cpus,
            load_cpus,
            target_pid: ov.target_pid,
            points,
        })
    }

    /// The largest region any point touches per namespace (`None`: a whole namespace).
    pub fn max_region(&self) -> Option<u64> {
        let mut max = Some(0u64);
        for p in &self.points {
            max = match (max, p.size) {
                (Some(a), Some(b)) => Some(a.max(b)),
                _ => None,
            };
        }
        max
    }
}

/// Whether `targets > 1` can run: every fabric mode starts its own targets, and the backend can
/// back several of them.
fn check_several_targets(job: &str, modes: &[Mode], backend: &BackendSpec) -> Result<(), JobError> {
    if let Some(m) = modes.iter().find(|m| matches!(m, Mode::Iscsi { .. })) {
        return Err(invalid(
            job,
            "targets",
            format!("{m} runs one target: targets > 1 is for tcp and tcp-bin"),
        ));
    }
    if let Some(m) = modes.iter().find(|m| {
        matches!(
            m,
            Mode::Tcp(TcpTarget::Remote { .. }) | Mode::Rdma { addr: Some(_) }
        )
    }) {
        return Err(invalid(
            job,
            "targets",
            format!(
                "{m} is one target at an address: targets > 1 needs targets the load generator \
                 starts (tcp, tcp-bin)"
            ),
        ));
    }
    if matches!(
        backend,
        BackendSpec::File(_) | BackendSpec::Bdev(_) | BackendSpec::Pcie { .. }
    ) {
        return Err(invalid(
            job,
            "targets",
            "several targets need a mem or null backend (one file or drive cannot back several)",
        ));
    }
    Ok(())
}

fn pick<T: Clone>(job: &Option<T>, global: &Option<T>) -> Option<T> {
    job.clone().or_else(|| global.clone())
}

fn sweep<T: Clone>(
    name: &str,
    key: &'static str,
    job: &Option<OneOrMany<T>>,
    global: &Option<OneOrMany<T>>,
    default: T,
    swept: &mut Vec<String>,
) -> Result<Vec<T>, JobError> {
    let v = match pick(job, global) {
        Some(v) => v.to_vec(),
        None => vec![default],
    };
    if v.is_empty() {
        return Err(invalid(name, key, "an empty list"));
    }
    if v.len() > 1 {
        swept.push(key.to_string());
    }
    Ok(v)
}

fn expand(name: &str, g: &Section, j: &Section, ov: &Overrides) -> Result<Vec<Point>, JobError> {
    let mut swept = Vec::new();
    let rws = sweep(name, "rw", &j.rw, &g.rw, Rw::RandRead, &mut swept)?;
    let bss = sweep(name, "bs", &j.bs, &g.bs, Bytes(4096), &mut swept)?;
    let depths = sweep(name, "iodepth", &j.iodepth, &g.iodepth, 1, &mut swept)?;
    let jobs = sweep(name, "numjobs", &j.numjobs, &g.numjobs, 1, &mut swept)?;
    let qps = sweep(
        name,
        "queue_pairs",
        &j.queue_pairs,
        &g.queue_pairs,
        1,
        &mut swept,
    )?;
    let served = g.namespaces.unwrap_or(1);
    let namespaces = j.namespaces.unwrap_or(served);
    if namespaces == 0 || namespaces > served {
        return Err(invalid(
            name,
            "namespaces",
            format!("{namespaces} not in 1..={served} (the namespaces [global] gives the target)"),
        ));
    }
    let targets = sweep(name, "targets", &j.targets, &g.targets, 1, &mut swept)?;
    in_range(name, "targets", &targets, MAX_TARGETS)?;
    let loads = match ov.host_load {
        Some(l) => vec![l],
        None => sweep(
            name,
            "host_load",
            &j.host_load,
            &g.host_load,
            HostLoad::Idle,
            &mut swept,
        )?,
    };
    let issues = sweep(name, "issue", &j.issue, &g.issue, Issue::Cpu, &mut swept)?;
    let chase = pick(&j.chase, &g.chase).unwrap_or(false);
    let ring_modes = sweep(
        name,
        "ring_mode",
        &j.ring_mode,
        &g.ring_mode,
        RingMode::Pull,
        &mut swept,
    )?;
    if issues.contains(&Issue::Gpu) {
        if let Some(rw) = rws.iter().find(|rw| **rw != Rw::RandRead) {
            return Err(invalid(
                name,
                "issue",
                format!("GPU threads issue random reads: use rw = \"randread\", not {rw}"),
            ));
        }
        if let Some(b) = bss.iter().find(|b| b.0 > 128 << 10) {
            return Err(invalid(
                name,
                "issue",
                format!(
                    "GPU-issued reads are at most 128 KiB (a ring slot), not {}",
                    b.0
                ),
            ));
        }
    }
    if issues.contains(&Issue::Gpu)
        && ov.runtime.is_none()
        && j.runtime.is_none()
        && g.runtime.is_none()
        && pick(&j.io_size, &g.io_size).is_some()
    {
        return Err(invalid(
            name,
            "issue",
            "GPU-issued reads run for a runtime, not an io_size",
        ));
    }
    if chase && !(rws.iter().all(|r| *r == Rw::RandRead)) {
        return Err(invalid(
            name,
            "chase",
            "a pointer chase needs rw = \"randread\"",
        ));
    }
    let rwmixread = pick(&j.rwmixread, &g.rwmixread).unwrap_or(50);
    if rwmixread > 100 {
        return Err(invalid(name, "rwmixread", "must be 0..=100"));
    }
    for b in &bss {
        if b.0 < MIN_BS || b.0 > MAX_BS || b.0 % MIN_BS != 0 {
            return Err(invalid(
                name,
                "bs",
                format!("{} is not a multiple of 512 in 512..=1M", b.0),
            ));
        }
    }
    in_range(name, "iodepth", &depths, MAX_IODEPTH)?;
    in_range(name, "numjobs", &jobs, MAX_NUMJOBS)?;
    in_range(name, "queue_pairs", &qps, MAX_QUEUE_PAIRS)?;
    let io_size = pick(&j.io_size, &g.io_size).map(|b| b.0);
    let runtime = match ov.runtime {
        Some(r) => Some(r),
        None => match (pick(&j.runtime, &g.runtime), io_size) {
            (Some(r), _) => Some(r.0),
            (None, Some(_)) => None,
            (None, None) => Some(DEFAULT_RUNTIME),
        },
    };
    if runtime == Some(Duration::ZERO) {
        return Err(invalid(name, "runtime", "must be more than zero"));
    }
    if io_size == Some(0) {
        return Err(invalid(name, "io_size", "must be more than zero"));
    }
    let ramp_time = ov
        .ramp_time
        .or_else(|| pick(&j.ramp_time, &g.ramp_time).map(|d| d.0))
        .unwrap_or(Duration::ZERO);
    let size = ov.size.or_else(|| pick(&j.size, &g.size).map(|b| b.0));
    if let Some(s) = size {
        if s == 0 || s % MIN_BS != 0 {
            return Err(invalid(name, "size", "must be a non-zero multiple of 512"));
        }
        if let Some(b) = bss.iter().find(|b| b.0 > s) {
            return Err(invalid(
                name,
                "size",
                format!("smaller than the block size {}", b.0),
            ));
        }
    }
    let verify = ov
        .verify
        .or_else(|| pick(&j.verify, &g.verify))
        .unwrap_or(true);
    let seed = pick(&j.seed, &g.seed).unwrap_or(DEFAULT_SEED);
    let prefill = ov.prefill.or_else(|| pick(&j.prefill, &g.prefill));
    let dest = pick(&j.dest, &g.dest).unwrap_or_default();
    let api = pick(&j.api, &g.api).unwrap_or_default();
    if api == Api::Rtc && dest == Dest::Gpu {
        return Err(invalid(
            name,
            "api",
            "rtc reads into host memory: use dest = host",
        ));
    }
    if api == Api::Rtc && issues.contains(&Issue::Gpu) {
        return Err(invalid(
            name,
            "api",
            "GPU threads issue through the queue tasks: use api = async with issue = gpu",
        ));
    }
    if chase && api == Api::Rtc {
        return Err(invalid(
            name,
            "chase",
            "a pointer chase runs with api = \"async\"",
        ));
    }
    let load_threads = ov
        .load_threads
        .or_else(|| pick(&j.load_threads, &g.load_threads))
        .unwrap_or(1);
    if load_threads == 0 || load_threads > 256 {
        return Err(invalid(name, "load_threads", "must be 1..=256"));
    }
    let load_mem = pick(&j.load_mem, &g.load_mem).map_or(256 << 20, |b| b.0);
    if !(1 << 20..=64 << 30).contains(&load_mem) {
        return Err(invalid(name, "load_mem", "must be 1M..=64G"));
    }
    let copy_lag = pick(&j.copy_lag, &g.copy_lag).map_or(0, |b| b.0);
    if copy_lag > 1 << 30 {
        return Err(invalid(name, "copy_lag", "must be 0..=1G"));
    }
    if copy_lag > 0 && dest != Dest::Gpu {
        return Err(invalid(
            name,
            "copy_lag",
            "delays copies to the GPU: use it with dest = \"gpu\"",
        ));
    }
    let description = pick(&j.description, &None);
    // Host load x issuer x ring mode; CPU-issued points use no ring: one point, not one per
    // mode.
    let mut combos = Vec::new();
    for &l in &loads {
        for &i in &issues {
            let modes = if i == Issue::Gpu {
                &ring_modes[..]
            } else {
                &ring_modes[..1]
            };
            combos.extend(modes.iter().map(|&m| (l, i, m)));
        }
    }
    let mut out = Vec::new();
    // Target count outermost: the targets restart only when it changes.
    for &targets in &targets {
        for &rw in &rws {
            for bs in &bss {
                for &iodepth in &depths {
                    for &numjobs in &jobs {
                        for &queue_pairs in &qps {
                            for &(host_load, issue, ring_mode) in &combos {
                                out.push(Point {
                                    job: name.to_string(),
                                    description: description.clone(),
                                    sweep: swept.clone(),
                                    rw,
                                    rwmixread,
                                    bs: bs.0,
                                    iodepth,
                                    numjobs,
                                    queue_pairs,
                                    targets,
                                    namespaces,
                                    runtime,
                                    ramp_time,
                                    size,
                                    io_size,
                                    verify,
                                    seed,
                                    prefill,
                                    dest,
                                    api,
                                    issue,
                                    chase,
                                    ring_mode,
                                    host_load,
                                    load_threads,
                                    load_mem,
                                    copy_lag,
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    if out.len() > 10_000 {
        return Err(invalid(name, "sweep", "more than 10000 points"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(text: &str) -> Result<Plan, JobError> {
        Plan::resolve(&JobFile::parse(text)?, &Overrides::default())
    }

    #[test]
    fn keep_jobs_runs_the_named_jobs_in_file_order() {
        let text = r#"
            [[job]]
            name = "a"
            [[job]]
            name = "b"
            [[job]]
            name = "c"
            "#;
        let mut f = JobFile::parse(text).unwrap();
        f.keep_jobs(&["c".into(), "a".into()]).unwrap();
        let names: Vec<_> = f.job.iter().filter_map(|j| j.name.as_deref()).collect();
        assert_eq!(names, ["a", "c"]);
        let mut f = JobFile::parse(text).unwrap();
        let e = f
            .keep_jobs(&["a".into(), "d".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"d\"") && e.contains("a, b, c"), "{e}");
        assert_eq!(f.job.len(), 3, "nothing dropped on error");
    }

    #[test]
    fn issue_sweeps_and_gpu_issue_checks() {
        let p = plan(
            r#"
            [[job]]
            name = "g"
            bs = ["512", "4k"]
            iodepth = 8
            issue = ["cpu", "gpu"]
            "#,
        )
        .unwrap();
        let got: Vec<(u64, Issue, bool)> =
            p.points.iter().map(|x| (x.bs, x.issue, x.chase)).collect();
        assert_eq!(
            got,
            [
                (512, Issue::Cpu, false),
                (512, Issue::Gpu, false),
                (4096, Issue::Cpu, false),
                (4096, Issue::Gpu, false)
            ]
        );
        assert_eq!(p.points[0].sweep, vec!["bs", "issue"]);
        assert_eq!(p.points[1].label(), "randread 512 qd8 x1 gpu-issued");
        let c = plan("[[job]]\nname = \"c\"\nissue = [\"cpu\", \"gpu\"]\nchase = true\n").unwrap();
        assert!(c.points.iter().all(|p| p.chase));
        assert_eq!(c.points[0].label(), "randread 4k qd1 x1 cpu-chase");
        assert_eq!(c.points[1].label(), "randread 4k qd1 x1 gpu-chase");
        let g = plan("[[job]]\nrw = \"read\"\ndest = \"gpu\"").unwrap();
        assert_eq!(g.points[0].label(), "read 4k qd1 x1 into-gpu");
        assert_eq!(g.points[0].copy_lag, 0);
        let l =
            plan("[[job]]\nrw = \"read\"\nbs = \"1m\"\ndest = \"gpu\"\ncopy_lag = \"2m\"").unwrap();
        assert_eq!(l.points[0].copy_lag, 2 << 20);
        assert_eq!(l.points[0].label(), "read 1m qd1 x1 into-gpu lag2m");
        let m = plan(
            "[[job]]\nname = \"m\"\nrw = \"randread\"\nissue = [\"cpu\", \"gpu\"]\nring_mode = [\"pull\", \"push\", \"device\"]\n",
        )
        .unwrap();
        let labels: Vec<String> = m.points.iter().map(Point::label).collect();
        assert_eq!(
            labels,
            [
                "randread 4k qd1 x1",
                "randread 4k qd1 x1 gpu-issued",
                "randread 4k qd1 x1 gpu-issued push",
                "randread 4k qd1 x1 gpu-issued device"
            ]
        );
        assert_eq!(m.points[2].ring_mode, RingMode::Push);
        assert_eq!(m.points[3].ring_mode, RingMode::Device);
        let e = plan("[[job]]\nname = \"r\"\napi = \"rtc\"\nchase = true\n").unwrap_err();
        assert!(e.to_string().contains("chase"), "{e}");
        for (text, key) in [
            ("issue = \"gpu\"\nrw = \"randwrite\"", "issue"),
            ("issue = \"gpu\"\nbs = \"256k\"", "issue"),
            ("issue = \"gpu\"\nio_size = \"1m\"", "issue"),
            ("chase = true\nrw = \"randrw\"", "chase"),
            ("issue = \"fpga\"", ""),
        ] {
            let e = plan(&format!("[[job]]\nname = \"x\"\n{text}\n")).unwrap_err();
            assert!(e.to_string().contains(key), "{text}: {e}");
        }
    }

    #[test]
    fn targets_sweep_outermost_and_checks() {
        let p = plan(
            r#"
            [global]
            targets = 2
            [[job]]
            name = "one"
            [[job]]
            name = "t"
            targets = [1, 4]
            queue_pairs = [1, 2]
            "#,
        )
        .unwrap();
        assert_eq!(p.points[0].targets, 2);
        assert_eq!(p.points[0].label(), "randread 4k qd1 x1 2tgt");
        assert!(p.points[0].sweep.is_empty());
        let got: Vec<(u32, u16)> = p.points[1..]
            .iter()
            .map(|x| (x.targets, x.queue_pairs))
            .collect();
        assert_eq!(got, [(1, 1), (1, 2), (4, 1), (4, 2)]);
        assert_eq!(p.points[1].sweep, vec!["queue_pairs", "targets"]);
        assert_eq!(p.points[1].label(), "randread 4k qd1 x1 qp1 1tgt");
        assert_eq!(p.points[4].label(), "randread 4k qd1 x1 qp2 4tgt");
        assert_eq!(plan("[[job]]").unwrap().points[0].targets, 1);
        assert_eq!(
            plan("[[job]]").unwrap().points[0].label(),
            "randread 4k qd1 x1"
        );
        let json = serde_json::to_value(&p.points[2]).unwrap();
        assert_eq!(json["targets"], 1);
        for (text, needle) in [
            ("[[job]]\ntargets = 0", "targets: 0 not in 1..=16"),
            ("[[job]]\ntargets = [1, 17]", "17 not in"),
            ("[[job]]\ntargets = []", "empty"),
            (
                "[global]\nmodes = [\"tcp=192.0.2.1:4420\"]\n[[job]]\ntargets = [1, 2]",
                "one target at an address",
            ),
            (
                "[global]\nmodes = [\"rdma=192.0.2.1:4420\"]\n[[job]]\ntargets = 2",
                "one target at an address",
            ),
            (
                "[global]\nbackend = \"pcie:0000:01:00.0\"\nmodes = [\"tcp\"]\n[[job]]\ntargets = 2",
                "mem or null backend",
            ),
        ] {
            let err = plan(text)
                .err()
                .unwrap_or_else(|| panic!("accepted {text:?}"));
            let msg = err.to_string();
            assert!(msg.contains(needle), "{text:?}: {msg}");
            assert_eq!(msg.lines().count(), 1, "{msg}");
        }
        // A job reads the first namespaces of what [global] gives the target.
        let p = plan("[global]\nnamespaces = 4\n[[job]]\n[[job]]\nnamespaces = 1\ntargets = 4")
            .unwrap();
        let got: Vec<(u32, u32)> = p.points.iter().map(|x| (x.namespaces, x.targets)).collect();
        assert_eq!(got, [(4, 1), (1, 4)]);
        let e = plan("[global]\nnamespaces = 2\n[[job]]\nnamespaces = 3").unwrap_err();
        assert!(e.to_string().contains("3 not in 1..=2"), "{e}");
        // One target at an address is fine; so is --target with targets = 1.
        assert!(plan("[global]\nmodes = [\"tcp=192.0.2.1:4420\"]\n[[job]]\ntargets = 1").is_ok());
        let file = JobFile::parse("[[job]]\ntargets = [1, 2]").unwrap();
        let ov = Overrides {
            target_addr: Some("127.0.0.1:4420".into()),
            ..Default::default()
        };
        let e = Plan::resolve(&file, &ov).unwrap_err();
        assert!(
            e.to_string().contains("tcp@127.0.0.1:4420 is one target"),
            "{e}"
        );
    }

    #[test]
    fn defaults_and_inheritance() {
        let p = plan(
            r#"
            [global]
            rw = "randread"
            bs = "4k"
            iodepth = 32
            runtime = "2s"
            ramp_time = "500ms"
            [[job]]
            name = "a"
            [[job]]
            name = "b"
            bs = 131072
            rw = "read"
            "#,
        )
        .unwrap();
        assert_eq!(p.modes, vec![Mode::Das, Mode::Tcp(TcpTarget::InProcess)]);
        assert_eq!(p.points.len(), 2);
        let a = &p.points[0];
        assert_eq!(
            (a.rw, a.bs, a.iodepth, a.numjobs, a.queue_pairs),
            (Rw::RandRead, 4096, 32, 1, 1)
        );
        assert_eq!(a.runtime, Some(Duration::from_secs(2)));
        assert_eq!(a.ramp_time, Duration::from_millis(500));
        assert!(a.verify && a.prefill.is_none());
        assert!(a.prefill_in(&Mode::Das) && a.prefill_in(&Mode::Tcp(TcpTarget::Process(None))));
        let remote = Mode::Tcp(TcpTarget::Remote {
            addr: "192.0.2.1:4420".into(),
        });
        assert!(!a.prefill_in(&remote));
        assert!(!a.prefill_in(&Mode::Rdma {
            addr: Some("192.0.2.1:4420".into())
        }));
        let b = &p.points[1];
        assert_eq!((b.rw, b.bs, b.iodepth), (Rw::Read, 128 * 1024, 32));
        assert_eq!(b.label(), "read 128k qd32 x1");
        assert!(b.sweep.is_empty());
    }

    #[test]
    fn sq_flow_control_key() {
        assert!(!plan("[[job]]\n").unwrap().sq_flow_control);
        assert!(
            plan("[global]\nsq_flow_control = true\n[[job]]\n")
                .unwrap()
                .sq_flow_control
        );
        let e = plan("[[job]]\nsq_flow_control = true\n").unwrap_err();
        assert!(e.to_string().contains("may only be set in [global]"), "{e}");
        let file = JobFile::parse("[global]\nsq_flow_control = true\n[[job]]\n").unwrap();
        let ov = Overrides {
            sq_flow_control: Some(false),
            ..Overrides::default()
        };
        assert!(!Plan::resolve(&file, &ov).unwrap().sq_flow_control);
    }

    #[test]
    fn hostnqn_and_prefill_keys() {
        let p = plan(
            r#"
            [global]
            hostnqn = "nqn.2026-11.io.example:host1"
            [[job]]
            prefill = true
            "#,
        )
        .unwrap();
        assert_eq!(p.hostnqn.as_deref(), Some("nqn.2026-11.io.example:host1"));
        let remote = Mode::Tcp(TcpTarget::Remote {
            addr: "192.0.2.1:4420".into(),
        });
        assert!(p.points[0].prefill_in(&remote));
        let e = plan("[[job]]\nhostnqn = \"nqn.2026-11.io.example:h\"\n").unwrap_err();
        assert!(e.to_string().contains("may only be set in [global]"), "{e}");
        let e = plan("[global]\nhostnqn = \"host1\"\n[[job]]\n").unwrap_err();
        assert!(e.to_string().contains("hostnqn"), "{e}");
        let ov = Overrides {
            prefill: Some(false),
            hostnqn: Some("nqn.2026-11.io.example:host2".into()),
            ..Overrides::default()
        };
        let file = JobFile::parse("[[job]]\nprefill = true\n").unwrap();
        let p = Plan::resolve(&file, &ov).unwrap();
        assert!(!p.points[0].prefill_in(&Mode::Das));
        assert_eq!(p.hostnqn.as_deref(), Some("nqn.2026-11.io.example:host2"));
    }

    #[test]
    fn sweeps_expand_in_order() {
        let p = plan(
            r#"
            [[job]]
            name = "s"
            iodepth = [1, 4]
            numjobs = [1, 2, 3]
            host_load = ["idle", "busy"]
            "#,
        )
        .unwrap();
        assert_eq!(p.points.len(), 12);
        assert_eq!(p.points[0].sweep, vec!["iodepth", "numjobs", "host_load"]);
        let order: Vec<(u32, u32, HostLoad)> = p
            .points
            .iter()
            .map(|x| (x.iodepth, x.numjobs, x.host_load))
            .collect();
        assert_eq!(order[0], (1, 1, HostLoad::Idle));
        assert_eq!(order[1], (1, 1, HostLoad::Busy));
        assert_eq!(order[2], (1, 2, HostLoad::Idle));
        assert_eq!(order[11], (4, 3, HostLoad::Busy));
        assert!(p.points[1].label().ends_with(" busy"));
    }

    #[test]
    fn rejects_bad_values() {
        for (text, needle) in [
            ("[[job]]\nbs = 1000", "bs"),
            ("[[job]]\nbs = \"2M\"", "bs"),
            ("[[job]]\nbs = 256", "bs"),
            ("[[job]]\niodepth = 0", "iodepth"),
            ("[[job]]\nnumjobs = 0", "numjobs"),
            ("[[job]]\nrwmixread = 101", "rwmixread"),
            ("[[job]]\nrw = \"sideways\"", "rw"),
            ("[[job]]\nruntime = \"fast\"", "runtime"),
            ("[[job]]\nbogus = 1", "bogus"),
            ("[[job]]\nmodes = [\"das\"]", "only be set in [global]"),
            ("[global]\nmodes = [\"ftp\"]\n[[job]]", "unknown mode"),
            ("[global]\nmodes = [\"das\", \"das\"]\n[[job]]", "twice"),
            ("[global]\nmodes = []\n[[job]]", "at least one"),
            ("[global]\nnamespaces = 0\n[[job]]", "namespaces"),
            ("[global]\ntarget_cpus = \"x\"\n[[job]]", "target_cpus"),
            ("[[job]]\nname = \"a\"\n[[job]]\nname = \"a\"", "two jobs"),
            ("[[job]]\nsize = \"4k\"\nbs = \"8k\"", "size"),
            ("[[job]]\niodepth = []", "empty"),
            ("[global]\nbackend = \"mem:0\"\n[[job]]", "backend"),
            (
                "[global]\nbackend = \"pcie:0000:01:00.0\"\nnamespaces = 2\n[[job]]",
                "several namespaces",
            ),
            (
                "[global]\nbackend = \"pcie:0000:01:00.0\"\nmodes = [\"das\", \"tcp-bin\"]\n[[job]]",
                "only one process can hold the controller",
            ),
            ("[global]\n", "no [[job]]"),
            ("[[job]]\napi = \"sync\"", "api"),
            ("[[job]]\napi = \"rtc\"\ndest = \"gpu\"", "dest = host"),
            ("[[job]]\ncopy_lag = \"1m\"", "use it with dest = \"gpu\""),
            ("[[job]]\ndest = \"gpu\"\ncopy_lag = \"2g\"", "0..=1G"),
        ] {
            let err = plan(text)
                .err()
                .unwrap_or_else(|| panic!("accepted {text:?}"));
            let msg = err.to_string();
            assert!(msg.contains(needle), "{text:?}: {msg}");
        }
    }

    #[test]
    fn modes_parse_and_overrides_apply() {
        assert_eq!("das".parse::<Mode>().unwrap(), Mode::Das);
        assert_eq!(
            "tcp=10.0.0.1:4420".parse::<Mode>().unwrap(),
            Mode::Tcp(TcpTarget::Remote {
                addr: "10.0.0.1:4420".into()
            })
        );
        assert_eq!(
            "tcp-bin".parse::<Mode>().unwrap(),
            Mode::Tcp(TcpTarget::Process(None))
        );
        assert_eq!("rdma".parse::<Mode>().unwrap(), Mode::Rdma { addr: None });
        assert!("tcp=nohost".parse::<Mode>().is_err());
        assert!("tcp=h:notaport".parse::<Mode>().is_err());
        let file = JobFile::parse("[[job]]\nruntime = 9").unwrap();
        let ov = Overrides {
            target_addr: Some("127.0.0.1:4420".into()),
            runtime: Some(Duration::from_millis(300)),
            verify: Some(false),
            ..Default::default()
        };
        let p = Plan::resolve(&file, &ov).unwrap();
        assert_eq!(p.modes[1].label(), "tcp@127.0.0.1:4420");
        assert_eq!(p.points[0].runtime, Some(Duration::from_millis(300)));
        assert!(!p.points[0].verify);
    }

    #[test]
    fn iscsi_modes_and_keys() {
        assert_eq!("iscsi".parse::<Mode>().unwrap(), Mode::Iscsi { addr: None });
        let at = "iscsi=192.0.2.1:3260".parse::<Mode>().unwrap();
        assert_eq!(at.label(), "iscsi@192.0.2.1:3260");
        assert!(!at.owns_target());
        assert!(Mode::Iscsi { addr: None }.owns_target());
        assert!("iscsi=nohost".parse::<Mode>().is_err());
        let p = plan(
            "[global]\nmodes = [\"das\", \"iscsi\"]\niqn = \"iqn.2026-11.io.example:disk\"\nlun = 3\n[[job]]",
        )
        .unwrap();
        assert_eq!(
            (p.iqn.as_str(), p.lun),
            ("iqn.2026-11.io.example:disk", Some(3))
        );
        let p = plan("[[job]]").unwrap();
        assert_eq!((p.iqn.as_str(), p.lun), (DEFAULT_IQN, None));
        for (text, needle) in [
            ("[global]\niqn = \"disk\"\n[[job]]", "iSCSI name"),
            ("[global]\nlun = 16384\n[[job]]", "LUNs end"),
            ("[[job]]\nlun = 1", "only be set in [global]"),
            (
                "[global]\nmodes = [\"iscsi\"]\n[[job]]\ntargets = 2",
                "runs one target",
            ),
        ] {
            let e = plan(text).unwrap_err().to_string();
            assert!(e.contains(needle), "{text:?}: {e}");
        }
    }

    #[test]
    fn io_size_without_runtime_and_durations() {
        let p = plan("[[job]]\nio_size = \"64M\"").unwrap();
        assert_eq!(p.points[0].runtime, None);
        assert_eq!(p.points[0].io_size, Some(64 << 20));
        let p = plan("[[job]]").unwrap();
        assert_eq!(p.points[0].runtime, Some(DEFAULT_RUNTIME));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("1y").is_err());
    }

    #[test]
    fn max_region() {
        let p = plan("[[job]]\nsize = \"1M\"\n[[job]]\nsize = \"4M\"").unwrap();
        assert_eq!(p.max_region(), Some(4 << 20));
        let p = plan("[[job]]\nsize = \"1M\"\n[[job]]").unwrap();
        assert_eq!(p.max_region(), None);
    }

    #[test]
    fn api_key_is_per_job_and_labelled() {
        let p = plan("[global]\napi = \"rtc\"\n[[job]]\nname = \"a\"\n[[job]]\nname = \"b\"\napi = \"async\"").unwrap();
        assert_eq!(p.points[0].api, Api::Rtc);
        assert_eq!(p.points[0].label(), "randread 4k qd1 x1 rtc");
        assert_eq!(p.points[1].api, Api::Async);
        assert_eq!(p.points[1].label(), "randread 4k qd1 x1");
        assert_eq!(plan("[[job]]").unwrap().points[0].api, Api::Async);
    }

    #[test]
    fn shipped_job_files_parse() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("jobs");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let path = e.unwrap().path();
            if path.extension().is_some_and(|x| x == "toml") {
                let f = JobFile::load(&path).unwrap();
                let p = Plan::resolve(&f, &Overrides::default())
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                assert!(!p.points.is_empty());
                n += 1;
            }
        }
        assert!(n >= 5, "expected the quick job and the four studies");
    }
}
