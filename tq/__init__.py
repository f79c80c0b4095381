"""TransferQueue (TQ): a key-value data plane for RL post-training.

Rollout actors put per-sample columns under keys minted once; the driver passes only
:class:`KVBatchMeta` handles around; each data-parallel worker fetches exactly its shard.
"""

from .client import TQClient, mint_keys
from .errors import *  # noqa: F401,F403 - the exception types are part of the API
from .jagged import JaggedTensor
from .meta import KVBatchMeta
from .server import TQServer
from .sharding import shard_meta_for_dp

__all__ = ["TQClient", "TQServer", "KVBatchMeta", "JaggedTensor", "mint_keys", "shard_meta_for_dp"]
