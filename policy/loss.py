"""The GRPO / PPO clipped policy-gradient loss (NeMo-RL's ``ClippedPGLossFn``) and its metrics.

Conventions (see :mod:`common.fields`): every per-token tensor is ``[b, T]`` with ``lp[:, t]`` the
log-prob of token ``t``; the tokens trained on are ``mask = token_mask * sample_mask[:, None]``.

**Global normalization.** A loss call sees one micro-batch but divides by the number of valid tokens
(``global_valid_toks``) or valid sequences (``global_valid_seqs``) of the whole global batch across all
micro-batches and DP ranks. So the micro-batch losses *sum* to the full-batch loss, and summing their
gradients (accumulation) and all-reducing with SUM across ranks gives exactly the full-batch gradient,
whatever the micro-batching and the DP size. The same holds for the metrics: every metric except
``*_min`` / ``*_max`` is a globally normalized partial sum, reduced by :func:`reduce_metrics`.

Pure: torch only, no I/O.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping, Protocol, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from common.fields import DP_TRAIN_FIELDS

__all__ = [
    "ClippedPGLossConfig",
    "ClippedPGLossFn",
    "LossFunction",
    "calculate_kl",
    "masked_sum",
    "metric_reduction",
    "reduce_metrics",
]

KLType = Literal["k1", "k2", "k3"]


class LossFunction(Protocol):
    """What the DP workers call once per micro-batch.

    ``curr_logprobs`` is ``[b, T]`` (with grad), ``data`` the micro-batch's columns cut to ``T``
    tokens. Returns the micro-batch's share of the global loss and its metrics (0-d tensors or floats,
    globally normalized, see :func:`reduce_metrics`). ``input_fields`` names the columns it reads.
    """

    input_fields: tuple[str, ...]

    def __call__(
        self,
        curr_logprobs: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


def metric_reduction(name: str) -> Literal["sum", "min", "max"]:
    """How a loss metric combines over micro-batches and ranks: by name suffix ``_min`` / ``_max``, else sum."""
    if name.endswith("_min"):
        return "min"
    if name.endswith("_max"):
        return "max"
    return "sum"


def reduce_metrics(per_micro_batch: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Combine the metrics of several micro-batches (see :func:`metric_reduction`) into float64 0-d tensors.

    Stays on the metrics' device (no host sync per metric); every micro-batch must report the same names.
    """
    if not per_micro_batch:
        raise ValueError("reduce_metrics needs at least one micro-batch's metrics")
    out: dict[str, torch.Tensor] = {}
    for k in per_micro_batch[0]:
        vals = torch.stack([torch.as_tensor(m[k]).to(torch.float64) for m in per_micro_batch])
        red = metric_reduction(k)
        out[k] = vals.amin() if red == "min" else vals.amax() if red == "max" else vals.sum()
    return out


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x * mask)`` where masked-out entries of ``x`` cannot leak NaN/inf into the sum."""
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def calculate_kl(
    logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    kl_type: KLType = "k3",
    input_clamp: float | None = 20.0,
    output_clamp: float | None = 10.0,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimators of Schulman (2020), with ``r = log pi_ref - log pi``.

    ``k1 = -r``, ``k2 = r**2 / 2``, ``k3 = exp(r) - 1 - r``; ``r`` is clamped to ``+-input_clamp``
    (keeps ``exp`` finite) and the result to ``+-output_clamp`` (``kl_clamp`` in the config).
    """
    logr = reference_logprobs - logprobs
    if input_clamp is not None:
        logr = logr.clamp(-input_clamp, input_clamp)
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = logr.square() / 2
    elif kl_type == "k3":
        kl = torch.exp(logr) - 1 - logr
    else:
        raise ValueError(f"reference_policy_kl_type must be k1, k2 or k3, got {kl_type!r}")
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


