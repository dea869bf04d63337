//! Run-time loading of libibverbs and librdmacm.
//!
//! Binaries built with this crate never list an RDMA library as NEEDED: the libraries are
//! opened with `dlopen` the first time RDMA is used, so a host without rdma-core runs
//! everything else and gets [`Error::Unavailable`] from RDMA calls.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use libloading::Library;

use crate::Error;
use crate::sys::*;

/// The libibverbs entry points this crate calls.
pub(crate) struct Verbs {
    pub get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device,
    pub free_device_list: unsafe extern "C" fn(*mut *mut ibv_device),
    pub get_device_name: unsafe extern "C" fn(*mut ibv_device) -> *const c_char,
    pub open_device: unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context,
    pub close_device: unsafe extern "C" fn(*mut ibv_context) -> c_int,
    pub query_device: unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int,
    pub alloc_pd: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd,
    pub dealloc_pd: unsafe extern "C" fn(*mut ibv_pd) -> c_int,
    pub reg_mr: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr,
    /// `ibv_reg_dmabuf_mr` (rdma-core 34 and later).
    pub reg_dmabuf_mr:
        Option<unsafe extern "C" fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr>,
    pub dereg_mr: unsafe extern "C" fn(*mut ibv_mr) -> c_int,
    pub create_comp_channel: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel,
    pub destroy_comp_channel: unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int,
    pub create_cq: unsafe extern "C" fn(
        *mut ibv_context,
        c_int,
        *mut c_void,
        *mut ibv_comp_channel,
        c_int,
    ) -> *mut ibv_cq,
    pub destroy_cq: unsafe extern "C" fn(*mut ibv_cq) -> c_int,
    pub get_cq_event:
        unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int,
    pub ack_cq_events: unsafe extern "C" fn(*mut ibv_cq, c_uint),
    pub wc_status_str: unsafe extern "C" fn(c_int) -> *const c_char,
    _lib: Library,
}

/// The librdmacm entry points this crate calls.
pub(crate) struct Cm {
    pub create_event_channel: unsafe extern "C" fn() -> *mut rdma_event_channel,
    pub destroy_event_channel: unsafe extern "C" fn(*mut rdma_event_channel),
    pub create_id: unsafe extern "C" fn(
        *mut rdma_event_channel,
        *mut *mut rdma_cm_id,
        *mut c_void,
        c_int,
    ) -> c_int,
    pub destroy_id: unsafe extern "C" fn(*mut rdma_cm_id) -> c_int,
    pub bind_addr: unsafe extern "C" fn(*mut rdma_cm_id, *mut libc::sockaddr) -> c_int,
    pub listen: unsafe extern "C" fn(*mut rdma_cm_id, c_int) -> c_int,
    pub resolve_addr: unsafe extern "C" fn(
        *mut rdma_cm_id,
        *mut libc::sockaddr,
        *mut libc::sockaddr,
        c_int,
    ) -> c_int,
    pub resolve_route: unsafe extern "C" fn(*mut rdma_cm_id, c_int) -> c_int,
    pub get_cm_event:
        unsafe extern "C" fn(*mut rdma_event_channel, *mut *mut rdma_cm_event) -> c_int,
    pub ack_cm_event: unsafe extern "C" fn(*mut rdma_cm_event) -> c_int,
    pub create_qp:
        unsafe extern "C" fn(*mut rdma_cm_id, *mut ibv_pd, *mut ibv_qp_init_attr) -> c_int,
    pub destroy_qp: unsafe extern "C" fn(*mut rdma_cm_id),
    pub accept: unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_conn_param) -> c_int,
    pub connect: unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_conn_param) -> c_int,
    pub reject: unsafe extern "C" fn(*mut rdma_cm_id, *const c_void, u8) -> c_int,
    pub disconnect: unsafe extern "C" fn(*mut rdma_cm_id) -> c_int,
    pub migrate_id: unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_event_channel) -> c_int,
    pub event_str: unsafe extern "C" fn(c_int) -> *const c_char,
    _lib: Library,
}

/// Both libraries, loaded together.
pub(crate) struct Libs {
    pub verbs: Verbs,
    pub cm: Cm,
}

/// File names tried, in order (the runtime packages ship only the versioned names).
const VERBS_NAMES: [&str; 2] = ["libibverbs.so.1", "libibverbs.so"];
const CM_NAMES: [&str; 2] = ["librdmacm.so.1", "librdmacm.so"];

fn open(names: &[&str]) -> Result<Library, String> {
    let mut last = String::new();
    for name in names {
        // SAFETY: loading rdma-core's libraries runs their ELF constructors, which only set up
        // internal state (provider lists, locks); they do not depend on anything of ours.
        match unsafe { Library::new(*name) } {
            Ok(l) => return Ok(l),
            Err(e) => {
                // libloading keeps dlerror()'s text in the source.
                let detail = std::error::Error::source(&e)
                    .map(|s| s.to_string())
                    .unwrap_or_else(|| e.to_string());
                last = if detail.contains(name) {
                    detail
                } else {
                    format!("{name}: {detail}")
                };
            }
        }
    }
    Err(last)
}

