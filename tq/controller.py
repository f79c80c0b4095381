"""The TQ controller: metadata only - partitions, keys, field status and schemas, placement, waits.

It never touches column bytes and never blocks on a request: a ``wait`` (or a ``hello`` arriving before
the storage units registered) is parked with a deadline and answered from the loop. Storage is freed by
fire-and-forget messages to the units over DEALER sockets polled in the same loop; those sends never
block either: work a unit cannot take now is not queued without bound but settled by a ``retain`` (the
full list of what it must keep) once it answers again.

Commits are idempotent and fenced. A storage unit keeps every block it stored *tentative* until this
controller claims it (its commit was applied) or fences it (it never will be: the put was refused, or
its writer gave up, or it waited past its lease for a commit). A fenced block is freed, and a commit
naming it later - a stalled request, a retry - is refused, so a key can never come to point at
storage that was freed or reused. Each unit reports a low-water mark (every block id below it is
claimed or freed), which bounds what the controller remembers about blocks.
"""

from __future__ import annotations

import argparse
import collections
import errno
import hashlib
import itertools
import logging
import os
import signal
import struct
import time
from typing import Any, Callable

import numpy as np
import zmq

from . import argtypes, launch, liveness, stream_transport, messages, protocol
from .errors import (
    CapacityError,
    DuplicateKeyError,
    FencedCommitError,
    FieldNotProducedError,
    InvalidRequestError,
    JournalError,
    KeyNotFoundError,
    PartitionExistsError,
    PartitionNotFoundError,
    SchemaConflictError,
    StorageUnitError,
    TQError,
    TQTimeoutError,
)
from .arena import host_identity
from .journal import Journal
from .leases import LeaseBook, leased_blocks, new_lease_id
from .locations import FEW_ROWS, LocationTable, remove_orphans, slots_index, take_records
from .messages import ControllerOp as Op
from .partition import Partition, Waiter, put_at, rows_at
from .meta import MAX_FIELDS, MAX_TAG_NAMES
from .pins import POLL_S as PIN_POLL_S, SUPPORTED as PINS_SUPPORTED, PinBoard
from .request_book import RequestBook
from .recovery import COMPACT_AFTER, JournalRecovery  # noqa: F401 - COMPACT_AFTER: tq.controller's API
from .supervision import UNIT_LOST_S, UnitLedger, UnitSupervision
from .protocol import LOC_BLOCK as BLOCK, LOC_COLUMNS, LOC_NBYTES as NBYTES  # location
from .protocol import LOC_ROW as ROW, LOC_UNIT as UNIT  # record columns
from .rpc import DEFERRED, Call, RpcServer, ServerMustStop
from .schema import FieldSchema

log = logging.getLogger(__name__)

PIN_PRUNE_S = 5.0  # how often the pin files of clients that closed or died are let go
PARENT_CHECK_S = 0.5  # how often a controller started with parent_pid checks that its starter lives
RECENT_COMMITS = 1 << 12  # settled commits remembered so that a resent one is answered like the first


def _pin_holds(deadline_ns: int | None, holder: liveness.Holder | None, now_ns: int, directory: str | None) -> bool:
    """Whether a reader's pin (its slot's deadline, None once given up) still pins its blocks: in
    time, or past it while its reader's process on this host runs (paused: its views live on)."""
    return deadline_ns is not None and (deadline_ns > now_ns or liveness.runs(holder, directory))