class ClippedPGLossConfig(BaseModel):
    """Settings of :class:`ClippedPGLossFn` (NeMo-RL's names and meanings).

    The ratio ``pi/pi_old`` is clipped to ``[1 - ratio_clip_min, 1 + ratio_clip_max]`` (both are
    epsilons). ``ratio_clip_c`` (> 1) enables dual clipping for negative advantages: the per-token
    loss is capped at ``-A * ratio_clip_c``.
    """

    model_config = ConfigDict(extra="forbid")

    ratio_clip_min: float = Field(0.2, ge=0.0, description="Lower clip epsilon: the ratio is clipped at 1 - ratio_clip_min.")
    ratio_clip_max: float = Field(0.2, ge=0.0, description="Upper clip epsilon: the ratio is clipped at 1 + ratio_clip_max.")
    ratio_clip_c: float | None = Field(None, description="Dual-clip constant (> 1) for negative advantages (null: off)")
    reference_policy_kl_penalty: float = Field(
        0.0, ge=0.0, description=("Weight of the KL term to the reference (initial) policy (0: no reference model)")
    )
    reference_policy_kl_type: KLType = Field("k3", description="KL estimator (k1, k2, k3)")
    kl_clamp: float | None = Field(10.0, gt=0.0, description="Clamp the per-token KL to [-kl_clamp, kl_clamp] (null: off)")
    kl_input_clamp: float | None = Field(20.0, gt=0.0, description="Clamp the log-ratio entering the KL estimator (null: off)")
    use_on_policy_kl_approximation: bool = Field(False, description="Weight the KL term by the importance ratio (an on-policy estimate)")
    token_level_loss: bool = Field(True, description="Average the loss over tokens (else over sequences)")
    use_importance_sampling_correction: bool = Field(
        False, description=("Weight the loss by pi_old / pi_generation per token (required in async mode)")
    )
    truncated_importance_sampling_ratio: float | None = Field(
        None, gt=0.0, description=("Cap the importance-sampling weight at this (null: no cap)")
    )

    @model_validator(mode="after")
    def _check(self) -> "ClippedPGLossConfig":
        if self.ratio_clip_c is not None and self.ratio_clip_c <= 1.0:
            raise ValueError(f"loss.ratio_clip_c must be > 1 (dual clip), got {self.ratio_clip_c}")
        if self.ratio_clip_min >= 1.0:
            raise ValueError(f"loss.ratio_clip_min is an epsilon and must be < 1, got {self.ratio_clip_min}")
        if self.truncated_importance_sampling_ratio is not None and not self.use_importance_sampling_correction:
            raise ValueError("loss.truncated_importance_sampling_ratio needs loss.use_importance_sampling_correction")
        return self


