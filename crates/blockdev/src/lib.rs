//! Block storage backends for the target: memory, null, file and block device through io_uring.
#![forbid(unsafe_code)]
