"""The trainers' one validated configuration: YAML plus dotted command-line overrides.

``load_config(path, ["grpo.num_prompts_per_step=8", "policy.model_name=Qwen/Qwen2.5-0.5B"])`` reads
the YAML (default: the offline CPU recipe), applies each override (values parsed as YAML, so numbers,
booleans, lists and ``null`` work) and validates everything with pydantic. Unknown keys and invalid
values are rejected with a message naming the dotted key.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from policy.config import PolicyConfig
from policy.loss import ClippedPGLossConfig
from rollout.data import DataProcessorConfig
from rollout.environments.multi_turn import TWO_TURN_TASK_NAME
from rollout.generation.config import GenerationBackendConfig
from tq.connection import TQConnection

CONFIG_DIR = Path(__file__).parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "grpo_offline_cpu.yaml"


class ConfigError(ValueError):
    """A configuration key is unknown or its value invalid (the message names the key)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RewardScalingConfig(_Strict):
    enabled: bool = Field(
        False,
        description=("Map rewards linearly from [source_min, source_max] to [target_min, target_max] (clamped) before the baselines."),
    )
    source_min: float = Field(0.0, description="Lower end of the raw reward range.")
    source_max: float = Field(1.0, description="Upper end of the raw reward range.")
    target_min: float = Field(0.0, description="What source_min maps to.")
    target_max: float = Field(1.0, description="What source_max maps to.")

    @model_validator(mode="after")
    def _check(self) -> "RewardScalingConfig":
        if self.enabled and self.source_max <= self.source_min:  # found at the first step's rewards otherwise
            raise ValueError(
                f"grpo.reward_scaling.source_max ({self.source_max}) must exceed grpo.reward_scaling.source_min ({self.source_min})"
            )
        return self


class OverlongShapingConfig(_Strict):
    """DAPO's soft overlong punishment over the last ``buffer_length`` tokens before the maximum."""

    enabled: bool = Field(False, description="Apply DAPO's soft overlong punishment to the rewards.")
    max_response_length: int = Field(1024, ge=1, description="Response length (tokens) at which the full penalty applies.")
    buffer_length: int = Field(128, ge=1, description="Tokens before max_response_length over which the penalty ramps up linearly.")
    penalty: float = Field(1.0, ge=0.0, description="Reward subtracted at max_response_length.")

    @model_validator(mode="after")
    def _check(self) -> "OverlongShapingConfig":
        if self.enabled and self.buffer_length > self.max_response_length:  # found at the first step's rewards otherwise
            raise ValueError(
                f"grpo.overlong_reward_shaping.buffer_length ({self.buffer_length}) must be at most "
                f"grpo.overlong_reward_shaping.max_response_length ({self.max_response_length})"
            )
        return self


class GRPOConfig(_Strict):
    num_prompts_per_step: int = Field(16, ge=1, description="Prompts (groups) per training step.")
    num_generations_per_prompt: int = Field(
        8, ge=2, description="Samples generated per prompt (the group the baseline is computed over; a group of one has no baseline)"
    )
    max_num_steps: int = Field(30, ge=1, description="Training steps of the run (a resumed run continues up to it)")
    max_rollout_turns: int = Field(1, ge=1, description="Model turns per conversation (multi-turn environments)")
    max_new_tokens: int = Field(16, ge=1, description="Tokens generated per turn at most.")
    normalize_rewards: bool = Field(True, description="Divide advantages by the group's reward std.")
    use_leave_one_out_baseline: bool = Field(
        True, description=("Baseline of a sample: the mean reward of the other samples of its group (else the group mean)")
    )
    advantage_clip: float | None = Field(
        None, gt=0.0, description=("Clip advantages to [-advantage_clip, advantage_clip] (null: no clipping)")
    )
    reward_scaling: RewardScalingConfig = Field(default_factory=RewardScalingConfig, description="Linear reward rescaling.")
    overlong_reward_shaping: OverlongShapingConfig = Field(
        default_factory=OverlongShapingConfig, description=("DAPO's soft overlong punishment.")
    )
    overlong_filtering: bool = Field(False, description="Drop truncated samples from the loss (sample_mask 0).")
    use_dynamic_sampling: bool = Field(
        False, description=("Drop groups whose rewards are all equal (no signal) and refill from more generation batches.")
    )
    dynamic_sampling_max_gen_batches: int = Field(
        4, ge=1, description=("Generation batches a step may draw under dynamic sampling before it fails.")
    )
    seq_logprob_error_threshold: float | None = Field(
        None, gt=0.0, description=("Mask samples whose mean per-token |generation log-prob - policy log-prob| exceeds this (null: off)")
    )
    message_advantage_penalties: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "Per-message advantage penalties: role -> amount subtracted from a sample's advantage for each message of that role in its "
            'conversation (e.g. {"environment": 0.05} favours fewer turns).'
        ),
    )
    val_period: int = Field(0, ge=0, description="Validate every N steps (0: no validation).")
    val_at_start: bool = Field(False, description="Validate once before the first step.")
    max_val_samples: int = Field(32, ge=1, description="Validation prompts used at most.")
    val_num_generations: int = Field(1, ge=1, description="Samples per validation prompt; > 1 samples (not greedy) and reports pass@k.")
    seed: int = Field(42, ge=0, lt=1 << 63, description="Seed of the run: model init, data order, sampling.")


