//! End-to-end tests with real processes and real peers (the Linux kernel host and target in a QEMU guest).
#![forbid(unsafe_code)]
