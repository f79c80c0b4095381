"""Multi-turn rollouts: generate -> environment step -> append observation -> repeat.

A conversation ends when its environment says it terminated, after ``max_rollout_turns`` assistant
turns, or when the next turn would not fit in ``max_seq_len`` (then it is flagged ``truncated``).
Assistant tokens are the only ones trained on (``token_mask``); rewards are summed over turns; the
generator's per-token log-probs are kept aligned with the tokens.

Records follow the data processor's per-sample spec (``rollout.data``): ``message_log`` (messages with
``role``, ``content``, ``token_ids``), ``extra_env_info``, ``loss_multiplier``, ``idx``, ``task_name``.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from .interfaces import EnvironmentInterface, EnvironmentReturn, GenerationInterface

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutLimits:
    """How long a rollout may run."""

    max_seq_len: int
    max_new_tokens: int
    max_rollout_turns: int = 1
    greedy: bool = False

    def __post_init__(self) -> None:
        for name in ("max_seq_len", "max_new_tokens", "max_rollout_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _conversation_ids(record: Mapping[str, Any]) -> torch.Tensor:
    return torch.cat([m["token_ids"] for m in record["message_log"]]) if record["message_log"] else torch.empty(0, dtype=torch.int64)


def _observation_tokens(tokenizer: Any, content: str) -> torch.Tensor:
    """Token ids of an environment turn followed by the prompt for the next assistant turn.

    Environment turns are rendered as user turns: chat templates of real models know no other role.
    """
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)


def _step_env(env: EnvironmentInterface, logs: list, metas: list, task: str) -> EnvironmentReturn | None:
    try:
        return env.step(logs, metas)
    except Exception:  # an environment bug must not kill the run: those samples score 0 and are masked
        log.exception("environment for task %r raised on a batch of %d conversations; scoring them 0", task, len(logs))
        return None


def run_multi_turn_rollout(
    generation: GenerationInterface,
    tokenizer: Any,
    records: Sequence[Mapping[str, Any]],
    task_to_env: Mapping[str, EnvironmentInterface],
    limits: RolloutLimits,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Roll every record out to the end; return the finished records and rollout metrics.

    Each returned record is a deep copy of the input with its ``message_log`` extended (assistant
    messages carry ``generation_logprobs``) and ``total_reward``, ``truncated``, ``num_turns``,
    ``env_error`` and ``weight_version`` set; ``loss_multiplier`` is 0 for conversations whose
    environment raised, whose generator returned nothing, or whose prompt did not fit.
    """
    unknown = sorted({r["task_name"] for r in records} - set(task_to_env))
    if unknown:
        raise KeyError(f"no environment registered for task(s) {unknown}; known: {sorted(task_to_env)}")
    t0 = time.perf_counter()
    out = [copy.deepcopy(dict(r)) for r in records]
    for r in out:
        r.update(total_reward=0.0, truncated=False, num_turns=0, env_error=False)
        r.setdefault("env_metadata", dict(r.get("extra_env_info") or {}))
    stop_strings: list[list[str] | None] = [None] * len(out)
    active = []
    for i, r in enumerate(out):
        if _conversation_ids(r).numel() >= limits.max_seq_len:  # no room to generate anything
            r.update(truncated=True, loss_multiplier=0.0)
        else:
            active.append(i)
    gen_tokens = 0
    version = generation.weight_version
    for _turn in range(limits.max_rollout_turns):
        if not active:
            break
        prompts = [_conversation_ids(out[i]) for i in active]
        budgets = [min(limits.max_new_tokens, limits.max_seq_len - p.numel()) for p in prompts]
        result = generation.generate(
            prompts, max_new_tokens=max(budgets), stop_strings=[stop_strings[i] for i in active], greedy=limits.greedy
        )
        version = result.weight_version
        still = []
        by_task: dict[str, list[int]] = {}
        for j, i in enumerate(active):
            r, ids, lps = out[i], result.response_ids[j][: budgets[j]], result.logprobs[j][: budgets[j]]
            gen_tokens += ids.numel()
            r["message_log"].append({
                "role": "assistant",
                "content": tokenizer.decode(ids.tolist(), skip_special_tokens=True),
                "token_ids": ids.to(torch.int64),
                "generation_logprobs": lps.to(torch.float32),
            })
            r["num_turns"] += 1
            if ids.numel() == 0:  # nothing to learn from: score 0, mask the sample
                r["loss_multiplier"] = 0.0
                continue
            if result.response_ids[j].numel() > budgets[j] or result.finish_reasons[j] == "length":
                r["truncated"] = True  # ended without a stop: cut by max_new_tokens or max_seq_len
            by_task.setdefault(r["task_name"], []).append(i)
        for task, idxs in by_task.items():
            ret = _step_env(task_to_env[task], [out[i]["message_log"] for i in idxs], [out[i]["env_metadata"] for i in idxs], task)
            for k, i in enumerate(idxs):
                r = out[i]
                if ret is None:
                    r.update(env_error=True, loss_multiplier=0.0)
                    continue
                r["total_reward"] += float(ret.rewards[k])
                r["env_metadata"] = ret.metadata[k]
                if ret.answers:
                    r["answer"] = ret.answers[k]
                if bool(ret.terminateds[k]) or r["truncated"]:
                    continue
                obs = _observation_tokens(tokenizer, ret.observations[k]["content"])
                if _conversation_ids(r).numel() + obs.numel() >= limits.max_seq_len:
                    r["truncated"] = True  # the next turn would not fit
                    continue
                r["message_log"].append({**ret.observations[k], "token_ids": obs})
                stop_strings[i] = ret.next_stop_strings[k]
                still.append(i)
        active = sorted(still)
    for r in out:
        r["weight_version"] = version
    n = max(len(out), 1)
    metrics = {
        "mean_total_reward": sum(r["total_reward"] for r in out) / n,
        "mean_turns": sum(r["num_turns"] for r in out) / n,
        "truncated_fraction": sum(r["truncated"] for r in out) / n,
        "env_error_fraction": sum(r["env_error"] for r in out) / n,
        "generated_tokens": float(gen_tokens),
        "rollout_seconds": time.perf_counter() - t0,
    }
    return out, metrics


