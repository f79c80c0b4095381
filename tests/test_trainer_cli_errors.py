"""What a user sees when the trainer's data-plane settings are wrong: one line naming what is wrong,
fast, before Ray starts - no traceback (``TQ_DEBUG=1`` brings it back)."""

from __future__ import annotations

import subprocess
import sys

from tq import TQServer


def _trainer(*overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.grpo_sync", *overrides], capture_output=True, text=True, timeout=120, env=env)


def test_address_without_a_scheme_is_a_config_error():
    r = _trainer("data_plane.address=10.0.0.5:5555")
    assert r.returncode == 2, r.stderr
    assert "data_plane.address" in r.stderr and "tcp://host:port" in r.stderr
    assert "Traceback" not in r.stderr and "ZMQError" not in r.stderr


def test_wrong_secret_is_one_line():
    with TQServer(storage_units=1, capacity=16 << 20, secret="right") as server:
        r = _trainer(f"data_plane.address={server.address}", "data_plane.secret=wrong")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1, r.stderr
    assert lines == [f"error: controller at {server.address} refused this client's credentials: wrong secret"], lines


def test_missing_dataset_is_reported_before_anything_starts():
    """The GPU recipe names /data/gsm8k.jsonl: absent here, it must be the first thing the user hears
    (it used to come after Ray had started and a 56 s tokenizer download attempt)."""
    r = _trainer("--config", "trainer/configs/grpo_gpu_qwen.yaml", "data.dataset=/nonexistent/prompts.jsonl")
    assert r.returncode == 2, r.stderr
    assert "data.dataset: no such file or directory: '/nonexistent/prompts.jsonl'" in r.stderr
    assert "Traceback" not in r.stderr and "ray" not in (r.stdout + r.stderr).lower()


def test_a_malformed_dataset_is_one_line_naming_the_key_row_and_field_before_ray_starts(tmp_path):
    """A user's JSONL with a row lacking its prompt: named (key, file, row, field) before Ray starts,
    as a bad setting is - it used to come as a traceback after Ray had started."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "ground_truth": "2"}\n{"question": "2+2=", "ground_truth": "4"}\n')
    r = _trainer(f"data.dataset={data}", "env.name=math", "data.processor.task_name=math", f"logger.log_dir={tmp_path}")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr
    assert lines == [f"error: data.dataset={data}: row 1: field 'prompt' (prompt) is missing"], lines
    assert "ray" not in r.stdout.lower()


def test_a_row_whose_task_names_no_environment_is_refused_before_ray_starts(tmp_path):
    """One row of eight naming a task no environment of the run has ('mathh') failed only when a
    rollout drew it - a step in here, epochs in on a big dataset: now named before Ray starts."""
    data = tmp_path / "mixed.jsonl"
    rows = [f'{{"prompt": "{i}+1=", "ground_truth": "{i + 1}", "task_name": "{"mathh" if i == 6 else "math"}"}}' for i in range(8)]
    data.write_text("\n".join(rows) + "\n")
    r = _trainer(f"data.dataset={data}", "env.name=math", "data.processor.task_name=null", f"logger.log_dir={tmp_path}")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith(f"error: data.dataset={data}: row 6: task_name 'mathh' names no environment"), lines
    assert "ray" not in r.stdout.lower()


def test_an_output_dir_that_is_a_file_is_named_before_ray_starts(tmp_path):
    """logger.log_dir or checkpointing.checkpoint_dir naming a file (or a path under one): one line naming
    the key, before Ray starts - it used to be a NotADirectoryError traceback once the workers were up."""
    afile = tmp_path / "notes.txt"
    afile.write_text("x")
    for override, key in [
        (f"logger.log_dir={afile}", "logger.log_dir"),
        (f"checkpointing.checkpoint_dir={afile}/ck", "checkpointing.checkpoint_dir"),
    ]:
        r = _trainer(
            "checkpointing.enabled=true", f"checkpointing.checkpoint_dir={tmp_path}/ck", f"logger.log_dir={tmp_path}/logs", override
        )
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2, r.stderr
        assert len(lines) == 1 and lines[0].startswith(f"error: {key}=") and "not a directory" in lines[0], lines
        assert "ray" not in r.stdout.lower()


def test_a_dp_layout_larger_than_the_local_ray_is_refused_at_once(tmp_path):
    """4 ranks of 1 CPU on a local Ray of 2 CPUs could never start: refused naming the settings and the
    CPUs there, before Ray starts - it used to wait policy.ray_timeout_s (600 s) printing nothing."""
    r = _trainer("policy.dp_size=4", "policy.num_cpus_per_worker=1", "cluster.num_cpus=2", f"logger.log_dir={tmp_path}")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1, lines
    assert (
        "policy.dp_size=4 x policy.num_cpus_per_worker=1" in lines[0]
        and "but 2 are there in the local Ray (cluster.num_cpus=2)" in lines[0]
    )
    assert "ray" not in r.stdout.lower()


def test_an_attached_cluster_too_small_for_the_run_gets_a_warning_not_a_refusal(capsys):
    """A cluster the run attaches to may add nodes (autoscaling): the same shortfall is a warning there."""
    from trainer.common import check_cluster_fits
    from trainer.config import parse_cli

    cfg = parse_cli(["policy.dp_size=2", "policy.num_gpus_per_worker=1", "cluster.ray_address=10.0.0.1:6379"])
    check_cluster_fits(cfg, {"CPU": 64.0, "GPU": 1.0}, local=False)
    err = capsys.readouterr().err
    assert err.startswith("warning: the run's actors need 2 GPUs (policy.dp_size=2 x policy.num_gpus_per_worker=1: 2) but 1 is there")
    assert "10.0.0.1:6379" in err and "policy.ray_timeout_s=600s" in err
    check_cluster_fits(cfg, {"CPU": 64.0, "GPU": 2.0}, local=False)
    assert capsys.readouterr().err == ""


def test_the_async_recipe_given_to_the_sync_trainer_is_refused_naming_the_trainer_to_run():
    """async_grpo.enabled on trainer.grpo_sync was ignored: the run trained synchronously."""
    r = _trainer("--config", "trainer/configs/grpo_async_cpu.yaml")
    assert r.returncode == 2, r.stderr
    assert (
        "error: async_grpo.enabled is true: python -m trainer.grpo_sync trains synchronously; run python -m trainer.grpo_async" in r.stderr
    )
    assert "Traceback" not in r.stderr
