"""``python -m tq.demo`` runs one GRPO-shaped step end to end and reports what moved where."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # 24 s; the demo's steps are each covered by the service tests
def test_demo_runs_end_to_end():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "tq.demo"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, f"demo failed:\n{r.stdout}\n{r.stderr}"
    out = r.stdout
    assert "samples: 32 (8 prompts x 4 generations)" in out
    assert "store empty after discard: yes (32 keys discarded)" in out
    for section in ("Partitions", "Storage units", "Operations", "TQ demo finished"):
        assert section in out

    moved = int(re.search(r"workers moved: (\d+) bytes", out).group(1))
    received = int(re.search(r"driver received: (\d+) bytes", out).group(1))
    # The driver reads two float32 per-sample columns (rewards, seq_logprob_error) for 32 samples;
    # bulk per-token data goes to the workers only.
    assert received == 32 * 2 * 4
    assert moved > 100 * received
    assert elapsed < 60, f"demo took {elapsed:.0f}s"
