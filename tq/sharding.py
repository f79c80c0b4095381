"""Data-parallel sharding and micro-batch planning for :class:`~tq.meta.KVBatchMeta`.

Everything here is pure (no I/O, no torch) and deterministic: the same input
always gives the same output.

* :func:`shard_meta_for_dp` splits a batch handle into one shard per DP rank,
  optionally token-balancing the ranks and writing a per-rank micro-batch plan
  (``extra_info["micro_batches"]``) whose micro-batch count is identical on
  every rank.
* :func:`balance_across_ranks` is the token balancer (LPT list scheduling).
* :func:`plan_micro_batches` is the per-rank micro-batch planner
  (``"packed"``: first-fit-decreasing sequence packing, ``"dynamic"``:
  padded-token budgeted dynamic batching).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Literal

import numpy as np

from tq.meta import KVBatchMeta

__all__ = [
    "shard_meta_for_dp",
    "balance_across_ranks",
    "plan_micro_batches",
    "round_lengths",
    "micro_batch_cost",
    "MICRO_BATCH_PLAN_KEYS",
]

MicroBatchMode = Literal["packed", "dynamic"]

#: extra_info keys that describe a micro-batch plan; a stale plan inherited
#: from the input meta is removed when sharding without packing/dynamic batching.
MICRO_BATCH_PLAN_KEYS: tuple[str, ...] = (
    "micro_batches",
    "micro_batch_mode",
    "max_tokens_per_microbatch",
    "sequence_length_round",
)


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def round_lengths(lengths: Sequence[int] | np.ndarray, sequence_length_round: int = 1) -> np.ndarray:
    """Round each length up to a multiple of ``sequence_length_round`` (int64 array; 0 stays 0)."""
    r = _check_int("sequence_length_round", sequence_length_round)
    if r < 1:
        raise ValueError(f"sequence_length_round must be >= 1, got {r}")
    arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"sequence lengths must be >= 0, got {int(arr.min())}")
    if r == 1:
        return arr
    return (arr + (r - 1)) // r * r


def micro_batch_cost(rounded_lengths: Sequence[int], mode: MicroBatchMode) -> int:
    """Cost of one micro-batch under ``mode``.

    ``"packed"``: sum of rounded lengths (one packed row).
    ``"dynamic"``: number of samples * max rounded length (padded tokens).
    An empty micro-batch costs 0.
    """
    if not len(rounded_lengths):
        return 0
    if mode == "packed":
        return int(sum(rounded_lengths))
    if mode == "dynamic":
        return len(rounded_lengths) * int(max(rounded_lengths))
    raise ValueError(f"mode must be 'packed' or 'dynamic', got {mode!r}")


def balance_across_ranks(lengths: Sequence[int] | np.ndarray, dp_size: int) -> list[list[int]]:
    """Token-balance samples over ``dp_size`` ranks by LPT list scheduling.

    Samples are visited by (length descending, index ascending) and each is
    given to the rank with the fewest tokens so far; ties go to the rank with
    the fewest samples, then the lowest rank (the sample-count tie-break makes
    zero-length samples spread out, so with ``len(lengths) >= dp_size`` every
    rank gets at least one sample: an empty rank always has the minimal
    ``(0 tokens, 0 samples)`` key).

    Guarantee: ``max_rank_tokens - min_rank_tokens <= max(lengths)``.  (The
    fullest rank was a least-loaded rank when it received its last sample
    ``x``, and loads only grow, so its final load <= final min load + x.)

    Returns one list of sample indices per rank, each in ascending (original)
    order.  Pass already-rounded lengths if rounding matters.
    """
    dp = _check_int("dp_size", dp_size)
    if dp < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp}")
    arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
    n = arr.shape[0]
    if n and int(arr.min()) < 0:
        raise ValueError(f"sequence lengths must be >= 0, got {int(arr.min())}")
    if dp == 1:
        return [list(range(n))]
    order = np.argsort(-arr, kind="stable").tolist()
    vals = arr.tolist()
    heap = [(0, 0, r) for r in range(dp)]  # (tokens, samples, rank); already a valid heap
    assign = [0] * n
    replace = heapq.heapreplace
    for i in order:
        tokens, count, rank = heap[0]
        assign[i] = rank
        replace(heap, (tokens + vals[i], count + 1, rank))
    assign_arr = np.asarray(assign, dtype=np.int64)
    by_rank = np.argsort(assign_arr, kind="stable")
    bounds = np.searchsorted(assign_arr[by_rank], np.arange(dp + 1))
    return [by_rank[bounds[r] : bounds[r + 1]].tolist() for r in range(dp)]


def _pack_ffd(rounded: list[int], order: list[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing; ``order`` is the items sorted by length descending.

    Leftmost bin with enough room is found in O(log bins) with a max segment
    tree over the bins' remaining capacities (unused leaves hold -1).
    """
    n = len(order)
    size = 1
    while size < n:
        size <<= 1
    tree = [-1] * (2 * size)
    bins: list[list[int]] = []
    for i in order:
        x = rounded[i]
        if tree[1] >= x:
            node = 1
            while node < size:
                node <<= 1
                if tree[node] < x:
                    node += 1
            bins[node - size].append(i)
            tree[node] -= x
        else:
            node = len(bins) + size
            bins.append([i])
            tree[node] = budget - x
        node >>= 1
        while node:
            left = tree[2 * node]
            right = tree[2 * node + 1]
            best = left if left > right else right
            if tree[node] == best:
                break
            tree[node] = best
            node >>= 1
    return bins


