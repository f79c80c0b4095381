"""Shared-memory arenas: where a storage unit keeps column bytes, mapped by same-host clients.

A storage unit owns one arena: a file in ``/dev/shm`` (tmpfs) mapped once. It hands out byte ranges
with :class:`RangeAllocator`; clients on the same host map the same file once and read or write the
ranges directly, so same-host puts and gets run at memory-copy speed instead of streaming through a
socket (the same idea as Ray's plasma store). Freed ranges are reused, so their pages stay warm.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import mmap
import sys
import os
import re
import resource
import time

import numpy as np

from .errors import CapacityError, StorageUnitError
from .liveness import create_held

ALIGN = 4096
BACKED_CHUNK = 2 << 20  # the granularity at which a storage unit allocates its arena's pages (Arena.allocate_pages)


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def release_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim``; nothing elsewhere): after
    a burst of large messages a process otherwise keeps its heap's high-water mark resident."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class RangeAllocator:
    """First-fit allocator of aligned byte ranges in ``[0, capacity)`` with coalescing frees."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._starts: list[int] = [0]  # free ranges, sorted by start
        self._sizes: list[int] = [capacity]
        self.used = 0

    def allocate(self, nbytes: int) -> int:
        """Return the start of a free range of ``nbytes`` (rounded up to ALIGN); raise CapacityError."""
        size = align_up(max(nbytes, 1))
        for i, free in enumerate(self._sizes):
            if free >= size:
                start = self._starts[i]
                if free == size:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += size
                    self._sizes[i] -= size
                self.used += size
                return start
        raise CapacityError(
            f"no room for {nbytes} bytes: {self.used} of {self.capacity} bytes in use "
            f"(largest free range {max(self._sizes, default=0)} bytes)"
        )

    def reserve(self, start: int, nbytes: int) -> None:
        """Mark ``[start, start + nbytes)`` (aligned as by :meth:`allocate`) used - for recovery."""
        size = align_up(max(nbytes, 1))
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0 or self._starts[i] + self._sizes[i] < start + size:
            raise ValueError(f"range [{start}, {start + size}) is not free")
        fs, fz = self._starts[i], self._sizes[i]
        del self._starts[i], self._sizes[i]
        if start + size < fs + fz:  # right remainder
            self._starts.insert(i, start + size)
            self._sizes.insert(i, fs + fz - start - size)
        if start > fs:  # left remainder
            self._starts.insert(i, fs)
            self._sizes.insert(i, start - fs)
        self.used += size

    def free(self, start: int, nbytes: int) -> None:
        """Return a range obtained from :meth:`allocate` (same ``nbytes``)."""
        size = align_up(max(nbytes, 1))
        i = bisect.bisect_left(self._starts, start)
        if (i < len(self._starts) and self._starts[i] < start + size) or (i > 0 and self._starts[i - 1] + self._sizes[i - 1] > start):
            raise ValueError(f"double free of range [{start}, {start + size})")
        self._starts.insert(i, start)
        self._sizes.insert(i, size)
        self.used -= size
        if i + 1 < len(self._starts) and start + size == self._starts[i + 1]:  # merge right
            self._sizes[i] += self._sizes.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start:  # merge left
            self._sizes[i - 1] += self._sizes.pop(i)
            self._starts.pop(i)

    def largest_free(self) -> int:
        """Bytes of the largest free range: the biggest allocation that can succeed now."""
        return max(self._sizes, default=0)

    def free_ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._sizes))


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def arena_in_use(path: str) -> bool:
    """Whether a live storage-unit process owns the arena at ``path`` (holds its lock). The lock dies
    with its process, however it dies, so this never reports a dead owner."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        if _try_lock(fd):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        return True
    finally:
        os.close(fd)


ARENA_NAME = re.compile(r"tq-[0-9a-f]{12}-unit[0-9]+\.arena")  # as storage units name them


def unowned_arenas(directory: str, min_age_s: float) -> list[str]:
    """The arenas of ``directory`` no live storage unit owns (:func:`arena_in_use`) that nothing wrote
    for ``min_age_s`` (arena and journal): left by units killed with their whole service. A unit
    restarted by a live controller recovers its arena within seconds; one left longer is stored data
    only a controller started again on the service's journal dir would take back."""
    try:
        names = sorted(n for n in os.listdir(directory) if ARENA_NAME.fullmatch(n))
    except OSError:
        return []
    out, now = [], time.time()
    for name in names:
        path = os.path.join(directory, name)
        try:
            newest = max(os.stat(p).st_mtime for p in (path, path + ".journal") if os.path.exists(p))
            if now - newest >= min_age_s and not arena_in_use(path):
                out.append(path)
        except (OSError, ValueError):  # gone meanwhile, or not ours to open (another user's): left alone
            continue
    return out


