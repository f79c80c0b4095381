"""The TQ client: put, write back, get, wait, discard - from any process, by the service's address.

Data never passes through the controller: the client asks the controller where (key, field) pairs
live, then moves bytes straight to or from the storage units. On the same host it writes into a
unit's shared-memory arena (blocks carved out of a slab the unit granted, so a put is one round trip:
its commit) and reads rows at the arena offsets the controller located, so a get is one round trip
(to the controller) plus one memory copy into the result, or no copy at all when borrowed
(``get(copy=False)``); elsewhere bytes stream over TCP as raw frames (one round trip per unit, all
units asked in parallel). On the controller's host a get
of a meta the service handed out needs no round trip at all: the client reads the locations from the
controller's shared location table (:mod:`tq.locations`) and falls back to asking whenever it cannot
trust what it read.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import os
import queue
import reprlib
import threading
import time
import warnings
import weakref
from collections import abc
from typing import Any, Callable, Literal, Mapping, NamedTuple, Sequence, TypeVar, cast

import msgspec
import numpy as np
import torch

from . import liveness, protocol
from .admin import connect_units, service_stats, unit_stats
from .arena import ALIGN, Arena, align_up, host_identity, map_read_only
from .bufferpool import HostBufferPool
from .columns import EncodedColumn, FieldLayout, encode_column, field_layout, pad_number, tensor_at, tensor_in, to_tensor, unpack_objects
from .errors import (
    CapacityError,
    DuplicateKeyError,
    ForkedClientError,
    InvalidRequestError,
    MalformedMessageError,
    StorageUnitError,
    TQConnectionError,
    TQError,
)
from .jagged import JaggedTensor
from .locations import H_PIN_EPOCH, SUPPORTED as LOCAL_TABLES_SUPPORTED, LocatedRows, LocationView, key_fingerprints
from . import messages
from .messages import ControllerOp as Op, UnitOp
from .argtypes import address_value, optional_text, seconds_value
from .meta import MAX_PAD_LENGTH, KVBatchMeta, check_names, is_pad_length, plain_strs
from .leases import new_lease_id
from .request_book import new_request_id
from .pins import SUPPORTED as PINS_SUPPORTED, PinFile
from .protocol import LOC_BLOCK as BLOCK, LOC_COLUMNS, LOC_NBYTES as NBYTES, LOC_OFFSET as OFFSET  # location
from .protocol import LOC_ROW as ROW, LOC_UNIT as UNIT  # record columns
from .rowcopy import FieldCopy, copy_fields, write_chunks
from .stream_transport import usable_cores
from .rpc import RpcChannel, refuses_connections, time_budget, time_left
from .schema import DTYPES, JAGGED, OBJECT, FieldSchema

ReadsArgsT = TypeVar("ReadsArgsT", bound=messages.ReadsArgs)
_Method = TypeVar("_Method", bound=Callable[..., Any])

Layout = Literal["padded", "jagged", "list"]
_FIELD_ALIGN = 64

_default_pool = HostBufferPool()
# Copies out of a shared arena that raced a free are redone this often before the units send the rows.
SHM_READ_TRIES = 3
# Each field's part of a get's result buffer starts on a cache line (whole streaming-store vectors).
OUT_ALIGN = 64
# Same-host puts carve blocks out of slabs: SLAB_BYTES and SLAB_IDS blocks per grant, used for at most
# SLAB_USE_S (well inside the unit's 60 s allocation lease); a put above a quarter slab gets its own.
SLAB_BYTES, SLAB_IDS, SLAB_USE_S = 4 << 20, 1024, 20.0
PUT_MIN_THREADS = 4  # see put_copy_threads
PREFAULT_MIN_BYTES = 1 << 20  # a put this big maps its pages in one call first (Arena.prefault); a small one is not worth the syscall
FREE_GRACE_S = 0.05  # a write that finds no room waits this long for frees already decided (see _room_wait_s)
GIVE_BACK_S = 0.25  # how long giving a slab's unused ids back may wait (close() must not hang on a dead controller)
ABORT_PROBE_S = 0.5  # after a commit or a destructive request got no reply: how long to ask whether it landed
UNIT_CHECK_MIN_S = 0.05  # a wait on a unit asks the controller about it only with this much of its time left
log = logging.getLogger("tq.client")

UNIT_AWAIT_S = 0.25  # how often a read waiting for a silent unit asks whether it answers again
UNIT_AWAIT_STATUS_S = 1.0  # how long each of those asks may take
UNIT_PROBE_S = 0.5  # how long a connect to a silent unit's address may take to be refused (see _await_unit)
DEFAULT_LEASE_S = 30.0  # a borrowed get's lease term; a live holder renews it every third of it


MAX_MINT_KEYS = 1 << 24  # keys one mint_keys makes: more is a slip (a group size of 10**9), not a batch


def mint_keys(uids: Sequence[str], group_size: int) -> list[str]:
    """Keys ``"{uid}_g{i}"`` for ``group_size`` generations of each prompt uid, grouped by prompt."""
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size < 1:
        raise InvalidRequestError(f"group_size must be a whole number >= 1, got {group_size!r}")
    uids = _names(uids, "uids")
    if len(uids) * group_size > MAX_MINT_KEYS:  # checked before a key is made: a slip must not eat the host's memory
        raise InvalidRequestError(
            f"{len(uids)} uids x group_size {group_size} is {len(uids) * group_size} keys, more than MAX_MINT_KEYS ({MAX_MINT_KEYS})"
        )
    return [f"{uid}_g{i}" for uid in uids for i in range(group_size)]


def _frames_of(chunks: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Regroup byte chunks into frames of about ``protocol.TCP_FRAME_BYTES`` (views where possible)."""
    frames: list[np.ndarray] = []
    small: list[np.ndarray] = []
    small_bytes = 0
    for c in chunks:
        if c.size >= protocol.TCP_FRAME_BYTES:
            if small:
                frames.append(np.concatenate(small))
                small, small_bytes = [], 0
            frames.extend(c[i : i + protocol.TCP_FRAME_BYTES] for i in range(0, c.size, protocol.TCP_FRAME_BYTES))
            continue
        small.append(c)
        small_bytes += c.size
        if small_bytes >= protocol.TCP_FRAME_BYTES:
            frames.append(np.concatenate(small))
            small, small_bytes = [], 0
    if small or not frames:
        frames.append(np.concatenate(small) if small else np.empty(0, np.uint8))
    return frames


def _rebased(row_offsets: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Byte offsets of rows ``[start, stop)`` from the first one's start (the array itself, not a copy,
    for all rows: the common, unsplit write)."""
    if start == 0 and stop == row_offsets.size - 1:
        return row_offsets
    return row_offsets[start : stop + 1] - row_offsets[start]


def _byte_range(chunks: Sequence[np.ndarray], start: int, stop: int) -> list[np.ndarray]:
    """Views of bytes ``[start, stop)`` of the concatenation of ``chunks`` (no copy)."""
    if start == 0 and stop == sum(c.size for c in chunks):
        return list(chunks)
    out, pos = [], 0
    for c in chunks:
        a, b = max(start - pos, 0), min(stop - pos, c.size)
        if a < b:
            out.append(c[a:b])
        pos += c.size
    return out


class _StoredPart(NamedTuple):
    """Rows ``[start, stop)`` of a write, stored as ``block`` of ``unit``; ``starts`` maps each field
    to the arena offset where its bytes begin; ``slab``: ``(slab id, start, size)`` when the block was
    carved out of a slab (its unit learns of it from the controller, once committed)."""

    unit: int
    block: int
    start: int
    stop: int
    starts: dict[str, int]
    slab: tuple[int, int, int] | None = None


class _Slab:
    """A range of a same-host unit's arena and a range of block ids granted to this client: puts
    carve blocks out of it with no request to the unit."""

    __slots__ = ("aid", "pos", "end", "next_id", "end_id", "use_until", "writers", "retired")

    def __init__(self, aid: int, start: int, size: int, first_id: int, n_ids: int, use_until: float) -> None:
        self.aid, self.pos, self.end = aid, start, start + size
        self.next_id, self.end_id, self.use_until = first_id, first_id + n_ids, use_until
        # the puts copying into blocks carved from it right now, by token: a set, not a count, so that
        # ending a put's writing is the same done twice (see TQClient._done_writing)
        self.writers: set[object] = set()
        self.retired = False  # replaced: released to its unit once nothing copies into it

    def carve(self, nbytes: int, now: float, writer: object) -> tuple[int, int] | None:
        """(start, block id) of a block of ``nbytes`` (ALIGN-rounded) for the put ``writer``, or None if
        it does not fit (or the slab is given back)."""
        if self.pos + nbytes > self.end or self.next_id >= self.end_id or now > self.use_until or self.retired:
            return None
        start, bid = self.pos, self.next_id
        self.pos += nbytes
        self.next_id += 1
        self.writers.add(writer)
        return start, bid


def _keep_slabs(client_ref: "weakref.ref[TQClient]", stop: threading.Event) -> None:
    """A client's slab keeper thread: every quarter of the slab use period, its idle slabs go back."""
    while not stop.wait(SLAB_USE_S / 4):
        client = client_ref()
        if client is None:
            return
        client._give_back_idle_slabs()
        del client


def copy_threads() -> int:
    """Threads a large copy of a get may use: torch's intra-op threads (``torch.set_num_threads``,
    ``OMP_NUM_THREADS``; Ray sets the latter to an actor's ``num_cpus``), as torch's own copies do."""
    return torch.get_num_threads()


def put_copy_threads() -> int:
    """Threads a large same-host put may copy on: :func:`copy_threads`, but at least PUT_MIN_THREADS
    (or this process's cores, if fewer). A producer is typically a Ray actor of one CPU or less, which
    Ray gives one intra-op thread, and a big put is one copy bound by memory bandwidth, not compute:
    Ray's own object store copies a big object on several threads whatever the worker's thread count
    (one thread left TQ's 512 MiB put at 0.27-0.40x Ray's on a 16-core H200 host)."""
    return max(copy_threads(), min(PUT_MIN_THREADS, usable_cores()))


class _UnitRestarted(Exception):
    """A storage unit came back at a new address while a request to its old one was pending."""


class _UnitUnreachable(Exception):
    """A storage unit its controller has not heard from lately - not given up on - holds rows a read
    needs (raised before they are asked for, or while a request to it waits): a get waits for it
    (TQClient._await_unit) and reads again; a write fails with StorageUnitError (its message is this)."""

    def __init__(self, unit: int, why: str) -> None:
        super().__init__(f"storage unit {unit} {why}")
        self.unit = unit


def _unit_down(unit: int, st: messages.UnitStatusReply) -> StorageUnitError:
    """The error for a unit its controller gave up on."""
    return StorageUnitError(f"storage unit {unit} at {st.address} is down ({messages.unit_down_reason(st.down_for_s)})")


class _Fetched:
    """Where each requested row of one field lives after a fetch: a source buffer and a byte range."""

    __slots__ = ("schema", "sources", "src", "starts", "sizes", "_longest", "_total", "row_offsets")

    def __init__(
        self,
        schema: FieldSchema,
        sources: list[np.ndarray],
        src: np.ndarray,
        starts: np.ndarray,
        sizes: np.ndarray,
        longest: int | None = None,
        total: int | None = None,
        row_offsets: np.ndarray | None = None,
    ) -> None:
        self.schema, self.sources, self.src, self.starts, self.sizes = schema, sources, src, starts, sizes
        self._longest, self._total = longest, total  # known up front on the location-table path
        self.row_offsets = row_offsets  # a jagged field's offsets, where the location read made them

    @property
    def longest(self) -> int:
        """Bytes of the longest row."""
        if self._longest is None:
            self._longest = int(self.sizes.max()) if self.sizes.size else 0
        return self._longest

    @property
    def total(self) -> int:
        """Bytes of all rows."""
        if self._total is None:
            self._total = int(self.sizes.sum())
        return self._total

    @classmethod
    def empty(cls, schema: FieldSchema, n: int) -> "_Fetched":
        """Rows to be placed by :func:`_place` (several units, or frames)."""
        return cls(schema, [], np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64))


# One field of a get, planned before any byte moves: (rows, layout, start of its part of the get's
# buffer, its bytes, its result's shape - None: msgpack rows, decoded after the copy). A plain tuple:
# one is made per field of every get.
_Planned = tuple[_Fetched, FieldLayout, int, int, "tuple[int, ...] | None"]


