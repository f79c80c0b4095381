"""A bounded load soak of the TQ service: many client processes, random operations, every byte checked.

``--procs`` client processes (spawned, default 32) hammer one TQ service (controller + storage units
on loopback) for ``--duration`` seconds (default 600) with random puts, gets, write-backs, discards,
partition clears and metadata reads of random shapes: jagged int64 / float32 / bfloat16 / bool
columns, fixed-shape tensors (float32, float64, int32, bfloat16), object columns. Each process works
in its own partition and in one shared partition, half of them over shared memory and half over TCP.

Every process keeps a sha256 per (key, field) of what it wrote and checks every row it reads back
(padding included), that discarded keys are gone and that each partition holds exactly the keys it
should: zero lost or corrupted samples is the bar, and any exception counts as an error. At the end
every process verifies all its live data, then clears it; the run then clears the shared partition
and checks that the storage units are back to zero bytes, blocks and allocations, and that the
controller's RSS is back near its level after warm-up (no leak).

Reports ops/s, p50/p99 latency per op type, errors, verified samples, and units' bytes_used and
controller/unit RSS at the start, during the run and after the final clear, as JSON and a short
summary. Exits non-zero on any error, corruption, lost sample or leak.

    python -m benchmarks.tq_soak                                   # 32 processes, 10 minutes
    python -m benchmarks.tq_soak --procs 6 --duration 20

Results go to a fresh ``logs/tq_soak/<timestamp>/`` (``tq_soak.json``, ``tq_soak.md``); ``--publish``
also writes ``benchmarks/results/tq_soak_<machine>.{json,md}``.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import platform
import queue
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from benchmarks.outputs import add_output_args, open_run
from tq.testing import digest, rows_of

MiB = 1 << 20
SHARED = "soak-shared"
OPS = ("put", "get", "write_back", "discard", "clear", "meta")
WEIGHTS = np.array([26, 36, 14, 12, 2, 10], dtype=np.float64)
# Field name -> what it holds. One name, one schema: processes share a partition, so they must agree.
JAGGED = {"ids": "int64", "lp": "float32", "bf": "bfloat16", "mask": "bool"}
FIXED = {"emb": ("float32", (4,)), "grid": ("float32", (2, 3)), "score": ("float64", ()), "tok": ("int32", (8,)), "h": ("bfloat16", (16,))}
OBJECTS = ("msgs", "info")
WRITE_BACK = ("adv", "plp", "note")  # fixed float32 scalar, jagged float32 aligned with ids, object
MAX_LIVE_KEYS = 256  # per process: bounds memory, so the soak can run for hours
MAX_BATCH = 16
RSS_GROWTH_LIMIT = 64 * MiB  # controller RSS after the final clear vs. after warm-up


# ----------------------------------------------------------------------------- checksums
def compare_rows(
    got: dict[str, Any], layout: str, want: dict[str, list[str]], lengths: list[int]
) -> tuple[int, list[tuple[str, int | None, str]]]:
    """Check a get's result row by row against the digests of what was written (``want[field][j]``
    for row j). Jagged fields of a padded result are cut at ``lengths[j]`` and their padding must be
    zero. Returns (rows that matched, problems as (field, row index or None for the whole field, what
    is wrong))."""
    import torch

    matched, problems = 0, []
    for name, col in got.items():
        if layout == "padded" and (name in JAGGED or name == "plp"):
            rows = []
            for j, L in enumerate(lengths):
                rows.append(col[j, :L])
                pad = col[j, L:]
                if pad.numel() and bool((pad.contiguous().view(torch.uint8) != 0).any()):
                    problems.append((name, j, "padding is not zero"))
        else:
            rows = rows_of(col)
        if len(rows) != len(lengths):
            problems.append((name, None, f"{name!r} came back with {len(rows)} rows"))
            continue
        for j, row in enumerate(rows):
            if digest(row) == want[name][j]:
                matched += 1
            else:
                problems.append((name, j, "does not match its checksum"))
    return matched, problems


# ----------------------------------------------------------------------------- one client process
@dataclass
class Batch:
    """What one put stored (minus what was discarded since): keys, lengths, per-field digests, tags,
    and the meta the put returned (its slots let same-host gets skip the controller)."""

    pid: str
    keys: list[str]
    lengths: list[int]
    sums: dict[str, list[str]]
    tags: dict[str, list[Any]]
    meta: Any = None


@dataclass
class Tally:
    ops: collections.Counter = field(default_factory=collections.Counter)
    lat: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    errors: int = 0
    corrupted: int = 0
    lost: int = 0
    verified: int = 0  # (key, field) rows read back and matched
    samples_written: int = 0
    bytes_written: int = 0
    notes: list[str] = field(default_factory=list)

    def note(self, kind: str, text: str) -> None:
        if len(self.notes) < 20:
            self.notes.append(f"{kind}: {text}")


class RowMaker:
    """Random per-sample columns of every kind the soak writes (also used by ``benchmarks.tq_chaos``):
    jagged rows of the ``JAGGED`` dtypes with lengths mostly short, some long, fixed-shape tensors,
    msgpack-able objects, and the ``WRITE_BACK`` fields."""

    def __init__(self, rng: np.random.Generator) -> None:
        import torch

        self.torch = torch
        self.rng = rng
        self.gen = torch.Generator().manual_seed(int(self.rng.integers(1 << 62)))

    def _lengths(self, n: int) -> list[int]:
        r = self.rng.random(n)
        small = self.rng.integers(0, 64, n)
        mid = self.rng.integers(64, 512, n)
        big = self.rng.integers(512, 2048, n)
        return np.where(r < 0.6, small, np.where(r < 0.95, mid, big)).tolist()

    def _jagged(self, dtype: str, lengths: list[int]) -> Any:
        torch, g = self.torch, self.gen
        rows = []
        for L in lengths:
            if dtype == "int64":
                rows.append(torch.randint(0, 150_000, (L,), generator=g))
            elif dtype == "bool":
                rows.append(torch.rand(L, generator=g) > 0.5)
            else:
                rows.append(torch.randn(L, generator=g).to(getattr(torch, dtype)))
        if self.rng.random() < 0.5:  # both encodings: a list of rows, or one JaggedTensor
            from tq import JaggedTensor

            return JaggedTensor.from_list(rows)
        return rows

    def _fixed(self, dtype: str, shape: tuple[int, ...], n: int) -> Any:
        torch, g = self.torch, self.gen
        if dtype == "int32":
            return torch.randint(-(2**31), 2**31 - 1, (n, *shape), generator=g, dtype=torch.int32)
        t = torch.randn((n, *shape), generator=g, dtype=torch.float64 if dtype == "float64" else torch.float32)
        return t.to(getattr(torch, dtype))

    def _object(self, name: str, n: int) -> list[Any]:
        out = []
        for _ in range(n):
            k = int(self.rng.integers(0, 4))
            if name == "msgs":
                out.append(
                    [{"role": "user" if i % 2 == 0 else "assistant", "content": "x" * int(self.rng.integers(0, 200))} for i in range(k)]
                )
            else:
                out.append(
                    {
                        "i": int(self.rng.integers(-(2**62), 2**62)),
                        "f": float(self.rng.standard_normal()),
                        "b": self.rng.bytes(int(self.rng.integers(0, 32))),
                        "l": list(range(k)),
                        "n": None,
                    }
                )
        return out

    def _column(self, name: str, n: int, lengths: list[int]) -> Any:
        if name in JAGGED:
            return self._jagged(JAGGED[name], lengths)
        if name in FIXED:
            return self._fixed(*FIXED[name], n)
        if name == "adv":
            return self._fixed("float32", (), n)
        if name == "plp":
            return self._jagged("float32", lengths)
        return self._object(name if name in OBJECTS else "info", n)


class SoakWorker(RowMaker):
    def __init__(self, idx: int, address: str, seed: int, transport: str) -> None:
        from tq import TQClient

        super().__init__(np.random.default_rng([seed, idx]))
        self.idx = idx
        self.client = TQClient(address, timeout=120.0, transport=transport)
        self.own = f"soak-w{idx}"
        self.client.register_partition(self.own)
        self.batches: list[Batch] = []
        self.counter = 0
        self.t = Tally()
        self.prev_get: tuple[dict, list] | None = None  # the last get's result, re-checked after the next one

    # -- bookkeeping
    def _timed(self, op: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        out = fn()
        self.t.lat[op].append(time.perf_counter() - t0)
        self.t.ops[op] += 1
        return out

    def _live(self, pid: str | None = None) -> int:
        return sum(len(b.keys) for b in self.batches if pid is None or b.pid == pid)

    def _meta(self, b: Batch, idx: list[int] | None = None, fields: tuple[str, ...] = ()):
        """Half the time the put's own meta (with slots: the location-table path on the same host,
        stale once another process reuses slots), else one built from the keys (the controller path)."""
        from tq import KVBatchMeta

        if b.meta is not None and self.rng.random() < 0.5:
            return (b.meta if idx is None else b.meta.select(idx)).with_fields(fields)
        keys = b.keys if idx is None else [b.keys[i] for i in idx]
        return KVBatchMeta(b.pid, tuple(keys), fields)

    def _check_rows(self, b: Batch, idx: list[int], got: dict[str, Any], layout: str, what: str) -> None:
        """Compare every row of a get's result with the digests of what was written."""
        self._check(
            got, layout, {f: [b.sums[f][i] for i in idx] for f in got}, [b.lengths[i] for i in idx], [b.keys[i] for i in idx], b.pid, what
        )

    def _check(
        self, got: dict[str, Any], layout: str, want: dict[str, list[str]], lengths: list[int], keys: list[str], pid: str, what: str
    ) -> None:
        matched, problems = compare_rows(got, layout, want, lengths)
        self.t.verified += matched
        for name, j, problem in problems:
            self.t.corrupted += len(keys) if j is None else 1
            self.t.note(
                "corrupted",
                f"{what}: {problem} ({len(keys)} keys)" if j is None else f"{what}: {name!r} of {keys[j]!r} in {pid!r}: {problem}",
            )

    # -- ops
    def op_put(self) -> None:
        n = int(self.rng.integers(1, MAX_BATCH + 1))
        pid = SHARED if self.rng.random() < 0.25 else self.own
        lengths = self._lengths(n)
        others = [f for f in (*JAGGED, *FIXED, *OBJECTS) if f != "ids" and self.rng.random() < 0.4]
        names = ["ids", *others]
        cols = {name: self._column(name, n, lengths) for name in names}
        keys = [f"w{self.idx}-{self.counter}-{j}" for j in range(n)]
        self.counter += 1
        tags = {"w": [self.idx] * n, "j": list(range(n)), "g": [f"g{self.counter}"] * n}
        meta = self._timed("put", lambda: self.client.put(pid, keys, cols, tags=tags))
        sums = {name: [digest(r) for r in rows_of(col)] for name, col in cols.items()}
        self.batches.append(Batch(pid, keys, lengths, sums, tags, meta))
        self.t.samples_written += n
        self.t.bytes_written += sum(_nbytes(c) for c in cols.values())

    def op_get(self) -> None:
        b = self.batches[int(self.rng.integers(len(self.batches)))]
        n = len(b.keys)
        idx = self.rng.permutation(n)[: int(self.rng.integers(1, n + 1))].tolist()  # a subset, in any order
        names = list(b.sums)
        fields = [f for f in names if self.rng.random() < 0.5] or [names[0]]
        layout = str(self.rng.choice(["padded", "jagged", "list"]))
        longest = max(b.lengths[i] for i in idx)
        pad_to = None if self.rng.random() < 0.5 else longest + int(self.rng.integers(0, 9))
        got = self._timed("get", lambda: self.client.get(self._meta(b, idx), fields, layout=layout, pad_to=pad_to))
        self._check_rows(b, idx, got, layout, "get")
        if self.prev_get is not None:  # a result stays valid while held (pooled buffers are not reused under it)
            self._check(*self.prev_get, "held result of the previous get")
        self.prev_get = (
            got,
            layout,
            {f: [b.sums[f][i] for i in idx] for f in got},
            [b.lengths[i] for i in idx],
            [b.keys[i] for i in idx],
            b.pid,
        )

    def op_write_back(self) -> None:
        b = self.batches[int(self.rng.integers(len(self.batches)))]
        name = str(self.rng.choice(WRITE_BACK))
        overwrite = name in b.sums
        n = len(b.keys)
        col = self._column(name, n, b.lengths)
        self._timed("write_back", lambda: self.client.write_back(self._meta(b), {name: col}, overwrite=overwrite))
        b.sums[name] = [digest(r) for r in rows_of(col)]
        self.t.samples_written += n

    def op_discard(self) -> None:
        from tq.errors import KeyNotFoundError

        i = int(self.rng.integers(len(self.batches)))
        b = self.batches[i]
        n = len(b.keys)
        gone = sorted(self.rng.permutation(n)[: int(self.rng.integers(1, n + 1))].tolist())
        meta = self._meta(b, gone)
        got = self._timed("discard", lambda: self.client.discard(meta))
        if got != len(gone):
            self.t.lost += abs(len(gone) - got)
            self.t.note("lost", f"discard of {len(gone)} keys in {b.pid!r} freed {got}")
        keep = [j for j in range(n) if j not in set(gone)]
        if self.rng.random() < 0.2:  # a discarded key must be gone for good
            try:
                self.client.get(self._meta(b, gone[:1]), ["ids"])
                self.t.corrupted += 1
                self.t.note("corrupted", f"discarded key {b.keys[gone[0]]!r} can still be read")
            except KeyNotFoundError:
                pass
        if keep:
            self.batches[i] = Batch(
                b.pid,
                [b.keys[j] for j in keep],
                [b.lengths[j] for j in keep],
                {f: [s[j] for j in keep] for f, s in b.sums.items()},
                {t: [v[j] for j in keep] for t, v in b.tags.items()},
                None if b.meta is None else b.meta.select(keep),
            )
        else:
            del self.batches[i]
        self.prev_get = None

    def op_clear(self) -> None:
        want = self._live(self.own)
        got = self._timed("clear", lambda: self.client.clear_partition(self.own))
        if got != want:
            self.t.lost += abs(want - got)
            self.t.note("lost", f"clear of {self.own!r} freed {got} keys, {want} were live")
        self.batches = [b for b in self.batches if b.pid != self.own]
        self.prev_get = None

    def op_meta(self) -> None:
        """The own partition holds exactly the live keys; a batch's tags and lengths round-trip."""
        m = self._timed("meta", lambda: self.client.get_meta(self.own))
        want = {k for b in self.batches if b.pid == self.own for k in b.keys}
        if set(m.keys) != want:
            self.t.lost += len(want - set(m.keys)) + len(set(m.keys) - want)
            self.t.note(
                "lost",
                f"{self.own!r} holds {len(m.keys)} keys, expected {len(want)} "
                f"(missing {sorted(want - set(m.keys))[:3]}, extra {sorted(set(m.keys) - want)[:3]})",
            )
        if self.batches:
            b = self.batches[int(self.rng.integers(len(self.batches)))]
            m = self._timed("meta", lambda: self.client.get_meta(b.pid, b.keys))
            if (
                list(m.keys) != b.keys
                or list(m.sequence_lengths or ()) != b.lengths
                or {t: list(v) for t, v in m.tags.items() if t in b.tags} != b.tags
                or not set(b.sums) <= set(m.fields)
            ):
                self.t.corrupted += 1
                self.t.note("corrupted", f"metadata of a batch in {b.pid!r} changed: {m.keys[:2]} {m.fields}")

    # -- loop
    def run(self, duration: float) -> None:
        deadline = time.monotonic() + duration
        ops = {
            "put": self.op_put,
            "get": self.op_get,
            "write_back": self.op_write_back,
            "discard": self.op_discard,
            "clear": self.op_clear,
            "meta": self.op_meta,
        }
        p = WEIGHTS / WEIGHTS.sum()
        while time.monotonic() < deadline and self.t.errors < 50:
            op = str(self.rng.choice(OPS, p=p))
            if not self.batches and op in ("get", "write_back", "discard"):
                op = "put"
            elif op == "put" and self._live() + MAX_BATCH > MAX_LIVE_KEYS:
                op = "discard" if self.rng.random() < 0.8 else "clear"
                if op == "discard" and not self.batches:
                    op = "clear"
            self._guarded(op, ops[op])

    def _guarded(self, op: str, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:
            self.t.errors += 1
            self.t.note("error", f"{op}: {type(exc).__name__}: {exc}"[:500])
            self.prev_get = None

    def finish(self) -> None:
        """Verify everything still live, then free it all: own partition cleared, shared keys discarded."""

        def verify_all() -> None:
            for b in self.batches:
                got = self._timed("get", lambda: self.client.get(self._meta(b), list(b.sums), layout="list"))
                self._check_rows(b, list(range(len(b.keys))), got, "list", "final read")

        self._guarded("final verify", verify_all)
        self._guarded("final clear", self.op_clear)
        shared = [b for b in self.batches if b.pid == SHARED]

        def discard_shared() -> None:
            for b in shared:
                got = self._timed("discard", lambda: self.client.discard(self._meta(b)))
                if got != len(b.keys):
                    self.t.lost += abs(len(b.keys) - got)
                    self.t.note("lost", f"final discard of {len(b.keys)} shared keys freed {got}")

        self._guarded("final discard", discard_shared)
        self.batches = []
        self._guarded("final meta", self.op_meta)
        self.client.close()

    def report(self) -> dict[str, Any]:
        return {
            "worker": self.idx,
            "ops": dict(self.t.ops),
            "lat": {k: np.asarray(v, np.float64) for k, v in self.t.lat.items()},
            "errors": self.t.errors,
            "corrupted": self.t.corrupted,
            "lost": self.t.lost,
            "verified": self.t.verified,
            "samples_written": self.t.samples_written,
            "bytes_written": self.t.bytes_written,
            "notes": self.t.notes,
        }


def _nbytes(col: Any) -> int:
    from tq import JaggedTensor

    if isinstance(col, JaggedTensor):
        return col.values.numel() * col.values.element_size()
    if isinstance(col, list):
        return sum(r.numel() * r.element_size() if hasattr(r, "numel") else len(msgpack.packb(r, use_bin_type=True)) for r in col)
    return col.numel() * col.element_size()


def worker_main(
    idx: int, address: str, duration: float, seed: int, transport: str, ready: Any, go: Any, results: Any, start_timeout: float
) -> None:
    """Entry point of one spawned client process."""
    is_ready = False
    try:
        w = SoakWorker(idx, address, seed, transport)
        ready.put(idx)
        is_ready = True
        if not go.wait(start_timeout):
            raise TimeoutError("the soak never started")
        try:
            w.run(duration)
        finally:
            w.finish()
        rep = w.report()
        rep["transport"] = transport
    except BaseException as exc:  # a worker that cannot even run reports it rather than vanishing
        rep = {"worker": idx, "errors": 1, "notes": [f"worker crashed: {type(exc).__name__}: {exc}", traceback.format_exc()[-1500:]]}
        if not is_ready:
            ready.put(idx)
    results.put(rep)


# ----------------------------------------------------------------------------- the driver
def _rss(pid: int) -> int | None:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return None


def _sample(admin: Any, controller_pid: int, t0: float) -> dict[str, Any]:
    st = admin.stats()
    units = []
    for u in st["unit_stats"]:
        journal = f"{u.get('arena_path')}.journal"
        units.append(
            {
                "unit_id": u["unit_id"],
                "bytes_used": u.get("bytes_used"),
                "blocks": u.get("blocks"),
                "pending_allocs": u.get("pending_allocs"),
                "parked_writes": u.get("parked_writes"),
                "rss": _rss(u["pid"]),
                "journal_bytes": os.path.getsize(journal) if os.path.exists(journal) else None,
            }
        )
    return {
        "t_s": round(time.monotonic() - t0, 1),
        "controller_rss": _rss(controller_pid),
        "units": units,
        "keys": sum(p["keys"] for p in st["partitions"]),
        "partitions": len(st["partitions"]),
        "parked_waits": st.get("parked_waits"),
    }


def _settled(admin: Any, timeout: float) -> dict[str, Any]:
    """Unit stats once no fire-and-forget free is in flight (everything at zero, or the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        units = admin.stats()["unit_stats"]
        if (
            all(u.get("bytes_used") == 0 and u.get("blocks") == 0 and u.get("pending_allocs") == 0 for u in units)
            or time.monotonic() > deadline
        ):  # a unit reported down has no counts: not settled
            return units
        time.sleep(0.2)


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q) * 1e3) if values.size else 0.0


def start_processes(ctx: Any, workers: list[Any], n: int, name: str, target: Any, ready: Any, timeout: float, args: Any) -> int:
    """Start ``n`` daemon processes ``target(*args(i))`` (appended to ``workers``) and wait until each
    put something on ``ready``, all of them died, or ``timeout`` ran out; returns how many got ready."""
    for i in range(n):
        p = ctx.Process(target=target, name=f"{name}-{i}", daemon=True, args=args(i))
        p.start()
        workers.append(p)
    n_ready, deadline = 0, time.monotonic() + timeout
    while n_ready < n and time.monotonic() < deadline:
        try:
            ready.get(timeout=1.0)
            n_ready += 1
        except queue.Empty:
            if not any(p.is_alive() for p in workers):
                break
    return n_ready


def run_soak(
    procs: int = 32,
    duration: float = 600.0,
    *,
    units: int = 2,
    capacity: int = 1 << 30,
    seed: int = 0,
    sample_every: float = 30.0,
    transport: str = "mixed",
    log: Any = print,
) -> dict[str, Any]:
    """Run the soak and return its report (see the module docstring); ``report["ok"]`` is the verdict."""
    from tq import TQClient, TQServer

    ctx = mp.get_context("spawn")
    started = time.time()
    with TQServer(storage_units=units, capacity=capacity) as server:
        admin = TQClient(server.address, timeout=120.0, transport="tcp")
        admin.register_partition(SHARED)
        t0 = time.monotonic()
        memory = {"start": _sample(admin, server.proc.pid, t0), "during": []}
        ready, go, results = ctx.Queue(), ctx.Event(), ctx.Queue()
        start_timeout = 120.0 + 5.0 * procs
        workers: list[Any] = []
        try:
            n_ready = start_processes(
                ctx,
                workers,
                procs,
                "tq-soak",
                worker_main,
                ready,
                start_timeout,
                lambda i: (
                    i,
                    server.address,
                    duration,
                    seed,
                    transport if transport != "mixed" else ("auto", "tcp")[i % 2],
                    ready,
                    go,
                    results,
                    start_timeout,
                ),
            )
            log(f"{n_ready}/{procs} client processes ready after {time.monotonic() - t0:.0f}s; running {duration:.0f}s")
            go.set()
            t_go = time.monotonic()
            reports: list[dict[str, Any]] = []
            end = t_go + duration + 300.0  # the final verification and clears get five minutes
            next_sample = t_go + min(sample_every, duration / 2)
            while len(reports) < procs and time.monotonic() < end:
                try:
                    reports.append(results.get(timeout=max(0.1, min(1.0, next_sample - time.monotonic()))))
                except queue.Empty:
                    pass
                if time.monotonic() >= next_sample and time.monotonic() < t_go + duration:
                    s = _sample(admin, server.proc.pid, t0)
                    memory["during"].append(s)
                    log(
                        f"  t={s['t_s']:.0f}s keys={s['keys']} controller RSS {s['controller_rss'] / MiB:.0f} MiB, "
                        f"units used {[round(u['bytes_used'] / MiB, 1) for u in s['units']]} MiB"
                    )
                    next_sample += sample_every
                if len(reports) < procs and not any(p.is_alive() for p in workers) and results.empty():
                    break
            elapsed = time.monotonic() - t_go
        finally:
            for p in workers:
                p.join(timeout=max(0.0, 10.0))
            stragglers = [p for p in workers if p.is_alive()]
            for p in stragglers:
                p.kill()
                p.join(timeout=10)

        # the final clear: the shared partition should already be empty (each process discarded its keys)
        leftover_shared = admin.clear_partition(SHARED)
        partitions = admin.list_partitions()
        leftover_keys = sum(p["keys"] for p in partitions)
        units_after = _settled(admin, 30.0)
        memory["after_clear"] = _sample(admin, server.proc.pid, t0)
        admin.trim()
        memory["after_trim"] = _sample(admin, server.proc.pid, t0)
        server_ops = admin.stats()["ops"]
        for p in partitions:
            admin.drop_partition(p["partition"])
        admin.close()

    # ------------------------------------------------------------------ verdict
    lat: dict[str, list[np.ndarray]] = collections.defaultdict(list)
    ops: collections.Counter = collections.Counter()
    totals = collections.Counter()
    notes = []
    for r in reports:
        for k in ("errors", "corrupted", "lost", "verified", "samples_written", "bytes_written"):
            totals[k] += int(r.get(k, 0))
        ops.update(r.get("ops", {}))
        for op, v in r.get("lat", {}).items():
            lat[op].append(v)
        notes += [f"w{r['worker']}: {n}" for n in r.get("notes", [])]
    missing = procs - len(reports)
    totals["errors"] += missing + len(stragglers)
    if missing or stragglers:
        notes.append(f"{missing} process(es) never reported, {len(stragglers)} had to be killed")
    latency = {
        op: {
            "count": int(sum(a.size for a in v)),
            "p50_ms": _pct(np.concatenate(v), 50),
            "p99_ms": _pct(np.concatenate(v), 99),
            "max_ms": _pct(np.concatenate(v), 100),
        }
        for op, v in sorted(lat.items())
    }
    all_lat = np.concatenate([a for v in lat.values() for a in v]) if lat else np.empty(0)
    warm = memory["during"][0] if memory["during"] else memory["start"]
    during = [(d["t_s"], d["controller_rss"]) for d in memory["during"] if d["controller_rss"]]
    long_enough = len(during) >= 3 and during[-1][0] - during[0][0] >= 60.0
    drift = round(float(np.polyfit(*zip(*during), 1)[0]) * 60 / MiB, 2) if long_enough else None  # MiB per minute
    ctrl_after = memory["after_clear"]["controller_rss"] or 0
    rss_growth = ctrl_after - (warm["controller_rss"] or 0)
    units_clean = all(
        u["bytes_used"] == 0 and u["blocks"] == 0 and u["pending_allocs"] == 0 and u["parked_writes"] == 0 for u in units_after
    )
    leak = not units_clean or leftover_keys > 0 or leftover_shared > 0 or rss_growth > RSS_GROWTH_LIMIT
    total_ops = sum(ops.values())
    report = {
        "config": {
            "procs": procs,
            "duration_s": duration,
            "units": units,
            "capacity_bytes": capacity,
            "seed": seed,
            "transport": transport,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "python": sys.version.split()[0],
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        },
        "elapsed_s": round(elapsed, 1),
        "ops": dict(ops),
        "total_ops": total_ops,
        "ops_per_s": round(total_ops / max(elapsed, 1e-9), 1),
        "latency_ms": latency,
        "p99_ms_all": _pct(all_lat, 99),
        "p50_ms_all": _pct(all_lat, 50),
        "errors": totals["errors"],
        "corrupted": totals["corrupted"],
        "lost": totals["lost"],
        "verified_samples": totals["verified"],
        "samples_written": totals["samples_written"],
        "bytes_written": totals["bytes_written"],
        "leftover_keys": leftover_keys + leftover_shared,
        "units_after_clear": [
            {k: u[k] for k in ("unit_id", "bytes_used", "blocks", "pending_allocs", "parked_writes")} for u in units_after
        ],
        "controller_rss_growth_after_warmup": rss_growth,
        "leak": leak,
        # Reported, not judged: how fast the controller's RSS climbed under load while live keys stayed flat.
        "controller_rss_drift_mib_per_min": drift,
        "memory": memory,
        "server_ops": server_ops,
        "notes": notes[:60],
    }
    report["ok"] = report["errors"] == 0 and report["corrupted"] == 0 and report["lost"] == 0 and not leak
    return report


def summary(r: dict[str, Any]) -> str:
    m = r["memory"]
    ctrl = [
        m["start"]["controller_rss"],
        max((s["controller_rss"] or 0) for s in m["during"]) if m["during"] else None,
        m["after_clear"]["controller_rss"],
    ]
    peak_used = max((sum(u["bytes_used"] for u in s["units"]) for s in m["during"]), default=0)
    lines = [
        f"TQ soak: {r['config']['procs']} processes x {r['elapsed_s']:.0f}s, {r['config']['units']} storage units "
        f"({r['config']['machine']})",
        f"  {r['total_ops']} ops ({r['ops_per_s']:.0f}/s), {r['samples_written']} samples / {r['bytes_written'] / MiB:.0f} MiB "
        f"written, {r['verified_samples']} (key, field) rows verified by sha256",
        "  latency p50 / p99 / max (ms): "
        + ", ".join(f"{op} {v['p50_ms']:.1f} / {v['p99_ms']:.1f} / {v['max_ms']:.0f}" for op, v in r["latency_ms"].items()),
        f"  all ops: p50 {r['p50_ms_all']:.1f} ms, p99 {r['p99_ms_all']:.1f} ms",
        f"  errors {r['errors']}, corrupted {r['corrupted']}, lost {r['lost']}, keys left {r['leftover_keys']}",
        f"  storage used: start {sum(u['bytes_used'] for u in m['start']['units'])} B, peak {peak_used / MiB:.1f} MiB, "
        f"after clear {sum(u['bytes_used'] for u in r['units_after_clear'])} B",
        "  controller RSS (MiB): start {}, peak {}, after clear {} (growth after warm-up {:+.1f}{})".format(
            *(f"{v / MiB:.0f}" if v else "?" for v in ctrl),
            r["controller_rss_growth_after_warmup"] / MiB,
            ""
            if r["controller_rss_drift_mib_per_min"] is None
            else f"; drift under load {r['controller_rss_drift_mib_per_min']:+.2f} MiB/min",
        ),
        f"  verdict: {'OK' if r['ok'] else 'FAILED'}" + ("" if r["ok"] else f" (leak: {r['leak']})"),
    ]
    lines += [f"  ! {n}" for n in r["notes"][:10]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line (every option with its help)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1]
    )
    p.add_argument("--procs", type=int, default=32, help="concurrent client processes (default 32)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--units", type=int, default=2, help="storage units (default 2)")
    p.add_argument("--capacity", type=int, default=1 << 30, help="total storage bytes, split over the units (default 1 GiB)")
    p.add_argument("--seed", type=int, default=0, help="seed of every process's random operations and shapes (default 0)")
    p.add_argument(
        "--transport",
        choices=["mixed", "auto", "tcp"],
        default="mixed",
        help="how clients reach the storage units: mixed = half shared memory, half TCP (default); "
        "auto = shared memory where on the same host; tcp = TCP only",
    )
    p.add_argument("--sample-every", type=float, default=30.0, help="seconds between memory samples (default 30)")
    add_output_args(p, "tq_soak")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.procs < 1 or a.units < 1 or a.duration <= 0 or a.capacity <= 0 or a.sample_every <= 0:
        p.error("--procs, --units, --duration, --capacity and --sample-every must be positive")
    out = open_run("tq_soak", a.run_dir)
    r = run_soak(a.procs, a.duration, units=a.units, capacity=a.capacity, seed=a.seed, sample_every=a.sample_every, transport=a.transport)
    text = summary(r)
    with open(out.path(".json"), "w") as f:
        json.dump(r, f, indent=1, default=str)
    with open(out.path(".md"), "w") as f:
        f.write(f"# TQ soak\n\n```\n{text}\n```\n")
    print(text)
    out.finish(a.publish, a.machine)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
