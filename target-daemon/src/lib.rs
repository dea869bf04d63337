//! The nvmeof-direct NVMe-oF target: subsystems, controllers, command handlers, transports, and the nvmeof-targetd daemon.
#![forbid(unsafe_code)]
