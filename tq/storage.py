"""A storage unit: holds column bytes in a shared-memory arena and serves them by (block, row).

The unit knows nothing of keys or partitions - the controller maps (key, field) to (unit, block, row).
A *block* is what one put or write-back stored: one arena range holding each of its fields as one
contiguous buffer (values back to back, per-row byte offsets beside), never one object per sample.
Same-host clients carve blocks out of a *slab* (an arena range and block ids granted by ``alloc``),
write them straight into the arena and commit them to the controller, which has this unit ``adopt``
them; they read rows at the arena offsets the controller hands out with their locations, without a
request to the unit. Other clients send the bytes as frames (``store``) and ``fetch`` them back as frames.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import logging
import os
import secrets
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from . import argtypes, launch, liveness, messages, protocol
from .arena import ALIGN, Arena, RangeAllocator, align_up, check_shm_room, host_identity, release_heap
from .journal import Journal, JournalWriteError
from .errors import CapacityError, InvalidRequestError, StorageUnitError, TQTimeoutError
from .bufferpool import HostBufferPool
from .rowcopy import copy_rows, write_chunks
from .stream_transport import trim_receive_buffers, usable_cores
from .rpc import DEFERRED, Call, RpcChannel, RpcServer, ServerMustStop
from .schema import JAGGED, TENSOR, FieldSchema

log = logging.getLogger(__name__)

DEFAULT_ALLOC_LEASE_S = 60.0  # a writer fills its allocation within this (seconds)
WRITER_CHECK_S = 1.0  # how often ranges held for paused writers are checked for writers gone
# A stored block waits this long for the controller to claim it (its put committed) before the unit
# asks the controller to resolve it: claim it, or fence it and have it freed. Never freed unasked.
DEFAULT_COMMIT_LEASE_S = 30.0
MAX_EXPIRED_REPORT = 4096  # tentative blocks reported per heartbeat reply
# An allocation answered this long after its (same-host) writer's deadline is refused.
ALLOC_CLOCK_SLACK_S = 0.5
FETCH_ADOPT_WAIT_S = 2.0  # a fetch of a committed block waits this long for the controller's adopt
# A unit's big copies - a fetch's rows gathered for its reply, a TCP store's frames written into the
# arena - run on up to this many threads (the copier's own, started and joined per call; only copies
# of rowcopy.SHARE_BYTES or more per thread are split): 4, or half the unit's cores (one on 2 vCPUs,
# where client, unit and their threads share the cores).
COPY_THREADS = max(1, min(4, usable_cores() // 2))
# Fetches of up to this many rows are located and gathered row by row: for a handful of rows a dozen
# vectorised numpy calls cost more than the loop (a 1-row fetch took ~0.4 ms of handler on the 2-vCPU VM).
FEW_ROWS = 16


def _writer_record(aid: int, writer: liveness.Holder) -> list:
    """The journal record of allocation ``aid``'s writer: its liveness file, or its pid and start time."""
    return ["W", aid, writer] if isinstance(writer, str) else ["W", aid, *writer]


def _wall(deadline: float) -> float:
    """A monotonic deadline as a wall-clock time, as journaled: a restarted unit keeps its leases'
    deadlines instead of granting each a fresh term (a unit restarted more often than a lease is
    long never asked about its tentative blocks and slabs, and the controller's ledger of blocks
    above the unit's low-water mark grew for as long as that went on)."""
    return time.time() + (deadline - time.monotonic())


def _monotonic(wall: float | None, now: float, lease: float) -> float:
    """The monotonic deadline of a journaled wall-clock one (a fresh ``lease`` for records written
    before deadlines were journaled), never further away than ``lease``: a clock set back must not
    stretch it."""
    return now + lease if wall is None else now + min(wall - time.time(), lease)


@dataclass
class FieldLayout:
    schema: FieldSchema
    start: int  # absolute arena offset of the field's first byte
    row_offsets: np.ndarray  # int64 [n_rows + 1], byte offsets relative to ``start``


@dataclass
class Block:
    start: int
    size: int
    fields: dict[str, FieldLayout]
    live: np.ndarray  # bool [n_rows]
    n_live: int
    # False until the controller claims the block (its commit was applied): a tentative block is
    # freed only when the controller says so, since a commit naming it may still be on its way
    claimed: bool = True


@dataclass
class Slab:
    """A range granted to one same-host writer with a range of block ids: the writer carves blocks
    out of it and commits them straight to the controller, which has this unit adopt them. An id is
    *unsettled* until adopted or fenced; once every id is settled the bytes never adopted go back."""

    start: int
    size: int
    first_id: int
    n_ids: int
    expiry: float  # past it, the unsettled ids are reported to the controller (it adopts or fences each)
    unsettled: set[int]
    carved: list[tuple[int, int]]  # (start, size) of every block adopted from it, sorted by start

    def holds(self, bid: int) -> bool:
        return self.first_id <= bid < self.first_id + self.n_ids

    def overlaps(self, start: int, size: int) -> bool:
        """Whether ``[start, start + size)`` overlaps a block adopted from this slab: only the blocks
        next to it in start order can (a slab adopts up to its ids' count of blocks: no scan of all)."""
        i = bisect.bisect_left(self.carved, (start, size))
        return any(a < start + size and start < a + n for a, n in self.carved[max(i - 1, 0) : i + 1])

    def add_carved(self, start: int, size: int) -> None:
        bisect.insort(self.carved, (start, size))

    def gaps(self) -> list[tuple[int, int]]:
        """The slab's ranges no adopted block ever took."""
        out, pos = [], self.start
        for a, n in self.carved:
            if a > pos:
                out.append((pos, a - pos))
            pos = max(pos, a + n)
        if pos < self.start + self.size:
            out.append((pos, self.start + self.size - pos))
        return out


def validate_layout(schema: FieldSchema, row_offsets: np.ndarray, name: str) -> None:
    """Check that per-row byte offsets fit the field's kind, dtype and shape. Every store and every
    adopted block checks one, mostly of a row or a few, so it avoids np.diff's overhead (a 1-row
    tensor column: 5.6 -> 2.6 us on the 2-vCPU VM)."""
    if row_offsets.ndim != 1 or row_offsets.size < 1 or row_offsets[0] != 0:
        raise InvalidRequestError(f"field {name!r}: row offsets must start at 0")
    sizes = row_offsets[1:] - row_offsets[:-1]
    unit = schema.itemsize * schema.row_elems
    if schema.kind == TENSOR and not (sizes != unit).any():  # rows of one size: non-decreasing too
        return
    if (sizes < 0).any():
        raise InvalidRequestError(f"field {name!r}: row offsets must be non-decreasing")
    if schema.kind == TENSOR:
        raise InvalidRequestError(f"field {name!r}: every row of a {schema.describe()} column holds {unit} bytes")
    if schema.kind == JAGGED and unit and (sizes % unit).any():
        raise InvalidRequestError(f"field {name!r}: row sizes must be multiples of {unit} bytes for {schema.describe()}")


