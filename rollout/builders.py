"""Building the pieces a rollout actor or collector runs on, from configs or existing objects.

- ``resolve_generation``: a ``GenerationInterface`` from a backend config (dict or
  ``GenerationBackendConfig``), an existing backend, or existing generation actor handle(s).
- ``resolve_tokenizer``: the tokenizer given, or the one the generation config / backend names.
- ``resolve_environments``: a task -> environment map from instances, names or ``{"name", ...}`` dicts.
- ``as_records``: a prompt batch (a list of ``DatumSpec`` or ``collate_datums`` columns) as records.
- ``prompt_uids``: the stable per-prompt ids keys are minted from.
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping, Sequence

import torch

from .data import DatasetError
from .environments import make_environment
from .generation import GenerationBackendConfig, make_generation_backend
from .generation.ray_worker import RayGenerationPool
from .interfaces import EnvironmentInterface, GenerationInterface

TRAIN_PARTITION = "train"
VAL_PARTITION = "val"


class AdoptedGenerationPool(RayGenerationPool):
    """A ``RayGenerationPool`` over generation actors someone else started (``RayGenerationWorker``s).

    It generates and refits through them exactly like a pool that started them, but ``shutdown``
    leaves them running: their owner kills them.
    """

    def __init__(self, workers: Sequence[Any], *, timeout_s: float = 600.0) -> None:  # noqa: D107 - see class
        # Deliberately not calling RayGenerationPool.__init__ (it starts new actors); set what it sets.
        if not workers:
            raise ValueError("AdoptedGenerationPool needs at least one generation actor handle")
        self.config = GenerationBackendConfig(ray_timeout_s=timeout_s)
        self.timeout_s = timeout_s
        self.workers = list(workers)
        versions = self._get([w.ready.remote() for w in self.workers], "reach the generation actors")
        if len(set(versions)) != 1:
            raise RuntimeError(f"the generation actors are at different weight versions {versions}")
        self._version = int(versions[0])
        self._next_worker = itertools.cycle(range(len(self.workers)))

    def shutdown(self) -> None:
        """Forget the actors without killing them (they are not this pool's)."""
        self.workers = []


def _is_actor_handle(obj: Any) -> bool:
    try:
        from ray.actor import ActorHandle
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return isinstance(obj, ActorHandle)


def resolve_generation(
    generation: GenerationInterface | GenerationBackendConfig | Mapping[str, Any] | Any | None,
    *,
    tokenizer: Any = None,
    seed: int | None = None,
    timeout_s: float = 600.0,
    placement_group: Any = None,
) -> tuple[GenerationInterface, bool]:
    """``(backend, owned)``: the backend ``generation`` names, and whether it was built here.

    ``generation`` is a backend (used as is), a config (built with ``make_generation_backend``; ``seed``
    overrides its sampling seed; an in-process transformers backend shares ``tokenizer``), a Ray
    actor handle or a list of them (``RayGenerationWorker`` actors, adopted), or None (the default
    config: the offline tiny model). ``placement_group``: where a config's Ray workers run (see
    ``make_generation_backend``).
    """
    if isinstance(generation, GenerationInterface):
        return generation, False
    if _is_actor_handle(generation):
        return AdoptedGenerationPool([generation], timeout_s=timeout_s), False
    if isinstance(generation, (list, tuple)) and generation and all(_is_actor_handle(h) for h in generation):
        return AdoptedGenerationPool(list(generation), timeout_s=timeout_s), False
    if generation is None:
        config = GenerationBackendConfig()
    elif isinstance(generation, GenerationBackendConfig):
        config = generation
    elif isinstance(generation, Mapping):
        config = GenerationBackendConfig(**generation)
    else:
        raise TypeError(
            "generation must be a GenerationInterface, a GenerationBackendConfig (or dict), a generation actor "
            f"handle or a list of them; got {type(generation).__name__}"
        )
    if seed is not None:
        config = config.model_copy(update={"seed": int(seed)})
    shares_tokenizer = tokenizer is not None and config.ray_workers == 0 and config.backend == "hf"
    shared = {"tokenizer": tokenizer} if shares_tokenizer else {}
    return make_generation_backend(config, placement_group=placement_group, **shared), True


def resolve_tokenizer(tokenizer: Any, generation: Any) -> Any:
    """The tokenizer to use: ``tokenizer`` (an object, or a name for ``load_tokenizer``), else the one
    a generation config names (``tokenizer_name`` or ``model_name``), else the backend's own."""
    from common.models import load_tokenizer

    if tokenizer is not None and not isinstance(tokenizer, str):
        return tokenizer
    name = tokenizer
    if name is None:
        if isinstance(generation, Mapping):
            generation = GenerationBackendConfig(**generation)
        if generation is None:
            generation = GenerationBackendConfig()
        if isinstance(generation, GenerationBackendConfig):
            name = generation.tokenizer_name or generation.model_name
        elif getattr(generation, "tokenizer", None) is not None:
            return generation.tokenizer
        else:
            raise ValueError("pass a tokenizer (or its name): it cannot be read from this generation backend")
    return load_tokenizer(name)


def resolve_environments(
    environments: Mapping[str, EnvironmentInterface | str | Mapping[str, Any]],
) -> dict[str, EnvironmentInterface]:
    """A task -> environment map; each value is an environment, a registered name
    (``make_environment``), or ``{"name": ..., **kwargs}``."""
    if not isinstance(environments, Mapping) or not environments:
        raise ValueError("environments must be a non-empty map of task name -> environment")
    out: dict[str, EnvironmentInterface] = {}
    for task, spec in environments.items():
        if isinstance(spec, EnvironmentInterface):
            out[task] = spec
        elif isinstance(spec, str):
            out[task] = make_environment(spec)
        elif isinstance(spec, Mapping) and isinstance(spec.get("name"), str):
            out[task] = make_environment(spec["name"], **{k: v for k, v in spec.items() if k != "name"})
        else:
            raise TypeError(
                f"environment for task {task!r} must be an EnvironmentInterface, a name or a "
                f"{{'name': ..., **kwargs}} dict; got {type(spec).__name__}"
            )
    return out


def _item(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()
    return value


def as_records(batch: Any) -> list[dict[str, Any]]:
    """A prompt batch as one record (``DatumSpec``-like dict) per prompt.

    Accepts a sequence of records, or columns as ``rollout.data.collate_datums`` makes them (a
    mapping of equal-length lists / 1-d tensors with a ``message_log`` list).
    """
    if isinstance(batch, Mapping):
        if not isinstance(batch.get("message_log"), list):
            raise DatasetError("a prompt batch given as columns needs a 'message_log' list (see rollout.data.collate_datums)")
        n = len(batch["message_log"])
        cols = {}
        for k, v in batch.items():
            size = v.shape[0] if isinstance(v, torch.Tensor) and v.dim() > 0 else (len(v) if isinstance(v, (list, tuple)) else None)
            if size != n:
                raise DatasetError(f"prompt batch column {k!r} has {size} entries for {n} prompts")
            cols[k] = v
        return [{k: _item(v[i]) for k, v in cols.items()} for i in range(n)]
    if isinstance(batch, (list, tuple)):
        return [dict(r) if isinstance(r, Mapping) else r for r in batch]
    raise DatasetError(f"a prompt batch must be a list of records or a mapping of columns, got {type(batch).__name__}")


def prompt_uids(records: Sequence[Mapping[str, Any]], uids: Sequence[Any] | None = None) -> tuple[list[str], list[int]]:
    """``(uids, prompt_ids)`` of a prompt batch.

    ``uids`` (strings keys are minted from) default to each record's dataset ``idx``; ``prompt_ids``
    (ints that group a prompt's samples) are the ``idx`` values when every record has one, else
    positions. Duplicate uids in one batch raise (their keys would collide): pass ``uids=``.
    """
    idxs = [r.get("idx") for r in records]
    have_idx = all(isinstance(i, int) and not isinstance(i, bool) for i in idxs)
    if uids is None:
        uids = [str(i) for i in idxs] if have_idx else [str(p) for p in range(len(records))]
    uids = [str(u) for u in uids]
    if len(uids) != len(records):
        raise ValueError(f"{len(uids)} uids for {len(records)} prompts")
    if len(set(uids)) != len(uids):
        dup = next(u for i, u in enumerate(uids) if u in uids[:i])
        raise ValueError(f"prompt uid {dup!r} appears twice in one batch; its keys would collide (pass distinct uids=)")
    prompt_ids = [int(i) for i in idxs] if have_idx and len(set(idxs)) == len(idxs) else list(range(len(records)))
    return uids, prompt_ids
