"""Starting and stopping a TQ service (controller + local storage units) from code."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from .errors import AuthenticationError, TQConnectionError
from .rpc import RpcChannel


def _is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def check_bind_allowed(bind: str, secret: bytes | None) -> None:
    """Refuse a non-loopback bind without an auth secret (anyone on the network could read the store)."""
    host = bind.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if not secret and not _is_loopback(host):
        raise AuthenticationError(
            f"refusing to bind {bind} without an auth secret: a non-loopback address needs --secret "
            "(or the TQ_SECRET environment variable)"
        )


class TQServer:
    """A controller process and its storage units, started as a subprocess of the caller.

    >>> with TQServer(storage_units=2) as server:
    ...     client = TQClient(server.address)
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        storage_units: int = 1,
        capacity: int = 4 << 30,
        shm_dir: str = "/dev/shm",
        secret: str | None = None,
        start_timeout: float = 60.0,
        state_dir: str | None = None,
        fsync: str = "never",
        commit_lease_s: float | None = None,
    ) -> None:
        check_bind_allowed(f"tcp://{host}:{port}", secret.encode() if secret else None)
        self.secret = secret
        fd, self._ready_file = tempfile.mkstemp(prefix="tq-ready-", suffix=".json")
        os.close(fd)
        os.unlink(self._ready_file)
        env = dict(os.environ)
        if secret:
            env["TQ_SECRET"] = secret
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tq.controller", "--host", host, "--port", str(port),
             "--storage-units", str(storage_units), "--capacity", str(capacity), "--shm-dir", shm_dir,
             "--ready-file", self._ready_file, "--fsync", fsync, *(["--state-dir", state_dir] if state_dir else []),
             *(["--commit-lease", str(commit_lease_s)] if commit_lease_s is not None else [])],
            env=env,
            stdout=subprocess.DEVNULL,
        )
        self.address = self._await_ready(start_timeout)["address"]
        self._await_units(storage_units, start_timeout)

    def _await_units(self, expected: int, timeout: float) -> None:
        """Return once every storage unit registered, so a client connecting next sees them all."""
        chan = RpcChannel(self.address, secret=self.secret.encode() if self.secret else None, timeout=timeout, name="controller")
        try:
            info, _ = chan.call("hello", {"timeout": 0.9 * timeout})
        finally:
            chan.close()
        if len(info["units"]) < expected:
            self.shutdown()
            raise TQConnectionError(f"only {len(info['units'])} of {expected} storage units registered within {timeout:.0f}s")

    def _await_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(self._ready_file):
                with open(self._ready_file) as f:
                    info = json.load(f)
                os.unlink(self._ready_file)
                return info
            if self.proc.poll() is not None:
                raise TQConnectionError(f"tq controller exited with code {self.proc.returncode} before it was ready")
            time.sleep(0.02)
        self.proc.kill()
        raise TQConnectionError(f"tq controller not ready within {timeout:.0f}s")

    def shutdown(self, timeout: float = 15.0) -> None:
        """Stop the controller and its storage units (SIGTERM, then SIGKILL after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "TQServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
