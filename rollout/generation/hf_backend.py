"""The transformers backend: ``model.generate`` on CPU or GPU, with per-token log-probs and refit.

Log-probs: each response token carries the float32 log-probability of the distribution it was drawn
from. With ``logprobs_mode="processed"`` (default) that is the distribution after the sampler's
processing - temperature ``T`` (``log_softmax(logits / T)``), then top-k and top-p filtering with
renormalisation - which is what vLLM reports with ``logprobs_mode="processed_logprobs"``. With
``"raw"`` it is ``log_softmax(logits)`` of the unprocessed model output (vLLM's ``raw_logprobs``).
Greedy decoding processes nothing, so its log-probs are those of the raw distribution.

The log-probs are recorded by a logits processor placed where the sampler reads the scores, so they
are exactly the numbers the sampler used, computed in float32, and only one ``[batch, vocab]`` step
is held at a time (``output_scores=True`` would keep ``[steps, batch, vocab]`` alive).
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from common.models import load_model, load_tokenizer
from rollout.generation.common import CallSeeds, prepare_request, resolve_stop_token_ids
from rollout.generation.config import GenerationBackendConfig
from rollout.interfaces import GenerationInterface, GenerationOutput

# Extra tokens decoded beyond the longest stop string when looking for it: tokens are at least one
# character except special/byte-fallback tokens, which this slack covers.
_STOP_WINDOW_SLACK = 8


class _LogprobRecorder(LogitsProcessor):
    """Records ``log_softmax(scores)`` of the token that was picked at each step (float32).

    The token picked from step ``t``'s scores is only known at step ``t + 1`` (as the last column of
    ``input_ids``), so one step's log-softmax is kept pending; ``finish`` resolves the last one.
    """

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []
        self._pending: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._pending is not None:
            self.steps.append(self._pending.gather(1, input_ids[:, -1:]).squeeze(1))
        self._pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """``[batch, n_generated]`` log-probs of ``generated`` (the new tokens of every row)."""
        n = generated.shape[1]
        if len(self.steps) < n and self._pending is not None:
            self.steps.append(self._pending.gather(1, generated[:, len(self.steps)].unsqueeze(1)).squeeze(1))
        self._pending = None
        if n == 0:
            return torch.zeros(generated.shape[0], 0)
        # generate() may have run (and then undone) extra steps; keep the ones that produced tokens.
        return torch.stack(self.steps[:n], dim=1)


class _PerRowStopStrings(StoppingCriteria):
    """Stops each row when its decoded response contains one of that row's stop strings."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: list[list[str]], prompt_len: int) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.prompt_len = prompt_len
        self.window = max((len(s) for row in stops for s in row), default=0) + _STOP_WINDOW_SLACK

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        gen = input_ids[:, self.prompt_len :]
        for i, stops in enumerate(self.stops):
            if stops:
                tail = self.tokenizer.decode(gen[i, -self.window :].tolist(), skip_special_tokens=True)
                done[i] = any(s in tail for s in stops)
        return done


def first_stop_string_end(tokenizer: PreTrainedTokenizerBase, tokens: list[int], stops: list[str]) -> int | None:
    """Number of tokens up to and including the one that completes the first stop string, or None.

    Matches the check ``_PerRowStopStrings`` runs at every step (same decode window), so the cut is
    the step at which generation stopped for that row.
    """
    if not stops:
        return None
    window = max(len(s) for s in stops) + _STOP_WINDOW_SLACK
    for t in range(len(tokens)):
        tail = tokenizer.decode(tokens[max(0, t + 1 - window) : t + 1], skip_special_tokens=True)
        if any(s in tail for s in stops):
            return t + 1
    return None


