"""Run logging: a live progress line per step, JSONL metrics, TensorBoard, wandb (when installed and
enabled) and a PNG of the reward and loss curves at the end of a run."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from .config import LoggerConfig


def _scalar(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


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

    def __init__(self, cfg: LoggerConfig, run_name: str, config_dump: Mapping[str, Any] | None = None,
                 resume_step: int | None = None) -> None:
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

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"),
                                     purge_step=None if resume_step is None else int(resume_step) + 1)
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

    def log(self, step: int, metrics: Mapping[str, Any], prefix: str = "train") -> None:
        """Record ``metrics`` (non-scalars are kept in the JSONL only) for ``step``."""
        row = {"step": step, "split": prefix, "time": time.time(), **{k: v for k, v in metrics.items()}}
        self.history.append(row)
        self._jsonl.write(json.dumps(row, default=lambda o: _scalar(o)) + "\n")
        scalars = {f"{prefix}/{k}": s for k, v in metrics.items() if (s := _scalar(v)) is not None}
        if self._tb is not None:
            for k, s in scalars.items():
                self._tb.add_scalar(k, s, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def progress(self, step: int, total: int, metrics: Mapping[str, Any]) -> None:
        """One live line per step: reward, loss, step time and the timing breakdown."""
        if not self.cfg.progress:
            return
        parts = [f"step {step}/{total}"]
        for key, label in (("reward", "reward"), ("loss", "loss"), ("token_mult_prob_error", "mult_prob_err"), ("step_time_s", "time")):
            if (s := _scalar(metrics.get(key))) is not None:
                parts.append(f"{label} {s:.4f}" if label != "time" else f"{label} {s:.2f}s")
        # The step's phases only; the driver_*/worker_* breakdowns stay in metrics.jsonl and TensorBoard.
        timing = [f"{k.removeprefix('timing/')} {float(v):.2f}s" for k, v in metrics.items()
                  if k.startswith("timing/") and not k.startswith(("timing/driver_", "timing/worker_"))]
        if timing:
            parts.append("(" + ", ".join(timing) + ")")
        print(" | ".join(parts), flush=True)

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
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
