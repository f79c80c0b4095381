"""Placing actors on GPUs: a placement group's bundles, and where a DP group's ranks landed.

Ray packs fractional GPU requests onto as few GPUs as it can: two ranks asking for half a GPU each
land on the same one unless a placement group's bundles keep them apart (one ``{"GPU": 1}`` bundle a
rank, colocated actors in the same bundles, as verl's resource pools and NeMo-RL's virtual clusters
do). NCCL refuses two ranks of one group on one GPU ("Duplicate GPU detected"), so a policy checks
first and names the fix. The checks are pure; :func:`in_bundle` only builds Ray's actor option.
"""

from __future__ import annotations

from typing import Any, Sequence

#: Where one rank runs: (Ray node id, the GPU ids Ray assigned it on that node).
RankPlacement = tuple[str, Sequence[str]]


def ranks_sharing_a_gpu(placements: Sequence[RankPlacement]) -> dict[tuple[str, str], list[int]]:
    """``{(node, gpu): [ranks]}`` for every GPU that more than one rank was given (empty: none shared).
    ``placements[r]`` is rank ``r``'s; a rank with no GPU shares none."""
    ranks_of: dict[tuple[str, str], list[int]] = {}
    for rank, (node, gpus) in enumerate(placements):
        for gpu in dict.fromkeys(gpus):
            ranks_of.setdefault((node, gpu), []).append(rank)
    return {where: ranks for where, ranks in ranks_of.items() if len(ranks) > 1}


def shared_gpu_error(shared: dict[tuple[str, str], list[int]], gpus_per_rank: float) -> str:
    """The message for :func:`ranks_sharing_a_gpu`'s finding: which ranks, which GPU, and what to do."""
    (node, gpu), ranks = next(iter(shared.items()))
    return (
        f"policy ranks {ranks} were all placed on GPU {gpu} of Ray node {node[:12]}: Ray packs fractional GPU requests "
        f"(policy.num_gpus_per_worker={gpus_per_rank:g}) onto one GPU, and NCCL needs a GPU per rank of a group. Ask for "
        "whole GPUs (policy.num_gpus_per_worker=1), or pass placement_group= a Ray placement group with one "
        '{"GPU": 1} bundle per rank (rank r runs in bundle r; put the actors that share its GPU in the same bundle)'
    )


def bundle_count(placement_group: Any, needed: int, what: str) -> int:
    """The bundle count of ``placement_group`` (a Ray ``PlacementGroup``), refused naming ``what`` if it
    is something else or has fewer than ``needed`` bundles."""
    from ray.util.placement_group import PlacementGroup

    if not isinstance(placement_group, PlacementGroup):
        raise TypeError(
            f"{what}: placement_group must be a Ray placement group (ray.util.placement_group), got {type(placement_group).__name__}"
        )
    if placement_group.bundle_count < needed:
        raise ValueError(f"{what}: placement_group has {placement_group.bundle_count} bundles for {needed}: one per rank")
    return placement_group.bundle_count


def in_bundle(placement_group: Any, index: int) -> dict[str, Any]:
    """Ray actor options that run an actor in bundle ``index`` of ``placement_group`` (none without one)."""
    if placement_group is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=index)}
