"""Multi-turn rollouts: generate -> environment step -> append observation -> repeat.

A conversation ends when its environment says it terminated, after ``max_rollout_turns`` assistant
turns, or when the next turn would not fit in ``max_seq_len``. It is flagged ``truncated`` when it did
not end naturally: cut by ``max_seq_len``, its last assistant turn stopped at a length limit instead
of a stop token/string, or it ran out of turns before the environment terminated it. Assistant tokens
are the only ones trained on (``token_mask``); rewards are summed over turns (then passed through the
environment's ``global_post_process_and_metrics`` hook); the generator's per-token log-probs are kept
aligned with the tokens.

Input records follow the data processor's per-sample spec (``rollout.data.DatumSpec``):
``message_log`` (messages with ``role``, ``content``, ``token_ids``), ``extra_env_info``,
``loss_multiplier``, ``idx``, ``task_name``. Two drivers share the per-turn logic:
``run_multi_turn_rollout`` (batched, one ``generate`` call per turn for all live conversations) and
``run_conversation_async`` (one conversation on ``generate_async``, for concurrent group rollouts).

Bad input, as a user expects it:
- a malformed record: ``DatasetError`` naming the record (and its dataset row) before anything runs;
- a prompt that leaves no room to generate: no generation, reward 0, ``loss_multiplier`` 0, truncated;
- an environment that raises: only the conversations that make it raise (found by retrying the
  failed batch one conversation at a time) get reward 0 and ``loss_multiplier`` 0 (``env_error``);
- an environment (or its post-processing hook) returning a NaN / inf reward: ``EnvironmentContractError``
  naming the task and the dataset row (it would zero its group's advantages or make the loss NaN);
- a generation of zero tokens: nothing to train on, so reward 0 and ``loss_multiplier`` 0
  (``empty_generation``). A response that is only a stop token is a real action of the policy: the
  environment scores it (an empty answer scores 0) and it stays in the loss, so the policy learns
  not to stop early.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Sequence

import torch

from .data import DatasetError
from .interfaces import EnvironmentInterface, EnvironmentReturn, GenerationInterface, GenerationOutput

log = logging.getLogger(__name__)

GenerateAsyncFn = Callable[..., Awaitable[GenerationOutput]]


@dataclass(frozen=True)
class RolloutLimits:
    """How long a rollout may run (``max_seq_len`` counts prompt, responses and observations)."""

    max_seq_len: int
    max_new_tokens: int
    max_rollout_turns: int = 1
    greedy: bool = False

    def __post_init__(self) -> None:
        for name in ("max_seq_len", "max_new_tokens", "max_rollout_turns"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


class EnvironmentContractError(RuntimeError):
    """An environment returned something that breaks the ``EnvironmentReturn`` contract (a bug in it)."""


# ------------------------------------------------------------------------------------ validation
def _where(pos: int, record: Any) -> str:
    idx = record.get("idx") if isinstance(record, Mapping) else None
    return f"record {pos}" + (f" (dataset row {idx})" if idx is not None else "")


def validate_records(records: Sequence[Any], task_to_env: Mapping[str, EnvironmentInterface]) -> None:
    """Raise ``DatasetError`` naming the first record that cannot be rolled out, and why.

    Checked before anything is generated, so a bad record never leaves a half-written batch behind.
    """
    for pos, r in enumerate(records):
        where = _where(pos, r)
        if not isinstance(r, Mapping):
            raise DatasetError(f"{where}: expected a mapping (a DatumSpec), got {type(r).__name__}")
        log_ = r.get("message_log")
        if not isinstance(log_, list) or not log_:
            raise DatasetError(f"{where}: 'message_log' must be a non-empty list of messages, got {type(log_).__name__}")
        total = 0
        for j, m in enumerate(log_):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise DatasetError(f"{where}: message {j} must be a mapping with a string 'role'")
            t = m.get("token_ids")
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
                raise DatasetError(f"{where}: message {j} needs 'token_ids' as a 1-d integer tensor, got {type(t).__name__}")
            total += t.numel()
        if total == 0:
            raise DatasetError(f"{where}: the prompt has no tokens")
        task = r.get("task_name")
        if task not in task_to_env:
            raise DatasetError(f"{where}: no environment registered for task {task!r}; known: {sorted(task_to_env)}")
        info = r.get("extra_env_info")
        if info is not None and not isinstance(info, Mapping):
            raise DatasetError(f"{where}: 'extra_env_info' must be a mapping, got {type(info).__name__}")
        lm = r.get("loss_multiplier", 1.0)
        if isinstance(lm, torch.Tensor):
            lm = lm.item()
        if isinstance(lm, bool) or not isinstance(lm, (int, float)):
            raise DatasetError(f"{where}: 'loss_multiplier' must be a number, got {type(lm).__name__}")


# ------------------------------------------------------------------------------------ per-turn logic
def _conversation_ids(record: Mapping[str, Any]) -> torch.Tensor:
    return torch.cat([m["token_ids"].to(torch.int64) for m in record["message_log"]])


def _observation_tokens(tokenizer: Any, content: str) -> torch.Tensor:
    """Token ids of an environment turn followed by the prompt for the next assistant turn.

    Environment turns are rendered as user turns: chat templates of real models know no other role.
    A tokenizer without a chat template gets the raw content (the environment formats it).
    """
    if getattr(tokenizer, "chat_template", None):
        content = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    return torch.tensor(tokenizer(content, add_special_tokens=False)["input_ids"], dtype=torch.int64)


def _start(record: Mapping[str, Any], limits: RolloutLimits, version: int) -> dict[str, Any]:
    """A private copy of ``record`` with the rollout's bookkeeping fields; ``_active`` says if it can generate."""
    r = copy.deepcopy(dict(record))
    prompt_len = int(_conversation_ids(r).numel())
    lm = r.get("loss_multiplier", 1.0)
    r.update(
        loss_multiplier=float(lm.item() if isinstance(lm, torch.Tensor) else lm),
        total_reward=0.0,
        truncated=False,
        terminated=False,
        num_turns=0,
        env_error=False,
        empty_generation=False,
        weight_version=None,
        finish_reason=None,
        answer=None,
        prompt_length=prompt_len,
        response_length=0,
        stop_strings=None,
        env_metadata=dict(r.get("extra_env_info") or {}),
    )
    r["_active"] = prompt_len < limits.max_seq_len
    if not r["_active"]:  # no room to generate anything: nothing to learn from
        r.update(truncated=True, loss_multiplier=0.0, weight_version=version)
    return r


