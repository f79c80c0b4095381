"""PolicyConfig: the policy's settings (model, optimizer, schedule, DP, batching), validated up front.

Invalid settings fail at construction with a message naming the offending key (pydantic puts the key
path in every error; cross-field checks below name theirs explicitly). Unknown keys are rejected.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from common.models import DTYPES, TINY_MODEL

__all__ = ["PolicyConfig", "DynamicBatchingConfig", "SequencePackingConfig"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DynamicBatchingConfig(_Strict):
    """Micro-batches cut to a padded-token budget (``samples * longest`` per micro-batch)."""

    enabled: bool = Field(False, description="Cut micro-batches to a padded-token budget instead of a sample count.")
    train_mb_tokens: int | None = Field(None, gt=0, description="Padded tokens per training micro-batch (required when enabled)")
    logprob_mb_tokens: int | None = Field(None, gt=0, description="Padded tokens per log-prob micro-batch (required when enabled)")
    sequence_length_round: int = Field(1, ge=1, description="Round each micro-batch's padded length up to a multiple of this.")


class SequencePackingConfig(_Strict):
    """Sequences packed into one row per micro-batch, first-fit-decreasing up to a token budget."""

    enabled: bool = Field(False, description="Pack sequences into one row per micro-batch instead of padding them.")
    train_mb_tokens: int | None = Field(None, gt=0, description="Tokens per packed training micro-batch (required when enabled)")
    logprob_mb_tokens: int | None = Field(None, gt=0, description="Tokens per packed log-prob micro-batch (required when enabled)")
    algorithm: Literal["first_fit_decreasing"] = Field("first_fit_decreasing", description="Bin-packing algorithm.")
    sequence_length_round: int = Field(1, ge=1, description="Round each sequence's length up to a multiple of this.")


class PolicyConfig(_Strict):
    """Settings of :class:`~policy.policy.Policy` / :class:`~policy.policy.TQPolicy` and their workers.

    Batch sizes count samples across all DP ranks: ``train_global_batch_size`` samples per optimizer
    step; ``train_micro_batch_size`` / ``logprob_batch_size`` samples per forward on one rank when
    neither dynamic batching nor sequence packing is on (those use token budgets instead).
    """

    model_name: str = Field(
        TINY_MODEL, description=("Hugging Face model name or local checkpoint path; tiny-random: the built-in 2-layer model (no download)")
    )
    tokenizer_name: str | None = Field(None, description="Tokenizer (null: model_name).")
    dtype: Literal[tuple(DTYPES)] = Field("float32", description="Compute dtype (weights stay float32).")  # type: ignore[valid-type]
    tiny_overrides: dict[str, Any] | None = Field(None, description="Config overrides of the built-in tiny model.")

    dp_size: int = Field(1, ge=1, description="Data-parallel policy workers (Ray actors)")
    seed: int = Field(0, ge=0, lt=1 << 63, description="Seed of the workers' sampling-free randomness (e.g. dropout)")

    learning_rate: float = Field(1e-5, gt=0.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.01, ge=0.0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    adam_eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear learning-rate warm-up.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="Learning-rate schedule after warm-up.")
    max_steps: int | None = Field(None, gt=0, description="Optimizer steps; the cosine schedule's horizon.")
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description=("The cosine schedule's final learning rate, as a fraction of learning_rate.")
    )
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="Clip the gradient norm to this (null: no clipping)")
    logprob_temperature: float = Field(
        1.0,
        gt=0.0,
        description=(
            "Logits are divided by this before the log-softmax of log-probs and of the loss, as the sampler does (NeMo-RL, verl): the"
            " trainers set it from generation (its temperature for 'processed' log-probs, 1 for 'raw' or greedy)."
        ),
    )

    train_global_batch_size: int = Field(32, ge=1, description="Samples per optimizer step, across all DP ranks.")
    train_micro_batch_size: int = Field(4, ge=1, description="Samples per training forward/backward on one rank.")
    logprob_batch_size: int = Field(8, ge=1, description="Samples per log-prob forward on one rank.")
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)
    sequence_packing: SequencePackingConfig = Field(default_factory=SequencePackingConfig)

    reference_model_on_cpu: bool = Field(True, description="Keep the frozen reference model (KL penalty) in CPU memory.")
    deterministic: bool = Field(
        False,
        description=(
            "Deterministic kernels (torch.use_deterministic_algorithms): on CUDA, atomics in backward passes otherwise make two identical"
            " training steps differ in the last bits. Slower; CPU is deterministic anyway."
        ),
    )
    num_cpus_per_worker: float = Field(0.5, ge=0.0, description="Logical CPUs Ray reserves per policy worker.")
    num_gpus_per_worker: float = Field(0.0, ge=0.0, description="GPUs per policy worker (0: CPU training)")
    torch_num_threads: int | None = Field(None, ge=1, description="torch threads per worker (null: max(1, int(num_cpus_per_worker))).")
    dist_backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed backend (auto: NCCL on GPU, gloo on CPU)")
    dist_timeout_s: float = Field(300.0, gt=0.0, description="Timeout of the workers' collectives.")
    ray_timeout_s: float = Field(600.0, gt=0.0, description="Bound (s) on every wait for a worker call.")

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "tq_timeout_s" in data:
            raise ValueError(
                "policy.tq_timeout_s was removed: set data_plane.timeout_s (the one timeout of every TQ client, TQConnection.timeout_s)"
            )
        return data

    @field_validator("adam_betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):  # torch.optim.AdamW says so only inside each worker's start-up
            raise ValueError(f"each AdamW beta must be in [0, 1), got {list(betas)}")
        return betas

    @model_validator(mode="after")
    def _check(self) -> "PolicyConfig":
        if self.dynamic_batching.enabled and self.sequence_packing.enabled:
            raise ValueError("policy.dynamic_batching.enabled and policy.sequence_packing.enabled cannot both be true: enable at most one")
        for name in ("dynamic_batching", "sequence_packing"):
            sub = getattr(self, name)
            if sub.enabled:
                for key in ("train_mb_tokens", "logprob_mb_tokens"):
                    if getattr(sub, key) is None:
                        raise ValueError(f"policy.{name}.{key} must be set when policy.{name}.enabled is true")
        if self.train_global_batch_size < self.dp_size:
            raise ValueError(
                f"policy.train_global_batch_size ({self.train_global_batch_size}) must be >= "
                f"policy.dp_size ({self.dp_size}): every rank needs a sample"
            )
        if self.lr_schedule == "cosine" and self.max_steps is None:
            raise ValueError("policy.max_steps must be set when policy.lr_schedule is 'cosine'")
        if self.lr_schedule == "cosine" and self.max_steps is not None and self.max_steps <= self.warmup_steps:
            raise ValueError(f"policy.max_steps ({self.max_steps}) must exceed policy.warmup_steps ({self.warmup_steps})")
        if self.dist_backend == "nccl" and self.num_gpus_per_worker == 0:
            raise ValueError("policy.dist_backend 'nccl' needs policy.num_gpus_per_worker > 0")
        return self

    @property
    def device(self) -> str:
        """``"cuda"`` when workers get GPUs, else ``"cpu"``."""
        return "cuda" if self.num_gpus_per_worker > 0 else "cpu"

    @property
    def backend(self) -> str:
        """The torch.distributed backend: NCCL on GPU, gloo on CPU (unless set)."""
        if self.dist_backend != "auto":
            return self.dist_backend
        return "nccl" if self.device == "cuda" else "gloo"
