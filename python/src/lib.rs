//! The `nvmeof._nvmeof` extension of the `nvmeof` Python package: a thin binding over the
//! `nvmeof-initiator` crate (the package re-exports it; `nvmeof.torch` is Python over it).
//!
//! Every protocol decision stays in the initiator; this crate turns Python arguments into
//! initiator calls, runs them on a Tokio runtime owned by the controller with the GIL released,
//! and turns initiator errors into Python exceptions. It is an FFI crate: the buffer protocol
//! (`PyObject_GetBuffer`) lends it raw pointers into Python objects, so it has `unsafe` blocks,
//! each with its SAFETY argument.

use std::ffi::c_char;
use std::mem::ManuallyDrop;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use nvmeof_initiator as ini;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

/// The subsystem `nvmeof-targetd` serves when started without arguments.
const DEFAULT_SUBNQN: &str = "nqn.2026-11.io.nvmeof-direct:default";

create_exception!(
    nvmeof,
    Error,
    PyException,
    "Base class of every error raised by nvmeof."
);
create_exception!(
    nvmeof,
    NvmeError,
    Error,
    "A command completed with an NVMe error status: see .sct, .sc and .dnr."
);
create_exception!(
    nvmeof,
    ConnectionError,
    Error,
    "The connection to the target failed, was lost, or timed out."
);

/// Turns an initiator error into a Python exception with a one-line message.
fn py_err(e: ini::Error) -> PyErr {
    let msg = e.to_string().replace('\n', " ");
    if let Some(st) = e.status() {
        return Python::with_gil(|py| {
            let err = NvmeError::new_err(msg);
            let v = err.value(py);
            let _ = v.setattr("sct", st.sct);
            let _ = v.setattr("sc", st.sc);
            let _ = v.setattr("dnr", st.dnr);
            err
        });
    }
    match e {
        ini::Error::InvalidArgument(_) => PyValueError::new_err(msg),
        e if e.is_transport() || e.is_timeout() => ConnectionError::new_err(msg),
        ini::Error::Tls { .. } | ini::Error::Auth { .. } | ini::Error::ControllerFailed { .. } => {
            ConnectionError::new_err(msg)
        }
        _ => Error::new_err(msg),
    }
}

/// Connection parameters: what `connect()` takes, kept so that a worker process can connect
/// again (`Spec` is picklable).
#[pyclass(module = "nvmeof", frozen)]
#[derive(Clone, Debug)]
struct Spec {
    /// Target address (host name or IP).
    #[pyo3(get)]
    traddr: String,
    /// Target port.
    #[pyo3(get)]
    trsvcid: u16,
    /// Subsystem NQN.
    #[pyo3(get)]
    subnqn: String,
    /// Host NQN; None: the host's identity (/etc/nvme or the nvmeof state directory).
    #[pyo3(get)]
    hostnqn: Option<String>,
    /// I/O queues to ask for; None: one per core.
    #[pyo3(get)]
    queues: Option<u16>,
    /// DH-HMAC-CHAP host secret (`DHHC-1:...`), or None.
    dhchap_key: Option<String>,
    /// Connect, admin and I/O timeout in seconds.
    #[pyo3(get)]
    timeout: f64,
    /// "tcp" or "rdma".
    #[pyo3(get)]
    transport: String,
    /// NVMe/TCP TLS configured PSK (`NVMeTLSkey-1:01:...:`), or None for plain TCP.
    tls_key: Option<String>,
}

