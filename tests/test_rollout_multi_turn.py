"""Multi-turn rollouts on the tiny offline model: turns, masks, log-probs, truncation, bad input,
and concurrent group rollouts (RolloutManager). No Ray, no TQ."""

from __future__ import annotations

import pytest
import torch

from rollout.data import DataProcessorConfig, DatasetError, PromptDataset
from rollout.environments import (
    BUILTIN_TASK_NAME,
    TWO_TURN_TASK_NAME,
    BuiltinTaskEnvironment,
    TwoTurnGuessEnvironment,
    builtin_task_processor_config,
    score_builtin_answer,
    two_turn_guess_dataset,
)
from rollout.generation import GenerationBackendConfig
from rollout.generation.hf_backend import HFGenerationBackend
from rollout.interfaces import GenerationOutput
from rollout.manager import RolloutManager
from rollout.multi_turn import Completion, EnvironmentContractError, RolloutLimits, records_to_columns, run_multi_turn_rollout


def backend(model, tok, **cfg) -> HFGenerationBackend:
    return HFGenerationBackend(GenerationBackendConfig(**cfg), model=model, tokenizer=tok)


class ShapedTwoTurnEnv(TwoTurnGuessEnvironment):
    """The two-turn game with a per-turn bonus (a user's reward shaping), so both turns score."""

    BONUS = 0.25

    def step(self, message_log_batch, metadata):
        ret = super().step(message_log_batch, metadata)
        ret.rewards = ret.rewards + self.BONUS
        return ret


class RaisesOnBoom(BuiltinTaskEnvironment):
    """A user's environment with a bug: it raises whenever a batch contains the ground truth "boom"."""

    def step(self, message_log_batch, metadata):
        if any(m.get("ground_truth") == "boom" for m in metadata):
            raise ValueError("cannot score 'boom'")
        return super().step(message_log_batch, metadata)


class NaNOnBoom(BuiltinTaskEnvironment):
    """A user's environment with a bug: it scores the ground truth "boom" NaN (e.g. 0/0 in a shaping term)."""

    def step(self, message_log_batch, metadata):
        ret = super().step(message_log_batch, metadata)
        ret.rewards = torch.where(torch.tensor([m.get("ground_truth") == "boom" for m in metadata]), float("nan"), ret.rewards)
        return ret


class StopTokenStrippingBackend(HFGenerationBackend):
    """A user's backend that, like some serving APIs, leaves stop tokens out of its responses."""

    def generate(self, prompts, **kwargs) -> GenerationOutput:
        out = super().generate(prompts, **kwargs)
        for i, ids in enumerate(out.response_ids):
            keep = ~torch.isin(ids, torch.tensor(self.stop_token_ids))
            out.response_ids[i], out.logprobs[i] = ids[keep], out.logprobs[i][keep]
        return out


def two_turn_records(tok, n=3):
    ds = PromptDataset(two_turn_guess_dataset(n, seed=1), tok)
    return [ds[i] for i in range(n)]


def builtin_records(tok, rows, max_seq_length=64):
    ds = PromptDataset(rows, tok, builtin_task_processor_config(max_seq_length))
    return [ds[i] for i in range(len(rows))]