def _lane_threads() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that carry a big TCP get's or put's other lanes, each over its own stream to the unit
    (a stream is one thread's): one thread's kernel copy into or out of its socket was most of such a
    transfer. One pool per process: a child forked after a get inherits a pool whose threads it does not have."""
    return _lane_threads_of(os.getpid())


@functools.cache
def _lane_threads_of(pid: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(protocol.TCP_FETCH_STREAMS - 1, thread_name_prefix="tq-lane")


def _fetch_parts(nbytes: np.ndarray, limit: int = protocol.TCP_FETCH_BYTES) -> list[slice]:
    """The rows of a TCP fetch from one unit (``nbytes`` each, in order) cut into requests of about
    ``limit`` bytes, all sent before any reply is awaited: the unit gathers the next request's rows
    while the last one's frames stream, instead of gathering all before the first byte leaves. A row
    is never split."""
    n = nbytes.size
    if n == 0:
        return [slice(0, 0)]
    bounds = [*protocol.whole_row_runs(np.cumsum(nbytes) - nbytes, limit).tolist(), n]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _lanes_of(nbytes: np.ndarray, most: int | None = None) -> list[slice]:
    """Rows of a TCP transfer with one unit (``nbytes`` each, in order) cut into lanes - runs of whole
    rows, each moved over its own stream on its own thread. A transfer of more than one request's bytes
    (``TCP_FETCH_BYTES``) gets up to ``most`` lanes of at least ``TCP_LANE_BYTES``; a smaller one, one
    lane. ``most`` defaults to this process's: a lane is a core's copy - and on one host another core's
    at the unit - so half its cores, at most ``TCP_FETCH_STREAMS``."""
    if most is None:
        most = min(protocol.TCP_FETCH_STREAMS, usable_cores() // 2)
    total = int(nbytes.sum())
    lanes = min(most, total // protocol.TCP_LANE_BYTES) if total > protocol.TCP_FETCH_BYTES else 1
    if lanes <= 1:
        return [slice(0, nbytes.size)]
    return _fetch_parts(nbytes, -(-total // lanes))


def _fetch_lanes_of(nbytes: np.ndarray, most: int | None = None) -> list[list[slice]]:
    """The rows of a TCP fetch from one unit cut into lanes (:func:`_lanes_of`), and each lane's rows
    into its requests (:func:`_fetch_parts`)."""
    if int(nbytes.sum()) <= protocol.TCP_FETCH_BYTES:  # one request (cutting it cost a 1-key get 12 us of numpy)
        return [[slice(0, nbytes.size)]]
    return [[slice(lane.start + p.start, lane.start + p.stop) for p in _fetch_parts(nbytes[lane])] for lane in _lanes_of(nbytes, most)]


def _place(
    out: dict[str, _Fetched],
    fields: list[str],
    where: np.ndarray,
    sources: list[np.ndarray],
    src: np.ndarray,
    starts: np.ndarray,
    sizes: np.ndarray,
) -> None:
    """Record where the rows ``where`` ([field index, key index]) of one unit can be copied from."""
    for f, name in enumerate(fields):
        sel = np.flatnonzero(where[:, 0] == f)
        if not sel.size:
            continue
        fx, keys_idx = out[name], where[sel, 1]
        fx.src[keys_idx] = src[sel] + len(fx.sources)
        fx.starts[keys_idx] = starts[sel]
        fx.sizes[keys_idx] = sizes[sel]
        fx.sources.extend(sources)


def _in_arena(
    arena: np.ndarray,
    schemas: list[FieldSchema],
    fields: list[str],
    starts: np.ndarray,
    sizes: np.ndarray,
    longest: Sequence[int] | None = None,
    totals: Sequence[int] | None = None,
    row_offsets: np.ndarray | None = None,
) -> dict[str, _Fetched]:
    """The rows ``[fields, keys]`` at ``starts`` / ``sizes`` of one mapped arena, read where they lie
    (with each field's longest row, byte total and jagged offsets where already known)."""
    src, sources = np.zeros(starts.shape[1], dtype=np.int64), [arena]  # shared: never extended (only _place extends)
    if longest is None or totals is None:
        return {name: _Fetched(schema, sources, src, st, sz) for name, schema, st, sz in zip(fields, schemas, starts, sizes)}
    offsets = itertools.repeat(None) if row_offsets is None else row_offsets
    return {
        name: _Fetched(schema, sources, src, st, sz, most, total, offs)
        for name, schema, st, sz, most, total, offs in zip(fields, schemas, starts, sizes, longest, totals, offsets)
    }


def _jagged(values: torch.Tensor, sizes: np.ndarray, row_bytes: int, offsets: np.ndarray | None = None) -> JaggedTensor:
    """``values`` as rows of ``sizes`` bytes back to back (offsets made here, or by the location
    read from the same sizes: trusted as made)."""
    if offsets is not None:
        return JaggedTensor.trusted(values, torch.from_numpy(offsets))
    offsets = np.empty(sizes.size + 1, dtype=np.int64)
    offsets[0] = 0
    np.cumsum(sizes, out=offsets[1:])
    if row_bytes & (row_bytes - 1) == 0:  # the usual itemsizes: a shift, half the time of a division per row
        offsets >>= row_bytes.bit_length() - 1
    else:
        offsets //= row_bytes
    return JaggedTensor.trusted(values, torch.from_numpy(offsets))


def _results(
    raw: np.ndarray, planned: list[_Planned], fields: list[str], layout: Layout, base: torch.Tensor | None = None
) -> dict[str, Any]:
    """The values handed back for the fields of a get: tensors viewing their parts of the get's
    buffer (a :class:`JaggedTensor` or its rows for jagged fields not padded), made before the copy
    fills it; object fields hold None until :func:`_decode_objects` runs on the copied bytes.
    ``base``: the buffer as a torch tensor, when torch allocated it (page-locked): views of it."""
    out: dict[str, Any] = {}
    for name, (fx, lay, start, nbytes, shape) in zip(fields, planned):
        if shape is None:
            out[name] = None
            continue
        t = tensor_at(raw, start, lay, shape) if base is None else tensor_in(base, start, nbytes, lay, shape)
        if lay.kind == JAGGED and layout != "padded":
            jt = _jagged(t, fx.sizes, lay.row_bytes, fx.row_offsets)
            out[name] = jt if layout == "jagged" else jt.unbind()
        else:
            out[name] = t
    return out


def _decode_objects(out: dict[str, Any], raw: np.ndarray, planned: list[_Planned], fields: list[str]) -> dict[str, Any]:
    """Fill in the object fields of :func:`_results` from the copied bytes; returns ``out``."""
    for name, (fx, _, start, nbytes, shape) in zip(fields, planned):
        if shape is None:
            out[name] = unpack_objects(raw[start : start + nbytes], fx.sizes)
    return out


class BorrowedBatch(dict):
    """What ``get(..., copy=False)`` returns: field -> value, where the fields named in ``viewed`` are
    read-only tensors viewing the storage arena (nothing copied) and the others are copies.

    The viewed bytes stay valid, whatever other clients discard, clear or overwrite meanwhile, until
    every tensor viewing them (slices and views of them included) is garbage collected, or until
    :meth:`release` (also on leaving a ``with`` block): after that the tensors must not be read.
    Writing to a viewed tensor is refused by the OS (the arena is mapped read-only here): ``clone()``
    one to modify it."""

    def __init__(self, values: dict[str, Any], viewed: frozenset[str], release: Callable[[], None] | None) -> None:
        super().__init__(values)
        self.viewed = viewed
        self._release = release

    def release(self) -> None:
        """Give the views up now (idempotent): the storage they view may be freed and reused."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> "BorrowedBatch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class _LeaseKeeper:
    """The leases of a client's borrowed gets: renews those with live views every third of their
    term and gives up each one once its last view is collected. A lease taken as a pin (``tq.pins``)
    is renewed and given up in this client's pin file, with no request.

    A view is watched by a weak reference whose callback is ``SimpleQueue.put`` itself: the collector
    runs it wherever it happens to run - in the middle of any code of any of the client's threads, this
    keeper's own included, possibly with ``_lock`` held - and it takes no lock a thread could hold. Being
    C, it also runs no Python code a signal handler's exception (a Ctrl-C) could cut short: a Python
    finalizer interrupted there lost the lease for good. The keeper's thread maps the reference to its
    lease, counts the views down and gives the lease up."""

    def __init__(self, client: "TQClient") -> None:
        self._client = weakref.ref(client)
        self._views: dict[int, int] = {}  # lease id -> tensors' arrays still alive
        self._slots: dict[int, tuple[PinFile, int]] = {}  # lease id -> its pin file and slot, for pins
        self._ended: list[int] = []
        # lease ids asked for by requests that failed (no reply): given up until then, in case one was granted
        self._abandoned: dict[int, float] = {}
        self._lock = threading.Lock()
        # id of a view's weak reference -> it and its lease (see the class docstring)
        self._watched: dict[int, tuple[weakref.ref, int]] = {}
        # a collected view's weak reference, or None: wake up and flush
        self._events: queue.SimpleQueue[weakref.ref | None] = queue.SimpleQueue()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.pins: PinFile | None = None  # the client's pin file for new pins, once registered
        self._retired_pins: list[PinFile] = []  # files no longer read: closed once they pin nothing
        # Started with the client, not at its first borrowed get: a Ctrl-C landing inside Thread.start()
        # there could kill the new thread in CPython's bootstrap (KeyError in _limbo) and leave every
        # lease of the client unrenewed and never given up.
        with self._lock:
            self._start()

    def hold(self, lease: int, arrays: list[np.ndarray], pin: tuple[PinFile, int] | None = None) -> Callable[[], None]:
        """Track ``lease`` (``pin``: its pin file and slot, for a pin) until every array handed to
        torch for it is collected; returns the explicit release."""
        with self._lock:
            self._views[lease] = len(arrays)
            if pin is not None:
                self._slots[lease] = pin
            self._start()
            for a in arrays:
                ref = weakref.ref(a, self._events.put)
                self._watched[id(ref)] = (ref, lease)
        return lambda: self.release_now(lease)

    def _settle(self, event: weakref.ref | None) -> bool:
        """A queued event: None asks for a flush (True); a weak reference says one of its lease's views
        was collected - count it, and at the last one give a pin up (one store) or queue the lease to be
        given up by request (True: the caller flushes)."""
        if event is None:
            return True
        with self._lock:
            _, lease = self._watched.pop(id(event), (None, 0))  # not there: the keeper stopped
            left = self._views.get(lease)
            if left is None:  # released explicitly before (or the keeper stopped)
                return False
            if left > 1:
                self._views[lease] = left - 1
                return False
            del self._views[lease]
            pin = self._slots.pop(lease, None)
            if pin is None:
                self._ended.append(lease)
                return True
        pin[0].release(pin[1], lease)
        return False

    def _settle_queued(self) -> bool:
        """Settle every queued event without waiting; True if one asks for a flush."""
        flush = False
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return flush
            flush = self._settle(event) or flush

    def give_up(self, lease: int, pin: tuple[PinFile, int] | None) -> None:
        """A lease a get took and never handed out (it raised): given up now, pinned or by request
        (given up first, forgotten after, as in :meth:`release_now`)."""
        if pin is not None:
            pin[0].release(pin[1], lease)
        else:
            self.abandon(lease)
        with self._lock:
            self._views.pop(lease, None)
            self._slots.pop(lease, None)

    def abandon(self, lease: int) -> None:
        """A request asking for ``lease`` failed without a reply: the controller may still grant it (it
        may only have been slow), so it is given up at every renewal for one term, and until the
        controller heard that once the term is over (it keeps the lease of a live reader)."""
        client = self._client()
        with self._lock:
            self._abandoned[lease] = time.monotonic() + (client.lease_s if client is not None else 0.0)
            self._start()
        self._events.put(None)

    def _start(self) -> None:
        """Start the keeper's thread if it is not running (call with the lock held): a thread that
        died - an interrupt cut its start short - is replaced, not taken for a live one."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="tq-lease-keeper", daemon=True)
            self._thread.start()

    def release_now(self, lease: int) -> None:
        client = self._client()
        if client is not None and client._pid != os.getpid():  # a forked child's copy of the views: the lease
            return  # and its pin are the parent's, whose views still read the bytes
        with self._lock:
            if lease not in self._views:
                return
            pin = self._slots.get(lease)
            if pin is None:  # by request: listed as ended first, so a release cut short (a Ctrl-C) or failed
                del self._views[lease]  # is the keeper's to give up, and no renewal goes out meanwhile
                self._ended.append(lease)
        if pin is None:
            if client is not None:
                try:
                    client._call(Op.LEASES, messages.Leases(release=[lease]))
                except TQError:  # the controller is away: the keeper gives it up later (or its term runs out)
                    self._events.put(None)
                    return
            with self._lock:
                if lease in self._ended:
                    self._ended.remove(lease)
            return
        # a pin: given up first, forgotten after - cut short in between, the lease is still tracked and goes
        # with its views; forgotten first, the pin of this live process would be held for good
        pin[0].release(pin[1], lease)
        with self._lock:
            self._views.pop(lease, None)
            self._slots.pop(lease, None)

    def _run(self) -> None:
        while not self._stopped:
            client = self._client()
            if client is None:
                return
            deadline = time.monotonic() + client.lease_s / 3
            del client
            while not self._stopped:  # settle collected views as they come; flush once a period or when asked
                try:
                    event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if self._settle(event) or self._settle_queued():
                    break
            self.flush()

    def flush(self) -> None:
        """Renew the leases still viewed, give up the others."""
        self._settle_queued()
        now_s = time.monotonic()
        with self._lock:
            pinned = list(self._slots.items())
            renew, ended, self._ended = [i for i in self._views if i not in self._slots], self._ended, []
            abandoned = list(self._abandoned)
        client = self._client()
        if client is None:
            return
        now = time.monotonic_ns()
        outlived = sum(not pins.renew(slot, i, now + int(client.lease_s * 1e9), now) for i, (pins, slot) in pinned)
        self._close_retired()
        if renew or ended or abandoned:
            try:
                reply = client._call(
                    Op.LEASES, messages.Leases(renew=renew, release=ended + abandoned), timeout=min(client.timeout, client.lease_s / 3)
                )
            except TQError:  # the controller is away: try again next period (leases are journaled)
                with self._lock:
                    self._ended.extend(ended)
            else:
                outlived += len(reply.ended)
                with self._lock:  # given up past their term at least once: no late grant is left to undo
                    self._abandoned = {i: until for i, until in self._abandoned.items() if until > now_s}
        if outlived:
            warnings.warn(
                f"{outlived} borrowed gets outlived their lease: their views may show reused storage", RuntimeWarning, stacklevel=1
            )

    def retire(self, pins: PinFile) -> None:
        """``pins`` is no longer read (revoked, or registered with another controller): new pins go to
        another file; it closes once its pins are given up."""
        with self._lock:
            self._retired_pins.append(pins)
            if self.pins is pins:
                self.pins = None

    def _close_retired(self) -> None:
        with self._lock:
            in_use = {id(p) for p, _ in self._slots.values()}
            done = [p for p in self._retired_pins if id(p) not in in_use]
            self._retired_pins = [p for p in self._retired_pins if id(p) in in_use]
        for p in done:
            p.close()

    def stop(self) -> None:
        """Give every lease up (the client closes), close the pin files and stop the thread."""
        self._stopped = True
        with self._lock:
            pinned = list(self._slots.items())
            self._ended.extend(i for i in self._views if i not in self._slots)
            self._views.clear()
            self._slots.clear()
            self._watched.clear()
        for i, (pins, slot) in pinned:
            pins.release(slot, i)
        for pins in [self.pins, *self._retired_pins]:
            if pins is not None:
                pins.close()
        try:
            self.flush()
        except TQError:
            pass
        self._events.put(None)


def _check_pin_memory(copy: bool) -> None:
    """A get's ``pin_memory=True`` needs CUDA and a copy: refused at once, naming why."""
    if not copy:
        raise InvalidRequestError("pin_memory=True copies into page-locked memory; copy=False views the arena instead - choose one")
    if not torch.cuda.is_available():
        raise InvalidRequestError(
            "pin_memory=True needs CUDA: page-locked memory is for copies to a GPU (torch.cuda.is_available() is False)"
        )


def _names(value: Any, what: str) -> list[str]:
    """``value`` (keys, fields) as a list; InvalidRequestError for a lone str or bytes, which ``list()``
    would read as one name per character."""
    if isinstance(value, (str, bytes)):
        raise InvalidRequestError(f"{what} must be a list of names, not a single {type(value).__name__} ({value[:40]!r})")
    names = list(value)
    return names if set(map(type, names)) <= {str} else plain_strs(names)  # np.str_ keys (a verl uid array) too


def _key_fingerprints_of(meta: KVBatchMeta) -> np.ndarray | None:
    """The fingerprints of the meta's keys, which a location table's slots are checked against
    (:func:`tq.locations.key_fingerprints`); None for keys that have none (not UTF-8: the controller
    then says why). Kept on the meta, which is immutable: a meta read again (a rank's micro-batches,
    the next field of the same shard) does not hash its keys again (~7 ns a key on the 2-vCPU VM;
    hashed on every read it cost the H200's 512 MiB borrowed get a third of its speed). Not pickled
    (KVBatchMeta.__getstate__)."""
    fps = meta.__dict__.get("_key_fingerprints")
    if fps is None:
        try:
            fps = key_fingerprints(meta.keys)
        except UnicodeError:
            return None
        object.__setattr__(meta, "_key_fingerprints", fps)
    return fps


BIG_RESULT_BYTES = 1 << 30  # a get's result this large is checked against the memory left first


def _memory_available() -> int:
    """Bytes this process may still take: the host's available memory, or less where its cgroup (a
    container's memory limit, v2 or v1) leaves less - what would kill it first."""
    import psutil

    available = psutil.virtual_memory().available
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read())
        except (OSError, ValueError):
            continue
        if limit.isdigit():
            available = min(available, max(int(limit) - usage, 0))
        break
    return available


def _check_result_fits(nbytes: int, planned: list, fields: list[str]) -> None:
    """InvalidRequestError naming the largest field when a get's result (``nbytes``) is more than
    the memory available here: a pad length of 2**31 (a sentinel passed as ``pad_to`` or as the
    meta's ``global_forward_pad_seqlen``) padded every row to it, and the host ran out of memory
    filling the pad instead of the call failing."""
    available = _memory_available()
    if nbytes > available:
        (_, _, _, size, shape), name = max(zip(planned, fields), key=lambda pf: pf[0][3])
        raise InvalidRequestError(
            f"this get's result needs {nbytes / 2**30:.1f} GiB, more than the {available / 2**30:.1f} GiB of memory available "
            f"here; the largest field, {name!r}, is {size / 2**30:.1f} GiB as {tuple(shape) if shape else 'objects'} "
            "(a pad length too long? pad_to, or the meta's extra_info['global_forward_pad_seqlen'])"
        )


def _check_meta(meta: Any, op: str) -> None:
    """TypeError naming what ``op`` got instead of a :class:`KVBatchMeta` (an AttributeError on some
    field of it, deep in the call, named nothing)."""
    if not isinstance(meta, KVBatchMeta):
        raise TypeError(f"{op} needs a KVBatchMeta (from put, get_meta or mint_keys), got {type(meta).__name__}")


def _in_opening_process(method: _Method) -> _Method:
    """A TQClient operation, refused (:class:`~tq.errors.ForkedClientError`) in a process forked from the
    one that opened the client: there it would share that process's sockets (answering its replies),
    its slabs (carving the block its parent carves next: two processes writing one arena range) and
    its leases."""

    @functools.wraps(method)
    def checked(self: "TQClient", *args: Any, **kwargs: Any) -> Any:
        if os.getpid() != self._pid:
            raise ForkedClientError(
                f"this TQClient was opened in process {self._pid}; process {os.getpid()} is a fork of it and cannot use its "
                "sockets, slabs and leases: open a client in this process (TQConnection.connect(), or TQClient(address))"
            )
        return method(self, *args, **kwargs)

    return cast(_Method, checked)


class TQClient:
    """A long-lived, thread-safe connection to a TQ service (controller + storage units).

    A client belongs to the process that opened it: a process forked from that one (a DataLoader
    worker, a ``multiprocessing`` child) opens its own; the inherited one refuses every call there.

    Args:
        address: the controller's address, e.g. ``tcp://127.0.0.1:5555``.
        secret: the service's shared secret (default: ``$TQ_SECRET``).
        timeout: seconds one call may take, all its requests together (a write: plus
            ``capacity_wait_s``; a get: plus its ``wait_timeout``), before
            :class:`~tq.errors.TQConnectionError`.
        transport: ``"auto"`` maps same-host storage arenas; ``"tcp"`` always streams bytes.
        capacity_wait_s: a write that finds its storage unit full waits up to this long for room
            (backpressure) before :class:`~tq.errors.CapacityError`; 0 fails at once. Nothing stored is
            ever evicted to make room.
        lease_s: the term of a borrowed get's lease (``get(..., copy=False)``): this client renews
            it while the views live; if the client dies, the controller ends it after this long.
    """

    def __init__(
        self,
        address: str,
        *,
        secret: str | None = None,
        timeout: float = 30.0,
        transport: Literal["auto", "tcp"] = "auto",
        buffer_pool: HostBufferPool | None = None,
        capacity_wait_s: float = 0.0,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> None:
        self._pid = os.getpid()  # the process this client belongs to (see _in_opening_process)
        if transport not in ("auto", "tcp"):
            raise InvalidRequestError(f"transport must be 'auto' or 'tcp', got {transport!r}")
        secret = optional_text("secret", secret if secret is not None else os.environ.get("TQ_SECRET"))
        self.address, self.timeout, self.transport = (
            address_value(address),
            seconds_value("timeout", timeout, 86400.0, zero=False),
            transport,
        )
        self.capacity_wait_s = seconds_value("capacity_wait_s", capacity_wait_s, 86400.0)
        self.lease_s = seconds_value("lease_s", lease_s, 86400.0, zero=False)
        self._leases = _LeaseKeeper(self)
        self._pins_refused = False  # the controller reads no pins: borrowed gets lease by request
        self._pins_lock = threading.Lock()  # one registration of a pin file at a time
        self._ro_views: dict[int, np.ndarray] = {}  # unit -> its arena mapped read-only (borrowed views)
        self._slabs: dict[int, _Slab] = {}  # unit -> the slab this client's same-host puts carve from
        self._slab_lock = threading.RLock()  # re-entered by the allocation a carve makes
        # unit -> allocations this client is done writing into, told to the unit with its next alloc
        # (or at close): a unit keeps the range of a live writer whose lease ran out until then
        self._released: dict[int, list[int]] = {}
        # unit -> ids of alloc requests whose reply never reached this client (a Ctrl-C, a timeout): told
        # to the unit like ``_released``, which frees what they were granted (nothing of it is in use)
        self._abandoned_allocs: dict[int, list[int]] = {}
        # same-host puts copying now -> (unit, allocation, slab or None, first and number of the block ids
        # to fence if the put is abandoned): registered by the carve under a token the put made before
        # it, so a put cut short anywhere still ends its writing
        self._carvings: dict[object, tuple[int, int, _Slab | None, int, int]] = {}
        # requests that raised with their outcome unknown, fenced before this client's next request to
        # the controller: ids of requests that change a partition (see _fenced_call), (unit, block) of writes' commits
        # (a same-host get that reads the location table asks the controller nothing: it works on
        # while the controller is away, and may see either outcome until then)
        self._unsettled: set[int] = set()
        self._unsettled_blocks: set[tuple[int, int]] = set()
        self._unsettled_lock = threading.Lock()
        self._slab_keeper: threading.Thread | None = None  # gives idle slabs back (see _keep_slabs)
        self._slab_keeper_stop = threading.Event()
        self._secret = secret.encode() if secret else None
        self._pool = buffer_pool or _default_pool
        self._ctrl = RpcChannel(
            address, secret=self._secret, timeout=self.timeout, name="controller", replies=messages.CONTROLLER_REPLY_DECODERS
        )
        self._units: list[messages.UnitInfo] = []
        self._units_lock = threading.Lock()  # see _refresh_units
        self._local_units: frozenset[int] = frozenset()
        self._unit_chans: dict[int, RpcChannel] = {}
        self._arenas: dict[int, Arena] = {}
        self._trim_epochs: dict[int, int] = {}  # each local unit's trim epoch at its last alloc reply
        self._host = host_identity()
        self._ctrl_host: str | None = None
        self._ctrl_shm_dir: str | None = None
        # partition -> (its location table mapped here, its clears count and the schemas located then)
        self._tables: dict[str, tuple[LocationView, int, dict[str, FieldSchema]]] = {}
        self._tables_lock = threading.Lock()
        self._reads: dict[int, int] = {}  # bytes read through the tables, reported with the next request
        self._rr = itertools.count(int.from_bytes(os.urandom(2), "little"))  # spread one-shot writers over units
        try:
            self._refresh_units()
        except BaseException:
            self.close()  # do not leak the sockets of a client that never connected
            raise

    # ------------------------------------------------------------------ connections
    def _refresh_units(self) -> None:
        # One refresh at a time: a put's lanes, each on its own thread, may all find their unit moved,
        # and two refreshes replacing one unit's channel at once would leave one of the new ones unclosed.
        # Waiting for another thread's refresh keeps to this thread's time budget.
        left = time_left()
        if not self._units_lock.acquire(timeout=-1 if left is None else max(left, 0.0)):
            raise TQConnectionError("no time left to learn the storage units' addresses (another thread of this client was asking)")
        try:
            self._refresh_units_now()
        finally:
            self._units_lock.release()

    def _refresh_units_now(self) -> None:
        """The refresh itself (under ``_units_lock``)."""
        # The controller parks hello until the expected units registered; ask it to answer (with the
        # units it has) well before this client's own timeout fires.
        info, _ = self._ctrl.call(Op.HELLO, messages.Hello(timeout=0.8 * self.timeout))
        self._units = info.units
        self._units_version = info.units_version
        self._ctrl_host = info.host
        self._ctrl_shm_dir = info.shm_dir
        # A client of the controller's host talks to it over its Unix socket, others (and a 'tcp' client,
        # one that acts as if it were remote) over its TCP stream socket: ZMQ where neither connects
        here = self.transport == "auto" and info.host == self._host
        self._ctrl.use_stream(info.local_address if here and info.local_address else info.stream_address)
        # Units whose arena this client can map: known once per units version, not per put (a stat each).
        self._local_units = frozenset(
            u.unit_id
            for u in info.units
            if self.transport == "auto" and u.host == self._host and u.arena_path is not None and os.path.exists(u.arena_path)
        )
        connect_units(self._unit_chans, self._units, self._secret, self.timeout)
        for u in info.units:  # a same-host unit's allocations (a put above a quarter slab), others' writes and reads
            here = u.unit_id in self._local_units and u.local_address
            self._unit_chans[u.unit_id].use_stream(u.local_address if here else u.stream_address)

    def _lease_holder(self) -> dict[str, Any]:
        """What tells the controller, when it runs on this host, that this process still runs (it
        keeps a borrowed get's lease while it does: see messages.Locate): its pid and, where it can
        make one, its liveness file in the controller's shared-memory directory (tq.liveness)."""
        if self._ctrl_host != self._host:
            return {}
        return {"holder": os.getpid(), "holder_file": liveness.own_file_or_none(self._ctrl_shm_dir)}

    def _is_local(self, unit: int) -> bool:
        return unit in self._local_units

    def _unit_check(self, unit: int, chan: RpcChannel) -> Any:
        """A liveness check for long waits on ``unit`` over ``chan``, so that a read or write does not
        sit out the whole timeout: raises StorageUnitError once the controller gave the unit up,
        _UnitUnreachable while it reports it silent (the request may have gone down with a dropped
        connection: a get asks again once the unit answers), and _UnitRestarted once it serves at
        another address than ``chan``'s - the channel the call waits on, not the client's current one,
        which another thread's refresh may have replaced already."""

        def check() -> None:
            left = time_left()
            if left is not None and left < UNIT_CHECK_MIN_S:
                # no time to ask: the wait ends on its own timeout, naming the unit that did not answer
                # (asked anyway, the call failed as if the controller had not: "no time left to ask
                # controller" - what a reader cut off from a unit the controller still hears was told)
                return
            try:
                st = self._unit_status(unit)
            except TQConnectionError:  # nor does its controller answer (this host cut off?): the request may be lost too
                raise _UnitUnreachable(unit, "does not answer, nor does its controller") from None
            if st.lost:
                raise _unit_down(unit, st)
            if not st.alive:
                raise _UnitUnreachable(unit, f"at {st.address} is unreachable ({messages.unit_down_reason(st.down_for_s)})")
            if st.address != chan.address:
                raise _UnitRestarted(unit)

        return check

    def _unit_status(self, unit: int, timeout: float = 5.0) -> messages.UnitStatusReply:
        return self._call(Op.UNIT_STATUS, messages.UnitStatus(unit=unit), timeout=min(self.timeout, timeout), resend=True)

    def _await_unit(self, unit: int) -> None:
        """Wait, within what is left of the call's time, until ``unit`` - silent, not given up on by
        its controller - answers again (a network partition healed, a stalled host resumed). Raises
        StorageUnitError once the controller gives it up, once its address refuses connections (its
        host answers and nothing listens: the process is gone, as when a node's processes die - a
        network cut gives no answer), or when the call's time runs out first. Logs a warning when it
        starts waiting and when the unit answers again (a silent wait would look like a hang)."""
        since, warned, why = time.monotonic(), False, "is unreachable"
        while True:
            left = time_left()
            if left is not None and left < UNIT_CHECK_MIN_S:  # no time to ask (the loop's end keeps enough)
                raise StorageUnitError(f"storage unit {unit} {why}: this call's time ran out waiting for it")
            try:
                # asked briefly: one asked into a cut waits out its whole timeout after the heal
                st = self._unit_status(unit, UNIT_AWAIT_STATUS_S)
            except TQConnectionError as exc:  # the controller is cut off too (this host's network?), or no time left
                why = f"is unreachable, and so is its controller ({exc})"
            else:
                if st.lost:
                    raise _unit_down(unit, st)
                if st.alive:
                    if self._unit_chans.get(unit) is None or st.address != self._unit_chans[unit].address:
                        self._refresh_units()  # it came back elsewhere
                    if warned:
                        log.warning(
                            "storage unit %d answers again: a read waited %.1fs for it and asks again", unit, time.monotonic() - since
                        )
                    return
                why = f"at {st.address} is unreachable ({messages.unit_down_reason(st.down_for_s)})"
                left = time_left()
                if refuses_connections(st.address, UNIT_PROBE_S if left is None else min(UNIT_PROBE_S, max(left / 2, 0.01))):
                    raise StorageUnitError(
                        f"storage unit {unit} at {st.address} is down (no answer for {st.down_for_s:.1f}s, and its address refuses connections)"
                    )
            left = time_left()
            if left is not None and left < UNIT_AWAIT_S + UNIT_CHECK_MIN_S:
                raise StorageUnitError(f"storage unit {unit} {why}: this call's time ran out waiting for it")
            if not warned:
                log.warning(
                    "storage unit %d %s: a read of its rows waits up to %s for it",
                    unit,
                    why,
                    "this call's time" if left is None else f"{left:.1f}s",
                )
                warned = True
            time.sleep(UNIT_AWAIT_S)

    def _arena(self, unit: int) -> Arena:
        arena = self._arenas.get(unit)
        if arena is None:
            u = self._units[unit]
            arena = self._arenas[unit] = Arena(u.arena_path, u.arena_size, create=False)
        return arena

    def _pick_unit(self, nbytes: int = 0) -> int:
        """A unit for a write of ``nbytes``: round robin over this host's units (else all units) that
        had room for it at their last report, else the one with the most room."""
        if not self._units:
            self._refresh_units()  # units placed on Ray nodes may register after this client connected
        if not self._units:
            raise TQError("the TQ service has no storage units")
        local = [u.unit_id for u in self._units if self._is_local(u.unit_id)]
        pool = local or [u.unit_id for u in self._units]
        fits = [u for u in pool if self._free_bytes(u) >= nbytes]
        if not fits:
            return max(pool, key=self._free_bytes)
        return fits[next(self._rr) % len(fits)]

    def close(self) -> None:
        """Give up every lease, close every connection and unmap every arena. In a process forked from
        the one that opened the client, nothing: all of that is the opening process's."""
        if getattr(self, "_pid", None) != os.getpid():
            return
        if hasattr(self, "_leases"):
            self._leases.stop()
            self._slab_keeper_stop.set()
            with self._slab_lock:
                self._give_back_slabs(lambda slab: True)
                for unit in {*self._released, *self._abandoned_allocs}:
                    self._send_released(unit)
                self._released.clear()
                self._abandoned_allocs.clear()  # what could not be sent: a unit holds it only while this process lives
            try:  # once this client is gone nothing fences them (best effort, as the slabs above)
                self._settle(GIVE_BACK_S)
            except TQError:
                pass
        self._ctrl.close()
        for chan in self._unit_chans.values():
            chan.close()
        for arena in self._arenas.values():
            arena.close()
        self._arenas.clear()
        for view, _, _ in self._tables.values():
            view.close()
        self._tables.clear()

    def __reduce__(self) -> Any:
        # what Ray does with an actor's or task's arguments: name the fix, not a weakref deep inside
        raise TypeError(
            "a TQClient is one process's connection (sockets, mapped arenas, leases) and does not pickle: pass a "
            "tq.TQConnection (it pickles, secret included) and open a client where it is used with .connect()"
        )

    def __enter__(self) -> "TQClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call(self, op: Op, args: messages.Args, buffers: Sequence[Any] = (), timeout: float | None = None, resend: bool = False) -> Any:
        return self._ask(op, args, buffers, timeout=timeout, resend=resend)[0]

    def _ask(self, op: Op, args: messages.Args, buffers: Sequence[Any] = (), **kw: Any) -> tuple[Any, protocol.ReplyMessage]:
        """A request to the controller (``RpcChannel.call``'s result and reply), once what earlier ones
        left unknown is settled (:meth:`_settle`)."""
        self._settle(kw.get("timeout"))
        return self._ctrl.call(op, args, buffers, **kw)

    def _probe(self, failed: TQConnectionError, ask: Callable[[], Any], unsettle: Callable[[], None], unknown: str) -> Any:
        """After a request that changes state got no reply (``failed``): ``ask`` the controller whether it
        was applied - which fences it if not - and return the answer. With no answer to that either,
        ``unsettle`` records it (under the lock) for :meth:`_settle` and TQConnectionError says ``unknown``."""
        try:
            return ask()
        except TQConnectionError:
            with self._unsettled_lock:
                unsettle()
            raise TQConnectionError(f"{failed}; {unknown}") from None

    def _settle(self, timeout: float | None = None) -> None:
        """Fence the requests that raised with their outcome unknown - destructive ones (see
        :meth:`_fenced_call`) and writes' commits - before anything else is asked: one still on its
        way is then dropped, never applied after this client saw the keys. Raises (TQConnectionError)
        while the controller cannot be told."""
        if not (self._unsettled or self._unsettled_blocks):  # the common case: two attribute tests
            return
        with self._unsettled_lock:
            ids, blocks = list(self._unsettled), list(self._unsettled_blocks)
        if ids:
            self._ctrl.call(Op.ABORT_REQUESTS, messages.AbortRequests(ids=ids), timeout=timeout, resend=True)
        if blocks:  # a commit applied by now is reported so (its keys stay); one not applied never will be
            self._ctrl.call(Op.ABORT_BLOCKS, messages.AbortBlocks(blocks=blocks), timeout=timeout, resend=True)
        with self._unsettled_lock:
            self._unsettled.difference_update(ids)
            self._unsettled_blocks.difference_update(blocks)

    # ------------------------------------------------------------------ partitions and keys
    @_in_opening_process
    def register_partition(self, partition_id: str, *, reuse: bool = False) -> None:
        """Create a partition; with ``reuse=True`` an existing one is cleared and reused (settled as
        :meth:`_fenced_call` says if it raised TQConnectionError)."""
        self._fenced_call(Op.CREATE_PARTITION, messages.CreatePartition(partition=partition_id, reuse=reuse, request_id=new_request_id()))

    @_in_opening_process
    def clear_partition(self, partition_id: str) -> int:
        """Free every key of a partition (the partition stays registered); returns keys cleared. One
        that raised TQConnectionError is settled as :meth:`_fenced_call` says."""
        return self._fenced_call(Op.CLEAR_PARTITION, messages.ClearPartition(partition=partition_id, request_id=new_request_id())).count

    @_in_opening_process
    def drop_partition(self, partition_id: str) -> None:
        """Free every key and unregister the partition (settled as :meth:`_fenced_call` says)."""
        self._fenced_call(Op.DROP_PARTITION, messages.DropPartition(partition=partition_id, request_id=new_request_id()))

    def _fenced_call(self, op: Op, args: Any) -> messages.OnceReply:
        """Send a request that changes a partition (with a ``request_id``) and return its reply
        (:class:`~tq.messages.OnceReply`).

        With no reply in time (a stalled controller, a network cut) the request asks whether it was
        applied, within its timeout: if it was, the reply is returned as the request sent again would
        get it (:meth:`~tq.messages.OnceReply.again`: its count, a mint's slots left out); if not, it
        is fenced and TQConnectionError says nothing was applied. If the controller cannot be asked
        either, TQConnectionError says the outcome is unknown - and this client settles it before
        its next request to the controller: from then on it has been applied for good or never will be (a copy of the
        request that arrives later is dropped, see tq.request_book). Sent again across a network cut
        (``resend``), it is answered as the first time."""
        probe_s = min(ABORT_PROBE_S, 0.25 * self.timeout)
        with time_budget(self.timeout):
            try:
                with time_budget(self.timeout - probe_s):  # keep time to ask, should no reply come
                    return self._call(op, args, resend=True)
            except TQConnectionError as exc:
                failed = exc
            except TQError:
                raise
            except BaseException:  # a Ctrl-C: whether it went out is unknown - settled before the next
                self._unsettled.add(args.request_id)  # request (one set.add, atomic: no lock to take first)
                raise
            applied = self._probe(
                failed,
                lambda: self._ctrl.call(Op.ABORT_REQUESTS, messages.AbortRequests(ids=[args.request_id]), timeout=probe_s)[0].applied,
                lambda: self._unsettled.add(args.request_id),
                f"the outcome of this {op} is unknown: it is settled before this client's next request to the controller "
                "(the controller has applied it all by then, or never will)",
            )
        if applied[0] is None:
            raise TQConnectionError(f"{failed}; this {op} was not applied (and never will be)") from None
        return messages.CONTROLLER_REPLIES[op].again(args, applied[0])

    @_in_opening_process
    def list_partitions(self) -> list[dict[str, Any]]:
        """Each partition's key count, fields (schema, how many keys produced them) and bytes held."""
        return msgspec.to_builtins(self._call(Op.LIST_PARTITIONS, messages.ListPartitions()))

    @_in_opening_process
    def register_keys(self, partition_id: str, keys: Sequence[str]) -> KVBatchMeta:
        """Register ``keys`` with no data yet; ``write_back`` on the returned meta fills their fields.

        Raises :class:`~tq.errors.DuplicateKeyError` naming a key the partition already holds (nothing is
        registered then); one that raised TQConnectionError is settled as :meth:`_fenced_call` says."""
        keys = _names(keys, "keys")
        r = self._fenced_call(Op.MINT, messages.Mint(partition=partition_id, keys=keys, request_id=new_request_id()))
        return KVBatchMeta(partition_id, tuple(keys), slot_table=r.slot_table, slots=r.slots)

    @_in_opening_process
    def mint_keys(self, partition_id: str, uids: Sequence[str], group_size: int) -> KVBatchMeta:
        """Register the ``"{uid}_g{i}"`` keys of ``uids`` with no data yet (:meth:`register_keys`)."""
        return self.register_keys(partition_id, mint_keys(uids, group_size))

    @_in_opening_process
    def get_meta(self, partition_id: str, keys: Sequence[str] | None = None) -> KVBatchMeta:
        """A meta for the given keys (default: every key), with their tags, lengths and common fields."""
        args = messages.GetMeta(partition=partition_id, keys=_names(keys, "keys") if keys is not None else None)
        r = self._call(Op.GET_META, args, resend=True)  # a read: asked again if stuck in a network cut
        return KVBatchMeta(
            partition_id,
            tuple(r.keys),
            tuple(r.fields),
            tuple(r.sequence_lengths) if r.sequence_lengths is not None else None,
            {k: tuple(v) for k, v in r.tags.items()},
            slot_table=r.slot_table,
            slots=r.slots,
        )

    @_in_opening_process
    def set_tags(self, meta: KVBatchMeta) -> None:
        """Store the meta's per-key tags on the controller (so :meth:`get_meta` returns them); one that
        raised TQConnectionError is settled as :meth:`_fenced_call` says."""
        _check_meta(meta, "set_tags")
        if meta.tags:
            tags = {k: list(v) for k, v in meta.tags.items()}
            self._fenced_call(
                Op.SET_TAGS, messages.SetTags(partition=meta.partition_id, keys=list(meta.keys), tags=tags, request_id=new_request_id())
            )

    # ------------------------------------------------------------------ writes
    @_in_opening_process
    def put(
        self,
        partition_id: str,
        keys: Sequence[str],
        columns: Mapping[str, Any],
        *,
        tags: Mapping[str, Sequence[Any]] | None = None,
        sequence_lengths: Sequence[int] | None = None,
    ) -> KVBatchMeta:
        """Store columns for new keys (fresh, or minted and still empty) in one batched write.

        A column is a tensor or numeric numpy array ``[n, ...]`` (fixed per-sample shape; ``[n]`` for
        scalars), a :class:`JaggedTensor` or nested tensor, a list of ``n`` tensors whose leading dim
        varies (token-aligned), or a list (or 1-D numpy array of objects or text, as verl's
        ``non_tensor_batch``) of ``n`` msgpack-able Python values (strings, message logs).
        ``sequence_lengths`` default to the row lengths of the first jagged column.
        """
        keys = _names(keys, "keys")
        encoded = self._encode(keys, columns)
        if sequence_lengths is None:  # ints already
            seq = next((c.lengths.tolist() for c in encoded.values() if c.lengths is not None), None)
        else:  # the meta takes any sequence of ints (numpy's too); a tensor's items are tensors
            seq = sequence_lengths.tolist() if isinstance(sequence_lengths, torch.Tensor) else sequence_lengths
        # the meta checks tags and lengths before anything is stored: one it refused after the commit
        # would report a put as failed whose keys are there
        try:
            meta = KVBatchMeta(partition_id, tuple(keys), tuple(columns), seq, dict(tags or {}))
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"put into {reprlib.repr(partition_id)}: {exc}") from None
        lengths = None if meta.sequence_lengths is None else list(meta.sequence_lengths)
        r = self._store_and_commit(meta.partition_id, keys, encoded, "put", meta.tags or None, lengths)
        return meta.with_slots(r.slot_table, r.slots)

    @_in_opening_process
    def write_back(self, meta: KVBatchMeta, columns: Mapping[str, Any], *, overwrite: bool = False) -> KVBatchMeta:
        """Store new fields for the meta's existing keys; returns the meta with the fields added.

        Writing a field a key already has is a :class:`~tq.errors.SchemaConflictError` unless
        ``overwrite`` (e.g. the driver updating ``sample_mask``); the schema must match either way.
        """
        _check_meta(meta, "write_back")
        keys = list(meta.keys)
        self._store_and_commit(meta.partition_id, keys, self._encode(keys, columns), "write_back", None, None, overwrite)
        return meta.add_fields(tuple(columns))

    def _encode(self, keys: list[str], columns: Mapping[str, Any]) -> dict[str, EncodedColumn]:
        if not keys:
            raise InvalidRequestError("a write needs at least one key")
        if not columns:
            raise InvalidRequestError("a write needs at least one column")
        try:  # a name the commit could not carry is refused before a byte is stored
            check_names(plain_strs(columns), "field")
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        if len(set(keys)) != len(keys):
            seen: set[str] = set()
            dup = next(k for k in keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise DuplicateKeyError(f"key {dup!r} appears more than once in the write")
        return {name: encode_column(name, value, len(keys)) for name, value in columns.items()}

    def _store_and_commit(
        self,
        partition_id: str,
        keys: list[str],
        encoded: dict[str, EncodedColumn],
        mode: str,
        tags: Mapping[str, Sequence[Any]] | None,
        sequence_lengths: list[int] | None,
        overwrite: bool = False,
    ) -> messages.CommitReply:
        """Store the batch (on one unit, or split over several when none has room for all of it),
        then make it visible with one commit - all keys at once. All of it, the commit's abort probe
        included, takes at most ``timeout + capacity_wait_s``."""
        with time_budget(self.timeout + self.capacity_wait_s):
            return self._store_and_commit_within(partition_id, keys, encoded, mode, tags, sequence_lengths, overwrite)

    def _store_and_commit_within(
        self,
        partition_id: str,
        keys: list[str],
        encoded: dict[str, EncodedColumn],
        mode: str,
        tags: Mapping[str, Sequence[Any]] | None,
        sequence_lengths: list[int] | None,
        overwrite: bool,
    ) -> messages.CommitReply:
        parts = self._store_parts(encoded, len(keys))
        try:  # stored: from here the blocks are this put's to settle
            slabs = [p.slab for p in parts if p.slab is not None]
            cbufs: list[Any] = []
            commit = messages.Commit(
                partition=partition_id,
                keys=keys,
                mode=mode,
                blocks=[(p.unit, p.block, p.stop - p.start) for p in parts],
                fields={
                    n: messages.CommitField(
                        schema=c.schema.to_wire(),
                        row_nbytes=protocol.pack_array(np.diff(c.row_offsets), cbufs),
                        arena_offsets=protocol.pack_array(
                            np.concatenate([p.starts[n] + _rebased(c.row_offsets, p.start, p.stop)[:-1] for p in parts]), cbufs
                        ),
                    )
                    for n, c in encoded.items()
                },
                overwrite=overwrite,
                tags={k: list(v) for k, v in tags.items()} if tags else None,
                sequence_lengths=sequence_lengths,
                slabs=slabs if len(slabs) == len(parts) else None,
            )
            probe_s = min(ABORT_PROBE_S, 0.25 * self.timeout)
            try:
                with time_budget((time_left() or 0.0) - probe_s):  # keep time to ask, should no reply come
                    return self._call(Op.COMMIT, commit, cbufs)
            except TQConnectionError as exc:
                # No reply (or no time left to ask): the commit may still be applied (a stalled controller)
                # or may be lost (a restarted one). Ask: the controller fences blocks not committed, so the
                # outcome is settled either way - never a key pointing at storage that is freed or reused.
                blocks = [(p.unit, p.block) for p in parts]
                landed = self._probe(
                    exc,
                    lambda: self._call(Op.ABORT_BLOCKS, messages.AbortBlocks(blocks=blocks), timeout=probe_s).committed,
                    lambda: self._unsettled_blocks.update(blocks),
                    f"the outcome of this {mode} is unknown: its keys are either absent or hold exactly this write's bytes, "
                    "settled before this client's next request to the controller (a commit arriving after that is refused)",
                )
                if all(landed):  # it did land (the meta then carries no slots: its gets ask the controller)
                    return messages.CommitReply(keys=len(keys))
                raise TQConnectionError(f"{exc}; this {mode} did not land (its storage was reclaimed): write it again") from None
        except TQConnectionError:
            raise
        except TQError:  # refused - by the controller, or before the commit went out (a value the wire
            self._abort_parts(parts)  # cannot carry): its blocks are given back now, not at their lease's end
            raise
        except BaseException:  # a Ctrl-C with the blocks stored: whether the commit went out is unknown -
            with self._unsettled_lock:  # settled (fenced, or found committed) before the next request
                self._unsettled_blocks.update((p.unit, p.block) for p in parts)
            raise

    def _store_parts(self, encoded: dict[str, EncodedColumn], n: int) -> list[_StoredPart]:
        """Store all rows on the unit picked for them; if it has no room (and ``capacity_wait_s``
        ran out), on the unit with the most free space, or split in row ranges over units by free
        space. A part stored before a later one failed is given back (fenced by the controller)."""
        need = self._stored_bytes(encoded, 0, n)
        try:
            unit = self._pick_unit(need)
            return [self._put_here(unit, encoded, n, need)] if self._is_local(unit) else self._store_lanes(unit, encoded, n, need)
        except CapacityError as exc:
            if not getattr(exc, "retryable", True) and len(self._units) < 2:
                raise
            plan = self._split_plan(encoded, n, self._units_room())
            if plan is None:
                raise
        parts: list[_StoredPart] = []
        try:
            for unit, start, stop in plan:
                parts.append(self._store(unit, encoded, start, stop))
        except TQError:
            self._abort_parts(parts)
            raise
        return parts

    def _store_lanes(self, unit: int, encoded: dict[str, EncodedColumn], n: int, need: int) -> list[_StoredPart]:
        """All rows (``need`` bytes stored) on ``unit``, a unit of another host: one block, or - a put of
        more than one request's bytes - a block per lane (:func:`_lanes_of`), each sent over its own
        stream on its own thread, as a big get's lanes are read. Every lane is awaited; if one failed,
        those stored are given back and its error raised."""
        # a small put is one lane without cutting it (a 1-key put's numpy would be most of the cut's cost)
        lanes = _lanes_of(self._row_bytes(encoded)) if need > protocol.TCP_FETCH_BYTES else [slice(0, n)]
        if len(lanes) == 1:
            return [self._store(unit, encoded, 0, n)]
        budget = time_left()  # the put's (every put runs in one): a pool thread holds none of its own
        assert budget is not None
        others = [_lane_threads().submit(self._store_lane, unit, encoded, lane, budget) for lane in lanes[1:]]
        outcomes: list[_StoredPart | BaseException] = []
        for lane in [functools.partial(self._store, unit, encoded, lanes[0].start, lanes[0].stop), *(f.result for f in others)]:
            try:
                outcomes.append(lane())
            except BaseException as exc:  # every lane is awaited (and the stored ones given back) first
                outcomes.append(exc)
        parts = [p for p in outcomes if isinstance(p, _StoredPart)]
        failed = next((e for e in outcomes if not isinstance(e, _StoredPart)), None)
        if failed is not None:
            self._abort_parts(parts)
            raise failed
        return parts

    def _store_lane(self, unit: int, encoded: dict[str, EncodedColumn], lane: slice, budget: float) -> _StoredPart:
        """A put's lane on a pool thread: :meth:`_store` of its rows within ``budget`` (seconds left of
        the put's time budget, which is per thread)."""
        with time_budget(budget):
            return self._store(unit, encoded, lane.start, lane.stop)

    def _put_here(self, unit: int, encoded: dict[str, EncodedColumn], n: int, need: int) -> _StoredPart:
        """Write all rows into a block carved out of this client's slab on ``unit`` (a unit of this
        host): no request to the unit, so the put's commit is its only round trip."""
        # the put's token, known before the carve: whatever cuts the put short after it (a Ctrl-C
        # included), the writing ends - and what was carved for a put that never returned is fenced
        writer, written = object(), False
        try:
            aid, base, bid = self._carve(unit, need, writer)
            arena = self._arena(unit)
            if need >= PREFAULT_MIN_BYTES:
                arena.prefault(base, need)
            view, starts, pos, threads = arena.view, {}, base, put_copy_threads()
            for name, col in encoded.items():
                nb = int(col.row_offsets[n] - col.row_offsets[0])
                write_chunks(view[pos : pos + nb], col.chunks, threads)
                starts[name] = pos
                pos = align_up(pos + nb, _FIELD_ALIGN)
            written = True
        finally:
            try:  # in this frame: an interrupt at the call's first line lands here, not past it
                self._done_writing(writer, abandoned=not written)
            except BaseException:  # cut short itself: run again to its end (idempotent) - the put now raises
                self._done_writing(writer, abandoned=True)
                raise
        return _StoredPart(unit, bid, 0, n, starts, (aid, base, need))

    def _done_writing(self, writer: object, *, abandoned: bool) -> None:
        """The put ``writer`` no longer copies into what it carved (if it carved at all): an allocation of
        its own is released to its unit with the next alloc, and so is a slab given back once nothing
        copies into it; the block ids of an ``abandoned`` put are fenced before this client's next
        request (its unit then frees their bytes at once, not after its lease). Done twice, the same as
        once."""
        with self._slab_lock:
            carving = self._carvings.get(writer)
            if carving is not None:
                unit, aid, slab, first, n_ids = carving
                if abandoned and n_ids:
                    with self._unsettled_lock:
                        self._unsettled_blocks.update((unit, b) for b in range(first, first + n_ids))
                if slab is None:
                    self._release_alloc(unit, aid)
                else:
                    slab.writers.discard(writer)
                    self._release_when_idle(unit, slab)
                del self._carvings[writer]

    def _release_alloc(self, unit: int, aid: int) -> None:
        """Tell ``unit`` with the next alloc that this client no longer writes into ``aid``. Under the
        slab lock; once only (the unit ignores an allocation it no longer has, if told again later)."""
        released = self._released.setdefault(unit, [])
        if aid not in released:
            released.append(aid)

    def _release_when_idle(self, unit: int, slab: _Slab) -> None:
        """A slab given back is released to its unit once no put copies into it. Under the slab lock."""
        if slab.retired and not slab.writers:  # (again, after a re-run: the unit ignores a second release)
            self._release_alloc(unit, slab.aid)

    def _carve(self, unit: int, need: int, writer: object) -> tuple[int, int, int]:
        """(allocation id, arena offset, block id) of ``need`` bytes on ``unit`` for the put ``writer``:
        from this client's slab, else from a new one (a request to the unit, once per SLAB_IDS puts or
        SLAB_BYTES), or an allocation of its own for a put above a quarter slab. Each is registered
        under ``writer`` before anything could cut the carve short; the caller tells
        :meth:`_done_writing` when its copy ended (or never began)."""
        with self._slab_lock:
            now = time.monotonic()
            slab = self._slabs.get(unit)
            if slab is not None:
                self._carvings[writer] = (unit, slab.aid, slab, 0, 0)
                got = slab.carve(need, now, writer)
                if got is not None:
                    self._carvings[writer] = (unit, slab.aid, slab, got[1], 1)
                    return slab.aid, got[0], got[1]
                del self._carvings[writer]  # a slab it could not carve from: nothing of it to end
            if need > SLAB_BYTES // 4:
                g = self._alloc(unit, need, ids=1, writer=writer)
                return g.alloc, g.offset, g.first_block  # type: ignore[return-value]
            if slab is not None:
                self._give_back_slabs(lambda s: s is slab)
            try:
                g = self._alloc(unit, SLAB_BYTES, ids=SLAB_IDS, wait=False, writer=writer)
            except CapacityError:  # no room for a whole slab: one just for this put (waiting for room)
                g = self._alloc(unit, need, ids=1, writer=writer)
                return g.alloc, g.offset, g.first_block  # type: ignore[return-value]
            slab = _Slab(g.alloc, g.offset, SLAB_BYTES, g.first_block, SLAB_IDS, now + SLAB_USE_S)  # type: ignore[arg-type]
            self._carvings[writer] = (unit, g.alloc, slab, 0, 0)
            self._slabs[unit] = slab
            start, bid = slab.carve(need, now, writer)  # type: ignore[misc]
            self._carvings[writer] = (unit, g.alloc, slab, bid, 1)
            if self._slab_keeper is None:  # holds the client weakly: a client nobody closes is still collected
                args = (weakref.ref(self), self._slab_keeper_stop)
                self._slab_keeper = threading.Thread(target=_keep_slabs, args=args, name="tq-slab-keeper", daemon=True)
                self._slab_keeper.start()
            return slab.aid, start, bid

    def _give_back_idle_slabs(self) -> None:
        """Give back every slab no put carved from for its use period: its unit gets the room back now
        (it would hold the range for as long as this process lives otherwise: see messages.Alloc)."""
        with self._slab_lock:
            now = time.monotonic()
            for unit in self._give_back_slabs(lambda slab: now > slab.use_until and not slab.writers):
                self._send_released(unit)

    def _give_back_slabs(self, which: Callable[[_Slab], bool]) -> list[int]:
        """Give back (and release, once nothing copies into them) the slabs ``which`` picks; returns
        their units. Under the slab lock."""
        units = []
        for unit, slab in list(self._slabs.items()):
            if which(slab):  # retired and released first: cut short after, it is still let go (idempotent)
                slab.retired = True
                self._release_when_idle(unit, slab)
                del self._slabs[unit]
                self._give_back(unit, slab)
                units.append(unit)
        return units

    def _send_released(self, unit: int) -> None:
        """Tell ``unit`` now which of its allocations this client no longer writes into (best effort:
        kept for the next alloc if the unit does not answer). Under the slab lock."""
        aids, abandoned = list(self._released.get(unit, ())), list(self._abandoned_allocs.get(unit, ()))
        if not aids and not abandoned:
            return
        try:
            self._unit_chans[unit].call(
                UnitOp.RELEASE, messages.Release(allocs=aids, abandoned=abandoned), [], timeout=min(self.timeout, GIVE_BACK_S)
            )
        except (TQError, KeyError):
            return
        self._forget_released(unit, aids, abandoned)

    def _forget_released(self, unit: int, aids: list[int], abandoned: list[int]) -> None:
        """``unit`` was told of ``aids`` and ``abandoned``: they leave their lists only now, so a request
        cut short anywhere (a Ctrl-C) leaves them to be told again (a unit ignores what it no longer
        has). Removed one by one, not replaced: ``_abandoned_allocs`` is appended to without the lock."""
        for table, told in ((self._released, aids), (self._abandoned_allocs, abandoned)):
            kept = table.get(unit, [])
            for x in told:
                if x in kept:
                    kept.remove(x)

    def _give_back(self, unit: int, slab: _Slab) -> None:
        """Have the ids this client never used fenced, so the unit closes the slab and frees what no
        block took now instead of after its lease (best effort: the lease settles it otherwise)."""
        if slab.next_id < slab.end_id:
            try:
                self._call(
                    Op.ABORT_BLOCKS,
                    messages.AbortBlocks(blocks=[(unit, b) for b in range(slab.next_id, slab.end_id)]),
                    timeout=min(self.timeout, GIVE_BACK_S),
                )
            except TQError:
                pass

    def _alloc(self, unit: int, nbytes: int, *, ids: int = 0, wait: bool = True, writer: object = None) -> messages.AllocReply:
        """Reserve ``nbytes`` of ``unit``'s arena (a slab with ``ids`` block ids, when ``ids``), waiting
        for room up to ``capacity_wait_s`` when ``wait``. The request of a same-host writer says when
        it stops waiting for the answer (one host, one clock): a unit that gets to it later grants
        nothing, since a range nobody fills would stay reserved until its lease ends. For the put
        ``writer`` the grant is registered as its own allocation (released when its writing ends, its
        ids fenced if it is abandoned) as soon as the reply is back, with no call in between for a
        Ctrl-C to land at."""
        reply_by, pid, writer_file, released, abandoned, request_id = None, None, None, [], [], None
        lost: list[int] | None = None  # where this request's id goes if its reply never reaches us
        if self._is_local(unit):
            timeout = self.timeout + self.capacity_wait_s
            reply_by = time.time() + min(timeout, time_left() or timeout)
            pid, request_id = os.getpid(), new_request_id()
            writer_file = liveness.own_file_or_none(os.path.dirname(self._units[unit].arena_path))
            with self._slab_lock:
                released = list(self._released.get(unit, ()))
                lost = self._abandoned_allocs.setdefault(unit, [])
                abandoned = list(lost)
        wait_s = self._room_wait_s() if wait else 0.0
        args = messages.Alloc(
            nbytes=nbytes,
            wait_s=wait_s,
            ids=ids,
            reply_by=reply_by,
            writer=pid,
            writer_file=writer_file,
            released=released,
            request_id=request_id,
            abandoned=abandoned,
        )
        try:
            reply = self._unit_call(unit, UnitOp.ALLOC, args, [])
        except BaseException:  # its reply never reached us, or came too late: what it was granted, if anything,
            if lost is not None:  # is in no one's use - freed at the next word (one append: nothing to cut short)
                lost.append(request_id)  # type: ignore[arg-type]
            raise
        if writer is not None:
            self._carvings[writer] = (unit, reply.alloc, None, reply.first_block, ids)  # type: ignore[assignment]
        if released or abandoned:
            with self._slab_lock:
                self._forget_released(unit, released, abandoned)
        if self._is_local(unit) and self._trim_epochs.get(unit) != reply.trim_epoch:  # it gave pages back (or restarted)
            self._trim_epochs[unit] = reply.trim_epoch
            self._arena(unit).forget_populated()
        return reply

    def _room_wait_s(self) -> float:
        """How long a write waits at its unit for room: ``capacity_wait_s``, and at least FREE_GRACE_S -
        the unit hears of a discard's frees from the controller, which may reach it just after the
        write of a client that was told the discard is done."""
        return max(self.capacity_wait_s, FREE_GRACE_S)

    def _unit_call(self, unit: int, op: UnitOp, args: messages.Args, buffers: list[Any]) -> Any:
        """A write request to ``unit`` (waiting for room up to ``capacity_wait_s``), asked again at the
        unit's new address if it restarted while this one was pending."""
        try:
            return self._unit_call_once(unit, op, args, buffers)
        except _UnitUnreachable as exc:  # a write is not sent again: the caller may put elsewhere
            raise StorageUnitError(str(exc)) from None

    def _unit_call_once(self, unit: int, op: UnitOp, args: messages.Args, buffers: list[Any]) -> Any:
        timeout = self.timeout + self.capacity_wait_s
        chan = self._unit_chans[unit]
        try:
            return chan.call(op, args, buffers, timeout=timeout, check=self._unit_check(unit, chan))[0]
        except (_UnitRestarted, TQConnectionError) as exc:
            # a connection error is a restart too when another thread's refresh (a put's other lane)
            # replaced the channel this call waited on - and closed it under the call
            if not isinstance(exc, _UnitRestarted) and self._unit_chans.get(unit) is chan:
                raise
            self._refresh_units()
            chan = self._unit_chans[unit]
            try:
                return chan.call(op, args, buffers, timeout=timeout, check=self._unit_check(unit, chan))[0]
            except _UnitRestarted:  # once more within one call: a unit that keeps restarting is down
                raise StorageUnitError(f"storage unit {unit} restarted again while '{op}' waited on it") from None

    def _abort_parts(self, parts: list[_StoredPart]) -> None:
        if parts:
            try:
                self._call(Op.ABORT_BLOCKS, messages.AbortBlocks(blocks=[(p.unit, p.block) for p in parts]))
            except TQError:  # unanswered: the units ask the controller once the blocks' lease runs out
                pass

    @staticmethod
    def _row_bytes(encoded: dict[str, EncodedColumn]) -> np.ndarray:
        """Each row's payload bytes over every column (alignment left out)."""
        return sum(np.diff(c.row_offsets) for c in encoded.values())  # type: ignore[return-value]

    @staticmethod
    def _stored_bytes(encoded: dict[str, EncodedColumn], start: int, stop: int) -> int:
        """Arena bytes rows ``[start, stop)`` take (fields aligned as :meth:`_store` lays them out)."""
        pos = 0
        for col in encoded.values():
            pos = align_up(pos + int(col.row_offsets[stop] - col.row_offsets[start]), _FIELD_ALIGN)
        return align_up(max(pos, 1), ALIGN)

    def _free_bytes(self, unit: int) -> int:
        """The largest write ``unit`` had room for at its last heartbeat (its arena size before one)."""
        u = self._units[unit]
        return u.free_bytes if u.free_bytes is not None else u.arena_size

    def _units_room(self) -> dict[int, int]:
        """The largest write each answering unit has room for now."""
        self._refresh_units()
        return {u: st.largest_free_bytes for u, st in unit_stats(self._unit_chans, [u.unit_id for u in self._units], self.timeout).items()}

    def _split_plan(self, encoded: dict[str, EncodedColumn], n: int, room: dict[int, int]) -> list[tuple[int, int, int]] | None:
        """Row ranges ``(unit, start, stop)`` that fit the units' ``room``, the units with most room
        first (same-host ones before others at equal room); None if they cannot hold the rows."""
        units = sorted(room, key=lambda u: (-room[u], not self._is_local(u)))
        cum = np.concatenate([[0], np.cumsum(self._row_bytes(encoded))])
        plan, start = [], 0
        for unit in units:
            if start == n:
                break
            stop = min(int(np.searchsorted(cum, cum[start] + room[unit], side="right")) - 1, n)  # payload bound
            while stop > start and self._stored_bytes(encoded, start, stop) > room[unit]:  # then alignment
                stop -= 1
            if stop > start:
                plan.append((unit, start, stop))
                start = stop
        return plan if start == n else None

    def _store(self, unit: int, encoded: dict[str, EncodedColumn], start: int, stop: int) -> _StoredPart:
        """Store rows ``[start, stop)`` of every column as one block of ``unit`` (tentative until the
        controller commits it): written straight into its arena on this host, else sent as frames.
        A unit that restarted meanwhile (it keeps its journaled allocations) is asked again, once."""
        buffers: list[Any] = []
        fields: dict[str, messages.StoreField] = {}
        cols = {
            name: (
                col,
                _rebased(col.row_offsets, start, stop),
                _byte_range(col.chunks, int(col.row_offsets[start]), int(col.row_offsets[stop])),
            )
            for name, col in encoded.items()
        }
        if self._is_local(unit):
            offsets, pos = {}, 0
            for name, (_, ro, _) in cols.items():
                offsets[name] = pos
                pos = align_up(pos + int(ro[-1]), _FIELD_ALIGN)
            alloc = self._alloc(unit, pos)
            try:
                view, base, threads = self._arena(unit).view, alloc.offset, put_copy_threads()
                for name, (col, ro, chunks) in cols.items():
                    write_chunks(view[base + offsets[name] : base + offsets[name] + int(ro[-1])], chunks, threads)
                    fields[name] = messages.StoreField(
                        schema=col.schema.to_wire(), offset=offsets[name], row_offsets=protocol.pack_array(ro, buffers)
                    )
                args = messages.Store(n_rows=stop - start, fields=fields, alloc=alloc.alloc)
                return self._stored(unit, self._unit_call(unit, UnitOp.STORE, args, buffers), start, stop)
            except BaseException:
                with self._slab_lock:  # abandoned: the unit may free it now
                    self._release_alloc(unit, alloc.alloc)
                raise
        else:
            for name, (col, ro, chunks) in cols.items():
                fields[name] = messages.StoreField(
                    schema=col.schema.to_wire(),
                    row_offsets=protocol.pack_array(ro, buffers),
                    data=[protocol.pack_array(c, buffers) for c in _frames_of(chunks)],
                )
            args = messages.Store(n_rows=stop - start, fields=fields, wait_s=self._room_wait_s())
        return self._stored(unit, self._unit_call(unit, UnitOp.STORE, args, buffers), start, stop)

    @staticmethod
    def _stored(unit: int, stored: messages.StoreReply, start: int, stop: int) -> _StoredPart:
        return _StoredPart(unit, stored.block, start, stop, stored.starts)

    # ------------------------------------------------------------------ reads
    @_in_opening_process
    def wait(self, meta: KVBatchMeta, fields: Sequence[str] | None = None, timeout: float = 60.0) -> None:
        """Block until every key of ``meta`` has ``fields`` (default: ``meta.fields``) or time out."""
        _check_meta(meta, "wait")
        timeout = seconds_value("timeout", timeout, messages.MAX_SECONDS)
        fields = _names(fields if fields is not None else meta.fields, "fields")
        self._call(
            Op.WAIT,
            messages.Wait(partition=meta.partition_id, keys=list(meta.keys), fields=fields, timeout=timeout),
            timeout=timeout + self.timeout,
            resend=True,  # it only waits: asked again if stuck in a network cut
        )

    def _with_reads(self, args: ReadsArgsT) -> ReadsArgsT:
        """Add the bytes read through location tables since the last report (the controller counts
        reads at ``locate``; these reads never asked it)."""
        if self._reads:
            with self._tables_lock:
                reads, self._reads = self._reads, {}
            args.reads = {str(u): b for u, b in reads.items()}
        return args

    def _remember_table(self, partition_id: str, desc: messages.TableRef | None, schemas: dict[str, FieldSchema]) -> None:
        """Map the partition's location table named in a locate reply (same host only)."""
        if not (desc is not None and LOCAL_TABLES_SUPPORTED and self.transport == "auto" and self._ctrl_host == self._host):
            return
        path, clears, columns = desc.path, desc.clears, desc.columns
        with self._tables_lock:
            entry = self._tables.get(partition_id)
            if entry is not None and entry[0].path == path and entry[1] == clears:
                entry[0].add_columns(columns)
                entry[2].update(schemas)
                return
            try:
                view = LocationView(path, columns)
            except (OSError, ValueError):  # gone already (replaced meanwhile): the next locate names the new one
                return
            # The old view is dropped, not closed: another thread may be reading it.
            self._tables[partition_id] = (view, clears, dict(schemas))

    def _follow_table(self, partition_id: str, entry: tuple[LocationView, int, dict[str, FieldSchema]]) -> LocationView | None:
        """The table that replaced the partition's grown one (same slots, clears and schemas), now
        mapped in its place; None when it was retired otherwise: the controller is asked."""
        successor = entry[0].successor()
        if successor is None:
            return None
        with self._tables_lock:  # another thread may have followed (or relearnt) it meanwhile
            if self._tables.get(partition_id) is entry:
                self._tables[partition_id] = (successor, entry[1], entry[2])  # the old view is dropped, not closed
        return successor

    def _read_table(
        self, meta: KVBatchMeta, fields: list[str], layout: Layout, views: bool = False
    ) -> tuple[LocatedRows, LocationView, dict[str, FieldSchema], int] | None:
        """The rows located in the partition's shared location table, with no round trip: only for a
        meta with slots, every row on one unit of this host, and a table that can be trusted right
        now. Jagged fields not asked ``"padded"`` get their offsets made in the same read; ``views``:
        see :meth:`LocationView.read`."""
        entry = self._tables.get(meta.partition_id) if meta.slots is not None and meta.keys else None
        if entry is None:
            return None
        view, clears, schemas = entry
        if any(f not in schemas for f in fields):
            return None
        row_bytes = None
        if layout != "padded":
            row_bytes = [lay.row_bytes if (lay := field_layout(schemas[f])).kind == JAGGED else 0 for f in fields]
        fps = _key_fingerprints_of(meta)
        if fps is None:
            return None
        rows = view.read(fields, meta.slots, fps, meta.slot_table, clears, self._units_version, row_bytes, views)  # type: ignore[arg-type]
        if rows is None and (view := self._follow_table(meta.partition_id, entry)) is not None:  # grown
            rows = view.read(fields, meta.slots, fps, meta.slot_table, clears, self._units_version, row_bytes, views)  # type: ignore[arg-type]
        # a unit whose arena this client mapped is local (no file-system check on the hot path); rows
        # past its end are left to the controller's path, which names them
        arena = self._arenas.get(rows.unit) if rows is not None else None
        if arena is None or rows.end > arena.view.size:  # type: ignore[union-attr]
            return None
        return rows, view, schemas, clears  # type: ignore[return-value]

    def _count_read(self, rows: LocatedRows) -> None:
        """Bytes read through a location table, reported with the next request (the controller
        counts reads at ``locate``, which these reads never asked)."""
        with self._tables_lock:
            self._reads[rows.unit] = self._reads.get(rows.unit, 0) + sum(rows.totals)

    def _locate_here(self, meta: KVBatchMeta, fields: list[str], layout: Layout) -> tuple[dict[str, _Fetched], Callable[[], bool]] | None:
        """Rows located by :meth:`_read_table`, read where they lie in the arena; also returns the
        check to run after copying (no bytes were freed meanwhile)."""
        here = self._read_table(meta, fields, layout)
        if here is None:
            return None
        rows, view, schemas, _ = here
        self._count_read(rows)
        arena = self._arenas[rows.unit]
        schemas_of = [schemas[f] for f in fields]
        fetched = _in_arena(arena.view, schemas_of, fields, rows.offsets, rows.sizes, rows.longest, rows.totals, rows.row_offsets)
        return fetched, lambda: view.unchanged(rows.frees)

    def _on_unit_here(
        self, unit: int, loc: np.ndarray, schemas: list[FieldSchema], fields: list[str], meta: KVBatchMeta
    ) -> dict[str, _Fetched]:
        """Every row on ``unit``, a unit of this host: rows are read where they lie in its arena."""
        n = len(meta.keys)
        starts, sizes = np.ascontiguousarray(loc[:, :, OFFSET]), np.ascontiguousarray(loc[:, :, NBYTES])
        view = self._arena_view(unit, starts.ravel(), sizes.ravel(), lambda i: (fields[i // n], meta.keys[i % n]))
        return _in_arena(view, schemas, fields, starts, sizes)

    def _fetch(
        self, meta: KVBatchMeta, fields: list[str], wait_timeout: float | None, shm: bool = True
    ) -> tuple[dict[str, _Fetched], Callable[[], bool] | None]:
        """Locate the rows (one controller round trip, parked there up to ``wait_timeout`` until they
        are produced). Rows on a unit of this host are then read straight out of its mapped arena at
        the offsets located (unless not ``shm``); the others are fetched as frames from their units,
        every unit asked before any reply is awaited. Also returns, when rows are read out of an
        arena, the check to run after copying them: no bytes of the partition were freed meanwhile
        (a unit serves a fetch between frees, so frames need no check)."""
        args = messages.Locate(partition=meta.partition_id, keys=list(meta.keys), fields=fields, timeout=wait_timeout)
        # a read, asked again if stuck in a network cut (no lease: asked twice, it takes nothing twice;
        # its bytes may be counted twice in the read metrics)
        located, lmsg = self._ask(Op.LOCATE, self._with_reads(args), timeout=self.timeout + (wait_timeout or 0.0), resend=True)
        if located.units_version != self._units_version:
            self._refresh_units()
        n = len(meta.keys)
        loc = protocol.unpack_array(located.loc, lmsg.buffers, name="loc", dtype="<i8")
        if loc.shape != (len(fields), n, LOC_COLUMNS):
            raise MalformedMessageError(f"locate reply has shape {loc.shape}, expected {(len(fields), n, LOC_COLUMNS)}")
        schemas = [FieldSchema.from_wire(located.schemas[f]) for f in fields]
        self._remember_table(meta.partition_id, located.table, dict(zip(fields, schemas)))
        entry, frees = self._tables.get(meta.partition_id), located.frees
        check = (lambda: entry[0].unchanged(frees)) if entry is not None and frees is not None else None
        is_local = self._is_local if shm else (lambda unit: False)
        for unit in located.unreachable or ():
            if not is_local(unit):  # rows it would send (those of this host are read out of its arena)
                raise _UnitUnreachable(unit, "is unreachable (its controller has not heard from it lately)")
        units = loc[:, :, UNIT]
        first = int(units.flat[0]) if units.size else 0
        if units.size and (units == first).all() and is_local(first):
            return self._on_unit_here(first, loc, schemas, fields, meta), check  # the common case
        out = {name: _Fetched.empty(schemas[f], n) for f, name in enumerate(fields)}
        pending, read_here = [], False
        for unit in np.unique(units).tolist():
            where = np.argwhere(units == unit)  # [field index, key index], grouped by field
            rec = loc[where[:, 0], where[:, 1]]
            if is_local(unit):
                read_here = True
                view = self._arena_view(unit, rec[:, OFFSET], rec[:, NBYTES], lambda i: (fields[where[i, 0]], meta.keys[where[i, 1]]))  # noqa: B023
                _place(out, fields, where, [view], np.zeros(where.shape[0], np.int64), rec[:, OFFSET], rec[:, NBYTES])
                continue
            entries = np.stack([where[:, 0], rec[:, BLOCK], rec[:, ROW]], axis=1)
            first, *others = [[(where[p], entries[p]) for p in lane] for lane in _fetch_lanes_of(rec[:, NBYTES])]
            budget = time_left()  # the get's (every get runs in one): a pool thread holds none of its own
            assert budget is not None
            pending += [(unit, _lane_threads().submit(self._read_lane, unit, fields, lane, budget).result) for lane in others]
            pending.append((unit, self._send_lane(unit, fields, first)))
        # every lane's replies before any is placed: a lane still running when another failed writes
        # into nothing of this get's (it receives into its own messages, and ends by its timeout)
        received = [(unit, *got) for unit, receive in pending for got in receive()]
        for unit, where, reply, msg in received:  # frames of whole rows, back to back
            m = where.shape[0]
            sizes = protocol.unpack_array(reply.sizes, msg.buffers, name="sizes", dtype="<i8")
            frame_rows = protocol.unpack_array(reply.frame_rows, msg.buffers, name="frame_rows", dtype="<i8")
            if sizes.shape != (m,) or frame_rows.sum() != m or len(reply.frames) != frame_rows.size:
                raise MalformedMessageError(f"fetch reply from unit {unit} does not frame the {m} rows asked for")
            src = np.repeat(np.arange(frame_rows.size), frame_rows)
            rel = np.cumsum(sizes) - sizes
            starts = rel - rel[np.cumsum(frame_rows) - frame_rows][src] if m else rel
            sources = [protocol.unpack_array(r, msg.buffers, dtype="|u1") for r in reply.frames]
            _place(out, fields, where, sources, src, starts, sizes)
        return out, check if read_here else None

    def _send_lane(
        self, unit: int, fields: list[str], parts: list[tuple[np.ndarray, np.ndarray]]
    ) -> Callable[[], list[tuple[np.ndarray, Any, protocol.ReplyMessage]]]:
        """Ask ``unit`` for ``parts`` ((where, [field index, block, row] entries) each) over this thread's
        stream, every request before any reply is awaited (pipelined: the unit gathers one while the last
        streams); returns the call that receives their ``(where, reply, message)`` on this thread."""
        chan = self._unit_chans[unit]
        check = self._unit_check(unit, chan)
        sent = []
        for where, entries in parts:
            bufs: list[Any] = []
            ref = protocol.pack_array(entries, bufs)
            sent.append((where, chan.send(UnitOp.FETCH, messages.Fetch(fields=fields, entries=ref), bufs, check=check)))
        return lambda: [(where, *chan.recv(rid, "fetch", check=check)) for where, rid in sent]

    def _read_lane(
        self, unit: int, fields: list[str], parts: list[tuple[np.ndarray, np.ndarray]], budget: float
    ) -> list[tuple[np.ndarray, Any, protocol.ReplyMessage]]:
        """A lane on a pool thread: :meth:`_send_lane` and its replies, within ``budget`` (seconds left
        of the get's time budget, which is per thread)."""
        with time_budget(budget):
            return self._send_lane(unit, fields, parts)()

    def _arena_view(self, unit: int, offsets: np.ndarray, nbytes: np.ndarray, row: Callable[[int], tuple[str, str]]) -> np.ndarray:
        """The mapped arena of ``unit``, once every located row ``[offsets[i], offsets[i] + nbytes[i])``
        is checked to lie in it: the offsets come from another process, and a bad one must fail naming
        its (field, key) = ``row(i)``, never read outside the mapping."""
        view = self._arena(unit).view
        if offsets.size and (offsets.min() < 0 or nbytes.min() < 0 or (offsets + nbytes).max() > view.size):
            i = int(np.flatnonzero((offsets < 0) | (nbytes < 0) | (offsets + nbytes > view.size))[0])
            field, key = row(i)
            raise MalformedMessageError(
                f"field {field!r} of key {key!r} is located outside storage unit {unit}'s arena "
                f"(offset {offsets[i]}, {nbytes[i]} bytes; arena {view.size} bytes)"
            )
        return view

    @_in_opening_process
    def get(
        self,
        meta: KVBatchMeta,
        fields: Sequence[str] | None = None,
        *,
        layout: Layout = "padded",
        pad_to: int | None = None,
        pad_value: float | int | bool | Mapping[str, float | int | bool] = 0,
        wait_timeout: float | None = None,
        copy: bool = True,
        pin_memory: bool = False,
    ) -> dict[str, Any]:
        """Fetch ``fields`` (default: ``meta.fields``) for the meta's keys, in key order.

        Fixed-shape fields come back as ``[n, ...]`` tensors and object fields as lists. Jagged fields
        come back as ``layout`` asks: ``"padded"`` - a dense ``[n, L, ...]`` tensor with ``L = pad_to``,
        else ``meta.extra_info["global_forward_pad_seqlen"]``, else the longest row, rounded up to
        ``extra_info["pad_to_multiple"]`` when set, filled with ``pad_value`` (a scalar or a per-field
        map); ``"jagged"`` - a :class:`JaggedTensor`; ``"list"`` - one tensor per sample.
        ``wait_timeout`` first waits up to that long for the fields to be produced (parked on the
        controller within the same round trip; :class:`~tq.errors.TQTimeoutError` if they are not).

        ``copy=False`` borrows instead of copying where the layout allows: a field whose rows lie back
        to back in one arena of this host (as a put stored them, read in the same key order) comes
        back as read-only tensors viewing the arena - fixed-shape fields, ``"jagged"`` values (the
        offsets are computed), ``"list"`` rows, and ``"padded"`` rows that need no padding - pinned
        by a lease (see :class:`BorrowedBatch`, which is returned); other fields are copied.

        ``pin_memory=True`` copies into page-locked host memory from torch's pinned-memory allocator
        (as ``Tensor.pin_memory()`` makes), for a rank that moves the batch to its GPU: a copy to the
        device then runs at the bus's speed and may be ``non_blocking``. Needs CUDA; not with
        ``copy=False`` (the arena is not page-locked).

        Rows on a storage unit its controller has not heard from for a few seconds are waited for,
        within this call's time, and read once it answers again (a network partition heals, a
        stalled host resumes); a unit given up on - its process ended, or silent for the
        controller's ``unit_lost_s`` (30 s) - fails the get at once with StorageUnitError.
        """
        _check_meta(meta, "get")
        if layout not in ("padded", "jagged", "list"):
            raise InvalidRequestError(f"layout must be 'padded', 'jagged' or 'list', got {layout!r}")
        fields = _names(fields if fields is not None else meta.fields, "fields")
        if not fields:
            raise InvalidRequestError("get needs at least one field (the meta names none)")
        if pad_to is not None and not is_pad_length(pad_to):
            raise InvalidRequestError(f"pad_to must be None or a whole number in [0, {MAX_PAD_LENGTH}], got {pad_to!r}")
        if isinstance(pad_value, abc.Mapping):
            pad_value = {name: pad_number(v, f"pad_value[{name!r}]") for name, v in pad_value.items()}
        else:
            pad_value = pad_number(pad_value, "pad_value")
        if wait_timeout is not None:
            wait_timeout = seconds_value("wait_timeout", wait_timeout, messages.MAX_SECONDS)
        if pin_memory:
            _check_pin_memory(copy)
        with time_budget(self.timeout + (wait_timeout or 0.0)):  # every request of the get, in all
            while True:
                try:
                    if not copy:
                        return self._get_borrowed(meta, fields, layout, pad_to, pad_value, wait_timeout)
                    return self._get_within(meta, fields, layout, pad_to, pad_value, wait_timeout, pin_memory)
                except _UnitUnreachable as silent:  # a network cut heals: read again once the unit answers
                    unit = silent.unit
                self._await_unit(unit)  # out of the handler: an error it raises is not chained to ours

    def _read_only(self, unit: int) -> np.ndarray:
        """``unit``'s arena mapped read-only: a write through a borrowed view faults instead of
        changing stored bytes."""
        view = self._ro_views.get(unit)
        if view is None:
            u = self._units[unit]
            view = self._ro_views[unit] = map_read_only(u.arena_path, u.arena_size)
        return view

    def _get_borrowed(
        self, meta: KVBatchMeta, fields: list[str], layout: Layout, pad_to: int | None, pad_value: Any, wait_timeout: float | None
    ) -> BorrowedBatch:
        """Views of the fields that lie back to back in one arena of this host, pinned by one lease; a
        copying get of the rest. The rows are located in the shared location table where it can be
        trusted (the lease then costs one small request, whatever the number of keys), else by a
        locate that also takes the lease."""
        if not meta.keys or self.transport != "auto":
            return BorrowedBatch(self._get_within(meta, fields, layout, pad_to, pad_value, wait_timeout), frozenset(), None)
        values: dict[str, Any] = {}
        arrays: list[np.ndarray] = []
        lease: int | None = None
        pin: tuple[PinFile, int] | None = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch warns of the read-only arrays it is handed
                lease, pin = self._borrow_here(meta, fields, layout, pad_to, values, arrays)
                if lease is None:
                    values.clear()
                    arrays.clear()
                    lease = self._borrow_located(meta, fields, layout, pad_to, wait_timeout, values, arrays)
            release = self._leases.hold(lease, arrays, pin)
        except BaseException:  # a Ctrl-C between taking the lease and handing it to the keeper: a pin of this
            if lease is not None:  # live process would hold its rows for as long as it runs
                self._leases.give_up(lease, pin)
            raise
        if not arrays:
            release()
        rest = [f for f in fields if f not in values]
        if rest:
            values.update(self._get_within(meta, rest, layout, pad_to, pad_value, None))
        return BorrowedBatch({f: values[f] for f in fields}, frozenset(fields) - frozenset(rest), release if arrays else None)

    def _borrow_here(
        self, meta: KVBatchMeta, fields: list[str], layout: Layout, pad_to: int | None, values: dict[str, Any], arrays: list[np.ndarray]
    ) -> tuple[int | None, tuple[PinFile, int] | None]:
        """Locate the rows in the partition's shared location table and lease their blocks: with a pin
        in this client's pin file where it can (no request: see tq.pins), else with a ``borrow``
        request carrying the table's incarnation and ``frees`` count of the read: the controller grants
        it only if that table freed nothing since, so the rows read are the ones pinned (the views are
        built while it is answered). Returns (lease, its pin file and slot or None), or (None, None) - nothing kept,
        nothing counted - to locate instead."""
        here = self._read_table(meta, fields, layout, views=layout != "padded")  # padded views check every size
        if here is None:
            return None, None
        rows, view, schemas, clears = here
        blocks = sorted(set(rows.blocks.tolist()))
        pins = self._pin_file(view)
        pinned = args = None
        pin_lease = new_lease_id()  # known before the pin: one cut short as it returned is given up by it
        try:  # from the pin (or the request) on: whatever raises - a Ctrl-C too - gives the lease up
            if pins is not None:
                deadline = time.monotonic_ns() + int(self.lease_s * 1e9)
                pinned = pins.pin(deadline, rows.unit, blocks, view.mapping, rows.frees, meta.slot_table, clears, pin_lease)  # type: ignore[arg-type]
            if pinned is None:
                args = messages.Borrow(
                    partition=meta.partition_id,
                    unit=rows.unit,
                    blocks=blocks,
                    incarnation=meta.slot_table,  # type: ignore[arg-type] - the reader checked it against the table
                    frees=rows.frees,
                    units_version=self._units_version,
                    lease_s=self.lease_s,
                    lease_id=new_lease_id(),
                    **self._lease_holder(),
                )
                self._settle()  # (sent and received apart: not through _ask)
                rid = self._ctrl.send(Op.BORROW, self._with_reads(args))
            # the reader checked every row lies in the arena; views need each field's rows back to back
            arena = self._read_only(rows.unit)
            for f, name in enumerate(fields):
                if rows.adjacent[f]:
                    got = self._view_field(
                        schemas[name],
                        arena,
                        int(rows.offsets[f, 0]),
                        rows.sizes[f],
                        rows.totals[f],
                        meta,
                        layout,
                        pad_to,
                        arrays,
                        None if rows.row_offsets is None else rows.row_offsets[f],
                    )
                    if got is not None:
                        values[name] = got
            if pinned is None:
                granted = self._ctrl.recv(rid, Op.BORROW)[0].lease
            lease, pin = (pinned[0], (pins, pinned[1])) if pinned is not None else (granted, None)
            if lease is not None:  # a refused borrow's rows are read again by the locate, which counts them
                self._count_read(rows)  # a call, where a Ctrl-C lands: inside the try (it lost the pin outside)
        except BaseException:
            if pins is not None:
                pins.unpin(pin_lease)
            if args is not None:  # the lease asked for may be granted all the same: give it up later
                self._leases.abandon(args.lease_id)  # type: ignore[arg-type]
            raise
        return lease, pin

    def _pin_file(self, view: LocationView) -> PinFile | None:
        """This client's pin file, made and registered with the controller at the first borrowed get
        (in the directory of its location tables), and again when the controller stopped reading it
        (revoked) or the table read carries another pin board's epoch than the file was registered
        with (a controller started anew, which never heard of it); None where the controller reads no
        pins."""
        pins = self._leases.pins
        epoch = int(view.header[H_PIN_EPOCH])
        if self._pins_refused or (pins is not None and pins.epoch == epoch and not pins.revoked):
            return pins
        with self._pins_lock:
            pins = self._leases.pins
            if pins is not None and (pins.epoch != epoch or pins.revoked):
                self._leases.retire(pins)  # its pins still held stay valid where they were taken
                pins = None
            if pins is None and not self._pins_refused:
                try:
                    pins = PinFile(os.path.dirname(os.path.realpath(view.path))) if PINS_SUPPORTED and epoch else None
                except CapacityError:  # a full tmpfs: lease by request this time, try again later
                    return None
                try:
                    reply = self._call(Op.PIN_FILE, messages.PinFile(path=pins.path)) if pins is not None else None
                except TQError:  # e.g. a controller without pins: lease by request
                    reply = None
                if reply is not None and reply.registered and reply.epoch == epoch:
                    pins.epoch = epoch  # type: ignore[union-attr]
                    self._leases.pins = pins
                else:
                    self._pins_refused = reply is None or not reply.registered
                    if pins is not None:
                        pins.close()
                    pins = None
        return pins

    def _borrow_located(
        self,
        meta: KVBatchMeta,
        fields: list[str],
        layout: Layout,
        pad_to: int | None,
        wait_timeout: float | None,
        values: dict[str, Any],
        arrays: list[np.ndarray],
    ) -> int:
        """One locate that also leases the rows, then the views; returns the lease."""
        args = messages.Locate(
            partition=meta.partition_id,
            keys=list(meta.keys),
            fields=fields,
            timeout=wait_timeout,
            lease_s=self.lease_s,
            lease_id=new_lease_id(),
            **self._lease_holder(),
        )
        try:  # from the request on: no reply, a bad one, a Ctrl-C - the lease may be granted all the same: give it up
            located, lmsg = self._ask(Op.LOCATE, self._with_reads(args), timeout=self.timeout + (wait_timeout or 0.0))
            if located.units_version != self._units_version:
                self._refresh_units()
            lease = located.lease
            n = len(meta.keys)
            loc = protocol.unpack_array(located.loc, lmsg.buffers, name="loc", dtype="<i8")
            if loc.shape != (len(fields), n, LOC_COLUMNS) or lease is None:
                raise MalformedMessageError(f"borrowing locate reply has shape {loc.shape} and lease {lease!r}")
            schemas = {f: FieldSchema.from_wire(located.schemas[f]) for f in fields}
            self._remember_table(meta.partition_id, located.table, schemas)
            for f, name in enumerate(fields):
                unit, starts, sizes = int(loc[f, 0, UNIT]), loc[f, :, OFFSET], loc[f, :, NBYTES]
                if (loc[f, :, UNIT] != unit).any() or not self._is_local(unit) or (starts[1:] != starts[:-1] + sizes[:-1]).any():
                    continue  # not all in one arena of this host, back to back in key order
                self._arena_view(unit, starts, sizes, lambda i: (name, meta.keys[i]))  # noqa: B023 - bounds, naming a bad row
                got = self._view_field(
                    schemas[name], self._read_only(unit), int(starts[0]), sizes, int(sizes.sum()), meta, layout, pad_to, arrays
                )
                if got is not None:
                    values[name] = got
            return lease
        except BaseException:
            self._leases.abandon(args.lease_id)  # type: ignore[arg-type]
            raise

    def _view_field(
        self,
        schema: FieldSchema,
        arena: np.ndarray,
        start: int,
        sizes: np.ndarray,
        total: int,
        meta: KVBatchMeta,
        layout: Layout,
        pad_to: int | None,
        arrays: list[np.ndarray],
        row_offsets: np.ndarray | None = None,
    ) -> Any:
        """The field's rows (``sizes`` bytes each, back to back from ``start`` in ``arena``, checked to
        lie in it) as tensors viewing the arena, or None when they cannot be viewed as asked. Every
        array handed to torch is added to ``arrays`` (the lease lives as long as they do).
        ``row_offsets``: a jagged field's offsets, where the location read made them - then ``sizes``
        gives only the row count (a views read of a run does not fill it; padded gets never ask one)."""
        if schema.kind == OBJECT:
            return None
        n = sizes.size
        raw = arena[start : start + total]
        row_bytes = max(schema.itemsize * schema.row_elems, 1)
        if schema.kind != JAGGED:
            return self._borrow_tensor(raw, schema, (n, *schema.shape), arrays)
        if layout == "padded":
            target = meta.pad_length(int(sizes.max()) // row_bytes, pad_to)
            if (sizes != target * row_bytes).any():  # padding needs a copy
                return None
            return self._borrow_tensor(raw, schema, (n, target, *schema.shape), arrays)
        jt = _jagged(self._borrow_tensor(raw, schema, (total // row_bytes, *schema.shape), arrays), sizes, row_bytes, row_offsets)
        return jt if layout == "jagged" else jt.unbind()

    @staticmethod
    def _borrow_tensor(raw: np.ndarray, schema: FieldSchema, shape: tuple[int, ...], arrays: list[np.ndarray]) -> torch.Tensor:
        # the array torch is handed is the one whose collection ends the view (numpy collapses the
        # bases of views, so only this object lives exactly as long as the tensor's storage)
        if not raw.size:
            return to_tensor(raw, schema, shape)
        arr = raw if schema.dtype == "bfloat16" else raw.view(DTYPES[schema.dtype][1]).reshape(shape)
        arrays.append(arr)
        t = torch.from_numpy(arr)
        return t.view(torch.bfloat16).reshape(shape) if schema.dtype == "bfloat16" else t

    def _get_within(
        self,
        meta: KVBatchMeta,
        fields: list[str],
        layout: Layout,
        pad_to: int | None,
        pad_value: Any,
        wait_timeout: float | None,
        pin_memory: bool = False,
    ) -> dict[str, Any]:
        attempt = self._locate_here(meta, fields, layout)
        for tries_left in range(SHM_READ_TRIES, -1, -1):
            if attempt is None:  # ask the controller; the last try has the units send the rows
                try:
                    attempt = self._fetch(meta, fields, wait_timeout, shm=tries_left > 0)
                except _UnitRestarted:  # it recovered its data at a new address: ask again, once
                    self._refresh_units()
                    try:
                        attempt = self._fetch(meta, fields, None, shm=tries_left > 0)
                    except _UnitRestarted as again:  # a unit that keeps restarting is down
                        raise StorageUnitError(f"storage unit {again.args[0]} restarted again while a get waited on it") from None
            fetched, intact = attempt
            at, planned, jobs = self._plan_copy(fetched, fields, meta, layout, pad_to, pad_value)
            if at >= BIG_RESULT_BYTES:
                _check_result_fits(at, planned, fields)
            base = torch.empty(at, dtype=torch.uint8, pin_memory=True) if pin_memory else None  # torch's pinned allocator
            raw = self._pool.empty(at) if base is None else base.numpy()
            # The result tensors are made before the copy: a large copy evicts the caches, and
            # per-field work done after it ran cold (2-vCPU VM, a 24 MiB get of 32 fields: making
            # its tensors took 229 us after the copy, 160 us before it)
            out = _results(raw, planned, fields, layout, base)
            copy_fields(raw, jobs, copy_threads())
            if intact is None or intact():
                return _decode_objects(out, raw, planned, fields)
            # Bytes of the partition were freed while we copied (ours or another key's): again. A unit
            # serves a fetch between frees, so the last try (frames, no shared memory) needs no check.
            attempt = None
        raise AssertionError("unreachable: the last try reads no shared memory")  # pragma: no cover

    def _plan_copy(
        self, fetched: dict[str, _Fetched], fields: list[str], meta: KVBatchMeta, layout: Layout, pad_to: int | None, pad_value: Any
    ) -> tuple[int, list[_Planned], list[FieldCopy]]:
        """Plan copying every field's rows into one buffer for the whole get (each field's part
        starting on a cache line) with one :func:`copy_fields` call, so that a get costs its bytes,
        not its number of fields: one pooled allocation instead of one per field (fields under the
        pool's minimum were fresh memory, faulted in page by page on every get), one copy call, one
        streaming decision, and a per-field loop kept to plain arithmetic. Returns the buffer's size,
        the plan of each field and the copy's jobs."""
        padded = layout == "padded"
        fills = pad_value if isinstance(pad_value, abc.Mapping) else None
        planned: list[_Planned] = []
        jobs = []
        at = 0
        for name in fields:
            fx = fetched[name]
            lay = field_layout(fx.schema)
            span, pad = 0, b""
            if lay.kind == JAGGED and padded:
                longest = fx.longest // lay.row_bytes
                pad_len = meta.pad_length(longest, pad_to)
                if pad_len < longest:
                    raise InvalidRequestError(
                        f"field {name!r}: key {meta.keys[int(np.argmax(fx.sizes))]!r} has {longest} tokens, more than the pad length {pad_len}"
                    )
                span = pad_len * lay.row_bytes
                n = fx.sizes.size
                nbytes, shape = n * span, (n, pad_len, *lay.shape)
                try:
                    pad = lay.pad(pad_value if fills is None else fills.get(name, 0))
                except InvalidRequestError as exc:
                    raise InvalidRequestError(f"field {name!r}: {exc}") from None
            elif lay.kind == JAGGED:
                nbytes = fx.total
                shape = (nbytes // lay.row_bytes, *lay.shape)
            elif lay.kind == OBJECT:
                nbytes, shape = fx.total, None
            else:
                nbytes, shape = fx.total, (fx.sizes.size, *lay.shape)
            planned.append((fx, lay, at, nbytes, shape))
            jobs.append((at, fx.sources, fx.src, fx.starts, fx.sizes, span, pad))
            at += -(-nbytes // OUT_ALIGN) * OUT_ALIGN
        return at, planned, jobs

    # ------------------------------------------------------------------ deletes and stats
    @_in_opening_process
    def discard(self, meta: KVBatchMeta) -> int:
        """Free the meta's keys (all their fields) and unregister them; returns keys discarded. All or
        nothing; a discard that raised TQConnectionError is settled as :meth:`_fenced_call` says."""
        _check_meta(meta, "discard")
        args = messages.Discard(partition=meta.partition_id, keys=list(meta.keys), request_id=new_request_id())
        return self._fenced_call(Op.DISCARD, self._with_reads(args)).count

    @_in_opening_process
    def stats(self) -> dict[str, Any]:
        """Controller stats (partitions, op counts and latencies) plus every storage unit's."""
        reply: messages.StatsReply = self._call(Op.STATS, self._with_reads(messages.Stats()))
        if reply.units_version != self._units_version:
            self._refresh_units()
        return service_stats(reply, self._unit_chans, self.timeout)

    @_in_opening_process
    def trim(self) -> int:
        """Have every storage unit give memory back to the OS: the pages of free arena ranges, its idle
        fetch buffers and its free heap; returns the bytes released."""
        return sum(self._unit_chans[u.unit_id].call(UnitOp.TRIM, messages.Trim())[0].released_bytes for u in self._units)

    @_in_opening_process
    def shutdown_service(self) -> None:
        """Stop the controller and its storage units."""
        self._call(Op.SHUTDOWN, messages.Shutdown())
