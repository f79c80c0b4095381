"""Request/reply over ZMQ: a single-threaded server loop and a thread-safe client channel.

Servers (controller, storage units) own one ROUTER socket and never sleep on a request: a handler
either answers at once or parks the request (``DEFERRED``) and answers it later from the loop, e.g.
when a wait's fields are produced or its deadline passes. Clients talk through DEALER sockets, one per
thread per server, so a client object is safe to share between threads without a lock; replies carry
the request id, so a late reply to a request that already timed out is recognised and dropped.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
import zmq

from . import protocol
from .errors import AuthenticationError, MalformedMessageError, TQConnectionError, TQError, UnknownOperationError

log = logging.getLogger(__name__)

DEFERRED = object()  # a handler's return value meaning "I will reply later"
Handler = Callable[[dict, list, "Call"], Any]


class Call:
    """The context of one request being served: who asked and under which request id."""

    __slots__ = ("identity", "rid", "op", "started")

    def __init__(self, identity: bytes, rid: Any, op: str, started: float) -> None:
        self.identity, self.rid, self.op, self.started = identity, rid, op, started


class OpStats:
    """Per-operation counters and a window of recent latencies (for p50/p99)."""

    def __init__(self) -> None:
        self.count = 0
        self.errors = 0
        self.latencies: collections.deque[float] = collections.deque(maxlen=4096)

    def summary(self) -> dict[str, float]:
        lat = np.asarray(self.latencies, dtype=np.float64)
        p50, p99 = (np.percentile(lat, [50, 99]) * 1e3).tolist() if lat.size else (0.0, 0.0)
        return {"count": self.count, "errors": self.errors, "p50_ms": p50, "p99_ms": p99}


class RpcServer:
    """A ROUTER socket and a poll loop dispatching ``op`` to registered handlers."""

    def __init__(self, name: str, bind: str, *, secret: bytes | None, max_message_bytes: int) -> None:
        self.name = name
        self.secret = secret
        self.max_message_bytes = max_message_bytes
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + protocol.MAX_HEADER_BYTES)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        if bind.endswith(":0"):
            port = self.sock.bind_to_random_port(bind.rsplit(":", 1)[0])
            bind = f"{bind.rsplit(':', 1)[0]}:{port}"
        else:
            self.sock.bind(bind)
        self.address = bind
        self.handlers: dict[str, Handler] = {}
        self.op_stats: dict[str, OpStats] = collections.defaultdict(OpStats)
        self.rejected = 0  # malformed, unauthenticated or otherwise refused messages
        self.started_at = time.time()
        self._running = False
        self._extra_sockets: dict[zmq.Socket, Callable[[list], None]] = {}
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)

    # -- hooks for subclasses
    def next_deadline(self) -> float | None:
        """Monotonic time at which :meth:`on_tick` must run next (None: no timer pending)."""
        return None

    def on_tick(self, now: float) -> None:
        """Called after every loop iteration (expire parked waits, flush work)."""

    def remove_socket(self, sock: zmq.Socket) -> None:
        """Stop polling and close a socket added with :meth:`add_socket`."""
        self._poller.unregister(sock)
        self._extra_sockets.pop(sock, None)
        sock.close(0)

    def on_applied(self, op: str, args: dict, buffers: list) -> None:
        """Called after a request was served successfully (before the reply goes out)."""

    def add_socket(self, sock: zmq.Socket, on_message: Callable[[list], None]) -> None:
        """Poll another socket (e.g. a DEALER to a storage unit) in the same loop."""
        self._extra_sockets[sock] = on_message
        self._poller.register(sock, zmq.POLLIN)

    # -- replies
    def reply(self, call: Call, result: Any, buffers: Sequence[Any] = ()) -> None:
        frames = protocol.reply_ok(call.rid, result, buffers, self.secret)
        self.sock.send_multipart([call.identity, *frames], copy=not _zero_copy(frames))
        self._record(call, ok=True)

    def reply_error(self, call: Call, exc: BaseException) -> None:
        self.sock.send_multipart([call.identity, *protocol.reply_error(call.rid, exc, self.secret)])
        self._record(call, ok=False)

    def _record(self, call: Call, *, ok: bool) -> None:
        st = self.op_stats[call.op]
        st.count += 1
        st.errors += 0 if ok else 1
        st.latencies.append(time.perf_counter() - call.started)

    # -- loop
    def stop(self) -> None:
        self._running = False

    def serve_forever(self) -> None:
        self._running = True
        while self._running:
            deadline = self.next_deadline()
            timeout_ms = 100.0 if deadline is None else max(0.0, min(100.0, (deadline - time.monotonic()) * 1e3))
            for sock, _ in self._poller.poll(timeout_ms):
                if sock is self.sock:
                    self._serve_one()
                else:
                    self._extra_sockets[sock](sock.recv_multipart())
            self.on_tick(time.monotonic())
        self.close()

    def close(self) -> None:
        self.sock.close(linger=1000)  # let the last replies (e.g. to "shutdown") go out
        for s in self._extra_sockets:
            s.close(0)

    def _serve_one(self) -> None:
        frames = self.sock.recv_multipart(copy=False)
        started = time.perf_counter()
        identity = frames[0].bytes
        call = Call(identity, None, "<invalid>", started)
        try:
            msg = protocol.decode(frames[1:], self.secret, max_message_bytes=self.max_message_bytes)
            call.rid = msg.header.get("rid")
            op, args = msg.header.get("op"), msg.header.get("args")
            if not isinstance(op, str) or not isinstance(args, dict):
                raise MalformedMessageError("request needs a string 'op' and a map 'args'")
            handler = self.handlers.get(op)
            if handler is None:
                raise UnknownOperationError(f"{self.name} has no operation {op!r}")
            call.op = op
            out = handler(args, msg.buffers, call)
            self.on_applied(op, args, msg.buffers)  # e.g. journal it - before the caller hears it is done
            if out is DEFERRED:
                return
            result, buffers = out if isinstance(out, tuple) else (out, ())
            self.reply(call, result, buffers)
        except TQError as exc:
            if call.op == "<invalid>":
                self.rejected += 1
                log.warning("%s rejected a message: %s", self.name, exc)
            self.reply_error(call, exc)
        except Exception as exc:  # a bug must not take the server down
            log.exception("%s failed serving %s", self.name, call.op)
            self.reply_error(call, exc)

    def server_stats(self) -> dict[str, Any]:
        return {
            "uptime_s": time.time() - self.started_at,
            "rejected_messages": self.rejected,
            "ops": {op: st.summary() for op, st in sorted(self.op_stats.items())},
        }


def _zero_copy(frames: Sequence[Any]) -> bool:
    """Whether to send ``frames`` zero-copy: only when one is big. pyzmq copies frames under
    ``zmq.COPY_THRESHOLD`` anyway, and its zero-copy path costs about twice as much per small message."""
    return any(memoryview(f).nbytes >= zmq.COPY_THRESHOLD for f in frames)


class RpcChannel:
    """Request/reply to one server, safe to use from many threads (one DEALER socket per thread)."""

    _rids = itertools.count(1)

    def __init__(self, address: str, *, secret: bytes | None, timeout: float, name: str) -> None:
        self.address, self.secret, self.timeout, self.name = address, secret, timeout, name
        self.ctx = zmq.Context.instance()
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def _socket(self) -> zmq.Socket:
        if self._closed:
            raise TQConnectionError(f"client connection to {self.name} is closed")
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a peer that is not connected
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(self.address)
            self._local.sock = sock
            with self._lock:
                self._sockets.append(sock)
        return sock

    def send(
        self, op: str, args: dict[str, Any], buffers: Sequence[Any] = (), *, timeout: float | None = None,
        check: Callable[[], None] | None = None,
    ) -> int:
        """Send a request and return its id; waits at most ``timeout`` for the connection.

        ``check`` is called about every second while waiting; it may raise to abandon the wait early
        (e.g. once the controller reports this server down)."""
        sock = self._socket()
        rid = next(self._rids)
        timeout = self.timeout if timeout is None else timeout
        frames = protocol.request(op, rid, args, buffers, self.secret)
        copy = not _zero_copy(frames)
        try:  # the common case: connected, so the send is queued at once without an extra poll
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
        except zmq.Again:  # IMMEDIATE: no connection yet - wait for one, up to the timeout
            if not self._wait(sock, zmq.POLLOUT, timeout, check):
                raise TQConnectionError(
                    f"cannot reach {self.name} at {self.address} within {timeout:.1f}s (op {op!r}): server down or unreachable"
                ) from None
            sock.send_multipart(frames, copy=copy)
        return rid

    @staticmethod
    def _wait(sock: zmq.Socket, event: int, timeout: float, check: Callable[[], None] | None) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if sock.poll(min(left, 1.0 if check else left) * 1e3, event):
                return True
            if check is not None:
                check()

    def recv(
        self, rid: int, op: str, *, timeout: float | None = None, check: Callable[[], None] | None = None
    ) -> tuple[Any, protocol.Message]:
        """Wait for the reply to request ``rid``; raise its error, or TQConnectionError on silence
        (``check`` as in :meth:`send`)."""
        sock = self._socket()
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._wait(sock, zmq.POLLIN, left, check):
                raise TQConnectionError(
                    f"no reply from {self.name} at {self.address} to {op!r} within {timeout:.1f}s: "
                    "server down, unreachable or overloaded"
                )
            frames = sock.recv_multipart(copy=False)
            try:
                msg = protocol.decode(frames, self.secret)
            except AuthenticationError:
                raise AuthenticationError(
                    f"reply from {self.name} at {self.address} to {op!r} is not signed with this client's secret "
                    "(wrong secret? the server rejects requests it cannot verify)"
                ) from None
            reply_rid = msg.header.get("rid")
            if reply_rid is None and msg.header.get("ok") is False:
                # The server could not decode one of our requests (e.g. unauthenticated), so it could
                # not echo its id; requests on this socket are sequential, so it answers this one.
                protocol.raise_for_reply(msg)
            if reply_rid != rid:
                continue  # a late reply to a request that timed out earlier
            return protocol.raise_for_reply(msg), msg

    def call(
        self, op: str, args: dict[str, Any], buffers: Sequence[Any] = (), *, timeout: float | None = None,
        check: Callable[[], None] | None = None,
    ) -> tuple[Any, protocol.Message]:
        """Send a request and wait for its reply."""
        rid = self.send(op, args, buffers, timeout=timeout, check=check)
        return self.recv(rid, op, timeout=timeout, check=check)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for s in self._sockets:
                s.close(0)
            self._sockets.clear()
