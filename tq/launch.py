"""Starting and watching TQ service processes: the one place that spawns a controller or a storage
unit, waits for it to be ready, checks whether it still runs, and stops it.

The handshake is a *ready file*: the launcher names a path that does not exist yet, the process writes
its description (address, pid, ...) there as JSON - atomically, so a reader never sees half of it -
once it serves, and the launcher polls for it while checking that the process has not died. No port
is guessed and no log is parsed. Used by ``tq-controller`` (:mod:`tq.cli`), :class:`tq.TQServer`, the
controller's own storage units (:func:`tq.controller.serve`) and Ray placement
(:mod:`tq.ray_placement`).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from .errors import TQConnectionError

POLL_S = 0.02  # how often a waiting launcher looks again


def service_env(secret: str | None) -> dict[str, str]:
    """The environment of a service process: this one's, plus the secret (by environment, never argv:
    argv is world-readable in ``ps``) and this package on ``PYTHONPATH``, so that a child finds it even
    from a source checkout that is not installed."""
    env = dict(os.environ)
    if secret:
        env["TQ_SECRET"] = secret
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    return env


UNIT_LOST_HELP = (
    "seconds a silent storage unit is waited for before it is given up on (default 30): until then a read "
    "of its keys waits for it within its own timeout - a network partition heals - after it the read fails at once"
)
STREAM_PORT_HELP = (
    "TCP port of the controller's stream socket, where clients of other hosts send their requests besides "
    "--port (0: a free one, kept across restarts with --journal-dir); a port given is used or the start "
    "fails - open both in a firewall"
)


def raise_open_file_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit (as Ray's processes do) and
    return it: a controller holds two descriptors per partition (its location table's lock and
    mapping) and a unit one per client connection, so the common soft default of 1,024 ran out at
    ~500 partitions while the hard limit allowed far more."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # a container may cap it below the hard limit it reports
            pass
    return soft


def controller_command(
    *,
    host: str,
    port: int,
    storage_units: int,
    capacity: int,
    shm_dir: str,
    ready_file: str,
    fsync: str = "never",
    journal_dir: str | None = None,
    commit_lease_s: float | None = None,
    metrics_port: int | None = None,
    stream_port: int = 0,
    unit_lost_s: float | None = None,
    parent_pid: int | None = None,
) -> list[str]:
    """The command line of a controller process (``python -m tq.controller``) and its local units;
    with ``parent_pid`` (the caller's own pid, when it starts the process itself) the service stops
    once that process is gone."""
    cmd = [
        sys.executable,
        "-m",
        "tq.controller",
        "--host",
        host,
        "--port",
        str(port),
        "--storage-units",
        str(storage_units),
        "--capacity",
        str(capacity),
        "--shm-dir",
        shm_dir,
        "--ready-file",
        ready_file,
        "--fsync",
        fsync,
    ]
    if journal_dir:
        cmd += ["--journal-dir", journal_dir]
    if commit_lease_s is not None:
        cmd += ["--commit-lease", str(commit_lease_s)]
    if metrics_port is not None:
        cmd += ["--metrics-port", str(metrics_port)]
    if stream_port:
        cmd += ["--stream-port", str(stream_port)]
    if unit_lost_s is not None:
        cmd += ["--unit-lost-s", str(unit_lost_s)]
    if parent_pid is not None:
        cmd += ["--parent-pid", str(parent_pid)]
    return cmd


def metrics_command(*, controller: str, host: str, port: int, ready_file: str, pid: int) -> list[str]:
    """The command line of a service's metrics endpoint (``python -m tq.metrics``, see :mod:`tq.metrics`)."""
    return [
        sys.executable,
        "-m",
        "tq.metrics",
        "--controller",
        controller,
        "--host",
        host,
        "--port",
        str(port),
        "--ready-file",
        ready_file,
        "--pid",
        str(pid),
    ]


def storage_unit_command(*, unit_id: int, bind: str, controller: str, capacity: int, shm_dir: str, **options: Any) -> list[str]:
    """The command line of a storage-unit process (``python -m tq.storage``). ``options`` are its
    other flags by their Python names (``ready_file="/tmp/x"`` -> ``--ready-file /tmp/x``); ``True``
    is a bare flag, ``None`` and ``False`` are left out."""
    cmd = [
        sys.executable,
        "-m",
        "tq.storage",
        "--unit-id",
        str(unit_id),
        "--bind",
        bind,
        "--controller",
        controller,
        "--capacity",
        str(capacity),
        "--shm-dir",
        shm_dir,
    ]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is not None and value is not False:
            cmd += [flag, str(value)]
    return cmd


def new_ready_file(prefix: str) -> str:
    """A fresh path for a ready file (it does not exist yet: its existence is the signal)."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".json")
    os.close(fd)
    os.unlink(path)
    return path


def write_json(path: str, info: dict[str, Any]) -> None:
    """Write ``info`` as JSON to ``path`` atomically (a ready file, a run file): a reader polling for it
    never sees half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(info, f, indent=1)
    os.replace(tmp, path)


def remove_ready_file(path: str) -> None:
    """Remove a ready file and its temporary (a launcher that gave up must not leave them behind)."""
    for p in (path, path + ".tmp"):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def await_ready_file(path: str, *, alive: Callable[[], bool], timeout: float, what: str) -> dict[str, Any]:
    """Wait until ``path`` exists and return what it holds; read and removed.

    Raises :class:`~tq.errors.TQConnectionError` as soon as ``alive()`` says the process is gone, or
    once ``timeout`` seconds passed, naming ``what`` (e.g. "the TQ controller"); and with the reason a
    process that could not start wrote there (``{"error": ...}``: a port in use, say)."""
    deadline = time.monotonic() + timeout
    try:
        while not os.path.exists(path):
            if not alive():
                if os.path.exists(path):  # written as it exited: why it could not start
                    break
                raise TQConnectionError(f"{what} exited before it was ready")
            if time.monotonic() > deadline:
                raise TQConnectionError(f"{what} was not ready within {timeout:.0f}s")
            time.sleep(POLL_S)
        with open(path) as f:
            info = json.load(f)
    finally:
        remove_ready_file(path)
    if "error" in info:
        raise TQConnectionError(f"{what} could not start: {info['error']}")
    return info


def process_identity(pid: int) -> tuple[int, int] | None:
    """(pid, start time) of a running process of this host, or None (gone, a zombie, or not visible
    here): the start time tells a process from a later one that got the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else (pid, int(fields[19]))


def same_process(identity: tuple[int, int] | None) -> bool:
    """Whether the process :func:`process_identity` described as ``identity`` still runs."""
    return identity is not None and process_identity(identity[0]) == identity


def pid_running(pid: int | None) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not yet reaped) counts as exited."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def wait_pid_exit(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``pid`` to exit; return whether it did."""
    deadline = time.monotonic() + timeout
    while pid_running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def signal_tree(pid: int, sig: int) -> None:
    """Signal a process and its descendants (children first, so none is orphaned in between)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = proc.children(recursive=True) + [proc]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def wait_exit(proc: subprocess.Popen, timeout: float) -> int:
    """``proc.wait(timeout)``, woken by the exit itself (a pidfd, Linux 5.3+) where Popen's own wait
    with a timeout looks every 50 ms - a service's shutdown waits on its units, then on it."""
    if proc.returncode is None and hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(proc.pid)
        except OSError:  # reaped already, or no pidfd here
            pass
        else:
            try:
                select.select([fd], [], [], timeout)
            finally:
                os.close(fd)
            return proc.wait(0.0)  # TimeoutExpired if it has not exited
    return proc.wait(timeout)


def stop_process(proc: subprocess.Popen, timeout: float, *, tree: bool = False) -> None:
    """SIGTERM ``proc`` (and, with ``tree``, its descendants), wait up to ``timeout``, then SIGKILL.

    SIGTERM first: a controller then stops its units, and units remove their shared-memory arenas."""
    if proc.poll() is None:
        signal_tree(proc.pid, signal.SIGTERM) if tree else proc.terminate()
    try:
        wait_exit(proc, timeout)
    except subprocess.TimeoutExpired:
        signal_tree(proc.pid, signal.SIGKILL) if tree else proc.kill()
        proc.wait()
