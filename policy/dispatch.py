"""How the driver splits a batch for the DP workers - one function for both policies.

The legacy :class:`~policy.policy.Policy` wraps its driver-side batch in a :class:`~tq.KVBatchMeta` of
index keys (``"0"``, ``"1"``, ...) and shards that with the very function :class:`~policy.policy.TQPolicy`
uses on real keys, :func:`shard_for_dp` (which calls :func:`tq.shard_meta_for_dp`). So for the same
lengths both paths put the same samples on the same rank in the same micro-batches.

Pure: no I/O, no Ray, no torch.
"""

from __future__ import annotations

from typing import Literal, Sequence

from tq.meta import KVBatchMeta
from tq.sharding import shard_meta_for_dp

__all__ = ["Purpose", "shard_for_dp", "global_batches", "index_meta", "shard_rows", "stamp_pad_seqlen", "pad_multiple"]

Purpose = Literal["train", "logprob"]
LEGACY_PARTITION = "legacy"


def pad_multiple(config) -> int:
    """The ``sequence_length_round`` of whichever of packing / dynamic batching is on (else 1)."""
    if config.sequence_packing.enabled:
        return config.sequence_packing.sequence_length_round
    if config.dynamic_batching.enabled:
        return config.dynamic_batching.sequence_length_round
    return 1


def shard_for_dp(meta: KVBatchMeta, config, purpose: Purpose) -> list[KVBatchMeta]:
    """``config.dp_size`` shards of ``meta`` with the micro-batch plan for ``purpose`` in ``extra_info``.

    Token budgets: ``train_mb_tokens`` for training, ``logprob_mb_tokens`` for log-prob passes. Rank
    assignment depends only on the lengths, so a sample lands on the same rank for both purposes.
    """
    packing, dynamic = config.sequence_packing, config.dynamic_batching
    mode_cfg = packing if packing.enabled else dynamic if dynamic.enabled else None
    budget = None
    if mode_cfg is not None:
        budget = mode_cfg.train_mb_tokens if purpose == "train" else mode_cfg.logprob_mb_tokens
    return shard_meta_for_dp(
        meta,
        config.dp_size,
        sequence_packing=packing.enabled,
        dynamic_batching=dynamic.enabled,
        max_tokens_per_microbatch=budget,
        sequence_length_round=pad_multiple(config),
    )


def global_batches(meta: KVBatchMeta, global_batch_size: int) -> list[KVBatchMeta]:
    """Contiguous global batches of ``global_batch_size`` samples, one optimizer step each.

    ``ValueError`` unless the batch is a whole number of global batches (NeMo-RL's rule: a ragged
    last step would weigh its samples differently).
    """
    n = len(meta)
    if n == 0 or n % global_batch_size:
        raise ValueError(f"train got {n} samples, not a positive multiple of train_global_batch_size={global_batch_size}")
    return [meta.slice(s, s + global_batch_size) for s in range(0, n, global_batch_size)]


def index_meta(lengths: Sequence[int]) -> KVBatchMeta:
    """A meta whose keys are the positions ``"0".."n-1"`` of a driver-side batch (legacy path)."""
    return KVBatchMeta(LEGACY_PARTITION, tuple(str(i) for i in range(len(lengths))), sequence_lengths=tuple(int(x) for x in lengths))


def shard_rows(shard: KVBatchMeta) -> list[int]:
    """The batch positions named by a shard of :func:`index_meta`."""
    return [int(k) for k in shard.keys]


def stamp_pad_seqlen(meta: KVBatchMeta, multiple: int = 1) -> KVBatchMeta:
    """Stamp ``extra_info["global_forward_pad_seqlen"]`` (longest sequence rounded up to ``multiple``) once.

    An existing stamp is kept (the sequence dim must not change between passes of one step) unless it
    is too short for the batch, which is an error.
    """
    if meta.sequence_lengths is None:
        raise ValueError("global_forward_pad_seqlen needs meta.sequence_lengths")
    longest = max(meta.sequence_lengths, default=0)
    stamped = meta.extra_info.get("global_forward_pad_seqlen")
    if stamped is not None:
        if stamped < longest:
            raise ValueError(f"global_forward_pad_seqlen={stamped} is shorter than the longest sequence ({longest})")
        return meta
    return meta.with_extra_info(global_forward_pad_seqlen=-(-longest // multiple) * multiple)
