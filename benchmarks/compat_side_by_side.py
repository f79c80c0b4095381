"""The same TransferQueue KV workload through the `transferqueue` package and through tq.compat's drop-in.

One GRPO-shaped step, written against TransferQueue's KV API only, runs ``--steps`` times on each
implementation in this process (which plays both the rollout writer and the trainer reader):

1. ``kv_batch_put``  new keys: ``input_ids`` / ``attention_mask`` ``[n, L]`` int64 + a tag per key
2. ``kv_batch_put``  existing keys, a new field: ``old_log_probs`` ``[n, L]`` float32 (a write back)
3. ``kv_batch_put``  tags only (``status: trained``)
4. ``kv_batch_get``  the three tensor fields of every key
5. ``kv_list``       the partition
6. ``kv_clear``      every key

Each op's wall time is reported as the median over the steps after the first (the first, cold one in
parentheses); the payload moved by 1, 2 and 4 is counted once per op. The read-back is checked against
what was written. Both implementations start their own service with two storage units (TransferQueue:
Ray actors; tq.compat: processes of this host). The drop-in runs first and without Ray, so
TransferQueue's named controller actor is never confused with the drop-in's.

    python -m benchmarks.compat_side_by_side                         # 512 samples x 1024 tokens, 5 steps
    python -m benchmarks.compat_side_by_side --samples 8 --seq-len 16 --steps 2   # a smoke run
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import time
from typing import Any

import torch

OPS = ("put_new", "put_field", "put_tags", "get", "list", "clear")


def run_workload(tq: Any, samples: int, seq_len: int, steps: int) -> dict[str, Any]:
    """Run the step ``steps`` times through the module ``tq`` (initialized); per-op seconds and bytes."""
    from tensordict import TensorDict

    times: dict[str, list[float]] = {op: [] for op in OPS}
    payload = {"put_new": samples * seq_len * 16, "put_field": samples * seq_len * 4, "get": samples * seq_len * 20}
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 32000, (samples, seq_len), generator=gen)
        mask = torch.ones(samples, seq_len, dtype=torch.int64)
        logp = torch.randn(samples, seq_len, generator=gen)
        keys, part = [f"s{step}_{i}" for i in range(samples)], f"train_{step}"

        def timed(op: str, fn: Any) -> Any:
            t0 = time.perf_counter()
            out = fn()
            times[op].append(time.perf_counter() - t0)
            return out

        timed(
            "put_new",
            lambda: tq.kv_batch_put(
                keys=keys,
                partition_id=part,
                tags=[{"step": step}] * samples,
                fields=TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=samples),
            ),
        )
        timed(
            "put_field",
            lambda: tq.kv_batch_put(keys=keys, partition_id=part, fields=TensorDict({"old_log_probs": logp}, batch_size=samples)),
        )
        timed("put_tags", lambda: tq.kv_batch_put(keys=keys, partition_id=part, tags=[{"status": "trained"}] * samples))
        got = timed(
            "get", lambda: tq.kv_batch_get(keys=keys, partition_id=part, select_fields=["input_ids", "attention_mask", "old_log_probs"])
        )
        listed = timed("list", lambda: tq.kv_list(partition_id=part))
        timed("clear", lambda: tq.kv_clear(keys=keys, partition_id=part))
        back = got["old_log_probs"]
        back = torch.stack(list(back.unbind())) if back.is_nested else back
        assert torch.equal(back, logp), "read back differs from what was written"
        assert len(listed[part]) == samples and listed[part][keys[0]]["status"] == "trained"
    return {"seconds": times, "bytes": payload}


def bench_compat(samples: int, seq_len: int, steps: int) -> dict[str, Any]:
    import tq.compat.transfer_queue as tq

    tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 2}}})
    try:
        return run_workload(tq, samples, seq_len, steps)
    finally:
        tq.close()


def bench_transferqueue(samples: int, seq_len: int, steps: int) -> dict[str, Any]:
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    # Its own local Ray, never a cluster another job left running. Logical CPUs beyond the cores: its
    # controller and storage-unit actors each reserve one, and on a 2-core machine they would wait forever.
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 2}}}))
        try:
            return run_workload(tq, samples, seq_len, steps)
        finally:
            tq.close()
    finally:
        ray.shutdown()


def summarize(results: dict[str, dict[str, Any]]) -> str:
    """A markdown table: per op, each implementation's warm median ms (cold in parentheses) and MB/s."""
    names = list(results)
    lines = [
        "| op | " + " | ".join(f"{n} ms" for n in names) + " | " + " | ".join(f"{n} MB/s" for n in names) + " |",
        "|---" * (1 + 2 * len(names)) + "|",
    ]
    for op in OPS:
        ms, rates = [], []
        for n in names:
            t = results[n]["seconds"][op]
            warm = statistics.median(t[1:]) if len(t) > 1 else t[0]
            ms.append(f"{warm * 1e3:.2f} ({t[0] * 1e3:.1f})")
            nbytes = results[n]["bytes"].get(op)
            rates.append(f"{nbytes / warm / 1e6:.0f}" if nbytes else "-")
        lines.append(f"| {op} | " + " | ".join(ms) + " | " + " | ".join(rates) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compat_side_by_side", description=__doc__.split("\n", 1)[0])
    p.add_argument("--samples", type=int, default=512, help="keys (samples) per step (default 512)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sample of each tensor field (default 1024)")
    p.add_argument("--steps", type=int, default=5, help="steps per implementation; the first is reported apart as the cold one (default 5)")
    p.add_argument("--json", metavar="FILE", help="also write the raw timings to FILE (default: none)")
    a = p.parse_args(argv)
    print(f"{a.samples} samples x {a.seq_len} tokens, {a.steps} steps, {platform.node()} ({platform.processor() or platform.machine()})")
    results = {"tq.compat": bench_compat(a.samples, a.seq_len, a.steps)}
    print(summarize(results), flush=True)
    if importlib.util.find_spec("transfer_queue") is None:
        print("transferqueue is not installed (pip install 'tq-rl[bench]'): ran tq.compat only")
    else:
        results["transferqueue"] = bench_transferqueue(a.samples, a.seq_len, a.steps)
        print(summarize(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
