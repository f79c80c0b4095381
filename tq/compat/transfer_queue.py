"""A drop-in for the KV API of ``transferqueue`` 0.1.11, served by this project's TQ service.

Switch (see docs/compat.md)::

    import tq.compat.transfer_queue as tq   # was: import transfer_queue as tq
    tq.init()                               # unchanged: starts a TQ service, or attaches to one

Same names, signatures, return types and errors as ``transfer_queue``'s KV API: :func:`init` /
:func:`close`, :func:`kv_put`, :func:`kv_batch_put`, :func:`kv_batch_get`,
:func:`kv_batch_get_by_meta`, :func:`kv_list`, :func:`kv_clear`, their ``async_kv_*`` twins and
:class:`KVBatchMeta`; TensorDicts in and out (``NonTensorStack`` for non-tensor values, jagged nested
tensors for per-sample tensors, dense tensors for per-sample scalars); tags and tag-only updates;
adding fields to existing keys and overwriting them; partitions created on first write. Every call
goes through one :class:`~tq.TQClient` per process, so it gets the same-host shared-memory path, the
controller's parked waits and the auth secret.

Where the semantics differ, by design:

- Reading a field that is not produced for every key raises ``ValueError`` at once, as in
  TransferQueue (its consumers poll). ``data_plane.wait_timeout_s`` in :func:`init`'s config (or
  ``wait_timeout_s=`` on a get) parks the get on the controller until the fields are produced instead.
- :func:`kv_batch_get` with some keys missing raises ``ValueError`` naming them (TransferQueue
  returns the present keys' rows only, silently).
- Non-tensor values cross the wire as msgpack, never pickle: strings, numbers, lists and dicts of
  those. Tag values are ``None``/bool/int/float/str; a tag set to ``None`` reads back as absent.
- A field's per-sample shape may vary only in its first dimension (its dtype and trailing dims are
  fixed per partition), and a field of per-sample scalars stays scalar.
- :func:`close` stops the service only in the process whose :func:`init` started it.
"""

from __future__ import annotations

import asyncio
import atexit
import copy
import dataclasses
import os
import reprlib
import sys
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Callable

import numpy as np
import torch

try:
    from omegaconf import DictConfig, OmegaConf
    from tensordict import NonTensorStack, TensorDict, TensorDictBase, is_non_tensor
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("tq.compat.transfer_queue needs tensordict and omegaconf: pip install 'tq-rl[compat]'") from exc

from . import _service
from ..client import TQClient
from ..connection import TQConnection
from ..errors import (
    DuplicateKeyError,
    FieldNotProducedError,
    KeyNotFoundError,
    PartitionExistsError,
    PartitionNotFoundError,
)
from ..jagged import JaggedTensor
from ..meta import KVBatchMeta as _NativeMeta
from ..meta import plain_strs
from ..server import TQServer

__all__ = [
    "init",
    "close",
    "get_client",
    "kv_put",
    "kv_batch_put",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_list",
    "kv_clear",
    "async_kv_put",
    "async_kv_batch_put",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_list",
    "async_kv_clear",
    "KVBatchMeta",
    "PartitionSnapshot",
    "alias_as_transfer_queue",
]

PartitionSnapshot = _service.PartitionSnapshot

# What init() merges the user's config into. TransferQueue's own sections are kept so a verl /
# NeMo-RL config passes unchanged; of them only backend.SimpleStorage.num_data_storage_units is used.
DEFAULT_CONFIG: dict[str, Any] = {
    "data_plane": {
        "address": None,  # a running tq-controller (else $TQ_ADDRESS, else the Ray job's, else start one here)
        "secret": None,  # default: $TQ_SECRET
        "timeout_s": 60.0,  # bound on every call
        "transport": "auto",  # auto: same-host processes map the storage arenas; tcp: always stream
        "capacity_wait_s": 0.0,  # a write into a full storage unit waits this long for room
        "wait_timeout_s": None,  # None: a get of unproduced fields raises ValueError (TransferQueue's polling);
        # seconds: the get is parked on the controller until they are produced
        "host": "127.0.0.1",  # bind of a service started here (non-loopback needs a secret)
        "storage_units": None,  # of a service started here; default backend.SimpleStorage.num_data_storage_units
        "capacity_bytes": 2 << 30,  # of a service started here, over all its units
        "start_timeout_s": 60.0,
    },
    "controller": {"sampler": "SequentialSampler", "polling_mode": False},
    "backend": {"storage_backend": "SimpleStorage", "SimpleStorage": {"total_storage_size": None, "num_data_storage_units": 2}},
}
_FROM_CONFIG: Any = object()  # a get's wait_timeout_s default: the value init() was configured with


