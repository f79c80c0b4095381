"""A synthetic generation backend: long token sequences at negligible compute, for benchmarks.

``SyntheticGenerationBackend`` implements :class:`~rollout.interfaces.GenerationInterface` without a
model: each response is a run of random (non-special) token ids whose length is drawn uniformly in
``[config.synthetic_min_new_tokens, max_new_tokens]`` (always ``max_new_tokens`` when the minimum is
unset), with a float32 log-prob per token. It lets a benchmark run both trainers end to end with long
sequences while generation costs (almost) nothing, so what is left of a step is data movement and the
policy's own passes. Select it with ``generation.backend: synthetic``.

- A response shorter than the call's ``max_new_tokens`` ends with a stop token (finish reason
  ``"stop"``); a full-length one has finish reason ``"length"``. Stop strings are not searched for.
- Log-probs are ``log(u)`` with ``u`` uniform in ``[1/V, 1)`` (``V`` the tokenizer's vocabulary
  size): negative, finite and of the same shape and dtype as a real backend's.
- Call ``k`` draws from ``call_seed(config.seed, k)`` (as the transformers backend does), so two
  backends with the same config and call sequence return the same tokens; ``greedy`` does not change
  the draw (there is no distribution to be greedy about).
- ``update_weights`` loads nothing: it records the version (and how many tensors it was given).
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from rollout.generation.common import CallSeeds, prepare_request, resolve_stop_token_ids
from rollout.generation.config import GenerationBackendConfig
from rollout.interfaces import GenerationInterface, GenerationOutput


class SyntheticGenerationBackend(GenerationInterface):
    """Random responses of configurable length, seeded, with no model (see the module docstring).

    Args:
        config: ``backend`` must be ``"synthetic"``; ``tokenizer_name`` / ``model_name`` name the
            tokenizer whose ids are emitted, ``seed`` seeds the draws, ``synthetic_min_new_tokens``
            sets the shortest response.
        tokenizer: an already loaded tokenizer (e.g. the rollout actor's) instead of loading one.
    """

    def __init__(self, config: GenerationBackendConfig | None = None, *, tokenizer: Any = None) -> None:
        self.config = config or GenerationBackendConfig(backend="synthetic")
        if self.config.backend != "synthetic":
            raise ValueError(f"SyntheticGenerationBackend needs backend='synthetic', got {self.config.backend!r}")
        if tokenizer is None:
            from common.models import load_tokenizer

            tokenizer = load_tokenizer(self.config.tokenizer_name or self.config.model_name)
        self.tokenizer = tokenizer
        self.stop_token_ids = resolve_stop_token_ids(tokenizer, None, self.config.stop_token_ids)
        special = set(int(t) for t in getattr(tokenizer, "all_special_ids", ()) or ()) | set(self.stop_token_ids)
        self.vocab_size = len(tokenizer)
        self._emittable = np.array([t for t in range(self.vocab_size) if t not in special], dtype=np.int64)
        if self._emittable.size == 0:
            raise ValueError("the tokenizer has no non-special token to emit")
        self._version = 0
        self.refits = 0
        self.last_refit_tensors = 0
        self._seeds = CallSeeds(self.config.seed)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ generation
    def response_lengths(self, rng: np.random.Generator, n: int, max_new_tokens: int) -> np.ndarray:
        """``n`` lengths, uniform in ``[min(synthetic_min_new_tokens, max_new_tokens), max_new_tokens]``."""
        lo = self.config.synthetic_min_new_tokens
        lo = max_new_tokens if lo is None else min(int(lo), max_new_tokens)
        return rng.integers(lo, max_new_tokens + 1, size=n, dtype=np.int64)

    def generate(
        self,
        prompts: Sequence[torch.Tensor],
        *,
        max_new_tokens: int,
        stop_strings: Sequence[Sequence[str] | None] | None = None,
        greedy: bool = False,
    ) -> GenerationOutput:
        """One random response per prompt (see the module docstring for lengths and log-probs)."""
        prompts, _stops, _greedy = prepare_request(prompts, stop_strings, max_new_tokens, greedy, self.config)
        with self._lock:
            seed = self._seeds.next()
            version = self._version
        n = len(prompts)
        if n == 0:
            return GenerationOutput(response_ids=[], logprobs=[], finish_reasons=[], weight_version=version)
        rng = np.random.default_rng(seed)
        lengths = self.response_lengths(rng, n, max_new_tokens)
        total = int(lengths.sum())
        ids = self._emittable[rng.integers(0, self._emittable.size, size=total)]
        # log(u), u uniform in [1/V, 1): a plausible log-prob of a sampled token, always finite and < 0.
        lps = np.log(rng.uniform(1.0 / self.vocab_size, 1.0, size=total)).astype(np.float32)
        stops = np.asarray(self.stop_token_ids, dtype=np.int64)
        ends = np.cumsum(lengths)
        short = lengths < max_new_tokens
        if short.any():  # a response that ends early ends with a stop token, as a real one would
            ids[ends[short] - 1] = stops[rng.integers(0, stops.size, size=int(short.sum()))]
        ids_t, lps_t = torch.from_numpy(ids), torch.from_numpy(lps)
        starts = ends - lengths
        return GenerationOutput(
            response_ids=[ids_t[s:e].clone() for s, e in zip(starts.tolist(), ends.tolist())],
            logprobs=[lps_t[s:e].clone() for s, e in zip(starts.tolist(), ends.tolist())],
            finish_reasons=["stop" if s else "length" for s in short.tolist()],
            weight_version=version,
        )

    # ------------------------------------------------------------------ weights and state
    def update_weights(self, state_dict: Mapping[str, torch.Tensor], weight_version: int) -> None:
        """Record ``weight_version`` (no model: nothing is loaded)."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"update_weights needs a mapping of tensors, got {type(state_dict).__name__}")
        with self._lock:
            self._version = int(weight_version)
            self.refits += 1
            self.last_refit_tensors = len(state_dict)

    @property
    def weight_version(self) -> int:
        """Version recorded by the last refit (0 before the first)."""
        return self._version

    def sampling_state(self) -> dict[str, int]:
        """The draw position (calls made), for checkpoints."""
        return {"seed": self._seeds.seed, "calls": self._seeds.calls}

    def load_sampling_state(self, state: Mapping[str, int]) -> None:
        """Resume the draws where :meth:`sampling_state` was taken."""
        self._seeds.seed, self._seeds.calls = int(state["seed"]), int(state["calls"])
