"""``python -m tq.demo``: one GRPO-shaped training step through TQ, end to end, on a laptop.

What it plays (the data flow of the sync TQ trainer, with fake compute):

1. Two *rollout* Ray actors each "generate" a batch - jagged ``input_ids``, ``token_mask``,
   ``generation_logprobs`` (random lengths) and a per-sample ``rewards`` scalar - and put it into TQ
   under minted keys ``"{uid}_g{i}"`` tagged with their group (prompt) id. They return only the
   :class:`~tq.KVBatchMeta` handle.
2. The driver concatenates the handles and shards them for two *DP worker* actors
   (:func:`~tq.shard_meta_for_dp`, token-balanced with a micro-batch plan).
3. Each worker fetches only its shard's fields (padded), computes per-token ``prev_logprobs`` with a
   fixed random "model" and writes them back, plus a per-sample ``seq_logprob_error`` (a per-token
   reduction done where the tokens already are).
4. The driver reads only per-sample columns (``rewards``, ``seq_logprob_error``), computes
   group-mean baselines and advantages, and writes ``advantages`` and ``sample_mask`` back.
5. Each worker fetches its shard again, now with advantages, and computes a (fake) policy loss.
6. The driver discards every key, checks the store is empty, prints what moved where and the
   ``tq-controller status`` table, and shuts everything down.

The point it demonstrates: bulk (per-token) bytes go rollout -> storage -> workers; the driver's
traffic is per-sample scalars and handles only.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

VOCAB = 128
PARTITION = "demo-train"
LP_FIELDS = ["input_ids", "token_mask", "generation_logprobs"]
TRAIN_FIELDS = ["input_ids", "token_mask", "generation_logprobs", "prev_logprobs", "advantages", "sample_mask"]
DRIVER_FIELDS = ["rewards", "seq_logprob_error"]


def _nbytes(value: Any) -> int:
    """Bytes of the tensors in a ``TQClient.get`` result (or any nested list/dict of tensors)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    if hasattr(value, "values") and hasattr(value, "offsets"):  # JaggedTensor
        return _nbytes(value.values) + _nbytes(value.offsets)
    return 0


class RolloutActor:
    """A fake generation worker: writes a batch into TQ and returns only its handle."""

    def __init__(self, address: str) -> None:
        from tq import TQClient

        self.client = TQClient(address, timeout=30.0)

    def rollout(self, uids: list[str], group_size: int, seed: int, min_len: int, max_len: int) -> tuple[Any, int]:
        """Put one batch of ``len(uids) * group_size`` samples; returns (meta, bytes written)."""
        import torch

        from tq import mint_keys

        g = torch.Generator().manual_seed(seed)
        keys = mint_keys(uids, group_size)
        n = len(keys)
        lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
        prompt_lens = torch.randint(4, min_len, (len(uids),), generator=g).repeat_interleave(group_size).tolist()
        input_ids = [torch.randint(0, VOCAB, (L,), generator=g) for L in lengths]
        token_mask = [torch.arange(L) >= p for L, p in zip(lengths, prompt_lens)]  # response tokens only
        gen_logprobs = [-3.0 * torch.rand(L, generator=g) * m for L, m in zip(lengths, token_mask)]
        # A reward a model could learn: the share of even tokens in the response.
        rewards = torch.tensor([float((ids[m] % 2 == 0).float().mean()) for ids, m in zip(input_ids, token_mask)])
        columns = {
            "input_ids": input_ids,
            "input_lengths": torch.tensor(lengths, dtype=torch.int64),
            "token_mask": token_mask,
            "generation_logprobs": gen_logprobs,
            "rewards": rewards,
        }
        tags = {"group": [k.rsplit("_g", 1)[0] for k in keys], "weight_version": [0] * n}
        meta = self.client.put(PARTITION, keys, columns, tags=tags)
        return meta, _nbytes(columns)


