"""What the legacy and the TQ trainer share: set-up, and the driver-side algorithm on per-sample scalars.

Keeping the algorithm here (one function both trainers call on the same per-sample tensors) is what
makes the two paths produce the same numbers; they differ only in where bulk data lives.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from common.models import load_tokenizer
from rollout.data import DatasetError, PromptDataset, StatefulDataLoader
from rollout.environments import builtin_task_dataset, make_environment

from . import algorithms as A
from .config import ConfigError, GRPOConfig, MasterConfig, colocation_bundles, generation_colocated


class _RayTokenAuthNotice(logging.Filter):
    """Drops Ray's warning that it turned token authentication on for a new local cluster (printed on
    every run); the trainer's start-up block says it instead, once, with how to turn it off."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Token authentication is enabled for this Ray cluster" not in record.getMessage()


_RAY_TOKEN_NOTICE = _RayTokenAuthNotice()  # one instance: addFilter ignores a filter already added


def ray_auth_note() -> str:
    """One line on Ray's token authentication for the start-up block (security unchanged: Ray's own
    default, token authentication on, stays; only its warning is replaced by this line)."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        return "token authentication on (Ray's default; token in ~/.ray/auth_token, RAY_AUTH_MODE=disabled turns it off)"
    return f"token authentication off (RAY_AUTH_MODE={os.environ.get('RAY_AUTH_MODE', 'unset')})"


def init_ray(cfg: MasterConfig) -> None:
    """Connect to the configured Ray cluster, or start a local one (fractional actors fit 2 cores).

    A local Ray is sized here, so a run whose actors can never fit it is refused (:class:`ConfigError`)
    before Ray starts (CPUs) or right after (GPUs, which Ray detects); on an attached cluster, which may
    autoscale, the same shortfall is only a warning. The caller's SIGTERM handler stays in force.
    """
    import ray

    if ray.is_initialized():
        return
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(_RAY_TOKEN_NOTICE)
    num_cpus = cfg.cluster.num_cpus or os.cpu_count() or 1
    if not cfg.cluster.ray_address:
        check_cluster_fits(cfg, {"CPU": num_cpus}, local=True, resources=("CPU",))  # GPUs: once Ray has found them
    main_thread = threading.current_thread() is threading.main_thread()
    # ray.init replaces SIGTERM's handler twice: with sys.exit, then (the core worker's) a C++ one that
    # dumps a stack and aborts - a `kill` would skip the trainer's clean stop (workers, TQ, driver record).
    on_sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
    if cfg.cluster.ray_address:
        # No secret travels through the environment: every actor gets the data plane's TQConnection.
        ray.init(address=cfg.cluster.ray_address, log_to_driver=True)
    else:
        # address="local": a Ray of its own, never a `ray start` cluster that happens to run on this host.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    if callable(on_sigterm):
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        check_cluster_fits(cfg, ray.cluster_resources(), local=not cfg.cluster.ray_address)
    except ConfigError:
        ray.shutdown()  # the Ray this call started, before the caller hears why
        raise


def resource_demand(cfg: MasterConfig) -> dict[str, list[tuple[str, float]]]:
    """What the run's long-lived actors reserve, per Ray resource (``"CPU"``, ``"GPU"``): a list of
    (what, amount) each - the policy's ranks (or their placement group's bundles), the rollout actor,
    its generation workers and math verifiers, and in async mode the collector and its own. All of
    them hold their share for the whole run, so the sums must fit the cluster at once."""
    from rollout.actors import DEFAULT_NUM_CPUS
    from rollout.environments.math_env import VERIFIER_NUM_CPUS

    p, g = cfg.policy, cfg.generation
    cpu: list[tuple[str, float]] = []
    gpu: list[tuple[str, float]] = []
    bundles = colocation_bundles(cfg)
    if bundles is not None:
        what = f"policy.dp_size={p.dp_size} ranks, a GPU each"
        cpu.append((f"{what}, {bundles[0]['CPU']:g} CPUs each", len(bundles) * bundles[0]["CPU"]))
        gpu.append((what, float(len(bundles))))
    else:
        cpu.append(
            (f"policy.dp_size={p.dp_size} x policy.num_cpus_per_worker={p.num_cpus_per_worker:g}", p.dp_size * p.num_cpus_per_worker)
        )
        if p.num_gpus_per_worker:
            gpu.append(
                (f"policy.dp_size={p.dp_size} x policy.num_gpus_per_worker={p.num_gpus_per_worker:g}", p.dp_size * p.num_gpus_per_worker)
            )
    async_mode = cfg.async_grpo.enabled
    engines = 2 if async_mode else 1  # async: the collector generates too, beside the validation actor
    cpu.append(("the rollout actor", DEFAULT_NUM_CPUS))
    if async_mode:
        cpu.append(("async_grpo.collector_num_cpus", cfg.async_grpo.collector_num_cpus))
    in_bundles = bundles is not None and generation_colocated(cfg)
    if g.ray_workers and not in_bundles:
        n = engines * g.ray_workers
        cpu.append((f"{n} x generation.num_cpus_per_worker={g.num_cpus_per_worker:g}", n * g.num_cpus_per_worker))
        if g.num_gpus_per_worker:
            gpu.append((f"{n} x generation.num_gpus_per_worker={g.num_gpus_per_worker:g}", n * g.num_gpus_per_worker))
    if cfg.env.name == "math" and cfg.env.num_workers:
        n = engines * cfg.env.num_workers
        cpu.append((f"{n} math verifiers (env.num_workers)", n * VERIFIER_NUM_CPUS))
    return {"CPU": [x for x in cpu if x[1] > 0], "GPU": gpu}


def check_cluster_fits(
    cfg: MasterConfig, available: Mapping[str, float], *, local: bool, resources: tuple[str, ...] = ("CPU", "GPU")
) -> None:
    """Compare :func:`resource_demand` with ``available`` (a Ray cluster's totals) for ``resources``.
    Where the run cannot fit, a local Ray (sized by this run) raises :class:`ConfigError` naming the
    settings - its actors would otherwise wait ``policy.ray_timeout_s`` in silence; an attached
    cluster, which may add nodes, gets a warning instead."""
    demand = resource_demand(cfg)
    short = []
    for res in resources:
        need, have = sum(n for _, n in demand[res]), float(available.get(res, 0.0))
        if need > have + 1e-9:
            parts = ", ".join(f"{w}: {n:g}" for w, n in demand[res])
            short.append((res, f"{need:g} {res}s ({parts}) but {have:g} {'is' if have == 1 else 'are'} there"))
    if not short:
        return
    what = "; and ".join(line for _, line in short)
    if local:
        size = (
            f"cluster.num_cpus={cfg.cluster.num_cpus}"
            if cfg.cluster.num_cpus
            else "this machine's CPUs; cluster.num_cpus sets another count"
        )
        fix = "lower policy.dp_size or policy.num_cpus_per_worker" + (", or raise cluster.num_cpus" if short[0][0] == "CPU" else "")
        if any(res == "GPU" for res, _ in short):
            fix += "; Ray sees the GPUs in CUDA_VISIBLE_DEVICES (all when unset)"
        raise ConfigError(f"the run's actors need {what} in the local Ray ({size}): they could never all start - {fix}")
    print(
        f"warning: the run's actors need {what} in the Ray cluster at {cfg.cluster.ray_address}: unless it adds nodes, "
        f"they wait up to policy.ray_timeout_s={cfg.policy.ray_timeout_s:g}s and fail",
        file=sys.stderr,
        flush=True,
    )


def check_output_paths(cfg: MasterConfig) -> None:
    """Fail at once, naming the key, when a directory the run writes (``logger.log_dir``, and
    ``checkpointing.checkpoint_dir`` when checkpointing) is a file, lies under one, or cannot be
    created - before Ray starts rather than as a NotADirectoryError once the workers are up."""
    dirs = {"logger.log_dir": cfg.logger.log_dir}
    if cfg.checkpointing.enabled:
        dirs["checkpointing.checkpoint_dir"] = cfg.checkpointing.checkpoint_dir
    for key, value in dirs.items():
        path = Path(value).expanduser()
        existing = next(p for p in (path, *path.parents) if p.exists() or p == Path(p.anchor))
        if not existing.is_dir():
            what = "is a file" if existing == path else f"lies under {existing}, which is a file"
            raise ConfigError(f"{key}={value}: {what}, not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"{key}={value}: {existing} is not writable")


def colocation_group(cfg: MasterConfig) -> Any:
    """The placement group of :func:`~trainer.config.colocation_bundles`, placed (None if the run needs
    none); bounded by ``policy.ray_timeout_s``, with an error naming what the cluster lacks."""
    import ray

    bundles = colocation_bundles(cfg)
    if bundles is None:
        return None
    pg = ray.util.placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=cfg.policy.ray_timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise TimeoutError(
            f"the run places its policy ranks (and colocated generation workers) in {len(bundles)} bundles of {bundles[0]}, "
            f"a GPU each, and Ray did not find them within policy.ray_timeout_s={cfg.policy.ray_timeout_s:g}s: the cluster "
            "has fewer free GPUs (or CPUs)"
        ) from None
    return pg


def run_name(cfg: MasterConfig, trainer: str) -> str:
    return cfg.logger.run_name or f"{trainer}-{time.strftime('%Y%m%d-%H%M%S')}"


def build_datasets(cfg: MasterConfig) -> tuple[PromptDataset, PromptDataset | None]:
    """The training prompts and (when validation is on) the validation prompts."""
    tok = load_tokenizer(cfg.policy.tokenizer_name or cfg.policy.model_name)
    if cfg.data.dataset == "builtin":
        # Validation is held out: operand pairs the run never trains on (each once; greedy decoding
        # would score a repeat the same).
        held_out = cfg.data.builtin_held_out_pairs
        train = PromptDataset(
            builtin_task_dataset(cfg.data.num_builtin_prompts, seed=cfg.grpo.seed, split="train", held_out=held_out),
            tok,
            cfg.data.processor,
            known_tasks=[cfg.env.name],
        )
        val = None
        if cfg.grpo.val_period:
            n = min(cfg.grpo.max_val_samples, held_out)
            val = PromptDataset(
                builtin_task_dataset(n, seed=cfg.grpo.seed + 1, split="held_out", held_out=held_out),
                tok,
                cfg.data.processor,
                known_tasks=[cfg.env.name],
            )
        return train, val
    # Missing files: trainer.config.check_local_paths names the key before anything starts; from_path
    # raises FileNotFoundError naming the path for callers that skip it.
    train = _prompts(cfg, "data.dataset", cfg.data.dataset, tok, split=cfg.data.split)
    val = None
    if cfg.grpo.val_period and cfg.data.val_dataset:
        val = _prompts(cfg, "data.val_dataset", cfg.data.val_dataset, tok)
    return train, val


def _prompts(cfg: MasterConfig, key: str, path: str, tok: Any, split: str | None = None) -> PromptDataset:
    """The dataset at ``path`` (config ``key``); its DatasetError names the key and the file."""
    try:
        # every row's task is checked against the run's environment here, not when a rollout draws it
        return PromptDataset.from_path(path, tok, cfg.data.processor, split=split, known_tasks=[cfg.env.name])
    except DatasetError as exc:
        raise DatasetError(f"{key}: {exc}" if str(exc).startswith(path) else f"{key}={path}: {exc}") from None


def build_dataloader(cfg: MasterConfig, dataset: PromptDataset) -> StatefulDataLoader:
    """The training prompts in batches of ``grpo.num_prompts_per_step``; the loader's DatasetError (fewer
    prompts than one batch) names the two keys."""
    try:
        return StatefulDataLoader(dataset, cfg.grpo.num_prompts_per_step, shuffle=cfg.data.shuffle, seed=cfg.grpo.seed)
    except DatasetError as exc:
        raise DatasetError(
            f"data.dataset={cfg.data.dataset} for grpo.num_prompts_per_step={cfg.grpo.num_prompts_per_step}: {exc}"
        ) from None


def build_task_to_env(cfg: MasterConfig) -> dict[str, Any]:
    kwargs = {"num_workers": cfg.env.num_workers} if cfg.env.name == "math" else {}
    return {cfg.env.name: make_environment(cfg.env.name, **kwargs)}


@dataclass
class StepTargets:
    """The driver's per-sample outputs for one step."""

    advantages: torch.Tensor  # float32 [n]
    sample_mask: torch.Tensor  # float32 [n]
    metrics: dict[str, float]


