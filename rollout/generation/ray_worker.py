"""Generation in its own Ray worker processes, behind the same ``GenerationInterface``.

``RayGenerationWorker`` is the actor body: it builds a backend (transformers or vLLM) from a config
inside the worker process, so model weights are never pickled at start-up. ``RayGenerationPool``
is the driver-side handle: it implements ``GenerationInterface`` by splitting a batch over its
workers (contiguous chunks, reassembled in order), and refits all of them with one ``ray.put`` of
the state dict - each worker reads it from the object store - or with a weight bucket
(``common.weight_sync``: a CUDA IPC handle every worker on the policy's GPU maps, or an NCCL broadcast
in which worker ``i`` takes ranks ``1 + i * tensor_parallel_size`` onwards). Every remote call is
bounded by ``config.ray_timeout_s``.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Mapping, Sequence

import torch

from common.placement import bundle_count, in_bundle
from common.weight_sync import is_weight_bucket
from rollout.generation.config import GenerationBackendConfig
from rollout.interfaces import GenerationInterface, GenerationOutput


class RayGenerationWorker:
    """The body of one generation actor (wrap with ``ray.remote``; ``RayGenerationPool`` does)."""

    def __init__(self, config: dict[str, Any]) -> None:
        from rollout.generation import make_generation_backend

        cfg = GenerationBackendConfig(**{**config, "ray_workers": 0})  # the worker runs it in-process
        self.backend = make_generation_backend(cfg)

    def ready(self) -> int:
        """Returns the loaded weight version once the backend is built (used as a start-up barrier)."""
        return self.backend.weight_version

    def generate(
        self,
        prompts: list[torch.Tensor],
        max_new_tokens: int,
        stop_strings: list[list[str] | None] | None,
        greedy: bool,
    ) -> GenerationOutput:
        """``GenerationInterface.generate`` on this worker's backend."""
        return self.backend.generate(prompts, max_new_tokens=max_new_tokens, stop_strings=stop_strings, greedy=greedy)

    def update_weights(self, state_dict: Mapping[str, Any], weight_version: int) -> int:
        """Refit from a state dict or a weight bucket (Ray resolves an ObjectRef argument from the object store)."""
        self.backend.update_weights(state_dict, weight_version)
        return self.backend.weight_version

    def weight_version(self) -> int:
        """Version of the weights this worker generates with."""
        return self.backend.weight_version

    def prepare_for_generation(self) -> None:
        """Forward to the backend (e.g. wake a sleeping vLLM engine)."""
        self.backend.prepare_for_generation()

    def finish_generation(self) -> None:
        """Forward to the backend (e.g. free vLLM's KV cache)."""
        self.backend.finish_generation()


