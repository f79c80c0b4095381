"""The trainers' configuration: shipped recipes load, overrides apply, bad keys and values are named."""

import re

import pytest

from trainer.config import CONFIG_DIR, ConfigError, load_config, parse_cli


@pytest.mark.parametrize("recipe", sorted(p.name for p in CONFIG_DIR.glob("*.yaml")))
def test_shipped_recipes_validate(recipe):
    cfg = load_config(CONFIG_DIR / recipe)
    assert cfg.policy.model_name == cfg.generation.model_name


def test_dotted_overrides_parse_as_yaml_values():
    cfg = parse_cli(
        [
            "grpo.num_prompts_per_step=8",
            "policy.train_global_batch_size=64",
            "policy.learning_rate=3e-4",
            "grpo.advantage_clip=null",
            "policy.sequence_packing.enabled=true",
            "policy.sequence_packing.train_mb_tokens=256",
            "policy.sequence_packing.logprob_mb_tokens=512",
        ]
    )
    assert cfg.grpo.num_prompts_per_step == 8 and cfg.policy.learning_rate == 3e-4
    assert cfg.policy.sequence_packing.enabled and cfg.grpo.advantage_clip is None


@pytest.mark.parametrize(
    "override, named",
    [
        ("grpo.num_prompts_per_stepz=8", "grpo.num_prompts_per_stepz"),
        ("policy.dp_size=0", "policy.dp_size"),
        ("loss.reference_policy_kl_type=k9", "loss.reference_policy_kl_type"),
        ("policy.model_name=other", "generation.model_name"),
        ("nosection.x=1", "nosection"),
        ("grpo.num_generations_per_prompt=3", "policy.train_global_batch_size"),
        ("env.name=math", "data.processor.task_name ('builtin_add') names no environment of this run: env.name is 'math'"),
    ],
)
def test_unknown_keys_and_bad_values_are_named(override, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        parse_cli([override])


def test_bad_command_lines():
    with pytest.raises(ConfigError, match="does not exist"):
        parse_cli(["--config", "/no/such/file.yaml"])
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_cli(["grpo.num_prompts_per_step"])
    with pytest.raises(ConfigError, match="unknown option"):
        parse_cli(["--fast"])


def test_progress_line_shows_the_step_phases_not_the_driver_and_worker_breakdowns(tmp_path, capsys, monkeypatch):
    """The live line stays readable: the phases of a step with 2 decimals; the instrumented
    driver_*/worker_* breakdowns go to metrics.jsonl only."""
    from trainer import logger as L
    from trainer.config import LoggerConfig
    from trainer.logger import MetricsLogger

    monkeypatch.setattr(L.time, "perf_counter", lambda: 5.0)  # no time passes: elapsed and ETA 0:00
    log = MetricsLogger(LoggerConfig(log_dir=str(tmp_path), tensorboard=False, plot=False), "run")
    try:
        log.start(2, 10)
        log.progress(
            3,
            10,
            {
                "reward": 0.5,
                "step_time_s": 0.123,
                "timing/generation": 0.061,
                "timing/training": 0.04,
                "timing/driver_get": 0.002,
                "timing/worker_fetch": 0.001,
            },
        )
    finally:
        log.close()
    line = capsys.readouterr().out.strip()
    assert line == "step 3/10 | reward 0.5000 | time 0.12s | (generation 0.06s, training 0.04s) | elapsed 0:00, ETA 0:00"


def test_console_prints_a_step_line_every_n_steps_with_elapsed_and_eta(tmp_path, capsys, monkeypatch):
    """The step line comes at the first step, every ``logger.console_every`` steps and the last; its
    ETA is the mean time per step so far times the steps left. Every step still reaches the JSONL."""
    import json

    from trainer import logger as L
    from trainer.config import LoggerConfig

    now = [100.0]
    monkeypatch.setattr(L.time, "perf_counter", lambda: now[0])
    log = L.MetricsLogger(LoggerConfig(log_dir=str(tmp_path), tensorboard=False, plot=False, console_every=10), "run")
    try:
        log.start(0, 25)
        for step in range(1, 26):
            now[0] += 3.0  # 3 s per step
            log.log(step, {"reward": 0.1})
            log.progress(step, 25, {"reward": 0.1})
    finally:
        log.close()
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split(" | ")[0] for ln in lines] == ["step 1/25", "step 10/25", "step 20/25", "step 25/25"]
    assert lines[1].endswith("elapsed 0:30, ETA 0:45") and lines[-1].endswith("elapsed 1:15, ETA 0:00")
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 25
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["reward"] == 0.1