# ------------------------------------------------------------------------------------ multi-turn
def test_two_turns_masks_summed_rewards_and_logprobs_equal_what_the_backend_returned(model, tok):
    records = two_turn_records(tok)
    limits = RolloutLimits(max_seq_len=256, max_new_tokens=6, max_rollout_turns=4)
    out, metrics, gen_metrics = run_multi_turn_rollout(
        backend(model, tok, seed=3), tok, records, {TWO_TURN_TASK_NAME: ShapedTwoTurnEnv()}, limits
    )
    # Replay the same two generate calls on a fresh backend with the same seed: bit-identical draws.
    replay = backend(model, tok, seed=3)
    turn1 = replay.generate([r["message_log"][0]["token_ids"] for r in records], max_new_tokens=6, stop_strings=[None] * 3)
    turn2 = replay.generate(
        [torch.cat([m["token_ids"] for m in r["message_log"][:3]]) for r in out], max_new_tokens=6, stop_strings=[None] * 3
    )
    cols = records_to_columns(out)
    for i, r in enumerate(out):
        assert [m["role"] for m in r["message_log"]] == ["user", "assistant", "environment", "assistant"]
        assert r["num_turns"] == 2 and r["terminated"] and not r["env_error"]
        assert r["message_log"][2]["content"] == f"Hint: it is {records[i]['extra_env_info']['ground_truth']}. Guess again:"
        a1, a2 = r["message_log"][1], r["message_log"][3]
        assert torch.equal(a1["token_ids"], turn1.response_ids[i]) and torch.equal(a1["generation_logprobs"], turn1.logprobs[i])
        assert torch.equal(a2["token_ids"], turn2.response_ids[i]) and torch.equal(a2["generation_logprobs"], turn2.logprobs[i])
        # Rewards summed over both turns: the bonus twice plus the scored second guess.
        scored, _ = score_builtin_answer(a2["content"], records[i]["extra_env_info"]["ground_truth"])
        assert r["total_reward"] == pytest.approx(2 * ShapedTwoTurnEnv.BONUS + scored)
        # Flattened: the whole conversation, assistant tokens masked in, log-probs at their positions.
        ids, mask, lps = cols["input_ids"][i], cols["token_mask"][i], cols["generation_logprobs"][i]
        assert torch.equal(ids, torch.cat([m["token_ids"] for m in r["message_log"]]))
        n0, n1, n2 = (r["message_log"][k]["token_ids"].numel() for k in range(3))
        gen_pos = torch.cat([torch.arange(n0, n0 + n1), torch.arange(n0 + n1 + n2, ids.numel())])
        assert torch.equal(mask.nonzero().flatten(), gen_pos)
        assert torch.equal(lps[gen_pos], torch.cat([turn1.logprobs[i], turn2.logprobs[i]]))
        assert not lps[~mask].any() and lps.dtype == torch.float32 and mask.dtype == torch.bool
        assert cols["input_lengths"][i] == ids.numel() and cols["sample_mask"][i] == 1.0
    assert metrics["mean_turns"] == 2.0 and metrics["num_samples"] == 3.0
    assert gen_metrics["generate_calls"] == 2.0
    assert gen_metrics["generated_tokens"] == sum(int(m.sum()) for m in cols["token_mask"])


def test_truncation_by_seq_len_by_turns_and_by_token_budget(model, tok):
    records = two_turn_records(tok, 2)
    prompt_len = records[0]["message_log"][0]["token_ids"].numel()
    env = {TWO_TURN_TASK_NAME: TwoTurnGuessEnvironment()}
    # The hint after turn 1 cannot fit: the conversation ends after one turn, flagged truncated.
    out, m, _ = run_multi_turn_rollout(
        backend(model, tok, seed=1), tok, records, env, RolloutLimits(max_seq_len=prompt_len + 12, max_new_tokens=4, max_rollout_turns=4)
    )
    for r in out:
        assert r["num_turns"] == 1 and r["truncated"] and not r["terminated"]
        assert [x["role"] for x in r["message_log"]] == ["user", "assistant"]
    assert m["truncated_fraction"] == 1.0
    # Out of turns before the environment terminated the conversation.
    out, _, _ = run_multi_turn_rollout(
        backend(model, tok, seed=1), tok, records, env, RolloutLimits(max_seq_len=256, max_new_tokens=4, max_rollout_turns=1)
    )
    assert all(r["num_turns"] == 1 and r["truncated"] and not r["terminated"] for r in out)
    # max_seq_len leaves room for 2 of the 8 new tokens: responses are cut there and flagged.
    out, _, _ = run_multi_turn_rollout(
        backend(model, tok, seed=1, stop_token_ids=[0]),
        tok,
        records,
        env,
        RolloutLimits(max_seq_len=prompt_len + 2, max_new_tokens=8, max_rollout_turns=2),
    )
    for r in out:
        c = Completion.from_record(r)
        assert c.token_ids.numel() == prompt_len + 2 and c.response_length == 2
        assert r["truncated"] and r["finish_reason"] == "length"