# madvise(MADV_POPULATE_WRITE) (Linux >= 5.14; Python names it from 3.13 on).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)


def populate_writable(mm: mmap.mmap, start: int = 0, nbytes: int | None = None) -> None:
    """Allocate and map the pages of ``mm[start:start + nbytes]`` (all of it by default) writable in
    one call, best effort, so a copy into them takes no fault per page."""
    if _MADV_POPULATE_WRITE is None or nbytes is not None and nbytes <= 0:
        return
    lo = start - start % mmap.PAGESIZE
    try:
        if nbytes is None:
            mm.madvise(_MADV_POPULATE_WRITE, lo)
        else:
            mm.madvise(_MADV_POPULATE_WRITE, lo, start + nbytes - lo)
    except OSError:  # a kernel before 5.14: the copy faults the pages in as it goes
        pass


class Arena:
    """A memory-mapped shared-memory file exposing its bytes as a numpy uint8 array.

    The storage unit that owns an arena opens it with ``own=True``: it holds an exclusive lock on the
    file for as long as it lives, so two unit processes can never serve (and journal, and free) the
    same arena - e.g. one restarted by a controller that crashed before it rejoined, and one restarted
    by the controller's next incarnation. Clients map arenas without the lock."""

    def __init__(self, path: str, size: int, *, create: bool, own: bool = False) -> None:
        self.path, self.size = path, size
        self._lock_fd: int | None = None  # the owner's descriptor: holds the lock, reserves pages
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if own:
                if not _try_lock(fd):
                    raise StorageUnitError(f"arena {path} is in use by another storage-unit process")
                self._lock_fd = os.dup(fd)  # the lock lives as long as this descriptor (this process)
            if create:
                os.ftruncate(fd, size)  # sparse: pages are allocated when first written
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"arena {path} is smaller than {size} bytes")
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.view = np.frombuffer(self._mm, dtype=np.uint8)
        # BACKED_CHUNK-sized pieces whose pages this owner allocated (none known for a reopened arena)
        self._backed = np.zeros(-(-size // BACKED_CHUNK), dtype=bool)
        # ... and those this mapping populated writable (prefault): mapped until the owner gives the
        # pages back (release_pages, which its writers learn of: forget_populated)
        self._populated = np.zeros(-(-size // BACKED_CHUNK), dtype=bool)

    def allocate_pages(self, start: int, nbytes: int) -> None:
        """Allocate the backing pages of ``[start, start + nbytes)`` now (the owner only), so a full
        tmpfs fails here with :class:`CapacityError` naming the directory: the arena is sparse, and a
        page that cannot be allocated when a writer first touches it kills that process with SIGBUS
        (another tenant of ``/dev/shm``, e.g. Ray's object store, may have taken the room since the
        unit started). Allocated in BACKED_CHUNK pieces, each once (until :meth:`release_pages`)."""
        if nbytes <= 0 or self._lock_fd is None:
            return
        lo, hi = start // BACKED_CHUNK, -(-(start + nbytes) // BACKED_CHUNK)
        missing = np.flatnonzero(~self._backed[lo:hi])
        if missing.size:  # a warm range costs no call: the kernel takes ~60 ns a page even for present ones
            first, last = lo + int(missing[0]), lo + int(missing[-1]) + 1
            end = min(last * BACKED_CHUNK, self.size)
            allocate_file_pages(self._lock_fd, self.path, first * BACKED_CHUNK, end - first * BACKED_CHUNK)
            self._backed[first:last] = True

    def prefault(self, start: int, nbytes: int) -> None:
        """Map the pages of ``[start, start + nbytes)`` writable in this process in one call (best
        effort), so a big copy into them takes no page faults: one fault per 4 KiB page, each a trap
        into a kernel that serialises them per shared-memory file, is what kept concurrent writers
        from scaling. Pieces this mapping populated before are skipped: the call walks every page even
        where all are mapped already (25 ms for 512 MiB on the 2-vCPU VM, against a 31 ms copy)."""
        if nbytes <= 0:
            return
        lo, hi = start // BACKED_CHUNK, -(-(start + nbytes) // BACKED_CHUNK)
        missing = np.flatnonzero(~self._populated[lo:hi])
        if not missing.size:
            return
        first = max(start, (lo + int(missing[0])) * BACKED_CHUNK)  # from the first piece not mapped yet
        end = min(start + nbytes, (lo + int(missing[-1]) + 1) * BACKED_CHUNK)  # to the end of the last one
        populate_writable(self._mm, first, end - first)
        # only the pieces the call covered whole count as mapped (the arena's last one may be short)
        whole_end = -(-end // BACKED_CHUNK) if end == self.size else end // BACKED_CHUNK
        self._populated[-(-first // BACKED_CHUNK) : whole_end] = True

    def forget_populated(self) -> None:
        """The owner gave pages back (:meth:`release_pages`): the next prefault maps them all again."""
        self._populated[:] = False

    def release_pages(self, start: int, nbytes: int) -> None:
        """Give the pages of a free range back to the OS (they read as zeros afterwards)."""
        if nbytes > 0 and hasattr(mmap, "MADV_REMOVE"):
            self._mm.madvise(mmap.MADV_REMOVE, start, nbytes)
            self._backed[start // BACKED_CHUNK : -(-(start + nbytes) // BACKED_CHUNK)] = False

    def close(self, *, unlink: bool = False) -> None:
        self.view = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view; the mapping dies with it
            pass
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        if self._lock_fd is not None:  # released last: nobody may take the arena over before it is gone
            os.close(self._lock_fd)
            self._lock_fd = None


def allocate_file_pages(fd: int, path: str, start: int, nbytes: int) -> None:
    """Allocate the pages of ``[start, start + nbytes)`` of the shared-memory file ``path`` (open as
    ``fd``; the file grows to cover them) before anyone maps them: on a full tmpfs that fails here, as
    :class:`CapacityError` naming the directory, where a first touch through a mapping would kill the
    process with SIGBUS - and past the process's file size limit as one naming that limit."""
    try:
        os.posix_fallocate(fd, start, nbytes)
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            raise CapacityError(
                f"{os.path.basename(path)} cannot grow to {start + nbytes} bytes: past this process's file size "
                f"limit (RLIMIT_FSIZE, `ulimit -f`: {resource.getrlimit(resource.RLIMIT_FSIZE)[0]} bytes); raise it"
            ) from None
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        directory = os.path.dirname(path)
        raise CapacityError(
            f"{directory} is full ({shm_free_bytes(directory)} bytes free): {os.path.basename(path)} cannot get "
            f"{nbytes} more bytes of shared memory ({exc.strerror}); free space there or point the service's "
            "--shm-dir at a larger tmpfs"
        ) from None


def map_new_shm_file(path: str, nbytes: int) -> tuple[int, mmap.mmap]:
    """Create ``path`` (which must not exist) as a file of ``nbytes`` whose pages are all allocated
    (:func:`allocate_file_pages`), map it read-write and return (a descriptor holding a shared lock on
    it, the mapping): the file is in use for as long as the descriptor stays open, in any pid
    namespace (:func:`tq.liveness.create_held`). Nothing is left behind when that fails."""
    fd = create_held(path, fill=lambda fd: allocate_file_pages(fd, path, 0, nbytes))  # fallocate sets the size
    try:
        return fd, mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise


def shm_free_bytes(directory: str) -> int:
    """Bytes free to an unprivileged writer in ``directory``'s file system."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def check_shm_room(directory: str, nbytes: int) -> None:
    """Fail fast, naming the directory, when it cannot hold an arena of ``nbytes``."""
    avail = shm_free_bytes(directory)
    if avail < nbytes:
        raise CapacityError(
            f"{directory} has {avail} bytes free but the storage unit needs {nbytes}; "
            "lower --capacity or pass --shm-dir pointing at a larger tmpfs"
        )


def map_read_only(path: str, nbytes: int) -> np.ndarray:
    """The first ``nbytes`` of the arena file at ``path``, mapped read-only: a write through it faults
    instead of changing stored bytes. The mapping lives as long as the array (and views of it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return np.frombuffer(mmap.mmap(fd, nbytes, prot=mmap.PROT_READ), dtype=np.uint8)
    finally:
        os.close(fd)


def host_identity() -> str:
    """An id equal for processes on the same host (and boot), used to pick the shared-memory path."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "noboot"
    return f"{os.uname().nodename}/{boot}"
