"""The two GRPO trainers end to end: parity, data movement, an empty store, resume, bad input.

Small runs of the offline default (tiny model, built-in task, 2 DP workers) on real Ray actors and a
real TQ service.
"""

from __future__ import annotations

import math

import pytest
import ray

from conftest import popen_ctrl_c
from tq import TQClient, TQServer
from trainer.base import run
from trainer.config import parse_cli
from trainer.grpo import GRPOTrainer
from trainer.grpo_sync import GRPOSyncTrainer

COMPARED = ("reward", "shaped_reward", "loss", "seq_logprob_error", "advantage_abs_mean", "kl_penalty", "grad_norm")


def _cfg(tmp_path, *extra: str):
    return parse_cli(
        [
            "grpo.num_prompts_per_step=8",
            "grpo.num_generations_per_prompt=8",
            "grpo.max_num_steps=5",
            "grpo.val_period=0",
            "policy.train_global_batch_size=64",
            "policy.train_micro_batch_size=16",
            "policy.logprob_batch_size=32",
            "policy.learning_rate=0.01",
            "data.num_builtin_prompts=40",
            "logger.tensorboard=false",
            "logger.plot=false",
            "logger.progress=false",
            f"logger.log_dir={tmp_path}/logs",
            "cluster.num_cpus=2",
            *extra,
        ]
    )


@pytest.fixture(autouse=True)
def _ray_down():
    yield
    ray.shutdown()


def _fit(cls, cfg):
    trainer = cls(cfg)
    try:
        return trainer.fit(), trainer
    finally:
        trainer.shutdown()


@pytest.mark.long
def test_legacy_and_tq_trainers_produce_the_same_metrics(tmp_path, monkeypatch, capsys):
    """Same config and seed: per-step reward, loss and log-prob metrics agree for 3 steps. The same
    runs check the TQ trainer's per-step data-plane metrics, its console, and that Ray's
    token-authentication warning is not printed (the start-up block explains it instead). The TQ run
    takes its data plane's secret from the config alone - no ``TQ_SECRET`` in any environment, so no
    worker can inherit one: every client it starts (driver, DP workers, rollout actor) signs its
    requests and the secret-protected service serves every step."""
    import logging
    import os
    import uuid

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)  # as on a fresh shell: Ray warns when it turns token auth on
    monkeypatch.delenv("TQ_SECRET", raising=False)
    warned: list[str] = []
    seen = logging.Handler()
    seen.emit = lambda record: warned.append(record.getMessage())
    ray_auth_log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    ray_auth_log.addHandler(seen)
    secret = f"e2e-{uuid.uuid4().hex}"
    try:
        legacy, _ = _fit(GRPOTrainer, _cfg(tmp_path, "grpo.max_num_steps=3"))
        with TQServer(storage_units=1, capacity=128 << 20, secret=secret) as server:
            capsys.readouterr()
            tq, trainer = _fit(
                GRPOSyncTrainer,
                _cfg(
                    tmp_path,
                    "grpo.max_num_steps=3",
                    f"data_plane.address={server.address}",
                    f"data_plane.secret={secret}",
                    "logger.progress=true",
                ),
            )
            out = capsys.readouterr().out
            with TQClient(server.address, secret=secret) as client:
                assert client.stats()["rejected_messages"] == 0  # no client tried without the secret
                assert all(p["keys"] == 0 for p in client.list_partitions())
    finally:
        ray_auth_log.removeHandler(seen)
    assert len(legacy) == len(tq) == 3
    assert any(h["loss"] != 0 for h in legacy)  # the runs did train
    assert "seq_logprob_error" in tq[0]  # the workers' written columns were read back
    for step, (a, b) in enumerate(zip(legacy, tq), start=1):
        for key in COMPARED:
            if key in a or key in b:
                assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-7), f"step {step}: {key} {a[key]} != {b[key]}"
    assert not [m for m in warned if "Token authentication is enabled" in m], warned
    assert "TQ_SECRET" not in os.environ  # the driver's environment is left alone
    # The console: the start-up block with the resolved config's key facts, then the step lines.
    for fact in (
        "grpo_sync: GRPO (synchronous, TQ path",
        "model       tiny-random",
        "steps       3 x 8 prompts x 8 samples",
        "DP          2 policy worker(s)",
        f"data plane  {server.address} (a running tq-controller)",
        f"logs        {trainer.logger.run_dir}",
        "ray         local: token authentication",
    ):
        assert fact in out, fact
    assert "step 3/3 | reward" in out and "| elapsed 0:" in out and ", ETA 0:00" in out
    # Data plane, every step: the time in TQ calls is part of the step; the rollout's columns, the
    # workers' log-probs and the driver's advantages are written, the workers read their shards back.
    assert not any(k.startswith("dataplane/") for k in legacy[0])
    n = 64  # samples per step
    for h in tq:
        assert 0 < h["dataplane/seconds"] < h["step_time_s"] and h["dataplane/frac_of_step"] == h["dataplane/seconds"] / h["step_time_s"]
        assert h["dataplane/slowest_rank_s"] > 0 and h["dataplane/driver_s"] > 0 and h["dataplane/rollout_put_s"] > 0
        # input_ids (int64) and token-aligned float32/bool columns of >= 5 tokens per sample, plus
        # prev_logprobs written back and advantages/sample_mask from the driver
        assert h["rollout/tq_put_bytes"] >= n * 5 * (8 + 4 + 1)
        assert h["dataplane/bytes_written"] >= h["rollout/tq_put_bytes"] + n * 5 * 4 + 2 * n * 4
        assert h["dataplane/bytes_read"] >= n * 5 * (8 + 4 + 1 + 4)  # each rank reads its shard's training columns
        assert h["dataplane/bytes_moved"] == h["dataplane/bytes_written"] + h["dataplane/bytes_read"] < 10 * h["store_bytes"]


