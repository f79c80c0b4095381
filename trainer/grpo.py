"""``python -m trainer.grpo``: synchronous GRPO on the legacy path (driver-side batches).

The same algorithm and loop as ``trainer.grpo_sync``, but every rollout comes back to the driver as a
``BatchedDataDict``, which the driver shards (with the same function as the TQ path) and ships to the
DP workers through Ray for log-probs and training. It is the baseline the TQ path is measured against.

    python -m trainer.grpo                                        # the offline CPU default
"""

from __future__ import annotations

import sys
import time

import torch

from common.batched_data_dict import BatchedDataDict
from policy.logprobs import per_sample_reductions
from policy.policy import Policy

from . import algorithms as A
from .base import BatchSource, GRPOTrainerBase, run
from .common import compute_step_targets, dynamic_sampling_keep

TRAIN_COLUMNS = ("input_ids", "input_lengths", "generation_logprobs", "token_mask", "sample_mask")


class GRPOTrainer(GRPOTrainerBase):
    """GRPO with driver-side batches (see module docstring)."""

    name = "grpo"

    def build_policy(self) -> Policy:
        return Policy(self.cfg.policy, calls=self.new_calls(), placement_group=self.placement_group)

    def _rollout(self, batches: BatchSource) -> tuple[BatchedDataDict, dict[str, float]]:
        """Roll out until enough groups survive dynamic sampling."""
        g = self.cfg.grpo
        want = g.num_prompts_per_step * g.num_generations_per_prompt
        parts: list[BatchedDataDict] = []
        metrics: dict[str, float] = {}
        kept = 0
        while kept < want:
            batches.check_budget(kept, want, g.dynamic_sampling_max_gen_batches)
            data, rmetrics, gmetrics = self.get(self.send(self.rollout.rollout, batches.next(), g.num_generations_per_prompt), "rollout")
            metrics = {**{f"rollout/{k}": v for k, v in rmetrics.items()}, **{f"generation/{k}": v for k, v in gmetrics.items()}}
            keep = dynamic_sampling_keep(g, data["total_reward"], data["prompt_ids"], data["loss_multiplier"])
            if not bool(keep.all()):
                data = data.select_indices(torch.nonzero(keep).flatten())
            data["prompt_ids"] = data["prompt_ids"] + 1_000_000 * len(parts)  # groups never span batches
            parts.append(data)
            kept += data.size
        data = BatchedDataDict.from_batches(parts) if len(parts) > 1 else parts[0]
        if data.size > want:
            data = data.slice(0, want)
        batches.settle(data["prompt_ids"].tolist())  # the prompt ledger: what this step trains on
        metrics["generation_batches"] = float(batches.drawn)
        return data, metrics

    def train_step(self, batches: BatchSource) -> dict[str, float]:
        g, timing = self.cfg.grpo, {}
        t = time.perf_counter()
        data, metrics = self._rollout(batches)
        timing["generation"] = time.perf_counter() - t

        targets = compute_step_targets(
            g,
            rewards=data["total_reward"],
            prompt_ids=data["prompt_ids"],
            response_lengths=data["response_lengths"],
            truncated=data["truncated"],
            loss_multiplier=data["loss_multiplier"],
        )
        t = time.perf_counter()
        train_data = data.select_columns(TRAIN_COLUMNS)
        train_data["prev_logprobs"] = self.policy.get_logprobs(train_data)["logprobs"]
        if self.cfg.loss.reference_policy_kl_penalty > 0:
            train_data["reference_policy_logprobs"] = self.policy.get_reference_policy_logprobs(train_data)["reference_logprobs"]
        red = per_sample_reductions(train_data)
        timing["logprobs"] = time.perf_counter() - t

        t = time.perf_counter()
        if g.message_advantage_penalties:  # needs each sample's message log: the legacy driver has it
            roles = [[m["role"] for m in log] for log in data["message_log"]]
            penalty = torch.tensor([sum(g.message_advantage_penalties.get(r, 0.0) for r in rs) for rs in roles])
            targets.advantages = targets.advantages - penalty
        train_data["advantages"] = targets.advantages
        train_data["sample_mask"] = targets.sample_mask * A.seq_logprob_error_mask(red["seq_logprob_error"], g.seq_logprob_error_threshold)
        timing["data_movement"] = time.perf_counter() - t

        t = time.perf_counter()
        train = self.policy.train(train_data, self.loss_fn)
        timing["training"] = time.perf_counter() - t
        out = {**targets.metrics, **metrics, **{k: float(v) for k, v in train.items() if isinstance(v, (int, float))}}
        out["seq_logprob_error"] = float(red["seq_logprob_error"].mean())
        out["seq_mult_prob_error"] = float(red["seq_mult_prob_error"].mean())
        out.update({f"timing/{k}": v for k, v in timing.items()})
        return out

    def validate(self) -> dict[str, float]:
        g = self.cfg.grpo
        records = [self.val_dataset[i] for i in range(min(len(self.val_dataset), g.max_val_samples))]
        data, _, _ = self.get(
            self.send(self.rollout.rollout, records, g.val_num_generations, validation=True, greedy=g.val_num_generations == 1),
            "validation rollout",
        )
        self.get(self.rollout.finish_generation.remote(), "finish_generation")
        correct = (data["total_reward"] >= 1.0).to(torch.float32)
        out = {"accuracy": float(correct.mean()), "reward": float(data["total_reward"].mean())}
        if g.val_num_generations > 1:
            out[f"pass@{g.val_num_generations}"] = A.pass_at_k(correct, data["prompt_ids"], g.val_num_generations)
        return out


def main(argv: list[str] | None = None) -> int:
    return run(GRPOTrainer, argv)


if __name__ == "__main__":
    sys.exit(main())