# ------------------------------------------------------------------------------------ bad input
def test_prompt_longer_than_the_limit_scores_zero_and_is_masked(model, tok):
    rows = [{"prompt": "1+2=", "ground_truth": "3"}, {"prompt": "1+2=" * 10, "ground_truth": "3"}]
    records = builtin_records(tok, rows, max_seq_length=10)
    assert records[1]["loss_multiplier"] == 0.0 and records[1]["length"] == 10  # the processor truncated it
    out, m, _ = run_multi_turn_rollout(
        backend(model, tok, seed=0),
        tok,
        records,
        {BUILTIN_TASK_NAME: BuiltinTaskEnvironment()},
        RolloutLimits(max_seq_len=10, max_new_tokens=2),
    )
    long = Completion.from_record(out[1])
    assert long.reward == 0.0 and long.loss_multiplier == 0.0 and long.truncated and long.num_turns == 0
    assert long.response_length == 0 and long.token_ids.numel() == 10
    short = Completion.from_record(out[0])
    assert short.loss_multiplier == 1.0 and short.num_turns == 1 and short.response_length >= 1
    assert m["masked_fraction"] == 0.5


def test_environment_that_raises_masks_only_its_sample(model, tok):
    rows = [{"prompt": "1+2=", "ground_truth": "3"}, {"prompt": "2+2=", "ground_truth": "boom"}, {"prompt": "0+1=", "ground_truth": "1"}]
    out, m, _ = run_multi_turn_rollout(
        backend(model, tok, seed=0),
        tok,
        builtin_records(tok, rows),
        {BUILTIN_TASK_NAME: RaisesOnBoom()},
        RolloutLimits(max_seq_len=32, max_new_tokens=2),
    )
    assert [r["env_error"] for r in out] == [False, True, False]
    assert out[1]["total_reward"] == 0.0 and out[1]["loss_multiplier"] == 0.0
    for r in (out[0], out[2]):  # scored as the real environment scores them
        expected, _ = score_builtin_answer(r["message_log"][-1]["content"], r["extra_env_info"]["ground_truth"])
        assert r["total_reward"] == expected and r["loss_multiplier"] == 1.0
    assert m["env_error_fraction"] == pytest.approx(1 / 3)


def _immediate_stop_seed(model, tok, prompt, n):
    """A sampling seed for which some of ``n`` copies of ``prompt`` draw a stop token first."""
    probe_cfg = dict(max_new_tokens=1, stop_strings=[None] * n)
    for seed in range(200):
        b = backend(model, tok, seed=seed)
        out = b.generate([prompt] * n, **probe_cfg)
        rows = [i for i, ids in enumerate(out.response_ids) if ids[0].item() in b.stop_token_ids]
        if rows:
            return seed, rows
    raise AssertionError("no seed in 200 draws a stop token first")


def test_non_finite_reward_is_refused_naming_the_task_and_row(model, tok):
    # A NaN reward would make its group's advantages 0 (or NaN, unnormalised) and the loss NaN.
    rows = [{"prompt": "1+2=", "ground_truth": "3"}, {"prompt": "2+2=", "ground_truth": "boom"}]
    records = builtin_records(tok, rows)
    with pytest.raises(
        EnvironmentContractError, match=r"task 'builtin_add' \(step\) returned a non-finite reward \(nan\) for dataset row 1"
    ):
        run_multi_turn_rollout(
            backend(model, tok, seed=0), tok, records, {BUILTIN_TASK_NAME: NaNOnBoom()}, RolloutLimits(max_seq_len=32, max_new_tokens=2)
        )
    manager = RolloutManager(  # the concurrent path (environment steps in a worker thread) refuses it too
        generation=backend(model, tok, seed=0),
        tokenizer=tok,
        environments={BUILTIN_TASK_NAME: NaNOnBoom()},
        limits={"max_seq_len": 32, "max_new_tokens": 2},
        num_generations_per_prompt=2,
    )
    with pytest.raises(EnvironmentContractError, match="non-finite reward .* for dataset row 1"):
        manager.run_rollouts(records)