# ---------------------------------------------------------------------------------------------- meta
@dataclasses.dataclass
class KVBatchMeta:
    """The handle TransferQueue's KV calls return: keys, per-key tag dicts, partition and fields.

    Same attributes and methods as ``transfer_queue.KVBatchMeta`` (0.1.11). Pass it to
    :func:`kv_batch_get_by_meta`; :meth:`native` turns it into a :class:`tq.KVBatchMeta` for
    :func:`tq.shard_meta_for_dp` and :class:`~tq.TQClient`.
    """

    keys: list[str] = dataclasses.field(default_factory=list)
    tags: list[dict] = dataclasses.field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] | None = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.tags):
            raise ValueError(f"keys and tags must have same length, but got {len(self.keys)} and {len(self.tags)}")
        if len(self.keys) != len(set(self.keys)):
            raise ValueError("Got duplicated keys.")
        if self.fields is not None and len(self.fields) != len(set(self.fields)):
            raise ValueError("Got duplicated fields.")
        # copies: a chunk or concat must not share tag dicts with its source
        self.tags = copy.deepcopy(self.tags)
        self.extra_info = copy.deepcopy(self.extra_info)

    @property
    def size(self) -> int:
        """Number of samples."""
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __str__(self) -> str:
        return f"KVBatchMeta(size={self.size}, field_names={self.fields}, extra_info={self.extra_info})"

    def select_keys(self, keys_to_select: list[str]) -> "KVBatchMeta":
        """A new meta with only these keys, in this order (ValueError on duplicates, RuntimeError on
        keys this meta does not have)."""
        if len(set(keys_to_select)) != len(keys_to_select):
            raise ValueError("Contain duplicate keys.")
        missing = set(keys_to_select) - set(self.keys)
        if missing:
            raise RuntimeError(f"Keys {missing} not found in current batch.")
        pos = {k: i for i, k in enumerate(self.keys)}
        return KVBatchMeta(
            list(keys_to_select), [self.tags[pos[k]] for k in keys_to_select], self.partition_id, self.fields, self.extra_info
        )

    def reorder(self, indexes: list[int]) -> None:
        """Reorder the samples in place."""
        if len(indexes) != self.size:
            raise ValueError(f"Attempted to reorder with indexes length {len(indexes)} that does not match the batch size {self.size}.")
        if len(set(indexes)) != len(indexes):
            raise ValueError("Contain duplicate indexes.")
        self.keys = [self.keys[i] for i in indexes]
        self.tags = [self.tags[i] for i in indexes]

    def chunk(self, chunks: int) -> list["KVBatchMeta"]:
        """Split into ``chunks`` contiguous metas, the first ``size % chunks`` one key larger."""
        base, extra = divmod(self.size, chunks)
        out, start = [], 0
        for i in range(chunks):
            stop = start + base + (i < extra)
            out.append(KVBatchMeta(self.keys[start:stop], self.tags[start:stop], self.partition_id, self.fields, self.extra_info))
            start = stop
        return out

    @classmethod
    def concat(cls, data: list["KVBatchMeta"]) -> "KVBatchMeta":
        """One meta of the non-empty ``data`` in order; fields and partition must agree, ``extra_info``
        entries are merged and must not conflict."""
        data = [m for m in data if m and m.size > 0]
        if not data:
            return cls()
        base = data[0]
        extra: dict[str, Any] = {}
        for m in data:
            if m.fields is not None and set(m.fields) != set(base.fields or ()):
                raise ValueError("Field names do not match for concatenation.")
            if m.partition_id != base.partition_id:
                raise ValueError("Partition do not match for concatenation.")
            for k, v in (m.extra_info or {}).items():
                if k in extra and not _same_value(extra[k], v):
                    raise ValueError(f"KVBatchMeta.concat: extra_info key '{k}' has conflicting values across chunks.")
                extra.setdefault(k, v)
        return cls([k for m in data for k in m.keys], [t for m in data for t in m.tags], base.partition_id, base.fields, extra or None)

    def native(self) -> _NativeMeta:
        """This handle as a :class:`tq.KVBatchMeta` (tags as columns; a key without a tag gets ``None``)."""
        names = list(dict.fromkeys(name for t in self.tags for name in t))
        return _NativeMeta(
            self.partition_id or "",
            tuple(self.keys),
            tuple(self.fields or ()),
            tags={n: tuple(t.get(n) for t in self.tags) for n in names},
            extra_info=dict(self.extra_info or {}),
        )


