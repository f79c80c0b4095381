"""Put/get throughput of the TQ service against Ray's object store, the `transferqueue` package and a
plain memory copy of the same bytes, plus latency of small control operations.

Every system moves the same GRPO-shaped batch (jagged ``input_ids`` int64, ``generation_logprobs`` and
``prev_logprobs`` float32, ``token_mask`` bool, per-sample ``rewards``): a producer in another process
writes it, the benchmark process reads it back as padded dense torch tensors (what a training worker
needs). Throughput counts the batch's unpadded bytes over the wall time of the call. Each size runs
``--iters`` times with fresh data and keys (3x up to 32 MiB); the table shows the median of the warm
iterations (all but the first) and, in parentheses, the first (cold) one, where fresh pages are faulted
in. Every system runs ``--rounds`` times in turn (default 2) and the rounds' warm iterations are
pooled, so a slow phase of a shared machine does not land on one system only.

    python -m benchmarks.tq_throughput                 # 8 MiB .. 512 MiB, all systems
    python -m benchmarks.tq_throughput --quick         # 8 and 32 MiB, fewer iterations
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import uuid
from typing import Any, Callable

import numpy as np
import torch

MiB = 1 << 20
MAX_LEN = 4096
# The bars: ratios of warm medians measured in the same run (at every batch size), and the
# p99 of every small control operation.
TARGETS = {"get_vs_transferqueue": 5.0, "get_vs_ray": 2.0, "get_vs_memcpy": 0.4, "put_vs_transferqueue": 3.0,
           "tcp_get_vs_transferqueue": 2.0}
CONTROL_P99_MS = 2.0
FIELDS = ("input_ids", "generation_logprobs", "prev_logprobs", "token_mask")
BYTES_PER_TOKEN = 8 + 4 + 4 + 1


# ----------------------------------------------------------------------------- the batch
def _iters(size: int, iters: int) -> int:
    """Iterations at one batch size: three times ``iters`` up to 32 MiB, where one call takes a few
    milliseconds and a median of few samples would be at the mercy of scheduler noise."""
    return 3 * iters if size <= 32 * MiB else iters


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


def batch_bytes(batch: dict[str, Any]) -> list[np.ndarray]:
    """The payload of a batch as raw bytes, field by field (``FIELDS``, then ``rewards``)."""
    return [batch[f].numpy().view(np.uint8).reshape(-1) for f in (*FIELDS, "rewards")]


def payload_bytes(nbytes: int, seed: int) -> int:
    """Unpadded bytes of ``make_batch(nbytes, seed)`` (every token's fields plus a float32 reward each)."""
    lengths = batch_lengths(nbytes, seed)
    return int(lengths.sum()) * BYTES_PER_TOKEN + 4 * lengths.size


def padded(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The batch as padded dense tensors (the form a trainer consumes)."""
    from tq.jagged import JaggedTensor

    out = {f: JaggedTensor(batch[f], batch["offsets"]).to_padded() for f in FIELDS}
    out["rewards"] = batch["rewards"]
    return out


# ----------------------------------------------------------------------------- TQ
def _one_torch_thread() -> None:
    """Producer processes build batches with one torch thread, as Ray runs the Ray and transferqueue
    producers (its workers get OMP_NUM_THREADS=1). With more, torch's OpenMP threads keep spinning
    after building a batch, on the cores the put then needs: measured on the 16-vCPU H100 host, an
    alloc round trip took 3.7 ms after a batch built with 16 threads and 0.57 ms with one."""
    torch.set_num_threads(1)


def _tq_producer(address: str, transport: str, conn: Any) -> None:
    """A producer process: builds batches on request and puts them; reports the put's wall time."""
    from tq import JaggedTensor, TQClient

    _one_torch_thread()

    client = TQClient(address, transport=transport, timeout=120)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        nbytes, seed, partition = msg
        b = make_batch(nbytes, seed)
        keys = [f"s{seed}_{i}" for i in range(len(b["rewards"]))]
        cols = {f: JaggedTensor(b[f], b["offsets"]) for f in FIELDS}
        cols["rewards"] = b["rewards"]
        t0 = time.perf_counter()
        meta = client.put(partition, keys, cols)
        conn.send((time.perf_counter() - t0, meta.to_dict()))
    client.close()


def bench_tq(sizes: list[int], iters: int, transport: str) -> dict[int, dict[str, list[float]]]:
    from tq import KVBatchMeta, TQClient, TQServer

    results: dict[int, dict[str, list[float]]] = {}
    ctx = mp.get_context("spawn")
    with TQServer(storage_units=1, capacity=max(sizes) * 3 + (256 * MiB)) as server:
        client = TQClient(server.address, transport=transport, timeout=120)
        partition = f"bench-{uuid.uuid4().hex[:6]}"
        client.register_partition(partition)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_tq_producer, args=(server.address, transport, child), daemon=True)
        proc.start()
        try:
            for size in sizes:
                res = results.setdefault(size, {"put": [], "get": []})
                for it in range(_iters(size, iters)):
                    seed = size // MiB * 1000 + it
                    parent.send((size, seed, partition))
                    put_s, meta_d = parent.recv()
                    meta = KVBatchMeta.from_dict(meta_d)
                    t0 = time.perf_counter()
                    got = client.get(meta, [*FIELDS, "rewards"])
                    get_s = time.perf_counter() - t0
                    nbytes = payload_bytes(size, seed)
                    res.setdefault("bytes", nbytes)  # the table's payload column: the first batch
                    res["put"].append(nbytes / put_s)
                    res["get"].append(nbytes / get_s)
                    if it == 0:
                        _check(got, make_batch(size, seed))
                    del got
                    client.discard(meta)
        finally:
            parent.send(None)
            proc.join(30)
            client.close()
    return results


def _check(got: dict[str, torch.Tensor], batch: dict[str, Any]) -> None:
    """The first iteration of every system is verified against the source batch."""
    want = padded(batch)
    for f, t in want.items():
        if not torch.equal(got[f], t):
            raise AssertionError(f"field {f} came back different")


# ----------------------------------------------------------------------------- Ray
def bench_ray(sizes: list[int], iters: int) -> dict[int, dict[str, list[float]]]:
    """Ray's object store: an actor ray.put()s the batch, the driver ray.get()s it.

    Two forms: ``jagged`` stores the same flat columns (the driver pads after the get) and
    ``padded`` stores padded tensors (more bytes, no padding work on the reader). The better is kept.
    """
    import ray

    @ray.remote(num_cpus=0.1)
    class Producer:
        def put(self, nbytes: int, seed: int, form: str) -> tuple[float, list]:
            b = make_batch(nbytes, seed)
            obj = padded(b) if form == "padded" else b
            t0 = time.perf_counter()
            ref = ray.put(obj)
            self.ref = ref  # keep the owner alive
            return time.perf_counter() - t0, [ref]

    results: dict[int, dict[str, list[float]]] = {}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=max(sizes) * 4 + (512 * MiB))
    try:
        prod = Producer.remote()
        for size in sizes:
            res = results.setdefault(size, {"put": [], "get": []})
            best: dict[str, list[float]] = {}
            for form in ("jagged", "padded"):
                puts, gets = [], []
                for it in range(_iters(size, iters)):
                    seed = size // MiB * 1000 + it
                    put_s, [ref] = ray.get(prod.put.remote(size, seed, form))
                    t0 = time.perf_counter()
                    obj = ray.get(ref)
                    got = obj if form == "padded" else padded(obj)
                    get_s = time.perf_counter() - t0
                    nbytes = payload_bytes(size, seed)
                    res.setdefault("bytes", nbytes)
                    if it == 0:
                        _check(got, make_batch(size, seed))
                    puts.append(nbytes / put_s)
                    gets.append(nbytes / get_s)
                    del obj, got, ref
                best[form] = [_warm(gets), puts, gets]
            form = max(best, key=lambda f: best[f][0])
            res["put"], res["get"], res["form"] = best[form][1], best[form][2], form
    finally:
        ray.shutdown()
    return results