def _next_prompt(r: Mapping[str, Any], limits: RolloutLimits) -> tuple[torch.Tensor, int]:
    ids = _conversation_ids(r)
    return ids, min(limits.max_new_tokens, limits.max_seq_len - ids.numel())


def _take_generation(
    r: dict[str, Any], ids: torch.Tensor, lps: torch.Tensor, reason: str, budget: int, version: int, tokenizer: Any
) -> bool:
    """Append one assistant turn (cut to ``budget``); True when the environment should step it."""
    if ids.numel() != lps.numel():
        raise RuntimeError(f"the generation backend returned {ids.numel()} tokens but {lps.numel()} log-probs")
    cut = ids.numel() > budget
    ids, lps = ids[:budget].to(torch.int64), lps[:budget].to(torch.float32)
    r["weight_version"] = version if r["weight_version"] is None else min(r["weight_version"], version)
    if ids.numel() == 0:  # no token carries a log-prob: nothing to train on
        r.update(empty_generation=True, loss_multiplier=0.0, total_reward=0.0, _active=False)
        return False
    r["message_log"].append(
        {
            "role": "assistant",
            "content": tokenizer.decode(ids.tolist(), skip_special_tokens=True),
            "token_ids": ids,
            "generation_logprobs": lps,
        }
    )
    r["num_turns"] += 1
    r["response_length"] += int(ids.numel())
    r["finish_reason"] = "length" if cut else reason
    return True