class DataConfig(_Strict):
    dataset: str = Field(
        "builtin",
        description=('Training prompts: "builtin" (the offline addition task) or a JSONL/Parquet file or a datasets-on-disk directory.'),
    )
    num_builtin_prompts: int = Field(64, ge=1, description="Training records of the built-in task (drawn evenly from its training prompts)")
    builtin_held_out_pairs: int = Field(
        5, ge=1, le=10, description=("Operand pairs of the built-in task never trained on: validation scores exactly these.")
    )
    val_dataset: str | None = Field(
        None, description=("Validation prompts (a file like data.dataset); the built-in task validates on its held-out pairs.")
    )
    split: str | None = Field(None, description="Split of a datasets-on-disk directory (null: the only one)")
    shuffle: bool = Field(True, description="Shuffle the training prompts every epoch.")
    processor: DataProcessorConfig = Field(default_factory=DataProcessorConfig, description="How a dataset row becomes a prompt.")


class EnvConfig(_Strict):
    name: Literal["builtin_add", "math", "two_turn_guess"] = Field(
        "builtin_add", description=("The environment that scores responses (also the task name the records carry).")
    )
    num_workers: int = Field(0, ge=0, description="math: verifier actors (0: verify in process).")

    @model_validator(mode="after")
    def _check(self) -> "EnvConfig":
        if self.num_workers and self.name != "math":  # the other environments score in process: it would be ignored
            raise ValueError(f"env.num_workers ({self.num_workers}) starts math verifier actors; env.name is {self.name!r}")
        return self


class DataPlaneConfig(_Strict):
    """The TQ service and how every process reaches it: the driver turns this section into one
    :class:`~tq.TQConnection` (:meth:`connection`) that every actor and worker gets at start-up."""

    address: str | None = Field(
        None, description=("Address (tcp://host:port) of a running tq-controller; null: start one on the driver for the run.")
    )
    storage_units: int = Field(1, ge=1, description="Storage units of a bootstrapped service.")
    capacity_bytes: int = Field(2 << 30, ge=1 << 20, description="Bytes of shared memory per storage unit of a bootstrapped service.")
    secret: str | None = Field(None, description="Shared secret of the TQ service (null: $TQ_SECRET of the driver, if set).")
    timeout_s: float = Field(60.0, gt=0.0, description="Bound (s) on every TQ call and every wait for fields to be produced.")
    transport: Literal["auto", "tcp"] = Field(
        "auto", description=("auto: same-host readers map the storage arenas (no copy over TCP); tcp: always stream bytes.")
    )
    capacity_wait_s: float = Field(0.0, ge=0.0, description="A write into a full storage unit waits this long for room.")

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
        return TQConnection(
            address, secret=self.secret, timeout_s=self.timeout_s, transport=self.transport, capacity_wait_s=self.capacity_wait_s
        )


class LoggerConfig(_Strict):
    log_dir: str = Field(
        "logs",
        description=("Directory of the run directories (<log_dir>/<run_name>/: metrics.jsonl, tensorboard/, curves.png, config.json)"),
    )
    run_name: str | None = Field(None, description="Run directory name (null: <trainer>-<timestamp>).")
    tensorboard: bool = Field(True, description="Write TensorBoard events.")
    wandb: bool = Field(False, description="Log to Weights & Biases (needs wandb installed)")
    wandb_project: str = Field("tq-rl", description="Weights & Biases project.")
    plot: bool = Field(True, description="Write curves.png (reward, validation accuracy, loss) at the end.")
    progress: bool = Field(True, description="Console output: the start-up block, the progress bar and the step lines.")
    progress_bar: bool = Field(True, description="A tqdm bar on stderr (only when it is a terminal)")
    console_every: int = Field(
        10, ge=1, description=("A step line every N steps (and the first and last); every step goes to metrics.jsonl.")
    )
    data_movement_metrics: bool = Field(
        False,
        description=(
            "Measure data movement each step (driver_bytes_*, timing/driver_*, timing/worker_*, fetch/rank*_s): the driver re-pickles "
            "every actor call's payload to count its bytes, so benchmarks turn it on."
        ),
    )


