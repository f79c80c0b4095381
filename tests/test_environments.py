"""Environments: math-verify rewards (in process and on Ray actors), the built-in task, two turns."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from common.models import TINY_MODEL, build_tiny_tokenizer, load_model
from rollout.data import PromptDataset
from rollout.environments import math_env
from rollout.environments import (
    BUILTIN_TASK_NAME,
    BuiltinTaskEnvironment,
    MathEnvironment,
    TwoTurnGuessEnvironment,
    builtin_task_dataset,
    builtin_task_processor_config,
    builtin_task_split,
    builtin_task_table,
    make_environment,
    reward_metrics,
    score_builtin_answer,
    two_turn_guess_dataset,
    verify_math_answer,
)


def convo(response, prompt: str = "Solve it.") -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


# ------------------------------------------------------------------------------------------ math
@pytest.mark.parametrize(
    "response, truth, reward, answer",
    [
        ("The answer is \\boxed{4}", "4", 1.0, "4"),
        ("so x = 1/2", "\\frac{1}{2}", 1.0, "1/2"),
        ("Final: \\boxed{0.5}", "1/2", 1.0, None),  # (math-verify normalises the extracted text here)
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0, "(x+1)^2"),
        ("The answer is \\boxed{5}", "4", 0.0, "5"),
        ("", "4", 0.0, None),
        ("asdf{{{ \\frac{ }}$$\\boxed{", "4", 0.0, None),
        ("\\boxed{4}", "", 0.0, None),
    ],
)
def test_verify_math_answer_hand_examples(response, truth, reward, answer):
    got_reward, got_answer = verify_math_answer(response, truth)
    assert got_reward == reward
    if answer is not None:
        assert got_answer == answer


def test_verify_never_raises_on_junk():
    junk = ["\x00\x01\x02", "\\" * 5000, "}{" * 3000 + "\\boxed{", "$" * 999, "1/0", "\\boxed{\\frac{1}{0}}"]
    for j in junk:
        r, _ = verify_math_answer(j, "4")
        assert r == 0.0
    assert verify_math_answer(None, "4") == (0.0, None)  # type: ignore[arg-type]


BATCH = [
    (convo("\\boxed{4}"), {"ground_truth": "4"}, 1.0),
    (convo("I think 7"), {"ground_truth": "6"}, 0.0),
    (convo("so x = 1/2"), {"ground_truth": "0.5"}, 1.0),
    ([{"role": "user", "content": "no reply yet"}], {"ground_truth": "1"}, 0.0),  # no assistant turn
    (convo(None), {"ground_truth": "1"}, 0.0),  # content is not text
    (convo("\\boxed{3}"), {}, 0.0),  # no ground truth
    (convo("\\boxed{10}"), {"ground_truth": 10}, 1.0),  # numeric ground truth
]


def test_math_environment_in_process():
    env = MathEnvironment(num_workers=0)
    logs, meta, expected = zip(*BATCH)
    ret = env.step(list(logs), list(meta))
    assert ret.rewards.dtype == torch.float32 and ret.rewards.tolist() == list(expected)
    assert ret.terminateds.dtype == torch.bool and ret.terminateds.all()
    assert ret.answers[0] == "4" and ret.answers[3] is None
    assert [o["role"] for o in ret.observations] == ["environment"] * len(BATCH)
    assert ret.next_stop_strings == [None] * len(BATCH)
    assert ret.metadata == [dict(m) for m in meta] and ret.metadata[0] is not meta[0]
    with pytest.raises(ValueError, match="metadata"):
        env.step(list(logs), list(meta)[:2])


def test_math_environment_splits_batch_over_ray_workers(ray_session):
    env = MathEnvironment(num_workers=2, batch_timeout_s=60)
    try:
        logs, meta, expected = zip(*BATCH)
        ret = env.step(list(logs), list(meta))
        assert ret.rewards.tolist() == list(expected)  # reassembled in order
        assert ret.answers == MathEnvironment(num_workers=0).step(list(logs), list(meta)).answers
        counts = [s["num_verified"] for s in ray_session.get([w.stats.remote() for w in env.workers], timeout=30)]
        assert counts == [4, 3]  # contiguous chunks, one per worker

        # A dead worker costs its chunk (scored 0), is replaced, and the next step is whole again.
        dead = env.workers[0]
        ray_session.kill(dead)
        deadline = time.monotonic() + 30  # ray.kill is asynchronous: make sure it is dead before the step
        while time.monotonic() < deadline:
            try:
                ray_session.get(dead.stats.remote(), timeout=5)
            except Exception:
                break
            time.sleep(0.1)
        ret = env.step(list(logs), list(meta))
        assert ret.rewards.tolist() == [0.0] * 4 + list(expected[4:])
        ret = env.step(list(logs), list(meta))
        assert ret.rewards.tolist() == list(expected)
    finally:
        env.shutdown()


HOSTILE = "9^{9^{9^{9}}}"  # sympy evaluates the power tower: minutes holding the GIL, unless interrupted

# A rollout thread stepping the math environment (as trainer.grpo_async's collector and RolloutManager's
# asyncio.to_thread do), in a process of its own: a thread holding the GIL would hang pytest itself.
OFF_MAIN_THREAD = """
import asyncio, json, time
from rollout.environments import MathEnvironment, math_env

