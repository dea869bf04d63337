//! Helpers shared by the integration tests.
#![allow(dead_code)]

use blockdev::IoBuf;

/// A current-thread runtime, as one reactor of the target uses.
pub fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A multi-thread runtime, as the load generator may use.
pub fn multi_thread(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .unwrap()
}

/// The content of block `lba` written with `seed`: differs per block and per seed.
pub fn block_pattern(seed: u8, lba: u64, block_size: usize) -> Vec<u8> {
    (0..block_size)
        .map(|j| (u64::from(seed) * 131 + lba * 7 + j as u64 % 253) as u8 ^ seed)
        .collect()
}

/// A buffer holding `blocks` blocks from `lba` written with `seed`.
pub fn pattern_buf(seed: u8, lba: u64, blocks: u64, block_size: usize) -> IoBuf {
    let mut buf = IoBuf::new(blocks as usize * block_size);
    for i in 0..blocks {
        let start = i as usize * block_size;
        buf[start..start + block_size].copy_from_slice(&block_pattern(seed, lba + i, block_size));
    }
    buf
}
