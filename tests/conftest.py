"""Shared fixtures: a real TQ service (controller + storage unit processes) per test module."""

from __future__ import annotations

import socket
import time
import uuid

import pytest
import zmq

from tq import TQClient, TQServer, protocol
from tq.rpc import set_client_credentials


@pytest.fixture(scope="module")
def tq_server():
    """A controller with two storage units on loopback, shut down after the module."""
    server = TQServer(storage_units=2, capacity=512 << 20)
    yield server
    server.shutdown()


@pytest.fixture()
def tq_connection(tq_server):
    """The module's service as a ``TQConnection`` (what actors and workers get at start-up)."""
    from tq import TQConnection

    return TQConnection(tq_server.address)


@pytest.fixture()
def client(tq_server):
    c = TQClient(tq_server.address, timeout=10.0)
    yield c
    c.close()


def _fresh_partition(client: TQClient):
    pid = f"p-{uuid.uuid4().hex[:8]}"
    client.register_partition(pid)
    yield pid
    try:
        client.drop_partition(pid)
    except Exception:
        pass


@pytest.fixture()
def partition(client):
    """A fresh partition id, dropped after the test."""
    yield from _fresh_partition(client)


TRANSPORTS = ("auto", "tcp")


@pytest.fixture(params=TRANSPORTS)
def tclient(request, tq_server):
    """A client over each transport: shared-memory ("auto") and forced TCP."""
    c = TQClient(tq_server.address, timeout=15.0, transport=request.param)
    yield c
    c.close()


@pytest.fixture()
def part(tclient):
    """A fresh partition id on ``tclient``, dropped after the test."""
    yield from _fresh_partition(tclient)


def unique_keys(n: int, prefix: str = "k") -> list[str]:
    """``n`` keys no other test uses."""
    tag = uuid.uuid4().hex[:6]
    return [f"{prefix}{tag}-{i}" for i in range(n)]


def free_port() -> int:
    """A loopback TCP port nobody listens on right now (for a service restarted on the same port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def raw_exchange(address: str, frames: list, *, secret: bytes | None = None, timeout: float = 5.0) -> protocol.Message | None:
    """Send raw frames from a fresh DEALER (connecting with the credentials of the server's ``secret``);
    return the decoded reply, or None if none came within ``timeout``."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    set_client_credentials(sock, secret)
    try:
        sock.connect(address)
        sock.send_multipart(frames)
        if not sock.poll(timeout * 1e3, zmq.POLLIN):
            return None
        return protocol.decode(sock.recv_multipart(), secret)
    finally:
        sock.close(0)


def wait_until(pred, timeout: float = 5.0, interval: float = 0.02):
    """Poll ``pred`` until it returns truthy (a bounded wait for fire-and-forget effects)."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray instance for one test module: 2 logical CPUs (actors ask for fractions of one),
    shut down when the module is done."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


# ----------------------------------------------------------------------------- bit-exact tensors
_BITS = {
    "float32": "int32",
    "float16": "int16",
    "bfloat16": "int16",
    "float64": "int64",
    "bool": "uint8",
}


def bits(t):
    """A float / bool tensor viewed as integers of its width (so NaNs and -0.0 compare bit for bit)."""
    import torch

    name = str(t.dtype).removeprefix("torch.")
    return t.view(getattr(torch, _BITS[name])) if name in _BITS else t


def assert_same(got, want) -> None:
    """Bit-exact equality, dtype and shape included."""
    import torch

    assert isinstance(got, torch.Tensor), type(got)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert tuple(got.shape) == tuple(want.shape), (tuple(got.shape), tuple(want.shape))
    assert torch.equal(bits(got), bits(want.contiguous()))


# ----------------------------------------------------------------------------- the tiny model
@pytest.fixture(scope="module")
def tok():
    """The built-in character-level tokenizer (offline)."""
    from common.models import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    """The seed-0 tiny random-init model, shared read-only by a module's tests (refit tests build their own)."""
    from common.models import TINY_MODEL, load_model

    return load_model(TINY_MODEL, tokenizer=tok, seed=0)
