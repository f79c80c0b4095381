"""Async vs sync GRPO steps/minute on a generation-dominated config, measured side by side in one run.

    python -m benchmarks.async_vs_sync                      # defaults: 6 steps each, 24 new tokens
    python -m benchmarks.async_vs_sync --steps 10 --max-new-tokens 32 --json out.json

Runs ``trainer.grpo_sync`` then ``trainer.grpo_async`` (same model, prompts, batch and seed; the async
run with importance-sampling correction, as async mode requires) and prints each one's steps/minute
over the steps after the first (start-up and the first generation excluded) and the ratio. Long
responses (``--max-new-tokens``) make generation dominate the step, which is where overlapping it
with training pays off; on a machine with few cores the two compete for the same CPUs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import ray


def _overrides(args: argparse.Namespace, log_dir: str) -> list[str]:
    n = args.prompts * args.generations
    return [
        f"grpo.num_prompts_per_step={args.prompts}", f"grpo.num_generations_per_prompt={args.generations}",
        f"grpo.max_num_steps={args.steps}", f"grpo.max_new_tokens={args.max_new_tokens}",
        f"generation.max_new_tokens={args.max_new_tokens}", "grpo.val_period=0",
        f"policy.train_global_batch_size={n}", f"policy.train_micro_batch_size={min(n, 32)}", f"policy.logprob_batch_size={n}",
        "data.num_builtin_prompts=200", "logger.tensorboard=false", "logger.plot=false", "logger.progress=false",
        f"logger.log_dir={log_dir}", f"cluster.num_cpus={args.num_cpus}", "checkpointing.enabled=false",
        f"data.processor.max_seq_length={64 + args.max_new_tokens}",
    ]


def _measure(trainer_cls: type, cfg: object) -> dict[str, float]:
    trainer = trainer_cls(cfg)
    try:
        t0 = time.perf_counter()
        history = trainer.fit()
        total = time.perf_counter() - t0
    finally:
        trainer.shutdown()
        ray.shutdown()
    timed = [h["step_time_s"] for h in history[1:]]
    return {"steps": len(history), "steps_per_min": 60.0 * len(timed) / sum(timed), "fit_s": total,
            "mean_step_s": sum(timed) / len(timed), "reward_last": history[-1]["reward"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--num-cpus", type=float, default=2)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step is excluded from the rate)")
    from trainer.config import parse_cli
    from trainer.grpo_async import ASYNC_CONFIG, GRPOAsyncTrainer
    from trainer.grpo_sync import GRPOSyncTrainer

    with tempfile.TemporaryDirectory() as tmp:
        sync_cfg = parse_cli([*_overrides(args, tmp), "loss.use_importance_sampling_correction=true"])
        async_cfg = parse_cli(["--config", str(ASYNC_CONFIG), *_overrides(args, tmp)])
        results = {"sync": _measure(GRPOSyncTrainer, sync_cfg), "async": _measure(GRPOAsyncTrainer, async_cfg)}
    results["ratio_async_over_sync"] = results["async"]["steps_per_min"] / results["sync"]["steps_per_min"]
    results["config"] = vars(args)
    for name in ("sync", "async"):
        r = results[name]
        print(f"{name:5s}: {r['steps_per_min']:.2f} steps/min (mean step {r['mean_step_s']:.2f}s over {r['steps'] - 1} steps; fit {r['fit_s']:.1f}s)")
    print(f"async / sync: {results['ratio_async_over_sync']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
