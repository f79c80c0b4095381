"""Configuration shared by every generation backend (transformers, vLLM) and their Ray workers."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.models import TINY_MODEL


class GenerationBackendConfig(BaseModel):
    """How to build a generation backend and how it samples.

    Sampling follows vLLM's conventions so a config means the same thing on both backends:
    ``temperature == 0`` is greedy, ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``logprobs_mode`` selects which distribution the reported per-token log-probs come from:
    ``"processed"`` (default) is the one the sampler drew from (after temperature, top-k, top-p;
    vLLM's ``processed_logprobs``), ``"raw"`` is the model's unscaled distribution (vLLM's
    ``raw_logprobs``). Greedy decoding applies no processing, so both modes agree there.
    """

    model_config = ConfigDict(extra="forbid")

    backend: Literal["hf", "vllm", "synthetic"] = "hf"  # synthetic: random tokens, no model (benchmarks)
    model_name: str = TINY_MODEL
    tokenizer_name: str | None = None  # default: model_name
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ... (transformers backend only)
    model_seed: int = 0  # init seed of the tiny random model (every process gets the same weights)
    tiny_overrides: dict[str, Any] | None = None

    seed: int = 0  # sampling seed; each call derives its own seed from (seed, call counter)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = 0
    max_new_tokens: int = Field(default=16, ge=1)  # default for callers that do not pass one
    stop_token_ids: list[int] | None = None  # None: tokenizer EOS + model EOS ids + ChatML <|im_end|>
    stop_strings: list[str] | None = None  # applied to every prompt, on top of per-prompt ones
    logprobs_mode: Literal["processed", "raw"] = "processed"
    max_batch_size: int | None = Field(default=None, ge=1)  # transformers: split larger batches
    # Synthetic backend: response lengths uniform in [synthetic_min_new_tokens, max_new_tokens of the
    # call] (None: always max_new_tokens).
    synthetic_min_new_tokens: int | None = Field(default=None, ge=1)

    # Ray placement: 0 runs the backend in this process; N > 0 runs N Ray actors (RayGenerationPool).
    ray_workers: int = Field(default=0, ge=0)
    num_cpus_per_worker: float = Field(default=0.25, ge=0.0)
    num_gpus_per_worker: float = Field(default=0.0, ge=0.0)
    ray_timeout_s: float = Field(default=600.0, gt=0.0)

    # vLLM engine arguments (ignored by the transformers backend).
    vllm_gpu_memory_utilization: float = Field(default=0.6, gt=0.0, le=1.0)
    vllm_tensor_parallel_size: int = Field(default=1, ge=1)
    vllm_max_model_len: int | None = None
    vllm_enforce_eager: bool = False
    vllm_enable_sleep_mode: bool = False
    vllm_async_engine: bool = False
    vllm_extra_kwargs: dict[str, Any] = Field(default_factory=dict)
    # How a refit reaches the generator: "state_dict" (CPU tensors through Ray's object store; any backend),
    # "cuda_ipc" (vLLM colocated with policy rank 0 on its GPU), "nccl" (vLLM on other GPUs; sync trainer).
    refit_transport: Literal["state_dict", "cuda_ipc", "nccl"] = "state_dict"

    @property
    def loads_weights(self) -> bool:
        """Whether a refit must ship the policy's weights (the synthetic backend has no model to load them into)."""
        return self.backend != "synthetic"

    @property
    def greedy_by_default(self) -> bool:
        """True when the configured temperature means greedy decoding."""
        return self.temperature == 0.0