class CheckpointingConfig(_Strict):
    enabled: bool = Field(False, description="Save checkpoints (policy, optimizer, data position, generation state)")
    checkpoint_dir: str = Field("checkpoints", description="Where checkpoints go (one driver per directory)")
    save_period: int = Field(10, ge=1, description="Save every N steps (and at the end)")
    resume: bool = Field(True, description="Continue from the latest checkpoint in checkpoint_dir if there is one.")


class ClusterConfig(_Strict):
    ray_address: str | None = Field(None, description="Connect to a running Ray cluster; None: start one locally.")
    # an int, as ray.init documents it: a float (16.0) kept a GPU host's raylet from starting (a 30 s
    # start-up timeout naming neither the value nor the key)
    num_cpus: int | None = Field(None, ge=1, description="Logical CPUs of a local Ray (default: the machine's)")


class AsyncGRPOConfig(_Strict):
    """Async GRPO (``python -m trainer.grpo_async``): generation runs ahead of training on older weights.

    A trajectory generated on weights ``v`` may be trained on at step ``t`` only if
    ``t - v <= max_trajectory_age_steps`` (NeMo-RL's bound); see ``trainer.async_collector``.
    """

    enabled: bool = Field(False, description="Set by the async recipe; requires loss.use_importance_sampling_correction.")
    max_trajectory_age_steps: int = Field(4, ge=1, description="A sample generated on weights v may train at step t only if t - v <= this.")
    max_buffered_groups: int | None = Field(
        None,
        ge=1,
        description=(
            "Groups (prompts) held awaiting training, in flight included; None: (age + 1) * num_prompts_per_step. A full buffer makes the"
            " collector back off (nothing is dropped)."
        ),
    )
    groups_per_generation: int | None = Field(
        None,
        ge=1,
        description=(
            "Prompts generated together in one backend call (batching is what makes CPU generation fast); None: a whole step's prompts at"
            " once."
        ),
    )
    max_failed_generations: int = Field(3, ge=0, description="Failed generation calls tolerated before the run fails.")
    wait_timeout_s: float = Field(600.0, gt=0.0, description="Bound on every wait for trajectories or in-flight generations.")
    collector_num_cpus: float = Field(0.25, ge=0.0, description="Logical CPUs of the collector actor.")
    partition_id: str = Field("async_replay", description="TQ partition the collector writes to.")


