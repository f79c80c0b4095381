"""The row copier (the data plane's one hot loop): the C helper and its numpy fallback give the same
bytes, on the plain-store path and on the streaming-store path for large destinations, with any row
alignment and any pad pattern width; bad ranges are refused before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tq import rowcopy

pytestmark = pytest.mark.skipif(not rowcopy.HAVE_FASTCOPY, reason="the C helper was not built")


def _case(rng: np.random.Generator, n: int, max_row: int, row_span: int, offset: int):
    sources = [rng.integers(0, 256, size=n * max_row + 64, dtype=np.uint8) for _ in range(2)]
    sizes = rng.integers(0, max_row + 1, size=n).astype(np.int64)
    src_idx = rng.integers(0, 2, size=n).astype(np.int64)
    src_starts = rng.integers(0, 64, size=n).astype(np.int64)
    span = row_span if row_span else max_row
    dst_starts = offset + np.arange(n, dtype=np.int64) * span  # odd offsets: rows start unaligned
    return sources, sizes, src_idx, src_starts, dst_starts, offset + n * span


@pytest.mark.parametrize("isa", rowcopy.STREAM_ISAS)  # every streaming-store width this CPU has
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    padded=st.booleans(),
    pad_width=st.sampled_from([1, 2, 4, 8, 3]),
    offset=st.integers(0, 17),
    large=st.booleans(),
)
def test_c_helper_matches_numpy_on_both_store_paths(seed, padded, pad_width, offset, large, isa):
    rng = np.random.default_rng(seed)
    n, max_row = (64, rowcopy.STREAM_BYTES // 48) if large else (16, 300)
    row_span = max_row + int(rng.integers(0, 100)) if padded else 0
    sources, sizes, src_idx, src_starts, dst_starts, total = _case(rng, n, max_row, row_span, offset)
    pad = bytes(rng.integers(0, 256, size=pad_width, dtype=np.uint8)) if padded else b""
    if large:  # the case is meant to reach the streaming path
        assert (row_span or max_row) * n >= rowcopy.STREAM_BYTES > 0
    want = np.full(total + 32, 0xAB, dtype=np.uint8)
    got = want.copy()
    rowcopy.copy_rows_numpy(want, dst_starts, sources, src_idx, src_starts, sizes, row_span, pad)
    was = rowcopy.set_stream_isa(isa)
    try:
        rowcopy.copy_rows(got, dst_starts, sources, src_idx, src_starts, sizes, row_span, pad)
    finally:
        rowcopy.set_stream_isa(was)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("large", [False, True])
def test_a_row_out_of_bounds_is_refused_before_any_byte_is_written(large):
    n, row = 8, (rowcopy.STREAM_BYTES // 4 if large else 100)
    src = np.ones(n * row, dtype=np.uint8)
    dst = np.zeros(n * row, dtype=np.uint8)
    starts = np.arange(n, dtype=np.int64) * row
    sizes = np.full(n, row, dtype=np.int64)
    bad = starts.copy()
    bad[-1] += 1  # the last row would read one byte past its source
    with pytest.raises(ValueError, match="row 7: copy out of bounds"):
        rowcopy.copy_rows(dst, starts, [src], np.zeros(n, dtype=np.int64), bad, sizes)
    assert not dst.any()


@pytest.mark.parametrize("row_span", [0, 400])
@pytest.mark.parametrize("large", [False, True])
def test_no_dst_starts_puts_rows_back_to_back(row_span, large):
    """``dst_starts=None``: row i at ``i * row_span`` when padded, else right after row i-1."""
    rng = np.random.default_rng(row_span + large)
    n = 4 * rowcopy.STREAM_BYTES // 300 if large else 16
    sources, sizes, src_idx, src_starts, _, _ = _case(rng, n, 300, row_span, 0)
    starts = np.arange(n, dtype=np.int64) * row_span if row_span else np.cumsum(sizes) - sizes
    total = n * row_span if row_span else int(sizes.sum())
    want, got = np.zeros(total, dtype=np.uint8), np.zeros(total, dtype=np.uint8)
    rowcopy.copy_rows_numpy(want, starts, sources, src_idx, src_starts, sizes, row_span, b"\x07")
    rowcopy.copy_rows(got, None, sources, src_idx, src_starts, sizes, row_span, b"\x07")
    assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="out of bounds"):  # one byte short: refused, not overrun
        rowcopy.copy_rows(got[:-1], None, sources, src_idx, src_starts, sizes, row_span, b"\x07")


def _fields_case(rng: np.random.Generator, n_fields: int, n: int, max_row: int, padded: bool, pad_width: int):
    """``n_fields`` jobs for copy_fields over two sources: spans of any length (rows straddle the
    store vectors), each field's part starting at an odd offset or on a cache line."""
    sources = [rng.integers(0, 256, size=n * max_row + 64, dtype=np.uint8) for _ in range(2)]
    jobs, at = [], int(rng.integers(0, 3))
    for _ in range(n_fields):
        sizes = rng.integers(0, max_row + 1, size=n).astype(np.int64)
        span = max_row + int(rng.integers(0, 70)) if padded else 0
        pad = bytes(rng.integers(0, 256, size=pad_width, dtype=np.uint8)) if padded else b""
        jobs.append(
            (at, sources, rng.integers(0, 2, size=n).astype(np.int64), rng.integers(0, 64, size=n).astype(np.int64), sizes, span, pad)
        )
        at += (n * span if padded else int(sizes.sum())) + int(rng.choice([0, 64 - at % 64 if at % 64 else 0, 5]))
    return jobs, at


