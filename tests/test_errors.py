"""Error paths of the TQ service: precise exception types, messages that name the offending thing,
and a service that keeps serving - with its stored data intact - after every error.

Real controller and storage-unit processes and real sockets throughout; hostile messages are sent
with a plain ZMQ DEALER socket.
"""

from __future__ import annotations

import os
import tempfile
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import msgpack
import numpy as np
import pytest
import torch
import zmq

from conftest import assert_same, free_port, pid_alive, raw_exchange, unique_keys, wait_until
from tq import JaggedTensor, KVBatchMeta, TQClient, TQServer, launch, protocol
from tq.locations import ALIVE_S, H_ALIVE_UNTIL
from tq.errors import (
    StorageUnitError,
    AuthenticationError,
    CapacityError,
    DuplicateKeyError,
    FieldNotProducedError,
    InvalidRequestError,
    KeyNotFoundError,
    MalformedMessageError,
    MessageTooLargeError,
    PartitionExistsError,
    PartitionNotFoundError,
    ProtocolVersionError,
    SchemaConflictError,
    TQConnectionError,
    TQError,
    UnknownOperationError,
)

TRANSPORTS = ["auto", "tcp"]


# ----------------------------------------------------------------------------- helpers
new_keys = unique_keys


# ----------------------------------------------------------------------------- reference data
class Reference:
    """Batches stored at the start of the module (on both units, over both transports) and re-read
    bit-exactly after every error: an error must never disturb data that is already stored."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.clients = {t: TQClient(address, timeout=15.0, transport=t) for t in TRANSPORTS}
        self.pid = f"ref-{uuid.uuid4().hex[:6]}"
        self.clients["auto"].register_partition(self.pid)
        self.batches = []
        g = torch.Generator().manual_seed(0)
        for i, transport in enumerate(TRANSPORTS * 2):  # two puts per client: round-robin over both units
            lengths = [3, 0, 5, 2]
            ids = [torch.randint(0, 50_000, (L,), generator=g) for L in lengths]
            lp = JaggedTensor.from_list([torch.randn(L, generator=g).to(torch.bfloat16) for L in lengths])
            lp.values[0:1].view(torch.int16).fill_(0x7FC1)  # a NaN with a payload
            reward = torch.randn(4, generator=g, dtype=torch.float64)
            msgs = [[{"role": "user", "content": f"q{i}-{j}"}] for j in range(4)]
            meta = self.clients[transport].put(self.pid, new_keys(4, f"ref{i}-"), {"ids": ids, "lp": lp, "reward": reward, "msgs": msgs})
            self.batches.append((meta, ids, lp, reward, msgs))

    def check(self) -> None:
        """Every stored batch reads back bit-exactly over both transports; every unit answers."""
        for transport, c in self.clients.items():
            for meta, ids, lp, reward, msgs in self.batches:
                got = c.get(meta, layout="list")
                assert len(got["ids"]) == len(ids)
                for g_, w in zip(got["ids"], ids):
                    assert_same(g_, w)
                for g_, w in zip(got["lp"], lp.unbind()):
                    assert_same(g_, w)
                assert_same(got["reward"], reward)
                assert got["msgs"] == msgs
        stats = self.clients["tcp"].stats()
        assert len(stats["unit_stats"]) == 2

    def close(self) -> None:
        try:
            self.clients["auto"].drop_partition(self.pid)
        finally:
            for c in self.clients.values():
                c.close()


@pytest.fixture(scope="module")
def ref(tq_server):
    r = Reference(tq_server.address)
    yield r
    r.close()


# ----------------------------------------------------------------------------- partitions
def test_unknown_partition(tclient, ref):
    ghost = f"ghost-{uuid.uuid4().hex[:6]}"
    meta = KVBatchMeta(ghost, ("a", "b"), ("x",))
    for call in (
        lambda: tclient.get(meta),
        lambda: tclient.put(ghost, ["a", "b"], {"x": torch.zeros(2)}),
        lambda: tclient.write_back(meta, {"y": torch.zeros(2)}),
        lambda: tclient.wait(meta, timeout=1),
        lambda: tclient.discard(meta),
        lambda: tclient.get_meta(ghost),
        lambda: tclient.mint_keys(ghost, ["u"], 2),
        lambda: tclient.clear_partition(ghost),
        lambda: tclient.drop_partition(ghost),
    ):
        with pytest.raises(PartitionNotFoundError, match=ghost):
            call()
    assert all(p["partition"] != ghost for p in tclient.list_partitions())
    ref.check()


def test_register_existing_partition_without_reuse(tclient, part, ref):
    meta = tclient.put(part, new_keys(2), {"x": torch.tensor([1.5, -2.0])})
    with pytest.raises(PartitionExistsError, match=rf"'{part}'.*reuse"):
        tclient.register_partition(part)
    assert_same(tclient.get(meta)["x"], torch.tensor([1.5, -2.0]))  # nothing was cleared
    with pytest.raises(PartitionExistsError, match=ref.pid):
        tclient.register_partition(ref.pid)
    ref.check()


# ----------------------------------------------------------------------------- keys
def test_unknown_key(tclient, part, ref):
    meta = tclient.put(part, new_keys(3), {"x": torch.arange(3)})
    bad = KVBatchMeta(part, (meta.keys[0], "no-such-key", meta.keys[2]), ("x",))
    with pytest.raises(KeyNotFoundError, match=r"'no-such-key'.*" + part):
        tclient.get(bad)
    with pytest.raises(KeyNotFoundError, match="no-such-key"):
        tclient.write_back(bad, {"y": torch.zeros(3)})
    with pytest.raises(KeyNotFoundError, match="no-such-key"):
        tclient.discard(bad)
    with pytest.raises(KeyNotFoundError, match="no-such-key"):
        tclient.get_meta(part, ["no-such-key"])
    # none of the failed calls changed anything: no field y, no key discarded
    assert tclient.get_meta(part).keys == meta.keys
    assert tclient.discard(meta) == 3
    ref.check()


def test_duplicate_keys_in_one_put(tclient, part, ref):
    with pytest.raises(DuplicateKeyError, match="'dup'"):
        tclient.put(part, ["a", "dup", "b", "dup"], {"x": torch.zeros(4)})
    with pytest.raises(DuplicateKeyError, match="'m_g0'"):
        tclient.mint_keys(part, ["m", "m"], 1)
    # the controller checks too, whatever the client does
    with pytest.raises(DuplicateKeyError, match="'z'"):
        tclient._call("discard", {"partition": part, "keys": ["z", "z"]})
    assert tclient.get_meta(part).keys == ()
    ref.check()


def test_put_of_key_that_already_holds_data(tclient, part, ref):
    uid = f"u{uuid.uuid4().hex[:6]}"
    keys = [f"{uid}_g{i}" for i in range(3)]
    meta = tclient.put(part, keys, {"x": torch.tensor([1, 2, 3], dtype=torch.int32)})
    with pytest.raises(DuplicateKeyError, match=rf"'{keys[1]}'.*already holds data"):
        tclient.put(part, [new_keys(1)[0], keys[1]], {"x": torch.tensor([7, 8], dtype=torch.int32)})
    with pytest.raises(DuplicateKeyError, match=rf"'{keys[0]}'.*already exists"):
        tclient.mint_keys(part, [uid], 3)
    assert tclient.get_meta(part).keys == tuple(keys)  # the new key of the failed put was not added
    assert_same(tclient.get(meta)["x"], torch.tensor([1, 2, 3], dtype=torch.int32))
    ref.check()


# ----------------------------------------------------------------------------- fields and schemas
def test_field_never_produced_or_produced_for_some_keys(tclient, part, ref):
    meta = tclient.put(part, new_keys(4), {"x": torch.arange(4.0)})
    with pytest.raises(FieldNotProducedError, match=rf"'never'.*never produced.*'{part}'"):
        tclient.get(meta, ["x", "never"])
    tclient.write_back(meta.select([0, 1]), {"half": torch.ones(2)})
    with pytest.raises(FieldNotProducedError, match=rf"'half'.*2 of 4 keys.*'{meta.keys[2]}'"):
        tclient.get(meta, ["half"])
    assert_same(tclient.get(meta.select([1, 0]), ["half"])["half"], torch.ones(2))
    ref.check()


def test_dtype_conflict_on_write_back(tclient, part, ref):
    meta = tclient.put(part, new_keys(4), {"ids": [torch.arange(L) for L in (2, 3, 1, 4)]})
    lp = [torch.randn(L) for L in (2, 3)]
    tclient.write_back(meta.select([0, 1]), {"lp": lp})
    with pytest.raises(SchemaConflictError, match=r"'lp'.*float32.*int64|'lp'.*jagged float32.*jagged int64"):
        tclient.write_back(meta.select([2, 3]), {"lp": [torch.arange(L) for L in (1, 4)]})
    with pytest.raises(SchemaConflictError, match="'ids'"):  # a new put must match the schema too
        tclient.put(part, new_keys(1), {"ids": [torch.arange(3, dtype=torch.int32)]})
    got = tclient.get(meta.select([0, 1]), ["lp"], layout="list")["lp"]
    for g, w in zip(got, lp):
        assert_same(g, w)
    with pytest.raises(FieldNotProducedError, match="'lp'"):  # the rejected write left nothing behind
        tclient.get(meta.select([2]), ["lp"])
    ref.check()


def test_shape_and_kind_conflicts_on_write_back(tclient, part, ref):
    meta = tclient.put(part, new_keys(4), {"x": torch.zeros(4)})
    emb = torch.randn(2, 3)
    tclient.write_back(meta.select([0, 1]), {"emb": emb})
    with pytest.raises(SchemaConflictError, match=r"'emb'.*\[3\].*\[4\]"):
        tclient.write_back(meta.select([2, 3]), {"emb": torch.randn(2, 4)})
    with pytest.raises(SchemaConflictError, match=r"'emb'.*tensor.*jagged"):
        tclient.write_back(meta.select([2, 3]), {"emb": [torch.randn(1, 3), torch.randn(2, 3)]})
    with pytest.raises(SchemaConflictError, match=r"'emb'.*object"):
        tclient.write_back(meta.select([2, 3]), {"emb": ["a", "b"]})
    assert_same(tclient.get(meta.select([0, 1]), ["emb"])["emb"], emb)
    ref.check()


def test_writing_a_field_twice(tclient, part, ref):
    meta = tclient.put(part, new_keys(3), {"x": torch.zeros(3)})
    adv = torch.tensor([0.5, -1.0, 2.0])
    tclient.write_back(meta, {"adv": adv})
    with pytest.raises(SchemaConflictError, match=rf"'adv'.*already produced.*'{meta.keys[1]}'"):
        tclient.write_back(meta.select([1]), {"adv": torch.tensor([9.0])})
    with pytest.raises(SchemaConflictError, match="'x'"):
        tclient.write_back(meta, {"x": torch.ones(3)})
    assert_same(tclient.get(meta, ["adv"])["adv"], adv)
    assert_same(tclient.get(meta, ["x"])["x"], torch.zeros(3))
    ref.check()


# ----------------------------------------------------------------------------- invalid requests
def test_wrong_row_count(tclient, part, ref):
    keys = new_keys(4)
    cases = {
        "t": torch.zeros(3),
        "fixed": torch.zeros(5, 2),
        "lst": [torch.zeros(2)] * 3,
        "obj": ["a", "b"],
        "jt": JaggedTensor.from_list([torch.zeros(1), torch.zeros(2)]),
        "scalar0d": torch.tensor(1.0),
    }
    for name, value in cases.items():
        with pytest.raises(InvalidRequestError, match=rf"'{name}'.*(3|5|2|shape \(\)).*4"):
            tclient.put(part, keys, {"ok": torch.zeros(4), name: value})
    with pytest.raises(InvalidRequestError, match="at least one key"):
        tclient.put(part, [], {"x": torch.zeros(0)})
    with pytest.raises(InvalidRequestError, match="at least one column"):
        tclient.put(part, keys, {})
    assert tclient.get_meta(part).keys == ()  # nothing half-written
    ref.check()


def test_unsupported_dtype(tclient, part, ref):
    keys = new_keys(2)
    with pytest.raises(InvalidRequestError, match=r"'cplx'.*complex64"):
        tclient.put(part, keys, {"cplx": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(InvalidRequestError, match=r"'jag'.*complex128"):
        tclient.put(part, keys, {"jag": [torch.zeros(1, dtype=torch.complex128)] * 2})
    with pytest.raises(InvalidRequestError, match=r"'u16'.*uint16"):
        tclient.put(part, keys, {"u16": torch.zeros(2, dtype=torch.uint16)})
    assert tclient.get_meta(part).keys == ()
    ref.check()


def test_unsupported_column_type(tclient, part, ref):
    keys = new_keys(2)
    for name, value, what in [
        ("d", {"a": 1}, "dict"),
        ("i", 5, "int"),
        ("s", "ab", "str"),
        ("objs", [object(), object()], "msgpack"),
        ("sets", [{1}, {2}], "msgpack"),
    ]:
        with pytest.raises(InvalidRequestError, match=rf"'{name}'.*{what}"):
            tclient.put(part, keys, {name: value})
    with pytest.raises(SchemaConflictError, match=r"'mixed'.*row 1"):  # rows of one column must agree
        tclient.put(part, keys, {"mixed": [torch.zeros(2), torch.zeros(2, dtype=torch.int64)]})
    with pytest.raises(InvalidRequestError, match="transport"):
        TQClient(tclient.address, transport="udp")
    assert tclient.get_meta(part).keys == ()
    ref.check()


def test_columns_that_would_read_back_wrong_are_refused_naming_the_field(tclient, part, ref):
    """Each was stored and read back wrong, or raised from inside a library: an int past 64 bits in
    a value (msgpack's OverflowError); 0-d rows of mixed dtypes (torch.stack made 2**40 + 1 a float32,
    1099511627776.0) or shapes (stack's RuntimeError naming no field); jagged rows whose entries hold
    no bytes (shape (L, 0): every length read back as 0, as the reader divides bytes by entry size)."""
    keys = new_keys(3)
    with pytest.raises(InvalidRequestError, match=r"field 'o': values must be .*msgpack-able.*out of range"):
        tclient.put(part, keys, {"o": [{"big": 2**64}, 1, 2]})
    with pytest.raises(SchemaConflictError, match=r"field 's': row 1 is torch.int64\(\), row 0 is torch.float32\(\)"):
        tclient.put(part, keys, {"s": [torch.tensor(1.0), torch.tensor(2**40 + 1), torch.tensor(3.0)]})
    with pytest.raises(SchemaConflictError, match=r"field 's': row 1 is torch.float32\(2,\)"):
        tclient.put(part, keys, {"s": [torch.tensor(1.0), torch.tensor([1.0, 2.0]), torch.tensor(3.0)]})
    with pytest.raises(SchemaConflictError, match=r"field 's': row 1 is torch.float32\(\), row 0 is torch.float32\(1,\)"):
        tclient.put(part, keys, {"s": [torch.tensor([1.0]), torch.tensor(2.0), torch.tensor(3.0)]})
    for empty in ([torch.zeros(2, 0), torch.zeros(1, 0), torch.zeros(3, 0)], JaggedTensor(torch.zeros(6, 0), torch.tensor([0, 2, 3, 6]))):
        with pytest.raises(InvalidRequestError, match=r"field 'x': jagged rows of shape \(length, 0\) hold no bytes"):
            tclient.put(part, keys, {"x": empty})
    assert tclient.get_meta(part).keys == ()
    ref.check()


# ----------------------------------------------------------------------------- hostile raw messages
def _hdr(**kv) -> bytes:
    return msgpack.packb(kv, use_bin_type=True)


def _bad_ref_fetch() -> list:
    return [
        _hdr(v=1, rid=5, op="fetch", bs=[8], args={"mode": "tcp", "fields": ["x"], "entries": {"b": 9, "d": "<i8", "s": [1, 3]}}),
        b"",
        b"\0" * 8,
    ]


def _bad_dtype_ref_commit(pid: str) -> list:
    return [
        _hdr(
            v=1,
            rid=5,
            op="commit",
            bs=[8],
            args={
                "partition": pid,
                "keys": ["a"],
                "mode": "put",
                "blocks": [[0, 10**9, 1]],  # no real block
                "fields": {
                    "f": {
                        "schema": ["tensor", "float32", []],
                        "row_nbytes": {"b": 0, "d": "|O", "s": [1]},
                        "arena_offsets": {"b": 0, "d": "<i8", "s": [1]},
                    }
                },
            },
        ),
        b"",
        b"\0" * 8,
    ]


HOSTILE = {
    # id: (frames, expected error type or None for "no reply required", message pattern)
    "not-msgpack": ([b"\xc1\xc1\xc1", b""], MalformedMessageError, "not valid msgpack"),
    "empty-header": ([b"", b""], MalformedMessageError, "not valid msgpack"),
    "bad-utf8": ([b"\xa2\xff\xfe", b""], MalformedMessageError, "not valid msgpack"),
    "header-is-list": ([msgpack.packb([1, "op", {}]), b""], MalformedMessageError, "must be a map, got list"),
    "missing-op": ([_hdr(v=1, rid=3, args={}, bs=[]), b""], MalformedMessageError, "'op'"),
    "args-not-map": ([_hdr(v=1, rid=3, op="stats", args=[1, 2], bs=[]), b""], MalformedMessageError, "'args'"),
    "unknown-op": ([_hdr(v=1, rid=3, op="frobnicate", args={}, bs=[]), b""], UnknownOperationError, "'frobnicate'"),
    "wrong-version": ([_hdr(v=99, rid=3, op="stats", args={}, bs=[]), b""], ProtocolVersionError, "99"),
    "no-version": ([_hdr(rid=3, op="stats", args={}, bs=[]), b""], ProtocolVersionError, "None"),
    "size-mismatch": ([_hdr(v=1, rid=3, op="stats", args={}, bs=[10]), b"", b"12345"], MalformedMessageError, "declared 10, got 5"),
    "truncated": ([_hdr(v=1, rid=3, op="stats", args={}, bs=[4, 4]), b"", b"1234"], MalformedMessageError, r"\[4, 4\].*1 buffer"),
    "extra-frame": ([_hdr(v=1, rid=3, op="stats", args={}, bs=[]), b"", b"xx"], MalformedMessageError, r"\[\].*1 buffer"),
    "sizes-not-list": ([_hdr(v=1, rid=3, op="stats", args={}, bs="4"), b"", b"1234"], MalformedMessageError, "buffer sizes"),
    "single-frame": ([_hdr(v=1, rid=3, op="stats", args={}, bs=[])], None, "1 frame"),
    # what a peer sent is shown cut short in the error (and the log line): a 1 MB field makes no 1 MB reply
    "huge-version": (
        [_hdr(v="v" * 1_000_000, rid=3, op="stats", args={}, bs=[]), b""],
        ProtocolVersionError,
        "version 'vvv.*not supported",
    ),
    "huge-op": ([_hdr(v=1, rid=3, op="o" * 1_000_000, args={}, bs=[]), b""], UnknownOperationError, "no operation 'ooo"),
    "huge-sizes": ([_hdr(v=1, rid=3, op="stats", args={}, bs=[7] * 200_000), b""], MalformedMessageError, r"\[7, 7, .*0 buffer frames"),
    "bad-array-ref": (_bad_ref_fetch(), None, None),  # per target below
}


def _target_address(tq_server_client: TQClient, target: str) -> str:
    if target == "controller":
        return tq_server_client.address
    return tq_server_client._units[int(target[-1])].address


@pytest.mark.parametrize("target", ["controller", "unit0", "unit1"])
@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_message_gets_error_reply_and_server_keeps_serving(ref, target, case):
    c = ref.clients["tcp"]
    address = _target_address(c, target)
    frames, exc_type, pattern = HOSTILE[case]
    if case == "bad-array-ref":
        if target == "controller":
            frames, exc_type, pattern = _bad_dtype_ref_commit(ref.pid), MalformedMessageError, r"row_nbytes.*'\|O'"
        else:
            frames, exc_type, pattern = _bad_ref_fetch(), MalformedMessageError, "buffer index 9 out of range"

    def rejected() -> int:
        s = c.stats()
        return s["rejected_messages"] if target == "controller" else s["unit_stats"][int(target[-1])]["rejected_messages"]

    rejected_before = rejected()
    reply = raw_exchange(address, frames)
    if exc_type is None:  # the server may drop a message it cannot even frame; it must keep serving
        if reply is not None:
            with pytest.raises(MalformedMessageError, match=pattern):
                protocol.raise_for_reply(reply)
    else:
        assert reply is not None, f"{target} sent no reply to a {case} message"
        with pytest.raises(exc_type, match=pattern) as raised:
            protocol.raise_for_reply(reply)
        assert len(str(raised.value)) < 400, f"an error of {len(str(raised.value))} characters"
        if case == "unknown-op":
            assert reply.header["rid"] == 3  # the request id is echoed
    if case != "bad-array-ref":  # well-framed requests with bad arguments are not "rejected messages"
        assert rejected() == rejected_before + 1
    ref.check()  # the service keeps serving and nothing stored was disturbed


def test_a_peer_flooding_malformed_messages_gets_every_error_but_not_a_log_line_each(caplog):
    """A server answers every malformed message with its error and counts each (stats, metrics), but
    logs what peers do wrong at most once per 10 s per kind, then says how many it left out: a peer
    sending garbage as fast as it can (or, with a secret, failing handshakes) must not fill the log."""
    import logging

    from tq import messages
    from tq.rpc import RpcServer

    server = RpcServer("flooded", "tcp://127.0.0.1:0", secret=None, max_message_bytes=1 << 20)
    server.serve_ops({"ping": messages.Ping}, {"ping": lambda args, buffers, call: {}})
    loop = threading.Thread(target=server.serve_forever, daemon=True)
    caplog.set_level(logging.WARNING, logger="tq.rpc")
    loop.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    try:
        for _ in range(300):
            sock.send_multipart([b"\xc1\xc1", b""])
        for _ in range(300):  # every one answered with its error
            assert sock.poll(5000), "a malformed message went unanswered"
            with pytest.raises(MalformedMessageError, match="not valid msgpack"):
                protocol.raise_for_reply(protocol.decode(sock.recv_multipart(), None))
        assert server.rejected == 300
        lines = [r for r in caplog.records if "rejected a message" in r.getMessage()]
        assert 1 <= len(lines) <= 2, f"{len(lines)} warning lines for 300 malformed messages"
    finally:
        sock.close(0)
        server.stop()
        loop.join(5)


def test_peer_log_writes_a_line_per_kind_per_interval_and_counts_what_it_left_out(caplog):
    """PeerLog itself: within its interval only the first line of a kind goes out, kinds apart; the
    next line after the interval says how many it left out (and only once)."""
    import logging

    from tq.peerlog import PeerLog

    peer_log = PeerLog(logging.getLogger("tq.test_peerlog"), every_s=0.2)
    with caplog.at_level(logging.WARNING, logger="tq.test_peerlog"):
        for i in range(5):
            peer_log.warning("message", "rejected %d", i)
        peer_log.warning("handshake", "refused %d", 0)
        time.sleep(0.25)
        peer_log.warning("message", "rejected %d", 5)
        time.sleep(0.25)
        peer_log.warning("message", "rejected %d", 6)
    assert [r.getMessage() for r in caplog.records] == [
        "rejected 0",
        "refused 0",
        "rejected 5 (and 4 more like it since the last such line, not logged)",
        "rejected 6",
    ]


def test_decode_rejects_oversized_messages_and_headers():
    frames = protocol.encode({"op": "x", "rid": 1, "args": {}}, [b"\0" * 64], None)
    assert protocol.decode(frames, None, max_message_bytes=64).buffers[0].nbytes == 64
    with pytest.raises(MessageTooLargeError, match=r"65 bytes exceeds the limit of 64"):
        protocol.decode(protocol.encode({"op": "x", "rid": 1, "args": {}}, [b"\0" * 65], None), None, max_message_bytes=64)
    big_header = b"\0" * (protocol.MAX_HEADER_BYTES + 1)
    with pytest.raises(MessageTooLargeError, match=str(protocol.MAX_HEADER_BYTES)):
        protocol.decode([big_header, b""], None)
    with pytest.raises(MalformedMessageError, match="0 frame"):
        protocol.decode([], None)


def test_decode_rejects_bad_array_refs():
    bufs = [memoryview(b"\0" * 16)]
    ok = protocol.unpack_array({"b": 0, "d": "<i8", "s": [2]}, bufs)
    assert ok.tolist() == [0, 0]
    for ref_, pattern in [
        ({"b": 0, "d": "|O", "s": [2]}, "dtype"),
        ({"b": 0, "d": "<i8", "s": [3]}, "needs 24"),
        ({"b": 1, "d": "<i8", "s": [2]}, "out of range"),
        ({"b": 0, "d": "<i8", "s": [-2]}, "invalid shape"),
        ({"b": 0, "d": "<i8", "s": [1] * 9}, "invalid shape"),
        ({"b": "0", "d": "<i8", "s": [2]}, "array ref"),
        ([0, "<i8", [2]], "array ref"),
    ]:
        with pytest.raises(MalformedMessageError, match=pattern):
            protocol.unpack_array(ref_, bufs, name="arr")
    with pytest.raises(MalformedMessageError, match="dtype"):
        protocol.unpack_array({"b": 0, "d": "<f8", "s": [2]}, bufs, dtype="<i8")


def test_a_storage_unit_refuses_row_offsets_that_do_not_fit_the_schema():
    """The layout check every store and every adopted block passes: offsets start at 0, never go
    back (a row ending before it starts would read bytes outside its own), and fit the kind - a
    tensor's rows all of one size (a row going back is named as that, not as a size), a jagged
    column's rows whole elements."""
    from tq.schema import FieldSchema
    from tq.storage import validate_layout

    def check(wire, offsets):
        validate_layout(FieldSchema.from_wire(wire), np.asarray(offsets, dtype="<i8"), "f")

    tensor, jagged, obj = ["tensor", "float32", [2]], ["jagged", "int64", []], ["object", "object", []]
    for wire, offsets in [(tensor, [0, 8, 16]), (tensor, [0]), (jagged, [0, 0, 24, 32]), (obj, [0, 3, 3, 10])]:
        check(wire, offsets)
    for wire, offsets, pattern in [
        (tensor, [8, 16], "start at 0"),
        (tensor, [], "start at 0"),
        (tensor, [0, 8, 12], "holds 8 bytes"),
        (tensor, [0, 16, 8], "non-decreasing"),
        (jagged, [0, 16, 8], "non-decreasing"),
        (jagged, [0, 12], "multiples of 8"),
        (obj, [0, 5, 2], "non-decreasing"),
    ]:
        with pytest.raises(InvalidRequestError, match=pattern):
            check(wire, offsets)


def test_storage_unit_enforces_its_message_size_limit():
    """A storage unit run standalone with a 4 KiB limit: larger messages get MessageTooLargeError."""
    ctx = zmq.Context.instance()
    fake_ctrl = ctx.socket(zmq.ROUTER)  # stands in for the controller the unit registers with
    fake_ctrl.setsockopt(zmq.LINGER, 0)
    port = fake_ctrl.bind_to_random_port("tcp://127.0.0.1")
    proc = subprocess.Popen(
        launch.storage_unit_command(
            unit_id=0,
            bind="tcp://127.0.0.1:0",
            controller=f"tcp://127.0.0.1:{port}",
            capacity=1 << 20,
            shm_dir="/dev/shm",
            max_message_bytes=4096,
        ),
        stdout=subprocess.DEVNULL,
    )
    try:
        assert fake_ctrl.poll(60_000), "the storage unit never registered"
        ident, *frames = fake_ctrl.recv_multipart()
        msg = protocol.decode(frames, None)
        assert msg.header["op"] == "register_unit"
        info = msg.header["args"]
        fake_ctrl.send_multipart([ident, *protocol.reply_ok(msg.header["rid"], {"unit_id": 0}, [], None)])

        def store(nbytes: int):
            bufs: list = []
            data = np.arange(nbytes, dtype=np.int64).astype(np.uint8)
            ro = np.array([0, nbytes], dtype=np.int64)
            args = {
                "n_rows": 1,
                "fields": {
                    "f": {
                        "schema": ["jagged", "uint8", []],
                        "row_offsets": protocol.pack_array(ro, bufs),
                        "data": protocol.pack_array(data, bufs),
                    }
                },
            }
            return raw_exchange(info["address"], protocol.request("store", 1, args, bufs, None)), data

        reply, _ = store(8192)
        with pytest.raises(MessageTooLargeError, match=r"8208 bytes exceeds the limit of 4096"):
            protocol.raise_for_reply(reply)
        reply, data = store(1000)  # it keeps serving
        stored = protocol.raise_for_reply(reply)
        bufs = []
        req = {"fields": ["f"], "entries": protocol.pack_array(np.array([[0, stored["block"], 0]]), bufs)}
        reply = raw_exchange(info["address"], protocol.request("fetch", 2, req, bufs, None))
        out = protocol.raise_for_reply(reply)
        assert np.array_equal(protocol.unpack_array(out["frames"][0], reply.buffers), data)
        with open(info["arena_path"], "rb") as f:  # the bytes, where the unit says the field starts
            f.seek(stored["starts"]["f"])
            got = np.frombuffer(f.read(data.size), dtype=np.uint8)
        assert np.array_equal(got, data)
        assert protocol.raise_for_reply(raw_exchange(info["address"], protocol.request("shutdown", 3, {}, [], None)))["stopping"]
        proc.wait(30)
        assert not os.path.exists(info["arena_path"])  # a unit that stops removes its arena
    finally:
        if proc.poll() is None:
            proc.terminate()  # SIGTERM: the unit stops and removes its arena
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        fake_ctrl.close(0)


# ----------------------------------------------------------------------------- times
BAD_SECONDS = [float("inf"), float("nan"), -1.0, 1e12, "soon"]


@pytest.mark.parametrize("value", BAD_SECONDS, ids=str)
def test_a_wait_or_get_with_an_impossible_time_is_refused_naming_it(tclient, part, value):
    """An infinite, NaN, negative, too long or non-numeric wait is an InvalidRequestError naming the
    argument, before anything is sent (it was an OverflowError, a ValueError or a TypeError from
    inside the transport); the client works on."""
    meta = tclient.put(part, unique_keys(1), {"x": torch.ones(1, 2)})
    with pytest.raises(InvalidRequestError, match=r"^timeout must be"):
        tclient.wait(meta, ["x"], timeout=value)
    with pytest.raises(InvalidRequestError, match=r"^wait_timeout must be"):
        tclient.get(meta, ["x"], wait_timeout=value)
    tclient.wait(meta, ["x"], timeout=1e8)  # long, but a time: fine
    assert torch.equal(tclient.get(meta, ["x"], wait_timeout=1e8)["x"], torch.ones(1, 2))


@pytest.mark.parametrize(
    "call",
    [
        lambda c, p, m: c.put(p, "mn", {"y": torch.ones(2)}),
        lambda c, p, m: c.register_keys(p, "qr"),
        lambda c, p, m: c.get_meta(p, "ab"),
        lambda c, p, m: c.get(m, "xy"),
        lambda c, p, m: c.wait(m, "x"),
    ],
    ids=["put", "register_keys", "get_meta", "get", "wait"],
)
def test_keys_or_fields_given_as_one_string_are_refused(tclient, part, call):
    """``list("mn")`` is ``["m", "n"]``: a put of keys "mn" stored keys m and n."""
    meta = tclient.put(part, unique_keys(1), {"x": torch.ones(1, 2)})
    with pytest.raises(InvalidRequestError, match="must be a list of names, not a single str"):
        call(tclient, part, meta)
    assert tclient.get_meta(part).keys == meta.keys  # nothing was stored or registered


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tags": {"t": [object()]}}, "tag 't' value at index 0 has type object"),
        ({"tags": {"t": [1, 2]}}, "tag 't' has 2 values for 1 keys"),
        ({"sequence_lengths": [-3]}, "sequence_lengths value -3 for key"),
        ({"sequence_lengths": [2.7]}, "has type float; expected int"),
        (
            {"sequence_lengths": [2**63]},
            r"sequence_lengths value 9223372036854775808 for key .* is more than 2147483648 \(MAX_PAD_LENGTH\)",
        ),
        ({"tags": {"t": ["x" * 65537]}}, r"tag 't' value at index 0 has 65537 characters, more than MAX_TAG_CHARS \(65536\)"),
    ],
    ids=["tag-object", "tag-length", "negative-length", "float-length", "huge-length", "long-tag"],
)
def test_a_put_with_bad_tags_or_lengths_is_refused_before_anything_is_stored(tclient, part, kwargs, message):
    """A negative length used to be refused by the returned meta after the commit: the put raised
    ValueError with its key stored (a retry then hit DuplicateKeyError); a float length was truncated,
    an unencodable tag a TypeError from msgpack."""
    key = unique_keys(1)
    with pytest.raises(InvalidRequestError, match=message):
        tclient.put(part, key, {"x": torch.ones(1, 2)}, **kwargs)
    assert tclient.get_meta(part).keys == ()
    meta = tclient.put(part, key, {"x": torch.ones(1, 2)}, sequence_lengths=torch.tensor([2]))  # a tensor of lengths is fine
    assert meta.sequence_lengths == (2,) and tclient.get_meta(part).keys == tuple(key)