class HFGenerationBackend(GenerationInterface):
    """Batched generation with transformers ``generate`` (left padding), seeded, with refit.

    ``model`` / ``tokenizer`` may be passed in (e.g. colocated with a policy worker: the backend then
    shares the policy's module, and ``update_weights`` with the same tensors costs nothing);
    otherwise they are loaded from ``config.model_name``.

    Reproducibility: call ``k`` of a backend samples with ``call_seed(config.seed, k)`` inside a
    forked RNG (the process-global RNG is left untouched), so two backends with the same config,
    weights and call sequence produce the same tokens. Concurrent calls (``generate_async``) are
    serialised by a lock; their order then decides which call gets which seed.
    """

    def __init__(
        self,
        config: GenerationBackendConfig | None = None,
        *,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        self.config = config or GenerationBackendConfig()
        if self.config.backend != "hf":
            raise ValueError(f"HFGenerationBackend needs backend='hf', got {self.config.backend!r}")
        self.tokenizer = tokenizer or load_tokenizer(self.config.tokenizer_name or self.config.model_name)
        if self.tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token (load it with common.models.load_tokenizer)")
        self.model = model or load_model(
            self.config.model_name,
            dtype=self.config.dtype,
            device=self.config.device,
            seed=self.config.model_seed,
            tokenizer=self.tokenizer,
            tiny_overrides=self.config.tiny_overrides,
        )
        self.device = next(self.model.parameters()).device
        self.stop_token_ids = resolve_stop_token_ids(self.tokenizer, self.model.generation_config.eos_token_id, self.config.stop_token_ids)
        # generate() fills every knob a call leaves unset from model.generation_config, and
        # checkpoints ship sampling defaults (top_k, temperature, min_p, repetition_penalty...) that
        # would then act after the log-prob recorder. A neutral one makes this config the only source.
        self.model.generation_config = GenerationConfig(
            bos_token_id=self.model.generation_config.bos_token_id,
            eos_token_id=self.stop_token_ids,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        self._version = 0
        self._seeds = CallSeeds(self.config.seed)
        self._lock = threading.Lock()  # one generate / refit at a time (shared model, shared RNG fork)

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Sequence[torch.Tensor],
        *,
        max_new_tokens: int,
        stop_strings: Sequence[Sequence[str] | None] | None = None,
        greedy: bool = False,
    ) -> GenerationOutput:
        """Generate one completion per prompt; see the module docstring for what the log-probs are."""
        prompts, stops, greedy = prepare_request(prompts, stop_strings, max_new_tokens, greedy, self.config)
        out = GenerationOutput(response_ids=[], logprobs=[], finish_reasons=[])
        if not prompts:
            out.weight_version = self._version
            return out
        with self._lock:
            seed = self._seeds.next()
            step = self.config.max_batch_size or len(prompts)
            fork_devices = [self.device] if self.device.type == "cuda" else []
            # Eval mode only for the call: a colocated policy shares this module and trains in between.
            was_training = self.model.training
            self.model.eval()
            try:
                with torch.random.fork_rng(devices=fork_devices), torch.inference_mode():
                    torch.manual_seed(seed)
                    for lo in range(0, len(prompts), step):
                        ids, lps, reasons = self._generate_chunk(prompts[lo : lo + step], stops[lo : lo + step], max_new_tokens, greedy)
                        out.response_ids += ids
                        out.logprobs += lps
                        out.finish_reasons += reasons
            finally:
                self.model.train(was_training)
            out.weight_version = self._version
        return out

    def _processors(self, greedy: bool) -> tuple[LogitsProcessorList, _LogprobRecorder]:
        """The sampler's logits processors, with the log-prob recorder where ``logprobs_mode`` says.

        Temperature / top-k / top-p are passed here rather than through ``GenerationConfig``: there,
        transformers appends them after user processors, so a recorder could not see their output.
        """
        recorder = _LogprobRecorder()
        warpers: list[LogitsProcessor] = []
        if not greedy:
            cfg = self.config
            if cfg.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(cfg.temperature))
            if cfg.top_k > 0:
                warpers.append(TopKLogitsWarper(top_k=cfg.top_k))
            if cfg.top_p < 1.0:
                warpers.append(TopPLogitsWarper(top_p=cfg.top_p))
        chain = [recorder, *warpers] if self.config.logprobs_mode == "raw" else [*warpers, recorder]
        return LogitsProcessorList(chain), recorder

    def _generation_config(self, max_new_tokens: int, greedy: bool) -> GenerationConfig:
        # Every sampling knob is set explicitly: generate() fills unset ones from the model's own
        # generation_config (a checkpoint's temperature / top_k / repetition_penalty) and from global
        # defaults (top_k=50), which would silently change the distribution after the recorder.
        # (Greedy leaves the warper knobs unset: transformers ignores them then, and warns if set.)
        sampling = {} if greedy else dict(temperature=1.0, top_k=0, top_p=1.0, typical_p=1.0)
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=not greedy,
            num_beams=1,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            eos_token_id=self.stop_token_ids,
            pad_token_id=self.tokenizer.pad_token_id,
            use_cache=True,
            return_dict_in_generate=False,
            output_scores=False,
            **sampling,
        )

    def _generate_chunk(
        self, prompts: list[torch.Tensor], stops: list[list[str]], max_new_tokens: int, greedy: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[str]]:
        pad = self.tokenizer.pad_token_id
        width = max(p.numel() for p in prompts)
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.int64)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.int64)
        for i, p in enumerate(prompts):  # left padding: every row's last prompt token is at width - 1
            input_ids[i, width - p.numel() :] = p
            attention_mask[i, width - p.numel() :] = 1
        processors, recorder = self._processors(greedy)
        criteria = StoppingCriteriaList()
        if any(stops):
            criteria.append(_PerRowStopStrings(self.tokenizer, stops, width))
        sequences = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            generation_config=self._generation_config(max_new_tokens, greedy),
            logits_processor=processors,
            stopping_criteria=criteria,
        )
        generated = sequences[:, width:].cpu()
        logprobs = recorder.finish(generated.to(self.device)).float().cpu()

        stop_ids = torch.tensor(self.stop_token_ids)
        ids_out, lps_out, reasons = [], [], []
        for i in range(len(prompts)):
            row = generated[i]
            # Rows that finished early are padded with pad tokens; the cut is decided from the real
            # tokens (first stop token, first completed stop string), never from the pad value,
            # which a model may legitimately sample.
            cut, reason = row.numel(), "length"
            eos_hits = torch.isin(row, stop_ids).nonzero()
            if eos_hits.numel():
                cut, reason = int(eos_hits[0]) + 1, "stop"
            string_cut = first_stop_string_end(self.tokenizer, row[:cut].tolist(), stops[i])
            if string_cut is not None:
                cut, reason = string_cut, "stop"
            if reason == "length" and cut < max_new_tokens:
                raise RuntimeError(  # generate() stopped a row for a reason this backend did not ask for
                    f"row {i} stopped after {cut} < {max_new_tokens} tokens without a stop token or string"
                )
            ids_out.append(row[:cut].clone())
            lps_out.append(logprobs[i, :cut].clone())
            reasons.append(reason)
        return ids_out, lps_out, reasons

    # ------------------------------------------------------------------ weights
    def sampling_state(self) -> dict[str, int]:
        """The sampling RNG position (calls made), for checkpoints: a restored backend draws the same."""
        return {"seed": self._seeds.seed, "calls": self._seeds.calls}

    def load_sampling_state(self, state: Mapping[str, int]) -> None:
        """Resume sampling where :meth:`sampling_state` was taken."""
        self._seeds.seed, self._seeds.calls = int(state["seed"]), int(state["calls"])

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], weight_version: int) -> None:
        """Copy ``state_dict`` into the model in place (refit) and record ``weight_version``.

        Every parameter must be covered (tied weights count as covered through their alias): a
        partial refit would silently keep generating with stale weights. Unknown names and shape
        mismatches raise. Dtype and device are converted on copy.
        """
        targets = dict(self.model.state_dict(keep_vars=True))
        targets.update(dict(self.model.named_parameters(remove_duplicate=False)))
        unknown = [k for k in state_dict if k not in targets]
        if unknown:
            raise KeyError(f"update_weights: {len(unknown)} names not in the model, e.g. {unknown[:3]}")
        covered: set[int] = set()
        for name, value in state_dict.items():  # validate everything before touching the model
            dst = targets[name]
            if tuple(dst.shape) != tuple(value.shape):
                raise ValueError(f"update_weights: {name} has shape {tuple(value.shape)}, model has {tuple(dst.shape)}")
            covered.add(dst.data_ptr())
        missing = [n for n, p in self.model.named_parameters() if p.data_ptr() not in covered]
        if missing:
            raise KeyError(f"update_weights: {len(missing)} parameters missing from the state dict, e.g. {missing[:3]}")
        with self._lock, torch.no_grad():
            for name, value in state_dict.items():
                dst = targets[name]
                if dst.data_ptr() != value.data_ptr():  # colocated: the policy's own tensor, nothing to copy
                    dst.copy_(value)
            self._version = int(weight_version)

    @property
    def weight_version(self) -> int:
        """Version of the weights currently loaded (0 until the first refit)."""
        return self._version
