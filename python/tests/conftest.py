"""Starts a real nvmeof-targetd (target/debug, or $NVMEOF_TARGETD) on a free port."""

import os
import pathlib
import socket
import subprocess
import tempfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NQN = "nqn.2026-11.io.nvmeof-direct:pytest"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def target():
    exe = os.environ.get("NVMEOF_TARGETD", str(ROOT / "target/debug/nvmeof-targetd"))
    port = free_port()
    tmp = tempfile.TemporaryDirectory()
    proc = subprocess.Popen(
        [exe, "--listen", f"tcp://127.0.0.1:{port}", "-n", NQN,
         "--namespace", "mem:16M", "--allow-any-host",
         "--control-socket", os.path.join(tmp.name, "ctl.sock")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    # Readiness: the listener accepts (bounded wait; a dead target fails at once).
    for _ in range(300):
        if proc.poll() is not None:
            raise RuntimeError(f"nvmeof-targetd exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError("nvmeof-targetd did not start listening")
    yield {"port": port, "nqn": NQN}
    proc.terminate()
    proc.wait()
    tmp.cleanup()


@pytest.fixture(scope="session")
def spec(target):
    import nvmeof
    return nvmeof.Spec("127.0.0.1", target["port"], target["nqn"],
                       hostnqn="nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-000000000001",
                       queues=2, timeout=10.0)


@pytest.fixture
def ctrl(spec):
    c = spec.connect()
    yield c
    c.close()


@pytest.fixture
def ns(ctrl):
    return ctrl.namespace(1)