@pytest.mark.parametrize("pad_to", [-1, True, 2.5, "x", 10**20], ids=str)
def test_a_bad_pad_to_is_refused_naming_it(tclient, part, pad_to):
    """A huge one was an OverflowError from the copier, a string a TypeError from a comparison."""
    meta = tclient.put(part, unique_keys(2), {"x": [torch.ones(3), torch.ones(5)]})
    with pytest.raises(InvalidRequestError, match=r"pad_to must be None or a whole number in \[0, 2147483648\]"):
        tclient.get(meta, ["x"], pad_to=pad_to)
    assert tclient.get(meta, ["x"], pad_to=6)["x"].shape == (2, 6)


@pytest.mark.parametrize(
    "pad_value, message",
    [
        ("x", "^pad_value 'x' is not a number"),
        (None, "^pad_value None is not a number"),
        ([0, 1], r"^pad_value \[0, 1\] is not a number"),
        ({"ids": 0, "mask": "0"}, r"^pad_value\['mask'\] '0' is not a number"),
        (float("nan"), "^field 'ids': pad value nan does not fit a int64 field"),
        (10**30, f"^field 'ids': pad value {10**30} does not fit a int64 field"),
        ({"ids": -1, "mask": 2**40}, "^field 'mask': pad value 1099511627776 does not fit a int32 field"),
    ],
    ids=["str", "none", "list", "per-field-str", "nan-int", "huge", "per-field-huge"],
)
def test_a_pad_value_that_is_no_number_of_the_fields_dtype_is_refused_naming_it(tclient, part, pad_value, message):
    """A str pad value was torch's TypeError ("new(): invalid data type 'str'"), a list a TypeError
    (unhashable), NaN for an int field a RuntimeError, 10**30 a ValueError from the copier - none
    naming the field. A numpy or 0-d tensor pad id (as tokenizers hand them out) is a number."""
    meta = tclient.put(
        part,
        unique_keys(2),
        {
            "ids": [torch.ones(3, dtype=torch.int64), torch.ones(1, dtype=torch.int64)],
            "mask": [torch.ones(3, dtype=torch.int32), torch.ones(1, dtype=torch.int32)],
        },
    )
    with pytest.raises(InvalidRequestError, match=message):
        tclient.get(meta, ["ids", "mask"], pad_value=pad_value)
    got = tclient.get(meta, ["ids", "mask"], pad_value={"ids": np.int64(7), "mask": torch.tensor(5)})
    assert got["ids"][1].tolist() == [1, 7, 7] and got["mask"][1].tolist() == [1, 5, 5]


