"""Put/get throughput of the TQ service against Ray's object store, the `transferqueue` package and a
plain memory copy of the same bytes, plus the latency of 1-key puts and gets and of small control operations.

Every system moves the same GRPO-shaped batch (jagged ``input_ids`` int64, ``generation_logprobs`` and
``prev_logprobs`` float32, ``token_mask`` bool, per-sample ``rewards``): a producer in another process
writes it, the benchmark process reads it back as padded dense torch tensors (what a training worker
needs). Throughput counts the batch's unpadded bytes over the wall time of the call. Each size runs
``--iters`` times with fresh data and keys (3x up to 32 MiB). A system's first get of a size is its
cold get (fresh pages are faulted in) and is reported on its own; the warm table is the median of
the other iterations, pooled over ``--rounds`` rounds of every system run in turn, so a slow phase of
a shared machine does not land on one system only.

Every system runs its best documented configuration, and every timed get ends in the same padded
tensors made by the same padding code as TQ's padded get makes its result (every field into one pooled
result buffer, ``tq.bufferpool``, by one call of TQ's C row copier, ``tq.rowcopy.copy_fields``, on as many
threads as TQ's get: torch's intra-op threads, at most 8):
  TQ             ``TQClient.get`` (padded layout), one storage unit, one partition reused.
  Ray            ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1``, Ray's switch for zero-copy torch tensors
                 (ray/_private/ray_constants.py; ray-project/ray PR 57639): an actor ``ray.put``s the
                 flat columns, the driver's ``ray.get`` returns read-only views of the object store and
                 pads them. "Ray views": the actor stores padded tensors and the get returns read-only
                 views of them, nothing copied - the bound for a get that copies nothing.
  transferqueue  its defaults (``transfer_queue.init()``: SimpleStorage, 2 storage units), one partition
                 reused. Its get returns jagged nested tensors: [pad] jagged nested tensors put, the get's
                 values/offsets views padded; [views] padded tensors put, the get's equal-length rows
                 viewed as dense tensors (no copy after the get). The faster get is compared.
  Both baselines put both forms ([jagged], [padded]); the faster put is compared (the same unpadded
  payload is counted either way).
  memcpy         ``np.copyto`` of the payload a producer process just wrote into shared memory (one thread:
                 the ceiling of a one-thread copy).
  padding only   the padding every timed get ends in, of those same bytes, and nothing else: what a get
                 that cost only its copy would reach (padding only / Ray get: such a get against Ray).
  TQ growing     TQ's get of a 32 MiB batch grown 3% a step (as a GRPO run's responses lengthen): each
                 get needs a larger result buffer than any before it.

    python -m benchmarks.tq_throughput                 # 8 MiB .. 512 MiB, all systems (~15 minutes on 2 cores)
    python -m benchmarks.tq_throughput --quick         # 8 and 32 MiB, fewer iterations, 1 round
    python -m benchmarks.tq_throughput --from-json logs/tq_throughput/<run>/tq_throughput.json   # rebuild its report

Results go to a fresh ``logs/tq_throughput/<timestamp>/`` (``tq_throughput.json``, ``tq_throughput.md``);
``--publish`` also writes ``benchmarks/results/tq_throughput_<machine>.{json,md}``. The `transferqueue`
package comes with the ``[bench]`` extra (``pip install -e '.[bench]'``); without it its columns read n/a.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import uuid
import warnings
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from benchmarks.outputs import add_output_args, code_version, cpu_model, open_run

MiB = 1 << 20
MAX_LEN = 4096
# The bars: ratios of warm medians measured in the same run (at every batch size); the p99 of every
# small operation (1-key puts and gets included) against the project's 1 ms; TQ's cold get; and the
# slowest warm TQ get against its median (a buffer-pool miss shows up there).
TARGETS = {
    "get_vs_transferqueue": 5.0,
    "get_vs_ray": 2.0,
    "get_vs_memcpy": 0.4,
    "put_vs_transferqueue": 3.0,
    "tcp_get_vs_transferqueue": 2.0,
    "borrowed_vs_ray_views": 1.0,
}
CONTROL_P99_MS = 1.0
# 1-key puts and gets on the same host have a tighter bar: one round trip each
CONTROL_P99_BARS_MS = {"put, 1 key (same host)": 0.5, "get, 1 key (same host)": 0.5}
COLD_GET_GBPS = 2.0
WARM_FLOOR = 0.5
# Growing batches: TQ's gets of a batch of GROWING_MIB (or the largest size run, if smaller) that
# grows by GROWTH a step, as a GRPO run's responses lengthen while it trains - every get needs a
# larger result buffer than the last one had.
GROWING_MIB, GROWTH = 32, 0.03
FIELDS = ("input_ids", "generation_logprobs", "prev_logprobs", "token_mask")
BYTES_PER_TOKEN = 8 + 4 + 4 + 1
SYSTEMS = ("tq", "tq_tcp", "ray", "transferqueue", "tq_growing")
RAY_ZERO_COPY_ENV = {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}
INSTALL_TRANSFERQUEUE = "transferqueue not installed: pip install -e '.[bench]' (or pip install transferqueue==0.1.11)"


class Unavailable(Exception):
    """A system that cannot run here; the message says why and what to do about it."""


# ----------------------------------------------------------------------------- the batch
def _iters(size: int, iters: int) -> int:
    """Iterations at one batch size: three times ``iters`` up to 32 MiB, where one call takes a few
    milliseconds and a median of few samples would be at the mercy of scheduler noise."""
    return 3 * iters if size <= 32 * MiB else iters


WARMUP_BYTES = 1 << 20  # each system's untimed first round, before any timed size


def batch_lengths(nbytes: int, seed: int) -> np.ndarray:
    """Response lengths (uniform in [MAX_LEN/4, MAX_LEN]) until the batch holds ~``nbytes``."""
    rng = np.random.default_rng(seed)
    mean = 5 * MAX_LEN / 8
    n = max(8, int(nbytes / (BYTES_PER_TOKEN * mean + 4)))
    return rng.integers(MAX_LEN // 4, MAX_LEN + 1, size=n)


def make_batch(nbytes: int, seed: int) -> dict[str, Any]:
    """Jagged columns as (values, offsets) plus per-sample rewards; deterministic in ``seed``."""
    lengths = batch_lengths(nbytes, seed)
    total = int(lengths.sum())
    g = torch.Generator().manual_seed(seed)
    offsets = torch.zeros(lengths.size + 1, dtype=torch.int64)
    offsets[1:] = torch.from_numpy(np.cumsum(lengths))
    return {
        "offsets": offsets,
        "input_ids": torch.randint(0, 150_000, (total,), generator=g),
        "generation_logprobs": -torch.rand(total, generator=g),
        "prev_logprobs": -torch.rand(total, generator=g),
        "token_mask": torch.rand(total, generator=g) > 0.1,
        "rewards": torch.rand(lengths.size, generator=g),
    }


def tq_columns(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch as a TQ put takes it: each jagged field a :class:`tq.JaggedTensor`, plus its rewards."""
    from tq import JaggedTensor

    cols: dict[str, Any] = {f: JaggedTensor(batch[f], batch["offsets"]) for f in FIELDS}
    cols["rewards"] = batch["rewards"]
    return cols