#[pymethods]
impl Spec {
    #[new]
    #[pyo3(signature = (traddr, trsvcid=ini::DEFAULT_PORT, subnqn=DEFAULT_SUBNQN.to_string(), hostnqn=None, queues=None, dhchap_key=None, timeout=10.0, transport="tcp".to_string(), tls_key=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        traddr: String,
        trsvcid: u16,
        subnqn: String,
        hostnqn: Option<String>,
        queues: Option<u16>,
        dhchap_key: Option<String>,
        timeout: f64,
        transport: String,
        tls_key: Option<String>,
    ) -> PyResult<Self> {
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(PyValueError::new_err(
                "timeout must be a positive number of seconds",
            ));
        }
        transport
            .parse::<ini::Transport>()
            .map_err(|e| PyValueError::new_err(format!("transport: {e}")))?;
        Ok(Spec {
            traddr,
            trsvcid,
            subnqn,
            hostnqn,
            queues,
            dhchap_key,
            timeout,
            transport,
            tls_key,
        })
    }

    /// Connects with these parameters (in this process).
    fn connect(&self, py: Python<'_>) -> PyResult<Controller> {
        Controller::open(py, self.clone())
    }

    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let cls = py.get_type::<Spec>();
        let args = (
            self.traddr.clone(),
            self.trsvcid,
            self.subnqn.clone(),
            self.hostnqn.clone(),
            self.queues,
            self.dhchap_key.clone(),
            self.timeout,
            self.transport.clone(),
            self.tls_key.clone(),
        );
        (cls, args).into_pyobject(py)
    }

    fn __repr__(&self) -> String {
        format!(
            "nvmeof.Spec({:?}, {}, {:?}, transport={:?})",
            self.traddr, self.trsvcid, self.subnqn, self.transport
        )
    }
}

impl Spec {
    fn options(&self) -> Result<ini::ConnectOptions, ini::Error> {
        let transport: ini::Transport = self.transport.parse()?;
        let addr =
            ini::TargetAddr::new(self.traddr.clone(), self.trsvcid).with_transport(transport);
        let host = match &self.hostnqn {
            Some(n) => ini::HostIdentity::new(n, *uuid_v4().as_bytes())?,
            None => ini::HostIdentity::load_or_create(&ini::default_state_dir())?,
        };
        let mut o = ini::ConnectOptions::new(addr, self.subnqn.clone(), host);
        o.io_queues = self.queues;
        let t = Duration::from_secs_f64(self.timeout);
        o.timeouts.connect = t;
        o.timeouts.admin = t;
        o.timeouts.io = t;
        if let Some(k) = &self.dhchap_key {
            o.dhchap = Some(ini::DhchapSecrets::parse(k, None)?);
        }
        if let Some(k) = &self.tls_key {
            o.tls = Some(ini::TlsOptions::parse(k)?);
        }
        Ok(o)
    }
}

/// A random host ID for an explicit host NQN (the target tells hosts apart by NQN and ID).
fn uuid_v4() -> uuid::Uuid {
    uuid::Uuid::new_v4()
}

/// What a live controller owns: its runtime and the initiator's handle.
struct Live {
    rt: tokio::runtime::Runtime,
    ctrl: ini::Controller,
}

/// State shared by a controller and its namespaces.
struct Shared {
    /// The process that connected; a forked child has none of the runtime's threads.
    pid: u32,
    /// `None` for an attachment of nvmeof-initd (its parameters stay with the daemon).
    spec: Option<Spec>,
    /// `None` once closed. I/O holds the read lock while it runs (GIL released); `close`
    /// takes the write lock, so it waits for I/O in flight.
    live: RwLock<Option<ManuallyDrop<Live>>>,
}

impl Shared {
    fn check_pid(&self) -> PyResult<()> {
        if self.pid != std::process::id() {
            return Err(Error::new_err(format!(
                "this controller was connected in process {}, not in this one (a fork); connect again in the child, e.g. with nvmeof.Spec.connect()",
                self.pid
            )));
        }
        Ok(())
    }

    /// Runs `f` on the live controller with the GIL released.
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Live) -> Result<T, ini::Error> + Send,
    ) -> PyResult<T> {
        self.check_pid()?;
        py.allow_threads(|| {
            let g = self.live.read().unwrap_or_else(|p| p.into_inner());
            match g.as_ref() {
                None => Err(Error::new_err("the controller is closed")),
                Some(live) => f(live).map_err(py_err),
            }
        })
    }
}