def _same_value(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    return bool(a == b)


# ------------------------------------------------------------------------------------ process state
@dataclasses.dataclass
class _State:
    client: TQClient
    settings: dict[str, Any]  # {"connection": TQConnection, "wait_timeout_s": float | None}
    server: TQServer | None = None  # started by this process's init()
    handle: Any = None  # the Ray handle actor this process created
    pid: int = dataclasses.field(default_factory=os.getpid)  # the process connected (a fork connects anew)
    attached: bool = False  # connected to what the Ray job's handle actor published (another process's service)


_STATE: _State | None = None
_LOCK = threading.Lock()


def _new_lock_in_child() -> None:
    """A forked child's lock: one held by another thread of the parent at the fork would stay held."""
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def _ray_if_initialized() -> Any:
    if "ray" not in sys.modules:  # never import Ray for a process that does not use it
        return None
    import ray

    return ray if ray.is_initialized() else None


def _connect(settings: dict[str, Any]) -> TQClient:
    return settings["connection"].connect()


def _attach_existing() -> _State | None:
    """Attach to the service this process's job already has: ``$TQ_ADDRESS``, else the one published
    through the Ray job's handle actor."""
    address = os.environ.get("TQ_ADDRESS")
    if address:
        settings = _settings_of(OmegaConf.create(DEFAULT_CONFIG), address)
        return _State(_connect(settings), settings)
    ray = _ray_if_initialized()
    handle = _service.existing_handle(ray) if ray is not None else None
    if handle is None:
        return None
    settings = _service.await_settings(ray, handle, DEFAULT_CONFIG["data_plane"]["start_timeout_s"])
    return _State(_connect(settings), settings, attached=True)


def _still_published(state: _State) -> bool:
    """Whether the service ``state`` attached to through the Ray job's handle actor is still the one
    it publishes: a driver that closed and called init() again published a new one, which a reused
    Ray worker must connect to - not wait out its timeout on every call to the stopped one."""
    ray = _ray_if_initialized()
    if ray is None or not state.attached or state.pid != os.getpid():
        return True
    handle = _service.existing_handle(ray)
    if handle is None:
        return False
    try:
        settings = ray.get(handle.get_config.remote(), timeout=DEFAULT_CONFIG["data_plane"]["start_timeout_s"])
    except Exception:  # the actor is going away with its service
        return False
    return settings is not None and settings["connection"] == state.settings["connection"]


def _settings_of(conf: DictConfig, address: str) -> dict[str, Any]:
    """What every process of the job attaches with: the one :class:`~tq.TQConnection` value (its secret
    resolved here, from the config or ``$TQ_SECRET``) and the gets' default wait."""
    dp = conf.data_plane
    wait = _wait_seconds(dp.wait_timeout_s, "data_plane.wait_timeout_s")
    connection = TQConnection(
        address, secret=dp.secret, timeout_s=float(dp.timeout_s), transport=dp.transport, capacity_wait_s=float(dp.capacity_wait_s)
    )
    return {"connection": connection, "wait_timeout_s": wait}


def _wait_seconds(wait: Any, what: str) -> float | None:
    """A get's wait: None (fail at once when a field is not produced) or seconds >= 0."""
    if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < float("inf")):
        raise ValueError(f"{what} must be None or seconds >= 0, got {wait!r}")
    return None if wait is None else float(wait)