macro_rules! sym {
    ($lib:expr, $name:literal) => {{
        // SAFETY: the symbol is declared in verbs.h / rdma_cma.h with exactly the signature of
        // the field it is stored in (see sys.rs for the argument types); the Library is kept in
        // the same struct, so the pointer never outlives the mapping.
        let s = unsafe { $lib.get($name.as_bytes()) }.map_err(|e| format!("{}: {e}", $name))?;
        *s
    }};
}

macro_rules! opt_sym {
    ($lib:expr, $name:literal) => {{
        // SAFETY: as for `sym!`; a missing symbol (older rdma-core) yields None.
        unsafe { $lib.get($name.as_bytes()) }.ok().map(|s| *s)
    }};
}

fn load_verbs() -> Result<Verbs, String> {
    let lib = open(&VERBS_NAMES)?;
    Ok(Verbs {
        get_device_list: sym!(lib, "ibv_get_device_list"),
        free_device_list: sym!(lib, "ibv_free_device_list"),
        get_device_name: sym!(lib, "ibv_get_device_name"),
        open_device: sym!(lib, "ibv_open_device"),
        close_device: sym!(lib, "ibv_close_device"),
        query_device: sym!(lib, "ibv_query_device"),
        alloc_pd: sym!(lib, "ibv_alloc_pd"),
        dealloc_pd: sym!(lib, "ibv_dealloc_pd"),
        reg_mr: sym!(lib, "ibv_reg_mr"),
        reg_dmabuf_mr: opt_sym!(lib, "ibv_reg_dmabuf_mr"),
        dereg_mr: sym!(lib, "ibv_dereg_mr"),
        create_comp_channel: sym!(lib, "ibv_create_comp_channel"),
        destroy_comp_channel: sym!(lib, "ibv_destroy_comp_channel"),
        create_cq: sym!(lib, "ibv_create_cq"),
        destroy_cq: sym!(lib, "ibv_destroy_cq"),
        get_cq_event: sym!(lib, "ibv_get_cq_event"),
        ack_cq_events: sym!(lib, "ibv_ack_cq_events"),
        wc_status_str: sym!(lib, "ibv_wc_status_str"),
        _lib: lib,
    })
}

fn load_cm() -> Result<Cm, String> {
    let lib = open(&CM_NAMES)?;
    Ok(Cm {
        create_event_channel: sym!(lib, "rdma_create_event_channel"),
        destroy_event_channel: sym!(lib, "rdma_destroy_event_channel"),
        create_id: sym!(lib, "rdma_create_id"),
        destroy_id: sym!(lib, "rdma_destroy_id"),
        bind_addr: sym!(lib, "rdma_bind_addr"),
        listen: sym!(lib, "rdma_listen"),
        resolve_addr: sym!(lib, "rdma_resolve_addr"),
        resolve_route: sym!(lib, "rdma_resolve_route"),
        get_cm_event: sym!(lib, "rdma_get_cm_event"),
        ack_cm_event: sym!(lib, "rdma_ack_cm_event"),
        create_qp: sym!(lib, "rdma_create_qp"),
        destroy_qp: sym!(lib, "rdma_destroy_qp"),
        accept: sym!(lib, "rdma_accept"),
        connect: sym!(lib, "rdma_connect"),
        reject: sym!(lib, "rdma_reject"),
        disconnect: sym!(lib, "rdma_disconnect"),
        migrate_id: sym!(lib, "rdma_migrate_id"),
        event_str: sym!(lib, "rdma_event_str"),
        _lib: lib,
    })
}

static LIBS: OnceLock<Result<Libs, String>> = OnceLock::new();

/// The loaded libraries, loading them on first use.
pub(crate) fn libs() -> Result<&'static Libs, Error> {
    LIBS.get_or_init(|| {
        const HINT: &str = "install rdma-core's libibverbs1, librdmacm1 and ibverbs-providers";
        let verbs = load_verbs().map_err(|e| format!("{e} ({HINT})"))?;
        let cm = load_cm().map_err(|e| format!("{e} ({HINT})"))?;
        Ok(Libs { verbs, cm })
    })
    .as_ref()
    .map_err(|e| Error::Unavailable(e.clone()))
}

/// Whether libibverbs and librdmacm can be loaded on this host.
pub fn available() -> bool {
    libs().is_ok()
}

/// Why libibverbs and librdmacm cannot be loaded on this host (None when they can).
pub fn unavailable_reason() -> Option<String> {
    match libs() {
        Ok(_) => None,
        Err(Error::Unavailable(why)) => Some(why),
        Err(e) => Some(e.to_string()),
    }
}

/// Converts a C string returned by the libraries into an owned string.
pub(crate) fn c_string(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the libraries return NUL-terminated static strings (names, status strings).
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_an_error_naming_it() {
        let e = open(&["libnvmeof-direct-missing.so.1"]).err().unwrap();
        assert!(e.contains("libnvmeof-direct-missing.so.1"), "{e}");
        assert_eq!(c_string(std::ptr::null()), "");
    }
}