impl Shared {
    fn new(spec: Option<Spec>, rt: tokio::runtime::Runtime, ctrl: ini::Controller) -> Arc<Self> {
        Arc::new(Shared {
            pid: std::process::id(),
            spec,
            live: RwLock::new(Some(ManuallyDrop::new(Live { rt, ctrl }))),
        })
    }
}

/// The I/O runtime of one controller.
fn runtime() -> PyResult<tokio::runtime::Runtime> {
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(4);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name("nvmeof-py")
        .enable_all()
        .build()
        .map_err(|e| Error::new_err(format!("cannot start the I/O runtime: {e}")))
}

impl Drop for Shared {
    fn drop(&mut self) {
        let live = self
            .live
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(live) = live {
            if self.pid == std::process::id() {
                let live = ManuallyDrop::into_inner(live);
                let Live { rt, ctrl } = live;
                // A graceful shutdown, bounded by the shutdown and admin timeouts; other
                // Python threads run meanwhile.
                Python::with_gil(|py| {
                    py.allow_threads(move || {
                        let _ = rt.block_on(ctrl.disconnect());
                        drop(rt);
                    })
                });
            }
            // In a forked child the runtime's threads do not exist: joining them would hang,
            // so the parent's state is left alone (ManuallyDrop).
        }
    }
}

/// A connection to one NVMe-oF controller.
#[pyclass(module = "nvmeof", frozen)]
struct Controller {
    shared: Arc<Shared>,
}

impl Controller {
    fn open(py: Python<'_>, spec: Spec) -> PyResult<Controller> {
        let opts = spec.options().map_err(py_err)?;
        let rt = runtime()?;
        let ctrl = py
            .allow_threads(|| rt.block_on(ini::Controller::connect(opts)))
            .map_err(py_err)?;
        Ok(Controller {
            shared: Shared::new(Some(spec), rt, ctrl),
        })
    }

    fn ns(&self, py: Python<'_>, nsid: u32) -> PyResult<Namespace> {
        let ns = self
            .shared
            .run(py, |l| l.rt.block_on(l.ctrl.namespace(nsid)))?;
        Ok(Namespace {
            shared: self.shared.clone(),
            ns: ManuallyDrop::new(ns),
        })
    }
}

#[pymethods]
impl Controller {
    /// The parameters this controller was connected with (picklable); None for an
    /// nvmeof-initd attachment.
    #[getter]
    fn spec(&self) -> Option<Spec> {
        self.shared.spec.clone()
    }

    /// True once `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.shared
            .live
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    /// The active namespaces.
    #[getter]
    fn namespaces(&self, py: Python<'_>) -> PyResult<Vec<Namespace>> {
        let ids = self.shared.run(py, |l| Ok(l.ctrl.namespace_ids()))?;
        ids.into_iter().map(|id| self.ns(py, id)).collect()
    }

    /// The namespace `nsid` (identified now: an inactive one raises NvmeError).
    fn namespace(&self, py: Python<'_>, nsid: u32) -> PyResult<Namespace> {
        self.ns(py, nsid)
    }

    /// Disconnects (normal shutdown). Later calls raise nvmeof.Error; closing twice is harmless.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.shared.check_pid()?;
        let live = py.allow_threads(|| {
            self.shared
                .live
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .take()
        });
        if let Some(live) = live {
            let Live { rt, ctrl } = ManuallyDrop::into_inner(live);
            let r = py.allow_threads(move || {
                let r = rt.block_on(ctrl.disconnect());
                drop(rt);
                r
            });
            r.map_err(py_err)?;
        }
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _t: Option<PyObject>,
        _v: Option<PyObject>,
        _tb: Option<PyObject>,
    ) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        let closed = if self.closed() { " closed" } else { "" };
        match &self.shared.spec {
            Some(s) => format!(
                "<nvmeof.Controller {} {}:{}{closed}>",
                s.subnqn, s.traddr, s.trsvcid
            ),
            None => format!("<nvmeof.Controller (attachment){closed}>"),
        }
    }
}