@dataclass
class _EnvStep:
    observation: dict[str, Any]
    metadata: dict[str, Any]
    stop_strings: list[str] | None
    reward: float
    terminated: bool
    answer: str | None


def _check_finite_rewards(rewards: torch.Tensor, task: str, records: Sequence[Mapping[str, Any]], what: str) -> None:
    """A NaN / inf reward would silently zero its group's advantages or turn the loss NaN: refuse it."""
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if bad:
        k = bad[0]
        idx = records[k].get("idx")
        sample = f"dataset row {int(idx)}" if idx is not None else f"sample {k} of its batch"
        raise EnvironmentContractError(
            f"the environment for task {task!r} ({what}) returned a non-finite reward ({rewards[k].item()}) for {sample}"
            + (f" and {len(bad) - 1} more" if len(bad) > 1 else "")
        )


def _split_env_return(ret: Any, n: int, task: str, records: Sequence[Mapping[str, Any]]) -> list[_EnvStep]:
    if not isinstance(ret, EnvironmentReturn):
        raise EnvironmentContractError(f"environment for task {task!r} returned {type(ret).__name__}, not EnvironmentReturn")
    rewards = torch.as_tensor(ret.rewards, dtype=torch.float32).flatten()
    terms = torch.as_tensor(ret.terminateds, dtype=torch.bool).flatten()
    sizes = {
        "observations": len(ret.observations),
        "metadata": len(ret.metadata),
        "next_stop_strings": len(ret.next_stop_strings),
        "rewards": rewards.numel(),
        "terminateds": terms.numel(),
    }
    if ret.answers:
        sizes["answers"] = len(ret.answers)
    wrong = {k: v for k, v in sizes.items() if v != n}
    if wrong:
        raise EnvironmentContractError(f"environment for task {task!r} stepped {n} conversations but returned {wrong}")
    _check_finite_rewards(rewards, task, records, "step")
    return [
        _EnvStep(
            dict(ret.observations[k]),
            dict(ret.metadata[k] or {}),
            ret.next_stop_strings[k],
            float(rewards[k]),
            bool(terms[k]),
            ret.answers[k] if ret.answers else None,
        )
        for k in range(n)
    ]


def _step_env(env: EnvironmentInterface, task: str, records: list[dict[str, Any]]) -> list[_EnvStep | None]:
    """Step ``records`` through ``env``; ``None`` for each conversation the environment raised on.

    A failed batch is retried one conversation at a time so only the conversations that make the
    environment raise are dropped (environments are stateless by contract: their state is the
    metadata passed in, so a retry is safe).
    """
    try:
        ret = env.step([r["message_log"] for r in records], [r["env_metadata"] for r in records])
    except Exception:
        if len(records) > 1:
            return [_step_env(env, task, [r])[0] for r in records]
        r = records[0]
        log.warning("environment for task %r raised on dataset row %s; it scores 0 and is masked", task, r.get("idx"), exc_info=True)
        return [None]
    return _split_env_return(ret, len(records), task, records)


def _take_env(r: dict[str, Any], step: _EnvStep | None, tokenizer: Any, limits: RolloutLimits) -> bool:
    """Apply one environment step; True when the conversation goes on to another assistant turn."""
    r["_active"] = False
    if step is None:
        r.update(env_error=True, loss_multiplier=0.0, total_reward=0.0)
        return False
    r["total_reward"] += step.reward
    r["env_metadata"] = step.metadata
    if step.answer is not None:
        r["answer"] = step.answer
    if step.terminated:
        r["terminated"] = True
        return False
    if r["num_turns"] >= limits.max_rollout_turns:
        r["truncated"] = True  # out of turns before the environment finished it
        return False
    obs = _observation_tokens(tokenizer, str(step.observation.get("content", "")))
    if _conversation_ids(r).numel() + obs.numel() >= limits.max_seq_len:
        r["truncated"] = True  # the observation and a next turn would not fit
        return False
    r["message_log"].append({**step.observation, "role": step.observation.get("role", "environment"), "token_ids": obs})
    r["stop_strings"] = step.stop_strings
    r["_active"] = True
    return True


