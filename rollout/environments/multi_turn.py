"""A two-turn environment for multi-turn rollouts: guess, get a hint, guess again (scored).

Each conversation's metadata holds the target digit in ``ground_truth`` and the number of assistant
turns taken so far in ``turn`` (absent = 0). After the first assistant turn the environment answers
with a hint that reveals the target and does not terminate (reward 0); after the second it scores
the guess (1 if the response starts with the target, as in the built-in task) and terminates. A
policy can learn to copy the hint, so multi-turn training shows learning too.
"""

from __future__ import annotations

import random
from typing import Any, Mapping

import torch

from rollout.environments.builtin_task import score_builtin_answer
from rollout.environments.common import ground_truth_of, last_assistant_content, reward_metrics
from rollout.interfaces import EnvironmentInterface, EnvironmentReturn, Message

TWO_TURN_TASK_NAME = "two_turn_guess"
TWO_TURN_PROMPT = "Guess my digit:"


class TwoTurnGuessEnvironment(EnvironmentInterface):
    """Turn 1 gets a hint observation (not terminated, reward 0); turn 2 is scored and terminates.

    ``hint_template`` is formatted with the metadata's fields (``{ground_truth}`` is the target).
    ``metadata`` returned by ``step`` carries ``turn`` incremented and, after turn 1, ``first_guess``.
    """

    def __init__(self, *, hint_template: str = "Hint: it is {ground_truth}. Guess again:") -> None:
        self.hint_template = hint_template

    def step(self, message_log_batch: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        """Advance every conversation by one assistant turn (see the class docstring)."""
        if len(message_log_batch) != len(metadata):
            raise ValueError(f"{len(message_log_batch)} conversations but {len(metadata)} metadata entries")
        observations, new_meta, rewards, terminated, answers = [], [], [], [], []
        for log, meta in zip(message_log_batch, metadata):
            meta = dict(meta) if isinstance(meta, Mapping) else {}
            turn = int(meta.get("turn", 0) or 0)
            truth = ground_truth_of(meta)
            reward, answer = score_builtin_answer(last_assistant_content(log), truth)
            meta["turn"] = turn + 1
            if turn == 0:
                meta["first_guess"] = answer
                hint = self.hint_template.format(**meta) if truth is not None else "Hint: none."
                observations.append({"role": "environment", "content": hint})
                rewards.append(0.0)
                terminated.append(False)
            else:
                observations.append({"role": "environment", "content": "correct" if reward == 1.0 else "incorrect"})
                rewards.append(reward)
                terminated.append(True)
            answers.append(answer)
            new_meta.append(meta)
        return EnvironmentReturn(
            observations=observations,
            metadata=new_meta,
            next_stop_strings=[None] * len(new_meta),
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.tensor(terminated, dtype=torch.bool),
            answers=answers,
        )

    def global_post_process_and_metrics(self, batch: Mapping[str, Any]) -> tuple[Mapping[str, Any], dict[str, float]]:
        """Accuracy of the scored (second) guesses; truncated responses keep their reward."""
        return reward_metrics(batch, zero_unended=False)


def two_turn_guess_dataset(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` records ``{"prompt", "ground_truth", "task_name"}`` with seeded random target digits."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    return [{"prompt": TWO_TURN_PROMPT, "ground_truth": str(rng.randrange(10)), "task_name": TWO_TURN_TASK_NAME} for _ in range(n)]
