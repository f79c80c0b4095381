"""``python -m trainer.grpo_async``: asynchronous GRPO on the TQ path.

An :class:`~trainer.async_collector.AsyncTrajectoryCollector` (a Ray actor) generates prompt groups
ahead of training, on weights at most ``async_grpo.max_trajectory_age_steps`` versions old, and writes
them to a TQ partition tagged ``weight_version`` / ``target_step``. Each step ``t`` the driver:

1. waits (bounded) for every group targeted at ``t`` and takes their ``KVBatchMeta`` from TQ;
2. reads per-sample scalars only (rewards, lengths, masks) and computes advantages (``trainer.common``);
3. has the DP workers compute ``prev_logprobs`` (and reference log-probs) from TQ, and trains with
   importance-sampling correction against ``generation_logprobs`` (required: the config refuses
   async mode without ``loss.use_importance_sampling_correction``);
4. frees the step's keys and tells the collector the step is consumed;
5. waits for step ``t + 1``'s groups, then stages the new weights on the collector (from DP rank 0
   as an object ref, never through the driver) without pausing it: the generation in flight
   finishes on the old weights and the next one runs on version ``t + 1``.

Checkpoints (at the refit point, the collector quiesced) save the policy, the step and the collector's
``get_dataloader_state``: the loader position plus, per unconsumed target step, the dataset indices
(and loader epoch) of its prompts - generated into TQ or not yet. TQ contents are not saved: a resumed
run (also after the driver was killed with SIGKILL) frees whatever the dead driver left in the
partition and regenerates exactly those prompts for the same target steps on the restored weights, so
no prompt pulled from the loader is lost or trained twice (NeMo-RL's async resume lost such prompts).
The regenerated trajectories are new samples: the first resumed step trains on samples of the
restored weights (age 0) where the uninterrupted run had one-step-old ones, so an async resume is not
bit-identical to the uninterrupted run (a sync one is). Each group is tagged ``epoch`` / ``prompt_idx``
and every step's prompts go to the prompt ledger (``trainer.ledger``).

    python -m trainer.grpo_async                                  # the offline CPU recipe, async
    python -m trainer.grpo_async grpo.max_num_steps=10 async_grpo.max_trajectory_age_steps=2
"""

from __future__ import annotations

import sys
import time
from typing import Any, Mapping, Sequence

import ray
import torch

from rollout.collector import TQReplayBuffer
from tq import KVBatchMeta

from .async_collector import AsyncTrajectoryCollector
from .base import BatchSource, run
from .checkpoint import load_checkpoint
from .common import compute_step_targets
from .config import CONFIG_DIR, ConfigError, MasterConfig, validate_async
from .grpo_sync import GRPOSyncTrainer

ASYNC_CONFIG = CONFIG_DIR / "grpo_async_cpu.yaml"
PER_SAMPLE_FIELDS = ["total_reward", "truncated", "loss_multiplier", "response_lengths"]


