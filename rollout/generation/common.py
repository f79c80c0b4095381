"""Helpers both generation backends share: argument checks, stop tokens, per-call seeds."""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np
import torch

from common.models import IM_END


def check_prompts(prompts: Sequence[torch.Tensor], max_new_tokens: int) -> list[torch.Tensor]:
    """Validate a batch of prompts (1-d integer token ids, non-empty) and return them as CPU int64."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    out = []
    for i, p in enumerate(prompts):
        if not isinstance(p, torch.Tensor):
            p = torch.as_tensor(p)
        if p.dim() != 1 or p.numel() == 0:
            raise ValueError(f"prompt {i} must be a non-empty 1-d tensor of token ids, got shape {tuple(p.shape)}")
        if p.dtype.is_floating_point or p.dtype == torch.bool:
            raise ValueError(f"prompt {i} must hold integer token ids, got dtype {p.dtype}")
        out.append(p.to(device="cpu", dtype=torch.int64))
    return out


def merge_stop_strings(n: int, per_prompt: Sequence[Sequence[str] | None] | None, global_stops: Sequence[str] | None) -> list[list[str]]:
    """One list of stop strings per prompt: the config-wide ones plus that prompt's own."""
    if per_prompt is not None and len(per_prompt) != n:
        raise ValueError(f"stop_strings has {len(per_prompt)} entries for {n} prompts")
    merged = []
    for i in range(n):
        stops = list(global_stops or [])
        if per_prompt is not None and per_prompt[i]:
            stops += [s for s in per_prompt[i] if s not in stops]
        if any(not isinstance(s, str) or s == "" for s in stops):
            raise ValueError(f"stop strings of prompt {i} must be non-empty strings, got {stops!r}")
        merged.append(stops)
    return merged


def resolve_stop_token_ids(tokenizer: Any, model_eos: int | list[int] | None, configured: list[int] | None) -> list[int]:
    """The token ids that end a response.

    Explicit ``configured`` ids win. Otherwise: the tokenizer's EOS, the model's generation-config
    EOS ids, and ChatML's ``<|im_end|>`` when the tokenizer has it as a token - a chat-formatted
    assistant turn ends with ``<|im_end|>``, and multi-turn rollouts rely on the turn ending there.
    """
    if configured is not None:
        if not configured:
            raise ValueError("stop_token_ids must not be empty (leave it None for the defaults)")
        return sorted(set(int(t) for t in configured))
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model_eos is not None:
        ids.update(int(t) for t in (model_eos if isinstance(model_eos, (list, tuple)) else [model_eos]))
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    if not ids:
        raise ValueError("the tokenizer has no EOS token and no stop_token_ids were configured")
    return sorted(ids)


def call_seed(seed: int, call_index: int) -> int:
    """A well-mixed 63-bit seed for the ``call_index``-th generate call of a backend seeded ``seed``.

    Mixing (rather than ``seed + call_index``) keeps backends with nearby seeds from replaying each
    other's streams one call apart.
    """
    state = np.random.SeedSequence([seed & 0xFFFFFFFF, call_index]).generate_state(1, dtype=np.uint64)
    return int(state[0] >> np.uint64(1))  # torch.manual_seed takes at most 2**63 - 1


class CallSeeds:
    """Thread-safe source of per-call seeds: the ``k``-th ``next()`` returns ``call_seed(seed, k)``."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.calls = 0
        self._lock = threading.Lock()

    def next(self) -> int:
        """The seed of the next call (advances the counter)."""
        with self._lock:
            k = self.calls
            self.calls += 1
        return call_seed(self.seed, k)


def prepare_request(
    prompts: Sequence[torch.Tensor],
    stop_strings: Sequence[Sequence[str] | None] | None,
    max_new_tokens: int,
    greedy: bool,
    config: Any,
) -> tuple[list[torch.Tensor], list[list[str]], bool]:
    """Checked prompts, per-prompt stop strings (config-wide ones merged in) and the effective greedy
    flag (``temperature == 0`` in the config means greedy) of one generate call."""
    checked = check_prompts(prompts, max_new_tokens)
    stops = merge_stop_strings(len(checked), stop_strings, config.stop_strings)
    return checked, stops, greedy or config.temperature == 0.0