def compute_step_targets(
    grpo: GRPOConfig,
    *,
    rewards: torch.Tensor,
    prompt_ids: torch.Tensor,
    response_lengths: torch.Tensor,
    truncated: torch.Tensor,
    loss_multiplier: torch.Tensor,
) -> StepTargets:
    """Reward scaling and overlong shaping, group baselines, advantages and the sample mask.

    Everything here is per sample (one scalar each), so the TQ trainer runs it without any token data.
    """
    r = rewards.to(torch.float32)
    raw_mean = float(r.mean()) if r.numel() else 0.0
    if grpo.reward_scaling.enabled:
        rs = grpo.reward_scaling
        r = A.scale_rewards(r, source_min=rs.source_min, source_max=rs.source_max, target_min=rs.target_min, target_max=rs.target_max)
    if grpo.overlong_reward_shaping.enabled:
        o = grpo.overlong_reward_shaping
        r = A.overlong_reward_shaping(
            r, response_lengths, max_response_length=o.max_response_length, buffer_length=o.buffer_length, penalty=o.penalty
        )
    mask = loss_multiplier.to(torch.float32).clone()
    if grpo.overlong_filtering:
        mask = mask * (~truncated.to(torch.bool)).to(torch.float32)
    baseline, std = A.calculate_baseline_and_std_per_prompt(prompt_ids, r, mask > 0, leave_one_out=grpo.use_leave_one_out_baseline)
    adv = A.compute_advantages(r, baseline, std, normalize_by_std=grpo.normalize_rewards, clip=grpo.advantage_clip)
    metrics = {
        "reward": raw_mean,
        "shaped_reward": float(r.mean()) if r.numel() else 0.0,
        "advantage_abs_mean": float(adv.abs().mean()) if adv.numel() else 0.0,
        "zero_std_group_fraction": float((std == 0).float().mean()) if std.numel() else 0.0,
        "truncated_fraction": float(truncated.float().mean()) if truncated.numel() else 0.0,
        "mean_response_length": float(response_lengths.float().mean()) if response_lengths.numel() else 0.0,
        "masked_fraction": float((mask == 0).float().mean()) if mask.numel() else 0.0,
    }
    return StepTargets(adv, mask, metrics)


def dynamic_sampling_keep(grpo: GRPOConfig, rewards: torch.Tensor, prompt_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Samples to keep under dynamic sampling (all, when it is off): groups whose rewards differ."""
    if not grpo.use_dynamic_sampling:
        return torch.ones_like(rewards, dtype=torch.bool)
    _, std = A.calculate_baseline_and_std_per_prompt(prompt_ids, rewards.to(torch.float32), mask > 0, leave_one_out=False)
    return A.dynamic_sampling_keep(std)


def summarize_train_metrics(train: Mapping[str, Any]) -> dict[str, float]:
    """Scalars of the policy's training metrics (tensors reduced to floats)."""
    out = {}
    for k, v in train.items():
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            continue
    return out
