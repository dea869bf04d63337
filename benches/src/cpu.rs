//! CPU time per thread from `/proc`, and pinning threads to CPUs.
//!
//! CPU time comes from `/proc/PID/task/TID/schedstat` (nanoseconds on the CPU), falling back to
//! `utime + stime` of `/proc/PID/task/TID/stat` (clock ticks, assumed 100 per second) where
//! schedstat is missing. Threads are told apart by their names (`comm`): the target's reactors
//! are `nvmeof-reactor-N`, the busy-host load threads `bench-load-N`.
//!
//! Pinning uses the `taskset` tool (util-linux) on thread IDs, so this crate needs no
//! `unsafe` code for `sched_setaffinity`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Name prefix of the target's reactor threads (`comm` is cut to 15 bytes).
pub const REACTOR_PREFIX: &str = "nvmeof-reactor";
/// Name prefix of the busy-host load threads.
pub const LOAD_PREFIX: &str = "bench-load";

/// Errors of CPU accounting and pinning.
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    /// A `/proc` file could not be read.
    #[error("cannot read {path}: {source}")]
    Proc {
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A CPU list is malformed.
    #[error("bad CPU list {0:?} (expected e.g. 0, 1-3 or 0,2)")]
    BadList(String),
    /// `taskset` failed.
    #[error("cannot pin thread {tid} to CPUs {cpus}: {msg}")]
    Pin {
        /// The thread.
        tid: u32,
        /// The CPU list.
        cpus: String,
        /// What went wrong.
        msg: String,
    },
}

/// Parses a CPU list (`0`, `1-3`, `0,2,4-5`) into CPU numbers.
pub fn parse_cpu_list(s: &str) -> Result<Vec<u32>, CpuError> {
    let bad = || CpuError::BadList(s.to_string());
    let mut out = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a, b),
            None => (part, part),
        };
        let a: u32 = a.trim().parse().map_err(|_| bad())?;
        let b: u32 = b.trim().parse().map_err(|_| bad())?;
        if a > b || b >= 4096 {
            return Err(bad());
        }
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// One thread's identity and CPU time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadCpu {
    /// Thread ID.
    pub tid: u32,
    /// Thread name.
    pub name: String,
    /// CPU time in nanoseconds.
    pub ns: u64,
}

/// CPU times of every thread of a process at one moment.
#[derive(Debug, Clone, Default)]
pub struct CpuSnapshot {
    threads: HashMap<u32, ThreadCpu>,
}

fn task_dir(pid: Option<u32>) -> PathBuf {
    match pid {
        Some(p) => PathBuf::from(format!("/proc/{p}/task")),
        None => PathBuf::from("/proc/self/task"),
    }
}

fn read(path: &Path) -> Result<String, CpuError> {
    std::fs::read_to_string(path).map_err(|source| CpuError::Proc {
        path: path.to_path_buf(),
        source,
    })
}

fn thread_ns(dir: &Path) -> Result<u64, CpuError> {
    if let Ok(s) = std::fs::read_to_string(dir.join("schedstat"))
        && let Some(Ok(ns)) = s.split_whitespace().next().map(str::parse::<u64>)
    {
        return Ok(ns);
    }
    let stat = read(&dir.join("stat"))?;
    parse_stat_ticks(&stat)
        .map(|t| t * 10_000_000)
        .ok_or_else(|| CpuError::Proc {
            path: dir.join("stat"),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed stat"),
        })
}

/// `utime + stime` in clock ticks from a `/proc/.../stat` line.
pub fn parse_stat_ticks(stat: &str) -> Option<u64> {
    // The command name is in parentheses and may contain spaces: fields follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state(0) ppid(1) ... utime is field 14 of the line, index 11 here.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some(utime + stime)
}

