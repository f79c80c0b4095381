"""A partition's state on the controller: its keys, their slots, tags, sequence lengths, field
schemas and location records (kept in a :class:`~tq.locations.LocationTable`, shared with same-host
readers), and the requests parked until their fields are produced."""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .errors import KeyNotFoundError
from .locations import FEW_ROWS, LocationTable, slots_index
from .protocol import LOC_NBYTES as NBYTES
from .rpc import Call
from .schema import FieldSchema


def rows_at(slots: np.ndarray | list[int]) -> slice | np.ndarray | list[int]:
    """How :func:`put_at` addresses these slots: a slice when there are many and they run
    consecutively upwards (:func:`~tq.locations.slots_index`), else the slots themselves (for a few,
    one at a time costs less than the check). Made once for every list set at the same slots."""
    return slots_index(slots) if len(slots) > FEW_ROWS else slots


def put_at(dst: list[Any], at: slice | np.ndarray | list[int], values: Sequence[Any]) -> None:
    """``dst[s] = v`` for the slots ``at`` addresses (:func:`rows_at`) and their ``values``, in order:
    one slice assignment, or one at a time."""
    if isinstance(at, slice):
        dst[at] = values
    else:
        for s, v in zip(at.tolist() if isinstance(at, np.ndarray) else at, values):
            dst[s] = v


@dataclass
class Partition:
    """Keys of one partition; per field a location table indexed by key slot (-1: not produced),
    kept in ``table`` (shared with same-host readers, see :mod:`tq.locations`)."""

    pid: str
    table: LocationTable
    index: dict[str, int] = field(default_factory=dict)  # key -> slot
    slot_keys: list[str | None] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)  # -1: unknown
    tags: dict[str, list[Any]] = field(default_factory=dict)
    schemas: dict[str, FieldSchema] = field(default_factory=dict)
    # schemas of fields before the partition was cleared, which same-host readers may still hold under
    # the table's current ``clears`` count: writing such a field with another schema bumps it
    prior_schemas: dict[str, FieldSchema] = field(default_factory=dict)
    free_slots: list[int] = field(default_factory=list)  # slots of discarded keys, reused first
    created_at: float = field(default_factory=time.time)

    @property
    def capacity(self) -> int:
        return len(self.slot_keys)

    @property
    def locs(self) -> dict[str, np.ndarray]:
        """field -> int64 ``[table capacity, LOC_COLUMNS]`` records (the fields produced so far)."""
        return self.table.views

    def slots_of(self, keys: list[str]) -> np.ndarray:
        try:
            if len(keys) == 1:
                return np.array([self.index[keys[0]]], dtype=np.int64)
            return np.array(operator.itemgetter(*keys)(self.index), dtype=np.int64) if keys else np.empty(0, np.int64)
        except KeyError as exc:
            raise KeyNotFoundError(f"key {exc.args[0]!r} is not in partition {self.pid!r}") from None

    def add_keys(self, keys: list[str]) -> None:
        # Slots of discarded keys are reused first, so a long-lived partition that keeps discarding
        # (a replay buffer) does not grow without bound between clears.
        reuse = min(len(keys), len(self.free_slots))
        self.table.grow(len(self.slot_keys) + len(keys) - reuse)  # first: it may fail (a full tmpfs)
        if reuse:  # a slot must never name two keys within one incarnation (see tq.locations)
            self.table.new_incarnation()
            slots, reused = self.free_slots[-reuse:], keys[:reuse]
            del self.free_slots[-reuse:]
            self.index.update(zip(reused, slots))
            at = rows_at(slots)
            self.table.set_keys(at, reused)
            put_at(self.slot_keys, at, reused)
            put_at(self.seq_lens, at, [-1] * reuse)
            for values in self.tags.values():
                put_at(values, at, [None] * reuse)
        keys = keys[reuse:]
        start = len(self.slot_keys)
        self.table.set_keys(slice(start, start + len(keys)), keys)
        self.index.update(zip(keys, range(start, start + len(keys))))
        self.slot_keys.extend(keys)
        self.seq_lens.extend([-1] * len(keys))
        for values in self.tags.values():
            values.extend([None] * len(keys))

    def loc(self, name: str) -> np.ndarray:
        return self.table.loc(name)

    def live_slots(self) -> np.ndarray:
        return np.fromiter(self.index.values(), dtype=np.int64, count=len(self.index))

    def bytes_held(self) -> int:
        live = self.live_slots()
        return int(sum(np.clip(loc[live, NBYTES], 0, None).sum() for loc in self.locs.values()))


@dataclass
class Waiter:
    call: Call
    pid: str
    keys: list[str]
    fields: list[str]
    deadline: float
    # what to answer once every (key, field) is produced: a result and its buffers
    answer: Callable[[], tuple[Any, list[Any]]] = lambda: ({"ready": True}, [])
