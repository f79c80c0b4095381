"""An append-only record log that survives the crash of the process writing it.

Format. Each record is a msgpack value framed as ``<I length><I crc> body`` (little-endian), where
``crc = zlib.crc32(length bytes + body)``. The CRC covers the length so that an all-zero tail (what a
filesystem may leave after a power loss) does not pass as an empty record. There is no file header.
This format replaced a length-only framing; old journals are not readable (their first record fails
the CRC, so they read as empty) - nothing persistent depended on them beyond a process crash.

Recovery. The valid prefix of a journal is every record up to the first one that is torn (the file
ends inside it), fails its CRC, or whose body is not exactly one msgpack value. ``Journal.replay``
yields that prefix and stops there, never raising on garbage. Opening a ``Journal`` truncates the
file to the end of that prefix *before* anything new is appended - otherwise records appended after
a torn tail would be unreadable after the next crash - and reports the dropped byte count in
``truncated_bytes`` so the caller can log it. An ``append`` that fails half-way (disk full) cuts the
file back to its last complete record, so one failed write does not poison the records after it.

Durability (the ``fsync`` policy):

* ``"never"`` (default): ``append`` returns once ``write()`` put the record in the OS page cache.
  That survives a crash of the process (SIGKILL included) but not a power loss or kernel crash.
* ``"always"``: ``os.fsync`` after every record - survives power loss, at the cost of a disk flush
  (typically 0.1-10 ms) per append.
* ``"interval"``: an ``append`` fsyncs when the last fsync is at least ``fsync_interval_s`` old, and
  ``close``/``rewrite``/``sync`` fsync too: a power loss loses at most the records written since
  the last fsync (up to one interval of a busy writer; a quiet journal keeps its last records
  unsynced until its next append, ``sync`` or ``close``).

``"never"`` is the default because the journal's job is surviving process crashes: the storage
units' arenas live in shared memory (tmpfs), so after a power loss the data the journal describes
is gone anyway. ``rewrite`` compacts the log atomically under every policy (write a temporary file,
``os.replace`` it over the log); with ``"always"``/``"interval"`` it also fsyncs the temporary file
before the rename and the directory after it, so the rename itself is durable.

A journal has a single writer; storage units keep one next to their shared-memory arena and the
controller one in its state directory.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
import zlib
from typing import Any, Iterable, Iterator, Literal

import msgpack

FsyncPolicy = Literal["never", "always", "interval"]
FSYNC_POLICIES: tuple[str, ...] = ("never", "always", "interval")

_HEAD = struct.Struct("<II")  # body length, crc32 of (length bytes + body)


def _crc(length: int, body: bytes | memoryview) -> int:
    return zlib.crc32(body, zlib.crc32(struct.pack("<I", length)))


def _frame(record: Any) -> bytes:
    body = msgpack.packb(record, use_bin_type=True)
    return _HEAD.pack(len(body), _crc(len(body), body)) + body


def _records(data: bytes) -> Iterator[tuple[Any, int]]:
    """Each record of the valid prefix of ``data`` with the offset where it ends."""
    view = memoryview(data)
    pos = 0
    while pos + _HEAD.size <= len(view):
        n, crc = _HEAD.unpack_from(view, pos)
        end = pos + _HEAD.size + n
        if end > len(view):
            return  # torn by a crash mid-write
        body = view[pos + _HEAD.size : end]
        if _crc(n, body) != crc:
            return  # corrupt, or bytes that were never a record
        try:
            record = msgpack.unpackb(body, raw=False, strict_map_key=False)
        except Exception:  # whatever the decoder objects to, it is not a record we wrote
            return
        yield record, end
        pos = end


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


def _fsync_dir(path: str) -> None:
    """Make a create or rename in the directory of ``path`` durable."""
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class JournalWriteError(OSError):
    """Records could not be written (disk full, file too large, I/O error). The journal is cut back to
    its last complete record, so it stays readable and appendable; what failed is not in it."""


class Journal:
    """Append-only, checksummed log of msgpack records at ``path`` (see the module docstring).

    Opening it truncates a torn or corrupt tail; ``truncated_bytes`` says how many bytes that dropped.
    """

    def __init__(self, path: str, *, fsync: FsyncPolicy = "never", fsync_interval_s: float = 1.0) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_POLICIES)}, not {fsync!r}")
        if not fsync_interval_s >= 0:  # also refuses NaN
            raise ValueError(f"fsync_interval_s must be >= 0, not {fsync_interval_s!r}")
        self.path = path
        self.fsync = fsync
        self.fsync_interval_s = float(fsync_interval_s)
        created = not os.path.exists(path)
        self._f = open(path, "ab", buffering=0)
        data = _read(path)
        ends = [end for _, end in _records(data)]
        # records since the last rewrite - at open, all the file holds: a process restarted before it
        # appended what its compaction waits for counts on from its predecessor's records (counted from
        # zero, a controller killed every few seconds never compacted: 5.6 MB, 3.1 s restarts)
        self.appended = len(ends)
        # where the last complete record ends: appends go here, and a failed one is cut back to it
        self._end = ends[-1] if ends else 0
        self.truncated_bytes = len(data) - self._end
        if self.truncated_bytes:
            os.ftruncate(self._f.fileno(), self._end)
        self._dirty = False  # written since the last fsync
        self._synced_at = float("-inf")  # so the first "interval" append fsyncs at once
        self._batch: list[bytes] | None = None  # frames held by batch(), written when it ends
        if fsync != "never":
            if self.truncated_bytes:
                os.fsync(self._f.fileno())
            if created:
                _fsync_dir(path)

    @staticmethod
    def replay(path: str) -> Iterator[Any]:
        """Every record of the valid prefix, in order; a torn or corrupt tail ends it (never raises on
        garbage). A missing file has no records."""
        for record, _ in _records(_read(path)):
            yield record

    def append(self, record: Any) -> None:
        """Write one record; it has reached the OS (and the disk, as the fsync policy says) on return -
        or, inside :meth:`batch`, when the batch ends."""
        frame = _frame(record)
        if self._f.closed:
            raise ValueError(f"journal {self.path} is closed")
        if self._batch is not None:
            self._batch.append(frame)
            return
        self._write(frame, 1)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Hold the records appended inside and write them in one system call when the block ends
        (raising or not: what was appended was applied), in order and framed as ever: a storage unit
        freeing the 1,024 blocks of a slab given back makes one write, not 1,024. The caller answers
        its request after the block, so the records still reach the OS before anyone hears of them.
        Nested batches write with the outermost."""
        if self._batch is not None:
            yield
            return
        self._batch = []
        try:
            yield
        finally:
            frames, self._batch = self._batch, None
            if frames:
                self._write(b"".join(frames), len(frames))

    def _write(self, data: bytes, records: int) -> None:
        try:
            view = memoryview(data)
            while view:  # a raw write may be short (disk full, a signal); the rest then raises
                view = view[self._f.write(view) :]
        except BaseException as exc:
            try:  # cut the partial record off, so later appends stay readable
                os.ftruncate(self._f.fileno(), self._end)
            except OSError:
                pass  # the next open truncates it instead
            if isinstance(exc, OSError):
                raise JournalWriteError(exc.errno, exc.strerror, self.path) from exc
            raise
        self._end += len(data)
        self.appended += records
        self._dirty = True
        if self.fsync == "always" or (self.fsync == "interval" and time.monotonic() - self._synced_at >= self.fsync_interval_s):
            self.sync()

    @property
    def size(self) -> int:
        """Bytes of complete records in the log."""
        return self._end

    def sync(self) -> None:
        """fsync what was appended since the last fsync (whatever the policy)."""
        if self._dirty and not self._f.closed:
            os.fsync(self._f.fileno())
            self._dirty = False
            self._synced_at = time.monotonic()

    def rewrite(self, records: Iterable[Any]) -> None:
        """Replace the log with ``records`` atomically: a crash leaves either the old log or the new
        one. If ``records`` raises, the old log stays in place and in use."""
        tmp = self.path + ".tmp"
        size = 0
        try:
            with open(tmp, "wb") as f:
                for r in records:
                    size += f.write(_frame(r))
                f.flush()
                if self.fsync != "never":
                    os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        if self.fsync != "never":
            _fsync_dir(self.path)
        self._f.close()
        self._f = open(self.path, "ab", buffering=0)
        self._end = size
        if self._batch is not None:  # the records held so far describe state the new log already holds
            self._batch = []
        self.appended = 0
        self._dirty = False
        self._synced_at = time.monotonic()

    def close(self, *, unlink: bool = False) -> None:
        """Close the log (fsyncing it under the "interval" policy) and, with ``unlink``, delete it."""
        if self.fsync == "interval" and not unlink:
            self.sync()
        self._f.close()
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
