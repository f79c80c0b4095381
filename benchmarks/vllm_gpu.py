"""vLLM on one GPU: refit time against model size, generation throughput, log-prob agreement.

    python -m benchmarks.vllm_gpu make-model --size 0.5b --out /models/qwen2-0.5b-random
    python -m benchmarks.vllm_gpu run --models tiny,/models/qwen2-0.5b-random            # one GPU
    python -m benchmarks.vllm_gpu run-nccl --models /models/qwen2-0.5b-random --publish  # two GPUs
    python -m benchmarks.vllm_gpu summarize logs/<run>/metrics.jsonl

``run`` and ``run-nccl`` write a fresh ``logs/vllm_gpu/<timestamp>/`` (``vllm_gpu.json``,
``vllm_gpu_nccl.json``); ``--publish`` copies it over ``benchmarks/results/vllm_gpu_<machine>*.json``.

``make-model`` writes a random-init Qwen2 model (``0.5b``: Qwen2.5-0.5B's shape, 494M parameters;
``1.5b``: Qwen2.5-1.5B's, 1.54B) with transformers, plus the built-in tokenizer, so nothing comes from
the Hub. ``run`` starts one engine per model (engine core in its own process, eager) with a float32
"policy" copy of the same model on the same GPU - the colocated layout - and measures:

- refit seconds, median of ``--reps``: ``cuda_ipc`` (the policy casts its weights into its GPU buffer,
  vLLM maps it by a CUDA IPC handle and loads from it) and ``bytes`` (the state dict through the CPU
  in byte buckets: the fallback); both end with the engine's load done (synchronised);
- generation throughput: ``--prompts`` prompts of 64 random tokens x ``--max-tokens`` new tokens
  (``ignore_eos``), tokens generated per second, eager and (``--cudagraphs``) with CUDA graphs;
- ``token_mult_prob_error`` (NeMo-RL): mean over sampled tokens of ``exp|policy - vLLM|`` log-prob,
  the policy recomputing with float32 weights under bf16 autocast as the training workers do.

``run-nccl`` puts the engine in a Ray generation worker on one GPU and the float32 model in a
``StandaloneWeightSender`` on another, and times the refit by NCCL broadcast (cast into the sender's buffer,
broadcast, load; the group is joined before timing).

``summarize`` reads a training run's ``metrics.jsonl`` (``trainer.grpo_sync`` / ``trainer.grpo_async``)
and prints what the results files quote: the reward curve, the first step whose 10-step mean reward
reaches 0.8 and when, step and refit times, staleness (async), ``token_mult_prob_error``, validation.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.outputs import add_output_args, open_run
from common.models import TINY_MODEL, build_tiny_tokenizer, load_model
from policy.weight_sync import StandaloneWeightSender, nccl_refit, token_mult_prob_error

SIZES = {  # Qwen2.5's shapes (vocab 151936, tied embeddings)
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2),
}


def make_model(size: str, out: str) -> int:
    """Write a random-init Qwen2 model of ``size`` (bf16 safetensors) and the built-in tokenizer to ``out``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tiny_tokenizer()
    cfg = Qwen2Config(
        vocab_size=151936,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=1e6,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **SIZES[size],
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{out}: {n / 1e6:.0f}M parameters", flush=True)
    return n


def _timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _throughput(llm: Any, n: int, max_tokens: int) -> float:
    from vllm import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 100, (64,), generator=g).tolist()} for _ in range(n)]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False, temperature=1.0)
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, detokenize=False), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def _mult_prob_error(gen: Any, policy: torch.nn.Module, n: int, max_tokens: int) -> float:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 100, (16,), generator=g) for _ in range(n)]
    return token_mult_prob_error(policy, prompts, gen.generate(prompts, max_new_tokens=max_tokens, greedy=False))


def _engine_config(name: str, **extra: Any) -> Any:
    """The vLLM engine both measurements use: bf16, eager, a third of the GPU, 1024 positions."""
    from rollout.generation.config import GenerationBackendConfig

    return GenerationBackendConfig(
        backend="vllm",
        model_name=name,
        dtype="bfloat16",
        vllm_enforce_eager=True,
        vllm_gpu_memory_utilization=0.35,
        vllm_max_model_len=1024,
        ray_timeout_s=600,
        **extra,
    )


