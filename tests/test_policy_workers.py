"""Policy and TQPolicy on real Ray actors (DP ranks in a gloo group), a real TQ service and the tiny model.

``tq_server`` (conftest) is a controller with two storage units for the module.
"""

from __future__ import annotations

import pickle
import time

import pytest
import torch

from common.batched_data_dict import BatchedDataDict
from common.fields import PER_SAMPLE_REDUCTION_FIELDS
from policy.dispatch import shard_for_dp, stamp_pad_seqlen
from policy.logprobs import per_sample_reductions
from policy.loss import ClippedPGLossFn
from policy.policy import Policy, PolicyConfig, TQPolicy
from policy.synthetic import synthetic_batch, to_tq_columns

ray = pytest.importorskip("ray")

ROLLOUT_FIELDS = ("input_ids", "input_lengths", "token_mask", "sample_mask", "generation_logprobs")
LOSS = ClippedPGLossFn({"reference_policy_kl_penalty": 0.05, "ratio_clip_c": 3.0})
PACKED = dict(sequence_packing={"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 96, "sequence_length_round": 4})
DYNAMIC = dict(dynamic_batching={"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 96, "sequence_length_round": 4})


def _cfg(**kw) -> PolicyConfig:
    base = dict(
        dp_size=2, train_global_batch_size=8, train_micro_batch_size=3, logprob_batch_size=4, learning_rate=1e-3, weight_decay=0.0, seed=11
    )
    return PolicyConfig(**{**base, **kw})


@pytest.fixture()
def batch() -> BatchedDataDict:
    return synthetic_batch(16, min_len=5, max_len=40, seed=5)


def _legacy_step(policy: Policy, batch: BatchedDataDict) -> tuple[BatchedDataDict, dict]:
    data = batch.select_columns(ROLLOUT_FIELDS + ("advantages",))
    data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
    data["reference_policy_logprobs"] = policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    return data, policy.train(data, LOSS)


def _put(policy: TQPolicy, batch: BatchedDataDict):
    policy.prepare_step(batch.size, 4)
    keys = [f"prompt{i // 4}_g{i % 4}" for i in range(batch.size)]
    return policy.client.put(policy.train_partition, keys, to_tq_columns(batch.select_columns(ROLLOUT_FIELDS)))


def _tq_step(policy: TQPolicy, batch: BatchedDataDict):
    meta = _put(policy, batch)
    meta = policy.get_logprobs_from_meta(meta)
    meta = policy.get_reference_policy_logprobs_from_meta(meta)
    meta = policy.write_to_dataplane(meta, {"advantages": batch["advantages"]})
    L = batch["input_ids"].shape[1]
    lps = policy.client.get(meta, ["prev_logprobs", "reference_policy_logprobs"], pad_to=L)  # test-side check only
    return meta, lps, policy.train_from_meta(meta, LOSS)


def _weights_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_policy_and_tqpolicy_are_bit_identical(ray_session, tq_connection, batch):
    """Same weights, batch and sharding: same log-probs, metrics and updated weights, to the bit."""
    cfg = _cfg(**PACKED)
    with Policy(cfg) as legacy, TQPolicy(cfg, tq_connection) as tqp:
        assert _weights_equal(legacy.get_weights(), tqp.get_weights())
        data, m_legacy = _legacy_step(legacy, batch)
        meta, lps, m_tq = _tq_step(tqp, batch)
        assert torch.equal(lps["prev_logprobs"], data["prev_logprobs"])
        assert torch.equal(lps["reference_policy_logprobs"], data["reference_policy_logprobs"])
        assert m_legacy["num_optimizer_steps"] == 2 and m_legacy["loss"] != 0
        assert m_legacy == m_tq
        assert _weights_equal(legacy.get_weights(), tqp.get_weights())
        after = legacy.get_logprobs(data)["logprobs"]
        assert not torch.equal(after, data["prev_logprobs"])  # the update changed the policy
        tqp.finish_step(meta)
        meta = tqp.get_logprobs_from_meta(_put(tqp, batch))  # the next step's log-prob pass
        got = tqp.client.get(meta, ["prev_logprobs"], pad_to=batch["input_ids"].shape[1])["prev_logprobs"]
        assert torch.equal(got, after)
        tqp.finish_step(meta)


def test_dp2_update_in_a_placement_group_matches_dp1(ray_session, batch):
    """The same global batch on 1 or 2 ranks gives the same update (global normalization + SUM all-reduce).
    The 2 ranks run in a placement group that holds nearly every CPU, a bundle per rank: they start
    only if rank r is scheduled into bundle r (outside it, or two in one bundle, they would not fit)."""
    data = batch.slice(0, 8)
    out = {}

    def step(dp: int, pg=None) -> None:
        with Policy(_cfg(dp_size=dp, ray_timeout_s=60), placement_group=pg) as policy:
            w0 = policy.get_weights()
            d, metrics = _legacy_step(policy, data)
            out[dp] = (w0, policy.get_weights(), metrics, d["prev_logprobs"])

    step(1)
    pg = ray.util.placement_group([{"CPU": 0.9}] * 2)
    try:
        ray.get(pg.ready(), timeout=30)
        step(2, pg)
    finally:
        ray.util.remove_placement_group(pg)
    (w0a, w1a, ma, lpa), (w0b, w1b, mb, lpb) = out[1], out[2]
    assert _weights_equal(w0a, w0b)
    torch.testing.assert_close(lpa, lpb, atol=1e-6, rtol=0)
    assert ma["num_optimizer_steps"] == mb["num_optimizer_steps"] == 1
    for k in ("loss", "grad_norm", "global_valid_toks", "probs_ratio_max", "kl_penalty"):
        assert ma[k] == pytest.approx(mb[k], rel=1e-5, abs=1e-7), k
    moved = max((w1a[k] - w0a[k]).abs().max().item() for k in w0a)
    assert moved > 5e-4  # Adam moved weights by about the learning rate
    for k in w0a:  # the two updates agree to far less than one learning rate
        torch.testing.assert_close(w1a[k] - w0a[k], w1b[k] - w0b[k], atol=2e-5, rtol=0, msg=k)


def _small(obj) -> int:
    """Pickled size of a worker's reply, asserting it carries no tensor."""

    def walk(x):
        assert not isinstance(x, torch.Tensor), f"a tensor came back through Ray: {x.shape}"
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(obj)
    return len(pickle.dumps(obj))


def test_tq_path_returns_only_small_dicts_and_leaves_store_empty(ray_session, tq_connection, batch):
    with TQPolicy(_cfg(**DYNAMIC), tq_connection) as tqp:
        ws = tqp.workers
        meta = stamp_pad_seqlen(_put(tqp, batch), 4)
        assert meta.extra_info["global_forward_pad_seqlen"] == 40
        # Call the workers the way TQPolicy does, and look at exactly what comes back through Ray.
        for reference in (False, True):
            shards = shard_for_dp(meta, tqp.config, "logprob")
            for r in ray.get([w.get_logprobs_from_meta.remote(s, reference) for w, s in zip(ws, shards)], timeout=120):
                assert _small(r) < 512
        meta = meta.add_fields(["prev_logprobs", "reference_policy_logprobs"])
        for r in ray.get(
            [w.compute_per_token_reductions.remote(s) for w, s in zip(ws, shard_for_dp(meta, tqp.config, "logprob"))], timeout=120
        ):
            assert _small(r) < 512
        meta = tqp.write_to_dataplane(meta, {"advantages": batch["advantages"]})
        per_rank = [[s] for s in shard_for_dp(meta.slice(0, 8), tqp.config, "train")]
        for r in ray.get([w.train_from_meta.remote(p, LOSS) for w, p in zip(ws, per_rank)], timeout=120):
            assert _small(r) < 2048 and r["num_optimizer_steps"] == 1

        # Per-token reductions, written by the workers, read by the driver as per-sample columns.
        red = tqp.read_from_dataplane(meta, PER_SAMPLE_REDUCTION_FIELDS)
        assert all(red[f].shape == (16,) for f in PER_SAMPLE_REDUCTION_FIELDS)
        full = tqp.client.get(meta, ["prev_logprobs", "generation_logprobs", "token_mask"])  # test-side check
        expected = per_sample_reductions(full)
        for f in PER_SAMPLE_REDUCTION_FIELDS:
            torch.testing.assert_close(red[f], expected[f], atol=0, rtol=0)
        assert red["num_valid_tokens"].tolist() == batch["token_mask"].sum(-1).tolist()
        with pytest.raises(ValueError, match="token-aligned"):
            tqp.read_from_dataplane(meta, ["prev_logprobs"])

        # The lifecycle: a dropped sample is freed at once, finish_step frees the rest.
        assert tqp.discard_samples([meta.keys[0]]) == 1
        kept = meta.drop([meta.keys[0]])
        assert tqp.finish_step(kept) == 15
        _assert_store_empty(tqp.client)
        assert tqp.prepare_val_partition() == "val"


def _assert_store_empty(client, timeout: float = 15.0) -> None:
    """No partition holds keys and no storage unit holds blocks (units free asynchronously: poll, bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        keys = {p["partition"]: p["keys"] for p in stats["partitions"]}
        blocks = [u["blocks"] for u in stats["unit_stats"]]
        if not any(keys.values()) and not any(blocks):
            return
        assert time.monotonic() < deadline, f"store not empty after finish_step: keys {keys}, unit blocks {blocks}"
        time.sleep(0.05)


def test_checkpoint_round_trip_and_errors(ray_session, batch, tmp_path):
    with Policy(_cfg(dp_size=1, lr_schedule="cosine", warmup_steps=1, max_steps=10)) as policy:
        data = batch.slice(0, 8)
        _legacy_step(policy, data)
        policy.save_checkpoint(str(tmp_path / "ckpt"))
        saved = policy.get_weights()
        trained, m2 = _legacy_step(policy, data)
        after_two = policy.get_weights()
        assert m2["step"] == 2 and not _weights_equal(saved, after_two)
        assert policy.load_checkpoint(str(tmp_path / "ckpt")) == 1
        assert _weights_equal(saved, policy.get_weights())
        # Optimizer moments and LR schedule came back too: the second step replays bit for bit.
        _, m2_again = _legacy_step(policy, data)
        assert m2_again == m2
        assert _weights_equal(after_two, policy.get_weights())
        with pytest.raises(ValueError, match="train_global_batch_size=8"):
            policy.train(trained.slice(0, 6), LOSS)


def test_bf16_worker_keeps_float32_master_weights(batch):
    """In process (no Ray): bf16 compute, float32 weights, so a small-lr AdamW step still moves them."""
    from policy.worker import DPPolicyWorker

    worker = DPPolicyWorker(_cfg(dp_size=1, dtype="bfloat16", learning_rate=1e-6), rank=0, world_size=1)
    worker.init_distributed("127.0.0.1", 0)  # one rank: no process group, just the reference model
    data = batch.slice(0, 8).select_columns(ROLLOUT_FIELDS + ("advantages",))
    data["prev_logprobs"] = worker.get_logprobs(data, {})["logprobs"]
    data["reference_policy_logprobs"] = worker.get_logprobs(data, {}, reference=True)["logprobs"]
    fp32 = DPPolicyWorker(_cfg(dp_size=1), rank=0, world_size=1)  # same seed, float32 compute
    fp32.init_distributed("127.0.0.1", 0)
    lp32 = fp32.get_logprobs(data, {})["logprobs"]
    err = (data["prev_logprobs"] - lp32).abs().max().item()
    assert 0 < err < 0.5  # bf16 compute really ran (not bit-equal to fp32) and is close
    before = worker.get_weights()
    worker.train([(data, {})], LOSS)
    after = worker.get_weights()
    assert all(v.dtype == torch.float32 for v in after.values())
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 5e-7  # ~lr: not lost to bf16 rounding


def test_a_non_finite_loss_is_refused_before_the_weights_change(batch):
    """In process (no Ray): a NaN advantage makes the loss NaN; the step raises naming the micro-batch
    instead of writing NaN weights."""
    from policy.worker import DPPolicyWorker

    worker = DPPolicyWorker(_cfg(dp_size=1), rank=0, world_size=1)
    worker.init_distributed("127.0.0.1", 0)
    data = batch.slice(0, 8).select_columns(ROLLOUT_FIELDS + ("advantages",))
    data["prev_logprobs"] = worker.get_logprobs(data, {})["logprobs"]
    data["reference_policy_logprobs"] = worker.get_logprobs(data, {}, reference=True)["logprobs"]
    data["advantages"][4] = float("nan")  # row 4: the second micro-batch of 3 rows
    before = worker.get_weights()
    with pytest.raises(RuntimeError, match=r"policy rank 0, optimizer step 1: non-finite loss \(nan\) in micro-batch 2 of 3"):
        worker.train([(data, {})], LOSS)
    after = worker.get_weights()
    assert worker.step == 0 and all(torch.equal(before[k], after[k]) for k in before)


def test_a_dead_actor_is_named_even_when_a_peer_failed_first(ray_session):
    """When a rank dies its peers fail too (one blocked in a collective with it sees the connection
    close), and ray.get raises whichever failed ref comes first. ActorCalls.get raises the death,
    which the trainer reports as "an actor died"."""
    import ray

    from policy.traffic import ActorCalls

    @ray.remote(num_cpus=0.1)
    class Rank:
        def fail(self) -> None:
            raise ConnectionError("peer closed the connection")  # what the surviving rank sees

        def sleep(self, s: float) -> None:
            time.sleep(s)

    alive, doomed = Rank.remote(), Rank.remote()
    ray.get([alive.sleep.remote(0), doomed.sleep.remote(0)])
    dead = doomed.sleep.remote(60)
    ray.kill(doomed)
    try:
        with pytest.raises(ray.exceptions.RayActorError):
            ActorCalls().get([alive.fail.remote(), dead], timeout=30)
    finally:
        ray.kill(alive)  # its handle outlives the test in Ray's reference counts: free its CPU for the next test


def test_a_gpu_ranks_fetch_pads_on_the_device_as_the_padded_get_pads(client, partition, batch):
    """What a GPU rank's fetch builds (rows copied unpadded, sent to the device, padded there; run
    here with the CPU as the device - on CUDA the copy lands in page-locked memory: the pinned get is
    tested in tests/test_gpu_fetch.py, and benchmarks/gpu_fetch.py compares this fetch's tensors on a
    GPU) is bit for bit the padded get a CPU rank makes, under the meta's pad length
    (``global_forward_pad_seqlen`` rounded up to ``pad_to_multiple``)."""
    from policy.worker import copy_and_pad, fetch_padded

    data = batch.select_columns(ROLLOUT_FIELDS)
    meta = client.put(partition, [f"s{i}" for i in range(batch.size)], to_tq_columns(data))
    meta = meta.with_extra_info(global_forward_pad_seqlen=42, pad_to_multiple=8)
    pad = {"input_ids": 7}
    padded = fetch_padded(client, meta, ROLLOUT_FIELDS, pad, torch.device("cpu"))
    on_device = copy_and_pad(client, meta, ROLLOUT_FIELDS, pad, torch.device("cpu"))
    assert padded["input_ids"].shape[1] == 48  # 42 rounded up to 8
    assert set(on_device) == set(ROLLOUT_FIELDS)
    for f in ROLLOUT_FIELDS:
        assert on_device[f].dtype == padded[f].dtype and torch.equal(on_device[f], padded[f]), f
    # Nothing returned views a storage arena: the arena's bytes may be freed and reused once the call ends.
    arenas = [(a.view.ctypes.data, a.view.ctypes.data + a.size) for a in client._arenas.values()]
    arenas += [(a.ctypes.data, a.ctypes.data + a.nbytes) for a in client._ro_views.values()]
    assert arenas  # same host: the rows were read out of the arena
    for f in ROLLOUT_FIELDS:
        at = on_device[f].untyped_storage().data_ptr()
        assert not any(lo <= at < hi for lo, hi in arenas), f"{f} views the storage arena"
    assert client.discard(meta) == batch.size
