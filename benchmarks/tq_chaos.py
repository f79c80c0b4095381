"""A chaos benchmark of the TQ service: faults injected under load, nothing acknowledged lost.

``--clients`` client processes (spawned, default 8; half over shared memory, half over TCP) put, get,
write back and discard checksummed data against one service on loopback, started the way an operator
starts a crash-recoverable one (``python -m tq.controller --port <fixed> --storage-units 2 --journal-dir
<dir>``), while a fault driver in this process injects, at random and one at a time:

- ``unit_kill``: SIGKILL a storage unit (its controller restarts it on its arena);
- ``unit_stop``: SIGSTOP a storage unit for 0.5-5 s, then SIGCONT;
- ``controller_kill``: SIGKILL the controller and start it again the same way, on the same port and
  state dir (the documented recovery: its storage units outlive it and are taken back);
- ``controller_stop``: SIGSTOP the controller for 0.5-5 s, then SIGCONT.

Only processes this run started are signalled (found by the run's private shared-memory dir on their
command lines). After each fault a canary client (TCP, short timeout) puts and gets one key on every
storage unit; recovery time is from the end of the fault (kill of a unit, restart command of the
controller, SIGCONT) until that succeeds.

Some puts (``BIG_P``; at most one such batch live per client) are big batches: ``BIG_KEYS`` keys of
``BIG_TOKENS`` tokens each, more than one fetch request's bytes (16 MiB) - so a TCP client's get of all
of one is cut into several pipelined requests, and, on a host with the cores (a client's half: at least
4), read in lanes over several connections that the unit writes on several threads. The report counts
such gets (``big_tcp_gets``) and the lanes this host's clients cut them into; and a TCP client's put of
one that is as big goes in lanes too, a block per lane made visible by one commit (``big_tcp_puts``).

Client semantics: an op that raises is failed and unacknowledged, never a loss, but whatever it may
have done must stay consistent: the keys of a put that raised must later be absent or read exactly its
bytes, a write-back that raised leaves each row's old bytes (or none) or its new ones (the same for all
its keys), a discard that raised leaves its keys gone or intact, and so does a clear of the client's
partition (now and then, with nothing else unsettled) for all of them. A quarter of the puts go the
rollout way instead - ``register_keys`` (a mint), then a ``write_back`` of every field into the keys -
and a mint that raised leaves its keys all there (empty) or all absent. Clients also tag batches
(``set_tags``): every key of a batch carries its last tag, and a set_tags that raised leaves the old
one on all of them or the new one. Each client checks this by listing its
partition and reading such keys back, and checks every row it reads against the sha256 of what it wrote.
Counted: **acknowledged writes lost** ((key, field) rows of a put or write-back that returned, not
discarded since, later missing or reading other bytes), **wrong-bytes reads** (rows read with bytes that
match nothing the client wrote there, and any outcome of a failed op other than those above), the
longest single client call against the client timeout (hangs), recovery times per fault kind, service
RSS (controller + units) after warm-up and at the end. At the end, with the service healthy, each client
verifies every live key bit-exact and discards everything; then the units must drain to nothing (no
block, slab, allocation or leased row) within the longest lease the service grants (60 s) plus a
margin; what they held at the discard and how long they took is reported.

    python -m benchmarks.tq_chaos                        # 8 clients, 600 s, >= 50 faults of every kind
    python -m benchmarks.tq_chaos --duration 60 --clients 4 --faults-min 3 --json /tmp/chaos.json

Results go to a fresh run dir (``logs/tq_chaos/<timestamp>/``: report.json, report.md, each controller
incarnation's log, the controller's state dir); ``--publish`` also writes
``benchmarks/results/tq_chaos_<machine>.{json,md}`` (``cpu2`` on the 2-vCPU VM). Exits non-zero when any target fails.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import json
import multiprocessing as mp
import os
import platform
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from benchmarks.outputs import code_version, machine_tag
from benchmarks.tq_soak import JAGGED, WRITE_BACK, RowMaker, _pct, compare_rows, digest, rows_of, start_processes
from tq.client import DEFAULT_LEASE_S, _fetch_lanes_of, _lanes_of
from tq.protocol import TCP_FETCH_BYTES
from tq.schema import DTYPES
from tq.storage import DEFAULT_ALLOC_LEASE_S, DEFAULT_COMMIT_LEASE_S

MiB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("unit_kill", "unit_stop", "controller_kill", "controller_stop")
OPS = ("put", "get", "write_back", "discard", "clear", "tag", "audit")
WEIGHTS = np.array([30, 36, 14, 12, 1, 4, 8], dtype=np.float64)
PUT_FIELDS = ("lp", "emb", "msgs")  # a put writes "ids" and some of these (the soak's schemas)
MAX_LIVE_KEYS = 128  # per client
MAX_BATCH = 8
BORROW_P = 1 / 3  # gets that borrow (copy=False): views held over the next 1-7 ops, then checked again
MAX_BORROWED = 4  # per client
BIG_P = 0.05  # of puts: a big batch (see the module docstring)
UNKNOWN_TAG = -1  # a batch's tag once found wrong (set_tags values are >= 0): not checked until tagged again
MINT_P = 0.25  # of the other puts: register_keys, then a write_back of every field (see the module docstring)
BIG_KEYS = 4
BIG_TOKENS = (550_000, 650_000)  # per key: its int64 "ids" alone are over 16 MiB for the batch
TOKEN_BYTES = {f: DTYPES[d][0] for f, d in {**JAGGED, "plp": "float32"}.items()}  # the jagged fields' (plp: a write-back)
# tq.controller restarts a crashed unit at most 3 times within 60 s, then gives up on it and removes its
# arena (crash-loop protection): the driver never kills one unit more often than that (with a margin).
UNIT_KILLS_PER_WINDOW, UNIT_KILL_WINDOW_S = 3, 63.0
HANG_MARGIN_S = (
    0.5  # a call may overrun its timeout by this much: scheduling on a loaded 2-core VM (the timeout bounds all of a call's requests)
)
UNIT_RESTART_P99_S = 2.0
CONTROLLER_RESTART_P99_S = 3.0
RSS_GROWTH_LIMIT = 0.10
CANARY = "chaos-canary"
# After the final discard the units may legitimately hold, each until its lease runs out: a block whose
# commit was lost in a fault (tentative until its 30 s commit lease ends, then fenced and freed), a
# slab with an id whose commit was lost, or an allocation never stored (60 s allocation lease), and
# rows under a borrowed get's lease (30 s). Each lease was granted before the discard, so it ends
# within the longest of them; the margin covers the controller's 1 s heartbeat that reports an
# expired lease and the free it sends.
DRAIN_BOUND_S = max(DEFAULT_COMMIT_LEASE_S, DEFAULT_ALLOC_LEASE_S, DEFAULT_LEASE_S) + 10.0
DRAIN_POLL_S = 0.5


# ----------------------------------------------------------------------------- one client process
@dataclass
class Held:
    """Keys of one put that this client tracks, and what each (key, field) row must read back as."""

    keys: list[str]
    lengths: list[int]
    sums: dict[str, list[str]]  # settled fields: one sha256 per key
    acked: set[str]  # fields whose rows a put or write-back that returned wrote
    meta: Any = None  # the put's meta (with slots: same-host gets skip the controller)
    # a write-back that raised: field -> (digests before or None, digests it wrote, old rows acknowledged)
    unsure: dict[str, tuple[list[str] | None, list[str], bool]] = field(default_factory=dict)
    broken: set[str] = field(default_factory=set)  # fields found in a state no write explains: not read again
    big: bool = False  # a big batch (BIG_KEYS keys of BIG_TOKENS tokens)
    tag: int | None = None  # the "step" tag its keys carry (set_tags), None if never tagged
    tag_unsure: int | None = None  # a set_tags that raised: the tag it set (``tag`` stays the one before)

    def select(self, idx: list[int]) -> "Held":
        return Held(
            [self.keys[i] for i in idx],
            [self.lengths[i] for i in idx],
            {f: [s[i] for i in idx] for f, s in self.sums.items()},
            set(self.acked),
            None if self.meta is None else self.meta.select(idx),
            {f: (None if o is None else [o[i] for i in idx], [n[i] for i in idx], a) for f, (o, n, a) in self.unsure.items()},
            set(self.broken),
            self.big,
            self.tag,
            self.tag_unsure,
        )


class ChaosClient(RowMaker):
    """One client process's workload and bookkeeping (see the module docstring)."""

    def __init__(self, idx: int, address: str, seed: int, transport: str, timeout: float, inflight: Any) -> None:
        from tq import TQClient

        super().__init__(np.random.default_rng([seed, idx]))
        self.torch.set_num_threads(1)
        self.idx, self.inflight = idx, inflight
        self.client = TQClient(address, timeout=timeout, transport=transport)
        self.pid = f"chaos-w{idx}"
        self.client.register_partition(self.pid)
        self.live: list[Held] = []
        self.maybe: list[Held] = []  # puts that raised, not yet found landed or absent
        self.dropping: list[Held] = []  # discards that raised, not yet found applied or not
        self.clearing: list[list[Held]] = []  # clears that raised (each: the batches live then), likewise
        self.absent: dict[str, Held] = {}  # keys of puts that raised and were found absent
        self.discarded: set[str] = set()  # keys of discards that returned (or were found applied)
        self.gone: set[str] = set()  # keys no longer tracked after a wrong outcome or a loss
        self.phantoms: set[str] = set()  # found absent, later present
        self.resurrected: set[str] = set()  # discarded, later present
        self.unknown: set[str] = set()  # present, never written by this client
        self.suspect = False  # a read said an acknowledged key or field is missing: audit every field
        # what this client did with each key and what came of it (time since start): a loss names the op
        self.history: dict[str, list[str]] = collections.defaultdict(list)
        self.t0 = time.monotonic()
        self.counter = 0
        self.calls: collections.Counter = collections.Counter()
        self.call_ok: collections.Counter = collections.Counter()
        self.errors: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.error_samples: dict[str, dict[str, str]] = {}  # call -> error type -> its first message
        self.lat: dict[str, list[float]] = collections.defaultdict(list)
        self.op_failed: collections.Counter = collections.Counter()
        self.wrong = 0
        self.lost: set[tuple[str, str]] = set()
        self.verified = 0
        self.outcomes: collections.Counter = collections.Counter()  # how failed ops turned out
        self.non_tq_errors = 0  # client calls that raised something other than a TQError
        self.internal_errors = 0  # bugs of this benchmark
        self.final: dict[str, Any] = {}
        self.notes: list[str] = []
        self.last_error = ""
        self.slow: list[dict[str, Any]] = []  # calls longer than the client timeout
        self.slow_s = timeout
        self.go_at = time.monotonic()  # when the load started (set by client_main)
        # borrowed gets (copy=False) still held: (views, what they should hold, the op count to let go at)
        self.borrowed: list[tuple[Any, dict[str, list[str]], list[int], str, int]] = []
        self.views_checked = 0  # rows of borrowed views checked again after being held
        self.ops_done = 0
        self.big_gets: collections.Counter = collections.Counter()  # gets of over one fetch request's bytes, by lanes
        self.big_puts: collections.Counter = collections.Counter()  # acknowledged puts as big, by lanes

    # -- bookkeeping
    def note(self, text: str) -> None:
        if len(self.notes) < 40:
            self.notes.append(f"w{self.idx}: {text}"[:600])

    def _call(self, kind: str, fn: Callable[[], Any]) -> Any:
        """One client call, timed (and visible to the driver while in flight); errors counted by type."""
        from tq.errors import TQError

        self.calls[kind] += 1
        self.inflight[self.idx] = m0 = time.monotonic()
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as exc:
            self.errors[kind][type(exc).__name__] += 1
            self.error_samples.setdefault(kind, {}).setdefault(type(exc).__name__, str(exc)[:300])
            if not isinstance(exc, TQError):
                self.non_tq_errors += 1
                self.note(f"{kind} raised a non-TQ error {type(exc).__name__}: {exc}")
            exc.tq_chaos_call = kind  # type: ignore[attr-defined] - tells step() it came from the client
            raise
        finally:
            took = time.perf_counter() - t0
            self.lat[kind].append(took)
            self.inflight[self.idx] = 0.0
            if took > self.slow_s:  # longer than the client timeout: what and when (to match with faults)
                exc = sys.exc_info()[1]
                self.slow.append(
                    {
                        "call": kind,
                        "s": round(took, 3),
                        "t_s": round(m0 - self.go_at, 2),
                        "error": None if exc is None else f"{type(exc).__name__}: {exc}"[:200],
                    }
                )
        self.call_ok[kind] += 1
        return out

    def _meta(self, h: Held, idx: list[int] | None = None, fields: tuple[str, ...] = (), table: bool = True):
        """Half the time the put's own meta (slots: the location-table path), else one built from keys."""
        from tq import KVBatchMeta

        if table and h.meta is not None and self.rng.random() < 0.5:
            return (h.meta if idx is None else h.meta.select(idx)).with_fields(fields)
        return KVBatchMeta(self.pid, tuple(h.keys if idx is None else [h.keys[i] for i in idx]), fields)

    def _check(self, h: Held, idx: list[int], got: dict[str, Any], layout: str, what: str) -> None:
        """Compare a read of rows ``idx`` of ``h`` with the digests: each wrong row counts (and is lost
        when acknowledged)."""
        want = {f: [h.sums[f][i] for i in idx] for f in got}
        matched, problems = compare_rows(got, layout, want, [h.lengths[i] for i in idx])
        self.verified += matched
        for name, j, problem in problems:
            for r in range(len(idx)) if j is None else [j]:
                self.wrong += 1
                if name in h.acked:
                    self.lost.add((h.keys[idx[r]], name))
            self.note(f"WRONG BYTES ({what}): {name!r} of {h.keys[idx[j or 0]]!r}: {problem}")

    def _vanished(self, h: Held, idx: list[int], fields: list[str], why: str) -> None:
        """Rows that should be there and are not: lost if acknowledged, else a wrong outcome."""
        for i in idx:
            for f in fields:
                if f in h.acked:
                    self.lost.add((h.keys[i], f))
                else:
                    self.wrong += 1
        first = h.keys[idx[0]]
        self.note(
            f"MISSING: {len(idx)} key(s) of a batch ({', '.join(fields)}), first {first!r}: {why}; "
            f"its history: {'; '.join(self.history.get(first, [])) or 'none'}"
        )

    def _did(self, keys: Any, what: str) -> None:
        """Record ``what`` happened to ``keys`` now (see ``history``)."""
        line = f"{time.monotonic() - self.t0:.2f}s {what}"
        for k in keys:
            self.history[k].append(line)

    def _live_keys(self) -> int:
        return sum(len(h.keys) for h in self.live)

    # -- ops
    def op_put(self) -> None:
        big = self.rng.random() < BIG_P and not any(h.big for h in self.live + self.maybe)
        n = BIG_KEYS if big else int(self.rng.integers(1, MAX_BATCH + 1))
        lengths = self.rng.integers(*BIG_TOKENS, n).tolist() if big else self._lengths(n)
        names = ["ids", *(f for f in PUT_FIELDS if self.rng.random() < 0.5)]
        cols = {name: self._column(name, n, lengths) for name in names}
        keys = [f"c{self.idx}-{self.counter}-{j}" for j in range(n)]
        self.counter += 1
        h = Held(keys, lengths, {name: [digest(r) for r in rows_of(col)] for name, col in cols.items()}, set(), big=big)
        if not big and self.rng.random() < MINT_P:
            self._mint_and_fill(h, cols)
            return
        try:
            h.meta = self._call("put", lambda: self.client.put(self.pid, keys, cols))
        except Exception as exc:
            self._did(keys, f"put raised {type(exc).__name__}")
            self.maybe.append(h)
            raise
        self._did(keys, f"put of {len(keys)} acknowledged")
        h.acked = set(h.sums)
        self.live.append(h)
        if big and self.client.transport == "tcp":
            self._count_big(
                self.big_puts, [sum(h.lengths[i] * TOKEN_BYTES[f] for f in names if f in TOKEN_BYTES) for i in range(n)], _lanes_of
            )

    def _mint_and_fill(self, h: Held, cols: dict[str, Any]) -> None:
        """A put the rollout way: the keys registered empty (a mint), then every field written back. A
        mint that raised is settled like a put that raised (its keys all there, empty, or all absent);
        a fill that raised like a write-back that raised, field by field (none, or the new rows)."""
        try:
            meta = self._call("mint", lambda: self.client.register_keys(self.pid, h.keys))
        except Exception as exc:
            self._did(h.keys, f"mint raised {type(exc).__name__}")
            self.maybe.append(Held(h.keys, h.lengths, {}, set()))
            raise
        self._did(h.keys, f"mint of {len(h.keys)} acknowledged")
        empty = Held(h.keys, h.lengths, {}, set(), meta)
        self.live.append(empty)  # tracked from here: no field yet
        try:
            self._call("write_back", lambda: self.client.write_back(meta, cols))
        except Exception:
            empty.unsure = {name: (None, sums, False) for name, sums in h.sums.items()}
            raise
        self._did(h.keys, f"fill of {len(h.keys)} acknowledged")
        empty.sums, empty.acked = h.sums, set(h.sums)

    def op_get(self) -> None:
        from tq.errors import FieldNotProducedError, KeyNotFoundError, TQError

        h = self.live[int(self.rng.integers(len(self.live)))]
        names = [f for f in h.sums if f not in h.broken]
        if not names:
            return
        n = len(h.keys)
        idx = self.rng.permutation(n)[: int(self.rng.integers(1, n + 1))].tolist()
        if h.big and self.rng.random() < 0.5:
            idx = list(range(n))  # all of it: past one fetch request's bytes
        fields = [f for f in names if self.rng.random() < 0.5] or [names[0]]
        layout = str(self.rng.choice(["padded", "jagged", "list"]))
        pad_to = None if self.rng.random() < 0.5 else max(h.lengths[i] for i in idx) + int(self.rng.integers(0, 5))
        meta = self._meta(h, idx)
        borrow = len(self.borrowed) < MAX_BORROWED and self.rng.random() < BORROW_P
        try:
            got = self._call("get", lambda: self.client.get(meta, fields, layout=layout, pad_to=pad_to, copy=not borrow))
        except (KeyNotFoundError, FieldNotProducedError):
            self.suspect = True  # the controller says rows it acknowledged are not there: the audit finds which
            raise
        except TQError:
            raise
        except Exception as exc:  # bytes that do not even decode (an object column that is not msgpack)
            self.wrong += 1
            self.note(f"WRONG BYTES (get): reading {fields} of {len(idx)} key(s) raised {type(exc).__name__}: {exc}")
            raise
        self._check(h, idx, got, layout, "get")
        if h.big and self.client.transport == "tcp":
            self._count_big(
                self.big_gets, [h.lengths[i] * TOKEN_BYTES[f] for f in fields if f in TOKEN_BYTES for i in idx], _fetch_lanes_of
            )
        if borrow and got.viewed:  # hold the views over a few more ops (discards, faults): they must not change
            want = {f: [h.sums[f][i] for i in idx] for f in got.viewed}
            self.borrowed.append((got, want, [h.lengths[i] for i in idx], layout, self.ops_done + int(self.rng.integers(1, 8))))
        elif borrow:
            got.release()

    @staticmethod
    def _count_big(counter: collections.Counter, rows: list[int], lanes_of: Callable[[np.ndarray], list]) -> None:
        """Count a TCP transfer of a big batch over more than one fetch request's bytes, by the lanes this
        client cuts it into (``lanes_of``): ``rows``, the token bytes of each row as it is cut (a put's
        key, a get's (field, key)), as one unit's (a put lands on one unit unless none has room for it;
        the batch's few other bytes do not change the cut)."""
        nbytes = np.asarray(rows, np.int64)
        if int(nbytes.sum()) > TCP_FETCH_BYTES:
            counter[len(lanes_of(nbytes))] += 1

    def _recheck_borrowed(self, everything: bool = False) -> None:
        """Views held long enough (or all of them) are checked against what they showed, then let go."""
        keep = []
        for got, want, lengths, layout, until in self.borrowed:
            if not everything and self.ops_done < until:
                keep.append((got, want, lengths, layout, until))
                continue
            matched, problems = compare_rows({f: got[f] for f in want}, layout, want, lengths)
            self.views_checked += matched
            for name, _, problem in problems:
                self.wrong += 1
                self.note(f"WRONG BYTES (a borrowed view, held): {name!r}: {problem}")
            got.release()
        self.borrowed = keep

    def op_write_back(self) -> None:
        ready = [h for h in self.live if not h.unsure]
        if not ready:
            return
        h = ready[int(self.rng.integers(len(ready)))]
        name = str(self.rng.choice([f for f in WRITE_BACK if f not in h.broken] or ["adv"]))
        if name in h.broken:
            return
        overwrite = name in h.sums
        col = self._column(name, len(h.keys), h.lengths)
        new = [digest(r) for r in rows_of(col)]
        meta = self._meta(h)
        try:
            self._call("write_back", lambda: self.client.write_back(meta, {name: col}, overwrite=overwrite))
        except Exception:
            h.unsure[name] = (h.sums.pop(name, None), new, name in h.acked)
            h.acked.discard(name)
            raise
        h.sums[name] = new
        h.acked.add(name)

    def op_tag(self) -> None:
        """Tag a batch's keys with a new "step" value (set_tags); the audit checks every batch's tags."""
        from tq import KVBatchMeta

        ready = [h for h in self.live if h.tag_unsure is None]
        if not ready:
            return
        h = ready[int(self.rng.integers(len(ready)))]
        value = self.counter
        self.counter += 1
        meta = KVBatchMeta(self.pid, tuple(h.keys), tags={"step": (value,) * len(h.keys)})
        try:
            self._call("set_tags", lambda: self.client.set_tags(meta))
        except Exception:
            h.tag_unsure = value
            raise
        h.tag = value

    def _check_tags(self, tags: dict[str, Any]) -> None:
        """Every live batch's keys carry its tag; a set_tags that raised left the old tag on all of them
        or the new one (the listing that gave ``tags`` settled it first). A batch found otherwise is
        counted once and checked again only after its next set_tags returns."""
        for h in self.live:
            got = {tags.get(k) for k in h.keys}
            new, h.tag_unsure = h.tag_unsure, None
            if new is not None and got == {new}:
                self.outcomes["set_tags_applied"] += 1
                h.tag = new
            elif h.tag == UNKNOWN_TAG or got == {h.tag}:
                if new is not None and h.tag != UNKNOWN_TAG:
                    self.outcomes["set_tags_not_applied"] += 1
            else:
                self.wrong += len(h.keys)
                self.outcomes["set_tags_wrong"] += 1
                self.note(f"WRONG TAGS: batch of {h.keys[0]!r} carries {sorted(got, key=str)}, want {h.tag}")
                h.tag = UNKNOWN_TAG

    def op_discard(self) -> None:
        ready = [i for i, h in enumerate(self.live) if not h.unsure]
        if not ready:
            return
        at = ready[int(self.rng.integers(len(ready)))]
        h = self.live[at]
        n = len(h.keys)
        gone = sorted(self.rng.permutation(n)[: int(self.rng.integers(1, n + 1))].tolist())
        keep = [i for i in range(n) if i not in set(gone)]
        meta = self._meta(h, gone)
        if keep:
            self.live[at] = h.select(keep)
        else:
            del self.live[at]
        try:
            got = self._call("discard", lambda: self.client.discard(meta))
        except Exception as exc:
            self._did(meta.keys, f"discard of {len(gone)} (of {n}) raised {type(exc).__name__}")
            self.dropping.append(h.select(gone))
            raise
        self._did(meta.keys, f"discard of {len(gone)} (of {n}) returned")
        self.discarded.update(h.keys[i] for i in gone)
        if got != len(gone):
            self.outcomes["discard_count_wrong"] += 1
            self.note(f"discard of {len(gone)} keys reported {got}")

    def op_clear(self) -> None:
        """Clear this client's partition (with nothing pending: every key in it is a live one), all of
        its batches going at once."""
        if self.pending() or not self.live:
            self.op_discard()
            return
        batches, self.live = self.live, []
        keys = [k for h in batches for k in h.keys]
        try:
            got = self._call("clear", lambda: self.client.clear_partition(self.pid))
        except Exception as exc:
            self._did(keys, f"clear of {len(keys)} raised {type(exc).__name__}")
            self.clearing.append(batches)
            raise
        self._did(keys, f"clear of {len(keys)} returned")
        self.discarded.update(keys)
        if got != len(keys):
            self.outcomes["clear_count_wrong"] += 1
            self.note(f"clear of {len(keys)} keys reported {got}")

    def _read_all(self, h: Held, what: str) -> None:
        """Read every settled field of every key of ``h`` (keys-built meta: asks the controller) and
        check it. A read that fails with something other than a TQError (e.g. an object column whose
        bytes are not msgpack) is redone row by row, so each wrong row is counted."""
        from tq.errors import TQError

        fields = [f for f in h.sums if f not in h.broken]
        if not fields:
            return
        meta = self._meta(h, table=False)
        try:
            got = self._call("get", lambda: self.client.get(meta, fields, layout="list"))
        except TQError:
            raise
        except Exception:
            self._by_row(h, what, final=False)
            return
        self._check(h, list(range(len(h.keys))), got, "list", what)

    def _by_row(self, h: Held, what: str, *, final: bool) -> None:
        """Read ``h`` one (key, field) row at a time and count each row: matched, wrong (a read that
        returns other bytes or fails with a non-TQ error), or missing (not there, or - when ``final`` -
        unreadable with a TQError). Without ``final`` a TQError is raised (it may pass)."""
        from tq import KVBatchMeta
        from tq.errors import FieldNotProducedError, KeyNotFoundError, TQError

        for i, k in enumerate(h.keys):
            for f in [f for f in h.sums if f not in h.broken]:
                meta = KVBatchMeta(self.pid, (k,))
                try:
                    got = self._call("get", lambda: self.client.get(meta, [f], layout="list"))  # noqa: B023
                except (KeyNotFoundError, FieldNotProducedError) as exc:
                    self._vanished(h, [i], [f], f"{what}: {type(exc).__name__}")
                    continue
                except TQError as exc:
                    if not final:
                        raise
                    self._vanished(h, [i], [f], f"{what}: still unreadable at the end: {type(exc).__name__}: {exc}")
                    continue
                except Exception as exc:
                    self.wrong += 1
                    if f in h.acked:
                        self.lost.add((k, f))
                    self.note(f"WRONG BYTES ({what}): reading {f!r} of {k!r} raised {type(exc).__name__}: {exc}")
                    continue
                self._check(h, [i], got, "list", what)
        for f in h.sums:
            h.broken.add(f)  # counted once: not read again

    def op_audit(self) -> None:
        """List the partition and settle every failed op's outcome (see the module docstring). Each
        pending item is settled on its own; the first error is raised after trying them all."""
        listed = self._call("get_meta", lambda: self.client.get_meta(self.pid))
        listing = set(listed.keys)
        tags = dict(zip(listed.keys, listed.tags.get("step", (None,) * len(listed.keys))))
        # acknowledged keys must all be there
        for at in range(len(self.live) - 1, -1, -1):
            h = self.live[at]
            missing = [i for i, k in enumerate(h.keys) if k not in listing]
            if missing:
                self._vanished(h, missing, list(h.sums), "not in the partition's listing")
                self.gone.update(h.keys[i] for i in missing)
                keep = [i for i in range(len(h.keys)) if h.keys[i] in listing]
                if keep:
                    self.live[at] = h.select(keep)
                else:
                    del self.live[at]
        errors: list[BaseException] = []

        def each(items: list[Any], settle: Callable[..., None]) -> None:
            for item in items:
                try:
                    settle(*item)
                except Exception as exc:
                    if not hasattr(exc, "tq_chaos_call"):
                        raise  # a bug of this benchmark
                    errors.append(exc)

        each([("put", h, listing) for h in list(self.maybe)], self._settle_keys)
        each([("discard", h, listing) for h in list(self.dropping)], self._settle_keys)
        each([(batches, listing) for batches in list(self.clearing)], self._settle_clear)
        each([(h, name) for h in self.live for name in list(h.unsure)], self._settle_write_back)
        self._check_tags(tags)
        if self.suspect:  # a read said rows are missing: check every field of every batch
            each([(h,) for h in list(self.live)], self._check_fields)
            self.suspect = bool(errors)
        self._strangers(listing)
        if errors:
            raise errors[0]

    def _settle_keys(self, op: str, h: Held, listing: set[str]) -> None:
        """A put or a discard that raised: its keys all absent, or all there reading exactly the put's
        bytes (a put that landed is tracked from then on, its rows not acknowledged; a discard that did
        not apply leaves its keys live)."""
        pending, none, done = (self.maybe, "absent", "landed") if op == "put" else (self.dropping, "applied", "not_applied")
        present = [i for i, k in enumerate(h.keys) if k in listing]
        self._did(h.keys, f"{op} settled: {len(present)} of {len(h.keys)} keys listed")
        if not present:
            pending.remove(h)
            self.outcomes[f"{op}_{none}"] += 1
            if op == "put":
                self.absent.update((k, h) for k in h.keys)
            else:
                self.discarded.update(h.keys)
        elif len(present) < len(h.keys):
            pending.remove(h)
            self.outcomes[f"{op}_partial"] += 1
            self.wrong += len(present) * len(h.sums)
            self.gone.update(h.keys)
            self.note(f"WRONG OUTCOME: a {op} that raised left {len(present)} of its {len(h.keys)} keys in the partition")
        else:
            before = self.wrong
            self._read_all(h, f"a {op} that raised")
            pending.remove(h)
            if self.wrong > before or h.broken:
                self.outcomes[f"{op}_wrong"] += 1
                self.gone.update(h.keys)
            else:
                self.outcomes[f"{op}_{done}"] += 1
                self.live.append(h)

    def _settle_clear(self, batches: list[Held], listing: set[str]) -> None:
        """A clear that raised: every key of every batch it found gone, or all there reading their bytes
        (then tracked live again)."""
        keys = [k for h in batches for k in h.keys]
        present = [k for k in keys if k in listing]
        self._did(keys, f"clear settled: {len(present)} of {len(keys)} keys listed")
        if not present:
            self.clearing.remove(batches)
            self.outcomes["clear_applied"] += 1
            self.discarded.update(keys)
            return
        if len(present) < len(keys):
            self.clearing.remove(batches)
            self.outcomes["clear_partial"] += 1
            self.wrong += sum(len(h.sums) for h in batches for k in h.keys if k in listing)
            self.gone.update(keys)
            self.note(f"WRONG OUTCOME: a clear that raised left {len(present)} of its {len(keys)} keys in the partition")
            return
        before = self.wrong
        for h in batches:
            self._read_all(h, "a clear that raised")
        self.clearing.remove(batches)
        if self.wrong > before or any(h.broken for h in batches):
            self.outcomes["clear_wrong"] += 1
            self.gone.update(keys)
        else:
            self.outcomes["clear_not_applied"] += 1
            self.live.extend(batches)

    def _settle_write_back(self, h: Held, name: str) -> None:
        """A write-back that raised: every row its old bytes (or none, if it had none) or its new ones."""
        from tq import KVBatchMeta
        from tq.errors import FieldNotProducedError, TQError

        old, new, was_acked = h.unsure[name]
        meta = KVBatchMeta(self.pid, tuple(h.keys))
        try:
            got = self._call("get", lambda: self.client.get(meta, [name], layout="list"))
            rows = [digest(r) for r in rows_of(got[name])]
        except FieldNotProducedError:
            have = [i for i, k in enumerate(h.keys) if name in self._call("get_meta", lambda: self.client.get_meta(self.pid, [k])).fields]  # noqa: B023
            del h.unsure[name]
            if old is None and not have:
                self.outcomes["write_back_not_applied"] += 1
                return
            h.broken.add(name)
            self.outcomes["write_back_wrong"] += 1
            bad = [i for i in range(len(h.keys)) if i not in have] if old is not None else have
            self.wrong += len(bad)
            if old is not None and was_acked:
                self.lost.update((h.keys[i], name) for i in bad)
            self.note(
                f"WRONG OUTCOME: a write-back of {name!r} that raised left the field on {len(have)} of "
                f"{len(h.keys)} keys (it {'had' if old is not None else 'had not'} been written before)"
            )
            return
        except TQError:
            raise
        except Exception as exc:  # bytes that do not even decode
            rows = [f"undecodable: {type(exc).__name__}"] * len(h.keys)
        del h.unsure[name]
        is_new = [r == w for r, w in zip(rows, new)]
        is_old = [old is not None and r == w for r, w in zip(rows, old or new)]
        if all(is_new) or all(is_old):
            h.sums[name] = new if all(is_new) else old  # type: ignore[assignment]
            if was_acked:
                h.acked.add(name)
            self.verified += len(rows)
            self.outcomes["write_back_applied" if all(is_new) else "write_back_not_applied"] += 1
            return
        h.broken.add(name)
        self.outcomes["write_back_wrong"] += 1
        neither = [i for i in range(len(rows)) if not (is_new[i] or is_old[i])]
        self.wrong += len(neither) or len(rows)  # rows that match nothing, or a half-applied write
        if was_acked:
            self.lost.update((h.keys[i], name) for i in neither)
        self.note(
            f"WRONG OUTCOME: a write-back of {name!r} that raised left {sum(is_new)} new, {sum(is_old)} old "
            f"and {len(neither)} unknown rows of {len(rows)}"
        )

    def _check_fields(self, h: Held) -> None:
        """Every settled field of ``h`` is still produced for every key."""
        if h not in self.live:
            return
        produced = set(self._call("get_meta", lambda: self.client.get_meta(self.pid, h.keys)).fields)
        for f in [f for f in h.sums if f not in produced and f not in h.broken]:
            h.broken.add(f)
            self._vanished(h, list(range(len(h.keys))), [f], "field no longer produced for every key")

    def _strangers(self, listing: set[str]) -> None:
        """Keys in the partition that should not be there."""
        clearing = [h for batches in self.clearing for h in batches]
        known = {k for hs in (self.live, self.maybe, self.dropping, clearing) for h in hs for k in h.keys} | self.gone
        for k in listing - known:
            if k in self.absent:  # found absent earlier, there now: settled again like any put that raised
                self.phantoms.add(k)
                h = self.absent[k]
                for key in h.keys:
                    self.absent.pop(key, None)
                self.maybe.append(h)
                self.note(f"PHANTOM: key {k!r} of a put that raised was absent, now present")
            elif k in self.discarded:
                if k not in self.resurrected:
                    self.note(f"RESURRECTED: discarded key {k!r} is back")
                self.resurrected.add(k)
            elif k not in self.unknown:
                self.unknown.add(k)
                self.note(f"UNKNOWN: key {k!r} was never written by this client")

    # -- loop
    def pending(self) -> bool:
        return bool(
            self.maybe or self.dropping or self.clearing or self.suspect or any(h.unsure or h.tag_unsure is not None for h in self.live)
        )

    def step(self, op: str) -> bool:
        """Run one op; False if it failed."""
        self.ops_done += 1
        self._recheck_borrowed()
        try:
            getattr(self, f"op_{op}")()
            return True
        except Exception as exc:
            self.op_failed[op] += 1
            self.last_error = f"{op}: {type(exc).__name__}: {exc}"[:300]
            if not hasattr(exc, "tq_chaos_call"):
                self.internal_errors += 1
                self.note(f"INTERNAL ERROR in {op}: {type(exc).__name__}: {exc} {traceback.format_exc()[-800:]}")
            return False

    def run(self, until: float, think_s: float) -> None:
        p = WEIGHTS / WEIGHTS.sum()
        retry_at = 0.0
        while time.monotonic() < until:
            now = time.monotonic()
            if self.pending() and now >= retry_at:
                op = "audit"
            else:
                op = str(self.rng.choice(OPS, p=p))
                if not self.live and op in ("get", "write_back", "discard", "clear"):
                    op = "put"
                elif op == "put" and self._live_keys() + MAX_BATCH > MAX_LIVE_KEYS:
                    op = "discard"
            if not self.step(op):
                back = float(self.rng.uniform(0.05, 0.3))  # do not spin on a service that is down
                retry_at = time.monotonic() + back
                time.sleep(back)
            elif think_s:
                time.sleep(float(self.rng.uniform(0, 2 * think_s)))

    def finish(self, timeout: float) -> None:
        """With the service healthy again: settle every failed op and verify every live key bit-exact
        (asking the controller), retrying what fails until ``timeout``; then judge what is left row by
        row (unreadable acknowledged rows are lost), and discard everything."""
        from tq import KVBatchMeta

        self._recheck_borrowed(everything=True)
        deadline = time.monotonic() + timeout
        done: set[int] = set()
        attempts = 0
        last_error = ""
        while True:
            attempts += 1
            if not self.step("audit"):
                last_error = self.last_error
            for h in list(self.live):
                if id(h) in done or h.unsure:
                    continue
                try:
                    self._read_all(h, "final verification")
                    done.add(id(h))
                except Exception as exc:
                    if not hasattr(exc, "tq_chaos_call"):
                        self.internal_errors += 1
                        self.note(f"INTERNAL ERROR in the final verification: {type(exc).__name__}: {exc} {traceback.format_exc()[-800:]}")
                        done.add(id(h))
                    last_error = f"{type(exc).__name__}: {exc}"[:300]
            left = [h for h in self.live if id(h) not in done]
            if (not self.pending() and not left) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        unverified = sum(len(h.keys) for h in self.live if id(h) not in done)
        clearing = [h for batches in self.clearing for h in batches]
        for h in [h for h in self.live if id(h) not in done] + self.maybe + self.dropping + clearing:
            if h in self.maybe:
                self.outcomes["put_unsettled"] += 1
            self._by_row(h, "final verification", final=True)
        for h in self.live:
            for name in h.unsure:
                self.wrong += len(h.keys)
                self.outcomes["write_back_unsettled"] += 1
                self.note(f"UNSETTLED at the end: a write-back of {name!r} that raised ({last_error})")
        self.final = {"attempts": attempts, "live_keys": self._live_keys(), "unverified_keys": unverified, "last_error": last_error}
        try:
            keys = list(self._call("get_meta", lambda: self.client.get_meta(self.pid)).keys)
            for i in range(0, len(keys), 256):
                chunk = KVBatchMeta(self.pid, tuple(keys[i : i + 256]))
                self._call("discard", lambda: self.client.discard(chunk))  # noqa: B023
            self.final["discarded_keys"] = len(keys)
            self.final["keys_left"] = len(self._call("get_meta", lambda: self.client.get_meta(self.pid)).keys)
        except Exception as exc:
            self.final["discard_error"] = f"{type(exc).__name__}: {exc}"[:300]
        self.live, self.maybe, self.dropping, self.clearing = [], [], [], []
        self.client.close()

    def report(self) -> dict[str, Any]:
        return {
            "client": self.idx,
            "calls": dict(self.calls),
            "call_ok": dict(self.call_ok),
            "errors": {k: dict(v) for k, v in self.errors.items()},
            "error_samples": self.error_samples,
            "op_failed": dict(self.op_failed),
            "lat": {k: np.asarray(v, np.float64) for k, v in self.lat.items()},
            "wrong": self.wrong,
            "lost": len(self.lost),
            "verified": self.verified,
            "views_checked": self.views_checked,
            "big_gets": dict(self.big_gets),
            "big_puts": dict(self.big_puts),
            "outcomes": dict(self.outcomes),
            "phantoms": len(self.phantoms),
            "resurrected": len(self.resurrected),
            "unknown": len(self.unknown),
            "non_tq_errors": self.non_tq_errors,
            "internal_errors": self.internal_errors,
            "final": self.final,
            "slow": self.slow[:50],
            "notes": self.notes,
        }


