"""A caching pool of host buffers for get results.

Fresh large allocations cost a page fault per page when first written (on some VMs that is slower
than the copy itself); the pool keeps the pages of buffers whose tensors have died and hands them to
the next get, as a caching allocator does. A buffer returns to the pool when the last tensor or array
viewing it is garbage collected; the pool never holds more than ``max_cached_bytes`` idle.
"""

from __future__ import annotations

import bisect
import itertools
import mmap
import os
import queue
import threading
import weakref

import numpy as np

from .arena import populate_writable

POOL_GRANULE = 2 << 20  # huge-page size: buffers are rounded up to it and reused by size class
_pools: "weakref.WeakSet[HostBufferPool]" = weakref.WeakSet()


def _unlock_pools_in_child() -> None:
    """A child forked while another thread of its parent was inside a pool (a TCP get's lane receiving
    a reply) would wait for that lock forever: the child's pools get fresh locks."""
    for pool in list(_pools):
        pool._lock = threading.Lock()


os.register_at_fork(after_in_child=_unlock_pools_in_child)


def huge_page_mapping(nbytes: int, *, populate: bool = False) -> mmap.mmap:
    """``nbytes`` of private anonymous memory advised for transparent huge pages. Private, not mmap's
    default shared anonymous memory: that is shmem, which gets no huge pages where shmem THP is off
    (the common default). ``populate``: its pages are allocated now, in one call, instead of by a
    fault per page as the first copy writes them."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    if populate:
        populate_writable(mm)
    return mm


class HostBufferPool:
    """Hands out uint8 numpy arrays backed by reusable anonymous mappings (see module docstring)."""

    def __init__(self, max_cached_bytes: int | None = None, min_pooled_bytes: int = 1 << 20, *, populate: bool = True) -> None:
        """``populate``: a new buffer's pages are allocated at once (a get's result, every byte of which
        is written at once); without it, as they are first written (a received message, whose sender
        declares its size before it sends a byte of it - and may never send them)."""
        env = os.environ.get("TQ_BUFFER_POOL_BYTES")
        self.max_cached_bytes = max_cached_bytes if max_cached_bytes is not None else int(env) if env else 2 << 30
        self.min_pooled_bytes = min_pooled_bytes
        self.populate = populate
        self._free: list[tuple[int, int, mmap.mmap]] = []  # (size, seq, mapping), sorted by size
        self._cached = 0
        self._seq = itertools.count()
        self._lock = threading.Lock()
        # Buffers whose last array was collected, not yet back in ``_free``: each array is watched by a
        # weak reference whose callback is ``SimpleQueue.put`` itself - it runs wherever the collector
        # runs (also on a thread inside ``empty`` with the lock held) and, being C, runs no Python code
        # a signal handler's exception (a Ctrl-C) could cut short.
        self._released: queue.SimpleQueue[weakref.ref] = queue.SimpleQueue()
        self._watched: dict[int, tuple[weakref.ref, mmap.mmap, int]] = {}  # id of the reference -> it, the buffer
        _pools.add(self)

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            self._take_back()
            return self._cached

    def empty(self, nbytes: int) -> np.ndarray:
        """An uninitialised uint8 array of ``nbytes`` (pooled when large)."""
        if nbytes < self.min_pooled_bytes or self.max_cached_bytes <= 0:
            return np.empty(nbytes, dtype=np.uint8)
        size = -(-nbytes // POOL_GRANULE) * POOL_GRANULE
        mm, smaller = None, None
        with self._lock:  # best fit: the smallest idle buffer that holds the request, if not over 2x;
            self._take_back()
            # among equal sizes the most recently released (its lines are likeliest still cached)
            i = bisect.bisect_left(self._free, (size, -(1 << 62)))
            if i < len(self._free) and self._free[i][0] <= 2 * size:
                size, _, mm = self._free.pop(i)
                self._cached -= size
            elif i > 0:  # only smaller ones idle: the largest of them, grown (see _grown)
                smaller = self._free.pop(i - 1)
                self._cached -= smaller[0]
        if smaller is not None:
            mm = self._grown(smaller[2], smaller[0], size)
        if mm is None:  # every byte of a get's buffer is written: populating it costs nothing extra and
            # saves a fault per page (a cold 512 MiB get on a 32-core host: 345 ms, 120 ms warm)
            mm = huge_page_mapping(size, populate=self.populate)
        arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
        ref = weakref.ref(arr, self._released.put)
        self._watched[id(ref)] = (ref, mm, size)
        return arr

    def _grown(self, mm: mmap.mmap, size: int, new_size: int) -> mmap.mmap | None:
        """An idle buffer grown in place to ``new_size`` (mremap: its pages move, nothing is copied),
        only the added pages populated; None if it cannot be (the buffer is dropped, unmapped once
        unreferenced; not closed: an array dying on another thread may not have let go of it yet).
        Batches that grow step by step - a GRPO run's responses lengthen as it trains - would
        otherwise find every idle buffer too small and fault a fresh one in on every get."""
        try:
            mm.resize(new_size)
        except (OSError, BufferError, SystemError):  # no room to move it, still exported, no mremap
            return None
        if self.populate:
            populate_writable(mm, size, new_size - size)
        return mm

    def _take_back(self) -> None:
        """Move the queued buffers into ``_free`` (call with the lock held), in the order they died."""
        while True:
            try:
                _, mm, size = self._watched.pop(id(self._released.get_nowait()))
            except queue.Empty:
                return
            if self._cached + size <= self.max_cached_bytes:
                bisect.insort(self._free, (size, -next(self._seq), mm))
                self._cached += size
            # Over budget: drop the mapping (unmapped once nothing references it).

    def clear(self) -> None:
        """Unmap every idle buffer."""
        with self._lock:
            self._take_back()
            for _, _, mm in self._free:
                try:
                    mm.close()
                except BufferError:  # queued by its array's finalizer, which still holds it: unmapped
                    pass  # when that array is gone (see _grown)
            self._free.clear()
            self._cached = 0
