"""``python -m trainer.grpo_sync``: synchronous GRPO on the TQ path.

Bulk data never reaches the driver. Per step (DESIGN.md's lifecycle): the rollout actor writes the
samples' columns to TQ and returns a ``KVBatchMeta`` plus per-sample scalars; the driver computes
advantages on those scalars; DP workers fetch their shards to compute log-probs, per-sample
reductions and the update; the driver writes back per-sample ``advantages`` / ``sample_mask`` and
clears the step's keys at the end (the store is empty between steps).

    python -m trainer.grpo_sync                                   # the offline CPU default
    python -m trainer.grpo_sync grpo.max_num_steps=10 data_plane.address=tcp://host:5555
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from policy.policy import VAL_PARTITION, TQPolicy
from tq import KVBatchMeta, TQConnection, TQServer

from . import algorithms as A
from .base import BatchSource, GRPOTrainerBase, run
from .common import compute_step_targets, dynamic_sampling_keep
from .config import MasterConfig


class GRPOSyncTrainer(GRPOTrainerBase):
    """GRPO whose data plane is TQ (see module docstring)."""

    name = "grpo_sync"
    uses_dataplane = True
    path_name = "TQ path: workers fetch their shards from the data plane"

    def __init__(self, cfg: MasterConfig) -> None:
        if cfg.grpo.message_advantage_penalties:
            keys = ", ".join(f"grpo.message_advantage_penalties.{k}" for k in cfg.grpo.message_advantage_penalties)
            raise NotImplementedError(
                f"{keys}: message-level advantage penalties are not implemented on the TQ trainer (they need each "
                "sample's message log on the driver); use trainer.grpo or remove them"
            )
        dp = cfg.data_plane
        self.tq_server: TQServer | None = None
        if dp.address is None:  # bootstrap a controller and its storage units on the driver's host
            self.tq_server = TQServer(storage_units=dp.storage_units, capacity=dp.capacity_bytes, secret=dp.secret)
        # The one data-plane connection: the policy, its DP workers and the rollout actors all get it.
        self.connection: TQConnection = dp.connection(self.tq_server.address if self.tq_server is not None else None)
        if self.tq_server is None:  # a running tq-controller: fail fast, naming it, if it does not answer
            self.connection.replace(timeout_s=min(dp.timeout_s, 10.0)).connect().close()
        try:
            super().__init__(cfg)
        except BaseException:
            if self.tq_server is not None:
                self.tq_server.shutdown()
            raise
        if self.tq_server is None:
            self._free_leftovers()

    def owned_partitions(self) -> list[str]:
        """The TQ partitions this trainer writes (scratch space: nothing in them is needed to resume)."""
        return [self.policy.train_partition, VAL_PARTITION]

    def _free_leftovers(self) -> None:
        """Free keys a previous driver left in this trainer's partitions of a long-lived TQ service (it
        was killed mid-step, or generating ahead): a resumed run regenerates what it needs from its
        checkpoint, so none of it may be read again."""
        held = {p["partition"]: p["keys"] for p in self.policy.client.list_partitions()}
        for part in self.owned_partitions():
            if held.get(part):
                freed = self.policy.client.clear_partition(part)
                print(f"freed {freed} keys a previous driver left in TQ partition {part!r}", flush=True)

    def _drop_partitions(self) -> None:
        """At exit, unregister this trainer's partitions of a long-lived TQ service (freeing any key left)."""
        from tq.errors import PartitionNotFoundError

        try:
            with self.connection.replace(timeout_s=10.0).connect() as client:
                for part in self.owned_partitions():
                    try:
                        client.drop_partition(part)
                    except PartitionNotFoundError:
                        pass
        except Exception as exc:  # the service may be gone; exiting must not fail on it
            print(f"warning: could not drop the TQ partitions {self.owned_partitions()}: {exc!r}", file=sys.stderr, flush=True)

    def dataplane_line(self) -> str:
        dp = self.cfg.data_plane
        if self.tq_server is not None:
            return (
                f"{self.connection.address} (started here: {dp.storage_units} storage unit(s), "
                f"{dp.capacity_bytes / 2**20:.0f} MiB; stops with the run)"
            )
        return f"{self.connection.address} (a running tq-controller)"

    @property
    def tq_address(self) -> str:
        """The TQ controller's address (bootstrapped here or configured)."""
        return self.connection.address

    def build_policy(self) -> TQPolicy:
        return TQPolicy(self.cfg.policy, self.connection, calls=self.new_calls(), placement_group=self.placement_group)

    def rollout_kwargs(self) -> dict[str, Any]:
        return {"connection": self.connection}

    def _read(self, meta: KVBatchMeta, fields: list[str]) -> dict[str, Any]:
        return self.policy.read_from_dataplane(meta, fields)  # the policy counts the bytes received

    def _rollout(self, batches: BatchSource) -> tuple[KVBatchMeta, dict[str, Any], dict[str, float]]:
        """Roll out until enough groups survive dynamic sampling; dropped keys leave the store at once."""
        g = self.cfg.grpo
        want = g.num_prompts_per_step * g.num_generations_per_prompt
        metas: list[KVBatchMeta] = []
        carries: list[dict[str, Any]] = []
        metrics: dict[str, float] = {}
        kept = 0
        while kept < want:
            batches.check_budget(kept, want, g.dynamic_sampling_max_gen_batches)
            meta, carry, rmetrics, gmetrics = self.get(
                self.send(self.rollout.rollout_to_tq, batches.next(), self.policy.train_partition, g.num_generations_per_prompt),
                "rollout_to_tq",
            )
            metrics = {**{f"rollout/{k}": v for k, v in rmetrics.items()}, **{f"generation/{k}": v for k, v in gmetrics.items()}}
            keep = dynamic_sampling_keep(g, carry["total_reward"], carry["prompt_ids"] + 1_000_000 * len(metas), carry["loss_multiplier"])
            if not bool(keep.all()):
                self.policy.discard_samples(meta.select((~keep).numpy()))
                meta = meta.select(keep.numpy())
                carry = {
                    k: (v[keep] if isinstance(v, torch.Tensor) else [x for x, k_ in zip(v, keep.tolist()) if k_]) for k, v in carry.items()
                }
            carry["prompt_ids"] = carry["prompt_ids"] + 1_000_000 * len(metas)  # groups never span batches
            metas.append(meta)
            carries.append(carry)
            kept += len(meta)
        meta = KVBatchMeta.concat(metas) if len(metas) > 1 else metas[0]
        carry = {
            k: (torch.cat([c[k] for c in carries]) if isinstance(carries[0][k], torch.Tensor) else sum((list(c[k]) for c in carries), []))
            for k in carries[0]
        }
        if len(meta) > want:  # whole groups came back: drop the surplus past the step's size
            self.policy.discard_samples(meta.slice(want, len(meta)))
            meta = meta.slice(0, want)
            carry = {k: v[:want] for k, v in carry.items()}
        batches.settle(carry["prompt_ids"].tolist())  # the prompt ledger: what this step trains on
        metrics["generation_batches"] = float(batches.drawn)
        return meta, carry, metrics

    def train_step(self, batches: BatchSource) -> dict[str, float]:
        g, timing = self.cfg.grpo, {}
        t = time.perf_counter()
        self.policy.prepare_step(g.num_prompts_per_step * g.num_generations_per_prompt, g.num_generations_per_prompt)
        meta, carry, metrics = self._rollout(batches)
        timing["generation"] = time.perf_counter() - t

        targets = compute_step_targets(
            g,
            rewards=carry["total_reward"],
            prompt_ids=carry["prompt_ids"],
            response_lengths=carry["response_lengths"],
            truncated=carry["truncated"],
            loss_multiplier=carry["loss_multiplier"],
        )
        out, meta = self.learn_from_meta(meta, targets, timing)
        out["store_bytes"] = float(self.policy.store_bytes())  # the step's peak: every column written
        self.policy.finish_step(meta)
        out.update(metrics)
        return out

    def learn_from_meta(self, meta: KVBatchMeta, targets: Any, timing: dict[str, float]) -> tuple[dict[str, float], KVBatchMeta]:
        """Log-probs and per-sample reductions on the workers, advantages and the sample mask written
        back, one training pass; returns the step's metrics and the meta (not yet cleared)."""
        g = self.cfg.grpo
        t = time.perf_counter()
        # Per-token work stays on the workers: the log-prob pass also writes the per-sample reductions.
        meta = self.policy.get_logprobs_from_meta(meta, with_reductions=True)
        if self.cfg.loss.reference_policy_kl_penalty > 0:
            meta = self.policy.get_reference_policy_logprobs_from_meta(meta)
        timing["logprobs"] = time.perf_counter() - t

        t = time.perf_counter()
        red = self._read(meta, ["seq_logprob_error", "seq_mult_prob_error"])
        sample_mask = targets.sample_mask * A.seq_logprob_error_mask(red["seq_logprob_error"], g.seq_logprob_error_threshold)
        meta = self.policy.write_to_dataplane(meta, {"advantages": targets.advantages}, overwrite=False)
        meta = self.policy.write_to_dataplane(meta, {"sample_mask": sample_mask}, overwrite=True)
        timing["data_movement"] = time.perf_counter() - t

        t = time.perf_counter()
        train = self.policy.train_from_meta(meta, self.loss_fn)
        timing["training"] = time.perf_counter() - t
        out = {**targets.metrics, **{k: float(v) for k, v in train.items() if isinstance(v, (int, float))}}
        out["seq_logprob_error"] = float(red["seq_logprob_error"].mean())
        out["seq_mult_prob_error"] = float(red["seq_mult_prob_error"].mean())
        out.update({f"timing/{k}": v for k, v in timing.items()})
        return out, meta

    def validate(self) -> dict[str, float]:
        g = self.cfg.grpo
        part = self.policy.prepare_val_partition()
        records = [self.val_dataset[i] for i in range(min(len(self.val_dataset), g.max_val_samples))]
        meta, carry, _, _ = self.get(
            self.send(self.rollout.rollout_to_tq, records, part, g.val_num_generations, validation=True, greedy=g.val_num_generations == 1),
            "validation rollout",
        )
        self.get(self.rollout.finish_generation.remote(), "finish_generation")
        self.policy.discard_samples(meta)
        correct = (carry["total_reward"] >= 1.0).to(torch.float32)
        out = {"accuracy": float(correct.mean()), "reward": float(carry["total_reward"].mean())}
        if g.val_num_generations > 1:
            out[f"pass@{g.val_num_generations}"] = A.pass_at_k(correct, carry["prompt_ids"], g.val_num_generations)
        return out

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self.tq_server is not None:
                self.tq_server.shutdown()
            else:
                self._drop_partitions()


def main(argv: list[str] | None = None) -> int:
    return run(GRPOSyncTrainer, argv)


if __name__ == "__main__":
    sys.exit(main())