def test_count_lists_become_tensorboard_histograms(tmp_path):
    """``*_counts`` metrics (the async staleness histogram) stay lists in the JSONL and are TensorBoard
    histograms over 0..len-1."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainer.config import LoggerConfig
    from trainer.logger import MetricsLogger

    log = MetricsLogger(LoggerConfig(log_dir=str(tmp_path), plot=False, progress=False), "run")
    log.log(1, {"async/trajectory_age_counts": [3, 5], "reward": 0.5})
    log.close()
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert row["async/trajectory_age_counts"] == [3, 5]
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    (h,) = acc.Histograms("train/async/trajectory_age")
    assert h.histogram_value.num == 8 and h.histogram_value.sum == 5 and h.histogram_value.max == 1


def _leaf_fields(model, prefix=""):
    from pydantic import BaseModel

    for key, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _leaf_fields(field.annotation, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", field


@pytest.mark.parametrize("module", ["grpo", "grpo_sync", "grpo_async"])
def test_help_lists_every_key_with_its_default_and_description(module, capsys):
    """``--help`` is generated from the pydantic models: every key, its default, its description, and
    what the trainer's default recipe sets instead; it exits 0 without starting anything."""
    import importlib

    from trainer.config import MasterConfig

    assert importlib.import_module(f"trainer.{module}").main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m trainer.{module} [--config FILE] [--print-config]")
    for key, field in _leaf_fields(MasterConfig):
        assert field.description, f"{key} has no description"
        assert f"  {key} (" in out, key
        assert field.description.split()[0] in out
    assert "  grpo.max_num_steps (int) = 30  [recipe: 600]" in out
    age = "  async_grpo.max_trajectory_age_steps (int) = 4"
    assert (age + "  [recipe: 1]" if module == "grpo_async" else age + "\n") in out


def test_print_config_prints_the_resolved_config_and_exits(capsys):
    import yaml

    from trainer.config import MasterConfig
    from trainer.grpo_sync import main

    assert main(["--print-config", "grpo.max_num_steps=7", "policy.learning_rate=3e-4"]) == 0
    printed = MasterConfig.model_validate(yaml.safe_load(capsys.readouterr().out))
    assert printed == parse_cli(["grpo.max_num_steps=7", "policy.learning_rate=3e-4"])
    assert main(["--print-config", "grpo.bogus=1"]) == 2 and "grpo.bogus" in capsys.readouterr().err


@pytest.mark.parametrize(
    "recipe, first",
    [
        ("grpo_offline_cpu.yaml", ["rollout", "policy"]),  # nothing on a GPU: side by side
        ("grpo_gpu_vllm_1gpu.yaml", ["policy"]),  # vLLM colocated with the policy: it measures free GPU memory at start-up
        ("grpo_gpu_vllm_2gpu.yaml", ["rollout", "policy"]),  # vLLM on its own GPU (NCCL refit)
    ],
)
def test_the_rollout_actor_starts_beside_the_policy_only_when_they_share_no_gpu(ray_session, monkeypatch, recipe, first):
    """The trainer's start-up order, up to the policy's build (stopped there: no model, no GPU needed);
    a rollout actor launched first is killed when the policy fails to build."""
    import trainer.base as base
    from trainer.grpo import GRPOTrainer

    class Stop(Exception):
        pass

    order, killed, handle = [], [], object()

    def build_policy(self):
        order.append("policy")
        raise Stop

    monkeypatch.setattr(GRPOTrainer, "_launch_rollout_actor", lambda self: order.append("rollout") or handle)
    monkeypatch.setattr(GRPOTrainer, "build_policy", build_policy)
    monkeypatch.setattr(base.ray, "kill", killed.append)
    with pytest.raises(Stop):
        GRPOTrainer(load_config(CONFIG_DIR / recipe))
    assert order == first
    assert killed == ([handle] if first[0] == "rollout" else [])


