//! NVMe/TCP PDU headers (NVMe TCP Transport Specification).
