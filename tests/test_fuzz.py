"""Hostile input, generated (issue 8): a hypothesis fuzz of the TQ wire protocol against a real
controller and real storage units.

Every example is sent from a fresh raw ZMQ DEALER socket: random frame counts of random bytes, valid
msgpack headers with random or mutated fields (ops known and unknown, args of any msgpack shape, wrong
``v``, wrong ``bs``, missing / extra / resized / oversized buffer frames, array refs with wrong dtypes,
shapes and indices) and truncations of valid requests. The oracle, for each example:

- the server answers with a reply that decodes, echoes the request id when the header could be read,
  and either carries a result (only for a well-formed request of a known op, and of that op's reply
  type in :mod:`tq.messages`) or an error that
  ``protocol.raise_for_reply`` raises as a :class:`TQError` subclass; it may stay silent only for a
  message of fewer than two frames or whose header is not a msgpack map;
- an error leaves the server's state as it was (partitions, keys and fields on the controller; blocks,
  bytes and allocations on a storage unit);
- the service keeps serving (``stats`` of the controller and both units) with the same processes (a
  crashed unit would be restarted by the controller, so its pid is checked too);
- after the run, a reference batch stored before it reads back with the same sha256 checksums over
  both transports.

Destructive ops (shutdown, drop/clear_partition, discard, free_rows, free_blocks, retain,
register_unit) are only ever sent with malformed arguments: ``_defang`` rewrites any example that would
be a valid destructive request - wherever its op and args came from - so the reference data can only
change if the server mishandles input. The ops and their argument names come from the request
definitions in :mod:`tq.messages`, which the servers decode with; the bugs the fuzz found are at the
end ("Findings"), each with a regression test.
"""

from __future__ import annotations

import collections
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tq.testing import digest, rows_of
from conftest import raw_exchange, raw_exchange_stream, wait_until
from tq import TQClient, TQServer, messages, protocol
from tq.errors import (
    InvalidRequestError,
    MalformedMessageError,
    MessageTooLargeError,
    StorageUnitError,
    TQError,
)
from tq.rpc import RpcChannel

# The ops and their argument names come from the request definitions the servers decode with; a
# result is checked against the reply definitions clients decode with.
CONTROLLER_OPS = tuple(op.value for op in messages.CONTROLLER_REQUESTS)
UNIT_OPS = tuple(op.value for op in messages.UNIT_REQUESTS)
REPLY_DECODERS = {"controller": messages.CONTROLLER_REPLY_DECODERS, "unit": messages.UNIT_REPLY_DECODERS}
DESTRUCTIVE = frozenset({"shutdown", "drop_partition", "clear_partition", "discard", "free_rows", "free_blocks", "retain", "register_unit"})
DROP_WAIT_S = 0.5  # how long silence is waited for where dropping is allowed (an unreadable header)
REPLY_TIMEOUT_S = 10.0  # where a reply is required: it comes in milliseconds, but CI machines stall
MAX_WAIT_S = 0.2  # wait / wait_s timeouts sent are capped so a parked request answers soon
REF_FIELDS = ("ids", "lp", "mask", "emb", "reward", "msgs")
FUZZ_KEYS = ("a", "b", "c", "k0", "k1", "")
EXAMPLES_PER_TARGET = int(os.environ.get("TQ_FUZZ_EXAMPLES", "75"))  # raise it for a longer local fuzz run
# Ops drawn by the fuzzer, the ones with rich arguments more often (unknown op names are drawn too).
OP_WEIGHTS = {
    "controller": ("commit",) * 5 + ("locate", "wait", "get_meta", "mint", "set_tags", "create_partition") * 2 + CONTROLLER_OPS,
    "unit": ("store",) * 6 + ("fetch",) * 4 + ("alloc",) * 2 + UNIT_OPS,
}


# ----------------------------------------------------------------------------- checksummed reference
class ChecksummedReference:
    """Batches stored (over both transports, so on both units) before fuzzing, with a sha256 per
    (key, field); :meth:`verify` reads them back and compares."""

    def __init__(self, address: str) -> None:
        self.clients = {t: TQClient(address, timeout=10.0, transport=t) for t in ("auto", "tcp")}
        self.pid = f"fuzzref-{uuid.uuid4().hex[:8]}"
        self.clients["auto"].register_partition(self.pid)
        self.metas = []
        self.sums: dict[tuple[str, str], str] = {}
        g = torch.Generator().manual_seed(8)
        for i, transport in enumerate(("auto", "tcp") * 2):
            lengths = [5, 0, 17, 2, 9]
            n = len(lengths)
            lp = [torch.randn(L, generator=g).to(torch.bfloat16) for L in lengths]
            lp[0].view(torch.int16)[0] = 0x7FC1  # a NaN with a payload must survive bit-exactly
            cols = {
                "ids": [torch.randint(0, 150_000, (L,), generator=g) for L in lengths],
                "lp": lp,
                "mask": [torch.rand(L, generator=g) > 0.3 for L in lengths],
                "emb": torch.randn(n, 3, generator=g),
                "reward": torch.randn(n, generator=g, dtype=torch.float64),
                "msgs": [[{"role": "user", "content": f"q{i}-{j}", "n": j}] for j in range(n)],
            }
            keys = [f"fuzzref{i}-{uuid.uuid4().hex[:6]}-{j}" for j in range(n)]
            meta = self.clients[transport].put(self.pid, keys, cols)
            self.metas.append(meta)
            for name, col in cols.items():
                for key, row in zip(keys, rows_of(col)):
                    self.sums[(key, name)] = digest(row)
        self.keys = [k for m in self.metas for k in m.keys]

    def verify(self) -> int:
        """Read every reference sample over both transports; return the (key, field) pairs checked."""
        checked = 0
        for client in self.clients.values():
            for meta in self.metas:
                got = client.get(meta, list(REF_FIELDS), layout="list")
                for name in REF_FIELDS:
                    rows = rows_of(got[name])
                    assert len(rows) == len(meta.keys)
                    for key, row in zip(meta.keys, rows):
                        assert digest(row) == self.sums[(key, name)], f"reference {name!r} of {key!r} changed"
                        checked += 1
        return checked

    def close(self) -> None:
        try:
            self.clients["auto"].drop_partition(self.pid)
        finally:
            for c in self.clients.values():
                c.close()