# slow: tests/test_dataplane_scale.py checks the same property (driver bytes flat in the payload on the
# TQ path, growing on the legacy one) on the trainers' dispatch code in a third of the time
@pytest.mark.slow
def test_tq_driver_receives_per_sample_data_only_and_the_store_empties(tmp_path):
    """The driver's received bytes per step (instrumented) stay within per-sample scalars, do not grow
    with response length, and are far below the legacy path's; no key is left in TQ after a step."""
    # One step per run: a step is all of its data movement (the three runs share the first one's Ray).
    with TQServer(storage_units=1, capacity=256 << 20) as server:
        runs = {}
        for tokens in (2, 24):
            cfg = _cfg(
                tmp_path,
                "grpo.max_num_steps=1",
                f"grpo.max_new_tokens={tokens}",
                f"data_plane.address={server.address}",
                "logger.data_movement_metrics=true",
            )
            history, _ = _fit(GRPOSyncTrainer, cfg)
            runs[tokens] = max(h["driver_bytes_received"] for h in history)
            with TQClient(server.address) as client:
                assert all(p["keys"] == 0 and p["bytes"] == 0 for p in client.list_partitions())
    n = 64
    assert runs[24] <= 600 * n + 8192, runs  # a few hundred bytes of scalars per sample, plus keys
    assert runs[24] < 1.25 * runs[2]  # 12x longer responses: (almost) the same driver traffic
    legacy, _ = _fit(GRPOTrainer, _cfg(tmp_path, "grpo.max_num_steps=1", "grpo.max_new_tokens=24", "logger.data_movement_metrics=true"))
    assert max(h["driver_bytes_received"] for h in legacy) > 2 * runs[24]


# slow since tests/test_crash_resume.py resumes both trainers from a checkpoint (after a kill -9) in CI
@pytest.mark.slow
def test_resumed_run_continues_the_same_curve(tmp_path):
    """Checkpoint at step 2, resume to step 4: steps 3-4 match an uninterrupted 4-step run."""
    straight, _ = _fit(GRPOSyncTrainer, _cfg(tmp_path, "grpo.max_num_steps=4"))
    ck = [f"checkpointing.checkpoint_dir={tmp_path}/ck", "checkpointing.enabled=true", "checkpointing.save_period=2"]
    first, _ = _fit(GRPOSyncTrainer, _cfg(tmp_path, "grpo.max_num_steps=2", *ck))
    resumed, trainer = _fit(GRPOSyncTrainer, _cfg(tmp_path, "grpo.max_num_steps=4", *ck))
    assert trainer.step == 4 and len(resumed) == 2
    for a, b in zip(straight[2:], resumed):
        for key in ("reward", "loss", "seq_logprob_error"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-7), (key, a[key], b[key])


