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


def test_staged_refit_switches_at_the_next_boundary_and_never_strands():
    s = TrajectoryScheduler(groups_per_step=1, max_age=1, start_step=0)
    r0 = s.start()
    assert r0.target == 0 and s.start().target == 1  # the initial version targets [0, 1]
    with pytest.raises(SchedulingError, match=r"cannot target steps \[0, 1\]"):
        s.stage_weight_version(1)  # version 1 targets [2] only: steps 0 and 1 (in flight) would be stranded
    s.finish(r0, ok=True)
    r1 = next(iter(s.in_flight.values()))
    s.finish(r1, ok=True)
    s.consume(0)
    s.stage_weight_version(1)  # step 1 is generated: stage without pausing anything
    assert s.weight_version == 0 and s.staged_version == 1
    r2 = s.start()  # nothing left for version 0: only the staged weights may go on ...
    assert r2 is None and s.apply_staged() == 1 and s.weight_version == 1
    r2 = s.start()
    assert (r2.target, r2.weight_version) == (2, 1)
    with pytest.raises(SchedulingError, match="backwards"):
        s.stage_weight_version(0)
    assert s.apply_staged() is None  # nothing staged


def test_staged_weights_wait_for_the_generation_in_flight():
    s = TrajectoryScheduler(groups_per_step=1, max_age=3, start_step=0)
    done = [s.start() for _ in range(2)]
    for r in done:
        s.finish(r, ok=True)
    s.consume(0)
    flying = s.start()  # target 2 on version 0
    s.stage_weight_version(1)
    assert s.apply_staged() is None and s.weight_version == 0  # a generation is in flight on the old weights
    s.finish(flying, ok=True)
    assert s.apply_staged() == 1
    s.prepare_for_refit()
    s.stage_weight_version(2)
    assert s.apply_staged() is None  # a quiescent refit is in charge now
    s.set_weight_version(3)  # ... and supersedes the staged version
    s.resume_after_refit()
    assert s.staged_version is None and s.weight_version == 3


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
    assert load_config(CONFIG_DIR / "grpo_async_cpu.yaml").async_grpo.max_trajectory_age_steps == 1  # the recipe (README)


ACTIONS = st.lists(
    st.tuples(st.sampled_from(["start", "finish", "fail", "train", "pause", "resume", "refit", "boundary"]), st.integers(0, 7)),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(
    actions=ACTIONS,
    groups=st.integers(1, 3),
    age=st.integers(1, 4),
    chunk=st.integers(1, 3),
    extra_capacity=st.integers(0, 4),
    start=st.integers(0, 5),
)
def test_random_interleavings_keep_invariants(actions, groups, age, chunk, extra_capacity, start):
    """The trainer's protocol (train step t, wait for t + 1, then refit: quiescent - prepare_for_refit,
    wait in flight, set_weight_version, resume - or staged - stage_weight_version, applied at a later
    generation boundary) interleaved at random with generation starts/finishes/failures and
    pause/resume: every generated group is trained exactly once, never beyond the age bound, the
    trainer never waits for a step no version can reach, weights never go backwards or change with
    generations in flight, and nothing starts while paused or refitting."""
    s = TrajectoryScheduler(
        groups_per_step=groups, max_age=age, start_step=start, capacity_groups=2 * groups + extra_capacity, chunk_groups=chunk
    )
    in_flight = []
    generated = trained = 0
    step = start

    def drain():  # what prepare_for_refit's wait does: in-flight generations land
        nonlocal generated
        while in_flight:
            r = in_flight.pop(0)
            s.finish(r, ok=True)
            generated += r.num_groups

    versions_seen = [s.weight_version]

    def boundary():  # what the collector loop does between generation calls
        v = s.apply_staged()
        if v is not None:
            assert not in_flight and v >= versions_seen[-1]
            versions_seen.append(v)

    def train_and_refit(staged: bool):
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
            boundary()
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
        if staged:  # in-flight generations go on; the switch waits for a boundary
            s.stage_weight_version(step)
            return
        s.prepare_for_refit()
        assert s.start() is None
        drain()
        s.set_weight_version(step)
        versions_seen.append(step)
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
            train_and_refit(staged=arg % 2 == 1)
        elif kind == "boundary" and not in_flight:
            boundary()
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