@pytest.mark.parametrize(
    "uids, group_size, message",
    [
        (["u"], 10**9, r"1 uids x group_size 1000000000 is 1000000000 keys, more than MAX_MINT_KEYS \(16777216\)"),
        (["u"] * 5000, 5000, "is 25000000 keys, more than MAX_MINT_KEYS"),
        (["u"], 2.0, "group_size must be a whole number >= 1, got 2.0"),
        (["u"], True, "group_size must be a whole number >= 1, got True"),
        (["u"], 0, "group_size must be a whole number >= 1, got 0"),
        ("abc", 2, r"uids must be a list of names, not a single str \('abc'\)"),
    ],
    ids=["huge-group", "huge-product", "float", "bool", "zero", "lone-str"],
)
def test_mint_keys_refuses_a_slip_before_making_a_key(client, partition, uids, group_size, message):
    """A group size of 10**9 made a billion key strings in the client before any check (the host ran
    out of memory); a float one was range()'s TypeError, a lone str was read as one uid per character."""
    t0 = time.monotonic()
    with pytest.raises(InvalidRequestError, match=message):
        client.mint_keys(partition, uids, group_size)
    assert time.monotonic() - t0 < 1.0 and client.get_meta(partition).keys == ()
    assert client.mint_keys(partition, ["u"], np.int64(2)).keys == ("u_g0", "u_g1")


@pytest.mark.parametrize("how", ["pad_to", "extra_info"])
def test_a_padded_get_larger_than_the_memory_left_is_refused_naming_the_field(tclient, part, how):
    """A pad length of 2**31 (a sentinel slipping into ``pad_to`` or the meta's
    ``global_forward_pad_seqlen``) padded every row to it: the client allocated and filled tens of GiB
    until the host ran out of memory. A result larger than the memory available is refused first."""
    import dataclasses

    import psutil

    from tq.meta import MAX_PAD_LENGTH

    n = psutil.virtual_memory().available // (MAX_PAD_LENGTH * 8) + 1  # rows of 16 GiB each, padded
    meta = tclient.put(part, unique_keys(n), {"ids": [torch.ones(1, dtype=torch.int64)] * n})
    kwargs = {"pad_to": MAX_PAD_LENGTH} if how == "pad_to" else {}
    if how == "extra_info":
        meta = dataclasses.replace(meta, extra_info={"global_forward_pad_seqlen": MAX_PAD_LENGTH})
    t0 = time.monotonic()
    with pytest.raises(
        InvalidRequestError, match=r"result needs .* GiB, more than the .* GiB of memory available here; the largest field, 'ids'"
    ):
        tclient.get(meta, ["ids"], **kwargs)
    assert time.monotonic() - t0 < 5.0
    assert tclient.get(meta, ["ids"], pad_to=4)["ids"].shape == (n, 4)


@pytest.mark.parametrize("op", ["get", "write_back", "wait", "discard", "set_tags"])
def test_a_call_given_no_meta_is_refused_naming_what_it_got(client, partition, op):
    """A dict or a tuple of keys where a meta goes was an AttributeError on some attribute of it."""
    meta = client.put(partition, unique_keys(1), {"x": torch.ones(1)})
    args = {"get": (["x"],), "write_back": ({"y": torch.ones(1)},), "wait": (["x"],), "discard": (), "set_tags": ()}[op]
    for bad in ({"keys": list(meta.keys), "partition_id": partition}, meta.keys):
        with pytest.raises(TypeError, match=rf"^{op} needs a KVBatchMeta \(from put, get_meta or mint_keys\), got {type(bad).__name__}$"):
            getattr(client, op)(bad, *args)
    assert client.get(meta, ["x"])["x"].tolist() == [1.0]


