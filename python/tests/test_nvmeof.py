import os
import pathlib
import pickle

import numpy as np
import pytest

import nvmeof


def test_connect_and_namespaces(target):
    c = nvmeof.connect("127.0.0.1", target["port"], target["nqn"], queues=1)
    try:
        nss = c.namespaces
        assert [n.nsid for n in nss] == [1]
        n = nss[0]
        assert n.size == 16 << 20
        assert n.block_size in (512, 4096)
        assert n.blocks * n.block_size == n.size
        assert n.uuid is None or isinstance(n.uuid, str)
        assert not c.closed
        assert "Controller" in repr(c) and "Namespace" in repr(n)
    finally:
        c.close()
    assert c.closed
    c.close()  # twice is harmless


def test_write_pread_roundtrip(ns):
    bs = ns.block_size
    data = os.urandom(4 * bs)
    assert ns.write(data, 8 * bs) == len(data)
    ns.flush()
    assert ns.pread(4 * bs, 8 * bs) == data


def test_read_into_bytearray_memoryview_numpy(ns):
    bs = ns.block_size
    data = os.urandom(2 * bs)
    ns.write(bytearray(data), 0)
    b = bytearray(2 * bs)
    assert ns.read_into(b, 0) == 2 * bs
    assert bytes(b) == data
    big = bytearray(4 * bs)
    ns.read_into(memoryview(big)[bs:3 * bs], 0)
    assert bytes(big[bs:3 * bs]) == data
    a = np.zeros(2 * bs // 4, dtype=np.float32)
    ns.read_into(a, 0)
    assert a.tobytes() == data
    ns.write(np.frombuffer(data, dtype=np.uint8), bs * 2)
    assert ns.pread(2 * bs, 2 * bs) == data


def test_read_batch(ns):
    bs = ns.block_size
    blobs = [os.urandom(bs) for _ in range(8)]
    for i, b in enumerate(blobs):
        ns.write(b, (100 + i) * bs)
    dests = [bytearray(bs) for _ in blobs]
    ns.read_batch([((100 + i) * bs, bs, d) for i, d in enumerate(dests)])
    assert [bytes(d) for d in dests] == blobs
    arr = np.zeros((8, bs), dtype=np.uint8)
    ns.read_batch([((100 + i) * bs, bs, arr[i]) for i in range(8)])
    assert [arr[i].tobytes() for i in range(8)] == blobs
    ns.read_batch([])


def test_bad_input(ns):
    bs = ns.block_size
    with pytest.raises(ValueError, match="multiples of the block size"):
        ns.pread(bs, 1)
    with pytest.raises(ValueError, match="multiples of the block size"):
        ns.read_into(bytearray(bs + 1), 0)
    with pytest.raises(ValueError, match="outside the namespace"):
        ns.pread(bs, ns.size)
    with pytest.raises(ValueError, match="outside the namespace"):
        ns.write(bytes(2 * bs), ns.size - bs)
    with pytest.raises(TypeError, match="read-only"):
        ns.read_into(bytes(bs), 0)
    with pytest.raises(TypeError, match="read-only"):
        ns.read_into(memoryview(bytearray(bs)).toreadonly(), 0)
    with pytest.raises(TypeError, match="buffer"):
        ns.read_into("not a buffer", 0)
    with pytest.raises(TypeError, match="buffer"):
        ns.write(12, 0)
    with pytest.raises(ValueError, match="contiguous"):
        ns.read_into(np.zeros((2, bs), dtype=np.uint8)[:, 0], 0)
    with pytest.raises(ValueError, match="fewer than"):
        ns.read_batch([(0, 2 * bs, bytearray(bs))])
    b = bytearray(2 * bs)
    with pytest.raises(ValueError, match="overlap"):
        ns.read_batch([(0, bs, b), (0, bs, memoryview(b)[:bs])])
    with pytest.raises(OverflowError):
        ns.pread(bs, -bs)


def test_read_only_and_undersized_destinations(ns):
    bs = ns.block_size
    ro = np.zeros(bs, dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="read-only"):
        ns.read_into(ro, 0)
    with pytest.raises(TypeError, match="read-only"):
        ns.read_batch([(0, bs, bytearray(bs)), (bs, bs, ro)])
    with pytest.raises(TypeError, match="read-only"):
        ns.read_batch([(0, bs, bytes(bs))])
    assert not ro.any()
    with pytest.raises(ValueError, match="fewer than"):
        ns.read_batch([(0, bs, bytearray(bs)), (bs, 2 * bs, np.zeros(2 * bs - 1, np.uint8))])
    with pytest.raises(ValueError, match="fewer than"):
        ns.read_batch([(0, bs, bytearray(0))])
    # An undersized read_into is a read of fewer bytes: it must still be whole blocks.
    with pytest.raises(ValueError, match="multiples of the block size"):
        ns.read_into(bytearray(bs - 1), 0)


def test_nvme_status_error(ctrl):
    with pytest.raises(nvmeof.NvmeError) as e:
        ctrl.namespace(77)
    assert isinstance(e.value.sct, int) and isinstance(e.value.sc, int)
    assert isinstance(e.value.dnr, bool)
    assert "\n" not in str(e.value)


def test_connection_errors(target):
    with pytest.raises(ValueError, match="transport"):
        nvmeof.connect("127.0.0.1", target["port"], transport="carrier-pigeon")
    with pytest.raises(ValueError, match="timeout"):
        nvmeof.connect("127.0.0.1", target["port"], timeout=0)
    with pytest.raises(ValueError, match="TLS PSK"):
        nvmeof.connect("127.0.0.1", target["port"], tls_key="NVMeTLSkey-1:01:bogus:")
    with pytest.raises(ValueError, match="DHHC|secret|DH-HMAC"):
        nvmeof.connect("127.0.0.1", target["port"], dhchap_key="not-a-key")
    with pytest.raises(ValueError, match="NQN"):
        nvmeof.connect("127.0.0.1", target["port"], "not-an-nqn")
    # Nothing listens on port 1.
    with pytest.raises(nvmeof.ConnectionError):
        nvmeof.connect("127.0.0.1", 1, target["nqn"], timeout=5)
    with pytest.raises(nvmeof.Error):
        nvmeof.connect("127.0.0.1", target["port"], "nqn.2026-11.io.nvmeof-direct:nope", timeout=5)


def test_closed_controller(spec):
    c = spec.connect()
    n = c.namespace(1)
    with c:
        pass
    assert c.closed
    with pytest.raises(nvmeof.Error, match="closed"):
        n.pread(n.block_size, 0)
    with pytest.raises(nvmeof.Error, match="closed"):
        c.namespace(1)
    with pytest.raises(nvmeof.Error, match="closed"):
        n.flush()
    bs = n.block_size
    with pytest.raises(nvmeof.Error, match="closed"):
        n.read_into(bytearray(bs), 0)
    with pytest.raises(nvmeof.Error, match="closed"):
        n.write(bytes(bs), 0)
    with pytest.raises(nvmeof.Error, match="closed"):
        n.read_batch([(0, bs, bytearray(bs))])
    with pytest.raises(nvmeof.Error, match="closed"):
        c.namespaces


def test_spec_pickles_and_reconnects(spec):
    s2 = pickle.loads(pickle.dumps(spec))
    assert (s2.traddr, s2.trsvcid, s2.subnqn, s2.queues, s2.timeout, s2.transport) == (
        spec.traddr, spec.trsvcid, spec.subnqn, spec.queues, spec.timeout, spec.transport)
    with s2.connect() as c:
        assert c.spec.subnqn == spec.subnqn
        assert c.namespace(1).nsid == 1


def test_use_after_fork(ctrl, spec):
    ns = ctrl.namespace(1)
    bs = ns.block_size
    ns.write(b"\x5a" * bs, 0)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                ns.pread(bs, 0)
            except nvmeof.Error as e:
                if "fork" in str(e):
                    with spec.connect() as c2:
                        if c2.namespace(1).pread(bs, 0) == b"\x5a" * bs:
                            code = 0
        finally:
            os.write(w, bytes([code]))
            os._exit(code)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert got == b"\x00" and os.waitstatus_to_exitcode(status) == 0
    # The parent's controller is untouched.
    assert ns.pread(bs, 0) == b"\x5a" * bs


def test_attach(target, tmp_path):
    import subprocess
    import time
    from conftest import ROOT

    bindir = pathlib.Path(os.environ.get("NVMEOF_TARGETD", str(ROOT / "target/debug/x"))).parent
    sock = tmp_path / "initd.sock"
    env = {k: v for k, v in os.environ.items() if k != "NVMEOF_INITD_SOCKET"}
    initd = subprocess.Popen(
        [str(bindir / "nvmeof-initd"), "--socket", str(sock), "--state-dir", str(tmp_path / "state")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        for _ in range(300):
            assert initd.poll() is None, "nvmeof-initd exited"
            if sock.exists():
                break
            time.sleep(0.05)
        subprocess.run(
            [str(bindir / "nvmeof"), "attach", "data0", "-a", "127.0.0.1", "-s", str(target["port"]),
             "-n", target["nqn"], "--namespace-id", "1", "--socket", str(sock),
             "--state-dir", str(tmp_path / "state")],
            check=True, env=env, stdout=subprocess.DEVNULL)
        ns = nvmeof.attach("data0", socket=str(sock))
        bs = ns.block_size
        assert ns.nsid == 1 and ns.size == 16 << 20
        ns.write(b"\xa5" * bs, 3 * bs)
        assert ns.pread(bs, 3 * bs) == b"\xa5" * bs
        assert ns.controller.spec is None
        ns.controller.close()
        with pytest.raises(nvmeof.Error, match="closed"):
            ns.pread(bs, 0)
        with pytest.raises(nvmeof.Error, match="nope"):
            nvmeof.attach("nope", socket=str(sock))
    finally:
        initd.terminate()
        initd.wait()


def test_large_transfer_and_threads(ns):
    import threading

    bs = ns.block_size
    data = os.urandom(4 << 20)  # larger than one command's transfer
    ns.write(data, 0)
    out = np.empty(len(data), dtype=np.uint8)
    ns.read_into(out, 0)
    assert out.tobytes() == data

    errors = []

    def reader(i):
        try:
            for j in range(20):
                off = ((i * 20 + j) % 64) * bs
                if ns.pread(bs, off) != data[off:off + bs]:
                    errors.append((i, j))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_drop_without_close(spec):
    import gc

    c = spec.connect()
    n = c.namespace(1)
    del c, n
    gc.collect()
    with spec.connect() as c2:
        assert c2.namespace(1).nsid == 1


def test_child_drops_parents_controller(spec):
    import gc

    c = spec.connect()
    n = c.namespace(1)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            del c, n
            gc.collect()  # must neither hang nor touch the parent's connection
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert n.pread(n.block_size, 0) is not None
    c.close()


def _key(prefix, byte):
    import base64
    import struct
    import zlib

    raw = bytes([byte]) * 32
    return f"{prefix}:01:{base64.b64encode(raw + struct.pack('<I', zlib.crc32(raw))).decode()}:"


def test_tls_and_dhchap(tmp_path):
    import subprocess
    import socket as so
    import time
    from conftest import ROOT, free_port

    exe = os.environ.get("NVMEOF_TARGETD", str(ROOT / "target/debug/nvmeof-targetd"))
    tls_port, port = free_port(), free_port()
    nqn = "nqn.2026-11.io.nvmeof-direct:keys"
    host = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000c1"
    psk, dh = _key("NVMeTLSkey-1", 0x21), _key("DHHC-1", 0x31)
    cfg = tmp_path / "t.toml"
    cfg.write_text(f"""
[[listener]]
address = "tcp://127.0.0.1:{tls_port}"
tls = "required"

[[listener]]
address = "tcp://127.0.0.1:{port}"

[[subsystem]]
nqn = "{nqn}"

[[subsystem.host]]
nqn = "{host}"
tls_psk = "{psk}"
dhchap_key = "{dh}"

[[subsystem.namespace]]
backend = "mem:8M"
""")
    cfg.chmod(0o600)
    proc = subprocess.Popen([exe, "--config", str(cfg), "--control-socket", str(tmp_path / "c.sock")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            assert proc.poll() is None, "nvmeof-targetd exited"
            try:
                so.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        with nvmeof.connect("127.0.0.1", tls_port, nqn, hostnqn=host, tls_key=psk,
                            dhchap_key=dh, queues=1) as c:
            n = c.namespace(1)
            assert n.pread(n.block_size, 0) == bytes(n.block_size)
        # A host given a TLS key is refused on the plain listener, with its NVMe status.
        with pytest.raises(nvmeof.NvmeError) as e:
            nvmeof.connect("127.0.0.1", port, nqn, hostnqn=host, dhchap_key=dh, queues=1)
        assert e.value.sct == 1 and e.value.dnr
        with pytest.raises(nvmeof.Error):
            nvmeof.connect("127.0.0.1", tls_port, nqn, hostnqn=host, tls_key=psk, queues=1,
                           timeout=5)
        with pytest.raises(nvmeof.ConnectionError):
            nvmeof.connect("127.0.0.1", tls_port, nqn, hostnqn=host, tls_key=psk, queues=1,
                           timeout=5, dhchap_key=_key("DHHC-1", 0x32))
    finally:
        proc.terminate()
        proc.wait()


@pytest.mark.parametrize("form", ["pread", "records", "batch"])
def test_target_restart(tmp_path, form):
    import signal
    import subprocess
    import socket as so
    import threading
    import time
    from conftest import ROOT, free_port

    exe = os.environ.get("NVMEOF_TARGETD", str(ROOT / "target/debug/nvmeof-targetd"))
    port = free_port()
    nqn = "nqn.2026-11.io.nvmeof-direct:restart"

    def start():
        p = subprocess.Popen([exe, "--listen", f"tcp://127.0.0.1:{port}", "-n", nqn,
                              "--namespace", "mem:8M", "--allow-any-host",
                              "--control-socket", str(tmp_path / "c.sock")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(300):
            assert p.poll() is None, "nvmeof-targetd exited"
            try:
                so.create_connection(("127.0.0.1", port), timeout=1).close()
                return p
            except OSError:
                time.sleep(0.05)
        raise AssertionError("nvmeof-targetd did not listen")

    proc = start()
    c = nvmeof.connect("127.0.0.1", port, nqn, queues=1, timeout=5)
    try:
        n = c.namespace(1)
        bs = n.block_size
        outcome = []

        offsets = np.arange(64, dtype=np.uint64) * bs
        rows = np.empty((64, bs), dtype=np.uint8)

        def read():
            if form == "pread":
                n.pread(bs, 0)
            elif form == "records":
                n.read_records(offsets, bs, rows)
            else:
                n.read_batch([(int(o), bs, rows[i]) for i, o in enumerate(offsets)])

        def reader():
            # Reads running while the target dies and comes back: each completes (after a
            # reconnect) or fails with a connection error; none hangs past the timeout.
            for _ in range(200):
                try:
                    read()
                    outcome.append("ok")
                except nvmeof.ConnectionError:
                    outcome.append("conn")
                except nvmeof.Error as e:
                    outcome.append(f"other: {e}")

        t = threading.Thread(target=reader)
        t.start()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc = start()
        t.join()
        assert all(o in ("ok", "conn") for o in outcome), outcome
        # After the restart, reads work again (reconnected or not, they end).
        try:
            read()
        except nvmeof.ConnectionError:
            pass
    finally:
        try:
            c.close()
        except nvmeof.Error:
            pass
        proc.terminate()
        proc.wait()


class FakeCai:
    """An object that claims CUDA memory through __cuda_array_interface__ (at an address no
    GPU has): what the module makes of it is checked without a GPU."""

    def __init__(self, **kw):
        self.__cuda_array_interface__ = dict(
            shape=(4096,), typestr="|u1", data=(0x7F0000000000, False), version=3,
            strides=None, stream=None)
        self.__cuda_array_interface__.update(kw)


def _fake_dlpack(shape, strides=None, device=2, bits=8):
    import ctypes as C

    class DLDevice(C.Structure):
        _fields_ = [("device_type", C.c_int32), ("device_id", C.c_int32)]

    class DLDataType(C.Structure):
        _fields_ = [("code", C.c_uint8), ("bits", C.c_uint8), ("lanes", C.c_uint16)]

    class DLTensor(C.Structure):
        _fields_ = [("data", C.c_void_p), ("device", DLDevice), ("ndim", C.c_int32),
                    ("dtype", DLDataType), ("shape", C.POINTER(C.c_int64)),
                    ("strides", C.POINTER(C.c_int64)), ("byte_offset", C.c_uint64)]

    class DLManagedTensor(C.Structure):
        _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", C.c_void_p),
                    ("deleter", C.c_void_p)]

    new_capsule = C.pythonapi.PyCapsule_New
    new_capsule.restype = C.py_object
    new_capsule.argtypes = [C.c_void_p, C.c_char_p, C.c_void_p]

    class Fake:
        def __init__(self):
            self.shape = (C.c_int64 * len(shape))(*shape)
            self.strides = None if strides is None else (C.c_int64 * len(strides))(*strides)
            t = DLManagedTensor()
            t.dl_tensor.data = 0x7F0000000000
            t.dl_tensor.device = DLDevice(device, 0)
            t.dl_tensor.ndim = len(shape)
            t.dl_tensor.dtype = DLDataType(1, bits, 1)
            t.dl_tensor.shape = self.shape
            if self.strides is not None:
                t.dl_tensor.strides = self.strides
            self.t, self.streams = t, []

        def __dlpack_device__(self):
            return (device, 0)

        def __dlpack__(self, stream=None):
            self.streams.append(stream)
            return new_capsule(C.addressof(self.t), b"dltensor", None)

    return Fake()


def test_cuda_destinations_checked_and_refused_cleanly(ns):
    """CUDA destinations are parsed and checked before any I/O; where there is no CUDA driver
    (or the address is not device memory) the read ends with a clear error, never a crash."""
    bs = ns.block_size
    assert nvmeof.GPU_DESTINATIONS is True
    no_gpu = (nvmeof.Error, ValueError)
    with pytest.raises(no_gpu, match="CUDA"):
        ns.read_into(FakeCai(shape=(bs,)), 0)
    with pytest.raises(no_gpu, match="CUDA"):
        ns.read_into(FakeCai(shape=(2, bs // 4), typestr="<f4", strides=(bs, 4)), 0)
    with pytest.raises(no_gpu, match="CUDA"):
        ns.read_batch([(0, bs, bytearray(bs)), (bs, bs, FakeCai(shape=(bs,), stream=2))])
    with pytest.raises(TypeError, match="read-only"):
        ns.read_into(FakeCai(shape=(bs,), data=(0x7F0000000000, True)), 0)
    with pytest.raises(ValueError, match="C-contiguous"):
        ns.read_into(FakeCai(shape=(bs,), strides=(2,)), 0)
    with pytest.raises(ValueError, match="C-contiguous"):
        ns.read_into(FakeCai(shape=(2, bs // 4), typestr="<f4", strides=(8, 4)), 0)
    with pytest.raises(ValueError, match="item size"):
        ns.read_into(FakeCai(typestr="|u"), 0)
    with pytest.raises(ValueError, match="stream 0"):
        ns.read_into(FakeCai(shape=(bs,), stream=0), 0)
    with pytest.raises(ValueError, match="mask"):
        ns.read_into(FakeCai(shape=(bs,), mask=object()), 0)
    with pytest.raises(ValueError, match="multiples of the block size"):
        ns.read_into(FakeCai(shape=(bs - 1,)), 0)
    with pytest.raises(ValueError, match="outside the namespace"):
        ns.read_into(FakeCai(shape=(2 * bs,)), ns.size - bs)
    with pytest.raises(ValueError, match="fewer than"):
        ns.read_batch([(0, 2 * bs, FakeCai(shape=(bs,)))])
    with pytest.raises(ValueError, match="__cuda_array_interface__"):
        ns.read_into(FakeCai(shape="x"), 0)
    # DLPack: CUDA tensors are asked for the legacy default stream (1).
    d = _fake_dlpack((bs,))
    with pytest.raises(no_gpu, match="CUDA"):
        ns.read_into(d, 0)
    assert d.streams == [1]
    with pytest.raises(ValueError, match="C-contiguous"):
        ns.read_into(_fake_dlpack((2, bs), strides=(1, 2)), 0)
    with pytest.raises(ValueError, match="bits"):
        ns.read_into(_fake_dlpack((bs,), bits=12), 0)
    # A DLPack tensor on the CPU is not CUDA memory: the buffer protocol is asked instead.
    with pytest.raises(TypeError, match="buffer"):
        ns.read_into(_fake_dlpack((bs,), device=1), 0)
    # Empty destinations read nothing, CUDA or not (no driver needed).
    assert ns.read_into(FakeCai(shape=(0,), data=(0, False)), 0) == 0
    assert ns.read_into(bytearray(0), 0) == 0
    ns.read_batch([(0, 0, FakeCai(shape=(0,), data=(0, False))), (0, 0, bytearray(0))])
    assert ns.pread(bs, 0) is not None  # the controller is fine


def test_gpu_rings_header_and_refusals(ctrl, ns):
    """The device header ships with the package; GPU rings with bad arguments are refused
    before anything is made, and where there is no CUDA driver the refusal is one clear error."""
    path = os.path.join(nvmeof.include_dir(), "nvmf_gpu.cuh")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert text == nvmeof.NVMF_GPU_CUH and "nvmf_gpu_read_warp" in text
    assert nvmeof.include_dir() == nvmeof.include_dir()  # written once per process
    with pytest.raises(ValueError, match="mode"):
        ctrl.gpu_rings([ns.nsid], mode="sideways")
    with pytest.raises(ValueError, match="namespace"):
        ctrl.gpu_rings([])
    with pytest.raises((nvmeof.Error, ValueError), match="CUDA|slots"):
        ctrl.gpu_rings([ns.nsid], slots=100)
    try:
        rings = ctrl.gpu_rings([ns.nsid])
    except nvmeof.Error as e:  # no CUDA driver or device here
        assert "CUDA" in str(e) and "\n" not in str(e)
    else:
        rings.close()
    assert ns.pread(ns.block_size, 0) is not None  # the controller is fine


def test_asyncio(ns, spec):
    import asyncio

    bs = ns.block_size
    data = os.urandom(4 * bs)

    async def main():
        assert await ns.write_async(data, 20 * bs) == 4 * bs
        await ns.flush_async()
        b = bytearray(4 * bs)
        assert await ns.read_into_async(b, 20 * bs) == 4 * bs
        assert bytes(b) == data
        assert await ns.pread_async(bs, 21 * bs) == data[bs:2 * bs]
        dests = [bytearray(bs) for _ in range(4)]
        assert await ns.read_batch_async([((20 + i) * bs, bs, d) for i, d in enumerate(dests)]) \
            is None
        assert b"".join(dests) == data
        # Many in flight at once, completing on the loop.
        res = await asyncio.gather(*[ns.pread_async(bs, (20 + i % 4) * bs) for i in range(32)])
        assert all(r == data[(i % 4) * bs:(i % 4 + 1) * bs] for i, r in enumerate(res))
        # Bad input is refused when the call is made, before anything is awaited.
        with pytest.raises(ValueError, match="block size"):
            ns.pread_async(bs, 1)
        with pytest.raises(TypeError, match="read-only"):
            ns.read_into_async(bytes(bs), 0)
        with pytest.raises(ValueError, match="overlap"):
            ns.read_batch_async([(0, bs, b), (0, bs, memoryview(b)[:bs])])
        with pytest.raises(TypeError, match="host buffers"):
            ns.read_into_async(FakeCai(shape=(bs,)), 0)
        # A cancelled call ends as cancelled.
        f = ns.pread_async(bs, 0)
        f.cancel()
        with pytest.raises(asyncio.CancelledError):
            await f
        # A closed controller: new calls raise; a call in flight completes or fails clearly.
        c = spec.connect()
        n = c.namespace(1)
        pending = n.pread_async(bs, 20 * bs)
        c.close()
        try:
            assert await pending == data[:bs]
        except nvmeof.Error as e:
            assert "closed" in str(e)
        with pytest.raises(nvmeof.Error, match="closed"):
            n.pread_async(bs, 0)

    asyncio.run(main())
    with pytest.raises(RuntimeError):  # no running event loop
        ns.pread_async(bs, 0)


def _fill(ns, first, count):
    """Writes `count` random blocks from block `first`; returns them."""
    bs = ns.block_size
    data = os.urandom(count * bs)
    ns.write(data, first * bs)
    return [data[i * bs:(i + 1) * bs] for i in range(count)]


def test_read_records(ns):
    bs = ns.block_size
    blocks = _fill(ns, 200, 64)
    rng = np.random.default_rng(7)
    idx = rng.permutation(64)[:48]
    for dtype in (np.uint64, np.int64):
        out = np.zeros((48, bs), dtype=np.uint8)
        offsets = (idx.astype(dtype) + 200) * bs
        assert ns.read_records(offsets, bs, out) == 48 * bs
        assert [out[i].tobytes() for i in range(48)] == [blocks[i] for i in idx]
    # A sequence of ints; adjacent records (one command) and repeats; a flat bytearray.
    offsets = [(200 + i) * bs for i in (0, 1, 2, 3, 10, 10, 11, 5)]
    out = bytearray(len(offsets) * bs)
    ns.read_records(offsets, bs, out)
    assert [bytes(out[i * bs:(i + 1) * bs]) for i in range(len(offsets))] == [
        blocks[o // bs - 200] for o in offsets]
    # Records of several blocks; a destination larger than needed keeps its tail.
    out = np.full(3 * 4 * bs + 1, 7, dtype=np.uint8)
    ns.read_records(np.array([4, 0, 8], dtype=np.uint64) * bs + 200 * bs, 4 * bs, out)
    assert out[:-1].tobytes() == b"".join(blocks[4:8] + blocks[0:4] + blocks[8:12])
    assert out[-1] == 7
    assert ns.read_records([], bs, bytearray(0)) == 0
    assert ns.read_records(np.zeros(0, np.uint64), bs, bytearray(0)) == 0


def test_read_records_bad_input(ns):
    bs = ns.block_size
    dest = np.zeros((4, bs), dtype=np.uint8)
    good = np.arange(4, dtype=np.uint64) * bs
    with pytest.raises(TypeError, match="64-bit integers"):
        ns.read_records(np.arange(4, dtype=np.int32) * bs, bs, dest)
    with pytest.raises(TypeError, match="64-bit integers"):
        ns.read_records(np.arange(4, dtype=np.float64) * bs, bs, dest)
    with pytest.raises(TypeError, match="offsets"):
        ns.read_records(["0"], bs, dest)
    with pytest.raises(TypeError, match="offsets"):
        ns.read_records(None, bs, dest)
    with pytest.raises(ValueError, match="negative"):
        ns.read_records(np.array([0, -bs], dtype=np.int64), bs, dest)
    with pytest.raises(OverflowError):
        ns.read_records([0, -bs], bs, dest)
    with pytest.raises(ValueError, match="contiguous"):
        ns.read_records(np.zeros((4, 2), dtype=np.uint64)[:, 0], bs, dest)
    with pytest.raises(ValueError, match="multiples of the block size"):
        ns.read_records(good, bs + 1, np.zeros(8 * bs, np.uint8))
    with pytest.raises(ValueError, match="multiples of the block size"):
        ns.read_records(good + 1, bs, dest)
    with pytest.raises(ValueError, match="fewer than"):
        ns.read_records(good, bs, dest[:3])
    ro = np.zeros((4, bs), dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="read-only"):
        ns.read_records(good, bs, ro)
    with pytest.raises(TypeError, match="buffer"):
        ns.read_records(good, bs, "not a buffer")
    # Checked before any I/O: a bad last record leaves the destination untouched.
    ns.write(b"\xee" * bs, 0)
    bad = good.copy()
    bad[-1] = ns.size
    with pytest.raises(ValueError, match="outside the namespace"):
        ns.read_records(bad, bs, dest)
    assert not dest.any()


def test_queue_pairs_many_threads(spec):
    """Threads reading at once, more of them than queue pairs (the others take the shared
    queues), every blocking read form, large transfers split at the transfer limit: all
    data lands where it should."""
    import threading

    with nvmeof.connect(spec.traddr, spec.trsvcid, spec.subnqn, hostnqn=spec.hostnqn,
                        queues=2, queue_pairs=2) as c:
        assert c.spec.queue_pairs == 2
        ns = c.namespace(1)
        bs = ns.block_size
        nblk = (4 << 20) // bs
        blocks = _fill(ns, 0, nblk)
        big = b"".join(blocks)  # 4 MiB: larger than one command's transfer
        errors = []

        def reader(t):
            rng = np.random.default_rng(t)
            try:
                for it in range(30):
                    idx = rng.integers(0, nblk, 64)
                    form = (t + it) % 4
                    if form == 0:
                        out = np.empty((64, bs), dtype=np.uint8)
                        ns.read_records(idx.astype(np.uint64) * bs, bs, out)
                        got = [out[i].tobytes() for i in range(64)]
                    elif form == 1:
                        out = [bytearray(bs) for _ in idx]
                        ns.read_batch([(int(i) * bs, bs, o) for i, o in zip(idx, out)])
                        got = [bytes(o) for o in out]
                    elif form == 2:
                        got = [ns.pread(bs, int(i) * bs) for i in idx[:8]]
                        idx = idx[:8]
                    else:
                        out = np.empty(len(big), dtype=np.uint8)
                        ns.read_into(out, 0)
                        if out.tobytes() != big:
                            errors.append((t, it, "big"))
                        continue
                    if got != [blocks[i] for i in idx]:
                        errors.append((t, it, form))
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=reader, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []


def test_without_queue_pairs(spec):
    with nvmeof.connect(spec.traddr, spec.trsvcid, spec.subnqn, hostnqn=spec.hostnqn,
                        queues=1, queue_pairs=0) as c:
        ns = c.namespace(1)
        bs = ns.block_size
        blocks = _fill(ns, 300, 16)
        out = np.empty((16, bs), dtype=np.uint8)
        ns.read_records(np.arange(300, 316, dtype=np.uint64)[::-1].copy() * bs, bs, out)
        assert [out[i].tobytes() for i in range(16)] == blocks[::-1]
        assert ns.pread(bs, 300 * bs) == blocks[0]


def test_queue_pair_spec_pickles():
    s = nvmeof.Spec("127.0.0.1", 4420, queue_pairs=3)
    assert pickle.loads(pickle.dumps(s)).queue_pairs == 3
    assert nvmeof.Spec("127.0.0.1").queue_pairs == 1


def test_queue_pairs_closed_and_fork(spec):
    c = spec.connect()
    ns = c.namespace(1)
    bs = ns.block_size
    blocks = _fill(ns, 400, 4)
    out = np.empty((4, bs), dtype=np.uint8)
    ns.read_records(np.arange(400, 404, dtype=np.uint64) * bs, bs, out)  # opens a queue pair
    assert [out[i].tobytes() for i in range(4)] == blocks
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                ns.read_records([400 * bs], bs, bytearray(bs))
            except nvmeof.Error as e:
                if "fork" in str(e):
                    del ns, c
                    import gc
                    gc.collect()  # neither hangs nor touches the parent's queue pair
                    code = 0
        finally:
            os.write(w, bytes([code]))
            os._exit(code)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert got == b"\x00" and os.waitstatus_to_exitcode(status) == 0
    # The parent's queue pair still works, then closes with its controller.
    out[:] = 0
    ns.read_records(np.arange(400, 404, dtype=np.uint64) * bs, bs, out)
    assert [out[i].tobytes() for i in range(4)] == blocks
    c.close()
    with pytest.raises(nvmeof.Error, match="closed"):
        ns.read_records([0], bs, bytearray(bs))
    with pytest.raises(nvmeof.Error, match="closed"):
        ns.read_into(bytearray(bs), 0)
