"""Environments behind ``rollout.interfaces.EnvironmentInterface``.

- ``MathEnvironment``: 1/0 rewards from ``math-verify`` on a pool of Ray verification actors.
- ``BuiltinTaskEnvironment`` + ``builtin_task_dataset``: single-digit addition a tiny model learns.
- ``TwoTurnGuessEnvironment`` + ``two_turn_guess_dataset``: a hint after turn 1, turn 2 scored.

``make_environment(name, **kwargs)`` builds one by task name.
"""

from __future__ import annotations

from typing import Any

from rollout.environments.builtin_task import (
    BUILTIN_TASK_MAX_NEW_TOKENS,
    BUILTIN_TASK_NAME,
    BuiltinTaskEnvironment,
    builtin_task_dataset,
    builtin_task_processor_config,
    builtin_task_split,
    builtin_task_table,
    score_builtin_answer,
)
from rollout.environments.common import last_assistant_content, reward_metrics
from rollout.environments.math_env import (
    MATH_TASK_NAME,
    MathEnvironment,
    MathVerifyWorker,
    shutdown_verifier_processes,
    verify_math_answer,
    verify_math_answers,
)
from rollout.environments.multi_turn import TWO_TURN_TASK_NAME, TwoTurnGuessEnvironment, two_turn_guess_dataset
from rollout.interfaces import EnvironmentInterface

ENVIRONMENTS = {
    MATH_TASK_NAME: MathEnvironment,
    BUILTIN_TASK_NAME: BuiltinTaskEnvironment,
    TWO_TURN_TASK_NAME: TwoTurnGuessEnvironment,
}


def make_environment(name: str, **kwargs: Any) -> EnvironmentInterface:
    """The environment registered under task ``name`` (``math``, ``builtin_add``, ``two_turn_guess``)."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; known: {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name](**kwargs)


__all__ = [
    "BUILTIN_TASK_MAX_NEW_TOKENS",
    "BUILTIN_TASK_NAME",
    "BuiltinTaskEnvironment",
    "ENVIRONMENTS",
    "MATH_TASK_NAME",
    "MathEnvironment",
    "MathVerifyWorker",
    "TWO_TURN_TASK_NAME",
    "TwoTurnGuessEnvironment",
    "builtin_task_dataset",
    "builtin_task_processor_config",
    "builtin_task_split",
    "builtin_task_table",
    "last_assistant_content",
    "make_environment",
    "reward_metrics",
    "score_builtin_answer",
    "shutdown_verifier_processes",
    "two_turn_guess_dataset",
    "verify_math_answer",
    "verify_math_answers",
]