@dataclass
class FuzzEnv:
    address: str
    ref: ChecksummedReference
    client: TQClient
    scratch: str  # an existing partition the fuzzer may write fuzz keys into
    unit_addresses: list[str]
    unit_pids: list[int]
    unit_chans: list[RpcChannel]
    ref_blocks: list[list[int]]  # per unit: block ids holding reference data (read-only fetch targets)
    local_address: str  # the controller's same-host Unix socket (tq.stream_transport)
    unit_local_addresses: list[str]
    stream_address: str  # ... and its TCP stream socket
    unit_stream_addresses: list[str]
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    internal: collections.Counter = field(default_factory=collections.Counter)  # generic (non-specific) errors


@pytest.fixture(scope="module")
def env(tq_server):
    ref = ChecksummedReference(tq_server.address)
    client = TQClient(tq_server.address, timeout=10.0, transport="tcp")
    scratch = f"fuzzscratch-{uuid.uuid4().hex[:6]}"
    client.register_partition(scratch)
    located, msg = client._ctrl.call("locate", {"partition": ref.pid, "keys": ref.keys, "fields": ["ids"]})
    loc = protocol.unpack_array(located.loc, msg.buffers)
    units = sorted(client._units, key=lambda u: u.unit_id)
    ref_blocks = [sorted({int(b) for u_, b in loc[0, :, :2].tolist() if u_ == u.unit_id}) for u in units]
    assert all(ref_blocks), "the reference batches should sit on both storage units"
    chans = [
        RpcChannel(u.address, secret=None, timeout=10.0, name=f"unit {u.unit_id}", replies=messages.UNIT_REPLY_DECODERS) for u in units
    ]
    hello = protocol.raise_for_reply(raw_exchange(tq_server.address, protocol.request("hello", 1, {}, [], None)))
    e = FuzzEnv(
        tq_server.address,
        ref,
        client,
        scratch,
        [u.address for u in units],
        [u.pid for u in units],
        chans,
        ref_blocks,
        hello["local_address"],
        [u.local_address for u in units],
        hello["stream_address"],
        [u.stream_address for u in units],
    )
    assert ref.verify() == 2 * len(ref.keys) * len(REF_FIELDS)
    yield e
    for ch in chans:
        ch.close()
    try:
        client.drop_partition(scratch)
    finally:
        client.close()
        ref.close()


# ----------------------------------------------------------------------------- value strategies
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.integers(-3, 8),
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=16),
)
ANY = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-3, 3)), inner, max_size=4)
    ),
    max_leaves=10,
)
NAMES = st.one_of(st.sampled_from(REF_FIELDS + ("x", "adv", "nope", "")), st.text(max_size=6))
DTYPE_STRS = sorted(protocol.ARRAY_DTYPES) + ["|O", "<c8", ">i8", "float32", "<i16", ""]
SCHEMA_DTYPES = ["float32", "bfloat16", "int64", "bool", "uint8", "object", "complex64", "", "int128"]


def maybe(data, valid, p_valid: int = 11):
    """Draw from ``valid`` ``p_valid`` times in ``p_valid + 1``, else any msgpack value: requests have many
    fields, so each is spoiled rarely and a good share of requests reach deep validation. (Hypothesis's
    ``one_of`` neither weights repeated branches nor draws integers uniformly: hence ``sampled_from``.)"""
    return data.draw(valid if data.draw(st.sampled_from([True] * p_valid + [False])) else ANY)


def one_in(data, n: int) -> bool:
    return data.draw(st.sampled_from([True] + [False] * (n - 1)))


def draw_schema(data) -> Any:
    """A field schema ``[kind, dtype, shape]``: mostly a valid one, sometimes an incoherent one, rarely junk."""
    if one_in(data, 4):
        return maybe(
            data,
            st.tuples(
                st.sampled_from(["tensor", "jagged", "object", "ragged"]),
                st.sampled_from(SCHEMA_DTYPES),
                st.lists(st.integers(-2, 5), max_size=3),
            ).map(list),
        )
    kind = data.draw(st.sampled_from(["tensor", "jagged", "object"]))
    if kind == "object":
        return ["object", "object", []]
    return [
        kind,
        data.draw(st.sampled_from(["float32", "bfloat16", "int64", "bool", "uint8"])),
        data.draw(st.lists(st.integers(0, 4), max_size=2)),
    ]


