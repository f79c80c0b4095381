"""Shared fixtures: a real TQ service (controller + storage unit processes) per test module."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import Any, Iterable

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


def no_room_to_grow(pid: int, path: str | os.PathLike, spare: int = 0) -> None:
    """Make ``pid``'s writes past ``path``'s current size plus ``spare`` bytes fail (EFBIG), as on a
    full disk: its file size limit (RLIMIT_FSIZE). Python ignores SIGXFSZ, so the write raises.
    Lift it with :func:`room_to_grow`."""
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (os.path.getsize(path) + spare, resource.RLIM_INFINITY))


def room_to_grow(pid: int) -> None:
    """Lift :func:`no_room_to_grow`'s limit (a process gone already is fine)."""
    try:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    except ProcessLookupError:
        pass


_BUG_SITECUSTOMIZE = """\
# Written by tests/conftest.py:inject_bug for one test: a bug in the serving loop of a {server}, raised once
import os

_ARM, _FIRED = {arm!r}, {fired!r}


def _patch():
    # Wrapped through the shared base class: the service modules run as __main__ (python -m), so a
    # class imported from them here would not be the one serving.
    from tq.rpc import RpcServer

    real_serve = RpcServer.serve_forever

    def serve_forever(self):
        if type(self).__name__ == {server!r}:
            real_tick = self.on_tick

            def on_tick(now):
                if os.path.exists(_ARM):
                    try:
                        os.close(os.open(_FIRED, os.O_CREAT | os.O_EXCL))
                    except FileExistsError:
                        pass
                    else:
                        raise RuntimeError("a bug injected by the test")
                return real_tick(now)

            self.on_tick = on_tick
        return real_serve(self)

    RpcServer.serve_forever = serve_forever


_patch()
"""


def inject_bug(monkeypatch, directory: os.PathLike, server: str) -> tuple[str, str]:
    """Have the loop of the first ``server`` process (a class name: ``StorageUnit``, ``Controller``)
    that ticks after the test arms it raise RuntimeError, once, in services started from now on: a
    ``sitecustomize`` on the children's ``PYTHONPATH`` wraps the tick (nothing in the product knows).
    Returns (arm, fired): create ``arm`` to arm it; ``fired`` exists once it raised."""
    hook = os.path.join(directory, "inject-bug")
    os.makedirs(hook, exist_ok=True)
    arm, fired = os.path.join(hook, "arm"), os.path.join(hook, "fired")
    with open(os.path.join(hook, "sitecustomize.py"), "w") as f:
        f.write(_BUG_SITECUSTOMIZE.format(server=server, arm=arm, fired=fired))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (hook, os.environ.get("PYTHONPATH")) if p))
    return arm, fired