def test_generation_that_returns_nothing(model, tok):
    n = 16
    records = builtin_records(tok, [{"prompt": "3+4=", "ground_truth": "7", "idx": 0}] * n)
    seed, rows = _immediate_stop_seed(model, tok, records[0]["message_log"][0]["token_ids"], n)
    envs = {BUILTIN_TASK_NAME: BuiltinTaskEnvironment()}
    limits = RolloutLimits(max_seq_len=32, max_new_tokens=2)
    # Only a stop token, no text: a real action of the policy - scored (an empty answer earns 0) and
    # kept in the loss with its one generated token, so the policy learns not to stop at once.
    out, m, _ = run_multi_turn_rollout(backend(model, tok, seed=seed), tok, records, envs, limits)
    for i in rows:
        c = Completion.from_record(out[i])
        assert c.response_length == 1 and c.message_log[-1]["content"] == ""
        assert c.reward == 0.0 and c.loss_multiplier == 1.0 and not c.truncated and c.finish_reason == "stop"
        assert c.logprobs[c.token_mask].numel() == 1 and c.logprobs[c.token_mask][0] < 0
    assert m["empty_response_fraction"] == pytest.approx(len(rows) / n)
    # A backend that returns zero tokens for them: nothing to train on - reward 0, sample masked.
    stripping = StopTokenStrippingBackend(GenerationBackendConfig(seed=seed), model=model, tokenizer=tok)
    out, m, _ = run_multi_turn_rollout(stripping, tok, records, envs, limits)
    for i in rows:
        assert out[i]["empty_generation"] and out[i]["loss_multiplier"] == 0.0 and out[i]["total_reward"] == 0.0
        assert Completion.from_record(out[i]).response_length == 0
    assert m["empty_generation_fraction"] == pytest.approx(len(rows) / n)


def test_malformed_rows_and_records_raise_naming_the_row(model, tok):
    with pytest.raises(DatasetError, match=r"row 1: field 'prompt' \(prompt\) must be a string"):
        PromptDataset([{"prompt": "1+1="}, {"prompt": 5}], tok, DataProcessorConfig(ground_truth_key=None))
    records = builtin_records(tok, [{"prompt": "1+2=", "ground_truth": "3"}, {"prompt": "1+3=", "ground_truth": "4"}])
    broken = [records[0], {**records[1], "idx": 7, "message_log": [{"role": "user", "content": "1+3=", "token_ids": [5, 6]}]}]
    envs = {BUILTIN_TASK_NAME: BuiltinTaskEnvironment()}
    limits = RolloutLimits(max_seq_len=32, max_new_tokens=2)
    b = backend(model, tok, seed=0)
    with pytest.raises(DatasetError, match=r"record 1 \(dataset row 7\): message 0 needs 'token_ids'"):
        run_multi_turn_rollout(b, tok, broken, envs, limits)
    with pytest.raises(DatasetError, match=r"record 0 \(dataset row 0\): no environment registered for task 'nope'"):
        run_multi_turn_rollout(b, tok, [{**records[0], "task_name": "nope"}], envs, limits)
    assert b._seeds.calls == 0  # validated before anything was generated


# ------------------------------------------------------------------------------------ async groups
def test_rollout_manager_runs_completions_concurrently(model, tok):
    records = two_turn_records(tok, 2)
    manager = RolloutManager(
        generation=backend(model, tok, seed=5),
        tokenizer=tok,
        environments={TWO_TURN_TASK_NAME: ShapedTwoTurnEnv()},
        limits={"max_seq_len": 256, "max_new_tokens": 4, "max_rollout_turns": 3},
        num_generations_per_prompt=4,
        max_concurrent_groups=2,
    )
    groups, metrics = manager.run_rollouts(records)
    # Both groups' 4 completions were awaiting the backend at once.
    assert manager.max_in_flight == 8 and metrics["max_requests_in_flight"] == 8.0
    assert [g.uid for g in groups] == [str(r["idx"]) for r in records]
    assert [g.keys for g in groups][0] == [f"{records[0]['idx']}_g{i}" for i in range(4)]
    for g, r in zip(groups, records):
        assert len(g.completions) == 4 and g.prompt_id == r["idx"] and g.policy_version == 0
        for c in g.completions:
            assert c.num_turns == 2 and c.terminated and [m["role"] for m in c.message_log][-1] == "assistant"
            assert torch.equal(c.token_ids[: c.prompt_length], r["message_log"][0]["token_ids"])
            scored, _ = score_builtin_answer(c.message_log[-1]["content"], r["extra_env_info"]["ground_truth"])
            assert c.reward == pytest.approx(2 * ShapedTwoTurnEnv.BONUS + scored)
            assert c.logprobs[~c.token_mask].abs().sum() == 0 and (c.logprobs[c.token_mask] < 0).all()
    assert metrics["num_groups"] == 2.0 and metrics["num_samples"] == 8.0 and metrics["mean_turns"] == 2.0
    assert metrics["generation/generation_requests"] == 16.0  # 8 conversations x 2 turns
    assert metrics["generation/generated_tokens"] == sum(c.response_length for g in groups for c in g.completions)
    assert metrics["env/two_turn_guess/num_samples"] == 4.0