def _finish(r: dict[str, Any]) -> dict[str, Any]:
    if r["finish_reason"] == "length":
        r["truncated"] = True  # the last assistant turn did not end with a stop token / string
    r.pop("_active", None)
    r.pop("stop_strings", None)
    return r


def postprocess_rewards(
    records: Sequence[dict[str, Any]], task_to_env: Mapping[str, EnvironmentInterface], prompt_ids: Sequence[Any]
) -> dict[str, float]:
    """Run each task's ``global_post_process_and_metrics`` hook on its finished records.

    The hook may adjust rewards (e.g. the math environment zeroes responses that never ended); the
    adjusted rewards become ``total_reward``. Samples whose environment raised keep reward 0. Returns
    the hooks' metrics as ``env/{task}/{name}``.
    """
    metrics: dict[str, float] = {}
    by_task: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        by_task.setdefault(r["task_name"], []).append(i)
    for task, idxs in sorted(by_task.items()):
        batch = {
            "rewards": torch.tensor([records[i]["total_reward"] for i in idxs], dtype=torch.float32),
            "truncated": torch.tensor([records[i]["truncated"] for i in idxs], dtype=torch.bool),
            "prompt_ids": [prompt_ids[i] for i in idxs],
        }
        out, task_metrics = task_to_env[task].global_post_process_and_metrics(batch)
        rewards = torch.as_tensor(out["rewards"], dtype=torch.float32).flatten()
        if rewards.numel() != len(idxs):
            raise EnvironmentContractError(f"post-processing of task {task!r} returned {rewards.numel()} rewards for {len(idxs)}")
        _check_finite_rewards(rewards, task, [records[i] for i in idxs], "global_post_process_and_metrics")
        for i, v in zip(idxs, rewards.tolist()):
            if not records[i]["env_error"] and not records[i]["empty_generation"]:
                records[i]["total_reward"] = v
        metrics.update({f"env/{task}/{k}": float(v) for k, v in task_metrics.items()})
    return metrics


# ------------------------------------------------------------------------------------ stats
@dataclass
class GenerationStats:
    """What the rollout asked of the generation backend (summed over calls)."""

    calls: int = 0
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    length_finishes: int = 0
    weight_version: int = 0

    def add(self, out: GenerationOutput, seconds: float) -> None:
        """Account one generate call's output."""
        self.calls += 1
        self.requests += len(out.response_ids)
        self.tokens += sum(int(t.numel()) for t in out.response_ids)
        self.length_finishes += sum(reason == "length" for reason in out.finish_reasons)
        self.seconds += seconds
        self.weight_version = int(out.weight_version)

    def merge(self, other: "GenerationStats") -> None:
        """Add another ``GenerationStats`` into this one."""
        self.calls += other.calls
        self.requests += other.requests
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.length_finishes += other.length_finishes
        self.weight_version = max(self.weight_version, other.weight_version)

    def metrics(self, wall_seconds: float | None = None) -> dict[str, float]:
        """Counts plus throughput: tokens per second of generate time (and of wall time when given)."""
        m = {
            "generate_calls": float(self.calls),
            "generation_requests": float(self.requests),
            "generated_tokens": float(self.tokens),
            "generation_seconds": self.seconds,
            "generated_tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else 0.0,
            "length_finish_fraction": self.length_finishes / self.requests if self.requests else 0.0,
            "weight_version": float(self.weight_version),
        }
        if wall_seconds is not None:
            m["wall_tokens_per_s"] = self.tokens / wall_seconds if wall_seconds > 0 else 0.0
        return m


def _check_output(out: Any, n: int) -> None:
    if not isinstance(out, GenerationOutput):
        raise RuntimeError(f"the generation backend returned {type(out).__name__}, not GenerationOutput")
    if not len(out.response_ids) == len(out.logprobs) == len(out.finish_reasons) == n:
        raise RuntimeError(
            f"the generation backend returned {len(out.response_ids)} responses / {len(out.logprobs)} log-prob rows / "
            f"{len(out.finish_reasons)} finish reasons for {n} prompts"
        )


