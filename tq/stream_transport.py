"""Request/reply over stream sockets, without ZMQ: how clients reach a server - over a Unix socket on
the server's host, over TCP from elsewhere - and how the controller reaches its storage units on its host.

A ZMQ round trip crosses six thread hand-offs (the caller, ZMQ's I/O thread on each side, the server
loop, and back): on a 2-vCPU VM a pyzmq DEALER/ROUTER echo measured p50 0.16 ms against 0.010 ms for a
blocking echo over a Unix socket between the same two processes, and a TQ control call over loopback
TCP p50 0.19 ms over ZMQ against 0.09 ms over a TCP stream. Every put, get and control call is one or
two such round trips. So a server also listens on

- a Unix socket in Linux's abstract namespace (no file to clean up after a crash; the name carries the
  server's token, 128 random bits, so a process on another host or in another network namespace
  cannot reach a different server by it: it fails to connect and keeps using ZMQ), and
- a TCP port on the interface its ZMQ socket is bound to (``tcp://host:port/token``). A client sends
  the token first (:func:`tq.protocol.stream_preamble`) and waits for the server's one-byte answer
  before its first request: a client that reached another server on a reused port finds out before it
  has sent anything, and keeps using ZMQ.

Messages are the same frames as on ZMQ, framed for a stream by :func:`tq.protocol.stream_prefix` /
:class:`tq.protocol.StreamReader`; a request is authenticated by its HMAC exactly as on ZMQ. A server's
side never blocks: its connections are non-blocking, driven by its poll loop (:class:`PollLoop`); a
client's side (:class:`ClientStream`) is a blocking connection per thread.
"""

from __future__ import annotations

import functools
import hmac
import logging
import math
import os
import secrets
import select
import socket
import sys
import time
from typing import Any, Callable, Protocol, Sequence

from . import protocol
from .bufferpool import HostBufferPool
from .errors import TQConnectionError, TQError
from .peerlog import PeerLog

log = logging.getLogger(__name__)

RECV_CHUNK = 64 << 10  # bytes read per recv: below malloc's mmap threshold, so a read costs no page faults
DRAIN_BYTES = 8 << 20  # of a large message, read in one turn of a server's loop (see StreamPeer._read)
MAX_IOV = 512  # buffers per sendmsg (IOV_MAX is 1024 on Linux)
# A connection with at least this much to write is written at the end of its loop's turn, beside every
# other such connection, each on a thread of the loop (see PollLoop.flush_beside): a TCP write's kernel
# copy is most of a big fetch's cost, and one loop thread copying for every reader of a unit was the
# bound on its reads (py-spy of a unit serving 64 MiB TCP gets: 70% in sendmsg).
PARALLEL_FLUSH_BYTES = 1 << 20
# ... and a message with this much still to come (a big TCP put's part) is read the same way: its rest
# received on a thread of the loop beside the other connections' (see PollLoop.read_beside)
PARALLEL_READ_BYTES = 1 << 20


@functools.cache
def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or a Ray worker's share, not
    the host's count), looked up once."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# A message of a MiB or more (a put's or a fetch reply's bytes) is received into a pooled buffer, whose
# pages stay mapped from one message to the next, not a fresh one: writing a fresh buffer's pages cost
# as much again as the copy on the 2-vCPU VM, and thirty times more where the VM had given them back
# (a 512 MiB TCP put read 0.4-3.2 GB/s by that). Its idle buffers are capped per process; a unit's
# ``trim`` gives them back.
RECEIVE_POOL_BYTES = 1 << 30
# not populated: a peer declares a message's size before its bytes (a hostile one may never send them)
_bodies = HostBufferPool(max_cached_bytes=RECEIVE_POOL_BYTES, populate=False)


def trim_receive_buffers() -> int:
    """Unmap this process's idle receive buffers; returns their bytes."""
    released = _bodies.cached_bytes
    _bodies.clear()
    return released