@pytest.mark.slow  # 24 s of training before a validation pass
def test_validation_reports_accuracy(tmp_path):
    history, trainer = _fit(
        GRPOSyncTrainer, _cfg(tmp_path, "grpo.max_num_steps=2", "grpo.val_period=2", "grpo.max_val_samples=8", "grpo.val_num_generations=2")
    )
    val = [r for r in trainer.logger.history if r["split"] == "val"]
    assert len(val) == 1 and 0.0 <= val[0]["accuracy"] <= 1.0 and "pass@2" in val[0]


@pytest.mark.parametrize(
    "override, message",
    [
        (["policy.model_name=/no/such/model", "generation.model_name=/no/such/model"], "/no/such/model"),
        (["data.dataset=/no/such/data.jsonl"], "/no/such/data.jsonl"),
        (["data_plane.address=tcp://127.0.0.1:9", "data_plane.timeout_s=1"], "tcp://127.0.0.1:9"),
        (["grpo.bogus=1"], "grpo.bogus"),
        (["grpo.message_advantage_penalties={environment: 0.1}"], "grpo.message_advantage_penalties.environment"),
    ],
)
def test_bad_input_fails_fast_with_a_clear_message(tmp_path, capsys, override, message):
    code = run(GRPOSyncTrainer, [f"logger.log_dir={tmp_path}", "cluster.num_cpus=2", *override])
    assert code != 0
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_without_orphans(tmp_path):
    """SIGINT mid-run: exit code 130 with a message, the last checkpoint loadable, no TQ process left."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from trainer.checkpoint import latest_checkpoint

    ck = tmp_path / "ck"
    proc = popen_ctrl_c(  # a terminal's Ctrl-C, even when this run ignores SIGINT
        [
            sys.executable,
            "-m",
            "trainer.grpo_sync",
            "grpo.max_num_steps=100000",
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "policy.train_global_batch_size=16",
            "checkpointing.enabled=true",
            "checkpointing.save_period=2",
            f"checkpointing.checkpoint_dir={ck}",
            f"logger.log_dir={tmp_path}/logs",
            "logger.tensorboard=false",
            "logger.plot=false",
            "cluster.num_cpus=2",
        ],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while latest_checkpoint(ck) is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert latest_checkpoint(ck) is not None, "no checkpoint written"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and "interrupted" in err
    assert latest_checkpoint(ck) is not None
    time.sleep(1)
    leftovers = subprocess.run(["pgrep", "-f", "tq.storage.*|tq.controller.*"], capture_output=True, text=True).stdout.split()
    mine = [p for p in leftovers if os.path.exists(f"/proc/{p}") and os.getsid(int(p)) == proc.pid]
    assert not mine, f"orphaned TQ processes: {mine}"


def _sigterm_run(tmp_path, module: str, *, after_checkpoint: bool):
    """Start ``module`` (a tiny config, a checkpoint every step), SIGTERM the driver alone once it has
    started (or checkpointed); return (its return code, its stderr, the processes of its session left
    a second later)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from trainer.checkpoint import latest_checkpoint

    ck = tmp_path / "ck"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            module,
            "grpo.max_num_steps=100000",
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "data.num_builtin_prompts=16",
            "policy.train_global_batch_size=16",
            "policy.train_micro_batch_size=8",
            "policy.logprob_batch_size=8",
            "policy.dp_size=1",
            "grpo.val_period=0",
            "checkpointing.enabled=true",
            "checkpointing.save_period=1",
            f"checkpointing.checkpoint_dir={ck}",
            f"logger.log_dir={tmp_path}/logs",
            "logger.tensorboard=false",
            "logger.plot=false",
            "cluster.num_cpus=2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 150
        # the run directory appears once Ray, the workers and the TQ service are up
        started = (lambda: latest_checkpoint(ck) is not None) if after_checkpoint else (lambda: any((tmp_path / "logs").glob("*")))
        while not started() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None and started(), "the run did not start in time"
        proc.send_signal(signal.SIGTERM)  # the driver only, as `kill <pid>` does
        _, err = proc.communicate(timeout=60)
        time.sleep(1)
        left = []
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == proc.pid and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except (psutil.Error, ProcessLookupError):
                pass
        for p in left:
            p.kill()
        return proc.returncode, err, [p.pid for p in left]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_sigterm_stops_like_ctrl_c(tmp_path):
    """``kill <driver pid>`` once the run is up: the clean stop of Ctrl-C (exit code 143, a message, no
    process of the run left, the driver record released). It was Ray's C++ SIGTERM dump (exit code
    -6 / -15), no clean-up at all."""
    code, err, left = _sigterm_run(tmp_path, "trainer.grpo_sync", after_checkpoint=False)
    assert code == 143, err[-3000:]
    assert "interrupted (SIGTERM): stopping workers; the last checkpoint stays loadable" in err and "SIGTERM received" not in err
    assert not left, f"processes left running: {left}"
    assert not (tmp_path / "ck" / "driver.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("module", ["trainer.grpo", "trainer.grpo_sync", "trainer.grpo_async"])
def test_sigterm_mid_run_stops_cleanly_and_leaves_a_loadable_checkpoint(tmp_path, module):
    """SIGTERM after a checkpoint, on each trainer: exit code 143, nothing left running, the latest
    checkpoint intact (it resumes)."""
    from trainer.checkpoint import checkpoint_problem, latest_checkpoint

    code, err, left = _sigterm_run(tmp_path, module, after_checkpoint=True)
    assert code == 143 and "interrupted (SIGTERM)" in err, err[-3000:]
    assert not left, f"processes left running: {left}"
    assert checkpoint_problem(latest_checkpoint(tmp_path / "ck")) is None


@pytest.mark.slow
@pytest.mark.parametrize("cls", [GRPOTrainer, GRPOSyncTrainer])
def test_dynamic_sampling_gives_up_after_max_generation_batches(tmp_path, cls):
    """A random model's groups nearly all score 0 (zero std): dynamic sampling drops them, draws more
    batches up to dynamic_sampling_max_gen_batches, then raises naming the setting; on the TQ path the
    dropped keys were discarded from the store at once."""
    with TQServer(storage_units=1, capacity=128 << 20) as server:
        cfg = _cfg(
            tmp_path, "grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=2", f"data_plane.address={server.address}"
        )
        trainer = cls(cfg)
        try:
            with pytest.raises(RuntimeError, match="dynamic_sampling_max_gen_batches=2"):
                trainer.fit()
            if cls is GRPOSyncTrainer:
                with TQClient(server.address) as client:
                    kept = {p["partition"]: p["keys"] for p in client.list_partitions()}.get("train", 0)
                assert kept < 2 * 64  # the zero-std groups of both batches left the store
        finally:
            trainer.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["policy worker", "rollout actor"])
