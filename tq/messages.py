"""Every TQ request, defined once: an op enum per server and one typed struct of arguments per op.

A server decodes a request's ``args`` straight into the struct of its op (``msgspec``'s typed msgpack
decoder), so a handler receives values of the declared types and holds only the state changes and
the checks that need state (does the partition exist, is the block fenced...). Shape and type checks -
"a list of strings", "an int >= 0 that is not a bool", "one of put / write_back" - live here, in the
types; a request that does not fit is refused with :class:`~tq.errors.InvalidRequestError` naming the
op and the path of the bad value (e.g. ``commit: Expected `int`, got `str` - at `$.blocks[0][1]```).

The framing around the args (header, HMAC, buffer frames, versioning, size limits) is
:mod:`tq.protocol`'s alone. Bulk data never travels in args: an :class:`ArrayRef` points at one of
the message's buffer frames, and :func:`tq.protocol.unpack_array` checks it against that frame.

Structs are maps on the wire (field names as keys), so the wire format is the one clients and journals
already speak; unknown keys are ignored (a newer client may send more).
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal, Union

import msgspec

from .errors import InvalidRequestError, MalformedMessageError

BLOCK_ID_LIMIT = 1 << 40  # storage units number blocks from 1 and never get near this

Count = Annotated[int, msgspec.Meta(ge=0)]  # msgspec never takes a bool for an int
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=BLOCK_ID_LIMIT)]
# Seconds to wait: finite (a NaN or infinity would park a request forever) and >= 0.
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]
TagValue = Union[None, bool, int, float, str]


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
    LOCATE = "locate"
    WAIT = "wait"
    DISCARD = "discard"
    GET_META = "get_meta"
    SET_TAGS = "set_tags"
    LEASES = "leases"
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
    STATS = "stats"
    SHUTDOWN = "shutdown"


class Args(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Base of every request's arguments (no fields: ``stats``, ``shutdown``, ``ping``...)."""


class ArrayRef(msgspec.Struct):
    """A numpy array carried in buffer frame ``b``: dtype string ``d`` (e.g. ``"<i8"``), shape ``s``."""

    b: int
    d: str
    s: list[int]


# ----------------------------------------------------------------------------- controller requests
class Hello(Args):
    """A client's first request: answered with the unit list once ``expected_units`` registered, or
    after ``timeout`` seconds."""

    timeout: Seconds = 30.0


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


class PartitionArgs(Args):
    partition: str


class CreatePartition(PartitionArgs):
    reuse: bool = False


class ClearPartition(PartitionArgs):
    pass


class DropPartition(PartitionArgs):
    pass


class ListPartitions(Args):
    pass


class KeysArgs(PartitionArgs):
    keys: list[str]


class Mint(KeysArgs):
    pass


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
    fields: Annotated[dict[str, CommitField], msgspec.Meta(min_length=1)]
    tags: Union[dict[str, list[TagValue]], None] = None
    sequence_lengths: Union[list[int], None] = None
    overwrite: bool = False
    # same-host puts: per part of ``blocks``, the slab (allocation id) it was carved from and its
    # arena range ``(slab, start, size)``; the controller has the unit adopt each block once committed
    slabs: Union[list[tuple[Count, Count, Count]], None] = None


class AbortBlocks(Args):
    """A writer gives up on stored blocks: ``[[unit, block], ...]``."""

    blocks: list[tuple[Count, BlockId]]


class ReadsArgs(Args):
    """Requests that also report bytes the client read through the location tables since its last
    request: storage unit id (a decimal string) -> bytes."""

    reads: Union[dict[str, Count], None] = None


class Locate(ReadsArgs, kw_only=True):
    partition: str
    keys: list[str]
    fields: list[str]
    timeout: Union[Seconds, None] = None  # first wait (parked) until every pair is produced
    # a borrowed get: pin the located rows for this many seconds (renewed with ``leases``) so that
    # no discard, clear or overwrite frees them while the reader views them in the arena
    lease_s: Union[Annotated[float, msgspec.Meta(gt=0.0, le=86400.0)], None] = None


