"""PolicyConfig rejects bad settings with a message naming the key; the LR schedule's shape."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from policy.optim import lr_factor
from policy.policy import PolicyConfig


@pytest.mark.parametrize(
    "kwargs,key",
    [
        (
            {
                "dynamic_batching": {"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 64},
                "sequence_packing": {"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 64},
            },
            "sequence_packing.enabled",
        ),
        ({"sequence_packing": {"enabled": True, "logprob_mb_tokens": 64}}, "sequence_packing.train_mb_tokens"),
        ({"dynamic_batching": {"enabled": True, "train_mb_tokens": 64}}, "dynamic_batching.logprob_mb_tokens"),
        ({"dp_size": 4, "train_global_batch_size": 2}, "train_global_batch_size"),
        ({"lr_schedule": "cosine"}, "max_steps"),
        ({"dp_size": 0}, "dp_size"),
        ({"dtype": "float8"}, "dtype"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"sequence_packing": {"algorithm": "best_fit"}}, "algorithm"),
        ({"train_mb_size": 2}, "train_mb_size"),  # unknown keys are rejected, not ignored
        ({"dist_backend": "nccl"}, "num_gpus_per_worker"),
    ],
)
def test_bad_config_names_the_key(kwargs, key):
    with pytest.raises(ValidationError, match=key.replace(".", r"\.")):
        PolicyConfig(**kwargs)


def test_good_config_defaults():
    cfg = PolicyConfig(sequence_packing={"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 128})
    assert cfg.device == "cpu" and cfg.backend == "gloo" and cfg.num_cpus_per_worker == 0.5
    assert PolicyConfig(num_gpus_per_worker=1).backend == "nccl"
    assert PolicyConfig(**cfg.model_dump()) == cfg  # round-trips through the dict the actors get


def test_lr_schedule_warmup_then_constant_or_cosine():
    kw = dict(warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [lr_factor(s, schedule="constant", **kw) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = [lr_factor(s, schedule="cosine", **kw) for s in (4, 9, 14, 20)]
    # half-way through the 10 decay steps the cosine is at 0.5: 0.1 + 0.9 * 0.5
    assert cos == pytest.approx([1.0, 0.55, 0.1, 0.1])
