//! Helpers for GPU tests that must pass (as skipped) on machines without a CUDA driver.
//!
//! A GPU test asks for a context; when the driver (or NVRTC) is missing it prints one
//! `SKIP <test>: skipped: ...` line and returns early. Setting the environment variable
//! [`REQUIRE_ENV`] to `1` turns skipping into failure, so a run on a GPU machine cannot pass
//! by skipping.

use crate::error::GpuError;

/// Environment variable that makes missing GPU support a test failure.
pub const REQUIRE_ENV: &str = "NVMEOF_GPU_REQUIRE";

/// True when [`REQUIRE_ENV`] is set to `1`.
pub fn gpu_required() -> bool {
    std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1")
}

/// Decides whether a test that got `err` while setting up should be skipped; prints the SKIP
/// line when it should. Returns false for real failures and whenever [`REQUIRE_ENV`] is `1`.
pub fn should_skip(test: &str, err: &GpuError) -> bool {
    let reason = match err {
        e if e.is_unavailable() => "no CUDA driver",
        GpuError::NvrtcNotFound => "no NVRTC library",
        _ => return false,
    };
    if gpu_required() {
        println!("FAIL {test}: {reason} but {REQUIRE_ENV}=1 ({err})");
        return false;
    }
    println!("SKIP {test}: skipped: {reason} ({err})");
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_unavailability_skips() {
        if gpu_required() {
            return;
        }
        assert!(should_skip("t", &GpuError::DriverNotFound));
        assert!(should_skip("t", &GpuError::NoDevice));
        assert!(should_skip("t", &GpuError::NvrtcNotFound));
        assert!(!should_skip("t", &GpuError::EmptyAllocation));
        assert!(!should_skip("t", &GpuError::ContextMismatch));
    }
}
