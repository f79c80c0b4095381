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
