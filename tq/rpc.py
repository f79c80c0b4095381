"""Request/reply over ZMQ (and over stream sockets - Unix on one host, TCP across - :mod:`tq.stream_transport`):
a single-threaded server loop and a thread-safe client channel.

Servers (controller, storage units) own one ROUTER socket (and a same-host Unix socket, served by the
same loop) and never sleep on a request: a handler
either answers at once or parks the request (``DEFERRED``) and answers it later from the loop, e.g.
when a wait's fields are produced or its deadline passes. Clients talk through DEALER sockets, one per
thread per server (or a Unix-socket connection per thread), so a client object is safe to share
between threads without a lock; replies carry
the request id, so a late reply to a request that already timed out is recognised and dropped.

With a secret, a server accepts connections only through ZMTP PLAIN with the password derived from the
secret, checked by a ZAP handler thread (one per ZMQ context, shared by every server in the process),
and refuses replayed requests (:class:`protocol.ReplayGuard`); clients set those credentials on every
socket they connect (:func:`set_client_credentials`). The Unix socket has no handshake to gate: any
local process can connect (as to a loopback port), and every request there is checked by its HMAC and
the replay guard alone, as every request over ZMQ is too; a connection whose request fails them gets
that error and is closed, and one that sends no authenticated request within
:data:`tq.stream_transport.HANDSHAKE_S` is closed too, so an unauthenticated process holds at most a
reply and a descriptor of a server, and not for long.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import contextlib
import math
import os
import hashlib
import hmac
import itertools
import logging
import secrets
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from . import stream_transport, protocol
from .errors import AuthenticationError, MalformedMessageError, TQConnectionError, TQError, UnknownOperationError
from .messages import Args, ArgsDecoder, ReplyDecoder, is_map
from .peerlog import PeerLog

log = logging.getLogger(__name__)

DEFERRED = object()  # a handler's return value meaning "I will reply later"
Handler = Callable[[Any, list, "Call"], Any]  # (the op's typed args, buffer frames, call) -> result
# Failed handshakes: wrong credentials (AUTH), another security mechanism (PROTOCOL), or the peer hung
# up mid-handshake (NO_DETAIL) - which is how a mechanism mismatch often looks from the side that did
# not detect it first.
_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
_monitor_ids = itertools.count()
# poll events as plain ints: pyzmq's flags are enums, and an enum operation costs a microsecond a turn
_READABLE, _WRITABLE = int(zmq.POLLIN | zmq.POLLERR), int(zmq.POLLOUT)


def _handshake_monitor(sock: zmq.Socket) -> zmq.Socket:
    """A PAIR socket receiving ``sock``'s failed-handshake events. Its inproc name is unique: pyzmq's
    default is named after the socket's fd, which a new socket may reuse before the old name is gone."""
    return sock.get_monitor_socket(_HANDSHAKE_FAILED, addr=f"inproc://tq-handshake-monitor-{next(_monitor_ids)}")


# ----------------------------------------------------------------------------- time budgets
_budget = threading.local()  # .stack: this thread's running budget blocks, [(deadline, frame of the `with`)], innermost last


class time_budget:
    """Every request this thread sends inside the block shares one deadline, ``seconds`` from now (or
    an enclosing block's, if sooner): a client call made of several requests (a put's store, commit
    and abort probe) then takes at most its timeout in all, not a timeout per request.

    A block interrupted between entering and its body (a Ctrl-C, a signal handler's exception: Python
    does not run ``__exit__`` then) would leave its deadline in force for every later call of the
    thread - a client answering "no time left" forever after one Ctrl-C. So a block is identified by
    the frame running its ``with``, and one whose frame no longer runs is dropped (:func:`_running`)."""

    __slots__ = ("seconds", "_entry")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._entry: tuple[float, Any] | None = None

    def __enter__(self) -> None:
        stack = _running(sys._getframe(1))
        mine = time.monotonic() + self.seconds
        self._entry = (mine if not stack else min(stack[-1][0], mine), sys._getframe(1))
        stack.append(self._entry)

    def __exit__(self, *exc: Any) -> None:
        stack, entry, self._entry = getattr(_budget, "stack", []), self._entry, None
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is entry:  # it and any interrupted block above it
                del stack[i:]
                return


def _running(frame: Any) -> list[tuple[float, Any]]:
    """This thread's budget stack, less the blocks on top whose frames are not among ``frame`` and
    its callers (interrupted blocks: see :class:`time_budget`). A running block's frame is found a
    few frames up; an interrupted one is dropped before any block is entered above it, so it is only
    ever on top."""
    stack: list[tuple[float, Any]] | None = getattr(_budget, "stack", None)
    if stack is None:
        stack = _budget.stack = []
    while stack:
        top, f = stack[-1][1], frame
        while f is not None and f is not top:
            f = f.f_back
        if f is not None:
            break
        stack.pop()
    return stack


def time_left() -> float | None:
    """Seconds left of this thread's current :class:`time_budget` (None outside one)."""
    stack = _running(sys._getframe(1))
    return stack[-1][0] - time.monotonic() if stack else None


def _bounded(timeout: float, op: str, peer: str) -> float:
    """``timeout`` cut to the current time budget; TQConnectionError if the budget is spent."""
    left = time_left()
    if left is None or left >= timeout:
        return timeout
    if left <= 0:
        raise TQConnectionError(f"no time left to ask {peer} for '{op}': the call's timeout ran out on earlier requests")
    return left


# ----------------------------------------------------------------------------- connections over a network
# A TCP connection that holds an unacknowledged request when the network fails (a partition, a switch
# dropping packets: no reset) is retransmitted into with a doubling back-off once the network is back
# (0.2 s up to 2 minutes: a controller heard its unit again 25 s after a 30 s partition healed), and
# a connect tried meanwhile waits out its SYN's back-off the same way. So a ZMQ connection that hears
# nothing for ZMQ_SILENT_S, though pinged every ZMQ_HEARTBEAT_S (ZMTP heartbeats, which the peer's I/O
# thread answers however busy its loop), is dropped and made again, each connect given ZMQ_CONNECT_TRY_S
# before ZMQ tries again (every 0.1 s) - all found within about a second of the network's return.
ZMQ_HEARTBEAT_S = 1.0
ZMQ_SILENT_S = 3.0
ZMQ_CONNECT_TRY_S = 1.0


