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

    backend: Literal["hf", "vllm", "synthetic"] = Field(
        "hf", description=("hf: transformers generate; vllm: vLLM (GPU); synthetic: random tokens, no model (benchmarks).")
    )
    model_name: str = Field(TINY_MODEL, description="Model to generate with (must equal policy.model_name)")
    tokenizer_name: str | None = Field(None, description="Tokenizer (null: model_name).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Generation dtype.")
    device: str = Field("cpu", description="Device of the transformers backend: cpu, cuda, cuda:1, ...")
    model_seed: int = Field(0, ge=0, lt=1 << 63, description="Init seed of the tiny random model (every process gets the same weights)")
    tiny_overrides: dict[str, Any] | None = Field(None, description="Config overrides of the built-in tiny model.")

    seed: int = Field(0, ge=0, lt=1 << 63, description="Sampling seed; each call derives its own seed from (seed, call counter)")
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature (0: greedy)")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling (1: off)")
    top_k: int = Field(0, description="Top-k sampling (<= 0: off)")
    max_new_tokens: int = Field(default=16, ge=1, description="Tokens generated at most, for callers that do not pass their own.")
    stop_token_ids: list[int] | None = Field(
        None, description=("Token ids that end a response (null: tokenizer EOS + model EOS ids + ChatML <|im_end|>).")
    )
    stop_strings: list[str] | None = Field(None, description="Applied to every prompt, on top of per-prompt ones.")
    logprobs_mode: Literal["processed", "raw"] = Field(
        "processed", description=("processed: log-probs of the distribution sampled from; raw: of the unscaled model distribution.")
    )
    max_batch_size: int | None = Field(
        default=None, ge=1, description=("transformers backend: split larger batches into batches of this size.")
    )
    synthetic_min_new_tokens: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Synthetic backend: response lengths uniform in [synthetic_min_new_tokens, max_new_tokens of the call] (None: always "
            "max_new_tokens)."
        ),
    )

    ray_workers: int = Field(
        default=0, ge=0, description=("Ray placement: 0 runs the backend in this process; N > 0 runs N Ray actors (RayGenerationPool).")
    )
    num_cpus_per_worker: float = Field(default=0.25, ge=0.0, description="Logical CPUs per generation actor.")
    num_gpus_per_worker: float = Field(default=0.0, ge=0.0, description="GPUs per generation actor.")
    ray_timeout_s: float = Field(default=600.0, gt=0.0, description="Bound (s) on every wait for a generation actor.")

    vllm_gpu_memory_utilization: float = Field(
        default=0.6,
        gt=0.0,
        le=1.0,
        description=("vLLM: fraction of the GPU memory it may use (vllm_* keys are ignored by the transformers backend)."),
    )
    vllm_tensor_parallel_size: int = Field(default=1, ge=1, description="vLLM tensor-parallel size.")
    vllm_max_model_len: int | None = Field(None, description="vLLM max_model_len (null: the model's)")
    vllm_enforce_eager: bool = Field(False, description="VLLM: no CUDA graphs.")
    vllm_enable_sleep_mode: bool = Field(False, description="vLLM sleeps (frees its GPU memory) while the policy trains on the same GPU.")
    vllm_async_engine: bool = Field(False, description="Use vLLM's async engine.")
    vllm_extra_kwargs: dict[str, Any] = Field(default_factory=dict, description="More vLLM engine arguments.")
    refit_transport: Literal["state_dict", "cuda_ipc", "nccl"] = Field(
        "state_dict",
        description=(
            'How a refit reaches the generator: "state_dict" (CPU tensors through Ray\'s object store; any backend), "cuda_ipc" (vLLM '
            'colocated with policy rank 0 on its GPU), "nccl" (vLLM on other GPUs; sync trainer).'
        ),
    )

    @property
    def loads_weights(self) -> bool:
        """Whether a refit must ship the policy's weights (the synthetic backend has no model to load them into)."""
        return self.backend != "synthetic"

    @property
    def greedy_by_default(self) -> bool:
        """True when the configured temperature means greedy decoding."""
        return self.temperature == 0.0