# ----------------------------------------------------------------------------- transferqueue package
def bench_transferqueue(sizes: list[int], iters: int) -> dict[int, dict[str, list[float]]] | None:
    """The `transferqueue` package (SimpleStorage backend): kv_batch_put from an actor, kv_batch_get here."""
    try:
        import transfer_queue as ptq  # noqa: F401
    except ImportError:
        return None
    import ray
    from omegaconf import OmegaConf
    from tensordict import TensorDict

    @ray.remote(num_cpus=0.1)
    class Producer:
        def __init__(self) -> None:
            import transfer_queue

            transfer_queue.init()
            self.tq = transfer_queue

        def put(self, nbytes: int, seed: int, partition: str) -> tuple[float, list[str]]:
            b = padded(make_batch(nbytes, seed))
            keys = [f"s{seed}_{i}" for i in range(len(b["rewards"]))]
            td = TensorDict(b, batch_size=len(keys))
            t0 = time.perf_counter()
            self.tq.kv_batch_put(keys=keys, partition_id=partition, fields=td)
            return time.perf_counter() - t0, keys

    results: dict[int, dict[str, list[float]]] = {}
    # The package reserves a whole logical CPU per controller and storage actor: give Ray enough
    # logical CPUs that its init does not wait forever on a 2-core machine.
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, object_store_memory=512 * MiB)
    try:
        import transfer_queue

        transfer_queue.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
        prod = Producer.remote()
        for size in sizes:
            res = results.setdefault(size, {"put": [], "get": []})
            for it in range(_iters(size, iters)):
                seed = size // MiB * 1000 + it
                partition = f"p{seed}"
                put_s, keys = ray.get(prod.put.remote(size, seed, partition))
                t0 = time.perf_counter()
                td = transfer_queue.kv_batch_get(keys=keys, partition_id=partition)
                # It hands rows back as nested tensors; a trainer needs them dense.
                got = {f: td[f].to_padded_tensor(0) if td[f].is_nested else td[f] for f in (*FIELDS, "rewards")}
                get_s = time.perf_counter() - t0
                nbytes = payload_bytes(size, seed)
                res.setdefault("bytes", nbytes)
                if it == 0:
                    _check(got, make_batch(size, seed))
                res["put"].append(nbytes / put_s)
                res["get"].append(nbytes / get_s)
                transfer_queue.kv_clear(keys=keys, partition_id=partition)
                del td, got
    finally:
        try:
            transfer_queue.close()
        finally:
            ray.shutdown()
    return results


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


