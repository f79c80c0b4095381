"""vLLM generation on a GPU: refit over every transport, sleep mode, the async engine, log-prob agreement.

The GPU tests (marked ``gpu``) need vLLM and a CUDA device and are skipped, naming what is missing,
anywhere else (CPU CI). Each builds a real engine on the built-in tiny model and checks it against the
transformers backend on the same GPU, greedy, so a refit that did not land, landed partly, or landed
stale weights shows up as different tokens or log-probs. The bucket format tests run on CPU too.

Three of them reproduce the bugs of issue 18 (they failed on the code before the fix):
``test_refit_with_engine_core_in_its_own_process`` ('list' object has no attribute 'shape': tensors in
``collective_rpc`` arguments arrive as lists when the engine core runs in its own process),
``test_async_engine_generates_a_batch_and_refits`` (``TypeError: A coroutine object is required``) and
``test_sleep_mode_refit_then_generate`` (CUDA error: invalid argument, loading into sleeping weights).
"""

from __future__ import annotations

import os

import pytest
import torch

from common.models import TINY_MODEL, build_tiny_tokenizer, load_model
from common.weight_sync import bucket_layout, bucket_views, bytes_bucket_views, bytes_buckets, is_weight_bucket
from policy.weight_sync import StandaloneWeightSender, WeightBucketSender, nccl_refit, token_mult_prob_error, unique_named_tensors
from rollout.generation.config import GenerationBackendConfig

PROMPTS = ["3+4=", "hello", "<|im_start|>user\n1+1=", "abcabcabc"]


def _missing_for_gpu() -> str | None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vLLM is not installed (pip install 'tq-rl[vllm]')"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return None


_MISSING = _missing_for_gpu()
needs_gpu = pytest.mark.skipif(_MISSING is not None, reason=f"needs vLLM and a GPU: {_MISSING}")
MULTIPROCESSING = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "1"


# ---------------------------------------------------------------------- the bucket format (CPU)
def test_bytes_buckets_round_trip_with_casts_and_alignment():
    sd = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(300), "d": torch.ones(1)}
    buckets = bytes_buckets(sd, torch.bfloat16, limit=650)  # a: 30 B, b: 56 B, c: 600 B, d: 2 B
    assert [b["names"] for b in buckets] == [["a", "b"], ["c", "d"]]
    for b in buckets:
        assert is_weight_bucket(b) and all(off % 256 == 0 for off in b["offsets"])
    got = dict(v for b in buckets for v in bytes_bucket_views(b))
    assert got["a"].dtype == torch.bfloat16 and torch.equal(got["a"], sd["a"].to(torch.bfloat16))
    assert got["b"].dtype == torch.int64 and torch.equal(got["b"], sd["b"])  # integers are never cast
    assert torch.equal(got["c"], sd["c"].to(torch.bfloat16)) and got["d"].shape == (1,)
    got["a"].add_(1)  # views of a writable copy: a receiver may use them in place


def test_bucket_errors_name_what_is_wrong():
    layout = bucket_layout([("w", torch.zeros(4, 4))], torch.float32)
    with pytest.raises(ValueError, match="uint8 tensor of >= 256 bytes"):
        bucket_views(torch.zeros(10, dtype=torch.uint8), layout)
    with pytest.raises(TypeError, match="'x' is a list"):
        bytes_buckets({"x": [1, 2]})
    with pytest.raises(ValueError, match="transport"):
        bucket_layout([], transport="smoke-signals")
    assert not is_weight_bucket({"model.norm.weight": torch.zeros(2)})


def test_sender_sends_tied_weights_once_and_needs_a_gpu():
    tok = build_tiny_tokenizer()
    model = load_model(TINY_MODEL, tokenizer=tok)
    names = [n for n, _ in unique_named_tensors(model)]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied: sent once
    assert len(names) == len(model.state_dict()) - 1
    with pytest.raises(ValueError, match="needs the policy on a GPU"):
        WeightBucketSender().cuda_ipc_bucket(model, torch.bfloat16, 1)


def test_configs_refuse_a_refit_transport_they_cannot_use():
    from trainer.config import CONFIG_DIR, ConfigError, load_config

    for name in ("grpo_gpu_vllm_1gpu", "grpo_gpu_vllm_2gpu", "grpo_gpu_vllm_async_2gpu"):
        load_config(CONFIG_DIR / f"{name}.yaml")
    with pytest.raises(ConfigError, match="refit_transport 'cuda_ipc' needs generation.backend 'vllm'"):
        load_config(None, ["generation.refit_transport=cuda_ipc"])  # the CPU recipe: transformers, no GPU
    with pytest.raises(ConfigError, match="'nccl' is not supported in async mode"):
        load_config(CONFIG_DIR / "grpo_gpu_vllm_async_2gpu.yaml", ["generation.refit_transport=nccl"])


