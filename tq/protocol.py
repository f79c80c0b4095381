"""The TQ wire format - the only module that knows how messages look on the wire.

A message is a ZMQ multipart message::

    [header, mac, frame_0, ..., frame_{k-1}]

``header`` is a msgpack map (never pickle). Requests carry ``v`` (protocol version), ``op``, ``rid``
(request id, echoed in the reply), ``args`` and ``bs`` (the byte size of every buffer); replies
carry ``v``, ``rid``, ``ok`` and ``result`` or ``error``. ``mac`` is the HMAC-SHA256 of the header bytes
under the shared secret (empty when the service runs without one); since the header lists every
buffer's size, a truncated or padded message is caught too. Buffers (tensor bytes, index arrays) are
referenced from ``args`` as ``{"b": index, "d": dtype, "s": shape}``. Bulk ones travel in frames of
their own, never copied through msgpack, sent and received zero-copy; small ones (up to
:data:`INLINE_BUFFER_BYTES`, :data:`INLINE_TOTAL_BYTES` in all) travel inside the header, in ``ib``: one
entry per buffer, its bytes or nil for one that comes in the next frame (version 2; a version-1
message has no ``ib``: every buffer is a frame). A frame costs more than copying a few kilobytes: each
is a separate send and receive in ZMQ, and a 1-key put or get is mostly small index arrays.

With a secret, two more rules hold:

* A signed request also carries ``sid`` (its sender: a random 64-bit id per client socket), ``seq``
  (strictly increasing per sender) and ``ts`` (the sender's wall clock, ns). A server accepts it only
  if ``ts`` is within :data:`REPLAY_WINDOW_S` of its own clock and ``seq`` is above the last one it
  accepted from that sender (:class:`ReplayGuard`), so a captured request cannot be replayed.
* Connections use ZMTP's PLAIN mechanism with the password :func:`connection_password` (derived from
  the secret; servers check it through ZAP), so a peer that does not know it is dropped during the
  handshake, before it can make the server buffer a single message. PLAIN only gates the connection:
  it sends the derived password in clear and encrypts nothing; every message is still authenticated
  by its HMAC, which the password does not reveal.
"""

from __future__ import annotations

import hmac
import itertools
import math
import os
import reprlib
import struct
import threading
import time
from dataclasses import dataclass, field
from hashlib import sha256
from typing import Any, Callable, Sequence

import msgpack
import msgspec
import numpy as np

from .errors import (
    ERROR_TYPES,
    AuthenticationError,
    InvalidRequestError,
    MalformedMessageError,
    MessageTooLargeError,
    ProtocolVersionError,
    ReplayError,
    TQError,
)
from .messages import ArrayRef

