"""The prompt ledger: which dataset prompts each training step trained on, across crashes and resumes.

Every trainer appends to ``<log_dir>/<run>/prompts.jsonl`` (a resumed run writes to the run directory
its checkpoint names, so one file holds the whole lineage). Lines, in order:

- ``{"event": "start", "step": 0, "loader": {...}}`` - a run started from scratch; anything logged
  before no longer belongs to the lineage (``loader``: the data loader's settings - dataset size,
  batch size, seed, shuffling - from which each epoch's rows are known);
- ``{"event": "resume", "step": k, "checkpoint": ..., "loader": {...}}`` - a run restored checkpoint
  ``step_k``: steps logged after ``k`` by the run that wrote them (and then died, or went on past its
  last checkpoint) are not part of the lineage any more, the resumed run logs them again;
- ``{"step": t, "trained": [[epoch, idx], ...], "dropped": [[epoch, idx], ...]}`` - step ``t`` (1-based,
  as in ``metrics.jsonl``) trained on the groups of these prompts.

What "trained on" means: a prompt (one dataset row, ``idx``, in loader epoch ``epoch``) was trained on
at step ``t`` when its group of ``grpo.num_generations_per_prompt`` samples was in step ``t``'s training
batch - the samples' loss masks (a truncated prompt, overlong filtering, the log-prob error mask) weight
samples inside the batch and do not change that. ``dropped`` lists prompts that were drawn for the step
and rolled out but not trained on, by design: dynamic sampling filtered their group (zero reward std)
or the step already had enough groups (the surplus of the last generation batch). A prompt is *drawn*
exactly once per epoch: it appears in exactly one step's ``trained`` or ``dropped`` list of the lineage.
The loader drops the last ``len(dataset) % num_prompts_per_step`` rows of each epoch's permutation
(``drop_last``), so an epoch covers ``len(dataset) // num_prompts_per_step * num_prompts_per_step`` rows.

``python -m trainer.ledger logs/<run>/prompts.jsonl`` prints the lineage's per-epoch coverage and
checks it: no prompt drawn twice in an epoch, no step missing and, for every epoch the lineage has
moved past, none of the epoch's rows missing (exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

FILE_NAME = "prompts.jsonl"

Prompt = tuple[int, int]  # (epoch, dataset idx)


class PromptLedger:
    """Appends the ledger lines of one run (see the module docstring); every line is flushed at once,
    so a driver killed with SIGKILL loses none it wrote; :meth:`sync` also fsyncs (checkpoints call it)."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / FILE_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)

    def _write(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps(row) + "\n")

    def start(self, step: int, checkpoint: str | os.PathLike | None = None, loader: Mapping[str, Any] | None = None) -> None:
        """A run begins: from scratch (``checkpoint`` None, ``step`` 0) or resumed from ``checkpoint``;
        ``loader``: the data loader's ``state_dict()`` (its settings say which rows each epoch visits)."""
        row: dict[str, Any] = {"event": "start" if checkpoint is None else "resume", "step": int(step)}
        if checkpoint is not None:
            row["checkpoint"] = str(checkpoint)
        if loader is not None:
            row["loader"] = {k: loader[k] for k in ("dataset_len", "batch_size", "seed", "shuffle", "drop_last") if k in loader}
        self._write(row)

    def record(self, step: int, trained: Iterable[Prompt], dropped: Iterable[Prompt] = ()) -> None:
        self._write(
            {"step": int(step), "trained": [[int(e), int(i)] for e, i in trained], "dropped": [[int(e), int(i)] for e, i in dropped]}
        )

    def sync(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def _rows(path: str | os.PathLike) -> Iterable[dict[str, Any]]:
    with open(path) as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:  # a torn last line: the driver died writing it
                continue


def read_loader(path: str | os.PathLike) -> Any:
    """A ``StatefulDataLoader`` over ``range(dataset_len)`` with the settings the last run logged (None
    if it logged none): its ``epoch_indices(e)`` are the rows epoch ``e`` visits."""
    from rollout.data import StatefulDataLoader

    settings = None
    for row in _rows(path):
        if "event" in row and row.get("loader"):
            settings = row["loader"]
    if settings is None:
        return None
    return StatefulDataLoader(
        range(int(settings["dataset_len"])),
        int(settings["batch_size"]),
        shuffle=bool(settings["shuffle"]),
        seed=int(settings["seed"]),
        drop_last=bool(settings.get("drop_last", True)),
    )


def read_lineage(path: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """Step -> its ledger line, for the lineage of the last run that wrote ``path``: each ``start`` /
    ``resume`` line forgets the steps logged after the step it restarts from. A torn last line (the
    driver died writing it) is ignored."""
    steps: dict[int, dict[str, Any]] = {}
    for row in _rows(path):
        if "event" in row:
            steps = {t: r for t, r in steps.items() if t <= int(row["step"])}
        else:
            steps[int(row["step"])] = row
    return dict(sorted(steps.items()))


def coverage(lineage: dict[int, dict[str, Any]]) -> dict[int, dict[str, Counter]]:
    """Per epoch: how often each prompt was trained on and how often it was dropped, over the lineage."""
    out: dict[int, dict[str, Counter]] = {}
    for row in lineage.values():
        for kind in ("trained", "dropped"):
            for e, i in row.get(kind, ()):
                out.setdefault(int(e), {"trained": Counter(), "dropped": Counter()})[kind][int(i)] += 1
    return dict(sorted(out.items()))


def check_exactly_once(
    lineage: dict[int, dict[str, Any]],
    epoch_rows: Callable[[int], Iterable[int]] | Iterable[int] | None = None,
    complete_epochs: Iterable[int] | None = None,
) -> list[str]:
    """Problems with the lineage (empty: none): a prompt drawn (trained or dropped) more than once in
    an epoch, a step missing from the lineage, and - for each epoch in ``complete_epochs`` (default:
    every epoch the lineage has moved past) - a row of ``epoch_rows`` (the dataset indices an epoch
    visits: one list for all, or a function of the epoch) never drawn."""
    problems = []
    if lineage:
        missing_steps = sorted(set(range(1, max(lineage) + 1)) - set(lineage))
        if missing_steps:
            problems.append(f"steps {missing_steps} are missing from the lineage")
    cov = coverage(lineage)
    for e, c in cov.items():
        drawn = c["trained"] + c["dropped"]
        twice = sorted(i for i, n in drawn.items() if n > 1)
        if twice:
            problems.append(f"epoch {e}: prompts {twice} drawn more than once")
    if epoch_rows is None:
        return problems
    rows_of = epoch_rows if callable(epoch_rows) else (lambda _e, rows=list(epoch_rows): rows)
    if complete_epochs is None:
        complete_epochs = [e for e in cov if e < max(cov)]
    for e in complete_epochs:
        c = cov.get(e, {"trained": Counter(), "dropped": Counter()})
        drawn = set(c["trained"]) | set(c["dropped"])
        lost = sorted(set(rows_of(e)) - drawn)
        if lost:
            problems.append(f"epoch {e}: prompts {lost} never trained on")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.ledger", description="Check a run's prompt ledger (prompts.jsonl).")
    p.add_argument("path", help="prompts.jsonl, or the run directory holding it")
    args = p.parse_args(argv)
    path = Path(args.path)
    if path.is_dir():
        path = path / FILE_NAME
    lineage = read_lineage(path)
    loader = read_loader(path)
    print(f"{path}: {len(lineage)} steps in the lineage" + (f" (1..{max(lineage)})" if lineage else ""))
    for e, c in coverage(lineage).items():
        drawn = c["trained"] + c["dropped"]
        twice = sum(1 for n in drawn.values() if n > 1)
        rows = f" (of the {len(loader.epoch_indices(e))} rows it visits)" if loader is not None else ""
        print(
            f"epoch {e}: {len(drawn)} prompts drawn{rows}: {len(c['trained'])} trained on, "
            f"{len(c['dropped'])} dropped, {twice} drawn more than once"
        )
    problems = check_exactly_once(lineage, loader.epoch_indices if loader is not None else None)
    for msg in problems:
        print(f"problem: {msg}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
