"""The trainers' one validated configuration: YAML plus dotted command-line overrides.

``load_config(path, ["grpo.num_prompts_per_step=8", "policy.model_name=Qwen/Qwen2.5-0.5B"])`` reads
the YAML (default: the offline CPU recipe), applies each override (values parsed as YAML, so numbers,
booleans, lists and ``null`` work) and validates everything with pydantic. Unknown keys and invalid
values are rejected with a message naming the dotted key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from policy.config import PolicyConfig
from policy.loss import ClippedPGLossConfig
from rollout.data import DataProcessorConfig
from rollout.generation.config import GenerationBackendConfig
from tq.connection import TQConnection

CONFIG_DIR = Path(__file__).parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "grpo_offline_cpu.yaml"


class ConfigError(ValueError):
    """A configuration key is unknown or its value invalid (the message names the key)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RewardScalingConfig(_Strict):
    enabled: bool = False
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0


class OverlongShapingConfig(_Strict):
    """DAPO's soft overlong punishment over the last ``buffer_length`` tokens before the maximum."""

    enabled: bool = False
    max_response_length: int = Field(1024, ge=1)
    buffer_length: int = Field(128, ge=1)
    penalty: float = Field(1.0, ge=0.0)


class GRPOConfig(_Strict):
    num_prompts_per_step: int = Field(16, ge=1)
    num_generations_per_prompt: int = Field(8, ge=1)
    max_num_steps: int = Field(30, ge=1)
    max_rollout_turns: int = Field(1, ge=1)
    max_new_tokens: int = Field(16, ge=1)
    normalize_rewards: bool = True  # divide advantages by the group's reward std
    use_leave_one_out_baseline: bool = True
    advantage_clip: float | None = Field(None, gt=0.0)
    reward_scaling: RewardScalingConfig = Field(default_factory=RewardScalingConfig)
    overlong_reward_shaping: OverlongShapingConfig = Field(default_factory=OverlongShapingConfig)
    overlong_filtering: bool = False  # truncated samples get sample_mask 0
    use_dynamic_sampling: bool = False  # drop zero-std groups, refill from more generation batches
    dynamic_sampling_max_gen_batches: int = Field(4, ge=1)
    seq_logprob_error_threshold: float | None = Field(None, gt=0.0)
    # Per-message advantage penalties: role -> amount subtracted from a sample's advantage for each
    # message of that role in its conversation (e.g. {"environment": 0.05} favours fewer turns).
    message_advantage_penalties: dict[str, float] = Field(default_factory=dict)
    val_period: int = Field(0, ge=0)  # 0: no validation
    val_at_start: bool = False
    max_val_samples: int = Field(32, ge=1)
    val_num_generations: int = Field(1, ge=1)  # > 1 reports pass@k
    seed: int = 42


class DataConfig(_Strict):
    dataset: str = "builtin"  # "builtin" (the offline task) or a JSONL/Parquet file or datasets-on-disk dir
    num_builtin_prompts: int = Field(64, ge=1)
    # Operand pairs of the built-in task never trained on: validation scores exactly these.
    builtin_held_out_pairs: int = Field(5, ge=1, le=10)
    val_dataset: str | None = None  # default: the built-in task's held-out pairs, or none
    split: str | None = None
    shuffle: bool = True
    processor: DataProcessorConfig = Field(default_factory=DataProcessorConfig)


class EnvConfig(_Strict):
    name: Literal["builtin_add", "math", "two_turn_guess"] = "builtin_add"  # also the task name records carry
    num_workers: int = Field(0, ge=0)  # math: verifier actors (0 = in process)