def init(conf: DictConfig | Mapping[str, Any] | None = None) -> DictConfig | None:
    """Start or attach to a TQ service and connect this process to it (once per process; a process
    forked from a connected one connects itself to the same service at its first call).

    In order, the first that applies:

    1. This process is connected already: nothing happens (returns ``conf``).
    2. ``conf.data_plane.address`` or ``$TQ_ADDRESS`` names a running ``tq-controller``: attach.
    3. A process of this Ray job already called :func:`init`: attach to the service it published
       through the named actor ``transfer_queue/TransferQueueController`` (returns ``conf``, like
       TransferQueue when it finds an existing controller). This is how Ray workers that call
       ``init()`` with no config find the driver's service.
    4. Start a service here (:class:`~tq.TQServer`: a controller and
       ``backend.SimpleStorage.num_data_storage_units`` storage units as processes of this host),
       stopped by this process's :func:`close` or at its exit.

    When Ray is initialized, the process that gets as far as 2 or 4 first also publishes the
    service through that actor (its settings, the secret included, are readable by the Ray job).

    Args:
        conf: merged into :data:`DEFAULT_CONFIG`; TransferQueue's config sections are accepted.
            Its own section is ``data_plane`` (address, secret, timeout_s, transport,
            wait_timeout_s, host, storage_units, capacity_bytes, ...).

    Returns:
        The merged config (``data_plane.address`` filled in), or ``conf`` when attaching to a
        service another process of the Ray job started.
    """
    global _STATE
    with _LOCK:
        if _STATE is not None:
            if _still_published(_STATE):
                return conf
            stale, _STATE = _STATE, None
            stale.client.close()
        merged = OmegaConf.merge(OmegaConf.create({}, flags={"allow_objects": True}), OmegaConf.create(DEFAULT_CONFIG))
        if conf:
            merged = OmegaConf.merge(merged, conf)
        backend = merged.backend.storage_backend
        if backend != "SimpleStorage":
            raise ValueError(
                f"backend.storage_backend={backend!r}: tq.compat.transfer_queue stores everything in the TQ service; "
                "use SimpleStorage (its num_data_storage_units sets the number of storage units)"
            )
        dp = merged.data_plane
        _settings_of(merged, "tcp://127.0.0.1:1")  # a bad setting fails here, before anything starts (an address to check with)
        address = dp.address or os.environ.get("TQ_ADDRESS")
        ray = _ray_if_initialized()
        handle = None
        if ray is not None:
            handle, created = _service.find_or_claim(ray)
            if not created:
                if address is None:  # the job's service: attach to what its first process published
                    settings = _service.await_settings(ray, handle, dp.start_timeout_s)
                    _STATE = _State(_connect(settings), settings, attached=True)
                    return conf
                handle = None  # an explicit address wins; the job's handle stays as it is
        server = None
        try:
            if address is None:
                secret = dp.secret if dp.secret is not None else os.environ.get("TQ_SECRET")
                units = dp.storage_units if dp.storage_units is not None else merged.backend.SimpleStorage.num_data_storage_units
                if isinstance(units, bool) or not isinstance(units, int) or units < 1:
                    source = "data_plane.storage_units" if dp.storage_units is not None else "backend.SimpleStorage.num_data_storage_units"
                    raise ValueError(f"{source} must be a whole number >= 1, got {units!r}")
                server = TQServer(
                    host=dp.host, storage_units=int(units), capacity=int(dp.capacity_bytes), secret=secret, start_timeout=dp.start_timeout_s
                )
                atexit.register(server.shutdown)
                address = server.address
            settings = _settings_of(merged, address)
            client = _connect(settings)
        except BaseException as exc:
            if server is not None:
                server.shutdown()
            if handle is not None:
                handle.fail.remote(f"the process that owns the TQ service failed to start it: {exc}")
                ray.kill(handle)
            raise
        if handle is not None:
            ray.get(handle.publish.remote(settings))
        dp.address = address
        _STATE = _State(client, settings, server, handle)
        return merged


def close() -> None:
    """Disconnect this process. In the process whose :func:`init` started the service, also stop the
    service (every key in it is gone) and remove the Ray handle actor."""
    global _STATE
    with _LOCK:
        state, _STATE = _STATE, None
    if state is None or state.pid != os.getpid():  # a forked child's copy: the connection, service and actor are its parent's
        return
    state.client.close()
    if state.handle is not None:
        ray = _ray_if_initialized()
        if ray is not None:
            try:
                ray.kill(state.handle)
            except Exception:  # Ray is shutting down: the actor goes with it
                pass
    if state.server is not None:
        state.server.shutdown()
        atexit.unregister(state.server.shutdown)


def _state() -> _State:
    global _STATE
    state = _STATE
    if state is not None and state.pid != os.getpid():  # a forked child (a DataLoader worker): connect it, once
        with _LOCK:
            if _STATE is state:
                _STATE = _State(_connect(state.settings), state.settings)
            state = _STATE
    if state is None:
        with _LOCK:
            if _STATE is None:
                _STATE = _attach_existing()
            state = _STATE
        if state is None:
            raise RuntimeError("TQ is not initialized in this process: call tq.compat.transfer_queue.init() first")
    return state


def get_client() -> TQClient:
    """This process's :class:`~tq.TQClient` (the native API: put / write_back / get / wait / ...)."""
    return _state().client


