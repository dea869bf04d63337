//! Loading the CUDA driver library and turning `CUresult` codes into [`GpuError`]s.
//!
//! cudarc loads `libcuda.so` lazily and panics when it is missing or lacks a symbol. Every entry
//! point of this crate therefore goes through [`ensure_driver`] first: it checks that the library
//! can be opened, that the driver is at least CUDA 13.0 (so every symbol of the 13.0 bindings
//! exists) and runs `cuInit` once.

use std::ffi::CStr;
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::error::{GpuError, GpuResult};

/// Oldest driver API version the bindings are generated for (CUDA 13.0, driver 580).
pub const MIN_DRIVER_VERSION: i32 = 13000;

/// Facts about the loaded driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DriverInfo {
    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    pub version: i32,
    /// Number of CUDA devices.
    pub device_count: usize,
}

static DRIVER: OnceLock<GpuResult<DriverInfo>> = OnceLock::new();

/// Loads and initialises the CUDA driver once per process.
///
/// Returns [`GpuError::DriverNotFound`] when `libcuda.so` is absent, [`GpuError::DriverTooOld`]
/// for drivers older than CUDA 13.0 and [`GpuError::NoDevice`] when no device is present.
pub fn ensure_driver() -> GpuResult<DriverInfo> {
    DRIVER.get_or_init(load_driver).clone()
}

/// True when a usable CUDA driver with at least one device is present.
pub fn driver_available() -> bool {
    ensure_driver().is_ok()
}

fn load_driver() -> GpuResult<DriverInfo> {
    // SAFETY: `is_culib_present` only tries to dlopen the candidate library names and drops the
    // handles again; it has no preconditions.
    let present = unsafe { sys::is_culib_present() };
    if !present {
        return Err(GpuError::DriverNotFound);
    }
    let mut version = 0i32;
    // SAFETY: the library is present (checked above), `cuDriverGetVersion` exists in every
    // driver and writes one int through a valid pointer; it may be called before `cuInit`.
    let rc = unsafe { sys::cuDriverGetVersion(&mut version) };
    check(rc, "cuDriverGetVersion")?;
    if version < MIN_DRIVER_VERSION {
        return Err(GpuError::DriverTooOld {
            found: version,
            required: MIN_DRIVER_VERSION,
        });
    }
    // SAFETY: the driver is present and new enough for the bindings; flags must be 0.
    let rc = unsafe { sys::cuInit(0) };
    if rc == sys::cudaError_enum::CUDA_ERROR_NO_DEVICE {
        return Err(GpuError::NoDevice);
    }
    check(rc, "cuInit")?;
    let mut count = 0i32;
    // SAFETY: the driver is initialised; the out-pointer is valid.
    let rc = unsafe { sys::cuDeviceGetCount(&mut count) };
    check(rc, "cuDeviceGetCount")?;
    if count <= 0 {
        return Err(GpuError::NoDevice);
    }
    Ok(DriverInfo {
        version,
        device_count: usize::try_from(count).unwrap_or(0),
    })
}

/// Converts a `CUresult` into `Ok(())` or a [`GpuError::Driver`] naming `call`.
pub(crate) fn check(rc: sys::CUresult, call: &'static str) -> GpuResult<()> {
    if rc == sys::cudaError_enum::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(driver_error(rc, call))
    }
}

/// Builds a [`GpuError::Driver`] for a failed call.
pub(crate) fn driver_error(rc: sys::CUresult, call: &'static str) -> GpuError {
    let (name, description) = describe(rc);
    GpuError::Driver {
        call,
        code: rc as u32,
        name,
        description,
    }
}

fn describe(rc: sys::CUresult) -> (String, String) {
    // Only called with codes returned by driver calls, so the library is loaded.
    let mut name_ptr: *const std::ffi::c_char = std::ptr::null();
    let mut desc_ptr: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the library is loaded; both calls write a pointer to a static string (or leave
    // null for unknown codes) through valid out-pointers.
    let (r1, r2) = unsafe {
        (
            sys::cuGetErrorName(rc, &mut name_ptr),
            sys::cuGetErrorString(rc, &mut desc_ptr),
        )
    };
    let name = if r1 == sys::cudaError_enum::CUDA_SUCCESS && !name_ptr.is_null() {
        // SAFETY: the driver returned a pointer to a NUL-terminated static string.
        unsafe { CStr::from_ptr(name_ptr) }
            .to_string_lossy()
            .into_owned()
    } else {
        format!("{rc:?}")
    };
    let description = if r2 == sys::cudaError_enum::CUDA_SUCCESS && !desc_ptr.is_null() {
        // SAFETY: as above, a NUL-terminated static string owned by the driver.
        unsafe { CStr::from_ptr(desc_ptr) }
            .to_string_lossy()
            .into_owned()
    } else {
        String::from("no description")
    };
    (name, description)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unavailable_errors_are_classified() {
        assert!(GpuError::DriverNotFound.is_unavailable());
        assert!(GpuError::NoDevice.is_unavailable());
        assert!(
            GpuError::DriverTooOld {
                found: 12040,
                required: MIN_DRIVER_VERSION
            }
            .is_unavailable()
        );
        assert!(!GpuError::EmptyAllocation.is_unavailable());
    }

    #[test]
    fn driver_not_found_message_is_clear() {
        let msg = GpuError::DriverNotFound.to_string();
        assert!(msg.contains("CUDA driver not found (libcuda.so)"), "{msg}");
        assert!(msg.contains("GPU features unavailable"), "{msg}");
    }

    #[test]
    fn ensure_driver_never_panics_and_is_stable() {
        // Either outcome is fine; calling twice must give the same answer and never panic.
        let a = ensure_driver();
        let b = ensure_driver();
        assert_eq!(a, b);
        assert_eq!(driver_available(), a.is_ok());
    }
}
