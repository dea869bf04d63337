//! CUDA kernels (scatter, verify) for GPU-side data movement, compiled at run time.
#![forbid(unsafe_code)]
