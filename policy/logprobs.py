"""Token log-probs from a causal LM, and the per-token reductions workers write back per sample.

Convention (see :mod:`common.fields`): ``lp[:, 0] = 0`` and
``lp[:, t] = log_softmax(logits[:, t - 1] / T)[input_ids[:, t]]`` (float32 log-softmax whatever the model
dtype); positions at or beyond a sequence's length are 0. ``T`` is the sampling temperature whose
distribution the generator drew from and reported (``PolicyConfig.logprob_temperature``; 1: the
model's own), so the policy's log-probs, its loss and the generator's log-probs are of one distribution.
"""

from __future__ import annotations

from typing import Mapping

import torch

__all__ = [
    "token_logprobs",
    "compute_logprobs",
    "length_mask",
    "per_sequence_logprob_error",
    "per_sequence_mult_prob_error",
    "num_valid_tokens",
    "per_sample_reductions",
]


def length_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Bool ``[n, width]``: True at positions ``t < lengths[i]``."""
    return torch.arange(width, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``lp[:, t] = log_softmax(logits[:, t-1].float() / temperature)[input_ids[:, t]]``, ``lp[:, 0] = 0`` (``[b, T]``).

    Differentiable; the log-softmax runs in float32 so bf16 models give comparable numbers.
    """
    scores = logits[:, :-1].float()
    if temperature != 1.0:
        scores = scores / temperature
    logp = torch.log_softmax(scores, dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0), value=0.0)


@torch.no_grad()
def compute_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, lengths: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of a right-padded batch in one forward (no micro-batching): float32 ``[n, L]``."""
    mask = length_mask(lengths, input_ids.shape[1])
    logits = model(input_ids=input_ids, attention_mask=mask.long()).logits
    return token_logprobs(logits, input_ids, temperature) * mask


def num_valid_tokens(token_mask: torch.Tensor) -> torch.Tensor:
    """Per-sample count of trained-on tokens (int64 ``[n]``)."""
    return token_mask.bool().sum(-1).to(torch.int64)


def per_sequence_logprob_error(prev_logprobs: torch.Tensor, generation_logprobs: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """Per-sample mean ``|prev_logprobs - generation_logprobs|`` over ``token_mask`` (float32 ``[n]``; 0 if none)."""
    m = token_mask.bool()
    err = torch.where(m, (prev_logprobs.float() - generation_logprobs.float()).abs(), 0.0)
    return err.sum(-1) / m.sum(-1).clamp(min=1)


def per_sequence_mult_prob_error(prev_logprobs: torch.Tensor, generation_logprobs: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """Per-sample mean ``exp(|prev - generation|)`` over ``token_mask`` (NeMo-RL's ``seq_mult_prob_error``; 0 if none)."""
    m = token_mask.bool()
    err = torch.where(m, torch.exp((prev_logprobs.float() - generation_logprobs.float()).abs()), 0.0)
    return err.sum(-1) / m.sum(-1).clamp(min=1)


def per_sample_reductions(data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The per-sample reductions of padded per-token columns (``REDUCTION_INPUT_FIELDS``).

    Returns ``seq_logprob_error`` (mean ``|prev_logprobs - generation_logprobs|`` over ``token_mask``),
    ``seq_mult_prob_error`` (mean ``exp`` of it) and ``num_valid_tokens`` - the
    ``PER_SAMPLE_REDUCTION_FIELDS`` that TQ workers write back and the legacy driver computes itself.
    """
    prev, gen, tm = data["prev_logprobs"], data["generation_logprobs"], data["token_mask"]
    return {
        "seq_logprob_error": per_sequence_logprob_error(prev, gen, tm),
        "seq_mult_prob_error": per_sequence_mult_prob_error(prev, gen, tm),
        "num_valid_tokens": num_valid_tokens(tm),
    }