class Bufs:
    """The buffer frames of a request being drawn, and refs to them - right or deliberately wrong."""

    def __init__(self, data) -> None:
        self.data = data
        self.frames: list[bytes] = []

    def add(self, raw: bytes) -> int:
        self.frames.append(raw)
        return len(self.frames) - 1

    def ref(self, arr: np.ndarray) -> Any:
        """A ref to ``arr`` (appended as a frame); sometimes with a wrong dtype, shape, index or size."""
        index = self.add(np.ascontiguousarray(arr).tobytes())
        good = {"b": index, "d": arr.dtype.str, "s": list(arr.shape)}
        how = self.data.draw(st.sampled_from(["good"] * 12 + ["dtype", "shape", "index", "huge", "junk", "missing"]))
        if how == "dtype":
            good["d"] = self.data.draw(st.sampled_from(DTYPE_STRS))
        elif how == "shape":
            good["s"] = self.data.draw(st.lists(st.integers(-2, 40), max_size=10))
        elif how == "index":
            good["b"] = self.data.draw(st.one_of(st.integers(-3, 8), ANY))
        elif how == "huge":  # element counts whose products overflow int64
            good["s"] = self.data.draw(st.lists(st.sampled_from([2**31, 2**32, 2**62, 2**63 - 1, 2**64 - 1, 0, 1]), min_size=1, max_size=4))
        elif how == "junk":
            return self.data.draw(ANY)
        elif how == "missing":
            good.pop(self.data.draw(st.sampled_from(["b", "d", "s"])))
        return good


def _ints(data, n: int, lo: int, hi: int) -> np.ndarray:
    return np.array(data.draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)), dtype=np.int64)


# ----------------------------------------------------------------------------- request drawing
def _partition(data, env: FuzzEnv) -> Any:
    return maybe(data, st.sampled_from([env.ref.pid, env.scratch, env.scratch, "ghost", "fz-0"]))


def _keys(data, read_only: bool, env: FuzzEnv) -> Any:
    pool = list(FUZZ_KEYS) + (env.ref.keys if read_only else [])
    return maybe(data, st.lists(st.one_of(st.sampled_from(pool), st.text(max_size=4)), max_size=5, unique=not one_in(data, 8)))


def _controller_args(data, op: str, env: FuzzEnv, bufs: Bufs) -> Any:
    if one_in(data, 20):
        return data.draw(ANY)  # any shape at all, a map or not
    part = _partition(data, env)
    if op in ("locate", "wait", "get_meta"):
        keys = _keys(data, True, env)
        args = {"partition": part, "keys": keys, "fields": maybe(data, st.lists(NAMES, max_size=3))}
        if op == "wait" or (op == "locate" and data.draw(st.booleans())):
            args["timeout"] = maybe(data, st.floats(-1.0, MAX_WAIT_S))
        if op == "get_meta" and data.draw(st.booleans()):
            args["keys"] = None
        return args
    if op == "commit":
        keys = _keys(data, False, env)
        n = len(keys) if isinstance(keys, list) else data.draw(st.integers(0, 3))
        fields = {}
        for name in data.draw(st.lists(NAMES, min_size=1, max_size=2)):
            row_nbytes = _ints(data, data.draw(st.sampled_from([n] * 5 + [n + 1])), -4, 64)
            offsets = _ints(data, data.draw(st.sampled_from([n] * 5 + [n + 1])), -4, 1 << 40)
            fields[name] = maybe(
                data, st.just({"schema": draw_schema(data), "row_nbytes": bufs.ref(row_nbytes), "arena_offsets": bufs.ref(offsets)})
            )
        # block ids the fuzzer commits never name a real block (real ids are small positive ints)
        block_ids = st.one_of(st.integers(-(2**63), -1), st.integers(10**9, 2**63 - 1))
        part_rows = st.sampled_from([n] * 5 + [n + 1, 0, -1])
        args = {
            "partition": part,
            "keys": keys,
            "mode": maybe(data, st.sampled_from(["put", "write_back"])),
            "blocks": maybe(data, st.lists(st.tuples(st.integers(-1, 3), block_ids, part_rows).map(list), min_size=1, max_size=2)),
            "fields": maybe(data, st.just(fields)),
        }
        if data.draw(st.booleans()):
            args["tags"] = maybe(data, st.dictionaries(NAMES, st.lists(SCALARS, min_size=n, max_size=n), max_size=2))
        if data.draw(st.booleans()):
            args["sequence_lengths"] = maybe(data, st.lists(st.integers(-5, 2**40), min_size=n, max_size=n))
        if data.draw(st.booleans()):
            args["overwrite"] = data.draw(st.one_of(st.booleans(), ANY))
        return args
    if op in ("mint", "discard", "set_tags"):
        args = {"partition": part, "keys": _keys(data, False, env)}
        if op == "set_tags":
            args["tags"] = data.draw(ANY)
        return args
    if op == "create_partition":
        return {"partition": part, "reuse": maybe(data, st.booleans())}
    if op in ("clear_partition", "drop_partition"):
        return {"partition": part}
    if op == "unit_status":
        return {"unit": maybe(data, st.integers(-2, 3))}
    if op == "hello":
        return {"timeout": maybe(data, st.floats(0, MAX_WAIT_S))}
    if op == "abort_blocks":
        return {"blocks": maybe(data, st.lists(st.tuples(st.integers(-1, 3), st.integers(-(2**63), 2**63 - 1)).map(list), max_size=3))}
    if op == "register_unit":
        return {
            "unit_id": data.draw(ANY),
            "address": data.draw(ANY),
            "host": data.draw(ANY),
            "arena_path": data.draw(ANY),
            "arena_size": maybe(data, st.integers(0, 2**40)),
            "pid": data.draw(ANY),
            "rejoin": maybe(data, st.one_of(st.none(), st.integers(-1, 3))),
        }
    return _any_args(data, messages.CONTROLLER_REQUESTS[messages.ControllerOp(op)]) if op in CONTROLLER_OPS else {}


