"""Where a benchmark's files go: a fresh run directory for every run; the published copy only on ``--publish``.

``benchmarks/results/`` holds one published set per benchmark and machine
(``<name>_<machine>.json`` / ``.md`` / ``_<plot>.png``), the files the README cites. A plain run never
writes there: it writes ``logs/<name>/<timestamp>/<name>.*`` (or ``--run-dir``) and says where;
``--publish`` then copies that run's files over the published ones (git keeps the earlier sets).

    p = argparse.ArgumentParser(...)
    add_output_args(p, "tq_throughput")
    a = p.parse_args()
    out = open_run("tq_throughput", a.run_dir)
    ... write out.path(".json"), out.path(".md") ...
    out.finish(a.publish, a.machine)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")


def machine_tag(gpu: bool = False) -> str:
    """The machine part of published file names: ``cpu<N>`` (usable cores), or with ``gpu`` the GPU
    model and count (``h200``, ``h100x4``), as the published files are named."""
    if gpu:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0).lower()
            kind = next((t for t in ("h200", "h100", "a100", "l40") if t in name), "gpu")
            n = torch.cuda.device_count()
            return kind if n == 1 else f"{kind}x{n}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return f"cpu{cores}"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for the machine line of a report."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def code_version(repo: str = REPO) -> dict[str, object]:
    """The commit a run measured and the files under tq/ that differed from it (a published figure
    names the code it is of); ``repo``: the checkout (default: this one)."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10).stdout.rstrip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    dirty = git("status", "--porcelain", "--", "tq")
    commit = git("rev-parse", "--short", "HEAD") or archived_commit(repo)
    return {"commit": commit, "tq_uncommitted": [ln[3:] for ln in dirty.splitlines()]}  # "XY path"


def archived_commit(repo: str) -> str:
    """The commit a tree exported with ``git archive`` was made from ("" if unknown): it writes it into
    benchmarks/TREE_COMMIT (``export-subst`` in .gitattributes), so a copy without .git - a baseline
    tree carried to another machine - still names its code."""
    try:
        with open(os.path.join(repo, "benchmarks", "TREE_COMMIT")) as f:
            text = f.read().strip()
    except OSError:
        return ""
    return text if re.fullmatch(r"[0-9a-f]{7,40}", text) else ""


def add_output_args(p: argparse.ArgumentParser, name: str) -> None:
    """``--run-dir``, ``--publish`` and ``--machine``, with help that names where files go."""
    g = p.add_argument_group("output")
    g.add_argument("--run-dir", default=None, help=f"directory for this run's files (default: a fresh logs/{name}/<timestamp>/)")
    g.add_argument(
        "--publish",
        action="store_true",
        help=f"also copy this run's files over the published benchmarks/results/{name}_<machine>.* "
        "(the files the README cites); without it nothing under benchmarks/results/ is written",
    )
    g.add_argument(
        "--machine",
        default=None,
        help="machine tag of the published file names (default: cpu<cores>, or with a GPU its model and count, e.g. h200, h100x4)",
    )


@dataclass
class RunOutput:
    """One run's output files: ``path(suffix)`` names ``<run_dir>/<name><suffix>`` and remembers it,
    ``finish`` publishes them (or not) and says where everything went."""

    name: str
    run_dir: str
    log: Callable[[str], None] = print
    written: list[str] = field(default_factory=list)

    def path(self, suffix: str) -> str:
        """Where this run's file ``<name><suffix>`` goes (e.g. ``.json``, ``.md``, ``_step_time.png``)."""
        p = os.path.join(self.run_dir, self.name + suffix)
        if p not in self.written:
            self.written.append(p)
        return p

    def write_report(self, res: dict[str, Any], lines: list[str]) -> None:
        """Write the run's results (``.json``) and its report (``.md``, also printed)."""
        with open(self.path(".json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(self.path(".md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        self.log("\n".join(lines))

    def finish(self, publish: bool, machine: str | None = None, *, gpu: bool = False, results_dir: str = RESULTS_DIR) -> list[str]:
        """With ``publish``, copy every file of this run that exists to ``<results_dir>/<name>_<machine><suffix>``
        (``machine`` defaults to :func:`machine_tag`); returns the published paths. Prints where the
        run's files are either way."""
        mine = [p for p in self.written if os.path.exists(p)]
        published: list[str] = []
        if publish:
            tag = machine or machine_tag(gpu)
            os.makedirs(results_dir, exist_ok=True)
            for p in mine:
                dst = os.path.join(results_dir, f"{self.name}_{tag}{os.path.basename(p)[len(self.name) :]}")
                shutil.copyfile(p, dst)
                published.append(dst)
        self.log(f"{self.name}: this run's files are in {self.run_dir}/ ({', '.join(os.path.basename(p) for p in mine)})")
        if published:
            self.log(f"{self.name}: published {', '.join(os.path.relpath(p, REPO) for p in published)}")
        elif mine:
            self.log(f"{self.name}: benchmarks/results/ untouched (--publish replaces the published files)")
        return published


def snapshot(directory: str = RESULTS_DIR) -> dict[str, tuple[int, int]]:
    """Every file under ``directory`` with its size and modification time (ns): equal before and after a
    run when the run left the published files alone."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            st = os.stat(os.path.join(root, name))
            out[os.path.relpath(os.path.join(root, name), directory)] = (st.st_size, st.st_mtime_ns)
    return out


def open_run(name: str, run_dir: str | None = None, *, log: Callable[[str], None] = print) -> RunOutput:
    """A run of benchmark ``name`` writing into ``run_dir`` (created), by default a fresh
    ``logs/<name>/<timestamp>/`` under the repository; refuses a directory inside benchmarks/results/,
    which only ``--publish`` writes."""
    if run_dir is None:
        base = os.path.join(REPO, "logs", name, time.strftime("%Y%m%d-%H%M%S"))
        run_dir, n = base, 1
        while os.path.exists(run_dir):  # two runs in the same second
            n += 1
            run_dir = f"{base}-{n}"
    run_dir = os.path.abspath(run_dir)
    if os.path.commonpath([run_dir, RESULTS_DIR]) == RESULTS_DIR:
        raise SystemExit(
            f"error: --run-dir {run_dir} is inside benchmarks/results/, which holds the published "
            "files only: pick another directory and pass --publish to replace them"
        )
    os.makedirs(run_dir, exist_ok=True)
    log(f"{name}: writing this run's files to {run_dir}/")
    return RunOutput(name, run_dir, log)
