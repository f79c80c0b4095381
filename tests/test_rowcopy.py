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
