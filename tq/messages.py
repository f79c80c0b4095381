"""Every TQ request and reply, defined once: an op enum per server, one typed struct of arguments per
op and one typed struct (or list of structs) of its result.

A server decodes a request's ``args`` straight into the struct of its op (``msgspec``'s typed msgpack
decoder), so a handler receives values of the declared types and holds only the state changes and
the checks that need state (does the partition exist, is the block fenced...). Shape and type checks -
"a list of strings", "an int >= 0 that is not a bool", "one of put / write_back" - live here, in the
types; a request that does not fit is refused with :class:`~tq.errors.InvalidRequestError` naming the
op and the path of the bad value (e.g. ``commit: Expected `int`, got `str` - at `$.blocks[0][1]```).

The framing around the args (header, HMAC, buffer frames, versioning, size limits) is
:mod:`tq.protocol`'s alone. Bulk data never travels in args: an :class:`ArrayRef` points at one of
the message's buffer frames, and :func:`tq.protocol.unpack_array` checks it against that frame.

A client decodes a reply's ``result`` the same way, into the reply type of its op
(:data:`CONTROLLER_REPLIES`, :data:`UNIT_REPLIES`, through :class:`ReplyDecoder`): a result that does
not fit is refused with :class:`~tq.errors.MalformedMessageError` naming the op and the path of the bad
value (``reply to 'locate': Expected `int`, got `str` - at `$.units_version```).

Structs are maps on the wire (field names as keys), so the wire format is the one clients and journals
already speak; unknown keys are ignored (a newer client may send more). A reply field with a default
is left out while it holds it, as the hand-built maps before them left optional keys out.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, ClassVar, Literal, Union

import msgspec

from .errors import InvalidRequestError, MalformedMessageError, TQError
from .liveness import NAME_PATTERN
from .meta import MAX_FIELDS, MAX_NAME_CHARS, MAX_PAD_LENGTH, MAX_TAG_CHARS, MAX_TAG_NAMES

BLOCK_ID_LIMIT = 1 << 40  # storage units number blocks from 1 and never get near this
UNIT_ENDED_S = 1e9  # a unit's down_for_s once its process ended (its controller saw it exit)


def unit_down_reason(down_for_s: float) -> str:
    """Why a unit reported down with ``down_for_s`` is down, in words."""
    return "its process ended" if down_for_s >= UNIT_ENDED_S else f"no answer for {down_for_s:.1f}s"


# a process's liveness file in a server's shared-memory directory (tq.liveness), which the server opens
LivenessFile = Annotated[str, msgspec.Meta(pattern=f"^{NAME_PATTERN}$")]

Count = Annotated[int, msgspec.Meta(ge=0)]  # msgspec never takes a bool for an int
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=BLOCK_ID_LIMIT)]
LeaseId = Annotated[int, msgspec.Meta(gt=0, le=(1 << 63) - 1)]  # a borrowed get's lease (a reader may choose it)
# Seconds to wait: finite (a NaN or infinity would park a request forever) and >= 0.
MAX_SECONDS = 1e9  # the longest time a request may name (a wait, a lease)
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SECONDS)]
# The id a client gives a request that changes a partition (discard, clear_partition, drop_partition,
# create_partition - which may clear one with ``reuse`` -, mint, set_tags): the controller answers the same request sent again with the first one's reply, and drops one whose
# client fenced it (AbortRequests) before it arrived (see tq.request_book).
RequestId = Annotated[int, msgspec.Meta(gt=0, le=(1 << 63) - 1)]
TagValue = Union[None, bool, int, float, str]
# A tag value a request stores (KVBatchMeta checks the same bound; replies carry TagValue).
NewTagValue = Union[None, bool, int, float, Annotated[str, msgspec.Meta(max_length=MAX_TAG_CHARS)]]
# A partition id, key, field or tag name a request creates or names (KVBatchMeta checks the same bound).
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
# The tags a request stores (KVBatchMeta checks the same bounds; a partition's names are counted too).
NewTags = Annotated[dict[Name, list[NewTagValue]], msgspec.Meta(max_length=MAX_TAG_NAMES)]
# A sample's unpadded length (KVBatchMeta checks the same bound).
SequenceLength = Annotated[int, msgspec.Meta(ge=0, le=MAX_PAD_LENGTH)]


class ControllerOp(enum.StrEnum):
    """The controller's operations (the ``op`` of a request header)."""

    HELLO = "hello"
    REGISTER_UNIT = "register_unit"
    CREATE_PARTITION = "create_partition"
    CLEAR_PARTITION = "clear_partition"
    DROP_PARTITION = "drop_partition"
    LIST_PARTITIONS = "list_partitions"
    MINT = "mint"
    COMMIT = "commit"
    ABORT_BLOCKS = "abort_blocks"
    ABORT_REQUESTS = "abort_requests"
    LOCATE = "locate"
    WAIT = "wait"
    DISCARD = "discard"
    GET_META = "get_meta"
    SET_TAGS = "set_tags"
    LEASES = "leases"
    BORROW = "borrow"
    PIN_FILE = "pin_file"
    UNIT_STATUS = "unit_status"
    STATS = "stats"
    SHUTDOWN = "shutdown"


