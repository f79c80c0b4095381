"""Crash recovery of the controller: every state change is journaled (:mod:`tq.journal`) before its
caller hears it is done, and a controller restarted on the same journal directory replays it.

A request is journaled as it arrived - its op, its args as the raw msgpack bytes and its buffer frames -
and replayed through the same typed decoders and handlers as a live request, with sends to the units
suppressed (``_replaying``). Fences and low-water marks reported by units are journaled as
``__fence__`` / ``__water__`` records. Once the records since the last snapshot outweigh it, the
journal is rewritten as one ``__snapshot__``, so a replay stays about as long as the state is big.

:class:`JournalRecovery` is a part of :class:`~tq.controller.Controller` (a mixin) and works on its
state (partitions, units, ledgers, recent commits and destructive requests).
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import msgspec
import numpy as np

from .errors import JournalError, TQError
from .journal import Journal, JournalWriteError
from .leases import LeaseBook, holder_ref, pin_ref
from .messages import AdoptBlock, ControllerOp as Op
from .request_book import RequestBook
from .rpc import Call, ServerMustStop
from .schema import FieldSchema
from .supervision import UnitLedger

log = logging.getLogger("tq.controller")

JOURNALED_OPS = frozenset(
    {
        Op.CREATE_PARTITION,
        Op.CLEAR_PARTITION,
        Op.DROP_PARTITION,
        Op.MINT,
        Op.COMMIT,
        Op.DISCARD,
        Op.ABORT_REQUESTS,
        Op.SET_TAGS,
        Op.REGISTER_UNIT,
        Op.PIN_FILE,
    }
)
COMPACT_AFTER = 2000  # journal records before it is rewritten as one snapshot


class JournalRecovery:
    """Journaling and replay of the controller's state (see module docstring)."""

    def on_applied(self, op: str, raw_args: Any, buffers: list) -> None:
        if self.journal is None or op not in JOURNALED_OPS:
            return
        # the args as they arrived (msgpack bytes): replay decodes them into the op's struct again
        self._journal([op, bytes(raw_args), [bytes(b) for b in buffers]])
        # Compact once the records since the last snapshot outweigh it: a restart replays at most about
        # twice the state's size (a long run of commits and discards no longer grows the replay), and
        # the snapshots' cost stays proportional to what was appended.
        if self.journal.appended > COMPACT_AFTER and self.journal.size > 2 * self._snapshot_bytes:
            try:
                self.journal.rewrite([["__snapshot__", self._snapshot(), []]])  # [op, args, buffers], as replayed
            except OSError as exc:  # the journal is intact (a rewrite replaces it whole or not at all)
                log.warning("controller journal %s: compaction failed (%s); trying again once it doubles", self.journal.path, exc)
            self._snapshot_bytes = self.journal.size

    def _journal(self, record: list) -> None:
        """Journal ``record`` (a change already applied in memory), or stop the controller: serving on
        with a change its journal lacks would let later journaled changes build on it (a restart then
        cannot replay them) and let its frees reach the units (a restart then points keys at freed
        bytes). Stopped, it is as if it had crashed just before the change: restarted on the same
        journal dir it recovers everything journaled, and its units, which outlive it, rejoin."""
        if self.journal is None:
            return
        try:
            self.journal.append(record)
        except JournalWriteError as exc:
            log.critical("controller: %s: stopping", exc)
            raise ServerMustStop(
                JournalError(
                    f"the controller could not journal '{record[0]}' to {self.journal.path} ({exc.strerror}), so it did "
                    "not make the change and stopped; restart it on the same journal dir once it can be written (it "
                    "recovers every change journaled before)"
                )
            ) from exc

    def _replay(self, path: str) -> None:
        self._replaying = True  # rebuild state only: nothing is sent to the units
        try:
            n = 0
            for op, args, bufs in Journal.replay(path):
                if op == "__snapshot__":
                    self._restore(args)
                elif op == "__fence__":
                    self.ledgers[args["unit"]].fenced.update(args["blocks"])
                elif op == "__water__":
                    self._raise_water(args["unit"], args["low_water"])
                elif op == "__lease__":  # a fresh term from now: its holder renews it if it still lives
                    self.lease_book.take(
                        args["id"],
                        args["ttl"],
                        [(u, b) for u, b in args["blocks"]],
                        pin=pin_ref(args.get("pin")),
                        holder=holder_ref(args.get("holder")),
                    )
                elif op == "__release__":
                    self._release_leases(args["ids"])
                else:  # args: msgpack bytes, or a map (journals written before args were kept raw)
                    try:
                        self.handle(op, args, [memoryview(b) for b in bufs], Call(b"", None, op, 0.0))
                    except TQError as exc:  # only applied changes are journaled: this one was applied by an older version
                        raise JournalError(
                            f"controller journal {path}: record {n + 1} ('{op}') cannot be replayed ({exc}); it was applied "
                            "by a version that allowed it: restart on this journal with that version"
                        ) from None
                n += 1
        finally:
            self._replaying = False
        if n:
            log.warning("controller recovered %d partitions and %d storage units from %s", len(self.partitions), len(self.units), path)

    def _snapshot(self) -> dict[str, Any]:
        return {
            "units": self.units,
            "units_version": self.units_version,
            "ledgers": {
                str(u): [
                    led.low_water,
                    [[b, d] for b, d in led.pending.items()],
                    sorted(led.fenced),
                    msgspec.to_builtins(list(led.adopts.values()), builtin_types=(bytes,)),
                ]
                for u, led in self.ledgers.items()
            },
            "recent_commits": [[u, b, d] for (u, b), d in self.recent_commits.items()],
            "requests": self.request_book.snapshot(),
            "leases": self.lease_book.snapshot(),
            "pin_files": sorted(self.pin_board.files) if self.pin_board is not None else [],
            "partitions": {
                pid: {
                    "slot_keys": p.slot_keys,
                    "seq_lens": p.seq_lens,
                    "tags": p.tags,
                    "schemas": {f: s.to_wire() for f, s in p.schemas.items()},
                    "locs": {f: [list(loc.shape), loc.tobytes()] for f, loc in p.locs.items()},
                }
                for pid, p in self.partitions.items()
            },
        }

    def _restore(self, snap: dict[str, Any]) -> None:
        self.units = list(snap["units"])
        self.units_version = int(snap["units_version"])
        self.ledgers.clear()
        for u, (low_water, pending, fenced, *adopts) in snap.get("ledgers", {}).items():
            led = self.ledgers[int(u)] = UnitLedger(low_water, {b: d for b, d in pending}, set(fenced))
            for ad in msgspec.convert(adopts[0] if adopts else [], list[AdoptBlock]):
                led.adopts[ad.block] = ad
        self.recent_commits = collections.OrderedDict(((u, b), d) for u, b, d in snap.get("recent_commits", []))
        self.request_book = RequestBook.restore(snap.get("requests"))
        self.lease_book = LeaseBook.restore(snap.get("leases"))
        for path in snap.get("pin_files", []):
            self._register_pins(path)
        for u in self.units:
            self._connect_unit(u["unit_id"], u["address"])
        for part in self.partitions.values():
            part.table.close()
        self.partitions = {}
        for pid, d in snap["partitions"].items():
            p = self._new_partition(pid)
            p.slot_keys = list(d["slot_keys"])
            p.index = {k: i for i, k in enumerate(p.slot_keys) if k is not None}
            p.free_slots = [i for i, k in enumerate(p.slot_keys) if k is None]
            p.seq_lens = list(d["seq_lens"])
            p.tags = {k: list(v) for k, v in d["tags"].items()}
            p.schemas = {f: FieldSchema.from_wire(w) for f, w in d["schemas"].items()}
            p.table.grow(max([len(p.slot_keys), *(shape[0] for shape, _ in d["locs"].values())]))
            live = list(p.index.values())
            p.table.set_keys(live, list(p.index))  # fingerprints for the snapshot's keys
            for f, (shape, b) in d["locs"].items():
                p.table.restore_rows(f, np.frombuffer(b, dtype=np.int64).reshape(shape))
            self.partitions[pid] = p