def alias_as_transfer_queue() -> None:
    """Make ``import transfer_queue`` in this process import this module, for frameworks whose own
    code imports ``transfer_queue`` (verl). In Ray workers too, with
    ``ray.init(runtime_env={"worker_process_setup_hook": "tq.compat.transfer_queue.alias_as_transfer_queue"})``.
    """
    sys.modules["transfer_queue"] = sys.modules[__name__]


# ------------------------------------------------------------------------------- column conversion
def _plain(fields: TensorDictBase) -> dict[str, Any]:
    """A TensorDict's top-level entries: tensors as they are, non-tensor values as lists."""
    out: dict[str, Any] = {}
    for name in fields.keys():
        value = fields.get(name)
        if is_non_tensor(value):
            out[name] = list(value.tolist())
        elif isinstance(value, TensorDictBase):
            raise ValueError(f"field {name!r} is a nested TensorDict: flatten it first (fields.flatten_keys())")
        else:
            out[name] = value
    return out


def _column(name: str, value: Any, n: int) -> Any:
    """A column for :meth:`TQClient.put`: per-sample tensors of one or more dims become a jagged
    column (one row per sample, its first dim free), per-sample scalars a dense ``[n]`` tensor,
    anything else a list of msgpack-able values."""
    if not isinstance(value, torch.Tensor):
        return list(value)  # per-sample tensors (scalars too) are checked and stacked by TQClient.put
    if value.is_nested:
        if value.layout == torch.jagged and getattr(value, "_ragged_idx", 1) == 1 and value.lengths() is None:
            return JaggedTensor(value.values(), value.offsets().to(torch.int64).cpu())
        return list(value.unbind())  # strided (or with holes): rows must share their trailing dims
    if value.dim() <= 1 or value.layout != torch.strided or 0 in value.shape[2:]:
        return value  # as it is: sparse is refused by TQClient.put naming it; entries of no bytes stay dense
    if value.shape[0] != n:
        raise ValueError(f"field {name!r} has {value.shape[0]} rows for {n} keys")
    length = value.shape[1]
    return JaggedTensor(value.reshape(n * length, *value.shape[2:]), torch.arange(n + 1, dtype=torch.int64) * length)


def _columns(fields: TensorDictBase | dict[str, Any], n: int, data_parser: Callable[[Any], Any] | None) -> dict[str, Any]:
    plain = _plain(fields) if isinstance(fields, TensorDictBase) else dict(fields)
    if data_parser is not None:
        # TransferQueue's contract: batched tensors as they are, nested tensors and non-tensor
        # columns as lists; the parser edits the values in place.
        plain = {k: list(v.unbind()) if isinstance(v, torch.Tensor) and v.is_nested else v for k, v in plain.items()}
        data_parser(plain)
    return {name: _column(name, value, n) for name, value in plain.items()}


def _tensordict(data: dict[str, Any], n: int) -> TensorDict:
    """The get's result as TransferQueue returns it: per-sample scalars as a dense ``[n]`` tensor,
    per-sample tensors as a jagged nested tensor (views of the fetched buffer, no copy), other
    values as a NonTensorStack."""
    out: dict[str, Any] = {}
    for name, value in data.items():
        if isinstance(value, JaggedTensor):
            out[name] = torch.nested.nested_tensor_from_jagged(value.values, value.offsets)
        elif isinstance(value, torch.Tensor):
            if value.dim() <= 1:
                out[name] = value
            else:  # a fixed-shape field written through TQClient: the same nested form
                length = value.shape[1]
                out[name] = torch.nested.nested_tensor_from_jagged(
                    value.reshape(n * length, *value.shape[2:]), torch.arange(n + 1, dtype=torch.int64) * length
                )
        else:
            out[name] = NonTensorStack(*value)
    return TensorDict(out, batch_size=[n])


# ------------------------------------------------------------------------------------------- writes
def _key_list(keys: Any, what: str = "keys") -> list[str]:
    if isinstance(keys, str):
        return [str.__str__(keys)]
    if not isinstance(keys, Iterable) or isinstance(keys, (bytes, Mapping)):
        raise TypeError(f"{what} must be a str or a list of str, got {type(keys).__name__}")
    keys = list(keys)
    if not all(isinstance(k, str) for k in keys):
        raise ValueError(f"{what} must be str, got {[type(k).__name__ for k in keys if not isinstance(k, str)][0]}")
    return plain_strs(keys)  # np.str_ (a verl uid array's items) as the str the wire carries


