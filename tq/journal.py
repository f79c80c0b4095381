"""An append-only record log that survives the crash of the process writing it.

Records are msgpack values framed by a 4-byte little-endian length, so a record torn by a crash in
mid-write is detected and dropped on replay (everything before it is kept). ``rewrite`` compacts the
log atomically (write a new file, rename over the old one). Storage units keep one next to their
shared-memory arena so a restarted unit recovers the blocks it held.
"""

from __future__ import annotations

import os
import struct
from typing import Any, Iterable, Iterator

import msgpack

_LEN = struct.Struct("<I")


class Journal:
    """Append-only log of msgpack records at ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.appended = 0  # records appended since open or the last rewrite
        self._f = open(path, "ab", buffering=0)

    @staticmethod
    def replay(path: str) -> Iterator[Any]:
        """Every complete record in order; a torn tail is ignored."""
        if not os.path.exists(path):
            return
        with open(path, "rb") as f:
            data = f.read()
        pos = 0
        while pos + _LEN.size <= len(data):
            (n,) = _LEN.unpack_from(data, pos)
            if pos + _LEN.size + n > len(data):
                return  # torn by a crash mid-write
            yield msgpack.unpackb(data[pos + _LEN.size : pos + _LEN.size + n], raw=False, strict_map_key=False)
            pos += _LEN.size + n

    @staticmethod
    def _frame(record: Any) -> bytes:
        body = msgpack.packb(record, use_bin_type=True)
        return _LEN.pack(len(body)) + body

    def append(self, record: Any) -> None:
        """Write one record (a single write call, unbuffered: it reaches the OS before returning)."""
        self._f.write(self._frame(record))
        self.appended += 1

    def rewrite(self, records: Iterable[Any]) -> None:
        """Replace the log with ``records`` atomically."""
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            for r in records:
                f.write(self._frame(r))
        os.replace(tmp, self.path)
        self._f.close()
        self._f = open(self.path, "ab", buffering=0)
        self.appended = 0

    def close(self, *, unlink: bool = False) -> None:
        self._f.close()
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
