"""vLLM on one GPU: refit time against model size, generation throughput, log-prob agreement.

    python -m benchmarks.vllm_gpu make-model --size 0.5b --out /models/qwen2-0.5b-random
    python -m benchmarks.vllm_gpu run --models tiny,/models/qwen2-0.5b-random --out results.json
    python -m benchmarks.vllm_gpu run-nccl --models tiny,/models/qwen2-0.5b-random --out nccl.json   # 2 GPUs

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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

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
    cfg = Qwen2Config(vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6,
                      bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **SIZES[size])
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


def bench_model(path: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement for one model (``tiny`` or a directory)."""
    from policy.weight_sync import WeightBucketSender
    from rollout.generation.config import GenerationBackendConfig
    from rollout.generation.vllm_backend import VllmGenerationBackend

    name = TINY_MODEL if path == "tiny" else path
    tok = build_tiny_tokenizer()
    t0 = time.perf_counter()
    gen = VllmGenerationBackend(GenerationBackendConfig(
        backend="vllm", model_name=name, dtype="bfloat16", vllm_enforce_eager=True, vllm_gpu_memory_utilization=0.35,
        vllm_max_model_len=1024, ray_timeout_s=600))
    start_s = time.perf_counter() - t0
    model = load_model(name, tokenizer=tok, device="cuda")  # float32, like a training worker's master weights
    n_params = sum(p.numel() for p in model.parameters())
    sender = WeightBucketSender()
    row: dict[str, Any] = {"model": path, "params": n_params, "engine_start_s": round(start_s, 1)}
    try:
        version = iter(range(1, 10_000))
        row["refit_cuda_ipc_s"] = _timed(lambda: gen.update_weights(sender.cuda_ipc_bucket(model, torch.bfloat16, 0), next(version)), args.reps)
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

    from rollout.generation.config import GenerationBackendConfig
    from rollout.generation.ray_worker import RayGenerationPool

    name = TINY_MODEL if path == "tiny" else path
    pool = RayGenerationPool(GenerationBackendConfig(
        backend="vllm", model_name=name, dtype="bfloat16", vllm_enforce_eager=True, vllm_gpu_memory_utilization=0.35,
        vllm_max_model_len=1024, ray_timeout_s=600, num_gpus_per_worker=1))
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
        return {"model": path, "refit_nccl_s": statistics.median(times), "refit_nccl_first_s": first,
                "refit_bucket_bytes": bucket["nbytes"]}
    finally:
        pool.shutdown()
        ray.kill(sender)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model")
    m.add_argument("--size", choices=sorted(SIZES), required=True)
    m.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--models", default="tiny", help="comma-separated: 'tiny' and/or model directories")
    r.add_argument("--reps", type=int, default=5)
    r.add_argument("--prompts", type=int, default=256)
    r.add_argument("--max-tokens", type=int, default=512)
    r.add_argument("--cudagraphs", action="store_true", help="also measure throughput with CUDA graphs (compiles)")
    r.add_argument("--out", required=True)
    n = sub.add_parser("run-nccl")
    n.add_argument("--models", default="tiny")
    n.add_argument("--reps", type=int, default=5)
    n.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.cmd == "make-model":
        make_model(args.size, args.out)
        return 0
    if args.cmd == "run-nccl":
        import ray

        ray.init(num_cpus=8, include_dashboard=False)
    rows = []
    for path in args.models.split(","):
        try:
            rows.append(bench_nccl(path, args.reps) if args.cmd == "run-nccl" else bench_model(path, args))
            torch.cuda.empty_cache()  # the model's blocks back to the driver before the next engine sizes itself
        except Exception as exc:  # one model failing must not lose the others' numbers
            rows.append({"model": path, "error": f"{type(exc).__name__}: {exc}"})
            print(f"{path}: {rows[-1]['error']}", file=sys.stderr, flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "vllm": __import__("vllm").__version__,
              "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
