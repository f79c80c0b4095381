"""The AsyncTrajectoryCollector in-process (no Ray) on a real TQ service and the tiny model: staged
refits switch weights between generation calls without pausing collection, every group lands in TQ
through ``rollout_to_tq`` tagged with the version it was generated on and its target step, and a
refit that would strand a step is refused."""

from __future__ import annotations

import pytest
import torch
from conftest import unique_keys

from rollout.collector import TQReplayBuffer
from tq import TQConnection
from trainer.async_collector import AsyncTrajectoryCollectorImpl, SchedulingError
from trainer.config import load_config
from trainer.grpo_async import ASYNC_CONFIG


@pytest.fixture()
def collector(tq_server):
    cfg = load_config(
        ASYNC_CONFIG,
        [
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=2",
            "grpo.max_new_tokens=2",
            "generation.max_new_tokens=2",
            "policy.train_global_batch_size=4",
            "grpo.val_period=0",
            "data.num_builtin_prompts=20",
            "async_grpo.max_trajectory_age_steps=1",
            "async_grpo.wait_timeout_s=60",
        ],
    )
    buffer = TQReplayBuffer(TQConnection(tq_server.address), capacity=16, partition_id=unique_keys(1, "async")[0])
    c = AsyncTrajectoryCollectorImpl(cfg.generation.model_dump(), None, {cfg.env.name: {"name": cfg.env.name}}, cfg, buffer, 0)
    yield c
    c.shutdown()


def _weights(c: AsyncTrajectoryCollectorImpl, shift: float) -> dict[str, torch.Tensor]:
    return {k: v + shift if v.is_floating_point() else v.clone() for k, v in c.rollout.generation.model.state_dict().items()}


def test_staged_refit_tags_versions_and_refuses_to_strand(collector, client):
    c = collector
    c.prepare_for_refit()  # the trainer's start-up: a quiescent refit to the start step, then start
    c.update_weights(_weights(c, 0.0), 0)
    c.start_collection()
    c.resume_after_refit()
    c.wait_for_target(0)
    c.wait_for_target(1)  # version 0 targets [0, 1], then idles: nothing else it may generate
    assert c.sched.blocked_reason().startswith("every target of weight version 0")
    assert c.release_target(0) == [(0, 2)]

    new = _weights(c, 0.01)
    with pytest.raises(SchedulingError, match=r"cannot target steps \[2\]"):
        c.stage_weights(new, 2)  # version 2 may not target step 2, which is not generated yet
    assert c.stage_weights(new, 1) == 1  # step 1 is complete: staged without pausing anything
    stats = c.wait_for_target(2)  # only the staged version 1 can generate step 2
    assert stats["staged_refits"] == 1 and c.get_weight_version() == 1
    assert all(torch.equal(v, new[k]) for k, v in c.rollout.generation.model.state_dict().items())

    meta = client.get_meta(c.buffer.partition_id)
    by_target = {}
    for t, v in zip(meta.tags["target_step"], meta.tags["weight_version"]):
        by_target.setdefault(t, set()).add(v)
    assert by_target == {0: {0}, 1: {0}, 2: {1}}  # (the trainer, not the collector, frees consumed keys)
    assert {"response_lengths", "loss_multiplier"} <= set(meta.fields)  # carry columns the async trainer reads
    timeline = c.get_timeline()
    assert [(t, v) for _, _, t, v in timeline] == [(0, 0), (1, 0), (2, 1)] and all(s <= e for s, e, _, _ in timeline)