class Wait(PartitionArgs):
    keys: list[str]
    fields: list[str]
    timeout: Seconds


class Discard(ReadsArgs, kw_only=True):
    partition: str
    keys: list[str]


class GetMeta(PartitionArgs):
    keys: Union[list[str], None] = None  # None: every key


class SetTags(KeysArgs):
    tags: dict[str, list[TagValue]]


class Leases(Args):
    """A borrower renews the leases it still holds (for their full term again) and gives up others."""

    renew: list[Count] = []
    release: list[Count] = []


class UnitStatus(Args):
    unit: Count


class Stats(ReadsArgs):
    pass


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
    ControllerOp.LOCATE: Locate,
    ControllerOp.WAIT: Wait,
    ControllerOp.DISCARD: Discard,
    ControllerOp.GET_META: GetMeta,
    ControllerOp.SET_TAGS: SetTags,
    ControllerOp.LEASES: Leases,
    ControllerOp.UNIT_STATUS: UnitStatus,
    ControllerOp.STATS: Stats,
    ControllerOp.SHUTDOWN: Shutdown,
}


# ----------------------------------------------------------------------------- storage-unit requests
class Ping(Args):
    """The controller's heartbeat."""


class Alloc(Args):
    nbytes: Count
    wait_s: Seconds = 0.0  # wait this long for room instead of failing at once
    # a slab: also grant this many block ids; the writer carves blocks out of the range itself and
    # names them in its commit, which the controller forwards (``adopt``): one round trip per put
    ids: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] = 0


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


class Fetch(Args):
    fields: list[str]
    entries: ArrayRef  # int64 [n, 3]: (field index, block, row)


class BlockRows(Args):
    """(block, row) pairs as two int64 arrays of one length."""

    blocks: ArrayRef
    rows: ArrayRef


class FreeRows(BlockRows):
    pass


class Retain(BlockRows):
    claimed: Union[ArrayRef, None] = None  # blocks the controller committed
    adopts: Union[list[AdoptBlock], None] = None  # committed slab blocks the unit may not have adopted


class FreeBlocks(Args):
    blocks: list[int]


class Claim(Args):
    blocks: ArrayRef


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


class Trim(Args):
    pass


class UnitStats(Args):
    pass


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
    UnitOp.STATS: UnitStats,
    UnitOp.SHUTDOWN: UnitShutdown,
}


# ----------------------------------------------------------------------------- decoding
_MAP_HEADS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}  # msgpack fixmap, map16, map32


def is_map(raw: Any) -> bool:
    """Whether raw msgpack bytes (a request's ``args``) hold a map."""
    view = memoryview(raw)
    return view.nbytes > 0 and view[0] in _MAP_HEADS


class ArgsDecoder:
    """Decodes the raw msgpack ``args`` of one op into its struct; every defect is one TQ error."""

    __slots__ = ("op", "_decoder", "_type")

    def __init__(self, op: str, args_type: type[Args]) -> None:
        self.op = op
        self._type = args_type
        self._decoder = msgspec.msgpack.Decoder(args_type)

    def decode(self, raw: bytes | memoryview) -> Args:
        """``raw``: the msgpack bytes of a request's ``args`` (a map: see :func:`is_map`)."""
        try:
            return self._decoder.decode(raw)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(f"{self.op}: {exc}") from None
        except msgspec.DecodeError as exc:  # e.g. a string that is not UTF-8 inside the map
            raise MalformedMessageError(f"args of {self.op!r} are not valid msgpack: {exc}") from None

    def convert(self, args: dict[str, Any]) -> Args:
        """The struct of already decoded args (a journal written before args were journaled raw)."""
        try:
            return msgspec.convert(args, self._type)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(f"{self.op}: {exc}") from None


def decoders(requests: dict[Any, type[Args]]) -> dict[str, ArgsDecoder]:
    """op name -> its :class:`ArgsDecoder`, for a server's dispatch table."""
    return {op.value: ArgsDecoder(op.value, t) for op, t in requests.items()}
