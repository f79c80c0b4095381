"""The vLLM backend (GPU, optional extra ``pip install 'tq-rl[vllm]'``), on vLLM's public API.

- Engine: ``vllm.LLM`` (offline, batched) or, with ``vllm_async_engine=True``, ``vllm.AsyncLLMEngine``
  driven from a private event-loop thread, so both ``generate`` and ``generate_async`` work and
  concurrent ``generate_async`` calls are batched by vLLM's scheduler.
- Sampling: one ``SamplingParams`` per prompt (per-prompt stop strings and a per-request seed derived
  from ``(config.seed, call counter, prompt index)``), ``logprobs=0`` so vLLM returns the sampled
  token's log-prob, ``include_stop_str_in_output=True`` so the response ends right after the stop
  string like the transformers backend's. The engine is started with
  ``logprobs_mode="processed_logprobs"`` (or ``"raw_logprobs"``), matching ``HFGenerationBackend``.
- Refit: the engine loads ``VllmWeightSyncExtension`` (``rollout.generation.weight_sync``) into every
  worker (``worker_extension_cls``). ``update_weights`` takes a state dict (sent as ``"bytes"`` weight
  buckets of at most ``REFIT_CHUNK_BYTES``: the fallback) or a weight bucket a policy rank made
  (``policy.weight_sync``: ``"cuda_ipc"`` for a colocated policy, ``"nccl"`` across GPUs), passes it
  through ``collective_rpc`` - plain values only, so it survives vLLM's engine-core process boundary
  (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, the default) - and each worker calls its model's
  ``load_weights`` (which maps Hugging Face names onto vLLM's fused layers). Then the prefix cache is
  reset so no KV computed with old weights is reused.
- Sleep mode (``vllm_enable_sleep_mode``): ``finish_generation`` puts the engine to sleep (level 1:
  weights offloaded to CPU, KV cache dropped) so a colocated policy can train; a refit wakes only the
  weights (``wake_up(tags=["weights"])``) before loading - loading into sleeping weights is a CUDA
  error - and ``prepare_for_generation`` wakes whatever still sleeps (the KV cache) before generating.

vLLM is imported lazily: importing this module never needs it. This backend cannot run on a machine
without vLLM and a GPU; its tests skip there.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
import uuid
from typing import Any, Mapping, Sequence

import torch

from common.models import DTYPES, TINY_MODEL, load_model, load_tokenizer
from common.weight_sync import bytes_buckets, is_weight_bucket
from rollout.generation.common import CallSeeds, prepare_request, resolve_stop_token_ids
from rollout.generation.config import GenerationBackendConfig
from rollout.generation.weight_sync import VllmWeightSyncExtension
from rollout.interfaces import GenerationInterface, GenerationOutput

# A state dict is sent in "bytes" buckets of at most this many bytes (bounds one RPC message).
REFIT_CHUNK_BYTES = 512 << 20


class VllmGenerationBackend(GenerationInterface):
    """``GenerationInterface`` on a vLLM engine (see the module docstring)."""

    def __init__(self, config: GenerationBackendConfig) -> None:
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise ImportError("the vLLM backend needs vLLM: pip install 'tq-rl[vllm]' (GPU only)") from exc
        if config.backend != "vllm":
            raise ValueError(f"VllmGenerationBackend needs backend='vllm', got {config.backend!r}")
        self.config = config
        self._tmpdir: tempfile.TemporaryDirectory | None = None
        model_path = config.model_name
        tokenizer_path = config.tokenizer_name or config.model_name
        self.tokenizer = load_tokenizer(tokenizer_path)
        if config.model_name == TINY_MODEL:
            # vLLM loads from a directory: materialise the seeded tiny model (and its tokenizer) once.
            self._tmpdir = tempfile.TemporaryDirectory(prefix="tqrl-tiny-")
            model = load_model(
                TINY_MODEL, dtype=config.dtype, seed=config.model_seed, tokenizer=self.tokenizer, tiny_overrides=config.tiny_overrides
            )
            model.save_pretrained(self._tmpdir.name)
            self.tokenizer.save_pretrained(self._tmpdir.name)
            model_path = tokenizer_path = self._tmpdir.name
            model_eos = model.generation_config.eos_token_id
            del model
        else:
            from transformers import GenerationConfig as HFGenerationConfig

            try:
                model_eos = HFGenerationConfig.from_pretrained(model_path).eos_token_id
            except OSError:  # no generation_config.json: the tokenizer's EOS is the stop token
                model_eos = None
        self.stop_token_ids = resolve_stop_token_ids(self.tokenizer, model_eos, config.stop_token_ids)

        engine_kwargs: dict[str, Any] = dict(
            model=model_path,
            tokenizer=tokenizer_path,
            dtype=config.dtype,
            seed=config.seed,
            tensor_parallel_size=config.vllm_tensor_parallel_size,
            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            enforce_eager=config.vllm_enforce_eager,
            enable_sleep_mode=config.vllm_enable_sleep_mode,
            worker_extension_cls=f"{VllmWeightSyncExtension.__module__}.{VllmWeightSyncExtension.__qualname__}",
            logprobs_mode="processed_logprobs" if config.logprobs_mode == "processed" else "raw_logprobs",
            **config.vllm_extra_kwargs,
        )
        if config.vllm_max_model_len is not None:
            engine_kwargs["max_model_len"] = config.vllm_max_model_len

        self._version = 0
        self._asleep: set[str] = set()  # sleep-mode tags ("weights", "kv_cache") now asleep
        self._dtype = DTYPES[config.dtype]
        self._seeds = CallSeeds(config.seed)
        self._lock = threading.Lock()  # vllm.LLM is not thread-safe; generate_async threads queue here
        self._loop: asyncio.AbstractEventLoop | None = None
        if config.vllm_async_engine:
            from vllm import AsyncEngineArgs, AsyncLLMEngine

            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine-loop", daemon=True)
            self._loop_thread.start()

            async def _build() -> Any:
                return AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**engine_kwargs))

            self.engine = self._run(_build())
            self.llm = None
        else:
            from vllm import LLM

            self.llm = LLM(**engine_kwargs)
            self.engine = None

    # ------------------------------------------------------------------ helpers
    def _run(self, coro: Any) -> Any:
        """Run a coroutine on the engine's loop thread and wait for it (bounded)."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=self.config.ray_timeout_s)

    def _sampling_params(self, stops: list[str], max_new_tokens: int, greedy: bool, seed: int) -> Any:
        from vllm import SamplingParams

        cfg = self.config
        return SamplingParams(
            n=1,
            temperature=0.0 if greedy else cfg.temperature,
            top_p=1.0 if greedy else cfg.top_p,
            top_k=0 if greedy or cfg.top_k <= 0 else cfg.top_k,  # 0 disables top-k in current vLLM
            max_tokens=max_new_tokens,
            logprobs=0,  # just the sampled token's log-prob
            stop=stops or None,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=True,
            skip_special_tokens=True,
            detokenize=bool(stops),  # responses are token ids; text is needed only to match stop strings
            seed=None if greedy else seed,
        )

    @staticmethod
    def _to_output(request_output: Any) -> tuple[torch.Tensor, torch.Tensor, str]:
        """(token ids, float32 log-probs, finish reason) of one vLLM ``RequestOutput``."""
        completion = request_output.outputs[0]
        ids = list(completion.token_ids)
        if completion.logprobs is None or len(completion.logprobs) != len(ids):
            raise RuntimeError("vLLM returned no per-token log-probs (SamplingParams.logprobs must be 0)")
        if completion.finish_reason not in ("stop", "length"):  # "abort": the engine dropped the request
            raise RuntimeError(f"vLLM request ended with finish_reason={completion.finish_reason!r}")
        lps = [float(step[tok].logprob) for step, tok in zip(completion.logprobs, ids)]
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(lps, dtype=torch.float32), completion.finish_reason

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Sequence[torch.Tensor],
        *,
        max_new_tokens: int,
        stop_strings: Sequence[Sequence[str] | None] | None = None,
        greedy: bool = False,
    ) -> GenerationOutput:
        """Generate one completion per prompt with vLLM (results in prompt order)."""
        from vllm.inputs import TokensPrompt

        prompts, stops, greedy = prepare_request(prompts, stop_strings, max_new_tokens, greedy, self.config)
        base = self._seeds.next()
        params = [self._sampling_params(stops[i], max_new_tokens, greedy, (base + i) % (1 << 63)) for i in range(len(prompts))]
        inputs = [TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts]
        if self.engine is not None:
            results = self._run(self._agenerate_all(inputs, params))
        else:
            with self._lock:
                results = self.llm.generate(inputs, sampling_params=params, use_tqdm=False)
        out = GenerationOutput(response_ids=[], logprobs=[], finish_reasons=[], weight_version=self._version)
        for r in results:
            ids, lps, reason = self._to_output(r)
            out.response_ids.append(ids)
            out.logprobs.append(lps)
            out.finish_reasons.append(reason)
        return out

    async def _agenerate_all(self, prompts: list[Any], params: list[Any]) -> list[Any]:
        # A coroutine for _run (run_coroutine_threadsafe takes no future, which is what gather returns).
        return await asyncio.gather(*(self._agenerate(x, sp) for x, sp in zip(prompts, params)))

    async def _agenerate(self, prompt: Any, params: Any) -> Any:
        final = None
        async for item in self.engine.generate(prompt, params, request_id=uuid.uuid4().hex):
            final = item
        if final is None:
            raise RuntimeError("vLLM returned no output for a request")
        return final

    async def generate_async(
        self,
        prompt: torch.Tensor,
        *,
        max_new_tokens: int,
        stop_strings: Sequence[str] | None = None,
        greedy: bool = False,
    ) -> GenerationOutput:
        """One prompt; with the async engine, concurrent calls share vLLM's continuous batching."""
        if self.engine is None:
            return await super().generate_async(prompt, max_new_tokens=max_new_tokens, stop_strings=stop_strings, greedy=greedy)
        from vllm.inputs import TokensPrompt

        (p,), (stops,), greedy = prepare_request([prompt], [stop_strings], max_new_tokens, greedy, self.config)
        seed = self._seeds.next()
        fut = asyncio.run_coroutine_threadsafe(
            self._agenerate(TokensPrompt(prompt_token_ids=p.tolist()), self._sampling_params(stops, max_new_tokens, greedy, seed)),
            self._loop,
        )
        result = await asyncio.wait_for(asyncio.wrap_future(fut), timeout=self.config.ray_timeout_s)
        ids, lps, reason = self._to_output(result)
        return GenerationOutput(response_ids=[ids], logprobs=[lps], finish_reasons=[reason], weight_version=self._version)

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, state_dict: Mapping[str, Any], weight_version: int) -> None:
        """Load new weights into every vLLM worker, then drop the prefix cache built with the old ones.

        ``state_dict``: a state dict of tensors (sent as ``"bytes"`` buckets) or one weight bucket
        (``common.weight_sync``). A sleeping engine gets its weights woken first (its KV cache stays
        asleep until ``prepare_for_generation``). Call it between generation phases: requests in
        flight on the async engine during a refit would mix old and new weights.
        """
        if is_weight_bucket(state_dict):
            buckets = [state_dict]
        else:
            buckets = bytes_buckets(state_dict, self._dtype, REFIT_CHUNK_BYTES, int(weight_version))
        with self._lock:
            self._wake(["weights"])
            for bucket in buckets:
                self._call("collective_rpc", "tqrl_load_bucket", args=(bucket,))
            if "kv_cache" not in self._asleep:  # a sleeping KV cache was emptied when it went to sleep
                self._call("reset_prefix_cache")
            self._version = int(weight_version)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One engine method, on whichever engine this backend runs (awaited on the async one)."""
        if self.engine is not None:
            return self._run(getattr(self.engine, method)(*args, **kwargs))
        return getattr(self.llm, method)(*args, **kwargs)

    def _wake(self, tags: list[str] | None = None) -> None:
        """Wake the sleeping ones of ``tags`` (None: all)."""
        wake = sorted(self._asleep if tags is None else self._asleep & set(tags))
        if wake:
            self._call("wake_up", tags=wake)
            self._asleep -= set(wake)

    @property
    def weight_version(self) -> int:
        """Version of the weights currently loaded (0 until the first refit)."""
        return self._version

    def prepare_for_generation(self) -> None:
        """Wake whatever sleeps (sleep mode only): the KV cache, and the weights if no refit woke them."""
        with self._lock:
            self._wake()

    def finish_generation(self) -> None:
        """Put the engine to sleep, freeing its GPU memory for training (sleep mode only)."""
        if not self.config.vllm_enable_sleep_mode:
            return
        with self._lock:
            if not self._asleep:
                self._call("sleep", level=1)
                self._asleep = {"weights", "kv_cache"}

    def shutdown(self) -> None:
        """Stop the engine (its core process, GPU memory) and loop thread; remove the materialised tiny model."""
        if self._loop is not None:
            if self.engine is not None:
                self.engine.shutdown()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(timeout=30)
            self._loop = None
        elif self.llm is not None:
            engine_core = getattr(self.llm.llm_engine, "engine_core", None)
            if engine_core is not None:
                engine_core.shutdown()
        self.engine = self.llm = None
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None


__all__ = ["VllmGenerationBackend", "VllmWeightSyncExtension", "REFIT_CHUNK_BYTES"]