# the loop's own included; half the cores at most, as a client's lanes: where client and server share
# two cores, writing beside each other only reordered the work (a VM's 256 MiB TCP get: 0.82x)
PARALLEL_FLUSH_THREADS = min(8, usable_cores() // 2)
ACCEPT_PAUSE_S = 1.0  # after accept fails for want of file descriptors, the listener rests this long
# A client polls for its reply this long before it sleeps: a same-host reply mostly comes within it, and
# a server waking a sleeping thread on another CPU is what a round trip mostly costs on a VM (2 vCPUs:
# list_partitions p50 0.12 -> 0.054 ms with it; measured).
SPIN_S = 250e-6
RETRY_S = 1.0  # a client that found nothing at a server's socket uses ZMQ this long before it tries again
# ... and this long when a TCP connect or the server's answer to it timed out (a firewall dropping
# packets, a server too busy to answer): every try would cost the connect timeout, so few are made -
# twice as long after each timeout in a row, up to UNREACHABLE_MAX_S (a port a firewall drops for good)
UNREACHABLE_RETRY_S = 30.0
UNREACHABLE_MAX_S = 600.0
TCP_CONNECT_S = 2.0  # a TCP stream not connected and answered within this is not used (ZMQ is)
# A client host that dies (power, kernel panic, a partition) sends no FIN: without keepalive its server
# would hold each of its connections - a descriptor and a peer - forever. Probed after this long idle,
# every TCP_KEEPALIVE[1] s, closed after TCP_KEEPALIVE[2] unanswered probes: about two minutes.
TCP_KEEPALIVE = (60, 10, 6)
# A request's bytes that the server's host has not acknowledged within the request's time (its call's
# timeout, at least a second) are given up on: TCP resets the connection (TCP_USER_TIMEOUT) instead of
# retransmitting them with a doubling back-off - for ~100 s even after the client process died
# (tcp_orphan_retries). So a request reaches the server within its call's time of being sent, or never:
# a client killed while its request waited in a network cut leaves nothing to arrive after the heal (a
# living client settles its own, by request id; a Unix socket loses nothing and is never cut).
UNACKED_MIN_S = 1
UNACKED_MAX_S = 2_000_000  # the option is a C int of milliseconds: a longer call's bytes get this long


def unacked_ms(seconds: float) -> int:
    """The TCP_USER_TIMEOUT, in milliseconds, of a request with ``seconds`` to be answered in (see above)."""
    return max(UNACKED_MIN_S, math.ceil(min(seconds, UNACKED_MAX_S))) * 1000


# While this many replies (or bytes of them) wait unwritten for a client's connection, the server reads
# no more of its requests (until they are all written): a process sending requests whose replies it
# does not read is held back by its own socket, instead of growing the server's memory. A client that
# pipelines (a big fetch's parts) still gets every reply. (Servers queue ZMQ replies without a bound,
# so that none is dropped; with a secret, only a peer that passed the PLAIN handshake gets that far.)
MAX_QUEUED_MESSAGES = 1000
MAX_QUEUED_BYTES = 256 << 20
# A connection that has not proven itself this long after it was accepted is closed - with a secret,
# one that sent no authenticated request; on TCP, also one that sent no token: no handshake gates the
# socket, and an idle connection would hold one of the server's file descriptors for as long as it
# liked (ZMQ gives its PLAIN handshake a limit too, ZMQ_HANDSHAKE_IVL). A TQ client sends its token
# and first request as soon as it has connected.
HANDSHAKE_S = 10.0


def stable_token(directory: str) -> str:
    """The socket token kept in ``directory`` (made there on first use): a server restarted on its
    state directory (a crash-recovered controller) listens at the same address, so the same-host
    clients that lost their connection get it back by connecting again."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "local-socket-token")
    try:
        with open(path) as f:
            token = f.read().strip()
        if len(token) == 32 and all(c in "0123456789abcdef" for c in token):
            return token
    except FileNotFoundError:
        pass
    token = secrets.token_hex(16)
    _write_file(path, token)
    return token


def remembered_port(directory: str) -> int:
    """The TCP stream port kept in ``directory`` by :func:`remember_port` (0: none yet, or unreadable)."""
    try:
        with open(os.path.join(directory, "tcp-stream-port")) as f:
            port = int(f.read().strip())
        return port if 0 < port < 65536 else 0
    except (OSError, ValueError):
        return 0


def remember_port(directory: str, port: int) -> None:
    """Keep the TCP stream port a server listens on in its state ``directory``: restarted there, it
    listens on it again (when free), so the remote clients that lost their connection get it back by
    connecting again, as :func:`stable_token` does for its Unix socket."""
    _write_file(os.path.join(directory, "tcp-stream-port"), str(port))


def _write_file(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def supported() -> bool:
    """Whether this platform has abstract Unix sockets (Linux)."""
    return sys.platform.startswith("linux")


def _sockaddr(address: str) -> str:
    if not address.startswith("@") or len(address) < 2:
        raise ValueError(f"not an abstract Unix socket address: {address!r}")
    return "\0" + address[1:]


def tcp_address(host: str, port: int, token: str) -> str:
    """A TCP stream's address as a server advertises it (IPv6 hosts in brackets, as in ZMQ's)."""
    return f"tcp://{f'[{host}]' if ':' in host else host}:{port}/{token}"


def parse_tcp_address(address: str) -> tuple[str, int, str]:
    """``(host, port, token)`` of ``tcp://host:port/token``; ValueError for anything else."""
    try:
        if not address.startswith("tcp://"):
            raise ValueError
        where, token = address[len("tcp://") :].rsplit("/", 1)
        host, port = where.rsplit(":", 1)
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not host or len(token) != protocol.STREAM_TOKEN_BYTES or not 0 < int(port) < 65536:
            raise ValueError
        return host, int(port), token
    except ValueError:
        raise ValueError(f"not a TCP stream address (tcp://host:port/token): {address!r}") from None


