"""DP training workers, the legacy and TQ policies, losses and micro-batching.

Models, tokenizers, ``BatchedDataDict`` and the column names live in ``common`` (rollout needs them
too). Modules: ``loss`` (ClippedPGLossFn), ``logprobs`` and
``micro_batching`` (pure compute), ``dispatch`` (the one sharding function both policies use),
``config`` (PolicyConfig), ``worker`` (DPPolicyWorker, a Ray actor per DP rank), ``policy`` (Policy,
TQPolicy). Names are imported lazily so ``import policy`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ClippedPGLossConfig": "loss",
    "ClippedPGLossFn": "loss",
    "PolicyConfig": "config",
    "DPPolicyWorker": "worker",
    "Policy": "policy",
    "TQPolicy": "policy",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'policy' has no attribute {name!r}")