def client_main(
    idx: int, address: str, cfg: dict[str, Any], ready: Any, go: Any, go_at: Any, faults_done: Any, inflight: Any, results: Any
) -> None:
    """Entry point of one spawned client process."""
    # A client stuck at the end gets SIGUSR1 before it is killed: its threads' stacks go to stderr (the
    # run's log), so a freeze says where it froze.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    is_ready = False
    try:
        w = ChaosClient(idx, address, cfg["seed"], cfg["transport"], cfg["client_timeout"], inflight)
        ready.put(idx)
        is_ready = True
        if not go.wait(cfg["start_timeout"]):
            raise TimeoutError("the run never started")
        w.go_at = go_at.value
        w.run(go_at.value + cfg["duration"], cfg["think_s"])
        faults_done.wait(cfg["faults_done_wait"])
        w.finish(cfg["final_timeout"])
        rep = w.report()
        rep["transport"] = cfg["transport"]
    except BaseException as exc:  # a client that cannot run reports it rather than vanishing
        rep = {"client": idx, "crashed": f"{type(exc).__name__}: {exc}", "notes": [traceback.format_exc()[-1500:]]}
        if not is_ready:
            ready.put(idx)
    results.put(rep)


# ----------------------------------------------------------------------------- the service and its faults
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """The controller (restartable the operator's way: same command, port and state dir) and every
    process of this run, found by the run's private shared-memory dir on their command lines."""

    def __init__(self, run_dir: str, units: int, capacity: int, log: Callable[[str], None], commit_lease_s: float | None = None) -> None:
        self.run_dir, self.units, self.log = run_dir, units, log
        self.shm_dir = tempfile.mkdtemp(prefix="tq-chaos-", dir="/dev/shm")
        self.state_dir = os.path.join(run_dir, "state")
        self.ready_file = os.path.join(run_dir, "controller.ready")
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable,
            "-m",
            "tq.controller",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--storage-units",
            str(units),
            "--capacity",
            str(capacity),
            "--shm-dir",
            self.shm_dir,
            "--journal-dir",
            self.state_dir,
            "--ready-file",
            self.ready_file,
        ]
        if commit_lease_s is not None:
            self.cmd += ["--commit-lease", str(commit_lease_s)]
        self.procs: list[subprocess.Popen] = []

    @property
    def proc(self) -> subprocess.Popen:
        return self.procs[-1]

    def start(self, timeout: float = 60.0) -> float:
        """Start a controller incarnation; returns seconds until it wrote its ready file."""
        if os.path.exists(self.ready_file):
            os.unlink(self.ready_file)
        t0 = time.monotonic()
        with open(os.path.join(self.run_dir, f"controller-{len(self.procs)}.log"), "wb") as out:
            self.procs.append(subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO))
        while time.monotonic() - t0 < timeout:
            if os.path.exists(self.ready_file):
                return time.monotonic() - t0
            if self.proc.poll() is not None:
                raise RuntimeError(f"controller exited with code {self.proc.returncode} before it was ready; log: {self.log_tail()}")
            time.sleep(0.01)
        raise RuntimeError(f"controller not ready within {timeout:.0f}s")

    def journal_bytes(self) -> int:
        """Size of the controller's journal files in its state dir."""
        try:
            return sum(e.stat().st_size for e in os.scandir(self.state_dir) if e.is_file())
        except OSError:
            return 0

    def log_tail(self, n: int = 1500) -> str:
        try:
            with open(os.path.join(self.run_dir, f"controller-{len(self.procs) - 1}.log"), "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def ours(self) -> list[Any]:
        """Every live process of this run (controllers and storage units), zombies excluded."""
        import psutil

        found = []
        for p in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                if p.info["status"] != psutil.STATUS_ZOMBIE and self.shm_dir in (p.info["cmdline"] or []):
                    found.append(p)
            except psutil.Error:
                pass
        return found

    def is_unit(self, pid: int) -> bool:
        return any(p.pid == pid and "tq.storage" in (p.info["cmdline"] or []) for p in self.ours())

    def rss(self) -> dict[str, Any]:
        """RSS of the controller and units (and its anonymous part: RSS minus file and shared pages)."""
        out = {"controller": 0, "units": 0, "controller_anon": 0, "units_anon": 0, "processes": 0}
        for p in self.ours():
            try:
                m = p.memory_info()
            except Exception:
                continue
            who = "units" if "tq.storage" in (p.info["cmdline"] or []) else "controller"
            out[who] += m.rss
            out[f"{who}_anon"] += m.rss - m.shared
            out["processes"] += 1
        out["total"] = out["controller"] + out["units"]
        out["anon"] = out["controller_anon"] + out["units_anon"]
        return out

    def kill_everything(self) -> list[int]:
        """SIGKILL every process of this run (SIGCONT first: a stopped one must not linger)."""
        killed = []
        for p in self.ours():
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass
            killed.append(p.pid)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        while self.ours() and time.monotonic() < deadline:
            time.sleep(0.05)
        return killed

    def files(self) -> list[str]:
        """Shared-memory files of this run: the units' arenas and journals (in the run's own dir) and
        the location tables of its controllers (``/dev/shm/tq-loc-<controller pid>-*``)."""
        from tq.locations import PREFIX

        found = [os.path.join(self.shm_dir, n) for n in sorted(os.listdir(self.shm_dir))] if os.path.isdir(self.shm_dir) else []
        pids = {str(p.pid) for p in self.procs}
        for d in {"/dev/shm", self.shm_dir}:
            if os.path.isdir(d):
                found += [
                    os.path.join(d, n) for n in sorted(os.listdir(d)) if n.startswith(PREFIX) and n[len(PREFIX) :].split("-", 1)[0] in pids
                ]
        return sorted(set(found))

    def remove_files(self) -> list[str]:
        left = self.files()
        for path in left:
            try:
                os.unlink(path)
            except OSError:
                pass
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        return left


class Canary:
    """A 1-key put + get on every storage unit, over TCP (so the unit itself must answer)."""

    def __init__(self, address: str, timeout: float) -> None:
        from tq import TQClient

        self.client = TQClient(address, timeout=timeout, transport="tcp")
        self.client.register_partition(CANARY)
        self.n = 0
        self.errors: collections.Counter = collections.Counter()

    def attempt(self, covered: set[int], units: int) -> bool:
        """One put + get; adds the unit it landed on to ``covered``; True once every unit is covered."""
        import torch

        from tq import KVBatchMeta, protocol

        self.n += 1
        key = f"canary-{self.n}"
        value = torch.arange(self.n % 97 + 1, dtype=torch.int64)
        try:
            self.client.put(CANARY, [key], {"x": [value]})
            meta = KVBatchMeta(CANARY, (key,))
            got = self.client.get(meta, ["x"], layout="list")["x"][0]  # asks the controller, then the unit
            if not torch.equal(got, value):
                self.errors["wrong bytes"] += 1
                return False
            located, msg = self.client._ctrl.call("locate", {"partition": CANARY, "keys": [key], "fields": ["x"]})
            covered.add(int(protocol.unpack_array(located.loc, msg.buffers)[0, 0, protocol.LOC_UNIT]))
            self.client.discard(meta)
        except Exception as exc:
            self.errors[type(exc).__name__] += 1
            return False
        return len(covered) >= units

    def wait(self, units: int, timeout: float) -> float | None:
        """Seconds until every unit served a canary put + get, or None after ``timeout``."""
        t0 = time.monotonic()
        covered: set[int] = set()
        while time.monotonic() - t0 < timeout:
            if self.attempt(covered, units):
                return time.monotonic() - t0
            time.sleep(0.02)
        return None


class FaultDriver:
    """Injects faults one at a time, at random, and times each recovery (see the module docstring)."""

    def __init__(
        self,
        service: Service,
        canary: Canary,
        admin: Any,
        rng: np.random.Generator,
        kinds: tuple[str, ...],
        faults_min: int,
        stop_s: tuple[float, float],
        recovery_timeout: float,
        log: Callable[[str], None],
        t0: float,
    ) -> None:
        self.service, self.canary, self.admin, self.rng = service, canary, admin, rng
        self.kinds, self.faults_min, self.stop_s = kinds, faults_min, stop_s
        self.recovery_timeout, self.log = recovery_timeout, log
        self.records: list[dict[str, Any]] = []
        self.counts: collections.Counter = collections.Counter()
        self.kills: dict[int, list[float]] = collections.defaultdict(list)  # unit id -> kill times
        self.unrecovered: dict[str, Any] | None = None
        self.anomalies: list[str] = []
        self.t0 = t0  # fault times are reported from here (the start of the load)

    def _units(self) -> list[dict[str, Any]]:
        """The controller's view of its units (id, pid), each checked to be a unit process of this run."""
        units = self.admin.stats()["units"]
        return [u for u in units if isinstance(u.get("pid"), int) and self.service.is_unit(u["pid"])]

    def _killable(self, now: float) -> list[int]:
        return [u for u in range(self.service.units) if sum(now - t < UNIT_KILL_WINDOW_S for t in self.kills[u]) < UNIT_KILLS_PER_WINDOW]

    def pick(self) -> str | None:
        now = time.monotonic()
        eligible = [k for k in self.kinds if k != "unit_kill" or self._killable(now)]
        if not eligible:
            return None
        # unit kills are rate-limited (UNIT_KILLS_PER_WINDOW): mostly take the chance while one is allowed
        if "unit_kill" in eligible and self.counts["unit_kill"] < self.faults_min and self.rng.random() < 0.9:
            return "unit_kill"
        wanted = [k for k in eligible if self.counts[k] < self.faults_min]
        if not wanted:  # every minimum met (or only a rate-limited kind left): any kind
            return str(self.rng.choice(eligible))
        w = np.array([self.faults_min - self.counts[k] for k in wanted], dtype=np.float64) ** 2  # the furthest behind first
        return str(self.rng.choice(wanted, p=w / w.sum()))

    def inject(self, kind: str) -> dict[str, Any]:
        svc = self.service
        rec: dict[str, Any] = {"kind": kind, "t_s": round(time.monotonic() - self.t0, 2)}
        if kind in ("unit_kill", "unit_stop"):
            units = self._units()
            if kind == "unit_kill":
                ok = set(self._killable(time.monotonic()))
                units = [u for u in units if u["unit_id"] in ok]
            if not units:
                raise RuntimeError("no storage unit of this run to signal")
            u = units[int(self.rng.integers(len(units)))]
            rec.update(unit=u["unit_id"], pid=u["pid"])
            if kind == "unit_kill":
                os.kill(u["pid"], signal.SIGKILL)
                end = time.monotonic()
                self.kills[u["unit_id"]].append(end)
            else:
                end = self._stop(u["pid"], rec)
        elif kind == "controller_kill":
            rec["pid"] = svc.proc.pid
            svc.proc.kill()
            svc.proc.wait(30)
            rec["journal_bytes"] = svc.journal_bytes()  # what the new incarnation replays
            time.sleep(float(self.rng.uniform(0.0, 1.0)))  # down for a moment: clients see it gone
            end = time.monotonic()
            ready = self._restart()
            if ready is not None:
                rec["ready_s"] = round(ready, 3)
        else:
            rec["pid"] = svc.proc.pid
            end = self._stop(svc.proc.pid, rec)
        took = None
        if kind != "controller_kill" or "ready_s" in rec:
            waited = time.monotonic() - end
            took = self.canary.wait(svc.units, self.recovery_timeout)
        rec["recovery_s"] = None if took is None else round(waited + took, 3)
        if took is None:
            rec["note"] = f"not serving {self.recovery_timeout:.0f}s after the fault"
        self.counts[kind] += 1
        self.records.append(rec)
        return rec

    def _stop(self, pid: int, rec: dict[str, Any]) -> float:
        stop = float(self.rng.uniform(*self.stop_s))
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(stop)
        finally:
            os.kill(pid, signal.SIGCONT)
        rec["stopped_s"] = round(stop, 3)
        return time.monotonic()

    def _restart(self) -> float | None:
        """The operator's recovery: the same command again (retried if an incarnation dies at start);
        seconds until it was ready, or None."""
        for attempt in range(3):
            try:
                return self.service.start(timeout=self.recovery_timeout)
            except RuntimeError as exc:
                self.anomalies.append(f"controller restart attempt {attempt + 1} failed: {exc}")
                self.log(f"  ! controller restart failed: {exc}")
        return None

    def run(self, until: float, max_faults: int) -> None:
        cost = [3.0]  # seconds a fault takes until recovered, running estimate
        while time.monotonic() < until and len(self.records) < max_faults:
            if self.service.proc.poll() is not None:  # died on its own: recover the operator's way, say so
                self.anomalies.append(
                    f"the controller exited by itself (code {self.service.proc.returncode}): {self.service.log_tail(600)}"
                )
                if self._restart() is None:
                    self.unrecovered = {"kind": "controller exited by itself", "error": "could not be restarted"}
                    return
            kind = self.pick()
            if kind is None:
                time.sleep(0.2)
                continue
            t = time.monotonic()
            try:
                rec = self.inject(kind)
            except Exception as exc:
                self.anomalies.append(f"{kind}: could not inject: {type(exc).__name__}: {exc}")
                self.log(f"  ! {kind}: {type(exc).__name__}: {exc}")
                if self.canary.wait(self.service.units, self.recovery_timeout) is None:
                    self.unrecovered = {"kind": kind, "error": f"{type(exc).__name__}: {exc}"}
                    return
                continue
            cost.append(time.monotonic() - t)
            self.log(f"  t={rec['t_s']:6.1f}s {kind:<16} " + ", ".join(f"{k}={v}" for k, v in rec.items() if k not in ("kind", "t_s")))
            if rec["recovery_s"] is None:
                self.unrecovered = rec
                self.log(f"  ! the service did not recover from {kind}: no more faults")
                return
            need = sum(max(self.faults_min - self.counts[k], 0) for k in self.kinds)
            left = until - time.monotonic()
            mean = float(np.mean(cost[-20:]))
            if need:  # spread the faults still needed over 80% of the time left
                gap = min(max((0.8 * left - need * mean) / need, 0.0), 5.0) * float(self.rng.uniform(0.5, 1.5))
            else:
                gap = float(self.rng.uniform(0.3, 1.5))
            time.sleep(min(gap, max(left, 0.0)))


# ----------------------------------------------------------------------------- the run
def held(stats: dict[str, Any]) -> dict[str, Any]:
    """What the service still holds, from ``TQClient.stats()``: per unit its blocks by state
    (``tentative``: stored, waiting for a commit or its lease; ``committed``: claimed, rows still
    referenced or freed under a borrowed get's lease), open slabs, pending allocations and parked
    writes; and the controller's borrowed-get leases and the rows freed under them."""
    units = []
    for u in stats["unit_stats"]:
        blocks, tentative = u.get("blocks"), u.get("tentative_blocks")
        units.append(
            {
                "unit_id": u["unit_id"],
                "alive": u.get("alive") is not False,  # a unit that answered has no flag; one reported down has False
                "bytes_used": u.get("bytes_used"),
                "blocks": blocks,
                "tentative": tentative,
                "committed": None if blocks is None or tentative is None else blocks - tentative,
                "slabs": u.get("slabs"),
                "slab_bytes_reserved": u.get("slab_bytes_reserved"),
                "pending_allocs": u.get("pending_allocs"),
                "parked_writes": u.get("parked_writes"),
            }
        )
    return {"units": units, "leases": stats.get("leases"), "rows_waiting_for_leases": stats.get("rows_waiting_for_leases")}


def is_drained(h: dict[str, Any]) -> bool:
    """Every unit up and holding nothing (a unit reported down has no counts: not drained)."""
    empty = ("bytes_used", "blocks", "slabs", "slab_bytes_reserved", "pending_allocs", "parked_writes")
    return not h["rows_waiting_for_leases"] and all(u["alive"] and all(u[k] == 0 for k in empty) for u in h["units"])


def drain(admin: Any, bound_s: float = DRAIN_BOUND_S, poll_s: float = DRAIN_POLL_S) -> dict[str, Any]:
    """Poll the service's stats every ``poll_s`` until it holds nothing or ``bound_s`` ran out.
    Returns what was held at the start, how long draining took (None: not within the bound, a leak)
    and each change of what was held on the way (seconds from the start)."""
    t0 = time.monotonic()
    first = last = held(admin.stats())
    changes = [{"t_s": 0.0, **first}]
    while not is_drained(last):
        if time.monotonic() - t0 > bound_s:
            return {"bound_s": bound_s, "drained_s": None, "start": first, "end": last, "changes": changes}
        time.sleep(poll_s)
        try:
            now = held(admin.stats())
        except Exception as exc:  # the service should be healthy here: noted, polled again
            now = {**last, "error": f"{type(exc).__name__}: {exc}"}
        if now != last:
            changes.append({"t_s": round(time.monotonic() - t0, 2), **now})
        last = now
    return {"bound_s": bound_s, "drained_s": round(time.monotonic() - t0, 2), "start": first, "end": last, "changes": changes}


def machine() -> dict[str, Any]:
    import psutil

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": model,
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": sys.version.split()[0],
    }