PROTOCOL_VERSION = 2
ACCEPTED_VERSIONS = (1, 2)  # what this side decodes: version 1 only lacks inline buffers
# A buffer up to this size travels inside the header while the inline ones stay within the total
# (measured on the 2-vCPU VM: every extra frame of a round trip costs about 10 us).
INLINE_BUFFER_BYTES = 16 << 10
INLINE_TOTAL_BYTES = 64 << 10
MAX_HEADER_BYTES = 64 << 20
# No frame of a request may be longer: servers refuse a longer frame at the socket (ZMQ_MAXMSGSIZE
# counts one frame), from its length prefix, before reading it - so a peer that has not authenticated
# (a ZMTP handshake command is such a frame) can make a server buffer at most this much. Bulk bytes
# travel in TCP_FRAME_BYTES frames, far below it. A header a little past its own limit still reaches
# the protocol, which answers with MessageTooLargeError.
MAX_FRAME_BYTES = MAX_HEADER_BYTES + (1 << 20)
DEFAULT_MAX_MESSAGE_BYTES = 8 << 30
# Bulk bytes crossing TCP are cut into frames of about this size (see StorageUnit._gather_frames and
# the client's puts). ZMQ's receiving I/O thread allocates every frame; a 1 MiB frame lands in memory
# just freed and still in cache, a larger one in cold or freshly faulted pages. Measured in one call on
# a 16-core H200 host (loopback, 128 MiB): a bare ROUTER/DEALER pair 3.1 / 4.2 / 2.2 / 1.7 GB/s with
# 256 KiB / 1 / 2 / 8 MiB frames; a TQ TCP get of 256 MiB 2.5 / 2.6 / 1.9 / 1.1 GB/s with 512 KiB /
# 1 / 2 / 8 MiB (a plain socket: 3.0 GB/s).
TCP_FRAME_BYTES = 1 << 20
# A TCP get asks a unit for at most about this many bytes of rows per request (several requests in flight).
TCP_FETCH_BYTES = 16 << 20
# A get of more than that from one unit is cut into up to this many lanes (and no more than half the
# client's cores) of at least TCP_LANE_BYTES, each a stream to the unit read on its own thread and
# written by the unit on its own thread (tq.stream_transport.PARALLEL_FLUSH_BYTES): one stream moves
# what one thread copies. Measured on 16 cores of an H200 host (loopback, one reader, A/B in one call):
# 64 MiB 1.31-1.44 -> 2.99-3.30 GB/s with 8 lanes of 8 MiB, 2.02 / 1.82 with 4 of 16 MiB; a 16 MiB get
# was slower in 2 lanes than in 1. On 2 vCPUs 8 lanes read 256 MiB at 1.23-1.45 GB/s, 2 at 1.85-2.46.
TCP_FETCH_STREAMS = 8
TCP_LANE_BYTES = 8 << 20