def batch_bytes(batch: dict[str, Any]) -> list[np.ndarray]:
    """The payload of a batch as raw bytes, field by field (``FIELDS``, then ``rewards``)."""
    return [batch[f].numpy().view(np.uint8).reshape(-1) for f in (*FIELDS, "rewards")]


def payload_bytes(nbytes: int, seed: int) -> int:
    """Unpadded bytes of ``make_batch(nbytes, seed)`` (every token's fields plus a float32 reward each)."""
    lengths = batch_lengths(nbytes, seed)
    return int(lengths.sum()) * BYTES_PER_TOKEN + 4 * lengths.size


def padded(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The batch as padded dense tensors (the form a trainer consumes), for checking what a get returned."""
    from tq.jagged import JaggedTensor

    out = {f: JaggedTensor(batch[f], batch["offsets"]).to_padded() for f in FIELDS}
    out["rewards"] = batch["rewards"]
    return out


def pad_fields(fields: dict[str, tuple[torch.Tensor, np.ndarray]], pool: Any) -> dict[str, torch.Tensor]:
    """Each field's ``(values, offsets)`` as a ``[n, longest]`` zero-padded tensor (row i is
    ``values[offsets[i]:offsets[i + 1]]``), made as TQ's own padded get makes its result: every field in
    one buffer of ``pool`` (a ``tq.bufferpool.HostBufferPool``), each part on a cache line, copied by
    one call of TQ's C row copier (``tq.rowcopy.copy_fields``) on as many threads
    (``tq.client.copy_threads``) - so every system's timed get ends in the same work. ``values`` may be
    read-only."""
    from tq.client import copy_threads
    from tq.rowcopy import copy_fields

    jobs, parts, at = [], [], 0
    for name, (values, offsets) in fields.items():
        item = values.element_size()
        sizes = (offsets[1:] - offsets[:-1]) * item
        n, span = sizes.size, int(sizes.max())
        src = values.numpy().reshape(-1).view(np.uint8)
        jobs.append((at, [src], np.zeros(n, dtype=np.int64), offsets[:-1] * item, sizes, span, bytes(item)))
        parts.append((name, at, n, span // item, values.dtype))
        at = -(-(at + n * span) // 64) * 64
    dst = pool.empty(at)
    out = {name: torch.from_numpy(dst[a : a + rows * w * d.itemsize]).view(d).reshape(rows, w) for name, a, rows, w, d in parts}
    copy_fields(dst, jobs, copy_threads())
    return out


def pad_batch(columns: dict[str, torch.Tensor], offsets: torch.Tensor, pool: Any) -> dict[str, torch.Tensor]:
    """Every jagged field of a fetched flat batch padded by :func:`pad_fields`, plus its rewards."""
    off = offsets.numpy()
    out = pad_fields({f: (columns[f], off) for f in FIELDS}, pool)
    out["rewards"] = columns["rewards"]
    return out


def _check(got: dict[str, torch.Tensor], batch: dict[str, Any]) -> None:
    """The first iteration of every system is verified against the source batch."""
    want = padded(batch)
    for f, t in want.items():
        if not torch.equal(got[f], t):
            raise AssertionError(f"field {f} came back different")


# ----------------------------------------------------------------------------- TQ
def _one_torch_thread() -> None:
    """Producer processes build batches with one torch thread, as Ray runs the Ray and transferqueue
    producers (its workers get OMP_NUM_THREADS=1). With more, torch's OpenMP threads keep spinning
    after building a batch, on the cores the put then needs: measured on the 16-vCPU H100 host, an
    alloc round trip took 3.7 ms after a batch built with 16 threads and 0.57 ms with one."""
    torch.set_num_threads(1)


def _tq_producer(address: str, transport: str, conn: Any) -> None:
    """A producer process: builds batches on request and puts them; reports the put's wall time."""
    from tq import TQClient

    _one_torch_thread()

    client = TQClient(address, transport=transport, timeout=120)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        nbytes, seed, partition = msg
        b = make_batch(nbytes, seed)
        keys = [f"s{seed}_{i}" for i in range(len(b["rewards"]))]
        cols = tq_columns(b)
        t0 = time.perf_counter()
        meta = client.put(partition, keys, cols)
        conn.send((time.perf_counter() - t0, meta.to_dict()))
    client.close()


def bench_tq(sizes: list[int], iters: int, transport: str, growth: float = 0.0) -> dict[int, dict[str, Any]]:
    """TQ: a producer process puts each batch, this process gets it back padded (``TQClient.get``).
    ``growth``: each batch of a size is this fraction larger than the one before (see GROWTH)."""
    from tq import KVBatchMeta, TQClient, TQServer

    results: dict[int, dict[str, Any]] = {}
    ctx = mp.get_context("spawn")
    with TQServer(storage_units=1, capacity=max(sizes) * 3 + (256 * MiB)) as server:
        client = TQClient(server.address, transport=transport, timeout=120)
        partition = f"bench-{uuid.uuid4().hex[:6]}"
        client.register_partition(partition)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_tq_producer, args=(server.address, transport, child), daemon=True)
        proc.start()
        try:
            # One untimed round first: a client's first get also maps the arena and the location
            # table, which is set-up, not what the cold column measures (fresh pages of a new size).
            parent.send((WARMUP_BYTES, 0, partition))
            meta = KVBatchMeta.from_dict(parent.recv()[1])
            client.get(meta, [*FIELDS, "rewards"])
            if transport == "auto":
                client.get(meta, [*FIELDS, "rewards"], layout="jagged", copy=False).release()
            client.discard(meta)
            for size in sizes:
                res = results.setdefault(size, {"put": [], "get": [], **({"borrowed": []} if transport == "auto" else {})})
                for it in range(_iters(size, iters)):
                    seed, nbytes = size // MiB * 1000 + it, int(size * (1 + growth) ** it)
                    parent.send((nbytes, seed, partition))
                    put_s, meta_d = parent.recv()
                    meta = KVBatchMeta.from_dict(meta_d)
                    t0 = time.perf_counter()
                    got = client.get(meta, [*FIELDS, "rewards"])
                    get_s = time.perf_counter() - t0
                    payload = payload_bytes(nbytes, seed)
                    res.setdefault("bytes", payload)  # the table's payload column: the first batch
                    res["put"].append(payload / put_s)
                    res["get"].append(payload / get_s)
                    if it == 0:
                        _check(got, make_batch(nbytes, seed))
                    del got
                    if transport == "auto":  # the borrowed get: read-only views of the arena, nothing copied
                        t0 = time.perf_counter()
                        got = client.get(meta, [*FIELDS, "rewards"], layout="jagged", copy=False)
                        res["borrowed"].append(payload / (time.perf_counter() - t0))
                        if it == 0:
                            _check_jagged(got, make_batch(nbytes, seed))
                        got.release()
                        del got
                    client.discard(meta)
        finally:
            parent.send(None)
            proc.join(30)
            client.close()
    return results


