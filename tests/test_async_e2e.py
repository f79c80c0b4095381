"""Async GRPO end to end on real Ray actors and a real TQ service (tiny model, built-in task): staleness
tags within the bound, an empty store at the end, and checkpoint/resume of the collector's state."""

from __future__ import annotations

import json

import pytest
import ray

from tq import TQClient
from trainer.checkpoint import latest_checkpoint
from trainer.config import parse_cli
from trainer.grpo_async import ASYNC_CONFIG, GRPOAsyncTrainer, main

pytestmark = pytest.mark.slow  # full async runs on Ray + TQ: run with `pytest -m slow`

AGE = 2


def _cfg(tmp_path, *extra: str):
    return parse_cli(
        [
            "--config",
            str(ASYNC_CONFIG),
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "grpo.val_period=0",
            "policy.train_global_batch_size=16",
            "policy.train_micro_batch_size=8",
            "policy.logprob_batch_size=16",
            "data.num_builtin_prompts=40",
            "logger.tensorboard=false",
            "logger.plot=false",
            "logger.progress=false",
            f"logger.log_dir={tmp_path}/logs",
            "cluster.num_cpus=2",
            f"async_grpo.max_trajectory_age_steps={AGE}",
            "checkpointing.enabled=true",
            "checkpointing.save_period=2",
            f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
            *extra,
        ]
    )


@pytest.fixture(autouse=True)
def _ray_down():
    yield
    ray.shutdown()


def _fit(cfg):
    trainer = GRPOAsyncTrainer(cfg)
    try:
        history = trainer.fit()
        client = TQClient(trainer.tq_address, timeout=10.0)
        try:
            held = {p["partition"]: p["keys"] for p in client.list_partitions()}
        finally:
            client.close()
        return trainer.step, history, held
    finally:
        trainer.shutdown()


def test_async_run_staleness_empty_store_and_resume(tmp_path):
    step, history, held = _fit(_cfg(tmp_path, "grpo.max_num_steps=2"))
    assert step == 2 and len(history) == 2
    assert all(0 <= h["async/trajectory_age_max"] <= AGE for h in history)
    assert history[0]["async/trajectory_age_max"] == 0  # step 0 can only come from the initial weights
    for h in history:  # the staleness histogram: every consumed sample counted at its policy-version lag
        counts = h["async/trajectory_age_counts"]
        assert len(counts) == AGE + 1 and sum(counts) == 16
        assert max(a for a, n in enumerate(counts) if n) == h["async/trajectory_age_max"]
        assert 0 < h["dataplane/frac_of_step"] < 1 and h["dataplane/bytes_read"] > 0 and h["dataplane/bytes_written"] > 0
    rows = [json.loads(line) for line in next((tmp_path / "logs").glob("*/metrics.jsonl")).read_text().splitlines()]
    assert [r["async/trajectory_age_counts"] for r in rows if r["split"] == "train"] == [h["async/trajectory_age_counts"] for h in history]
    assert all(n == 0 for n in held.values()), held  # consumed keys freed, generated-ahead ones too

    ck = latest_checkpoint(tmp_path / "ckpt")
    state = json.loads((ck / "trainer_state.json").read_text())["collector"]
    targets = {int(t): v for t, v in state["targets"].items()}
    # the generator is on version 1 (targets [2, 1 + AGE]) or already on the staged version 2 ([3, 2 + AGE])
    assert targets and min(targets) >= 2 and max(targets) <= 2 + AGE
    idx = [i for v in targets.values() for i in v]
    assert len(idx) == len(set(idx))  # first epoch: no prompt buffered twice
    assert targets[2] and len(targets[2]) == 4  # step 2 was complete before the refit to version 2

    ray.shutdown()
    step, history, held = _fit(_cfg(tmp_path, "grpo.max_num_steps=3"))  # resumes at step 2
    assert step == 3 and len(history) == 1
    assert history[0]["async/trajectory_age_max"] == 0  # the resumed generator regenerated step 2's prompts
    assert all(n == 0 for n in held.values()), held


def test_cli_refuses_async_without_importance_sampling(capsys):
    assert main(["loss.use_importance_sampling_correction=false"]) == 2
    assert "loss.use_importance_sampling_correction" in capsys.readouterr().err