def _existing(client: TQClient, partition_id: str, keys: list[str]) -> _NativeMeta | None:
    """The keys' meta (tags, fields every key holds) if every key is registered; None if some are
    new. Creates the partition when it does not exist (TransferQueue creates partitions on write)."""
    try:
        return client.get_meta(partition_id, keys)
    except KeyNotFoundError:
        return None
    except PartitionNotFoundError:
        try:
            client.register_partition(partition_id)
        except PartitionExistsError:  # another writer created it meanwhile
            pass
        return None


def _register(client: TQClient, partition_id: str, keys: list[str]) -> _NativeMeta:
    """Register the keys not registered yet (no fields), then return the meta of all of them. Another
    writer registering one of them (DuplicateKeyError: nothing registered) or a clear removing one
    (KeyNotFoundError) in between is looked at again - an upsert does not fail for a race it lost."""
    attempt = 0
    while True:
        attempt += 1
        held = set(client.get_meta(partition_id).keys)
        new = [k for k in keys if k not in held]
        try:
            if new:
                client.register_keys(partition_id, new)
            return client.get_meta(partition_id, keys)
        except (DuplicateKeyError, KeyNotFoundError):
            if attempt == _UPSERT_ATTEMPTS:
                raise


#: How often an upsert looks again at keys that other writers registered or cleared under it.
_UPSERT_ATTEMPTS = 8


def _set_tags(client: TQClient, partition_id: str, keys: list[str], tags: list[dict]) -> None:
    """Merge per-key tag dicts into the controller's tags: one request per distinct set of keys
    sharing tag names (one, when every key gets the same names), so no other tag is touched."""
    groups: dict[tuple[int, ...], dict[str, list]] = {}
    for name in dict.fromkeys(n for t in tags for n in t):
        idx = tuple(i for i, t in enumerate(tags) if name in t)
        groups.setdefault(idx, {})[name] = [tags[i][name] for i in idx]
    for idx, columns in groups.items():
        client.set_tags(_NativeMeta(partition_id, tuple(keys[i] for i in idx), tags=columns))


def _put(keys: list[str], partition_id: str, fields: Any, tags: list[dict] | None, data_parser: Callable[[Any], Any] | None) -> KVBatchMeta:
    n = len(keys)
    if not isinstance(partition_id, str) or not partition_id:
        raise ValueError(f"partition_id must be a non-empty str, got {partition_id!r}")
    if tags is not None and (not isinstance(tags, (list, tuple)) or not all(t is None or isinstance(t, Mapping) for t in tags)):
        raise TypeError(f"tags must be a list of one dict (or None) per key, got {reprlib.repr(tags)}")
    tags = [dict(t) if t else {} for t in tags] if tags is not None else None
    names = list(dict.fromkeys(name for t in tags or () for name in t))
    # validates keys (unique) and tag values (None/bool/int/float/str) before any I/O
    check = _NativeMeta(partition_id, tuple(keys), tags={name: tuple(t.get(name) for t in tags) for name in names} if tags else {})
    columns = _columns(fields, n, data_parser) if fields is not None else {}
    client = _state().client
    for attempt in range(_UPSERT_ATTEMPTS):
        prev = _existing(client, partition_id, keys)
        if prev is None and columns:
            try:  # every key new (the common case): data and tags in one write
                client.put(partition_id, keys, columns, tags=dict(check.tags) or None)
                return KVBatchMeta(keys, tags or [{} for _ in keys], partition_id, sorted(columns), {})
            except DuplicateKeyError:  # some keys hold data already: register the new ones, write all back
                pass
        try:
            if prev is None:
                prev = _register(client, partition_id, keys)
            if columns:
                client.write_back(prev, columns, overwrite=True)
            if tags:
                _set_tags(client, partition_id, keys, tags)
            break
        except KeyNotFoundError:  # a clear took a key after it was looked up: as if it came first
            if attempt == _UPSERT_ATTEMPTS - 1:
                raise
    merged = [{**old, **new} for old, new in zip(_service.tag_dicts(prev.tags, n), tags or [{}] * n)]
    return KVBatchMeta(keys, merged, partition_id, sorted(set(prev.fields) | set(columns)), {})


