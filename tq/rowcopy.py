"""Copying byte rows between buffers - the one hot loop of the data plane.

``copy_rows`` uses the C helper ``tq._fastcopy`` (built at install, GIL released, bounds-checked; streaming
stores for destinations of ``STREAM_BYTES`` or more, of the widest vectors the CPU has: ``STREAM_ISAS``
lists those it supports, ``set_stream_isa`` picks one) and falls back to numpy slicing (same results, more
Python overhead per row) where it was not built.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

try:
    from ._fastcopy import STREAM_BYTES, STREAM_ISAS, set_stream_isa
    from ._fastcopy import copy_rows as _c_copy_rows
except ImportError:  # no compiler at install time
    _c_copy_rows, STREAM_BYTES, STREAM_ISAS, set_stream_isa = None, -1, (), None

HAVE_FASTCOPY = _c_copy_rows is not None


def copy_rows(
    dst: np.ndarray,
    dst_starts: np.ndarray | None,
    sources: Sequence[np.ndarray],
    src_idx: np.ndarray,
    src_starts: np.ndarray,
    sizes: np.ndarray,
    row_span: int = 0,
    pad: bytes = b"",
) -> None:
    """For each row i copy ``sizes[i]`` bytes from ``sources[src_idx[i]][src_starts[i]:]`` to
    ``dst[dst_starts[i]:]`` (``dst_starts`` None: rows back to back, row i at ``i * row_span`` when
    padded); with ``row_span > 0`` fill the rest of each row's span with ``pad``."""
    as64 = lambda a: a.astype(np.int64, copy=False)  # noqa: E731
    if _c_copy_rows is not None:
        _c_copy_rows(
            dst, None if dst_starts is None else as64(dst_starts), sources, as64(src_idx), as64(src_starts), as64(sizes), row_span, pad
        )
        return
    if dst_starts is None:
        dst_starts = np.arange(sizes.size, dtype=np.int64) * row_span if row_span > 0 else np.cumsum(sizes) - sizes
    copy_rows_numpy(dst, as64(dst_starts), list(sources), as64(src_idx), as64(src_starts), as64(sizes), row_span, pad)


def copy_rows_numpy(
    dst: np.ndarray,
    dst_starts: np.ndarray,
    sources: list[np.ndarray],
    src_idx: np.ndarray,
    src_starts: np.ndarray,
    sizes: np.ndarray,
    row_span: int,
    pad: bytes,
) -> None:
    """:func:`copy_rows` in numpy, on int64 index arrays (where the C helper was not built)."""
    n = sizes.size
    if n and (
        (src_starts < 0).any()
        or (dst_starts < 0).any()
        or (sizes < 0).any()
        or (row_span > 0 and (sizes > row_span).any())
        or (dst_starts + (row_span if row_span > 0 else sizes) > dst.size).any()
        or any((src_starts[src_idx == k] + sizes[src_idx == k] > s.size).any() for k, s in enumerate(sources))
    ):
        raise ValueError("copy out of bounds")
    pattern = np.frombuffer(pad, dtype=np.uint8) if row_span > 0 else None
    for k, s, d, z in zip(src_idx.tolist(), src_starts.tolist(), dst_starts.tolist(), sizes.tolist()):
        dst[d : d + z] = sources[k][s : s + z]
        if pattern is not None and z < row_span:
            tail = dst[d + z : d + row_span]
            tail[:] = np.resize(pattern, tail.size)


def write_chunks(dst: np.ndarray, chunks: Sequence[np.ndarray]) -> None:
    """Copy chunks back to back into ``dst`` (a uint8 view of exactly their total size)."""
    if len(chunks) == 1:
        dst[:] = chunks[0]
        return
    sizes = np.fromiter((c.size for c in chunks), dtype=np.int64, count=len(chunks))
    n = sizes.size
    copy_rows(dst, None, chunks, np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64), sizes)
