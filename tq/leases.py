"""Leases of borrowed gets: the controller's record of which stored blocks readers view in place.

A borrowed get (``TQClient.get(..., copy=False)``) hands out tensors that view a storage arena, so the
bytes under them must not be freed or reused while they live. The controller takes a lease on every
(unit, block) the get located, in the same request; a discard, clear or overwrite of a borrowed key
still removes the key at once, but the rows it frees wait here until no lease holds their block. A
lease ends when its holder releases it (its tensors were collected, or it said so) or when its term
runs out without a renewal: a holder that died pins nothing for longer than one term.
"""

from __future__ import annotations

import collections
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .liveness import Holder

UNIT, BLOCK, ROW = 0, 1, 2  # columns of the rows kept here, as in the location records
BLOCK_BITS = 40  # block ids stay below 2**40, so (unit, block) packs into one int64


def distinct(ids: np.ndarray) -> np.ndarray:
    """The distinct values of ``ids`` (any shape), sorted. A get's rows come block by block, so runs
    are collapsed first: np.unique then sorts a few values, not one per row."""
    flat = ids.ravel()
    runs = flat[np.flatnonzero(np.diff(flat, prepend=flat[:1] - 1))] if flat.size else flat
    return np.unique(runs)


def leased_blocks(loc: np.ndarray) -> list[tuple[int, int]]:
    """The distinct (unit, block) pairs of location records (unit and block columns first)."""
    packed = distinct(loc[..., UNIT] * (1 << BLOCK_BITS) + loc[..., BLOCK])
    return [divmod(int(x), 1 << BLOCK_BITS) for x in packed.tolist()]


def new_lease_id() -> int:
    """A random lease id in [1, 2**62]: a reader chooses its own (so it can give up a lease whose grant
    it never heard), and two random ones collide with probability ~2**-62."""
    return secrets.randbits(62) + 1


def pin_ref(pin: Any) -> tuple[str, int] | None:
    """A lease's pin reference as journaled ([path, slot] or None) back as a tuple."""
    return None if pin is None else (str(pin[0]), int(pin[1]))


def holder_ref(holder: Any) -> Holder | None:
    """A lease's holder as journaled (a liveness file's name, [pid, start time] or None) back."""
    if holder is None or isinstance(holder, str):
        return holder
    return (int(holder[0]), int(holder[1]))


@dataclass
class Lease:
    ttl: float
    deadline: float
    blocks: list[tuple[int, int]]
    pin: tuple[str, int] | None = None  # (pin file, slot) of a lease a reader took as a pin (tq.pins)
    # a holder on the controller's host: while it runs, a term with no renewal means it is paused
    # (its views live on), not gone, and the lease is kept
    holder: Holder | None = None


@dataclass
class LeaseBook:
    """Leases by id, how many hold each (unit, block), and the rows freed under them."""

    leases: dict[int, Lease] = field(default_factory=dict)
    refs: collections.Counter[tuple[int, int]] = field(default_factory=collections.Counter)
    deferred: dict[tuple[int, int], list[np.ndarray]] = field(default_factory=dict)  # [n, 3] (unit, block, row)

    def take(
        self,
        lease_id: int,
        ttl: float,
        blocks: list[tuple[int, int]],
        now: float | None = None,
        pin: tuple[str, int] | None = None,
        holder: Holder | None = None,
    ) -> None:
        """Pin ``blocks`` for ``ttl`` seconds under ``lease_id`` (``pin``: the slot whose pin it is;
        ``holder``: see :class:`Lease`)."""
        now = time.monotonic() if now is None else now
        self.leases[lease_id] = Lease(ttl, now + ttl, blocks, pin, holder)
        self.refs.update(blocks)

    def renew(self, ids: list[int], now: float | None = None) -> list[int]:
        """Extend each lease by its full term; returns the ids that are not (or no longer) held."""
        now = time.monotonic() if now is None else now
        gone = []
        for i in ids:
            lease = self.leases.get(i)
            if lease is None:
                gone.append(i)
            else:
                lease.deadline = now + lease.ttl
        return gone

    def release(self, ids: list[int]) -> np.ndarray:
        """End these leases; returns the rows (``[n, 3]`` unit, block, row) no lease holds any more."""
        free = [np.empty((0, 3), np.int64)]
        for i in ids:
            lease = self.leases.pop(i, None)
            if lease is None:
                continue
            for b in lease.blocks:
                self.refs[b] -= 1
                if self.refs[b] <= 0:
                    del self.refs[b]
                    free.extend(self.deferred.pop(b, ()))
        return np.concatenate(free)

    def expired(self, now: float) -> list[int]:
        return [i for i, lease in self.leases.items() if lease.deadline <= now]

    def next_deadline(self) -> float | None:
        return min((lease.deadline for lease in self.leases.values()), default=None)

    def hold(self, rows: np.ndarray) -> np.ndarray:
        """Keep the rows (location records: unit, block, row first) whose block a lease holds; returns
        the others, which can be freed now."""
        if not self.refs or not rows.size:
            return rows
        keys = rows[:, UNIT] * (1 << BLOCK_BITS) + rows[:, BLOCK]
        held = np.isin(keys, np.fromiter((u * (1 << BLOCK_BITS) + b for u, b in self.refs), dtype=np.int64, count=len(self.refs)))
        for key in np.unique(keys[held]).tolist():
            sel = held & (keys == key)
            self.deferred.setdefault(divmod(key, 1 << BLOCK_BITS), []).append(np.ascontiguousarray(rows[sel][:, [UNIT, BLOCK, ROW]]))
        return rows[~held]

    def held_on(self, unit: int) -> np.ndarray:
        """(block, row) pairs of ``unit`` freed under a lease (a unit must keep them)."""
        rows = [r[:, [BLOCK, ROW]] for (u, _), rs in self.deferred.items() if u == unit for r in rs]
        return np.concatenate(rows) if rows else np.empty((0, 2), np.int64)

    def waiting_rows(self) -> int:
        return sum(r.shape[0] for rs in self.deferred.values() for r in rs)

    def snapshot(self) -> dict[str, Any]:
        deferred = [r for rs in self.deferred.values() for r in rs]
        return {
            "leases": [[i, lease.ttl, [list(b) for b in lease.blocks], lease.pin, lease.holder] for i, lease in self.leases.items()],
            "deferred": np.concatenate(deferred).astype(np.int64).tobytes() if deferred else b"",
        }

    @classmethod
    def restore(cls, snap: dict[str, Any] | None) -> "LeaseBook":
        """The book of a snapshot, every lease given a fresh term (its holder may renew it again)."""
        book = cls()
        if not snap:
            return book
        for i, ttl, blocks, *rest in snap["leases"]:
            pin, holder = (rest + [None, None])[:2]
            book.take(int(i), float(ttl), [(int(u), int(b)) for u, b in blocks], pin=pin_ref(pin), holder=holder_ref(holder))
        rows = np.frombuffer(snap["deferred"], dtype=np.int64).reshape(-1, 3)
        book.hold(rows)
        return book
