//! Sans-IO NVMe/TCP transport engine used by both the target and the host.
#![forbid(unsafe_code)]