def _percentiles(values: list[float]) -> dict[str, Any]:
    a = np.asarray(values, dtype=np.float64)
    if not a.size:
        return {"n": 0}
    return {
        "n": int(a.size),
        "p50_s": round(float(np.percentile(a, 50)), 3),
        "p99_s": round(float(np.percentile(a, 99)), 3),
        "max_s": round(float(a.max()), 3),
    }


def run_chaos(
    duration: float = 600.0,
    clients: int = 8,
    faults_min: int = 50,
    seed: int = 0,
    *,
    run_dir: str | None = None,
    units: int = 2,
    capacity: int = 512 << 20,
    client_timeout: float = 2.0,
    kinds: tuple[str, ...] = KINDS,
    stop_s: tuple[float, float] = (0.5, 5.0),
    warmup_s: float | None = None,
    recovery_timeout: float = 30.0,
    final_timeout: float = 60.0,
    max_faults: int = 2000,
    think_ms: float = 5.0,
    drain_bound_s: float = DRAIN_BOUND_S,
    commit_lease_s: float | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the chaos benchmark and return its report (see the module docstring); ``report["ok"]`` is
    the verdict. Every process started is stopped and the run's shared-memory files removed, whatever
    happens. ``commit_lease_s`` is the service's ``--commit-lease`` (default 30 s): a shorter one lets
    blocks whose commit a fault lost drain sooner after the final discard (the CI test's)."""
    from tq import TQClient
    from tq.errors import TQConnectionError

    started, t_start = time.time(), time.monotonic()
    phases: dict[str, float] = {}
    if run_dir is None:
        run_dir = os.path.join(REPO, "logs", "tq_chaos", time.strftime("%Y%m%d-%H%M%S"))
    if os.path.exists(os.path.join(run_dir, "state")):  # its journal would bring the old run's partitions back
        raise ValueError(f"run dir {run_dir} holds an earlier run's service state: give a fresh --run-dir")
    os.makedirs(run_dir, exist_ok=True)
    warmup_s = warmup_s if warmup_s is not None else min(max(0.05 * duration, 3.0), 10.0)
    tail_s = 3.0  # no fault starts in the last seconds of the load
    rng = np.random.default_rng([seed, 1 << 20])
    svc = Service(run_dir, units, capacity, log, commit_lease_s)
    ctx = mp.get_context("spawn")
    workers: list[Any] = []
    admin = canary = None
    reports: list[dict[str, Any]] = []
    rss: dict[str, Any] = {"samples": []}
    shutdown: dict[str, Any] = {}
    max_inflight = [0.0] * clients
    stop_monitor = threading.Event()
    driver: FaultDriver | None = None
    run_errors: list[str] = []
    leftover_keys: dict[str, int] = {}
    drained: dict[str, Any] = {}  # what the units held after the final discard, and how long it took them to drain
    ledgers: dict[str, Any] = {}  # the controller's block ledger per unit at the end (bounded by its low-water mark)
    elapsed = 0.0
    log(f"TQ chaos: run dir {run_dir}")
    try:
        svc.start()
        admin = TQClient(svc.address, timeout=10.0, transport="tcp")
        canary = Canary(svc.address, timeout=1.0)
        ready, go, results, faults_done = ctx.Queue(), ctx.Event(), ctx.Queue(), ctx.Event()
        go_at = ctx.Value("d", 0.0, lock=False)
        inflight = ctx.Array("d", clients, lock=False)
        start_timeout = 120.0 + 10.0 * clients
        cfg = {
            "seed": seed,
            "client_timeout": client_timeout,
            "duration": duration,
            "think_s": think_ms / 1e3,
            "start_timeout": start_timeout,
            "final_timeout": final_timeout,
            "faults_done_wait": recovery_timeout + stop_s[1] + 60.0,
        }
        n_ready = start_processes(
            ctx,
            workers,
            clients,
            "tq-chaos",
            client_main,
            ready,
            start_timeout,
            lambda i: (i, svc.address, {**cfg, "transport": ("auto", "tcp")[i % 2]}, ready, go, go_at, faults_done, inflight, results),
        )

        import psutil

        psutil.cpu_percent(None)

        def monitor() -> None:  # ops in flight too long (a client stuck inside a call), and RSS over time
            next_rss = 0.0
            while not stop_monitor.wait(0.1):
                now = time.monotonic()
                for i in range(clients):
                    t = inflight[i]
                    if t > 0:
                        max_inflight[i] = max(max_inflight[i], now - t)
                if now >= next_rss:
                    rss["samples"].append({"t_s": round(now - go_at.value, 1), "cpu_percent": psutil.cpu_percent(None), **svc.rss()})
                    next_rss = now + 10.0

        phases["clients_ready_s"] = round(time.monotonic() - t_start, 1)
        go_at.value = time.monotonic()
        go.set()
        threading.Thread(target=monitor, name="chaos-monitor", daemon=True).start()
        log(
            f"{n_ready}/{clients} clients ready; {duration:.0f}s of load, faults from {warmup_s:.0f}s "
            f"(>= {faults_min} of each of {', '.join(kinds)})"
        )
        time.sleep(warmup_s)
        admin.trim()
        rss["start"] = svc.rss()
        driver = FaultDriver(svc, canary, admin, rng, kinds, faults_min, stop_s, recovery_timeout, log, go_at.value)
        try:
            driver.run(go_at.value + duration - tail_s, max_faults)
        except Exception as exc:  # a bug of the driver: stop injecting, still verify and report
            run_errors.append(f"fault driver: {type(exc).__name__}: {exc} {traceback.format_exc()[-800:]}")
        finally:
            faults_done.set()
        phases["faults_done_s"] = round(time.monotonic() - t_start, 1)
        healthy = canary.wait(units, recovery_timeout)
        log(
            f"faults done ({len(driver.records)}); service {'healthy' if healthy is not None else 'NOT healthy'}; "
            "clients verify and clean up"
        )
        end = go_at.value + duration + recovery_timeout + stop_s[1] + 60.0 + final_timeout + 60.0
        while len(reports) < clients and time.monotonic() < end:
            try:
                reports.append(results.get(timeout=1.0))
            except queue.Empty:
                if not any(p.is_alive() for p in workers) and results.empty():
                    break
        elapsed = time.monotonic() - go_at.value
        # A client that reported is exiting; its liveness file is swept at the service's stop only once its
        # process is gone (on a loaded 2-core VM two were still exiting and their files were counted as left)
        join_by = time.monotonic() + 30.0
        for p in workers:
            p.join(timeout=max(0.0, join_by - time.monotonic()))
        phases["clients_done_s"] = round(time.monotonic() - t_start, 1)
        stop_monitor.set()
        try:  # everything left (the canary's keys; whatever a client could not discard) goes too
            from tq import KVBatchMeta

            for part in admin.list_partitions():
                keys = admin.get_meta(part["partition"]).keys
                if keys:
                    leftover_keys[part["partition"]] = len(keys)
                    admin.discard(KVBatchMeta(part["partition"], tuple(keys)))
            drained = {"discard_t_s": round(time.monotonic() - go_at.value, 1), **drain(admin, drain_bound_s)}
            log(
                "final discard done; "
                + (f"drained in {drained['drained_s']} s" if drained["drained_s"] is not None else f"NOT drained in {drain_bound_s:g} s")
            )
            ledgers = admin.stats()["unit_ledgers"]
            admin.trim()
            rss["end"] = svc.rss()
        except Exception as exc:
            run_errors.append(f"final discard: {type(exc).__name__}: {exc}")
        phases["settled_s"] = round(time.monotonic() - t_start, 1)
        t = time.monotonic()
        try:  # a clean shutdown, as an operator does it (tq-controller stop): nothing of the run may be left
            with TQClient(svc.address, timeout=2.0, transport="tcp") as stopper:
                stopper.shutdown_service()
        except TQConnectionError:
            pass  # it may stop before its reply leaves (as tq-controller stop knows): its exit tells
        except Exception as exc:
            run_errors.append(f"shutdown: {type(exc).__name__}: {exc}")
        while (svc.proc.poll() is None or svc.ours()) and time.monotonic() - t < 30:
            time.sleep(0.05)
        if svc.proc.poll() is None or svc.ours():
            run_errors.append(f"shutdown: the service was still running {time.monotonic() - t:.0f}s after shutdown")
        shutdown.update(
            {
                "controller_exit_code": svc.proc.poll(),
                "shutdown_s": round(time.monotonic() - t, 2),
                "processes_left": [p.pid for p in svc.ours()],
                "shm_files_left": svc.files(),
            }
        )
    finally:
        stop_monitor.set()
        for p in workers:
            p.join(timeout=5)
        stragglers = [p for p in workers if p.is_alive()]
        for p in stragglers:
            print(f"client process {p.pid} is stuck: its threads' stacks follow (SIGUSR1), then it is killed", file=sys.stderr, flush=True)
            os.kill(p.pid, signal.SIGUSR1)
            time.sleep(1.0)
            p.kill()
            p.join(timeout=5)
        for c in (canary.client if canary else None, admin):
            if c is not None:
                c.close()
        shutdown["killed_at_cleanup"] = svc.kill_everything()
        shutdown["shm_files_removed_at_cleanup"] = svc.remove_files()
        shutdown["processes_after_cleanup"] = [p.pid for p in svc.ours()]
        shutdown["shm_files_after_cleanup"] = svc.files()
        shutdown["shm_dir"] = svc.shm_dir
        shutdown["controller_pids"] = [p.pid for p in svc.procs]
        phases["cleaned_up_s"] = round(time.monotonic() - t_start, 1)

    report = _report(locals())
    write_report(report, os.path.join(run_dir, "report"))
    return report


def _report(v: dict[str, Any]) -> dict[str, Any]:
    """Aggregate the clients' reports and the driver's records, and judge the targets."""
    reports, driver, rss = v["reports"], v["driver"], v["rss"]
    clients, client_timeout, faults_min, kinds = v["clients"], v["client_timeout"], v["faults_min"], v["kinds"]
    calls: collections.Counter = collections.Counter()
    ok: collections.Counter = collections.Counter()
    errors: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    lat: dict[str, list[np.ndarray]] = collections.defaultdict(list)
    totals: collections.Counter = collections.Counter()
    outcomes: collections.Counter = collections.Counter()
    op_failed: collections.Counter = collections.Counter()
    notes: list[str] = []
    finals = []
    slow: list[dict[str, Any]] = []
    samples: dict[str, dict[str, str]] = {}
    big_gets: collections.Counter = collections.Counter()
    big_puts: collections.Counter = collections.Counter()
    for r in reports:
        if "crashed" in r:
            totals["crashed"] += 1
            notes.append(f"client {r['client']} crashed: {r['crashed']}")
            notes += r.get("notes", [])
            continue
        calls.update(r["calls"])
        ok.update(r["call_ok"])
        op_failed.update(r["op_failed"])
        outcomes.update(r["outcomes"])
        for k, c in r["errors"].items():
            errors[k].update(c)
        for k, c in r.get("error_samples", {}).items():
            for t, msg in c.items():
                samples.setdefault(k, {}).setdefault(t, msg)
        for k, a in r["lat"].items():
            lat[k].append(a)
        for k in ("wrong", "lost", "verified", "phantoms", "resurrected", "unknown", "non_tq_errors", "internal_errors"):
            totals[k] += int(r[k])
        totals["views_checked"] += int(r.get("views_checked", 0))
        big_gets.update({int(k): n for k, n in r.get("big_gets", {}).items()})
        big_puts.update({int(k): n for k, n in r.get("big_puts", {}).items()})
        finals.append({"client": r["client"], "transport": r.get("transport"), **r["final"]})
        slow += [{"client": r["client"], **c} for c in r.get("slow", [])]
        notes += r["notes"]
    missing = clients - len(reports)
    ops = {}
    longest = (0.0, "")
    for k in sorted(calls):
        a = np.concatenate(lat[k]) if lat[k] else np.empty(0)
        ops[k] = {
            "calls": calls[k],
            "ok": ok[k],
            "failed": calls[k] - ok[k],
            "errors": dict(errors[k]),
            "error_samples": samples.get(k, {}),
            "p50_ms": round(_pct(a, 50), 2),
            "p99_ms": round(_pct(a, 99), 2),
            "max_ms": round(_pct(a, 100), 1),
        }
        if a.size and a.max() > longest[0]:
            longest = (float(a.max()), k)
    in_flight = max(v["max_inflight"], default=0.0)
    records = driver.records if driver else []
    faults = {}
    for k in kinds:
        recs = [r for r in records if r["kind"] == k]
        faults[k] = {
            "injected": len(recs),
            "recovered": sum(r["recovery_s"] is not None for r in recs),
            "recovery": _percentiles([r["recovery_s"] for r in recs if r["recovery_s"] is not None]),
        }
        if k == "controller_kill":
            faults[k]["ready"] = _percentiles([r["ready_s"] for r in recs if "ready_s" in r])
            faults[k]["journal_bytes_max"] = max((r.get("journal_bytes", 0) for r in recs), default=0)
        if k.endswith("_stop"):
            faults[k]["stopped"] = _percentiles([r["stopped_s"] for r in recs])
    start, end = rss.get("start"), rss.get("end")
    growth = (end["total"] - start["total"]) / start["total"] if start and end and start["total"] else None
    drained = v.get("drained") or {}
    shutdown = v["shutdown"]
    longest_s = max(longest[0], in_flight)
    hang_limit = client_timeout + HANG_MARGIN_S

    def p99(kind: str) -> float | None:
        f = faults.get(kind)
        if not f or not f["injected"]:
            return None
        return float("inf") if f["recovered"] < f["injected"] else f["recovery"]["p99_s"]

    targets = []

    def target(name: str, measured: Any, want: str, good: bool | None) -> None:
        targets.append({"target": name, "measured": measured, "want": want, "ok": good})

    target("acknowledged writes lost", totals["lost"], "0", totals["lost"] == 0 and missing == 0 and not totals["crashed"])
    target("wrong-bytes reads", totals["wrong"], "0", totals["wrong"] == 0 and missing == 0 and not totals["crashed"])
    target(
        "longest client call (s)",
        round(longest_s, 2),
        f"<= client timeout {client_timeout:g} s + {HANG_MARGIN_S:g} s",
        longest_s <= hang_limit and not v["stragglers"],
    )
    for k in kinds:
        target(f"{k} faults injected", faults[k]["injected"], f">= {faults_min}", faults[k]["injected"] >= faults_min)
    target(
        "every fault recovered",
        sum(f["recovered"] for f in faults.values()),
        f"= {len(records)} injected",
        all(f["recovered"] == f["injected"] for f in faults.values()) and driver is not None and driver.unrecovered is None,
    )
    if "unit_kill" in kinds:
        m = p99("unit_kill")
        target("unit restart to serving, p99 (s)", m, f"<= {UNIT_RESTART_P99_S:g}", m is not None and m <= UNIT_RESTART_P99_S)
    if "controller_kill" in kinds:
        m = p99("controller_kill")
        target(
            "controller restart (journal) to serving, p99 (s)",
            m,
            f"<= {CONTROLLER_RESTART_P99_S:g}",
            m is not None and m <= CONTROLLER_RESTART_P99_S,
        )
    target(
        "service RSS growth, warm-up -> end",
        None if growth is None else f"{growth:+.1%}",
        f"< {RSS_GROWTH_LIMIT:.0%}",
        growth is not None and growth < RSS_GROWTH_LIMIT,
    )
    target("client calls raising a non-TQ error", totals["non_tq_errors"], "0", totals["non_tq_errors"] == 0)
    if drained:  # (absent when the final discard itself failed: reported as a run error below)
        target(
            "units drained after the final discard (s)",
            drained["drained_s"],
            f"<= {drained['bound_s']:g} (longest lease + margin)",
            drained["drained_s"] is not None,
        )
    if totals["internal_errors"] or totals["crashed"] or missing or v["run_errors"]:
        target(
            "the run itself completed (no client crashed, no benchmark bug, final discard and shutdown worked)",
            f"{totals['internal_errors']} internal errors, {totals['crashed']} crashed, {missing} never reported, "
            f"{len(v['run_errors'])} run errors",
            "0",
            False,
        )
    return {
        "config": {
            "duration_s": v["duration"],
            "clients": clients,
            "transports": "half auto (shared memory), half tcp",
            "faults_min": faults_min,
            "seed": v["seed"],
            "units": v["units"],
            "capacity_bytes": v["capacity"],
            "client_timeout_s": client_timeout,
            "kinds": list(kinds),
            "stop_s": list(v["stop_s"]),
            "warmup_s": v["warmup_s"],
            "recovery_timeout_s": v["recovery_timeout"],
            "think_ms": v["think_ms"],
            "commit_lease_s": v["commit_lease_s"] or DEFAULT_COMMIT_LEASE_S,
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v["started"])),
            "run_dir": v["run_dir"],
        },
        "machine": machine(),
        "code": code_version(),
        "elapsed_s": round(v.get("elapsed", 0.0), 1),
        "phases": v["phases"],
        "ops": ops,
        "total_calls": sum(calls.values()),
        "failed_ops": dict(op_failed),
        "lost_acked_writes": totals["lost"],
        "wrong_bytes_reads": totals["wrong"],
        "verified_rows": totals["verified"],
        "borrowed_view_rows_rechecked": totals["views_checked"],
        "big_tcp_gets": sum(big_gets.values()),
        "big_tcp_gets_by_lanes": {str(k): n for k, n in sorted(big_gets.items())},
        "big_tcp_puts": sum(big_puts.values()),
        "big_tcp_puts_by_lanes": {str(k): n for k, n in sorted(big_puts.items())},
        "failed_op_outcomes": dict(outcomes),
        "phantom_keys": totals["phantoms"],
        "resurrected_keys": totals["resurrected"],
        "unknown_keys": totals["unknown"],
        "non_tq_errors": totals["non_tq_errors"],
        "internal_errors": totals["internal_errors"],
        "clients_crashed": totals["crashed"],
        "clients_missing": missing,
        "clients_killed": len(v["stragglers"]),
        "longest_call_s": round(longest[0], 3),
        "longest_call_kind": longest[1],
        "longest_in_flight_s": round(in_flight, 3),
        "calls_over_timeout": sorted(slow, key=lambda c: -c["s"])[:40],
        "faults": faults,
        "faults_total": len(records),
        "fault_log": records,
        "unrecovered": driver.unrecovered if driver else None,
        "driver_anomalies": driver.anomalies if driver else [],
        "run_errors": v["run_errors"],
        "canary": {"attempts": v["canary"].n if v["canary"] else 0, "errors": dict(v["canary"].errors) if v["canary"] else {}},
        "rss": {"start": start, "end": end, "growth": None if growth is None else round(growth, 4), "samples": rss["samples"]},
        "machine_cpu_percent_mean": round(float(np.mean([s["cpu_percent"] for s in rss["samples"][1:]])), 1)
        if len(rss["samples"]) > 1
        else None,
        "drain_after_discard": drained,
        "controller_ledgers_end": v.get("ledgers", {}),
        "leftover_keys_discarded_by_driver": v.get("leftover_keys", {}),
        "client_final": finals,
        "shutdown": shutdown,
        "targets": targets,
        "ok": all(t["ok"] for t in targets),
        "notes": notes[:80],
    }


