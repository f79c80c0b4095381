"""GRPO algorithm pieces against hand-computed values."""

import math

import pytest
import torch

from trainer.algorithms import (
    calculate_baseline_and_std_per_prompt,
    compute_advantages,
    dynamic_sampling_keep,
    overlong_reward_shaping,
    pass_at_k,
    scale_rewards,
    seq_logprob_error_mask,
)


def test_group_mean_baseline_and_unbiased_std():
    prompts = torch.tensor([0, 0, 0, 1, 1])
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0])
    base, std = calculate_baseline_and_std_per_prompt(prompts, rewards, torch.ones(5), leave_one_out=False)
    assert torch.allclose(base, torch.tensor([0.5, 0.5, 0.5, 2.0, 2.0]))
    assert torch.allclose(std, torch.tensor([0.5, 0.5, 0.5, 0.0, 0.0]))  # var of (1, 0, .5) = .25


def test_leave_one_out_baseline_ignores_invalid_samples():
    prompts = torch.tensor([7, 7, 7, 3])
    rewards = torch.tensor([1.0, 0.0, 9.0, 4.0])
    valid = torch.tensor([1.0, 1.0, 0.0, 1.0])  # the 9.0 sample is masked out
    base, std = calculate_baseline_and_std_per_prompt(prompts, rewards, valid, leave_one_out=True)
    assert torch.allclose(base[:2], torch.tensor([0.0, 1.0]))  # each sees only the other valid one
    assert base[2] == pytest.approx(0.5)  # an invalid sample's baseline is the mean of the valid ones
    assert base[3] == 0.0  # alone in its group
    assert std[0] == pytest.approx(math.sqrt(0.5)) and std[3] == 0.0


def test_advantages_normalized_and_clipped():
    adv = compute_advantages(
        torch.tensor([1.0, 0.0, 3.0]), torch.tensor([0.5, 0.5, 3.0]), torch.tensor([0.5, 0.5, 0.0]), normalize_by_std=True
    )
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0]), atol=1e-5)
    clipped = compute_advantages(torch.tensor([10.0]), torch.tensor([0.0]), torch.tensor([1.0]), normalize_by_std=False, clip=2.0)
    assert clipped.item() == 2.0
    with pytest.raises(ValueError, match="clip"):
        compute_advantages(torch.ones(1), torch.zeros(1), torch.ones(1), normalize_by_std=False, clip=0.0)


def test_reward_scaling_and_overlong_shaping():
    assert torch.allclose(
        scale_rewards(torch.tensor([0.0, 0.5, 1.0, 2.0]), source_min=0, source_max=1, target_min=-1, target_max=1),
        torch.tensor([-1.0, 0.0, 1.0, 1.0]),
    )
    shaped = overlong_reward_shaping(torch.ones(4), torch.tensor([10, 16, 18, 25]), max_response_length=20, buffer_length=4, penalty=1.0)
    assert torch.allclose(shaped, torch.tensor([1.0, 1.0, 0.5, 0.0]))


def test_dynamic_sampling_and_logprob_error_masks():
    assert dynamic_sampling_keep(torch.tensor([0.0, 0.3])).tolist() == [False, True]
    assert seq_logprob_error_mask(torch.tensor([0.1, 0.5]), 0.2).tolist() == [1.0, 0.0]
    assert seq_logprob_error_mask(torch.tensor([9.0]), None).tolist() == [1.0]


def test_pass_at_k_unbiased():
    correct = torch.tensor([1, 0, 0, 0, 1, 1, 1, 1])
    prompts = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    # prompt 0: n=4, c=1 -> pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = .5; prompt 1: 1.0
    assert pass_at_k(correct, prompts, 2) == pytest.approx(0.75)
    assert pass_at_k(correct, prompts, 1) == pytest.approx((0.25 + 1.0) / 2)