def _recipe(recipe: str, *overrides: str):
    return parse_cli(["--config", str(CONFIG_DIR / recipe), *overrides])


def test_colocated_policy_ranks_get_a_gpu_bundle_each_shared_with_their_generation_worker():
    """Half a GPU per policy rank: one {"GPU": 1} bundle per rank (Ray alone packs two halves onto one
    GPU); the colocated generation workers' CPUs go in the same bundles. Ray's own placement where it
    is right: one rank, whole GPUs, CPU ranks."""
    from trainer.config import colocation_bundles, generation_colocated

    one = _recipe("grpo_gpu_vllm_1gpu.yaml")
    assert colocation_bundles(one) is None and generation_colocated(one)  # one rank: both on the one GPU
    two = _recipe("grpo_gpu_vllm_1gpu.yaml", "policy.dp_size=2", "policy.train_global_batch_size=512")
    assert colocation_bundles(two) == [{"GPU": 1.0, "CPU": 2.0}] * 2
    more = _recipe("grpo_gpu_vllm_1gpu.yaml", "policy.dp_size=2", "generation.ray_workers=4", "generation.refit_transport=state_dict")
    assert colocation_bundles(more) == [{"GPU": 1.0, "CPU": 2.0}] * 4  # a bundle per worker, ranks in the first two
    apart = _recipe(
        "grpo_gpu_vllm_1gpu.yaml", "policy.dp_size=2", "generation.num_gpus_per_worker=1", "generation.refit_transport=state_dict"
    )
    assert not generation_colocated(apart) and colocation_bundles(apart) == [{"GPU": 1.0, "CPU": 1.0}] * 2  # engines elsewhere
    assert colocation_bundles(_recipe("grpo_gpu_vllm_2gpu.yaml", "policy.dp_size=2", "policy.train_global_batch_size=512")) is None
    assert colocation_bundles(parse_cli(["policy.dp_size=2"])) is None  # CPU ranks


def test_colocated_configs_that_cannot_work_are_refused_naming_the_key():
    with pytest.raises(
        ConfigError, match=r"'cuda_ipc' maps each generation worker .* generation.ray_workers \(3\) must be <= policy.dp_size \(2\)"
    ):
        _recipe("grpo_gpu_vllm_1gpu.yaml", "policy.dp_size=2", "generation.ray_workers=3")
    _recipe("grpo_gpu_vllm_1gpu.yaml", "policy.dp_size=2", "generation.ray_workers=2")  # engine j maps the buffer of rank j, beside it
    with pytest.raises(ConfigError, match=r"policy.num_gpus_per_worker 0.5 with policy.dp_size 2 is not supported in async mode"):
        _recipe("grpo_gpu_vllm_async_2gpu.yaml", "policy.num_gpus_per_worker=0.5", "policy.dp_size=2")


def test_the_local_rays_cpu_count_is_a_whole_number():
    """``ray.init`` takes ``num_cpus`` as an int: given 16.0 (this key was a float) the raylet of a
    2-GPU host never started - a 30 s start-up timeout naming neither the value nor the key."""
    assert type(parse_cli(["cluster.num_cpus=16"]).cluster.num_cpus) is int
    with pytest.raises(ConfigError, match=r"cluster.num_cpus: Input should be a valid integer"):
        parse_cli(["cluster.num_cpus=2.5"])


def test_a_run_needing_gpus_the_cluster_lacks_fails_naming_them_and_leaves_no_placement_group(ray_session, tmp_path):
    """Half-GPU ranks on a Ray without GPUs: the trainer's placement group is not placed within
    ``policy.ray_timeout_s``; the error names the bundles, and the group is removed."""
    from trainer.grpo import GRPOTrainer

    cfg = parse_cli(
        [
            *("policy.dp_size=2", "policy.num_gpus_per_worker=0.5", "policy.ray_timeout_s=2"),
            *("checkpointing.enabled=false", f"logger.log_dir={tmp_path}"),
        ]
    )
    with pytest.raises(TimeoutError, match=r"in 2 bundles of \{'GPU': 1.0, 'CPU': 0.5\}, a GPU each.*fewer free GPUs"):
        GRPOTrainer(cfg)
    assert all(pg["state"] == "REMOVED" for pg in ray_session.util.placement_group_table().values())


