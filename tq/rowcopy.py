"""Copying byte rows between buffers - the one hot loop of the data plane.

``copy_rows`` (one set of rows) and ``copy_fields`` (one per field of a get, into one buffer, in one call) use the C helper ``tq._fastcopy`` (built at install, GIL released, bounds-checked; streaming
stores for destinations of ``STREAM_BYTES`` or more, of the widest vectors the CPU has: ``STREAM_ISAS``
lists those it supports, ``set_stream_isa`` picks one) and falls back to numpy slicing (same results, more
Python overhead per row) where it was not built. A copy of ``SHARE_BYTES`` or more per thread is split
among up to ``threads`` threads (at most 8) that the call starts and joins, each claiming 1 MiB chunks
of rows in turn: memory bandwidth is per core until the socket's is reached (2 vCPUs: a 24 MiB padded
get copies 1.4x faster on 2 threads; a 32-core host: a 512 MiB get 5.3x faster on 8).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

try:
    from ._fastcopy import SHARE_BYTES, STREAM_BYTES, STREAM_ISAS, set_stream_isa
    from ._fastcopy import copy_fields as _c_copy_fields
    from ._fastcopy import copy_rows as _c_copy_rows
except ImportError:  # no compiler at install time
    _c_copy_rows, _c_copy_fields, STREAM_BYTES, STREAM_ISAS, set_stream_isa = None, None, -1, (), None
    SHARE_BYTES = 1 << 62  # numpy copies on one thread (write_chunks keeps one chunk on numpy too)

PIECE_BYTES = 1 << 20  # write_chunks cuts a shared copy into rows of this size (the C helper's CHUNK_BYTES)

# One field's copy for copy_fields: (dst_start, sources, src_idx, src_starts, sizes, row_span, pad).
FieldCopy = tuple[int, Sequence[np.ndarray], np.ndarray, np.ndarray, np.ndarray, int, bytes]

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
    threads: int = 1,
) -> int:
    """For each row i copy ``sizes[i]`` bytes from ``sources[src_idx[i]][src_starts[i]:]`` to
    ``dst[dst_starts[i]:]`` (``dst_starts`` None: rows back to back, row i at ``i * row_span`` when
    padded); with ``row_span > 0`` fill the rest of each row's span with ``pad``. ``threads``: the
    most threads the copy may use (see :data:`SHARE_BYTES`); returns how many it ran on."""
    as64 = lambda a: a.astype(np.int64, copy=False)  # noqa: E731
    if _c_copy_rows is not None:
        return _c_copy_rows(
            dst,
            None if dst_starts is None else as64(dst_starts),
            sources,
            as64(src_idx),
            as64(src_starts),
            as64(sizes),
            row_span,
            pad,
            threads,
        )
    if dst_starts is None:
        dst_starts = np.arange(sizes.size, dtype=np.int64) * row_span if row_span > 0 else np.cumsum(sizes) - sizes
    copy_rows_numpy(dst, as64(dst_starts), list(sources), as64(src_idx), as64(src_starts), as64(sizes), row_span, pad)
    return 1


def copy_fields(dst: np.ndarray, jobs: Sequence[FieldCopy], threads: int = 1) -> int:
    """Several :func:`copy_rows` into one destination in one call, one job per field of a get:
    ``(dst_start, sources, src_idx, src_starts, sizes, row_span, pad)``, its rows back to back from
    ``dst_start`` (int64 index arrays). Every job is checked before any byte is written, and the
    streaming-store choice and the split among ``threads`` are made on all of them together (see
    ``tq/_fastcopy.c``); returns how many threads it ran on."""
    if _c_copy_fields is not None:
        return _c_copy_fields(dst, jobs, threads)
    planned = []
    for k, (base, sources, src_idx, src_starts, sizes, row_span, pad) in enumerate(jobs):
        starts = base + (np.arange(sizes.size, dtype=np.int64) * row_span if row_span > 0 else np.cumsum(sizes) - sizes)
        if base < 0 or not _in_bounds(dst, starts, list(sources), src_idx, src_starts, sizes, row_span) or (row_span > 0 and not pad):
            raise ValueError(f"job {k}: copy out of bounds")
        planned.append((starts, list(sources), src_idx, src_starts, sizes, row_span, pad))
    for job in planned:
        _copy_checked(dst, job)
    return 1


def _in_bounds(
    dst: np.ndarray,
    dst_starts: np.ndarray,
    sources: list[np.ndarray],
    src_idx: np.ndarray,
    src_starts: np.ndarray,
    sizes: np.ndarray,
    row_span: int,
) -> bool:
    return not sizes.size or not (
        (src_starts < 0).any()
        or (dst_starts < 0).any()
        or (sizes < 0).any()
        or (row_span > 0 and (sizes > row_span).any())
        or (dst_starts + (row_span if row_span > 0 else sizes) > dst.size).any()
        or ((src_idx < 0) | (src_idx >= len(sources))).any()
        or any((src_starts[src_idx == k] + sizes[src_idx == k] > s.size).any() for k, s in enumerate(sources))
    )


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
    if not _in_bounds(dst, dst_starts, sources, src_idx, src_starts, sizes, row_span):
        raise ValueError("copy out of bounds")
    _copy_checked(dst, (dst_starts, sources, src_idx, src_starts, sizes, row_span, pad))


def _copy_checked(dst: np.ndarray, rows: tuple[np.ndarray, list[np.ndarray], np.ndarray, np.ndarray, np.ndarray, int, bytes]) -> None:
    """The copy of :func:`copy_rows_numpy` (``rows``: its arguments after ``dst``), bounds already
    checked - by it, or by ``copy_fields`` for every job before the first byte."""
    dst_starts, sources, src_idx, src_starts, sizes, row_span, pad = rows
    pattern = np.frombuffer(pad, dtype=np.uint8) if row_span > 0 else None
    for k, s, d, z in zip(src_idx.tolist(), src_starts.tolist(), dst_starts.tolist(), sizes.tolist()):
        dst[d : d + z] = sources[k][s : s + z]
        if pattern is not None and z < row_span:
            tail = dst[d + z : d + row_span]
            tail[:] = np.resize(pattern, tail.size)


def write_chunks(dst: np.ndarray, chunks: Sequence[np.ndarray], threads: int = 1) -> int:
    """Copy chunks back to back into ``dst`` (a uint8 view of exactly their total size), on up to
    ``threads`` threads where it is large enough to share (see :data:`SHARE_BYTES`); returns how many
    it ran on."""
    if len(chunks) == 1 and (threads < 2 or dst.size < 2 * SHARE_BYTES):  # one thread: numpy's memcpy
        dst[:] = chunks[0]
        return 1
    sizes = np.fromiter((c.size for c in chunks), dtype=np.int64, count=len(chunks))
    n = sizes.size
    if threads < 2 or dst.size < 2 * SHARE_BYTES:
        return copy_rows(dst, None, chunks, np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64), sizes, threads=threads)
    # The copier's threads share rows, never one row: a put's column is one chunk (a whole tensor), so
    # it is cut into PIECE_BYTES rows (a 512 MiB put on a 16-core host: 7.8 GB/s as one row on 2-8
    # threads, 26 GB/s as 4 rows on 4)
    pieces = -(-sizes // PIECE_BYTES)
    src_idx = np.repeat(np.arange(n, dtype=np.int64), pieces)
    src_starts = (np.arange(int(pieces.sum()), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * PIECE_BYTES
    piece_sizes = np.minimum(PIECE_BYTES, np.repeat(sizes, pieces) - src_starts)
    return copy_rows(dst, None, chunks, src_idx, src_starts, piece_sizes, threads=threads)
