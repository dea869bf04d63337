//! The `nvmeof._nvmeof` extension of the `nvmeof` Python package: a thin binding over the
//! `nvmeof-initiator` crate (the package re-exports it; `nvmeof.torch` is Python over it).
//!
//! Every protocol decision stays in the initiator; this crate turns Python arguments into
//! initiator calls, runs them on a Tokio runtime owned by the controller with the GIL released,
//! and turns initiator errors into Python exceptions. It is an FFI crate: the buffer protocol
//! (`PyObject_GetBuffer`) lends it raw pointers into Python objects, so it has `unsafe` blocks,
//! each with its SAFETY argument.

use std::ffi::c_char;
use std::future::Future;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

mod rings;

use nvmeof_initiator as ini;
use nvmeof_initiator::gpu::{GpuIoError, GpuStaging, StagingConfig, cuda};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyCFunction, PyCapsule, PyDict, PyTuple};

/// The subsystem `nvmeof-targetd` serves when started without arguments.
const DEFAULT_SUBNQN: &str = "nqn.2026-11.io.nvmeof-direct:default";

/// Queue pairs kept per controller by default: one, for the thread that reads (a DataLoader
/// worker process has one controller and one reading thread). A kept queue ID costs nothing
/// until a read uses it, and the target grants the shared queues first.
const DEFAULT_QUEUE_PAIRS: u16 = 1;

/// Read buffers a queue pair keeps between calls, in bytes at most.
const KEPT_BUFFER_BYTES: usize = 16 << 20;

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

/// Turns a CUDA error into a Python exception.
fn cuda_err(e: cuda::GpuError) -> PyErr {
    let msg = e.to_string().replace('\n', " ");
    if e.is_unavailable() {
        return Error::new_err(format!(
            "a CUDA destination needs a usable CUDA driver and device: {msg}"
        ));
    }
    match e {
        cuda::GpuError::NotDeviceMemory { .. } => {
            PyValueError::new_err(format!("CUDA destination: {msg}"))
        }
        _ => Error::new_err(format!("CUDA: {msg}")),
    }
}