def bench_memcpy(sizes: list[int], iters: int) -> dict[int, dict[str, list[float]]]:
    """A plain copy of the payload bytes into a warm destination (the ceiling).

    The bytes are in the state every system's get finds them: a producer process has just built the
    batch and written it into shared memory. (Copying a batch this process built itself would read it
    from this core's caches; copying one source over and over would measure the caches alone.)"""
    from multiprocessing import shared_memory

    from tq.bufferpool import huge_page_mapping

    results = {}
    shm = shared_memory.SharedMemory(create=True, size=2 * max(sizes))
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_memcpy_producer, args=(shm.name, child), daemon=True)
    proc.start()
    try:
        src = np.ndarray((shm.size,), dtype=np.uint8, buffer=shm.buf)
        for size in sizes:
            rates, nbytes = [], 0
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
                if it == 0 and not np.array_equal(dst[:n], np.concatenate(batch_bytes(make_batch(size, seed)))):
                    raise AssertionError("the memcpy ceiling copied other bytes than the producer's batch")  # checked like every first read
                nbytes = nbytes or n
            results[size] = {"copy": rates, "bytes": nbytes}
        del src
    finally:
        parent.send(None)
        proc.join(30)
        shm.close()
        shm.unlink()
    return results


def bench_control_ops(n: int) -> dict[str, dict[str, float]]:
    """p50/p99 latency of small control operations against a running service."""
    from tq import TQClient, TQServer

    out = {}
    with TQServer(storage_units=1, capacity=64 * MiB) as server, TQClient(server.address) as client:
        client.register_partition("ctl")
        meta = client.put("ctl", [f"k{i}" for i in range(8)], {"x": torch.arange(8)})
        ops: dict[str, Callable[[], Any]] = {
            "wait (already produced, 8 keys)": lambda: client.wait(meta, ["x"], timeout=1.0),
            "get_meta (8 keys)": lambda: client.get_meta("ctl", meta.keys),
            "register_partition (reuse, empty)": lambda: client.register_partition("ctl-empty", reuse=True),
            "get of 8 scalars": lambda: client.get(meta, ["x"]),
        }
        for name, fn in ops.items():
            for _ in range(50):
                fn()
            lat = []
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                lat.append(time.perf_counter() - t0)
            a = np.array(lat) * 1e3
            out[name] = {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99))}
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
        forms = sorted({r[size]["form"] for r in rounds if "form" in r[size]})
        if forms:
            merged["form"] = "/".join(forms)
        out[size] = merged
    return out


