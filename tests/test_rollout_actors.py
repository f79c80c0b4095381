"""SyncRolloutActor on the tiny offline model with a real TQ service and real Ray: keys, columns in TQ
bit-exact against the legacy path, scalar-only driver_carry, validation mode, actor + generation handle."""

from __future__ import annotations

import pickle
import uuid

import pytest
import torch

from common.fields import LP_SEED_FIELDS, TOKEN_FIELDS
from common.models import TINY_MODEL, build_tiny_tokenizer, load_model
from rollout.actors import SyncRolloutActor, SyncRolloutImpl
from rollout.data import DatasetError, PromptDataset, collate_datums
from rollout.environments import TWO_TURN_TASK_NAME, TwoTurnGuessEnvironment, two_turn_guess_dataset
from rollout.generation import GenerationBackendConfig
from rollout.generation.hf_backend import HFGenerationBackend
from rollout.multi_turn import RolloutLimits, records_to_columns, run_multi_turn_rollout
from tq import TQConnection

GEN = {"seed": 7, "max_new_tokens": 4}
ENVS = {TWO_TURN_TASK_NAME: TWO_TURN_TASK_NAME}
LIMITS = {"max_seq_len": 160, "max_new_tokens": 4, "max_rollout_turns": 2}
BULK = ("input_ids", "input_lengths", "generation_logprobs", "token_mask", "sample_mask", "message_log")


@pytest.fixture(scope="module")
def dataset():
    return PromptDataset(two_turn_guess_dataset(8, seed=3), build_tiny_tokenizer())


def impl(tq_server, **kw) -> SyncRolloutImpl:
    return SyncRolloutImpl(generation=GEN, environments=ENVS, connection=TQConnection(tq_server.address), limits=LIMITS, **kw)


def batch_of(dataset, rows):
    return collate_datums([dataset[i] for i in rows])


def test_rollout_to_tq_keys_columns_bit_exact_and_scalar_carry(tq_server, client, partition, dataset):
    rows, g = [5, 2, 6], 2
    tq_impl, legacy_impl = impl(tq_server), impl(tq_server)
    meta, carry, rollout_metrics, gen_metrics = tq_impl.rollout_to_tq(batch_of(dataset, rows), partition, g, carry_keys=["ground_truth"])
    legacy, legacy_rollout_metrics, _ = legacy_impl.rollout(batch_of(dataset, rows), g, carry_keys=["ground_truth"])
    n = len(rows) * g
    keys = [f"{r}_g{i}" for r in rows for i in range(g)]
    assert list(meta.keys) == keys == carry["keys"] == legacy["keys"]
    assert meta.partition_id == partition and set(BULK) <= set(meta.fields)
    assert list(meta.sequence_lengths) == carry["input_lengths"].tolist()
    assert meta.tags["uid"] == tuple(str(r) for r in rows for _ in range(g))
    assert meta.tags["group_id"] == tuple(r for r in rows for _ in range(g))
    assert meta.tags["weight_version"] == (0,) * n

    # What TQ holds, read back as lists, is bit for bit what the rollout generated: the records of the
    # same rollout (same model, same sampling seed) run directly ...
    got = client.get(meta, list(BULK) + ["total_reward", "truncated"], layout="list")
    records, _, _ = run_multi_turn_rollout(
        HFGenerationBackend(GenerationBackendConfig(**GEN)),
        build_tiny_tokenizer(),
        [dataset[r] for r in rows for _ in range(g)],
        {TWO_TURN_TASK_NAME: TwoTurnGuessEnvironment()},
        RolloutLimits(**LIMITS),
    )
    expected = records_to_columns(records)
    for f in ("input_ids", "generation_logprobs", "token_mask"):
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got[f], expected[f])), f
    for f in ("input_lengths", "sample_mask", "total_reward", "truncated"):
        assert torch.equal(got[f], expected[f]), f
    assert got["message_log"] == [[{"role": m["role"], "content": m["content"]} for m in r["message_log"]] for r in records]
    # ... and the legacy path's columns (the same algorithm on both paths), and the driver_carry scalars.
    assert torch.equal(got["input_lengths"], legacy["input_lengths"])
    for i in range(n):
        length = int(legacy["input_lengths"][i])
        for f in ("input_ids", "generation_logprobs", "token_mask"):
            assert got[f][i].dtype == legacy[f].dtype and torch.equal(got[f][i], legacy[f][i, :length])
            assert not legacy[f][i, length:].any() or f == "input_ids"
        assert int(got["token_mask"][i].sum()) == int(carry["response_lengths"][i])
    assert got["message_log"] == legacy["message_log"]
    assert [m["role"] for m in got["message_log"][0]] == ["user", "assistant", "environment", "assistant"]
    for f, c in (("sample_mask", "loss_multiplier"), ("total_reward", "total_reward"), ("truncated", "truncated")):
        assert torch.equal(got[f], carry[c]) and torch.equal(carry[c], legacy[c])
    # wall times, and the put's own figures (it exists on the TQ path only)
    not_compared = ("rollout_seconds", "tq_put_seconds", "tq_put_bytes")
    assert {k: v for k, v in rollout_metrics.items() if k not in not_compared} == {
        k: v for k, v in legacy_rollout_metrics.items() if k not in not_compared
    }
    assert rollout_metrics["tq_put_bytes"] >= sum(carry["input_lengths"].tolist()) * 8  # input_ids alone are int64
    assert gen_metrics["generate_calls"] == 2.0 and gen_metrics["generation_requests"] == 2 * n

    # driver_carry: per-sample scalars only - nothing with a token dimension, small.
    assert not set(TOKEN_FIELDS) & set(carry) and "message_log" not in carry
    for k, v in carry.items():
        if isinstance(v, torch.Tensor):
            assert v.shape == (n,), k
        else:
            assert len(v) == n and all(x is None or isinstance(x, (bool, int, float, str)) for x in v), k
    assert len(pickle.dumps(carry)) < 4096 + 200 * n
    assert torch.equal(carry["prompt_ids"], torch.tensor([r for r in rows for _ in range(g)]))
    assert carry["ground_truth"] == [dataset[r]["extra_env_info"]["ground_truth"] for r in rows for _ in range(g)]
    # The per-worker seed fields are all there for the log-prob pass.
    client.wait(meta, LP_SEED_FIELDS, timeout=5)