/// Turns an error of the GPU staging path into a Python exception.
fn gpu_err(e: GpuIoError) -> PyErr {
    match e {
        GpuIoError::Io(e) => py_err(e),
        GpuIoError::Gpu(e) => cuda_err(e),
        e => Error::new_err(format!("CUDA: {}", e.to_string().replace('\n', " "))),
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
    /// I/O queue IDs kept for run-to-completion queue pairs, which blocking reads into host
    /// memory use (one per thread reading at once); 0: every read goes through the shared
    /// queues.
    #[pyo3(get)]
    queue_pairs: u16,
}

#[pymethods]
impl Spec {
    #[new]
    #[pyo3(signature = (traddr, trsvcid=ini::DEFAULT_PORT, subnqn=DEFAULT_SUBNQN.to_string(), hostnqn=None, queues=None, dhchap_key=None, timeout=10.0, transport="tcp".to_string(), tls_key=None, queue_pairs=DEFAULT_QUEUE_PAIRS))]
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
        queue_pairs: u16,
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
            queue_pairs,
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
            self.queue_pairs,
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
        o.queue_pairs = self.queue_pairs;
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
    /// CUDA state per device, made on the first CUDA destination of that device.
    gpu: Mutex<Vec<GpuDevice>>,
    /// Idle run-to-completion queue pairs. A blocking read into host memory takes one of its
    /// namespace (or opens one, while kept queue IDs are free), drives it on the calling
    /// thread and puts it back; with none to be had it goes through the shared queues.
    pairs: Mutex<Vec<Pair>>,
}

/// A run-to-completion queue pair of one namespace and the read buffers it reuses.
struct Pair {
    nsid: u32,
    qp: ini::BlockingQueuePair,
    bufs: Vec<Vec<u8>>,
}

impl Pair {
    /// A buffer of `len` bytes, reused when one is kept.
    fn buffer(&mut self, len: usize) -> Vec<u8> {
        match self.bufs.pop() {
            Some(mut b) => {
                b.resize(len, 0);
                b
            }
            None => vec![0u8; len],
        }
    }

    /// Keeps `buf` for later commands, within `KEPT_BUFFER_BYTES`.
    fn keep(&mut self, buf: Vec<u8>) {
        if (self.bufs.len() + 1) * buf.len() <= KEPT_BUFFER_BYTES {
            self.bufs.push(buf);
        }
    }

    /// Reads `jobs` -- (first block, host address, length) -- through the queue pair, at most
    /// `chunk` bytes per command, keeping the queue full; the data is copied to each address as
    /// its command completes. After an error nothing more is submitted, the commands in
    /// flight are waited for, and the first error is returned.
    ///
    /// The caller guarantees that each `[address, address + length)` is writable host memory
    /// that nothing else references during the call, and that the ranges do not overlap.
    fn read(
        &mut self,
        jobs: &[(u64, u64, usize)],
        block_size: usize,
        chunk: usize,
    ) -> Result<(), ini::Error> {
        let mut cmds: Vec<(u64, u64, usize)> = Vec::with_capacity(jobs.len());
        for &(lba, addr, len) in jobs {
            let mut at = 0;
            while at < len {
                let n = chunk.min(len - at);
                cmds.push((lba + (at / block_size) as u64, addr + at as u64, n));
                at += n;
            }
        }
        let depth = self.qp.get().depth();
        let mut next = 0;
        let mut first_err: Option<ini::Error> = None;
        let mut done: Vec<ini::Completion> = Vec::with_capacity(depth);
        loop {
            while first_err.is_none() && next < cmds.len() && self.qp.in_flight() < depth {
                let (lba, _, len) = cmds[next];
                let buf = self.buffer(len);
                if let Err(r) = self.qp.read(lba, buf, next as u64) {
                    self.keep(r.buf);
                    first_err = Some(r.error);
                    break;
                }
                next += 1;
            }
            if self.qp.in_flight() == 0 {
                break;
            }
            self.qp.wait(&mut done, 1, None);
            for c in done.drain(..) {
                match c.result {
                    Ok(()) => {
                        let (_, addr, len) = cmds[c.user_data as usize];
                        // SAFETY: the caller guarantees that `[addr, addr + len)` is writable
                        // host memory referenced by nothing else during this call; `c.buf`
                        // holds exactly `len` bytes (the read's length) and is a separate
                        // allocation.
                        unsafe {
                            std::ptr::copy_nonoverlapping(c.buf.as_ptr(), addr as *mut u8, len)
                        };
                    }
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
                self.keep(c.buf);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

/// Whether a queue pair that ended a call with `e` can serve later calls (it sets its
/// connection up again by itself after transport errors and timeouts; a failed or closed
/// controller fails it for good).
fn pair_reusable(e: &ini::Error) -> bool {
    e.status().is_some() || e.is_transport() || e.is_timeout()
}

/// What reads into one device's memory use: its primary context, the initiator's pinned
/// staging ring (single reads) and a pinned buffer that batches are received into.
struct GpuDevice {
    ctx: cuda::GpuContext,
    staging: GpuStaging,
    batch: Option<cuda::PinnedBuffer>,
}

impl GpuDevice {
    /// The state of device `ordinal`, made on first use.
    fn of(devs: &mut Vec<GpuDevice>, ordinal: usize) -> Result<&mut GpuDevice, GpuIoError> {
        let i = match devs.iter().position(|d| d.ctx.ordinal() == ordinal) {
            Some(i) => i,
            None => {
                let ctx = cuda::GpuContext::new(ordinal)?;
                let staging = GpuStaging::new(&ctx, StagingConfig::default())?;
                devs.push(GpuDevice {
                    ctx,
                    staging,
                    batch: None,
                });
                devs.len() - 1
            }
        };
        Ok(&mut devs[i])
    }

    /// A pinned buffer of at least `len` bytes for a batch.
    fn batch_buffer(&mut self, len: usize) -> Result<&mut cuda::PinnedBuffer, GpuIoError> {
        if self.batch.as_ref().is_none_or(|b| b.len() < len) {
            self.batch = None;
            self.batch = Some(
                self.ctx
                    .alloc_pinned(len.next_power_of_two().max(1 << 20))?,
            );
        }
        self.batch
            .as_mut()
            .ok_or_else(|| GpuIoError::InvalidArgument("no batch buffer".into()))
    }
}

impl Shared {
    /// True once the controller was closed.
    fn is_closed(&self) -> bool {
        self.live
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

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
    /// Reads `jobs` -- (first block, host address, length) -- of `ns` on a queue pair driven by
    /// this thread (the caller holds the live controller); `None` when no queue pair is to be
    /// had (none kept, all in use, or the controller is reconnecting): then the caller reads
    /// through the shared queues. The caller guarantees what [`Pair::read`] asks for.
    fn pair_read(
        &self,
        ns: &ini::Namespace,
        jobs: &[(u64, u64, usize)],
    ) -> Option<Result<(), ini::Error>> {
        if self.spec.as_ref().is_some_and(|s| s.queue_pairs == 0) {
            return None;
        }
        let nsid = ns.nsid();
        let taken = {
            let mut idle = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
            idle.iter()
                .position(|p| p.nsid == nsid)
                .map(|i| idle.swap_remove(i))
        };
        let mut pair = match taken {
            Some(p) => p,
            None => {
                let qp = match ini::BlockingQueuePair::open(ns) {
                    Ok(qp) => qp,
                    Err(ini::Error::InvalidArgument(_)) => {
                        // No kept queue ID is free; idle queue pairs of other namespaces may
                        // hold them: one is closed and its ID tried once more.
                        let other = {
                            let mut idle = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
                            idle.pop()
                        };
                        drop(other?);
                        ini::BlockingQueuePair::open(ns).ok()?
                    }
                    // Not connected now (reconnecting): the shared queues wait for it.
                    Err(_) => return None,
                };
                Pair {
                    nsid,
                    qp,
                    bufs: Vec::new(),
                }
            }
        };
        let bs = ns.block_size() as usize;
        let max = ns.controller().info().max_transfer_bytes as usize;
        // Whole blocks, at most 65536 of them (the command's 16-bit block count).
        let chunk = (max / bs).clamp(1, 1 << 16) * bs;
        let r = pair.read(jobs, bs, chunk);
        if r.as_ref().err().is_none_or(pair_reusable) {
            self.pairs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(pair);
        }
        Some(r)
    }

    /// Runs `f` on the live controller with the GIL released; `f` makes its own Python errors.
    fn run_py<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Live) -> PyResult<T> + Send,
    ) -> PyResult<T> {
        self.check_pid()?;
        py.allow_threads(|| {
            let g = self.live.read().unwrap_or_else(|p| p.into_inner());
            match g.as_ref() {
                None => Err(Error::new_err("the controller is closed")),
                Some(live) => f(live),
            }
        })
    }

    fn new(spec: Option<Spec>, rt: tokio::runtime::Runtime, ctrl: ini::Controller) -> Arc<Self> {
        Arc::new(Shared {
            pid: std::process::id(),
            spec,
            live: RwLock::new(Some(ManuallyDrop::new(Live { rt, ctrl }))),
            gpu: Mutex::new(Vec::new()),
            pairs: Mutex::new(Vec::new()),
        })
    }
}

/// The I/O runtime of one controller: a worker thread per I/O queue asked for (4 when not
/// said), at most one per core, so every queue (and the GPU rings it serves) has a thread.
fn runtime(queues: Option<u16>) -> PyResult<tokio::runtime::Runtime> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let workers = queues.map_or(4, usize::from).clamp(1, cores);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name("nvmeof-py")
        .enable_all()
        .build()
        .map_err(|e| Error::new_err(format!("cannot start the I/O runtime: {e}")))
}

impl Drop for Shared {
    fn drop(&mut self) {
        let gpu = std::mem::take(self.gpu.get_mut().unwrap_or_else(|p| p.into_inner()));
        if self.pid == std::process::id() {
            drop(gpu);
        } else {
            // CUDA contexts do not survive fork: the child leaves the parent's alone.
            std::mem::forget(gpu);
        }
        let pairs = std::mem::take(self.pairs.get_mut().unwrap_or_else(|p| p.into_inner()));
        if self.pid == std::process::id() {
            drop(pairs);
        } else {
            // Their runtimes and connections belong to the parent.
            std::mem::forget(pairs);
        }
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
        let rt = runtime(spec.queues)?;
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
        self.shared.is_closed()
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

    /// Request rings through which GPU threads issue their own reads of the namespaces
    /// `nsids` (default: every active one), served by this controller's I/O queues. Kernels
    /// include `nvmf_gpu.cuh` (`nvmeof.include_dir()`) and take the rings' descriptor table
    /// (`cupy.asarray(rings)`); ring namespace index `i` reads `nsids[i]`. `rings`: how many
    /// (default one per I/O queue); `slots`: per ring, a power of two (the most reads a ring
    /// has in flight); `slot_bytes`: the largest read of one request (default the first
    /// namespace's block size, at least 4096); `mode`: "pull" (the waiting threads copy from
    /// pinned host memory) or "push" (a copy kernel moves the data to each request's
    /// destination); `device`: the CUDA device ordinal.
    #[pyo3(signature = (nsids=None, rings=None, slots=256, slot_bytes=None, mode="pull", device=0))]
    #[allow(clippy::too_many_arguments)]
    fn gpu_rings(
        &self,
        py: Python<'_>,
        nsids: Option<Vec<u32>>,
        rings: Option<u32>,
        slots: u32,
        slot_bytes: Option<u32>,
        mode: &str,
        device: usize,
    ) -> PyResult<rings::GpuRings> {
        let nsids = match nsids {
            Some(n) => n,
            None => self.shared.run(py, |l| Ok(l.ctrl.namespace_ids()))?,
        };
        rings::GpuRings::open(
            py,
            self.shared.clone(),
            nsids,
            rings,
            slots,
            slot_bytes,
            mode,
            device,
        )
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
            // No call uses a queue pair now (calls hold the read lock while they do).
            let pairs =
                std::mem::take(&mut *self.shared.pairs.lock().unwrap_or_else(|p| p.into_inner()));
            let Live { rt, ctrl } = ManuallyDrop::into_inner(live);
            let r = py.allow_threads(move || {
                drop(pairs);
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

/// A destination in CUDA device memory, given through `__cuda_array_interface__` or DLPack.
struct CudaDest {
    /// Device address of the first byte.
    ptr: u64,
    len: usize,
    /// A stream whose queued work must finish before the memory is written (CAI v3's
    /// `stream`; `1`, the legacy default stream, for DLPack).
    stream: Option<u64>,
    /// The exporting object (or the DLPack capsule), alive until the read returns.
    _owner: PyObject,
}

/// DLPack's `DLDevice`.
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// DLPack's `DLDataType`.
#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// DLPack's `DLTensor`, the first member of `DLManagedTensor` (the unversioned capsule
/// `"dltensor"`).
#[repr(C)]
struct DlTensor {
    data: *mut std::ffi::c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// DLPack device types that are CUDA device memory (`kDLCUDA`, `kDLCUDAManaged`).
const DL_CUDA: [i32; 2] = [2, 13];

/// Checks that `shape` and `strides` (in units of `unit` bytes; None: C order) describe a
/// C-contiguous array of `itemsize`-byte items; returns its size in bytes.
fn contiguous_len(
    shape: &[i64],
    strides: Option<&[i64]>,
    itemsize: usize,
    unit: usize,
) -> PyResult<usize> {
    if shape.iter().any(|&d| d < 0) {
        return Err(PyValueError::new_err(format!("negative shape {shape:?}")));
    }
    let count = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d as usize))
        .and_then(|n| n.checked_mul(itemsize))
        .ok_or_else(|| PyValueError::new_err(format!("shape {shape:?} overflows")))?;
    if let (Some(strides), true) = (strides, count > 0) {
        if strides.len() != shape.len() {
            return Err(PyValueError::new_err("strides and shape differ in length"));
        }
        let mut expect = itemsize as i128;
        for (&d, &st) in shape.iter().zip(strides).rev() {
            if d != 1 && i128::from(st) * unit as i128 != expect {
                return Err(PyValueError::new_err(
                    "the CUDA destination is not C-contiguous",
                ));
            }
            expect *= i128::from(d);
        }
    }
    Ok(count)
}

impl CudaDest {
    /// The destination `obj` describes with `__cuda_array_interface__`, if it has one, and the
    /// interface's version.
    fn from_cai(obj: &Bound<'_, PyAny>) -> PyResult<Option<(CudaDest, i64)>> {
        let py = obj.py();
        // Objects that do not live on a GPU have no such attribute (PyTorch raises for CPU
        // tensors): any failure means "not a CUDA array".
        let Ok(cai) = obj.getattr(pyo3::intern!(py, "__cuda_array_interface__")) else {
            return Ok(None);
        };
        let bad = |what: &str| PyValueError::new_err(format!("__cuda_array_interface__: {what}"));
        let d = cai
            .downcast::<PyDict>()
            .map_err(|_| PyTypeError::new_err("__cuda_array_interface__ is not a dict"))?;
        let item = |k: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
            Ok(d.get_item(k)?.filter(|v| !v.is_none()))
        };
        let version: i64 = item("version")?
            .map(|v| v.extract())
            .transpose()
            .map_err(|_| bad("version is not an integer"))?
            .unwrap_or(0);
        let shape: Vec<i64> = item("shape")?
            .ok_or_else(|| bad("no shape"))?
            .extract()
            .map_err(|_| bad("shape is not a tuple of integers"))?;
        let typestr: String = item("typestr")?
            .ok_or_else(|| bad("no typestr"))?
            .extract()
            .map_err(|_| bad("typestr is not a string"))?;
        let itemsize = typestr
            .get(2..)
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .ok_or_else(|| bad(&format!("typestr {typestr:?} has no item size")))?;
        let (ptr, readonly): (u64, bool) =
            item("data")?
                .ok_or_else(|| bad("no data"))?
                .extract()
                .map_err(|_| bad("data is not a (pointer, read-only) tuple"))?;
        if readonly {
            return Err(PyTypeError::new_err(
                "the destination is read-only (its __cuda_array_interface__ says so)",
            ));
        }
        if item("mask")?.is_some() {
            return Err(bad("masked arrays cannot be read into"));
        }
        let strides: Option<Vec<i64>> = item("strides")?
            .map(|s| s.extract())
            .transpose()
            .map_err(|_| bad("strides is not a tuple of integers"))?;
        let len = contiguous_len(&shape, strides.as_deref(), itemsize, 1)?;
        let stream = match item("stream")? {
            None => None,
            Some(v) => match v.extract::<i64>() {
                Ok(0) => {
                    return Err(bad(
                        "stream 0 is ambiguous (use 1 for the legacy default stream, 2 for the per-thread one)",
                    ));
                }
                Ok(n) if n > 0 => Some(n as u64),
                _ => return Err(bad("stream is not a positive integer")),
            },
        };
        let dest = CudaDest {
            ptr,
            len,
            stream,
            _owner: obj.clone().unbind(),
        };
        Ok(Some((dest, version)))
    }

    /// The destination `obj` exports through DLPack, if it is CUDA device memory.
    fn from_dlpack(obj: &Bound<'_, PyAny>) -> PyResult<Option<CudaDest>> {
        let py = obj.py();
        let Ok(device) = obj.call_method0(pyo3::intern!(py, "__dlpack_device__")) else {
            return Ok(None);
        };
        let Ok((device_type, _)) = device.extract::<(i32, i32)>() else {
            return Ok(None);
        };
        if !DL_CUDA.contains(&device_type) {
            return Ok(None);
        }
        // Ask the producer to order its pending work before the legacy default stream, which
        // is synchronized before the memory is written.
        let kwargs = PyDict::new(py);
        kwargs.set_item("stream", 1)?;
        let cap = match obj.call_method(pyo3::intern!(py, "__dlpack__"), (), Some(&kwargs)) {
            Ok(c) => c,
            Err(_) => obj.call_method0(pyo3::intern!(py, "__dlpack__"))?,
        };
        let capsule = cap
            .downcast::<PyCapsule>()
            .map_err(|_| PyTypeError::new_err("__dlpack__ did not return a capsule"))?;
        if capsule.name()? != Some(c"dltensor") {
            return Err(PyValueError::new_err(
                "__dlpack__ returned a capsule that is not an unused \"dltensor\"",
            ));
        }
        let t = capsule.pointer().cast::<DlTensor>();
        if t.is_null() {
            return Err(PyValueError::new_err(
                "__dlpack__ returned an empty capsule",
            ));
        }
        // SAFETY: a "dltensor" capsule holds a DLManagedTensor, whose first member is the
        // DLTensor laid out as `DlTensor`; the producer keeps it and the arrays it points to
        // valid until the capsule's destructor runs, and we hold the capsule.
        let t = unsafe { &*t };
        if !DL_CUDA.contains(&t.device.device_type) {
            return Err(PyValueError::new_err(
                "the DLPack tensor is not CUDA device memory",
            ));
        }
        let ndim = usize::try_from(t.ndim)
            .map_err(|_| PyValueError::new_err("DLPack tensor with negative ndim"))?;
        let bits = usize::from(t.dtype.bits) * usize::from(t.dtype.lanes);
        if bits == 0 || bits % 8 != 0 {
            return Err(PyValueError::new_err(format!(
                "DLPack items of {bits} bits are not whole bytes"
            )));
        }
        // `dtype.code` (integer, float...) does not matter: the read fills bytes.
        let _ = t.dtype.code;
        let (shape, strides): (Vec<i64>, Option<Vec<i64>>) = if ndim == 0 {
            (Vec::new(), None)
        } else {
            if t.shape.is_null() {
                return Err(PyValueError::new_err("DLPack tensor without a shape"));
            }
            // SAFETY: `shape` points to `ndim` integers and `strides`, when not null, too
            // (DLPack), valid while the capsule lives.
            let shape = unsafe { std::slice::from_raw_parts(t.shape, ndim) }.to_vec();
            let strides = (!t.strides.is_null())
                // SAFETY: as above.
                .then(|| unsafe { std::slice::from_raw_parts(t.strides, ndim) }.to_vec());
            (shape, strides)
        };
        let itemsize = bits / 8;
        let len = contiguous_len(&shape, strides.as_deref(), itemsize, itemsize)?;
        let ptr = (t.data as u64)
            .checked_add(t.byte_offset)
            .ok_or_else(|| PyValueError::new_err("DLPack data pointer overflows"))?;
        Ok(Some(CudaDest {
            ptr,
            len,
            stream: Some(1),
            _owner: capsule.clone().into_any().unbind(),
        }))
    }
}

/// A read destination: host memory lent through the buffer protocol, or CUDA memory.
enum Dest {
    Host(Lent),
    Cuda(CudaDest),
}

impl Dest {
    /// What `obj` offers: `__cuda_array_interface__` v3 (which names the stream to wait for),
    /// else DLPack on a CUDA device (the producer orders its work before the legacy default
    /// stream), else an older `__cuda_array_interface__` (PyTorch's is v2: no stream, so the
    /// legacy default stream is waited for), else a writable buffer.
    fn get(obj: &Bound<'_, PyAny>) -> PyResult<Dest> {
        // SAFETY: obj is a live object (we hold the GIL through the Bound).
        if unsafe { ffi::PyObject_CheckBuffer(obj.as_ptr()) } != 0 {
            // The buffer protocol lends host memory: no need to look for CUDA interfaces
            // (which cost an attribute lookup and a call each). CuPy arrays offer the
            // protocol only to refuse it: an object that refuses and has a CUDA interface is
            // taken as CUDA memory.
            match Lent::get(obj, true) {
                Ok(l) => return Ok(Dest::Host(l)),
                Err(e) => {
                    if !(obj.hasattr("__cuda_array_interface__")? || obj.hasattr("__dlpack__")?) {
                        return Err(e);
                    }
                }
            }
        }
        let cai = CudaDest::from_cai(obj)?;
        match cai {
            Some((d, version)) if version >= 3 => return Ok(Dest::Cuda(d)),
            _ => {}
        }
        if let Some(d) = CudaDest::from_dlpack(obj)? {
            return Ok(Dest::Cuda(d));
        }
        if let Some((mut d, _)) = cai {
            d.stream = d.stream.or(Some(1));
            return Ok(Dest::Cuda(d));
        }
        Lent::get(obj, true).map(Dest::Host)
    }

    fn len(&self) -> usize {
        match self {
            Dest::Host(l) => l.len(),
            Dest::Cuda(c) => c.len,
        }
    }

    fn addr(&self) -> u64 {
        match self {
            Dest::Host(l) => l.addr() as u64,
            Dest::Cuda(c) => c.ptr,
        }
    }
}

/// The integers of `obj`: a C-contiguous buffer of 64-bit integers (a NumPy uint64 or int64
/// array), else a sequence of ints.
fn offsets_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    // SAFETY: obj is a live object (we hold the GIL through the Bound).
    if unsafe { ffi::PyObject_CheckBuffer(obj.as_ptr()) } == 0 {
        return obj.extract::<Vec<u64>>().map_err(|e| {
            let py = obj.py();
            if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(py) {
                // A negative or too large int, as for the other calls' offsets.
                return e;
            }
            let err = PyTypeError::new_err(
                "offsets must be a buffer of 64-bit integers (a NumPy uint64 or int64 array) or a sequence of non-negative ints",
            );
            err.set_cause(py, Some(e));
            err
        });
    }
    let lent = Lent::get(obj, false)?;
    // SAFETY: the view was filled in by a successful PyObject_GetBuffer with PyBUF_FORMAT, so
    // `format` is null (unsigned bytes) or a NUL-terminated string.
    let format = unsafe {
        let f = lent.view.format;
        if f.is_null() {
            "B".to_string()
        } else {
            std::ffi::CStr::from_ptr(f).to_string_lossy().into_owned()
        }
    };
    // Native byte order: no prefix, '@' or '=' ('<' too on a little-endian host).
    let native = !format.starts_with('<') || cfg!(target_endian = "little");
    let code = format.trim_start_matches(['@', '=', '<']);
    let signed = match (code, lent.view.itemsize) {
        ("Q" | "L" | "N", 8) if native => false,
        ("q" | "l" | "n", 8) if native => true,
        _ => {
            return Err(PyTypeError::new_err(format!(
                "offsets must be 64-bit integers (uint64 or int64), not items of format {format:?} ({} bytes)",
                lent.view.itemsize
            )));
        }
    };
    let n = lent.len() / 8;
    let mut out = Vec::with_capacity(n);
    let base = lent.addr() as *const u8;
    for i in 0..n {
        let mut raw = [0u8; 8];
        // SAFETY: the exported contiguous region holds `n * 8` bytes at `base`, pinned while
        // `lent` lives; read as bytes, so its alignment does not matter.
        unsafe { std::ptr::copy_nonoverlapping(base.add(i * 8), raw.as_mut_ptr(), 8) };
        let v = u64::from_ne_bytes(raw);
        if signed && (v as i64) < 0 {
            return Err(PyValueError::new_err(format!(
                "offset {} (index {i}) is negative",
                v as i64
            )));
        }
        out.push(v);
    }
    Ok(out)
}

/// Waits for the streams CUDA destinations named (each once).
fn sync_streams(dev: &GpuDevice, dests: &[&CudaDest]) -> Result<(), GpuIoError> {
    let mut done: Vec<u64> = Vec::new();
    for s in dests.iter().filter_map(|d| d.stream) {
        if !done.contains(&s) {
            // SAFETY: the stream comes from the destination's exporter, which describes memory
            // of this device and names a stream of its context (or 1 / 2, the default
            // streams), as the interface requires.
            unsafe { dev.ctx.synchronize_raw_stream(s) }?;
            done.push(s);
        }
    }
    Ok(())
}

/// The device all `dests` live on (one batch reads into one device).
fn device_of(dests: &[&CudaDest]) -> Result<usize, GpuIoError> {
    let mut ordinal = None;
    for d in dests {
        let o = cuda::device_of_pointer(d.ptr)?;
        if ordinal.is_some_and(|p| p != o) {
            return Err(GpuIoError::InvalidArgument(
                "the CUDA destinations of one batch must be on one device".into(),
            ));
        }
        ordinal = Some(o);
    }
    ordinal.ok_or_else(|| GpuIoError::InvalidArgument("no CUDA destination".into()))
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

    /// Runs `work` on the controller's runtime and returns an asyncio future of the running
    /// loop that completes with `to_py` of its result (or its error). Cancelling the future
    /// aborts the work; closing the controller fails it.
    fn spawn<'py, T: Send + 'static>(
        &self,
        py: Python<'py>,
        work: impl Future<Output = Result<T, ini::Error>> + Send + 'static,
        to_py: fn(Python<'_>, T) -> PyResult<PyObject>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.shared.check_pid()?;
        let event_loop = py.import("asyncio")?.call_method0("get_running_loop")?;
        let fut = event_loop.call_method0("create_future")?;
        let settler = Settler {
            target: Some((event_loop.unbind(), fut.clone().unbind())),
        };
        let abort = {
            let g = self.shared.live.read().unwrap_or_else(|p| p.into_inner());
            let Some(live) = g.as_ref() else {
                let mut settler = settler;
                settler.target = None;
                return Err(Error::new_err("the controller is closed"));
            };
            live.rt
                .spawn(async move {
                    let mut settler = settler;
                    let r = work.await;
                    let r = Python::with_gil(|py| r.map_err(py_err).and_then(|v| to_py(py, v)));
                    settler.settle(r);
                })
                .abort_handle()
        };
        let on_done = PyCFunction::new_closure(
            py,
            None,
            None,
            move |args: &Bound<'_, PyTuple>, _kw: Option<&Bound<'_, PyDict>>| -> PyResult<()> {
                if args.get_item(0)?.call_method0("cancelled")?.is_truthy()? {
                    abort.abort();
                }
                Ok(())
            },
        )?;
        fut.call_method1("add_done_callback", (on_done,))?;
        Ok(fut)
    }

    /// Reads `jobs` -- (first block, address, length), `is_cuda[i]` telling whether job `i`
    /// writes CUDA memory of `cuda` -- with the GIL released. Host-only reads run on a queue
    /// pair driven by this thread when one is to be had, else through the shared queues; reads
    /// with CUDA destinations are staged through pinned memory.
    ///
    /// The caller checked the ranges, keeps every destination's exporter alive until this
    /// returns, and made sure that the destinations are writable, large enough and do not
    /// overlap.
    fn read_jobs(
        &self,
        py: Python<'_>,
        jobs: &[(u64, u64, usize)],
        is_cuda: &[bool],
        cuda: &[&CudaDest],
    ) -> PyResult<()> {
        let ns = &*self.ns;
        if cuda.is_empty() {
            let shared = &self.shared;
            return shared.run(py, |l| {
                if let Some(r) = shared.pair_read(ns, jobs) {
                    return r;
                }
                let reads = jobs.iter().map(|&(lba, addr, len)| {
                    // SAFETY: each region is pinned by its exporter, held by the caller until
                    // after this call, writable and at least `len` bytes long, and no two
                    // overlap (the caller checked), so each slice is the only reference to
                    // its bytes.
                    let buf = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
                    (lba, buf)
                });
                l.rt.block_on(ns.read_many(reads))
            });
        }
        let shared = &self.shared;
        shared.run_py(py, |l| {
            let read = || -> Result<(), GpuIoError> {
                let ordinal = device_of(cuda)?;
                let mut devs = shared.gpu.lock().unwrap_or_else(|p| p.into_inner());
                let dev = GpuDevice::of(&mut devs, ordinal)?;
                sync_streams(dev, cuda)?;
                // Reads into CUDA memory are received, all together with the host ones,
                // into one pinned buffer, then copied to their destinations on one stream.
                let staged: usize = jobs
                    .iter()
                    .zip(is_cuda)
                    .filter(|(_, c)| **c)
                    .map(|(j, _)| j.2)
                    .sum();
                let stream = dev.staging.stream().clone();
                let ctx = dev.ctx.clone();
                let pinned = dev.batch_buffer(staged.max(1))?;
                let mut copies = Vec::new();
                {
                    let mut rest = &mut pinned.as_mut_slice()?[..staged];
                    let mut at = 0usize;
                    let mut reads = Vec::with_capacity(jobs.len());
                    for (&(lba, addr, len), &c) in jobs.iter().zip(is_cuda) {
                        let buf: &mut [u8] = if c {
                            let (head, tail) = std::mem::take(&mut rest).split_at_mut(len);
                            rest = tail;
                            copies.push((at, addr, len));
                            at += len;
                            head
                        } else {
                            // SAFETY: as for host-only reads above.
                            unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
                        };
                        reads.push((lba, buf));
                    }
                    l.rt.block_on(ns.read_many(reads))?;
                }
                let mut bufs = Vec::with_capacity(copies.len());
                for &(at, addr, len) in &copies {
                    // SAFETY: each CUDA destination's exporter is held by the caller until
                    // this call returns, after the buffers drop; the driver checks the
                    // range; destinations do not overlap (the caller checked).
                    let mut buf = unsafe { ctx.borrow_device_memory(addr, len) }?;
                    stream.copy_h2d_async(&pinned.slice(at..at + len)?, &mut buf.as_slice_mut())?;
                    bufs.push(buf);
                }
                stream.synchronize()?;
                drop(bufs);
                Ok(())
            };
            read().map_err(gpu_err)
        })?;
        Ok(())
    }

    /// A host buffer for an asynchronous call (CUDA memory is read with the blocking calls).
    fn host_dest(obj: &Bound<'_, PyAny>) -> PyResult<Lent> {
        match Dest::get(obj)? {
            Dest::Host(l) => Ok(l),
            Dest::Cuda(_) => Err(PyTypeError::new_err(
                "the asynchronous calls take host buffers; read CUDA memory with read_into or read_batch",
            )),
        }
    }
}

/// Reads into a host buffer that Python exported, for the blocking and the asyncio calls;
/// returns its length. `dest` is dropped when the read has ended (or was dropped).
async fn read_host(ns: &ini::Namespace, lba: u64, dest: Lent) -> Result<usize, ini::Error> {
    let (addr, len) = (dest.addr(), dest.len());
    if len > 0 {
        // SAFETY: `dest` keeps the exported, writable, contiguous region of `len` bytes at
        // `addr` pinned until it drops at the end of this function, after the read completed
        // or was dropped (then the initiator no longer touches the slice); the binding makes
        // no other reference to it.
        let buf = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
        ns.read(lba, buf).await?;
    }
    drop(dest);
    Ok(len)
}

/// Completes an asyncio future from any thread, through its loop's `call_soon_threadsafe`;
/// dropped unfinished (the work was aborted, or the controller closed) it fails the future.
struct Settler {
    target: Option<(PyObject, PyObject)>,
}

impl Settler {
    fn settle(&mut self, r: PyResult<PyObject>) {
        let Some((event_loop, fut)) = self.target.take() else {
            return;
        };
        Python::with_gil(|py| {
            let (failed, value) = match r {
                Ok(v) => (false, v),
                Err(e) => (true, e.into_value(py).into_any()),
            };
            let settle = py
                .import("nvmeof._nvmeof")
                .and_then(|m| m.getattr("_settle"));
            if let Ok(settle) = settle {
                // A closed loop has nobody waiting: nothing to tell.
                let _ = event_loop
                    .bind(py)
                    .call_method1("call_soon_threadsafe", (settle, fut, failed, value));
            }
        });
    }
}

impl Drop for Settler {
    fn drop(&mut self) {
        if self.target.is_some() {
            self.settle(Err(Error::new_err(
                "the call did not complete: it was cancelled or the controller was closed",
            )));
        }
    }
}

/// Sets the result or exception of an asyncio future, unless it is done (cancelled).
#[pyfunction]
fn _settle(fut: &Bound<'_, PyAny>, failed: bool, value: &Bound<'_, PyAny>) -> PyResult<()> {
    if fut.call_method0("done")?.is_truthy()? {
        return Ok(());
    }
    let method = if failed {
        "set_exception"
    } else {
        "set_result"
    };
    fut.call_method1(method, (value,))?;
    Ok(())
}

fn int_to_py(py: Python<'_>, n: usize) -> PyResult<PyObject> {
    Ok(n.into_pyobject(py)?.into_any().unbind())
}

#[pymethods]
impl Namespace {
    /// asyncio form of `read_into` (host buffers): a future of the number of bytes read.
    fn read_into_async<'py>(
        &self,
        py: Python<'py>,
        buffer: &Bound<'_, PyAny>,
        offset: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.shared.check_pid()?;
        let dest = Self::host_dest(buffer)?;
        let lba = self.range(offset, dest.len())?;
        let ns = (*self.ns).clone();
        let work = async move { read_host(&ns, lba, dest).await };
        self.spawn(py, work, int_to_py)
    }

    /// asyncio form of `read_batch` (host buffers): a future of None.
    fn read_batch_async<'py>(
        &self,
        py: Python<'py>,
        reads: Vec<(u64, usize, Bound<'_, PyAny>)>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.shared.check_pid()?;
        let mut lent = Vec::with_capacity(reads.len());
        let mut jobs = Vec::with_capacity(reads.len());
        for (i, (offset, length, dest)) in reads.iter().enumerate() {
            let d = Self::host_dest(dest)?;
            if d.len() < *length {
                return Err(PyValueError::new_err(format!(
                    "read {i}: the destination holds {} bytes, fewer than {length}",
                    d.len()
                )));
            }
            let lba = self.range(*offset, *length)?;
            if *length > 0 {
                jobs.push((lba, d.addr(), *length));
                lent.push(d);
            }
        }
        let mut spans: Vec<(usize, usize)> = jobs.iter().map(|j| (j.1, j.1 + j.2)).collect();
        spans.sort_unstable();
        if spans.windows(2).any(|w| w[1].0 < w[0].1) {
            return Err(PyValueError::new_err("destinations of a batch overlap"));
        }
        let ns = (*self.ns).clone();
        let work = async move {
            let reads = jobs.iter().map(|&(lba, addr, len)| {
                // SAFETY: each region is pinned by its `Lent` in `lent` until it drops below,
                // after every read completed or was dropped; regions are writable, `len`
                // bytes long and do not overlap (checked above).
                let buf = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
                (lba, buf)
            });
            let r = ns.read_many(reads).await;
            drop(lent);
            r
        };
        self.spawn(py, work, |py, ()| Ok(py.None()))
    }

    /// asyncio form of `pread`: a future of bytes.
    fn pread_async<'py>(
        &self,
        py: Python<'py>,
        size: usize,
        offset: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.shared.check_pid()?;
        let lba = self.range(offset, size)?;
        let ns = (*self.ns).clone();
        let work = async move {
            let mut v = vec![0u8; size];
            ns.read_into(lba, &mut v).await?;
            Ok(v)
        };
        self.spawn(py, work, |py, v| {
            Ok(PyBytes::new(py, &v).into_any().unbind())
        })
    }

    /// asyncio form of `write`: a future of the number of bytes written.
    fn write_async<'py>(
        &self,
        py: Python<'py>,
        data: &Bound<'_, PyAny>,
        offset: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.shared.check_pid()?;
        let src = Lent::get(data, false)?;
        let lba = self.range(offset, src.len())?;
        let ns = (*self.ns).clone();
        let work = async move {
            let (addr, len) = (src.addr(), src.len());
            if len > 0 {
                // SAFETY: `src` keeps the exported contiguous region of `len` bytes at `addr`
                // pinned until it drops below; it is only read.
                let buf = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
                ns.write(lba, buf).await?;
            }
            drop(src);
            Ok(len)
        };
        self.spawn(py, work, int_to_py)
    }

    /// asyncio form of `flush`: a future of None.
    fn flush_async<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.shared.check_pid()?;
        let ns = (*self.ns).clone();
        self.spawn(py, async move { ns.flush().await }, |py, ()| Ok(py.None()))
    }

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

    /// Reads len(buffer) bytes at `offset` into a writable, C-contiguous buffer or CUDA
    /// array; returns the number of bytes read.
    fn read_into(&self, py: Python<'_>, buffer: &Bound<'_, PyAny>, offset: u64) -> PyResult<usize> {
        let dest = Dest::get(buffer)?;
        let lba = self.range(offset, dest.len())?;
        let ns = &*self.ns;
        match dest {
            Dest::Host(dest) if dest.len() == 0 => Ok(0),
            Dest::Host(dest) => {
                let len = dest.len();
                let jobs = [(lba, dest.addr() as u64, len)];
                let shared = &self.shared;
                shared.run(py, |l| match shared.pair_read(ns, &jobs) {
                    // `dest` keeps the memory exported until the closure returns.
                    Some(r) => r.map(|()| drop(dest)),
                    None => l.rt.block_on(read_host(ns, lba, dest)).map(drop),
                })?;
                Ok(len)
            }
            Dest::Cuda(d) => {
                if d.len > 0 {
                    let (ptr, len) = (d.ptr, d.len);
                    let shared = &self.shared;
                    let dref = &d;
                    shared.run_py(py, |l| {
                        let read = || -> Result<(), GpuIoError> {
                            let ordinal = cuda::device_of_pointer(ptr)?;
                            let mut devs = shared.gpu.lock().unwrap_or_else(|p| p.into_inner());
                            let dev = GpuDevice::of(&mut devs, ordinal)?;
                            sync_streams(dev, &[dref])?;
                            // SAFETY: `d` holds the exporting object, so the memory stays
                            // allocated until this call returns, after the buffer is dropped;
                            // the driver checked that the range is device memory of this
                            // device; the caller gave it to be written.
                            let mut buf = unsafe { dev.ctx.borrow_device_memory(ptr, len) }?;
                            l.rt.block_on(dev.staging.read(ns, lba, buf.as_slice_mut()))
                        };
                        read().map_err(gpu_err)
                    })?;
                }
                Ok(d.len)
            }
        }
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
        let jobs = [(lba, v.as_mut_ptr() as u64, size)];
        let ns = &*self.ns;
        let shared = &self.shared;
        shared.run(py, |l| {
            match (size > 0).then(|| shared.pair_read(ns, &jobs)).flatten() {
                Some(r) => r,
                None => l.rt.block_on(ns.read_into(lba, &mut v)),
            }
        })?;
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
    /// buffer or CUDA array of at least `length` bytes. Every read is submitted before any is
    /// waited for.
    fn read_batch(
        &self,
        py: Python<'_>,
        reads: Vec<(u64, usize, Bound<'_, PyAny>)>,
    ) -> PyResult<()> {
        let mut dests = Vec::with_capacity(reads.len());
        let mut jobs = Vec::with_capacity(reads.len());
        for (i, (offset, length, dest)) in reads.iter().enumerate() {
            let d = Dest::get(dest)?;
            if d.len() < *length {
                return Err(PyValueError::new_err(format!(
                    "read {i}: the destination holds {} bytes, fewer than {length}",
                    d.len()
                )));
            }
            let lba = self.range(*offset, *length)?;
            // Nothing to read for an empty range (and an empty destination may have no
            // address).
            if *length > 0 {
                jobs.push((lba, d.addr(), *length));
                dests.push(d);
            }
        }
        let mut spans: Vec<(u64, u64)> = jobs.iter().map(|j| (j.1, j.1 + j.2 as u64)).collect();
        spans.sort_unstable();
        if spans.windows(2).any(|w| w[1].0 < w[0].1) {
            return Err(PyValueError::new_err("destinations of a batch overlap"));
        }
        let is_cuda: Vec<bool> = dests.iter().map(|d| matches!(d, Dest::Cuda(_))).collect();
        let cuda: Vec<&CudaDest> = dests
            .iter()
            .filter_map(|d| match d {
                Dest::Cuda(c) => Some(c),
                Dest::Host(_) => None,
            })
            .collect();
        self.read_jobs(py, &jobs, &is_cuda, &cuda)?;
        drop(dests);
        Ok(())
    }

    /// Reads records of `size` bytes: record `i` at byte `offsets[i]` into bytes
    /// `i * size .. (i + 1) * size` of `dest`. `offsets` is a buffer of 64-bit integers (a
    /// NumPy uint64 or int64 array) or a sequence of ints; `dest` a writable buffer or CUDA
    /// array of at least `len(offsets) * size` bytes. Records that follow each other on the
    /// namespace and in `dest` are read with one command. Returns the number of bytes read.
    fn read_records(
        &self,
        py: Python<'_>,
        offsets: &Bound<'_, PyAny>,
        size: usize,
        dest: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let offsets = offsets_of(offsets)?;
        let d = Dest::get(dest)?;
        let total = offsets
            .len()
            .checked_mul(size)
            .ok_or_else(|| PyValueError::new_err("len(offsets) * size overflows"))?;
        if d.len() < total {
            return Err(PyValueError::new_err(format!(
                "the destination holds {} bytes, fewer than {} records of {size}",
                d.len(),
                offsets.len()
            )));
        }
        if total == 0 {
            return Ok(0);
        }
        let bs = u64::from(self.ns.block_size());
        let mut jobs: Vec<(u64, u64, usize)> = Vec::with_capacity(offsets.len());
        let mut addr = d.addr();
        for &off in &offsets {
            let lba = self.range(off, size)?;
            match jobs.last_mut() {
                Some(last)
                    if last.0 + (last.2 as u64) / bs == lba && last.1 + last.2 as u64 == addr =>
                {
                    last.2 += size;
                }
                _ => jobs.push((lba, addr, size)),
            }
            addr += size as u64;
        }
        let cuda = matches!(d, Dest::Cuda(_));
        let is_cuda = vec![cuda; jobs.len()];
        let cudas: Vec<&CudaDest> = match &d {
            Dest::Cuda(c) => vec![c],
            Dest::Host(_) => Vec::new(),
        };
        self.read_jobs(py, &jobs, &is_cuda, &cudas)?;
        drop(d);
        Ok(total)
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
#[pyo3(signature = (traddr, trsvcid=ini::DEFAULT_PORT, subnqn=DEFAULT_SUBNQN.to_string(), hostnqn=None, queues=None, dhchap_key=None, timeout=10.0, transport="tcp".to_string(), tls_key=None, queue_pairs=DEFAULT_QUEUE_PAIRS))]
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
    queue_pairs: u16,
) -> PyResult<Controller> {
    let spec = Spec::new(
        traddr,
        trsvcid,
        subnqn,
        hostnqn,
        queues,
        dhchap_key,
        timeout,
        transport,
        tls_key,
        queue_pairs,
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
    let rt = runtime(None)?;
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
    m.add_function(wrap_pyfunction!(_settle, m)?)?;
    m.add_class::<Spec>()?;
    m.add_class::<Controller>()?;
    m.add_class::<Namespace>()?;
    m.add_class::<rings::GpuRings>()?;
    m.add("Error", py.get_type::<Error>())?;
    m.add("NvmeError", py.get_type::<NvmeError>())?;
    m.add("ConnectionError", py.get_type::<ConnectionError>())?;
    m.add("DEFAULT_SUBNQN", DEFAULT_SUBNQN)?;
    m.add("GPU_DESTINATIONS", true)?;
    m.add("NVMF_GPU_CUH", ini::gpu::kernels::ring::HEADER)?;
    Ok(())
}