# ----------------------------------------------------------------------------- concurrent writers and readers
WRITERS_TARGET = 2.5  # aggregate put with 4 writers over one writer (a host with >= 8 cores)


def _sweep_worker(address: str, partition: str, wid: int, nbytes: int, n_puts: int, conn: Any) -> None:
    """One writer and reader of the sweep: builds its batches up front, then on each command puts them
    all (or gets them all back padded, or discards them) and reports when it started and finished.
    With a profile asked for, the put pass runs under cProfile and sends its top functions."""
    import cProfile
    import io
    import pstats

    from tq import TQClient

    _one_torch_thread()
    client = TQClient(address, timeout=120)
    batches = []
    for i in range(n_puts):
        seed = 10_000 * (wid + 1) + i
        batches.append((payload_bytes(nbytes, seed), tq_columns(make_batch(nbytes, seed))))
    conn.send(sum(n for n, _ in batches))
    metas: list[Any] = []
    while (msg := conn.recv()) is not None:
        op, tag, profile = msg
        if op == "small":  # ``profile``: how many 1-key puts, each timed
            conn.send(_small_puts(client, partition, f"w{wid}-{tag}", profile))
            continue
        prof = cProfile.Profile() if profile else None
        t0 = time.monotonic()  # CLOCK_MONOTONIC: comparable across the processes of one host
        if op == "put":
            if prof:
                prof.enable()
            metas = [
                client.put(partition, [f"w{wid}-{tag}-{i}-{j}" for j in range(len(cols["rewards"]))], cols)
                for i, (_, cols) in enumerate(batches)
            ]
            if prof:
                prof.disable()
        elif op == "get":
            for m in metas:
                client.get(m)
        else:
            for m in metas:
                client.discard(m)
        t1 = time.monotonic()
        top = ""
        if prof:
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(8)
            top = buf.getvalue()
        conn.send((t0, t1, top))
    client.close()


def _small_puts(client: Any, partition: str, prefix: str, n: int) -> tuple[float, float, list[float]]:
    """``n`` timed 1-key puts (after CONTROL_WARMUP untimed ones): (start, end, each put's seconds)."""
    row, key = {"x": torch.arange(1)}, itertools.count()
    return timed_calls(lambda: client.put(partition, [f"{prefix}-{next(key)}"], row), n, CONTROL_WARMUP)


def bench_writers(counts: list[int], nbytes: int, n_puts: int, profile_at: int = 4, small_puts: int = 0) -> dict[str, Any]:
    """Aggregate put and get GB/s of ``n`` concurrent writer (then reader) processes for each ``n`` in
    ``counts``: each puts ``n_puts`` batches of ``nbytes`` into one service (one storage unit), then
    gets its own back padded. Each count runs twice: into an arena whose free pages were given back
    to the OS (``cold``: every write faults fresh pages in) and again into the same, now warm, pages.
    Then, with ``small_puts``, ``n`` writers each make that many 1-key puts at once (``small_rows``:
    aggregate puts/s and the latency of every put), the control plane's load of many rollout workers
    streaming one sample at a time."""
    from tq import TQClient, TQServer

    ctx = mp.get_context("spawn")
    top = max(counts)
    capacity = top * n_puts * (nbytes + 4 * MiB) + 256 * MiB
    out: dict[str, Any] = {
        "counts": counts,
        "batch_bytes": nbytes,
        "puts_per_writer": n_puts,
        "cores": os.cpu_count(),
        "rows": [],
        "profiles": {},
    }
    with TQServer(storage_units=1, capacity=capacity) as server, TQClient(server.address, timeout=120) as admin:
        partition = f"sweep-{uuid.uuid4().hex[:6]}"
        admin.register_partition(partition)
        pipes, procs = [], []
        for w in range(top):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_sweep_worker, args=(server.address, partition, w, nbytes, n_puts, child), daemon=True)
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        try:
            payload = [p.recv() for p in pipes]

            def run(n: int, op: str, tag: str, profile: bool = False) -> float:
                for i, p in enumerate(pipes[:n]):
                    p.send((op, tag, profile and i == 0))
                got = [p.recv() for p in pipes[:n]]
                if got[0][2]:
                    out["profiles"][f"{n} writers, {tag}"] = got[0][2]
                return sum(payload[:n]) / (max(t1 for _, t1, _ in got) - min(t0 for t0, _, _ in got))

            def freed() -> None:
                """Wait until the unit applied the discards' frees (they are sent after the reply): the
                next pass then reuses the same pages instead of faulting fresh ones in."""
                deadline = time.monotonic() + 30
                while admin.stats()["unit_stats"][0]["bytes_used"] and time.monotonic() < deadline:
                    time.sleep(0.01)

            for n in counts:
                row: dict[str, Any] = {"writers": n}
                for tag in ("cold", "warm", "warm2", "warm3"):
                    freed()
                    if tag == "cold":
                        admin.trim()  # free pages back to the OS: this pass faults them in again
                    row[f"put_{tag}"] = run(n, "put", tag, profile=n == profile_at and tag in ("cold", "warm"))
                    row[f"get_{tag}"] = run(n, "get", tag)
                    run(n, "discard", tag)
                for op in ("put", "get"):  # warm: the median of three passes over the same pages
                    row[f"{op}_warm_passes"] = [row.pop(f"{op}_{t}") for t in ("warm", "warm2", "warm3")]
                    row[f"{op}_warm"] = statistics.median(row[f"{op}_warm_passes"])
                out["rows"].append(row)
                print(
                    f"  {n} writers: put {row['put_cold'] / 1e9:.2f} cold, {row['put_warm'] / 1e9:.2f} warm GB/s; "
                    f"get {row['get_warm'] / 1e9:.2f} GB/s",
                    file=sys.stderr,
                    flush=True,
                )
            if small_puts:
                out["small_puts_per_writer"], out["small_rows"] = small_puts, []
                for n in counts:
                    for p in pipes[:n]:
                        p.send(("small", f"small{n}", small_puts))
                    got = [p.recv() for p in pipes[:n]]
                    lat = np.concatenate([g[2] for g in got]) * 1e3
                    wall = max(g[1] for g in got) - min(g[0] for g in got)
                    out["small_rows"].append({"writers": n, "puts_per_s": n * small_puts / wall, **latency_summary(lat / 1e3)})
                    print(f"  {n} writers: {n * small_puts / wall:,.0f} 1-key puts/s", file=sys.stderr, flush=True)
                    admin.clear_partition(partition)
            st = admin.stats()
            out["controller_ops"] = {k: v for k, v in st["ops"].items() if k in ("commit", "locate", "discard")}
            out["unit_ops"] = {k: v for k, v in st["unit_stats"][0]["ops"].items() if k in ("alloc", "store", "adopt")}
        finally:
            for p in pipes:
                try:
                    p.send(None)
                except OSError:
                    pass
            for proc in procs:
                proc.join(30)
    return out


