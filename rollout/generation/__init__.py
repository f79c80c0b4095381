"""Generation backends behind ``rollout.interfaces.GenerationInterface``.

- ``HFGenerationBackend``: transformers ``generate`` on CPU or GPU (the offline default).
- ``VllmGenerationBackend``: vLLM on GPU (optional extra; imported only when selected).
- ``SyntheticGenerationBackend``: random token sequences of configurable length at negligible compute
  (no model; refit is a no-op) - isolates data movement in benchmarks.
- ``RayGenerationPool``: either of them in Ray worker processes, refitted through the object store.

``make_generation_backend(config)`` picks one from a ``GenerationBackendConfig``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollout.generation.config import GenerationBackendConfig
from rollout.interfaces import GenerationInterface

if TYPE_CHECKING:
    from rollout.generation.hf_backend import HFGenerationBackend
    from rollout.generation.ray_worker import RayGenerationPool, RayGenerationWorker
    from rollout.generation.vllm_backend import VllmGenerationBackend


def make_generation_backend(
    config: GenerationBackendConfig | dict[str, Any] | None = None, *, placement_group: Any = None, **hf_kwargs: Any
) -> GenerationInterface:
    """Build the backend ``config`` selects.

    ``backend`` picks "hf" (transformers), "vllm" or "synthetic"; ``ray_workers > 0`` puts that many copies in Ray
    actors behind a ``RayGenerationPool`` (needs ``ray.init``), in the bundles of ``placement_group`` if
    given (one per worker, shared with the policy ranks colocated there). ``hf_kwargs`` (``model=``,
    ``tokenizer=``) go to an in-process transformers backend, e.g. to share a colocated policy's model.
    """
    if config is None:
        config = GenerationBackendConfig()
    elif isinstance(config, dict):
        config = GenerationBackendConfig(**config)
    if config.ray_workers > 0:
        if hf_kwargs:
            raise ValueError("model=/tokenizer= cannot be shared with Ray workers (they load their own)")
        from rollout.generation.ray_worker import RayGenerationPool

        return RayGenerationPool(config, placement_group=placement_group)
    if placement_group is not None:
        raise ValueError("placement_group places Ray generation workers: it needs generation.ray_workers > 0")
    if config.backend == "vllm":
        if hf_kwargs:
            raise ValueError(f"the vLLM backend takes no {sorted(hf_kwargs)}")
        from rollout.generation.vllm_backend import VllmGenerationBackend

        return VllmGenerationBackend(config)
    if config.backend == "synthetic":
        unknown = sorted(set(hf_kwargs) - {"tokenizer"})
        if unknown:
            raise ValueError(f"the synthetic backend takes no {unknown}")
        from rollout.generation.synthetic import SyntheticGenerationBackend

        return SyntheticGenerationBackend(config, **hf_kwargs)
    from rollout.generation.hf_backend import HFGenerationBackend

    return HFGenerationBackend(config, **hf_kwargs)


def __getattr__(name: str) -> Any:
    # Lazy exports: importing the package must not import vLLM (optional) or Ray.
    if name == "HFGenerationBackend":
        from rollout.generation.hf_backend import HFGenerationBackend

        return HFGenerationBackend
    if name in ("RayGenerationPool", "RayGenerationWorker"):
        from rollout.generation import ray_worker

        return getattr(ray_worker, name)
    if name == "SyntheticGenerationBackend":
        from rollout.generation.synthetic import SyntheticGenerationBackend

        return SyntheticGenerationBackend
    if name in ("VllmGenerationBackend", "VllmWeightSyncExtension"):
        from rollout.generation import vllm_backend

        return getattr(vllm_backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GenerationBackendConfig",
    "HFGenerationBackend",
    "RayGenerationPool",
    "RayGenerationWorker",
    "SyntheticGenerationBackend",
    "VllmGenerationBackend",
    "make_generation_backend",
]
