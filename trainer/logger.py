"""Run logging: a progress bar and a step line every ``logger.console_every`` steps on the console,
every step's metrics in JSONL, TensorBoard and wandb (when installed and enabled), and a PNG of the
reward and loss curves at the end of a run.

A metric whose name ends in ``_counts`` and whose value is a list of counts is a histogram over the
integers ``0..len-1`` (e.g. the async trainer's ``async/trajectory_age_counts``): the JSONL keeps the
list, TensorBoard gets a histogram."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .config import LoggerConfig

HISTOGRAM_SUFFIX = "_counts"


def _scalar(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def format_duration(seconds: float) -> str:
    """``M:SS`` or ``H:MM:SS``."""
    s = max(0, int(round(seconds)))
    h, rem = divmod(s, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


def read_metrics_lineage(path: Path, upto: int | None = None) -> list[dict[str, Any]]:
    """The train/val rows of ``metrics.jsonl`` that belong to the current lineage (a ``"resume"`` row at
    step ``k`` drops earlier rows past ``k``, a ``"start"`` row drops all), up to step ``upto``."""
    rows: list[dict[str, Any]] = []
    try:
        f = open(path)
    except FileNotFoundError:
        return rows
    with f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a torn last line of a killed run
                continue
            if row.get("split") in ("resume", "start"):
                rows = [r for r in rows if r["step"] <= int(row["step"])] if row["split"] == "resume" else []
            else:
                rows.append(row)
    return [r for r in rows if upto is None or r["step"] <= upto]


class MetricsLogger:
    """Writes every step's metrics to ``<log_dir>/<run>/metrics.jsonl`` (+ TensorBoard, wandb)."""

    def __init__(
        self, cfg: LoggerConfig, run_name: str, config_dump: Mapping[str, Any] | None = None, resume_step: int | None = None
    ) -> None:
        """``resume_step``: this run resumes a checkpoint of that step, in the same run directory: the
        history (and ``curves.png``) starts with the lineage's rows up to it, ``metrics.jsonl`` gets a
        ``"resume"`` row, after which rows of later steps replace those a dead run logged, and
        TensorBoard purges the dead run's events past it."""
        self.cfg = cfg
        self.run_dir = Path(cfg.log_dir) / run_name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = read_metrics_lineage(path, resume_step) if resume_step is not None else []
        had_rows = path.exists() and path.stat().st_size > 0
        self._jsonl = open(path, "a", buffering=1)
        if resume_step is not None:
            self._jsonl.write(json.dumps({"step": int(resume_step), "split": "resume", "time": time.time()}) + "\n")
        elif had_rows:  # the same run name started again from scratch: earlier rows are not this run's
            self._jsonl.write(json.dumps({"step": 0, "split": "start", "time": time.time()}) + "\n")
        self._tb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=None if resume_step is None else int(resume_step) + 1)
        self._wandb = None
        if cfg.wandb:
            try:
                import wandb
            except ImportError:
                print("logger.wandb is enabled but wandb is not installed (pip install wandb); skipping it", file=sys.stderr)
            else:
                self._wandb = wandb.init(project=cfg.wandb_project, name=run_name, config=dict(config_dump or {}))
        if config_dump is not None:
            (self.run_dir / "config.json").write_text(json.dumps(config_dump, indent=1, default=str))
        self._bar: Any = None
        self._clock: tuple[float, int] | None = None  # (start time, start step) of this process's steps

    def start(self, step: int, total: int) -> None:
        """Training starts (or resumes) at ``step`` of ``total``: the clock for elapsed / ETA starts, and
        the progress bar (tqdm, on stderr when it is a terminal) appears."""
        self._clock = (time.perf_counter(), step)
        if self.cfg.progress and self.cfg.progress_bar and total > step:
            from tqdm import tqdm

            # disable=None: no bar when stderr is not a terminal (a log file gets the step lines only)
            self._bar = tqdm(total=total, initial=step, unit="step", dynamic_ncols=True, disable=None, leave=False)

    def write(self, line: str) -> None:
        """A console line (through the bar, so it does not tear it)."""
        if self._bar is not None and not self._bar.disable:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def log(self, step: int, metrics: Mapping[str, Any], prefix: str = "train") -> None:
        """Record ``metrics`` (non-scalars are kept in the JSONL only) for ``step``."""
        row = {"step": step, "split": prefix, "time": time.time(), **{k: v for k, v in metrics.items()}}
        self.history.append(row)
        self._jsonl.write(json.dumps(row, default=lambda o: _scalar(o)) + "\n")
        scalars = {f"{prefix}/{k}": s for k, v in metrics.items() if (s := _scalar(v)) is not None}
        if self._tb is not None:
            for k, s in scalars.items():
                self._tb.add_scalar(k, s, step)
            for k, v in metrics.items():
                if k.endswith(HISTOGRAM_SUFFIX) and isinstance(v, (list, tuple)) and sum(v) > 0:
                    values = np.repeat(np.arange(len(v)), np.asarray(v, dtype=np.int64))
                    self._tb.add_histogram(f"{prefix}/{k.removesuffix(HISTOGRAM_SUFFIX)}", values, step, bins=np.arange(len(v) + 1) - 0.5)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def progress(self, step: int, total: int, metrics: Mapping[str, Any]) -> None:
        """Advance the bar; every ``logger.console_every`` steps (and the first and last) one line:
        reward, loss, step time, the timing breakdown, elapsed and ETA."""
        if not self.cfg.progress:
            return
        start_time, start_step = self._clock or (time.perf_counter(), step - 1)
        elapsed = time.perf_counter() - start_time
        done = step - start_step
        eta = elapsed / done * (total - step) if done > 0 else 0.0
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            if (r := _scalar(metrics.get("reward"))) is not None:
                self._bar.set_postfix(reward=f"{r:.3f}", refresh=False)
        if not (step % self.cfg.console_every == 0 or done == 1 or step == total):
            return
        parts = [f"step {step}/{total}"]
        for key, label in (("reward", "reward"), ("loss", "loss"), ("token_mult_prob_error", "mult_prob_err"), ("step_time_s", "time")):
            if (s := _scalar(metrics.get(key))) is not None:
                parts.append(f"{label} {s:.4f}" if label != "time" else f"{label} {s:.2f}s")
        # The step's phases only; the driver_*/worker_* breakdowns stay in metrics.jsonl and TensorBoard.
        timing = [
            f"{k.removeprefix('timing/')} {float(v):.2f}s"
            for k, v in metrics.items()
            if k.startswith("timing/") and not k.startswith(("timing/driver_", "timing/worker_"))
        ]
        if timing:
            parts.append("(" + ", ".join(timing) + ")")
        if (f := _scalar(metrics.get("dataplane/frac_of_step"))) is not None:
            parts.append(f"data plane {100 * f:.0f}% of step")
        parts.append(f"elapsed {format_duration(elapsed)}, ETA {format_duration(eta)}")
        self.write(" | ".join(parts))

    def plot(self) -> Path | None:
        """reward and loss against step, as ``curves.png`` in the run directory."""
        if not self.cfg.plot:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        train = [r for r in self.history if r["split"] == "train"]
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))

        def series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
            pts = [(r["step"], _scalar(r.get(key))) for r in rows]
            return [(st, v) for st, v in pts if v is not None]

        # Reward panel: the training reward, and validation accuracy when validation ran.
        if pts := series(train, "reward"):
            axes[0].plot(*zip(*pts), marker="o", markersize=3, label="mean training reward")
        if val := series([r for r in self.history if r["split"] == "val"], "accuracy"):
            axes[0].plot(*zip(*val), marker="s", label="validation accuracy")
        axes[0].set_ylabel("reward / accuracy")
        axes[0].set_title("reward")
        # Loss panel: the total and its two terms, so a rising KL term is not read as divergence.
        for key, label in (("loss", "total loss"), ("actor_loss", "policy-gradient term"), ("kl_loss", "KL term")):
            if (pts := series(train, key)) and (key == "loss" or any(v for _, v in pts)):
                axes[1].plot(*zip(*pts), marker="o" if key == "loss" else None, markersize=3, label=label)
        axes[1].set_ylabel("loss (per token)")
        axes[1].set_title("loss = policy-gradient term + KL term")
        for ax in axes:
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        fig.tight_layout()
        out = self.run_dir / "curves.png"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