def writers_report(res: dict[str, Any]) -> str:
    """The sweep's table and its target (aggregate put with 4 writers over one writer, warm)."""
    rows = res["rows"]
    one = next((r for r in rows if r["writers"] == 1), None)
    lines = [
        f"Machine: {res.get('machine', machine_info())}",
        "",
        f"Concurrent writers, then readers, of one service (1 storage unit): each puts {res['puts_per_writer']} "
        f"GRPO-shaped batches of {res['batch_bytes'] // MiB} MiB, then gets them back padded. GB/s of payload "
        "over the wall time from the first start to the last finish. cold: the arena's free pages were given "
        "back to the OS first (every write faults fresh pages in); warm: the same pages again (the median of "
        "three passes, each after the unit applied the previous pass's frees).",
        "",
        "| writers | put GB/s cold | put GB/s warm | warm put / 1 writer | get GB/s cold | get GB/s warm | warm get / 1 reader |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['writers']} | {r['put_cold'] / 1e9:.2f} | {r['put_warm'] / 1e9:.2f} | "
            f"{r['put_warm'] / one['put_warm']:.2f}x | {r['get_cold'] / 1e9:.2f} | {r['get_warm'] / 1e9:.2f} | "
            f"{r['get_warm'] / one['get_warm']:.2f}x |"
            if one
            else ""
        )
    four = next((r for r in rows if r["writers"] == 4), None)
    if one and four:
        ratio = four["put_warm"] / one["put_warm"]
        cores_ok = (res.get("cores") or 0) >= 8
        met = ratio >= WRITERS_TARGET
        res["target"] = {"target": WRITERS_TARGET, "measured": ratio, "met": met, "cores": res.get("cores")}
        lines += [
            "",
            f"Target: aggregate put with 4 writers >= {WRITERS_TARGET}x one writer (warm), on >= 8 cores: "
            f"{ratio:.2f}x on {res.get('cores')} cores - "
            + ("met" if met else "NOT met")
            + ("" if cores_ok else " (this host has fewer than 8 cores: not the target's host)"),
        ]
    small = res.get("small_rows")
    if small:
        one_small = next((r for r in small if r["writers"] == 1), small[0])
        lines += [
            "",
            f"1-key puts (same host): each of n writers makes {res['small_puts_per_writer']} puts of one key, all "
            f"at once (after {CONTROL_WARMUP} untimed each); puts/s over the wall time from the first start to the "
            "last finish, and the latency of every put.",
            "",
            "| writers | 1-key puts/s | / 1 writer | p50 ms | p99 ms |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['writers']} | {r['puts_per_s']:,.0f} | {r['puts_per_s'] / one_small['puts_per_s']:.2f}x | "
            f"{r['p50_ms']:.3f} | {r['p99_ms']:.3f} |"
            for r in small
        ]
    for name, text in res.get("profiles", {}).items():
        lines += ["", f"Profile of writer 0's puts ({name}), top functions by own time:", "", "```", text.strip(), "```"]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the baselines' two forms
def run_forms(
    sizes: list[int],
    iters: int,
    put: Callable[[int, int, str], tuple[float, Any]],
    get: Callable[[Any, str], tuple[dict[str, torch.Tensor], Callable[[], None]]],
) -> dict[int, dict[str, Any]]:
    """Time a baseline in both forms at every size: ``pad`` (the flat columns stored, padded after the
    get; ``put``/``get``) and ``views`` (padded tensors stored; ``put_padded``/``get_views``).
    ``put(size, seed, form)`` stores a batch elsewhere and returns (its put seconds, a handle);
    ``get(handle, form)`` is the timed get, returning the padded tensors and what frees the batch."""
    results: dict[int, dict[str, Any]] = {}
    for form in ("pad", "views"):  # untimed: a first get's set-up is not what the cold column measures
        _, handle = put(WARMUP_BYTES, 0, form)
        got, free = get(handle, form)
        del got, handle
        free()
    for size in sizes:
        res = results.setdefault(size, {"put": [], "get": [], "put_padded": [], "get_views": []})
        for form, put_key, get_key in (("pad", "put", "get"), ("views", "put_padded", "get_views")):
            for it in range(_iters(size, iters)):
                seed = size // MiB * 1000 + it
                put_s, handle = put(size, seed, form)
                t0 = time.perf_counter()
                got, free = get(handle, form)
                get_s = time.perf_counter() - t0
                nbytes = payload_bytes(size, seed)
                res.setdefault("bytes", nbytes)
                if it == 0:
                    _check(got, make_batch(size, seed))
                res[put_key].append(nbytes / put_s)
                res[get_key].append(nbytes / get_s)
                del got, handle
                free()
    return results


# ----------------------------------------------------------------------------- Ray
def _import_ray_zero_copy() -> Any:
    """``ray`` with zero-copy torch tensors on in this process. Ray reads the switch when it is first
    imported, so it is set before; a process that imported Ray earlier cannot turn it on."""
    os.environ.update(RAY_ZERO_COPY_ENV)
    import ray
    from ray._private import ray_constants

    if not ray_constants.RAY_ENABLE_ZERO_COPY_TORCH_TENSORS:
        raise Unavailable(
            "Ray was imported before its zero-copy tensors could be switched on: run the benchmark "
            "in a fresh process (python -m benchmarks.tq_throughput)"
        )
    return ray


def bench_ray(sizes: list[int], iters: int) -> dict[int, dict[str, Any]]:
    """Ray's object store with zero-copy torch tensors: an actor ray.put()s the batch, the driver
    ray.get()s it. ``put``/``get``: the flat columns, padded after the get like every system;
    ``put_padded``/``get_views``: padded tensors stored, the get returns read-only views (no copy)."""
    from tq.bufferpool import HostBufferPool

    ray = _import_ray_zero_copy()

    @ray.remote(num_cpus=0.1)
    class Producer:
        def put(self, nbytes: int, seed: int, form: str) -> tuple[float, list]:
            b = make_batch(nbytes, seed)
            obj = padded(b) if form == "views" else b
            t0 = time.perf_counter()
            ref = ray.put(obj)
            self.ref = ref  # keep the owner alive
            return time.perf_counter() - t0, [ref]

    pool = HostBufferPool()
    # Ray's documented way to switch it on in every worker too: the job's runtime_env. A cluster of its
    # own ("local"): ray.init() would join any cluster `ray start` left on this machine.
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": RAY_ZERO_COPY_ENV},
        object_store_memory=max(sizes) * 4 + (512 * MiB),
    )
    try:
        prod = Producer.remote()

        def put(size: int, seed: int, form: str) -> tuple[float, Any]:
            put_s, [ref] = ray.get(prod.put.remote(size, seed, form))
            return put_s, ref

        def get(ref: Any, form: str) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
            obj = ray.get(ref)  # read-only views of the object store
            return (obj if form == "views" else pad_batch(obj, obj["offsets"], pool)), lambda: None

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns once that the object store's arrays are read-only
            return run_forms(sizes, iters, put, get)
    finally:
        ray.shutdown()