def test_two_gpu_recipes_cap_the_kv_cache_at_a_step():
    """Without a cap vLLM sizes its KV cache from memory: ~10M blocks for the tiny model at these
    fractions, and each refit's prefix-cache reset walks them all (0.58 s a step on 2 x H100). The cap
    must still hold a whole step's samples at once, so generation is never throttled by it."""
    from trainer.config import CONFIG_DIR, load_config

    for name in ("grpo_gpu_vllm_2gpu", "grpo_gpu_vllm_async_2gpu"):
        cfg = load_config(CONFIG_DIR / f"{name}.yaml")
        blocks = cfg.generation.vllm_extra_kwargs.get("num_gpu_blocks_override")
        assert blocks is not None and blocks <= 65536, f"{name}: KV cache not capped ({blocks})"
        per_sample = -(-(cfg.data.processor.max_seq_length + cfg.grpo.max_new_tokens) // 16)  # 16-token blocks
        assert blocks >= cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt * per_sample, name


def test_benchmark_writes_its_run_dir_only_and_summarizes_a_run(tmp_path, capsys):
    import json

    from benchmarks import vllm_gpu
    from benchmarks.outputs import snapshot

    sub = next(a for a in vllm_gpu.build_parser()._actions if a.dest == "cmd")
    for name, parser in sub.choices.items():
        missing = [a.option_strings or a.dest for a in parser._actions if not (a.help or "").strip()]
        assert not missing, f"{name}: options without help: {missing}"
    before = snapshot()
    assert vllm_gpu.main(["run", "--models", str(tmp_path / "no-model"), "--run-dir", str(tmp_path / "run")]) == 0
    rows = json.loads((tmp_path / "run" / "vllm_gpu.json").read_text())["rows"]
    assert rows[0]["model"] == str(tmp_path / "no-model") and rows[0]["error"]  # no vLLM here, or no such model
    assert snapshot() == before  # benchmarks/results/ only changes with --publish

    metrics, t0 = tmp_path / "metrics.jsonl", 1000.0
    with open(metrics, "w") as f:
        for step in range(1, 31):  # reward step / 20: the 10-step mean first reaches 0.8 at step 21 (mean of 12..21 = 0.82)
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "split": "train",
                        "time": t0 + 10 + step,
                        "reward": min(1.0, step / 20),
                        "step_time_s": 1.0,
                        "timing/refit": 4.0 if step == 1 else 0.01,
                        "token_mult_prob_error": 1.01,
                        "async/trajectory_age_mean": 1.0,
                        "async/trajectory_age_max": 1.0,
                        "async/generation_refit_s": 0.02,
                    }
                )
                + "\n"
            )
        f.write(json.dumps({"step": 20, "split": "val", "time": t0 + 31, "accuracy": 0.5}) + "\n")
    out = vllm_gpu.summarize_run(str(metrics), launched=t0)
    assert out["first_step_10_step_mean_reward_ge_0.8"] == 21 and out["time_to_10_step_mean_reward_ge_0.8_s"] == 31.0
    assert out["start_up_s"] == 10.0 and out["first_refit_s"] == 4.0 and out["median_refit_s"] == 0.01
    assert out["mean_trajectory_age"] == 1.0 and out["median_generation_refit_s"] == 0.02
    assert out["validation_accuracy"] == [[20, 0.5]] and len(out["reward"]) == 30


# ---------------------------------------------------------------------- vLLM on a GPU
@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _encode(tok, text):
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"])


def _vllm(**kw):
    from rollout.generation.vllm_backend import VllmGenerationBackend

    cfg = dict(
        backend="vllm",
        dtype="bfloat16",
        vllm_enforce_eager=True,
        vllm_gpu_memory_utilization=0.15,
        vllm_max_model_len=256,
        ray_timeout_s=300,
    )
    return VllmGenerationBackend(GenerationBackendConfig(**{**cfg, **kw}))


def _hf(tok, model):
    import copy

    from rollout.generation.hf_backend import HFGenerationBackend

    model = copy.deepcopy(model).to("cuda", torch.bfloat16)  # what vLLM holds: the weights cast to bf16
    return HFGenerationBackend(GenerationBackendConfig(device="cuda", dtype="bfloat16"), model=model, tokenizer=tok)


def _tiny(tok, seed):
    return load_model(TINY_MODEL, tokenizer=tok, seed=seed)  # float32, as a policy's master weights


