"""Checkpoints: ``<checkpoint_dir>/step_<n>/`` holding the policy (model, optimizer, scheduler - saved
by the workers), the trainer state (step, dataloader position) and the driver's RNG states.

A checkpoint counts only once its ``COMPLETE`` marker is written (last), so a run interrupted while
saving leaves the previous checkpoint as the latest loadable one.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

MARKER = "COMPLETE"


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    root = Path(checkpoint_dir)
    done = [p for p in root.glob("step_*") if (p / MARKER).exists()] if root.exists() else []
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def save_checkpoint(checkpoint_dir: str | Path, step: int, policy: Any, trainer_state: Mapping[str, Any], *, keep: int = 2) -> Path:
    """Write checkpoint ``step`` and prune all but the newest ``keep`` complete ones."""
    path = Path(checkpoint_dir) / f"step_{step}"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    policy.save_checkpoint(str(path / "policy"))
    (path / "trainer_state.json").write_text(json.dumps({"step": step, **trainer_state}, default=str))
    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        path / "rng.pt",
    )
    (path / MARKER).write_text("ok")
    complete = sorted((p for p in path.parent.glob("step_*") if (p / MARKER).exists()), key=lambda p: int(p.name.split("_")[1]))
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_checkpoint(path: str | Path, policy: Any) -> dict[str, Any]:
    """Restore the policy and the driver's RNGs from ``path``; return the trainer state."""
    path = Path(path)
    if not (path / MARKER).exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    policy.load_checkpoint(str(path / "policy"))
    rng = torch.load(path / "rng.pt", weights_only=False)  # our own file, written by save_checkpoint
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    return json.loads((path / "trainer_state.json").read_text())


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """The trainer state of checkpoint ``path`` (step, run name, loader / collector state), without
    loading the policy."""
    return json.loads((Path(path) / "trainer_state.json").read_text())