def kv_put(
    key: str,
    partition_id: str,
    fields: TensorDict | dict[str, Any] | None = None,
    tag: dict[str, Any] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    """Put one sample: ``fields`` (a TensorDict of batch size 1, or a dict of unbatched values - each
    tensor gets a batch dim, anything else is one non-tensor value) and/or ``tag``.

    A new key is registered; an existing key gets new fields added and given fields overwritten; with
    ``fields=None`` only the tag is merged into the key's tags. Returns a :class:`KVBatchMeta` whose
    ``fields`` are all the fields the key holds now. ``data_parser(plain_dict)`` may rewrite the
    values in place before they are stored.

    Raises:
        ValueError: neither ``fields`` nor ``tag``; nested tensors in a dict (use kv_batch_put);
            ``fields`` neither dict nor TensorDict; a TensorDict of batch size other than 1.
    """
    if fields is None and tag is None:
        raise ValueError("Please provide at least one parameter of fields or tag.")
    if isinstance(fields, dict):
        batch: dict[str, Any] = {}
        for name, value in fields.items():
            if isinstance(value, torch.Tensor):
                if value.is_nested:
                    raise ValueError("Please use (async)kv_batch_put for batch operation")
                batch[name] = value.unsqueeze(0)
            else:
                batch[name] = [value]
        fields = batch
    elif fields is not None:
        if not isinstance(fields, TensorDictBase):
            raise ValueError("`fields` can only be dict or TensorDict")
        if tuple(fields.batch_size[:1]) != (1,):
            raise ValueError(f"kv_put stores one sample: `fields` needs batch_size [1], got {list(fields.batch_size)} (use kv_batch_put)")
    return _put(_key_list([key]), partition_id, fields, [tag] if tag is not None else None, data_parser)


def kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: TensorDict | None = None,
    tags: list[dict[str, Any]] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    """Put many samples in one write: ``fields`` a TensorDict with ``batch_size[0] == len(keys)``,
    ``tags`` one dict per key; either may be None (tags only: merged into existing tags).

    New keys are registered, existing ones get fields added or overwritten (see :func:`kv_put`).

    Raises:
        ValueError: neither ``fields`` nor ``tags``; ``fields``' batch size or ``tags``' length
            differs from ``len(keys)``; duplicate keys; a field or tag value that cannot be stored.
    """
    if fields is None and tags is None:
        raise ValueError("Please provide at least one parameter of `fields` or `tags`.")
    keys = _key_list(keys)
    if fields is not None:
        if not isinstance(fields, TensorDictBase):
            raise ValueError(f"`fields` must be a TensorDict, got {type(fields).__name__}")
        if not fields.batch_size or fields.batch_size[0] != len(keys):
            batch = fields.batch_size[0] if fields.batch_size else "[]"
            raise ValueError(f"`keys` with length {len(keys)} does not match the `fields` TensorDict with batch_size {batch}")
    if tags is not None and len(tags) != len(keys):
        raise ValueError(f"keys with length {len(keys)} does not match length of tags {len(tags)}")
    return _put(keys, partition_id, fields, tags, data_parser)


# -------------------------------------------------------------------------------------------- reads
def _get(keys: list[str], partition_id: str, fields: list[str] | None, wait_timeout_s: Any) -> TensorDict:
    state = _state()
    client = state.client
    wait = state.settings.get("wait_timeout_s") if wait_timeout_s is _FROM_CONFIG else _wait_seconds(wait_timeout_s, "wait_timeout_s")
    if not keys:
        raise ValueError("keys or partition were not found!")
    try:
        if not fields:  # the fields every key holds (none asked) / an existence check (empty list)
            meta = client.get_meta(partition_id, keys)
            if fields is not None or not meta.fields:
                return TensorDict({}, batch_size=[len(keys)])
        else:
            meta = _NativeMeta(partition_id, tuple(keys), tuple(fields))
        try:
            data = client.get(meta, layout="jagged", wait_timeout=wait)
        except PartitionNotFoundError:
            if wait is None:
                raise
            _existing(client, partition_id, [])  # a reader may come first: create it, then wait
            data = client.get(meta, layout="jagged", wait_timeout=wait)
    except (PartitionNotFoundError, KeyNotFoundError) as exc:
        raise ValueError(f"keys or partition were not found! ({exc})") from None
    except FieldNotProducedError as exc:
        raise ValueError(f"Some fields are not ready in all the requested keys! ({exc})") from None
    return _tensordict(data, len(keys))


def kv_batch_get(
    keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None, *, wait_timeout_s: float | None = _FROM_CONFIG
) -> TensorDict:
    """Get samples by key: a TensorDict of ``len(keys)`` rows in key order.

    ``select_fields`` (a name or a list) picks the fields; by default every field that all the keys
    hold. ``wait_timeout_s`` (default: the ``data_plane.wait_timeout_s`` given to :func:`init`):
    ``None`` fails at once when a field is not produced yet; a number parks the get on the
    controller until every key holds every selected field (a key not written yet included), then
    raises :class:`~tq.errors.TQTimeoutError` (a ``TimeoutError``).

    Raises:
        ValueError: unknown partition or keys ("keys or partition were not found!"); a selected
            field not produced for every key ("Some fields are not ready in all the requested keys!").
    """
    fields = [select_fields] if isinstance(select_fields, str) else (list(select_fields) if select_fields is not None else None)
    return _get(_key_list(keys), partition_id, fields, wait_timeout_s)


def kv_batch_get_by_meta(
    meta: KVBatchMeta, select_fields: list[str] | str | None = None, *, wait_timeout_s: float | None = _FROM_CONFIG
) -> TensorDict:
    """Get the samples of a :class:`KVBatchMeta` (from a put): its ``fields``, or ``select_fields``,
    which must be among them (ValueError otherwise). See :func:`kv_batch_get`."""
    if meta.partition_id is None:
        raise ValueError("Must provide partition_id in the input KVBatchMeta.")
    if select_fields is not None:
        fields = [select_fields] if isinstance(select_fields, str) else list(select_fields)
        if meta.fields is None or any(f not in meta.fields for f in fields):
            raise ValueError(
                f"Some fields assigned in select_fields not found in the metadata. "
                f"Assigned: {fields}; Fields in KVBatchMeta: {meta.fields}."
            )
    else:
        fields = list(meta.fields) if meta.fields is not None else None
    return _get(list(meta.keys), meta.partition_id, fields, wait_timeout_s)


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    """``{partition_id: {key: tag dict}}`` for one partition (``{}`` if it does not exist) or all."""
    client = _state().client
    pids = [partition_id] if partition_id is not None else [p["partition"] for p in client.list_partitions()]
    out: dict[str, dict[str, Any]] = {}
    for pid in pids:
        try:
            meta = client.get_meta(pid)
        except PartitionNotFoundError:  # absent, or dropped since it was listed
            continue
        out[pid] = dict(zip(meta.keys, _service.tag_dicts(meta.tags, len(meta.keys))))
    return out


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """Remove keys and all their data. Keys (or a partition) that do not exist are ignored."""
    keys = list(dict.fromkeys(_key_list(keys)))
    client = _state().client
    while keys:
        try:
            client.discard(_NativeMeta(partition_id, tuple(keys)))
            return
        except PartitionNotFoundError:
            return
        except KeyNotFoundError:  # some keys are not there (or were cleared meanwhile): only the others
            try:
                held = set(client.get_meta(partition_id).keys)
            except PartitionNotFoundError:
                return
            keys = [k for k in keys if k in held]


# -------------------------------------------------------------------------------------- async twins
async def async_kv_put(
    key: str,
    partition_id: str,
    fields: TensorDict | dict[str, Any] | None = None,
    tag: dict[str, Any] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    """:func:`kv_put` on a worker thread (the event loop keeps running)."""
    return await asyncio.to_thread(kv_put, key, partition_id, fields, tag, data_parser)


async def async_kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: TensorDict | None = None,
    tags: list[dict[str, Any]] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    """:func:`kv_batch_put` on a worker thread."""
    return await asyncio.to_thread(kv_batch_put, keys, partition_id, fields, tags, data_parser)


async def async_kv_batch_get(
    keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None, *, wait_timeout_s: float | None = _FROM_CONFIG
) -> TensorDict:
    """:func:`kv_batch_get` on a worker thread (a parked wait does not block the event loop)."""
    return await asyncio.to_thread(kv_batch_get, keys, partition_id, select_fields, wait_timeout_s=wait_timeout_s)


async def async_kv_batch_get_by_meta(
    meta: KVBatchMeta, select_fields: list[str] | str | None = None, *, wait_timeout_s: float | None = _FROM_CONFIG
) -> TensorDict:
    """:func:`kv_batch_get_by_meta` on a worker thread."""
    return await asyncio.to_thread(kv_batch_get_by_meta, meta, select_fields, wait_timeout_s=wait_timeout_s)


async def async_kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    """:func:`kv_list` on a worker thread."""
    return await asyncio.to_thread(kv_list, partition_id)


async def async_kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """:func:`kv_clear` on a worker thread."""
    await asyncio.to_thread(kv_clear, keys, partition_id)
