"""Plain, dynamic and packed micro-batching give the same log-probs and gradients (tiny model, in process)."""

from __future__ import annotations

import pytest
import torch

from common.batched_data_dict import BatchedDataDict
from common.models import TINY_MODEL, load_model
from policy.config import PolicyConfig
from policy.dispatch import global_batches, index_meta, shard_for_dp, shard_rows, stamp_pad_seqlen
from policy.logprobs import compute_logprobs, per_sample_reductions, token_logprobs
from policy.loss import ClippedPGLossFn
from policy.micro_batching import (
    MicroBatchPlan,
    build_micro_batch,
    forward_backward,
    local_valid_counts,
    logprobs_for_plan,
    micro_batch_logprobs,
    plain_plan,
    plan_from_extra_info,
)
from policy.synthetic import synthetic_batch
from tq.meta import KVBatchMeta
from tq.sharding import plan_micro_batches

N = 10


@pytest.fixture(scope="module")
def model(tok):
    torch.set_num_threads(1)
    return load_model(TINY_MODEL, tokenizer=tok, seed=3).eval()


@pytest.fixture(scope="module")
def batch():
    return synthetic_batch(N, min_len=5, max_len=40, seed=7)


def _plans(lengths: torch.Tensor) -> dict[str, MicroBatchPlan]:
    lens = lengths.tolist()
    return {
        "plain": MicroBatchPlan("plain", plain_plan(len(lens), 3)),
        "dynamic": MicroBatchPlan("dynamic", plan_micro_batches(lens, 96, "dynamic", 8), 8),
        "packed": MicroBatchPlan("packed", plan_micro_batches(lens, 96, "packed", 1), 1),
        "packed_round8": MicroBatchPlan("packed", plan_micro_batches(lens, 96, "packed", 8), 8),
    }


def test_logprob_convention(model, tok):
    ids = torch.tensor([[5, 9, 12, 7]])
    logits = model(input_ids=ids).logits
    lp = token_logprobs(logits, ids)
    assert lp[0, 0] == 0
    expected = torch.log_softmax(logits[0, 1].float(), -1)[12]  # token 2 given tokens 0..1
    assert lp[0, 2].item() == pytest.approx(expected.item(), abs=1e-6)


def test_modes_give_the_same_logprobs_as_one_sequence_at_a_time(model, tok, batch):
    ids, lens = batch["input_ids"], batch["input_lengths"]
    alone = torch.zeros(ids.shape)
    for i in range(N):  # no padding and no neighbours at all: the ground truth
        n = int(lens[i])
        alone[i, :n] = compute_logprobs(model, ids[i : i + 1, :n], lens[i : i + 1])[0]
    plans = _plans(lens)
    assert max(len(mb) for mb in plans["packed"].micro_batches) >= 3  # really packs several per row
    assert len(plans["packed"].micro_batches) < N
    for name, plan in plans.items():
        got = logprobs_for_plan(model, ids, lens, plan, tok.pad_token_id)
        torch.testing.assert_close(got, alone, atol=1e-5, rtol=0, msg=f"{name} log-probs differ")


def test_packed_row_is_block_diagonal_with_restarting_positions(model, tok):
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [10, 11, 12, 0, 0, 0]])
    lens = torch.tensor([5, 3])
    mb = build_micro_batch(ids, lens, [0, 1], packed=True, pad_token_id=0, sequence_length_round=4)
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    m = mb.attention_mask[0, 0]
    assert m.shape == (8, 8) and not m[5:, :5].any() and m[5:, 5:].tril().eq(m[5:, 5:]).all()
    base = micro_batch_logprobs(model, mb)
    # Changing the first sequence must not move the second one's log-probs (no cross-attention).
    ids2 = ids.clone()
    ids2[0, :5] = torch.tensor([40, 41, 42, 43, 44])
    other = micro_batch_logprobs(model, build_micro_batch(ids2, lens, [0, 1], packed=True, pad_token_id=0, sequence_length_round=4))
    torch.testing.assert_close(other[1], base[1], atol=1e-6, rtol=0)
    assert base[1, 0] == 0 and base[1, 3:].eq(0).all()