def _any_args(data, args_type: type) -> dict:
    """Any value for each argument the op's request type declares (ops without richer drawing above)."""
    return {f.encode_name: data.draw(ANY) for f in msgspec.structs.fields(args_type) if data.draw(st.booleans())}


def _unit_args(data, op: str, env: FuzzEnv, unit: int, bufs: Bufs) -> Any:
    if one_in(data, 20):
        return data.draw(ANY)
    if op == "alloc":
        return {"nbytes": maybe(data, st.integers(-8, 1 << 16)), "wait_s": maybe(data, st.floats(0, MAX_WAIT_S))}
    if op == "store":
        n_rows = data.draw(st.integers(0, 4))
        fields = {}
        for name in data.draw(st.lists(NAMES, min_size=1, max_size=2, unique=True)):
            itemsize = data.draw(st.sampled_from([1, 2, 4, 8]))
            sizes = _ints(data, n_rows, 0, 6) * itemsize
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            if one_in(data, 5):  # offsets that decrease, start off zero, or miscount rows
                offsets = _ints(data, data.draw(st.integers(0, n_rows + 2)), -8, 64)
            spec: dict[str, Any] = {"schema": draw_schema(data), "row_offsets": bufs.ref(offsets)}
            nbytes = max(int(offsets[-1]) if offsets.size else 0, 0) + data.draw(st.sampled_from([0, 0, 0, -1, 1]))
            payload = np.frombuffer(data.draw(st.binary(min_size=max(nbytes, 0), max_size=max(nbytes, 0))), np.uint8)
            where = data.draw(st.sampled_from(["data", "data", "chunks", "offset"]))
            if where == "data":
                spec["data"] = bufs.ref(payload)
            elif where == "chunks":
                cut = data.draw(st.integers(0, payload.size))
                spec["data"] = [bufs.ref(payload[:cut]), bufs.ref(payload[cut:])]
            else:
                spec["offset"] = maybe(data, st.integers(-8, 256))
            fields[name] = maybe(data, st.just(spec))
        args = {"n_rows": maybe(data, st.just(n_rows)), "fields": maybe(data, st.just(fields))}
        if one_in(data, 4):
            args["alloc"] = maybe(data, st.integers(-1, 50))
        if data.draw(st.booleans()):
            args["wait_s"] = maybe(data, st.floats(0, MAX_WAIT_S))
        return args
    if op == "fetch":
        m = data.draw(st.integers(0, 4))
        real = env.ref_blocks[unit]
        blocks = data.draw(
            st.lists(st.one_of(st.sampled_from(real), st.integers(-3, 200), st.integers(-(2**62), 2**62)), min_size=m, max_size=m)
        )
        entries = np.stack([_ints(data, m, -1, 7), np.array(blocks, dtype=np.int64), _ints(data, m, -1, 6)], axis=1)
        if one_in(data, 5):
            entries = entries.reshape(-1)  # wrong rank
        return {
            "fields": maybe(data, st.lists(NAMES, max_size=4)),
            "mode": maybe(data, st.sampled_from(["shm", "tcp"])),
            "entries": bufs.ref(entries.astype(np.int64)),
        }
    if op in ("free_rows", "retain"):
        m = data.draw(st.integers(0, 3))
        return {"blocks": bufs.ref(_ints(data, m, -1, 20)), "rows": bufs.ref(_ints(data, m, -1, 5))}
    if op == "free_blocks":
        return {"blocks": maybe(data, st.lists(st.integers(-1, 200), max_size=3))}
    if op == "claim":
        return {"blocks": bufs.ref(_ints(data, data.draw(st.integers(0, 3)), -1, 200))}
    return _any_args(data, messages.UNIT_REQUESTS[messages.UnitOp(op)]) if op in UNIT_OPS else {}


def _known_ops(target: str) -> tuple[str, ...]:
    return CONTROLLER_OPS if target == "controller" else UNIT_OPS