# ----------------------------------------------------------------------------- transferqueue package
def bench_transferqueue(sizes: list[int], iters: int) -> dict[int, dict[str, Any]]:
    """The `transferqueue` package with its defaults (``transfer_queue.init()``: SimpleStorage, 2 storage
    units), one partition reused across iterations: an actor ``kv_batch_put``s, this process
    ``kv_batch_get``s. It returns rows as jagged nested tensors; ``put``/``get``: the flat columns put as
    jagged nested tensors, the get's values/offsets views padded like every system; ``put_padded``/
    ``get_views``: padded tensors put, the get's equal-length rows viewed as dense tensors (no copy)."""
    try:
        import transfer_queue
        from tensordict import TensorDict
    except ImportError:
        raise Unavailable(INSTALL_TRANSFERQUEUE) from None
    from tq.bufferpool import HostBufferPool

    ray = _import_ray_zero_copy()  # one Ray per process: the same switch as the Ray baseline's

    @ray.remote(num_cpus=0.1)
    class Producer:
        def __init__(self) -> None:
            import transfer_queue

            transfer_queue.init()  # joins the driver's controller and storage units
            self.tq = transfer_queue

        def put(self, nbytes: int, seed: int, partition: str, form: str) -> tuple[float, list[str]]:
            b = make_batch(nbytes, seed)
            keys = [f"s{seed}_{i}" for i in range(len(b["rewards"]))]
            if form == "views":
                cols = padded(b)
            else:
                cols = {f: torch.nested.nested_tensor_from_jagged(b[f], b["offsets"]) for f in FIELDS}
                cols["rewards"] = b["rewards"]
            td = TensorDict(cols, batch_size=len(keys))
            t0 = time.perf_counter()
            self.tq.kv_batch_put(keys=keys, partition_id=partition, fields=td)
            return time.perf_counter() - t0, keys

    pool = HostBufferPool()
    # The package reserves a whole logical CPU per controller and storage actor: give Ray enough
    # logical CPUs that its init does not wait forever on a 2-core machine.
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": RAY_ZERO_COPY_ENV},
        object_store_memory=512 * MiB,
    )
    try:
        transfer_queue.init()  # its defaults: SimpleStorage with 2 storage units
        prod = Producer.remote()
        partition = f"bench-{uuid.uuid4().hex[:6]}"

        def put(size: int, seed: int, form: str) -> tuple[float, Any]:
            return ray.get(prod.put.remote(size, seed, partition, form))

        def get(keys: list[str], form: str) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
            td = transfer_queue.kv_batch_get(keys=keys, partition_id=partition)
            return _dense(td, pool), lambda: transfer_queue.kv_clear(keys=keys, partition_id=partition)

        return run_forms(sizes, iters, put, get)
    finally:
        try:
            transfer_queue.close()
        finally:
            ray.shutdown()


def _dense(td: Any, pool: Any) -> dict[str, torch.Tensor]:
    """A ``kv_batch_get`` result as padded tensors: a jagged nested tensor's values and offsets are views
    (no copy); rows of one length are viewed as a dense tensor as they are, others padded by
    :func:`pad_fields` like every system's rows."""
    out, jagged = {"rewards": td["rewards"]}, {}
    for f in FIELDS:
        t = td[f]
        values, offsets = t.values(), t.offsets().numpy()
        lengths = np.diff(offsets)
        if lengths.min() == lengths.max():
            out[f] = values.view(lengths.size, -1)
        else:
            jagged[f] = (values, offsets)
    return {**out, **pad_fields(jagged, pool)} if jagged else out


# ----------------------------------------------------------------------------- memcpy and control ops
def _memcpy_producer(name: str, conn: Any) -> None:
    """Writes each requested batch's bytes into the shared-memory buffer ``name``; reports their size."""
    from multiprocessing import shared_memory

    _one_torch_thread()

    shm = shared_memory.SharedMemory(name=name)
    try:
        while (msg := conn.recv()) is not None:
            pos = 0
            for raw in batch_bytes(make_batch(*msg)):
                shm.buf[pos : pos + raw.size] = raw
                pos += raw.size
            conn.send(pos)
    finally:
        shm.close()


def _shm_columns(src: np.ndarray, size: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The columns of ``make_batch(size, seed)`` as views of the bytes a producer wrote into ``src``
    (:func:`batch_bytes`' order), and the batch's offsets (computed here: they are not in the payload).
    The dtypes are those of a small batch from the same :func:`make_batch`."""
    lengths = batch_lengths(size, seed)
    offsets = torch.zeros(lengths.size + 1, dtype=torch.int64)
    offsets[1:] = torch.from_numpy(np.cumsum(lengths))
    small = make_batch(WARMUP_BYTES, 0)
    columns, pos = {}, 0
    for name in (*FIELDS, "rewards"):
        dtype = small[name].dtype
        nbytes = (lengths.size if name == "rewards" else int(offsets[-1])) * dtype.itemsize
        columns[name] = torch.from_numpy(src[pos : pos + nbytes]).view(dtype)
        pos += nbytes
    return columns, offsets


def bench_memcpy(sizes: list[int], iters: int) -> dict[int, dict[str, list[float]]]:
    """A plain copy of the payload bytes into a warm destination (``copy``: the one-thread ceiling), and
    the padding alone (``pad``: :func:`pad_batch` of the same bytes into pooled buffers, on a get's
    threads - the work every system's timed get ends in, with nothing else: what a get that cost only
    its copy would reach).

    The bytes are in the state every system's get finds them: a producer process has just built the
    batch and written it into shared memory. (Copying a batch this process built itself would read it
    from this core's caches; copying one source over and over would measure the caches alone.)"""
    from multiprocessing import shared_memory

    from tq.bufferpool import HostBufferPool, huge_page_mapping

    results = {}
    shm = shared_memory.SharedMemory(create=True, size=2 * max(sizes))
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_memcpy_producer, args=(shm.name, child), daemon=True)
    proc.start()
    try:
        src = np.ndarray((shm.size,), dtype=np.uint8, buffer=shm.buf)
        pool = HostBufferPool()
        for size in sizes:
            rates, pads, nbytes = [], [], 0
            # Room for any batch of this size, in the kind of memory TQ's result buffers use (huge
            # pages where allowed); its first iteration pays the page faults.
            dst = np.frombuffer(huge_page_mapping(2 * size), dtype=np.uint8)
            for it in range(_iters(size, iters)):
                seed = size // MiB * 1000 + it
                parent.send((size, seed))
                n = parent.recv()
                t0 = time.perf_counter()
                np.copyto(dst[:n], src[:n])
                rates.append(n / (time.perf_counter() - t0))
                want = make_batch(size, seed) if it == 0 else None  # every first read is checked
                if want is not None and not np.array_equal(dst[:n], np.concatenate(batch_bytes(want))):
                    raise AssertionError("the memcpy ceiling copied other bytes than the producer's batch")
                parent.send((size, seed))  # written again: the padding finds the bytes as the copy did
                parent.recv()
                columns, offsets = _shm_columns(src, size, seed)
                t0 = time.perf_counter()
                got = pad_batch(columns, offsets, pool)
                pads.append(n / (time.perf_counter() - t0))
                if want is not None:
                    _check(got, want)
                del got, columns, want
                nbytes = nbytes or n
            results[size] = {"copy": rates, "pad": pads, "bytes": nbytes}
        del src
    finally:
        parent.send(None)
        proc.join(30)
        shm.close()
        shm.unlink()
    return results


@contextlib.contextmanager
def control_ops(address: str) -> Iterator[tuple[dict[str, Callable[[], Any]], Callable[[], None]]]:
    """The control table's operations against the service at ``address``: ``(ops, reset)``, each op a
    call to time (1-key puts and gets, same host and over TCP, and small control operations), ``reset``
    what to run after an op's timed calls (drops the puts' keys, outside the timing)."""
    from tq import TQClient

    with TQClient(address) as client, TQClient(address, transport="tcp") as tcp:
        client.register_partition("ctl")
        client.register_partition("ctl-put")
        meta = client.put("ctl", [f"k{i}" for i in range(8)], {"x": torch.arange(8)})
        one = client.put("ctl", ["one"], {"x": torch.arange(1)})
        row, fresh = {"x": torch.arange(1)}, itertools.count()
        yield (
            {
                "put, 1 key (same host)": lambda: client.put("ctl-put", [f"p{next(fresh)}"], row),
                "get, 1 key (same host)": lambda: client.get(one, ["x"]),
                "put, 1 key (tcp)": lambda: tcp.put("ctl-put", [f"p{next(fresh)}"], row),
                "get, 1 key (tcp)": lambda: tcp.get(one, ["x"]),
                "wait (already produced, 8 keys)": lambda: client.wait(meta, ["x"], timeout=1.0),
                "get_meta (8 keys)": lambda: client.get_meta("ctl", meta.keys),
                "register_partition (reuse, empty)": lambda: client.register_partition("ctl-empty", reuse=True),
                "get of 8 scalars": lambda: client.get(meta, ["x"]),
            },
            lambda: client.clear_partition("ctl-put"),
        )


CONTROL_WARMUP = 50  # untimed calls per op first


def timed_calls(fn: Callable[[], Any], n: int, warmup: int) -> tuple[float, float, list[float]]:
    """Call ``fn`` ``warmup`` times untimed, then ``n`` times timed: (start and end of the timed calls
    on CLOCK_MONOTONIC, comparable across processes; each call's seconds)."""
    for _ in range(warmup):
        fn()
    lat = []
    start = time.monotonic()
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t0)
    return start, time.monotonic(), lat


def latency_summary(seconds: Sequence[float]) -> dict[str, float]:
    """p50/p99 in milliseconds of one op's timed calls."""
    a = np.asarray(seconds) * 1e3
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99))}


