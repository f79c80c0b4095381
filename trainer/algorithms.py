"""GRPO's per-sample algorithm pieces, pure functions of per-sample tensors (no I/O).

Both trainers call these on the driver with per-sample scalars only (rewards, lengths, truncation
flags, prompt ids), so the TQ path never needs per-token data on the driver.
"""

from __future__ import annotations

import torch


def calculate_baseline_and_std_per_prompt(
    prompt_ids: torch.Tensor, rewards: torch.Tensor, valid_mask: torch.Tensor, *, leave_one_out: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline and the reward std of the sample's prompt group.

    Groups are samples sharing ``prompt_ids``; only ``valid_mask`` samples count. The baseline is the
    group mean, or with ``leave_one_out`` the mean of the *other* valid members (0 when there are
    none). The std is the unbiased std of the group's valid rewards (0 for groups of fewer than 2).
    """
    if not (prompt_ids.shape == rewards.shape == valid_mask.shape) or rewards.dim() != 1:
        raise ValueError("prompt_ids, rewards and valid_mask must be 1-d tensors of one length")
    rewards = rewards.to(torch.float32)
    valid = valid_mask.to(torch.float32)
    _, group = torch.unique(prompt_ids, return_inverse=True)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    count = torch.zeros(n_groups).index_add_(0, group, valid)
    total = torch.zeros(n_groups).index_add_(0, group, rewards * valid)
    sq = torch.zeros(n_groups).index_add_(0, group, rewards * rewards * valid)
    c, s, q = count[group], total[group], sq[group]
    if leave_one_out:
        others = c - valid
        baseline = torch.where(others > 0, (s - rewards * valid) / others.clamp(min=1), torch.zeros_like(s))
    else:
        baseline = s / c.clamp(min=1)
    mean = s / c.clamp(min=1)
    var = (q - c * mean * mean) / (c - 1).clamp(min=1)
    std = torch.where(c > 1, var.clamp(min=0).sqrt(), torch.zeros_like(var))
    return baseline, std


def compute_advantages(
    rewards: torch.Tensor,
    baseline: torch.Tensor,
    std: torch.Tensor,
    *,
    normalize_by_std: bool,
    clip: float | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """``rewards - baseline``, divided by ``std + eps`` when normalizing (samples of zero-std groups
    get advantage 0 either way), optionally clipped to ``[-clip, clip]``."""
    adv = rewards.to(torch.float32) - baseline
    if normalize_by_std:
        adv = torch.where(std > 0, adv / (std + eps), torch.zeros_like(adv))
    if clip is not None:
        if clip <= 0:
            raise ValueError(f"advantage clip must be > 0, got {clip}")
        adv = adv.clamp(-clip, clip)
    return adv


def scale_rewards(rewards: torch.Tensor, *, source_min: float, source_max: float, target_min: float, target_max: float) -> torch.Tensor:
    """Map rewards linearly from ``[source_min, source_max]`` to ``[target_min, target_max]`` (clamped)."""
    if source_max <= source_min:
        raise ValueError(f"reward scaling needs source_max > source_min, got [{source_min}, {source_max}]")
    r = rewards.to(torch.float32).clamp(source_min, source_max)
    return target_min + (r - source_min) * (target_max - target_min) / (source_max - source_min)


def overlong_reward_shaping(
    rewards: torch.Tensor, response_lengths: torch.Tensor, *, max_response_length: int, buffer_length: int, penalty: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment: responses longer than ``max_response_length - buffer_length``
    lose up to ``penalty`` linearly over the buffer (the full penalty at or beyond the maximum)."""
    if buffer_length <= 0 or buffer_length > max_response_length:
        raise ValueError(f"overlong buffer_length must be in (0, {max_response_length}], got {buffer_length}")
    start = max_response_length - buffer_length
    over = (response_lengths.to(torch.float32) - start).clamp(0, buffer_length)
    return rewards.to(torch.float32) - penalty * over / buffer_length


def dynamic_sampling_keep(std: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: keep only samples of groups whose rewards differ (std > 0)."""
    return std > 0


def seq_logprob_error_mask(seq_logprob_error: torch.Tensor, threshold: float | None) -> torch.Tensor:
    """1.0 for samples whose mean |prev_logprobs - generation_logprobs| is within ``threshold``, else 0
    (no masking when ``threshold`` is None)."""
    if threshold is None:
        return torch.ones_like(seq_logprob_error, dtype=torch.float32)
    return (seq_logprob_error <= threshold).to(torch.float32)


def pass_at_k(correct: torch.Tensor, prompt_ids: torch.Tensor, k: int) -> float:
    """Unbiased pass@k averaged over prompts: ``1 - C(n - c, k) / C(n, k)`` with n samples, c correct."""
    scores = []
    for pid in torch.unique(prompt_ids).tolist():
        sel = correct[prompt_ids == pid].to(torch.bool)
        n, c = int(sel.numel()), int(sel.sum())
        if n < k:
            raise ValueError(f"pass@{k} needs at least {k} samples per prompt; prompt {pid} has {n}")
        if n - c < k:
            scores.append(1.0)
            continue
        prob_all_wrong = 1.0
        for i in range(k):
            prob_all_wrong *= (n - c - i) / (n - i)
        scores.append(1.0 - prob_all_wrong)
    return float(sum(scores) / max(len(scores), 1))
