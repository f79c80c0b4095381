"""Asynchronous group rollouts: every completion of a prompt in flight at once, on ``generate_async``.

``AsyncRolloutImpl.run_rollout(sample)`` rolls one prompt out ``num_generations_per_prompt`` times
concurrently (asyncio) and returns a ``PromptGroupRecord`` of ``Completion``s. ``RolloutManager``
adds many prompts at a time (``max_concurrent_groups``), a blocking entry point for code without
an event loop, and aggregated rollout metrics. A backend whose ``generate_async`` really overlaps
requests (vLLM's async engine, a ``RayGenerationPool`` of several workers) then serves several
completions together; one that serialises them (transformers) still works, one request at a time.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from .builders import resolve_environments, resolve_generation, resolve_tokenizer
from .interfaces import EnvironmentInterface, GenerationOutput
from .multi_turn import (
    Completion,
    GenerationStats,
    RolloutLimits,
    postprocess_rewards,
    run_conversation_async,
    summarize_completions,
    validate_records,
)


@dataclass
class PromptGroupRecord:
    """The completions of one prompt (a GRPO group), in generation order.

    ``uid`` names this group (keys are ``"{uid}_g{i}"``); ``prompt_id`` is the prompt's stable id
    (its dataset ``idx``), shared by every group ever made from that prompt.
    """

    uid: str
    prompt_id: int
    task_name: str
    extra_env_info: dict[str, Any]
    completions: list[Completion]
    env_metrics: dict[str, float] = field(default_factory=dict)
    generation: GenerationStats = field(default_factory=GenerationStats)
    seconds: float = 0.0

    @property
    def keys(self) -> list[str]:
        """``"{uid}_g{i}"`` for each completion."""
        return [f"{self.uid}_g{i}" for i in range(len(self.completions))]

    @property
    def rewards(self) -> torch.Tensor:
        """Total reward of each completion (float32 ``[group_size]``)."""
        return torch.tensor([c.reward for c in self.completions], dtype=torch.float32)

    @property
    def policy_version(self) -> int:
        """The oldest weight version that generated any token of the group (its staleness reference)."""
        return min(c.weight_version for c in self.completions)

    @property
    def dialog_turns(self) -> int:
        """Assistant turns in the group; a conversation that could not generate counts as one, so
        unusable prompts still count towards a collector's batch."""
        return sum(max(1, c.num_turns) for c in self.completions)


def aggregate_rollout_metrics(groups: Sequence[PromptGroupRecord], wall_seconds: float | None = None) -> dict[str, float]:
    """Rollout metrics over groups: ``summarize_completions`` of every completion, environment metrics
    (sample-weighted means over groups), generation counts and throughput."""
    completions = [c for g in groups for c in g.completions]
    metrics = summarize_completions(completions)
    metrics["num_groups"] = float(len(groups))
    env_sum: dict[str, float] = {}
    env_weight: dict[str, int] = {}
    stats = GenerationStats()
    for g in groups:
        stats.merge(g.generation)
        for k, v in g.env_metrics.items():
            env_sum[k] = env_sum.get(k, 0.0) + v * len(g.completions)
            env_weight[k] = env_weight.get(k, 0) + len(g.completions)
    metrics.update({k: env_sum[k] / env_weight[k] for k in env_sum})
    metrics.update({f"generation/{k}": v for k, v in stats.metrics(wall_seconds).items()})
    if wall_seconds is not None:
        metrics["rollout_seconds"] = wall_seconds
        metrics["samples_per_s"] = len(completions) / wall_seconds if wall_seconds > 0 else 0.0
    return metrics