def whole_row_runs(row_starts: np.ndarray, limit: int) -> np.ndarray:
    """Rows laid back to back (``row_starts``: each row's byte offset, ascending) cut into runs of about
    ``limit`` bytes: the index of each run's first row. A run begins at each row whose start crosses a
    multiple of ``limit``, so it holds less than ``limit`` bytes before its last row, and no row is split
    (a unit's reply frames, a client's fetch requests)."""
    return np.flatnonzero(np.diff(row_starts // limit, prepend=-1))


# Columns of a location record (the ``locate`` reply and the controller's tables): where one
# (key, field) row lives - storage unit, block, row in the block, byte size and absolute byte offset in
# the unit's arena. The offset lets a client on the unit's host copy the row straight out of the
# mapped arena with no request to the unit. The run: rows one commit laid back to back in one block,
# in slot order, share its id (else -1); see tq.locations.
LOC_UNIT, LOC_BLOCK, LOC_ROW, LOC_NBYTES, LOC_OFFSET, LOC_RUN = range(6)
LOC_COLUMNS = 6
# Index arrays and raw-byte views may only use these dtypes; anything else in a ref is rejected.
ARRAY_DTYPES = frozenset({"<i8", "<i4", "<i2", "|i1", "|u1", "<u2", "<f4", "<f8", "|b1", "<f2"})
# A signed request is accepted only if its timestamp is within this many seconds of the server's clock:
# the hosts of one service need clocks in sync to well within it (NTP). It also bounds how long a server
# remembers a sender (see ReplayGuard), so it bounds the replay-protection state.
REPLAY_WINDOW_S = 60.0
# The ZMTP PLAIN user name of every connection to a server with a secret (the password is what counts).
CONNECTION_USERNAME = b"tq"


_encoder = msgspec.msgpack.Encoder()  # maps, lists, bytes as bin - and the typed structs of tq.messages


def _packb(obj: Any) -> bytes:
    return _encoder.encode(obj)


def _unpackb(data: bytes | memoryview) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 60
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 8
_SHOWN.maxlevel = 3


def shown(value: Any) -> str:
    """A value a peer sent, as an error message names it: its repr cut short. A header may hold
    megabytes, and the error goes back in the reply and into the server's log."""
    return _SHOWN.repr(value)


def sign(secret: bytes | None, header: bytes) -> bytes:
    """HMAC-SHA256 of a header under ``secret`` (empty when no secret is set)."""
    return hmac.new(secret, header, sha256).digest() if secret else b""


def connection_password(secret: bytes) -> bytes:
    """The ZMTP PLAIN password a connection to a server with ``secret`` must present.

    Derived, not the secret itself: PLAIN sends it in clear, and it must not let anyone sign requests."""
    return hmac.new(secret, b"tq-zap-v1", sha256).hexdigest().encode()


@dataclass
class Message:
    """A decoded message: its header map and its buffer frames (memoryviews, not copied)."""

    header: dict[str, Any]
    buffers: list[memoryview] = field(default_factory=list)


def frame_view(frame: Any) -> memoryview:
    """A frame (zmq.Frame, bytes or any buffer) as a flat byte memoryview, not copied."""
    buf = getattr(frame, "buffer", frame)  # zmq.Frame or bytes
    return memoryview(buf).cast("B") if not isinstance(buf, memoryview) or buf.format != "B" else buf


def encode(header: dict[str, Any], buffers: Sequence[Any], secret: bytes | None) -> list[Any]:
    """Frame a header and its buffers: small buffers go inside the header, the others out as given
    (no copy here)."""
    views = [memoryview(b) for b in buffers]
    sizes = [v.nbytes for v in views]
    inline: list[Any] | None = None
    frames, room = [], INLINE_TOTAL_BYTES
    for i, v in enumerate(views):
        if sizes[i] <= INLINE_BUFFER_BYTES and sizes[i] <= room:
            if inline is None:
                inline = [None] * len(views)
            inline[i] = v
            room -= sizes[i]
        else:
            frames.append(v)
    header = dict(header, v=PROTOCOL_VERSION, bs=sizes)
    if inline is not None:
        header["ib"] = inline
    hb = _packb(header)
    return [hb, sign(secret, hb), *frames]


class _RequestHeader(msgspec.Struct):
    """A request header as a server reads it: ``args`` stays raw msgpack until the op is known, then
    it is decoded straight into that op's struct (:mod:`tq.messages`). Everything else is checked here
    or by the server, so every field takes any value."""

    v: Any = None
    op: Any = None
    rid: Any = None
    args: msgspec.Raw = msgspec.Raw()
    bs: Any = None
    ib: Any = None
    sid: Any = None
    seq: Any = None
    ts: Any = None


_request_header = msgspec.msgpack.Decoder(_RequestHeader)


@dataclass
class Request:
    """A decoded, verified request: its op, request id, raw msgpack args (empty when absent), buffer
    frames (memoryviews, not copied) and, when signed, its sender's stamp."""

    op: Any
    rid: Any
    args: msgspec.Raw
    buffers: list[memoryview]
    sid: Any = None
    seq: Any = None
    ts: Any = None


def _open(frames: Sequence[Any], secret: bytes | None) -> bytes:
    """The header bytes of a message, once its frame count, header size and signature are checked."""
    if len(frames) < 2:
        raise MalformedMessageError(f"message has {len(frames)} frame(s); expected header, mac, buffers")
    hview = frame_view(frames[0])
    if hview.nbytes > MAX_HEADER_BYTES:
        raise MessageTooLargeError(f"header of {hview.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    hb = hview.tobytes()
    mac = frame_view(frames[1]).tobytes()
    if secret is not None and not hmac.compare_digest(mac, sign(secret, hb)):
        raise AuthenticationError("request signature missing or invalid for this server's secret")
    return hb


def _unpack_header(hb: bytes) -> dict[str, Any]:
    try:
        header = _unpackb(hb)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MalformedMessageError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise MalformedMessageError(f"header must be a map, got {type(header).__name__}")
    return header


def _buffers(version: Any, sizes: Any, frames: Sequence[Any], max_message_bytes: int | None, inline: Any = None) -> list[memoryview]:
    """The buffers (inline ones and frames, in order), once the version and the declared sizes (and
    their total) are checked."""
    if version not in ACCEPTED_VERSIONS or type(version) is not int:
        raise ProtocolVersionError(f"protocol version {shown(version)} is not supported (this side speaks {PROTOCOL_VERSION})")
    buffers = [frame_view(f) for f in frames[2:]]
    if inline is not None:
        buffers = _with_inline(version, sizes, inline, buffers)
    if not isinstance(sizes, list) or len(sizes) != len(buffers):
        raise MalformedMessageError(f"header declares {shown(sizes)} buffer sizes but {len(buffers)} buffer frames arrived")
    total = 0
    for declared, buf in zip(sizes, buffers):
        if not isinstance(declared, int) or declared != buf.nbytes:
            raise MalformedMessageError(f"buffer size mismatch: declared {shown(declared)}, got {buf.nbytes}")
        total += declared
    if max_message_bytes is not None and total > max_message_bytes:
        raise MessageTooLargeError(f"message of {total} bytes exceeds the limit of {max_message_bytes}")
    return buffers


def _with_inline(version: int, sizes: Any, inline: Any, frames: list[memoryview]) -> list[memoryview]:
    """The buffers of a message with inline ones: ``inline`` holds each buffer's bytes, or nil for
    the next frame."""
    if version < 2 or not isinstance(inline, list) or not isinstance(sizes, list) or len(inline) != len(sizes):
        raise MalformedMessageError(f"header's inline buffers ({type(inline).__name__}) do not match its buffer sizes {shown(sizes)}")
    framed = sum(b is None for b in inline)
    if framed != len(frames):
        raise MalformedMessageError(f"header declares {framed} buffer frames but {len(frames)} arrived")
    out, it = [], iter(frames)
    for b in inline:
        if b is None:
            out.append(next(it))
        elif type(b) is bytes:
            out.append(memoryview(bytearray(b)))  # writable, as a received frame is (a few KiB copied)
        else:
            raise MalformedMessageError(f"an inline buffer must be bytes or nil, got {type(b).__name__}")
    return out


def decode(frames: Sequence[Any], secret: bytes | None, *, max_message_bytes: int | None = None) -> Message:
    """Decode and verify a message (a reply, or any message read generically); raises a specific
    :class:`TQError` for every defect."""
    header = _unpack_header(_open(frames, secret))
    return Message(header, _buffers(header.get("v"), header.get("bs"), frames, max_message_bytes, header.get("ib")))


def _typed_header(hb: bytes, decoder: msgspec.msgpack.Decoder, raw_key: str) -> Any:
    """Header bytes decoded into ``decoder``'s struct, whose ``raw_key`` field keeps its value as raw
    msgpack; a header msgspec refuses (not msgpack, not a map, a key that is not a string) is read
    generically, raising the specific error if it is not a map at all."""
    try:
        return decoder.decode(hb)
    except msgspec.DecodeError:
        header = _unpack_header(hb)
        cls = decoder.type
        fields = {k: header.get(k) for k in cls.__struct_fields__ if k != raw_key}
        fields[raw_key] = msgspec.Raw(_packb(header[raw_key])) if raw_key in header else msgspec.Raw()
        return cls(**fields)


def decode_request(frames: Sequence[Any], secret: bytes | None, *, max_message_bytes: int | None = None) -> Request:
    """Decode and verify a request as a server does: like :func:`decode`, but its ``args`` are left as
    raw msgpack for the op's typed decoder (:class:`tq.messages.ArgsDecoder`)."""
    h = _typed_header(_open(frames, secret), _request_header, "args")
    return Request(h.op, h.rid, h.args, _buffers(h.v, h.bs, frames, max_message_bytes, h.ib), h.sid, h.seq, h.ts)


class _ReplyHeader(msgspec.Struct):
    """A reply header as a client reads it: ``result`` stays raw msgpack until the reply is known to
    answer the request waited for, then it is decoded into its op's reply type (:mod:`tq.messages`)."""

    v: Any = None
    rid: Any = None
    ok: Any = None
    result: msgspec.Raw = msgspec.Raw()
    error: Any = None
    bs: Any = None
    ib: Any = None


_reply_header = msgspec.msgpack.Decoder(_ReplyHeader)


@dataclass
class ReplyMessage:
    """A decoded, verified reply: the request id it answers, ``ok``, its raw msgpack ``result`` (empty
    when absent), its ``error`` and its buffer frames (memoryviews, not copied)."""

    rid: Any
    ok: Any
    result: msgspec.Raw
    error: Any
    buffers: list[memoryview]


def decode_reply(frames: Sequence[Any], secret: bytes | None, *, max_message_bytes: int | None = None) -> ReplyMessage:
    """Decode and verify a reply as a client does: like :func:`decode`, but its ``result`` is left as
    raw msgpack for the op's typed decoder (:class:`tq.messages.ReplyDecoder`)."""
    h = _typed_header(_open(frames, secret), _reply_header, "result")
    return ReplyMessage(h.rid, h.ok, h.result, h.error, _buffers(h.v, h.bs, frames, max_message_bytes, h.ib))


# ----------------------------------------------------------------------------- replay protection
class Sender:
    """One stream of signed requests: a random 64-bit id and a strictly increasing sequence number.

    A server refuses a request whose ``seq`` is not above the last one it accepted from the same id, so
    every request of a sender must reach a server in the order it was built: use one sender per client
    socket (a socket keeps order; two sockets to one server need not)."""

    __slots__ = ("sid", "_seq")

    def __init__(self) -> None:
        self.sid = int.from_bytes(os.urandom(8), "little")
        self._seq = itertools.count(1)

    def stamp(self, header: dict[str, Any]) -> None:
        """Add this sender's id, its next sequence number and the wall clock to a request header."""
        header["sid"] = self.sid
        header["seq"] = next(self._seq)
        header["ts"] = time.time_ns()


_thread = threading.local()


def _thread_sender() -> Sender:
    sender = getattr(_thread, "sender", None)
    if sender is None:
        sender = _thread.sender = Sender()
    return sender


def _forget_thread_senders() -> None:
    global _thread
    _thread = threading.local()  # a forked child must not reuse its parent's sender ids


os.register_at_fork(after_in_child=_forget_thread_senders)


class ReplayGuard:
    """A server's check that a signed request is fresh: its timestamp within the window of this clock,
    its sequence number above the last one accepted from its sender.

    Memory stays bounded: a sender is forgotten once the newest timestamp it sent is older than the
    window, and from then on any request it sent before is refused by the timestamp check alone.
    (That assumes this server's clock does not step back by more than the window.)"""

    def __init__(self, window_s: float = REPLAY_WINDOW_S) -> None:
        self.window_s = window_s
        self._window_ns = int(window_s * 1e9)
        self._senders: dict[int, tuple[int, int]] = {}  # sid -> (last accepted seq, newest timestamp)
        self._next_prune = 0

    def __len__(self) -> int:
        return len(self._senders)

    def check(self, header: dict[str, Any]) -> None:
        """Accept a signed request header or raise :class:`ReplayError`; an accepted one is remembered."""
        self.check_stamp(header.get("sid"), header.get("seq"), header.get("ts"))

    def check_stamp(self, sid: Any, seq: Any, ts: Any) -> None:
        """:meth:`check` of a request's sender id, sequence number and timestamp."""
        if type(sid) is not int or type(seq) is not int or type(ts) is not int:
            raise ReplayError("signed request lacks its sender id, sequence number or timestamp")
        now = time.time_ns()
        if not -self._window_ns <= ts - now <= self._window_ns:
            raise ReplayError(
                f"request timestamp is {(ts - now) / 1e9:+.1f}s off this server's clock, outside the "
                f"±{self.window_s:g}s window: a replay, or the hosts' clocks are not in sync"
            )
        last = self._senders.get(sid)
        if last is None:
            self._senders[sid] = (seq, ts)
        elif seq > last[0]:
            self._senders[sid] = (seq, ts if ts > last[1] else last[1])
        else:
            raise ReplayError(f"request {seq} of sender {sid:016x} is a replay (already accepted up to {last[0]})")
        if now >= self._next_prune:
            self._prune(now)

    def _prune(self, now: int) -> None:
        oldest = now - self._window_ns
        self._senders = {sid: v for sid, v in self._senders.items() if v[1] >= oldest}
        self._next_prune = now + self._window_ns // 4


# ----------------------------------------------------------------------------- requests / replies
def request(op: str, rid: int, args: Any, buffers: Sequence[Any], secret: bytes | None, sender: Sender | None = None) -> list[Any]:
    """Frame a request. With a secret it is stamped by ``sender`` (default: one sender per thread, fine
    for a thread that talks to each server over one socket) so the server can refuse replays."""
    header = {"op": op, "rid": rid, "args": args}
    if secret:
        (sender or _thread_sender()).stamp(header)
    name = getattr(op, "value", op)  # an op enum: its wire name
    try:
        frames = encode(header, buffers, secret)
    except UnicodeEncodeError as exc:  # a lone surrogate (e.g. from os.fsdecode): msgpack's error names nothing of ours
        raise InvalidRequestError(
            f"request {name!r} holds text that is not valid UTF-8 ({exc.reason}: {exc.object[exc.start : exc.end]!r}): "
            "keys, partition ids and field names must be encodable text"
        ) from None
    for f in frames:  # a server would drop the connection without a word: say it here
        n = memoryview(f).nbytes
        if n > MAX_FRAME_BYTES:
            raise MessageTooLargeError(
                f"request {name!r} has a frame of {n} bytes, over the {MAX_FRAME_BYTES}-byte frame limit: split the batch"
            )
    return frames


def reply_ok(rid: Any, result: Any, buffers: Sequence[Any], secret: bytes | None) -> list[Any]:
    return encode({"rid": rid, "ok": True, "result": result}, buffers, secret)


def reply_error(rid: Any, exc: BaseException, secret: bytes | None) -> list[Any]:
    name = type(exc).__name__ if isinstance(exc, TQError) else "TQError"
    message = str(exc) if isinstance(exc, TQError) else f"{type(exc).__name__}: {exc}"
    return encode({"rid": rid, "ok": False, "error": {"type": name, "message": message}}, [], secret)


def raise_for_reply(msg: Message) -> Any:
    """Return a reply's result or raise the error it carries as its own :class:`TQError` subclass."""
    header = msg.header
    if header.get("ok") is True:
        return header.get("result")
    _raise_error(header.get("error"), header)


def raise_for_error(reply: ReplyMessage) -> None:
    """Raise the error a reply carries as its own :class:`TQError` subclass (nothing if it is ``ok``)."""
    if reply.ok is not True:
        _raise_error(reply.error, reply)


def _raise_error(err: Any, reply: Any) -> None:
    if not isinstance(err, dict):
        raise MalformedMessageError(f"reply carries neither result nor error: {shown(reply)}")
    raise ERROR_TYPES.get(str(err.get("type")), TQError)(str(err.get("message")))


# ----------------------------------------------------------------------------- byte streams
# A client may talk to a server over a stream socket instead of ZMQ - a Unix socket on the server's
# host, TCP from elsewhere (see tq.stream_transport). A stream has no message boundaries, so each
# message travels as
#
#     u32 frame count, u64 size of every frame (little-endian), then the frames back to back
#
# - the same frames as on ZMQ ([header, mac, buffers...]), so everything above is shared. A TCP
# connection first carries the preamble below (the server's token: a client that reached another
# server on a reused port finds out before it sends a request) and the server's one-byte answer.
MAX_STREAM_FRAMES = 4096  # a peer declaring more frames than any request has is refused before it sends them
_COUNT = struct.Struct("<I")
STREAM_MAGIC = b"TQS1"
STREAM_TOKEN_BYTES = 32  # hex characters of a server's token (128 random bits)
STREAM_PREAMBLE_BYTES = len(STREAM_MAGIC) + STREAM_TOKEN_BYTES
STREAM_ACCEPTED = b"\x06"


def stream_preamble(token: str) -> bytes:
    """What a client sends first on a TCP stream to the server whose token is ``token``."""
    raw = token.encode("ascii")
    if len(raw) != STREAM_TOKEN_BYTES:
        raise ValueError(f"a stream token has {STREAM_TOKEN_BYTES} characters, got {shown(token)}")
    return STREAM_MAGIC + raw


def stream_prefix(frames: Sequence[Any]) -> bytes:
    """The bytes that go before ``frames`` on a stream (their count and sizes)."""
    sizes = [memoryview(f).nbytes for f in frames]
    return _COUNT.pack(len(sizes)) + struct.pack(f"<{len(sizes)}Q", *sizes)


def _fresh_bytes(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, np.uint8)


class StreamReader:
    """Cuts a byte stream into messages (lists of frames) as bytes arrive: pure, no I/O.

    Once a message's prefix has come, its frames get one buffer of their total size: later bytes are
    copied into it (:meth:`feed`), or a large message's rest is received straight into it
    (:meth:`body_left`, then :meth:`received`) - a 100 MiB reply costs one copy out of the kernel,
    not a growing buffer copied again as it grows. ``max_message_bytes`` bounds a message's frames
    together, checked from its prefix before anything is allocated (a server reading an
    unauthenticated peer sets it; None: no bound). ``alloc(nbytes)`` makes a body's buffer (a uint8
    array; default: a fresh one - a transport passes its pool's)."""

    def __init__(self, max_message_bytes: int | None = None, alloc: Callable[[int], np.ndarray] | None = None) -> None:
        self.max_message_bytes = max_message_bytes
        self._alloc = alloc if alloc is not None else _fresh_bytes
        self._head = bytearray()  # bytes before the current message's frames (its prefix, the next messages')
        self._sizes: list[int] = []  # the current message's frame sizes, once its prefix arrived
        self._body: memoryview | None = None  # ... and the buffer its frames arrive in
        self._got = 0  # bytes of the body arrived

    @property
    def pending(self) -> int:
        """Bytes held of a message not yet complete (0 between messages)."""
        return len(self._head) + self._got

    def feed(self, data: Any) -> list[list[memoryview]]:
        """Take received bytes; return the messages they completed, in order. Raises
        :class:`MalformedMessageError` or :class:`MessageTooLargeError` for a prefix no TQ peer sends
        (the stream cannot be read past it: close it)."""
        view = memoryview(data).cast("B")
        pos, out = 0, []
        while True:
            if self._body is not None:
                take = min(len(self._body) - self._got, len(view) - pos)
                self._body[self._got : self._got + take] = view[pos : pos + take]
                self._got += take
                pos += take
                if self._got < len(self._body):
                    return out
                out.append(self._complete())
                continue
            if pos < len(view):
                self._head += view[pos:]
                pos = len(view)
            if not self._start():
                return out

    def body_left(self, at_least: int) -> memoryview | None:
        """The rest of the current message's buffer, to receive into, when at least ``at_least``
        bytes of it are still to come (None: read into a chunk and :meth:`feed` it)."""
        if self._body is None or len(self._body) - self._got < at_least:
            return None
        return self._body[self._got :]

    def received(self, n: int) -> list[list[memoryview]]:
        """``n`` bytes were received into :meth:`body_left`'s view: the message, if that completed it."""
        if self._body is None or not 0 <= n <= len(self._body) - self._got:
            raise ValueError(f"received {n} bytes into a body with {len(self._body or b'') - self._got} left")
        self._got += n
        if self._got < len(self._body):
            return []
        return [self._complete(), *self.feed(b"")]

    def _start(self) -> bool:
        """Read a prefix out of the head, if it has one whole: then the body is made, filled with the
        head's bytes after the prefix."""
        head = self._head
        if len(head) < _COUNT.size:
            return False
        (n,) = _COUNT.unpack_from(head)
        if not 0 < n <= MAX_STREAM_FRAMES:
            raise MalformedMessageError(f"stream message declares {n} frames (1 to {MAX_STREAM_FRAMES} allowed)")
        prefix = _COUNT.size + 8 * n
        if len(head) < prefix:
            return False
        sizes = list(struct.unpack_from(f"<{n}Q", head, _COUNT.size))
        if max(sizes) > MAX_FRAME_BYTES:
            raise MessageTooLargeError(f"stream message declares a frame of {max(sizes)} bytes, over {MAX_FRAME_BYTES}")
        total = sum(sizes)
        if self.max_message_bytes is not None and total > self.max_message_bytes:
            raise MessageTooLargeError(f"stream message of {total} bytes exceeds the limit of {self.max_message_bytes}")
        take = min(total, len(head) - prefix)
        # writable, as a received ZMQ frame is; not zeroed (a bytearray's memset cost a 16 MiB part 8 ms)
        self._sizes, self._body = sizes, memoryview(self._alloc(total))
        self._body[:take] = head[prefix : prefix + take]
        self._got = take
        del head[: prefix + take]
        return True

    def _complete(self) -> list[memoryview]:
        whole = self._body
        assert whole is not None
        frames, pos = [], 0
        for size in self._sizes:
            frames.append(whole[pos : pos + size])
            pos += size
        self._body, self._got = None, 0
        return frames


# ----------------------------------------------------------------------------- array refs
def pack_array(arr: np.ndarray, buffers: list[Any]) -> ArrayRef:
    """Append a contiguous array's bytes to ``buffers`` and return its ref for the header."""
    arr = np.ascontiguousarray(arr)
    if arr.dtype.str not in ARRAY_DTYPES:
        raise TypeError(f"array dtype {arr.dtype} cannot travel on the wire")
    buffers.append(arr.reshape(-1).view(np.uint8) if arr.size else b"")
    return ArrayRef(len(buffers) - 1, arr.dtype.str, list(arr.shape))


def unpack_array(ref: Any, buffers: Sequence[memoryview], *, name: str = "array", dtype: str | None = None) -> np.ndarray:
    """Return a read-only zero-copy view of a referenced buffer, validating dtype, shape and size.

    ``ref``: a typed :class:`tq.messages.ArrayRef` (a server's decoded request) or its map form (a reply)."""
    if type(ref) is ArrayRef:
        index, dt, shape = ref.b, ref.d, ref.s
    elif isinstance(ref, dict) and isinstance(ref.get("b"), int) and isinstance(ref.get("s"), list):
        index, dt, shape = ref["b"], ref.get("d"), ref["s"]
    else:
        raise MalformedMessageError(f"{name}: expected an array ref, got {shown(ref)}")
    if dt not in ARRAY_DTYPES or (dtype is not None and dt != dtype and np.dtype(dt) != np.dtype(dtype)):
        raise MalformedMessageError(f"{name}: dtype {shown(dt)} not allowed here")
    if not 0 <= index < len(buffers):
        raise MalformedMessageError(f"{name}: buffer index {index} out of range")
    if len(shape) > 8 or any(not isinstance(d, int) or d < 0 for d in shape):
        raise MalformedMessageError(f"{name}: invalid shape {shown(shape)}")
    npdt = np.dtype(dt)
    expected = math.prod(shape) * npdt.itemsize  # Python ints: a huge shape cannot wrap around
    buf = buffers[index]
    if buf.nbytes != expected:
        raise MalformedMessageError(f"{name}: buffer holds {buf.nbytes} bytes, shape {shape} of {dt} needs {expected}")
    out = np.frombuffer(buf, dtype=npdt) if expected else np.empty(0, dtype=npdt)
    return out.reshape(shape)
