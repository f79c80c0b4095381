"""How the processes of a Ray job find one TQ service, and a view of a partition in TransferQueue's shape.

TransferQueue's ``init()`` registers a named Ray actor (``TransferQueueController`` in namespace
``transfer_queue``); every other process of the job - a rollout worker, a DP rank - calls ``init()``
with no config and attaches through it. :class:`ServiceHandle` plays that part here: it holds only the
connection settings of the TQ service (the service runs as its own processes, not in the actor) and
answers the few controller calls that TransferQueue users and tests make on that actor
(``get_config``, ``list_partitions``, ``clear_partition``, ``get_partition_snapshot``), from the
controller's state read through the public :class:`~tq.TQClient` API.

This module imports neither torch nor tensordict at import time: the handle actor starts light, and
the workers' ``init()`` only asks it for the settings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ACTOR_NAME = "TransferQueueController"
NAMESPACE = "transfer_queue"


def tag_dicts(tags: dict[str, tuple], n: int) -> list[dict[str, Any]]:
    """Per-key tag dicts from columnar tags. The controller stores tags as columns, so a key that never
    got a tag holds ``None`` in that column: ``None`` values are left out (a tag set to ``None``
    reads back as absent)."""
    out: list[dict[str, Any]] = [{} for _ in range(n)]
    for name, values in tags.items():
        for d, v in zip(out, values):
            if v is not None:
                d[name] = v
    return out


@dataclass
class PartitionSnapshot:
    """A partition's state in the shape of TransferQueue's ``DataPartitionStatus`` snapshot.

    ``global_indexes`` are the controller's slot numbers for the keys (its row in the partition's
    location table), so they are stable while the key lives and reused after it is cleared.
    """

    partition_id: str
    keys_mapping: dict[str, int] = field(default_factory=dict)
    global_indexes: set[int] = field(default_factory=set)
    custom_meta: dict[int, dict[str, Any]] = field(default_factory=dict)
    field_name_mapping: dict[str, int] = field(default_factory=dict)
    production_status: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int8))  # [index, field]: 1 = produced


def partition_snapshot(client: Any, partition_id: str) -> PartitionSnapshot | None:
    """Read ``partition_id``'s keys, tags, fields and per-(key, field) production status from the
    controller (``None`` if there is no such partition). One request per key: for inspection and
    tests, not for a training loop."""
    from ..errors import KeyNotFoundError, PartitionNotFoundError

    summary = next((p for p in client.list_partitions() if p["partition"] == partition_id), None)
    if summary is None:
        return None
    try:
        meta = client.get_meta(partition_id)
    except PartitionNotFoundError:
        return None
    index = list(meta.slots) if meta.slots is not None else list(range(len(meta.keys)))
    columns = {name: i for i, name in enumerate(summary["fields"])}
    status = np.zeros((max(index, default=-1) + 1, len(columns)), np.int8)
    for key, gi in zip(meta.keys, index):
        try:
            held = client.get_meta(partition_id, [key]).fields
        except (KeyNotFoundError, PartitionNotFoundError):  # cleared meanwhile
            continue
        for name in held:
            if name in columns:
                status[gi, columns[name]] = 1
    return PartitionSnapshot(
        partition_id,
        keys_mapping=dict(zip(meta.keys, index)),
        global_indexes=set(index),
        custom_meta=dict(zip(index, tag_dicts(meta.tags, len(meta.keys)))),
        field_name_mapping=columns,
        production_status=status,
    )


class ServiceHandle:
    """Body of the named Ray actor through which a Ray job's processes find the TQ service.

    The process that creates it (the first ``init()``) publishes the connection settings once the
    service answers; the others poll :meth:`get_config` until then.
    """

    def __init__(self) -> None:
        self._settings: dict[str, Any] | None = None
        self._error: str | None = None
        self._client: Any = None

    def publish(self, settings: dict[str, Any]) -> None:
        """Set what every process attaches with: ``{"connection": TQConnection, "wait_timeout_s": ...}``."""
        self._settings = dict(settings)

    def fail(self, message: str) -> None:
        """The creating process could not start or reach the service: waiters get this error."""
        self._error = message

    def get_config(self) -> dict[str, Any] | None:
        """The connection settings, or ``None`` while the creating process is still starting the service."""
        if self._error is not None:
            raise RuntimeError(self._error)
        return self._settings

    def _tq(self) -> Any:
        if self._client is None:
            if self._settings is None:
                raise RuntimeError("the TQ service is not started yet")
            self._client = self._settings["connection"].connect()
        return self._client

    def list_partitions(self) -> list[str]:
        """Every partition id, like TransferQueueController.list_partitions."""
        return [p["partition"] for p in self._tq().list_partitions()]

    def clear_partition(self, partition_id: str, clear_consumption: bool = True) -> None:
        """Delete a partition and every key in it (TransferQueue's clear_partition drops the partition);
        a missing partition is ignored. ``clear_consumption`` is accepted for TransferQueue's signature:
        the TQ controller keeps no consumption state."""
        from ..errors import PartitionNotFoundError

        try:
            self._tq().drop_partition(partition_id)
        except PartitionNotFoundError:
            pass

    def get_partition_snapshot(self, partition_id: str) -> PartitionSnapshot | None:
        """See :func:`partition_snapshot`."""
        return partition_snapshot(self._tq(), partition_id)


def find_or_claim(ray: Any) -> tuple[Any, bool]:
    """The job's handle actor and whether this process just created it (and so must start or name
    the service). Two processes racing here agree: Ray lets only one create the named actor."""
    try:
        return ray.get_actor(ACTOR_NAME, namespace=NAMESPACE), False
    except ValueError:
        pass
    try:
        actor = ray.remote(num_cpus=0)(ServiceHandle).options(name=ACTOR_NAME, namespace=NAMESPACE)
        return actor.remote(), True
    except ValueError:  # another process created it first
        return ray.get_actor(ACTOR_NAME, namespace=NAMESPACE), False


def existing_handle(ray: Any) -> Any | None:
    """The job's handle actor, if a process created one."""
    try:
        return ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def await_settings(ray: Any, handle: Any, timeout: float) -> dict[str, Any]:
    """Poll the handle until the creating process published the settings (it may still be starting
    the service), for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        settings = ray.get(handle.get_config.remote(), timeout=timeout)
        if settings is not None:
            return settings
        if time.monotonic() > deadline:
            raise TimeoutError(f"no TQ service was published through the Ray actor {NAMESPACE}/{ACTOR_NAME} within {timeout:.0f}s")
        time.sleep(0.05)