class StorageUnit(RpcServer):
    """One storage unit process (see module docstring)."""

    def __init__(
        self,
        unit_id: int,
        bind: str,
        *,
        capacity: int,
        shm_dir: str = "/dev/shm",
        secret: bytes | None = None,
        max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES,
        alloc_lease_s: float = DEFAULT_ALLOC_LEASE_S,
        recover_arena: str | None = None,
        orphan_timeout_s: float | None = None,
        commit_lease_s: float = DEFAULT_COMMIT_LEASE_S,
        fsync: str = "never",
        managed: bool = False,
    ) -> None:
        super().__init__(f"storage unit {unit_id}", bind, secret=secret, max_message_bytes=max_message_bytes)
        self.listen_streams()  # the controller of this host, and clients, skip ZMQ's I/O threads
        self.orphan_timeout_s = orphan_timeout_s  # stop after this long without a controller heartbeat
        self._last_ping = time.monotonic()
        self.unit_id = unit_id
        self.blocks: dict[int, Block] = {}
        self.tentative: dict[int, float] = {}  # block id -> when to ask the controller to resolve it
        self.commit_lease_s = commit_lease_s
        self.managed = managed  # started by the controller, which restarts it if it dies
        self._next_id = 1
        self.pending: dict[int, tuple[int, int, float]] = {}  # alloc id -> (start, size, expiry)
        self.slabs: dict[int, Slab] = {}  # alloc id -> slab (see Slab)
        # alloc id -> its same-host writer: its liveness file (tq.liveness) or, where it sent none, its
        # process_identity
        self.writers: dict[int, liveness.Holder] = {}
        # ranges of allocations whose lease ran out while their writer's process lived (it may be paused
        # mid-copy): kept from everyone else until it releases them or exits. alloc id -> the ranges, and
        # the slab they are the gaps of (None: an allocation)
        self.held: dict[int, tuple[list[tuple[int, int]], Slab | None]] = {}
        # a same-host writer's alloc request id -> the allocation it was granted (see Alloc.request_id);
        # journaled ("Q"): a unit restarted before the writer names the request abandoned still frees it
        self.grants: dict[int, int] = {}
        # abandoned alloc request ids that matched no grant (yet: one parked for room may still come up) -> when
        # told; such a request is refused if it comes up within an allocation lease
        self.abandoned: dict[int, float] = {}
        self._next_writer_check = 0.0
        self._next_liveness_sweep = 0.0  # the first tick sweeps: files of writers that exited while no unit ran
        self.parked_fetches: list[tuple[messages.Fetch, list, Call, float]] = []  # rows of blocks not adopted yet
        self.alloc_lease_s = alloc_lease_s
        if recover_arena is None:
            check_shm_room(shm_dir, capacity)
            self.arena = Arena(os.path.join(shm_dir, f"tq-{uuid.uuid4().hex[:12]}-unit{unit_id}.arena"), capacity, create=True, own=True)
            self.alloc = RangeAllocator(capacity)
        else:  # a restart after a crash: the arena file outlived the process; replay what it held
            self.arena = Arena(recover_arena, os.path.getsize(recover_arena), create=False, own=True)
            self.alloc = RangeAllocator(self.arena.size)
            self._replay(recover_arena + ".journal")
        self.journal = Journal(self.arena.path + ".journal", fsync=fsync)
        self._compact_failed_at = 0  # records appended when a compaction last failed
        if self.journal.truncated_bytes:
            log.warning("storage unit %d: dropped a torn journal tail of %d bytes", unit_id, self.journal.truncated_bytes)
        self.parked: list[tuple[Any, dict, list, Call, float]] = []  # writes waiting for room
        self.bytes_stored = 0
        self.pool = HostBufferPool(max_cached_bytes=256 << 20)
        # changes with every trim, and with every unit process (random start): in alloc replies, so a
        # same-host writer learns its mapping lost the pages given back (Arena.forget_populated)
        self.trim_epoch = secrets.randbits(31)
        self.bytes_served = 0
        Op = messages.UnitOp
        self.serve_ops(
            messages.UNIT_REQUESTS,
            {
                Op.PING: self.op_ping,
                Op.ALLOC: self._waiting_for_room(self.op_alloc),
                Op.STORE: self._waiting_for_room(self.op_store),
                Op.FETCH: self.op_fetch,
                Op.FREE_ROWS: self.op_free_rows,
                Op.FREE_BLOCKS: self.op_free_blocks,
                Op.RETAIN: self.op_retain,
                Op.CLAIM: self.op_claim,
                Op.ADOPT: self.op_adopt,
                Op.TRIM: self.op_trim,
                Op.RELEASE: self.op_release,
                Op.STATS: lambda a, b, c: self.stats(),
                Op.SHUTDOWN: self.op_shutdown,
            },
        )

    def describe(self) -> dict[str, Any]:
        return {
            "unit_id": self.unit_id,
            "address": self.address,
            "host": host_identity(),
            "arena_path": self.arena.path,
            "arena_size": self.arena.size,
            "pid": os.getpid(),
            "managed": self.managed,
            "local_address": self.local.address if self.local is not None else None,
            "stream_address": self.tcp.address if self.tcp is not None else None,
        }

    # -- helpers
    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def op_ping(self, args: messages.Ping, buffers: list, call: Call) -> messages.PingReply:
        """The controller's heartbeat. The reply says which blocks are settled (every id below
        ``low_water`` is claimed or freed), which tentative blocks waited past their lease for a
        claim (the controller claims or fences each) and the free bytes (placement by free space)."""
        now = self._last_ping = time.monotonic()  # only the controller pings: its heartbeat
        expired = [bid for bid, exp in self.tentative.items() if exp <= now]
        for slab in self.slabs.values():
            if slab.expiry <= now:
                expired.extend(sorted(slab.unsettled))
        expired = expired[:MAX_EXPIRED_REPORT]
        return messages.PingReply(unit_id=self.unit_id, low_water=self.low_water(), expired=expired, free_bytes=self.alloc.largest_free())

    def low_water(self) -> int:
        """The lowest block id still waiting for its claim or adoption (every lower id is settled)."""
        return min([min(self.tentative, default=self._next_id), *(min(s.unsettled) for s in self.slabs.values() if s.unsettled)])

    def next_deadline(self) -> float | None:
        times = [exp for _, _, exp in self.pending.values()] + [p[4] for p in self.parked] + [p[3] for p in self.parked_fetches]
        if self.orphan_timeout_s is not None:
            times.append(self._last_ping + self.orphan_timeout_s)
        return min(times, default=None)

    @contextlib.contextmanager
    def applying(self) -> Iterator[None]:
        """Every request's journal records leave in one write (freeing a slab given back journals up to
        1,024 records). Nothing is sent while a handler runs: writes and fetches parked behind it are
        served at the loop's tick, after its reply. If the records cannot be written, the unit stops
        (:class:`ServerMustStop`) as if it had crashed just before them: its arena and journal stay,
        its controller restarts it on them, and it recovers everything journaled before - serving on
        with changes its journal lacks would let a restart double-book or resurrect arena ranges."""
        try:
            with self.journal.batch():
                yield
        except JournalWriteError as exc:
            log.critical("storage unit %d: %s: stopping", self.unit_id, exc)
            raise ServerMustStop(
                StorageUnitError(
                    f"storage unit {self.unit_id} could not journal this request ({exc.strerror}), so it did not make "
                    "the change and stopped; its controller restarts it on its arena"
                )
            ) from exc

    def on_tick(self, now: float) -> None:
        if self.orphan_timeout_s is not None and now - self._last_ping > self.orphan_timeout_s:
            log.error("storage unit %d heard no controller for %.0fs: stopping", self.unit_id, now - self._last_ping)
            self.stop()
        with self.applying():  # every journal write of the unit runs inside it (one failing stops the unit)
            for aid, (start, size, exp) in list(self.pending.items()):
                if exp <= now:  # a writer that allocated and never stored (crashed): reclaim
                    del self.pending[aid]
                    if self._writer_alive(aid):  # paused, not gone: its copy may still land there
                        log.warning("storage unit %d holds expired allocation %d for its live writer", self.unit_id, aid)
                        self.held[aid] = ([(start, size)], None)
                        continue
                    log.warning("storage unit %d reclaims expired allocation %d (%d bytes)", self.unit_id, aid, size)
                    self._free_allocation(aid, [(start, size)], "X")
            if self.held and now >= self._next_writer_check:
                self._next_writer_check = now + WRITER_CHECK_S
                for aid in [a for a in self.held if not self._writer_alive(a)]:
                    self._release_held(aid)
        if now >= self._next_liveness_sweep:
            self._next_liveness_sweep = now + liveness.SWEEP_S
            liveness.remove_gone(os.path.dirname(self.arena.path))
        self._retry_parked(now)
        self._retry_fetches(now)

    def _check_fits_at_all(self, nbytes: int) -> None:
        if nbytes > self.arena.size:
            exc = CapacityError(f"a write of {nbytes} bytes can never fit storage unit {self.unit_id}'s {self.arena.size}-byte arena")
            exc.retryable = False  # type: ignore[attr-defined] - waiting for frees cannot help
            raise exc

    def _allocate(self, nbytes: int) -> int:
        """An arena range of ``nbytes`` whose pages are allocated (a writer touching them cannot SIGBUS)."""
        start = self.alloc.allocate(nbytes)
        try:
            self.arena.allocate_pages(start, align_up(max(nbytes, 1)))
        except BaseException:
            self.alloc.free(start, nbytes)
            raise
        return start

    def _writer_alive(self, aid: int) -> bool:
        """Whether the same-host process that was granted allocation ``aid`` still runs."""
        return liveness.runs(self.writers.get(aid), os.path.dirname(self.arena.path))

    def _release_held(self, aid: int) -> int:
        """Free the ranges held for allocation ``aid``'s writer (see ``held``); the bytes freed."""
        ranges, slab = self.held.pop(aid)
        return self._free_allocation(aid, ranges, "X" if slab is None else "Y")

    def _free_allocation(self, aid: int, ranges: list[tuple[int, int]], record: str) -> int:
        """Free what is left of allocation (or slab) ``aid`` - ``ranges`` - journaling its end
        (``record``: "X" for an allocation, "Y" for a slab), and forget its writer; the bytes freed."""
        for start, size in ranges:
            self.alloc.free(start, size)
        self.journal.append([record, aid])
        self.writers.pop(aid, None)
        return sum(size for _, size in ranges)

    # -- backpressure: a write that does not fit may wait (``wait_s``) for frees instead of failing
    def _waiting_for_room(self, handler: Any) -> Any:
        def serve(args: messages.Alloc | messages.Store, buffers: list, call: Call) -> Any:
            try:
                return handler(args, buffers, call)
            except CapacityError as exc:
                if args.wait_s <= 0 or not getattr(exc, "retryable", True):
                    raise
                self.parked.append((handler, args, buffers, call, time.monotonic() + args.wait_s))
                return DEFERRED

        return serve

    def _retry_parked(self, now: float) -> None:
        """Serve parked writes in arrival order while they fit; fail those whose wait ran out."""
        while self.parked:
            handler, args, buffers, call, deadline = self.parked[0]
            try:
                with self.applying():  # as a request is served: its records in one write, or the unit stops
                    out = handler(args, buffers, call)
            except ServerMustStop as stop:
                self.parked.pop(0)
                self.reply_error(call, stop.error)
                raise
            except CapacityError as exc:
                if deadline > now:
                    return  # first in line still does not fit: later ones wait behind it
                self.parked.pop(0)
                self.reply_error(call, CapacityError(f"{exc} (waited {args.wait_s}s for room)"))
                continue
            except Exception as exc:  # anything else: answer it, keep serving the queue
                self.parked.pop(0)
                self.reply_error(call, exc)
                continue
            self.parked.pop(0)
            result, bufs = out if isinstance(out, tuple) else (out, ())
            self.reply(call, result, bufs)

    # -- ops
    def op_alloc(self, args: messages.Alloc, buffers: list, call: Call) -> messages.AllocReply:
        if args.reply_by is not None and time.time() > args.reply_by + ALLOC_CLOCK_SLACK_S:
            raise TQTimeoutError(f"allocation of {args.nbytes} bytes reached storage unit {self.unit_id} after its writer stopped waiting")
        if args.request_id is not None and args.request_id in self.abandoned:
            raise TQTimeoutError(f"allocation of {args.nbytes} bytes reached storage unit {self.unit_id} after its writer gave it up")
        if args.released or args.abandoned:
            self._release(args.released, args.abandoned)
            args.released = args.abandoned = []  # once, should the request be parked and served again
        nbytes = args.nbytes
        self._check_fits_at_all(nbytes)
        start = self._allocate(nbytes)
        aid = self._new_id()
        writer = liveness.identify(args.writer, args.writer_file)
        if writer is not None:  # journaled first: the records below are in the same write
            self.writers[aid] = writer
            self.journal.append(_writer_record(aid, writer))
            if args.request_id is not None:
                self.grants[args.request_id] = aid
                self.journal.append(["Q", aid, args.request_id])
        if args.ids:  # a slab: the writer names its blocks (these ids) in its commit
            size, first = align_up(max(nbytes, 1)), self._next_id
            self._next_id += args.ids
            expiry = time.monotonic() + self.alloc_lease_s
            self.slabs[aid] = Slab(start, size, first, args.ids, expiry, set(range(first, first + args.ids)), [])
            self.journal.append(["G", aid, start, size, first, args.ids, _wall(expiry)])  # a restarted unit keeps it
            return messages.AllocReply(alloc=aid, offset=start, first_block=first, trim_epoch=self.trim_epoch)
        self.pending[aid] = (start, nbytes, time.monotonic() + self.alloc_lease_s)
        # journaled: a writer may still be filling the range when this unit is killed and restarted,
        # so the restarted unit must not hand the range to anyone else before the lease ends
        self.journal.append(["A", aid, start, nbytes, _wall(self.pending[aid][2])])
        return messages.AllocReply(alloc=aid, offset=start, trim_epoch=self.trim_epoch)

    def op_store(self, args: messages.Store, buffers: list, call: Call) -> messages.StoreReply:
        """Register a block: either an earlier ``alloc`` the client filled, or bytes sent as frames."""
        n_rows = args.n_rows
        layouts: list[tuple[str, FieldSchema, int, np.ndarray, Any]] = []
        rel = 0
        for name, spec in args.fields.items():
            schema = FieldSchema.from_wire(spec.schema)
            ro = protocol.unpack_array(spec.row_offsets, buffers, name=f"{name}.row_offsets", dtype="<i8")
            if ro.size != n_rows + 1:
                raise InvalidRequestError(f"field {name!r}: {ro.size} row offsets for {n_rows} rows")
            validate_layout(schema, ro, name)
            nbytes = int(ro[-1])
            data = None
            if spec.data is not None:  # one or more chunks, back to back
                refs = spec.data if isinstance(spec.data, list) else [spec.data]
                data = [protocol.unpack_array(r, buffers, name=f"{name}.data", dtype="|u1") for r in refs]
                got = sum(d.size for d in data)
                if got != nbytes:
                    raise InvalidRequestError(f"field {name!r}: {got} data bytes, row offsets say {nbytes}")
                offset = rel
            else:
                offset = spec.offset
                if offset is None or offset < rel:
                    raise InvalidRequestError(f"field {name!r}: offset {offset!r} overlaps the previous field")
            layouts.append((name, schema, offset, np.array(ro, dtype=np.int64), data))
            rel = offset + nbytes
        if args.alloc is not None:
            pend = self.pending.get(args.alloc)
            if pend is None:
                raise InvalidRequestError(f"unknown or expired allocation {args.alloc!r}")
            start, size, _ = pend
            if rel > size:
                raise InvalidRequestError(f"fields need {rel} bytes but allocation {args.alloc} holds {size}")
            if any(d is not None for *_, d in layouts):
                raise InvalidRequestError("store: give either an allocation or data frames, not both")
            del self.pending[args.alloc]
            self.writers.pop(args.alloc, None)
            if n_rows == 0:
                self.journal.append(["X", args.alloc])
        else:
            if any(d is None for *_, d in layouts):
                raise InvalidRequestError("store without an allocation needs a data frame for every field")
            size = rel
            self._check_fits_at_all(size)
            start = self._allocate(size)
            for _, _, offset, _, chunks in layouts:
                write_chunks(self.arena.view[start + offset : start + offset + sum(c.size for c in chunks)], chunks, COPY_THREADS)
        block = Block(
            start,
            size,
            {n: FieldLayout(s, start + off, ro) for n, s, off, ro, _ in layouts},
            np.ones(n_rows, dtype=bool),
            n_rows,
        )
        bid = self._new_id()
        if n_rows == 0:
            self.alloc.free(start, size)
        else:
            block.claimed = False
            self.blocks[bid] = block
            self.tentative[bid] = time.monotonic() + self.commit_lease_s
            self.journal.append(self._store_record(bid, block, self.tentative[bid]))
        self.bytes_stored += rel
        return messages.StoreReply(
            block=bid,
            nbytes={n: int(ro[-1]) for n, _, _, ro, _ in layouts},
            starts={n: start + off for n, _, off, _, _ in layouts},  # where each field begins in the arena
        )

    @staticmethod
    def _rows_of(args: messages.BlockRows, buffers: list, name: str) -> tuple[np.ndarray, np.ndarray]:
        blocks = protocol.unpack_array(args.blocks, buffers, name=f"{name}.blocks", dtype="<i8")
        rows = protocol.unpack_array(args.rows, buffers, name=f"{name}.rows", dtype="<i8")
        if blocks.shape != rows.shape or blocks.ndim != 1:
            raise InvalidRequestError(f"{name}: blocks and rows must be 1-d arrays of one length")
        return blocks, rows

    def _block_field(self, field: str, bid: int) -> tuple[Block, FieldLayout]:
        block = self.blocks.get(bid)
        if block is None or field not in block.fields:
            raise StorageUnitError(f"storage unit {self.unit_id} holds no field {field!r} in block {bid} (freed or never stored)")
        return block, block.fields[field]

    def _locate_few(self, fields: list[str], entries: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_locate` of a few entries, one by one."""
        starts, sizes = [], []
        for f, bid, r in entries:
            block, lay = self._block_field(fields[f], bid)
            if not 0 <= r < block.live.size:
                raise StorageUnitError(f"block {bid} has {block.live.size} rows; asked for row {r}")
            if not block.live[r]:
                raise StorageUnitError(f"rows of block {bid} were already freed")
            a, b = lay.row_offsets[r : r + 2].tolist()
            starts.append(lay.start + a)
            sizes.append(b - a)
        return np.array(starts, dtype=np.int64), np.array(sizes, dtype=np.int64)

    def _locate(self, fields: list[str], entries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Absolute arena offsets and byte sizes of ``entries`` ([field index, block, row] rows),
        vectorised per (field, block) group."""
        if entries.shape[0] <= FEW_ROWS:
            return self._locate_few(fields, entries.tolist())
        starts = np.empty(entries.shape[0], dtype=np.int64)
        sizes = np.empty(entries.shape[0], dtype=np.int64)
        group = entries[:, 0] * (1 << 40) + entries[:, 1]
        for g in np.unique(group).tolist():
            f, bid = divmod(g, 1 << 40)
            block, lay = self._block_field(fields[f], bid)
            sel = np.flatnonzero(group == g)
            r = entries[sel, 2]
            if r.min() < 0 or r.max() >= block.live.size:
                raise StorageUnitError(f"block {bid} has {block.live.size} rows; asked for row {int(r.max())}")
            if not block.live[r].all():
                raise StorageUnitError(f"rows of block {bid} were already freed")
            starts[sel] = lay.start + lay.row_offsets[r]
            sizes[sel] = lay.row_offsets[r + 1] - lay.row_offsets[r]
        return starts, sizes

    def op_fetch(self, args: messages.Fetch, buffers: list, call: Call, park_until: float | None = -1.0) -> Any:
        """Serve ``entries`` ([field index, block, row]) gathered back to back into frames of whole rows.
        Rows of a block committed but not adopted yet (its adopt is on its way from the controller)
        wait for it, up to ``FETCH_ADOPT_WAIT_S``."""
        fields = args.fields
        entries = protocol.unpack_array(args.entries, buffers, name="entries", dtype="<i8")
        if entries.ndim != 2 or entries.shape[1] != 3:
            raise InvalidRequestError("fetch entries must be an [n, 3] array of (field index, block, row)")
        if entries.size and (entries[:, 0].min() < 0 or entries[:, 0].max() >= len(fields)):
            raise InvalidRequestError("fetch entries name a field index out of range")
        if entries.size and (entries[:, 1].min() < 0 or entries[:, 1].max() >= 1 << 40):
            raise InvalidRequestError("fetch entries name a block id out of range")
        try:
            starts, sizes = self._locate(fields, entries)
        except StorageUnitError:
            waiting = any((s := self._slab_of(b)) is not None and b in s[1].unsettled for b in np.unique(entries[:, 1]).tolist())
            if not waiting or park_until is None:
                raise
            self.parked_fetches.append((args, buffers, call, time.monotonic() + FETCH_ADOPT_WAIT_S if park_until < 0 else park_until))
            return DEFERRED
        total = int(sizes.sum())
        self.bytes_served += total
        return self._gather_frames(starts, sizes, total)

    def _gather_frames(self, starts: np.ndarray, sizes: np.ndarray, total: int) -> tuple[messages.FetchReply, list[Any]]:
        """The fetch's reply and its frames: rows copied back to back into one pooled buffer, cut
        into frames of whole rows.

        Frames of at most ~``TCP_FRAME_BYTES`` (plus one row) let the receiver's allocator reuse warm
        memory instead of faulting in a fresh mapping per message; they go out zero-copy.
        """
        frames: list[Any] = []
        sizes_ref = protocol.pack_array(sizes, frames)
        if sizes.size <= FEW_ROWS and total <= protocol.TCP_FRAME_BYTES:  # one frame, no pooled buffer
            view = self.arena.view
            data = np.frombuffer(b"".join(view[a : a + n] for a, n in zip(starts.tolist(), sizes.tolist())), dtype=np.uint8)
            refs = [protocol.pack_array(data, frames)]
            return messages.FetchReply(sizes_ref, refs, protocol.pack_array(np.array([sizes.size]), frames)), frames
        data = self.pool.empty(total)
        n = sizes.size
        rel = np.cumsum(sizes) - sizes
        copy_rows(data, rel, [self.arena.view], np.zeros(n, dtype=np.int64), starts, sizes, threads=COPY_THREADS)
        firsts = protocol.whole_row_runs(rel, protocol.TCP_FRAME_BYTES)
        bounds = np.append(rel[firsts], total).tolist()
        refs = [protocol.pack_array(data[a:b], frames) for a, b in zip(bounds[:-1], bounds[1:])]
        frame_rows = protocol.pack_array(np.diff(np.append(firsts, n)), frames)
        return messages.FetchReply(sizes=sizes_ref, frames=refs, frame_rows=frame_rows), frames

    def _free_block(self, bid: int) -> None:
        block = self.blocks.pop(bid, None)
        self.tentative.pop(bid, None)
        if block is not None:
            self.alloc.free(block.start, block.size)
            self.journal.append(["F", bid])
            self._maybe_compact()  # parked writes get the room at this loop's tick (see applying)
            return
        slab = self._slab_of(bid)
        if slab is not None and bid in slab[1].unsettled:  # fenced before it was adopted: never will be
            self.journal.append(["F", bid])
            slab[1].unsettled.discard(bid)
            self._settled(*slab)

    def _slab_of(self, bid: int) -> tuple[int, Slab] | None:
        return next(((aid, s) for aid, s in self.slabs.items() if s.holds(bid)), None)

    def _settled(self, aid: int, slab: Slab) -> None:
        """Close a slab whose every id is adopted or fenced: the bytes no block took go back."""
        if slab.unsettled:
            return
        del self.slabs[aid]
        if slab.expiry <= time.monotonic() and self._writer_alive(aid):  # closed by its lease, writer paused?
            self.held[aid] = (slab.gaps(), slab)
        else:
            self._free_allocation(aid, slab.gaps(), "Y")

    def _adopt(self, ad: messages.AdoptBlock) -> None:
        """Register a committed block carved out of a slab (idempotent). Once it returns, the block is
        settled: adopted now or before, or no open slab holds it unsettled."""
        if ad.block in self.blocks:
            return
        found = self._slab_of(ad.block)
        if found is None or ad.block not in found[1].unsettled:
            # adopted (and maybe freed) already: the controller sends adopts again after a restart or in a retain
            log.debug("storage unit %d: adopt of block %d, which no open slab holds unsettled", self.unit_id, ad.block)
            return
        aid, slab = found
        if (
            aid != ad.slab
            or ad.start < slab.start
            or ad.start + ad.size > slab.start + slab.size
            or ad.start % ALIGN
            or slab.overlaps(ad.start, ad.size)
        ):
            raise InvalidRequestError(f"adopt: block {ad.block} at [{ad.start}, {ad.start + ad.size}) is not a free part of slab {aid}")
        fields, n_rows = {}, None
        for name, f in ad.fields.items():
            schema = FieldSchema.from_wire(f.schema)
            ro = np.frombuffer(f.row_offsets, dtype="<i8")  # read-only, not copied: a layout never changes
            validate_layout(schema, ro, name)
            if n_rows not in (None, ro.size - 1) or f.start < ad.start or f.start + int(ro[-1]) > ad.start + ad.size:
                raise InvalidRequestError(f"adopt: field {name!r} of block {ad.block} does not fit it")
            n_rows = ro.size - 1
            fields[name] = FieldLayout(schema, f.start, ro)
        block = Block(ad.start, ad.size, fields, np.ones(n_rows or 0, dtype=bool), n_rows or 0)
        self.blocks[ad.block] = block
        self.journal.append(self._store_record(ad.block, block))
        slab.unsettled.discard(ad.block)
        slab.add_carved(ad.start, ad.size)
        self.bytes_stored += sum(int(f.row_offsets[-1]) for f in fields.values())
        self._settled(aid, slab)

    def op_adopt(self, args: messages.Adopt, buffers: list, call: Call) -> messages.AdoptReply:
        """The controller committed these blocks, carved out of slabs by their writers: register them."""
        for ad in args.blocks:
            self._adopt(ad)
        return messages.AdoptReply(adopted=[ad.block for ad in args.blocks])  # all settled (see _adopt)

    def _settled_of(self, adopts: Any) -> list[int]:
        """The blocks of these adopts that this unit settled (adopted - journaled - or freed since): the
        controller need not keep, nor send again, their layouts."""
        return [ad.block for ad in adopts if (s := self._slab_of(ad.block)) is None or ad.block not in s[1].unsettled]

    def _retry_fetches(self, now: float) -> None:
        parked, self.parked_fetches = self.parked_fetches, []
        for args, buffers, call, deadline in parked:
            try:
                out = self.op_fetch(args, buffers, call, park_until=deadline if deadline > now else None)
            except Exception as exc:
                self.reply_error(call, exc)
                continue
            if out is not DEFERRED:
                self.reply(call, *out)

    # -- crash recovery: every stored block and every free is journaled next to the arena
    @staticmethod
    def _store_record(bid: int, block: Block, expiry: float | None = None) -> list:
        """A block as journaled; a tentative one (``expiry``: when to ask about its commit) with that
        deadline as a wall-clock time."""
        fields = [[n, lay.schema.to_wire(), lay.start, lay.row_offsets.tobytes()] for n, lay in block.fields.items()]
        dead = b"" if block.n_live == block.live.size else np.flatnonzero(~block.live).astype(np.int64).tobytes()
        rec = ["S", bid, block.start, block.size, int(block.live.size), fields, dead, block.claimed]
        return rec if expiry is None else [*rec, _wall(expiry)]

    def _replay(self, path: str) -> None:
        """Rebuild the blocks from the journal: stores ("S"), claims ("C"), partial ("R") and whole
        ("F") frees, allocations a writer may still be filling ("A", and "X" once released), the alloc
        requests that were granted them ("Q") and the next id ("N", so ids are never reused after a
        compaction)."""
        allocs: dict[int, tuple[int, int, float | None]] = {}
        grants: dict[int, int] = {}  # alloc request id -> the allocation granted it
        slabs: dict[int, Slab] = {}
        expiries: dict[int, float | None] = {}  # slab or tentative block -> journaled wall-clock deadline
        for rec in Journal.replay(path):
            kind, bid = rec[0], rec[1]
            slab = next((sl for sl in slabs.values() if sl.holds(bid)), None) if kind in ("S", "F") else None
            if kind == "S":
                _, _, start, size, n_rows, fields, dead, claimed, *expiry = rec
                expiries[bid] = expiry[0] if expiry else None
                live = np.ones(n_rows, dtype=bool)
                live[np.frombuffer(dead, dtype=np.int64)] = False
                lays = {n: FieldLayout(FieldSchema.from_wire(w), fs, np.frombuffer(ro, dtype=np.int64).copy()) for n, w, fs, ro in fields}
                self.blocks[bid] = Block(start, size, lays, live, int(live.sum()), claimed)
                if slab is not None and bid in slab.unsettled:  # adopted out of its slab
                    slab.unsettled.discard(bid)
                    slab.add_carved(start, size)
            elif kind == "F":
                self.blocks.pop(bid, None)
                if slab is not None:  # fenced before it was adopted
                    slab.unsettled.discard(bid)
            elif kind == "G":  # a slab (with its state when written by a compaction)
                _, aid, start, size, first, n, *state = rec
                expiries[aid] = state.pop(0) if state and isinstance(state[0], float) else None
                unsettled = set(np.frombuffer(state[0], dtype=np.int64).tolist()) if state else set(range(first, first + n))
                carved = sorted((a, z) for a, z in np.frombuffer(state[1], dtype=np.int64).reshape(-1, 2).tolist()) if state else []
                slabs[aid] = Slab(start, size, first, n, 0.0, unsettled, carved)
                self._next_id = max(self._next_id, first + n)
            elif kind == "Y":
                slabs.pop(bid, None)
                self.writers.pop(bid, None)
            elif kind == "R" and bid in self.blocks:
                b = self.blocks[bid]
                b.live[np.frombuffer(rec[2], dtype=np.int64)] = False
                b.n_live = int(b.live.sum())
            elif kind == "C":
                for b in np.frombuffer(rec[2], dtype=np.int64).tolist():
                    if b in self.blocks:
                        self.blocks[b].claimed = True
            elif kind == "A":
                allocs[bid] = (rec[2], rec[3], rec[4] if len(rec) > 4 else None)
            elif kind == "X":
                allocs.pop(bid, None)
                self.writers.pop(bid, None)
            elif kind == "W":  # a liveness file's name, or a pid and start time
                self.writers[bid] = rec[2] if len(rec) == 3 else (rec[2], rec[3])
            elif kind == "Q":  # the alloc request granted allocation ``bid``
                grants[rec[2]] = bid
            if kind == "S":  # an allocation stored as this block is no longer pending
                allocs = {a: r for a, r in allocs.items() if r[0] != rec[2]}
            self._next_id = max(self._next_id, bid + 1)
        now = time.monotonic()  # the leases run on from their journaled deadlines
        self.tentative = {bid: _monotonic(expiries.get(bid), now, self.commit_lease_s) for bid, b in self.blocks.items() if not b.claimed}
        self.pending = {a: (start, size, _monotonic(wall, now, self.alloc_lease_s)) for a, (start, size, wall) in allocs.items()}
        # a slab whose ids were all settled before a crash let it close is closed now (its gaps stay
        # free), unless its writer still runs (it was held for it; see ``held``)
        self.slabs = {aid: sl for aid, sl in slabs.items() if sl.unsettled}
        self.held = {aid: (sl.gaps(), sl) for aid, sl in slabs.items() if not sl.unsettled and self._writer_alive(aid)}
        self.writers = {a: w for a, w in self.writers.items() if self._is_open(a)}
        self.grants = self._open_grants(grants)
        for aid, sl in self.slabs.items():
            sl.expiry = _monotonic(expiries.get(aid), now, self.alloc_lease_s)
        for b in self.blocks.values():
            self.alloc.reserve(b.start, b.size)
        for start, size, _ in self.pending.values():
            self.alloc.reserve(start, size)
        for sl in self.slabs.values():
            for start, size in sl.gaps():
                self.alloc.reserve(start, size)
        for ranges, _ in self.held.values():
            for start, size in ranges:
                self.alloc.reserve(start, size)
        log.warning(
            "storage unit %d recovered %d blocks (%d awaiting their claim) from %s",
            self.unit_id,
            len(self.blocks),
            len(self.tentative),
            path,
        )

    def _maybe_compact(self) -> None:
        if self.journal.appended > max(4 * len(self.blocks) + 1024, 2 * self._compact_failed_at):
            try:
                self._compact()
                self._compact_failed_at = 0
            except OSError as exc:  # the journal is intact (a rewrite replaces it whole or not at all)
                self._compact_failed_at = self.journal.appended  # not again at every free: once it doubles
                log.warning("storage unit %d: journal compaction failed (%s); trying again once it doubles", self.unit_id, exc)

    def _compact(self) -> None:
        self.journal.rewrite(
            [
                ["N", self._next_id - 1],
                *(self._store_record(bid, b, self.tentative.get(bid)) for bid, b in self.blocks.items()),
                *(_writer_record(aid, w) for aid, w in self.writers.items()),
                *(["Q", aid, rid] for rid, aid in self._open_grants(self.grants).items()),
                *(["A", aid, start, size, _wall(exp)] for aid, (start, size, exp) in self.pending.items()),
                # a held allocation comes back as one whose lease ran out (held again, or freed)
                *(["A", aid, *ranges[0], 0.0] for aid, (ranges, slab) in self.held.items() if slab is None),
                *(
                    [
                        "G",
                        aid,
                        sl.start,
                        sl.size,
                        sl.first_id,
                        sl.n_ids,
                        _wall(sl.expiry),
                        np.array(sorted(sl.unsettled), dtype=np.int64).tobytes(),
                        np.array(sl.carved, dtype=np.int64).reshape(-1, 2).tobytes(),
                    ]
                    # a held slab comes back with every id settled (held again, or closed)
                    for aid, sl in [*self.slabs.items(), *((a, sl) for a, (_, sl) in self.held.items() if sl is not None)]
                ),
            ]
        )

    def _claim(self, bids: list[int]) -> None:
        claimed = [b for b in bids if b in self.tentative]
        for b in claimed:
            del self.tentative[b]
            self.blocks[b].claimed = True
        if claimed:
            self.journal.append(["C", 0, np.asarray(claimed, dtype=np.int64).tobytes()])

    def op_claim(self, args: messages.Claim, buffers: list, call: Call) -> messages.ClaimReply:
        """The controller applied the commits of these blocks: they are settled (freed only by row)."""
        bids = protocol.unpack_array(args.blocks, buffers, name="claim.blocks", dtype="<i8")
        if bids.ndim != 1:
            raise InvalidRequestError("claim needs a 1-d array of block ids")
        self._claim(bids.tolist())
        return messages.ClaimReply(claimed=int(bids.size))

    def op_retain(self, args: messages.Retain, buffers: list, call: Call) -> messages.RetainReply:
        """Keep only the listed (block, row) pairs of settled blocks: after a restart, or after frees it
        could not send, the controller lists what it still references (and, in ``claimed``, the blocks
        it committed), and anything freed meanwhile is freed here too. Blocks still waiting for their
        claim are left alone: a commit naming one may still arrive."""
        blocks, rows = self._rows_of(args, buffers, "retain")
        for ad in args.adopts or ():  # committed while this unit was away: adopted before anything is freed
            self._adopt(ad)
        if args.claimed is not None:
            claimed = protocol.unpack_array(args.claimed, buffers, name="retain.claimed", dtype="<i8")
            self._claim(claimed.ravel().tolist())
        freed = 0
        for bid in list(self.blocks):
            block = self.blocks[bid]
            if not block.claimed:
                continue
            keep = np.zeros(block.live.size, dtype=bool)
            r = rows[blocks == bid]
            keep[r[(r >= 0) & (r < keep.size)]] = True
            if not (block.live & keep).any():
                self._free_block(bid)
                freed += 1
            elif (block.live & ~keep).any():
                dropped = np.flatnonzero(block.live & ~keep)
                block.live[dropped] = False
                block.n_live = int(block.live.sum())
                self.journal.append(["R", bid, dropped.astype(np.int64).tobytes()])
        return messages.RetainReply(blocks_freed=freed, adopted=self._settled_of(args.adopts or ()))

    def op_free_rows(self, args: messages.FreeRows, buffers: list, call: Call) -> messages.FreeRowsReply:
        blocks, rows = self._rows_of(args, buffers, "free_rows")
        freed = 0
        for bid in np.unique(blocks).tolist():
            block = self.blocks.get(bid)
            if block is None:
                continue
            self._claim([bid])  # the controller frees rows only of blocks it committed
            r = rows[blocks == bid]
            r = r[(r >= 0) & (r < block.live.size)]
            block.live[r] = False
            block.n_live = int(block.live.sum())
            if block.n_live == 0:
                self._free_block(bid)
                freed += 1
            else:
                self.journal.append(["R", bid, r.astype(np.int64).tobytes()])
        return messages.FreeRowsReply(blocks_freed=freed)

    def op_free_blocks(self, args: messages.FreeBlocks, buffers: list, call: Call) -> messages.FreeBlocksReply:
        """Free whole blocks (the controller fenced them: no commit of theirs will ever be applied)."""
        for bid in args.blocks:
            self._free_block(bid)
        return messages.FreeBlocksReply(blocks_freed=len(args.blocks))

    def op_release(self, args: messages.Release, buffers: list, call: Call) -> messages.ReleaseReply:
        return messages.ReleaseReply(released_bytes=self._release(args.allocs, args.abandoned))

    def _is_open(self, aid: int) -> bool:
        """Allocation ``aid`` is still granted: pending, an open slab, or held for its live writer."""
        return aid in self.pending or aid in self.slabs or aid in self.held

    def _open_grants(self, grants: dict[int, int]) -> dict[int, int]:
        """The alloc requests of ``grants`` whose allocation is still open (the rest have ended)."""
        return {rid: aid for rid, aid in grants.items() if self._is_open(aid)}

    def _release(self, aids: list[int], abandoned: Sequence[int] = ()) -> int:
        """A same-host writer will not write into these allocations any more: ranges held for it
        past their lease are freed, an allocation it abandoned unstored is freed now, and an open
        slab closes as any other once its ids are settled. What ``abandoned`` alloc requests were
        granted is freed at once - a slab too, its ids settled with it: the writer never heard of
        them. Returns the bytes freed."""
        if len(self.grants) > 2 * (len(self.pending) + len(self.slabs) + len(self.held)) + 64:  # forget ended ones
            self.grants = self._open_grants(self.grants)
        released = 0
        now = time.monotonic()
        if len(self.abandoned) > 1024:
            self.abandoned = {r: t for r, t in self.abandoned.items() if now - t < self.alloc_lease_s}
        for rid in abandoned:
            aid = self.grants.pop(rid, -1)
            if aid == -1:
                self.abandoned[rid] = now
            elif aid in self.slabs:
                slab = self.slabs[aid]
                slab.unsettled.clear()  # ids nobody was told of: no commit can name them
                self.writers.pop(aid, None)
                self._settled(aid, slab)
                released += sum(size for _, size in slab.gaps())
            elif aid in self.pending or aid in self.held:
                aids = [*aids, aid]
        for aid in aids:
            if aid in self.held:
                released += self._release_held(aid)
            elif aid in self.pending:
                start, size, _ = self.pending.pop(aid)
                released += self._free_allocation(aid, [(start, size)], "X")
            elif aid in self.slabs:
                self.writers.pop(aid, None)
        return released

    def op_trim(self, args: messages.Trim, buffers: list, call: Call) -> messages.TrimReply:
        """Release the pages of every free arena range to the OS, and the memory this process only
        caches: idle buffers of past fetches (up to 256 MiB) and of received messages (up to
        ``stream_transport.RECEIVE_POOL_BYTES``), and free heap pages."""
        released = self.pool.cached_bytes + trim_receive_buffers()
        self.pool.clear()
        release_heap()
        self.trim_epoch += 1
        for start, size in self.alloc.free_ranges():
            self.arena.release_pages(start, size)
            released += size
        return messages.TrimReply(released_bytes=released)

    def op_shutdown(self, args: messages.UnitShutdown, buffers: list, call: Call) -> messages.Stopping:
        self.stop()
        return messages.Stopping(stopping=True)

    def stats(self) -> messages.UnitStatsReply:
        slab_free = sum(size for s in self.slabs.values() for _, size in s.gaps())
        return messages.UnitStatsReply(
            **self.describe(),
            **self.server_stats(),
            blocks=len(self.blocks),
            # slab space no block took yet is reserved for its writer, not used: shown on its own
            bytes_used=self.alloc.used - slab_free,
            slab_bytes_reserved=slab_free,
            largest_free_bytes=self.alloc.largest_free(),
            bytes_live=int(sum(int(b.fields[f].row_offsets[-1]) for b in self.blocks.values() for f in b.fields)),
            bytes_stored_total=self.bytes_stored,
            bytes_served_total=self.bytes_served,
            pending_allocs=len(self.pending),
            slabs=len(self.slabs),
            tentative_blocks=len(self.tentative),
            parked_writes=len(self.parked),
            held_bytes=sum(size for ranges, _ in self.held.values() for _, size in ranges),
        )

    def close(self) -> None:
        super().close()
        liveness.remove_gone(os.path.dirname(self.arena.path))  # the service owns its directory: leave no litter
        self.journal.close(unlink=True)
        self.arena.close(unlink=True)


def run_storage_unit(
    unit_id: int,
    bind: str,
    controller: str,
    *,
    capacity: int,
    shm_dir: str = "/dev/shm",
    secret: bytes | None = None,
    max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES,
    register_timeout: float = 30.0,
    ready_file: str | None = None,
    watch_fd: int | None = None,
    recover_arena: str | None = None,
    rejoin: int | None = None,
    orphan_timeout_s: float | None = None,
    commit_lease_s: float = DEFAULT_COMMIT_LEASE_S,
    alloc_lease_s: float = DEFAULT_ALLOC_LEASE_S,
    fsync: str = "never",
    managed: bool = False,
    metrics: bool = False,
) -> None:
    """Start a unit, register it with the controller at ``controller`` and serve until shut down.

    Once registered, the unit's description (with the ``unit_id`` the controller assigned) is written
    as JSON to ``ready_file`` when given, so a launcher (e.g. a Ray actor) knows it is serving.
    With ``watch_fd`` (the read end of a pipe whose write end the launcher holds) the unit also stops,
    cleaning its arena up, when that pipe reaches EOF: the launcher closed it or died, however it died.
    With ``metrics`` it records latency histograms and bytes per op for the controller's metrics endpoint.
    """
    launch.raise_open_file_limit()  # a connection of each client holds a descriptor here
    unit = StorageUnit(
        unit_id,
        bind,
        capacity=capacity,
        shm_dir=shm_dir,
        secret=secret,
        max_message_bytes=max_message_bytes,
        recover_arena=recover_arena,
        orphan_timeout_s=orphan_timeout_s,
        commit_lease_s=commit_lease_s,
        alloc_lease_s=alloc_lease_s,
        fsync=fsync,
        managed=managed,
    )
    unit.metrics = metrics
    served = threading.Event()
    if watch_fd is not None:

        def watch() -> None:
            try:
                while os.read(watch_fd, 4096):
                    pass
            except OSError:
                pass
            # Repeat: a stop() issued before serve_forever() starts would be overwritten by it.
            while not served.is_set():
                unit.stop()
                served.wait(0.1)

        threading.Thread(target=watch, name="tq-unit-watch", daemon=True).start()

    def exit_now(*_: Any) -> None:
        raise SystemExit(0)  # before serving: unwind through the cleanup below, removing the arena

    # SIGINT as SIGTERM: a Ctrl-C in the terminal reaches every process of its group - the launcher,
    # the controller and this unit - and is a shutdown, not an error to print a traceback for.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, exit_now)
    may_hold_data = recover_arena is not None  # acknowledged data: a restarted unit's arena, or once serving
    try:
        chan = RpcChannel(
            controller, secret=secret, timeout=register_timeout, name="controller", replies=messages.CONTROLLER_REPLY_DECODERS
        )
        registered, _ = chan.call(messages.ControllerOp.REGISTER_UNIT, messages.RegisterUnit(**unit.describe(), rejoin=rejoin))
        chan.close()
        unit.unit_id = registered.unit_id  # the controller numbers units in registration order
        unit.metrics = metrics or registered.metrics
        if ready_file:
            launch.write_json(ready_file, unit.describe())
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: unit.stop())
        may_hold_data = True
        unit.serve_forever()
    except ServerMustStop as stop:  # as after a crash: the arena and journal stay for the restart
        unit.close_after_last_reply()
        raise SystemExit(f"tq storage unit {unit.unit_id}: {stop.error}") from None
    except Exception:
        # A bug, not a shutdown: a managed unit that may hold acknowledged data (it served, or it
        # was restarted on an arena) leaves arena and journal as a crash would, for the controller's
        # restart - which gives the arena up itself after 3 crashes a minute. Others clean up.
        if unit.managed and may_hold_data:
            log.critical("storage unit %d failed; its arena and journal stay for its restart", unit.unit_id, exc_info=True)
        else:
            unit.close()
        raise
    except BaseException:  # SIGTERM / SIGINT before serving, or the watched pipe: a shutdown
        unit.close()
        raise
    finally:
        served.set()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Run one TQ storage unit (normally started by tq-controller).")
    p.add_argument("--unit-id", type=argtypes.count, required=True)
    p.add_argument("--bind", required=True, help="e.g. tcp://127.0.0.1:0")
    p.add_argument("--controller", required=True)
    p.add_argument("--capacity", type=argtypes.size, required=True, help="arena bytes, e.g. 4G")
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--max-message-bytes", type=argtypes.size, default=protocol.DEFAULT_MAX_MESSAGE_BYTES)
    p.add_argument("--ready-file", help="write the registered unit's description here as JSON once serving")
    p.add_argument("--watch-fd", type=argtypes.count, help="stop when this inherited file descriptor (a pipe) reaches EOF")
    p.add_argument("--recover-arena", help="restart after a crash: reopen this arena and replay its journal")
    p.add_argument("--rejoin", type=argtypes.count, help="take over this unit id at the controller (with --recover-arena)")
    p.add_argument("--orphan-timeout", type=argtypes.positive_seconds, help="stop after this many seconds without a controller heartbeat")
    p.add_argument(
        "--commit-lease",
        type=argtypes.positive_seconds,
        default=DEFAULT_COMMIT_LEASE_S,
        help="seconds a stored block waits for its commit before the controller is asked to resolve it",
    )
    p.add_argument(
        "--alloc-lease",
        type=argtypes.positive_seconds,
        default=DEFAULT_ALLOC_LEASE_S,
        help="seconds a writer has to fill a range it was granted, once its process is gone",
    )
    p.add_argument("--fsync", choices=("never", "always", "interval"), default="never", help="journal fsync policy")
    p.add_argument("--managed", action="store_true", help="started by the controller, which restarts it on its arena if it dies")
    p.add_argument(
        "--metrics", action="store_true", help="record latency histograms and bytes per op (for the controller's --metrics-port endpoint)"
    )
    a = p.parse_args(argv)
    secret = os.environ.get("TQ_SECRET")
    logging.basicConfig(level=os.environ.get("TQ_LOG_LEVEL", "WARNING"))
    run_storage_unit(
        a.unit_id,
        a.bind,
        a.controller,
        capacity=a.capacity,
        shm_dir=a.shm_dir,
        secret=secret.encode() if secret else None,
        max_message_bytes=a.max_message_bytes,
        ready_file=a.ready_file,
        watch_fd=a.watch_fd,
        recover_arena=a.recover_arena,
        rejoin=a.rejoin,
        orphan_timeout_s=a.orphan_timeout,
        commit_lease_s=a.commit_lease,
        alloc_lease_s=a.alloc_lease,
        fsync=a.fsync,
        managed=a.managed,
        metrics=a.metrics,
    )


if __name__ == "__main__":
    main()
