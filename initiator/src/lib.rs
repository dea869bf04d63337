//! The nvmeof-direct user-space NVMe-oF initiator library, the nvmeof CLI and the nvmeof-initd daemon.
#![forbid(unsafe_code)]
