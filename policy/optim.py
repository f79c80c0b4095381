"""Optimizer and learning-rate schedule of the DP workers (AdamW; linear warmup, then constant or cosine)."""

from __future__ import annotations

import math
from functools import partial

import torch

from .config import PolicyConfig

__all__ = ["lr_factor", "build_optimizer", "build_scheduler"]


def lr_factor(step: int, *, warmup_steps: int, schedule: str, max_steps: int | None, min_lr_ratio: float) -> float:
    """Multiplier of the base learning rate for optimizer step ``step`` (0-based).

    Warmup rises linearly to 1 over ``warmup_steps`` steps, starting at ``1 / warmup_steps`` (never 0,
    so the first step learns); then 1 (``constant``) or a cosine decay to ``min_lr_ratio`` at ``max_steps``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    assert max_steps is not None
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: PolicyConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.learning_rate, betas=cfg.adam_betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: PolicyConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR applying :func:`lr_factor` (stepped once per optimizer step)."""
    fn = partial(lr_factor, warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule, max_steps=cfg.max_steps, min_lr_ratio=cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