def test_validation_partition_stays_warm_and_training_releases(tq_server, client, dataset):
    val = impl(tq_server)
    try:
        client.drop_partition("val")
    except Exception:
        pass
    m1, c1, _, _ = val.rollout_to_tq(batch_of(dataset, [0, 1]), validation=True, carry_keys=["ground_truth"])
    m2, _, _, _ = val.rollout_to_tq(batch_of(dataset, [2, 3]), validation=True)
    assert m1.partition_id == m2.partition_id == "val"
    assert sorted(client.get_meta("val").keys) == sorted(m1.keys + m2.keys) == ["0_g0", "1_g0", "2_g0", "3_g0"]
    assert c1["ground_truth"] == [dataset[0]["extra_env_info"]["ground_truth"], dataset[1]["extra_env_info"]["ground_truth"]]
    # Inference state kept warm across the validation batches: brought up once, never released.
    assert val.get_counters()["prepare_calls"] == 1 and val.get_counters()["finish_calls"] == 0 and val.is_warm()
    pid = f"t-{uuid.uuid4().hex[:6]}"
    meta, _, _, _ = val.rollout_to_tq(batch_of(dataset, [4]), pid, 2)
    assert meta.partition_id == pid and val.get_counters()["finish_calls"] == 1 and not val.is_warm()
    client.drop_partition(pid)  # dropped behind the actor's back: the next write makes it again
    meta, _, _, _ = val.rollout_to_tq(batch_of(dataset, [4]), pid, 1)
    assert client.get_meta(pid).keys == meta.keys == ("4_g0",)
    client.drop_partition("val")
    client.drop_partition(pid)
    val.shutdown()


def test_bad_batches_fail_before_anything_is_written(tq_server, client, partition, dataset):
    r = impl(tq_server)
    broken = [dataset[0], {**dataset[1], "task_name": "unknown"}]
    with pytest.raises(DatasetError, match=r"record 1 \(dataset row 1\): no environment registered"):
        r.rollout_to_tq(broken, partition, 2)
    with pytest.raises(ValueError, match="prompt uid '3' appears twice"):
        r.rollout_to_tq([dataset[3], dataset[3]], partition, 2)
    with pytest.raises(TypeError, match="driver_carry holds per-sample scalars only"):
        r.rollout_to_tq([{**dataset[0], "extra_env_info": {"ground_truth": "1", "hints": [1, 2]}}], partition, 1, carry_keys=["hints"])
    assert client.get_meta(partition).keys == ()
    r.shutdown()


