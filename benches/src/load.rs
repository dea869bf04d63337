//! The busy-host load: threads that keep CPUs busy and move memory, like the background load
//! of Micron's busy-system GPUDirect Storage study (86 % CPU, about half the memory
//! bandwidth).
//!
//! Each thread owns two halves of its share of `load_mem` bytes and copies one into the other
//! in 1 MiB steps, adding a constant to every word so the copy cannot be elided: that costs
//! CPU time and memory bandwidth at once. Threads are named `bench-load-N` so CPU accounting
//! can leave them out of the client's figures.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::cpu;

const STEP_WORDS: usize = (1 << 20) / 8;

/// What the load did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadStats {
    /// Threads.
    pub threads: u32,
    /// Bytes read plus bytes written per second, in GB/s (10^9).
    pub memory_gbps: f64,
    /// Seconds the load ran.
    pub seconds: f64,
}

/// A running load; [`BusyLoad::stop`] ends it.
pub struct BusyLoad {
    stop: Arc<AtomicBool>,
    bytes: Arc<AtomicU64>,
    handles: Vec<JoinHandle<()>>,
    started: Instant,
}

impl BusyLoad {
    /// Starts `threads` threads over `mem` bytes in all, pinned to `cpus` when given.
    pub fn start(threads: u32, mem: u64, cpus: Option<&str>) -> std::io::Result<BusyLoad> {
        let stop = Arc::new(AtomicBool::new(false));
        let bytes = Arc::new(AtomicU64::new(0));
        let per_thread = (mem / u64::from(threads.max(1))).max(2 << 20) as usize;
        let mut handles = Vec::new();
        for i in 0..threads {
            let stop = Arc::clone(&stop);
            let bytes = Arc::clone(&bytes);
            let cpus = cpus.map(str::to_string);
            let h = std::thread::Builder::new()
                .name(format!("{}-{i}", cpu::LOAD_PREFIX))
                .spawn(move || {
                    if let Some(c) = cpus
                        && let Err(e) = cpu::pin_current(&c)
                    {
                        tracing::warn!(error = %e, "busy load thread not pinned");
                    }
                    run(per_thread, &stop, &bytes)
                })?;
            handles.push(h);
        }
        Ok(BusyLoad {
            stop,
            bytes,
            handles,
            started: Instant::now(),
        })
    }

    /// Stops the threads and reports the memory bandwidth they achieved.
    pub fn stop(self) -> LoadStats {
        self.stop.store(true, Ordering::Relaxed);
        let threads = self.handles.len() as u32;
        for h in self.handles {
            let _ = h.join();
        }
        let seconds = self.started.elapsed().as_secs_f64();
        let bytes = self.bytes.load(Ordering::Relaxed) as f64;
        LoadStats {
            threads,
            memory_gbps: if seconds > 0.0 {
                bytes / seconds / 1e9
            } else {
                0.0
            },
            seconds,
        }
    }
}

fn run(bytes_per_thread: usize, stop: &AtomicBool, moved: &AtomicU64) {
    let words = (bytes_per_thread / 16).max(STEP_WORDS);
    let mut src: Vec<u64> = (0..words as u64).collect();
    let mut dst = vec![0u64; words];
    let mut pass = 0u64;
    while !stop.load(Ordering::Relaxed) {
        for start in (0..words).step_by(STEP_WORDS) {
            let end = (start + STEP_WORDS).min(words);
            for (d, s) in dst[start..end].iter_mut().zip(&src[start..end]) {
                *d = s.wrapping_add(pass);
            }
            moved.fetch_add(((end - start) * 16) as u64, Ordering::Relaxed);
            if stop.load(Ordering::Relaxed) {
                break;
            }
        }
        std::mem::swap(&mut src, &mut dst);
        pass = pass.wrapping_add(1);
    }
    std::hint::black_box(&dst);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_moves_memory_and_stops() {
        let l = BusyLoad::start(1, 4 << 20, None).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(100));
        let s = l.stop();
        assert_eq!(s.threads, 1);
        assert!(s.memory_gbps > 0.0);
        assert!(s.seconds >= 0.1);
    }
}