# ------------------------------------------------------------------------------------ drivers
def run_multi_turn_rollout(
    generation: GenerationInterface,
    tokenizer: Any,
    records: Sequence[Mapping[str, Any]],
    task_to_env: Mapping[str, EnvironmentInterface],
    limits: RolloutLimits,
    *,
    prompt_ids: Sequence[Any] | None = None,
    greedy: bool | None = None,
) -> tuple[list[dict[str, Any]], dict[str, float], dict[str, float]]:
    """Roll every record out to the end with one batched ``generate`` call per turn.

    Returns ``(finished records, rollout metrics, generation metrics)``. Each finished record is a
    deep copy of its input with ``message_log`` extended (assistant messages carry
    ``generation_logprobs``) and ``total_reward``, ``truncated``, ``terminated``, ``num_turns``,
    ``env_error``, ``empty_generation``, ``weight_version`` (the oldest weights that generated any of
    its tokens), ``finish_reason``, ``answer``, ``prompt_length``, ``response_length`` and
    ``loss_multiplier`` set (see the module docstring for the bad-input rules). ``prompt_ids`` group
    samples for the environments' metrics (default: one group per record).
    """
    validate_records(records, task_to_env)
    greedy = limits.greedy if greedy is None else greedy
    t0 = time.perf_counter()
    stats = GenerationStats(weight_version=generation.weight_version)
    out = [_start(r, limits, generation.weight_version) for r in records]
    for _turn in range(limits.max_rollout_turns):
        active = [i for i, r in enumerate(out) if r["_active"]]
        if not active:
            break
        prompts, budgets = zip(*(_next_prompt(out[i], limits) for i in active))
        t = time.perf_counter()
        result = generation.generate(
            list(prompts), max_new_tokens=max(budgets), stop_strings=[out[i]["stop_strings"] for i in active], greedy=greedy
        )
        _check_output(result, len(active))
        stats.add(result, time.perf_counter() - t)
        by_task: dict[str, list[int]] = {}
        for j, i in enumerate(active):
            out[i]["_active"] = False
            if _take_generation(
                out[i], result.response_ids[j], result.logprobs[j], result.finish_reasons[j], budgets[j], result.weight_version, tokenizer
            ):
                by_task.setdefault(out[i]["task_name"], []).append(i)
        for task, idxs in by_task.items():
            steps = _step_env(task_to_env[task], task, [out[i] for i in idxs])
            for i, step in zip(idxs, steps):
                _take_env(out[i], step, tokenizer, limits)
    finished = [_finish(r) for r in out]
    env_metrics = postprocess_rewards(finished, task_to_env, prompt_ids if prompt_ids is not None else range(len(finished)))
    wall = time.perf_counter() - t0
    summary = summarize_completions([Completion.from_record(r) for r in finished])
    return finished, {**summary, **env_metrics, "rollout_seconds": wall}, stats.metrics(wall)


async def run_conversation_async(
    generate_fn: GenerateAsyncFn,
    tokenizer: Any,
    record: Mapping[str, Any],
    env: EnvironmentInterface,
    limits: RolloutLimits,
    *,
    weight_version: int,
    greedy: bool | None = None,
    stats: GenerationStats | None = None,
) -> dict[str, Any]:
    """Roll one conversation out on ``generate_fn`` (``GenerationInterface.generate_async``'s signature).

    Same rules and finished-record fields as ``run_multi_turn_rollout`` (the record must have passed
    ``validate_records``); environment steps run in a worker thread so the event loop keeps serving
    the other conversations. Rewards are not post-processed here (that needs the whole group).
    """
    greedy = limits.greedy if greedy is None else greedy
    task = record["task_name"]
    r = _start(record, limits, weight_version)
    while r["_active"] and r["num_turns"] < limits.max_rollout_turns:
        prompt, budget = _next_prompt(r, limits)
        t = time.perf_counter()
        result = await generate_fn(prompt, max_new_tokens=budget, stop_strings=r["stop_strings"], greedy=greedy)
        _check_output(result, 1)
        if stats is not None:
            stats.add(result, time.perf_counter() - t)
        r["_active"] = False
        if _take_generation(
            r, result.response_ids[0], result.logprobs[0], result.finish_reasons[0], budget, result.weight_version, tokenizer
        ):
            (step,) = await asyncio.to_thread(_step_env, env, task, [r])
            _take_env(r, step, tokenizer, limits)
    return _finish(r)


