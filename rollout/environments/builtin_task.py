"""The built-in task: single-digit addition that a tiny random-init model can learn with GRPO on a CPU.

Prompts are ``"a+b="`` with ``0 <= a, b <= max_operand`` (default 4: 25 distinct prompts, answers
0..8 that depend on the prompt); the ground truth is ``str(a + b)``. Why it is learnable from random
init with the character-level tokenizer:

- the whole prompt is 4 tokens and the answer is the first generated token, so ``max_new_tokens``
  can be 1-2 and every rollout is cheap;
- the answer space is 9 digits out of ~100 tokens, so a random policy is right about 1% of the
  time: a group of 8 samples over a batch of 32 prompts sees a few correct answers per step, enough
  for a non-zero GRPO advantage from the first step; the optional ``format_reward`` (e.g. 0.1 for a
  wrong digit) makes the early signal denser still;
- the mapping is a 25-entry table, within reach of a 2-layer, 64-wide model.

Held out: :func:`builtin_task_split` keeps some operand pairs out of training (``split="train"``) for
validation (``split="held_out"``): pairs ``a+b=`` with ``a > b`` whose mirror ``b+a=`` is trained on,
so every answer and every operand is still seen in training and the held-out accuracy measures
whether the model generalises (commutativity), not whether it memorised the table.

Use it without a chat template (``builtin_task_processor_config``): the response starts right after
the ``=``. Reward: 1 when the response, after leading whitespace, starts with the answer and is not
followed by another digit (``"7"``, ``" 7"``, ``"7<|im_end|>"`` score for 7; ``"72"`` does not).
"""

from __future__ import annotations

import random
import re
from typing import Any, Literal, Mapping

import torch

from rollout.environments.common import ground_truth_of, last_assistant_content, reward_metrics
from rollout.interfaces import EnvironmentInterface, EnvironmentReturn, Message

BUILTIN_TASK_NAME = "builtin_add"
BUILTIN_TASK_MAX_NEW_TOKENS = 2  # the answer token, plus one for an end-of-turn token
_LEADING_NUMBER = re.compile(r"\s*(\d+)")
DEFAULT_HELD_OUT_PAIRS = 5
_SPLIT_SEED = 20240521  # the split is a property of the task, not of a run's seed


def builtin_task_split(max_operand: int = 4, held_out: int = DEFAULT_HELD_OUT_PAIRS) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(train, held_out)`` pairs of the table: ``held_out`` pairs ``a+b=`` with ``a > b`` (a fixed
    choice), whose mirrors ``b+a=`` stay in ``train``; disjoint, together the whole table."""
    table = builtin_task_table(max_operand)
    candidates = [i for i, (p, _) in enumerate(table) if p[0] > p[2]]
    if not 0 <= held_out <= len(candidates):
        raise ValueError(f"held_out must be in 0..{len(candidates)} (pairs a+b= with a > b) for max_operand={max_operand}, got {held_out}")
    random.Random(_SPLIT_SEED).shuffle(candidates)
    out = set(candidates[:held_out])
    return [t for i, t in enumerate(table) if i not in out], [t for i, t in enumerate(table) if i in out]


def builtin_task_table(max_operand: int = 4) -> list[tuple[str, str]]:
    """Every distinct ``(prompt, answer)`` pair of the task, in a fixed order."""
    if not 0 <= max_operand <= 9:
        raise ValueError(f"max_operand must be a single digit (0..9), got {max_operand}")
    return [(f"{a}+{b}=", str(a + b)) for a in range(max_operand + 1) for b in range(max_operand + 1)]


def builtin_task_dataset(
    n: int,
    seed: int = 0,
    *,
    max_operand: int = 4,
    split: Literal["all", "train", "held_out"] = "all",
    held_out: int = DEFAULT_HELD_OUT_PAIRS,
) -> list[dict[str, Any]]:
    """``n`` records ``{"prompt", "ground_truth", "task_name"}``, balanced over the distinct prompts
    of ``split``: the whole table, or the training or held-out part of :func:`builtin_task_split`.

    The records cycle through seeded shuffles of those prompts, so every prompt appears
    ``n // len(prompts)`` or one more times, and the same arguments give the same list.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if split == "all":
        table = builtin_task_table(max_operand)
    elif split in ("train", "held_out"):
        table = builtin_task_split(max_operand, held_out)[split == "held_out"]
    else:
        raise ValueError(f"split must be 'all', 'train' or 'held_out', got {split!r}")
    if not table and n:
        raise ValueError(f"the {split!r} split of the built-in task is empty (held_out={held_out})")
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    while len(records) < n:
        order = list(range(len(table)))
        rng.shuffle(order)
        records += [{"prompt": table[i][0], "ground_truth": table[i][1], "task_name": BUILTIN_TASK_NAME} for i in order]
    return records[:n]


def builtin_task_processor_config(max_seq_length: int = 64) -> Any:
    """The data-processor settings the task is designed for: raw prompt, no chat template."""
    from rollout.data import DataProcessorConfig

    return DataProcessorConfig(
        prompt_key="prompt",
        use_chat_template=False,
        ground_truth_key="ground_truth",
        task_name=BUILTIN_TASK_NAME,
        max_seq_length=max_seq_length,
    )


def extract_leading_number(response: str) -> str | None:
    """The run of digits the response starts with (after whitespace), or None."""
    if not isinstance(response, str):
        return None
    m = _LEADING_NUMBER.match(response)
    return m.group(1) if m else None


def score_builtin_answer(response: str, ground_truth: str, *, format_reward: float = 0.0) -> tuple[float, str | None]:
    """``(reward, extracted answer)``: 1 for the exact answer, ``format_reward`` for another number, else 0."""
    answer = extract_leading_number(response)
    if answer is None or ground_truth is None:
        return 0.0, answer
    return (1.0 if answer == ground_truth.strip() else float(format_reward)), answer


class BuiltinTaskEnvironment(EnvironmentInterface):
    """Single-turn exact-match environment for the built-in task (cheap: no workers needed)."""

    def __init__(self, *, format_reward: float = 0.0) -> None:
        if not 0.0 <= format_reward < 1.0:
            raise ValueError(f"format_reward must be in [0, 1), got {format_reward}")
        self.format_reward = format_reward

    def step(self, message_log_batch: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        """Score the last assistant turn of each conversation against ``metadata[i]["ground_truth"]``."""
        if len(message_log_batch) != len(metadata):
            raise ValueError(f"{len(message_log_batch)} conversations but {len(metadata)} metadata entries")
        scored = [
            score_builtin_answer(last_assistant_content(log), ground_truth_of(m), format_reward=self.format_reward)
            for log, m in zip(message_log_batch, metadata)
        ]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": "correct" if r == 1.0 else "incorrect"} for r, _ in scored],
            metadata=[dict(m) if isinstance(m, Mapping) else {} for m in metadata],
            next_stop_strings=[None] * len(scored),
            rewards=torch.tensor([r for r, _ in scored], dtype=torch.float32),
            terminateds=torch.ones(len(scored), dtype=torch.bool),
            answers=[a for _, a in scored],
        )

    def global_post_process_and_metrics(self, batch: Mapping[str, Any]) -> tuple[Mapping[str, Any], dict[str, float]]:
        """Accuracy metrics (``reward_metrics``); exact answers are the rewards equal to 1.

        Truncated responses keep their reward: with ``max_new_tokens`` of 1-2 the answer token is
        all that matters, and requiring an end-of-turn token would make the task much sparser.
        """
        return reward_metrics(batch, zero_unended=False)