class Controller(UnitSupervision, JournalRecovery, RpcServer):
    """The controller process's server (see module docstring): the ops and the partition state here,
    its storage units in :class:`~tq.supervision.UnitSupervision`, crash recovery in
    :class:`~tq.recovery.JournalRecovery`."""

    def __init__(
        self,
        bind: str,
        *,
        secret: bytes | None = None,
        expected_units: int = 0,
        max_message_bytes: int = 256 << 20,
        journal_dir: str | None = None,
        shm_dir: str | None = "/dev/shm",
        fsync: str = "never",
        stream_port: int = 0,
        unit_lost_s: float = UNIT_LOST_S,
    ) -> None:
        super().__init__("controller", bind, secret=secret, max_message_bytes=max_message_bytes)
        # Location tables go to shared memory when there is a tmpfs to hold them (see tq.locations).
        self.shm_dir = shm_dir if shm_dir is not None and os.access(shm_dir, os.W_OK | os.X_OK) else None
        if self.shm_dir is not None and remove_orphans(self.shm_dir):
            log.warning("removed location tables of controllers that are gone from %s", self.shm_dir)
        self.host = host_identity()
        self._published_down = 0
        self.journal: Journal | None = None
        self._snapshot_bytes = 0  # size of the journal right after its last compaction
        self._replaying = False
        self.stop_units_on_close = False
        # set by serve() for a service started in code (TQServer): the process that started us; once
        # it is gone we stop as on SIGTERM, as Ray's actors die with their driver
        self.parent_pid: int | None = None
        self._next_parent_check = 0.0
        self.partitions: dict[str, Partition] = {}
        self.units: list[dict[str, Any]] = []
        self.unit_socks: dict[int, Any] = {}
        self.unit_streams: dict[int, stream_transport.StreamPeer] = {}  # units of this host, reached over their Unix socket
        self.expected_units = expected_units
        self.waiters: list[Waiter] = []
        self.unit_seen: dict[int, float] = {}  # last time each storage unit answered
        self.unit_lost_s = unit_lost_s  # silent this long, a unit is given up on (see supervision.UNIT_LOST_S)
        self.units_version = 0  # bumped whenever a unit registers or rejoins (clients refresh on change)
        self.restart_unit: Any = None  # set by serve(): restarts a crashed unit of this controller
        self._restarts: dict[int, list[float]] = {}
        self._restarting: dict[int, Any] = {}  # unit id -> the process restarted for it, until it rejoins
        self.ledgers: dict[int, UnitLedger] = collections.defaultdict(UnitLedger)
        # (unit, block) -> commit digest of recent commits: a retried commit gets the first one's answer
        self.recent_commits: collections.OrderedDict[tuple[int, int], int] = collections.OrderedDict()
        self.request_book = RequestBook()  # requests with an id (see _once): sent again answered again, late ones fenced
        self._next_adopted_check = 0.0
        self._next_heartbeat = 0.0
        self._next_unit_flush = 0.0
        self.children: list[Any] = []  # storage-unit processes this controller started (serve())
        self.hello_waiters: list[tuple[Call, float]] = []
        self.bytes_committed = 0
        self.bytes_read: dict[int, int] = {}  # per storage unit, counted at locate
        self.recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=4096)
        self.lease_book = LeaseBook()  # blocks borrowed gets view in place (see tq.leases)
        # same-host readers' pin files (tq.pins): read at every free, where a location table is shared
        self.pin_board = PinBoard(self.shm_dir) if self.shm_dir is not None and PINS_SUPPORTED else None
        # written into every table: a reader pins only against tables of the board it registered with
        # (a controller started anew reads none of the files its predecessor had registered)
        self.pin_epoch = new_lease_id() if self.pin_board is not None else 0
        self._next_pin_prune = 0.0
        self._next_liveness_sweep = time.monotonic() + liveness.SWEEP_S  # swept once at start (below), then every SWEEP_S
        self.serve_ops(
            messages.CONTROLLER_REQUESTS,
            {
                Op.HELLO: self.op_hello,
                Op.REGISTER_UNIT: self.op_register_unit,
                Op.CREATE_PARTITION: self._once(Op.CREATE_PARTITION, self.op_create_partition),
                Op.CLEAR_PARTITION: self._once(Op.CLEAR_PARTITION, self.op_clear_partition),
                Op.DROP_PARTITION: self._once(Op.DROP_PARTITION, self.op_drop_partition),
                Op.LIST_PARTITIONS: self.op_list_partitions,
                Op.MINT: self._once(Op.MINT, self.op_mint),
                Op.COMMIT: self.op_commit,
                Op.ABORT_BLOCKS: self.op_abort_blocks,
                Op.ABORT_REQUESTS: self.op_abort_requests,
                Op.LOCATE: self.op_locate,
                Op.WAIT: self.op_wait,
                Op.DISCARD: self._once(Op.DISCARD, self.op_discard),
                Op.GET_META: self.op_get_meta,
                Op.SET_TAGS: self._once(Op.SET_TAGS, self.op_set_tags),
                Op.LEASES: self.op_leases,
                Op.BORROW: self.op_borrow,
                Op.PIN_FILE: self.op_pin_file,
                Op.UNIT_STATUS: self.op_unit_status,
                Op.STATS: lambda a, b, c: self._count_reads(a) or self.stats(),
                Op.SHUTDOWN: self.op_shutdown,
            },
        )
        # this host's clients skip ZMQ's I/O threads (tq.stream_transport); a controller restarted on its
        # journal listens where its clients found it before; ``stream_port``: the operator's TCP port for it
        try:
            if journal_dir is None:
                self.listen_streams(tcp_port=stream_port, exact_port=bool(stream_port))
            else:  # restarted on its journal, it is found where its clients' streams were
                port = stream_port or stream_transport.remembered_port(journal_dir)
                self.listen_streams(stream_transport.stable_token(journal_dir), port, exact_port=bool(stream_port))
        except OSError as exc:
            self.close()
            raise InvalidRequestError(f"--stream-port {stream_port}: {exc.strerror}") from None
        if journal_dir is not None:  # crash recovery: replay what was journaled, then keep journaling
            if self.tcp is not None:
                stream_transport.remember_port(journal_dir, self.tcp.sock.getsockname()[1])
            path = os.path.join(journal_dir, "controller.journal")
            try:
                self._replay(path)
            except JournalError:
                self.close()
                raise
            self.journal = Journal(path, fsync=fsync)
            if self.journal.truncated_bytes:
                log.warning("controller journal %s: dropped a torn tail of %d bytes", path, self.journal.truncated_bytes)
            self.expected_units = max(self.expected_units, len(self.units))
            for uid in range(len(self.units)):  # frees lost with the crash: settle them once each unit answers
                self.ledgers[uid].resync = True
        self._sweep_gone_files()  # after the journal registered its pin files again

    def _sweep_gone_files(self) -> None:
        """Unlink what processes that exited left in the shared-memory directory: readers' liveness
        files and pin files no controller reads (files a pin board reads go once their pins end)."""
        if self.shm_dir is None:
            return
        liveness.remove_gone(self.shm_dir)
        if self.pin_board is not None and (n := self.pin_board.remove_orphans()):
            log.warning("removed %d pin files of clients that are gone from %s", n, self.shm_dir)

    # -- small helpers
    def _partition(self, pid: str) -> Partition:
        part = self.partitions.get(pid)
        if part is None:
            raise PartitionNotFoundError(f"partition {pid!r} is not registered")
        return part

    @staticmethod
    def _unique(keys: list[str]) -> None:
        if len(set(keys)) != len(keys):
            seen: set[str] = set()
            dup = next(k for k in keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise DuplicateKeyError(f"key {dup!r} appears more than once in the request")

    def _units_info(self) -> messages.HelloReply:
        # the unit maps are encoded as they are: the reply type describes them for the client
        return messages.HelloReply(
            units=self.units,  # type: ignore[arg-type]
            units_version=self.units_version,
            host=self.host,
            shm_dir=self.shm_dir,
            local_address=self.local.address if self.local is not None else None,
            stream_address=self.tcp.address if self.tcp is not None else None,
        )

    def _new_partition(self, pid: str, table: LocationTable | None = None) -> Partition:
        try:
            table = table or LocationTable(self.shm_dir, pin_epoch=self.pin_epoch)
        except OSError as exc:
            if exc.errno != errno.EMFILE:
                raise
            import resource

            raise CapacityError(
                f"the controller is out of file descriptors ({len(self.partitions)} partitions hold two each; its limit is "
                f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}): drop partitions no longer used, or raise the open-file "
                f"limit (ulimit -n) of the process that starts the service; partition {pid!r} was not made"
            ) from None
        part = Partition(pid, table)
        self._publish_status(part.table)
        return part

    # -- units
    def op_hello(self, args: messages.Hello, buffers: list, call: Call) -> messages.HelloReply | object:
        if len(self.units) >= self.expected_units:
            return self._units_info()
        self.hello_waiters.append((call, time.monotonic() + args.timeout))
        return DEFERRED

    def op_register_unit(self, args: messages.RegisterUnit, buffers: list, call: Call) -> messages.RegisterUnitReply:
        """Register a new storage unit, or (``rejoin``) a restarted one taking over its old id."""
        # a unit the controller started (``managed``) is supervised: restarted on its arena when it dies,
        # also by a later incarnation of this controller that took it back from the journal
        info = {
            "unit_id": args.unit_id,
            "address": args.address,
            "host": args.host,
            "arena_path": args.arena_path,
            "arena_size": args.arena_size,
            "pid": args.pid,
            "managed": args.managed,
            "local_address": args.local_address,
            "stream_address": args.stream_address,
        }
        rejoin = args.rejoin
        if rejoin is not None and rejoin >= len(self.units):
            raise InvalidRequestError(f"register_unit: no unit {rejoin!r} to rejoin")
        uid = len(self.units) if rejoin is None else rejoin  # new units are numbered in registration order
        info["unit_id"] = uid
        self._connect_unit(uid, info["address"], args.local_address)
        if rejoin is None:
            self.units.append(info)
        else:  # keep what it recovered that we still reference; it frees the rest
            self.units[uid] = info
            self._restarting.pop(uid, None)
            self._resync(uid)
            log.warning("storage unit %d rejoined at %s", uid, info["address"])
        self.units_version += 1
        self._publish_status()
        # metrics: whether the service exports them, so a unit started elsewhere (tq.ray_placement, a
        # rejoin) records its latency histograms and bytes without being told on its command line
        return messages.RegisterUnitReply(unit_id=uid, metrics=self.metrics)

    def op_unit_status(self, args: messages.UnitStatus, buffers: list, call: Call) -> messages.UnitStatusReply:
        unit = args.unit
        if unit >= len(self.units):
            raise InvalidRequestError(f"no storage unit {unit!r}")
        down = self._unit_down_for(unit, time.monotonic())
        if bool(down) != bool(self._published_down >> min(unit, 62) & 1):
            self._publish_status()  # a reader told "down" here must not read that unit through a table
        return messages.UnitStatusReply(alive=not down, down_for_s=down, address=self.units[unit]["address"], lost=self._unit_lost(down))

    def close(self) -> None:
        self._flush_units()  # what the coalescing window still held
        if self.stop_units_on_close:
            shutdown = protocol.request(messages.UnitOp.SHUTDOWN, 0, messages.UnitShutdown(), [], self.secret)
            for unit, sock in list(self.unit_socks.items()):
                if unit in self.unit_streams:  # after what waits on it there (adopts before the shutdown)
                    self._close_unit_stream(unit, shutdown)
                else:
                    try:
                        sock.send_multipart(shutdown, flags=zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
                self._extra_sockets.pop(sock, None)
                sock.close(linger=1000)  # let the shutdown request go out
        for part in self.partitions.values():
            part.table.close()
        if self.pin_board is not None:
            self.pin_board.close()
        if self.shm_dir is not None:  # readers' liveness files (tq.liveness) of processes that exited
            liveness.remove_gone(self.shm_dir)
        super().close()

    @staticmethod
    def _held_rows(part: Partition, slots: np.ndarray) -> np.ndarray:
        """The location records that these slots hold, over all fields."""
        if not slots.size or not part.locs:
            return np.empty((0, LOC_COLUMNS), np.int64)
        at = slots_index(slots)
        rows = np.concatenate([loc[at] for loc in part.locs.values()])
        return rows[rows[:, UNIT] >= 0]

    def _free_rows(self, part: Partition, rows: np.ndarray) -> None:
        """Have every unit free these rows. Their records must be gone from the location table already:
        ``freed`` tells same-host readers that copied them to copy again. The frees go out from the
        loop (:meth:`_flush_units`), after the op that freed them is journaled: a controller killed in
        between must not come back pointing at rows its units already freed."""
        part.table.freed()  # atomic, then a full fence: a reader's pin published before it is seen below
        if not self._replaying:
            self._adopt_pins()
        rows = self.lease_book.hold(rows)  # rows of borrowed blocks wait for their leases to end
        if self._replaying:
            return
        self._queue_frees(rows)

    def _queue_frees(self, rows: np.ndarray) -> None:
        """Queue these location records' (block, row) pairs for their units' next flush."""
        units = rows[:, UNIT]
        if units.size and (units == units[0]).all():  # the common case: all on one unit
            self.ledgers[int(units[0])].frees.append(rows[:, [BLOCK, ROW]])
            return
        for unit in np.unique(units).tolist():
            self.ledgers[unit].frees.append(rows[units == unit][:, [BLOCK, ROW]])

    # -- leases of borrowed gets (tq.leases)
    def _take_lease(
        self,
        blocks: list[tuple[int, int]],
        ttl: float,
        lease_id: int | None = None,
        pin: tuple[str, int] | None = None,
        holder: liveness.Holder | None = None,
    ) -> int:
        """Pin these (unit, block) pairs; journaled, so a restarted controller keeps the pins (each for
        a fresh term) and its ``retain`` keeps their rows. ``pin``: a reader's pin taken over (tq.pins),
        under the reader's lease id; ``holder``: the reader's process on this host (see Lease)."""
        lease_id = new_lease_id() if lease_id is None else lease_id
        self.lease_book.take(lease_id, ttl, blocks, pin=pin, holder=holder)
        self._journal(["__lease__", {"id": lease_id, "ttl": ttl, "blocks": blocks, "pin": pin, "holder": holder}, []])
        return lease_id

    def _holder(self, pid: int | None, file: str | None) -> liveness.Holder | None:
        """What tells whether a reader's process that says it runs on this host still runs: its
        liveness file in this controller's shared-memory directory, else its pid and start time
        (None if none runs)."""
        return liveness.identify(pid, file if self.shm_dir is not None else None)

    def _check_lease_id(self, lease_id: int | None) -> None:
        if lease_id is not None and lease_id in self.lease_book.leases:
            raise InvalidRequestError(f"lease id {lease_id} is in use (a reader must choose a new random id per lease)")

    def _adopt_pins(self) -> None:
        """Take every reader's pin that is not a lease yet as one, so the rows about to be freed in its
        blocks wait for it (called after the frees count was bumped: see tq.pins)."""
        if self.pin_board is None or not self.pin_board.files:
            return
        now = time.monotonic_ns()
        for p in self.pin_board.pins():
            owner = self.pin_board.owner(p.path)
            if p.lease not in self.lease_book.leases and _pin_holds(p.deadline_ns, owner, now, self.shm_dir):
                self._take_lease([(p.unit, b) for b in p.blocks], PIN_POLL_S, lease_id=p.lease, pin=(p.path, p.slot), holder=owner)

    def _register_pins(self, path: str) -> bool:
        """Read the pin file at ``path`` at every free from now on; False when this controller reads no
        pins. At replay a file gone meanwhile is skipped (its client closed or died)."""
        if self.pin_board is None:
            return False
        try:
            self.pin_board.register(path)
        except (OSError, ValueError) as exc:
            if self._replaying:
                return False
            raise InvalidRequestError(f"cannot read pin file {path!r}: {exc}") from None
        return True

    def op_pin_file(self, args: messages.PinFile, buffers: list, call: Call) -> messages.PinFileReply:
        return messages.PinFileReply(registered=self._register_pins(args.path), epoch=self.pin_epoch)

    def _poll_pins(self, expired: list[int], now: float) -> list[int]:
        """Of the leases whose time is up, those whose holder still runs on this host (paused, if it
        renewed nothing: its views live on) get another term, and pins still held (in their slot, and
        in time or of a running reader) another poll period; returns the others (to end)."""
        ended, now_ns = [], time.monotonic_ns()
        for i in expired:
            lease = self.lease_book.leases[i]
            if lease.pin is None:
                if liveness.runs(lease.holder, self.shm_dir):
                    lease.deadline = now + lease.ttl
                else:
                    ended.append(i)
            elif self.pin_board is not None and _pin_holds(self.pin_board.deadline(*lease.pin, i), lease.holder, now_ns, self.shm_dir):
                lease.deadline = now + PIN_POLL_S
            else:
                ended.append(i)
        return ended

    def _release_leases(self, ids: list[int]) -> None:
        """End these leases: rows freed under them (no other lease holding their block) are freed now."""
        if not any(i in self.lease_book.leases for i in ids):
            return
        self._journal(["__release__", {"ids": ids}, []])
        rows = self.lease_book.release(ids)
        if self._replaying:
            return
        self._queue_frees(rows)

    def op_borrow(self, args: messages.Borrow, buffers: list, call: Call) -> messages.BorrowReply:
        """Lease the blocks a same-host reader located in the shared table itself - only if it read this
        very table (``incarnation``), nothing of it was freed (``frees``) and no unit re-registered
        (``units_version``) since: then the rows it read are still the keys' rows, and from now on
        their frees wait for the lease. Otherwise no lease: the reader locates through ``locate``."""
        self._count_reads(args)
        part = self._partition(args.partition)
        if args.unit >= len(self.units):
            raise InvalidRequestError(f"borrow names storage unit {args.unit}; there are {len(self.units)}")
        table = part.table
        self._check_lease_id(args.lease_id)
        if (table.incarnation, table.frees, self.units_version) != (args.incarnation, args.frees, args.units_version) or not args.blocks:
            return messages.BorrowReply(lease=None)
        return messages.BorrowReply(
            lease=self._take_lease(
                [(args.unit, b) for b in args.blocks], args.lease_s, args.lease_id, holder=self._holder(args.holder, args.holder_file)
            )
        )

    def op_leases(self, args: messages.Leases, buffers: list, call: Call) -> messages.LeasesReply:
        """Renew the leases a borrower still holds, end those it gave up; answers which of the renewed
        ones had already ended (their term ran out: the borrower must not trust those views)."""
        self._release_leases(args.release)
        return messages.LeasesReply(ended=self.lease_book.renew(args.renew))

    def _rows_on(self, unit: int) -> np.ndarray:
        """What ``unit`` must keep: rows live keys reference, and rows freed under a lease."""
        return np.unique(np.concatenate([super()._rows_on(unit), self.lease_book.held_on(unit)]), axis=0)

    # -- partitions
    def op_create_partition(self, args: messages.CreatePartition, buffers: list, call: Call) -> messages.CreatePartitionReply:
        pid = args.partition  # 1 to MAX_NAME_CHARS characters (messages.Name)
        if pid in self.partitions:
            if not args.reuse:
                raise PartitionExistsError(f"partition {pid!r} already exists (pass reuse=True to clear and reuse it)")
            self._clear(self.partitions[pid])
            return messages.CreatePartitionReply(partition=pid, reused=True)
        self.partitions[pid] = self._new_partition(pid)
        return messages.CreatePartitionReply(partition=pid, reused=False)

    def _clear(self, part: Partition, *, drop: bool = False) -> int:
        n = len(part.index)
        rows = self._held_rows(part, part.live_slots())
        if drop:
            part.table.close()
        else:
            part.table.reset()
            self.partitions[part.pid] = Partition(part.pid, part.table, prior_schemas={**part.prior_schemas, **part.schemas})
        self._free_rows(part, rows)
        return n

    def op_clear_partition(self, args: messages.ClearPartition, buffers: list, call: Call) -> messages.ClearPartitionReply:
        return messages.ClearPartitionReply(keys_cleared=self._clear(self._partition(args.partition)))

    def op_drop_partition(self, args: messages.DropPartition, buffers: list, call: Call) -> messages.DropPartitionReply:
        part = self._partition(args.partition)
        n = self._clear(part, drop=True)
        del self.partitions[part.pid]
        for w in [w for w in self.waiters if w.pid == part.pid]:
            self.waiters.remove(w)
            self.reply_error(w.call, PartitionNotFoundError(f"partition {part.pid!r} was dropped while waiting"))
        return messages.DropPartitionReply(keys_cleared=n)

    def op_list_partitions(self, args: messages.ListPartitions, buffers: list, call: Call) -> list[messages.PartitionSummary]:
        return [self._partition_summary(p) for p in self.partitions.values()]

    def _partition_summary(self, p: Partition) -> messages.PartitionSummary:
        live = p.live_slots()
        produced = {name: int((loc[live, UNIT] >= 0).sum()) for name, loc in p.locs.items()}
        fields = {name: messages.FieldSummary(p.schemas[name].describe(), produced.get(name, 0)) for name in p.schemas}
        return messages.PartitionSummary(p.pid, len(p.index), fields, p.bytes_held())

    # -- keys and fields
    def op_mint(self, args: messages.Mint, buffers: list, call: Call) -> messages.MintReply:
        part = self._partition(args.partition)
        keys = args.keys
        self._unique(keys)
        clash = next((k for k in keys if k in part.index), None)
        if clash is not None:
            raise DuplicateKeyError(f"key {clash!r} already exists in partition {part.pid!r}")
        part.add_keys(keys)
        return messages.MintReply(minted=len(keys), slot_table=part.table.incarnation, slots=part.slots_of(keys).tolist())

    def op_commit(self, args: messages.Commit, buffers: list, call: Call) -> messages.CommitReply:
        """Make stored blocks visible: new keys (``mode='put'``) or new fields of existing keys.

        ``blocks`` lists ``[unit, block, rows]`` parts covering the keys in order (one part unless the
        put was split over units). Idempotent and fenced: a retry of an applied commit gets the first
        answer again; a commit naming a block that was fenced or settled is refused with
        :class:`FencedCommitError`; any other refusal fences the blocks (the unit frees them), so a
        block is freed only on this controller's word and never while a key points at it."""
        keys = args.keys
        parts = self._commit_parts(args.blocks, len(keys))
        digest = self._commit_digest(args, keys)
        known = [self._committed_as(u, b) for u, b, _ in parts]
        if any(d is not None for d in known):
            if all(d == digest for d in known):  # a retry of a commit already applied
                return self._answer_again(args.partition, keys)
            raise InvalidRequestError("commit names a block already committed with other keys")
        settled = [(u, b) for u, b, _ in parts if self.ledgers[u].settled(b)]
        if settled:
            u, b = settled[0]
            how = (
                "was reclaimed before this commit arrived (its write timed out, was aborted or refused)"
                if b in self.ledgers[u].fenced
                else "is settled: reclaimed, or committed by an earlier request"
            )
            raise FencedCommitError(f"block {b} of storage unit {u} {how}: this commit makes nothing visible")
        try:
            rows_of = self._commit_rows(args, buffers, len(keys))
            adopts = self._adopts(args, rows_of, parts)
            result = self._apply_commit(args, rows_of, keys, parts)
        except TQError:
            for unit, block, _ in parts:  # this put will never land: its storage goes back now
                self._fence(unit, [block])
            raise
        for i, (unit, block, _) in enumerate(parts):
            led = self.ledgers[unit]
            led.pending[block] = digest
            if adopts:  # carved out of a slab: the unit learns of the block from us (after the journal)
                led.adopts[block] = adopts[i]
                if not self._replaying:  # replayed ones go out in the retain every unit gets after a restart
                    led.adopt_queue.append(block)
            else:
                led.claims.append(block)
            self.recent_commits[(unit, block)] = digest
        while len(self.recent_commits) > RECENT_COMMITS:
            self.recent_commits.popitem(last=False)
        return result

    @staticmethod
    def _adopts(
        args: messages.Commit, rows_of: dict[str, tuple[np.ndarray, np.ndarray]], parts: list[tuple[int, int, int]]
    ) -> list[messages.AdoptBlock] | None:
        """For a commit of blocks carved out of slabs: each block's layout, as its unit registers it
        (every field's rows of a part back to back, inside the part's range). ``rows_of``: per field,
        its rows' byte sizes and arena offsets."""
        if args.slabs is None:
            return None
        if len(args.slabs) != len(parts):
            raise InvalidRequestError(f"commit names {len(args.slabs)} slabs for {len(parts)} blocks")
        out, first = [], 0
        for (_, block, rows), (slab, start, size) in zip(parts, args.slabs):
            fields = {}
            for name, (nbytes, offsets) in rows_of.items():
                schema = args.fields[name].schema
                nb, off = nbytes[first : first + rows], offsets[first : first + rows]
                if nb.size != rows or off.size != rows:
                    raise InvalidRequestError(f"field {name!r}: row sizes and arena offsets for {nb.size} of {rows} rows")
                packed = _packed_rows(nb, off, start, size)
                if packed is None:
                    raise InvalidRequestError(f"field {name!r} of block {block}: rows not back to back inside its slab range")
                fields[name] = messages.AdoptField(schema, *packed)
            out.append(messages.AdoptBlock(block, slab, start, size, fields))
            first += rows
        return out

    def _commit_parts(self, parts: list[tuple[int, int, int]], n_keys: int) -> list[tuple[int, int, int]]:
        for unit, _, _ in parts:
            if unit >= len(self.units):
                raise InvalidRequestError(f"commit names unknown storage unit {unit!r}")
        if len({(u, b) for u, b, _ in parts}) != len(parts):
            raise InvalidRequestError("commit names the same block twice")
        if sum(r for _, _, r in parts) != n_keys:
            raise InvalidRequestError(f"commit: the blocks hold {sum(r for _, _, r in parts)} rows for {n_keys} keys")
        return parts

    @staticmethod
    def _commit_digest(args: messages.Commit, keys: list[str]) -> int:
        """What identifies a commit across retries: partition, mode and keys, hashed to 63 bits
        (stable across restarts: it is journaled)."""
        text = "\0".join([args.partition, args.mode, *keys])
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1

    def _committed_as(self, unit: int, block: int) -> int | None:
        return self.ledgers[unit].pending.get(block) or self.recent_commits.get((unit, block))

    def _answer_again(self, pid: str, keys: list[str]) -> messages.CommitReply:
        reply = messages.CommitReply(keys=len(keys), duplicate=True)
        part = self.partitions.get(pid)
        try:
            if part is not None:
                reply.slots, reply.slot_table = part.slots_of(keys).tolist(), part.table.incarnation
        except KeyNotFoundError:  # discarded since: the commit did land, the keys are gone now
            pass
        return reply

    def op_abort_blocks(self, args: messages.AbortBlocks, buffers: list, call: Call) -> messages.AbortBlocksReply:
        """A writer gives up on stored blocks (``[[unit, block], ...]``): each one not committed yet is
        fenced and freed. Answers, per block, whether its commit had been applied - so a writer
        whose commit reply was lost learns that its put did land."""
        for unit, block in args.blocks:
            if unit >= len(self.units):
                raise InvalidRequestError(f"abort_blocks: no block {block!r} on storage unit {unit!r}")
        committed = [self._committed_as(unit, block) is not None for unit, block in args.blocks]
        fence: dict[int, list[int]] = {}
        for (unit, block), landed in zip(args.blocks, committed):
            if not landed:
                fence.setdefault(unit, []).append(block)
        for unit, blocks in fence.items():  # one journal record and one message a unit: a slab given
            self._fence(unit, blocks)  # back names up to its 1,024 ids
        return messages.AbortBlocksReply(committed=committed)

    @staticmethod
    def _commit_rows(args: messages.Commit, buffers: list, n_keys: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per field of a commit, its rows' byte sizes and arena offsets, checked: one of each per key,
        none negative."""
        out = {}
        for name, spec in args.fields.items():
            nb = protocol.unpack_array(spec.row_nbytes, buffers, name=f"{name}.row_nbytes", dtype="<i8")
            off = protocol.unpack_array(spec.arena_offsets, buffers, name=f"{name}.arena_offsets", dtype="<i8")
            if nb.shape != (n_keys,) or off.shape != (n_keys,):
                raise InvalidRequestError(f"field {name!r}: {nb.size} row sizes and {off.size} arena offsets for {n_keys} keys")
            if n_keys and (_least(nb) < 0 or _least(off) < 0):
                raise InvalidRequestError(f"field {name!r}: row sizes and arena offsets must be >= 0")
            out[name] = (nb, off)
        return out

    def _apply_commit(
        self, args: messages.Commit, rows_of: dict[str, tuple[np.ndarray, np.ndarray]], keys: list[str], parts: list[tuple[int, int, int]]
    ) -> messages.CommitReply:
        part = self._partition(args.partition)
        self._unique(keys)
        mode = args.mode
        schemas = {n: FieldSchema.from_wire(spec.schema) for n, spec in args.fields.items()}
        for name, schema in schemas.items():
            known = part.schemas.get(name)
            if known is not None and known != schema:
                raise SchemaConflictError(
                    f"field {name!r} of partition {part.pid!r} is {known.describe()}; this write is {schema.describe()}"
                )
        self._check_field_count(part, schemas)
        tags = self._tags(part, args.tags, len(keys))
        seq = args.sequence_lengths
        if seq is not None and len(seq) != len(keys):
            raise InvalidRequestError("sequence_lengths must be a list of ints, one per key")

        # Validate everything before changing any state: a bad commit must leave the partition as it was.
        if mode == "put":
            known_slots = list(map(part.index.get, keys))
            new = keys  # all of them, unless some were minted before
            if known_slots.count(None) != len(keys):
                for k, s in zip(keys, known_slots):
                    if s is not None and any(loc[s, UNIT] >= 0 for loc in part.locs.values()):
                        raise DuplicateKeyError(f"key {k!r} already holds data in partition {part.pid!r}")
                new = [k for k, s in zip(keys, known_slots) if s is None]
        else:
            part.slots_of(keys)  # raises on unknown keys
            new = []
            for name in schemas:
                if name in part.locs and not args.overwrite:
                    loc = part.locs[name]
                    slots = part.slots_of(keys)
                    taken = np.flatnonzero(loc[slots, UNIT] >= 0)
                    if taken.size:
                        raise SchemaConflictError(
                            f"field {name!r} was already produced for key {keys[int(taken[0])]!r} (pass overwrite=True to replace it)"
                        )
        for name in schemas:  # a new field's column and new keys' slots may remap the table (and fail
            part.loc(name)  # on a full tmpfs): before any state changes or records are written
        if new:
            part.add_keys(new)
        slots = part.slots_of(keys)
        released = self._overwritten_rows(part, slots, list(schemas)) if args.overwrite else None
        if len(parts) == 1:
            ((unit, block, _),) = parts
            rows: Any = np.arange(len(keys))
        else:
            counts = [r for _, _, r in parts]
            unit = np.repeat([u for u, _, _ in parts], counts)
            block = np.repeat([b for _, b, _ in parts], counts)
            rows = np.concatenate([np.arange(r) for r in counts])
        with part.table.writing():
            if any(part.prior_schemas.get(name, schemas[name]) != schemas[name] for name in schemas.keys() - part.schemas.keys()):
                part.table.schemas_changed()  # readers drop what they learnt before the clear
                part.prior_schemas = {}
            for name, schema in schemas.items():
                part.schemas[name] = schema
                part.table.write_rows(name, slots, unit, block, rows, *rows_of[name], one_block=len(parts) == 1)
        if released is not None:
            self._free_rows(part, released)
        at = rows_at(slots)
        for tname, values in tags.items():
            put_at(part.tags.setdefault(tname, [None] * part.capacity), at, values)
        if seq is not None:
            put_at(part.seq_lens, at, seq)
        total = sum(_total(nb) for nb, _ in rows_of.values())
        self.bytes_committed += total
        self.recent.append((time.monotonic(), total))
        self._check_waiters(part.pid)
        return messages.CommitReply(keys=len(keys), slot_table=part.table.incarnation, slots=slots.tolist())

    def _overwritten_rows(self, part: Partition, slots: np.ndarray, fields: list[str]) -> np.ndarray:
        """The rows that the overwritten fields of ``slots`` hold and that become free, unless another
        field of the same key still lives in the same block row (a block row is freed as a whole)."""
        old = [part.locs[f][slots] for f in fields if f in part.locs]
        if not old:
            return np.empty((0, LOC_COLUMNS), np.int64)
        others = [loc[slots] for f, loc in part.locs.items() if f not in fields]
        free = []
        for rec in old:
            held = rec[:, UNIT] >= 0
            for o in others:
                held &= ~((o[:, UNIT] == rec[:, UNIT]) & (o[:, BLOCK] == rec[:, BLOCK]))
            free.append(rec[held])
        # one (unit, block, row) per freed row, whichever fields pointed at it
        return np.unique(np.concatenate(free)[:, : ROW + 1], axis=0)

    @staticmethod
    def _check_field_count(part: Partition, schemas: dict[str, FieldSchema]) -> None:
        """At most MAX_FIELDS fields in a partition's location table, which keeps a column of records
        per field for every slot, across clears (readers keep the columns they learnt): 1,000 fields
        written to one key of a 20k-key partition took 933 MB of shared memory."""
        new = [name for name in schemas if name not in part.table.columns]
        if new and len(part.table.columns) + len(new) > MAX_FIELDS:
            raise InvalidRequestError(
                f"partition {part.pid!r} would hold {len(part.table.columns) + len(new)} fields (first new: {new[0]!r}; "
                f"fields count from the partition's making, across clears), more than MAX_FIELDS ({MAX_FIELDS}): "
                "reuse field names, or drop the partition and make it again"
            )

    @staticmethod
    def _tags(part: Partition, tags: dict[str, list[Any]] | None, n: int) -> dict[str, list[Any]]:
        """``tags`` checked: one value per key, and at most MAX_TAG_NAMES names in the partition with
        them (each name holds a value per slot of the partition: 2,000 names on a 20k-key partition
        took 300 MB of this process and get_meta 4 s)."""
        for name, values in (tags or {}).items():
            if len(values) != n:
                raise InvalidRequestError(f"tag {name!r} must list one value per key ({n})")
        new = [name for name in tags or () if name not in part.tags]
        if new and len(part.tags) + len(new) > MAX_TAG_NAMES:  # names it holds already stay writable
            raise InvalidRequestError(
                f"partition {part.pid!r} would hold {len(part.tags) + len(new)} tag names (first new: {new[0]!r}), more than "
                f"MAX_TAG_NAMES ({MAX_TAG_NAMES}): a per-sample value belongs in a tag's values, not in its name"
            )
        return tags or {}

    def _missing(self, part: Partition, keys: list[str], fields: list[str]) -> tuple[int, str | None]:
        """(number of missing (key, field) pairs, a description of the first one)."""
        slots = np.fromiter((part.index.get(k, -1) for k in keys), dtype=np.int64, count=len(keys))
        missing, first = 0, None
        unknown = np.flatnonzero(slots < 0)
        if unknown.size:
            missing += unknown.size * len(fields)
            first = f"key {keys[int(unknown[0])]!r} (not registered yet)"
        known = slots[slots >= 0]
        for name in fields:
            loc = part.locs.get(name)
            absent = np.flatnonzero(loc[known, UNIT] < 0) if loc is not None else np.arange(known.size)
            if absent.size:
                missing += absent.size
                if first is None:
                    first = f"field {name!r} of key {part.slot_keys[int(known[int(absent[0])])]!r}"
        return missing, first

    def op_locate(self, args: messages.Locate, buffers: list, call: Call) -> Any:
        """Where each (field, key) lives: one int64 ``[fields, keys, LOC_COLUMNS]`` array of location
        records (unit, block, row, bytes, arena offset; see :mod:`tq.protocol`). With ``timeout`` it
        first waits (parked, like ``wait``) until every pair is produced - a get that must wait for
        its fields still costs one round trip."""
        self._count_reads(args)
        part = self._partition(args.partition)
        keys, fields, timeout, lease_s, lease_id = args.keys, args.fields, args.timeout, args.lease_s, args.lease_id
        holder = self._holder(args.holder, args.holder_file) if lease_s is not None else None
        self._check_lease_id(lease_id)
        if timeout is not None:
            if self._missing(part, keys, fields)[0]:
                self.waiters.append(
                    Waiter(
                        call,
                        part.pid,
                        keys,
                        fields,
                        time.monotonic() + timeout,
                        lambda: self._locate(self.partitions[part.pid], keys, fields, lease_s, lease_id, holder),
                    )
                )
                return DEFERRED
        return self._locate(part, keys, fields, lease_s, lease_id, holder)

    def _locate(
        self,
        part: Partition,
        keys: list[str],
        fields: list[str],
        lease_s: float | None = None,
        lease_id: int | None = None,
        holder: liveness.Holder | None = None,
    ) -> tuple[messages.LocateReply, list]:
        slots = part.slots_of(keys)
        loc = np.empty((len(fields), len(keys), LOC_COLUMNS), dtype=np.int64)
        for f, name in enumerate(fields):
            if name not in part.schemas:
                raise FieldNotProducedError(f"field {name!r} was never produced in partition {part.pid!r}")
            take_records(part.locs[name], slots, loc[f])
        units = loc[:, :, UNIT]
        if units.size and units.min() < 0:
            f, absent = next((f, np.flatnonzero(units[f] < 0)) for f in range(len(fields)) if units[f].min() < 0)
            raise FieldNotProducedError(
                f"field {fields[f]!r} is not produced for {absent.size} of {len(keys)} keys "
                f"in partition {part.pid!r} (first: {keys[int(absent[0])]!r})"
            )
        now = time.monotonic()
        unreachable = []  # silent units holding rows: the reader waits for them (see supervision.UNIT_LOST_S)
        for unit in range(len(self.units)):
            age = self._unit_down_for(unit, now)
            hit = np.argwhere(units == unit) if age else ()
            if not len(hit):
                continue
            if not self._unit_lost(age):
                unreachable.append(unit)
                continue
            raise StorageUnitError(  # given up on: fail fast, naming the unit
                f"storage unit {unit} at {self.units[unit]['address']} is down ({messages.unit_down_reason(age)}): "
                f"{len(hit)} of the requested (key, field) pairs live there, first "
                f"{fields[int(hit[0, 0])]!r} of key {keys[int(hit[0, 1])]!r}"
            )
        # Same-host clients copy straight out of the arenas, so reads are counted here, not by the units.
        if len(self.units) == 1:
            self.bytes_read[0] = self.bytes_read.get(0, 0) + int(loc[:, :, NBYTES].sum())
        else:
            units_read = np.bincount(units.ravel(), weights=loc[:, :, NBYTES].ravel(), minlength=len(self.units))
            for unit, nb in enumerate(units_read.tolist()):
                self.bytes_read[unit] = self.bytes_read.get(unit, 0) + int(nb)
        frames: list[Any] = []
        schemas = {name: part.schemas[name].to_wire() for name in fields}
        reply = messages.LocateReply(
            schemas=schemas,
            loc=protocol.pack_array(loc, frames),
            units_version=self.units_version,
            table=part.table.descriptor(),  # type: ignore[arg-type] - its map, encoded as a TableRef
            frees=part.table.frees,
            lease=self._take_lease(leased_blocks(loc), lease_s, lease_id, holder=holder) if lease_s is not None else None,
            unreachable=unreachable or None,
        )
        return reply, frames

    def op_wait(self, args: messages.Wait, buffers: list, call: Call) -> Any:
        part = self._partition(args.partition)
        missing, first = self._missing(part, args.keys, args.fields)
        if not missing:
            return messages.WaitReply(ready=True)
        self.waiters.append(Waiter(call, part.pid, args.keys, args.fields, time.monotonic() + args.timeout))
        return DEFERRED

    def _check_waiters(self, pid: str) -> None:
        for w in [w for w in self.waiters if w.pid == pid]:
            if not self._missing(self.partitions[pid], w.keys, w.fields)[0]:
                self.waiters.remove(w)
                try:
                    result, frames = w.answer()
                except TQError as exc:  # e.g. a unit went down meanwhile
                    self.reply_error(w.call, exc)
                else:
                    self.reply(w.call, result, frames)

    def next_deadline(self) -> float | None:
        times = [w.deadline for w in self.waiters] + [d for _, d in self.hello_waiters]
        lease_end = self.lease_book.next_deadline()
        if lease_end is not None:
            times.append(lease_end)
        if self.unit_socks:
            times.append(self._next_heartbeat)
        flush = self._unit_flush_due()
        if flush is not None:
            times.append(flush)
        if self.parent_pid is not None:
            times.append(self._next_parent_check)
        return min(times, default=None)

    def on_applied(self, op: str, raw_args: Any, buffers: list) -> None:
        super().on_applied(op, raw_args, buffers)  # journaled first: frees leave only after that
        self._flush_frees_now()  # and before the reply (see _flush_frees_now)

    def on_tick(self, now: float) -> None:
        expired = self.lease_book.expired(now)
        if expired:
            ended = self._poll_pins(expired, now)
            gone = [i for i in ended if self.lease_book.leases[i].pin is None]
            if gone:  # their holders stopped renewing them (died, or hung): the rows they pinned go
                log.warning("%d leases of borrowed gets ran out without a renewal", len(gone))
            self._release_leases(ended)  # pins given up (or run out) among them
        if self.pin_board is not None and now >= self._next_pin_prune:
            self._next_pin_prune = now + PIN_PRUNE_S
            self.pin_board.prune(time.monotonic_ns())
        if now >= self._next_liveness_sweep:
            self._next_liveness_sweep = now + liveness.SWEEP_S
            self._sweep_gone_files()
        self._flush_units(now)
        self._heartbeat(now)
        if self.parent_pid is not None and now >= self._next_parent_check:
            self._next_parent_check = now + PARENT_CHECK_S
            if os.getppid() != self.parent_pid:  # reparented: the process that started us is gone
                log.warning("tq.controller: process %d, which started this service, is gone: stopping", self.parent_pid)
                self.stop()
        if self._running:  # once stopping (shutdown, SIGTERM, Ctrl-C), units that exit are not crashes
            self._reap_children()
        if self.units and self._down_units() != self._published_down:
            self._publish_status()
        for w in [w for w in self.waiters if w.deadline <= now]:
            self.waiters.remove(w)
            part = self.partitions.get(w.pid)
            missing, first = self._missing(part, w.keys, w.fields) if part else (len(w.keys), None)
            self.reply_error(
                w.call,
                TQTimeoutError(f"timed out waiting for {missing} (key, field) pairs in partition {w.pid!r}; first missing: {first}"),
            )
        if self.hello_waiters and (len(self.units) >= self.expected_units or any(d <= now for _, d in self.hello_waiters)):
            for c, _ in self.hello_waiters:
                self.reply(c, self._units_info())
            self.hello_waiters.clear()

    def _count_reads(self, args: messages.ReadsArgs) -> None:
        """Bytes a client read through the location tables since its last request (see tq.locations)."""
        reads = args.reads
        if reads is None or self._replaying:
            return
        if not all(u.isdigit() for u in reads):
            raise InvalidRequestError("'reads' must map storage unit ids to byte counts")
        for u, b in reads.items():
            self.bytes_read[int(u)] = self.bytes_read.get(int(u), 0) + b

    def op_discard(self, args: messages.Discard, buffers: list, call: Call) -> messages.DiscardReply:
        self._count_reads(args)
        part = self._partition(args.partition)
        keys = args.keys
        self._unique(keys)
        slots = part.slots_of(keys)
        rows = self._held_rows(part, slots)
        for k in keys:
            del part.index[k]
        at = slots_index(slots)
        put_at(part.slot_keys, at, [None] * len(keys))
        with part.table.writing():
            for loc in part.locs.values():
                loc[at] = -1
        part.free_slots.extend(slots.tolist())
        self._free_rows(part, rows)
        return messages.DiscardReply(discarded=len(keys))

    def _once(self, op: Op, handler: Callable[..., messages.OnceReply]) -> Callable[..., messages.OnceReply]:
        """``handler`` of a request its client gives an id (tq.request_book): applied once - sent again,
        it gets the first answer (a discard's reads are not counted twice); fenced by its client, it is
        dropped."""
        reply_type = messages.CONTROLLER_REPLIES[op]

        def once(args: Any, buffers: list, call: Call) -> messages.OnceReply:
            done = self.request_book.check(op, args.request_id)
            if done is not None:
                return reply_type.again(args, done)
            reply = handler(args, buffers, call)
            self.request_book.record(args.request_id, reply.count)
            return reply

        return once

    def op_abort_requests(self, args: messages.AbortRequests, buffers: list, call: Call) -> messages.AbortRequestsReply:
        """A client gives up on requests it got no reply to: each one not applied yet is fenced (see
        tq.request_book). Answers, per id, whether it had been applied."""
        return messages.AbortRequestsReply(applied=self.request_book.abort(args.ids))

    def op_get_meta(self, args: messages.GetMeta, buffers: list, call: Call) -> messages.GetMetaReply:
        """Keys (all, or the given ones), their tags and sequence lengths, and fields produced for all."""
        part = self._partition(args.partition)
        if args.keys is not None:  # a meta's keys are unique: a repeated one is named here, not by the reader's meta
            self._unique(args.keys)
        keys = args.keys if args.keys is not None else [k for k in part.slot_keys if k is not None]
        slots = part.slots_of(keys)
        sl = slots.tolist()
        produced = [n for n, loc in part.locs.items() if keys and bool((loc[slots, UNIT] >= 0).all())]
        seq = [part.seq_lens[s] for s in sl]
        return messages.GetMetaReply(
            keys=keys,
            slot_table=part.table.incarnation,
            slots=sl,
            fields=produced,
            sequence_lengths=None if any(v < 0 for v in seq) else seq,
            tags={name: [col[s] for s in sl] for name, col in part.tags.items()},
        )

    def op_set_tags(self, args: messages.SetTags, buffers: list, call: Call) -> messages.SetTagsReply:
        part = self._partition(args.partition)
        keys = args.keys
        at = rows_at(part.slots_of(keys))
        for name, values in self._tags(part, args.tags, len(keys)).items():
            put_at(part.tags.setdefault(name, [None] * part.capacity), at, values)
        return messages.SetTagsReply(keys=len(keys))

    def op_shutdown(self, args: messages.Shutdown, buffers: list, call: Call) -> messages.Stopping:
        for unit in list(self.unit_socks):
            self._send_to_unit(unit, messages.UnitOp.SHUTDOWN, messages.UnitShutdown(), [])
        self.stop()
        return messages.Stopping(stopping=True)

    def stats(self) -> messages.StatsReply:
        now = time.monotonic()
        # on copies: the registry itself goes out in hello replies and journal snapshots, where a
        # health of the last stats call would be stale
        units = []
        for u in self.units:
            down = self._unit_down_for(u["unit_id"], now)
            units.append({**u, "alive": not down, "down_for_s": down or None, "lost": self._unit_lost(down) if down else None})
        window = [(t, b) for t, b in self.recent if now - t <= 60.0]
        return messages.StatsReply(
            **self.server_stats(),
            partitions=[self._partition_summary(p) for p in self.partitions.values()],
            units=units,  # type: ignore[arg-type] - the unit maps, encoded as UnitInfo
            units_version=self.units_version,
            bytes_committed_total=self.bytes_committed,
            bytes_read_total={str(u): b for u, b in self.bytes_read.items()},
            put_bytes_per_s_60s=sum(b for _, b in window) / 60.0,
            parked_waits=len(self.waiters),
            leases=len(self.lease_book.leases),
            unit_ledgers={
                str(u): messages.LedgerSummary(led.low_water, len(led.pending), len(led.fenced), len(led.adopts))
                for u, led in self.ledgers.items()
            },
            rows_waiting_for_leases=self.lease_book.waiting_rows(),
            stream_address=self.tcp.address if self.tcp is not None else None,
        )


# Sums and minima of a commit's per-row arrays: Python's for a few rows (see tq.locations.FEW_ROWS)
def _least(a: np.ndarray) -> int:
    """The least entry of a non-empty int array."""
    return min(a.tolist()) if a.size <= FEW_ROWS else int(a.min())


def _total(a: np.ndarray) -> int:
    """The sum of an int array."""
    return sum(a.tolist()) if a.size <= FEW_ROWS else int(a.sum())


def _packed_rows(nb: np.ndarray, off: np.ndarray, start: int, size: int) -> tuple[int, bytes] | None:
    """For rows of ``nb`` bytes at arena offsets ``off`` (non-negative, at least one): the first row's
    offset and each row's offset from it (``rows + 1`` int64s, as bytes) if the rows lie back to back
    inside the arena range ``[start, start + size)``; None if not."""
    if nb.size <= FEW_ROWS:
        ends = list(itertools.accumulate(nb.tolist(), initial=0))
        offs = off.tolist()
        base = offs[0]
        if base < start or base + ends[-1] > start + size or any(o - base != e for o, e in zip(offs, ends)):
            return None
        return base, struct.pack(f"<{len(ends)}q", *ends)
    ro = np.zeros(nb.size + 1, dtype=np.int64)
    np.cumsum(nb, out=ro[1:])
    base = int(off[0])
    if (off != base + ro[:-1]).any() or base < start or base + int(ro[-1]) > start + size:
        return None
    return base, ro.tobytes()


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child before exec
    """Ask Linux to SIGTERM a storage unit when its controller dies (even by SIGKILL), so no unit and
    no shared-memory arena outlives the controller that started it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: a graceful controller shutdown still stops its units


def serve(
    bind: str,
    *,
    storage_units: int = 1,
    capacity: int = 4 << 30,
    shm_dir: str = "/dev/shm",
    unit_host: str | None = None,
    secret: bytes | None = None,
    ready_file: str | None = None,
    journal_dir: str | None = None,
    orphan_timeout_s: float = 60.0,
    fsync: str = "never",
    commit_lease_s: float | None = None,
    metrics_port: int | None = None,
    stream_port: int = 0,
    unit_lost_s: float = UNIT_LOST_S,
    parent_pid: int | None = None,
) -> None:
    """Run a controller and ``storage_units`` local storage-unit processes until shut down.

    The units split ``capacity`` evenly. Once bound, the controller writes its address as JSON to
    ``ready_file`` (and prints ``TQ_READY <address>``), so launchers never guess ports.

    With ``journal_dir`` the controller journals its state there and survives its own crash: restarted
    on the same address and ``journal_dir`` it replays the journal and takes its running storage units
    back (they outlive it for up to ``orphan_timeout_s`` without its heartbeat, then clean up and exit).
    Without it the units die with the controller.

    With ``metrics_port`` (0: a free one) the service's Prometheus metrics are served at
    ``http://<host>:<port>/metrics`` (see :mod:`tq.metrics`; the URL is in the ready file too).

    With ``parent_pid`` (the process that started this one, e.g. :class:`~tq.server.TQServer`'s
    caller) the service stops, as on SIGTERM, within ``PARENT_CHECK_S`` of that process dying by any
    means - a SIGKILL included - so a killed program leaves no service and no arena behind.
    """
    import subprocess

    from .server import check_bind_allowed

    check_bind_allowed(bind, secret)
    launch.raise_open_file_limit()  # a partition holds two descriptors here
    if parent_pid is not None and os.getppid() != parent_pid:  # gone already, or not our parent: nothing would stop us
        raise SystemExit(f"tq.controller: --parent-pid {parent_pid} is not this process's parent (its parent is {os.getppid()})")
    try:
        ctrl = Controller(
            bind,
            secret=secret,
            expected_units=storage_units,
            journal_dir=journal_dir,
            shm_dir=shm_dir,
            fsync=fsync,
            stream_port=stream_port,
            unit_lost_s=unit_lost_s,
        )
    except Exception as exc:  # a port in use, a journal it cannot read: its launcher names it (await_ready_file)
        if ready_file:
            launch.write_json(ready_file, {"error": f"{type(exc).__name__}: {exc}"})
        raise
    env = launch.service_env(secret.decode() if secret else None)
    metrics = None
    if metrics_port is not None:  # the endpoint is a process of its own: a scrape never holds our GIL
        ready = launch.new_ready_file("tq-metrics-ready-")
        metrics = subprocess.Popen(
            launch.metrics_command(
                controller=ctrl.address,
                host=bind.split("://", 1)[1].rsplit(":", 1)[0],
                port=metrics_port,
                ready_file=ready,
                pid=os.getpid(),
            ),
            env=env,
            preexec_fn=_die_with_parent,
        )
        try:
            info = launch.await_ready_file(ready, alive=lambda: metrics.poll() is None, timeout=60, what="the metrics endpoint")
        except TQError as exc:  # its port in use, say: named in the error
            launch.stop_process(metrics, 5.0)
            ctrl.close()
            raise SystemExit(f"tq.controller: {exc}") from None
        ctrl.metrics, ctrl.metrics_url = True, info["url"]
    recovered = bool(ctrl.units)
    ctrl.stop_units_on_close = journal_dir is not None  # they do not die with us: stop them on a clean exit
    ctrl.parent_pid = parent_pid
    host = unit_host or bind.split("://", 1)[1].rsplit(":", 1)[0]
    per_unit = argtypes.unit_capacity(storage_units, capacity)  # checked before anything started (main, TQServer, the CLI)

    def spawn(unit_id: int, recover_arena: str | None = None) -> subprocess.Popen:
        cmd = launch.storage_unit_command(
            unit_id=unit_id,
            bind=f"tcp://{host}:0",
            controller=ctrl.address,
            capacity=per_unit,
            shm_dir=shm_dir,
            managed=True,
            fsync=fsync,
            commit_lease=commit_lease_s,
            recover_arena=recover_arena,
            rejoin=unit_id if recover_arena is not None else None,
            metrics=metrics is not None,
            # with a journal, a unit outlives a crashed controller until it comes back (or time runs out)
            orphan_timeout=orphan_timeout_s if journal_dir is not None else None,
        )
        if journal_dir is not None:
            return subprocess.Popen(cmd, env=env)
        return subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)

    procs = [] if recovered else [spawn(i) for i in range(storage_units)]
    ctrl.restart_unit = spawn
    ctrl.children = procs
    signal.signal(signal.SIGTERM, lambda *_: ctrl.stop())
    signal.signal(signal.SIGINT, lambda *_: ctrl.stop())
    if ready_file:
        launch.write_json(ready_file, {"address": ctrl.address, "pid": os.getpid(), "metrics_url": ctrl.metrics_url})
    print(f"TQ_READY {ctrl.address}", flush=True)
    try:
        ctrl.serve_forever()
    except ServerMustStop as stop:  # exit as after a crash: nothing more served or ticked
        ctrl.close_after_last_reply()
        ctrl.children = []  # the units outlive us (journal dir): a restart takes them back
        raise SystemExit(f"tq.controller: {stop.error}") from None
    except Exception:
        if journal_dir is not None:  # a bug: exit as after a crash; the units (and their data) outlive us
            log.critical("tq.controller failed; its storage units keep running for its restart", exc_info=True)
            ctrl.children = []
        raise
    finally:
        if metrics is not None:
            launch.stop_process(metrics, 5.0)
        for p in ctrl.children:  # all at once, then wait: they clean up in parallel
            if p.poll() is None:
                p.terminate()
        for p in ctrl.children:
            launch.stop_process(p, 10.0)
        ctrl.remove_arenas_of(ctrl.children)


def argument_parser() -> argparse.ArgumentParser:
    """The controller's command line (also what :class:`~tq.server.TQServer` checks its settings with)."""
    p = argparse.ArgumentParser(description="Run the TQ controller and its local storage units in the foreground.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=argtypes.port, default=0, help="0..65535 (0: pick a free one)")
    p.add_argument("--stream-port", type=argtypes.port, default=0, metavar="PORT", help=launch.STREAM_PORT_HELP)
    p.add_argument("--storage-units", type=argtypes.count, default=1)
    p.add_argument("--capacity", type=argtypes.size, default=4 << 30, help="total bytes over all units, e.g. 4G")
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--ready-file")
    p.add_argument(
        "--journal-dir",
        type=argtypes.directory,
        metavar="DIR",
        help="crash recovery: journal partitions and keys here; a restart on the same address and dir recovers them",
    )
    p.add_argument("--state-dir", dest="journal_dir", action=argtypes.deprecated_alias("--journal-dir"), help=argparse.SUPPRESS)
    p.add_argument(
        "--fsync",
        choices=("never", "always", "interval"),
        default="never",
        help="journal fsync policy of the controller and its units (see tq.journal): 'never' survives "
        "process crashes, 'interval'/'always' also power loss of the journal (arenas live in tmpfs)",
    )
    p.add_argument(
        "--commit-lease",
        type=argtypes.positive_seconds,
        help="seconds a stored block waits for its commit before its storage "
        "unit asks for it to be resolved (claimed or reclaimed); default 30",
    )
    p.add_argument(
        "--metrics-port",
        type=argtypes.port,
        metavar="PORT",
        help="serve the service's Prometheus metrics at http://HOST:PORT/metrics (0: a free port; "
        "default: $TQ_METRICS_PORT, else no metrics)",
    )
    p.add_argument("--unit-lost-s", type=argtypes.positive_seconds, default=UNIT_LOST_S, metavar="SECONDS", help=launch.UNIT_LOST_HELP)
    p.add_argument(
        "--parent-pid",
        type=argtypes.count,
        metavar="PID",
        help="stop (as on SIGTERM) once this process, the one that started the controller, is gone (TQServer passes its own)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    p = argument_parser()
    a = p.parse_args(argv)
    if a.metrics_port is None and os.environ.get("TQ_METRICS_PORT"):  # a service a program starts (a trainer's TQServer)
        try:
            a.metrics_port = argtypes.port(os.environ["TQ_METRICS_PORT"])
        except argparse.ArgumentTypeError as exc:
            p.error(f"TQ_METRICS_PORT: {exc}")
    try:
        argtypes.unit_capacity(a.storage_units, a.capacity)
    except InvalidRequestError as exc:
        p.error(str(exc))
    logging.basicConfig(level=os.environ.get("TQ_LOG_LEVEL", "WARNING"))
    secret = os.environ.get("TQ_SECRET")
    serve(
        f"tcp://{a.host}:{a.port}",
        storage_units=a.storage_units,
        capacity=a.capacity,
        shm_dir=a.shm_dir,
        secret=secret.encode() if secret else None,
        ready_file=a.ready_file,
        journal_dir=a.journal_dir,
        fsync=a.fsync,
        commit_lease_s=a.commit_lease,
        metrics_port=a.metrics_port,
        stream_port=a.stream_port,
        unit_lost_s=a.unit_lost_s,
        parent_pid=a.parent_pid,
    )


if __name__ == "__main__":
    main()
