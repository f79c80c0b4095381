"""LLMCollector and TQReplayBuffer on the tiny offline model with a real TQ service and real Ray:
batch counts, replay-buffer fill and backpressure, pause/resume, state_dict resume, policy-version
(staleness) tags after refits, and the collector as a Ray actor."""

from __future__ import annotations

import time
import uuid

import pytest

from common.models import TINY_MODEL, load_model
from rollout.collector import CollectorExhausted, LLMCollector, TQReplayBuffer
from rollout.data import PromptDataset, StatefulDataLoader, collate_datums
from rollout.environments import BUILTIN_TASK_NAME, builtin_task_dataset, builtin_task_processor_config
from tq import TQConnection

GEN = {"seed": 11}
ENVS = {BUILTIN_TASK_NAME: BUILTIN_TASK_NAME}
LIMITS = {"max_seq_len": 16, "max_new_tokens": 2}


@pytest.fixture(scope="module")
def dataset(tok):
    return PromptDataset(builtin_task_dataset(25, seed=0), tok, builtin_task_processor_config())


def loader(dataset, batch_size=3):
    return StatefulDataLoader(dataset, batch_size, seed=4, collate_fn=collate_datums)


def collector(dataset, **kw) -> LLMCollector:
    args = dict(
        generation=GEN, dataloader=loader(dataset), environments=ENVS, limits=LIMITS, group_size=2, dialog_turns_per_batch=4, timeout_s=60
    )
    args.update(kw)
    return LLMCollector(**args)


def buffer(tq_server, capacity, **kw) -> TQReplayBuffer:
    return TQReplayBuffer(
        TQConnection(tq_server.address),
        capacity=capacity,
        partition_id=f"rb-{uuid.uuid4().hex[:6]}",
        write_timeout_s=30,
        read_timeout_s=30,
        **kw,
    )


def wait_until(cond, timeout_s=30.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s}s")
        time.sleep(0.02)


def prompt_order(dataset, n, batch_size=3):
    """The dataset rows a fresh loader hands out first (across epochs)."""
    ld, out = loader(dataset, batch_size), []
    while len(out) < n:
        out += ld.next_batch()["idx"].tolist()
    return out[:n]


def test_iteration_counts_groups_and_version_tags(dataset):
    c = collector(dataset, total_dialog_turns=12)
    batches = list(c)
    assert len(batches) == 3 and c.counters == {"dialog_turns": 12, "groups": 6, "samples": 12, "batches": 3}
    order = prompt_order(dataset, 6)
    for b, k in zip(batches, range(0, 6, 2)):
        assert b["prompt_ids"].tolist() == [order[k], order[k], order[k + 1], order[k + 1]]  # whole groups, in order
        assert b["keys"] == [f"{order[k]}-{k}_g0", f"{order[k]}-{k}_g1", f"{order[k + 1]}-{k + 1}_g0", f"{order[k + 1]}-{k + 1}_g1"]
        assert b["input_ids"].shape[0] == 4 and b["token_mask"].shape == b["input_ids"].shape
        assert b["policy_version"].tolist() == [0] * 4
    with pytest.raises(CollectorExhausted):
        c.next()
    # Each completed group on its own.
    single = collector(dataset, yield_completed_trajectories=True, dialog_turns_per_batch=None, total_dialog_turns=6)
    assert [b["prompt_ids"].tolist() for b in single] == [[o, o] for o in order[:3]]


def test_update_policy_weights_stamps_versions_and_staleness(dataset, tok):
    c = collector(dataset)
    first = c.next()
    new_weights = load_model(TINY_MODEL, tokenizer=tok, seed=1).state_dict()
    assert c.update_policy_weights_(new_weights) == 1 and c.policy_version == 1
    second = c.next()
    assert second["policy_version"].tolist() == [1] * 4
    assert first["policy_version"].tolist() == [0] * 4
    assert c.update_policy_weights_(lambda: new_weights, version=5) == 5
    assert c.next()["policy_version"].tolist() == [5] * 4
    assert c.manager.generation.weight_version == 5


def test_replay_buffer_fill_backpressure_pause_resume_and_staleness_tags(tq_server, dataset, tok):
    rb = buffer(tq_server, capacity=4)
    c = collector(dataset, replay_buffer=rb, dialog_turns_per_batch=None, yield_completed_trajectories=True)
    c.start()
    try:
        wait_until(lambda: rb.stored() == 4, what="buffer full")
        time.sleep(0.5)  # the collector is blocked on the full buffer: nothing is dropped, nothing added
        assert rb.stored() == 4 and len(rb) == 4 and c.counters["groups"] == 2
        first = rb.sample(2)
        assert first.tags["policy_version"] == (0, 0) and first.tags["group_id"][0] == first.tags["group_id"][1]
        assert len(rb) == 2 and rb.stored() == 4  # handed out but not released: still holds its room
        c.pause()  # returns although the buffer is full: the blocked group is held, not dropped
        assert rb.release(first) == 2
        time.sleep(0.5)  # paused: the freed room stays free
        assert rb.stored() == 2 and c.counters["groups"] == 2
        state = c.state_dict()  # allowed while paused; the held group's prompt is in it
        held_prompts = [r["idx"] for r in state["requeued_prompts"]]
        assert len(held_prompts) >= 1 and state["counters"]["groups"] == 2
        # New weights while paused; groups started after resume are stamped with them.
        c.update_policy_weights_(load_model(TINY_MODEL, tokenizer=tok, seed=1).state_dict())
        c.resume()
        # Drain group by group: the held groups come first (oldest), then groups made with the new weights.
        versions, last = [], None
        while 1 not in versions and len(versions) < 12:
            last = rb.sample(2)
            assert last.tags["policy_version"][0] == last.tags["policy_version"][1]  # one group, one version
            versions.append(last.tags["policy_version"][0])
            if 1 not in versions:
                rb.release(last)
        assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
        data = rb.client.get(last, ["input_ids", "token_mask", "total_reward"], layout="list")
        assert len(data["input_ids"]) == 2 and all(m.any() for m in data["token_mask"])
        rb.release(last)
    finally:
        c.shutdown()
    assert not c.is_running()
    rb.clear()
    # A collector restored from the paused checkpoint collects the held-back prompts first.
    restored = collector(dataset, yield_completed_trajectories=True, dialog_turns_per_batch=None)
    restored.load_state_dict(state)
    assert [restored.next()["prompt_ids"][0].item() for _ in held_prompts] == held_prompts


