//! Memory and null backends: sparseness, ranges, lengths, opening from specs.

mod common;

use blockdev::{AnyBackend, Backend, BackendError, BackendSpec, IoBuf, StatusHint, open};
use common::pattern_buf;

#[test]
fn one_tebibyte_namespace_is_sparse() {
    let spec: BackendSpec = "mem:1T,bs=512".parse().unwrap();
    let AnyBackend::Memory(mem) = open(&spec).unwrap() else {
        panic!("not a memory backend");
    };
    assert_eq!(mem.capacity_bytes(), 1 << 40);
    assert_eq!(mem.num_blocks(), (1 << 40) / 512);
    assert_eq!(mem.allocated_chunks(), 0);
    let last = mem.num_blocks() - 8;
    let middle = mem.num_blocks() / 2 + 3;
    common::current_thread().block_on(async {
        // Reading anywhere allocates nothing and returns zeros.
        let (res, buf) = mem.read(middle, pattern_buf(1, 0, 8, 512)).await;
        res.unwrap();
        assert!(buf.iter().all(|&b| b == 0));
        assert_eq!(mem.allocated_chunks(), 0);

        for (i, lba) in [0, middle, last].into_iter().enumerate() {
            let (res, _) = mem.write(lba, pattern_buf(i as u8, lba, 8, 512)).await;
            res.unwrap();
        }
        assert_eq!(mem.allocated_chunks(), 3);
        assert_eq!(mem.allocated_bytes(), 3 * mem.chunk_size() as u64);
        for (i, lba) in [0, middle, last].into_iter().enumerate() {
            let (res, buf) = mem.read(lba, IoBuf::new(8 * 512)).await;
            res.unwrap();
            assert!(buf[..] == pattern_buf(i as u8, lba, 8, 512)[..]);
        }
        // A write spanning a chunk boundary allocates both chunks.
        let per_chunk = (mem.chunk_size() / 512) as u64;
        let (res, _) = mem
            .write(10 * per_chunk - 1, pattern_buf(9, 0, 2, 512))
            .await;
        res.unwrap();
        assert_eq!(mem.allocated_chunks(), 5);

        // Deallocating the whole namespace frees everything, quickly.
        let started = std::time::Instant::now();
        mem.deallocate(0, mem.num_blocks()).await.unwrap();
        assert_eq!(mem.allocated_chunks(), 0);
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        let (res, buf) = mem.read(last, IoBuf::new(8 * 512)).await;
        res.unwrap();
        assert!(buf.iter().all(|&b| b == 0));

        // Write Zeroes never allocates.
        mem.write_zeroes(0, per_chunk * 3 + 5).await.unwrap();
        assert_eq!(mem.allocated_chunks(), 0);
    });
}

#[test]
fn out_of_range_and_bad_lengths() {
    let specs = ["mem:1M,bs=4096", "null:1M,bs=512"];
    for spec in specs {
        let b = open(&spec.parse().unwrap()).unwrap();
        let bs = b.block_size() as usize;
        let n = b.num_blocks();
        common::current_thread().block_on(async {
            // Last block: fine. One past: LBA Out of Range, and the buffer comes back.
            let (res, _) = b.write(n - 1, IoBuf::new(bs)).await;
            res.unwrap();
            let (res, buf) = b.read(n - 1, IoBuf::new(2 * bs)).await;
            let err = res.unwrap_err();
            assert!(matches!(err, BackendError::OutOfRange { lba, blocks: 2, capacity } if lba == n - 1 && capacity == n));
            assert_eq!(err.status_hint(), StatusHint::LbaOutOfRange);
            assert_eq!(buf.len(), 2 * bs);
            let (res, _) = b.write(n, IoBuf::new(bs)).await;
            assert!(matches!(res, Err(BackendError::OutOfRange { .. })));
            let (res, _) = b.read(u64::MAX, IoBuf::new(bs)).await;
            assert!(matches!(res, Err(BackendError::OutOfRange { .. })));
            assert!(matches!(
                b.write_zeroes(n - 1, 2).await,
                Err(BackendError::OutOfRange { .. })
            ));
            assert!(matches!(
                b.deallocate(u64::MAX - 1, 4).await,
                Err(BackendError::OutOfRange { .. })
            ));
            b.write_zeroes(n, 0).await.unwrap();

            // Lengths that are not whole blocks.
            let (res, _) = b.read(0, IoBuf::new(bs + 1)).await;
            let err = res.unwrap_err();
            assert!(matches!(err, BackendError::InvalidLength { .. }));
            assert_eq!(err.status_hint(), StatusHint::InvalidField);
            let (res, _) = b.write(0, IoBuf::new(0)).await;
            assert!(matches!(res, Err(BackendError::InvalidLength { .. })));
        });
    }
}

#[test]
fn null_discards_writes() {
    let b = open(&"null:512M".parse().unwrap()).unwrap();
    assert_eq!(b.kind(), "null");
    assert_eq!(b.block_size(), 4096);
    common::current_thread().block_on(async {
        let (res, _) = b.write(5, pattern_buf(3, 5, 4, 4096)).await;
        res.unwrap();
        // A dirty buffer comes back zero-filled.
        let (res, buf) = b.read(5, pattern_buf(7, 0, 4, 4096)).await;
        res.unwrap();
        assert!(buf.iter().all(|&x| x == 0));
        b.flush().await.unwrap();
    });
}

#[test]
fn open_rejects_bad_specs() {
    let bad = BackendSpec::Memory {
        size: 1000,
        block_size: 512,
    };
    assert!(matches!(open(&bad), Err(BackendError::Config(_))));
    let bad = BackendSpec::Null {
        size: 1 << 20,
        block_size: 300,
    };
    assert!(matches!(open(&bad), Err(BackendError::Config(_))));
}
