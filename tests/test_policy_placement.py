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


def test_a_placement_group_must_be_one_with_a_bundle_per_rank(ray_session):
    pg = ray.util.placement_group([{"CPU": 0.1}])
    try:
        with pytest.raises(ValueError, match=r"policy.dp_size=2: placement_group has 1 bundles for 2: one per rank"):
            Policy(PolicyConfig(dp_size=2), placement_group=pg)
        with pytest.raises(TypeError, match=r"placement_group must be a Ray placement group .*got str"):
            Policy(PolicyConfig(dp_size=2), placement_group="pg")
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


@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_colocated_run_puts_a_policy_rank_and_a_generation_worker_on_each_gpu(ray_session, tmp_path):
    """The trainer with half-GPU ranks and generation workers on 2 GPUs: its placement group has a
    bundle per rank, the ranks are on different GPUs, each generation worker is on a rank's GPU, and a
    step trains (on the module's 2-CPU Ray: every actor asks for a quarter of a CPU)."""
    from trainer.config import parse_cli
    from trainer.grpo_sync import GRPOSyncTrainer

    cfg = parse_cli(
        [
            *("policy.dp_size=2", "policy.num_gpus_per_worker=0.5", "policy.num_cpus_per_worker=0.25"),
            *("generation.backend=hf", "generation.device=cuda", "generation.ray_workers=2"),
            *("generation.num_gpus_per_worker=0.5", "generation.num_cpus_per_worker=0.25"),
            *("grpo.max_num_steps=1", "grpo.val_period=0", "checkpointing.enabled=false"),
            *("logger.tensorboard=false", "logger.plot=false", "logger.progress=false", f"logger.log_dir={tmp_path}"),
        ]
    )
    trainer = GRPOSyncTrainer(cfg)
    try:
        assert trainer.placement_group is not None and trainer.placement_group.bundle_count == 2
        ranks = ray.get([w.placement.remote() for w in trainer.policy.workers])
        assert ranks_sharing_a_gpu(ranks) == {} and all(len(g) == 1 for _, g in ranks), ranks
        gens = ray.get(
            trainer.rollout.__ray_call__.remote(
                lambda actor: ray.get(
                    [w.__ray_call__.remote(lambda _: [str(g) for g in ray.get_gpu_ids()]) for w in actor.generation.workers]
                )
            )
        )
        assert sorted(g for (g,) in gens) == sorted(g for _, (g,) in ranks), (gens, ranks)  # a worker per rank's GPU
        assert "2 policy worker(s), a GPU each (placement group of 2 bundles, shared with the generation workers)" in "\n".join(
            trainer.startup_lines()
        )
        assert len(trainer.fit()) == 1
    finally:
        trainer.shutdown()


def test_a_placement_group_only_places_ray_generation_workers():
    from rollout.generation import make_generation_backend

    with pytest.raises(ValueError, match=r"placement_group places Ray generation workers: it needs generation.ray_workers > 0"):
        make_generation_backend({"backend": "synthetic", "ray_workers": 0}, placement_group=object())