/// A buffer lent by a Python object through the buffer protocol, released on drop.
struct Lent {
    view: Box<ffi::Py_buffer>,
}

// SAFETY: the view only holds pointers into the exporting object, which it keeps alive (it
// holds a reference), and the export pins the memory (a bytearray cannot be resized while
// exported). Only `Drop` touches the view again, and it takes the GIL to do so.
unsafe impl Send for Lent {}

impl Lent {
    /// Gets a C-contiguous buffer from `obj`; `writable` asks for a destination.
    fn get(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Lent> {
        // SAFETY: Py_buffer is plain data (pointers and integers); all zeroes is a valid
        // value, and PyObject_GetBuffer fills it in.
        let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
        // SAFETY: obj is a live object (we hold the GIL through the Bound), and view points
        // to writable memory of the right type.
        let rc = unsafe {
            ffi::PyObject_GetBuffer(
                obj.as_ptr(),
                &mut *view,
                ffi::PyBUF_STRIDES | ffi::PyBUF_FORMAT,
            )
        };
        if rc != 0 {
            let py = obj.py();
            let cause = PyErr::take(py);
            let name = obj
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "?".into());
            let err = PyTypeError::new_err(format!(
                "a buffer (bytearray, memoryview, NumPy array...) is required, not {name}"
            ));
            err.set_cause(py, cause);
            return Err(err);
        }
        let lent = Lent { view };
        if writable && lent.view.readonly != 0 {
            return Err(PyTypeError::new_err(
                "the destination buffer is read-only (use a bytearray, a writable memoryview or array)",
            ));
        }
        // SAFETY: the view was filled in by a successful PyObject_GetBuffer.
        if unsafe { ffi::PyBuffer_IsContiguous(&*lent.view, b'C' as c_char) } == 0 {
            return Err(PyValueError::new_err("the buffer is not C-contiguous"));
        }
        Ok(lent)
    }

    fn len(&self) -> usize {
        self.view.len as usize
    }

    /// The buffer's address, as an integer that crosses `allow_threads`.
    fn addr(&self) -> usize {
        self.view.buf as usize
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        Python::with_gil(|_| {
            // SAFETY: the view came from a successful PyObject_GetBuffer and is released
            // exactly once, with the GIL held.
            unsafe { ffi::PyBuffer_Release(&mut *self.view) }
        });
    }
}

/// A namespace of a controller: byte-addressed block I/O.
#[pyclass(module = "nvmeof", frozen)]
struct Namespace {
    shared: Arc<Shared>,
    /// Never dropped in a forked child (see `Shared`'s drop).
    ns: ManuallyDrop<ini::Namespace>,
}

impl Drop for Namespace {
    fn drop(&mut self) {
        if self.shared.pid == std::process::id() {
            // SAFETY: not a raw-memory operation: ManuallyDrop::drop is unsafe only because
            // the value must not be used again, and `self` is being dropped.
            unsafe { ManuallyDrop::drop(&mut self.ns) }
        }
    }
}

impl Namespace {
    /// Checks that `[offset, offset + len)` is block aligned and inside the namespace; returns
    /// the first block.
    fn range(&self, offset: u64, len: usize) -> PyResult<u64> {
        let bs = u64::from(self.ns.block_size());
        let len = len as u64;
        if offset % bs != 0 || len % bs != 0 {
            return Err(PyValueError::new_err(format!(
                "offset {offset} and length {len} must be multiples of the block size {bs}"
            )));
        }
        let size = self.ns.size_bytes();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(PyValueError::new_err(format!(
                "{len} bytes at offset {offset} lie outside the namespace ({size} bytes)"
            )));
        }
        Ok(offset / bs)
    }
}

#[pymethods]
impl Namespace {
    /// Namespace ID.
    #[getter]
    fn nsid(&self) -> u32 {
        self.ns.nsid()
    }