def test_ray_actor_with_an_existing_generation_actor(ray_session, tq_server, client, partition, dataset):
    ray = ray_session
    from rollout.generation import RayGenerationWorker

    worker = ray.remote(RayGenerationWorker).options(num_cpus=0.25).remote({**GEN, "model_seed": 0})
    actor = SyncRolloutActor.remote(
        generation=worker, tokenizer_name=TINY_MODEL, environments=ENVS, connection=TQConnection(tq_server.address), limits=LIMITS
    )
    try:
        assert ray.get(actor.ready.remote(), timeout=120) == 0
        meta, carry, rollout_metrics, _ = ray.get(actor.rollout_to_tq.remote(batch_of(dataset, [1, 4]), partition, 3), timeout=120)
        assert list(meta.keys) == carry["keys"] == [f"{r}_g{i}" for r in (1, 4) for i in range(3)]
        got = client.get(meta, ["input_lengths", "token_mask"], layout="list")
        assert got["input_lengths"].tolist() == list(meta.sequence_lengths) == carry["input_lengths"].tolist()
        assert [int(m.sum()) for m in got["token_mask"]] == carry["response_lengths"].tolist()
        assert rollout_metrics["num_samples"] == 6.0
        # A refit through the actor reaches the adopted generation actor: the next batch is tagged with it.
        state = load_model(TINY_MODEL, tokenizer=build_tiny_tokenizer(), seed=1).state_dict()
        assert ray.get(actor.update_weights.remote(state, 3), timeout=60) == 3
        meta2, carry2, _, _ = ray.get(actor.rollout_to_tq.remote(batch_of(dataset, [7]), partition, 1), timeout=120)
        assert meta2.tags["weight_version"] == (3,) and carry2["weight_version"].tolist() == [3]
        ray.get(actor.shutdown.remote(), timeout=60)
    finally:
        ray.kill(actor)
        ray.kill(worker)


def test_extra_tags_and_carry_columns_reach_tq(tq_server, client, partition, dataset):
    r = impl(tq_server)
    meta, carry, _, _ = r.rollout_to_tq(
        batch_of(dataset, [1, 4]),
        partition,
        2,
        extra_tags={"target_step": 7, "shard": [3, 2, 1, 0]},
        carry_columns=("response_lengths", "loss_multiplier"),
    )
    assert meta.tags["target_step"] == (7,) * 4 and meta.tags["shard"] == (3, 2, 1, 0)
    assert meta.tags["weight_version"] == (0,) * 4  # the tags rollout_to_tq writes itself are still there
    got = client.get(meta, ["response_lengths", "loss_multiplier"])
    assert torch.equal(got["response_lengths"], carry["response_lengths"])
    assert torch.equal(got["loss_multiplier"], carry["loss_multiplier"])
    assert client.get_meta(partition).tags["target_step"] == (7,) * 4  # stored by the controller, not just echoed

    for kwargs, match in [
        ({"extra_tags": {"weight_version": 3}}, "would replace tags"),
        ({"carry_columns": ["total_reward"]}, "would replace bulk columns"),
        ({"carry_columns": ["no_such"]}, "not driver_carry entries"),
        ({"extra_tags": {"target_step": [1, 2]}}, "2 values for 4 samples"),
    ]:
        with pytest.raises(ValueError, match=match):
            r.rollout_to_tq(batch_of(dataset, [2, 6]), partition, 2, **kwargs)
    assert client.get_meta(partition).keys == meta.keys  # nothing written by the refused calls
    assert r.get_counters()["batches"] == 2  # only the length mismatch got as far as generating
    for bad, err, match in [  # refused by the put after a whole rollout was generated, before
        ({"note": object()}, TypeError, "tag 'note' value at index 0 has type object"),
        ({"note": ["x" * 65537] * 4}, ValueError, "more than MAX_TAG_CHARS"),
        ({"": 1}, ValueError, "tag name '' has 0 characters"),
        ({"big": 2**64}, ValueError, "does not fit in 64 bits"),
    ]:
        with pytest.raises(err, match=match):
            r.rollout_to_tq(batch_of(dataset, [2, 6]), partition, 2, extra_tags=bad)
    assert r.get_counters()["batches"] == 2 and client.get_meta(partition).keys == meta.keys  # no rollout spent
    r.shutdown()
