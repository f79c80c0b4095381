"""ClippedPGLossFn against numbers computed by hand (in the comments), not by re-running the loss."""

from __future__ import annotations

import math

import pytest
import torch

from policy.loss import ClippedPGLossConfig, ClippedPGLossFn, calculate_kl, reduce_metrics

LN = math.log


def _batch(curr_ratio, token_mask, adv, prev=None, gen=None, ref=None, sample_mask=None):
    """A [b, T] batch with prev_logprobs = log(0.5) (or ``prev``) and curr = prev + log(ratio)."""
    ratio = torch.tensor(curr_ratio, dtype=torch.float32)
    tm = torch.tensor(token_mask, dtype=torch.bool)
    prev_t = torch.full_like(ratio, LN(0.5)) if prev is None else torch.tensor(prev, dtype=torch.float32)
    curr = (prev_t + torch.log(ratio)).requires_grad_(True)
    data = {
        "token_mask": tm,
        "sample_mask": torch.ones(ratio.shape[0]) if sample_mask is None else torch.tensor(sample_mask, dtype=torch.float32),
        "prev_logprobs": prev_t,
        "generation_logprobs": prev_t.clone() if gen is None else torch.tensor(gen, dtype=torch.float32),
        "advantages": torch.tensor(adv, dtype=torch.float32),
    }
    if ref is not None:
        data["reference_policy_logprobs"] = torch.tensor(ref, dtype=torch.float32)
    return curr, data


# Two samples, 3 tokens; position 0 is a prompt token. eps = 0.2 -> ratios clamp to [0.8, 1.2].
# sample 0 (A = +1): t1 ratio 1.5 -> max(-1.5, -1.2) = -1.2 (clipped); t2 ratio 0.5 -> max(-0.5, -0.8) = -0.5
# sample 1 (A = -2): t1 ratio 1.5 -> max(3.0, 2.4) = 3.0; t2 is not a generated token.
RATIOS = [[1.0, 1.5, 0.5], [1.0, 1.5, 1.0]]
MASK = [[0, 1, 1], [0, 1, 0]]
ADV = [1.0, -2.0]


def test_token_level_clipped_loss_and_metrics():
    curr, data = _batch(RATIOS, MASK, ADV)
    loss, m = ClippedPGLossFn()(curr, data, global_valid_seqs=2, global_valid_toks=3)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 3.0) / 3, abs=1e-6)  # 0.4333
    assert m["probs_ratio"].item() == pytest.approx((1.5 + 0.5 + 1.5) / 3, abs=1e-6)
    assert m["probs_ratio_clamped"].item() == pytest.approx((1.2 + 0.8 + 1.2) / 3, abs=1e-6)
    assert m["probs_ratio_min"].item() == pytest.approx(0.5, abs=1e-6)
    assert m["probs_ratio_max"].item() == pytest.approx(1.5, abs=1e-6)
    assert m["clip_fraction"].item() == pytest.approx(1 / 3, abs=1e-6)  # only sample 0, t1
    assert m["num_valid_tokens"].item() == 3 and m["num_valid_samples"].item() == 2
    # prev == generation: trainer and generator agree -> exp(0) = 1 and IS ratio 1
    assert m["token_mult_prob_error"].item() == pytest.approx(1.0, abs=1e-6)
    assert m["sampling_importance_ratio"].item() == pytest.approx(1.0, abs=1e-6)
    loss.backward()
    # d/dcurr of -A * ratio = -A * ratio, over N = 3 tokens; the clipped token and the prompt get 0.
    expected = torch.tensor([[0.0, 0.0, -1 * 0.5 / 3], [0.0, 2 * 1.5 / 3, 0.0]])
    torch.testing.assert_close(curr.grad, expected, atol=1e-6, rtol=0)