def test_actor_dying_mid_run_stops_with_a_clear_error(tmp_path, victim):
    """A DP worker or the rollout actor killed mid-run: fit() stops with an error saying an actor died,
    the last checkpoint stays loadable, and shutdown leaves no TQ process behind."""
    import threading
    import time

    from trainer.checkpoint import latest_checkpoint, load_checkpoint

    ck = tmp_path / "ck"
    cfg = _cfg(
        tmp_path,
        "grpo.max_num_steps=1000",
        "checkpointing.enabled=true",
        "checkpointing.save_period=1",
        f"checkpointing.checkpoint_dir={ck}",
    )
    trainer = GRPOSyncTrainer(cfg)
    tq_pid = trainer.tq_server.proc.pid
    try:

        def kill_after_first_checkpoint() -> None:
            deadline = time.monotonic() + 120
            while latest_checkpoint(ck) is None and time.monotonic() < deadline:
                time.sleep(0.2)
            ray.kill(trainer.policy.workers[1] if victim == "policy worker" else trainer.rollout)

        killer = threading.Thread(target=kill_after_first_checkpoint)
        killer.start()
        with pytest.raises(RuntimeError, match="an actor died"):
            trainer.fit()
        killer.join()
    finally:
        trainer.shutdown()
    assert latest_checkpoint(ck) is not None
    state = load_checkpoint(latest_checkpoint(ck), _Reader())
    assert state["step"] >= 1
    time.sleep(1)
    import os

    assert not os.path.exists(f"/proc/{tq_pid}") or "State:\tZ" in open(f"/proc/{tq_pid}/status").read()


class _Reader:
    """Stands in for a policy when only the trainer-side state of a checkpoint is read back."""

    def load_checkpoint(self, path: str) -> None:
        import os

        assert os.path.isdir(path) and os.listdir(path), f"policy checkpoint {path} is empty"