    /// Size in bytes.
    #[getter]
    fn size(&self) -> u64 {
        self.ns.size_bytes()
    }

    /// Logical block size in bytes.
    #[getter]
    fn block_size(&self) -> u32 {
        self.ns.block_size()
    }

    /// Size in logical blocks.
    #[getter]
    fn blocks(&self) -> u64 {
        self.ns.num_blocks()
    }

    /// Namespace UUID, or None when the controller reports none.
    #[getter]
    fn uuid(&self) -> Option<String> {
        self.ns.info().uuid.clone()
    }

    /// IEEE EUI-64 (hex), or None when zero.
    #[getter]
    fn eui64(&self) -> Option<String> {
        Some(self.ns.info().eui64.clone()).filter(|s| !s.is_empty())
    }

    /// Namespace GUID (hex), or None when zero.
    #[getter]
    fn nguid(&self) -> Option<String> {
        Some(self.ns.info().nguid.clone()).filter(|s| !s.is_empty())
    }

    /// Reads len(buffer) bytes at `offset` into a writable, C-contiguous buffer; returns the
    /// number of bytes read.
    fn read_into(&self, py: Python<'_>, buffer: &Bound<'_, PyAny>, offset: u64) -> PyResult<usize> {
        let dest = Lent::get(buffer, true)?;
        let lba = self.range(offset, dest.len())?;
        let (addr, len) = (dest.addr(), dest.len());
        let ns = &*self.ns;
        self.shared.run(py, |l| {
            // SAFETY: `dest` keeps the exported, writable, contiguous region of `len` bytes
            // at `addr` pinned until it drops after this call; the binding makes no other
            // reference to it while the read runs.
            let buf = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
            l.rt.block_on(ns.read(lba, buf))
        })?;
        drop(dest);
        Ok(len)
    }

    /// Reads `size` bytes at `offset` and returns them as bytes.
    fn pread<'py>(
        &self,
        py: Python<'py>,
        size: usize,
        offset: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let lba = self.range(offset, size)?;
        let mut v = vec![0u8; size];
        let ns = &*self.ns;
        self.shared
            .run(py, |l| l.rt.block_on(ns.read(lba, &mut v)))?;
        Ok(PyBytes::new(py, &v))
    }

    /// Writes the bytes of `data` (any C-contiguous buffer) at `offset`; returns the count.
    fn write(&self, py: Python<'_>, data: &Bound<'_, PyAny>, offset: u64) -> PyResult<usize> {
        let src = Lent::get(data, false)?;
        let lba = self.range(offset, src.len())?;
        let (addr, len) = (src.addr(), src.len());
        let ns = &*self.ns;
        self.shared.run(py, |l| {
            // SAFETY: `src` keeps the exported contiguous region of `len` bytes at `addr`
            // pinned until it drops after this call; it is only read.
            let buf = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
            l.rt.block_on(ns.write(lba, buf))
        })?;
        drop(src);
        Ok(len)
    }

    /// Flushes the namespace's volatile write cache.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let ns = &*self.ns;
        self.shared.run(py, |l| l.rt.block_on(ns.flush()))
    }

    /// Reads many ranges: `reads` is a list of (offset, length, dest) with `dest` a writable
    /// buffer of at least `length` bytes. Every read is submitted before any is waited for.
    fn read_batch(
        &self,
        py: Python<'_>,
        reads: Vec<(u64, usize, Bound<'_, PyAny>)>,
    ) -> PyResult<()> {
        let mut lent = Vec::with_capacity(reads.len());
        let mut jobs = Vec::with_capacity(reads.len());
        for (i, (offset, length, dest)) in reads.iter().enumerate() {
            let d = Lent::get(dest, true)?;
            if d.len() < *length {
                return Err(PyValueError::new_err(format!(
                    "read {i}: the destination holds {} bytes, fewer than {length}",
                    d.len()
                )));
            }
            let lba = self.range(*offset, *length)?;
            jobs.push((lba, d.addr(), *length));
            lent.push(d);
        }
        let mut spans: Vec<(usize, usize)> = jobs.iter().map(|j| (j.1, j.1 + j.2)).collect();
        spans.sort_unstable();
        if spans.windows(2).any(|w| w[1].0 < w[0].1) {
            return Err(PyValueError::new_err("destinations of a batch overlap"));
        }
        let ns = &*self.ns;
        self.shared.run(py, |l| {
            let ios = jobs.iter().map(|&(lba, addr, len)| {
                // SAFETY: each region is pinned by its `Lent` in `lent` until after this
                // call, writable and at least `len` bytes long, and no two overlap (checked
                // above), so each slice is the only reference to its bytes.
                let buf = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
                ns.read(lba, buf)
            });
            l.rt.block_on(futures_util::future::try_join_all(ios))
                .map(|_| ())
        })?;
        drop(lent);
        Ok(())
    }

    /// The controller this namespace belongs to.
    #[getter]
    fn controller(&self) -> Controller {
        Controller {
            shared: self.shared.clone(),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "<nvmeof.Namespace nsid={} size={} block_size={}>",
            self.ns.nsid(),
            self.ns.size_bytes(),
            self.ns.block_size()
        )
    }
}

