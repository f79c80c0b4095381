"""Tests for tq.sharding (DP sharding, token balancing, micro-batch planning)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tq.meta import KVBatchMeta
from tq.sharding import (
    balance_across_ranks,
    micro_batch_cost,
    plan_micro_batches,
    round_lengths,
    shard_meta_for_dp,
)


def make_meta(lengths, **extra) -> KVBatchMeta:
    n = len(lengths)
    return KVBatchMeta(
        partition_id="train@3",
        keys=[f"s{i}" for i in range(n)],
        fields=["input_ids", "advantages"],
        sequence_lengths=list(lengths),
        tags={"group_id": [i // 4 for i in range(n)], "prompt": [f"p{i}" for i in range(n)]},
        extra_info={"global_forward_pad_seqlen": 4096, **extra},
    )


def rounded(x: int, r: int) -> int:
    return -(-x // r) * r


def check_shards(meta, shards, dp, *, mode=None, budget=None, rnd=1):
    """All invariants of shard_meta_for_dp's output."""
    assert len(shards) == dp
    # partition of keys: none lost, none duplicated
    all_keys = [k for s in shards for k in s.keys]
    assert len(all_keys) == len(meta.keys)
    assert set(all_keys) == set(meta.keys)
    pos = {k: i for i, k in enumerate(meta.keys)}
    for r, s in enumerate(shards):
        assert len(s) >= 1
        idx = [pos[k] for k in s.keys]
        assert idx == sorted(idx), "original relative order kept within a shard"
        assert s.sequence_lengths == tuple(meta.sequence_lengths[i] for i in idx)
        for name, vals in meta.tags.items():
            assert s.tags[name] == tuple(vals[i] for i in idx)
        assert s.partition_id == meta.partition_id and s.fields == meta.fields
        for k, v in meta.extra_info.items():
            assert s.extra_info[k] == v, "extra_info propagated"
        assert s.extra_info["dp_rank"] == r and s.extra_info["dp_size"] == dp
    if mode is None:
        assert all("micro_batches" not in s.extra_info for s in shards)
        return
    # token balance bound (in rounded tokens)
    toks = [sum(rounded(x, rnd) for x in s.sequence_lengths) for s in shards]
    max_len = max(rounded(x, rnd) for x in meta.sequence_lengths)
    assert max(toks) - min(toks) <= max_len
    # micro-batch plans
    counts = {len(s.extra_info["micro_batches"]) for s in shards}
    assert len(counts) == 1, f"micro-batch counts differ across ranks: {counts}"
    for s in shards:
        info = s.extra_info
        assert info["micro_batch_mode"] == mode
        assert info["max_tokens_per_microbatch"] == budget
        assert info["sequence_length_round"] == rnd
        plan = info["micro_batches"]
        flat = [i for mb in plan for i in mb]
        assert sorted(flat) == list(range(len(s))), "each local index in exactly one micro-batch"
        for mb in plan:
            assert mb == sorted(mb)
            rl = [rounded(s.sequence_lengths[i], rnd) for i in mb]
            if mode == "packed":
                cost = sum(rl)
            else:
                cost = len(rl) * max(rl) if rl else 0
            assert cost <= budget


# ----------------------------------------------------------------- plain mode
@pytest.mark.parametrize("n,dp", [(8, 1), (8, 8), (10, 4), (17, 3)])
def test_plain_mode_equals_chunk(n, dp):
    meta = make_meta(list(range(n)))
    shards = shard_meta_for_dp(meta, dp)
    for shard, chunk in zip(shards, meta.chunk(dp), strict=True):
        assert shard == chunk.with_extra_info(dp_rank=shard.extra_info["dp_rank"], dp_size=dp)
    check_shards(meta, shards, dp)


def test_plain_mode_without_sequence_lengths():
    meta = KVBatchMeta("p", [f"k{i}" for i in range(5)])
    shards = shard_meta_for_dp(meta, 2)
    assert [s.keys for s in shards] == [("k0", "k1", "k2"), ("k3", "k4")]


def test_plain_mode_drops_stale_plan():
    meta = make_meta([5] * 4, micro_batches=[[0, 1, 2, 3]], micro_batch_mode="dynamic")
    for s in shard_meta_for_dp(meta, 2):
        assert "micro_batches" not in s.extra_info and "micro_batch_mode" not in s.extra_info
        assert s.extra_info["global_forward_pad_seqlen"] == 4096


