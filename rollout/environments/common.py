"""Pieces every environment shares: reading the last assistant turn, and reward metrics."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from rollout.interfaces import Message


def last_assistant_content(message_log: Sequence[Message]) -> str:
    """Text of the last assistant message of a conversation ("" when there is none or it is not text)."""
    for message in reversed(message_log):
        if isinstance(message, Mapping) and message.get("role") == "assistant":
            content = message.get("content")
            return content if isinstance(content, str) else ""
    return ""


def ground_truth_of(metadata: Mapping[str, Any] | None) -> str | None:
    """``metadata["ground_truth"]`` as a string, or None when missing / not a scalar."""
    if not isinstance(metadata, Mapping):
        return None
    gt = metadata.get("ground_truth")
    if isinstance(gt, bool) or not isinstance(gt, (str, int, float)):
        return None
    return str(gt)


def reward_metrics(batch: Mapping[str, Any], *, zero_unended: bool = True) -> tuple[dict[str, Any], dict[str, float]]:
    """Post-process a finished batch of 0/1 rewards and report accuracy-style metrics.

    ``batch["rewards"]`` (per sample) is required. Optional keys:
    - ``is_end`` (bool, True when the response ended with a stop token/string) or ``truncated``
      (its negation): with ``zero_unended`` the rewards of samples that did not end properly are
      set to 0, as NeMo-RL's math environment does, so a correct prefix of a run-away response
      earns nothing; the fraction that ended is reported either way;
    - ``prompt_ids`` / ``group_ids`` (per sample): samples of one prompt, for ``pass@k``.
    Returns a shallow copy of ``batch`` with the adjusted ``rewards`` (float32 tensor) and the metrics.
    """
    if "rewards" not in batch:
        raise KeyError("the batch has no 'rewards'")
    rewards = torch.as_tensor(batch["rewards"], dtype=torch.float32).flatten().clone()
    out = dict(batch)
    metrics: dict[str, float] = {"num_samples": float(rewards.numel())}
    ended = None
    if "is_end" in batch:
        ended = torch.as_tensor(batch["is_end"], dtype=torch.bool).flatten()
    elif "truncated" in batch:
        ended = ~torch.as_tensor(batch["truncated"], dtype=torch.bool).flatten()
    if ended is not None:
        if ended.numel() != rewards.numel():
            raise ValueError(f"is_end/truncated has {ended.numel()} entries for {rewards.numel()} rewards")
        if zero_unended:
            rewards = rewards * ended
        metrics["fraction_of_samples_properly_ended"] = float(ended.float().mean()) if ended.numel() else 0.0
    out["rewards"] = rewards
    metrics["accuracy"] = float((rewards == 1.0).float().mean()) if rewards.numel() else 0.0
    metrics["mean_reward"] = float(rewards.mean()) if rewards.numel() else 0.0
    groups = batch.get("prompt_ids", batch.get("group_ids"))
    if groups is not None:
        groups = [g.item() if isinstance(g, torch.Tensor) else g for g in groups]
        if len(groups) != rewards.numel():
            raise ValueError(f"prompt_ids has {len(groups)} entries for {rewards.numel()} rewards")
        best: dict[Any, float] = {}
        for g, r in zip(groups, rewards.tolist()):
            best[g] = max(best.get(g, 0.0), r)
        metrics["pass_at_samples_per_prompt"] = sum(v == 1.0 for v in best.values()) / len(best) if best else 0.0
        metrics["num_problems"] = float(len(best))
    return out, metrics
