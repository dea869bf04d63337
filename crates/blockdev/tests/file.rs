//! File backend: opening and sizing, durability across reopen, errors (durability across a
//! process crash: `file_crash.rs`).

mod common;

use std::path::Path;

use blockdev::{
    AnyBackend, Backend, BackendError, BackendSpec, FileBackend, FileSpec, IoBuf, StatusHint, open,
};
use common::pattern_buf;

fn spec(s: &str) -> BackendSpec {
    s.parse().unwrap()
}

fn file_spec(path: &Path, opts: &str) -> BackendSpec {
    spec(&format!("file:{}{opts}", path.display()))
}

#[test]
fn created_with_size_then_reopened_at_its_length() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ns.img");
    let b = open(&file_spec(&path, ",size=1M")).unwrap();
    assert_eq!(b.kind(), "file");
    assert_eq!(b.capacity_bytes(), 1 << 20);
    assert_eq!(b.block_size(), 4096);
    assert!(b.volatile_write_cache());
    drop(b);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 1 << 20);
    // An existing file keeps its length: a size= that disagrees is refused, not ignored.
    let err = open(&file_spec(&path, ",size=2M,bs=512")).unwrap_err();
    assert!(matches!(err, BackendError::Config(_)), "{err}");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 1 << 20);
    let b = open(&file_spec(&path, ",size=1M,bs=512")).unwrap();
    assert_eq!(b.capacity_bytes(), 1 << 20);
    assert_eq!(b.num_blocks(), 2048);
    drop(b);
    let b = open(&file_spec(&path, "")).unwrap();
    assert_eq!(b.num_blocks(), 256);
}

#[test]
fn empty_file_is_sized_when_asked() {
    let tmp = tempfile::NamedTempFile::new().unwrap();
    let err = open(&file_spec(tmp.path(), "")).unwrap_err();
    assert!(matches!(err, BackendError::Config(_)), "{err}");
    let b = open(&file_spec(tmp.path(), ",size=64K")).unwrap();
    assert_eq!(b.capacity_bytes(), 64 << 10);
}

#[test]
fn bad_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let odd = dir.path().join("odd.img");
    std::fs::write(&odd, vec![0u8; 4096 + 512]).unwrap();
    assert!(matches!(
        open(&file_spec(&odd, "")),
        Err(BackendError::Config(_))
    ));
    // 512-byte blocks fit it.
    assert_eq!(open(&file_spec(&odd, ",bs=512")).unwrap().num_blocks(), 9);
    // Missing file without size=: the error names the fix.
    match open(&file_spec(&dir.path().join("missing"), "")) {
        Err(BackendError::Config(m)) => assert!(m.contains("add size=SIZE"), "{m}"),
        other => panic!("unexpected {other:?}"),
    }
    // A directory.
    assert!(open(&file_spec(dir.path(), "")).is_err());
    // bdev: on a regular file.
    let err = open(&spec(&format!("bdev:{}", odd.display()))).unwrap_err();
    assert!(matches!(err, BackendError::Config(_)), "{err}");
}

fn write_flush_reopen(dir: &Path, opts: &str) {
    let path = dir.join("ns.img");
    let b = open(&file_spec(&path, &format!(",size=4M{opts}"))).unwrap();
    let bs = b.block_size() as usize;
    common::current_thread().block_on(async {
        let (res, _) = b.write(3, pattern_buf(1, 3, 100, bs)).await;
        res.unwrap();
        let (res, _) = b.write(500, pattern_buf(2, 500, 12, bs)).await;
        res.unwrap();
        b.write_zeroes(10, 4).await.unwrap();
        b.flush().await.unwrap();
    });
    drop(b);
    let data = std::fs::read(&path).unwrap();
    assert_eq!(data.len(), 4 << 20);
    let mut want = pattern_buf(1, 3, 100, bs).to_vec();
    want[7 * bs..11 * bs].fill(0);
    assert!(data[3 * bs..103 * bs] == want[..], "first write");
    assert!(data[500 * bs..512 * bs] == pattern_buf(2, 500, 12, bs)[..]);
    assert!(data[..3 * bs].iter().all(|&x| x == 0));
    // And through a new backend.
    let b = open(&file_spec(&path, opts)).unwrap();
    common::multi_thread(2).block_on(async {
        let (res, buf) = b.read(500, IoBuf::new(12 * bs)).await;
        res.unwrap();
        assert!(buf[..] == pattern_buf(2, 500, 12, bs)[..]);
    });
}