def _dynamic_batches(rounded: list[int], order: list[int], budget: int) -> list[list[int]]:
    """Greedy dynamic batching over items sorted by length descending.

    A micro-batch starting with (its longest) item of length ``m`` takes the
    next ``budget // m`` items; a run of zero-length items costs 0 and forms
    one micro-batch.
    """
    batches = []
    n = len(order)
    start = 0
    while start < n:
        m = rounded[order[start]]
        stop = n if m == 0 else min(n, start + budget // m)
        batches.append(order[start:stop])
        start = stop
    return batches


def plan_micro_batches(
    lengths: Sequence[int] | np.ndarray,
    max_tokens: int,
    mode: MicroBatchMode,
    sequence_length_round: int = 1,
) -> list[list[int]]:
    """Plan micro-batches for one rank's samples.

    ``lengths`` are the rank's unpadded sequence lengths; each is rounded up to
    a multiple of ``sequence_length_round`` (0 stays 0) before costing.

    * ``"dynamic"``: samples sorted by rounded length descending (index
      ascending on ties) are cut greedily into micro-batches whose padded cost
      ``len(mb) * max rounded length in mb`` is ``<= max_tokens``.
    * ``"packed"``: first-fit-decreasing bin packing, cost ``sum of rounded
      lengths <= max_tokens``; each bin is one packed row / micro-batch.

    Returns lists of local indices (``0..len(lengths)-1``); each list is
    sorted ascending, every index appears exactly once, and the lists are in
    creation order (longest sequences first).  ``ValueError`` if any single
    rounded length exceeds ``max_tokens``.
    """
    if mode not in ("packed", "dynamic"):
        raise ValueError(f"mode must be 'packed' or 'dynamic', got {mode!r}")
    budget = _check_int("max_tokens", max_tokens)
    if budget <= 0:
        raise ValueError(f"max_tokens must be > 0, got {budget}")
    arr = round_lengths(lengths, sequence_length_round)
    if arr.size == 0:
        return []
    too_long = np.flatnonzero(arr > budget)
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(f"sequence at index {i} has rounded length {int(arr[i])} > max_tokens={budget}")
    order = np.argsort(-arr, kind="stable").tolist()
    rounded = arr.tolist()
    if mode == "packed":
        batches = _pack_ffd(rounded, order, budget)
    else:
        batches = _dynamic_batches(rounded, order, budget)
    for b in batches:
        b.sort()
    return batches


def _equalize_micro_batches(batches: list[list[int]], rounded: list[int], mode: MicroBatchMode, target: int) -> list[list[int]]:
    """Grow ``batches`` to exactly ``target`` micro-batches.

    Repeatedly split the micro-batch with the most samples (ties: highest cost,
    then earliest position) into two halves in place (first half = first
    ``ceil(k/2)`` indices).  Halves never cost more than the original under
    either cost model.  When only single-sample micro-batches remain, empty
    micro-batches are appended.
    """
    need = target - len(batches)
    if need <= 0:
        return batches

    def cost(b: list[int]) -> int:
        return micro_batch_cost([rounded[i] for i in b], mode)

    # Heap entries: (-samples, -cost, position key, batch); position keys are
    # tuples so a split's halves sort right where the original was.
    heap = [(-len(b), -cost(b), (p,), b) for p, b in enumerate(batches)]
    heapq.heapify(heap)
    while need > 0 and heap and -heap[0][0] >= 2:
        _, _, pos, b = heapq.heappop(heap)
        half = (len(b) + 1) // 2
        for j, part in enumerate((b[:half], b[half:])):
            heapq.heappush(heap, (-len(part), -cost(part), pos + (j,), part))
        need -= 1
    done = sorted(((pos, b) for _, _, pos, b in heap), key=lambda t: t[0])
    result = [b for _, b in done]
    result.extend([] for _ in range(need))
    return result


def shard_meta_for_dp(
    meta: KVBatchMeta,
    dp_size: int,
    *,
    sequence_packing: bool = False,
    dynamic_batching: bool = False,
    max_tokens_per_microbatch: int | None = None,
    sequence_length_round: int = 1,
) -> list[KVBatchMeta]:
    """Split ``meta`` into ``dp_size`` shards, one per data-parallel rank.

    Pure: creates no keys, every key lands in exactly one shard, and shards
    keep their keys in the original relative order.  Each shard's
    ``extra_info`` is the input's ``extra_info`` plus ``"dp_rank"`` and
    ``"dp_size"``.

    Plain mode (neither ``sequence_packing`` nor ``dynamic_batching``): shards
    are exactly ``meta.chunk(dp_size)`` (contiguous, sizes differ by at most
    1); no micro-batch plan is written and a stale one inherited from ``meta``
    (``MICRO_BATCH_PLAN_KEYS``) is dropped.

    With ``sequence_packing`` or ``dynamic_batching`` (at most one):

    1. Tokens are balanced across ranks by :func:`balance_across_ranks` (LPT
       over rounded lengths).  **Guarantee:** ``max_rank_tokens -
       min_rank_tokens <= max rounded sequence length`` (token counts in
       rounded lengths), and every rank gets at least one sample.
    2. Each shard gets a micro-batch plan over its own local indices from
       :func:`plan_micro_batches` (``"packed"`` or ``"dynamic"``), every
       micro-batch within ``max_tokens_per_microbatch`` under its cost model.
    3. Micro-batch counts are equalised to the maximum ``M`` over ranks (a
       mismatch would deadlock collectives): a rank with fewer splits its
       largest micro-batch in halves until it has ``M``; a rank with fewer than
       ``M`` samples gets empty micro-batches appended, which workers must run
       as no-ops that still join the collectives.

       The plan is written to ``extra_info``: ``"micro_batches"`` (list of
       sorted local-index lists), ``"micro_batch_mode"`` (``"packed"`` |
       ``"dynamic"``), ``"max_tokens_per_microbatch"``,
       ``"sequence_length_round"``, ``"dp_rank"``, ``"dp_size"``.

    ``sequence_length_round`` rounds each length up to a multiple of it
    (0 stays 0) for balancing and costing.

    Raises ``ValueError`` for: ``dp_size < 1``; fewer samples than ranks; both
    modes enabled; a mode enabled without ``meta.sequence_lengths`` or without
    a positive ``max_tokens_per_microbatch``; ``sequence_length_round < 1``; a
    single sequence whose rounded length exceeds the budget (naming its key).
    """
    if not isinstance(meta, KVBatchMeta):
        raise TypeError(f"meta must be a KVBatchMeta, got {type(meta).__name__}")
    dp = _check_int("dp_size", dp_size)
    if dp < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp}")
    if sequence_packing and dynamic_batching:
        raise ValueError("enable at most one of sequence_packing and dynamic_batching")
    n = len(meta)
    if n < dp:
        raise ValueError(f"cannot shard {n} samples over {dp} DP ranks")
    rnd = _check_int("sequence_length_round", sequence_length_round)
    if rnd < 1:
        raise ValueError(f"sequence_length_round must be >= 1, got {rnd}")

    if not (sequence_packing or dynamic_batching):
        base = {k: v for k, v in meta.extra_info.items() if k not in MICRO_BATCH_PLAN_KEYS}
        return [shard._replace(extra_info={**base, "dp_rank": r, "dp_size": dp}) for r, shard in enumerate(meta.chunk(dp))]

    mode: MicroBatchMode = "packed" if sequence_packing else "dynamic"
    option = "sequence_packing" if sequence_packing else "dynamic_batching"
    if meta.sequence_lengths is None:
        raise ValueError(f"{option} requires meta.sequence_lengths, but they are None")
    if max_tokens_per_microbatch is None:
        raise ValueError(f"{option} requires max_tokens_per_microbatch, but it is None")
    budget = _check_int("max_tokens_per_microbatch", max_tokens_per_microbatch)
    if budget <= 0:
        raise ValueError(f"max_tokens_per_microbatch must be > 0, got {budget}")

    rounded = round_lengths(meta.sequence_lengths, rnd)
    too_long = np.flatnonzero(rounded > budget)
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(
            f"sequence {meta.keys[i]!r} has length {meta.sequence_lengths[i]} "
            f"(rounded to {int(rounded[i])} with sequence_length_round={rnd}) "
            f"> max_tokens_per_microbatch={budget}"
        )

    rank_indices = balance_across_ranks(rounded, dp)
    rounded_list = rounded.tolist()
    local_rounded = [[rounded_list[i] for i in idx] for idx in rank_indices]
    plans = [plan_micro_batches(lr, budget, mode) for lr in local_rounded]
    target = max(len(p) for p in plans)
    plans = [_equalize_micro_batches(p, lr, mode, target) for p, lr in zip(plans, local_rounded)]

    shards = []
    for r, (idx, plan) in enumerate(zip(rank_indices, plans)):
        shard = meta.select(idx)
        info = {
            **meta.extra_info,
            "micro_batches": plan,
            "micro_batch_mode": mode,
            "max_tokens_per_microbatch": budget,
            "sequence_length_round": rnd,
            "dp_rank": r,
            "dp_size": dp,
        }
        shards.append(shard._replace(extra_info=info))
    return shards
