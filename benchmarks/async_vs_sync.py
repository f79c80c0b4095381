"""Async vs sync GRPO steps/minute on a generation-dominated config, measured side by side in one run.

    python -m benchmarks.async_vs_sync                       # 20 steps, 256 new tokens, DP 1 and 2, 2 rounds
    python -m benchmarks.async_vs_sync --steps 10 --max-new-tokens 64 --dp-sizes 2

Results go to a fresh ``logs/async_vs_sync/<timestamp>/async_vs_sync.json``; ``--publish`` also writes
``benchmarks/results/async_vs_sync_<machine>.json``.

Runs ``trainer.grpo_sync`` and ``trainer.grpo_async`` alternately (``--rounds`` times each, for each
DP layout in ``--dp-sizes``; same model, prompts, batch, seed and Ray/CPU/thread settings on both
sides; both with importance-sampling correction, which async mode requires) and prints each one's
steps/minute, the ratio per layout and the ratio of each side's best layout. A rate counts the
steps after the first and before the last: the first includes start-up and the first generation;
the last async step does not wait for a next step's generation. Long responses
(``--max-new-tokens``) make generation dominate the sync step - autoregressive decoding is
sequential while training processes every token at once - which is where overlap pays off.

Every process's torch runs one intra-op thread on both sides (Ray sets ``OMP_NUM_THREADS=1`` in its
actors; ``policy.torch_num_threads=1`` for the DP workers). Why layouts matter on few cores: sync
runs one thing at a time, so two DP workers let training use both cores; async runs the generator
(one thread) beside training, so with two DP workers three busy processes share two cores and the
generator - the bottleneck here - slows down, while one DP worker gives each stage its own core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import ray

from benchmarks.outputs import add_output_args, cpu_model, open_run


def _overrides(args: argparse.Namespace, log_dir: str, dp_size: int) -> list[str]:
    n = args.prompts * args.generations
    return [
        f"grpo.num_prompts_per_step={args.prompts}",
        f"grpo.num_generations_per_prompt={args.generations}",
        f"grpo.max_num_steps={args.steps}",
        f"grpo.max_new_tokens={args.max_new_tokens}",
        f"generation.max_new_tokens={args.max_new_tokens}",
        "grpo.val_period=0",
        f"policy.train_global_batch_size={n}",
        f"policy.train_micro_batch_size={min(n, 32)}",
        f"policy.logprob_batch_size={n}",
        f"policy.dp_size={dp_size}",
        "policy.torch_num_threads=1",
        "data.num_builtin_prompts=200",
        "logger.tensorboard=false",
        "logger.plot=false",
        "logger.progress=false",
        "logger.data_movement_metrics=true",
        f"logger.log_dir={log_dir}",
        f"cluster.num_cpus={args.num_cpus}",
        "checkpointing.enabled=false",
        f"data.processor.max_seq_length={64 + args.max_new_tokens}",
    ]


def _measure(trainer_cls: type, cfg: Any) -> dict[str, Any]:
    trainer = trainer_cls(cfg)
    try:
        t0 = time.perf_counter()
        history = trainer.fit()
        total = time.perf_counter() - t0
        timeline = ray.get(trainer.collector.get_timeline.remote()) if getattr(trainer, "collector", None) else None
    finally:
        trainer.shutdown()
        ray.shutdown()
    timed = history[1:-1]
    wall = sum(h["step_time_s"] for h in timed)
    out: dict[str, Any] = {
        "steps": len(history),
        "timed_steps": len(timed),
        "steps_per_min": 60.0 * len(timed) / wall,
        "fit_s": total,
        "mean_step_s": wall / len(timed),
        "reward_last": history[-1]["reward"],
        "timing_mean_s": {k: statistics.fmean(h.get(k, 0.0) for h in timed) for k in sorted(timed[0]) if k.startswith("timing/")},
    }
    if timeline:  # how busy the generator was over the timed steps: 1.0 = generating all the time
        out["generator_calls"] = len(timeline)
        out["generator_busy_s"] = sum(e - s for s, e, _, _ in timeline)
    if "async/trajectory_age_mean" in timed[0]:
        out["trajectory_age_mean"] = statistics.fmean(h["async/trajectory_age_mean"] for h in timed)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line (every option with its help)."""
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1]
    )
    p.add_argument("--steps", type=int, default=20, help="GRPO steps per run; the first and the last are not timed (default 20)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    p.add_argument("--generations", type=int, default=8, help="responses generated per prompt (default 8)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help="tokens generated per response: longer responses make generation dominate a step (default 256)",
    )
    p.add_argument("--dp-sizes", type=int, nargs="+", default=[1, 2], help="DP worker layouts, each run on both sides (default 1 2)")
    p.add_argument("--max-age", type=int, default=None, help="async_grpo.max_trajectory_age_steps (default: the async recipe's)")
    p.add_argument("--num-cpus", type=float, default=2, help="logical CPUs Ray is given, the same on both sides (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="each (layout, side) this many times, interleaved (default 2)")
    add_output_args(p, "async_vs_sync")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error("--steps must be >= 3 (the first and the last step are excluded from the rate)")
    if args.rounds < 1 or args.prompts < 1 or args.generations < 1 or args.max_new_tokens < 1 or min(args.dp_sizes) < 1:
        p.error("--rounds, --prompts, --generations, --max-new-tokens and --dp-sizes must be >= 1")
    out = open_run("async_vs_sync", args.run_dir)
    from trainer.config import parse_cli
    from trainer.grpo_async import ASYNC_CONFIG, GRPOAsyncTrainer
    from trainer.grpo_sync import GRPOSyncTrainer

    age = [] if args.max_age is None else [f"async_grpo.max_trajectory_age_steps={args.max_age}"]
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for dp in args.dp_sizes:
                for side, cls, base in (
                    ("sync", GRPOSyncTrainer, ["loss.use_importance_sampling_correction=true"]),
                    ("async", GRPOAsyncTrainer, ["--config", str(ASYNC_CONFIG), *age]),
                ):
                    name = f"{side}_dp{dp}"
                    res = _measure(cls, parse_cli([*base, *_overrides(args, tmp, dp)]))
                    runs.setdefault(name, []).append(res)
                    print(
                        f"round {r + 1} {name:9s}: {res['steps_per_min']:6.1f} steps/min (mean step {res['mean_step_s']:.3f}s "
                        f"over {res['timed_steps']} steps) "
                        + " ".join(f"{k[7:]}={v:.3f}" for k, v in res["timing_mean_s"].items() if not k.startswith("timing/worker_")),
                        flush=True,
                    )
    rate = {}
    for name, rs in runs.items():  # pooled over rounds: total timed steps / total timed seconds
        rate[name] = 60.0 * sum(x["timed_steps"] for x in rs) / sum(x["timed_steps"] * x["mean_step_s"] for x in rs)
    results: dict[str, Any] = {
        "machine": f"{os.cpu_count()} CPUs ({cpu_model()})",
        "config": vars(args),
        "steps_per_min": rate,
        "runs": runs,
    }
    results["config"]["max_age"] = parse_cli(["--config", str(ASYNC_CONFIG), *age]).async_grpo.max_trajectory_age_steps
    results["ratio_same_layout"] = {f"dp{dp}": rate[f"async_dp{dp}"] / rate[f"sync_dp{dp}"] for dp in args.dp_sizes}
    best_sync = max((k for k in rate if k.startswith("sync")), key=rate.get)
    best_async = max((k for k in rate if k.startswith("async")), key=rate.get)
    results["best"] = {"sync": best_sync, "async": best_async, "ratio_async_over_sync": rate[best_async] / rate[best_sync]}
    print("steps/min: " + ", ".join(f"{k} {v:.1f}" for k, v in rate.items()))
    print("async / sync, same layout: " + ", ".join(f"{k} {v:.2f}x" for k, v in results["ratio_same_layout"].items()))
    print(f"async / sync, each side's best layout ({best_async} / {best_sync}): {results['best']['ratio_async_over_sync']:.2f}x")
    with open(out.path(".json"), "w") as f:
        json.dump(results, f, indent=2)
    out.finish(args.publish, args.machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
