"""Synthetic GRPO-shaped batches for tests and benchmarks, in both layouts.

:func:`synthetic_batch` builds a driver-side :class:`BatchedDataDict` with the columns of
:mod:`common.fields` (random prompt + response tokens, a response ``token_mask``, generation
log-probs, per-sample advantages); :func:`to_tq_columns` turns one into the jagged per-sample columns
a rollout writes to TQ, so the legacy and TQ paths can be fed the very same samples.
"""

from __future__ import annotations

from typing import Any

import torch

from common.batched_data_dict import BatchedDataDict
from common.fields import TOKEN_FIELDS
from tq.jagged import JaggedTensor

from .logprobs import length_mask

__all__ = ["synthetic_batch", "to_tq_columns"]


def synthetic_batch(
    n: int,
    *,
    min_len: int = 4,
    max_len: int = 32,
    prompt_len: int = 3,
    vocab: tuple[int, int] = (4, 90),
    seed: int = 0,
) -> BatchedDataDict:
    """``n`` right-padded samples of lengths in ``[min_len, max_len]`` (padded to the longest).

    Tokens ``[prompt_len, length)`` are "generated" (``token_mask``); ``generation_logprobs`` are
    small negative numbers there (0 elsewhere); ``advantages`` are standard normal; ``sample_mask`` 1.
    """
    if not 1 <= prompt_len < min_len <= max_len:
        raise ValueError("need 1 <= prompt_len < min_len <= max_len")
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    L = int(lengths.max())
    valid = length_mask(lengths, L)
    input_ids = torch.randint(vocab[0], vocab[1], (n, L), generator=g).masked_fill(~valid, 0)
    token_mask = valid & (torch.arange(L).unsqueeze(0) >= prompt_len)
    gen = (-torch.rand(n, L, generator=g) * 3.0) * token_mask
    return BatchedDataDict(
        input_ids=input_ids,
        input_lengths=lengths,
        token_mask=token_mask,
        sample_mask=torch.ones(n),
        generation_logprobs=gen,
        advantages=torch.randn(n, generator=g),
    )


def to_tq_columns(batch: BatchedDataDict) -> dict[str, Any]:
    """The batch as TQ columns: token-aligned ones jagged (each row its own length), the rest as is."""
    lengths = batch["input_lengths"]
    return {k: (JaggedTensor.from_padded(v, lengths) if k in TOKEN_FIELDS else v) for k, v in batch.items()}