# ----------------------------------------------------------------------------- output
def summary(r: dict[str, Any]) -> str:
    c, m = r["config"], r["machine"]
    lines = [
        f"TQ chaos: {c['clients']} clients x {c['duration_s']:.0f}s, {c['units']} storage units, client timeout "
        f"{c['client_timeout_s']:g}s; {m['platform']}, {m['nproc']} CPUs ({m['cpu']})",
        f"  code: {r['code']['commit'][:12]}"
        + (f" (+ uncommitted tq/: {', '.join(r['code']['tq_uncommitted'])})" if r["code"]["tq_uncommitted"] else ""),
        "",
        "| op | calls | ok | failed | errors by type | p50 ms | p99 ms | max ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, o in r["ops"].items():
        errs = ", ".join(f"{t} {n}" for t, n in sorted(o["errors"].items(), key=lambda x: -x[1])) or "-"
        lines.append(
            f"| {k} | {o['calls']} | {o['ok']} | {o['failed']} | {errs} | {o['p50_ms']:.1f} | {o['p99_ms']:.1f} | {o['max_ms']:.0f} |"
        )
    lines += ["", "| fault | injected | recovered | recovery p50 / p99 / max s |", "|---|---|---|---|"]
    for k, f in r["faults"].items():
        rec = f["recovery"]
        lines.append(
            f"| {k} | {f['injected']} | {f['recovered']} | "
            + (f"{rec['p50_s']:.2f} / {rec['p99_s']:.2f} / {rec['max_s']:.2f} |" if rec["n"] else "- |")
        )
    o = r["failed_op_outcomes"]
    lines += [
        "",
        "failed ops settled as: " + (", ".join(f"{k} {n}" for k, n in sorted(o.items())) or "-"),
        f"verified rows {r['verified_rows']} (of them re-checked in borrowed views held over later ops and faults: "
        f"{r.get('borrowed_view_rows_rechecked', 0)}); phantom keys {r['phantom_keys']}, resurrected {r['resurrected_keys']}, "
        f"unknown {r['unknown_keys']}; machine CPU busy {r['machine_cpu_percent_mean']}% (mean over the run)",
        "RSS (controller + units, MiB): after warm-up {}, end {} ({}); anon {} -> {}".format(
            *(f"{x / MiB:.0f}" if x else "?" for x in ((r["rss"]["start"] or {}).get("total"), (r["rss"]["end"] or {}).get("total"))),
            "?" if r["rss"]["growth"] is None else f"{r['rss']['growth']:+.1%}",
            *(f"{x / MiB:.0f}" if x else "?" for x in ((r["rss"]["start"] or {}).get("anon"), (r["rss"]["end"] or {}).get("anon"))),
        ),
        f"TCP gets of big batches (over one fetch request's 16 MiB): {r.get('big_tcp_gets', 0)}, by the lanes their "
        "clients cut them into: " + (", ".join(f"{k} lane(s) {n}" for k, n in r.get("big_tcp_gets_by_lanes", {}).items()) or "-"),
        f"TCP puts of big batches acknowledged: {r.get('big_tcp_puts', 0)}, by their lanes: "
        + (", ".join(f"{k} lane(s) {n}" for k, n in r.get("big_tcp_puts_by_lanes", {}).items()) or "-"),
        *drain_lines(r.get("drain_after_discard") or {}),
        "controller's ledger of unsettled blocks at the end: "
        + (
            ", ".join(
                f"unit {u} low water {d['low_water']}, {d['pending']} committed, {d['fenced']} fenced"
                for u, d in sorted(r.get("controller_ledgers_end", {}).items())
            )
            or "?"
        ),
        f"shutdown: {r['shutdown'].get('shutdown_s')} s, controller exit code {r['shutdown'].get('controller_exit_code')}, "
        f"processes left {r['shutdown'].get('processes_left')}, shm files left {r['shutdown'].get('shm_files_left')}",
        "",
        "| target | measured | want | result |",
        "|---|---|---|---|",
    ]
    for t in r["targets"]:
        lines.append(f"| {t['target']} | {t['measured']} | {t['want']} | {'PASS' if t['ok'] else 'FAIL'} |")
    lines.append(f"\nverdict: {'OK' if r['ok'] else 'FAILED'}")
    if r["unrecovered"]:
        lines.append(f"  ! not recovered: {r['unrecovered']}")
    over = r["calls_over_timeout"]
    if over:
        lines.append(
            f"  calls longer than the client timeout: {len(over)}"
            + ("+" if len(over) >= 40 else "")
            + "; longest: "
            + "; ".join(f"{c['call']} {c['s']:.2f}s at t={c['t_s']:.1f}s ({c['error'] or 'ok'})" for c in over[:3])
        )
    lines += [f"  ! {a}" for a in r["driver_anomalies"][:5] + r["run_errors"]]
    lines += [f"  ! {n}" for n in r["notes"][:15]]
    return "\n".join(lines)


def _held_text(h: dict[str, Any]) -> str:
    units = ", ".join(
        f"unit {u['unit_id']}{'' if u['alive'] else ' (down)'} {u['bytes_used']} B in {u['blocks']} blocks "
        f"({u['tentative']} tentative, {u['committed']} committed), {u['slabs']} slabs ({u['slab_bytes_reserved']} B), "
        f"{u['pending_allocs']} pending allocations"
        for u in h["units"]
    )
    return f"{units}; {h['leases']} borrowed-get leases, {h['rows_waiting_for_leases']} rows freed under them"


def drain_lines(d: dict[str, Any]) -> list[str]:
    """What the units held after the final discard and how they drained, for the summary."""
    if not d:
        return ["units after the final discard: ? (the final discard failed)"]
    out = [f"held at the final discard (t={d['discard_t_s']}s): {_held_text(d['start'])}"]
    if d["drained_s"] is None:
        return [*out, f"NOT drained within {d['bound_s']:g} s (a leak): still held {_held_text(d['end'])}"]
    steps = "; ".join(
        f"{c['t_s']} s: "
        + ", ".join(f"unit {u['unit_id']} {u['blocks']} blocks ({u['tentative']} tentative), {u['slabs']} slabs" for u in c["units"])
        for c in d["changes"][1:]
    )
    return [*out, f"drained in {d['drained_s']} s (bound {d['bound_s']:g} s)" + (f"; on the way: {steps}" if steps else "")]


def write_report(r: dict[str, Any], base: str) -> None:
    """``base``.json (everything) and ``base``.md (the summary)."""
    with open(base + ".json", "w") as f:
        json.dump(r, f, indent=1, default=str)
    with open(base + ".md", "w") as f:
        f.write(f"# TQ chaos benchmark\n\n`python -m benchmarks.tq_chaos` ({r['config']['started']})\n\n{summary(r)}\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (faults from the end of warm-up)")
    p.add_argument("--clients", type=int, default=8, help="client processes (half shared memory, half TCP)")
    p.add_argument("--faults-min", type=int, default=50, help="faults of every kind to inject at least")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault driver and the clients' op choices (default 0)")
    p.add_argument("--kinds", default=",".join(KINDS), help="fault kinds, comma-separated (default: all four)")
    p.add_argument("--client-timeout", type=float, default=2.0, help="every client's TQClient timeout (s)")
    p.add_argument("--capacity", type=int, default=512 << 20, help="total storage bytes (split over the 2 units)")
    p.add_argument("--think-ms", type=float, default=5.0, help="mean pause between a client's ops")
    p.add_argument("--run-dir", help="default: logs/tq_chaos/<timestamp>/")
    p.add_argument("--json", help="also write the full report here")
    p.add_argument("--publish", action="store_true", help="write benchmarks/results/tq_chaos_<machine>.{json,md}")
    p.add_argument("--machine", default=machine_tag(), help="machine tag of the published files (default: cpu<usable cores>)")
    a = p.parse_args(argv)
    kinds = tuple(k for k in a.kinds.split(",") if k)
    if set(kinds) - set(KINDS):
        p.error(f"unknown fault kinds {sorted(set(kinds) - set(KINDS))}; known: {', '.join(KINDS)}")
    r = run_chaos(
        a.duration,
        a.clients,
        a.faults_min,
        a.seed,
        run_dir=a.run_dir,
        client_timeout=a.client_timeout,
        capacity=a.capacity,
        kinds=kinds,
        think_ms=a.think_ms,
    )
    text = summary(r)
    paths = [os.path.join(r["config"]["run_dir"], "report")]
    if a.publish:
        paths.append(os.path.join(REPO, "benchmarks", "results", f"tq_chaos_{a.machine}"))
        write_report(r, paths[1])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1, default=str)
    print(text)
    print(f"\nreport: {paths[0]}.json" + (f", published {paths[1]}.json/.md" if a.publish else ""))
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