class DPWorker:
    """A fake data-parallel policy worker: fetches its shard from TQ, writes results back."""

    def __init__(self, address: str, rank: int) -> None:
        import torch

        from tq import TQClient

        self.client = TQClient(address, timeout=30.0)
        self.rank = rank
        # The "model": fixed random next-token logits per current token (same on every rank).
        self.weights = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1234))

    def compute_logprobs(self, shard: Any) -> dict[str, Any]:
        """Fetch the log-prob seed fields of this shard, write ``prev_logprobs`` and a per-sample error."""
        import torch

        got = self.client.get(shard, LP_FIELDS, layout="padded")
        ids, mask, gen = got["input_ids"], got["token_mask"], got["generation_logprobs"]
        logp = torch.log_softmax(self.weights[ids[:, :-1]], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        prev = torch.cat([torch.zeros(ids.shape[0], 1), logp], dim=1) * mask  # token 0 has no prediction
        maskf = mask.float()
        err = ((prev - gen).abs() * maskf).sum(1) / maskf.sum(1).clamp(min=1.0)
        lengths = shard.sequence_lengths
        out = {"prev_logprobs": [prev[i, :L].clone() for i, L in enumerate(lengths)], "seq_logprob_error": err}
        self.client.write_back(shard, out)
        return {
            "rank": self.rank,
            "samples": len(shard),
            "tokens": sum(lengths),
            "micro_batches": len(shard.extra_info.get("micro_batches", [])),
            "fetched": _nbytes(got),
            "written": _nbytes(out),
        }

    def train_step(self, shard: Any) -> dict[str, Any]:
        """Fetch the training fields of this shard (advantages included) and compute a fake GRPO loss."""
        import torch

        got = self.client.get(shard, TRAIN_FIELDS, layout="padded")
        mask = got["token_mask"].float() * got["sample_mask"][:, None]
        ratio = torch.exp(got["prev_logprobs"] - got["generation_logprobs"])
        loss = -(got["advantages"][:, None] * ratio * mask).sum() / mask.sum().clamp(min=1.0)
        return {"rank": self.rank, "loss": float(loss), "fetched": _nbytes(got), "written": 0}


def group_advantages(rewards: Any, groups: tuple[str, ...], eps: float = 1e-6) -> tuple[Any, Any]:
    """GRPO advantages ``(r - mean_group) / (std_group + eps)`` and per-group baselines, per sample."""
    import torch

    ids = {g: i for i, g in enumerate(dict.fromkeys(groups))}
    index = torch.tensor([ids[g] for g in groups])
    counts = torch.bincount(index).float()
    mean = torch.zeros(len(ids)).index_add_(0, index, rewards) / counts
    var = torch.zeros(len(ids)).index_add_(0, index, (rewards - mean[index]) ** 2) / counts.clamp(min=1.0)
    baseline = mean[index]
    return (rewards - baseline) / (var.sqrt()[index] + eps), baseline


def _wait_store_empty(client: Any, timeout: float = 15.0) -> dict[str, Any]:
    """Stats once no partition holds keys and no unit holds live bytes (unit frees are asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        held = sum(p["keys"] + p["bytes"] for p in stats["partitions"])
        live = sum(u.get("bytes_live", 0) + u.get("blocks", 0) for u in stats["unit_stats"])
        if not held and not live:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(
                f"store not empty {timeout:.0f}s after discard: {held} keys+bytes in partitions, {live} live bytes+blocks in units"
            )
        time.sleep(0.05)


def run_demo(
    *,
    prompts_per_actor: int = 4,
    group_size: int = 4,
    rollout_actors: int = 2,
    dp_size: int = 2,
    min_len: int = 32,
    max_len: int = 384,
    seed: int = 0,
    ray_address: str | None = None,
) -> dict[str, Any]:
    """Run the demo step (see the module docstring), print its summary and return its numbers."""
    import ray

    from tq import KVBatchMeta, TQClient, TQServer, shard_meta_for_dp
    from tq.cli import format_bytes, print_status

    t0 = time.monotonic()
    ray.init(
        address=ray_address, num_cpus=None if ray_address else 2, include_dashboard=False, log_to_driver=False, logging_level="WARNING"
    )
    server = TQServer(storage_units=2, capacity=256 << 20)
    try:
        client = TQClient(server.address, timeout=30.0)
        client.register_partition(PARTITION)
        # Fractional CPUs: six actors and the driver share a 2-core machine without waiting on resources.
        rollout_cls = ray.remote(num_cpus=0.25)(RolloutActor)
        worker_cls = ray.remote(num_cpus=0.25)(DPWorker)
        rollouts = [rollout_cls.remote(server.address) for _ in range(rollout_actors)]
        workers = [worker_cls.remote(server.address, r) for r in range(dp_size)]
        print(f"TQ demo: Ray + TQ service up in {time.monotonic() - t0:.1f}s (controller {server.address})")

        # 1. Rollouts put bulk columns; only handles come back.
        results = ray.get(
            [
                a.rollout.remote([f"p{i}-{j}" for j in range(prompts_per_actor)], group_size, seed + i, min_len, max_len)
                for i, a in enumerate(rollouts)
            ],
            timeout=120,
        )
        meta = KVBatchMeta.concat([m for m, _ in results])
        rollout_bytes = sum(b for _, b in results)
        handle_bytes = sum(len(m.to_msgpack()) for m, _ in results)

        # 2. Shard for DP (token-balanced, same micro-batch count on every rank).
        shards = shard_meta_for_dp(meta, dp_size, sequence_packing=True, max_tokens_per_microbatch=2 * max_len)
        handle_bytes += sum(len(s.to_msgpack()) for s in shards)

        # 3. Workers: log-probs for their shard, written back under the same keys.
        lp = ray.get([w.compute_logprobs.remote(s) for w, s in zip(workers, shards)], timeout=120)

        # 4. Driver: per-sample columns only -> advantages.
        small = client.get(meta, DRIVER_FIELDS)
        driver_received = _nbytes(small)
        advantages, baseline = group_advantages(small["rewards"], meta.tags["group"])
        sample_mask = (small["seq_logprob_error"] < 50.0).float()  # the sequence log-prob error filter
        back = {"advantages": advantages.float(), "sample_mask": sample_mask}
        client.write_back(meta, back)
        driver_sent = _nbytes(back)

        # 5. Workers: the training fetch, now with advantages.
        train = ray.get(
            [w.train_step.remote(s.add_fields(["prev_logprobs", "advantages", "sample_mask"])) for w, s in zip(workers, shards)],
            timeout=120,
        )

        # 6. Clean up the step and check nothing is left behind.
        discarded = client.discard(meta)
        stats = _wait_store_empty(client)
        elapsed = time.monotonic() - t0

        worker_fetched = sum(r["fetched"] for r in lp + train)
        worker_written = sum(r["written"] for r in lp + train)
        out = {
            "samples": len(meta),
            "tokens": meta.total_tokens,
            "discarded": discarded,
            "rollout_bytes": rollout_bytes,
            "worker_fetched": worker_fetched,
            "worker_written": worker_written,
            "driver_received": driver_received,
            "driver_sent": driver_sent,
            "handle_bytes": handle_bytes,
            "losses": [r["loss"] for r in train],
            "elapsed_s": elapsed,
        }
        worker_total = worker_fetched + worker_written
        print(
            f"samples: {len(meta)} ({rollout_actors * prompts_per_actor} prompts x {group_size} generations), tokens: {meta.total_tokens}"
        )
        for r in lp:
            print(f"  dp rank {r['rank']}: {r['samples']} samples, {r['tokens']} tokens, {r['micro_batches']} micro-batches")
        print(f"rollout actors wrote: {rollout_bytes} bytes ({format_bytes(rollout_bytes)})")
        print(f"workers moved: {worker_total} bytes ({format_bytes(worker_total)}; fetched {worker_fetched}, wrote {worker_written})")
        print(
            f"driver received: {driver_received} bytes ({', '.join(DRIVER_FIELDS)}: per-sample only; "
            f"{100.0 * driver_received / max(worker_total, 1):.2f}% of the workers' traffic)"
        )
        print(f"driver sent: {driver_sent} bytes (advantages, sample_mask); handles passed: {handle_bytes} bytes of metas")
        print(
            f"group baselines: {sorted(set(round(float(b), 3) for b in baseline))[:4]}...; "
            f"loss per rank: {', '.join(f'{x:.4f}' for x in out['losses'])}"
        )
        print(f"store empty after discard: yes ({discarded} keys discarded)")
        print_status(stats, address=server.address)
        print(f"TQ demo finished in {elapsed:.1f}s")
        client.drop_partition(PARTITION)
        client.close()
        return out
    finally:
        server.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m tq.demo``; returns the process exit code."""
    p = argparse.ArgumentParser(description="Play one GRPO-shaped step through TQ with Ray actors.")
    p.add_argument("--prompts-per-actor", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--rollout-actors", type=int, default=2)
    p.add_argument("--dp-size", type=int, default=2)
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ray-address", help="join this Ray cluster instead of starting a local one")
    a = p.parse_args(argv)
    run_demo(
        prompts_per_actor=a.prompts_per_actor,
        group_size=a.group_size,
        rollout_actors=a.rollout_actors,
        dp_size=a.dp_size,
        max_len=a.max_len,
        seed=a.seed,
        ray_address=a.ray_address,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
