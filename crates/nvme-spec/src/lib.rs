//! NVMe and NVMe-oF wire formats: no I/O, no unsafe.
#![forbid(unsafe_code)]

pub mod tcp;