def process_state(pid: int) -> str | None:
    """``pid``'s state letter in /proc (``R``, ``S``, ``T`` stopped, ``Z`` zombie...), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    return process_state(pid) not in (None, "Z")


def shut_down(servers: Iterable[Any], unit_pids: Iterable[int]) -> None:
    """Shut down ``servers`` (the ones not None; a journaled controller restarted in the test, say),
    then SIGKILL the storage units of ``unit_pids`` still running: a journaled service's units outlive
    a killed controller, so no shutdown reaches those of an incarnation that is gone."""
    for server in servers:
        if server is not None:
            server.shutdown()
    for pid in unit_pids:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def raw_exchange_stream(address: str, frames: list, *, secret: bytes | None = None, timeout: float = 5.0) -> protocol.Message | None:
    """As :func:`raw_exchange`, over a server's stream socket (its Unix one ``@name`` or its TCP one
    ``tcp://host:port/token``, tq.stream_transport) from a fresh connection: None if no reply came
    within ``timeout`` or the server closed it."""
    from tq.errors import TQConnectionError
    from tq.stream_transport import ClientStream

    stream = ClientStream(address, timeout)
    try:
        stream.send(frames, timeout)
        got = stream.recv(timeout)
    except (OSError, TQConnectionError):
        return None
    finally:
        stream.close()
    return None if got is None else protocol.decode(got, secret)


def raw_exchange(address: str, frames: list, *, secret: bytes | None = None, timeout: float = 5.0) -> protocol.Message | None:
    """Send raw frames from a fresh DEALER (connecting with the credentials of the server's ``secret``);
    return the decoded reply, or None if none came within ``timeout``. The send is bounded too: a
    connection the server refused (a peer without the secret) may leave the DEALER nothing to queue
    on, and a plain send then blocks for good (seen once in CI: test_auth's 100 MiB send, 300 s)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1e3))
    set_client_credentials(sock, secret)
    try:
        sock.connect(address)
        try:
            sock.send_multipart(frames)
        except zmq.Again:
            return None
        if not sock.poll(timeout * 1e3, zmq.POLLIN):
            return None
        return protocol.decode(sock.recv_multipart(), secret)
    finally:
        sock.close(0)


# Runs python in a pid namespace of its own (and its own /proc) whose pids start near pid_max, so
# that its pid there names no process here - as for a process in another container of a pod
# sharing /dev/shm. $0: the code, $1: the first pid's predecessor, $2: the interpreter, then its args.
_IN_PID_NAMESPACE = """n="$1"; py="$2"; shift 2; echo "$n" > /proc/sys/kernel/ns_last_pid && "$py" -c "$0" "$@"; exit $?"""


def python_command(code: str, args: list[str], pid_namespace_start: int | None = None) -> list[str]:
    """``python -c code args``, in a pid namespace of its own numbered from ``pid_namespace_start``
    when given (see :func:`pid_namespace_start`)."""
    if pid_namespace_start is None:
        return [sys.executable, "-c", code, *args]
    return [
        "unshare",
        "--pid",
        "--fork",
        "--mount-proc",
        "sh",
        "-c",
        _IN_PID_NAMESPACE,
        code,
        str(pid_namespace_start),
        sys.executable,
        *args,
    ]


def python_pid(proc: subprocess.Popen) -> int:
    """The pid here of the python process :func:`python_command` started (under unshare and sh)."""
    if os.path.basename(proc.args[0]) != "unshare":
        return proc.pid
    import psutil

    return next(p.pid for p in psutil.Process(proc.pid).children(recursive=True) if p.cmdline()[0] == sys.executable)


def pid_namespace_start() -> int | None:
    """A pid to number a new pid namespace's processes from, none of whose next few exists here; None
    where this process cannot make pid namespaces (not root, no util-linux ``unshare``)."""
    start = int(open("/proc/sys/kernel/pid_max").read()) - 1000
    while start > 1000 and any(os.path.exists(f"/proc/{start + i}") for i in range(1, 8)):
        start -= 1000
    # A probe that is only slow (a loaded CI machine) is tried again, longer, and then fails the test:
    # skipping would hide the tests that need a namespace on exactly the machines that run them.
    for timeout in (10, 60):
        try:
            probe = subprocess.run(
                python_command("import os; print(os.getpid())", [], start), capture_output=True, text=True, timeout=timeout
            )
        except OSError:
            return None
        except subprocess.TimeoutExpired:
            continue
        return start if probe.returncode == 0 and probe.stdout.strip() == str(start + 1) else None
    raise RuntimeError("starting python in a new pid namespace timed out twice (10 s, then 60 s)")


def cannot_make_netns() -> str | None:
    """Why network namespaces (the emulated hosts of the multi-node tests) cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs the ip and unshare commands"
    # a name of this process's own: every xdist worker probes while it collects this module, and two
    # probes of one name at once made one of them fail ("File exists") and skip the emulated-cluster test
    name = f"tq-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def wait_until(pred, timeout: float = 5.0, interval: float = 0.02):
    """Poll ``pred`` until it returns truthy (a bounded wait for fire-and-forget effects)."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def popen_ctrl_c(cmd: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` of a process a test will Ctrl-C: it starts with SIGINT's default action even
    when this run inherited SIGINT ignored (a shell's background job does: ``pytest ... &``), which
    Popen passes on and Python then installs no KeyboardInterrupt handler under (the SIGINT is lost)."""
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # a handler is reset to SIG_DFL at exec
    try:
        return subprocess.Popen(cmd, **kwargs)
    finally:
        signal.signal(signal.SIGINT, inherited)


# ----------------------------------------------------------------------------- one Ray for the Ray tests
# Starting a local Ray costs 4-5 s of a 2-core machine: the tests that only need a running Ray (they ask
# for ``ray_session``) share one. Their modules run last, one after the other (pytest_collection_modifyitems),
# and the shared Ray is shut down before any test of another module, so every other test - and every test
# that starts a Ray of its own (trainers, benchmarks, the compat suite) - runs with none up, as before.
# Under pytest-xdist each worker process has its own shared Ray (with the same rules).
RAY_INIT = dict(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
_ray_modules: set = set()  # modules with a test that asks for ``ray_session``
_shared_ray: list = []  # the GCS address of the Ray ``ray_session`` started, while it runs


def _uses_ray_session(item) -> bool:
    return "ray_session" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config, items):
    """Tests marked ``long`` first, then the rest, with the modules that use ``ray_session`` at the end
    (each module's tests together and in order). pytest-xdist's worksteal hands each worker a
    contiguous share of this order and lets an idle worker take from the end of another's queue: a
    test of a minute that starts late is the suite's tail, one that starts first is not."""
    _ray_modules.update(item.module for item in items if _uses_ray_session(item))
    items.sort(key=lambda item: (item.get_closest_marker("long") is None, getattr(item, "module", None) in _ray_modules))


def _shared_ray_up():
    """The ``ray`` module if the Ray ``ray_session`` started is still the one this process is connected to."""
    import sys

    ray = sys.modules.get("ray")
    if not _shared_ray or ray is None or not ray.is_initialized():
        return None
    return ray if ray.get_runtime_context().gcs_address == _shared_ray[0] else None


def _stop_shared_ray() -> None:
    ray = _shared_ray_up()
    if ray is not None:
        ray.shutdown()
    _shared_ray.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the test's own teardown: stop the shared Ray unless the next test is in a Ray module."""
    yield
    if nextitem is None or getattr(nextitem, "module", None) not in _ray_modules:
        _stop_shared_ray()


@pytest.fixture()
def ray_session():
    """A running local Ray (2 logical CPUs; actors ask for fractions of one), shared with the next tests
    that ask for it. A test may shut it down or kill its own actors; one that leaves CPUs reserved (a
    leaked actor) gets the Ray shut down after it, so the next test starts a fresh one."""
    import ray

    if _shared_ray_up() is None:
        if ray.is_initialized():  # a Ray of the test before (not ours): this test gets a clean one
            ray.shutdown()
        ray.init(**RAY_INIT)
        _shared_ray[:] = [ray.get_runtime_context().gcs_address]
    yield ray

    def all_cpus_free() -> bool:
        return ray.available_resources().get("CPU", 0) >= ray.cluster_resources()["CPU"]

    if _shared_ray_up() is not None and not wait_until(all_cpus_free, 3.0):
        _stop_shared_ray()


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


class LoopbackController:
    """A controller driven in this process as its server loop drives it - the op's handler, then its
    journal record, then the loop's tick - with storage unit 0 played by a bare ROUTER socket whose
    requests the test listens to (``heard``)."""

    def __init__(self) -> None:
        from tq.rpc import Call

        self.unit = zmq.Context.instance().socket(zmq.ROUTER)
        self.port = self.unit.bind_to_random_port("tcp://127.0.0.1")
        self.call = Call(b"", None, "test", 0.0)

    @staticmethod
    def start(**kwargs):
        from tq.controller import Controller

        return Controller("tcp://127.0.0.1:0", **kwargs)

    def apply(self, ctrl, op: str, args: dict, bufs: list = (), *, tick: bool = True):
        import msgspec

        out = ctrl.handle(op, args, list(bufs), self.call)
        ctrl.on_applied(op, msgspec.msgpack.encode(args), list(bufs))
        if tick:
            ctrl.on_tick(time.monotonic())
        return out

    def heard(self, timeout_ms: int = 300, ignore: tuple[str, ...] = ("ping", "retain")) -> list[str]:
        """The ops the unit was sent, in order, until none came for 50 ms (the first wait ``timeout_ms``)."""
        ops = []
        while self.unit.poll(timeout_ms):
            op = protocol.decode(self.unit.recv_multipart()[1:], None).header["op"]
            ops += [] if op in ignore else [op]
            timeout_ms = 50
        return ops

    def commit_two_rows(self, ctrl, *, tick: bool = True) -> None:
        """Unit 0 registered, partition ``p`` made, keys ``a`` and ``b`` committed as rows 0 and 1 of block 5."""
        import numpy as np

        unit = {"address": f"tcp://127.0.0.1:{self.port}", "arena_size": 1 << 20, "pid": 1, "host": "h", "arena_path": "/nonexistent"}
        self.apply(ctrl, "register_unit", unit, tick=tick)
        self.apply(ctrl, "create_partition", {"partition": "p"}, tick=tick)
        bufs: list = []
        fields = {
            "x": {
                "schema": ["tensor", "int64", []],
                "row_nbytes": protocol.pack_array(np.array([8, 8]), bufs),
                "arena_offsets": protocol.pack_array(np.array([0, 8]), bufs),
            }
        }
        commit = {"partition": "p", "keys": ["a", "b"], "mode": "put", "blocks": [[0, 5, 2]], "fields": fields}
        self.apply(ctrl, "commit", commit, bufs, tick=tick)


@pytest.fixture()
def loopback():
    """A :class:`LoopbackController` harness (its unit socket closed after the test)."""
    harness = LoopbackController()
    yield harness
    harness.unit.close(0)


WIDE_DTYPES = ("float32", "bfloat16", "float16", "int64", "int32", "int8", "uint8", "bool", "float64")
# pad values of the wide batch's dtypes where 0 would not show a missing pad
_WIDE_PADS = {"bool": True, "uint8": 7, "int8": -3, "int32": -100, "int64": -1}


def wide_pad(dtype, default=0):
    """The pad value :func:`wide_batch`'s tests use for a field of ``dtype`` (a torch dtype)."""
    return _WIDE_PADS.get(str(dtype).removeprefix("torch."), default)


def wide_batch(n: int, fields: int, longest: int, seed: int) -> dict:
    """``fields`` jagged columns sharing their row lengths (as a rollout's per-token fields do), of
    every dtype, some with a trailing dim, plus a fixed-shape and an object column."""
    import numpy as np
    import torch

    from tq import JaggedTensor

    rng = np.random.default_rng(seed)
    lengths = rng.integers(longest // 3, longest + 1, size=n)
    lengths[int(rng.integers(n))] = longest - 3  # odd byte spans: rows straddle the store vectors
    lengths[int(rng.integers(n))] = 0
    lengths = torch.from_numpy(lengths.astype(np.int64))
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    cols: dict = {}
    for f in range(fields):
        dtype, trailing = getattr(torch, WIDE_DTYPES[f % len(WIDE_DTYPES)]), ((3,) if f % 4 == 3 else ())
        raw = torch.from_numpy(rng.integers(0, 256, size=int(offsets[-1]) * int(np.prod(trailing)) * dtype.itemsize, dtype=np.uint8))
        values = (raw % 2 if dtype == torch.bool else raw).view(dtype).reshape(int(offsets[-1]), *trailing)
        cols[f"f{f:02d}"] = JaggedTensor(values, offsets)
    cols["reward"] = torch.from_numpy(rng.standard_normal((n, 2)).astype(np.float32))
    cols["tag"] = [f"sample-{i}" * (i % 3) for i in range(n)]
    return cols