class GRPOAsyncTrainer(GRPOSyncTrainer):
    """GRPO with generation overlapping training (see module docstring).

    Reuses the sync TQ trainer's set-up (TQ service, ``TQPolicy``, validation on the sync rollout
    actor); replaces how a step gets its samples and how the generator is refit.
    """

    name = "grpo_async"

    @classmethod
    def check_config(cls, cfg: MasterConfig) -> None:
        try:
            validate_async(cfg)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def __init__(self, cfg: MasterConfig) -> None:
        self.check_config(cfg)
        self._resume_state: dict[str, Any] | None = None
        self.collector: Any = None
        super().__init__(cfg)
        try:
            self._start_collector()
        except BaseException:
            self.shutdown()
            raise

    def owned_partitions(self) -> list[str]:
        return [*super().owned_partitions(), self.cfg.async_grpo.partition_id]

    def algorithm_line(self) -> str:
        a = self.cfg.async_grpo
        return (
            f"GRPO (asynchronous: generation runs ahead on weights at most {a.max_trajectory_age_steps} step(s) old, "
            f"importance-sampling correction; {self.path_name})"
        )

    # ------------------------------------------------------------------ collector
    def _start_collector(self) -> None:
        cfg, a = self.cfg, self.cfg.async_grpo
        buffer = TQReplayBuffer(
            self.connection,
            partition_id=a.partition_id,
            capacity=(a.max_buffered_groups or (a.max_trajectory_age_steps + 1) * cfg.grpo.num_prompts_per_step)
            * cfg.grpo.num_generations_per_prompt,
        )
        env = {"name": cfg.env.name, **({"num_workers": cfg.env.num_workers} if cfg.env.name == "math" else {})}
        self.collector = AsyncTrajectoryCollector.options(num_cpus=a.collector_num_cpus).remote(
            cfg.generation.model_dump(),
            cfg.policy.tokenizer_name,
            {cfg.env.name: env},
            cfg.model_dump(),
            buffer,
            self.step,
        )
        # The generator starts on the policy's weights at version = the start step (a resumed run's too).
        self._refit_collector(self.step, state=(self._resume_state or {}).get("collector"), first=True)

    def _refit_collector(self, version: int, state: dict[str, Any] | None = None, first: bool = False) -> None:
        c = self.collector
        self.get(c.prepare_for_refit.remote(), "collector prepare_for_refit")
        weights = self.refit_weights()
        self.get(c.update_weights.remote(weights, version), "collector update_weights")
        if first:
            self.get(c.start_collection.remote(state), "collector start_collection")
        self.get(c.resume_after_refit.remote(), "collector resume_after_refit")

    def refit_generation(self) -> None:
        """Wait for the next step's groups (version ``step`` can no longer target it), then stage the
        new weights: generation keeps running, the collector switches at its next call."""
        if self.collector is None or self.step >= self.cfg.grpo.max_num_steps:  # nothing left to generate for
            return
        self.get(self.collector.wait_for_target.remote(self.step), f"trajectories of step {self.step}")
        weights = self.refit_weights()
        self.get(self.collector.stage_weights.remote(weights, self.step), "collector stage_weights")

    loader_state_key = "collector"

    def saved_loader_state(self, state: Mapping[str, Any]) -> Any:
        """The collector's data loader state (the collector draws the prompts in async mode)."""
        collector = state.get("collector")
        return collector.get("loader") if isinstance(collector, dict) else None

    def _maybe_resume(self) -> None:
        path = self.resume_from
        if path is None:
            return
        state = load_checkpoint(path, self.policy)
        self.step = int(state["step"])
        self._resume_state = state
        print(f"resumed from {path} at step {self.step}", flush=True)

    def _checkpoint(self) -> None:
        c = self.collector
        self.get(c.prepare_for_refit.remote(), "collector quiesce for checkpoint")
        try:
            collector_state = self.get(c.get_dataloader_state.remote(), "collector state")
            self._save_checkpoint({"collector": collector_state})
        finally:
            self.get(c.resume_after_refit.remote(), "collector resume")

    # ------------------------------------------------------------------ a step
    def _take_step_meta(self, step: int) -> tuple[KVBatchMeta, dict[str, Any]]:
        stats = self.get(self.collector.wait_for_target.remote(step), f"trajectories of step {step}")
        with self.policy.calls.driver_tq():
            meta = self.policy.client.get_meta(self.cfg.async_grpo.partition_id)
        tags = meta.tags.get("target_step", ())
        meta = meta.select([i for i, t in enumerate(tags) if t == step])
        g = self.cfg.grpo
        want = g.num_prompts_per_step * g.num_generations_per_prompt
        if len(meta) != want:
            raise RuntimeError(f"step {step}: TQ holds {len(meta)} samples targeted at it, expected {want}")
        ages = [step - v for v in meta.tags["weight_version"]]
        if max(ages) > self.cfg.async_grpo.max_trajectory_age_steps or min(ages) < 0:
            raise RuntimeError(f"step {step}: trajectory ages {sorted(set(ages))} break async_grpo.max_trajectory_age_steps")
        return meta, stats

    def train_step(self, batches: BatchSource) -> dict[str, float]:
        g, timing, step = self.cfg.grpo, {}, self.step
        t = time.perf_counter()
        meta, stats = self._take_step_meta(step)
        timing["wait_for_trajectories"] = time.perf_counter() - t

        cols = self._read(meta, PER_SAMPLE_FIELDS)
        uid_ids: dict[str, int] = {}
        prompt_ids = torch.tensor([uid_ids.setdefault(u, len(uid_ids)) for u in meta.tags["uid"]], dtype=torch.int64)
        targets = compute_step_targets(
            g,
            rewards=cols["total_reward"],
            prompt_ids=prompt_ids,
            response_lengths=cols["response_lengths"],
            truncated=cols["truncated"],
            loss_multiplier=cols["loss_multiplier"],
        )
        # The prompt ledger: one (epoch, dataset idx) per group, in batch order.
        groups = dict.fromkeys(zip(meta.tags["uid"], meta.tags["epoch"], meta.tags["prompt_idx"]))
        batches.trained = [(int(e), int(i)) for _, e, i in groups]
        out, meta = self.learn_from_meta(meta, targets, timing)
        self.policy.finish_step(meta, clear_partition=False)  # later steps' groups share the partition
        self.get(self.collector.release_target.remote(step), "collector release_target")

        ages = torch.tensor([step - v for v in meta.tags["weight_version"]], dtype=torch.int64)
        # The staleness histogram: samples consumed this step per policy-version lag 0..max age.
        counts = torch.bincount(ages, minlength=self.cfg.async_grpo.max_trajectory_age_steps + 1).tolist()
        ages = ages.to(torch.float32)
        out.update(
            {
                "async/trajectory_age_counts": counts,
                "async/trajectory_age_mean": float(ages.mean()),
                "async/trajectory_age_max": float(ages.max()),
                "async/buffered_groups": float(stats["held_groups"]),
                "async/failed_generations": float(stats["failed_generations"]),
                "async/generation_refit_s": float(stats["last_refit_s"]),
            }
        )
        return out

    def fit(self) -> list[dict[str, Any]]:
        """Train (``GRPOTrainerBase.fit``), then stop generation and free the groups generated ahead for
        steps beyond the run (after the last checkpoint recorded their prompts), so TQ ends empty."""
        history = super().fit()
        self.get(self.collector.prepare_for_refit.remote(), "collector quiesce at the end")
        freed = self.policy.client.clear_partition(self.cfg.async_grpo.partition_id)
        if history:
            history[-1]["async/unused_samples_freed"] = float(freed)
        return history

    def validate(self) -> dict[str, float]:
        """Greedy validation on the sync rollout actor, refit first with the current weights."""
        self.get(self.rollout.update_weights.remote(self.refit_weights(), self.step), "validation refit")
        return super().validate()

    def shutdown(self) -> None:
        """Stop the collector (bounded), then the policy, the rollout actor and the TQ service."""
        try:
            if self.collector is not None:
                try:
                    ray.get(self.collector.shutdown.remote(), timeout=60)
                except Exception as exc:  # still kill it below; the error is reported, not hidden
                    print(f"warning: collector shutdown: {exc!r}", file=sys.stderr)
                ray.kill(self.collector)
                self.collector = None
        finally:
            super().shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry; without ``--config`` the async CPU recipe is the base config."""
    return run(GRPOAsyncTrainer, argv, default_config=str(ASYNC_CONFIG))


if __name__ == "__main__":
    sys.exit(main())