class ClippedPGLossFn:
    """Clipped policy-gradient loss with optional dual clip, KL to a reference and IS correction.

    Per valid token (``mask``), with ``ratio = exp(curr - prev_logprobs)`` and advantage ``A``
    (per-sample ``[b]`` broadcast over tokens, or per-token ``[b, T]``)::

        clip_loss = max(-A * ratio, -A * clamp(ratio, 1 - ratio_clip_min, 1 + ratio_clip_max))
        if ratio_clip_c and A < 0: clip_loss = min(clip_loss, -A * ratio_clip_c)
        w = exp(prev_logprobs - generation_logprobs) (nan->0, clamped to truncated_..._ratio)
            if use_importance_sampling_correction else 1
        kl = reference_policy_kl_penalty * calculate_kl(curr, reference_policy_logprobs)
            (times exp(curr - generation_logprobs).detach() with use_on_policy_kl_approximation)

    Token level (``token_level_loss``): ``loss = sum(mask * (w * clip_loss + kl)) / global_valid_toks``.
    Sequence level: each sequence's token mean of ``w * clip_loss + kl`` (over its ``token_mask``),
    then ``sum(sample_mask * seq_mean) / global_valid_seqs``.

    Metrics (all over valid tokens of the global batch unless said):

    - ``loss``: the loss; ``actor_loss`` / ``kl_loss`` its two parts.
    - ``probs_ratio`` (mean), ``probs_ratio_min``, ``probs_ratio_max`` of ``ratio``;
      ``probs_ratio_clamped`` mean of the clamped ratio; ``clip_fraction``: share of tokens where the
      clipped term was taken (``-A * clamped > -A * ratio``, verl's ``pg_clipfrac``);
      ``dual_clip_fraction``: share where the dual clip bound was taken.
    - ``kl_penalty``: mean per-token KL to the reference (without the coefficient); 0 when off.
    - ``token_mult_prob_error``: ``mean(exp(|prev_logprobs - generation_logprobs|))`` (NeMo-RL's
      definition; 1.0 when trainer and generator agree exactly).
    - ``sampling_importance_ratio``: ``mean(exp(prev_logprobs - generation_logprobs))``.
    - ``approx_entropy``: ``-mean(exp(curr - generation_logprobs) * curr)``, the entropy of the current
      policy estimated from tokens sampled by the generator (importance-weighted).
    - ``num_valid_tokens`` / ``num_valid_samples``: counts of the micro-batch (summing gives the batch).
    """

    def __init__(self, config: ClippedPGLossConfig | Mapping[str, Any] | None = None) -> None:
        if config is None:
            config = ClippedPGLossConfig()
        elif not isinstance(config, ClippedPGLossConfig):
            config = ClippedPGLossConfig(**config)
        self.config = config
        need_ref = config.reference_policy_kl_penalty > 0
        # Only what the loss reads is fetched from the data plane (no reference pass needed without KL).
        self.input_fields: tuple[str, ...] = tuple(f for f in DP_TRAIN_FIELDS if need_ref or f != "reference_policy_logprobs")

    def __call__(
        self,
        curr_logprobs: torch.Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's share of the global loss, and its metrics (detached 0-d tensors)."""
        cfg = self.config
        curr = curr_logprobs.float()
        T = curr.shape[1]
        token_mask = data["token_mask"][:, :T].to(curr.dtype)
        sample_mask = data["sample_mask"].to(curr.dtype)
        mask = token_mask * sample_mask.unsqueeze(-1)
        # Whatever sits outside the mask (padding, dropped samples) is zeroed so that no inf/NaN there
        # can reach the gradient (where() zeroes the grad, but 0 * inf in exp's backward is NaN).
        valid = mask > 0
        zero = torch.zeros((), dtype=curr.dtype, device=curr.device)
        prev = torch.where(valid, data["prev_logprobs"][:, :T].float(), zero)
        gen = torch.where(valid, data["generation_logprobs"][:, :T].float(), zero)
        adv = data["advantages"].float()
        adv = torch.where(valid, adv.unsqueeze(-1) if adv.dim() == 1 else adv[:, :T], zero)
        toks = torch.as_tensor(global_valid_toks, dtype=curr.dtype, device=curr.device).clamp(min=1)
        seqs = torch.as_tensor(global_valid_seqs, dtype=curr.dtype, device=curr.device).clamp(min=1)

        ratio = torch.exp(curr - prev)
        ratio_clamped = ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
        loss1 = -adv * ratio
        loss2 = -adv * ratio_clamped
        clip_loss = torch.maximum(loss1, loss2)
        dual_taken = torch.zeros_like(clip_loss, dtype=torch.bool)
        if cfg.ratio_clip_c is not None:
            loss3 = -adv * cfg.ratio_clip_c
            dual_taken = (adv < 0) & (loss3 < clip_loss)
            clip_loss = torch.where(dual_taken, loss3, clip_loss)

        is_weights = torch.nan_to_num(torch.exp(prev - gen), nan=0.0, posinf=0.0, neginf=0.0)
        if cfg.use_importance_sampling_correction:
            w = is_weights
            if cfg.truncated_importance_sampling_ratio is not None:
                w = w.clamp(max=cfg.truncated_importance_sampling_ratio)
        else:
            w = torch.ones_like(is_weights)
        actor_tok = w * clip_loss

        if cfg.reference_policy_kl_penalty > 0:
            ref = torch.where(valid, data["reference_policy_logprobs"][:, :T].float(), zero)
            kl_raw = calculate_kl(curr, ref, cfg.reference_policy_kl_type, cfg.kl_input_clamp, cfg.kl_clamp)
            kl_w = torch.ones_like(kl_raw)
            if cfg.use_on_policy_kl_approximation:
                kl_w = torch.nan_to_num(torch.exp(curr - gen).detach(), nan=0.0, posinf=0.0, neginf=0.0)
            kl_tok = cfg.reference_policy_kl_penalty * kl_w * kl_raw
        else:
            kl_raw = kl_tok = torch.zeros_like(curr)

        if cfg.token_level_loss:
            actor_loss = masked_sum(actor_tok, mask) / toks
            kl_loss = masked_sum(kl_tok, mask) / toks
        else:
            per_seq_tokens = token_mask.sum(-1).clamp(min=1)
            actor_loss = (masked_sum(actor_tok, token_mask, dim=-1) / per_seq_tokens * sample_mask).sum() / seqs
            kl_loss = (masked_sum(kl_tok, token_mask, dim=-1) / per_seq_tokens * sample_mask).sum() / seqs
        loss = actor_loss + kl_loss

        with torch.no_grad():
            inf = torch.tensor(math.inf, device=curr.device)
            r = ratio.detach()
            metrics = {
                "loss": loss.detach(),
                "actor_loss": actor_loss.detach(),
                "kl_loss": kl_loss.detach(),
                "probs_ratio": masked_sum(r, mask) / toks,
                "probs_ratio_clamped": masked_sum(ratio_clamped.detach(), mask) / toks,
                "probs_ratio_min": torch.where(valid, r, inf).min() if r.numel() else inf,
                "probs_ratio_max": torch.where(valid, r, -inf).max() if r.numel() else -inf,
                "clip_fraction": masked_sum((loss2 > loss1).to(curr.dtype), mask) / toks,
                "dual_clip_fraction": masked_sum(dual_taken.to(curr.dtype), mask) / toks,
                "kl_penalty": masked_sum(kl_raw.detach(), mask) / toks,
                "token_mult_prob_error": masked_sum(torch.exp((prev - gen).abs()), mask) / toks,
                "sampling_importance_ratio": masked_sum(is_weights, mask) / toks,
                "approx_entropy": -masked_sum(torch.exp(curr.detach() - gen) * curr.detach(), mask) / toks,
                "num_valid_tokens": mask.sum(),
                "num_valid_samples": sample_mask.sum(),
            }
        return loss, metrics