def _defang(target: str, header: Any, env: FuzzEnv) -> bool:
    """Make a decodable request harmless to the reference data: a destructive op (or a commit naming a
    real block, a create_partition reusing the reference partition...) gets args it must refuse, and
    timeouts are capped so parked requests answer in time. Returns whether anything changed."""
    if not isinstance(header, dict) or not isinstance(header.get("op"), str) or not isinstance(header.get("args"), dict):
        return False
    op, args, before = header["op"], header["args"], msgpack.packb(header, use_bin_type=True)

    def cap(name: str) -> None:
        t = args.get(name)
        if isinstance(t, (int, float)) and not (t <= MAX_WAIT_S):  # NaN too (refused anyway)
            args[name] = MAX_WAIT_S if not isinstance(t, bool) else False

    if op == "shutdown":
        header["args"] = [args]  # args must be a map: refused before any handler runs
    elif target == "controller":
        if op in ("clear_partition", "drop_partition") and isinstance(args.get("partition"), str):
            args["partition"] = 0
        elif op == "discard" and isinstance(args.get("keys"), list) and all(isinstance(k, str) for k in args["keys"]):
            args["keys"] = 0
        elif op == "register_unit" and isinstance(args.get("address"), str):
            args["address"] = None
        elif op == "create_partition" and args.get("partition") == env.ref.pid and args.get("reuse"):
            args["reuse"] = False
        if op not in ("locate", "wait", "get_meta") and isinstance(args.get("keys"), list):
            args["keys"] = [k for k in args["keys"] if k not in env.ref.keys]  # reference keys are only read
        if op in ("commit", "abort_blocks") and isinstance(args.get("blocks"), list):
            for part in args["blocks"]:
                if isinstance(part, list) and len(part) >= 2 and isinstance(part[1], int) and not isinstance(part[1], bool):
                    if 0 <= part[1] < 10**9:
                        part[1] = -1 - part[1]  # never point fuzz keys at (or fence) a real block
        if op == "wait":
            cap("timeout")
        if op == "hello":
            cap("timeout")
    else:
        if op in ("free_rows", "retain") and isinstance(args.get("blocks"), dict):
            args["blocks"] = 0
        elif op == "free_blocks" and isinstance(args.get("blocks"), list):
            args["blocks"] = {"blocks": args["blocks"]}
        elif op == "alloc" and isinstance(args.get("nbytes"), int) and (16 << 20) < args["nbytes"]:
            args["nbytes"] = 1 << 62  # never pin a large part of the arena (an allocation is held for a minute)
        if op in ("alloc", "store"):
            cap("wait_s")
    return msgpack.packb(header, use_bin_type=True) != before


@dataclass
class Example:
    kind: str
    frames: list[bytes]


def draw_example(data, target: str, env: FuzzEnv, unit: int) -> Example:
    kind = data.draw(st.sampled_from(["request", "request", "request", "raw", "truncated"]), label="kind")
    if kind == "raw":  # 1..6 frames of random bytes, the first sometimes a msgpack value
        frames = data.draw(st.lists(st.binary(max_size=48), min_size=1, max_size=6))
        if data.draw(st.booleans()):
            frames[0] = msgpack.packb(data.draw(ANY), use_bin_type=True)
        return Example(kind, frames)

    op = data.draw(st.sampled_from(OP_WEIGHTS[target] + (None,)), label="op")
    if op is None:  # an unknown op name
        op = data.draw(st.text(max_size=10), label="unknown op")
    bufs = Bufs(data)
    args = _controller_args(data, op, env, bufs) if target == "controller" else _unit_args(data, op, env, unit, bufs)
    header: Any = {"v": 1, "op": op, "rid": data.draw(st.integers(0, 2**31)), "args": args}
    frames = list(bufs.frames)
    bs: Any = None  # None: the true sizes
    if kind == "request":
        for _ in range(data.draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]), label="mutations")):
            what = data.draw(
                st.sampled_from(
                    [
                        "arg",
                        "del-arg",
                        "add-arg",
                        "v",
                        "op",
                        "rid",
                        "args",
                        "header",
                        "drop-frame",
                        "add-frame",
                        "big-frame",
                        "cut-frame",
                        "flip",
                        "bs",
                    ]
                )
            )
            if what in ("arg", "del-arg") and isinstance(header, dict) and isinstance(header.get("args"), dict) and header["args"]:
                k = data.draw(st.sampled_from(sorted(header["args"], key=repr)))
                if what == "arg":
                    header["args"][k] = data.draw(ANY)
                else:
                    del header["args"][k]
            elif what == "add-arg" and isinstance(header, dict) and isinstance(header.get("args"), dict):
                header["args"][data.draw(st.text(max_size=6))] = data.draw(ANY)
            elif what in ("v", "op", "rid", "args") and isinstance(header, dict):
                header[what] = data.draw(ANY if what != "op" else st.one_of(st.sampled_from(CONTROLLER_OPS + UNIT_OPS), ANY))
            elif what == "header":
                header = data.draw(ANY)
            elif what == "drop-frame" and frames:
                del frames[data.draw(st.integers(0, len(frames) - 1))]
            elif what == "add-frame":
                frames.append(data.draw(st.binary(max_size=64)))
            elif what == "big-frame":  # an oversized payload (bounded: this runs on a 2-core CI box)
                frames.append(bytes(data.draw(st.sampled_from([64 << 10, 1 << 20, 4 << 20]))))
            elif what == "cut-frame" and frames:
                i = data.draw(st.integers(0, len(frames) - 1))
                frames[i] = frames[i][: data.draw(st.integers(0, max(len(frames[i]) - 1, 0)))]
            elif what == "flip" and any(frames):
                i = data.draw(st.sampled_from([j for j, f in enumerate(frames) if f]))
                b = bytearray(frames[i])
                b[data.draw(st.integers(0, len(b) - 1))] ^= 1 << data.draw(st.integers(0, 7))
                frames[i] = bytes(b)
            elif what == "bs":
                bs = data.draw(st.one_of(st.lists(st.one_of(st.integers(-1, 70), st.integers(0, 2**64 - 1)), max_size=5), ANY))
    if isinstance(header, dict):
        header["bs"] = [len(f) for f in frames] if bs is None else bs
    out = [msgpack.packb(header, use_bin_type=True), data.draw(st.sampled_from([b"", b"\0" * 32])), *frames]
    if kind == "truncated":  # a valid request cut short: fewer frames, or a cut header or buffer
        how = data.draw(st.sampled_from(["frames", "header", "buffer"]))
        if how == "frames" or (how == "buffer" and len(out) < 3):
            out = out[: data.draw(st.integers(1, len(out) - 1))]
        elif how == "header":
            out[0] = out[0][: data.draw(st.integers(0, len(out[0]) - 1))]
        else:
            i = data.draw(st.integers(2, len(out) - 1))
            out[i] = out[i][: data.draw(st.integers(0, max(len(out[i]) - 1, 0)))]
    return Example(kind, out)