def test_global_normalization_micro_batches_sum_to_full_batch():
    fn = ClippedPGLossFn()
    curr, data = _batch(RATIOS, MASK, ADV)
    full, _ = fn(curr, data, 2, 3)
    # The same tokens counted over a global batch twice as large: half the loss.
    half, _ = fn(curr, data, 4, 6)
    assert half.item() == pytest.approx(full.item() / 2, abs=1e-6)
    parts = []
    for i in range(2):  # one sample per micro-batch, normalized by the global count
        c, d = _batch([RATIOS[i]], [MASK[i]], [ADV[i]])
        parts.append(fn(c, d, 2, 3)[0].item())
    assert parts[0] == pytest.approx((-1.2 - 0.5) / 3, abs=1e-6)
    assert sum(parts) == pytest.approx(full.item(), abs=1e-6)


def test_sequence_level_loss():
    curr, data = _batch(RATIOS, MASK, ADV)
    loss, _ = ClippedPGLossFn({"token_level_loss": False})(curr, data, global_valid_seqs=2, global_valid_toks=3)
    # sample 0: (-1.2 - 0.5) / 2 tokens = -0.85; sample 1: 3.0 / 1 token; mean over 2 sequences
    assert loss.item() == pytest.approx((-0.85 + 3.0) / 2, abs=1e-6)
    # a masked-out sample drops from the sum (the global count says how many remain)
    curr, data = _batch(RATIOS, MASK, ADV, sample_mask=[1.0, 0.0])
    loss, m = ClippedPGLossFn({"token_level_loss": False})(curr, data, global_valid_seqs=1, global_valid_toks=2)
    assert loss.item() == pytest.approx(-0.85, abs=1e-6)
    assert m["num_valid_samples"].item() == 1


def test_dual_clip_caps_negative_advantage_only():
    # ratio 4, eps 0.2, c = 3. A = -2: max(8, 2.4) = 8, dual cap -A*c = 6 -> 6.
    # A = +2: max(-8, -2.4) = -2.4; the dual clip never applies to positive advantages.
    cfg = {"ratio_clip_c": 3.0}
    curr, data = _batch([[1.0, 4.0]], [[0, 1]], [-2.0])
    assert ClippedPGLossFn(cfg)(curr, data, 1, 1)[0].item() == pytest.approx(6.0, abs=1e-5)
    assert ClippedPGLossFn()(curr, data, 1, 1)[0].item() == pytest.approx(8.0, abs=1e-5)
    _, m = ClippedPGLossFn(cfg)(curr, data, 1, 1)
    assert m["dual_clip_fraction"].item() == pytest.approx(1.0)
    curr, data = _batch([[1.0, 4.0]], [[0, 1]], [2.0])
    assert ClippedPGLossFn(cfg)(curr, data, 1, 1)[0].item() == pytest.approx(-2.4, abs=1e-5)


@pytest.mark.parametrize(
    "kl_type,expected",
    [
        # r = log pi_ref - log pi = log 0.25 - log 0.5 = -ln 2
        ("k1", math.log(2)),  # -r = 0.693147
        ("k2", math.log(2) ** 2 / 2),  # r^2 / 2 = 0.240227
        ("k3", 0.5 - 1 + math.log(2)),  # e^r - 1 - r = 0.193147
    ],
)
def test_kl_penalty_types(kl_type, expected):
    curr, data = _batch([[1.0, 1.0]], [[0, 1]], [0.0], ref=[[LN(0.25), LN(0.25)]])
    fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": kl_type})
    assert "reference_policy_logprobs" in fn.input_fields
    loss, m = fn(curr, data, 1, 1)
    assert loss.item() == pytest.approx(0.1 * expected, abs=1e-6)  # A = 0: the actor part is 0
    assert m["kl_penalty"].item() == pytest.approx(expected, abs=1e-6)
    if kl_type == "k3":
        loss.backward()  # d/dcurr (e^(ref-curr) - 1 - ref + curr) = 1 - e^r = 0.5, times 0.1
        assert curr.grad[0, 1].item() == pytest.approx(0.05, abs=1e-6)