class DataPlaneConfig(_Strict):
    """The TQ service and how every process reaches it: the driver turns this section into one
    :class:`~tq.TQConnection` (:meth:`connection`) that every actor and worker gets at start-up."""

    address: str | None = None  # a running tq-controller; None: bootstrap one on the driver
    storage_units: int = Field(1, ge=1)
    capacity_bytes: int = Field(2 << 30, ge=1 << 20)
    secret: str | None = None  # None: $TQ_SECRET of the driver, if set
    timeout_s: float = Field(60.0, gt=0.0)  # every TQ call, and every wait for fields to be produced
    transport: Literal["auto", "tcp"] = "auto"  # auto: same-host readers map the storage arenas
    capacity_wait_s: float = Field(0.0, ge=0.0)  # a write into a full storage unit waits this long for room

    @field_validator("address")
    @classmethod
    def _address_is_a_tq_address(cls, v: str | None) -> str | None:
        # Checked with the config, before anything starts (a bad one used to end in a ZMQError traceback).
        if v is not None:
            try:
                TQConnection(v, secret="")
            except ValueError:
                raise ValueError("must look like tcp://host:port") from None
        return v

    def connection(self, address: str | None = None) -> TQConnection:
        """The connection value for ``address`` (default: ``address`` of this section, e.g. a
        bootstrapped service's address when that is None)."""
        address = address or self.address
        if address is None:
            raise ValueError("data_plane.address is not set and no bootstrapped service address was given")
        return TQConnection(address, secret=self.secret, timeout_s=self.timeout_s, transport=self.transport,
                            capacity_wait_s=self.capacity_wait_s)


class LoggerConfig(_Strict):
    log_dir: str = "logs"
    run_name: str | None = None  # default: <trainer>-<timestamp>
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "tq-rl"
    plot: bool = True
    progress: bool = True
    # Measure data movement each step (driver_bytes_*, timing/driver_*, timing/worker_*, fetch/rank*_s):
    # the driver re-pickles every actor call's payload to count its bytes, so benchmarks turn it on.
    data_movement_metrics: bool = False


class CheckpointingConfig(_Strict):
    enabled: bool = False
    checkpoint_dir: str = "checkpoints"
    save_period: int = Field(10, ge=1)
    resume: bool = True  # continue from the latest checkpoint in checkpoint_dir if there is one


class ClusterConfig(_Strict):
    ray_address: str | None = None  # connect to a running Ray cluster; None: start one locally
    num_cpus: float | None = None  # logical CPUs of a local Ray (default: the machine's)


class AsyncGRPOConfig(_Strict):
    """Async GRPO (``python -m trainer.grpo_async``): generation runs ahead of training on older weights.

    A trajectory generated on weights ``v`` may be trained on at step ``t`` only if
    ``t - v <= max_trajectory_age_steps`` (NeMo-RL's bound); see ``trainer.async_collector``.
    """

    enabled: bool = False  # set by the async recipe; requires loss.use_importance_sampling_correction
    max_trajectory_age_steps: int = Field(4, ge=1)
    # Groups (prompts) held awaiting training, in flight included; None: (age + 1) * num_prompts_per_step.
    # A full buffer makes the collector back off (nothing is dropped).
    max_buffered_groups: int | None = Field(None, ge=1)
    # Prompts generated together in one backend call (batching is what makes CPU generation fast);
    # None: a whole step's prompts at once.
    groups_per_generation: int | None = Field(None, ge=1)
    max_failed_generations: int = Field(3, ge=0)  # failed generation calls tolerated before the run fails
    wait_timeout_s: float = Field(600.0, gt=0.0)  # bound on every wait for trajectories or in-flight generations
    collector_num_cpus: float = Field(0.25, ge=0.0)
    partition_id: str = "async_replay"


