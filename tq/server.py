"""Starting and stopping a TQ service (controller + local storage units) from code."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import subprocess
from typing import Any

from . import launch
from .argtypes import optional_text, seconds_value, unit_capacity
from .arena import check_shm_room
from .errors import AuthenticationError, InvalidRequestError, TQConnectionError
from .messages import CONTROLLER_REPLY_DECODERS, ControllerOp, Hello, HelloReply
from .rpc import RpcChannel, serve_spin_s
from .stream_transport import endpoint_host


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
    host = endpoint_host(bind)
    if not secret and not _is_loopback(host):
        raise AuthenticationError(
            f"refusing to bind {bind} without an auth secret: a non-loopback address needs --secret (or the TQ_SECRET environment variable)"
        )


def _checked(command: list[str]) -> argparse.Namespace:
    """The settings of a controller command line, checked by the controller's own parser before
    anything starts: a bad one is a ValueError naming it here, not a controller that exits with the
    reason only in its stderr (and TQServer's error saying no more than that it exited)."""
    from .controller import argument_parser

    parser = argument_parser()
    parser.exit_on_error = False
    try:
        settings = parser.parse_args(command[3:])  # past "python -m tq.controller"
        unit_capacity(settings.storage_units, settings.capacity)
    except (argparse.ArgumentError, InvalidRequestError) as exc:
        raise ValueError(f"TQServer setting refused: {exc}") from None
    return settings


class TQServer:
    """A controller process and its storage units, started as a subprocess of the caller, and owned by
    it: they stop with :meth:`shutdown`, and also once the caller's process is gone (killed, even by
    SIGKILL). A service that outlives its starter is ``tq-controller start``'s.

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
        journal_dir: str | None = None,
        fsync: str = "never",
        commit_lease_s: float | None = None,
        stream_port: int = 0,
        unit_lost_s: float | None = None,
    ) -> None:
        self._pid = os.getpid()  # the owner: only it stops the service (see shutdown)
        optional_text("host", host)  # refused here, not as a subscript or .encode far from here
        optional_text("secret", secret)
        start_timeout = seconds_value("start_timeout", start_timeout, 86400.0, zero=False)
        ready_file = launch.new_ready_file("tq-ready-")
        command = launch.controller_command(
            host=host,
            port=port,
            storage_units=storage_units,
            capacity=capacity,
            shm_dir=shm_dir,
            ready_file=ready_file,
            fsync=fsync,
            journal_dir=journal_dir,
            commit_lease_s=commit_lease_s,
            stream_port=stream_port,
            unit_lost_s=unit_lost_s,
            parent_pid=self._pid,  # the service is this process's: it stops when this process dies, however
        )
        settings = _checked(command)
        check_bind_allowed(f"tcp://{host}:{port}", secret.encode() if secret else None)
        if settings.storage_units:  # the arenas are allocated at start: room for all of them, or a clear error now
            check_shm_room(shm_dir, settings.capacity)
        serve_spin_s()  # a bad TQ_SERVE_SPIN_US is named here, not only in the processes' stderr
        self.secret = secret
        self.proc = subprocess.Popen(command, env=launch.service_env(secret), stdout=subprocess.DEVNULL)
        try:
            self.address = launch.await_ready_file(
                ready_file, alive=lambda: self.proc.poll() is None, timeout=start_timeout, what="the TQ controller"
            )["address"]
            self._await_units(settings.storage_units, start_timeout)
        except BaseException:
            self.shutdown()
            raise

    def _await_units(self, expected: int, timeout: float) -> None:
        """Return once every storage unit registered, so a client connecting next sees them all."""
        chan = RpcChannel(
            self.address,
            secret=self.secret.encode() if self.secret else None,
            timeout=timeout,
            name="controller",
            replies=CONTROLLER_REPLY_DECODERS,
        )
        try:
            info: HelloReply = chan.call(ControllerOp.HELLO, Hello(timeout=0.9 * timeout))[0]
        finally:
            chan.close()
        if len(info.units) < expected:
            raise TQConnectionError(f"only {len(info.units)} of {expected} storage units registered within {timeout:.0f}s")

    def shutdown(self, timeout: float = 15.0) -> None:
        """Stop the controller and its storage units (SIGTERM, then SIGKILL after ``timeout``). In a
        process forked from the owner (its atexit hooks, a ``with`` it inherited), nothing: the service
        is the owner's."""
        if os.getpid() == self._pid:
            launch.stop_process(self.proc, timeout)

    def __enter__(self) -> "TQServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
