//! nvmeof-bench: the DAS vs NVMe-oF load generator and criterion micro-benchmarks.
//!
//! The load generator runs one job in several modes side by side, in one run, on one
//! machine: `das` (the `blockdev` backend directly, in-process, no network), `tcp` (NVMe/TCP
//! through the `nvmeof-initiator` library to our target started in-process, to our target
//! binary started as a process, or to any NVMe/TCP target by address), `rdma=HOST:PORT`
//! (NVMe/RDMA through the same initiator to a target by address), and `iscsi` (iSCSI through
//! the workspace's `iscsi-initiator` to Debian's `tgt` started on this machine, or
//! `iscsi=HOST:PORT` to any iSCSI target). Knobs carry fio's names; every
//! read is checked against a seeded pattern so no speed is bought with wrong data. Results are
//! IOPS, bandwidth, latency percentiles from merged HdrHistograms, CPU-seconds of the target
//! and of the client, IOPS per core and the spread over namespaces, as JSON
//! ([`report::SCHEMA`]), a markdown table and SVG plots.
//!
//! | module | what |
//! |---|---|
//! | [`job`] | job files (TOML), sweeps, command-line overrides, the resolved [`job::Plan`] |
//! | [`pattern`] | the verify pattern (offset + seed per 512-byte block) |
//! | [`hist`] | latency histograms and their summaries |
//! | [`path`] | the I/O paths: DAS backends, NVMe/TCP through the initiator |
//! | [`gpu`] | the `gpu` destination: reads into GPU memory through pinned staging |
//! | [`gather`] | the turns of the reads that wait for batches (the `gpu` destination's gather) |
//! | [`fabric`] | starting or naming the target of the fabric modes |
//! | [`iscsi`] | the iscsi modes: tgt started here, the path through `iscsi-initiator` |
//! | [`worker`] | the workers that keep `iodepth` I/Os in flight |
//! | [`slots`] | a worker's I/O slot futures polled together, a waker per slot |
//! | [`run`] | the coordinator: phases, CPU accounting, measurements |
//! | [`cpu`] | per-thread CPU time from /proc, pinning |
//! | [`load`] | the busy-host CPU and memory-bandwidth load |
//! | [`report`] | JSON, markdown, medians over repeats, ratios to DAS |
//! | [`svg`] | latency-vs-load, scaling and DAS-vs-oF plots |
//!
//! The criterion benches (`cargo bench -p nvmeof-bench`) time the hot functions: PDU encode
//! and decode, CRC32C digests, command parsing, the submission path and an in-process
//! loopback read.
#![forbid(unsafe_code)]

pub mod cpu;
pub mod fabric;
pub mod gather;
pub mod gpu;
pub mod gpu_issue;
pub mod hist;
pub mod iscsi;
pub mod job;
pub mod lag;
pub mod load;
pub mod path;
pub mod pattern;
pub mod report;
pub mod run;
pub mod slots;
pub mod svg;
pub mod worker;

/// The job file `--quick` runs: DAS against NVMe/TCP loopback on a memory namespace.
pub const QUICK_JOB: &str = include_str!("../jobs/quick.toml");