def records_to_columns(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Flatten finished conversations into the per-sample columns of ``policy.fields``.

    Token-aligned columns are lists of 1-d tensors (one per sample, unpadded): ``input_ids``,
    ``token_mask`` (True on assistant tokens) and ``generation_logprobs`` (0 off assistant tokens);
    per-sample columns are tensors: ``input_lengths``, ``sample_mask`` (the loss multiplier),
    ``total_reward``, ``truncated``.
    """
    ids, masks, lps = [], [], []
    for r in records:
        parts_ids, parts_mask, parts_lp = [], [], []
        for m in r["message_log"]:
            t = m["token_ids"].to(torch.int64)
            parts_ids.append(t)
            is_gen = m["role"] == "assistant" and "generation_logprobs" in m
            parts_mask.append(torch.full((t.numel(),), is_gen, dtype=torch.bool))
            parts_lp.append(m["generation_logprobs"].to(torch.float32) if is_gen else torch.zeros(t.numel(), dtype=torch.float32))
        ids.append(torch.cat(parts_ids) if parts_ids else torch.empty(0, dtype=torch.int64))
        masks.append(torch.cat(parts_mask) if parts_mask else torch.empty(0, dtype=torch.bool))
        lps.append(torch.cat(parts_lp) if parts_lp else torch.empty(0, dtype=torch.float32))
    return {
        "input_ids": ids,
        "token_mask": masks,
        "generation_logprobs": lps,
        "input_lengths": torch.tensor([t.numel() for t in ids], dtype=torch.int64),
        "sample_mask": torch.tensor([float(r.get("loss_multiplier", 1.0)) for r in records], dtype=torch.float32),
        "total_reward": torch.tensor([float(r["total_reward"]) for r in records], dtype=torch.float32),
        "truncated": torch.tensor([bool(r["truncated"]) for r in records], dtype=torch.bool),
    }
