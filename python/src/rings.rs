//! GPU-issued reads from Python: request rings in GPU-visible memory that the controller's I/O
//! queues serve, handed to kernels (CuPy `RawKernel`, or any CUDA code) as a descriptor table
//! that includes `nvmf_gpu.cuh` reads (see the package's `include_dir()`).

use std::sync::{Arc, Mutex};

use nvmeof_initiator as ini;
use nvmeof_initiator::gpu_ring::{DataMode, NsBinding, RingConfig, RingSet};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::{Error, GpuDevice, Shared, py_err};

/// The rings while attached: the attachment is dropped before the set, so the queue tasks let
/// go of the host sides before the memory goes.
struct Attached {
    rings: ini::AttachedRings,
    set: RingSet,
}

/// Request rings GPU threads read through (`Controller.gpu_rings()`).
///
/// The object exposes the rings' descriptor table (`struct nvmf_gpu_ring[nrings]` in device
/// memory) through `__cuda_array_interface__` as bytes, so `cupy.asarray(rings)` passes it to a
/// kernel as `const unsigned char*` without a copy. `close()` (or leaving a `with` block)
/// detaches the rings and frees them: no kernel may be using them then.
#[pyclass(module = "nvmeof", frozen)]
pub(crate) struct GpuRings {
    shared: Arc<Shared>,
    live: Mutex<Option<Attached>>,
    table_ptr: u64,
    table_len: usize,
    device: usize,
    nrings: usize,
    slots: u32,
    slot_bytes: u32,
    nsids: Vec<u32>,
}

impl GpuRings {
    /// Makes `nrings` rings on device `device` binding `nsids` (ring namespace index `i` is
    /// `nsids[i]`) and attaches them to the controller's I/O queues.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn open(
        py: Python<'_>,
        shared: Arc<Shared>,
        nsids: Vec<u32>,
        nrings: Option<u32>,
        slots: u32,
        slot_bytes: Option<u32>,
        mode: &str,
        device: usize,
    ) -> PyResult<GpuRings> {
        let mode = match mode {
            "pull" => DataMode::Pull,
            "push" => DataMode::Push,
            m => {
                return Err(PyValueError::new_err(format!(
                    "mode {m:?}: expected \"pull\" or \"push\""
                )));
            }
        };
        if nsids.is_empty() {
            return Err(PyValueError::new_err(
                "gpu_rings needs at least one namespace",
            ));
        }
        let kept = nsids.clone();
        let shared2 = shared.clone();
        let (attached, nrings, config) = shared.run_py(py, move |l| {
            let mut bindings = Vec::with_capacity(nsids.len());
            for &nsid in &nsids {
                let ns = l.rt.block_on(l.ctrl.namespace(nsid)).map_err(py_err)?;
                bindings.push(NsBinding {
                    nsid,
                    block_size: ns.block_size(),
                    blocks: ns.num_blocks(),
                });
            }
            let nrings = match nrings {
                Some(n) => n,
                None => l.ctrl.queue_stats().len().saturating_sub(1).max(1) as u32,
            };
            let config = RingConfig {
                slots,
                slot_bytes: slot_bytes.unwrap_or(bindings[0].block_size.max(4096)),
                mode,
            };
            let mut devs = shared2.gpu.lock().unwrap_or_else(|p| p.into_inner());
            let dev = GpuDevice::of(&mut devs, device).map_err(crate::gpu_err)?;
            let mut set = RingSet::new_gpu(&dev.ctx, nrings, config, &bindings)
                .map_err(|e| PyValueError::new_err(e.to_string().replace('\n', " ")))?;
            drop(devs);
            let rings =
                l.rt.block_on(l.ctrl.attach_gpu_rings(&mut set))
                    .map_err(py_err)?;
            Ok((Attached { rings, set }, nrings, config))
        })?;
        let table = attached
            .set
            .table_buffer()
            .ok_or_else(|| Error::new_err("the ring set has no device table"))?;
        let (table_ptr, table_len) = (table.device_ptr(), table.len());
        Ok(GpuRings {
            shared,
            live: Mutex::new(Some(attached)),
            table_ptr,
            table_len,
            device,
            nrings: nrings as usize,
            slots: config.slots,
            slot_bytes: config.slot_bytes,
            nsids: kept,
        })
    }
}

#[pymethods]
impl GpuRings {
    /// Number of rings.
    #[getter]
    fn nrings(&self) -> usize {
        self.nrings
    }

    /// Slots per ring: the most unwaited tickets a ring holds at once.
    #[getter]
    fn slots(&self) -> u32 {
        self.slots
    }

    /// Bytes of one slot's data area: the largest read one request may make.
    #[getter]
    fn slot_bytes(&self) -> u32 {
        self.slot_bytes
    }

    /// The namespaces bound to the rings, in ring index order (index `i` in a kernel's
    /// `nvmf_gpu_read(ring, i, ...)` reads namespace `nsids[i]`).
    #[getter]
    fn nsids(&self) -> Vec<u32> {
        self.nsids.clone()
    }

    /// The CUDA device the rings live on.
    #[getter]
    fn device(&self) -> usize {
        self.device
    }

    /// Device address of the descriptor table (`struct nvmf_gpu_ring*`).
    #[getter]
    fn table_ptr(&self) -> PyResult<u64> {
        self.check_open()?;
        Ok(self.table_ptr)
    }

    /// Size of the descriptor table in bytes.
    #[getter]
    fn table_len(&self) -> usize {
        self.table_len
    }

    /// True once `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    /// The descriptor table as a one-dimensional uint8 CUDA array (version 3 of the
    /// interface; no stream: the table is written before this object exists).
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.check_open()?;
        let d = PyDict::new(py);
        d.set_item("shape", (self.table_len,))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.table_ptr, true))?;
        d.set_item("strides", py.None())?;
        d.set_item("version", 3)?;
        Ok(d)
    }

    /// Detaches the rings from the controller's queues (reads in flight end first) and frees
    /// them. No kernel may use them any more; closing twice is harmless.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.shared.check_pid()?;
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some(Attached { rings, set }) = live else {
            return Ok(());
        };
        let r = self.shared.run_py(py, move |l| {
            l.rt.block_on(rings.detach());
            Ok(())
        });
        // Detached, or the controller is closed and its queue tasks (and their rings) ended.
        drop(set);
        r.or_else(|e| {
            if self.shared.is_closed() {
                Ok(())
            } else {
                Err(e)
            }
        })
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
        format!(
            "<nvmeof.GpuRings {} rings x {} slots of {} B on cuda:{}{closed}>",
            self.nrings, self.slots, self.slot_bytes, self.device
        )
    }
}

impl GpuRings {
    fn check_open(&self) -> PyResult<()> {
        if self.closed() {
            return Err(Error::new_err("the GPU rings are closed"));
        }
        Ok(())
    }
}

impl Drop for GpuRings {
    fn drop(&mut self) {
        let live = self
            .live
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(live) = live {
            if self.shared.pid == std::process::id() {
                // Dropping the attachment detaches without waiting; the queue tasks hold the
                // host sides until their reads end, the set's memory stays until then.
                drop(live);
            } else {
                // CUDA memory does not survive fork: the child leaves the parent's alone.
                std::mem::forget(live);
            }
        }
    }
}