class MasterConfig(_Strict):
    grpo: GRPOConfig = Field(default_factory=GRPOConfig, description="The GRPO algorithm: steps, group size, advantages, validation.")
    loss: ClippedPGLossConfig = Field(
        default_factory=ClippedPGLossConfig, description=("The clipped policy-gradient loss (NeMo-RL's names and meanings).")
    )
    policy: PolicyConfig = Field(
        default_factory=PolicyConfig, description=("The trained model, its optimizer and its data-parallel workers.")
    )
    generation: GenerationBackendConfig = Field(
        default_factory=GenerationBackendConfig, description=("How rollouts are generated (transformers, vLLM) and sampled.")
    )
    data: DataConfig = Field(default_factory=DataConfig, description="Training and validation prompts.")
    env: EnvConfig = Field(default_factory=EnvConfig, description="The environment that scores responses.")
    data_plane: DataPlaneConfig = Field(
        default_factory=DataPlaneConfig, description=("The TQ service step data moves through (TQ trainers).")
    )
    logger: LoggerConfig = Field(default_factory=LoggerConfig, description="Console, metrics.jsonl, TensorBoard, wandb, curves.png.")
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig, description="Checkpoints and resume.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="The Ray cluster.")
    async_grpo: AsyncGRPOConfig = Field(
        default_factory=AsyncGRPOConfig, description=("Async GRPO (python -m trainer.grpo_async): generation runs ahead of training.")
    )

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
            raise ValueError(
                f"generation.refit_transport {t!r} needs generation.backend 'vllm' and the policy on a GPU "
                "(policy.num_gpus_per_worker > 0); use 'state_dict'"
            )
        if t == "cuda_ipc" and self.generation.ray_workers > self.policy.dp_size:
            raise ValueError(
                f"generation.refit_transport 'cuda_ipc' maps each generation worker onto the GPU memory of the policy rank beside it: "
                f"generation.ray_workers ({self.generation.ray_workers}) must be <= policy.dp_size ({self.policy.dp_size}); "
                "or use 'state_dict'"
            )
        task = self.data.processor.task_name
        if task is not None and task != self.env.name:  # every record would be refused at the first rollout
            raise ValueError(
                f"data.processor.task_name ({task!r}) names no environment of this run: env.name is {self.env.name!r} "
                f"(set data.processor.task_name={self.env.name}, or null to take each row's task_name)"
            )
        if self.env.name == TWO_TURN_TASK_NAME and self.grpo.max_rollout_turns < 2:  # it scores the second turn only
            raise ValueError(
                f"env.name {TWO_TURN_TASK_NAME!r} scores the answer of the second turn: grpo.max_rollout_turns must be >= 2, "
                f"got {self.grpo.max_rollout_turns}"
            )
        self._agree_with_generation()
        if self.async_grpo.enabled:
            validate_async(self)
        return self

    def _agree_with_generation(self) -> None:
        """The settings the trainers take from one section for both sides: the per-turn token limit
        (``grpo.max_new_tokens``; NeMo-RL users set ``generation.max_new_tokens``) and the temperature
        the policy scores with (the distribution the generator sampled and reported). One set and the
        other not: the set one serves both; both set and different: refused naming both."""
        g, grpo, p = self.generation, self.grpo, self.policy
        if "max_new_tokens" in g.model_fields_set and "max_new_tokens" in grpo.model_fields_set:
            if g.max_new_tokens != grpo.max_new_tokens:
                raise ValueError(
                    f"generation.max_new_tokens ({g.max_new_tokens}) and grpo.max_new_tokens ({grpo.max_new_tokens}) differ: "
                    f"the trainers generate grpo.max_new_tokens per turn: set grpo.max_new_tokens={g.max_new_tokens} too, or drop one"
                )
        elif "max_new_tokens" in g.model_fields_set:
            grpo.max_new_tokens = g.max_new_tokens
        else:
            g.max_new_tokens = grpo.max_new_tokens
        temperature = g.temperature if g.logprobs_mode == "processed" and g.temperature > 0 else 1.0
        if "logprob_temperature" in p.model_fields_set and p.logprob_temperature != temperature:
            raise ValueError(
                f"policy.logprob_temperature ({p.logprob_temperature}) must be {temperature}: the generator reports log-probs of "
                f"generation.temperature {g.temperature} with generation.logprobs_mode {g.logprobs_mode!r}, and the policy scores the "
                "same distribution (leave policy.logprob_temperature unset: it is derived)"
            )
        p.logprob_temperature = temperature


def generation_colocated(cfg: "MasterConfig") -> bool:
    """Whether the Ray generation workers share the policy ranks' GPUs: each takes a fraction of a GPU
    that leaves room for a rank's fraction (``refit_transport: nccl`` puts them on GPUs of their own)."""
    g, p = cfg.generation, cfg.policy
    return (
        g.ray_workers > 0
        and 0 < g.num_gpus_per_worker
        and g.num_gpus_per_worker + p.num_gpus_per_worker <= 1
        and g.refit_transport != "nccl"
    )


def colocation_bundles(cfg: "MasterConfig") -> list[dict[str, float]] | None:
    """The bundles of the placement group a run needs when its policy ranks ask for a fraction of a
    GPU each: one ``{"GPU": 1}`` bundle per GPU, rank r (and generation worker r, when colocated) in
    bundle r - Ray alone packs fractional requests onto one GPU, and NCCL needs a GPU per rank (verl's
    resource pools and NeMo-RL's virtual clusters do the same). None where Ray's own placement is
    right: CPU ranks, whole GPUs, or a single rank."""
    p, g = cfg.policy, cfg.generation
    if not 0 < p.num_gpus_per_worker < 1 or p.dp_size < 2:
        return None
    gen = generation_colocated(cfg)
    cpus = p.num_cpus_per_worker + (g.num_cpus_per_worker if gen else 0.0)
    return [{"GPU": 1.0, "CPU": cpus} for _ in range(max(p.dp_size, g.ray_workers if gen else 0))]


