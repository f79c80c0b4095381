"""The trainers' configuration: shipped recipes load, overrides apply, bad keys and values are named."""

import pytest

from trainer.config import CONFIG_DIR, ConfigError, load_config, parse_cli


@pytest.mark.parametrize("recipe", sorted(p.name for p in CONFIG_DIR.glob("*.yaml")))
def test_shipped_recipes_validate(recipe):
    cfg = load_config(CONFIG_DIR / recipe)
    assert cfg.policy.model_name == cfg.generation.model_name


def test_dotted_overrides_parse_as_yaml_values():
    cfg = parse_cli(["grpo.num_prompts_per_step=8", "policy.train_global_batch_size=64", "policy.learning_rate=3e-4", "grpo.advantage_clip=null",
                     "policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=256",
                     "policy.sequence_packing.logprob_mb_tokens=512"])
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
    ],
)
def test_unknown_keys_and_bad_values_are_named(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        parse_cli([override])


def test_bad_command_lines():
    with pytest.raises(ConfigError, match="does not exist"):
        parse_cli(["--config", "/no/such/file.yaml"])
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_cli(["grpo.num_prompts_per_step"])
    with pytest.raises(ConfigError, match="unknown option"):
        parse_cli(["--fast"])


def test_progress_line_shows_the_step_phases_not_the_driver_and_worker_breakdowns(tmp_path, capsys):
    """The live line stays readable: the phases of a step with 2 decimals; the instrumented
    driver_*/worker_* breakdowns go to metrics.jsonl only."""
    from trainer.config import LoggerConfig
    from trainer.logger import MetricsLogger

    log = MetricsLogger(LoggerConfig(log_dir=str(tmp_path), tensorboard=False, plot=False), "run")
    try:
        log.progress(3, 10, {"reward": 0.5, "step_time_s": 0.123, "timing/generation": 0.061, "timing/training": 0.04,
                             "timing/driver_get": 0.002, "timing/worker_fetch": 0.001})
    finally:
        log.close()
    line = capsys.readouterr().out.strip()
    assert line == "step 3/10 | reward 0.5000 | time 0.12s | (generation 0.06s, training 0.04s)"