class RayGenerationPool(GenerationInterface):
    """``GenerationInterface`` over ``num_workers`` generation actors (needs ``ray.init`` first).

    Each actor reserves ``config.num_cpus_per_worker`` CPUs (fractional, default 0.25, so a 2-core
    machine can host several) and ``config.num_gpus_per_worker`` GPUs; with ``placement_group``,
    worker ``j`` runs in its bundle ``j`` (modulo its bundle count), beside the policy rank of that
    bundle. ``generate`` splits a batch into contiguous chunks, one per worker; ``generate_async``
    sends each single-prompt request to the next worker in turn.
    """

    def __init__(self, config: GenerationBackendConfig, *, num_workers: int | None = None, placement_group: Any = None) -> None:
        import ray

        if not ray.is_initialized():
            raise RuntimeError("RayGenerationPool needs a running Ray (call ray.init first)")
        n = num_workers if num_workers is not None else max(1, config.ray_workers)
        if n < 1:
            raise ValueError(f"num_workers must be >= 1, got {n}")
        self.config = config
        self.timeout_s = config.ray_timeout_s
        actor_cls = ray.remote(RayGenerationWorker)
        cfg = config.model_dump()
        bundles = 1 if placement_group is None else bundle_count(placement_group, 1, "RayGenerationPool")
        self.workers = [
            actor_cls.options(
                num_cpus=config.num_cpus_per_worker, num_gpus=config.num_gpus_per_worker, **in_bundle(placement_group, j % bundles)
            ).remote(cfg)
            for j in range(n)
        ]
        versions = self._get([w.ready.remote() for w in self.workers], "start generation workers")
        self._version = int(versions[0])
        self._next_worker = itertools.cycle(range(n))

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        import ray

        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{what}: no answer from the generation workers within {self.timeout_s:.0f}s") from None

    def generate(
        self,
        prompts: Sequence[torch.Tensor],
        *,
        max_new_tokens: int,
        stop_strings: Sequence[Sequence[str] | None] | None = None,
        greedy: bool = False,
    ) -> GenerationOutput:
        """Split the batch over the workers, generate, and reassemble in prompt order."""
        prompts = list(prompts)
        if stop_strings is not None and len(stop_strings) != len(prompts):
            raise ValueError(f"stop_strings has {len(stop_strings)} entries for {len(prompts)} prompts")
        n = len(self.workers)
        bounds = [round(i * len(prompts) / n) for i in range(n + 1)]
        refs = []
        for w, lo, hi in zip(self.workers, bounds, bounds[1:]):
            if hi > lo:
                stops = None if stop_strings is None else [None if s is None else list(s) for s in stop_strings[lo:hi]]
                refs.append(w.generate.remote(prompts[lo:hi], max_new_tokens, stops, greedy))
        parts: list[GenerationOutput] = self._get(refs, "generate")
        out = GenerationOutput(response_ids=[], logprobs=[], finish_reasons=[], weight_version=self._version)
        for part in parts:
            out.response_ids += part.response_ids
            out.logprobs += part.logprobs
            out.finish_reasons += part.finish_reasons
            if part.weight_version != self._version:
                raise RuntimeError(f"a generation worker is at weight version {part.weight_version}, expected {self._version}")
        return out

    async def generate_async(
        self,
        prompt: torch.Tensor,
        *,
        max_new_tokens: int,
        stop_strings: Sequence[str] | None = None,
        greedy: bool = False,
    ) -> GenerationOutput:
        """One prompt on the next worker (round robin), awaited without blocking the event loop."""
        worker = self.workers[next(self._next_worker)]
        ref = worker.generate.remote([prompt], max_new_tokens, None if stop_strings is None else [list(stop_strings)], greedy)
        try:
            return await asyncio.wait_for(ref, timeout=self.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"generate_async: no answer within {self.timeout_s:.0f}s") from None

    def update_weights(self, state_dict: Mapping[str, Any] | Sequence[Any], weight_version: int) -> None:
        """Push new weights to every worker: a state dict as one object-store copy read by all of
        them; a weight bucket as it is (small: a handle or a broadcast's layout); a list of one bucket
        (or its object reference) per worker, worker ``j`` getting item ``j`` (a CUDA IPC refit: each
        worker maps the buffer of the policy rank on its own GPU)."""
        import ray

        n = len(self.workers)
        if isinstance(state_dict, (list, tuple)):
            if len(state_dict) != n:
                raise ValueError(f"update_weights got {len(state_dict)} per-worker buckets for {n} generation workers")
            per_worker = list(state_dict)
        elif is_weight_bucket(state_dict):
            per_worker = [state_dict] * n
            if state_dict["transport"] == "nccl":  # each worker's ranks in the sender's group
                tp = self.config.vllm_tensor_parallel_size
                base = int(state_dict["group"].get("rank_offset", 1))
                per_worker = [{**state_dict, "group": {**state_dict["group"], "rank_offset": base + i * tp}} for i in range(n)]
        else:  # one object-store copy, read by every worker
            per_worker = [ray.put({k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()})] * n
        try:
            self._get([w.update_weights.remote(b, int(weight_version)) for w, b in zip(self.workers, per_worker)], "update_weights")
        finally:
            del per_worker  # a state dict's object-store copy goes with its last reference
        self._version = int(weight_version)

    @property
    def weight_version(self) -> int:
        """Version every worker was last refitted to."""
        return self._version

    def prepare_for_generation(self) -> None:
        """Forward to every worker."""
        self._get([w.prepare_for_generation.remote() for w in self.workers], "prepare_for_generation")

    def finish_generation(self) -> None:
        """Forward to every worker."""
        self._get([w.finish_generation.remote() for w in self.workers], "finish_generation")

    def shutdown(self) -> None:
        """Kill the worker actors (idempotent)."""
        import ray

        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # already dead: nothing to release
                pass
        self.workers = []