WILDCARD_HOSTS = ("0.0.0.0", "::", "*")


def endpoint_host(address: str) -> str:
    """The host of a ``scheme://host:port`` endpoint (a ZMQ bind or connect address), an IPv6 one
    without its brackets."""
    return address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")


def on_host_of(address: str, server: str) -> str:
    """``address`` (a TCP stream's), its wildcard host (a server bound to every interface) replaced
    by the host of ``server`` (the ``tcp://host:port`` its client reaches it at); else unchanged."""
    try:
        host, port, token = parse_tcp_address(address)
    except ValueError:
        return address  # refused where it is connected to
    if host not in WILDCARD_HOSTS or not server.startswith("tcp://"):
        return address
    return tcp_address(endpoint_host(server), port, token)


def connect(address: str, timeout: float) -> socket.socket:
    """A connected stream socket to ``address`` (``@name``, or ``tcp://host:port/token``: connected,
    then the token sent and the server's answer read, all within ``timeout``); OSError if no server
    of that token answers there (another host or network namespace, a server that is gone, another
    server on the port)."""
    if address.startswith("tcp://"):
        host, port, token = parse_tcp_address(address)
        sock = socket.create_connection((host, port), timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # requests are small and waited on
            sock.sendall(protocol.stream_preamble(token))
            if sock.recv(1) != protocol.STREAM_ACCEPTED:
                raise ConnectionRefusedError(f"the server at {host}:{port} is not the one of this address (token refused)")
        except BaseException:
            sock.close()
            raise
        return sock
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(_sockaddr(address))
    except BaseException:
        sock.close()
        raise
    return sock


def _wire(frames: Sequence[Any]) -> list[memoryview]:
    """One message as it goes on the stream: its prefix, then its frames (empty ones need no bytes)."""
    views = [protocol.frame_view(f) for f in frames]
    return [memoryview(protocol.stream_prefix(views)), *(v for v in views if v.nbytes)]


def _write(sock: socket.socket, views: list[memoryview]) -> None:
    """Write ``views`` until none is left, dropping what is written from the list: BlockingIOError
    when a non-blocking socket takes no more, OSError when the connection is broken."""
    while views:
        sent = sock.sendmsg(views[:MAX_IOV])
        while sent:
            head = views[0]
            if sent >= head.nbytes:
                sent -= head.nbytes
                views.pop(0)
            else:
                views[0] = head[sent:]
                sent = 0


def _receive(sock: socket.socket, reader: protocol.StreamReader, chunk: bytearray) -> list[list[memoryview]]:
    """One receive on a non-blocking stream: a large message's rest straight into its buffer, else a
    chunk fed to ``reader``; the messages it completed. BlockingIOError if nothing had come,
    ConnectionResetError at the end of the stream (a message the peer cut short is dropped)."""
    into = reader.body_left(RECV_CHUNK)
    n = sock.recv_into(chunk if into is None else into)
    if n == 0:
        raise ConnectionResetError("closed by the peer")
    return reader.received(n) if into is not None else reader.feed(memoryview(chunk)[:n])


class PollLoop(Protocol):
    """What a stream needs from the server loop that drives it (:class:`tq.rpc.RpcServer`)."""

    read_buffer: bytearray  # one receive buffer for every stream of the loop (it serves one at a time)

    def watch_fd(self, fd: int, writable: bool, handler: Callable[[bool, bool], None], readable: bool = True) -> None:
        """Call ``handler(readable, writable)`` whenever ``fd`` is readable (unless not ``readable``; an
        error or hang-up counts as readable either way) or, with ``writable``, writable; watching a
        watched fd again replaces its handler and interest."""

    def unwatch_fd(self, fd: int) -> None:
        """Stop watching ``fd``."""

    def flush_beside(self, peer: "StreamPeer") -> bool:
        """Write ``peer`` at the end of this turn of the loop, alongside the other connections with
        much to write, each on its own thread, the loop waiting for all (:meth:`StreamPeer.write_out`,
        then :meth:`StreamPeer.written` on the loop's thread); False: write it now instead."""

    def read_beside(self, peer: "StreamPeer") -> bool:
        """Read the rest of ``peer``'s big message at the end of this turn of the loop, alongside the
        other connections receiving one, each on its own thread, the loop waiting for all
        (:meth:`StreamPeer.read_body`, then :meth:`StreamPeer.body_read` on the loop's thread); False:
        read it now instead."""


class StreamPeer:
    """One non-blocking connection driven by a server's poll loop: a client the server accepted (a
    reply goes to it: it stands where a ZMQ identity stands in :class:`tq.rpc.Call`), or the
    controller's connection to a storage unit. Each message that arrives goes to
    ``on_message(peer, frames)``; when the connection ends by itself (the peer closed it, it sent bytes
    no TQ peer sends) it is closed and ``on_close(peer, exc)`` hears why. A write that fails (the peer
    went away) ends only the writing: what the peer sent before is still read and served, as ZMQ
    serves what a peer sent before it disconnected, until the read finds the end. What
    the socket has not taken yet waits in ``out`` until it is writable; a ``bounded`` connection is not
    read while MAX_QUEUED_MESSAGES (or MAX_QUEUED_BYTES) wait there."""

    __slots__ = (
        "sock",
        "loop",
        "on_message",
        "on_close",
        "reader",
        "out",
        "queued",
        "pending",
        "bounded",
        "paused",
        "watching",
        "closed",
        "ending",
        "gone",
        "preamble",
        "on_preamble",
        "seen",
        "beside",
    )

    def __init__(
        self,
        sock: socket.socket,
        loop: PollLoop,
        on_message: Callable[["StreamPeer", list[memoryview]], None],
        on_close: Callable[["StreamPeer", Exception], None],
        *,
        max_message_bytes: int | None = None,
        bounded: bool = False,
        preamble: bytes | None = None,
        on_preamble: Callable[["StreamPeer"], None] | None = None,
    ) -> None:
        sock.setblocking(False)
        self.sock, self.loop, self.on_message, self.on_close = sock, loop, on_message, on_close
        self.reader = protocol.StreamReader(max_message_bytes, alloc=_bodies.empty)
        self.out: list[memoryview] = []
        self.queued = 0  # bytes in ``out`` (approximately: not lowered by partial writes)
        self.pending = 0  # messages in ``out`` (the same way)
        self.bounded = bounded
        self.paused = False  # not read: too much waits in ``out`` (bounded only)
        self.watching = (True, False)  # polled for (readable, writable)
        self.closed = False
        self.ending = False  # closed once ``out`` is written; nothing more is read or sent
        self.gone = False  # a write failed: nothing more is written, what arrived is still read
        # what the peer must send before its first message (a TCP client's token), and who hears it did
        self.preamble, self.on_preamble, self.seen = preamble, on_preamble, bytearray()
        self.beside = False  # to be written at the end of the loop's turn (flush_beside)
        loop.watch_fd(sock.fileno(), False, self._on_ready)

    def send(self, frames: Sequence[Any]) -> bool:
        """Queue one message and write what the socket takes now; False if nothing more can be written
        to the connection: closed (``on_close`` heard why), or the peer went away (this write or an
        earlier one failed)."""
        if self.closed or self.ending or self.gone:
            return False
        wire = _wire(frames)
        self.out += wire
        self.queued += sum(v.nbytes for v in wire)
        self.pending += 1
        self._flush_soon()
        return not (self.closed or self.gone)

    def _flush_soon(self) -> None:
        """Write what waits: now, or - much of it - at the end of the loop's turn, beside the other
        connections with much to write (see PARALLEL_FLUSH_BYTES). ``beside`` holds from being put on
        the loop's list until the loop takes it off to write it: the peer is on that list once."""
        if self.beside:
            return
        if self.queued >= PARALLEL_FLUSH_BYTES and self.loop.flush_beside(self):
            self.beside = True
            return
        self._flush()

    def has_input(self) -> bool:
        """Whether bytes from the peer wait unread (or the connection ended: its read finds out)."""
        try:
            return bool(self.sock.recv(1, socket.MSG_PEEK))
        except BlockingIOError:
            return False
        except OSError:
            return True

    def end_after_flush(self) -> None:
        """Close once what waits in ``out`` is written (the reply just sent, say), reading nothing more."""
        self.ending = True
        self._flush()

    def _flush(self) -> None:
        self.written(self.write_out())

    def write_out(self) -> OSError | None:
        """Write what the socket takes of what waits - on any thread, while the loop's thread waits for
        it (``flush_beside``); what stopped it (BlockingIOError: the socket takes no more for now), None
        once everything is written. The loop's thread then hands the outcome to :meth:`written`."""
        try:
            _write(self.sock, self.out)
        except OSError as exc:
            return exc.with_traceback(None)  # its frames would hold the last view written, and the buffer under it
        return None

    def written(self, exc: OSError | None) -> None:
        """After a write (on the loop's thread): end the connection if it was ending or broke, and poll
        for writable while something waits."""
        if self.closed:
            return
        if exc is None:
            self.queued = self.pending = 0
            if self.ending:
                self._ended(ConnectionAbortedError("closed by this side"))
                return
        elif not isinstance(exc, BlockingIOError):
            if self.ending or not isinstance(exc, (BrokenPipeError, ConnectionResetError)):
                self._ended(exc)
                return
            # The peer went away. A controller stopping sends its units a shutdown after its last
            # messages and reads no reply: a unit failing to write one reply must still read the
            # shutdown. The read that finds the end closes the connection.
            self.out.clear()
            self.queued = self.pending = 0
            self.gone = True
        if self.bounded:  # paused from a bound until everything waiting is written
            self.paused = bool(self.out) and (self.paused or self.pending >= MAX_QUEUED_MESSAGES or self.queued >= MAX_QUEUED_BYTES)
        want = (not self.paused, bool(self.out))
        if want != self.watching:
            self.watching = want
            self.loop.watch_fd(self.sock.fileno(), want[1], self._on_ready, readable=want[0])

    def _on_ready(self, readable: bool, writable: bool) -> None:
        if writable:
            self._flush_soon()
        elif readable and self.paused:  # paused, "readable" is a hang-up: the write meets it
            self._flush()
        if not readable or self.closed or self.paused:
            return
        try:
            messages = self._read()
        except BlockingIOError:
            return
        except (OSError, TQError) as exc:
            self._ended(exc)
            return
        self._serve(messages)

    def _serve(self, messages: list[list[memoryview]]) -> None:
        for frames in messages:
            if self.beside:  # what waits goes out before the next request is served: a fetch's
                self._flush()  # parts, pipelined on one stream, stream while the next is gathered
            if self.closed or self.ending:
                return
            self.on_message(self, frames)

    def _read(self) -> list[list[memoryview]]:
        """Read what the socket holds: a chunk, or a large message's rest straight into its buffer - as
        much as has come, up to DRAIN_BYTES (a loop woken per socket-buffer's worth moved 128 MiB
        slower than ZMQ's I/O thread), so other peers are not kept waiting long. BlockingIOError if
        nothing had come; ConnectionResetError at the end of the stream."""
        if self.preamble is not None:
            n = self.sock.recv_into(self.loop.read_buffer)
            if n == 0:
                raise ConnectionResetError("closed by the peer")
            return self.reader.feed(self._check_preamble(memoryview(self.loop.read_buffer)[:n]))
        start = self.reader.pending
        if self._read_later():
            return []
        done = _receive(self.sock, self.reader, self.loop.read_buffer)
        if not done and self._read_later():
            return done
        while not done and self.reader.body_left(RECV_CHUNK) is not None and self.reader.pending - start < DRAIN_BYTES:
            try:
                done = _receive(self.sock, self.reader, self.loop.read_buffer)
            except BlockingIOError:
                break
        return done

    def _read_later(self) -> bool:
        """Whether the rest of a big message is left to the end of the loop's turn (``read_beside``),
        to be received beside other connections' big messages, each on its own thread."""
        return self.reader.body_left(PARALLEL_READ_BYTES) is not None and self.loop.read_beside(self)

    def read_body(self) -> tuple[list[list[memoryview]], Exception | None]:
        """Receive the current message's rest into its buffer - on any thread, while the loop's thread
        waits for it (``read_beside``) - as much as has come, up to DRAIN_BYTES, never past the
        message: the messages completed (none, or this one) and what stopped the read (None: the
        message is whole, or the socket had nothing more for now). The loop's thread then hands the
        outcome to :meth:`body_read`."""
        start, done = self.reader.pending, []
        try:
            while not done and self.reader.pending - start < DRAIN_BYTES:
                into = self.reader.body_left(1)
                if into is None:
                    break
                n = self.sock.recv_into(into)
                if n == 0:
                    raise ConnectionResetError("closed by the peer")
                done = self.reader.received(n)
        except BlockingIOError:
            pass
        except (OSError, TQError) as exc:
            return done, exc.with_traceback(None)
        return done, None

    def body_read(self, done: list[list[memoryview]], exc: Exception | None) -> None:
        """After :meth:`read_body` (on the loop's thread): serve what it completed, or end the
        connection it found broken."""
        if self.closed:
            return
        if exc is not None:
            self._ended(exc)
            return
        self._serve(done)

    def _check_preamble(self, data: memoryview) -> memoryview:
        """Take the preamble's bytes off the front of ``data`` (kept until it is whole); once whole and
        right, answer it and return what follows. TQError when it is not this server's (compared only
        whole: a peer learns nothing of the token from when it is closed)."""
        want = self.preamble
        assert want is not None
        got = len(self.seen)
        self.seen += data[: len(want) - got]
        if len(self.seen) < len(want):
            return data[len(data) :]
        if not hmac.compare_digest(bytes(self.seen), want):
            raise TQError("the connection did not open with this server's token (not a TQ client of this server)")
        self.preamble = None
        self.out.append(memoryview(protocol.STREAM_ACCEPTED))
        self._flush()
        if self.on_preamble is not None:
            self.on_preamble(self)
        return data[len(want) - got :]

    def _ended(self, exc: Exception) -> None:
        if not self.closed:
            self.close()
            self.on_close(self, exc)

    def finish(self, frames: Sequence[Any], *, timeout: float) -> None:
        """Write what waits and one last message, blocking up to ``timeout`` a write, then close: best
        effort, for a connection being given up."""
        if self.closed:
            return
        try:
            self.out += _wire(frames)
            self.sock.settimeout(timeout)
            _write(self.sock, self.out)
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        """Close it (its owner's decision: ``on_close`` is not called)."""
        if not self.closed:
            self.closed = True
            self.out.clear()
            self.loop.unwatch_fd(self.sock.fileno())
            self.sock.close()


class StreamListener:
    """A server's listening stream socket (see :func:`listen_unix`, :func:`listen_tcp`): accepts
    connections, each a :class:`StreamPeer` whose requests go to ``serve(peer, frames)`` and which the
    server answers with ``peer.send``. A connection that has not proven itself within ``handshake_s``
    is closed: one that has not sent the ``preamble`` (TCP), or, with a ``secret``, no authenticated
    request (the server calls :meth:`proven`)."""

    def __init__(
        self,
        name: str,
        loop: PollLoop,
        serve: Callable[[StreamPeer, list[memoryview]], None],
        sock: socket.socket,
        address: str,
        *,
        max_message_bytes: int | None,
        secret: bool,
        preamble: bytes | None = None,
    ) -> None:
        self.name, self.loop, self.serve = name, loop, serve
        self.sock, self.address = sock, address
        self.max_message_bytes = max_message_bytes
        self.secret, self.preamble = secret, preamble
        self.handshake_s = HANDSHAKE_S if secret or preamble is not None else None  # None: nothing to prove
        # accepted, not proven yet -> (when it is closed, whether that was put off once)
        self.unproven: dict[StreamPeer, tuple[float, bool]] = {}
        self.sock.listen(256)
        self.sock.setblocking(False)
        self.peers: set[StreamPeer] = set()
        self._paused_until = 0.0
        self.rejected = 0  # connections closed for sending what no TQ client sends
        self.peer_log = PeerLog(log)  # a line per 10 s for them, however many come
        loop.watch_fd(self.sock.fileno(), False, self._accept)

    def on_tick(self, now: float) -> None:
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self.loop.watch_fd(self.sock.fileno(), False, self._accept)
        if self.unproven and self.handshake_s is not None:
            for peer, (_, put_off) in [(p, u) for p, u in self.unproven.items() if u[0] <= now]:
                if not put_off and peer.has_input():  # its request waits unread (this loop was busy): read it first
                    self.unproven[peer] = (now + self.handshake_s, True)
                    continue
                peer.close()
                self._ended(peer, TQError(f"no authenticated request within {self.handshake_s:g} s of connecting"))

    def proven(self, peer: StreamPeer) -> None:
        """``peer`` sent a request that passed the secret's check: it may stay connected."""
        self.unproven.pop(peer, None)

    def _accept(self, readable: bool, writable: bool) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return
            except (ConnectionAbortedError, InterruptedError):  # that one connection is gone: the next
                continue
            except OSError as exc:  # out of descriptors (or worse): rest, or the loop would spin on it
                log.warning("%s: cannot accept a stream connection (%s); pausing %.0f s", self.name, exc, ACCEPT_PAUSE_S)
                self.loop.unwatch_fd(self.sock.fileno())
                self._paused_until = time.monotonic() + ACCEPT_PAUSE_S
                return
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # replies are small and waited on
                _keep_alive(conn)
            peer = StreamPeer(
                conn,
                self.loop,
                self.serve,
                self._ended,
                max_message_bytes=self.max_message_bytes,
                bounded=True,
                preamble=self.preamble,
                on_preamble=None if self.secret else self.proven,
            )
            self.peers.add(peer)
            if self.handshake_s is not None:
                self.unproven[peer] = (time.monotonic() + self.handshake_s, False)

    def _ended(self, peer: StreamPeer, exc: Exception) -> None:
        """A client's connection ended: it went away (a request it cut short is dropped unread), it
        sent what no TQ client sends (a TQError: counted), or this server closed it (a request that
        failed the secret's check)."""
        self.peers.discard(peer)
        self.unproven.pop(peer, None)
        if isinstance(exc, TQError):
            self.rejected += 1
            self.peer_log.warning("connection", "%s closed a stream connection: %s", self.name, exc)

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        self.peers.clear()
        self.unproven.clear()
        if not self._paused_until:
            self.loop.unwatch_fd(self.sock.fileno())
        self.sock.close()


def _keep_alive(sock: socket.socket) -> None:
    """Probe an idle TCP connection so a peer whose host died is found (see TCP_KEEPALIVE)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = TCP_KEEPALIVE
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's defaults (hours)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)


def listen_unix(
    name: str,
    loop: PollLoop,
    serve: Callable[[StreamPeer, list[memoryview]], None],
    *,
    token: str,
    max_message_bytes: int | None,
    secret: bool,
) -> StreamListener:
    """A listener on the abstract Unix socket ``@tq-<token>`` (this host, this network namespace)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = f"@tq-{token}"
    try:
        sock.bind(_sockaddr(address))
    except BaseException:
        sock.close()
        raise
    return StreamListener(name, loop, serve, sock, address, max_message_bytes=max_message_bytes, secret=secret)


def listen_tcp(
    name: str,
    loop: PollLoop,
    serve: Callable[[StreamPeer, list[memoryview]], None],
    host: str,
    *,
    token: str,
    max_message_bytes: int | None,
    secret: bool,
    port: int = 0,
    exact: bool = False,
) -> StreamListener:
    """A listener on TCP ``port`` of ``host`` (as a ZMQ bind names it: ``*`` is every interface, an
    IPv6 address comes in brackets), on a free one if that is 0 or taken - unless ``exact`` (a port an
    operator chose, e.g. to open in a firewall, is never replaced); its clients open with ``token``.
    OSError if it cannot be bound."""
    bind_host = None if host == "*" else host.strip("[]")
    family, kind, proto, _, where = socket.getaddrinfo(bind_host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server's connections linger in TIME_WAIT
        try:
            sock.bind(where)
        except OSError as exc:
            if not port or exact:
                raise OSError(exc.errno, f"cannot listen on TCP port {port} of {host}: {exc.strerror}") from None
            sock.bind((where[0], 0, *where[2:]))
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    preamble = protocol.stream_preamble(token)
    return StreamListener(
        name,
        loop,
        serve,
        sock,
        tcp_address(host.strip("[]"), port, token),
        max_message_bytes=max_message_bytes,
        secret=secret,
        preamble=preamble,
    )


class ClientStream:
    """A client's blocking connection to a server's stream socket, Unix or TCP (one per thread, as a
    DEALER socket is)."""

    def __init__(self, address: str, timeout: float) -> None:
        self.address = address
        self.sock = connect(address, timeout)
        self.reader = protocol.StreamReader(alloc=_bodies.empty)
        self._buf = bytearray(RECV_CHUNK)
        self._ready: list[list[memoryview]] = []  # messages read past the one asked for
        # non-blocking from here on: a socket with a timeout switches mode and polls before every call
        self.sock.setblocking(False)
        self._readable, self._writable = select.poll(), select.poll()  # not select(): fds past FD_SETSIZE
        self._readable.register(self.sock, select.POLLIN)
        self._writable.register(self.sock, select.POLLOUT)
        self.sender: protocol.Sender | None = None  # with a secret: this stream's request stamps
        self._unacked_ms = 0 if address.startswith("tcp://") and hasattr(socket, "TCP_USER_TIMEOUT") else -1

    def give_up_after(self, seconds: float) -> None:
        """Have TCP reset this connection once bytes it sent stay unacknowledged ``seconds`` (rounded
        up, at least UNACKED_MIN_S: see there). A Unix socket, or a system without the option: nothing."""
        if self._unacked_ms < 0:
            return
        ms = unacked_ms(seconds)
        if ms != self._unacked_ms:  # mostly the same from call to call: no syscall
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, ms)
            self._unacked_ms = ms

    def send(self, frames: Sequence[Any], timeout: float) -> None:
        """Write a whole request; OSError (the server closed, or took nothing within ``timeout``)
        leaves the stream unusable: close it. A server that closed the connection since the last
        reply (it stopped, or died) is found before anything is written: a write to a TCP peer that
        is gone succeeds, and the request would be lost instead of sent over ZMQ."""
        try:
            if self.sock.recv(1, socket.MSG_PEEK) == b"":
                raise ConnectionResetError("the server closed the connection")
        except BlockingIOError:  # nothing to read: the connection is open
            pass
        self.give_up_after(timeout)
        views, deadline = _wire(frames), time.monotonic() + timeout
        while True:
            try:
                _write(self.sock, views)
                return
            except BlockingIOError:  # the socket's buffer is full: wait until the server reads
                left = deadline - time.monotonic()
                if left <= 0 or not self._writable.poll(left * 1e3):
                    raise TimeoutError(f"the server took no more of a request for {timeout:.1f}s") from None

    def recv(self, timeout: float) -> list[memoryview] | None:
        """The next message, or None if none came within ``timeout``; TQConnectionError once the
        server closed the connection. Polls without sleeping for SPIN_S first."""
        if self._ready:
            return self._ready.pop(0)
        deadline = time.monotonic() + timeout
        spin_until = time.perf_counter() + SPIN_S
        while True:
            try:
                got = _receive(self.sock, self.reader, self._buf)
            except BlockingIOError:
                if time.perf_counter() < spin_until:
                    continue
                left = deadline - time.monotonic()
                if left <= 0 or not self._readable.poll(left * 1e3):
                    return None
                continue
            except OSError as exc:
                raise TQConnectionError(f"connection lost ({exc})") from None
            if got:
                self._ready += got[1:]
                return got[0]

    def retransmitting(self) -> bool:
        """Whether TCP is retransmitting bytes of ours the server has not acknowledged (Linux's
        TCP_INFO: a timeout's retransmissions, or its back-off, under way): what we sent is not
        getting through - across a network cut, retransmitted with a doubling back-off after the
        network is back. False elsewhere (a Unix socket, no TCP_INFO)."""
        if not self.address.startswith("tcp://") or not hasattr(socket, "TCP_INFO"):
            return False
        try:
            info = self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
        except OSError:
            return False
        return info[2] > 0 or info[4] > 0  # tcpi_retransmits, tcpi_backoff (struct tcp_info)

    def close(self) -> None:
        self.sock.close()