def _warm(x: list[float]) -> float:
    """Median over the warm iterations (all but the first)."""
    return statistics.median(x[1:] if len(x) > 1 else x)


def _gbps(x: list[float]) -> str:
    return f"{_warm(x) / 1e9:.2f} ({x[0] / 1e9:.2f})"


def report(all_res: dict[str, Any], sizes: list[int]) -> str:
    machine = all_res.setdefault(  # kept in the JSON, so a table rebuilt elsewhere names the machine that ran it
        "machine", f"{platform.node()} - {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}")
    lines = [
        f"Machine: {machine}",
        "",
        f"GB/s of unpadded payload: median of warm iterations, pooled over {all_res.get('rounds', 1)} round(s) of every system "
        "run in turn (first, cold iteration in parentheses).",
        "",
        "| batch | payload MB | memcpy | TQ put | TQ get | TQ tcp put | TQ tcp get | Ray put | Ray get | transferqueue put | transferqueue get |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for size in sizes:
        mc = all_res["memcpy"][size]
        tq = all_res["tq"][size]
        tcp, ray_, ptq = ((all_res.get(k) or {}).get(size) for k in ("tq_tcp", "ray", "transferqueue"))  # None: skipped
        cell = lambda r, k: _gbps(r[k]) if r else "n/a"  # noqa: E731
        row = [f"{size // MiB} MiB", f"{tq['bytes'] / 1e6:.0f}", cell(mc, "copy"), cell(tq, "put"), cell(tq, "get"),
               cell(tcp, "put"), cell(tcp, "get"), cell(ray_, "put") + (f" [{ray_.get('form', '-')}]" if ray_ else ""),
               cell(ray_, "get"), cell(ptq, "put"), cell(ptq, "get")]
        lines.append("| " + " | ".join(row) + " |")
        med = lambda r, k: _warm(r[k])  # noqa: E731
        r = {"size": f"{size // MiB} MiB", "get_vs_memcpy": med(tq, "get") / med(mc, "copy")}
        if ray_:
            r["get_vs_ray"] = med(tq, "get") / med(ray_, "get")
        if ptq:
            r.update(get_vs_transferqueue=med(tq, "get") / med(ptq, "get"), put_vs_transferqueue=med(tq, "put") / med(ptq, "put"))
        if ptq and tcp:
            r["tcp_get_vs_transferqueue"] = med(tcp, "get") / med(ptq, "get")
        ratios.append(r)
    lines += ["", "Ratios (warm medians; targets: get >= 5x transferqueue, >= 2x Ray, >= 0.4x memcpy; put >= 3x transferqueue; "
              "TCP get >= 2x transferqueue):", "",
              "| batch | TQ get / memcpy | TQ get / Ray | TQ get / transferqueue | TQ put / transferqueue | TQ tcp get / transferqueue |",
              "|---|---|---|---|---|---|"]
    for r in ratios:
        f = lambda k: f"{r[k]:.2f}x" if k in r else "n/a"  # noqa: E731
        lines.append(f"| {r['size']} | {f('get_vs_memcpy')} | {f('get_vs_ray')} | {f('get_vs_transferqueue')} | "
                     f"{f('put_vs_transferqueue')} | {f('tcp_get_vs_transferqueue')} |")
    lines += ["", "Control operations (TQ, same host):", "", "| operation | p50 ms | p99 ms |", "|---|---|---|"]
    for name, v in all_res["control_ops"].items():
        lines.append(f"| {name} | {v['p50_ms']:.3f} | {v['p99_ms']:.3f} |")
    targets = {}
    for key, bar in TARGETS.items():
        got = [r[key] for r in ratios if key in r]
        if got:
            targets[key] = {"target": bar, "worst": min(got), "met": min(got) >= bar}
    p99 = max((v["p99_ms"] for v in all_res["control_ops"].values()), default=0.0)
    targets["control_p99_ms"] = {"target": CONTROL_P99_MS, "worst": p99, "met": p99 < CONTROL_P99_MS}
    lines += ["", "Targets (worst batch size): " + "; ".join(
        f"{k} {v['worst']:.2f} vs {v['target']} - {'met' if v['met'] else 'NOT met'}" for k, v in targets.items())]
    all_res["ratios"], all_res["targets"] = ratios, targets
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[8, 32, 128, 512])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="8 and 32 MiB, 4 iterations, 1 round")
    p.add_argument("--skip", nargs="*", default=[], choices=["ray", "transferqueue", "tcp"])
    p.add_argument("--rounds", type=int, default=2,
                   help="run every system this many times in turn and pool their warm iterations (default 2; --quick 1)")
    p.add_argument("--out", default="results/tq_throughput")
    a = p.parse_args(argv)
    if a.quick:
        a.sizes_mib, a.iters, a.rounds = [8, 32], 4, 1
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    sizes = [s * MiB for s in a.sizes_mib]
    res: dict[str, Any] = {"sizes": sizes, "rounds": a.rounds}
    t0 = time.time()
    systems: dict[str, Callable[[], Any]] = {
        "memcpy": lambda: bench_memcpy(sizes, a.iters),
        "tq": lambda: bench_tq(sizes, a.iters, "auto"),
    }
    if "tcp" not in a.skip:
        systems["tq_tcp"] = lambda: bench_tq(sizes, a.iters, "tcp")
    if "ray" not in a.skip:
        systems["ray"] = lambda: bench_ray(sizes, a.iters)
    if "transferqueue" not in a.skip:
        systems["transferqueue"] = lambda: bench_transferqueue(sizes, a.iters)
    runs: dict[str, list[Any]] = {name: [] for name in systems}
    for r in range(a.rounds):  # in turn, so a slow phase of a shared machine does not land on one system
        for name, run in systems.items():
            print(f"[{time.time() - t0:5.0f}s] {name}, round {r + 1}/{a.rounds}", file=sys.stderr, flush=True)
            runs[name].append(run())
    for name, got in runs.items():
        res[name] = merge_rounds(got) if got[0] is not None else None
    for skipped in ("tq_tcp", "ray", "transferqueue"):
        res.setdefault(skipped, None)
    res["control_ops"] = bench_control_ops(2000)
    table = report(res, sizes)
    res["wall_s"] = time.time() - t0
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(a.out + ".md", "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
