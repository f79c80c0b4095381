"""Executing a micro-batch plan over one DP shard: plain, dynamic (token budget) and packed.

The plan itself comes from :func:`tq.sharding.shard_meta_for_dp` (``extra_info["micro_batches"]``,
``"micro_batch_mode"``, ``"sequence_length_round"``) - the same function for the legacy and the TQ
path, so both run identical micro-batches - or, without packing / dynamic batching, is contiguous
chunks of a fixed number of samples.

- **plain** / **dynamic**: a micro-batch is its rows right-padded to the longest row in it (rounded up
  to ``sequence_length_round``), with a 2-D padding mask.
- **packed**: a micro-batch is ONE row holding its sequences back to back (tail padded to a multiple
  of ``sequence_length_round``), ``position_ids`` restarting at 0 per sequence, and a block-diagonal
  causal 4-D bool mask ``[1, 1, S, S]`` (True = may attend) so no sequence attends to another.
  transformers (5.x, ``masking_utils._preprocess_mask_arguments``) passes a 4-D mask through to SDPA
  untouched; tail padding attends only to itself so no softmax row is empty (which would give NaN).

Log-probs always come back in the per-sample layout ``[k, width]`` (``lp[:, 0] = 0``, 0 past each
length), so the loss never sees the packing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

import torch

from common.batched_data_dict import BatchedDataDict

from .logprobs import length_mask, token_logprobs

__all__ = [
    "MicroBatchMode",
    "MicroBatchPlan",
    "ModelInputs",
    "plain_plan",
    "plan_from_extra_info",
    "build_micro_batch",
    "micro_batch_logprobs",
    "logprobs_for_plan",
    "local_valid_counts",
    "forward_backward",
]

MicroBatchMode = Literal["plain", "dynamic", "packed"]


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class MicroBatchPlan:
    """Micro-batches (lists of local row indices) of one shard and how to lay each out."""

    mode: MicroBatchMode
    micro_batches: list[list[int]]
    sequence_length_round: int = 1


def plain_plan(n: int, micro_batch_size: int) -> list[list[int]]:
    """Contiguous micro-batches of ``micro_batch_size`` rows (the last may be smaller)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [list(range(s, min(s + micro_batch_size, n))) for s in range(0, n, micro_batch_size)]


def plan_from_extra_info(extra_info: Mapping[str, Any], n: int, micro_batch_size: int) -> MicroBatchPlan:
    """The shard's plan: the one ``shard_meta_for_dp`` stamped, else plain chunks of ``micro_batch_size``."""
    if "micro_batches" in extra_info:
        mode = extra_info.get("micro_batch_mode")
        if mode not in ("packed", "dynamic"):
            raise ValueError(f"extra_info has micro_batches but micro_batch_mode is {mode!r}")
        mbs = [list(map(int, mb)) for mb in extra_info["micro_batches"]]
        covered = sorted(i for mb in mbs for i in mb)
        if covered != list(range(n)):
            raise ValueError(f"the micro-batch plan does not cover the shard's {n} rows exactly once")
        return MicroBatchPlan(mode, mbs, int(extra_info.get("sequence_length_round", 1)))
    return MicroBatchPlan("plain", plain_plan(n, micro_batch_size), 1)


@dataclass
class ModelInputs:
    """One micro-batch ready for the model, plus how to map its outputs back to its rows."""

    rows: list[int]  # shard-local row indices, in output order
    input_ids: torch.Tensor  # [b, S]
    attention_mask: torch.Tensor  # [b, S] int (padded) or [1, 1, S, S] bool (packed)
    position_ids: torch.Tensor  # [b, S]
    lengths: torch.Tensor  # [k] int64
    starts: torch.Tensor | None  # [k] offsets in the packed row, None when padded
    width: int  # per-sample output width

    @property
    def packed(self) -> bool:
        return self.starts is not None