# ----------------------------------------------------------- property tests
@settings(max_examples=300, deadline=None)
@given(
    dp=st.integers(1, 8),
    data=st.data(),
    mode=st.sampled_from(["packed", "dynamic"]),
    rnd=st.sampled_from([1, 8, 64]),
)
def test_sharding_properties(dp, data, mode, rnd):
    n = data.draw(st.integers(dp, 300), label="n")
    lengths = data.draw(st.lists(st.integers(0, 4096), min_size=n, max_size=n), label="lengths")
    max_r = max(rounded(x, rnd) for x in lengths)
    budget = data.draw(st.integers(max(max_r, 1), max(max_r, 1) * 6), label="budget")
    meta = make_meta(lengths)
    shards = shard_meta_for_dp(
        meta,
        dp,
        sequence_packing=mode == "packed",
        dynamic_batching=mode == "dynamic",
        max_tokens_per_microbatch=budget,
        sequence_length_round=rnd,
    )
    check_shards(meta, shards, dp, mode=mode, budget=budget, rnd=rnd)
    # deterministic
    again = shard_meta_for_dp(
        meta,
        dp,
        sequence_packing=mode == "packed",
        dynamic_batching=mode == "dynamic",
        max_tokens_per_microbatch=budget,
        sequence_length_round=rnd,
    )
    assert again == shards


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(0, 4096), min_size=0, max_size=200), dp=st.integers(1, 8))
def test_balance_across_ranks_properties(lengths, dp):
    ranks = balance_across_ranks(lengths, dp)
    assert len(ranks) == dp
    flat = sorted(i for r in ranks for i in r)
    assert flat == list(range(len(lengths)))
    for r in ranks:
        assert r == sorted(r)
    if len(lengths) >= dp:
        assert all(ranks), "every rank gets a sample"
    if lengths:
        toks = [sum(lengths[i] for i in r) for r in ranks]
        assert max(toks) - min(toks) <= max(lengths)


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 4096), min_size=0, max_size=200),
    mode=st.sampled_from(["packed", "dynamic"]),
    rnd=st.sampled_from([1, 8, 64]),
    slack=st.integers(0, 20000),
)
def test_plan_micro_batches_properties(lengths, mode, rnd, slack):
    budget = max([rounded(x, rnd) for x in lengths] + [1]) + slack
    plan = plan_micro_batches(lengths, budget, mode, rnd)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    for mb in plan:
        assert mb and mb == sorted(mb)
        assert micro_batch_cost([rounded(lengths[i], rnd) for i in mb], mode) <= budget


# ---------------------------------------------------------- exact behaviours
def test_lpt_assignment_exact():
    # sorted desc: 10(i1), 8(i3), 7(i0), 3(i2), 2(i4)
    # r0 <- 10; r1 <- 8; r1 <- 7 (8 < 10); r0 <- 3 (10 < 15); r0 <- 2 (13 < 15)
    assert balance_across_ranks([7, 10, 3, 8, 2], 2) == [[1, 2, 4], [0, 3]]


def test_lpt_zero_lengths_fill_every_rank():
    ranks = balance_across_ranks([0] * 5, 4)
    assert all(ranks) and sorted(map(len, ranks)) == [1, 1, 1, 2]
    meta = make_meta([0, 0, 0, 100])
    shards = shard_meta_for_dp(meta, 4, sequence_packing=True, max_tokens_per_microbatch=100)
    check_shards(meta, shards, 4, mode="packed", budget=100)


def test_balance_beats_contiguous_chunking():
    lengths = [4000] * 8 + [10] * 8
    meta = make_meta(lengths)
    shards = shard_meta_for_dp(meta, 2, dynamic_batching=True, max_tokens_per_microbatch=8000)
    assert [s.total_tokens for s in shards] == [16040, 16040]


def test_dynamic_plan_exact():
    # rounded to 8: [16, 104, 8, 64, 0]; sorted desc: 1(104), 3(64), 0(16), 2(8), 4(0)
    # budget 128: [1] (2*104 > 128), [3, 0] (3*64 > 128), [2, 4] -> sorted lists
    assert plan_micro_batches([10, 100, 8, 60, 0], 128, "dynamic", 8) == [[1], [0, 3], [2, 4]]


def test_dynamic_zero_lengths_cost_nothing():
    assert plan_micro_batches([0, 0, 0], 1, "dynamic") == [[0, 1, 2]]