def reconnect_when_silent(sock: zmq.Socket) -> None:
    """Set a connecting ZMQ socket up to find a dead network path and connect again (see above); call
    it before ``connect``."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(ZMQ_HEARTBEAT_S * 1e3))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(ZMQ_SILENT_S * 1e3))
    sock.setsockopt(zmq.CONNECT_TIMEOUT, int(ZMQ_CONNECT_TRY_S * 1e3))


RESEND_MIN_S = 0.05  # a stuck request is sent again only with this much of its call's time left


class _RequestStuck(Exception):
    """A request not getting through: TCP is retransmitting it, or the ZMQ connection that held it was
    dropped for its silence (see RpcChannel.call's ``resend``)."""


def refuses_connections(address: str, timeout: float) -> bool:
    """Whether a TCP connect to ``address`` (``tcp://host:port``) is refused within ``timeout``: its
    host answers and nothing listens there - the server's process is gone, where silence (a network
    cut, a host down) gives no answer at all. False for any other outcome, and for other transports."""
    if not address.startswith("tcp://"):
        return False
    host, port = stream_transport.endpoint_host(address), int(address.rsplit(":", 1)[1])
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False
    return False


# ----------------------------------------------------------------------------- connection security
def set_client_credentials(sock: zmq.Socket, secret: bytes | None) -> None:
    """Give a client socket (DEALER) what a server with ``secret`` asks at connect time; call it
    before ``connect``. Without a secret the socket stays on ZMTP's NULL mechanism, as the server."""
    if secret:
        sock.plain_username = protocol.CONNECTION_USERNAME
        sock.plain_password = protocol.connection_password(secret)


_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (RFC 27)
_zap_lock = threading.Lock()
_zap_handlers: dict[zmq.Context, threading.Thread] = {}
_zap_passwords: dict[bytes, bytes] = {}  # ZAP domain -> the password its connections must present


def _secure_server_socket(sock: zmq.Socket, secret: bytes) -> None:
    """Make a server socket (before ``bind``) accept only PLAIN connections that present the password
    derived from ``secret``. A peer without it is dropped in the handshake, before libzmq reads any
    message frame from it - the HMAC check comes only after a whole message is buffered."""
    password = protocol.connection_password(secret)
    domain = b"tq-" + hashlib.sha256(password).hexdigest()[:16].encode()  # one per secret in this process
    ctx = sock.context
    with _zap_lock:
        _zap_passwords[domain] = password
        if ctx not in _zap_handlers:  # ZAP is per context: one handler serves every server in it
            zap = ctx.socket(zmq.REP)
            zap.setsockopt(zmq.LINGER, 0)
            zap.bind(_ZAP_ENDPOINT)
            thread = threading.Thread(target=_serve_zap, args=(zap,), name="tq-zap", daemon=True)
            thread.start()
            _zap_handlers[ctx] = thread
    sock.zap_domain = domain
    sock.plain_server = True


def _serve_zap(zap: zmq.Socket) -> None:
    """ZAP handler (RFC 27): allow a PLAIN connection whose password is the one of its server's domain."""
    try:
        while True:
            msg = zap.recv_multipart()
            if len(msg) < 6:
                if len(msg) >= 2:
                    zap.send_multipart([b"1.0", msg[1], b"400", b"malformed ZAP request", b"", b""])
                continue
            _version, request_id, domain, _address, _identity, mechanism, *credentials = msg
            expected = _zap_passwords.get(domain)
            ok = mechanism == b"PLAIN" and expected is not None and len(credentials) == 2 and hmac.compare_digest(credentials[1], expected)
            reply = [b"200", b"OK", protocol.CONNECTION_USERNAME] if ok else [b"400", b"wrong credentials", b""]
            zap.send_multipart([b"1.0", request_id, *reply, b""])
    except zmq.ContextTerminated:
        pass
    finally:
        zap.close(0)


class Call:
    """The context of one request being served: who asked and under which request id (and, with
    metrics on, how many bytes the request was)."""

    __slots__ = ("identity", "rid", "op", "started", "nbytes")

    def __init__(self, identity: bytes | stream_transport.StreamPeer, rid: Any, op: str, started: float, nbytes: int = 0) -> None:
        self.identity, self.rid, self.op, self.started, self.nbytes = identity, rid, op, started, nbytes


# Upper bounds (seconds) of the latency histogram buckets (Prometheus ``le``; +Inf is the last bucket):
# controller ops take tens of microseconds, a parked wait or a big store up to seconds.
LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


LATENCY_WINDOW = 4096  # recent latencies per op kept for p50/p99 (a power of two: the ring's index is a mask)


class OpStats:
    """Per-operation counters and a ring of the last LATENCY_WINDOW latencies (for p50/p99); with
    metrics on also a latency histogram (counts per :data:`LATENCY_BUCKETS` bucket, not cumulative) and
    bytes in/out. The ring is a numpy array, so a summary (every ``stats`` request: each ``status``,
    each metrics scrape) reads it without converting 4096 Python floats while the loop waits."""

    __slots__ = ("count", "errors", "window", "buckets", "sum_s", "bytes_in", "bytes_out")

    def __init__(self) -> None:
        self.count = 0
        self.errors = 0
        self.window = np.zeros(LATENCY_WINDOW)
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum_s = 0.0
        self.bytes_in = 0
        self.bytes_out = 0

    def add(self, latency: float) -> None:
        """Count one request that took ``latency`` seconds (its errors are counted by the caller)."""
        self.window[self.count & (LATENCY_WINDOW - 1)] = latency
        self.count += 1

    def summary(self, histogram: bool = False) -> dict[str, Any]:
        lat = self.window[: min(self.count, LATENCY_WINDOW)]
        p50 = p99 = 0.0
        if lat.size:
            ranks = [(lat.size - 1) // 2, (lat.size - 1) * 99 // 100]  # nearest-rank, as a partition finds them
            p50, p99 = (np.partition(lat, ranks)[ranks] * 1e3).tolist()
        out: dict[str, Any] = {"count": self.count, "errors": self.errors, "p50_ms": p50, "p99_ms": p99}
        if histogram:
            out.update(buckets=list(self.buckets), sum_s=self.sum_s, bytes_in=self.bytes_in, bytes_out=self.bytes_out)
        return out


class ServerMustStop(BaseException):
    """Raised by a handler, :meth:`RpcServer.on_applied`, :meth:`RpcServer.applying` or a tick when
    the server must stop at once - e.g.
    its journal cannot be written, so a change applied in memory would not survive a restart, and
    serving on would let later requests (or messages to storage units) build on it. The request's
    caller gets ``error``; then it leaves :meth:`RpcServer.serve_forever` without serving, ticking or
    closing anything (a BaseException, so no handler's ``except Exception`` swallows it)."""

    def __init__(self, error: TQError) -> None:
        super().__init__(str(error))
        self.error = error


class RpcServer:
    """A ROUTER socket and a poll loop dispatching ``op`` to registered handlers."""

    def __init__(self, name: str, bind: str, *, secret: bytes | None, max_message_bytes: int) -> None:
        self.name = name
        self.secret = secret
        self.spin_s = serve_spin_s()  # before anything is bound: a bad TQ_SERVE_SPIN_US fails the start
        self.max_message_bytes = max_message_bytes
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)  # per frame, checked before it is read
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        # With a secret: connections must pass the PLAIN handshake, requests must be fresh. Without one
        # nothing is checked at all (and nothing costs anything).
        self._guard: protocol.ReplayGuard | None = None
        self._monitor: zmq.Socket | None = None
        if secret:
            _secure_server_socket(self.sock, secret)
            self._guard = protocol.ReplayGuard()
        if bind.endswith(":0"):
            port = self.sock.bind_to_random_port(bind.rsplit(":", 1)[0])
            bind = f"{bind.rsplit(':', 1)[0]}:{port}"
        else:
            self.sock.bind(bind)
        self.address = bind
        self.handlers: dict[str, tuple[Handler, ArgsDecoder]] = {}  # op -> its handler and args decoder
        self.op_stats: dict[str, OpStats] = collections.defaultdict(OpStats)
        self.rejected = 0  # malformed, unauthenticated or otherwise refused messages (and handshakes)
        self.peer_log = PeerLog(log)  # what peers do wrong: every one counted, a line per kind per 10 s
        self.auth_failures = 0  # of those: refused handshakes and requests failing the secret's checks
        # Per-op latency histograms and bytes in/out, for the Prometheus endpoint (tq.metrics): off
        # unless metrics are exported, so a service without them pays nothing for them.
        self.metrics = False
        self.metrics_url: str | None = None
        self.started_at = time.time()
        self._running = False
        self._extra_sockets: dict[zmq.Socket, Callable[[list], None]] = {}
        self._poller = zmq.Poller()
        if secret:  # count refused handshakes; polled first, so they are counted before later requests
            self._monitor = _handshake_monitor(self.sock)
            self._poller.register(self._monitor, zmq.POLLIN)
        self._poller.register(self.sock, zmq.POLLIN)
        self._fd_handlers: dict[int, Callable[[bool, bool], None]] = {}  # see watch_fd
        self.read_buffer = bytearray(stream_transport.RECV_CHUNK)  # for every stream of this loop
        # see listen_streams: this host's processes come over the Unix socket, others' over TCP
        self.local: stream_transport.StreamListener | None = None
        self.tcp: stream_transport.StreamListener | None = None
        self.listeners: tuple[stream_transport.StreamListener, ...] = ()  # those of the two there are
        self._beside: list[stream_transport.StreamPeer] = []  # see flush_beside
        self._reading: list[stream_transport.StreamPeer] = []  # see read_beside
        self._beside_pool: concurrent.futures.ThreadPoolExecutor | None = None

    def listen_streams(self, token: str | None = None, tcp_port: int = 0, exact_port: bool = False) -> None:
        """Also serve clients over stream sockets (:mod:`tq.stream_transport`: a round trip without ZMQ's
        I/O threads): this host's on an abstract Unix socket (where the platform has them), others on a
        TCP port of the interface the ZMQ socket is bound to (where it is a TCP one). ``token``: the
        addresses' random part, and ``tcp_port``, kept by a server that is restarted on its state (see
        :func:`tq.stream_transport.stable_token`); taken by another process, fresh ones are drawn -
        unless ``exact_port`` (an operator's choice): then OSError naming it."""
        if self.local is not None or self.tcp is not None:
            return
        limit = self.max_message_bytes + protocol.MAX_FRAME_BYTES  # a limit on buffers; the header comes on top
        token = token or secrets.token_hex(16)
        kw: dict[str, Any] = {"max_message_bytes": limit, "secret": bool(self.secret)}
        if stream_transport.supported():
            try:
                self.local = stream_transport.listen_unix(self.name, self, self._serve_frames, token=token, **kw)
            except OSError:  # the token is taken (a restarted server's old one, still held)
                token = secrets.token_hex(16)
                self.local = stream_transport.listen_unix(self.name, self, self._serve_frames, token=token, **kw)
        if self.address.startswith("tcp://"):
            host = stream_transport.endpoint_host(self.address)
            try:
                self.tcp = stream_transport.listen_tcp(
                    self.name, self, self._serve_frames, host, token=token, port=tcp_port, exact=exact_port, **kw
                )
            except OSError as exc:  # e.g. a ZMQ interface name: its clients keep to ZMQ
                if exact_port:
                    raise
                log.info("%s: no TCP stream socket on %s (%s); remote clients use ZMQ", self.name, host, exc)
        self.listeners = tuple(x for x in (self.local, self.tcp) if x is not None)

    def watch_fd(self, fd: int, writable: bool, handler: Callable[[bool, bool], None], readable: bool = True) -> None:
        """Poll a file descriptor in this loop (:class:`tq.stream_transport.PollLoop`)."""
        self._fd_handlers[fd] = handler
        self._poller.register(fd, (zmq.POLLIN if readable else 0) | (zmq.POLLOUT if writable else 0))

    def unwatch_fd(self, fd: int) -> None:
        if self._fd_handlers.pop(fd, None) is not None:
            self._poller.unregister(fd)

    def flush_beside(self, peer: stream_transport.StreamPeer) -> bool:
        """Write ``peer`` at the end of this turn (:class:`tq.stream_transport.PollLoop`)."""
        if not self._beside_threads():
            return False
        self._beside.append(peer)
        return True

    def read_beside(self, peer: stream_transport.StreamPeer) -> bool:
        """Read ``peer``'s big message at the end of this turn (:class:`tq.stream_transport.PollLoop`)."""
        if not self._beside_threads():
            return False
        self._reading.append(peer)
        return True

    def _beside_threads(self) -> bool:
        """Whether this loop has threads to write and read beside it (made on first use)."""
        if self._beside_pool is None:
            if stream_transport.PARALLEL_FLUSH_THREADS < 2:
                return False
            self._beside_pool = concurrent.futures.ThreadPoolExecutor(
                stream_transport.PARALLEL_FLUSH_THREADS - 1, thread_name_prefix=f"{self.name}-beside"
            )
        return True

    def _side_by_side(self, peers: list[stream_transport.StreamPeer], work: Callable[[stream_transport.StreamPeer], Any]) -> list[Any]:
        """``work(peer)`` for every peer, each on a thread (this one does the first), waiting for all:
        the loop's state is touched on this thread only, before and after."""
        assert self._beside_pool is not None
        futures = [self._beside_pool.submit(work, p) for p in peers[1:]]
        return [work(peers[0]), *(f.result() for f in futures)]

    def _flush_beside(self) -> None:
        """Write the connections ``flush_beside`` was given side by side."""
        listed, self._beside = self._beside, []
        for p in listed:  # each is listed once (StreamPeer.beside): two threads writing one socket would interleave it
            p.beside = False
        peers = [p for p in listed if not p.closed]
        if peers:
            for peer, exc in zip(peers, self._side_by_side(peers, stream_transport.StreamPeer.write_out)):
                peer.written(exc)

    def _read_beside(self) -> None:
        """Read the big messages of the connections ``read_beside`` was given side by side (each is
        listed once: a connection lists itself from its one read of a turn), then serve what completed."""
        listed, self._reading = self._reading, []
        peers = [p for p in listed if not p.closed]
        if peers:
            for peer, (done, exc) in zip(peers, self._side_by_side(peers, stream_transport.StreamPeer.read_body)):
                peer.body_read(done, exc)

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

    def on_applied(self, op: str, raw_args: Any, buffers: list) -> None:
        """Called after a request was served successfully (before the reply goes out), with its args as
        the raw msgpack bytes they arrived in."""

    def applying(self) -> contextlib.AbstractContextManager:
        """The context a request's handler and :meth:`on_applied` run in; its reply goes out after. A
        server whose handlers send nothing while they run may return its journal's ``batch()``, so a
        request's records leave in one write (a storage unit does)."""
        return contextlib.nullcontext()

    def serve_ops(self, requests: dict[Any, type[Args]], handlers: dict[Any, Handler]) -> None:
        """Serve every op of ``requests`` (op -> its args struct, see :mod:`tq.messages`) with its handler
        in ``handlers``: each op has exactly one of each."""
        if set(requests) != set(handlers):
            raise TypeError(f"{self.name}: ops without a handler or a request type: {set(requests) ^ set(handlers)}")
        for op, args_type in requests.items():
            name = getattr(op, "value", op)
            self.handlers[name] = (handlers[op], ArgsDecoder(name, args_type))

    def handle(self, op: str, args: Any, buffers: list, call: "Call") -> Any:
        """Decode ``args`` (raw msgpack, or a map as a journal or a test holds them) into the op's
        struct and run its handler, as the serving loop does."""
        handler, decoder = self.handlers[op]
        return handler(decoder.convert(args) if isinstance(args, dict) else decoder.decode(args), buffers, call)

    def add_socket(self, sock: zmq.Socket, on_message: Callable[[list], None]) -> None:
        """Poll another socket (e.g. a DEALER to a storage unit) in the same loop."""
        self._extra_sockets[sock] = on_message
        self._poller.register(sock, zmq.POLLIN)

    # -- replies
    def reply(self, call: Call, result: Any, buffers: Sequence[Any] = ()) -> None:
        frames = protocol.reply_ok(call.rid, result, buffers, self.secret)
        self._send_reply(call, frames)
        self._record(call, frames, ok=True)

    def reply_error(self, call: Call, exc: BaseException) -> None:
        frames = protocol.reply_error(call.rid, exc, self.secret)
        self._send_reply(call, frames)
        self._record(call, frames, ok=False)

    def _send_reply(self, call: Call, frames: list[Any]) -> None:
        if type(call.identity) is bytes:
            self.sock.send_multipart([call.identity, *frames], copy=not _zero_copy(frames))
        else:  # a same-host client (nothing is sent to one that went away)
            call.identity.send(frames)

    def _record(self, call: Call, frames: Sequence[Any], *, ok: bool) -> None:
        st = self.op_stats[call.op]
        latency = time.perf_counter() - call.started
        st.add(latency)
        st.errors += 0 if ok else 1
        if self.metrics:  # plain ints, no lock: the loop is the only writer (a scrape reads via the stats op)
            st.buckets[bisect.bisect_left(LATENCY_BUCKETS, latency)] += 1
            st.sum_s += latency
            st.bytes_in += call.nbytes
            st.bytes_out += sum(memoryview(f).nbytes for f in frames)

    def close_after_last_reply(self) -> None:
        """For a server leaving on :class:`ServerMustStop`: keep its sockets open for
        ``LAST_REPLY_GRACE_S`` (serving nothing) so that the error reply it just sent is read by its
        caller, then drop them. Exiting right after the send lost that reply now and then under load
        (the caller then waited out its timeout)."""
        time.sleep(LAST_REPLY_GRACE_S)
        self.sock.context.destroy(linger=0)
        for listener in self.listeners:
            listener.close()

    # -- loop
    def stop(self) -> None:
        self._running = False

    def _wake_on_signals(self) -> Callable[[], None]:
        """Have a signal wake this loop's poll (``signal.set_wakeup_fd``): a SIGTERM's handler calls
        :meth:`stop`, and without this the poll, restarted after the interruption, slept out its
        remaining 100 ms first - twice in a service's shutdown (controller, then its units). Only in
        the main thread, where Python runs signal handlers; returns what undoes it."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        earlier = signal.set_wakeup_fd(w, warn_on_full_buffer=False)

        def drain(readable: bool, writable: bool) -> None:
            with contextlib.suppress(BlockingIOError):
                os.read(r, 4096)

        self.watch_fd(r, False, drain)

        def undo() -> None:
            signal.set_wakeup_fd(earlier)
            self.unwatch_fd(r)
            os.close(r)
            os.close(w)

        return undo

    def serve_forever(self) -> None:
        self._running = True
        unwake = self._wake_on_signals()
        try:
            self._serve_loop()
        finally:
            unwake()
        self.close()

    def _serve_loop(self) -> None:
        spin_s, busy_at = self.spin_s, 0.0
        while self._running:
            if self._beside:  # what this loop's last turn left to write, written side by side
                self._flush_beside()
            deadline = self.next_deadline()
            # whole milliseconds, rounded up: zmq's poll truncates, so a deadline under 1 ms away would
            # spin the loop (and a CPU) until it passed
            timeout_ms = 100 if deadline is None else max(0, min(100, math.ceil((deadline - time.monotonic()) * 1e3)))
            if spin_s and time.perf_counter() - busy_at < spin_s:  # see serve_spin_s
                timeout_ms = 0
            ready = self._poller.poll(timeout_ms)
            if ready:
                busy_at = time.perf_counter()
            for sock, event in ready:
                if sock is self.sock:
                    self._serve_ready()
                elif type(sock) is int:  # a file descriptor (watch_fd); None: unwatched earlier in this batch
                    handler = self._fd_handlers.get(sock)
                    if handler is not None:
                        handler(bool(event & _READABLE), bool(event & _WRITABLE))
                elif sock is self._monitor:
                    self._on_refused_handshake()
                else:
                    on_message = self._extra_sockets.get(sock)
                    if on_message is not None:  # None: closed by a message earlier in this batch (a unit rejoined)
                        on_message(sock.recv_multipart())
            if self._reading:  # the big messages this turn found coming in, read side by side now
                self._read_beside()
            now = time.monotonic()
            for listener in self.listeners:
                listener.on_tick(now)
            self.on_tick(now)

    def close(self) -> None:
        if self._monitor is not None:
            self.sock.disable_monitor()
            self._monitor.close(0)
        self.sock.close(linger=1000)  # let the last replies (e.g. to "shutdown") go out
        for s in self._extra_sockets:
            s.close(0)
        for listener in self.listeners:
            listener.close()
        if self._beside_pool is not None:
            self._beside_pool.shutdown(wait=True)

    def _on_refused_handshake(self) -> None:
        event = recv_monitor_message(self._monitor)["event"]
        self.rejected += 1
        self.auth_failures += 1
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # e.g. a port probe, or a peer that saw a mismatch
            log.info("%s: a peer hung up during its handshake", self.name)
        else:
            why = "wrong credentials" if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH else "no or another security mechanism"
            self.peer_log.warning(
                "handshake", "%s refused a connection at its handshake: %s (the peer lacks this service's secret)", self.name, why
            )

    def secure_client_socket(self, sock: zmq.Socket) -> None:
        """Set this server's credentials on a client socket it opens to its peers (before ``connect``)."""
        set_client_credentials(sock, self.secret)

    def _serve_ready(self) -> None:
        """Serve the requests already queued, up to SERVE_BATCH, before the loop's tick: under many
        clients the tick's work (the units' claims, adopts and frees) then goes out once per batch,
        not once per request; a lone client's request is served as before (nothing else queued)."""
        for _ in range(SERVE_BATCH):
            # a handshake refused before the next request came is counted before it is served, as the
            # poll (monitor first) would (the loop may have been descheduled while both arrived)
            while self._monitor is not None and self._monitor.get(zmq.EVENTS) & zmq.POLLIN:
                self._on_refused_handshake()
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._serve_one(frames)

    def _serve_one(self, frames: list[zmq.Frame]) -> None:
        self._serve_frames(frames[0].bytes, frames[1:])

    def _serve_frames(self, identity: bytes | stream_transport.StreamPeer, frames: Sequence[Any]) -> None:
        """Serve one request (its frames after the ZMQ identity) from ``identity``: a ZMQ peer, or a
        same-host client of :attr:`local`."""
        started = time.perf_counter()
        call = Call(identity, None, "<invalid>", started, sum(map(len, frames)) if self.metrics else 0)
        try:
            msg = protocol.decode_request(frames, self.secret, max_message_bytes=self.max_message_bytes)
            call.rid = msg.rid
            if self._guard is not None:
                self._guard.check_stamp(msg.sid, msg.seq, msg.ts)  # authentic, but is it fresh?
                if type(identity) is not bytes:  # a stream connection proved it holds the secret
                    for listener in self.listeners:
                        listener.proven(identity)
            op = msg.op
            if not isinstance(op, str) or not is_map(msg.args):
                raise MalformedMessageError("request needs a string 'op' and a map 'args'")
            entry = self.handlers.get(op)
            if entry is None:
                raise UnknownOperationError(f"{self.name} has no operation {protocol.shown(op)}")
            call.op = op
            handler, decoder = entry
            with self.applying():
                out = handler(decoder.decode(msg.args), msg.buffers, call)
                self.on_applied(op, msg.args, msg.buffers)  # e.g. journal it - before the caller hears it is done
            if out is DEFERRED:
                return
            result, buffers = out if isinstance(out, tuple) else (out, ())
            self.reply(call, result, buffers)
        except ServerMustStop as stop:  # the caller hears why; nothing else is served or sent
            self.reply_error(call, stop.error)
            raise
        except TQError as exc:
            if call.op == "<invalid>":
                self.rejected += 1
                self.auth_failures += isinstance(exc, AuthenticationError)
                self.peer_log.warning("message", "%s rejected a message: %s", self.name, exc)
            self.reply_error(call, exc)
            if isinstance(exc, AuthenticationError) and type(call.identity) is not bytes:
                # no handshake authenticated this same-host connection (PLAIN does a ZMQ one): a peer
                # failing the check gets this one answer, then the connection ends
                call.identity.end_after_flush()
        except Exception as exc:  # a bug must not take the server down
            log.exception("%s failed serving %s", self.name, call.op)
            self.reply_error(call, exc)

    def server_stats(self) -> dict[str, Any]:
        """Uptime, refused messages, per-op counts and latencies (histograms with metrics on), the
        metrics endpoint and, for a server that journals (``self.journal``), the journal's size."""
        journal = getattr(self, "journal", None)
        return {
            "uptime_s": time.time() - self.started_at,
            "rejected_messages": self.rejected + sum(x.rejected for x in self.listeners),
            "auth_failures": self.auth_failures,
            "ops": {op: st.summary(self.metrics) for op, st in sorted(self.op_stats.items())},
            "metrics": self.metrics,
            "metrics_url": self.metrics_url,
            "journal_bytes": _file_size(journal.path) if journal is not None else 0,
            "local_connections": len(self.local.peers) if self.local is not None else 0,
            "tcp_stream_connections": len(self.tcp.peers) if self.tcp is not None else 0,
        }


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:  # closed and removed on shutdown
        return 0


def _zero_copy(frames: Sequence[Any]) -> bool:
    """Whether to send ``frames`` zero-copy: only when one is big. pyzmq copies frames under
    ``zmq.COPY_THRESHOLD`` anyway, and its zero-copy path costs about twice as much per small message."""
    return any(memoryview(f).nbytes >= zmq.COPY_THRESHOLD for f in frames)


# how often a wait on a server calls its ``check`` (a client asks the controller whether the storage
# unit it waits on is down or came back at another address): a unit restarted meanwhile is found
# within this (at 1 s, the chaos benchmark's client-seen unit restarts read 2.2-2.3 s now and then,
# a request sent to the dead unit waiting out the check)
CHECK_EVERY_S = 0.25
LAST_REPLY_GRACE_S = 0.5  # a server stopping at once (ServerMustStop) keeps its sockets this long first
SERVE_BATCH = 64  # requests a server takes from its queue before its loop ticks again (bounds the tick's delay)


def serve_spin_s() -> float:
    """How long a server's loop polls without sleeping after it last had something to do, before it
    blocks: a sleeping server is woken through the kernel's scheduler - on a VM an interrupt through the
    hypervisor, most of what a same-host round trip costs - and a client's next request (a put's
    commit after its store, the next put) mostly comes within a millisecond. Spinning takes a core, so
    only where there are cores to spare: 1 ms with 8 or more, none below (on 2 vCPUs the spinning
    server took the CPU its client needed: put p50 0.31 -> 0.55 ms). ``TQ_SERVE_SPIN_US`` sets it
    (0: never spin, as on a host whose cores the trainer needs). Measured on a 16-core H200 host (1 ms,
    two runs of 3,000 calls): 1-key TCP put p99 1.20 / 1.15 -> 0.79 / 0.62 ms, TCP get p99
    0.90 / 1.01 -> 0.73 / 0.52 ms, same-host put p99 0.55 / 0.72 -> 0.40 / 0.39 ms."""
    env = os.environ.get("TQ_SERVE_SPIN_US")
    if env is not None:
        try:
            us = float(env)
        except ValueError:
            raise ValueError(f"TQ_SERVE_SPIN_US must be a number of microseconds, not {env!r}") from None
        if not 0 <= us <= 100_000:
            raise ValueError(f"TQ_SERVE_SPIN_US must be between 0 and 100000 microseconds, not {env!r}")
        return us * 1e-6
    return 1e-3 if stream_transport.usable_cores() >= 8 else 0.0


# A client polls for a reply this long before it sleeps on the socket: most replies of a same-host
# server come within it, and waking a sleeping thread is what a round trip mostly cost on a busy VM
# (2 vCPUs: bare round trip p50 0.57 -> 0.34 ms with a 250 us spin, 0.36 ms with 1 ms; measured).
REPLY_SPIN_S = 250e-6


def _polled_within(sock: zmq.Socket, seconds: float) -> bool:
    """Whether a message arrives on ``sock`` within ``seconds``, found by polling without sleeping."""
    end = time.perf_counter() + seconds
    while True:
        if sock.poll(0, zmq.POLLIN):
            return True
        if time.perf_counter() >= end:
            return False


class RpcChannel:
    """Request/reply to one server, safe to use from many threads (one DEALER socket per thread).

    ``replies`` (op name -> :class:`~tq.messages.ReplyDecoder`: ``messages.CONTROLLER_REPLY_DECODERS``
    or ``messages.UNIT_REPLY_DECODERS``) are the ops the channel may send: every reply is decoded into
    its op's typed result, and an op without a reply type is refused before anything is sent."""

    _rids = itertools.count(1)

    def __init__(self, address: str, *, secret: bytes | None, timeout: float, name: str, replies: Mapping[str, ReplyDecoder]) -> None:
        self.address, self.secret, self.timeout, self.name = address, secret, timeout, name
        self.replies = replies
        self.ctx = zmq.Context.instance()
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._monitors: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._streams: list[stream_transport.ClientStream] = []
        self.stream_address: str | None = None  # see use_stream
        # (address, until when, seconds waited) after a stream could not be had there: every thread keeps
        # to ZMQ until then - a firewall drops every thread's connect alike, and each try costs its timeout
        self.stream_refused: tuple[str, float, float] | None = None

    def use_stream(self, address: str | None) -> None:
        """Send this channel's requests over the server's stream socket at ``address`` (its Unix socket
        or its TCP one, from the server's hello; None: ZMQ only). A thread that cannot connect to it
        keeps using ZMQ. A server bound to every interface (``0.0.0.0``, ``*``) advertises that
        wildcard: the stream is sought on the host this channel reaches the server's ZMQ socket at."""
        if address and address.startswith("tcp://"):
            address = stream_transport.on_host_of(address, self.address)
        self.stream_address = address if address and (address.startswith("tcp://") or stream_transport.supported()) else None

    def _stream(self, timeout: float) -> stream_transport.ClientStream | None:
        """This thread's stream to :attr:`stream_address`, connected on first use, within ``timeout``
        (the call's time left); None when there is none to use (no address, or it refused this
        thread: another host or network namespace, a firewall, another server on the port)."""
        stream = getattr(self._local, "stream", None)
        address = self.stream_address
        if stream is not None and stream.address != address:  # the server moved (or is not to be used)
            self._drop_stream(stream)
            stream = None
        refused = self.stream_refused
        if stream is not None or address is None or (refused is not None and refused[0] == address and time.monotonic() < refused[1]):
            return stream
        full = min(self.timeout, stream_transport.TCP_CONNECT_S)
        try:
            stream = stream_transport.ClientStream(address, min(full, timeout))
        except (OSError, ValueError) as exc:  # ValueError: an address no server of ours advertises
            log.debug("%s: no stream connection at %s (%s); using %s", self.name, address, exc, self.address)
            # a connect cut short by the call's time left says little of the server: tried again soon
            self._refuse_stream(address, timed_out=isinstance(exc, TimeoutError) and timeout >= full)
            return None
        self.stream_refused = None
        stream.sender = protocol.Sender() if self.secret else None
        with self._lock:
            if self._closed:
                stream.close()
                raise TQConnectionError(f"client connection to {self.name} is closed")
            self._streams.append(stream)
        self._local.stream = stream
        return stream

    def _refuse_stream(self, address: str, *, timed_out: bool) -> None:
        """Keep every thread off the stream at ``address`` for a while: RETRY_S after a refusal (nothing
        listens there, it closed), UNREACHABLE_RETRY_S after a connect that timed out, doubling with each
        timeout in a row up to UNREACHABLE_MAX_S (a firewall that drops the port costs each try the
        connect timeout: at most one try in that long, however many threads call)."""
        wait = stream_transport.RETRY_S
        if timed_out:
            last = self.stream_refused
            waited = last[2] if last is not None and last[0] == address else 0.0
            wait = min(max(2 * waited, stream_transport.UNREACHABLE_RETRY_S), stream_transport.UNREACHABLE_MAX_S)
        self.stream_refused = (address, time.monotonic() + wait, wait)

    def _drop_stream(self, stream: stream_transport.ClientStream) -> None:
        """Forget a broken stream: this thread's next request connects again (or uses ZMQ)."""
        self._local.stream = None
        with self._lock:
            if stream in self._streams:
                self._streams.remove(stream)
        stream.close()

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
            reconnect_when_silent(sock)
            # a request TCP could not deliver within the channel's timeout is given up on, as on a stream
            # (stream_transport.UNACKED_MIN_S) - also one in a connection the heartbeats dropped
            sock.setsockopt(zmq.TCP_MAXRT, stream_transport.unacked_ms(self.timeout))
            set_client_credentials(sock, self.secret)
            # Watch the first handshake: a server that refuses this client's credentials is then
            # reported at once (AuthenticationError), not after the timeout as if it were down; and the
            # socket is closed rather than left retrying with the same credentials every 100 ms.
            monitor = _handshake_monitor(sock)
            sock.connect(self.address)
            self._local.sock, self._local.monitor = sock, monitor
            self._local.sender = protocol.Sender() if self.secret else None  # one per socket: it keeps order
            with self._lock:
                self._sockets.append(sock)
                self._monitors.append(monitor)
        return sock

    def send(
        self,
        op: str,
        args: Any,
        buffers: Sequence[Any] = (),
        *,
        timeout: float | None = None,
        check: Callable[[], None] | None = None,
    ) -> int:
        """Send a request and return its id; waits at most ``timeout`` for the connection.

        ``check`` is called every CHECK_EVERY_S while waiting; it may raise to abandon the wait early
        (e.g. once the controller reports this server down)."""
        self._decoder(op)  # an op this channel cannot decode the reply of is not sent at all
        with self._unless_closed(op):
            return self._send(op, args, buffers, timeout, check)

    @contextlib.contextmanager
    def _unless_closed(self, op: str) -> Iterator[None]:
        """A call in flight when another thread closes the channel (a client closing while its lease
        keeper waits for a stopped controller) ends in TQConnectionError, not in ZMQ's error about a
        closed socket."""
        try:
            yield
        except zmq.ZMQError:
            if not self._closed:
                raise
            raise TQConnectionError(f"client connection to {self.name} was closed during '{op}'") from None

    def _send(self, op: str, args: Any, buffers: Sequence[Any], timeout: float | None, check: Callable[[], None] | None) -> int:
        rid = next(self._rids)
        timeout = _bounded(self.timeout if timeout is None else timeout, op, f"{self.name} at {self.address}")
        deadline = time.monotonic() + timeout
        stream = self._stream(timeout)
        self._local.sent_on = None  # where _recv waits for the reply: that stream, or ZMQ
        if stream is not None:
            frames = protocol.request(op, rid, args, buffers, self.secret, stream.sender)
            try:
                stream.send(frames, max(0.0, deadline - time.monotonic()))
                self._local.sent_on = stream
                return rid
            except OSError as exc:  # the server closed it (stopped or restarted), or took nothing for the
                self._drop_stream(stream)  # whole timeout: it served none of this request (a message cut
                # short is dropped unread), so it goes over ZMQ, which waits for a server
                self._refuse_stream(stream.address, timed_out=False)
                log.debug("%s: stream connection lost (%s); using %s", self.name, exc, self.address)
            except BaseException:  # a Ctrl-C (a signal handler's exception) may have cut the request short:
                self._drop_stream(stream)  # the server drops it unread; the next request connects again
                raise
        sock = self._socket()
        frames = protocol.request(op, rid, args, buffers, self.secret, self._local.sender)
        copy = not _zero_copy(frames)
        try:  # the common case: connected, so the send is queued at once without an extra poll
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
            if self._local.monitor is not None:  # connected before its first wait: the handshake is done
                self._drop_monitor(sock)
        except zmq.Again:  # IMMEDIATE: no connection yet - wait for one, up to the timeout (what a
            # stream connect that failed left of it)
            try:
                connected = self._await_connection(sock, max(0.0, deadline - time.monotonic()), check)
            finally:
                if self._local.monitor is not None:  # the wait ended before a first connection: see _close_unconnected
                    self._close_unconnected(sock)
            if not connected:
                raise TQConnectionError(
                    f"cannot reach {self.name} at {self.address} within {timeout:.1f}s (op '{op}'): server down or unreachable"
                ) from None
            sock.send_multipart(frames, copy=copy)
        return rid

    def _await_connection(self, sock: zmq.Socket, timeout: float, check: Callable[[], None] | None) -> bool:
        """Wait until ``sock`` is connected (True) or ``timeout`` passes (False). On the socket's first
        handshake, raise AuthenticationError as soon as the server refuses it.

        A handshake that ends with no detail is the server hanging up on credentials it refuses (19 of
        20 times it is how a client without the secret learns it) - or a server that died mid-handshake.
        So one is not taken as a refusal: ZMQ reconnects within 0.1 s, and a refusing server hangs up on
        that handshake too, while a dead one is waited for like any unreachable server."""
        monitor = self._local.monitor
        if monitor is None:  # connected before: a reconnect (e.g. the server restarted) is just waited for
            return self._wait(sock, zmq.POLLOUT, timeout, check)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLOUT)
        poller.register(monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        hung_up = False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready = dict(poller.poll(min(left, CHECK_EVERY_S if check else left) * 1e3))
            if monitor in ready:
                event = recv_monitor_message(monitor)
                if event["event"] != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL or hung_up:
                    self._refused(sock, event)
                hung_up = True
            if sock in ready:
                self._drop_monitor(sock)
                return True
            if check is not None:
                check()

    def _drop_monitor(self, sock: zmq.Socket) -> None:
        monitor, self._local.monitor = self._local.monitor, None
        with self._lock:
            if self._closed:  # close() got there first
                return
            self._monitors.remove(monitor)
        sock.disable_monitor()
        monitor.close(0)

    def _close_unconnected(self, sock: zmq.Socket) -> None:
        """Close this thread's socket that never connected (nothing is queued on it: IMMEDIATE); the next
        call opens a new one. Its monitor of failed handshakes is read only while a call waits, and left
        behind it would fill as ZMQ went on reconnecting - a peer that hangs up on every try fails one
        handshake per reconnect, every 0.1 s - until libzmq's I/O thread blocked sending the next event,
        and no socket of the process could connect any more (tests/test_errors.py)."""
        self._drop_monitor(sock)
        with self._lock:
            if sock in self._sockets:
                self._sockets.remove(sock)
        sock.close(0)
        self._local.sock = None

    def _refused(self, sock: zmq.Socket, event: dict) -> None:
        """The server refused this socket's first handshake: close the socket (the next call opens a new
        one) and raise AuthenticationError."""
        self._close_unconnected(sock)
        kind, value = event["event"], event["value"]
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            raise AuthenticationError(f"{self.name} at {self.address} refused this client's credentials: wrong secret")
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value != zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            raise TQConnectionError(
                f"handshake with {self.name} at {self.address} failed (ZMTP protocol error {value:#x}): not a TQ server?"
            )
        # A mechanism mismatch, seen here or (the peer hung up mid-handshake) by the server first.
        if self.secret:
            why = "runs without an auth secret (or is not a TQ server), but this client has one"
        else:
            why = "requires an auth secret, and this client has none (pass secret= or set TQ_SECRET)"
        raise AuthenticationError(f"{self.name} at {self.address} {why}: the handshake failed")

    @staticmethod
    def _wait(sock: zmq.Socket, event: int, timeout: float, check: Callable[[], None] | None, resend: bool = False) -> bool:
        """Whether ``event`` comes on ``sock`` within ``timeout``, calling ``check`` every CHECK_EVERY_S.
        With ``resend``, _RequestStuck once the socket's connection was dropped and made again since:
        what it held when dropped (ZMTP heartbeats found it silent: a network cut) is lost."""
        deadline = time.monotonic() + timeout
        dropped = False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if sock.poll(min(left, CHECK_EVERY_S if check or resend else left) * 1e3, event):
                return True
            if resend:  # IMMEDIATE: writable only while connected
                connected = bool(sock.get(zmq.EVENTS) & zmq.POLLOUT)
                if connected and dropped:
                    raise _RequestStuck("reconnected")
                dropped = dropped or not connected
            if check is not None:
                check()

    def recv(
        self, rid: int, op: str, *, timeout: float | None = None, check: Callable[[], None] | None = None, resend: bool = False
    ) -> tuple[Any, protocol.ReplyMessage]:
        """Wait for the reply to request ``rid`` and return its typed result and the reply; raise its
        error, or TQConnectionError on silence (``check`` as in :meth:`send`; ``resend``: see :meth:`call`)."""
        with self._unless_closed(op):
            return self._recv(rid, op, timeout, check, resend)

    def _recv(
        self, rid: int, op: str, timeout: float | None, check: Callable[[], None] | None, resend: bool
    ) -> tuple[Any, protocol.ReplyMessage]:
        if (left := time_left()) is not None and left <= 0:  # sent, its call's time spent getting it out
            raise TQConnectionError(f"no reply from {self.name} at {self.address} to '{op}': the call's timeout ran out")
        timeout = _bounded(self.timeout if timeout is None else timeout, op, f"{self.name} at {self.address}")
        deadline = time.monotonic() + timeout
        stream = getattr(self._local, "sent_on", None)
        sock = self._socket() if stream is None else None
        spin = True  # for the first reply only: a stale one does not start a second spin
        while True:
            left = deadline - time.monotonic()
            if stream is not None:
                # A request left unanswered over TCP may sit unacknowledged in the connection: across a
                # network partition TCP retransmits it with a doubling back-off, and every later request
                # on that stream waited behind it after the network healed (measured: 25 s after a 30 s
                # partition). So the next request connects again. (A Unix socket loses nothing.)
                tcp = stream.address.startswith("tcp://")
                try:
                    frames = self._recv_stream(stream, op, left, check, resend)
                except BaseException as exc:  # the check gave up on the reply (e.g. the unit is down), or it is
                    # stuck - or a Ctrl-C (a signal handler's exception) cut a reply short: the stream is out of
                    # step for good (every later read would start mid-message), so it is dropped
                    if tcp or not isinstance(exc, (TQError, _RequestStuck)):
                        self._drop_stream(stream)
                    raise
                if frames is None and tcp:
                    self._drop_stream(stream)
            else:
                ready, spin = spin and _polled_within(sock, REPLY_SPIN_S), False
                if not ready and (left <= 0 or not self._wait(sock, zmq.POLLIN, left, check, resend)):
                    frames = None
                else:
                    frames = sock.recv_multipart(copy=False)
            if frames is None:
                raise TQConnectionError(
                    f"no reply from {self.name} at {self.address} to '{op}' within {timeout:.1f}s: server down, unreachable or overloaded"
                )
            try:
                msg = protocol.decode_reply(frames, self.secret)
            except AuthenticationError:
                raise AuthenticationError(
                    f"reply from {self.name} at {self.address} to '{op}' is not signed with this client's secret "
                    "(wrong secret? the server rejects requests it cannot verify)"
                ) from None
            if msg.rid is None and msg.ok is False:
                # The server could not decode one of our requests (e.g. unauthenticated), so it could
                # not echo its id; requests on this socket are sequential, so it answers this one.
                protocol.raise_for_error(msg)
            if msg.rid != rid:
                continue  # a late reply to a request that timed out earlier (maybe of another op)
            protocol.raise_for_error(msg)
            return self._decoder(op).decode(msg.result), msg

    def _recv_stream(
        self, stream: stream_transport.ClientStream, op: str, left: float, check: Callable[[], None] | None, resend: bool = False
    ) -> list[memoryview] | None:
        """The next message on this thread's stream within ``left`` seconds (None: none came), calling
        ``check`` every CHECK_EVERY_S. If the server closed the connection no reply will come:
        TQConnectionError at once - or, with a ``check``, once the time is up, unless the check says
        first what happened (a storage unit's death or restart, which its controller learns a few
        seconds later: the reset comes at once), as it does for a request ZMQ waits on. With
        ``resend``, _RequestStuck once TCP retransmits our bytes (see :meth:`call`)."""
        deadline = time.monotonic() + left
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                frames = stream.recv(min(left, CHECK_EVERY_S) if check is not None or resend else left)
            except TQConnectionError as exc:
                self._drop_stream(stream)
                lost = TQConnectionError(f"{self.name} at {self.address}: stream connection lost during '{op}': {exc}")
                while check is not None and (left := deadline - time.monotonic()) > 0:
                    time.sleep(min(left, CHECK_EVERY_S))
                    check()
                raise lost from None
            if frames is not None:
                return frames
            if resend and stream.retransmitting():  # asked only once a reply is late: off the fast path
                raise _RequestStuck(op)
            if check is not None:
                check()

    def _decoder(self, op: str) -> ReplyDecoder:
        decoder = self.replies.get(op)
        if decoder is None:
            raise UnknownOperationError(f"{self.name} has no operation {op!r} (no reply type for it on this channel)")
        return decoder

    def call(
        self,
        op: str,
        args: Any,
        buffers: Sequence[Any] = (),
        *,
        timeout: float | None = None,
        check: Callable[[], None] | None = None,
        resend: bool = False,
    ) -> tuple[Any, protocol.ReplyMessage]:
        """Send a request and wait for its reply, both within ``timeout`` (default: the channel's).

        ``resend`` (a request the server may get twice): one that TCP is still retransmitting, or that a
        ZMQ connection dropped for its silence held, is sent again on a new connection - sent into a
        network cut, it would reach the server only at TCP's next retransmission after the heal
        (measured: a get's locate 7 s after a 20 s cut healed), or never (ZMQ)."""
        with time_budget(self.timeout if timeout is None else timeout):
            rid = self.send(op, args, buffers, timeout=timeout, check=check)
            while True:
                try:
                    return self.recv(rid, op, timeout=timeout, check=check, resend=resend)
                except _RequestStuck:
                    if (time_left() or 0.0) < RESEND_MIN_S:  # found stuck as its time ran out
                        raise TQConnectionError(
                            f"no reply from {self.name} at {self.address} to '{op}' in time: the network did not carry it"
                        ) from None
                    rid = self.send(op, args, buffers, timeout=timeout, check=check)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for s in (*self._monitors, *self._sockets):
                s.close(0)
            self._sockets.clear()
            self._monitors.clear()
            for stream in self._streams:
                stream.close()
            self._streams.clear()
