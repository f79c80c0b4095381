"""The wire format's buffers: small ones inside the header, bulk ones in frames of their own (pure, no
sockets), and the storage unit's slab bookkeeping that adopts lean on."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest

from tq import protocol
from tq.errors import AuthenticationError, MalformedMessageError, ProtocolVersionError
from tq.messages import ArrayRef
from tq.storage import Slab

SECRET = b"s" * 32


def _request(arrays: list[np.ndarray], secret: bytes | None = None) -> tuple[list, list[ArrayRef]]:
    bufs: list = []
    refs = [protocol.pack_array(a, bufs) for a in arrays]
    return protocol.request("fetch", 7, {"refs": [msgpack.packb([r.b, r.d, r.s]) for r in refs]}, bufs, secret), refs


def _unpacked(frames: list, refs: list[ArrayRef], secret: bytes | None = None) -> list[np.ndarray]:
    msg = protocol.decode_request([bytes(memoryview(f)) for f in frames], secret)
    return [protocol.unpack_array(r, msg.buffers) for r in refs]


def test_small_buffers_travel_inside_the_header():
    arrays = [np.arange(3), np.array([1.5, 2.5], dtype=np.float32), np.zeros(0, dtype=np.int64)]
    frames, refs = _request(arrays)
    assert len(frames) == 2  # header and mac only: no frame per index array
    for got, want in zip(_unpacked(frames, refs), arrays):
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_bulk_buffers_keep_frames_of_their_own_and_their_order():
    big = np.arange(1 << 17, dtype=np.int64)  # 1 MiB: over the inline size
    arrays = [np.arange(4), big, np.arange(5, 9)]
    frames, refs = _request(arrays)
    assert len(frames) == 3 and memoryview(frames[2]).nbytes == big.nbytes
    for got, want in zip(_unpacked(frames, refs), arrays):
        assert np.array_equal(got, want)


def test_inline_buffers_stop_at_the_total_budget():
    n = protocol.INLINE_BUFFER_BYTES // 8
    arrays = [np.full(n, i, dtype=np.int64) for i in range(protocol.INLINE_TOTAL_BYTES // protocol.INLINE_BUFFER_BYTES + 2)]
    frames, refs = _request(arrays)
    assert len(frames) == 2 + 2  # the budget holds four of them; the last two get frames
    for got, want in zip(_unpacked(frames, refs), arrays):
        assert np.array_equal(got, want)


def test_inline_buffers_are_covered_by_the_mac():
    frames, refs = _request([np.arange(6)], SECRET)
    assert np.array_equal(_unpacked(frames, refs, SECRET)[0], np.arange(6))
    header = bytearray(frames[0])
    i = header.rindex(np.arange(6).tobytes())  # the array's bytes, inside the signed header
    header[i] ^= 1
    with pytest.raises(AuthenticationError):
        _unpacked([bytes(header), *frames[1:]], refs, SECRET)


def test_a_version_1_message_has_every_buffer_in_a_frame():
    data = np.arange(3, dtype=np.int64).tobytes()
    header = msgpack.packb({"v": 1, "op": "stats", "rid": 1, "args": {}, "bs": [len(data)]})
    msg = protocol.decode_request([header, b"", data], None)
    assert bytes(msg.buffers[0]) == data
    inline = msgpack.packb({"v": 1, "op": "stats", "rid": 1, "args": {}, "bs": [len(data)], "ib": [data]})
    with pytest.raises(MalformedMessageError, match="inline buffers"):
        protocol.decode_request([inline, b""], None)  # version 1 had no inline buffers
    with pytest.raises(ProtocolVersionError):
        protocol.decode_request([msgpack.packb({"v": 3, "op": "stats", "rid": 1, "args": {}, "bs": []}), b""], None)


@pytest.mark.parametrize(
    "bs, ib, frames, match",
    [
        ([3], [b"abc", None], [], "inline buffers"),  # one entry per buffer
        ([3], [7], [], "must be bytes or nil"),
        ([3, 2], [b"abc", None], [], "declares 1 buffer frames but 0 arrived"),
        ([3], [b"abc"], [b"xy"], "declares 0 buffer frames but 1 arrived"),
        ([4], [b"abc"], [], "buffer size mismatch"),
        ([3], {"0": b"abc"}, [], "inline buffers"),
    ],
)
def test_malformed_inline_buffers_are_refused_naming_the_defect(bs, ib, frames, match):
    header = msgpack.packb({"v": 2, "op": "stats", "rid": 1, "args": {}, "bs": bs, "ib": ib})
    with pytest.raises(MalformedMessageError, match=match):
        protocol.decode_request([header, b"", *frames], None)
    reply = msgpack.packb({"v": 2, "rid": 1, "ok": True, "result": {}, "bs": bs, "ib": ib})
    with pytest.raises(MalformedMessageError, match=match):
        protocol.decode_reply([reply, b"", *frames], None)


def test_slab_overlap_check_agrees_with_a_scan_of_every_carved_block():
    rng = random.Random(0)
    blocks = [(i * 256, 128 + 64 * (i % 2)) for i in range(200)]  # disjoint, 64..128 bytes of gap between
    rng.shuffle(blocks)  # adopts arrive in any order
    slab = Slab(0, 200 * 256, 0, 200, 0.0, set(), [])
    for start, size in blocks:
        assert not slab.overlaps(start, size)
        slab.add_carved(start, size)
    assert slab.carved == sorted(blocks)
    for _ in range(2000):
        start, size = rng.randrange(-64, 200 * 256), rng.randrange(1, 600)
        scan = any(a < start + size and start < a + n for a, n in blocks)
        assert slab.overlaps(start, size) == scan, (start, size)
    assert slab.gaps()[0] == (128, 128) and sum(n for _, n in slab.gaps()) == 200 * 256 - sum(n for _, n in blocks)


def test_inline_buffers_arrive_writable_like_frames():
    frames, refs = _request([np.arange(4)])
    got = _unpacked(frames, refs)[0]
    got[0] = 9  # a handler may work on a received array in place, as on a ZMQ frame
    assert got.tolist() == [9, 1, 2, 3]


def test_tcp_fetch_parts_cut_between_whole_rows_near_the_request_size():
    from tq.client import _fetch_parts

    limit = protocol.TCP_FETCH_BYTES
    assert _fetch_parts(np.array([10, 20], np.int64)) == [slice(0, 2)]  # small: one request
    assert _fetch_parts(np.empty(0, np.int64)) == [slice(0, 0)]
    rng = np.random.default_rng(0)
    for nbytes in (rng.integers(1, limit // 50, 400), np.array([3 * limit, 5, limit, limit, 7], np.int64)):
        parts = _fetch_parts(nbytes)
        assert len(parts) > 1
        assert parts[0].start == 0 and parts[-1].stop == nbytes.size  # every row, in order, once
        assert all(a.stop == b.start and a.stop > a.start for a, b in zip(parts, parts[1:]))
        for p in parts:  # a request ends with the row that crossed the size (a bigger row goes alone)
            assert int(nbytes[p][:-1].sum()) < limit


def test_a_big_tcp_fetch_is_cut_into_lanes_of_whole_rows_each_cut_into_requests():
    from tq.client import _fetch_lanes_of

    MiB = 1 << 20
    one = _fetch_lanes_of(np.full(16, MiB, np.int64), 8)  # 16 MiB: one request's worth, one lane
    assert one == [[slice(0, 16)]]
    assert _fetch_lanes_of(np.array([8], np.int64), 8) == [[slice(0, 1)]]  # a 1-key get
    assert _fetch_lanes_of(np.empty(0, np.int64), 8) == [[slice(0, 0)]]
    lanes = _fetch_lanes_of(np.full(64, MiB, np.int64), 8)  # 64 MiB: 8 lanes of 8 MiB
    assert len(_fetch_lanes_of(np.full(64, MiB, np.int64), 2)) == 2  # no more than asked (the client's cores)
    assert [[(p.start, p.stop) for p in lane] for lane in lanes] == [[(8 * i, 8 * i + 8)] for i in range(8)]
    rng = np.random.default_rng(1)
    for nbytes in (rng.integers(1, 3 * MiB, 300), np.array([40 * MiB, 5, 2 * MiB, 30 * MiB, 7], np.int64)):
        lanes = _fetch_lanes_of(nbytes, 8)
        assert 1 < len(lanes) <= 8
        parts = [p for lane in lanes for p in lane]
        assert parts[0].start == 0 and parts[-1].stop == nbytes.size  # every row, in order, once
        assert all(a.stop == b.start and a.stop > a.start for a, b in zip(parts, parts[1:]))
        for p in parts:  # no request past its size but by the row that crossed it
            assert int(nbytes[p][:-1].sum()) < protocol.TCP_FETCH_BYTES
        assert all(int(nbytes[lane[0].start : lane[-1].stop].sum()) >= protocol.TCP_LANE_BYTES for lane in lanes[:-1])