# ----------------------------------------------------------------------------- the oracle
def _header_of(frames: list[bytes]) -> Any:
    """The request header as the server reads it, or None when it cannot (garbled, too few frames)."""
    if len(frames) < 2:
        return None
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    except Exception:
        return None
    return header if isinstance(header, dict) else None


def _decodes(frames: list[bytes]) -> protocol.Message | None:
    try:
        return protocol.decode(frames, None)
    except TQError:
        return None


def _state(env: FuzzEnv, target: str, unit: int) -> Any:
    if target == "controller":
        return sorted(
            (p["partition"], p["keys"], sorted((f, d["produced"], d["schema"]) for f, d in p["fields"].items()), p["bytes"])
            for p in env.client.list_partitions()
        )
    s = env.unit_chans[unit].call("stats", {})[0]
    return {k: getattr(s, k) for k in ("blocks", "bytes_used", "bytes_live", "pending_allocs", "parked_writes")}


def _quiet_state(env: FuzzEnv, unit: int) -> Any:
    """The unit's state once no free sent by an earlier test is still arriving (two reads 0.1 s apart
    agree): frees reach a unit after the discard that caused them has returned."""
    prev = _state(env, "unit", unit)
    for _ in range(50):
        time.sleep(0.1)
        now = _state(env, "unit", unit)
        if now == prev:
            return now
        prev = now
    return prev


def _same(a: Any, b: Any) -> bool:
    return msgpack.packb(a, use_bin_type=True) == msgpack.packb(b, use_bin_type=True)


def check_example(env: FuzzEnv, target: str, unit: int, ex: Example, transport: str = "zmq") -> None:
    frames = ex.frames
    msg = _decodes(frames)
    if msg is not None and _defang(target, msg.header, env):  # re-encode the defanged header
        frames = [msgpack.packb(msg.header, use_bin_type=True), *frames[1:]]
        msg = _decodes(frames)
    header = _header_of(frames)
    if transport == "unix":  # the same server over its same-host socket: a stream of prefixed messages
        address = env.local_address if target == "controller" else env.unit_local_addresses[unit]
    elif transport == "tcp":  # ... and over its TCP stream socket (after the token)
        address = env.stream_address if target == "controller" else env.unit_stream_addresses[unit]
    else:
        address = env.address if target == "controller" else env.unit_addresses[unit]
    before = _state(env, target, unit)
    timeout = DROP_WAIT_S if header is None else REPLY_TIMEOUT_S
    exchange = raw_exchange if transport == "zmq" else raw_exchange_stream
    reply = exchange(address, frames, timeout=timeout)  # a reply that fails to decode raises here
    if reply is None:
        assert header is None, f"{target} sent no reply within {timeout}s to a request with a readable header: {header!r}"
        env.outcomes["dropped"] += 1
    else:
        want_rid = msg.header.get("rid") if msg is not None else None  # echoed once the message decodes
        assert _same(reply.header.get("rid"), want_rid), f"reply rid {reply.header.get('rid')!r}, request rid {want_rid!r}"
        if reply.header.get("ok") is True:
            assert msg is not None and msg.header.get("op") in _known_ops(target) and isinstance(msg.header.get("args"), dict), (
                f"{target} accepted a malformed request: {header!r}"
            )
            assert msg.header["op"] not in DESTRUCTIVE, f"a destructive request got through _defang: {msg.header!r}"
            # the result is of the op's reply type, as a client decodes it (MalformedMessageError if not)
            REPLY_DECODERS[target][msg.header["op"]].decode(msgspec.msgpack.encode(reply.header["result"]))
            env.outcomes[f"ok:{msg.header['op']}"] += 1
        else:
            with pytest.raises(TQError) as info:
                protocol.raise_for_reply(reply)
            name = type(info.value).__name__
            env.outcomes[f"error:{name}"] += 1
            if name == "TQError":  # the server's catch-all: input reached code that did not validate it
                env.internal[(target, str(header.get("op")) if header else None, str(info.value).split(":")[0])] += 1
            after = _state(env, target, unit)
            assert _same(after, before), f"a refused request changed {target} state:\n{header!r}\n{before!r}\n->\n{after!r}"

    # the service keeps serving, with the same processes (a unit that missed a heartbeat on a stalled CI
    # machine gets a few seconds to answer the next one)
    def all_alive() -> dict | None:
        s = env.client.stats()
        return s if all(u["alive"] for u in s["units"]) else None

    stats = wait_until(all_alive, timeout=10.0)
    assert stats, "a storage unit stopped answering the controller's heartbeat"
    assert [u["pid"] for u in sorted(stats["units"], key=lambda u: u["unit_id"])] == env.unit_pids
    assert all("bytes_used" in u for u in stats["unit_stats"]) and len(stats["unit_stats"]) == len(env.unit_pids)