def _reference(jobs, total: int) -> np.ndarray:
    want = np.full(total + 32, 0xAB, dtype=np.uint8)
    for base, sources, src_idx, src_starts, sizes, span, pad in jobs:
        starts = base + (np.arange(sizes.size, dtype=np.int64) * span if span else np.cumsum(sizes) - sizes)
        rowcopy.copy_rows_numpy(want, starts, list(sources), src_idx, src_starts, sizes, span, pad)
    return want


@pytest.mark.parametrize("isa", rowcopy.STREAM_ISAS)
@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    padded=st.booleans(),
    pad_width=st.sampled_from([1, 2, 4, 8, 16, 3]),
    n_fields=st.integers(1, 12),
    large=st.booleans(),
)
def test_copy_fields_matches_field_by_field_copies(seed, padded, pad_width, n_fields, large, isa):
    """One call for all fields gives the bytes of one copy per field, on both store paths: fields
    that are small one by one stream when the call as a whole is large."""
    rng = np.random.default_rng(seed)
    n = 64 if large else 8
    max_row = 3 * rowcopy.STREAM_BYTES // (n * n_fields) if large else 200
    jobs, total = _fields_case(rng, n_fields, n, max_row, padded, pad_width)
    if large:  # the call as a whole reaches the streaming path, its fields need not
        assert sum(n * j[5] if padded else int(j[4].sum()) for j in jobs) >= rowcopy.STREAM_BYTES > 0
    want = _reference(jobs, total)
    got = np.full(total + 32, 0xAB, dtype=np.uint8)
    was = rowcopy.set_stream_isa(isa)
    try:
        rowcopy.copy_fields(got, jobs)
    finally:
        rowcopy.set_stream_isa(was)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("threads", [2, 3, 8])