class MasterConfig(_Strict):
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    loss: ClippedPGLossConfig = Field(default_factory=ClippedPGLossConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    generation: GenerationBackendConfig = Field(default_factory=GenerationBackendConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    data_plane: DataPlaneConfig = Field(default_factory=DataPlaneConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    async_grpo: AsyncGRPOConfig = Field(default_factory=AsyncGRPOConfig)

    @model_validator(mode="after")
    def _check(self) -> "MasterConfig":
        n = self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt
        if n % self.policy.train_global_batch_size:
            raise ValueError(
                f"grpo.num_prompts_per_step * grpo.num_generations_per_prompt ({n}) must be a multiple of "
                f"policy.train_global_batch_size ({self.policy.train_global_batch_size})"
            )
        if self.generation.model_name != self.policy.model_name:
            raise ValueError(
                f"generation.model_name ({self.generation.model_name!r}) must equal policy.model_name "
                f"({self.policy.model_name!r}): the generator is refit with the policy's weights"
            )
        t = self.generation.refit_transport
        if t != "state_dict" and (self.generation.backend != "vllm" or self.policy.device != "cuda"):
            raise ValueError(f"generation.refit_transport {t!r} needs generation.backend 'vllm' and the policy on a GPU "
                             "(policy.num_gpus_per_worker > 0); use 'state_dict'")
        if self.async_grpo.enabled:
            validate_async(self)
        return self


def validate_async(cfg: "MasterConfig") -> None:
    """What async mode needs (raises ``ValueError`` naming the key): trajectories come from older
    weights, so the loss must correct for the policy mismatch, and the buffer must hold two steps."""
    if not cfg.loss.use_importance_sampling_correction:
        raise ValueError("loss.use_importance_sampling_correction must be true in async mode (async_grpo): "
                         "trajectories are generated by older weights than the ones trained")
    if cfg.generation.refit_transport != "state_dict":
        raise ValueError(f"generation.refit_transport {cfg.generation.refit_transport!r} is not supported in async mode "
                         "(async_grpo): its refits are staged while generation runs on; use 'state_dict'")
    a, n = cfg.async_grpo, cfg.grpo.num_prompts_per_step
    if a.max_buffered_groups is not None and a.max_buffered_groups < 2 * n:
        raise ValueError(f"async_grpo.max_buffered_groups ({a.max_buffered_groups}) must hold at least two steps "
                         f"(2 * grpo.num_prompts_per_step = {2 * n}): the step being trained and the next one")


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {dotted!r}: {p!r} is not a section")
        node = child
    node[parts[-1]] = value


def _format(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<config>"
        lines.append(f"  {key}: {e['msg']}" + (f" (got {e['input']!r})" if e["type"] != "extra_forbidden" and "input" in e and not isinstance(e["input"], dict) else ""))
    return "invalid configuration:\n" + "\n".join(lines)


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> MasterConfig:
    """Read ``path`` (default: the offline CPU recipe), apply ``key.sub=value`` overrides, validate."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    tree = yaml.safe_load(path.read_text()) or {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw))
    try:
        return MasterConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format(exc)) from None


def check_local_paths(cfg: MasterConfig) -> None:
    """Fail at once, naming the key, when a file the run needs is missing - before Ray starts or a
    tokenizer is looked up (a missing dataset used to surface only after both, 9-56 s in). Checked
    when the run starts rather than in the schema: a recipe may name paths of the machine it is for."""
    paths = {"data.dataset": cfg.data.dataset if cfg.data.dataset != "builtin" else None,
             "data.val_dataset": cfg.data.val_dataset if cfg.grpo.val_period else None}
    for key in ("model_name", "tokenizer_name"):  # a local checkpoint, not a hub name
        name = getattr(cfg.policy, key)
        if name and name.startswith(("/", "./", "../", "~")):
            paths[f"policy.{key}"] = name
    missing = [f"{key}: no such file or directory: {os.path.expanduser(v)!r}"
               for key, v in paths.items() if v is not None and not os.path.exists(os.path.expanduser(v))]
    if missing:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(missing))


def parse_cli(argv: Sequence[str]) -> MasterConfig:
    """``[--config FILE] [key=value ...]`` as the trainers' command lines take them."""
    argv = list(argv)
    path = None
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ConfigError("--config needs a file path")
        path = argv[i + 1]
        del argv[i : i + 2]
    bad = [a for a in argv if a.startswith("-")]
    if bad:
        raise ConfigError(f"unknown option(s) {bad}: pass --config FILE and key=value overrides")
    return load_config(path, argv)
