"""TransferQueue (TQ): a key-value data plane for RL post-training.

Rollout actors put per-sample columns under keys minted once; the driver passes only
:class:`KVBatchMeta` handles around; each data-parallel worker fetches exactly its shard.

Names are imported lazily, so the service processes (``python -m tq.controller`` / ``tq.storage``)
start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import *  # noqa: F401,F403 - the exception types are part of the API
from .meta import KVBatchMeta
from .sharding import shard_meta_for_dp

_LAZY = {
    "TQClient": "client",
    "mint_keys": "client",
    "TQServer": "server",
    "TQConnection": "connection",
    "JaggedTensor": "jagged",
}

__all__ = ["TQClient", "TQConnection", "TQServer", "KVBatchMeta", "JaggedTensor", "mint_keys", "shard_meta_for_dp"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'tq' has no attribute {name!r}")
