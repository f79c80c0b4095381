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