class AsyncRolloutImpl:
    """Concurrent multi-turn rollouts of one prompt's group.

    Args:
        generation: a backend, a backend config (built here), or generation actor handle(s).
        tokenizer: a tokenizer or its name (default: the one the generation config names).
        environments: task name -> environment (or name / ``{"name", **kwargs}``).
        limits: a ``RolloutLimits`` or its fields.
        num_generations_per_prompt: completions per prompt (the group size).
    """

    def __init__(
        self,
        *,
        generation: Any = None,
        tokenizer: Any = None,
        environments: Mapping[str, EnvironmentInterface | str | Mapping[str, Any]],
        limits: RolloutLimits | Mapping[str, Any],
        num_generations_per_prompt: int = 1,
        seed: int | None = None,
    ) -> None:
        if (
            isinstance(num_generations_per_prompt, bool)
            or not isinstance(num_generations_per_prompt, int)
            or num_generations_per_prompt < 1
        ):
            raise ValueError(f"num_generations_per_prompt must be an int >= 1, got {num_generations_per_prompt!r}")
        self.tokenizer = resolve_tokenizer(tokenizer, generation)
        self.generation, self.owns_generation = resolve_generation(generation, tokenizer=self.tokenizer, seed=seed)
        self.task_to_env = resolve_environments(environments)
        self.limits = limits if isinstance(limits, RolloutLimits) else RolloutLimits(**limits)
        self.num_generations_per_prompt = num_generations_per_prompt
        self.in_flight = 0  # generate requests awaiting the backend right now
        self.max_in_flight = 0  # the most there ever were at once

    async def _generate(self, prompt: torch.Tensor, **kwargs: Any) -> GenerationOutput:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self.generation.generate_async(prompt, **kwargs)
        finally:
            self.in_flight -= 1

    async def run_rollout(
        self, sample: Mapping[str, Any], *, uid: str | None = None, prompt_id: int | None = None, greedy: bool | None = None
    ) -> PromptGroupRecord:
        """Roll ``sample`` (a ``DatumSpec``) out ``num_generations_per_prompt`` times concurrently.

        ``uid`` defaults to ``str(sample["idx"])`` and ``prompt_id`` to ``sample["idx"]`` (0 without
        one). Rewards go through the environment's post-processing hook with the whole group.
        """
        validate_records([sample], self.task_to_env)
        idx = sample.get("idx")
        idx = idx.item() if isinstance(idx, torch.Tensor) else idx
        prompt_id = int(prompt_id if prompt_id is not None else (idx if isinstance(idx, int) else 0))
        uid = str(uid if uid is not None else (idx if idx is not None else prompt_id))
        env = self.task_to_env[sample["task_name"]]
        stats = GenerationStats(weight_version=self.generation.weight_version)
        t0 = time.perf_counter()
        records = await asyncio.gather(
            *(
                run_conversation_async(
                    self._generate,
                    self.tokenizer,
                    sample,
                    env,
                    self.limits,
                    weight_version=self.generation.weight_version,
                    greedy=greedy,
                    stats=stats,
                )
                for _ in range(self.num_generations_per_prompt)
            )
        )
        env_metrics = postprocess_rewards(records, self.task_to_env, [prompt_id] * len(records))
        return PromptGroupRecord(
            uid=uid,
            prompt_id=prompt_id,
            task_name=sample["task_name"],
            extra_env_info=dict(sample.get("extra_env_info") or {}),
            completions=[Completion.from_record(r) for r in records],
            env_metrics=env_metrics,
            generation=stats,
            seconds=time.perf_counter() - t0,
        )


class RolloutManager(AsyncRolloutImpl):
    """``AsyncRolloutImpl`` over many prompts: up to ``max_concurrent_groups`` groups in flight."""

    def __init__(self, *, max_concurrent_groups: int = 4, **kwargs: Any) -> None:  # noqa: D107 - see class
        super().__init__(**kwargs)
        if max_concurrent_groups < 1:
            raise ValueError(f"max_concurrent_groups must be >= 1, got {max_concurrent_groups}")
        self.max_concurrent_groups = max_concurrent_groups

    async def run_rollouts_async(
        self, samples: Sequence[Mapping[str, Any]], *, uids: Sequence[str] | None = None, greedy: bool | None = None
    ) -> list[PromptGroupRecord]:
        """One group per sample (in sample order), ``max_concurrent_groups`` at a time."""
        if uids is not None and len(uids) != len(samples):
            raise ValueError(f"{len(uids)} uids for {len(samples)} samples")
        validate_records(samples, self.task_to_env)  # fail before anything runs, naming the record
        gate = asyncio.Semaphore(self.max_concurrent_groups)

        async def one(k: int) -> PromptGroupRecord:
            async with gate:
                return await self.run_rollout(samples[k], uid=None if uids is None else uids[k], greedy=greedy)

        return list(await asyncio.gather(*(one(k) for k in range(len(samples)))))

    def run_rollouts(
        self, samples: Sequence[Mapping[str, Any]], *, uids: Sequence[str] | None = None, greedy: bool | None = None
    ) -> tuple[list[PromptGroupRecord], dict[str, float]]:
        """Blocking ``run_rollouts_async`` (from code without a running event loop) plus aggregated metrics."""
        t0 = time.perf_counter()
        groups = asyncio.run(self.run_rollouts_async(samples, uids=uids, greedy=greedy))
        metrics = aggregate_rollout_metrics(groups, time.perf_counter() - t0)
        metrics["max_requests_in_flight"] = float(self.max_in_flight)
        return groups, metrics