#[test]
fn flushed_writes_are_in_the_file_tmp() {
    let dir = tempfile::tempdir().unwrap();
    write_flush_reopen(dir.path(), "");
}

#[test]
fn flushed_writes_are_in_the_file_tmp_512() {
    let dir = tempfile::tempdir().unwrap();
    write_flush_reopen(dir.path(), ",bs=512");
}

#[test]
fn flushed_writes_are_in_the_file_shm() {
    // tmpfs: O_DIRECT may be refused (older kernels) and FALLOC_FL_ZERO_RANGE is.
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    write_flush_reopen(dir.path(), "");
}

#[test]
fn flushed_writes_are_in_the_file_blocking_engine() {
    let dir = tempfile::tempdir().unwrap();
    write_flush_reopen(dir.path(), ",engine=blocking");
}

#[test]
fn flushed_writes_are_in_the_file_buffered() {
    let dir = tempfile::tempdir().unwrap();
    write_flush_reopen(dir.path(), ",direct=off");
}

#[test]
fn reading_past_a_truncated_end_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ns.img");
    for opts in ["", ",engine=blocking"] {
        std::fs::remove_file(&path).ok();
        let b = open(&file_spec(&path, &format!(",size=64K{opts}"))).unwrap();
        // Someone else shrinks the file under the backend.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(32 << 10)
            .unwrap();
        common::current_thread().block_on(async {
            let (res, buf) = b.read(12, IoBuf::new(4096)).await;
            let err = res.unwrap_err();
            assert!(matches!(err, BackendError::Io { .. }), "{err}");
            assert_eq!(err.status_hint(), StatusHint::UnrecoveredReadError);
            assert_eq!(buf.len(), 4096);
        });
    }
}

#[test]
fn large_transfers() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(&file_spec(&dir.path().join("ns.img"), ",size=16M")).unwrap();
    common::current_thread().block_on(async {
        let (res, _) = b.write(0, pattern_buf(4, 0, 4096, 4096)).await;
        res.unwrap();
        let (res, buf) = b.read(0, IoBuf::new(16 << 20)).await;
        res.unwrap();
        assert!(buf[..] == pattern_buf(4, 0, 4096, 4096)[..]);
        // Deallocate is a hint: afterwards blocks read as old data or zeros.
        b.deallocate(16, 32).await.unwrap();
        let (res, buf) = b.read(16, IoBuf::new(32 * 4096)).await;
        res.unwrap();
        let old = pattern_buf(4, 16, 32, 4096);
        for i in 0..32 {
            let got = &buf[i * 4096..(i + 1) * 4096];
            assert!(got == &old[i * 4096..(i + 1) * 4096] || got.iter().all(|&x| x == 0));
        }
    });
}

/// Needs a scratch block device whose contents may be destroyed, named by
/// `BLOCKDEV_TEST_BDEV` (for example a loop device: `losetup -f --show img`).
#[test]
#[ignore = "needs a scratch block device in BLOCKDEV_TEST_BDEV"]
fn block_device() {
    let dev = std::env::var("BLOCKDEV_TEST_BDEV").expect("BLOCKDEV_TEST_BDEV");
    let b = open(&spec(&format!("bdev:{dev}"))).unwrap();
    assert_eq!(b.kind(), "bdev");
    let AnyBackend::File(f) = &b else { panic!() };
    assert!(f.is_block_device());
    let bs = b.block_size() as usize;
    let n = b.num_blocks();
    assert!(n > 16);
    common::current_thread().block_on(async {
        let (res, _) = b.write(n - 8, pattern_buf(8, n - 8, 8, bs)).await;
        res.unwrap();
        b.flush().await.unwrap();
        let (res, buf) = b.read(n - 8, IoBuf::new(8 * bs)).await;
        res.unwrap();
        assert!(buf[..] == pattern_buf(8, n - 8, 8, bs)[..]);
        b.write_zeroes(n - 6, 2).await.unwrap();
        let (res, buf) = b.read(n - 6, IoBuf::new(2 * bs)).await;
        res.unwrap();
        assert!(buf.iter().all(|&x| x == 0));
        b.deallocate(n - 8, 8).await.unwrap();
        let (res, _) = b.read(n - 1, IoBuf::new(2 * bs)).await;
        assert!(matches!(res, Err(BackendError::OutOfRange { .. })));
    });
    // The same device through file: works too.
    let f = FileBackend::open(&FileSpec::new(&dev)).unwrap();
    assert!(f.is_block_device());
    assert_eq!(f.num_blocks(), n);
}
