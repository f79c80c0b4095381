"""The controller's book of recent discards, by the id each client gives its discard.

A discard whose reply never reached its client (the controller was stalled, or the network cut) has
an unknown outcome, and its request may still be on its way: a Unix or TCP socket's buffer, a TCP
retransmission after a cut heals. So the client fences it (``abort_discards``) before it relies on
the keys again: a discard applied by then is reported applied; one not applied yet never will be -
when its request arrives, it is dropped. A discard sent again (a resend across a cut) gets the first
one's answer instead of failing on keys it freed itself.

Bounded: the ids of the last ``RECENT`` applied discards and of the last ``RECENT`` fenced ones (a
fence is rare: one per discard that failed). Journaled through the requests that make it, so a
restarted controller keeps it.
"""

from __future__ import annotations

import collections
from typing import Any

from .errors import InvalidRequestError

RECENT = 16384  # ids kept of each kind (about 2 MB each, full)


class DiscardBook:
    """Recent discard ids: applied (with the count their reply carried) or fenced."""

    def __init__(self) -> None:
        self.applied: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.fenced: collections.OrderedDict[int, None] = collections.OrderedDict()

    def check(self, discard_id: int | None) -> int | None:
        """Before a discard is applied: the count it answered if it was applied already (a resend),
        None if it is new. Raises InvalidRequestError if its client fenced it."""
        if discard_id is None:
            return None
        if discard_id in self.fenced:
            raise InvalidRequestError(f"discard {discard_id} was given up on by its client before it arrived: not applied")
        return self.applied.get(discard_id)

    def record(self, discard_id: int | None, discarded: int) -> None:
        """A discard was applied."""
        if discard_id is not None:
            _bounded_add(self.applied, discard_id, discarded)

    def abort(self, ids: list[int]) -> list[bool]:
        """Fence each id not applied; per id, whether it had been applied."""
        out = []
        for i in ids:
            applied = i in self.applied
            if not applied:
                _bounded_add(self.fenced, i, None)
            out.append(applied)
        return out

    def snapshot(self) -> list[list[Any]]:
        return [[i, n] for i, n in self.applied.items()] + [[i, None] for i in self.fenced]

    @classmethod
    def restore(cls, snap: list[list[Any]] | None) -> DiscardBook:
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
