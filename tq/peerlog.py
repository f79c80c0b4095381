"""Warnings about what peers do wrong (malformed messages, refused handshakes), rate-limited.

A server answers and counts every refused message or connection (its stats and metrics count each);
its log gets at most one line per kind every :data:`EVERY_S`, and the next line says how many were
left out. A peer sending garbage as fast as it can - or, with a secret, failing handshakes from the
network - must not fill the log.
"""

from __future__ import annotations

import logging
import time
from typing import Any

EVERY_S = 10.0


class PeerLog:
    """One server's warnings about its peers: at most one line per kind every ``every_s``."""

    def __init__(self, logger: logging.Logger, every_s: float = EVERY_S) -> None:
        self.logger, self.every_s = logger, every_s
        self._last: dict[str, tuple[float, int]] = {}  # kind -> (when its last line was logged, left out since)

    def warning(self, kind: str, msg: str, *args: Any) -> None:
        """Log ``msg % args`` as a warning unless a line of this ``kind`` went out within ``every_s``
        (then it is only counted, and the next line of the kind says how many were left out)."""
        now = time.monotonic()
        last, left_out = self._last.get(kind, (float("-inf"), 0))
        if now - last < self.every_s:
            self._last[kind] = (last, left_out + 1)
            return
        if left_out:
            msg = f"{msg} (and {left_out} more like it since the last such line, not logged)"
        self._last[kind] = (now, 0)
        self.logger.warning(msg, *args)