def test_kl_clamp_and_no_reference_without_penalty():
    curr, data = _batch([[1.0, 1.0]], [[0, 1]], [0.0], ref=[[LN(0.25), LN(0.25)]])
    fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": "k1", "kl_clamp": 0.1})
    assert fn(curr, data, 1, 1)[0].item() == pytest.approx(0.1 * 0.1, abs=1e-7)  # 0.693 clamped to 0.1
    assert "reference_policy_logprobs" not in ClippedPGLossFn().input_fields
    assert calculate_kl(torch.tensor([0.0]), torch.tensor([-100.0]), "k3", input_clamp=20.0, output_clamp=None).item() == pytest.approx(
        math.exp(-20) - 1 + 20, abs=1e-4
    )


def test_importance_sampling_correction_and_truncation():
    # prev = log 0.5, gen = log 0.25 -> IS weight e^(ln 2) = 2; ratio 1, A = 1 -> clip loss -1 per token.
    kw = dict(prev=[[LN(0.5), LN(0.5)]], gen=[[0.0, LN(0.25)]])
    curr, data = _batch([[1.0, 1.0]], [[0, 1]], [1.0], **kw)
    assert ClippedPGLossFn()(curr, data, 1, 1)[0].item() == pytest.approx(-1.0, abs=1e-6)
    loss, m = ClippedPGLossFn({"use_importance_sampling_correction": True})(curr, data, 1, 1)
    assert loss.item() == pytest.approx(-2.0, abs=1e-5)
    assert m["sampling_importance_ratio"].item() == pytest.approx(2.0, abs=1e-5)
    assert m["token_mult_prob_error"].item() == pytest.approx(math.exp(math.log(2)), abs=1e-5)  # exp(|ln .5 - ln .25|) = 2
    # approx entropy: -(e^(curr - gen) * curr) = -(2 * ln 0.5) = 1.386294
    assert m["approx_entropy"].item() == pytest.approx(2 * math.log(2), abs=1e-5)
    trunc = ClippedPGLossFn({"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 1.5})
    assert trunc(curr, data, 1, 1)[0].item() == pytest.approx(-1.5, abs=1e-5)


def test_garbage_outside_the_mask_cannot_reach_gradients():
    curr, data = _batch(RATIOS, MASK, ADV)
    data["prev_logprobs"] = data["prev_logprobs"].clone()
    data["prev_logprobs"][1, 2] = -1e4  # a masked position: exp(curr - prev) overflows to inf there
    data["generation_logprobs"][1, 2] = float("nan")
    loss, m = ClippedPGLossFn({"use_importance_sampling_correction": True})(curr, data, 2, 3)
    loss.backward()
    assert torch.isfinite(curr.grad).all() and math.isfinite(loss.item())
    assert m["probs_ratio_max"].item() == pytest.approx(1.5, abs=1e-6)


def test_reduce_metrics_sums_and_extremes():
    out = reduce_metrics(
        [{"loss": 0.25, "probs_ratio_min": 0.9, "probs_ratio_max": 1.1}, {"loss": 0.5, "probs_ratio_min": 0.7, "probs_ratio_max": 1.05}]
    )
    assert {k: v.item() for k, v in out.items()} == pytest.approx({"loss": 0.75, "probs_ratio_min": 0.7, "probs_ratio_max": 1.1})


@pytest.mark.parametrize(
    "bad,key",
    [
        ({"ratio_clip_c": 1.0}, "ratio_clip_c"),
        ({"reference_policy_kl_type": "k4"}, "reference_policy_kl_type"),
        ({"truncated_importance_sampling_ratio": 2.0}, "truncated_importance_sampling_ratio"),
        ({"ratio_clip_maxx": 0.2}, "ratio_clip_maxx"),
    ],
)
def test_bad_loss_config_names_the_key(bad, key):
    with pytest.raises(ValueError, match=key):
        ClippedPGLossConfig(**bad)
