//! nvmeof-bench: the DAS vs NVMe-oF load generator and criterion micro-benchmarks.
#![forbid(unsafe_code)]