@pytest.mark.parametrize("value", [*BAD_SECONDS, 0.0, 1e5], ids=str)
def test_a_client_with_an_impossible_timeout_is_refused_naming_it(tq_server, value):
    with pytest.raises(InvalidRequestError, match=r"^timeout must be"):
        TQClient(tq_server.address, timeout=value)
    with pytest.raises(InvalidRequestError, match=r"^capacity_wait_s must be"):
        TQClient(tq_server.address, capacity_wait_s=-1.0 if value in (0.0, 1e5) else value)


def test_a_client_takes_its_settings_as_numbers_and_strings_or_names_them(tq_server):
    """A timeout of '5' reached the controller channel unconverted (TypeError from its time budget at
    the first request); a secret that is no str an AttributeError from ``.encode``."""
    with TQClient(tq_server.address, timeout="5") as c:
        assert c.timeout == 5.0 and c.list_partitions() is not None
    for secret in (123, b"bytes"):
        with pytest.raises(InvalidRequestError, match=f"^secret must be a string, got {type(secret).__name__}$"):
            TQClient(tq_server.address, secret=secret)
        with pytest.raises(InvalidRequestError, match=f"^secret must be a string, got {type(secret).__name__}$"):
            TQServer(storage_units=0, secret=secret)
    with pytest.raises(InvalidRequestError, match="^host must be a string, got int$"):  # was "'int' object is not subscriptable"
        TQServer(storage_units=0, host=5)


# ----------------------------------------------------------------------------- unreachable servers
@pytest.mark.parametrize(
    "address",
    ["foo", "tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://127.0.0.1:99999", "ipc:///tmp/tq", "tcp://*:5555", 5555, None],
    ids=str,
)
def test_a_malformed_address_is_refused_naming_it(address):
    """ZMQ raised its own error for some ('Invalid argument') and took others for a server that never
    answers (the whole timeout, then 'server down or unreachable')."""
    t0 = time.monotonic()
    with pytest.raises(InvalidRequestError, match=r"address must be a controller's 'tcp://HOST:PORT'"):
        TQClient(address, timeout=5.0)
    assert time.monotonic() - t0 < 2.0  # a bound on hanging, not a speed test


_STALL_THEN_HANG_UP = r"""
import socket, sys, threading, time, zmq
from tq import messages, rpc
from tq.errors import TQConnectionError

# A peer that holds the first connection silent - the call gives up waiting for its handshake - and
# then hangs up on every connection at once: each of ZMQ's reconnects fails its handshake.
ls = socket.socket()
ls.bind(("127.0.0.1", 0))
ls.listen(1000)
held, hang_up = [], threading.Event()

def peer():
    while True:
        c, _ = ls.accept()
        if hang_up.is_set():
            c.close()
        else:
            held.append(c)

threading.Thread(target=peer, daemon=True).start()
silent = rpc.reconnect_when_silent

def fast_reconnects(sock):  # 1 ms between tries instead of 100: the events come 100x as fast
    silent(sock)
    sock.setsockopt(zmq.RECONNECT_IVL, 1)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1)

rpc.reconnect_when_silent = fast_reconnects
chan = rpc.RpcChannel(f"tcp://127.0.0.1:{ls.getsockname()[1]}", secret=None, timeout=0.5, name="stalling peer",
                      replies=messages.CONTROLLER_REPLY_DECODERS)
try:
    chan.call(messages.ControllerOp.HELLO, messages.Hello(timeout=0.1))
except TQConnectionError:
    pass
hang_up.set()
for c in held:
    c.close()
time.sleep(3.0)  # thousands of failed handshakes
router = zmq.Context.instance().socket(zmq.ROUTER)
port = router.bind_to_random_port("tcp://127.0.0.1")
other = zmq.Context.instance().socket(zmq.DEALER)
other.setsockopt(zmq.IMMEDIATE, 1)
other.connect(f"tcp://127.0.0.1:{port}")
print("other socket connected:", bool(other.poll(3000, zmq.POLLOUT)), flush=True)
import os
os._exit(0)
"""


def test_a_socket_whose_handshakes_fail_after_its_call_gave_up_does_not_freeze_the_process():
    """A client socket keeps a monitor of failed handshakes until it first connects; its events are
    read only while a call waits. One whose call gave up (the peer held the handshake) went on
    reconnecting, and once its peer hung up on each try the unread events filled the monitor's
    queue: libzmq's I/O thread then blocked sending the next one, and no socket of the process could
    connect any more - the whole client froze (seen as a test module whose every later test failed
    'cannot reach controller'). Run in a child process: the freeze is of its ZMQ context."""
    out = subprocess.run([sys.executable, "-c", _STALL_THEN_HANG_UP], capture_output=True, text=True, timeout=60)
    assert "other socket connected: True" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_client_to_a_port_nobody_listens_on():
    address = f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(TQConnectionError, match=address):
        TQClient(address, timeout=1.0)
    assert time.monotonic() - t0 < 5.0  # a bound on hanging, not a speed test


def test_controller_killed_mid_session():
    # A shared-memory directory of its own: a controller starting meanwhile on this host (a test on
    # another worker) retires a dead controller's location tables as orphans - rightly - and this
    # client would then ask the dead controller at once instead of reading the table until it expires.
    shm_dir = tempfile.mkdtemp(prefix="tq-test-", dir="/dev/shm")
    server = TQServer(storage_units=1, capacity=16 << 20, shm_dir=shm_dir)
    unit_pids: list[int] = []
    try:
        with TQClient(server.address, timeout=30.0):  # returns once the storage unit has registered
            pass
        c = TQClient(server.address, timeout=1.0)
        unit_pids = [u.pid for u in c._units]
        arenas = [u.arena_path for u in c._units]
        assert unit_pids and all(os.path.exists(a) for a in arenas)
        c.register_partition("p")
        meta = c.put("p", ["a", "b"], {"x": torch.tensor([1, 2])})
        assert_same(c.get(meta)["x"], torch.tensor([1, 2]))
        server.proc.kill()
        server.proc.wait(10)
        for call in (c.list_partitions, lambda: c.put("p", ["c"], {"x": torch.tensor([3])})):
            t0 = time.monotonic()
            with pytest.raises(TQConnectionError, match=r"(controller|storage unit 0) at tcp://"):
                call()  # a put talks to the storage unit first: it may be the one found gone
            assert time.monotonic() - t0 < 5.0
        # A same-host get of a meta it already located reads the dead controller's location table
        # until the lease it renewed every second runs out (nothing can free bytes meanwhile: only a
        # controller does); then it asks the controller, and fails fast like every other call.
        table = c._tables.get("p")  # none where the tables are not used (not x86-64)
        lease_left = (table[0].header[H_ALIVE_UNTIL] - time.monotonic_ns()) / 1e9 if table else 0.0
        assert lease_left <= ALIVE_S
        if lease_left > 0.2:
            assert_same(c.get(meta)["x"], torch.tensor([1, 2]))
        time.sleep(max(lease_left, 0.0))
        t0 = time.monotonic()
        with pytest.raises(TQConnectionError, match=r"controller at tcp://"):
            c.get(meta)
        assert time.monotonic() - t0 < 5.0
        c.close()
        # Storage units notice that their controller is gone and exit (nothing is left behind).
        assert wait_until(lambda: not any(pid_alive(p) for p in unit_pids), timeout=15.0), "storage units outlived the controller"
        assert wait_until(lambda: not any(os.path.exists(a) for a in arenas)), "a storage unit left its arena behind"
    finally:
        server.shutdown()
        for p in unit_pids:  # only if the test failed: stop orphaned units (SIGTERM lets them clean up)
            if pid_alive(p):
                os.kill(p, signal.SIGTERM)
        for p in unit_pids:
            if not wait_until(lambda: not pid_alive(p), timeout=10.0):
                os.kill(p, signal.SIGKILL)
        shutil.rmtree(shm_dir, ignore_errors=True)


# ----------------------------------------------------------------------------- authentication
@pytest.fixture(scope="module")
def secure_server():
    with TQServer(storage_units=1, capacity=16 << 20, secret="s3cret") as server:
        yield server


def test_right_secret_works(secure_server, monkeypatch):
    monkeypatch.delenv("TQ_SECRET", raising=False)
    for transport in TRANSPORTS:
        with TQClient(secure_server.address, secret="s3cret", timeout=5.0, transport=transport) as c:
            pid = f"sec-{uuid.uuid4().hex[:6]}"
            c.register_partition(pid)
            meta = c.put(pid, ["a", "b"], {"x": torch.tensor([1.0, 2.0]), "o": ["s", None]})
            got = c.get(meta)
            assert_same(got["x"], torch.tensor([1.0, 2.0]))
            assert got["o"] == ["s", None]
            c.drop_partition(pid)
    monkeypatch.setenv("TQ_SECRET", "s3cret")  # the environment supplies the secret by default
    with TQClient(secure_server.address, timeout=5.0) as c:
        assert isinstance(c.list_partitions(), list)


@pytest.mark.parametrize("secret", ["wrong", None], ids=["wrong-secret", "no-secret"])
def test_wrong_or_missing_secret_is_rejected(secure_server, monkeypatch, secret):
    monkeypatch.delenv("TQ_SECRET", raising=False)
    with TQClient(secure_server.address, secret="s3cret", timeout=5.0) as good:
        pid = f"sec-{uuid.uuid4().hex[:6]}"
        good.register_partition(pid)
        meta = good.put(pid, ["a", "b", "c"], {"x": torch.tensor([3, 1, 2], dtype=torch.int8)})
        rejected_before = good.stats()["rejected_messages"]
        t0 = time.monotonic()
        with pytest.raises(AuthenticationError, match="secret"):
            TQClient(secure_server.address, secret=secret, timeout=5.0)
        assert time.monotonic() - t0 < 5.0  # answered at once, not timed out
        # one refused handshake - or two without a secret: a client the server hangs up on tries once
        # more before it calls it a refusal (a hang-up is also how a server dying mid-handshake looks)
        assert good.stats()["rejected_messages"] - rejected_before in ((1,) if secret else (1, 2))
        # raw requests with a bad signature, to the controller and to the storage unit
        for address in (secure_server.address, good._units[0].address):
            frames = protocol.request("stats", 1, {}, [], secret.encode() if secret else None)
            reply = raw_exchange(address, frames, secret=b"s3cret")  # replies are signed by the server
            with pytest.raises(AuthenticationError, match="signature"):
                protocol.raise_for_reply(reply)
            with pytest.raises(AuthenticationError):  # a client without the right secret cannot trust it
                protocol.decode(protocol.reply_ok(1, {}, [], b"s3cret"), b"wrong")
        # the server keeps serving the good client, data intact
        assert_same(good.get(meta)["x"], torch.tensor([3, 1, 2], dtype=torch.int8))
        good.drop_partition(pid)


def test_non_loopback_bind_needs_a_secret():
    t0 = time.monotonic()
    with pytest.raises(AuthenticationError, match=r"0\.0\.0\.0.*secret"):
        TQServer(host="0.0.0.0")
    assert time.monotonic() - t0 < 5.0  # refused before starting anything


def test_out_of_range_port_is_refused_before_starting_anything():
    """A port past 65535 used to be taken modulo 65536 by the bind."""
    with pytest.raises(ValueError, match=r"port must be in 0\.\.65535"):
        TQServer(port=99999)
    with pytest.raises(ValueError, match=r"--stream-port: port must be in 0\.\.65535"):
        TQServer(stream_port=-1)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"storage_units": -1}, r"--storage-units: must be >= 0, got -1"),
        ({"capacity": 0}, r"--capacity: size must be positive"),
        ({"capacity": -5}, r"--capacity: invalid size '-5'"),
        ({"fsync": "sometimes"}, r"--fsync: invalid choice: 'sometimes'"),
        ({"commit_lease_s": -1.0}, r"--commit-lease: must be a finite number of seconds > 0"),
        ({"unit_lost_s": float("inf")}, r"--unit-lost-s: must be a finite number of seconds > 0"),
        ({"start_timeout": float("nan")}, r"start_timeout must be in \(0, 86400\] seconds"),
        ({"storage_units": 1000, "capacity": 1 << 30}, r"--storage-units 1000: one controller starts at most 256 storage units"),
        ({"storage_units": 2, "capacity": 1 << 20}, r"gives each unit 524288 bytes; a unit needs at least 1048576"),
        (
            {"journal_dir": __file__},
            r"--journal-dir: '.*test_errors.py' exists and is not a directory",
        ),  # was '--stream-port 0: File exists'
    ],
    ids=lambda v: str(v)[:30],
)
def test_a_bad_server_setting_is_refused_naming_it_before_anything_starts(settings, message):
    """Checked by the controller's own parser in the caller's process: before, the controller exited
    with the reason on its stderr only, and TQServer said no more than that it exited."""
    with pytest.raises(ValueError, match=message):
        TQServer(**settings)


