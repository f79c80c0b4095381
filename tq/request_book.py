"""The controller's book of recent requests that change a partition (discard, clear_partition,
drop_partition, create_partition - which clears an existing partition with ``reuse`` -, mint,
set_tags), by the id each client gives such a request.

One whose reply never reached its client (the controller was stalled, or the network cut) has an
unknown outcome, and it may still be on its way: in a socket's buffer, or retransmitted by TCP after
a cut heals. So the client fences it (``abort_requests``) before it relies on the keys again: one
applied by then is reported applied; one not applied yet never will be - when it arrives, it is
dropped. The same request sent again (a resend across a cut) gets the first one's answer instead of
failing on keys or a partition it removed itself.

Bounded: the ids of the last ``RECENT`` applied requests and of the last ``RECENT`` fenced ones (a
fence is rare: one per request that failed). Journaled through the requests that make it, so a
restarted controller keeps it.
"""

from __future__ import annotations

import collections
import secrets
from typing import Any

from .errors import InvalidRequestError

RECENT = 16384  # ids kept of each kind (about 2 MB each, full)


def new_request_id() -> int:
    """A random request id in [1, 2**63 - 1]: two clients' ids collide with probability ~2**-63."""
    return secrets.randbits(63) or 1


class RequestBook:
    """Recent request ids: applied (with the count their reply carried) or fenced."""

    def __init__(self) -> None:
        self.applied: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.fenced: collections.OrderedDict[int, None] = collections.OrderedDict()

    def check(self, op: str, request_id: int | None) -> int | None:
        """Before request ``op`` is applied: the count it answered if it was applied already (sent
        again), None if it is new. Raises InvalidRequestError if its client fenced it."""
        if request_id is None:
            return None
        if request_id in self.fenced:
            raise InvalidRequestError(f"{op} {request_id} was given up on by its client before it arrived: not applied")
        return self.applied.get(request_id)

    def record(self, request_id: int | None, count: int) -> None:
        """A request was applied; ``count``: what its reply counted (keys freed, minted or tagged; for
        a create, 1 if it reused a partition)."""
        if request_id is not None:
            _bounded_add(self.applied, request_id, count)

    def abort(self, ids: list[int]) -> list[int | None]:
        """Fence each id not applied; per id, the count its reply carried if it had been applied, else
        None (fenced now)."""
        out = []
        for i in ids:
            count = self.applied.get(i)
            if count is None:
                _bounded_add(self.fenced, i, None)
            out.append(count)
        return out

    def snapshot(self) -> list[list[Any]]:
        return [[i, n] for i, n in self.applied.items()] + [[i, None] for i in self.fenced]

    @classmethod
    def restore(cls, snap: list[list[Any]] | None) -> RequestBook:
        book = cls()
        for i, n in snap or []:
            if n is None:
                _bounded_add(book.fenced, i, None)
            else:
                _bounded_add(book.applied, i, n)
        return book


def _bounded_add(d: collections.OrderedDict, key: int, value: Any) -> None:
    d[key] = value
    d.move_to_end(key)
    while len(d) > RECENT:
        d.popitem(last=False)