# ------------------------------------------------------------------------------------ results
def _as_message_log(log_: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The text of a conversation (role and content only: msgpack-able, no tensors)."""
    return [{"role": str(m.get("role")), "content": str(m.get("content", ""))} for m in log_]


@dataclass
class Completion:
    """One finished conversation, flattened.

    ``token_ids`` is the whole conversation (prompt, responses, observations); ``logprobs`` and
    ``token_mask`` are aligned with it: ``token_mask`` is True on generated tokens and ``logprobs``
    holds the generator's log-prob there (0 elsewhere). ``reward`` is the total over turns.
    ``weight_version`` is the oldest weight version that generated any of its tokens.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    token_mask: torch.Tensor
    prompt_length: int
    reward: float
    finish_reason: str | None
    weight_version: int
    env_answer: str | None
    truncated: bool
    terminated: bool
    env_error: bool
    empty_generation: bool
    num_turns: int
    loss_multiplier: float
    message_log: list[dict[str, str]] = field(default_factory=list)

    @property
    def response_ids(self) -> torch.Tensor:
        """The generated tokens only (every assistant turn, in order)."""
        return self.token_ids[self.token_mask]

    @property
    def response_length(self) -> int:
        """Number of generated tokens."""
        return int(self.token_mask.sum())

    @classmethod
    def from_record(cls, r: Mapping[str, Any]) -> "Completion":
        """Flatten a finished record of ``run_multi_turn_rollout`` / ``run_conversation_async``."""
        ids, mask, lps = [], [], []
        for m in r["message_log"]:
            t = m["token_ids"].to(torch.int64)
            gen = m["role"] == "assistant" and "generation_logprobs" in m
            ids.append(t)
            mask.append(torch.full((t.numel(),), gen, dtype=torch.bool))
            lps.append(m["generation_logprobs"].to(torch.float32) if gen else torch.zeros(t.numel(), dtype=torch.float32))
        return cls(
            token_ids=torch.cat(ids),
            logprobs=torch.cat(lps),
            token_mask=torch.cat(mask),
            prompt_length=int(r["prompt_length"]),
            reward=float(r["total_reward"]),
            finish_reason=r["finish_reason"],
            weight_version=int(r["weight_version"]),
            env_answer=r.get("answer"),
            truncated=bool(r["truncated"]),
            terminated=bool(r["terminated"]),
            env_error=bool(r["env_error"]),
            empty_generation=bool(r["empty_generation"]),
            num_turns=int(r["num_turns"]),
            loss_multiplier=float(r["loss_multiplier"]),
            message_log=_as_message_log(r["message_log"]),
        )


def completions_to_columns(completions: Sequence[Completion]) -> dict[str, Any]:
    """The per-sample columns of ``common.fields`` (plus the message log and a few scalars).

    Token-aligned columns are lists of 1-d tensors (one per sample, unpadded): ``input_ids``,
    ``token_mask``, ``generation_logprobs``. Per-sample columns are ``[n]`` tensors: ``input_lengths``,
    ``sample_mask`` (the loss multiplier), ``total_reward``, ``truncated``. ``message_log`` is a list
    of per-sample lists of ``{"role", "content"}``.
    """
    return {
        "input_ids": [c.token_ids for c in completions],
        "token_mask": [c.token_mask for c in completions],
        "generation_logprobs": [c.logprobs for c in completions],
        "input_lengths": torch.tensor([c.token_ids.numel() for c in completions], dtype=torch.int64),
        "sample_mask": torch.tensor([c.loss_multiplier for c in completions], dtype=torch.float32),
        "total_reward": torch.tensor([c.reward for c in completions], dtype=torch.float32),
        "truncated": torch.tensor([c.truncated for c in completions], dtype=torch.bool),
        "message_log": [c.message_log for c in completions],
    }


def records_to_columns(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``completions_to_columns`` of finished records (see ``Completion.from_record``)."""
    return completions_to_columns([Completion.from_record(r) for r in records])


def completion_scalars(completions: Sequence[Completion]) -> dict[str, Any]:
    """The per-sample scalars of completions (``[n]`` tensors, or lists for strings): what a driver
    needs for rewards, baselines, filtering and logging - nothing with a token dimension."""
    return {
        "total_reward": torch.tensor([c.reward for c in completions], dtype=torch.float32),
        "loss_multiplier": torch.tensor([c.loss_multiplier for c in completions], dtype=torch.float32),
        "truncated": torch.tensor([c.truncated for c in completions], dtype=torch.bool),
        "terminated": torch.tensor([c.terminated for c in completions], dtype=torch.bool),
        "env_error": torch.tensor([c.env_error for c in completions], dtype=torch.bool),
        "input_lengths": torch.tensor([c.token_ids.numel() for c in completions], dtype=torch.int64),
        "response_lengths": torch.tensor([c.response_length for c in completions], dtype=torch.int64),
        "num_turns": torch.tensor([c.num_turns for c in completions], dtype=torch.int64),
        "weight_version": torch.tensor([c.weight_version for c in completions], dtype=torch.int64),
        "env_answer": [c.env_answer for c in completions],
    }


def padded_columns(completions: Sequence[Completion], pad_token_id: int) -> dict[str, Any]:
    """The bulk columns for a driver-side batch: token-aligned ones right-padded to the longest sample
    (``input_ids`` with ``pad_token_id``, ``token_mask`` with False, ``generation_logprobs`` with 0),
    plus ``input_lengths``, ``sample_mask`` and ``message_log``."""
    cols = completions_to_columns(completions)
    pad = torch.nn.utils.rnn.pad_sequence
    return {
        "input_ids": pad(cols["input_ids"], batch_first=True, padding_value=int(pad_token_id)),
        "token_mask": pad(cols["token_mask"], batch_first=True, padding_value=False),
        "generation_logprobs": pad(cols["generation_logprobs"], batch_first=True, padding_value=0.0),
        "input_lengths": cols["input_lengths"],
        "sample_mask": cols["sample_mask"],
        "message_log": cols["message_log"],
    }


def summarize_completions(completions: Sequence[Completion]) -> dict[str, float]:
    """Rollout metrics: rewards, turns, lengths, and how conversations ended (fractions of samples)."""
    n = len(completions)
    if n == 0:
        return {"num_samples": 0.0}

    def mean(values: Any) -> float:
        return float(sum(float(v) for v in values)) / n

    lengths = [c.token_ids.numel() for c in completions]
    return {
        "num_samples": float(n),
        "mean_total_reward": mean(c.reward for c in completions),
        "mean_turns": mean(c.num_turns for c in completions),
        "max_turns": float(max(c.num_turns for c in completions)),
        "truncated_fraction": mean(c.truncated for c in completions),
        "terminated_fraction": mean(c.terminated for c in completions),
        "env_error_fraction": mean(c.env_error for c in completions),
        "empty_generation_fraction": mean(c.empty_generation for c in completions),
        "empty_response_fraction": mean(
            c.num_turns > 0 and all(m["content"] == "" for m in c.message_log if m["role"] == "assistant") for c in completions
        ),
        "masked_fraction": mean(c.loss_multiplier == 0.0 for c in completions),
        "mean_response_length": mean(c.response_length for c in completions),
        "mean_prompt_length": mean(c.prompt_length for c in completions),
        "mean_input_length": mean(lengths),
        "max_input_length": float(max(lengths)),
    }