def test_replay_buffer_waits_then_fails_loudly_never_drops(tq_server, dataset):
    groups, _ = collector(dataset).manager.run_rollouts([dataset[0], dataset[1]])
    rb = buffer(tq_server, capacity=3)
    rb.write_timeout_s = 0.3
    with pytest.raises(ValueError, match="4 samples can never fit a replay buffer of capacity 3"):
        rb.extend(groups)
    meta = rb.extend(groups[0])
    assert list(meta.keys) == groups[0].keys and meta.tags["policy_version"] == (0, 0)
    with pytest.raises(TimeoutError, match="stayed full for 0s: 2 of 3 samples held, 2 to write"):
        rb.extend(groups[1])
    assert rb.stored() == 2
    with pytest.raises(TimeoutError, match="has 2 samples ready, 3 asked for"):
        rb.sample(3, timeout_s=0.2)
    assert rb.clear() == 2


def test_replay_buffer_waits_parked_on_the_controller_not_polling(tq_server, dataset):
    """A sample() of an empty buffer parks one wait on the controller (its bell) instead of re-reading
    the partition's metadata in a loop, and wakes as soon as another connection writes a group."""
    import pickle
    import threading

    groups, _ = collector(dataset).manager.run_rollouts([dataset[0]])
    rb = buffer(tq_server, capacity=4)
    writer = pickle.loads(pickle.dumps(rb))  # as an actor would get it: its own connection
    got: dict = {}

    def consume() -> None:
        got["meta"] = rb.sample(2, timeout_s=20)
        got["at"] = time.monotonic()

    def reads() -> int:
        return int(rb.client.stats()["ops"].get("get_meta", {}).get("count", 0))

    try:
        rb.client  # connected before the clock starts
        t = threading.Thread(target=consume)
        t.start()
        wait_until(lambda: rb.client.stats()["parked_waits"] >= 1, what="a parked wait")
        before = reads()
        time.sleep(1.0)
        assert reads() - before <= 1, "sample() polled the partition while nothing changed"
        sent = time.monotonic()
        writer.extend(groups[0])
        t.join(20)
        assert not t.is_alive() and list(got["meta"].keys) == groups[0].keys
        assert got["at"] - sent < 1.0  # woken by the write, not by a poll interval
        assert rb.client.stats()["parked_waits"] == 0
    finally:
        rb.clear()
        writer.close()
        rb.close()


def test_state_dict_resumes_at_the_same_dataloader_position(dataset):
    # 2 prompts per batch from loader batches of 3: the checkpoint falls inside a loader batch.
    a = collector(dataset)
    a.next()
    state = a.state_dict()
    assert state["taken_in_batch"] == 2 and state["counters"]["batches"] == 1
    expected = [a.next()["prompt_ids"].tolist() for _ in range(2)]
    b = collector(dataset)
    b.load_state_dict(state)
    assert [b.next()["prompt_ids"].tolist() for _ in range(2)] == expected
    assert b.counters["batches"] == 3 and b.counters["groups"] == 6


def test_collector_as_a_ray_actor(ray_session, dataset, tok):
    ray = ray_session
    actor = (
        ray.remote(LLMCollector)
        .options(num_cpus=0.25)
        .remote(
            generation=GEN,
            dataloader=loader(dataset),
            environments=ENVS,
            limits=LIMITS,
            group_size=2,
            dialog_turns_per_batch=4,
            total_dialog_turns=8,
            timeout_s=60,
        )
    )
    try:
        batch = ray.get(actor.next.remote(), timeout=120)
        assert batch["prompt_ids"].shape == (4,) and batch["policy_version"].tolist() == [0] * 4
        weights = ray.put(load_model(TINY_MODEL, tokenizer=tok, seed=1).state_dict())
        assert ray.get(actor.update_policy_weights_.remote(weights), timeout=60) == 1
        batch = ray.get(actor.next.remote(), timeout=120)
        assert batch["policy_version"].tolist() == [1] * 4
        state = ray.get(actor.state_dict.remote(), timeout=60)
        assert state["counters"]["dialog_turns"] == 8 and state["policy_version"] == 1
        with pytest.raises(CollectorExhausted):
            ray.get(actor.next.remote(), timeout=60)
    finally:
        ray.kill(actor)
