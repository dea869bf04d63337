//! File backend: acknowledged writes survive a crash of the process that made them. In a
//! test binary of its own: the test starts a child process, and a child forked while another
//! test of the same process holds a file's `flock` would hold that lock too until it execs,
//! so that test would find its file "in use".

mod common;

use std::path::Path;
use std::process::Command;

use blockdev::{Backend, BackendSpec, open};
use common::pattern_buf;

fn file_spec(path: &Path, opts: &str) -> BackendSpec {
    format!("file:{}{opts}", path.display()).parse().unwrap()
}

const CRASH_ENV: &str = "BLOCKDEV_CRASH_CHILD_PATH";

/// Run by `acknowledged_writes_survive_a_process_crash` in a child process: writes, flushes,
/// then aborts without any cleanup.
#[test]
#[ignore = "helper: runs only as the child of acknowledged_writes_survive_a_process_crash"]
fn crash_child() {
    let path = std::env::var(CRASH_ENV).expect("run by the crash test");
    let b = open(&file_spec(Path::new(&path), ",size=1M")).unwrap();
    common::current_thread().block_on(async {
        for i in 0..16u64 {
            let (res, _) = b.write(i * 8, pattern_buf(i as u8, i * 8, 8, 4096)).await;
            res.unwrap();
        }
        b.flush().await.unwrap();
    });
    std::process::abort();
}

#[test]
fn acknowledged_writes_survive_a_process_crash() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ns.img");
    let status = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "crash_child", "--nocapture"])
        .env(CRASH_ENV, &path)
        .status()
        .unwrap();
    assert!(!status.success(), "the child must have aborted");
    let data = std::fs::read(&path).unwrap();
    for i in 0..16u64 {
        let at = (i * 8 * 4096) as usize;
        assert!(
            data[at..at + 8 * 4096] == pattern_buf(i as u8, i * 8, 8, 4096)[..],
            "write {i} lost"
        );
    }
}