def test_packed_plan_is_first_fit_decreasing():
    # sorted desc: 6(i0), 5(i2), 4(i1), 3(i4), 2(i3); budget 10
    # bin0: 6 -> +4 = 10; bin1: 5 -> +3 = 8 -> +2 = 10
    assert plan_micro_batches([6, 4, 5, 2, 3], 10, "packed") == [[0, 1], [2, 3, 4]]


def test_packed_plan_first_fit_uses_leftmost_bin():
    # desc: 7, 6, 5, 3, 2 with budget 10: 7 | 6 | 5 ; 3 -> bin0 (7+3); 2 -> bin1 (6+2)
    assert plan_micro_batches([7, 6, 5, 3, 2], 10, "packed") == [[0, 3], [1, 4], [2]]


def test_round_lengths():
    assert round_lengths([0, 1, 8, 9, 64], 8).tolist() == [0, 8, 8, 16, 64]
    assert round_lengths([0, 1, 63, 65], 64).tolist() == [0, 64, 64, 128]


def test_equalisation_splits_largest_micro_batch_in_sharding():
    # LPT on [60, 50, 50, 40]: r0 <- s0(60), r1 <- s1(50), r1 <- s2(50) (50 < 60), r0 <- s3(40)
    # dynamic, budget 100: r0 = [60, 40] -> [[0], [1]]; r1 = [50, 50] -> [[0, 1]] -> split
    meta = make_meta([60, 50, 50, 40])
    shards = shard_meta_for_dp(meta, 2, dynamic_batching=True, max_tokens_per_microbatch=100)
    check_shards(meta, shards, 2, mode="dynamic", budget=100)
    assert [s.keys for s in shards] == [("s0", "s3"), ("s1", "s2")]
    assert [s.extra_info["micro_batches"] for s in shards] == [[[0], [1]], [[0], [1]]]
    # without equalisation rank 1 would have a single micro-batch
    assert plan_micro_batches([50, 50], 100, "dynamic") == [[0, 1]]


def test_equalisation_pads_with_empty_micro_batches():
    # LPT on [100, 60, 40]: r0 <- s0; r1 <- s1, s2. Dynamic budget 100:
    # r0 = [[0]] (unsplittable single sample) -> padded with an empty micro-batch.
    meta = make_meta([100, 60, 40])
    shards = shard_meta_for_dp(meta, 2, dynamic_batching=True, max_tokens_per_microbatch=100)
    check_shards(meta, shards, 2, mode="dynamic", budget=100)
    assert [s.extra_info["micro_batches"] for s in shards] == [[[0], []], [[0], [1]]]


def test_equalize_helper_split_order_and_padding():
    from tq.sharding import _equalize_micro_batches

    rl = [10, 10, 10, 10, 10, 40]
    # most samples first: [0,1,2,3] -> [0,1],[2,3]; then 2-sample tie broken by cost:
    # [4,5] (50) beats [0,1] / [2,3] (20) -> [4],[5]
    assert _equalize_micro_batches([[0, 1, 2, 3], [4, 5]], rl, "packed", 4) == [[0, 1], [2, 3], [4], [5]]
    # odd split: first half gets the extra sample, halves stay in place
    assert _equalize_micro_batches([[7], [0, 1, 2]], [1] * 8, "packed", 3) == [[7], [0, 1], [2]]
    # samples and cost tied -> earliest position split first
    assert _equalize_micro_batches([[0, 1], [2, 3]], [5, 5, 5, 5], "dynamic", 3) == [[0], [1], [2, 3]]
    # singletons only -> empties appended
    assert _equalize_micro_batches([[0], [1]], [5, 5], "dynamic", 4) == [[0], [1], [], []]
    # already at target -> unchanged
    assert _equalize_micro_batches([[0, 1]], [5, 5], "packed", 1) == [[0, 1]]


def test_packed_with_extra_info_plan_keys():
    meta = make_meta([3, 5, 7, 9], pad_to_multiple=8)
    shards = shard_meta_for_dp(meta, 2, sequence_packing=True, max_tokens_per_microbatch=16, sequence_length_round=8)
    check_shards(meta, shards, 2, mode="packed", budget=16, rnd=8)
    for r, s in enumerate(shards):
        assert s.extra_info["pad_to_multiple"] == 8
        assert s.extra_info["global_forward_pad_seqlen"] == 4096
        assert s.extra_info["micro_batch_mode"] == "packed"
        assert s.extra_info["max_tokens_per_microbatch"] == 16
        assert s.extra_info["sequence_length_round"] == 8
        assert s.extra_info["dp_rank"] == r and s.extra_info["dp_size"] == 2
    # rounded: 8, 8, 8, 16 -> LPT: r0 <- s3(16); r1 <- s0, s1 (16); s2: token tie, r0 has fewer samples
    assert [s.keys for s in shards] == [("s2", "s3"), ("s0", "s1")]
    # r0: bins [16] then [8]; r1: one bin [8, 8] split in two to match r0's count
    assert [s.extra_info["micro_batches"] for s in shards] == [[[1], [0]], [[0], [1]]]