/// Connects to an NVMe-oF subsystem and returns a Controller.
#[pyfunction]
#[pyo3(signature = (traddr, trsvcid=ini::DEFAULT_PORT, subnqn=DEFAULT_SUBNQN.to_string(), hostnqn=None, queues=None, dhchap_key=None, timeout=10.0, transport="tcp".to_string(), tls_key=None))]
#[allow(clippy::too_many_arguments)]
fn connect(
    py: Python<'_>,
    traddr: String,
    trsvcid: u16,
    subnqn: String,
    hostnqn: Option<String>,
    queues: Option<u16>,
    dhchap_key: Option<String>,
    timeout: f64,
    transport: String,
    tls_key: Option<String>,
) -> PyResult<Controller> {
    let spec = Spec::new(
        traddr, trsvcid, subnqn, hostnqn, queues, dhchap_key, timeout, transport, tls_key,
    )?;
    Controller::open(py, spec)
}

/// Opens the namespace of the nvmeof-initd attachment `name`, as the `nvmeof` CLI resolves a
/// NAME: the daemon gives the connection parameters (keys included) and this process connects
/// its own controller. `socket`: the daemon's socket, else `$NVMEOF_INITD_SOCKET` or the
/// default ones.
#[pyfunction]
#[pyo3(signature = (name, socket=None))]
fn attach(py: Python<'_>, name: String, socket: Option<std::path::PathBuf>) -> PyResult<Namespace> {
    let rt = runtime()?;
    let ns = py
        .allow_threads(|| {
            rt.block_on(async {
                match &socket {
                    Some(p) => ini::open_attached_at(p, &name).await,
                    None => ini::open_attached(&name).await,
                }
            })
        })
        .map_err(py_err)?;
    let ctrl = ns.controller().clone();
    Ok(Namespace {
        shared: Shared::new(None, rt, ctrl),
        ns: ManuallyDrop::new(ns),
    })
}

/// The `nvmeof` module.
#[pymodule]
#[pyo3(name = "_nvmeof")]
fn nvmeof_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_function(wrap_pyfunction!(connect, m)?)?;
    m.add_function(wrap_pyfunction!(attach, m)?)?;
    m.add_class::<Spec>()?;
    m.add_class::<Controller>()?;
    m.add_class::<Namespace>()?;
    m.add("Error", py.get_type::<Error>())?;
    m.add("NvmeError", py.get_type::<NvmeError>())?;
    m.add("ConnectionError", py.get_type::<ConnectionError>())?;
    m.add("DEFAULT_SUBNQN", DEFAULT_SUBNQN)?;
    Ok(())
}