impl CpuSnapshot {
    /// Reads every thread of `pid` (`None`: this process).
    pub fn take(pid: Option<u32>) -> Result<CpuSnapshot, CpuError> {
        let dir = task_dir(pid);
        let entries = std::fs::read_dir(&dir).map_err(|source| CpuError::Proc {
            path: dir.clone(),
            source,
        })?;
        let mut threads = HashMap::new();
        for e in entries.flatten() {
            let Some(tid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let path = e.path();
            // A thread may exit between listing and reading: skip it.
            let Ok(name) = std::fs::read_to_string(path.join("comm")) else {
                continue;
            };
            let Ok(ns) = thread_ns(&path) else {
                continue;
            };
            threads.insert(
                tid,
                ThreadCpu {
                    tid,
                    name: name.trim_end().to_string(),
                    ns,
                },
            );
        }
        Ok(CpuSnapshot { threads })
    }

    /// Reads every thread of every process of `pids` into one snapshot (thread IDs are
    /// unique across processes).
    pub fn take_processes(pids: &[u32]) -> Result<CpuSnapshot, CpuError> {
        let mut all = CpuSnapshot::default();
        for &p in pids {
            all.threads.extend(CpuSnapshot::take(Some(p))?.threads);
        }
        Ok(all)
    }

    /// The threads in this snapshot.
    pub fn threads(&self) -> impl Iterator<Item = &ThreadCpu> {
        self.threads.values()
    }

    /// CPU seconds used between `self` and `later` by threads whose name `select` accepts.
    /// Threads born in between count from zero; threads that ended in between are lost.
    pub fn seconds_until(&self, later: &CpuSnapshot, select: impl Fn(&str) -> bool) -> f64 {
        let mut ns = 0u64;
        for t in later.threads.values() {
            if !select(&t.name) {
                continue;
            }
            let before = self.threads.get(&t.tid).map_or(0, |b| b.ns);
            ns += t.ns.saturating_sub(before);
        }
        ns as f64 / 1e9
    }

    /// Thread IDs whose names start with `prefix`.
    pub fn tids_named(&self, prefix: &str) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .threads
            .values()
            .filter(|t| t.name.starts_with(prefix))
            .map(|t| t.tid)
            .collect();
        v.sort_unstable();
        v
    }
}

/// The calling thread's ID.
pub fn current_tid() -> Option<u32> {
    let link = std::fs::read_link("/proc/thread-self").ok()?;
    link.file_name()?.to_str()?.parse().ok()
}

/// Pins thread `tid` to the CPUs of `cpus` (a CPU list).
pub fn pin_thread(tid: u32, cpus: &str) -> Result<(), CpuError> {
    parse_cpu_list(cpus)?;
    let out = Command::new("taskset")
        .args(["-p", "-c", cpus, &tid.to_string()])
        .output()
        .map_err(|e| CpuError::Pin {
            tid,
            cpus: cpus.to_string(),
            msg: format!("cannot run taskset: {e}"),
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(CpuError::Pin {
            tid,
            cpus: cpus.to_string(),
            msg: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// Pins the calling thread.
pub fn pin_current(cpus: &str) -> Result<(), CpuError> {
    let tid = current_tid().ok_or_else(|| CpuError::Pin {
        tid: 0,
        cpus: cpus.to_string(),
        msg: "cannot read /proc/thread-self".into(),
    })?;
    pin_thread(tid, cpus)
}

/// Pins every thread of process `pid` (`None`: this process) whose name starts with `prefix`
/// (every thread when `prefix` is empty). Returns how many were pinned.
pub fn pin_named(pid: Option<u32>, prefix: &str, cpus: &str) -> Result<usize, CpuError> {
    let snap = CpuSnapshot::take(pid)?;
    let tids = snap.tids_named(prefix);
    for &t in &tids {
        pin_thread(t, cpus)?;
    }
    Ok(tids.len())
}

/// The number of CPUs this process may run on.
pub fn online_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0").unwrap(), vec![0]);
        assert_eq!(parse_cpu_list("1-3,0,2").unwrap(), vec![0, 1, 2, 3]);
        assert!(parse_cpu_list("").is_err());
        assert!(parse_cpu_list("3-1").is_err());
        assert!(parse_cpu_list("a").is_err());
    }

    #[test]
    fn stat_parsing_handles_spaces_in_names() {
        let line = "1234 (a b) c) S 1 2 3 4 5 6 7 8 9 10 70 30 0 0 20 0 1 0 100";
        assert_eq!(parse_stat_ticks(line), Some(100));
        assert_eq!(parse_stat_ticks("garbage"), None);
    }

    #[test]
    fn a_spinning_thread_shows_up_by_name() {
        let before = CpuSnapshot::take(None).unwrap();
        let h = std::thread::Builder::new()
            .name("bench-spin-test".into())
            .spawn(|| {
                let start = std::time::Instant::now();
                let mut x = 0u64;
                while start.elapsed() < std::time::Duration::from_millis(150) {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
                // Keep the thread alive while the snapshot is taken.
                std::thread::sleep(std::time::Duration::from_millis(200));
                x
            })
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(250));
        let after = CpuSnapshot::take(None).unwrap();
        h.join().unwrap();
        let spin = before.seconds_until(&after, |n| n == "bench-spin-test");
        assert!(spin > 0.02, "spin thread used {spin} s");
        assert!(!after.tids_named("bench-spin-test").is_empty());
        assert!(current_tid().is_some());
    }
}