def build_micro_batch(
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    rows: Sequence[int],
    *,
    packed: bool,
    pad_token_id: int,
    sequence_length_round: int = 1,
) -> ModelInputs:
    """Lay out ``rows`` of a right-padded ``[n, L]`` batch as a padded or a packed micro-batch.

    Positions past each length are reset to ``pad_token_id`` so the model input does not depend on
    how the caller padded (the legacy and TQ paths feed bit-identical tensors).
    """
    rows = list(rows)
    device = input_ids.device
    idx = torch.as_tensor(rows, dtype=torch.int64, device=device)
    lens = lengths.to(device=device, dtype=torch.int64).index_select(0, idx)
    longest = int(lens.max()) if rows else 0
    if longest < 1:
        raise ValueError(f"micro-batch rows {rows} are all empty sequences")
    L = input_ids.shape[1]
    if not packed:
        width = min(_round_up(longest, sequence_length_round), L)
        ids = input_ids.index_select(0, idx)[:, :width]
        valid = length_mask(lens, width)
        ids = ids.masked_fill(~valid, pad_token_id)
        pos = torch.arange(width, device=device).unsqueeze(0).expand(len(rows), -1)
        return ModelInputs(rows, ids, valid.long(), pos, lens, None, width)

    total = int(lens.sum())
    S = _round_up(total, sequence_length_round)
    starts = torch.cumsum(lens, 0) - lens
    src = input_ids.index_select(0, idx)
    ids = src[length_mask(lens, L)]  # row-major: sequences back to back
    ids = torch.nn.functional.pad(ids, (0, S - total), value=pad_token_id).unsqueeze(0)
    seg = torch.repeat_interleave(torch.arange(len(rows), device=device), lens)
    # tail padding: each position its own segment, so it attends only to itself
    seg = torch.cat([seg, len(rows) + torch.arange(S - total, device=device)])
    pos = torch.arange(S, device=device) - torch.cat([torch.repeat_interleave(starts, lens), torch.arange(total, S, device=device)])
    causal = torch.ones(S, S, dtype=torch.bool, device=device).tril_()
    mask = (seg.unsqueeze(0) == seg.unsqueeze(1)) & causal
    return ModelInputs(rows, ids, mask[None, None], pos.unsqueeze(0), lens, starts, longest)


def micro_batch_logprobs(model: torch.nn.Module, mb: ModelInputs, temperature: float = 1.0) -> torch.Tensor:
    """Forward one micro-batch; float32 log-probs ``[k, mb.width]`` in per-sample layout (grad if enabled),
    of the model's distribution at ``temperature`` (see :mod:`policy.logprobs`)."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, use_cache=False).logits
    lp = token_logprobs(logits, mb.input_ids, temperature)
    t = torch.arange(mb.width, device=lp.device).unsqueeze(0)
    if not mb.packed:
        return lp * (t < mb.lengths.unsqueeze(1))
    # Each sequence's first token was "predicted" from the previous sequence: t = 0 stays 0.
    valid = (t < mb.lengths.unsqueeze(1)) & (t > 0)
    gather = (mb.starts.unsqueeze(1) + t).clamp(max=lp.shape[1] - 1)
    return torch.where(valid, lp[0][gather], torch.zeros((), dtype=lp.dtype, device=lp.device))


@torch.no_grad()
def logprobs_for_plan(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    plan: MicroBatchPlan,
    pad_token_id: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs of a whole shard (``[n, L]`` float32, 0 past each length), micro-batch by micro-batch."""
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    for rows in plan.micro_batches:
        if not rows:
            continue  # an equalisation filler: nothing to compute (no per-micro-batch collective here)
        mb = build_micro_batch(
            input_ids,
            lengths,
            rows,
            packed=plan.mode == "packed",
            pad_token_id=pad_token_id,
            sequence_length_round=plan.sequence_length_round,
        )
        out[torch.as_tensor(rows, device=out.device), : mb.width] = micro_batch_logprobs(model, mb, temperature)
    return out


def local_valid_counts(data: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid sequences, valid tokens)`` of a shard: ``sum(sample_mask)``, ``sum(token_mask * sample_mask)``.

    Summed over DP ranks they are the global normalizers of :class:`policy.loss.ClippedPGLossFn`.
    """
    sample_mask = data["sample_mask"].float()
    toks = (data["token_mask"].float() * sample_mask.unsqueeze(-1)).sum()
    return sample_mask.sum(), toks


def forward_backward(
    model: torch.nn.Module,
    data: BatchedDataDict,
    plan: MicroBatchPlan,
    loss_fn: Any,
    global_valid_seqs: torch.Tensor,
    global_valid_toks: torch.Tensor,
    pad_token_id: int,
    temperature: float = 1.0,
) -> list[dict[str, Any]]:
    """Accumulate the gradients of one shard's share of a global batch; returns per-micro-batch metrics.

    ``data`` holds ``input_ids`` / ``input_lengths`` and what ``loss_fn`` reads (token-aligned columns
    ``[n, L]`` like ``input_ids``). Each micro-batch's loss is already globally normalized, so plain
    ``backward`` accumulation needs no rescaling.
    """
    L = data["input_ids"].shape[1]
    metrics = []
    for rows in plan.micro_batches:
        if not rows:
            continue
        mb = build_micro_batch(
            data["input_ids"],
            data["input_lengths"],
            rows,
            packed=plan.mode == "packed",
            pad_token_id=pad_token_id,
            sequence_length_round=plan.sequence_length_round,
        )
        lp = micro_batch_logprobs(model, mb, temperature)
        mb_data = data.select_indices(rows)
        for k, v in mb_data.items():
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == L:
                mb_data[k] = v[:, : mb.width]
        loss, m = loss_fn(lp, mb_data, global_valid_seqs, global_valid_toks)
        loss.backward()
        metrics.append({k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in m.items()})
    return metrics