env = MathEnvironment(num_workers=0, verify_timeout_s=1)
logs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": a}] for a in ("2", "\\\\boxed{4}", "\\\\boxed{9}")]
meta = [{"ground_truth": g} for g in ("HOSTILE", "4", "9")]
t0 = time.monotonic()
ret = asyncio.run(asyncio.to_thread(env.step, logs, meta))
pool = math_env._shared_pool()
children = [p.proc for p in pool._idle]
env.shutdown()
print(json.dumps({"rewards": ret.rewards.tolist(), "seconds": time.monotonic() - t0, "children": len(children),
                  "reaped": all(c.poll() is not None for c in children)}))
""".replace("HOSTILE", HOSTILE)


def test_math_verification_off_the_main_thread_is_bounded():
    r = subprocess.run([sys.executable, "-c", OFF_MAIN_THREAD], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["rewards"] == [0.0, 1.0, 1.0]  # timed out as math-verify times out: 0; the others verified
    assert out["seconds"] < 20  # math-verify's 1s per phase, plus starting the child
    assert out["children"] == 1 and out["reaped"]  # one child verified the batch; shutdown reaped it


def test_a_verification_child_past_its_deadline_is_killed_and_replaced(monkeypatch):
    # The parent's own deadline is the backstop for a child math-verify's timeout does not stop: made
    # shorter than that timeout here, so the parent kills the child first.
    monkeypatch.setattr(math_env._VerifierPool, "GRACE_S", -3 * 2 + 1.0)  # deadline 1s, math-verify's 2s
    pool = math_env._VerifierPool(size=1)
    try:
        assert pool.verify([("\\boxed{4}", "4")], 2, 10_000, None) == [(1.0, "4")]
        child = pool._idle[0].proc
        assert pool.verify([("\\boxed{5}", "4")], 2, 10_000, None) == [(0.0, "5")]
        assert pool._idle[0].proc is child  # the child stays up between batches
        pairs = [("\\boxed{2}", HOSTILE), ("\\boxed{4}", "4"), ("\\boxed{5}", "4")]
        assert pool.verify(pairs, 2, 10_000, None) == [(0.0, None), (1.0, "4"), (0.0, "5")]
        assert child.poll() is not None  # killed and reaped; a new child verified the rest
        assert pool.num_processes() == 1 and pool._idle[0].proc.pid != child.pid
        pool._idle[0].proc.kill()  # an idle child that died (OOM killer, a user): replaced, its answer still verified
        pool._idle[0].proc.wait()
        assert pool.verify([("\\boxed{4}", "4")], 2, 10_000, None) == [(1.0, "4")] and pool.num_processes() == 1
        # A batch budget spent mid-answer stops the batch: the answers left are not verified.
        t0 = time.monotonic()
        assert pool.verify(pairs, 2, 10_000, budget_s=0.5) == []
        assert time.monotonic() - t0 < 2 and pool.num_processes() == 0
    finally:
        pool.close()
    assert pool.num_processes() == 0


def test_a_batch_of_hostile_answers_is_bounded_by_its_budget():
    # On the main thread (math-verify's timeouts work): 3 answers of 1s each, but a budget of 1.5s.
    t0 = time.monotonic()
    got = math_env.verify_math_answers([("\\boxed{2}", HOSTILE)] * 3 + [("\\boxed{4}", "4")], timeout_s=1, budget_s=1.5)
    assert [r for r, _ in got] == [0.0] * 4 and time.monotonic() - t0 < 3.5  # not 3s + the easy one
    env = MathEnvironment(num_workers=0, verify_timeout_s=1, batch_timeout_s=1.5)
    t0 = time.monotonic()
    ret = env.step([convo("2")] * 3 + [convo("\\boxed{4}")], [{"ground_truth": HOSTILE}] * 3 + [{"ground_truth": "4"}])
    assert ret.rewards.tolist() == [0.0] * 4 and time.monotonic() - t0 < 3.5


def test_reward_metrics_and_post_process():
    env = MathEnvironment(num_workers=0)
    batch = {"rewards": torch.tensor([1.0, 0.0, 1.0, 1.0]), "is_end": [True, True, False, True], "prompt_ids": [0, 0, 1, 1]}
    out, m = env.global_post_process_and_metrics(batch)
    assert out["rewards"].tolist() == [1.0, 0.0, 0.0, 1.0]  # the unended correct answer earns nothing
    assert m["accuracy"] == 0.5 and m["fraction_of_samples_properly_ended"] == 0.75
    assert m["pass_at_samples_per_prompt"] == 1.0 and m["num_problems"] == 2
    out, m = reward_metrics({"rewards": [1.0, 0.0], "truncated": [True, False]}, zero_unended=False)
    assert out["rewards"].tolist() == [1.0, 0.0] and m["accuracy"] == 0.5
    with pytest.raises(KeyError):
        reward_metrics({})


# ------------------------------------------------------------------------------------ built-in task
def test_builtin_task_has_prompt_dependent_answers():
    table = builtin_task_table()
    prompts = [p for p, _ in table]
    assert len(set(prompts)) == len(prompts) >= 20
    for p, a in table:  # the answer is the sum: a function of the prompt, and correct arithmetic
        x, y = p.rstrip("=").split("+")
        assert a == str(int(x) + int(y))
    assert len({a for _, a in table}) >= 5
    records = builtin_task_dataset(60, seed=1)
    assert records == builtin_task_dataset(60, seed=1) and records != builtin_task_dataset(60, seed=2)
    counts = {}
    for r in records:
        counts[r["prompt"]] = counts.get(r["prompt"], 0) + 1
        assert r["task_name"] == BUILTIN_TASK_NAME and dict(table)[r["prompt"]] == r["ground_truth"]
    assert len(counts) == 25 and max(counts.values()) - min(counts.values()) <= 1  # balanced


def test_builtin_task_held_out_pairs_are_never_trained_on():
    """The split is disjoint and covers the table; every held-out a+b= has its mirror b+a= in training,
    and every answer is still trained on, so the held-out accuracy measures generalisation."""
    train, held = builtin_task_split()
    assert len(held) == 5 and not {p for p, _ in train} & {p for p, _ in held}
    assert sorted(train + held) == sorted(builtin_task_table())
    assert all(f"{p[2]}+{p[0]}=" in dict(train) for p, _ in held)
    assert {a for _, a in held} <= {a for _, a in train}
    trained = {r["prompt"] for r in builtin_task_dataset(200, seed=3, split="train")}
    assert trained == {p for p, _ in train}
    assert {r["prompt"] for r in builtin_task_dataset(5, seed=3, split="held_out")} == {p for p, _ in held}
    with pytest.raises(ValueError, match="held_out must be in 0..10"):
        builtin_task_split(held_out=11)


def test_trainer_validation_set_is_disjoint_from_training():
    from trainer.common import build_datasets
    from trainer.config import parse_cli

    train, val = build_datasets(parse_cli(["grpo.val_period=10", "grpo.max_val_samples=25"]))
    trained = {train.records[i]["prompt"] for i in range(len(train))}
    validated = {val.records[i]["prompt"] for i in range(len(val))}
    assert len(val) == 5 and validated and not trained & validated


def test_builtin_task_records_process_into_short_prompts():
    tok = build_tiny_tokenizer()
    ds = PromptDataset(builtin_task_dataset(30, seed=0), tok, builtin_task_processor_config())
    d = ds[0]
    assert d["length"] == 4 and d["loss_multiplier"] == 1.0 and d["task_name"] == BUILTIN_TASK_NAME
    assert tok.decode(d["message_log"][0]["token_ids"]) == ds.records[0]["prompt"]
    assert d["extra_env_info"] == {"ground_truth": ds.records[0]["ground_truth"]}


def test_builtin_reward_on_hand_examples():
    assert score_builtin_answer("7", "7") == (1.0, "7")
    assert score_builtin_answer("  7 apples", "7") == (1.0, "7")
    assert score_builtin_answer("7<|im_end|>", "7") == (1.0, "7")
    assert score_builtin_answer("72", "7") == (0.0, "72")
    assert score_builtin_answer("x7", "7") == (0.0, None)
    assert score_builtin_answer("", "7") == (0.0, None)
    assert score_builtin_answer("3", "7", format_reward=0.1) == (0.1, "3")
    env = BuiltinTaskEnvironment()
    ret = env.step([convo("5"), convo("4"), [], convo("8")], [{"ground_truth": "5"}, {"ground_truth": "5"}, {"ground_truth": "1"}, {}])
    assert ret.rewards.tolist() == [1.0, 0.0, 0.0, 0.0] and ret.terminateds.all()
    assert ret.answers == ["5", "4", None, "8"]
    _, m = env.global_post_process_and_metrics({"rewards": ret.rewards, "truncated": [True, False, False, False]})
    assert m["accuracy"] == 0.25  # truncation does not cost the built-in task its reward


def test_builtin_task_reward_is_reachable_from_random_init():
    """Learnability check without training: the random tiny model puts enough mass on the answers
    that a GRPO step of 32 prompts x 8 samples expects at least one rewarded sample."""
    tok = build_tiny_tokenizer()
    model = load_model(TINY_MODEL, tokenizer=tok, seed=0)
    probs = []
    for prompt, answer in builtin_task_table():
        ids = torch.tensor([tok(prompt)["input_ids"]])
        with torch.no_grad():
            p = torch.softmax(model(ids).logits[0, -1].float(), -1)
        probs.append(p[tok.convert_tokens_to_ids(answer)].item())
    assert 32 * 8 * (sum(probs) / len(probs)) >= 1.0


# ------------------------------------------------------------------------------------ two turns
def test_two_turn_environment_hints_then_scores():
    env = make_environment("two_turn_guess")
    assert isinstance(env, TwoTurnGuessEnvironment)
    records = two_turn_guess_dataset(5, seed=0)
    assert records == two_turn_guess_dataset(5, seed=0) and len({r["ground_truth"] for r in records}) > 1
    meta = [{"ground_truth": "7"}, {"ground_truth": "3"}]
    logs = [convo("1"), convo("2")]
    first = env.step(logs, meta)
    assert first.rewards.tolist() == [0.0, 0.0] and not first.terminateds.any()
    assert "7" in first.observations[0]["content"] and "3" in first.observations[1]["content"]
    assert [m["turn"] for m in first.metadata] == [1, 1] and first.metadata[0]["first_guess"] == "1"
    assert "turn" not in meta[0]  # the caller's metadata is not mutated
    logs = [log + [first.observations[i], {"role": "assistant", "content": g}] for i, (log, g) in enumerate(zip(logs, ["7", "4"]))]
    second = env.step(logs, first.metadata)
    assert second.rewards.tolist() == [1.0, 0.0] and second.terminateds.all()
    assert second.answers == ["7", "4"]


def test_make_environment_rejects_unknown():
    assert isinstance(make_environment(BUILTIN_TASK_NAME), BuiltinTaskEnvironment)
    with pytest.raises(ValueError, match="unknown environment"):
        make_environment("chess")