def test_a_controller_that_cannot_start_says_why_in_the_error():
    """A port in use made the controller exit with the reason on its stderr only: TQServer said 'the TQ
    controller exited before it was ready'. The controller writes why into its ready file."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(TQConnectionError, match=r"the TQ controller could not start: ZMQError: Address already in use"):
            TQServer(port=port, storage_units=0)


def test_a_capacity_the_shm_dir_cannot_hold_is_refused_at_once():
    """It used to start the controller, whose unit could not make its arena, and wait out the whole
    start timeout (60 s) for a unit that never registered."""
    t0 = time.monotonic()
    with pytest.raises(CapacityError, match="bytes free but the storage unit needs"):
        TQServer(storage_units=1, capacity=1 << 70)
    assert time.monotonic() - t0 < 10.0  # a bound on hanging, not a speed test


# ----------------------------------------------------------------------------- capacity
@pytest.fixture(scope="module")
def small_server():
    with TQServer(storage_units=1, capacity=1 << 20) as server:  # one unit, 1 MiB
        yield server


@pytest.fixture(params=TRANSPORTS)
def small(request, small_server):
    c = TQClient(small_server.address, timeout=15.0, transport=request.param)
    pid = f"cap-{uuid.uuid4().hex[:6]}"
    c.register_partition(pid)
    yield c, pid
    c.drop_partition(pid)
    c.close()


def _unit(c: TQClient) -> dict:
    return c.stats()["unit_stats"][0]


def _settled_used(c: TQClient) -> int:
    """Bytes in use once no fire-and-forget free is in flight (two equal readings in a row)."""
    last = None
    for _ in range(50):
        used = _unit(c)["bytes_used"]
        if used == last:
            return used
        last = used
        time.sleep(0.05)
    return last


def test_put_larger_than_capacity(small):
    c, pid = small
    assert wait_until(lambda: _unit(c)["bytes_used"] == 0)
    big = torch.zeros(2 << 20, dtype=torch.uint8)  # 2 MiB into a 1 MiB unit
    with pytest.raises(CapacityError, match=r"2097152 bytes.*1048576"):
        c.put(pid, ["big"], {"x": big.reshape(1, -1)})
    u = _unit(c)
    assert u["bytes_used"] == 0 and u["blocks"] == 0 and u["pending_allocs"] == 0  # nothing left allocated
    assert c.get_meta(pid).keys == ()
    meta = c.put(pid, ["small"], {"x": torch.arange(16, dtype=torch.uint8).reshape(1, -1)})  # still serving
    assert_same(c.get(meta)["x"], torch.arange(16, dtype=torch.uint8).reshape(1, -1))


def test_put_larger_than_free_space(small):
    c, pid = small
    assert wait_until(lambda: _unit(c)["bytes_used"] == 0)
    first = torch.randint(0, 255, (1, 600 << 10), dtype=torch.uint8)
    meta = c.put(pid, ["first"], {"x": first})
    # a same-host put's block is adopted by its unit (and counted there) just after the commit is answered
    assert wait_until(lambda: _unit(c)["bytes_used"] >= 600 << 10)
    used = _unit(c)["bytes_used"]
    with pytest.raises(CapacityError, match=rf"614400 bytes.*{used} of 1048576"):
        c.put(pid, ["second"], {"x": first.clone()})
    u = _unit(c)
    assert u["bytes_used"] == used and u["pending_allocs"] == 0
    assert_same(c.get(meta)["x"], first)
    c.discard(meta)
    assert wait_until(lambda: _unit(c)["bytes_used"] == 0)
    meta2 = c.put(pid, ["second"], {"x": first.flip(1)})  # room again after the discard
    assert_same(c.get(meta2)["x"], first.flip(1))


def test_full_storage_applies_backpressure_until_room_frees(small, small_server):
    """With capacity_wait_s a write into a full unit waits for frees (never evicts), or fails when the
    wait runs out; nothing stored is touched either way."""
    c, pid = small
    assert wait_until(lambda: _unit(c)["bytes_used"] == 0)
    first = torch.randint(0, 255, (1, 600 << 10), dtype=torch.uint8)
    meta = c.put(pid, ["first"], {"x": first})
    patient = TQClient(small_server.address, timeout=15.0, transport=c.transport, capacity_wait_s=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(CapacityError, match=r"waited 0.5s"):
            patient.put(pid, ["second"], {"x": first.flip(1)})
        assert time.monotonic() - t0 >= 0.5
        assert_same(c.get(meta)["x"], first)  # the stored batch was not evicted

        patient.capacity_wait_s = 10.0
        done: dict = {}
        writer = threading.Thread(target=lambda: done.setdefault("meta", patient.put(pid, ["second"], {"x": first.flip(1)})))
        writer.start()
        time.sleep(0.3)
        assert "meta" not in done and _unit(c)["parked_writes"] == 1  # waiting, not failed, not evicting
        c.discard(meta)  # room frees: the parked write goes through
        writer.join(10)
        assert_same(c.get(done["meta"])["x"], first.flip(1))
    finally:
        patient.close()


def test_rejected_commits_leave_nothing_allocated(small):
    c, pid = small
    meta = c.put(pid, ["a", "b"], {"x": torch.randn(2, 1000), "lp": [torch.randn(5), torch.randn(0)]})
    used = _settled_used(c)
    with pytest.raises(DuplicateKeyError, match="'a'"):
        c.put(pid, ["a"], {"x": torch.randn(1, 1000)})
    with pytest.raises(PartitionNotFoundError, match="'no-such-partition'"):
        c.put("no-such-partition", ["z"], {"x": torch.randn(1, 1000)})
    with pytest.raises(SchemaConflictError, match="'x'"):
        c.write_back(meta, {"x": torch.randn(2, 1000)})
    with pytest.raises(KeyNotFoundError, match="'ghost'"):
        c.write_back(KVBatchMeta(pid, ("ghost",)), {"y": torch.randn(1)})
    # the controller fenced each refused block and had the unit free it (fire and forget)
    assert wait_until(lambda: _unit(c)["bytes_used"] == used)
    u = _unit(c)
    assert u["bytes_used"] == used and u["pending_allocs"] == 0 and u["tentative_blocks"] == 0
    got = c.get(meta, layout="list")
    assert got["lp"][0].shape == (5,) and got["lp"][1].shape == (0,)


def _full_shm_dir_scenario(shm_dir: str) -> None:
    """Run inside a private mount namespace where ``shm_dir`` is a small tmpfs of its own (see below)."""
    filler = os.path.join(shm_dir, "another-tenant")
    with TQServer(storage_units=1, capacity=32 << 20, shm_dir=shm_dir) as server:
        with TQClient(server.address, timeout=5.0) as c, TQClient(server.address, timeout=5.0, transport="tcp") as tcp:
            c.register_partition("p")
            meta = c.put("p", ["a"], {"x": torch.arange(2048).reshape(1, -1)})  # its slab's pages are backed
            c.register_partition("r")
            c.put("r", ["r0"], {"z": torch.zeros(1, 1, dtype=torch.int8)})
            pids = [server.proc.pid] + [u.pid for u in c._units]
            with open(filler, "wb") as f:  # another tenant of the tmpfs takes every free page
                try:
                    while True:
                        f.write(b"\1" * (64 << 10))
                        f.flush()
                except OSError:
                    pass
            assert os.statvfs(shm_dir).f_bavail == 0
            meta_s = c.put("p", ["s"], {"x": torch.ones(1, 2048, dtype=torch.int64)})  # fits its slab's backed pages
            failing = {
                "same-host put": lambda: c.put("p", ["big"], {"y": torch.ones(1, 1 << 20, dtype=torch.int64)}),
                "tcp put": lambda: tcp.put("p", ["t"], {"x": torch.ones(1, 2048, dtype=torch.int64)}),
                "partition": lambda: c.register_partition("q"),  # its location table
                "table growth": lambda: c.put("r", [f"k{i}" for i in range(5000)], {"z": torch.zeros(5000, 1, dtype=torch.int8)}),
                "new fields": lambda: c.put("p", ["n"], {f"f{j}": torch.ones(1, 4) for j in range(40)}),
            }
            for what, call in failing.items():
                t0 = time.monotonic()
                with pytest.raises(CapacityError, match=f"{shm_dir} is full") as err:
                    call()
                assert time.monotonic() - t0 < 5.0, what
                print(what, "->", err.value)
            borrowed = c.get(meta, copy=False)  # the pin file cannot be made: the lease is asked for
            assert_same(borrowed["x"], torch.arange(2048).reshape(1, -1))
            borrowed.release()
            assert all(pid_alive(p) for p in pids) and [u.pid for u in c._units] == pids[1:], "a process died"
            os.unlink(filler)
            for call in failing.values():  # nothing was half-done: each works now
                call()
            for client in (c, tcp):
                assert_same(client.get(meta)["x"], torch.arange(2048).reshape(1, -1))
                assert_same(client.get(meta_s)["x"], torch.ones(1, 2048, dtype=torch.int64))
            assert_same(c.get(c.get_meta("p", ["big"]))["y"], torch.ones(1, 1 << 20, dtype=torch.int64))
    print("scenario passed")


def test_a_full_shm_dir_fails_writes_with_capacity_error_not_sigbus(tmp_path):
    """Arenas (and location tables, pin files) are sparse tmpfs files: on a tmpfs that another tenant
    (Ray's object store, say) filled after the service started, the first touch of a page through a
    mapping kills the toucher with SIGBUS - the writing client, a storage unit or the controller.
    Every page is allocated before it is handed out, so a full tmpfs is a CapacityError naming the
    directory, every process lives on, and the same writes succeed once there is room."""
    mount = tmp_path / "shm"
    mount.mkdir()
    # user, mount and pid namespaces: the tmpfs is private, and when the scenario's process ends (a
    # SIGBUS, say) every process it started is killed with it
    unshare = ["unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork", "--mount-proc"]
    probe = subprocess.run([*unshare, "true"], capture_output=True, text=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode:
        pytest.skip(f"needs a private tmpfs ({' '.join(unshare)}): {probe.stderr.strip() if probe else 'no unshare'}")
    run = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_errors; test_errors._full_shm_dir_scenario(sys.argv[1])"
    proc = subprocess.run(
        [*unshare, "sh", "-c", 'mount -t tmpfs -o size=48m tq-test "$0" && exec "$1" -c "$2" "$0"', str(mount), sys.executable, run],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "scenario passed" in proc.stdout, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"


def test_errors_are_tq_errors():
    """Every error type the wire can carry is a TQError and round-trips through a reply by name."""
    for name, cls in protocol.ERROR_TYPES.items():
        assert issubclass(cls, TQError)
        frames = protocol.reply_error(9, cls(f"boom {name}"), None)
        with pytest.raises(cls, match=f"boom {name}"):
            protocol.raise_for_reply(protocol.decode(frames, None))
    frames = protocol.reply_error(9, RuntimeError("internal"), None)  # a non-TQ error stays generic
    with pytest.raises(TQError, match="RuntimeError: internal"):
        protocol.raise_for_reply(protocol.decode(frames, None))


def _unit_of(c: TQClient, meta: KVBatchMeta, field: str) -> int:
    """The storage unit holding ``field`` of the meta's last key (asked of the controller)."""
    located, msg = c._ctrl.call("locate", {"partition": meta.partition_id, "keys": [meta.keys[-1]], "fields": [field]})
    return int(protocol.unpack_array(located.loc, msg.buffers)[0, 0, 0])


def test_hung_storage_unit_is_waited_for_within_a_reads_timeout_and_read_once_it_resumes():
    """A unit that stops answering (SIGSTOP) past the heartbeat: a read of its keys over TCP waits for
    it within its own timeout - its request abandoned, asked again once the unit answers - and gets
    its rows bit-exact after it resumes, not StorageUnitError at the first seconds of silence (a
    stalled host or a network cut heals: that error ended a GRPO job over a 10 s cut that Ray rode
    out); a read whose timeout ends first fails then, naming the unit as unreachable; a same-host
    read copies the rows out of the arena without the unit; other units' keys stay readable."""
    from concurrent.futures import ThreadPoolExecutor

    from tq.supervision import UNIT_TIMEOUT_S

    with TQServer(storage_units=2, capacity=64 << 20) as server:
        c = TQClient(server.address, timeout=30.0)
        tcp = TQClient(server.address, timeout=30.0, transport="tcp")
        short = TQClient(server.address, timeout=4.0, transport="tcp")
        try:
            c.register_partition("p")
            metas = [c.put("p", [f"h{i}_{j}" for j in range(2)], {"x": torch.full((2, 3), float(i))}) for i in range(2)]
            units = [_unit_of(c, m, "x") for m in metas]
            assert sorted(units) == [0, 1]
            info = next(u for u in c._units if u.unit_id == units[0])
            for m in metas:  # connected to both units: the get's requests go out, then wait for the reply
                tcp.get(m)
            os.kill(info.pid, signal.SIGSTOP)
            try:
                with ThreadPoolExecutor(1) as pool:
                    waiting = pool.submit(tcp.get, metas[0])  # in flight before the heartbeat misses
                    time.sleep(UNIT_TIMEOUT_S + 1.0)
                    assert not waiting.done() and not c.stats()["units"][units[0]]["alive"]
                    assert torch.equal(c.get(metas[0])["x"], torch.full((2, 3), 0.0))  # no request to the unit
                    assert torch.equal(tcp.get(metas[1])["x"], torch.full((2, 3), 1.0))
                    t0 = time.monotonic()
                    with pytest.raises(StorageUnitError, match=rf"storage unit {units[0]} .* is unreachable .*time ran out"):
                        short.get(metas[0])  # asked while it is reported down: waited for, to the end of its timeout
                    assert 3.5 < time.monotonic() - t0 < 4.0 + 1.0
                    os.kill(info.pid, signal.SIGCONT)
                    resumed = time.monotonic()
                    assert torch.equal(waiting.result(timeout=20)["x"], torch.full((2, 3), 0.0))
                    assert time.monotonic() - resumed < 3.0
            finally:
                os.kill(info.pid, signal.SIGCONT)
            assert torch.equal(short.get(metas[0])["x"], torch.full((2, 3), 0.0))
        finally:
            for client in (c, tcp, short):
                client.close()


def test_a_unit_silent_past_unit_lost_s_is_given_up_and_reads_of_its_keys_fail_fast():
    """With the controller's unit_lost_s at 5 s, a stopped unit is waited for 5 s, no longer: a read
    in flight fails then with StorageUnitError naming it (not at the end of its 30 s timeout), a new
    read fails at once naming the unit and a key, and once the unit resumes its keys read again."""
    with TQServer(storage_units=1, capacity=64 << 20, unit_lost_s=5.0) as server:
        tcp = TQClient(server.address, timeout=30.0, transport="tcp")
        try:
            tcp.register_partition("p")
            meta = tcp.put("p", ["a", "b"], {"x": torch.arange(6.0).reshape(2, 3)})
            pid = tcp._units[0].pid
            os.kill(pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with pytest.raises(StorageUnitError, match=r"storage unit 0 at .* is down \(no answer for [5-9]\.[0-9]s\)"):
                    tcp.get(meta)
                assert 5.0 < time.monotonic() - t0 < 8.0
                t0 = time.monotonic()
                with pytest.raises(StorageUnitError, match=r"storage unit 0 .* is down .*first 'x' of key 'a'"):
                    tcp.get(meta)
                assert time.monotonic() - t0 < 1.0
            finally:
                os.kill(pid, signal.SIGCONT)
            assert wait_until(lambda: all(u["alive"] for u in tcp.stats()["units"]), timeout=10)
            assert torch.equal(tcp.get(meta)["x"], torch.arange(6.0).reshape(2, 3))
        finally:
            tcp.close()


def test_a_unit_whose_process_is_gone_fails_reads_fast_though_no_controller_saw_it_end():
    """A unit its controller did not start (placed by Ray on another node, say) is killed: nothing
    tells the controller its process ended, only that it went silent - as over a network cut. A read
    of its keys waiting for it finds its address refusing connections (its host answers, nothing
    listens) and fails with StorageUnitError within seconds, not at the end of its 30 s timeout."""
    shm = tempfile.mkdtemp(prefix="tq-gone-", dir="/dev/shm")
    ready = os.path.join(shm, "unit.ready")
    unit = None
    try:
        with TQServer(storage_units=0, capacity=64 << 20, shm_dir=shm) as server:
            cmd = launch.storage_unit_command(
                unit_id=0, bind="tcp://127.0.0.1:0", controller=server.address, capacity=32 << 20, shm_dir=shm, ready_file=ready
            )
            unit = subprocess.Popen(cmd, env=launch.service_env(None))
            launch.await_ready_file(ready, alive=lambda: unit.poll() is None, timeout=60, what="storage unit 0")
            tcp = TQClient(server.address, timeout=30.0, transport="tcp")
            try:
                tcp.register_partition("p")
                meta = tcp.put("p", ["a"], {"x": torch.ones(1, 4)})
                assert torch.equal(tcp.get(meta)["x"], torch.ones(1, 4))
                unit.kill()
                unit.wait()
                t0 = time.monotonic()
                with pytest.raises(StorageUnitError, match=r"storage unit 0 at .* is down .*refuses connections"):
                    tcp.get(meta)
                assert time.monotonic() - t0 < 8.0
            finally:
                tcp.close()
    finally:
        if unit is not None and unit.poll() is None:
            unit.kill()
        shutil.rmtree(shm, ignore_errors=True)


def test_a_read_a_dropped_zmq_connection_held_is_asked_again_once_the_controller_answers():
    """The controller stopped (SIGSTOP) longer than rpc.ZMQ_SILENT_S while a get_meta waits over ZMQ:
    the client drops the silent connection and, with it, the request (the controller, resumed, reads
    it and answers into the dropped connection). Once connected again the read is asked again and
    returns within seconds of the controller resuming, not at the end of its 30 s timeout."""
    from concurrent.futures import ThreadPoolExecutor

    from tq import rpc

    with TQServer(storage_units=1, capacity=16 << 20) as server:
        c = TQClient(server.address, timeout=30.0)
        try:
            c.register_partition("p")
            c.put("p", ["a"], {"x": torch.ones(1, 2)})
            c._ctrl.use_stream(None)  # ZMQ only (this host's clients reach the controller over its Unix socket)
            with ThreadPoolExecutor(1) as pool:
                assert pool.submit(c.get_meta, "p").result().keys == ("a",)  # this thread's ZMQ socket connected
                os.kill(server.proc.pid, signal.SIGSTOP)
                try:
                    waiting = pool.submit(c.get_meta, "p")
                    time.sleep(rpc.ZMQ_SILENT_S + 2.0)
                    assert not waiting.done()
                finally:
                    os.kill(server.proc.pid, signal.SIGCONT)
                resumed = time.monotonic()
                assert waiting.result(timeout=35).keys == ("a",)
                assert time.monotonic() - resumed < 5.0
        finally:
            c.close()


def test_a_hung_unit_holds_a_pipelined_tcp_get_which_asks_again_once_it_resumes_and_no_late_reply_confuses_it():
    """A TCP get of a unit's rows is several requests in flight at once (protocol.TCP_FETCH_BYTES each).
    With the unit stopped past the heartbeat, the get abandons its requests and waits; once the unit
    resumes it asks again and returns bit-exact, in order; so does the next get in another order
    (whatever became of the abandoned requests, no reply to one is taken for its own)."""
    from concurrent.futures import ThreadPoolExecutor

    from tq.supervision import UNIT_TIMEOUT_S

    value = torch.arange(288 * 32768, dtype=torch.float32).reshape(288, 32768)  # 36 MiB: three requests
    assert value.numel() * 4 > 2 * protocol.TCP_FETCH_BYTES
    with TQServer(storage_units=1, capacity=128 << 20) as server:
        c = TQClient(server.address, timeout=30.0)
        tcp = TQClient(server.address, timeout=30.0, transport="tcp")
        try:
            c.register_partition("p")
            meta = c.put("p", [f"big{i}" for i in range(288)], {"x": value})
            pid = c._units[0].pid
            try:
                with ThreadPoolExecutor(1) as pool:
                    # connected (streams are per thread): the get's requests go out, then wait for the replies
                    assert torch.equal(pool.submit(tcp.get, meta).result()["x"], value)
                    os.kill(pid, signal.SIGSTOP)
                    waiting = pool.submit(tcp.get, meta)
                    time.sleep(UNIT_TIMEOUT_S + 1.0)  # reported down, and the get's check has seen it: requests abandoned
                    assert not waiting.done()
                    os.kill(pid, signal.SIGCONT)
                    assert torch.equal(waiting.result(timeout=25)["x"], value)
            finally:
                os.kill(pid, signal.SIGCONT)
            order = list(range(287, -1, -1))
            assert torch.equal(tcp.get(meta.select(order))["x"], value[order])
            parts = -(-value.numel() * 4 // protocol.TCP_FETCH_BYTES)
            assert c.stats()["unit_stats"][0]["ops"]["fetch"]["count"] >= 3 * parts  # that get was pipelined too
        finally:
            c.close()
            tcp.close()


def test_killed_storage_unit_is_restarted_and_recovers_its_data():
    """SIGKILL one of two units mid-run: reads of its keys fail fast (or already succeed) instead of
    hanging; the controller restarts it on its shared-memory arena, it replays its journal, and every
    key written before the kill - over both transports, partial frees included - reads back bit-exactly."""
    with TQServer(storage_units=2, capacity=64 << 20) as server:
        c = TQClient(server.address, timeout=20.0)
        tcp = TQClient(server.address, timeout=20.0, transport="tcp")
        try:
            c.register_partition("p")
            data = [torch.randn(3, 4) + i for i in range(4)]
            metas = [
                (c if i % 2 else tcp).put("p", [f"u{i}_{j}" for j in range(3)], {"x": d, "lp": [d[j, : j + 1] for j in range(3)]})
                for i, d in enumerate(data)
            ]
            c.discard(metas[3].select([0]))  # a partial free before the crash must survive recovery too
            units = [_unit_of(c, m, "x") for m in metas]
            assert set(units) == {0, 1}
            victim = units[0]
            info = next(u for u in c._units if u.unit_id == victim)
            os.kill(info.pid, signal.SIGKILL)
            t0 = time.monotonic()
            try:  # fails fast while it is down, or reads recovered data if it is already back
                assert torch.equal(c.get(metas[0])["x"], data[0])
            except StorageUnitError as exc:
                assert f"storage unit {victim}" in str(exc) and "down" in str(exc)
            assert time.monotonic() - t0 < 5  # well inside the 20 s client timeout
            kept = next(i for i, u in enumerate(units) if u != victim)
            assert torch.equal(c.get(metas[kept])["x"], data[kept])

            def recovered() -> bool:  # over TCP: a same-host get needs no answer from the unit
                try:
                    tcp.get(metas[0])
                    return True
                except (StorageUnitError, TQConnectionError):
                    return False

            assert wait_until(recovered, timeout=20)
            new = next(u for u in c.stats()["units"] if u["unit_id"] == victim)
            assert new["pid"] != info.pid and new["arena_path"] == info.arena_path and new["alive"]
            for i, m in enumerate(metas):
                m = m.select(range(1, 3)) if i == 3 else m
                want = data[i][1:] if i == 3 else data[i]
                for client in (c, tcp):
                    got = client.get(m, layout="list")
                    assert torch.equal(torch.stack(list(got["x"])), want)
                    assert all(torch.equal(a, b) for a, b in zip(got["lp"], [want[j, : j + 1 + (i == 3)] for j in range(len(want))]))
            c.clear_partition("p")  # and frees after recovery work: the store empties
            assert wait_until(lambda: all(u.get("bytes_used") == 0 for u in c.stats()["unit_stats"]), timeout=10), [
                (u["unit_id"], u["bytes_used"], u["blocks"], u["pending_allocs"], u["pid"]) for u in c.stats()["unit_stats"]
            ]
        finally:
            c.close()
            tcp.close()


def test_controller_killed_and_restarted_recovers_its_state(tmp_path):
    """SIGKILL the controller of a service started with a journal dir; start it again on the same
    address and dir: partitions, keys, tags, field status and placement come back from its journal,
    its storage units (still running) are taken back, and the same client object keeps working
    without any manual step."""
    port = free_port()
    state = str(tmp_path / "state")
    first = TQServer(port=port, storage_units=2, capacity=64 << 20, journal_dir=state)
    c = TQClient(first.address, timeout=10.0)
    second = None
    try:
        c.register_partition("p")
        a = c.put(
            "p",
            [f"a{i}" for i in range(4)],
            {"x": torch.randn(4, 3), "ids": [torch.arange(i + 1) for i in range(4)]},
            tags={"group": [0, 0, 1, 1]},
        )
        b = c.put("p", ["b0", "b1"], {"x": torch.randn(2, 3), "ids": [torch.arange(5), torch.arange(2)]})
        a = c.write_back(a, {"lp": [torch.randn(i + 1) for i in range(4)]})
        c.discard(b.select([1]))
        c.mint_keys("p", ["later"], 1)
        before = {"a": c.get(a, layout="list"), "b": c.get(b.select([0]), layout="list")}
        unit_pids = [u["pid"] for u in c.stats()["units"]]
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        assert all(os.path.exists(f"/proc/{p}") for p in unit_pids)  # the units outlive it

        second = TQServer(port=port, storage_units=2, capacity=64 << 20, journal_dir=state)
        meta = c.get_meta("p", a.keys)
        assert meta.tags["group"] == (0, 0, 1, 1) and set(meta.fields) == {"x", "ids", "lp"}
        after = c.get(a, layout="list")
        for f in ("x", "ids", "lp"):
            assert all(torch.equal(p, q) for p, q in zip(before["a"][f], after[f]))
        assert torch.equal(c.get(b.select([0]), layout="list")["ids"][0], before["b"]["ids"][0])
        with pytest.raises(KeyNotFoundError, match="'b1'"):
            c.get(b.select([1]))
        late = c.put("p", ["later_g0"], {"x": torch.ones(1, 3), "ids": [torch.arange(3)]})  # into the minted key
        assert torch.equal(c.get(late)["x"], torch.ones(1, 3))
        assert sorted(u["pid"] for u in c.stats()["units"]) == sorted(unit_pids)  # the same units
        c.clear_partition("p")
        assert wait_until(lambda: all(u.get("bytes_used") == 0 for u in c.stats()["unit_stats"]))
    finally:
        c.close()
        for server in (second, first):
            if server is not None:
                server.shutdown()
    assert wait_until(lambda: not any(pid_alive(p) for p in unit_pids), timeout=10)  # stopped with the new controller


def test_a_call_in_flight_when_another_thread_closes_the_channel_ends_in_tq_connection_error():
    """A client closing while its lease keeper waits for a stopped controller closed the keeper's
    socket under it: the keeper thread died of ZMQ's 'Socket operation on non-socket' (seen as an
    unhandled thread exception in the suite). The call now ends in TQConnectionError."""
    import socket

    from tq import messages
    from tq.errors import TQConnectionError
    from tq.rpc import RpcChannel

    with socket.socket() as s:  # a port nothing listens on: the call waits for a connection
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    chan = RpcChannel(f"tcp://127.0.0.1:{port}", secret=None, timeout=10.0, name="controller", replies=messages.CONTROLLER_REPLY_DECODERS)
    raised: list[BaseException] = []

    def call() -> None:
        try:
            chan.call(messages.ControllerOp.STATS, messages.Stats())
        except BaseException as exc:  # the test inspects what came out
            raised.append(exc)

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.3)  # waiting for a connection
    chan.close()
    t.join(5)
    assert not t.is_alive() and len(raised) == 1
    assert isinstance(raised[0], TQConnectionError) and "closed" in str(raised[0]), repr(raised[0])


def _use_a_forked_client(server: TQServer, client: TQClient, borrowed, i: int, results) -> None:
    """In a forked child: every use of the parent's client is refused by name; closing it sends nothing;
    the parent's server is not stopped by the child's shutdown; a client of the child's own works."""
    from tq.errors import ForkedClientError

    refused = []
    for name, call in [
        ("put", lambda: client.put("forked", [f"inherited{i}"], {"x": torch.full((1, 8), i)})),
        ("get", lambda: client.get(KVBatchMeta("forked", ("parent",), ("x",)), ["x"])),
        ("register_partition", lambda: client.register_partition("forked", reuse=True)),
    ]:
        try:
            call()
            refused.append(f"{name}: not refused")
        except ForkedClientError as exc:
            refused.append(str(exc))
    borrowed.release()  # the parent's views' lease (or pin) is the parent's to give up
    client.close()  # in the child: drops its copies, tells the service nothing
    server.shutdown()  # as an inherited `with` or atexit hook would: the parent's service runs on
    with TQClient(server.address) as own:
        meta = own.put("forked", [f"child{i}"], {"x": torch.full((1, 8), i)})
        ok = bool((own.get(meta, ["x"])["x"] == i).all())
    results.put((i, refused, ok))


def test_a_client_used_in_a_forked_child_is_refused_and_the_parent_keeps_working():
    """A forked child (a DataLoader worker, multiprocessing's default on Linux) shares its parent's
    sockets, slabs and leases: used there, the parent's client would carve the parent's next block
    (two processes writing one arena range - another key's bytes), answer the parent's replies or give
    back its slabs. Every call of it in the child is refused naming the fix, its close and a borrowed
    result's release in the child send nothing, the parent's TQServer is not stopped by a child's shutdown, and the parent's client
    works on. (Before: children's puts collided on one block and the parent's next put was refused as
    fenced.)"""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    with TQServer(storage_units=1, capacity=64 << 20) as server, TQClient(server.address) as client:
        client.register_partition("forked")
        parent = client.put("forked", ["parent"], {"x": torch.full((1, 8), -1)})
        borrowed = client.get(parent, ["x"], copy=False)
        results = ctx.Queue()
        children = [ctx.Process(target=_use_a_forked_client, args=(server, client, borrowed, i, results)) for i in range(3)]
        for p in children:
            p.start()
        got = sorted(results.get(timeout=60) for _ in children)
        for p in children:
            p.join(30)
            assert p.exitcode == 0
        for i, refused, ok in got:
            assert ok, i
            for msg in refused:
                assert f"opened in process {os.getpid()}" in msg and "TQConnection" in msg, msg
        assert torch.equal(client.get(parent, ["x"])["x"], torch.full((1, 8), -1))
        after = client.put("forked", ["parent2"], {"x": torch.full((1, 8), 7)})
        assert torch.equal(client.get(after, ["x"])["x"], torch.full((1, 8), 7))
        meta = client.get_meta("forked")
        assert sorted(meta.keys) == ["child0", "child1", "child2", "parent", "parent2"]
        for i in range(3):
            assert torch.equal(client.get(client.get_meta("forked", [f"child{i}"]), ["x"])["x"], torch.full((1, 8), i))
        client.discard(parent)  # its rows wait for the parent's lease, which no child gave up
        assert client.stats()["rows_waiting_for_leases"] == 1
        assert torch.equal(borrowed["x"], torch.full((1, 8), -1))
        borrowed.release()
        assert wait_until(lambda: client.stats()["rows_waiting_for_leases"] == 0, timeout=10)


def test_a_budget_block_interrupted_before_its_body_leaves_no_deadline_behind():
    """A Ctrl-C (or a signal handler's exception) landing between a ``with time_budget`` entering and
    its body: Python runs no ``__exit__``. The block's deadline must not outlive the call - before,
    the abandoned block restored its enclosing call's deadline when it was collected, and every later
    call of the thread failed with "no time left" (a client dead after one Ctrl-C)."""
    from tq.rpc import time_budget, time_left

    def call() -> None:
        with time_budget(0.05):  # a client call's budget (a put's)
            inner = time_budget(0.05)  # its commit's, held by this frame as a `with` holds it,
            inner.__enter__()  # interrupted before its body
            raise KeyboardInterrupt

    for keep in (False, True):  # the exception dropped, or kept alive as a REPL keeps sys.last_value
        try:
            call()
        except KeyboardInterrupt as exc:
            kept = exc if keep else None
        time.sleep(0.1)  # past both deadlines
        assert time_left() is None, keep
        with time_budget(5.0):
            assert 4.0 < time_left() <= 5.0, keep
    del kept


def test_a_client_interrupted_inside_a_put_keeps_working_past_the_puts_timeout(monkeypatch):
    """The same through a real client: a put interrupted just after its commit's budget block entered
    (its 3rd: put, commit, the channel's call); past the put's timeout the client still puts and gets."""
    from tq.rpc import time_budget

    enter, entered = time_budget.__enter__, []

    def interrupted_once(self):
        enter(self)
        entered.append(self)
        if len(entered) == 3:
            raise KeyboardInterrupt

    with TQServer(storage_units=1, capacity=16 << 20) as server, TQClient(server.address, timeout=0.5) as client:
        client.register_partition("ctrl-c")
        monkeypatch.setattr(time_budget, "__enter__", interrupted_once)
        with pytest.raises(KeyboardInterrupt):
            client.put("ctrl-c", ["a"], {"x": torch.arange(4)[None]})
        monkeypatch.setattr(time_budget, "__enter__", enter)
        time.sleep(0.7)  # past the interrupted put's deadline
        meta = client.put("ctrl-c", ["b"], {"x": torch.arange(4)[None]})
        assert torch.equal(client.get(meta, ["x"])["x"], torch.arange(4)[None])


@pytest.mark.parametrize("cut", ["reply", "request"])
def test_a_message_cut_short_by_a_ctrl_c_leaves_the_client_in_step(monkeypatch, cut):
    """A Ctrl-C landing while a reply is half read (or a request half written) on a stream connection:
    the next call must not start reading mid-message (before: every later call of the client failed
    with "stream message declares 3457797581 frames"); the stream is dropped and the next call
    connects again."""
    from tq import stream_transport

    if not stream_transport.supported():
        pytest.skip("no stream connections here")
    real_receive, real_write, armed = stream_transport._receive, stream_transport._write, [True]

    def receive_cut(sock, reader, chunk):
        if armed:
            sock.recv(3)  # 3 bytes of the reply taken off the socket, never parsed (BlockingIOError: none yet)
            armed.clear()
            raise KeyboardInterrupt
        return real_receive(sock, reader, chunk)

    def write_cut(sock, views):
        if armed:
            armed.clear()
            sock.send(bytes(views[0])[:3])  # 3 bytes of the request out, the rest never
            raise KeyboardInterrupt
        return real_write(sock, views)

    with TQServer(storage_units=1, capacity=16 << 20) as server, TQClient(server.address, timeout=5.0) as client:
        client.register_partition("cut")
        meta = client.put("cut", ["a"], {"x": torch.arange(4)[None]})
        if cut == "reply":
            monkeypatch.setattr(stream_transport, "_receive", receive_cut)
        else:
            monkeypatch.setattr(stream_transport, "_write", write_cut)
        with pytest.raises(KeyboardInterrupt):
            client.get_meta("cut")
        assert not armed  # the cut did land on the stream
        for _ in range(3):
            assert client.get_meta("cut").keys == ("a",)
            assert torch.equal(client.get(meta, ["x"])["x"], torch.arange(4)[None])
        client.put("cut", ["b"], {"x": torch.arange(4)[None]})


def test_text_that_is_not_utf8_is_refused_naming_it_and_nothing_lands(tq_server):
    """A key or partition id holding a lone surrogate (what os.fsdecode makes of a bad file name)
    cannot cross the wire: InvalidRequestError naming the text, not msgpack's UnicodeEncodeError; the
    put lands nothing and the client works on."""
    with TQClient(tq_server.address, timeout=10.0) as client:
        part = f"utf8-{uuid.uuid4().hex[:8]}"
        client.register_partition(part)
        with pytest.raises(InvalidRequestError, match=r"key at index 1 'bad\\ud800' is not valid UTF-8 text \(surrogates not allowed"):
            client.put(part, ["ok", "bad\ud800"], {"x": torch.zeros(2, 2)})
        with pytest.raises(InvalidRequestError, match="not valid UTF-8"):
            client.register_partition("p\udcff")
        with pytest.raises(InvalidRequestError, match="not valid UTF-8"):
            client.get_meta(part, ["k\udcff"])
        assert client.get_meta(part).keys == ()
        assert client.put(part, ["ok"], {"x": torch.zeros(1, 2)}).keys == ("ok",)
        client.drop_partition(part)


def test_text_the_wire_cannot_carry_is_refused_before_a_byte_is_stored(small):
    """A lone surrogate in a key, a field name or a tag value was refused only when the put's commit
    was encoded - after its rows were stored: each such put held its bytes until their lease ran out,
    and meanwhile every writer got CapacityError. Now the meta (or the write's field check) refuses
    it naming the text, before anything is stored."""
    c, pid = small
    meta = c.put(pid, ["kept"], {"y": torch.ones(1, 4)})
    used = _settled_used(c)
    row = torch.randn(1, 150_000)  # 600 KB of the 1 MiB unit: a second one held would leave no room
    cases = [
        (["k"], {"x": row}, {"src": ["file\udcff.txt"]}, r"tag 'src' value at index 0 'file\\udcff.txt' is not valid UTF-8"),
        (["k\ud800"], {"x": row}, None, r"key 'k\\ud800' is not valid UTF-8"),
        (["k"], {"x\ud800": row}, None, r"field 'x\\ud800' is not valid UTF-8"),
    ]
    for keys, columns, tags, match in cases:
        for _ in range(2):
            with pytest.raises(InvalidRequestError, match=match):
                c.put(pid, keys, columns, tags=tags)
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match=r"field 'z\\udcff' is not valid UTF-8"):
            c.write_back(meta, {"z\udcff": row})
    assert _settled_used(c) == used
    assert c.get_meta(pid).keys == ("kept",)
    assert torch.equal(c.get(c.put(pid, ["room"], {"x": row}), ["x"])["x"], row)  # the room is there


def test_a_commit_refused_before_it_is_sent_gives_its_stored_blocks_back_at_once(small, monkeypatch):
    """A commit that cannot go out (here the wire refusing its encoding, as it did text with a lone
    surrogate) after the rows were stored: the client gives the blocks back at once (abort_blocks), not
    after their commit lease (30 s) - a full unit's other writers would get CapacityError meanwhile."""
    c, pid = small
    used = _settled_used(c)
    row = torch.randn(1, 150_000)
    real = protocol.request

    def refusing(op, *args, **kwargs):
        if op == "commit":
            raise InvalidRequestError("request 'commit' holds text that is not valid UTF-8 (test)")
        return real(op, *args, **kwargs)

    monkeypatch.setattr(protocol, "request", refusing)
    with pytest.raises(InvalidRequestError, match="not valid UTF-8 \\(test\\)"):
        c.put(pid, ["k"], {"x": row})
    monkeypatch.setattr(protocol, "request", real)
    assert wait_until(lambda: _unit(c)["bytes_used"] == used, timeout=5.0)
    assert torch.equal(c.get(c.put(pid, ["k"], {"x": row}), ["x"])["x"], row)


def test_names_out_of_bounds_are_refused_by_the_client_and_on_the_wire(tq_server):
    """An empty or over-long key, field, tag name or partition id (a 10 MB key used to be accepted and
    journaled) is refused naming it, before anything is stored; the same request sent past the client's
    check is refused by the controller's typed decoder naming the path. A 64-bit tag at each edge goes
    through; one past it is refused naming the tag, not msgpack's OverflowError. Nothing lands."""
    from tq import messages
    from tq.errors import InvalidRequestError
    from tq.messages import ControllerOp as Op
    from tq.meta import MAX_NAME_CHARS

    long = "k" * (MAX_NAME_CHARS + 1)
    x = torch.zeros(2, 2)
    with TQClient(tq_server.address, timeout=10.0) as client:
        part = f"names-{uuid.uuid4().hex[:8]}"
        client.register_partition(part)
        for keys, columns, tags, match in [
            (["a", "k" * 10_000_000], {"x": x}, None, "key at index 1 'kkk.*' has 10000000 characters; a name has 1 to 1024"),
            (["a", ""], {"x": x}, None, "key at index 1 '' has 0 characters"),
            (["a", "b"], {long: x}, None, "field 'kkk.*' has 1025 characters"),
            (["a", "b"], {"x": x}, {long: [1, 2]}, "tag name 'kkk.*' has 1025 characters"),
            (["a", "b"], {"x": x}, {"t": [1, 2**64]}, r"tag 't' value at index 1 \(18446744073709551616\) does not fit in 64 bits"),
        ]:
            with pytest.raises(InvalidRequestError, match=match):
                client.put(part, keys, columns, tags=tags)
        with pytest.raises(InvalidRequestError, match="put into 'kkk.*': partition_id 'kkk.*' has 1025 characters"):
            client.put(long, ["a"], {"x": x[:1]})
        for op, request, path in [
            (
                Op.CREATE_PARTITION,
                messages.CreatePartition(partition=long),
                r"create_partition: Expected `str` of length <= 1024 - at `\$\.partition`",
            ),
            (Op.CREATE_PARTITION, messages.CreatePartition(partition=""), r"Expected `str` of length >= 1 - at `\$\.partition`"),
            (Op.MINT, messages.Mint(partition=part, keys=["a", long]), r"mint: Expected `str` of length <= 1024 - at `\$\.keys\[1\]`"),
            (Op.MINT, messages.Mint(partition=part, keys=[""]), r"mint: Expected `str` of length >= 1 - at `\$\.keys\[0\]`"),
            (Op.SET_TAGS, messages.SetTags(partition=part, keys=["a"], tags={long: [1]}), r"set_tags: Expected `str` of length <= 1024"),
            (  # a 50 MB tag value was stored and journaled for its key
                Op.SET_TAGS,
                messages.SetTags(partition=part, keys=["a"], tags={"t": ["v" * 65537]}),
                r"set_tags: Expected `str` of length <= 65536 - at `\$\.tags\[\.\.\.\]\[0\]`",
            ),
        ]:
            with pytest.raises(InvalidRequestError, match=path):
                client._call(op, request)
        assert client.get_meta(part).keys == () and [p["partition"] for p in client.list_partitions()].count(long) == 0
        edge = client.put(part, ["a", "b"], {"x": x}, tags={"t": [-(2**63), 2**64 - 1]})
        assert client.get_meta(part).tags == edge.tags == {"t": (-(2**63), 2**64 - 1)}
        client.drop_partition(part)


@pytest.mark.parametrize("length", [-1, 2**31 + 1, 2**63])
def test_a_commit_whose_sequence_lengths_no_sample_has_is_refused_by_the_controllers_decoder(length):
    """A peer past the client's check (a length of 2**63 was stored and journaled; 10**30 was msgpack's
    OverflowError in the client) is refused on the wire naming the path."""
    import msgpack

    from tq import messages
    from tq.errors import InvalidRequestError

    field = {
        "schema": ["tensor", "int64", []],
        "row_nbytes": {"b": 0, "d": "<i8", "s": [1]},
        "arena_offsets": {"b": 1, "d": "<i8", "s": [1]},
    }
    commit = {"partition": "p", "keys": ["a"], "mode": "put", "blocks": [[0, 1, 1]], "fields": {"x": field}}
    decoder = messages.ArgsDecoder("commit", messages.Commit)
    assert decoder.decode(msgpack.packb(commit | {"sequence_lengths": [2**31]})).sequence_lengths == [2**31]
    with pytest.raises(InvalidRequestError, match=r"^commit: Expected `int` .* - at `\$\.sequence_lengths\[0\]`"):
        decoder.decode(msgpack.packb(commit | {"sequence_lengths": [length]}))


def test_a_partition_holds_at_most_max_tag_names_tag_names(tq_server):
    """Each tag name holds a value per slot of its partition on the controller: 2,000 names set on
    one key of a 20k-key partition took 300 MB of the controller and get_meta 4 s - a per-sample
    value (a uid) used as a tag *name* would take the service's memory. A meta refuses more than
    MAX_TAG_NAMES names, the wire too, and the controller a request that would take its partition
    past it (names of earlier requests counted); the names it has keep working."""
    from tq import messages
    from tq.errors import InvalidRequestError
    from tq.messages import ControllerOp as Op
    from tq.meta import MAX_TAG_NAMES

    with TQClient(tq_server.address, timeout=10.0) as client:
        part = f"tagnames-{uuid.uuid4().hex[:8]}"
        client.register_partition(part)
        meta = client.put(part, ["a", "b"], {"x": torch.zeros(2, 2)}, tags={"t0": [0, 1]})
        with pytest.raises(ValueError, match=f"tags has {MAX_TAG_NAMES + 1} names, more than MAX_TAG_NAMES"):
            KVBatchMeta(part, ("a",), tags={f"u{i}": (i,) for i in range(MAX_TAG_NAMES + 1)})
        many = {f"u{i}": [i] for i in range(MAX_TAG_NAMES + 1)}
        with pytest.raises(InvalidRequestError, match=rf"set_tags: Expected `object` of length <= {MAX_TAG_NAMES} - at `\$\.tags`"):
            client._call(Op.SET_TAGS, messages.SetTags(partition=part, keys=["a"], tags=many))
        client.set_tags(KVBatchMeta(part, ("a",), tags={f"u{i}": (i,) for i in range(MAX_TAG_NAMES - 1)}))  # 128 with t0
        with pytest.raises(InvalidRequestError, match=rf"partition '{part}' would hold {MAX_TAG_NAMES + 1} tag names \(first new: 'v'\)"):
            client.set_tags(KVBatchMeta(part, ("b",), tags={"t0": (5,), "v": (1,)}))
        with pytest.raises(InvalidRequestError, match="would hold"):
            client.put(part, ["c"], {"x": torch.zeros(1, 2)}, tags={"w": [1]})
        got = client.get_meta(part, ["a", "b"])
        assert len(got.tags) == MAX_TAG_NAMES and got.tags["t0"] == (0, 1) and "v" not in got.tags  # the refused set changed nothing
        assert "c" not in client.get_meta(part).keys and client.get(meta, ["x"])["x"].shape == (2, 2)
        client.drop_partition(part)


def test_a_partition_holds_at_most_max_fields_fields_across_clears(tq_server):
    """A partition's location table keeps a column of records per field for every slot, across
    clears: 1,000 fields written to one key of a 20k-key partition took 933 MB of shared memory, and a
    trainer naming a field per step grew it at every clear. A meta names at most MAX_FIELDS fields, a
    commit too (the wire), and the controller refuses one that would take its partition past it,
    counting every field since the partition was made; nothing of the refused write lands."""
    import msgspec

    from tq import messages
    from tq.errors import InvalidRequestError
    from tq.meta import MAX_FIELDS

    with TQClient(tq_server.address, timeout=10.0) as client:
        part = f"fields-{uuid.uuid4().hex[:8]}"
        client.register_partition(part)
        with pytest.raises(ValueError, match=f"fields has {MAX_FIELDS + 1} names, more than MAX_FIELDS"):
            KVBatchMeta(part, ("a",), fields=tuple(f"f{i}" for i in range(MAX_FIELDS + 1)))
        field = {
            "schema": ["tensor", "int64", []],
            "row_nbytes": {"b": 0, "d": "<i8", "s": [1]},
            "arena_offsets": {"b": 1, "d": "<i8", "s": [1]},
        }
        commit = {
            "partition": part,
            "keys": ["a"],
            "mode": "put",
            "blocks": [[0, 1, 1]],
            "fields": {f"f{i}": field for i in range(MAX_FIELDS + 1)},
        }
        with pytest.raises(InvalidRequestError, match=rf"commit: Expected `object` of length <= {MAX_FIELDS} - at `\$\.fields`"):
            messages.ArgsDecoder("commit", messages.Commit).decode(msgspec.msgpack.encode(commit))
        one = torch.zeros(1)
        meta = client.put(part, ["a"], {f"f{i}": one for i in range(MAX_FIELDS // 2)})
        client.clear_partition(part)  # the table keeps those columns: they count
        client.put(part, ["a"], {f"g{i}": one for i in range(MAX_FIELDS // 2)})
        with pytest.raises(InvalidRequestError, match=rf"partition '{part}' would hold {MAX_FIELDS + 1} fields \(first new: 'h'"):
            client.write_back(meta, {"h": one, "g0": one}, overwrite=True)
        assert "h" not in client.get_meta(part).fields and client.get(meta, ["g0"])["g0"].tolist() == [0.0]
        client.write_back(meta, {"f0": one + 1, "g1": one + 2}, overwrite=True)  # fields it had before are fine
        assert client.get(meta, ["f0", "g1"])["g1"].tolist() == [2.0]
        client.drop_partition(part)


_PARTITIONS_UNTIL_REFUSED = """
import sys
import torch
from tq import TQServer, TQClient
with TQServer(storage_units=1, capacity=16 << 20) as s, TQClient(s.address, timeout=10.0) as c:
    made = 0
    try:
        for i in range(int(sys.argv[1])):
            c.register_partition(f"p{i}")
            made += 1
    except Exception as e:
        print(type(e).__name__, str(e))
    meta = c.put("p1", ["a"], {"x": torch.ones(2)[None]})  # the service works on
    c.drop_partition("p2")
    c.register_partition("again")  # a dropped partition's descriptors are free again
    print("made", made, "ok", c.get(meta, ["x"])["x"].tolist())
"""


@pytest.mark.parametrize("soft, hard", [(256, 256), (256, 4096)])
def test_partitions_past_the_open_file_limit_are_refused_clearly_and_the_soft_limit_is_raised(soft, hard):
    """Each partition holds two descriptors in the controller (its location table's lock and
    mapping): under the common soft limit of 1,024 the 503rd register_partition failed with a bare
    "OSError: [Errno 24] Too many open files". The service now raises its soft limit to the hard one
    (as Ray's processes do), and past that refuses a new partition with CapacityError naming the
    limit and what to do - the service works on."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    out = subprocess.run(
        [sys.executable, "-c", _PARTITIONS_UNTIL_REFUSED, "300"], capture_output=True, text=True, timeout=120, preexec_fn=limit
    )
    assert out.returncode == 0, out.stderr[-2000:]
    if hard == soft:  # nothing to raise: refused, clearly
        assert "CapacityError the controller is out of file descriptors" in out.stdout and "(ulimit -n)" in out.stdout, out.stdout
        assert "ok [[1.0, 1.0]]" in out.stdout
    else:
        assert out.stdout.strip() == "made 300 ok [[1.0, 1.0]]", out.stdout


def test_a_listing_that_names_a_key_twice_is_refused_by_the_controller_naming_it(tq_server):
    """``get_meta`` with a key given twice: a meta's keys are unique, so the controller refuses the
    request naming the key (DuplicateKeyError, as a mint or put that repeats one), instead of a reply
    the reader's meta then refused with a bare ValueError after the round trip."""
    from tq.errors import DuplicateKeyError

    with TQClient(tq_server.address, timeout=10.0) as client:
        part = f"dup-{uuid.uuid4().hex[:8]}"
        client.register_partition(part)
        client.put(part, ["a", "b"], {"x": torch.zeros(2, 2)})
        with pytest.raises(DuplicateKeyError, match="key 'a' appears more than once in the request"):
            client.get_meta(part, ["a", "b", "a"])
        assert client.get_meta(part, ["b", "a"]).keys == ("b", "a")
        client.drop_partition(part)


@pytest.mark.parametrize("op", ["mint", "commit"])
def test_a_change_cut_short_by_a_ctrl_c_as_it_is_sent_never_lands_later(tq_server, monkeypatch, op):
    """A Ctrl-C landing as a ``register_keys`` sends its mint (a request with an id) or a put sends its
    commit: whether it went out is unknown, so it is settled before the client's next request, as one
    that got no reply is (the request fenced; the put's blocks fenced, or found committed). The same
    request arriving late is then refused, and the keys never appear after the client listed them
    as absent. (Before, nothing was settled: the late request was applied.)"""
    from tq.errors import FencedCommitError, InvalidRequestError
    from tq.messages import ControllerOp as Op

    with TQClient(tq_server.address, timeout=10.0) as client:
        part = f"cut-{op}-{uuid.uuid4().hex[:8]}"
        client.register_partition(part)
        sent: list = []
        real = TQClient._call

        def cut(self, called, args, *rest, **kw):
            if called == op:
                monkeypatch.setattr(TQClient, "_call", real)
                sent.append((args, rest[0] if rest else kw.get("buffers", [])))
                raise KeyboardInterrupt  # as the request goes out: the controller may or may not get it
            return real(self, called, args, *rest, **kw)

        monkeypatch.setattr(TQClient, "_call", cut)
        change = (
            (lambda: client.register_keys(part, ["a"])) if op == "mint" else (lambda: client.put(part, ["a"], {"x": torch.zeros(1, 4)}))
        )
        with pytest.raises(KeyboardInterrupt):
            change()
        assert client.get_meta(part).keys == ()  # settled first
        refused = (
            (InvalidRequestError, "was given up on by its client before it arrived")
            if op == "mint"
            else (FencedCommitError, "this commit makes nothing visible")
        )
        with pytest.raises(refused[0], match=refused[1]):
            client._ctrl.call(Op(op), *sent[0])  # the same request, arriving late
        assert client.get_meta(part).keys == ()
        assert change().keys == ("a",)  # the client works on
        client.drop_partition(part)