def bench_control_ops(n: int) -> dict[str, dict[str, float]]:
    """p50/p99 latency of :func:`control_ops` (``n`` timed calls each) against a fresh one-unit service."""
    from tq import TQServer

    out = {}
    with TQServer(storage_units=1, capacity=64 * MiB) as server, control_ops(server.address) as (ops, reset):
        for name, fn in ops.items():
            lat = timed_calls(fn, n, min(CONTROL_WARMUP, n))[2]
            reset()
            out[name] = latency_summary(lat)
    return out


# ----------------------------------------------------------------------------- report
def merge_rounds(rounds: list[dict[int, dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """One result per size from several rounds of a system: the first round's first (cold) iteration,
    then the warm iterations of every round (each round's first one pays fresh set-up, so it is left out)."""
    out: dict[int, dict[str, Any]] = {}
    for size, first in rounds[0].items():
        merged = dict(first)
        for key, value in first.items():
            if isinstance(value, list):
                merged[key] = value[:1] + [x for r in rounds for x in r[size][key][1:]]
        out[size] = merged
    return out


def _warm(x: list[float]) -> float:
    """Median over the warm iterations (all but the first)."""
    return statistics.median(x[1:] if len(x) > 1 else x)


def _floor(x: list[float]) -> float:
    """The slowest warm iteration over the warm median (1.0 = no outlier)."""
    return min(x[1:] if len(x) > 1 else x) / _warm(x)


def machine_info() -> str:
    """The machine, as the published table names it."""
    return f"{platform.node()} - {os.cpu_count()} CPUs ({cpu_model()}), Python {platform.python_version()}, torch {torch.__version__}"


def _check_jagged(got: dict[str, Any], batch: dict[str, Any]) -> None:
    """A borrowed get's jagged views hold the batch's values and offsets."""
    for f in FIELDS:
        if not (torch.equal(got[f].values, batch[f]) and torch.equal(got[f].offsets, batch["offsets"])):
            raise AssertionError(f"field {f} came back different (borrowed)")
    if not torch.equal(got["rewards"], batch["rewards"]):
        raise AssertionError("rewards came back different (borrowed)")


FORM_TAGS = {"put": "jagged", "put_padded": "padded", "get": "pad", "get_views": "views"}


def _faster(r: dict[str, Any] | None, keys: tuple[str, str]) -> str | None:
    """Of a baseline's two forms (e.g. ``put`` / ``put_padded``), the key with the faster warm median."""
    if not r:
        return None
    return max((k for k in keys if r.get(k)), key=lambda k: _warm(r[k]))


def report(all_res: dict[str, Any], sizes: list[int]) -> str:
    """The markdown tables (warm, cold, ratios, small operations) and the targets; stores ``ratios``
    and ``targets`` in ``all_res``. A system that did not run (None) reads n/a, with the reason from
    ``all_res["unavailable"]``."""
    machine = all_res.setdefault("machine", machine_info())  # kept in the JSON, so a table rebuilt elsewhere names the machine
    get = lambda k: all_res.get(k) or {}  # noqa: E731
    warm = lambda r, k: f"{_warm(r[k]) / 1e9:.2f}" if r and k and r.get(k) else "n/a"  # noqa: E731
    cold = lambda r, k: f"{r[k][0] / 1e9:.2f}" if r and k and r.get(k) else "n/a"  # noqa: E731
    lines = [
        f"Machine: {machine}",
        "",
        f"GB/s of unpadded payload, median of the warm iterations (every one after a system's first get of a size), "
        f"pooled over {all_res.get('rounds', 1)} round(s) of every system run in turn. Every get ends in padded "
        "tensors made by the same C row copier. Ray views: padded tensors stored, read-only views returned, "
        "nothing copied. A baseline's put and transferqueue's get show the faster of its two forms: [jagged] or "
        "[padded] tensors put; [pad]: the get's flat rows padded, [views]: padded rows stored and viewed. "
        "Padding only: that padding alone, from the bytes a producer just wrote into shared memory, with no "
        "get around it.",
        "",
        "| batch | payload MB | memcpy | padding only | TQ put | TQ get | TQ borrowed | TQ tcp put | TQ tcp get | Ray put | Ray get "
        "| Ray views | transferqueue put | transferqueue get |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cold_lines = [
        "",
        "Cold gets: GB/s of the first get of each size (fresh pages faulted in; every system ran one "
        "untimed 1 MiB round first, so client set-up is not counted); the last column is "
        "the slowest warm TQ get over the warm median.",
        "",
        "| batch | memcpy | TQ get | TQ borrowed | TQ tcp get | Ray get | Ray views | transferqueue get | TQ slowest warm get / median |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for size in sizes:
        mc, tq = all_res["memcpy"][size], all_res["tq"][size]
        tcp, ray_, ptq = (get(k).get(size) for k in ("tq_tcp", "ray", "transferqueue"))
        # The baselines' faster form where both do the same work: either put (same payload counted), and
        # transferqueue's either get (its views copy inside kv_batch_get); Ray's get pads like TQ's.
        rput, pput, pget = _faster(ray_, ("put", "put_padded")), _faster(ptq, ("put", "put_padded")), _faster(ptq, ("get", "get_views"))
        tag = lambda k: f" [{FORM_TAGS[k]}]" if k else ""  # noqa: E731
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{size // MiB} MiB",
                    f"{tq['bytes'] / 1e6:.0f}",
                    warm(mc, "copy"),
                    warm(mc, "pad"),
                    warm(tq, "put"),
                    warm(tq, "get"),
                    warm(tq, "borrowed"),
                    warm(tcp, "put"),
                    warm(tcp, "get"),
                    warm(ray_, rput) + tag(rput),
                    warm(ray_, "get"),
                    warm(ray_, "get_views"),
                    warm(ptq, pput) + tag(pput),
                    warm(ptq, pget) + tag(pget),
                ]
            )
            + " |"
        )
        cold_lines.append(
            "| "
            + " | ".join(
                [
                    f"{size // MiB} MiB",
                    cold(mc, "copy"),
                    cold(tq, "get"),
                    cold(tq, "borrowed"),
                    cold(tcp, "get"),
                    cold(ray_, "get"),
                    cold(ray_, "get_views"),
                    cold(ptq, pget) + tag(pget),
                    f"{_floor(tq['get']):.2f}",
                ]
            )
            + " |"
        )
        med = lambda r, k: _warm(r[k])  # noqa: E731
        r = {
            "size": f"{size // MiB} MiB",
            "get_vs_memcpy": med(tq, "get") / med(mc, "copy"),
            "tq_cold_get_gbps": tq["get"][0] / 1e9,
            "tq_warm_floor": _floor(tq["get"]),
        }
        if mc.get("pad"):
            r["get_vs_padding"] = med(tq, "get") / med(mc, "pad")
        if ray_:
            if mc.get("pad"):  # the padding alone against Ray's get: what a get costing only its copy would reach
                r["padding_vs_ray"] = med(mc, "pad") / med(ray_, "get")
            r.update(
                get_vs_ray=med(tq, "get") / med(ray_, "get"),
                get_vs_ray_views=med(tq, "get") / med(ray_, "get_views"),
                put_vs_ray=med(tq, "put") / med(ray_, rput),
            )
            if tq.get("borrowed"):
                r["borrowed_vs_ray_views"] = med(tq, "borrowed") / med(ray_, "get_views")
        if ptq:
            r.update(get_vs_transferqueue=med(tq, "get") / med(ptq, pget), put_vs_transferqueue=med(tq, "put") / med(ptq, pput))
        if ptq and tcp:
            r["tcp_get_vs_transferqueue"] = med(tcp, "get") / med(ptq, pget)
        ratios.append(r)
    lines += cold_lines
    lines += [
        "",
        "Ratios of warm medians (targets: get >= 5x transferqueue, >= 2x Ray, >= 0.4x memcpy; put >= 3x "
        "transferqueue; TCP get >= 2x transferqueue; borrowed get >= 1x Ray views; the copying get against Ray "
        "views is reported, not a target). Padding only / Ray is what a get that cost nothing but its padding "
        "would reach against Ray (Ray's get is that padding plus ``ray.get``); TQ get / padding only near 1 "
        "means TQ's get costs its copy and little else:",
        "",
        "| batch | TQ get / memcpy | TQ get / padding only | TQ get / Ray | padding only / Ray | TQ get / Ray views "
        "| TQ borrowed / Ray views | TQ get / transferqueue | TQ put / Ray | TQ put / transferqueue | TQ tcp get / transferqueue |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ratios:
        f = lambda k: f"{r[k]:.2f}x" if k in r else "n/a"  # noqa: E731
        lines.append(
            f"| {r['size']} | {f('get_vs_memcpy')} | {f('get_vs_padding')} | {f('get_vs_ray')} | {f('padding_vs_ray')} | "
            f"{f('get_vs_ray_views')} | {f('borrowed_vs_ray_views')} | "
            f"{f('get_vs_transferqueue')} | {f('put_vs_ray')} | {f('put_vs_transferqueue')} | "
            f"{f('tcp_get_vs_transferqueue')} |"
        )
    lines += [
        "",
        f"Small operations (TQ; target p99 <= {CONTROL_P99_MS:g} ms each, "
        + ", ".join(f"{k} <= {v:g} ms" for k, v in CONTROL_P99_BARS_MS.items())
        + "):",
        "",
        "| operation | p50 ms | p99 ms | bar ms |",
        "|---|---|---|---|",
    ]
    for name, v in all_res["control_ops"].items():
        lines.append(f"| {name} | {v['p50_ms']:.3f} | {v['p99_ms']:.3f} | {CONTROL_P99_BARS_MS.get(name, CONTROL_P99_MS):g} |")
    targets = {}
    for key, bar in TARGETS.items():
        rows = [r for r in ratios if key in r]
        if rows:
            worst = min(rows, key=lambda r: r[key])
            targets[key] = {"target": bar, "worst": worst[key], "met": worst[key] >= bar}
            if key == "get_vs_ray" and "padding_vs_ray" in worst:
                targets[key]["bound"] = worst["padding_vs_ray"]  # at the worst size: what a get that only pads would reach
    # each operation's p99 over its bar: the worst (highest) ratio must be <= 1
    over = max((v["p99_ms"] / CONTROL_P99_BARS_MS.get(k, CONTROL_P99_MS) for k, v in all_res["control_ops"].items()), default=0.0)
    targets["control_p99_over_bar"] = {"target": 1.0, "worst": over, "met": over <= 1.0}
    worst_cold = min(r["tq_cold_get_gbps"] for r in ratios)
    targets["cold_get_gbps"] = {"target": COLD_GET_GBPS, "worst": worst_cold, "met": worst_cold >= COLD_GET_GBPS}
    base, growing = next(((s, r["get"]) for s, r in get("tq_growing").items()), (0, None))
    floor = min([r["tq_warm_floor"] for r in ratios] + ([_floor(growing)] if growing else []))
    targets["warm_get_floor"] = {"target": WARM_FLOOR, "worst": floor, "met": floor >= WARM_FLOOR}
    if growing:
        fixed = all_res["tq"].get(base)
        lines += [
            "",
            f"Growing batches (a GRPO run's responses lengthen as it trains): TQ gets of a {base // MiB} MiB batch "
            f"grown {GROWTH:.0%} a step, each needing a larger result buffer than the last: warm median "
            f"{_warm(growing) / 1e9:.2f} GB/s"
            + (f" (the fixed {base // MiB} MiB batch: {_warm(fixed['get']) / 1e9:.2f})" if fixed else "")
            + f", slowest / median {_floor(growing):.2f} (counted in warm_get_floor).",
        ]
    lines += [
        "",
        "Targets (worst batch size): "
        + "; ".join(
            f"{k} {v['worst']:.2f} vs {v['target']} - {'met' if v['met'] else 'NOT met'}"
            + (f" (a get costing only its padding: {v['bound']:.2f} at that size)" if "bound" in v else "")
            for k, v in targets.items()
        ),
    ]
    notes = [f"{name}: n/a - {why}" for name, why in all_res.get("unavailable", {}).items()]
    code = all_res.get("code")
    if code:
        notes.append(
            f"code: commit {code['commit']}"
            + (f", with uncommitted changes in {', '.join(code['tq_uncommitted'])}" if code["tq_uncommitted"] else "")
        )
    load = all_res.get("load_avg")
    if load:
        notes.append(
            f"machine load (1/5/15-minute averages): {' / '.join(f'{x:.2f}' for x in load['start'])} at the start, "
            f"{' / '.join(f'{x:.2f}' for x in load['end'])} at the end"
        )
    notes += all_res.get("notes", [])
    if notes:
        lines += ["", "Notes:", *(f"- {n}" for n in notes)]
    all_res["ratios"], all_res["targets"] = ratios, targets
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line (every option with its help)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1]
    )
    p.add_argument(
        "--sizes-mib", type=int, nargs="+", default=[8, 32, 128, 512], help="batch sizes in MiB of payload (default 8 32 128 512)"
    )
    p.add_argument("--iters", type=int, default=5, help="gets per size and system, the first one cold; 3x this up to 32 MiB (default 5)")
    p.add_argument("--quick", action="store_true", help="8 and 32 MiB, 4 iterations, 1 round")
    p.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["ray", "transferqueue", "tcp"],
        help="systems to leave out: Ray's object store, the transferqueue package, TQ over TCP",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="run every system this many times in turn and pool their warm iterations (default 2; --quick 1)",
    )
    p.add_argument(
        "--control-iters", type=int, default=2000, help="timed calls of each small operation, after 50 untimed ones (default 2000)"
    )
    p.add_argument(
        "--from-json",
        default=None,
        help="only rebuild the report (tables, ratios, targets) of an earlier run's JSON, into a fresh run directory",
    )
    p.add_argument(
        "--writers",
        type=int,
        nargs="+",
        default=None,
        help="only the concurrent writers/readers sweep, e.g. --writers 1 2 4 8 16 (its own run: tq_writers)",
    )
    p.add_argument("--writer-mib", type=int, default=32, help="batch MiB each writer puts in the sweep (default 32)")
    p.add_argument("--writer-puts", type=int, default=4, help="batches each writer puts in the sweep (default 4)")
    p.add_argument(
        "--writer-small-puts", type=int, default=2000, help="1-key puts each writer makes in the sweep's last pass (0: none; default 2000)"
    )
    p.add_argument(
        "--note", action="append", default=[], help="a line for the report's notes, e.g. what else ran on the machine (repeatable)"
    )
    add_output_args(p, "tq_throughput")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.quick:
        a.sizes_mib, a.iters, a.rounds = [8, 32], 4, 1
    if a.rounds < 1 or a.iters < 1 or a.control_iters < 1 or min(a.sizes_mib) < 1:
        p.error("--rounds, --iters, --control-iters and --sizes-mib must be >= 1")
    if a.writers:
        out = open_run("tq_writers", a.run_dir)
        res = {
            "command": " ".join(["python -m benchmarks.tq_throughput", *(sys.argv[1:] if argv is None else argv)]),
            "started": time.strftime("%Y-%m-%d %H:%M"),
            "code": code_version(),
            "machine": machine_info(),
            **bench_writers(a.writers, a.writer_mib * MiB, a.writer_puts, small_puts=a.writer_small_puts),
        }
        table = writers_report(res)
        with open(out.path(".json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        with open(out.path(".md"), "w") as f:
            f.write(f"# TQ concurrent writers\n\n`{res['command']}` ({res['started']})\n\n{table}\n")
        print(table)
        out.finish(a.publish, a.machine)
        return 0
    out = open_run("tq_throughput", a.run_dir)
    if a.from_json:
        with open(a.from_json) as f:
            res = json.load(f)
        for name in ("memcpy", *SYSTEMS):  # JSON made the sizes strings
            res[name] = {int(k): v for k, v in res[name].items()} if res.get(name) else None
        res["notes"] = res.get("notes", []) + a.note
        return write_run(res, out, a.publish, a.machine)
    sizes = [s * MiB for s in a.sizes_mib]
    res: dict[str, Any] = {
        "sizes": sizes,
        "rounds": a.rounds,
        "unavailable": {},
        "notes": list(a.note),
        "command": " ".join(["python -m benchmarks.tq_throughput", *(sys.argv[1:] if argv is None else argv)]),
        "started": time.strftime("%Y-%m-%d %H:%M"),
        "load_avg": {"start": list(os.getloadavg())},
        "code": code_version(),
    }
    t0 = time.time()
    systems: dict[str, Callable[[], Any]] = {
        "memcpy": lambda: bench_memcpy(sizes, a.iters),
        "tq": lambda: bench_tq(sizes, a.iters, "auto"),
        "tq_tcp": lambda: bench_tq(sizes, a.iters, "tcp"),
        "ray": lambda: bench_ray(sizes, a.iters),
        "transferqueue": lambda: bench_transferqueue(sizes, a.iters),
        "tq_growing": lambda: bench_tq([min(GROWING_MIB, max(a.sizes_mib)) * MiB], a.iters, "auto", growth=GROWTH),
    }
    for name, flag in (("tq_tcp", "tcp"), ("ray", "ray"), ("transferqueue", "transferqueue")):
        if flag in a.skip:
            del systems[name]
            res["unavailable"][name] = f"left out (--skip {flag})"
    runs: dict[str, list[Any]] = {name: [] for name in systems}
    for r in range(a.rounds):  # in turn, so a slow phase of a shared machine does not land on one system
        for name, run in systems.items():
            if name in res["unavailable"]:
                continue
            print(f"[{time.time() - t0:5.0f}s] {name}, round {r + 1}/{a.rounds}", file=sys.stderr, flush=True)
            try:
                runs[name].append(run())
            except Unavailable as exc:
                res["unavailable"][name] = str(exc)
                print(f"  {name}: n/a - {exc}", file=sys.stderr, flush=True)
    for name in ("memcpy", *SYSTEMS):
        res[name] = merge_rounds(runs[name]) if runs.get(name) and name not in res["unavailable"] else None
    res["control_ops"] = bench_control_ops(a.control_iters)
    res["load_avg"]["end"] = list(os.getloadavg())
    res["wall_s"] = time.time() - t0
    return write_run(res, out, a.publish, a.machine)


def write_run(res: dict[str, Any], out: Any, publish: bool, machine: str | None) -> int:
    """The report of ``res`` (a run's measurements) as the run's JSON and markdown; prints it, publishes on request."""
    table = report(res, res["sizes"])
    with open(out.path(".json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(out.path(".md"), "w") as f:
        f.write(
            f"# TQ throughput\n\n`{res.get('command', 'python -m benchmarks.tq_throughput')}` "
            f"({res.get('started', '?')}, {res.get('wall_s', 0) / 60:.1f} min)\n\n{table}\n"
        )
    print(table)
    out.finish(publish, machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