def test_shards_survive_msgpack():
    meta = make_meta([5, 50, 500, 17, 33, 1])
    for s in shard_meta_for_dp(meta, 3, dynamic_batching=True, max_tokens_per_microbatch=600):
        assert KVBatchMeta.from_msgpack(s.to_msgpack()) == s


# ----------------------------------------------------------------- errors
def test_error_dp_size_below_one():
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        shard_meta_for_dp(make_meta([1, 2]), 0)


def test_error_too_few_samples():
    with pytest.raises(ValueError, match="cannot shard 3 samples over 4 DP ranks"):
        shard_meta_for_dp(make_meta([1, 2, 3]), 4)


def test_error_both_modes():
    with pytest.raises(ValueError, match="enable at most one of sequence_packing and dynamic_batching"):
        shard_meta_for_dp(make_meta([1, 2]), 1, sequence_packing=True, dynamic_batching=True, max_tokens_per_microbatch=10)


@pytest.mark.parametrize("flag", ["sequence_packing", "dynamic_batching"])
def test_error_mode_without_sequence_lengths(flag):
    meta = KVBatchMeta("p", ["a", "b"])
    with pytest.raises(ValueError, match=f"{flag} requires meta.sequence_lengths"):
        shard_meta_for_dp(meta, 1, **{flag: True}, max_tokens_per_microbatch=10)


@pytest.mark.parametrize("flag", ["sequence_packing", "dynamic_batching"])
@pytest.mark.parametrize("budget,msg", [(None, "requires max_tokens_per_microbatch"), (0, "must be > 0"), (-5, "must be > 0")])
def test_error_bad_budget(flag, budget, msg):
    with pytest.raises(ValueError, match=msg):
        shard_meta_for_dp(make_meta([1, 2]), 1, **{flag: True}, max_tokens_per_microbatch=budget)


def test_error_bad_round():
    with pytest.raises(ValueError, match="sequence_length_round must be >= 1"):
        shard_meta_for_dp(make_meta([1, 2]), 1, sequence_packing=True, max_tokens_per_microbatch=10, sequence_length_round=0)


def test_error_sequence_exceeds_budget_names_key():
    meta = make_meta([10, 60, 20])
    with pytest.raises(ValueError, match=r"'s1' has length 60 .*max_tokens_per_microbatch=50"):
        shard_meta_for_dp(meta, 1, dynamic_batching=True, max_tokens_per_microbatch=50)
    # rounding pushes 41 -> 64 over 50
    meta = make_meta([0, 41])
    with pytest.raises(ValueError, match=r"'s1' has length 41 \(rounded to 64"):
        shard_meta_for_dp(meta, 1, sequence_packing=True, max_tokens_per_microbatch=50, sequence_length_round=64)


def test_plan_micro_batches_errors():
    with pytest.raises(ValueError, match="mode"):
        plan_micro_batches([1], 10, "bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tokens must be > 0"):
        plan_micro_batches([1], 0, "packed")
    with pytest.raises(ValueError, match="index 1 has rounded length 16"):
        plan_micro_batches([1, 9], 10, "packed", 8)
    assert plan_micro_batches([], 10, "packed") == []


# ------------------------------------------------------------ performance
@pytest.mark.parametrize("flags", [{}, {"sequence_packing": True}, {"dynamic_batching": True}])
def test_large_batch_completes(flags):
    rng = np.random.default_rng(0)
    n = 16_384
    lengths = rng.integers(0, 4097, n)
    meta = KVBatchMeta("p", [f"k{i}" for i in range(n)], ["input_ids"], lengths, {"group_id": rng.integers(0, 1024, n)})
    shards = shard_meta_for_dp(meta, 8, max_tokens_per_microbatch=16_384, sequence_length_round=64, **flags)
    assert sum(map(len, shards)) == n