def test_a_dataset_smaller_than_one_step_is_named_with_both_keys(tmp_path):
    """One prompt for a step of two: the loader's DatasetError (a run would have no batch) names the
    dataset and the step's prompt count - the trainer prints it as its one line."""
    from common.models import build_tiny_tokenizer
    from rollout.data import DatasetError, PromptDataset
    from trainer.common import build_dataloader

    cfg = parse_cli(["grpo.num_prompts_per_step=2", "policy.train_global_batch_size=16", f"data.dataset={tmp_path}/p.jsonl"])
    one = PromptDataset([{"prompt": "1+1=", "ground_truth": "2"}], build_tiny_tokenizer())
    with pytest.raises(
        DatasetError, match=rf"^data\.dataset={tmp_path}/p\.jsonl for grpo\.num_prompts_per_step=2: a dataset of 1 rows gives no batch of 2"
    ):
        build_dataloader(cfg, one)


@pytest.mark.parametrize(
    "overrides, named",
    [
        # each was accepted and trained nothing, or failed inside step 1 (minutes in, with vLLM) naming no key
        (
            ["grpo.num_generations_per_prompt=1", "policy.train_global_batch_size=4"],
            "grpo.num_generations_per_prompt: Input should be greater than or equal to 2",
        ),
        (["env.name=two_turn_guess", "data.processor.task_name=two_turn_guess"], "grpo.max_rollout_turns must be >= 2, got 1"),
        (
            ["grpo.overlong_reward_shaping.enabled=true", "grpo.overlong_reward_shaping.buffer_length=4096"],
            "grpo.overlong_reward_shaping.buffer_length (4096) must be at most grpo.overlong_reward_shaping.max_response_length (1024)",
        ),
        (
            ["grpo.reward_scaling.enabled=true", "grpo.reward_scaling.source_min=1", "grpo.reward_scaling.source_max=0"],
            "grpo.reward_scaling.source_max (0.0) must exceed grpo.reward_scaling.source_min (1.0)",
        ),
        (["policy.adam_betas=[1.5, 2]"], "policy.adam_betas: Value error, each AdamW beta must be in [0, 1)"),
        (["grpo.seed=99999999999999999999"], "grpo.seed: Input should be less than 9223372036854775808"),
        (["generation.seed=-1"], "generation.seed: Input should be greater than or equal to 0"),
        # generation.max_new_tokens was ignored: the trainers generate grpo.max_new_tokens per turn
        (["generation.max_new_tokens=8"], "generation.max_new_tokens (8) and grpo.max_new_tokens (2) differ"),
        (["policy.logprob_temperature=0.5"], "policy.logprob_temperature (0.5) must be 1.0"),
        (["env.num_workers=2"], "env.num_workers (2) starts math verifier actors; env.name is 'builtin_add'"),
    ],
)
def test_settings_that_could_never_train_are_refused_naming_the_keys(overrides, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        parse_cli(overrides)


def test_the_policy_scores_at_the_temperature_the_generator_reports_and_one_token_limit_serves_both():
    cfg = parse_cli(["generation.temperature=0.7"])
    assert cfg.policy.logprob_temperature == 0.7  # 'processed' log-probs: the tempered distribution
    assert parse_cli(["generation.temperature=0.7", "generation.logprobs_mode=raw"]).policy.logprob_temperature == 1.0
    assert parse_cli(["generation.temperature=0"]).policy.logprob_temperature == 1.0  # greedy: no processing
    for recipe in sorted(CONFIG_DIR.glob("*.yaml")):  # the usual override works on every recipe (they set grpo's only)
        assert load_config(recipe, ["grpo.max_new_tokens=24"]).generation.max_new_tokens == 24
    both = parse_cli(["generation.max_new_tokens=8", "grpo.max_new_tokens=8"])
    assert both.grpo.max_new_tokens == both.generation.max_new_tokens == 8
    from trainer.config import MasterConfig

    assert MasterConfig(generation={"max_new_tokens": 5}).grpo.max_new_tokens == 5  # the one set serves both
    assert MasterConfig(grpo={"max_new_tokens": 6}).generation.max_new_tokens == 6
    again = MasterConfig.model_validate(cfg.model_dump())  # the collector actor re-validates the driver's dump
    assert again.policy.logprob_temperature == 0.7
