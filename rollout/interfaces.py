"""The two small interfaces the rollout side is built on: generation backends and environments.

Backends (transformers ``generate``, vLLM) and environments (math, the built-in task, multi-turn
games) implement these ABCs; rollout code, actors and collectors depend only on them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

Message = dict[str, Any]  # {"role": "user" | "assistant" | "environment" | "system", "content": str, ...}


@dataclass
class GenerationOutput:
    """What a backend returns for a batch of prompts (one entry per prompt, in order).

    ``response_ids[i]`` are the generated token ids only (no prompt, no padding, EOS kept when
    produced); ``logprobs[i]`` holds the float32 log-probability the generating policy gave each of
    those tokens; ``finish_reasons[i]`` is ``"stop"`` (EOS or a stop string) or ``"length"``.
    ``weight_version`` is the version of the weights that produced the batch.
    """

    response_ids: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    finish_reasons: list[str]
    weight_version: int = 0


class GenerationInterface(ABC):
    """A generation backend: batched and async generation with per-token log-probs, and weight refit."""

    @abstractmethod
    def generate(
        self,
        prompts: Sequence[torch.Tensor],
        *,
        max_new_tokens: int,
        stop_strings: Sequence[Sequence[str] | None] | None = None,
        greedy: bool = False,
    ) -> GenerationOutput:
        """Generate one completion per prompt (``prompts[i]``: 1-d int64 token ids)."""

    async def generate_async(
        self,
        prompt: torch.Tensor,
        *,
        max_new_tokens: int,
        stop_strings: Sequence[str] | None = None,
        greedy: bool = False,
    ) -> GenerationOutput:
        """Generate one completion for one prompt without blocking the event loop (default: a thread)."""
        import asyncio

        return await asyncio.to_thread(
            self.generate,
            [prompt],
            max_new_tokens=max_new_tokens,
            stop_strings=[stop_strings] if stop_strings is not None else None,
            greedy=greedy,
        )

    def prepare_for_generation(self) -> None:
        """Bring the engine up to generate (e.g. wake a sleeping vLLM engine). Default: nothing."""

    def finish_generation(self) -> None:
        """Release what generation held (e.g. KV cache) before training. Default: nothing."""

    @abstractmethod
    def update_weights(self, state_dict: Mapping[str, torch.Tensor], weight_version: int) -> None:
        """Load new policy weights (refit) and record their version."""

    @property
    @abstractmethod
    def weight_version(self) -> int:
        """Version of the weights currently loaded."""


@dataclass
class EnvironmentReturn:
    """One environment step over a batch (one entry per conversation)."""

    observations: list[Message]  # appended to each message log ({"role": "environment", "content": ...})
    metadata: list[dict[str, Any]]  # per-conversation state carried to the next step
    next_stop_strings: list[list[str] | None]
    rewards: torch.Tensor  # float32 [n]
    terminateds: torch.Tensor  # bool [n]
    answers: list[str | None] = field(default_factory=list)  # the answer the environment extracted, if any


class EnvironmentInterface(ABC):
    """An environment: scores (and for multi-turn tasks, answers) a batch of conversations."""

    @abstractmethod
    def step(self, message_log_batch: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        """Take the latest assistant turn of each conversation; return observations and rewards."""

    def global_post_process_and_metrics(self, batch: Mapping[str, Any]) -> tuple[Mapping[str, Any], dict[str, float]]:
        """Post-process a finished rollout batch and report environment metrics. Default: no change."""
        return batch, {}