def _check_against_hf(gen, tok, model, version, max_new_tokens=6):
    """``gen`` (refitted to ``model``) generates greedily what transformers does with ``model`` in bf16."""
    prompts = [_encode(tok, p) for p in PROMPTS]
    out = gen.generate(prompts, max_new_tokens=max_new_tokens, greedy=True)
    assert out.weight_version == version
    ref = _hf(tok, model).generate(prompts, max_new_tokens=max_new_tokens, greedy=True)
    assert [x.tolist() for x in out.response_ids] == [x.tolist() for x in ref.response_ids]
    for x, y in zip(out.logprobs, ref.logprobs):
        assert torch.allclose(x, y, atol=5e-2), (x, y)
    return out


@pytest.fixture(scope="module")
def engine(tok):
    """One synchronous engine (engine core in its own process unless the environment says otherwise)."""
    if _MISSING is not None:
        pytest.skip(f"needs vLLM and a GPU: {_MISSING}")
    gen = _vllm()
    yield gen
    gen.shutdown()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(not MULTIPROCESSING, reason="VLLM_ENABLE_V1_MULTIPROCESSING=0: the bug needs the engine core in its own process")
def test_refit_with_engine_core_in_its_own_process(engine, tok):
    _check_against_hf(engine, tok, _tiny(tok, 0), version=0)  # the policy's initial weights
    new = _tiny(tok, 1)
    engine.update_weights(new.state_dict(), weight_version=1)  # a plain state dict: the bytes fallback
    _check_against_hf(engine, tok, new, version=1)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(not MULTIPROCESSING, reason="CUDA IPC needs the engine core in another process than the sender")
def test_cuda_ipc_refit_from_a_gpu_policy(engine, tok):
    """A policy-side sender on the GPU refits the engine by a CUDA IPC handle; a second refit reuses the
    mapped buffer (same handle) and still lands the new values."""
    sender = WeightBucketSender()
    for seed, version in ((2, 10), (3, 11)):
        policy = _tiny(tok, seed).to("cuda")  # float32 master weights, as a training worker holds them
        bucket = sender.cuda_ipc_bucket(policy, torch.bfloat16, version)
        assert bucket["transport"] == "cuda_ipc" and "data" not in bucket  # a handle, not the weights
        engine.update_weights(bucket, weight_version=version)
        _check_against_hf(engine, tok, policy, version=version)


@pytest.mark.gpu
@needs_gpu
def test_generation_logprobs_agree_with_the_policy(engine, tok):
    """NeMo-RL's token_mult_prob_error (mean exp|policy - generation| per token) of sampled responses:
    vLLM's log-probs against the policy's own recomputation (float32 weights, bf16 autocast)."""
    sender = WeightBucketSender()
    policy = _tiny(tok, 4).to("cuda")
    engine.update_weights(sender.cuda_ipc_bucket(policy, torch.bfloat16, 20) if MULTIPROCESSING else policy.state_dict(), 20)
    prompts = [_encode(tok, p) for p in PROMPTS] * 16
    err = token_mult_prob_error(policy, prompts, engine.generate(prompts, max_new_tokens=16, greedy=False))
    assert 1.0 <= err <= 1.05, err


@pytest.mark.gpu
@needs_gpu
def test_async_engine_generates_a_batch_and_refits(tok):
    import asyncio

    gen = _vllm(vllm_async_engine=True)
    try:
        _check_against_hf(gen, tok, _tiny(tok, 0), version=0)
        new = _tiny(tok, 1)
        gen.update_weights(new.state_dict(), weight_version=1)
        batch = _check_against_hf(gen, tok, new, version=1)

        async def one_by_one():
            return await asyncio.gather(*(gen.generate_async(_encode(tok, p), max_new_tokens=6, greedy=True) for p in PROMPTS))

        for single, ids in zip(asyncio.run(one_by_one()), batch.response_ids):
            assert single.response_ids[0].tolist() == ids.tolist() and single.weight_version == 1
    finally:
        gen.shutdown()


@pytest.mark.gpu
@needs_gpu
def test_sleep_mode_refit_then_generate(tok):
    """The colocated cycle: generate, sleep (training runs), refit the sleeping engine, wake, generate."""
    gen = _vllm(vllm_enable_sleep_mode=True)
    try:
        model = _tiny(tok, 0)  # the model the engine started with
        for version in (1, 2, 3):
            gen.prepare_for_generation()
            _check_against_hf(gen, tok, model, version=version - 1)
            gen.finish_generation()  # asleep: weights offloaded, KV cache released
            free_asleep = torch.cuda.mem_get_info()[0]
            model = _tiny(tok, version)
            gen.update_weights(model.state_dict(), weight_version=version)  # the refit wakes the weights only
            assert torch.cuda.mem_get_info()[0] >= free_asleep - (64 << 20)  # the KV cache still sleeps
        gen.prepare_for_generation()
        assert torch.cuda.mem_get_info()[0] < free_asleep - (64 << 20)  # now the KV cache is back
        _check_against_hf(gen, tok, model, version=3)
    finally:
        gen.shutdown()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL refit across GPUs needs 2 GPUs")
