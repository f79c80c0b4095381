"""Where a policy's DP ranks run: a bundle of a placement group per rank, and ranks that Ray put on one
GPU refused before NCCL meets them (``common.placement``; the GPU cases run where CUDA is)."""

from __future__ import annotations

import pytest
import torch

from common.placement import ranks_sharing_a_gpu, shared_gpu_error
from policy.policy import Policy, PolicyConfig

ray = pytest.importorskip("ray")


def test_ranks_given_the_same_gpu_of_a_node_are_found():
    assert ranks_sharing_a_gpu([("a", ["0"]), ("a", ["1"]), ("b", ["0"])]) == {}  # GPU 0 of two nodes
    assert ranks_sharing_a_gpu([("a", ["0"]), ("a", ["1"]), ("a", ["0"])]) == {("a", "0"): [0, 2]}
    assert ranks_sharing_a_gpu([("a", ["0", "1"]), ("a", ["1", "1"])]) == {("a", "1"): [0, 1]}  # a rank once per GPU
    assert ranks_sharing_a_gpu([("a", []), ("a", [])]) == {}  # CPU ranks share nothing
    msg = shared_gpu_error({("0123456789abcdef", "3"): [0, 1]}, 0.5)
    assert "ranks [0, 1]" in msg and "GPU 3 of Ray node 0123456789ab:" in msg and "num_gpus_per_worker=0.5" in msg
    assert "placement_group=" in msg and '{"GPU": 1}' in msg


def test_a_placement_group_needs_a_bundle_per_rank(ray_session):
    pg = ray.util.placement_group([{"CPU": 0.1}])
    try:
        with pytest.raises(ValueError, match=r"placement_group has 1 bundles for policy.dp_size=2: one per rank"):
            Policy(PolicyConfig(dp_size=2), placement_group=pg)
    finally:
        ray.util.remove_placement_group(pg)


CUDA = torch.cuda.is_available()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_two_nccl_ranks_ray_packed_onto_one_gpu_are_refused_naming_the_fix(ray_session):
    """Half a GPU per rank and no placement group: Ray puts both ranks on one GPU; the group refuses
    them with the ranks, the GPU and the fix (NCCL's own error names none of them)."""
    cfg = PolicyConfig(dp_size=2, train_global_batch_size=2, num_gpus_per_worker=0.5, num_cpus_per_worker=0.5, ray_timeout_s=120)
    with pytest.raises(ValueError, match=r"policy ranks \[0, 1\] were all placed on GPU .* placement_group="):
        Policy(cfg)


@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_half_gpu_ranks_in_a_bundle_each_get_a_gpu_each_and_form_their_group(ray_session):
    pg = ray.util.placement_group([{"GPU": 1, "CPU": 0.5}] * 2)
    try:
        ray.get(pg.ready(), timeout=60)
        cfg = PolicyConfig(dp_size=2, train_global_batch_size=2, num_gpus_per_worker=0.5, num_cpus_per_worker=0.5, ray_timeout_s=120)
        with Policy(cfg, placement_group=pg) as policy:
            where = ray.get([w.placement.remote() for w in policy.workers])
            assert ranks_sharing_a_gpu(where) == {} and all(len(g) == 1 for _, g in where), where
            assert [i["world_size"] for i in policy.worker_info] == [2, 2]
    finally:
        ray.util.remove_placement_group(pg)
