//! CUDA device memory, pinned staging, streams and dma-buf export through cudarc with dynamic loading.
#![forbid(unsafe_code)]
