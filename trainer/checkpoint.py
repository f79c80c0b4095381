"""Checkpoints: ``<checkpoint_dir>/step_<n>/`` holding the policy (model, optimizer, scheduler - saved
by the workers), the trainer state (step, dataloader position) and the driver's RNG states.

A checkpoint counts only once its ``COMPLETE`` marker is written (last), so a run interrupted while
saving leaves the previous checkpoint as the latest loadable one. A complete checkpoint whose files
were damaged afterwards (a full disk, a partial copy) is found by :func:`checkpoint_problem` before
anything starts; :func:`find_resume_checkpoint` then falls back to the newest intact one.
"""

from __future__ import annotations

import json
import random
import shutil
import zipfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

MARKER = "COMPLETE"
#: The policy files the workers write (``DPPolicyWorker.save_checkpoint``), ``torch.save`` zip archives.
POLICY_FILES = ("model.pt", "optim.pt")


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from (unreadable, or saved with other settings); names its path."""


def _step_of(path: Path) -> int:
    return int(path.name.split("_")[1])


def complete_checkpoints(checkpoint_dir: str | Path) -> list[Path]:
    """The checkpoints with a ``COMPLETE`` marker, newest (highest step) first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step_*") if p.name.split("_")[1].isdigit() and (p / MARKER).exists()]
    return sorted(done, key=_step_of, reverse=True)


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    done = complete_checkpoints(checkpoint_dir)
    return done[0] if done else None


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
    for old in complete_checkpoints(path.parent)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_checkpoint(path: str | Path, policy: Any) -> dict[str, Any]:
    """Restore the policy and the driver's RNGs from ``path``; return the trainer state. A file that
    cannot be read raises :class:`CheckpointError` naming the checkpoint."""
    path = Path(path)
    if not (path / MARKER).exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    state = read_trainer_state(path)
    rng = _read_rng(path)
    try:
        policy.load_checkpoint(str(path / "policy"))
    except Exception as exc:
        import ray

        if isinstance(exc, (TimeoutError, ray.exceptions.RayActorError)):  # a worker's fate, not the files'
            raise
        cause = getattr(exc, "cause", None) or exc  # raised in a worker: its cause is the line
        raise CheckpointError(f"checkpoint {path}: the policy could not be loaded from {path / 'policy'}: {_first_line(cause)}") from None
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    return state


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """The trainer state of checkpoint ``path`` (step, run name, loader / collector state), without
    loading the policy; :class:`CheckpointError` naming the file if it is missing or damaged."""
    f = Path(path) / "trainer_state.json"
    try:
        state = json.loads(f.read_text())
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise ValueError("no integer 'step'")
    except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"checkpoint {path}: {f.name} is unreadable ({type(exc).__name__}: {_first_line(exc)})") from None
    return state


def _read_rng(path: Path) -> dict[str, Any]:
    f = path / "rng.pt"
    try:
        rng = torch.load(f, weights_only=False)  # our own file, written by save_checkpoint
        if not isinstance(rng, dict) or not {"python", "numpy", "torch"} <= rng.keys():
            raise ValueError("not a driver RNG state")
    except Exception as exc:  # EOFError, pickle and zip errors: what a damaged file raises varies
        raise CheckpointError(
            f"checkpoint {path}: {f.name} is unreadable ({type(exc).__name__}: {_first_line(exc) or 'empty file'})"
        ) from None
    return rng


def checkpoint_problem(path: str | Path) -> str | None:
    """What makes complete checkpoint ``path`` unloadable (one line naming the file), or None. Reads
    the trainer state and the RNG states, and checks the policy's archives are whole (their zip
    directory, at the end of the file, is what a truncation loses) without loading the weights."""
    path = Path(path)
    try:
        read_trainer_state(path)
        _read_rng(path)
    except CheckpointError as exc:
        return str(exc).removeprefix(f"checkpoint {path}: ")
    for name in POLICY_FILES:
        f = path / "policy" / name
        try:
            with zipfile.ZipFile(f):
                pass
        except FileNotFoundError:
            return f"policy/{name} is missing"
        except (OSError, zipfile.BadZipFile) as exc:
            return f"policy/{name} is damaged ({_first_line(exc)})"
    return None


def find_resume_checkpoint(checkpoint_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint that is intact (None if there is none), and the newer complete
    ones skipped as damaged, each with its problem. A damaged latest checkpoint is skipped rather than
    fatal: the previous one is what a run killed while saving would resume from too."""
    skipped: list[tuple[Path, str]] = []
    for path in complete_checkpoints(checkpoint_dir):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def set_aside(path: Path) -> Path:
    """Rename damaged checkpoint ``path`` to ``corrupt_step_<n>`` beside it (kept for inspection; no
    longer counted as a checkpoint, nor pruned in place of an intact one); returns the new path."""
    target = path.with_name(f"corrupt_{path.name}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"corrupt_{path.name}.{n}")
    path.rename(target)
    return target


def _first_line(exc: BaseException | str) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