def _grads(model, batch, plan, tok) -> torch.Tensor:
    data = BatchedDataDict(batch)
    data["prev_logprobs"] = (compute_logprobs(model, data["input_ids"], data["input_lengths"]) - 0.05) * data["token_mask"]
    data["reference_policy_logprobs"] = data["prev_logprobs"] - 0.1 * data["token_mask"]
    loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.05, "ratio_clip_c": 3.0})
    seqs, toks = local_valid_counts(data)
    model.zero_grad(set_to_none=True)
    metrics = forward_backward(model, data, plan, loss_fn, seqs, toks, tok.pad_token_id)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return grads, sum(float(m["loss"]) for m in metrics)


def test_modes_give_the_same_gradients(model, tok, batch):
    one = MicroBatchPlan("plain", plain_plan(N, N))  # the whole batch in one forward
    ref_grads, ref_loss = _grads(model, batch, one, tok)
    assert ref_grads.abs().max() > 1e-3
    for name, plan in _plans(batch["input_lengths"]).items():
        grads, loss = _grads(model, batch, plan, tok)
        assert loss == pytest.approx(ref_loss, abs=1e-5), name
        torch.testing.assert_close(grads, ref_grads, atol=1e-5, rtol=1e-4, msg=f"{name} gradients differ")


def test_empty_filler_micro_batches_are_skipped(model, tok, batch):
    plan = MicroBatchPlan("dynamic", [[], *plain_plan(N, 4), []])
    ids, lens = batch["input_ids"], batch["input_lengths"]
    expected = logprobs_for_plan(model, ids, lens, MicroBatchPlan("plain", plain_plan(N, 4)), tok.pad_token_id)
    assert torch.equal(logprobs_for_plan(model, ids, lens, plan, tok.pad_token_id), expected)


def test_plan_from_extra_info():
    assert plan_from_extra_info({}, 5, 2) == MicroBatchPlan("plain", [[0, 1], [2, 3], [4]])
    info = {"micro_batches": [[1], [0, 2]], "micro_batch_mode": "packed", "sequence_length_round": 4}
    assert plan_from_extra_info(info, 3, 2) == MicroBatchPlan("packed", [[1], [0, 2]], 4)
    with pytest.raises(ValueError, match="exactly once"):
        plan_from_extra_info({**info, "micro_batches": [[1], [0]]}, 3, 2)


def test_legacy_index_meta_shards_like_real_keys():
    lengths = [7, 30, 3, 12, 25, 9, 14, 2]
    cfg = PolicyConfig(
        dp_size=3, train_global_batch_size=8, dynamic_batching={"enabled": True, "train_mb_tokens": 60, "logprob_mb_tokens": 90}
    )
    real = KVBatchMeta("train", tuple(f"p{i}_g0" for i in range(8)), sequence_lengths=tuple(lengths))
    for purpose in ("train", "logprob"):
        legacy = shard_for_dp(index_meta(lengths), cfg, purpose)
        tq = shard_for_dp(real, cfg, purpose)
        assert [shard_rows(s) for s in legacy] == [[real.keys.index(k) for k in s.keys] for s in tq]
        assert [s.extra_info["micro_batches"] for s in legacy] == [s.extra_info["micro_batches"] for s in tq]
    with pytest.raises(ValueError, match="train_global_batch_size=3"):
        global_batches(real, 3)
    assert stamp_pad_seqlen(real, 8).extra_info["global_forward_pad_seqlen"] == 32
    assert stamp_pad_seqlen(real.with_extra_info(global_forward_pad_seqlen=40)).extra_info["global_forward_pad_seqlen"] == 40


def test_per_sample_reductions():
    tm = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    prev = torch.tensor([[0.0, -1.0, -2.0, 9.0], [0.0, 0.0, 0.0, 0.0]])
    gen = torch.tensor([[0.0, -1.5, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    out = per_sample_reductions({"prev_logprobs": prev, "generation_logprobs": gen, "token_mask": tm})
    assert out["seq_logprob_error"].tolist() == pytest.approx([(0.5 + 1.0) / 2, 0.0])
    assert out["seq_mult_prob_error"].tolist() == pytest.approx([(2.718281828**0.5 + 2.718281828) / 2, 0.0])
    assert out["num_valid_tokens"].tolist() == [2, 0]