# ----------------------------------------------------------------------------- the fuzz tests
@pytest.mark.parametrize("transport", ["zmq", "unix", "tcp"])
@pytest.mark.parametrize("target", ["controller", "unit"])
def test_fuzz_hostile_messages(env, target, transport):
    """Random, mutated and truncated messages to the controller or a storage unit, over ZMQ or the
    server's Unix or TCP stream socket: each gets an error reply (or is dropped, if unreadable), changes
    nothing when refused, and the service keeps serving; the reference data stays intact (sha256
    over both transports)."""
    rejected_before = _rejected(env)
    env.outcomes.clear()
    env.internal.clear()

    @settings(
        max_examples=EXAMPLES_PER_TARGET,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(data=st.data())
    def run(data):
        unit = data.draw(st.integers(0, len(env.unit_addresses) - 1), label="unit") if target == "unit" else 0
        check_example(env, target, unit, draw_example(data, target, env, unit), transport)

    run()
    assert env.ref.verify() == 2 * len(env.ref.keys) * len(REF_FIELDS)
    assert _rejected(env) > rejected_before  # the fuzz did reach the servers' validation
    errors = sum(v for k, v in env.outcomes.items() if k.startswith("error:"))
    assert errors > 0
    print(f"\n{target}: outcomes {dict(sorted(env.outcomes.items()))}\n  generic errors {dict(env.internal)}")


def _rejected(env: FuzzEnv) -> int:
    s = env.client.stats()
    return s["rejected_messages"] + sum(u["rejected_messages"] for u in s["unit_stats"])


def test_oversized_header_and_many_frames(env):
    """A header frame past the 64 MiB header limit and a message of 500 frames get error replies from
    the controller and a unit; the reference data stays intact."""
    big = msgpack.packb({"v": 1, "op": "stats", "rid": 1, "args": {"pad": b"\0" * protocol.MAX_HEADER_BYTES}, "bs": []})
    many = [b"\0"] * 500
    for address in (env.address, env.unit_addresses[0]):
        reply = raw_exchange(address, [big, b""], timeout=30.0)
        with pytest.raises(MessageTooLargeError, match=str(protocol.MAX_HEADER_BYTES)):
            protocol.raise_for_reply(reply)
        head = msgpack.packb({"v": 1, "op": "stats", "rid": 2, "args": {}, "bs": [1] * 499})
        reply = raw_exchange(address, [head, b"", *many[:-1]], timeout=10.0)
        assert protocol.raise_for_reply(reply) is not None  # well-formed: 499 buffers, all declared
        reply = raw_exchange(address, [head, b"", *many], timeout=10.0)
        with pytest.raises(TQError, match="buffer"):
            protocol.raise_for_reply(reply)
    del big
    env.ref.verify()


# ----------------------------------------------------------------------------- findings
# Bugs the fuzzer found, now fixed; each test states the contract it broke.
def _call_raw(address: str, op: str, args: dict, bufs: list | None = None, timeout: float = 2.0):
    return raw_exchange(address, protocol.request(op, 7, args, bufs or [], None), timeout=timeout)


@pytest.mark.parametrize("timeout", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_finding_wait_with_nonfinite_timeout_is_answered(env, timeout):
    reply = _call_raw(
        env.address, "wait", {"partition": env.ref.pid, "keys": env.ref.keys[:1], "fields": ["never"], "timeout": timeout}, timeout=2.0
    )
    assert reply is not None, "no answer: the wait is parked with a deadline that never comes"
    with pytest.raises(InvalidRequestError):
        protocol.raise_for_reply(reply)


def test_finding_commit_with_overflowing_block_changes_nothing(env):
    c = env.client
    pid = f"fz-overflow-{uuid.uuid4().hex[:6]}"
    c.register_partition(pid)
    try:
        meta = c.put(pid, ["a", "b"], {"x": torch.tensor([1, 2])})
        meta = c.write_back(meta, {"adv": torch.tensor([0.5, -1.0])})
        bufs: list = []
        nb = protocol.pack_array(np.array([4, 4], dtype=np.int64), bufs)
        offsets = protocol.pack_array(np.array([0, 4], dtype=np.int64), bufs)
        base = {
            "partition": pid,
            "blocks": [[0, 2**63, 2]],
            "fields": {"adv": {"schema": ["tensor", "float32", []], "row_nbytes": nb, "arena_offsets": offsets}},
        }
        put = _call_raw(env.address, "commit", {**base, "keys": ["new1", "new2"], "mode": "put"}, bufs)
        over = _call_raw(env.address, "commit", {**base, "keys": ["a", "b"], "mode": "write_back", "overwrite": True}, bufs)
        problems = []
        for name, reply in (("put", put), ("overwrite", over)):
            try:
                protocol.raise_for_reply(reply)
                problems.append(f"{name}: accepted")
            except InvalidRequestError:
                pass
            except TQError as exc:
                problems.append(f"{name}: {type(exc).__name__}: {exc}")
        keys = c.get_meta(pid).keys
        if keys != ("a", "b"):
            problems.append(f"the failed put commit added keys: {keys}")
        time.sleep(0.3)  # frees are fire-and-forget
        try:
            assert torch.equal(c.get(meta, ["adv"])["adv"], torch.tensor([0.5, -1.0]))
        except StorageUnitError as exc:
            problems.append(f"the failed overwrite commit freed the old rows: {exc}")
        assert not problems, problems
    finally:
        c.drop_partition(pid)


def test_commit_locating_rows_outside_the_arena_fails_reads_naming_the_key(env):
    """Same-host reads copy at the arena offsets a commit recorded: offsets past the arena's end give a
    clear error naming the field and key (never a read outside the mapping), and nothing else breaks."""
    c = env.ref.clients["auto"]
    pid = f"fz-offsets-{uuid.uuid4().hex[:6]}"
    c.register_partition(pid)
    try:
        ok = c.put(pid, ["near"], {"x": torch.tensor([2.5])})
        located, msg = c._ctrl.call("locate", {"partition": pid, "keys": ["near"], "fields": ["x"]})
        far_unit = 1 - int(protocol.unpack_array(located.loc, msg.buffers)[0, 0, 0])  # the other unit
        bufs: list = []  # a real block of the other unit, stored as a client would
        spec = {
            "schema": ["tensor", "float32", []],
            "row_offsets": protocol.pack_array(np.array([0, 4], dtype=np.int64), bufs),
            "data": protocol.pack_array(np.frombuffer(np.float32(2.5).tobytes(), np.uint8), bufs),
        }
        block = protocol.raise_for_reply(_call_raw(env.unit_addresses[far_unit], "store", {"n_rows": 1, "fields": {"x": spec}}, bufs))[
            "block"
        ]
        bufs = []
        fields = {
            "x": {
                "schema": ["tensor", "float32", []],
                "row_nbytes": protocol.pack_array(np.array([4], dtype=np.int64), bufs),
                "arena_offsets": protocol.pack_array(np.array([1 << 40], dtype=np.int64), bufs),
            }
        }
        protocol.raise_for_reply(
            _call_raw(
                env.address,
                "commit",
                {"partition": pid, "keys": ["far"], "mode": "put", "blocks": [[far_unit, block, 1]], "fields": fields},
                bufs,
            )
        )
        bad = rf"field 'x' of key 'far' is located outside storage unit {far_unit}'s arena"
        with pytest.raises(MalformedMessageError, match=bad):  # every row on one unit
            c.get(c.get_meta(pid, ["far"]), ["x"])
        with pytest.raises(MalformedMessageError, match=bad):  # rows on both units
            c.get(c.get_meta(pid, ["near", "far"]), ["x"])
        assert torch.equal(c.get(ok, ["x"])["x"], torch.tensor([2.5]))
    finally:
        c.drop_partition(pid)


@pytest.mark.parametrize("bad", ["n_rows", "offset"])
def test_finding_store_with_a_boolean_count_is_refused_and_changes_nothing(env, bad):
    """msgpack's ``false`` is a Python bool, which passes ``isinstance(v, int)``: a store whose row count
    or field offset was ``false`` got an allocation and then failed with a TypeError, leaving it behind."""
    before = _quiet_state(env, 0)
    bufs: list = []
    rows = [0] if bad == "n_rows" else [0, 1]  # n_rows=false reads as 0 rows: one row offset
    spec = {
        "schema": ["tensor", "uint8", []],
        "row_offsets": protocol.pack_array(np.array(rows, dtype=np.int64), bufs),
        **({"data": protocol.pack_array(np.zeros(0, dtype=np.uint8), bufs)} if bad == "n_rows" else {"offset": False}),
    }
    args = {"n_rows": False if bad == "n_rows" else 1, "fields": {"f": spec}}
    if bad == "offset":
        args["alloc"] = protocol.raise_for_reply(_call_raw(env.unit_addresses[0], "alloc", {"nbytes": 64}))["alloc"]
        before = _quiet_state(env, 0)
    with pytest.raises(InvalidRequestError):
        protocol.raise_for_reply(_call_raw(env.unit_addresses[0], "store", args, bufs))
    assert _state(env, "unit", 0) == before


def test_finding_fetch_with_out_of_range_block_is_refused(env):
    block = env.ref_blocks[0][0]
    bufs: list = []
    entries = protocol.pack_array(np.array([[0, block - (1 << 40), 0]], dtype=np.int64), bufs)
    reply = _call_raw(env.unit_addresses[0], "fetch", {"fields": ["nope", "ids"], "mode": "tcp", "entries": entries}, bufs)
    with pytest.raises(TQError):  # served: row 0 of field 'ids' (index -1) of the real block
        protocol.raise_for_reply(reply)


def test_finding_register_unit_with_bad_address_keeps_the_unit():
    with TQServer(storage_units=1, capacity=8 << 20) as server, TQClient(server.address, timeout=10.0) as c:
        c.register_partition("p")
        meta = c.put("p", ["a"], {"x": torch.tensor([7])})
        reply = _call_raw(server.address, "register_unit", {"address": "not-an-endpoint", "arena_size": 1, "rejoin": 0})
        with pytest.raises(TQError) as refused:
            protocol.raise_for_reply(reply)
        time.sleep(4.0)  # past the controller's 3 s unit timeout: today unit 0 is reported down here
        assert torch.equal(c.get(meta)["x"], torch.tensor([7]))
        assert isinstance(refused.value, InvalidRequestError), refused.value  # today: TQError "ZMQError: ..."


def test_finding_array_ref_with_overflowing_shape_is_malformed(env):
    bufs: list = []
    entries = {"b": 0, "d": "<i8", "s": [2**32, 2**32]}  # 2**64 elements: the int64 product wraps to 0
    bufs.append(b"")
    reply = _call_raw(env.unit_addresses[0], "fetch", {"fields": ["ids"], "mode": "tcp", "entries": entries}, bufs)
    with pytest.raises(protocol.MalformedMessageError, match="entries"):  # today: TQError "ValueError: array is too big"
        protocol.raise_for_reply(reply)
