"""Generation backends on the tiny offline model: outputs, stops, log-probs, seeding, refit, Ray."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common.models import TINY_MODEL, load_model
from rollout.generation import GenerationBackendConfig, make_generation_backend
from rollout.generation.hf_backend import HFGenerationBackend

PROMPTS = ["2+3=", "hello, world 12", "x"]


def encode(tok, text: str) -> torch.Tensor:
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)


def backend(model, tok, **cfg) -> HFGenerationBackend:
    return HFGenerationBackend(GenerationBackendConfig(**cfg), model=model, tokenizer=tok)


def expected_logprobs(model, prompt, response, *, temperature=1.0, top_k=0) -> torch.Tensor:
    """log p(response[t] | prompt, response[:t]) from one unpadded forward pass, processed like the sampler."""
    full = torch.cat([prompt, response]).unsqueeze(0)
    with torch.no_grad():
        logits = model(full).logits[0, prompt.numel() - 1 : -1].float() / temperature
    if top_k > 0:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.log_softmax(logits, dim=-1).gather(1, response.unsqueeze(1)).squeeze(1)


def test_shapes_lengths_and_finish_reasons(model, tok):
    b = backend(model, tok)
    prompts = [encode(tok, p) for p in PROMPTS]
    out = b.generate(prompts, max_new_tokens=6)
    assert len(out.response_ids) == len(out.logprobs) == len(out.finish_reasons) == 3
    for ids, lps, reason in zip(out.response_ids, out.logprobs, out.finish_reasons):
        assert ids.dtype == torch.int64 and ids.dim() == 1 and 1 <= ids.numel() <= 6
        assert lps.dtype == torch.float32 and lps.shape == ids.shape
        assert torch.isfinite(lps).all() and (lps <= 0).all()
        ended = ids[-1].item() in b.stop_token_ids
        assert reason == ("stop" if ended else "length")
        assert ended or ids.numel() == 6
    assert out.weight_version == 0


def test_eos_token_ends_response_and_is_kept(model, tok):
    prompt = [encode(tok, "abc")]
    # A seed whose response has a later token that did not occur before; make it the only stop token.
    for seed in range(3, 64):
        ref = backend(model, tok, seed=seed).generate(prompt, max_new_tokens=8).response_ids[0]
        ks = [k for k in range(2, ref.numel()) if ref[k].item() not in ref[:k].tolist()]
        if ks:
            break
    k = ks[0]
    out = backend(model, tok, seed=seed, stop_token_ids=[ref[k].item()]).generate(prompt, max_new_tokens=8)
    assert out.finish_reasons == ["stop"]
    assert torch.equal(out.response_ids[0], ref[: k + 1])  # same seed, same draws, cut right after EOS
    assert out.logprobs[0].shape == (k + 1,)


def test_per_prompt_stop_strings(model, tok):
    prompts = [encode(tok, "abc"), encode(tok, "hello")]
    ref = backend(model, tok, seed=5).generate(prompts, max_new_tokens=10)
    r0 = ref.response_ids[0].tolist()
    # A two-token stop string that first completes at token k (both tokens printable characters).
    visible = lambda t: tok.decode([t], skip_special_tokens=True).strip() != ""  # noqa: E731
    k = next(k for k in range(2, 10) if visible(r0[k - 1]) and visible(r0[k]) and tok.decode(r0[k - 1 : k + 1]) not in tok.decode(r0[:k]))
    stop = tok.decode(r0[k - 1 : k + 1])
    out = backend(model, tok, seed=5).generate(prompts, max_new_tokens=10, stop_strings=[[stop], None])
    assert out.finish_reasons[0] == "stop"
    assert out.response_ids[0].tolist() == r0[: k + 1]
    assert tok.decode(out.response_ids[0]).endswith(stop)
    assert torch.allclose(out.logprobs[0], ref.logprobs[0][: k + 1])
    # The other prompt has no stop strings: untouched.
    assert torch.equal(out.response_ids[1], ref.response_ids[1])
    assert out.finish_reasons[1] == ref.finish_reasons[1]


@pytest.mark.parametrize(
    "cfg, expect",
    [
        (dict(temperature=1.0), dict(temperature=1.0)),
        (dict(temperature=0.7), dict(temperature=0.7)),
        (dict(temperature=1.0, top_k=5), dict(top_k=5)),
        (dict(temperature=0.7, logprobs_mode="raw"), dict(temperature=1.0)),
    ],
    ids=["T1", "T0.7", "top_k5", "raw_mode"],
)
def test_logprobs_match_forward_pass(model, tok, cfg, expect):
    b = backend(model, tok, seed=11, **cfg)
    prompts = [encode(tok, p) for p in PROMPTS]  # different lengths: exercises left padding
    out = b.generate(prompts, max_new_tokens=8)
    for p, ids, lps in zip(prompts, out.response_ids, out.logprobs):
        ref = expected_logprobs(model, p, ids, **expect)
        assert torch.allclose(lps, ref, atol=1e-4), (lps, ref)
    if "top_k" in cfg:  # every sampled token is one of the top k
        assert all(torch.isfinite(lp).all() for lp in out.logprobs)


def test_seeded_reproducibility(model, tok):
    prompts = [encode(tok, p) for p in PROMPTS]
    rng_before = torch.get_rng_state()
    a, b, c = backend(model, tok, seed=7), backend(model, tok, seed=7), backend(model, tok, seed=8)
    a1, a2 = a.generate(prompts, max_new_tokens=8), a.generate(prompts, max_new_tokens=8)
    b1, b2 = b.generate(prompts, max_new_tokens=8), b.generate(prompts, max_new_tokens=8)
    c1 = c.generate(prompts, max_new_tokens=8)
    same = lambda x, y: all(torch.equal(i, j) for i, j in zip(x.response_ids, y.response_ids))  # noqa: E731
    assert same(a1, b1) and same(a2, b2)  # same seed, same call sequence: same tokens
    assert not same(a1, a2)  # a call counter moves the seed between calls
    assert not same(a1, c1)  # another seed, other samples
    assert torch.equal(torch.get_rng_state(), rng_before)  # the global RNG is not consumed


def test_greedy_is_deterministic_and_batch_invariant(model, tok):
    b = backend(model, tok, seed=0)
    prompts = [encode(tok, p) for p in PROMPTS]
    g1 = b.generate(prompts, max_new_tokens=8, greedy=True)
    g2 = b.generate(prompts, max_new_tokens=8, greedy=True)
    assert all(torch.equal(x, y) for x, y in zip(g1.response_ids, g2.response_ids))
    # Alone (no padding) vs. in a left-padded batch: the same tokens and log-probs.
    for i, p in enumerate(prompts):
        alone = b.generate([p], max_new_tokens=8, greedy=True)
        assert torch.equal(alone.response_ids[0], g1.response_ids[i])
        assert torch.allclose(alone.logprobs[0], g1.logprobs[i], atol=1e-5)
    # Greedy picks the argmax: its log-prob is the largest of the raw distribution.
    p, ids = prompts[0], g1.response_ids[0]
    with torch.no_grad():
        logits = model(torch.cat([p, ids]).unsqueeze(0)).logits[0, p.numel() - 1 : -1]
    assert torch.equal(logits.argmax(-1), ids)
    # The async path (a thread by default) gives the same answer.
    one = asyncio.run(b.generate_async(prompts[1], max_new_tokens=8, greedy=True))
    assert torch.equal(one.response_ids[0], g1.response_ids[1])
    # temperature 0 in the config means greedy too.
    g3 = backend(model, tok, temperature=0.0).generate(prompts, max_new_tokens=8)
    assert all(torch.equal(x, y) for x, y in zip(g1.response_ids, g3.response_ids))


def test_shared_training_model_generates_in_eval_mode(tok):
    """Colocated with a policy that trains (dropout on), generation still uses the eval-mode model
    and leaves the module in training mode afterwards."""
    m = load_model(TINY_MODEL, tokenizer=tok, tiny_overrides={"attention_dropout": 0.5})
    m.train()
    p = encode(tok, "abc")
    out = backend(m, tok).generate([p], max_new_tokens=6)
    assert m.training
    m.eval()
    assert torch.allclose(out.logprobs[0], expected_logprobs(m, p, out.response_ids[0]), atol=1e-4)


def test_bad_arguments(model, tok):
    b = backend(model, tok)
    with pytest.raises(ValueError, match="non-empty"):
        b.generate([torch.tensor([], dtype=torch.int64)], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        b.generate([encode(tok, "a")], max_new_tokens=0)
    with pytest.raises(ValueError, match="stop_strings has 1 entries for 2 prompts"):
        b.generate([encode(tok, "a"), encode(tok, "b")], max_new_tokens=4, stop_strings=[["x"]])


def test_refit_generates_with_new_weights(tok):
    prompts = [encode(tok, p) for p in PROMPTS]
    old_model = load_model(TINY_MODEL, tokenizer=tok, seed=0)
    new_model = load_model(TINY_MODEL, tokenizer=tok, seed=1)
    gen = HFGenerationBackend(GenerationBackendConfig(model_seed=0, seed=4), tokenizer=tok)  # owns its model
    gen.generate(prompts, max_new_tokens=8)
    gen.update_weights(new_model.state_dict(), weight_version=3)
    after = gen.generate(prompts, max_new_tokens=8)
    assert gen.weight_version == 3 and after.weight_version == 3
    # The log-probs are the new model's, not the old one's.
    for p, ids, lps in zip(prompts, after.response_ids, after.logprobs):
        assert torch.allclose(lps, expected_logprobs(new_model, p, ids), atol=1e-4)
        assert not torch.allclose(lps, expected_logprobs(old_model, p, ids), atol=1e-2)
    # Same tokens as a generator independently built on the new weights, at the same call index.
    ref = HFGenerationBackend(GenerationBackendConfig(model_seed=1, seed=4), tokenizer=tok)
    ref.generate(prompts, max_new_tokens=8)
    ref_after = ref.generate(prompts, max_new_tokens=8)
    for x, y, lx, ly in zip(after.response_ids, ref_after.response_ids, after.logprobs, ref_after.logprobs):
        assert torch.equal(x, y) and torch.allclose(lx, ly, atol=1e-6)

    # A partial or mismatched state dict is refused and leaves the version unchanged.
    sd = new_model.state_dict()
    partial = {k: v for k, v in sd.items() if "layers.1." not in k}
    with pytest.raises(KeyError, match="missing"):
        gen.update_weights(partial, weight_version=4)
    with pytest.raises(KeyError, match="not in the model"):
        gen.update_weights({**sd, "bogus.weight": torch.zeros(1)}, weight_version=4)
    bad = dict(sd)
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        gen.update_weights(bad, weight_version=4)
    assert gen.weight_version == 3


def test_factory_selects_backend(tok):
    assert isinstance(make_generation_backend({"backend": "hf"}, tokenizer=tok), HFGenerationBackend)
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="vLLM"):
            make_generation_backend({"backend": "vllm"})
    with pytest.raises(ValueError):
        GenerationBackendConfig(backend="tgi")


def test_ray_pool_generates_and_refits_through_object_store(ray_session, model, tok):
    from rollout.generation.ray_worker import RayGenerationPool

    prompts = [encode(tok, p) for p in PROMPTS]
    pool = RayGenerationPool(GenerationBackendConfig(ray_timeout_s=120), num_workers=2)
    try:
        local = backend(model, tok).generate(prompts, max_new_tokens=6, greedy=True)
        remote = pool.generate(prompts, max_new_tokens=6, greedy=True)  # split over 2 workers, reassembled
        assert all(torch.equal(x, y) for x, y in zip(local.response_ids, remote.response_ids))
        assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(local.logprobs, remote.logprobs))

        new_model = load_model(TINY_MODEL, tokenizer=tok, seed=1)
        pool.update_weights(new_model.state_dict(), weight_version=1)
        assert pool.weight_version == 1
        after = pool.generate(prompts, max_new_tokens=6, greedy=True)
        assert after.weight_version == 1
        ref = backend(new_model, tok).generate(prompts, max_new_tokens=6, greedy=True)
        assert all(torch.equal(x, y) for x, y in zip(ref.response_ids, after.response_ids))
        for p, ids, lps, old_lps in zip(prompts, after.response_ids, after.logprobs, remote.logprobs):
            assert torch.allclose(lps, expected_logprobs(new_model, p, ids), atol=1e-4)  # the pushed weights
            assert not torch.allclose(lps, old_lps, atol=1e-2)

        async def two_async():
            return await asyncio.gather(*(pool.generate_async(p, max_new_tokens=6, greedy=True) for p in prompts[:2]))

        outs = asyncio.run(two_async())
        for i, o in enumerate(outs):
            assert torch.equal(o.response_ids[0], ref.response_ids[i]) and o.weight_version == 1

        # One state per worker (as a CUDA IPC refit of colocated engines ships them: worker j gets
        # item j, an object reference resolved where it runs). The batch's first prompt goes to
        # worker 0, the rest to worker 1.
        third = load_model(TINY_MODEL, tokenizer=tok, seed=2)
        pool.update_weights([ray_session.put(m.state_dict()) for m in (new_model, third)], weight_version=2)
        split = pool.generate(prompts, max_new_tokens=6, greedy=True)
        assert split.weight_version == 2
        bound = round(len(prompts) / 2)
        for i, (p, ids, lps) in enumerate(zip(prompts, split.response_ids, split.logprobs)):
            mine, other = (new_model, third) if i < bound else (third, new_model)
            assert torch.allclose(lps, expected_logprobs(mine, p, ids), atol=1e-4), i
            assert not torch.allclose(lps, expected_logprobs(other, p, ids), atol=1e-2), i
        with pytest.raises(ValueError, match=r"update_weights got 1 per-worker buckets for 2 generation workers"):
            pool.update_weights([new_model.state_dict()], weight_version=3)
    finally:
        pool.shutdown()


def test_vllm_backend_matches_hf_and_refits(tok):
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("the vLLM backend needs a GPU")
    from rollout.generation.vllm_backend import VllmGenerationBackend

    prompts = [encode(tok, p) for p in PROMPTS]
    # bf16 on both sides: vLLM's GPU attention kernels do not all take float32.
    cfg = GenerationBackendConfig(backend="vllm", dtype="bfloat16", vllm_enforce_eager=True, vllm_gpu_memory_utilization=0.3)
    gen = VllmGenerationBackend(cfg)
    try:
        hf = HFGenerationBackend(GenerationBackendConfig(device="cuda", dtype="bfloat16"), tokenizer=tok)
        a, b = gen.generate(prompts, max_new_tokens=6, greedy=True), hf.generate(prompts, max_new_tokens=6, greedy=True)
        assert all(torch.equal(x, y) for x, y in zip(a.response_ids, b.response_ids))
        assert all(torch.allclose(x, y, atol=5e-2) for x, y in zip(a.logprobs, b.logprobs))
        new_model = load_model(TINY_MODEL, tokenizer=tok, seed=1)
        gen.update_weights(new_model.state_dict(), weight_version=1)
        hf.update_weights(new_model.state_dict(), weight_version=1)
        a, b = gen.generate(prompts, max_new_tokens=6, greedy=True), hf.generate(prompts, max_new_tokens=6, greedy=True)
        assert a.weight_version == 1
        assert all(torch.equal(x, y) for x, y in zip(a.response_ids, b.response_ids))
        assert all(torch.allclose(x, y, atol=5e-2) for x, y in zip(a.logprobs, b.logprobs))
    finally:
        gen.shutdown()


@pytest.mark.parametrize("mode", ["processed", "raw"])
def test_the_policy_scores_responses_in_the_distribution_the_generator_reports(tok, mode):
    """With generation.temperature 0.5 the generator samples - and by default reports log-probs of -
    logits / 0.5, but the policy scored the untempered model: with identical weights a probe run read
    token_mult_prob_error 1.13 at step 1 (1.0 expected), biasing the importance weights, the KL and
    seq_logprob_error_threshold. The trainers' config now derives the temperature the policy workers
    score with (NeMo-RL's and verl's logits / temperature), and a worker's log-probs match the
    generator's token for token; with logprobs_mode 'raw' both are the untempered model's."""
    from common.batched_data_dict import BatchedDataDict
    from policy.worker import DPPolicyWorker
    from trainer.config import load_config

    cfg = load_config(None, ["generation.temperature=0.5", f"generation.logprobs_mode={mode}", "generation.seed=3"])
    assert cfg.policy.logprob_temperature == (0.5 if mode == "processed" else 1.0)
    worker = DPPolicyWorker(cfg.policy.model_copy(update={"dp_size": 1}), rank=0, world_size=1)
    worker.init_distributed("127.0.0.1", 0)
    gen = HFGenerationBackend(cfg.generation, tokenizer=tok)
    gen.update_weights(worker.get_weights(), weight_version=1)  # the trainers' first refit
    prompts = [encode(tok, p) for p in PROMPTS]
    out = gen.generate(prompts, max_new_tokens=6)
    seqs = [torch.cat([p, r]) for p, r in zip(prompts, out.response_ids)]
    width = max(s.numel() for s in seqs)
    ids = torch.stack([torch.nn.functional.pad(s, (0, width - s.numel())) for s in seqs])
    lengths = torch.tensor([s.numel() for s in seqs])
    lp = worker.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lengths), {})["logprobs"]
    for i, (p, r, lp_gen) in enumerate(zip(prompts, out.response_ids, out.logprobs)):
        policy_lp = lp[i, p.numel() : p.numel() + r.numel()]
        assert torch.allclose(policy_lp, lp_gen, atol=1e-4)
        untempered = expected_logprobs(worker.model, p, r)
        assert torch.allclose(untempered, lp_gen, atol=1e-4) == (mode == "raw")  # the two distributions differ