def test_a_large_copy_shared_among_threads_gives_the_same_bytes(padded, threads):
    """A copy of several SHARE_BYTES runs on up to ``threads`` threads, which claim its rows in chunks:
    chunks end inside fields and between rows that share a store vector (odd row lengths, odd field
    starts), and each thread writes only its own bytes - the result is byte for byte the one-thread
    copy's, on every streaming width."""
    rng = np.random.default_rng(threads + 10 * padded)
    n = 64
    max_row = 6 * rowcopy.SHARE_BYTES // (n * 3)  # 3 fields: 3 (rows half full) to 6 shares in all
    jobs, total = _fields_case(rng, 3, n, max_row, padded, 3)
    written = sum(n * j[5] if padded else int(j[4].sum()) for j in jobs)
    want = _reference(jobs, total)
    for isa in rowcopy.STREAM_ISAS or (None,):
        got = np.full(total + 32, 0xAB, dtype=np.uint8)
        was = rowcopy.set_stream_isa(isa) if isa else None
        try:
            ran = rowcopy.copy_fields(got, jobs, threads)
        finally:
            if was:
                rowcopy.set_stream_isa(was)
        assert ran == min(threads, written // rowcopy.SHARE_BYTES) > 1
        assert np.array_equal(got, want)
    one = np.full(total + 32, 0xAB, dtype=np.uint8)  # copy_rows shares its rows the same way
    base, sources, src_idx, src_starts, sizes, span, pad = jobs[0]
    part = one[base : base + (n * span if padded else int(sizes.sum()))]
    assert rowcopy.copy_rows(part, None, sources, src_idx, src_starts, sizes, span, pad, threads=threads) == max(
        1, min(threads, part.size // rowcopy.SHARE_BYTES)
    )
    assert np.array_equal(part, want[base : base + part.size])
    small = np.full(1 << 20, 0xAB, dtype=np.uint8)
    assert rowcopy.copy_rows(small, None, [small.copy()], np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([1 << 20]), threads=8) == 1


@pytest.mark.parametrize("padded", [False, True])
def test_a_shared_copy_of_many_short_rows_gives_the_same_bytes(padded):
    """Hundreds of thousands of rows of 0-60 bytes (a get of many short fields): the chunks the
    threads claim end between rows that share a store vector, in and across jobs."""
    rng = np.random.default_rng(5 + padded)
    n, max_row = 100_000, 60
    jobs, total = _fields_case(rng, 6, n, max_row, padded, 2)
    written = sum(n * j[5] if padded else int(j[4].sum()) for j in jobs)
    want = np.full(total + 32, 0xAB, dtype=np.uint8)  # one thread (the tests above hold it to numpy's bytes)
    assert rowcopy.copy_fields(want, jobs, 1) == 1
    got = np.full(total + 32, 0xAB, dtype=np.uint8)
    assert rowcopy.copy_fields(got, jobs, 4) == min(4, written // rowcopy.SHARE_BYTES) > 1
    assert np.array_equal(got, want)


def test_write_chunks_of_a_large_put_shares_the_copy_and_keeps_its_bytes():
    """A put's column copy (``write_chunks``), one chunk or many, large enough to share: the same bytes,
    on as many threads as it has shares - one chunk too (cut into rows: the copier never splits a row,
    and starts no more threads than it has pieces of rows), empty chunks among them."""
    rng = np.random.default_rng(3)
    total = 3 * rowcopy.SHARE_BYTES + 12345
    one = [rng.integers(0, 256, size=total, dtype=np.uint8)]
    cuts = np.sort(rng.integers(0, total, size=40))
    many = np.split(one[0], cuts)
    many.insert(3, one[0][:0])
    for chunks in (one, many):
        got = np.zeros(total, dtype=np.uint8)
        assert rowcopy.write_chunks(got, chunks, threads=4) == 3
        assert np.array_equal(got, one[0])


def test_copy_fields_numpy_fallback_gives_the_same_bytes(monkeypatch):
    rng = np.random.default_rng(7)
    jobs, total = _fields_case(rng, 5, 16, 300, True, 4)
    got = np.full(total + 32, 0xAB, dtype=np.uint8)
    monkeypatch.setattr(rowcopy, "_c_copy_fields", None)
    rowcopy.copy_fields(got, jobs)
    assert np.array_equal(got, _reference(jobs, total))


@pytest.mark.parametrize("c_helper", [True, False])
def test_copy_fields_refuses_a_bad_job_before_writing_any(c_helper, monkeypatch):
    """A bad range in the last field: ValueError naming that job, and no field copied."""
    rng = np.random.default_rng(3)
    jobs, total = _fields_case(rng, 4, 16, 300, True, 4)
    base, sources, src_idx, src_starts, sizes, span, pad = jobs[-1]
    bad = src_starts.copy()
    bad[-1] = sources[int(src_idx[-1])].size  # reads past its source
    jobs[-1] = (base, sources, src_idx, bad, sizes, span, pad)
    dst = np.zeros(total, dtype=np.uint8)
    if not c_helper:
        monkeypatch.setattr(rowcopy, "_c_copy_fields", None)
    with pytest.raises(ValueError, match="job 3: .*out of bounds"):
        rowcopy.copy_fields(dst, jobs)
    assert not dst.any()
    with pytest.raises(ValueError, match="job 0: .*out of bounds"):  # one byte short of the last field
        rowcopy.copy_fields(np.zeros(jobs[0][0] + 8, dtype=np.uint8), jobs[:1])


def test_copy_fields_wants_int64_index_arrays():
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    starts32 = np.zeros(2, dtype=np.int32)  # 8 bytes in all: read as int64 it would be one row
    with pytest.raises(ValueError, match="src_starts must be an int64 buffer"):
        rowcopy.copy_fields(dst, [(0, [src], np.zeros(2, np.int64), starts32, np.full(2, 4, np.int64), 0, b"")])
