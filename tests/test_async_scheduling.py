"""Async GRPO's pure scheduling (``trainer.async_collector.TrajectoryScheduler``), no Ray: the target
arithmetic, and property tests that random interleavings of generation, training, pause/resume and
refit never lose, duplicate or over-age a trajectory."""

from __future__ import annotations

from contextlib import nullcontext as _nullcontext

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.async_collector import SchedulingError, TrajectoryScheduler
from trainer.config import CONFIG_DIR, ConfigError, load_config


def test_target_weights_issue_example():
    s = TrajectoryScheduler(groups_per_step=2, max_age=4, start_step=0)
    assert s.target_weights(10) == [11, 12, 13, 14]
    assert s.target_weights(0) == [0, 1, 2, 3, 4]  # the initial version targets itself and the next ones
    resumed = TrajectoryScheduler(groups_per_step=2, max_age=4, start_step=7)
    assert resumed.target_weights(7) == [7, 8, 9, 10, 11] and resumed.target_weights(8) == [9, 10, 11, 12]


def test_idles_when_all_targets_generated_and_refit_ordering():
    s = TrajectoryScheduler(groups_per_step=1, max_age=2, start_step=0)
    rs = [s.start() for _ in range(3)]
    assert [r.target for r in rs] == [0, 1, 2] and s.start() is None
    assert "every target" in s.blocked_reason()
    for r in rs:
        s.finish(r, ok=True)
    assert s.consume(0) == [(0, 1)]
    s.prepare_for_refit()
    s.set_weight_version(1)
    s.resume_after_refit()
    assert s.start().target == 3  # version 1 targets [2, 3]; 2 is done
    with pytest.raises(SchedulingError):
        s.set_weight_version(2)  # a generation is in flight and no refit was prepared
    with pytest.raises(SchedulingError):
        s.consume(2)  # out of order


def test_failed_generation_is_retried_not_lost():
    s = TrajectoryScheduler(groups_per_step=2, max_age=1, start_step=0, chunk_groups=2)
    r = s.start()
    s.finish(r, ok=False)
    assert not s.ready(0) and s.start().target == 0


def test_backpressure_capacity():
    s = TrajectoryScheduler(groups_per_step=2, max_age=4, start_step=0, capacity_groups=4, chunk_groups=1)
    rs = [s.start() for _ in range(4)]
    assert all(rs) and s.start() is None and s.blocked_reason().startswith("buffer full")
    for r in rs:
        s.finish(r, ok=True)
    s.consume(0)
    assert s.start() is not None


def test_async_config_requires_importance_sampling():
    with pytest.raises(ConfigError, match="loss.use_importance_sampling_correction"):
        load_config(CONFIG_DIR / "grpo_async_cpu.yaml", ["loss.use_importance_sampling_correction=false"])
    assert load_config(CONFIG_DIR / "grpo_async_cpu.yaml").async_grpo.max_trajectory_age_steps == 4


ACTIONS = st.lists(st.tuples(st.sampled_from(["start", "finish", "fail", "train", "pause", "resume", "refit"]),
                             st.integers(0, 7)), max_size=200)


@settings(max_examples=200, deadline=None)
@given(actions=ACTIONS, groups=st.integers(1, 3), age=st.integers(1, 4), chunk=st.integers(1, 3),
       extra_capacity=st.integers(0, 4), start=st.integers(0, 5))
def test_random_interleavings_keep_invariants(actions, groups, age, chunk, extra_capacity, start):
    """The trainer's protocol (train step t, wait for t + 1, prepare_for_refit, wait in flight,
    set_weight_version, resume) interleaved at random with generation starts/finishes/failures and
    pause/resume: every generated group is trained exactly once, never beyond the age bound, no
    weight change happens with generations in flight, and nothing starts while paused or refitting."""
    s = TrajectoryScheduler(groups_per_step=groups, max_age=age, start_step=start,
                            capacity_groups=2 * groups + extra_capacity, chunk_groups=chunk)
    in_flight = []
    generated = trained = 0
    step = start

    def drain():  # what prepare_for_refit's wait does: in-flight generations land
        nonlocal generated
        while in_flight:
            r = in_flight.pop(0)
            s.finish(r, ok=True)
            generated += r.num_groups

    def train_and_refit():
        nonlocal step, trained, generated
        versions = s.consume(step)
        assert sum(n for _, n in versions) == groups
        assert all(0 <= step - v <= age for v, _ in versions)
        trained += groups
        step += 1
        # wait until step's data is complete: generation keeps running (the trainer waits on it)
        for _ in range(100):
            if s.ready(step):
                break
            r = s.start()
            if r is None:
                assert s.paused or in_flight, f"step {step} unreachable: {s.blocked_reason()}"
                if s.paused:
                    s.resume()
                drain()
                continue
            s.finish(r, ok=True)
            generated += r.num_groups
        assert s.ready(step)
        s.prepare_for_refit()
        assert s.start() is None
        drain()
        s.set_weight_version(step)
        s.resume_after_refit()

    for kind, arg in actions:
        if kind == "start":
            r = s.start()
            if s.paused or s.refitting:
                assert r is None
            if r is not None:
                assert r.target in s.target_weights(s.weight_version) and r.target >= step
                assert s.held_groups() <= s.capacity_groups
                in_flight.append(r)
        elif kind in ("finish", "fail") and in_flight:
            r = in_flight.pop(arg % len(in_flight))
            s.finish(r, ok=kind == "finish")
            generated += r.num_groups if kind == "finish" else 0
        elif kind == "train" and s.ready(step):
            train_and_refit()
        elif kind == "pause":
            s.pause()
        elif kind == "resume":
            s.resume()
        elif kind == "refit":
            s.prepare_for_refit()
            with pytest.raises(SchedulingError) if in_flight else _nullcontext():
                s.set_weight_version(s.weight_version)
            s.resume_after_refit()
    drain()
    buffered = sum(t.generated_groups() for k, t in s.targets.items() if k >= step)
    assert generated == trained + buffered  # none lost, none used twice
    assert all(t.in_flight == 0 for t in s.targets.values())