class UnitOp(enum.StrEnum):
    """A storage unit's operations."""

    PING = "ping"
    ALLOC = "alloc"
    STORE = "store"
    FETCH = "fetch"
    FREE_ROWS = "free_rows"
    FREE_BLOCKS = "free_blocks"
    RETAIN = "retain"
    CLAIM = "claim"
    ADOPT = "adopt"
    TRIM = "trim"
    RELEASE = "release"
    STATS = "stats"
    SHUTDOWN = "shutdown"


class Args(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Base of every request's arguments (no fields: ``stats``, ``shutdown``, ``ping``...)."""


class ArrayRef(msgspec.Struct):
    """A numpy array carried in buffer frame ``b``: dtype string ``d`` (e.g. ``"<i8"``), shape ``s``."""

    b: int
    d: str
    s: list[int]


class Reply(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Base of every reply's result (what a handler returns). Fields without a default are always on
    the wire; one with a default is left out while it holds it."""


class Stopping(Reply):
    """The answer to ``shutdown`` (either server's)."""

    stopping: bool


class OpSummary(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One op's counters and latencies in a server's stats (histogram and bytes with metrics on)."""

    count: int
    errors: int
    p50_ms: float
    p99_ms: float
    buckets: Union[list[int], None] = None
    sum_s: Union[float, None] = None
    bytes_in: Union[int, None] = None
    bytes_out: Union[int, None] = None


class ServerStats(Reply, kw_only=True):
    """What every server reports of itself (:meth:`tq.rpc.RpcServer.server_stats`)."""

    uptime_s: float
    rejected_messages: int
    auth_failures: int
    ops: dict[str, OpSummary]
    metrics: bool
    metrics_url: Union[str, None]
    journal_bytes: int
    local_connections: int  # open connections to its same-host Unix socket (tq.stream_transport)
    tcp_stream_connections: int = 0  # ... and to its TCP stream socket (absent from an older server's)


class UnitInfo(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A storage unit as the controller lists it (``free_bytes``: at its last heartbeat; ``alive``: in
    stats)."""

    unit_id: int
    address: str
    host: Union[str, None]
    arena_path: Union[str, None]
    arena_size: int
    pid: Union[int, None]
    managed: bool
    free_bytes: Union[int, None] = None
    alive: Union[bool, None] = None
    down_for_s: Union[float, None] = None  # in stats, of a unit reported down: as UnitStatusReply's
    lost: Union[bool, None] = None  # in stats, of a unit reported down: given up on (as UnitStatusReply's)
    local_address: Union[str, None] = None  # its same-host Unix socket (tq.stream_transport), if any
    stream_address: Union[str, None] = None  # its TCP stream socket (tq.stream_transport), if any


# ----------------------------------------------------------------------------- controller requests
class Hello(Args):
    """A client's first request: answered with the unit list once ``expected_units`` registered, or
    after ``timeout`` seconds."""

    timeout: Seconds = 30.0


class HelloReply(Reply, omit_defaults=False):
    """The registered storage units (``units_version`` changes whenever one registers or rejoins), the
    controller's host and its same-host socket (absent from an older controller's reply)."""

    units: list[UnitInfo]
    units_version: int
    host: Union[str, None] = None
    shm_dir: Union[str, None] = None  # its shared-memory directory (location tables, pin files)
    local_address: Union[str, None] = None  # its same-host Unix socket (tq.stream_transport), if any
    stream_address: Union[str, None] = None  # its TCP stream socket (tq.stream_transport), if any


class RegisterUnit(Args):
    """A storage unit announces itself (``rejoin``: a restarted unit takes its old id back)."""

    address: str
    arena_size: Count
    unit_id: Union[int, None] = None
    host: Union[str, None] = None
    arena_path: Union[str, None] = None
    pid: Union[int, None] = None
    managed: bool = False
    rejoin: Union[Count, None] = None
    local_address: Union[str, None] = None
    stream_address: Union[str, None] = None


class RegisterUnitReply(Reply, omit_defaults=False):
    """The unit's id, and whether the service exports metrics (so the unit records them; absent from
    an older controller's reply)."""

    unit_id: int
    metrics: bool = False


class PartitionArgs(Args):
    partition: Name


class CreatePartition(PartitionArgs):
    reuse: bool = False
    request_id: Union[RequestId, None] = None


class OnceReply(Reply):
    """The reply of a request a client gives an id (tq.request_book): what the controller keeps of it
    is one count (the field ``counted`` names), from which it answers the request sent again
    (``duplicate``)."""

    counted: ClassVar[str]
    duplicate: bool = False

    @property
    def count(self) -> int:
        return int(getattr(self, self.counted))

    @classmethod
    def again(cls, args: Any, count: int) -> "OnceReply":
        """The reply to ``args`` sent again, applied the first time with ``count``."""
        return cls(**{cls.counted: count}, duplicate=True)


class CreatePartitionReply(OnceReply, kw_only=True):
    counted = "reused"
    partition: str
    reused: bool

    @classmethod
    def again(cls, args: Any, count: int) -> "CreatePartitionReply":
        return cls(partition=args.partition, reused=bool(count), duplicate=True)


class ClearPartition(PartitionArgs):
    request_id: Union[RequestId, None] = None


class ClearPartitionReply(OnceReply, kw_only=True):
    counted = "keys_cleared"
    keys_cleared: int


class DropPartition(PartitionArgs):
    request_id: Union[RequestId, None] = None


class DropPartitionReply(ClearPartitionReply):
    pass


class ListPartitions(Args):
    pass


class FieldSummary(msgspec.Struct):
    schema: str  # as FieldSchema.describe() writes it
    produced: int  # keys that have the field


class PartitionSummary(msgspec.Struct):
    """One partition in ``list_partitions`` and the controller's stats."""

    partition: str
    keys: int
    fields: dict[str, FieldSummary]
    bytes: int


class KeysArgs(PartitionArgs):
    keys: list[Name]


class Mint(KeysArgs):
    request_id: Union[RequestId, None] = None


class MintReply(OnceReply, kw_only=True):
    """Keys minted, and what a meta carries so a same-host reader finds their records (the location
    table's incarnation and each key's slot: ``KVBatchMeta.slots``; left out of a mint answered again,
    whose keys a reader then finds by name)."""

    counted = "minted"
    minted: int
    slot_table: Union[int, None] = None
    slots: Union[list[int], None] = None


class CommitField(msgspec.Struct):
    """One field of a commit: its schema (``[kind, dtype, shape]``) and per-key byte sizes and arena
    offsets (int64 arrays, one entry per key)."""

    schema: Any  # checked by FieldSchema.from_wire, whose messages name what is wrong
    row_nbytes: ArrayRef
    arena_offsets: ArrayRef


class Commit(KeysArgs):
    """Make stored blocks visible (see ``Controller.op_commit``). ``blocks``: ``[unit, block, rows]``
    parts covering ``keys`` in order."""

    mode: Literal["put", "write_back"]
    blocks: Annotated[list[tuple[Count, BlockId, Annotated[int, msgspec.Meta(ge=1)]]], msgspec.Meta(min_length=1)]
    fields: Annotated[dict[Name, CommitField], msgspec.Meta(min_length=1, max_length=MAX_FIELDS)]
    tags: Union[NewTags, None] = None
    sequence_lengths: Union[list[SequenceLength], None] = None
    overwrite: bool = False
    # same-host puts: per part of ``blocks``, the slab (allocation id) it was carved from and its
    # arena range ``(slab, start, size)``; the controller has the unit adopt each block once committed
    slabs: Union[list[tuple[Count, Count, Count]], None] = None


class CommitReply(Reply):
    """``keys`` committed and their slots (as :class:`MintReply`); ``duplicate``: a retry of a commit
    already applied (its slots are left out when its keys were discarded since)."""

    keys: int
    duplicate: bool = False
    slot_table: Union[int, None] = None
    slots: Union[list[int], None] = None


class AbortBlocks(Args):
    """A writer gives up on stored blocks: ``[[unit, block], ...]``."""

    blocks: list[tuple[Count, BlockId]]


class AbortBlocksReply(Reply):
    committed: list[bool]  # per block: whether its commit had been applied (then it was not fenced)


class ReadsArgs(Args):
    """Requests that also report bytes the client read through the location tables since its last
    request: storage unit id (a decimal string) -> bytes."""

    reads: Union[dict[str, Count], None] = None


class Locate(ReadsArgs, kw_only=True):
    partition: Name
    keys: list[Name]
    fields: list[Name]
    timeout: Union[Seconds, None] = None  # first wait (parked) until every pair is produced
    # a borrowed get: pin the located rows for this many seconds (renewed with ``leases``) so that
    # no discard, clear or overwrite frees them while the reader views them in the arena
    lease_s: Union[Annotated[float, msgspec.Meta(gt=0.0, le=86400.0)], None] = None
    # the lease's id, chosen by the reader: one whose reply is lost can still be given up by it
    lease_id: Union[LeaseId, None] = None
    # the reader's pid when it runs on the controller's host: its lease is kept while that process
    # lives (renewing nothing for a term means it is paused - its views live on - not gone); told,
    # where the reader could make one, by its liveness file in the controller's shared-memory
    # directory instead (a pid does not name a reader in another pid namespace)
    holder: Union[Annotated[int, msgspec.Meta(gt=0)], None] = None
    holder_file: Union[LivenessFile, None] = None


class TableRef(msgspec.Struct):
    """A partition's shared location table (see :mod:`tq.locations`): its file, clears count and the
    column of each field."""

    path: str
    clears: int
    columns: dict[str, int]


class LocateReply(Reply):
    """``loc``: the int64 ``[fields, keys, LOC_COLUMNS]`` location records; ``schemas``: each field's
    wire schema; ``table``: the partition's shared table (None, left out, when not shared);
    ``frees``: its free count now; ``lease``: the borrowed get's lease id."""

    schemas: dict[str, Any]  # checked by FieldSchema.from_wire
    loc: ArrayRef
    units_version: int
    table: Union[TableRef, None] = None
    frees: Union[int, None] = None
    lease: Union[int, None] = None
    # units holding some of the rows that are silent but not given up on: the reader waits for them
    unreachable: Union[list[Count], None] = None


class Wait(PartitionArgs):
    keys: list[Name]
    fields: list[Name]
    timeout: Seconds


class WaitReply(Reply):
    ready: bool


class Discard(ReadsArgs, kw_only=True):
    partition: Name
    keys: list[Name]
    request_id: Union[RequestId, None] = None


class DiscardReply(OnceReply, kw_only=True):
    counted = "discarded"
    discarded: int


class AbortRequests(Args):
    """A client gives up on requests (with ids) whose replies it never got: each one not applied yet
    never will be (see tq.request_book)."""

    ids: Annotated[list[RequestId], msgspec.Meta(min_length=1)]


class AbortRequestsReply(Reply):
    applied: list[Union[Count, None]]  # per id: the count its reply carried if it was applied, else None (fenced now)


class GetMeta(PartitionArgs):
    keys: Union[list[Name], None] = None  # None: every key


class GetMetaReply(Reply):
    keys: list[str]
    slot_table: int
    slots: list[int]
    fields: list[str]  # produced for every key
    sequence_lengths: Union[list[int], None]  # None unless every key has one
    tags: dict[str, list[TagValue]]


class SetTags(KeysArgs):
    tags: NewTags
    request_id: Union[RequestId, None] = None


class SetTagsReply(OnceReply, kw_only=True):
    counted = "keys"
    keys: int


class Leases(Args):
    """A borrower renews the leases it still holds (for their full term again) and gives up others."""

    renew: list[Count] = []
    release: list[Count] = []


class LeasesReply(Reply):
    ended: list[int]  # renewed leases whose term had run out already


class Borrow(ReadsArgs, kw_only=True):
    """A same-host borrowed get located its rows in the partition's shared location table itself,
    under the table's ``incarnation`` (the meta's ``slot_table``), ``frees`` count and
    ``units_version``, and asks for a lease on the ``blocks`` of ``unit`` those rows lie in. Granted
    only if all three are unchanged - the same table (not a partition dropped and made again under
    the same name), nothing of it freed, no unit re-registered - so the rows read are still the keys'
    rows when the lease pins them."""

    partition: str
    unit: Count
    blocks: list[BlockId]
    incarnation: int
    frees: int
    units_version: int
    lease_s: Annotated[float, msgspec.Meta(gt=0.0, le=86400.0)]
    lease_id: Union[LeaseId, None] = None  # chosen by the reader (see Locate)
    holder: Union[Annotated[int, msgspec.Meta(gt=0)], None] = None  # see Locate
    holder_file: Union[LivenessFile, None] = None  # see Locate


class BorrowReply(Reply):
    lease: Union[int, None]  # None: the table moved since the read (the reader locates through us)


class PinFile(Args):
    """A same-host client's pin file (``tq.pins``): from now on every free reads its pins first."""

    path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


class PinFileReply(Reply):
    registered: bool  # False: this controller reads no pins (no shared memory, or no C helper)
    epoch: int = 0  # the board's: written in every table of this controller, which pins must match


class UnitStatus(Args):
    unit: Count


class UnitStatusReply(Reply):
    alive: bool
    down_for_s: float  # 0 while alive; UNIT_ENDED_S once its controller saw its process end
    address: str
    lost: bool = False  # given up on (ended, or silent past the controller's unit_lost_s): reads fail fast


class Stats(ReadsArgs):
    pass


class LedgerSummary(msgspec.Struct):
    low_water: int
    pending: int
    fenced: int
    adopts: int


class StatsReply(ServerStats):
    """The controller's stats."""

    partitions: list[PartitionSummary]
    units: list[UnitInfo]
    units_version: int
    bytes_committed_total: int
    bytes_read_total: dict[str, int]  # per storage unit id
    put_bytes_per_s_60s: float
    parked_waits: int
    leases: int
    unit_ledgers: dict[str, LedgerSummary]  # what the controller remembers of each unit's unsettled blocks
    rows_waiting_for_leases: int
    stream_address: Union[str, None] = None  # its TCP stream socket (tq.stream_transport), if any


class Shutdown(Args):
    pass


CONTROLLER_REQUESTS: dict[ControllerOp, type[Args]] = {
    ControllerOp.HELLO: Hello,
    ControllerOp.REGISTER_UNIT: RegisterUnit,
    ControllerOp.CREATE_PARTITION: CreatePartition,
    ControllerOp.CLEAR_PARTITION: ClearPartition,
    ControllerOp.DROP_PARTITION: DropPartition,
    ControllerOp.LIST_PARTITIONS: ListPartitions,
    ControllerOp.MINT: Mint,
    ControllerOp.COMMIT: Commit,
    ControllerOp.ABORT_BLOCKS: AbortBlocks,
    ControllerOp.ABORT_REQUESTS: AbortRequests,
    ControllerOp.LOCATE: Locate,
    ControllerOp.WAIT: Wait,
    ControllerOp.DISCARD: Discard,
    ControllerOp.GET_META: GetMeta,
    ControllerOp.SET_TAGS: SetTags,
    ControllerOp.LEASES: Leases,
    ControllerOp.BORROW: Borrow,
    ControllerOp.PIN_FILE: PinFile,
    ControllerOp.UNIT_STATUS: UnitStatus,
    ControllerOp.STATS: Stats,
    ControllerOp.SHUTDOWN: Shutdown,
}


# What each op's handler returns and its client decodes (``hello`` and ``shutdown`` share no type with
# another op; ``list_partitions`` answers a list).
CONTROLLER_REPLIES: dict[ControllerOp, Any] = {
    ControllerOp.HELLO: HelloReply,
    ControllerOp.REGISTER_UNIT: RegisterUnitReply,
    ControllerOp.CREATE_PARTITION: CreatePartitionReply,
    ControllerOp.CLEAR_PARTITION: ClearPartitionReply,
    ControllerOp.DROP_PARTITION: DropPartitionReply,
    ControllerOp.LIST_PARTITIONS: list[PartitionSummary],
    ControllerOp.MINT: MintReply,
    ControllerOp.COMMIT: CommitReply,
    ControllerOp.ABORT_BLOCKS: AbortBlocksReply,
    ControllerOp.ABORT_REQUESTS: AbortRequestsReply,
    ControllerOp.LOCATE: LocateReply,
    ControllerOp.WAIT: WaitReply,
    ControllerOp.DISCARD: DiscardReply,
    ControllerOp.GET_META: GetMetaReply,
    ControllerOp.SET_TAGS: SetTagsReply,
    ControllerOp.LEASES: LeasesReply,
    ControllerOp.BORROW: BorrowReply,
    ControllerOp.PIN_FILE: PinFileReply,
    ControllerOp.UNIT_STATUS: UnitStatusReply,
    ControllerOp.STATS: StatsReply,
    ControllerOp.SHUTDOWN: Stopping,
}


# ----------------------------------------------------------------------------- storage-unit requests
class Ping(Args):
    """The controller's heartbeat."""


class PingReply(Reply):
    """Every block id below ``low_water`` is settled; ``expired``: tentative blocks past their commit
    lease (the controller claims or fences each); ``free_bytes``: the largest write that fits now."""

    unit_id: int
    low_water: int
    expired: list[BlockId]
    free_bytes: int


class Alloc(Args):
    nbytes: Count
    wait_s: Seconds = 0.0  # wait this long for room instead of failing at once
    # a slab: also grant this many block ids; the writer carves blocks out of the range itself and
    # names them in its commit, which the controller forwards (``adopt``): one round trip per put
    ids: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] = 0
    # a same-host writer's wall clock (time.time()) when it stops waiting for the answer: a unit that
    # gets to the request later (it was stopped, or the request waited for room) grants nothing, since
    # a range nobody fills would stay reserved until its lease ends (remote writers send none: their
    # clock need not match the unit's)
    reply_by: Union[Annotated[float, msgspec.Meta(ge=0.0)], None] = None
    # a same-host writer's pid: past its lease, the range of a writer whose process still lives is
    # not given to anyone else (it may only be paused mid-copy) until it releases it or exits
    writer: Union[Annotated[int, msgspec.Meta(gt=0)], None] = None
    # ... told, where the writer could make one, by its liveness file in the unit's shared-memory
    # directory instead (tq.liveness): a pid does not name the writer in another pid namespace
    writer_file: Union[LivenessFile, None] = None
    # allocations of this writer's that it will not write into any more (see Release), told in passing
    released: list[Count] = []
    # a same-host writer's id for this request: should its reply never reach the writer (a Ctrl-C, a
    # timeout), the writer names it in ``abandoned`` (see Release) and the unit frees what it granted
    request_id: Union[RequestId, None] = None
    abandoned: list[RequestId] = []


class Release(Args):
    """A same-host writer will not write into these allocations (or slabs) of the unit any more, nor
    into what its ``abandoned`` alloc requests (by ``request_id``) were granted - their replies never
    reached it, so nothing of them is in use: freed at once, a slab's block ids with it."""

    allocs: list[Count]
    abandoned: list[RequestId] = []


class ReleaseReply(Reply):
    released_bytes: int


class AllocReply(Reply):
    """The allocation's id and arena offset; ``first_block``: of a slab's block ids."""

    alloc: int
    offset: int
    first_block: Union[int, None] = None
    # changes whenever the unit gives free pages back to the OS (trim) and with every unit process: a
    # same-host writer that sees another value forgets which pages its mapping populated
    # (Arena.forget_populated)
    trim_epoch: int = 0


class StoreField(msgspec.Struct):
    """One field of a stored block: its schema, ``n_rows + 1`` int64 row offsets and its bytes -
    either in frames (``data``: one ref or chunks back to back) or already in the allocation at
    ``offset``."""

    schema: Any
    row_offsets: ArrayRef
    data: Union[ArrayRef, list[ArrayRef], None] = None
    offset: Union[Count, None] = None


class Store(Args):
    n_rows: Count
    fields: Annotated[dict[str, StoreField], msgspec.Meta(min_length=1)]
    alloc: Union[int, None] = None  # the allocation the client filled (None: the bytes come as frames)
    wait_s: Seconds = 0.0


class StoreReply(Reply):
    """The block's id, and each field's byte size and absolute arena offset."""

    block: int
    nbytes: dict[str, int]
    starts: dict[str, int]


class Fetch(Args):
    fields: list[str]
    entries: ArrayRef  # int64 [n, 3]: (field index, block, row)


class FetchReply(Reply):
    """The rows' byte sizes (int64), their bytes back to back in ``frames`` of whole rows and how many
    rows each frame holds (int64)."""

    sizes: ArrayRef
    frames: list[ArrayRef]
    frame_rows: ArrayRef


class BlockRows(Args):
    """(block, row) pairs as two int64 arrays of one length."""

    blocks: ArrayRef
    rows: ArrayRef


class FreeRows(BlockRows):
    pass


class FreeRowsReply(Reply):
    blocks_freed: int


class Retain(BlockRows):
    claimed: Union[ArrayRef, None] = None  # blocks the controller committed
    adopts: Union[list[AdoptBlock], None] = None  # committed slab blocks the unit may not have adopted


class RetainReply(Reply):
    blocks_freed: int
    adopted: list[int]  # blocks of ``adopts`` settled here: the controller forgets their layouts


class FreeBlocks(Args):
    blocks: list[int]


class FreeBlocksReply(FreeRowsReply):
    pass


class Claim(Args):
    blocks: ArrayRef


class ClaimReply(Reply):
    claimed: int


class AdoptField(msgspec.Struct, array_like=True):
    schema: Any
    start: Count  # absolute arena offset of the field's first byte
    row_offsets: bytes  # int64 little-endian, n_rows + 1, from 0


class AdoptBlock(msgspec.Struct, array_like=True):
    """A block a writer carved out of its slab and the controller committed: the unit registers it."""

    block: BlockId
    slab: Count  # the slab's allocation id
    start: Count
    size: Count
    fields: dict[str, AdoptField]


class Adopt(Args):
    blocks: list[AdoptBlock]


class AdoptReply(Reply):
    adopted: list[int]  # blocks settled here (adopted now or before, or freed)


class Trim(Args):
    pass


class TrimReply(Reply):
    released_bytes: int


class UnitStats(Args):
    pass


class UnitStatsReply(ServerStats):
    """A storage unit's stats: its description (as :class:`UnitInfo`), its server stats and its storage."""

    unit_id: int
    address: str
    host: str
    arena_path: str
    arena_size: int
    pid: int
    managed: bool
    blocks: int
    bytes_used: int
    slab_bytes_reserved: int  # slab space no block took yet
    largest_free_bytes: int
    bytes_live: int
    bytes_stored_total: int
    bytes_served_total: int
    pending_allocs: int
    slabs: int
    tentative_blocks: int
    parked_writes: int
    held_bytes: int  # ranges kept for same-host writers paused past their lease
    local_address: Union[str, None] = None  # its same-host Unix socket, if any
    stream_address: Union[str, None] = None  # its TCP stream socket, if any


class UnitShutdown(Args):
    pass


UNIT_REQUESTS: dict[UnitOp, type[Args]] = {
    UnitOp.PING: Ping,
    UnitOp.ALLOC: Alloc,
    UnitOp.STORE: Store,
    UnitOp.FETCH: Fetch,
    UnitOp.FREE_ROWS: FreeRows,
    UnitOp.FREE_BLOCKS: FreeBlocks,
    UnitOp.RETAIN: Retain,
    UnitOp.CLAIM: Claim,
    UnitOp.ADOPT: Adopt,
    UnitOp.TRIM: Trim,
    UnitOp.RELEASE: Release,
    UnitOp.STATS: UnitStats,
    UnitOp.SHUTDOWN: UnitShutdown,
}


UNIT_REPLIES: dict[UnitOp, Any] = {
    UnitOp.PING: PingReply,
    UnitOp.ALLOC: AllocReply,
    UnitOp.STORE: StoreReply,
    UnitOp.FETCH: FetchReply,
    UnitOp.FREE_ROWS: FreeRowsReply,
    UnitOp.FREE_BLOCKS: FreeBlocksReply,
    UnitOp.RETAIN: RetainReply,
    UnitOp.CLAIM: ClaimReply,
    UnitOp.ADOPT: AdoptReply,
    UnitOp.TRIM: TrimReply,
    UnitOp.RELEASE: ReleaseReply,
    UnitOp.STATS: UnitStatsReply,
    UnitOp.SHUTDOWN: Stopping,
}


# ----------------------------------------------------------------------------- decoding
_MAP_HEADS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}  # msgpack fixmap, map16, map32


def is_map(raw: Any) -> bool:
    """Whether raw msgpack bytes (a request's ``args``) hold a map."""
    view = memoryview(raw)
    return view.nbytes > 0 and view[0] in _MAP_HEADS


class _TypedDecoder:
    """Decodes raw msgpack into one op's type; every defect is one TQ error (see the subclasses)."""

    __slots__ = ("op", "_decoder", "_type")

    def __init__(self, op: str, typ: Any) -> None:
        self.op = op
        self._type = typ
        self._decoder = msgspec.msgpack.Decoder(typ)

    def decode(self, raw: bytes | memoryview) -> Any:
        try:
            return self._decoder.decode(raw)
        except msgspec.ValidationError as exc:
            raise self._misfit(exc) from None
        except msgspec.DecodeError as exc:  # e.g. a string that is not UTF-8 inside the map
            raise self._garbled(exc) from None

    def _misfit(self, exc: Exception) -> TQError:
        raise NotImplementedError

    def _garbled(self, exc: Exception) -> TQError:
        raise NotImplementedError


class ArgsDecoder(_TypedDecoder):
    """Decodes the raw msgpack ``args`` of one op (a map: see :func:`is_map`) into its struct: args
    that do not fit are an :class:`~tq.errors.InvalidRequestError` naming the op and the bad value's path."""

    __slots__ = ()

    def _misfit(self, exc: Exception) -> TQError:
        return InvalidRequestError(f"{self.op}: {exc}")

    def _garbled(self, exc: Exception) -> TQError:
        return MalformedMessageError(f"args of {self.op!r} are not valid msgpack: {exc}")

    def convert(self, args: dict[str, Any]) -> Args:
        """The struct of already decoded args (a journal written before args were journaled raw)."""
        try:
            return msgspec.convert(args, self._type)
        except msgspec.ValidationError as exc:
            raise self._misfit(exc) from None


class ReplyDecoder(_TypedDecoder):
    """Decodes the raw msgpack ``result`` of one op's reply into its reply type; a result that does not
    fit is a :class:`~tq.errors.MalformedMessageError` naming the op and the path of the bad value."""

    __slots__ = ()

    def _misfit(self, exc: Exception) -> TQError:
        return MalformedMessageError(f"reply to {self.op!r} does not fit its type: {exc}")

    def _garbled(self, exc: Exception) -> TQError:
        return MalformedMessageError(f"reply to {self.op!r} is not valid msgpack: {exc}")


def decoders(table: dict[Any, Any], kind: type[_TypedDecoder] = ArgsDecoder) -> dict[str, Any]:
    """op name -> its decoder of ``kind`` (:class:`ArgsDecoder` for a server's dispatch table,
    :class:`ReplyDecoder` for a client channel: ``RpcChannel(replies=...)``)."""
    return {op.value: kind(op.value, t) for op, t in table.items()}


CONTROLLER_REPLY_DECODERS: dict[str, ReplyDecoder] = decoders(CONTROLLER_REPLIES, ReplyDecoder)
UNIT_REPLY_DECODERS: dict[str, ReplyDecoder] = decoders(UNIT_REPLIES, ReplyDecoder)