def validate_async(cfg: "MasterConfig") -> None:
    """What async mode needs (raises ``ValueError`` naming the key): trajectories come from older
    weights, so the loss must correct for the policy mismatch, and the buffer must hold two steps."""
    if not cfg.loss.use_importance_sampling_correction:
        raise ValueError(
            "loss.use_importance_sampling_correction must be true in async mode (async_grpo): "
            "trajectories are generated by older weights than the ones trained"
        )
    if cfg.generation.refit_transport != "state_dict":
        raise ValueError(
            f"generation.refit_transport {cfg.generation.refit_transport!r} is not supported in async mode "
            "(async_grpo): its refits are staged while generation runs on; use 'state_dict'"
        )
    if colocation_bundles(cfg) is not None:
        raise ValueError(
            f"policy.num_gpus_per_worker {cfg.policy.num_gpus_per_worker:g} with policy.dp_size {cfg.policy.dp_size} is not "
            "supported in async mode (async_grpo): its collector's engines are not placed beside the ranks; give each "
            "rank a whole GPU (policy.num_gpus_per_worker: 1)"
        )
    a, n = cfg.async_grpo, cfg.grpo.num_prompts_per_step
    if a.max_buffered_groups is not None and a.max_buffered_groups < 2 * n:
        raise ValueError(
            f"async_grpo.max_buffered_groups ({a.max_buffered_groups}) must hold at least two steps "
            f"(2 * grpo.num_prompts_per_step = {2 * n}): the step being trained and the next one"
        )


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
        lines.append(
            f"  {key}: {e['msg']}"
            + (f" (got {e['input']!r})" if e["type"] != "extra_forbidden" and "input" in e and not isinstance(e["input"], dict) else "")
        )
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
    paths = {
        "data.dataset": cfg.data.dataset if cfg.data.dataset != "builtin" else None,
        "data.val_dataset": cfg.data.val_dataset if cfg.grpo.val_period else None,
    }
    for key in ("model_name", "tokenizer_name"):  # a local checkpoint, not a hub name
        name = getattr(cfg.policy, key)
        if name and name.startswith(("/", "./", "../", "~")):
            paths[f"policy.{key}"] = name
    missing = [
        f"{key}: no such file or directory: {os.path.expanduser(v)!r}"
        for key, v in paths.items()
        if v is not None and not os.path.exists(os.path.expanduser(v))
    ]
    if missing:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(missing))


def _type_name(annotation: Any) -> str:
    name = getattr(annotation, "__name__", None) if not getattr(annotation, "__args__", None) else None
    return name or str(annotation).replace("typing.", "").replace("NoneType", "None")


def _shown(value: Any) -> str:
    return "null" if value is None else yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip().removesuffix("...").strip()


def config_help(recipe: str | os.PathLike | None = None, width: int = 100) -> str:
    """Every config section and key, with its type, default and description, generated from the
    pydantic models (:class:`MasterConfig`). Where ``recipe`` (default: the offline CPU recipe) sets
    another value, it is shown as ``recipe: <value>``."""
    import textwrap

    from pydantic_core import PydanticUndefined

    recipe_cfg = load_config(recipe).model_dump(mode="json")
    lines: list[str] = []

    def section(model: type[BaseModel], name: str, recipe_node: Any, about: str | None) -> None:
        # The field's description, else the first sentence of the model's docstring (roles stripped).
        doc = about or re.sub(r":\w+:`~?([^`]+)`", r"\1", " ".join((model.__doc__ or "").split("\n\n")[0].split()).replace("``", ""))
        lines.extend(["", f"{name}:" + (f"  {doc}" if doc else "")])
        subsections = []
        for key, field in model.model_fields.items():
            ann, sub = field.annotation, recipe_node.get(key) if isinstance(recipe_node, dict) else None
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                subsections.append((ann, f"{name}.{key}", sub, field.description))
                continue
            default = field.default_factory() if field.default is PydanticUndefined and field.default_factory else field.default
            head = f"  {name}.{key} ({_type_name(ann)}) = {_shown(default)}"
            if isinstance(recipe_node, dict) and key in recipe_node and sub != _jsonable(default):
                head += f"  [recipe: {_shown(sub)}]"
            lines.append(head)
            lines.extend(textwrap.wrap(field.description or "", width=width, initial_indent="      ", subsequent_indent="      "))
        for args in subsections:
            section(*args)

    for name, field in MasterConfig.model_fields.items():
        section(field.annotation, name, recipe_cfg.get(name), field.description)
    return "\n".join(lines).lstrip("\n")


def _jsonable(value: Any) -> Any:
    """``value`` as ``model_dump(mode="json")`` writes it (tuples as lists), for comparing with a recipe."""
    import json

    return json.loads(json.dumps(value, default=str))


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