def test_nccl_refit_across_gpus(tok):
    """vLLM in a Ray generation worker on one GPU, the sender on another: the refit is a broadcast in a
    stateless NCCL group (joined at the first refit, reused by the second)."""
    import ray

    from rollout.generation.ray_worker import RayGenerationPool

    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False)
    try:
        pool = RayGenerationPool(
            GenerationBackendConfig(
                backend="vllm",
                dtype="bfloat16",
                vllm_enforce_eager=True,
                vllm_gpu_memory_utilization=0.2,
                vllm_max_model_len=256,
                ray_timeout_s=300,
                num_gpus_per_worker=1,
            )
        )
        sender = ray.remote(num_gpus=1)(StandaloneWeightSender).remote(TINY_MODEL, seed=5)
        group = ray.get(sender.group.remote(2))
        for seed, version in ((5, 1), (6, 2)):
            ray.get(sender.reseed.remote(seed))
            bucket = nccl_refit(pool, sender, group, version)
            assert bucket["transport"] == "nccl" and "data" not in bucket
            _check_against_hf(pool, tok, _tiny(tok, seed), version=version)
        pool.shutdown()
    finally:
        ray.shutdown()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a CUDA IPC refit per engine needs 2 GPUs")
def test_cuda_ipc_refit_gives_each_engine_the_buffer_on_its_own_gpu(tok):
    """The colocated refit on 2 GPUs: a placement group bundle per GPU holds a sender (a policy rank's
    side) and a vLLM engine; ``update_weights`` with one bucket per worker maps, in each engine, the
    buffer of the sender beside it. The two senders hold different weights, so an engine that got the
    other GPU's bucket (or the first one, as before the per-worker list) gives the wrong log-probs."""
    import ray

    from common.placement import in_bundle
    from rollout.generation.ray_worker import RayGenerationPool

    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False)
    try:
        pg = ray.util.placement_group([{"GPU": 1, "CPU": 1}] * 2)
        ray.get(pg.ready(), timeout=60)
        cfg = dict(backend="vllm", dtype="bfloat16", vllm_enforce_eager=True, vllm_gpu_memory_utilization=0.2, vllm_max_model_len=256)
        pool = RayGenerationPool(
            GenerationBackendConfig(**cfg, ray_timeout_s=300, ray_workers=2, num_gpus_per_worker=0.5, num_cpus_per_worker=0.25),
            placement_group=pg,
        )
        senders = [
            ray.remote(num_gpus=0.5, num_cpus=0.25)(StandaloneWeightSender).options(**in_bundle(pg, j)).remote(TINY_MODEL, seed=7 + j)
            for j in range(2)
        ]
        engine_gpus = [ray.get(w.__ray_call__.remote(lambda _: ray.get_gpu_ids())) for w in pool.workers]
        sender_gpus = [ray.get(s.__ray_call__.remote(lambda _: ray.get_gpu_ids())) for s in senders]
        assert engine_gpus == sender_gpus and engine_gpus[0] != engine_gpus[1], (engine_gpus, sender_gpus)
        for version, seeds in ((1, (7, 8)), (2, (9, 10))):  # new weights on both GPUs: the second refit lands too
            if version > 1:
                ray.get([s.reseed.remote(seed) for s, seed in zip(senders, seeds)])
            buckets = ray.get([s.ipc_bucket.remote(version) for s in senders])
            assert all(b["transport"] == "cuda_ipc" and "data" not in b for b in buckets)
            pool.update_weights(buckets, weight_version=version)
            prompts = [_encode(tok, p) for p in PROMPTS]
            out = pool.generate(prompts * 2, max_new_tokens=6, greedy=True)  # the first 4 to engine 0, the rest to engine 1
            assert out.weight_version == version
            refs = [_hf(tok, _tiny(tok, seed)).generate(prompts, max_new_tokens=6, greedy=True) for seed in seeds]
            # a tiny random model's greedy tokens may not tell two inits apart; its log-probs do
            assert not all(torch.allclose(x, y, atol=0.2) for x, y in zip(refs[0].logprobs, refs[1].logprobs))
            for j, ref in enumerate(refs):
                assert [x.tolist() for x in out.response_ids[4 * j : 4 * j + 4]] == [x.tolist() for x in ref.response_ids], (version, j)
                for x, y in zip(out.logprobs[4 * j : 4 * j + 4], ref.logprobs):
                    assert torch.allclose(x, y, atol=5e-2), (version, j, x, y)
        pool.shutdown()
    finally:
        ray.shutdown()