def bench_model(path: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement for one model (``tiny`` or a directory)."""
    from policy.weight_sync import WeightBucketSender
    from rollout.generation.vllm_backend import VllmGenerationBackend

    name = TINY_MODEL if path == "tiny" else path
    tok = build_tiny_tokenizer()
    t0 = time.perf_counter()
    gen = VllmGenerationBackend(_engine_config(name))
    start_s = time.perf_counter() - t0
    model = load_model(name, tokenizer=tok, device="cuda")  # float32, like a training worker's master weights
    n_params = sum(p.numel() for p in model.parameters())
    sender = WeightBucketSender()
    row: dict[str, Any] = {"model": path, "params": n_params, "engine_start_s": round(start_s, 1)}
    try:
        version = iter(range(1, 10_000))
        row["refit_cuda_ipc_s"] = _timed(
            lambda: gen.update_weights(sender.cuda_ipc_bucket(model, torch.bfloat16, 0), next(version)), args.reps
        )
        row["refit_bytes_s"] = _timed(lambda: gen.update_weights(model.state_dict(), next(version)), max(1, args.reps // 2))
        row["refit_bucket_bytes"] = int(sender._flat.numel())
        row["token_mult_prob_error"] = _mult_prob_error(gen, model, 64, 64)
        row["throughput_eager_tok_s"] = _throughput(gen.llm, args.prompts, args.max_tokens)
        print(json.dumps(row), flush=True)
    finally:
        gen.shutdown()
    if args.cudagraphs and path != "tiny":
        from vllm import LLM

        t0 = time.perf_counter()
        llm = LLM(model=path, dtype="bfloat16", gpu_memory_utilization=0.35, max_model_len=1024, skip_tokenizer_init=True)
        row["cudagraph_engine_start_s"] = round(time.perf_counter() - t0, 1)
        try:
            row["throughput_cudagraphs_tok_s"] = _throughput(llm, args.prompts, args.max_tokens)
        finally:
            llm.llm_engine.engine_core.shutdown()
        print(json.dumps(row), flush=True)
    return row


def bench_nccl(path: str, reps: int) -> dict[str, Any]:
    """Refit seconds over NCCL from a sender on one GPU to a vLLM worker on another (median of ``reps``)."""
    import ray

    from rollout.generation.ray_worker import RayGenerationPool

    name = TINY_MODEL if path == "tiny" else path
    pool = RayGenerationPool(_engine_config(name, num_gpus_per_worker=1))
    sender = ray.remote(num_gpus=1)(StandaloneWeightSender).remote(name)
    try:
        group = ray.get(sender.group.remote(2))
        t = time.perf_counter()
        bucket = nccl_refit(pool, sender, group, 1)  # joins the group
        first = time.perf_counter() - t
        times = []
        for v in range(2, 2 + reps):
            t = time.perf_counter()
            nccl_refit(pool, sender, group, v)
            times.append(time.perf_counter() - t)
        return {
            "model": path,
            "refit_nccl_s": statistics.median(times),
            "refit_nccl_first_s": first,
            "refit_bucket_bytes": bucket["nbytes"],
        }
    finally:
        pool.shutdown()
        ray.kill(sender)


def _window_mean(xs: list[float], n: int) -> list[float]:
    return [statistics.fmean(xs[max(0, i + 1 - n) : i + 1]) for i in range(len(xs))]


def summarize_run(metrics_path: str, launched: float | None = None, threshold: float = 0.8) -> dict[str, Any]:
    """What a GRPO run's ``metrics.jsonl`` says (see the module docstring); ``launched``: the launch's
    epoch seconds (else times count from the logger's start row, after start-up)."""
    rows = [json.loads(line) for line in open(metrics_path) if line.strip()]
    start = next((r["time"] for r in rows if r.get("split") == "start"), None)
    train = [r for r in rows if r.get("split") == "train"]
    if not train:
        raise ValueError(f"{metrics_path}: no training steps logged")
    if start is None:  # a fresh run directory has no start row: training began when step 1 did
        start = train[0]["time"] - float(train[0].get("step_time_s", 0.0))
    t0 = launched if launched is not None else start
    reward = [float(r["reward"]) for r in train]
    mean10 = _window_mean(reward, 10)
    hit = next((i for i, m in enumerate(mean10) if i >= 9 and m >= threshold), None)

    def med(key: str, skip_first: bool = False) -> float | None:
        xs = [float(r[key]) for r in train[1 if skip_first else 0 :] if r.get(key) is not None]
        return round(statistics.median(xs), 4) if xs else None

    out: dict[str, Any] = {
        "steps": len(train),
        "start_up_s": round(start - launched, 1) if launched is not None else None,
        "wall_s": round(train[-1]["time"] - t0, 1),
        f"first_step_10_step_mean_reward_ge_{threshold}": train[hit]["step"] if hit is not None else None,
        f"time_to_10_step_mean_reward_ge_{threshold}_s": round(train[hit]["time"] - t0, 1) if hit is not None else None,
        "last_10_mean_reward": round(mean10[-1], 4),
        "median_step_time_s": med("step_time_s", skip_first=True),
        "first_refit_s": round(float(train[0]["timing/refit"]), 3) if "timing/refit" in train[0] else None,
        "median_refit_s": med("timing/refit", skip_first=True),
        "median_timing_s": {k[7:]: med(k, skip_first=True) for k in sorted(train[-1]) if k.startswith("timing/")},
        "mean_token_mult_prob_error": round(statistics.fmean(float(r["token_mult_prob_error"]) for r in train), 5)
        if all("token_mult_prob_error" in r for r in train)
        else None,
        "validation_accuracy": [[r["step"], round(float(r["accuracy"]), 3)] for r in rows if r.get("split") == "val"],
        "reward": [round(x, 4) for x in reward],
    }
    if "async/trajectory_age_mean" in train[-1]:
        out["mean_trajectory_age"] = round(statistics.fmean(float(r["async/trajectory_age_mean"]) for r in train), 3)
        out["max_trajectory_age"] = max(float(r["async/trajectory_age_max"]) for r in train)
        out["median_generation_refit_s"] = med("async/generation_refit_s", skip_first=True)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``make-model``, ``run``, ``run-nccl``, ``summarize`` (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model", help="write a random-init Qwen2 model and the built-in tokenizer")
    m.add_argument("--size", choices=sorted(SIZES), required=True, help="Qwen2.5's shape to copy")
    m.add_argument("--out", required=True, help="directory to write the model to")
    r = sub.add_parser("run", help="refit, throughput and log-prob agreement on one GPU")
    r.add_argument("--models", default="tiny", help="comma-separated: 'tiny' and/or model directories")
    r.add_argument("--reps", type=int, default=5, help="refits timed per transport (median; bytes: half as many)")
    r.add_argument("--prompts", type=int, default=256, help="prompts of the throughput measurement")
    r.add_argument("--max-tokens", type=int, default=512, help="new tokens per prompt of the throughput measurement")
    r.add_argument("--cudagraphs", action="store_true", help="also measure throughput with CUDA graphs (compiles)")
    add_output_args(r, "vllm_gpu")
    n = sub.add_parser("run-nccl", help="refit over NCCL from one GPU to a vLLM engine on another (2 GPUs)")
    n.add_argument("--models", default="tiny", help="comma-separated: 'tiny' and/or model directories")
    n.add_argument("--reps", type=int, default=5, help="refits timed after the first (median)")
    add_output_args(n, "vllm_gpu")
    sm = sub.add_parser("summarize", help="what a training run's metrics.jsonl says (reward, step and refit times)")
    sm.add_argument("metrics", help="a run's metrics.jsonl")
    sm.add_argument("--launched", type=float, help="the launch's epoch seconds (default: when step 1 began)")
    sm.add_argument("--out", help="also write the summary here (JSON)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "summarize":
        text = json.dumps(summarize_run(args.metrics, args.launched), indent=1)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        print(text)
        return 0
    if args.cmd == "make-model":
        make_model(args.size, args.out)
        return 0
    run = open_run("vllm_gpu", args.run_dir)
    if args.cmd == "run-nccl":
        import ray

        ray.init(num_cpus=8, include_dashboard=False)
    rows = []
    for path in args.models.split(","):
        try:
            rows.append(bench_nccl(path, args.reps) if args.cmd == "run-nccl" else bench_model(path, args))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the model's blocks back to the driver before the next engine sizes itself
        except Exception as exc:  # one model failing must not lose the others' numbers
            rows.append({"model": path, "error": f"{type(exc).__name__}: {exc}"})
            print(f"{path}: {rows[-1]['error']}", file=sys.stderr, flush=True)
    try:
        vllm_version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        vllm_version = None
    result = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device",
        "torch": torch.__version__,
        "vllm": vllm_version,
        "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),
        "rows": rows,
    }
    with open(run.path("_nccl.json" if args.cmd == "run-nccl" else ".json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    run.finish(args.publish, args.machine, gpu=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
