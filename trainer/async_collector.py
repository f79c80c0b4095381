"""Async GRPO's generation side: a pure scheduler and the ``AsyncTrajectoryCollector`` Ray actor.

Vocabulary (NeMo-RL's async GRPO). Training step ``t`` trains weights version ``t`` into ``t + 1``; the
generator runs on some weight version ``v`` and writes each prompt group to TQ tagged with
``weight_version`` (``v``) and ``target_step`` (the training step that will consume it). A generator on
weights ``v`` may target ``TrajectoryScheduler.target_weights(v)``:

- the initial version ``v0`` (the start step) targets itself and the next ``max_trajectory_age_steps``
  steps: ``[v0, ..., v0 + age]`` (step ``v0`` has no older weights to come from);
- any later ``v`` targets ``[v + 1, ..., v + age]`` (age 4, ``v = 10``: ``[11, 12, 13, 14]``).

So a trajectory trained at step ``t`` is at most ``age`` versions old. The generator fills the first
target still missing groups; once every target of its version is generated (or the buffer is full)
it idles until the next weight update. The trainer waits for step ``t + 1``'s groups before refitting
to version ``t + 1`` (which can no longer target ``t + 1``), so no target is ever stranded.

Two ways to refit. Quiescent (start-up, checkpoints): ``prepare_for_refit`` stops new generations and
waits for in-flight ones, ``update_weights`` changes weights and version, ``resume_after_refit``
restarts generation. Staged (every training step): ``stage_weights`` returns at once; the generation
call in flight finishes on the old weights (its groups keep the old version tag) and the next call
starts on the new ones. The trainer never waits for a generation to finish just to refit - with the
quiescent refit every step did, which serialised generation and training again.

:class:`TrajectoryScheduler` holds all of that as pure bookkeeping (no Ray, no threads, no I/O) so it
can be property-tested; :class:`AsyncTrajectoryCollectorImpl` drives it from a background thread and
does the generation and the TQ writes; ``AsyncTrajectoryCollector`` is that class as a Ray actor.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

log = logging.getLogger(__name__)


class SchedulingError(RuntimeError):
    """An operation would break the scheduling invariants (e.g. a refit with generations in flight)."""


class GenerationBudgetExceeded(RuntimeError):
    """More generation calls failed than ``async_grpo.max_failed_generations`` allows."""


@dataclass(frozen=True)
class Reservation:
    """Groups one generation call produces: ``num_groups`` prompts of ``target`` on weights ``weight_version``."""

    rid: int
    target: int
    num_groups: int
    weight_version: int


@dataclass
class _Target:
    generated: list[tuple[int, int]] = field(default_factory=list)  # (weight_version, groups) written to TQ
    in_flight: int = 0

    def generated_groups(self) -> int:
        return sum(n for _, n in self.generated)


class TrajectoryScheduler:
    """Which step each generation targets, buffer room, pause/refit state - pure and deterministic.

    Args:
        groups_per_step: prompt groups one training step consumes (``grpo.num_prompts_per_step``).
        max_age: ``async_grpo.max_trajectory_age_steps``.
        start_step: the first training step (also the initial weight version).
        capacity_groups: groups awaiting training (in flight included) the buffer may hold.
        chunk_groups: groups per generation call (at most; the last chunk of a step may be smaller).
    """

    def __init__(
        self,
        *,
        groups_per_step: int,
        max_age: int,
        start_step: int = 0,
        capacity_groups: int | None = None,
        chunk_groups: int | None = None,
    ) -> None:
        if groups_per_step < 1 or max_age < 1:
            raise ValueError(f"groups_per_step ({groups_per_step}) and max_age ({max_age}) must be >= 1")
        self.groups_per_step, self.max_age = groups_per_step, max_age
        self.initial_version = self.weight_version = start_step
        self.next_train_step = start_step  # targets below it were consumed
        self.capacity_groups = capacity_groups if capacity_groups is not None else (max_age + 1) * groups_per_step
        if self.capacity_groups < 2 * groups_per_step:
            raise ValueError(f"capacity_groups ({self.capacity_groups}) must hold two steps ({2 * groups_per_step} groups)")
        self.chunk_groups = min(chunk_groups or groups_per_step, groups_per_step)
        self.targets: dict[int, _Target] = {}
        self.paused = False
        self.refitting = False
        self.staged_version: int | None = None  # weights that arrived during generation, not yet applied
        self._rids = itertools.count()
        self.in_flight: dict[int, Reservation] = {}

    # ------------------------------------------------------------------ targets
    def target_weights(self, version: int) -> list[int]:
        """Training steps a generator on weights ``version`` may target (module docstring)."""
        if version == self.initial_version:
            return list(range(version, version + self.max_age + 1))
        return list(range(version + 1, version + self.max_age + 1))

    def _needs(self, t: int) -> int:
        s = self.targets.get(t)
        return self.groups_per_step - (s.generated_groups() + s.in_flight if s else 0)

    def next_target(self) -> int | None:
        """The first target of the current version still needing groups (None: all are generated)."""
        for t in self.target_weights(self.weight_version):
            if t >= self.next_train_step and self._needs(t) > 0:
                return t
        return None

    def held_groups(self) -> int:
        """Groups generated or in flight and not yet consumed (what the capacity bounds)."""
        return sum(s.generated_groups() + s.in_flight for t, s in self.targets.items() if t >= self.next_train_step)

    def blocked_reason(self) -> str | None:
        """Why no generation may start now (None: one may)."""
        if self.paused:
            return "paused"
        if self.refitting:
            return "refitting"
        t = self.next_target()
        if t is None:
            return f"every target of weight version {self.weight_version} is generated"
        if self.held_groups() + min(self.chunk_groups, self._needs(t)) > self.capacity_groups:
            return f"buffer full ({self.held_groups()} of {self.capacity_groups} groups held)"
        return None

    # ------------------------------------------------------------------ generation side
    def start(self) -> Reservation | None:
        """Reserve the next chunk of groups to generate, or None when generation must wait."""
        if self.blocked_reason() is not None:
            return None
        t = self.next_target()
        assert t is not None
        n = min(self.chunk_groups, self._needs(t))
        r = Reservation(next(self._rids), t, n, self.weight_version)
        self.targets.setdefault(t, _Target()).in_flight += n
        self.in_flight[r.rid] = r
        return r

    def finish(self, r: Reservation, ok: bool) -> None:
        """A reserved generation ended: its groups are in TQ (``ok``) or must be generated again."""
        if self.in_flight.pop(r.rid, None) is None:
            raise SchedulingError(f"reservation {r.rid} finished twice or was never started")
        s = self.targets[r.target]
        s.in_flight -= r.num_groups
        if ok:
            s.generated.append((r.weight_version, r.num_groups))

    # ------------------------------------------------------------------ training side
    def ready(self, step: int) -> bool:
        """Whether every group of ``step`` is in TQ."""
        s = self.targets.get(step)
        return s is not None and s.generated_groups() == self.groups_per_step

    def consume(self, step: int) -> list[tuple[int, int]]:
        """The trainer consumed ``step``'s groups (in order); returns their ``(weight_version, groups)``.

        Raises if it is not the next step, not complete, or any group is older than the age bound.
        """
        if step != self.next_train_step:
            raise SchedulingError(f"consume({step}) out of order: the next training step is {self.next_train_step}")
        if not self.ready(step):
            raise SchedulingError(f"step {step} is not fully generated")
        s = self.targets.pop(step)
        too_old = [v for v, _ in s.generated if step - v > self.max_age]
        if too_old:
            raise SchedulingError(f"step {step} would train on weight versions {too_old}, older than {self.max_age} steps")
        self.next_train_step = step + 1
        return list(s.generated)

    # ------------------------------------------------------------------ pause / refit
    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def prepare_for_refit(self) -> None:
        """Start no new generations (in-flight ones finish on the old weights)."""
        self.refitting = True

    def set_weight_version(self, version: int) -> None:
        """Move to new weights; only while refitting with nothing in flight, never backwards."""
        if self.in_flight:
            raise SchedulingError(
                f"set_weight_version({version}) with {len(self.in_flight)} generations in flight (call prepare_for_refit and wait for them)"
            )
        if not self.refitting:
            raise SchedulingError("set_weight_version outside prepare_for_refit / resume_after_refit")
        if version < self.weight_version:
            raise SchedulingError(f"weight version moved backwards: {self.weight_version} -> {version}")
        self.weight_version = version
        if self.staged_version is not None and self.staged_version <= version:
            self.staged_version = None  # superseded

    def stage_weight_version(self, version: int) -> None:
        """New weights arrived without a pause: generations in flight finish on the old ones and the
        switch happens at the next generation boundary (:meth:`apply_staged`), so a refit never waits
        for generation. Refused if it would strand a target: every step up to ``version`` that
        ``version`` may not target must already be fully generated (the trainer waits for it)."""
        current = self.weight_version if self.staged_version is None else self.staged_version
        if version < current:
            raise SchedulingError(f"weight version moved backwards: {current} -> {version}")
        allowed = self.target_weights(version)
        stranded = [t for t in range(self.next_train_step, version + 1) if t not in allowed and not self.ready(t)]
        if stranded:
            raise SchedulingError(f"weights {version} cannot target steps {stranded}, which are not fully generated yet")
        self.staged_version = version

    def apply_staged(self) -> int | None:
        """At a generation boundary (nothing in flight, no quiescent refit): switch to the staged
        version. Returns it, or None when there is nothing to switch to now."""
        if self.staged_version is None or self.in_flight or self.refitting:
            return None
        self.weight_version, self.staged_version = self.staged_version, None
        return self.weight_version

    def resume_after_refit(self) -> None:
        self.refitting = False


def _wait(
    cond: threading.Condition,
    done: Callable[[], bool],
    timeout_s: float,
    what: Callable[[], str],
    error: Callable[[], BaseException | None],
) -> None:
    """Wait on ``cond`` (held by the caller) until ``done()``; raise the collector's error or a timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        err = error()
        if err is not None:
            raise err
        if done():
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(what())
        cond.wait(min(left, 0.5))


class AsyncTrajectoryCollectorImpl:
    """Generates GRPO groups ahead of training into a TQ partition (see the module docstring).

    Args:
        generation: a generation backend config (dict), a backend, or generation actor handle(s).
        tokenizer_name: the tokenizer (default: the generation config's).
        task_to_env: task name -> environment (instance, name or ``{"name", **kwargs}``).
        master_config: the ``MasterConfig`` (or its dict): grpo, data, async_grpo and data_plane sections.
        replay_buffer: the ``rollout.collector.TQReplayBuffer`` naming the TQ connection and partition (its
            ``capacity`` in samples bounds the groups held, with ``async_grpo.max_buffered_groups``).
        start_step: the first training step (= the initial weight version).
    """

    def __init__(
        self,
        generation: Any,
        tokenizer_name: str | None,
        task_to_env: Mapping[str, Any],
        master_config: Any,
        replay_buffer: Any,
        start_step: int = 0,
    ) -> None:
        from rollout.actors import SyncRolloutImpl

        from .common import build_dataloader, build_datasets
        from .config import MasterConfig

        cfg = master_config if isinstance(master_config, MasterConfig) else MasterConfig.model_validate(master_config)
        self.cfg = cfg
        g, a = cfg.grpo, cfg.async_grpo
        self.group_size = g.num_generations_per_prompt
        self.buffer = replay_buffer
        capacity = a.max_buffered_groups or (a.max_trajectory_age_steps + 1) * g.num_prompts_per_step
        capacity = min(capacity, replay_buffer.capacity // self.group_size)
        self.sched = TrajectoryScheduler(
            groups_per_step=g.num_prompts_per_step,
            max_age=a.max_trajectory_age_steps,
            start_step=start_step,
            capacity_groups=capacity,
            chunk_groups=a.groups_per_generation,
        )
        self.rollout = SyncRolloutImpl(
            generation=generation,
            tokenizer_name=tokenizer_name,
            environments=task_to_env,
            seed=g.seed,
            connection=replay_buffer.connection,
            limits={
                "max_seq_len": cfg.data.processor.max_seq_length + g.max_rollout_turns * g.max_new_tokens,
                "max_new_tokens": g.max_new_tokens,
                "max_rollout_turns": g.max_rollout_turns,
            },
        )
        # Versions count training steps: the trainer refits (update_weights) with version start_step
        # before start_collection, so every sample's weight_version tag is a training step.
        train_ds, _ = build_datasets(cfg)
        self.dataset = train_ds
        self.loader = build_dataloader(cfg, train_ds)
        # Prompts of each target not yet handed to a generation call, and the dataset indices of each
        # target's groups written to TQ (for checkpoints: these are what a resumed run regenerates).
        self._todo: dict[int, deque[dict[str, Any]]] = {}
        self._written: dict[int, list[int]] = {}
        self._epochs: dict[int, int] = {}  # the loader epoch each target's prompts were drawn in (ledger tags)
        self._serial = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._error: BaseException | None = None
        self.failed_generations = 0
        self._last_failure: BaseException | None = None
        self._staged_weights: Mapping[str, torch.Tensor] | None = None
        self.counters = {"generation_calls": 0, "groups": 0, "samples": 0, "idle_waits": 0, "staged_refits": 0, "last_refit_s": 0.0}
        # When each generation call ran and what it targeted (monotonic seconds; for overlap profiles).
        self.timeline: deque[tuple[float, float, int, int]] = deque(maxlen=10_000)
        self.timeout_s = a.wait_timeout_s

    # ------------------------------------------------------------------ weight versions
    def set_weight_version(self, version: int) -> int:
        with self._cond:
            self.sched.set_weight_version(version)
            self._cond.notify_all()
            return version

    def get_weight_version(self) -> int:
        return self.sched.weight_version

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        """Refit the generator (between ``prepare_for_refit`` and ``resume_after_refit``); ``state_dict``
        arrives as an object ref resolved by Ray, never through the driver."""
        with self._cond:
            if self.sched.in_flight or not self.sched.refitting:
                raise SchedulingError("update_weights needs prepare_for_refit first (and no generation in flight)")
            self.rollout.update_weights(state_dict, version)
            self.sched.set_weight_version(version)
            if self.sched.staged_version is None:
                self._staged_weights = None
            self._cond.notify_all()
            return version

    def stage_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        """Refit without pausing generation: the call in flight finishes on the old weights, the next
        one starts on these (``TrajectoryScheduler.stage_weight_version``); returns at once. A newer
        staged version replaces an older one not yet applied."""
        with self._cond:
            self.sched.stage_weight_version(version)
            self._staged_weights = state_dict
            self._cond.notify_all()
            return version

    def _apply_staged_weights(self) -> None:
        """At a generation boundary (``self._cond`` held): load staged weights, if any."""
        if self._staged_weights is None or self.sched.in_flight or self.sched.refitting:
            return
        t = time.perf_counter()
        self.rollout.update_weights(self._staged_weights, self.sched.staged_version)
        self.counters["last_refit_s"] = time.perf_counter() - t  # the generator's load, overlapping training
        self.sched.apply_staged()
        self._staged_weights = None
        self.counters["staged_refits"] += 1

    # ------------------------------------------------------------------ lifecycle
    def start_collection(self, state: Mapping[str, Any] | None = None) -> None:
        """Start the background loop, first restoring a :meth:`get_dataloader_state` if given."""
        if self._thread is not None:
            raise RuntimeError("start_collection was already called")
        client = self.buffer.client
        client.clear_partition(self.buffer.partition_id)  # a restart regenerates what the old run buffered
        if state:
            self.loader.load_state_dict(state["loader"])
            if state.get("generation") is not None:
                self.rollout.load_generation_state(state["generation"])
            epochs = {int(t): int(e) for t, e in state.get("target_epochs", {}).items()}
            for t, idxs in state["targets"].items():
                if int(t) >= self.sched.next_train_step:
                    self._todo[int(t)] = deque(self.dataset[i] for i in idxs)
                    self._epochs[int(t)] = epochs.get(int(t), -1)  # -1: a checkpoint from before epochs were kept
        self._thread = threading.Thread(target=self._loop, name="async-trajectory-collector", daemon=True)
        self._thread.start()

    def pause(self) -> None:
        with self._cond:
            self.sched.pause()

    def resume(self) -> None:
        with self._cond:
            self.sched.resume()
            self._cond.notify_all()

    def prepare_for_refit(self, timeout_s: float | None = None) -> None:
        """Start no new generations and wait (bounded) for the in-flight ones to land in TQ."""
        with self._cond:
            self.sched.prepare_for_refit()
        self.wait_for_pending_generations(timeout_s)

    def resume_after_refit(self) -> None:
        with self._cond:
            self.sched.resume_after_refit()
            self._cond.notify_all()

    def wait_for_pending_generations(self, timeout_s: float | None = None) -> None:
        t = self.timeout_s if timeout_s is None else timeout_s
        with self._cond:
            _wait(
                self._cond,
                lambda: not self.sched.in_flight,
                t,
                lambda: f"{len(self.sched.in_flight)} generations still in flight after {t:.0f}s",
                lambda: self._error,
            )

    def wait_for_target(self, step: int, timeout_s: float | None = None) -> dict[str, Any]:
        """Block until every group of ``step`` is in TQ (async_grpo.wait_timeout_s); re-raises a failure
        of the collection loop. Returns the collector's counters."""
        t = self.timeout_s if timeout_s is None else timeout_s
        with self._cond:
            _wait(
                self._cond,
                lambda: self.sched.ready(step),
                t,
                lambda: (
                    f"step {step}: only {self.sched.targets[step].generated_groups() if step in self.sched.targets else 0} of "
                    f"{self.sched.groups_per_step} groups generated after {t:.0f}s (async_grpo.wait_timeout_s); "
                    f"collector: {self.sched.blocked_reason() or 'generating'}, weight version {self.sched.weight_version}"
                ),
                lambda: self._error,
            )
            return self.stats()

    def release_target(self, step: int) -> list[tuple[int, int]]:
        """The trainer consumed ``step`` (its keys are freed): frees its room; returns ``(version, groups)``."""
        with self._cond:
            out = self.sched.consume(step)
            self._written.pop(step, None)
            self._epochs.pop(step, None)
            self._cond.notify_all()
            return out

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            "failed_generations": self.failed_generations,
            "weight_version": self.sched.weight_version,
            "held_groups": self.sched.held_groups(),
        }

    def get_timeline(self) -> list[tuple[float, float, int, int]]:
        """``(start, end, target_step, weight_version)`` of recent generation calls, ``time.monotonic``
        seconds (one clock per host: comparable with the trainer's when on the same machine)."""
        with self._cond:
            return list(self.timeline)

    def get_dataloader_state(self) -> dict[str, Any]:
        """For checkpoints; only while paused or refitting with nothing in flight (so it is exact).

        Holds the loader position (after every batch drawn so far), the generator's sampling state and,
        per unconsumed target, the dataset indices of its prompts - generated (in TQ) or not. A resumed
        collector regenerates exactly those prompts for those targets (TQ contents are not saved):
        no prompt is lost or trained twice; the regenerated trajectories are fresh samples.
        """
        with self._cond:
            if self.sched.in_flight or not (self.sched.paused or self.sched.refitting):
                raise SchedulingError("get_dataloader_state needs pause() or prepare_for_refit() first")
            targets = {
                t: list(self._written.get(t, [])) + [int(r["idx"]) for r in self._todo.get(t, ())]
                for t in set(self._written) | set(self._todo)
                if t >= self.sched.next_train_step
            }
            return {
                "loader": self.loader.state_dict(),
                "generation": self.rollout.generation_state(),
                "targets": {str(t): v for t, v in sorted(targets.items())},
                "target_epochs": {str(t): self._epochs.get(t, -1) for t in sorted(targets)},
            }

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop (bounded) and release the rollout's resources; TQ data stays."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.rollout.shutdown()
        self.buffer.close()

    # ------------------------------------------------------------------ the background loop
    def _prompts_for(self, r: Reservation) -> list[dict[str, Any]]:
        todo = self._todo.get(r.target)
        if todo is None:  # first reservation of this target: it owns the loader's next batch
            from rollout.builders import as_records

            todo = self._todo[r.target] = deque(as_records(self.loader.next_batch()))
            self._epochs[r.target] = int(self.loader.epoch)
            if len(todo) < self.sched.groups_per_step:
                raise RuntimeError(f"the dataloader returned {len(todo)} prompts, {self.sched.groups_per_step} needed")
        return [todo.popleft() for _ in range(r.num_groups)]

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while True:
                        if self._stop:
                            return
                        self._apply_staged_weights()  # a boundary: nothing of this loop is in flight
                        if (r := self.sched.start()) is not None:
                            break
                        self.counters["idle_waits"] += 1
                        self._cond.wait(0.5)  # idle: woken by resume / refit / staged weights / a consumed step
                    records = self._prompts_for(r)
                t0 = time.monotonic()
                ok = self._generate(r, records)
                self.timeline.append((t0, time.monotonic(), r.target, r.weight_version))
                with self._cond:
                    self.sched.finish(r, ok)
                    if ok:
                        self._written.setdefault(r.target, []).extend(int(x["idx"]) for x in records)
                    else:  # the prompts go back to the front of their target: nothing is lost
                        self._todo[r.target].extendleft(reversed(records))
                        if self.failed_generations > self.cfg.async_grpo.max_failed_generations:
                            raise GenerationBudgetExceeded(
                                f"{self.failed_generations} generation calls failed (async_grpo.max_failed_generations="
                                f"{self.cfg.async_grpo.max_failed_generations}); last error: {self._last_failure!r}"
                            )
                    self._cond.notify_all()
        except BaseException as exc:  # surfaced by every wait_* call
            log.exception("async trajectory collection stopped")
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _generate(self, r: Reservation, records: list[dict[str, Any]]) -> bool:
        """Roll ``records`` out and write their groups to TQ in one put; False if it failed."""
        try:
            uids = [f"t{r.target}-{int(x['idx'])}-{next(self._serial)}" for x in records]  # unique across epochs
            # epoch and prompt_idx: which dataset prompt each sample's group rolls out (the prompt ledger)
            tags = {
                "target_step": r.target,
                "epoch": self._epochs.get(r.target, -1),
                "prompt_idx": [int(x["idx"]) for x in records for _ in range(self.group_size)],
            }
            meta, _, _, _ = self.rollout.rollout_to_tq(
                records,
                self.buffer.partition_id,
                self.group_size,
                uids=uids,
                keep_warm=True,
                extra_tags=tags,
                carry_columns=("response_lengths", "loss_multiplier"),
            )
        except Exception as exc:  # counted against the budget, logged, retried; never swallowed silently
            log.warning("generation for step %d failed (%d so far): %r", r.target, self.failed_generations + 1, exc)
            self.failed_generations += 1
            self._last_failure = exc
            return False
        n = len(meta)
        if any(v != r.weight_version for v in meta.tags["weight_version"]):  # the age bound relies on it: stop the loop
            raise SchedulingError(
                f"step {r.target}: generated on weights {sorted(set(meta.tags['weight_version']))}, reserved on {r.weight_version}"
            )
        self.counters["generation_calls"] += 1
        self.counters["groups"] += r.num_groups
        self.counters["samples"] += n
        return True


def _make_actor_class() -> Any:
    import ray

    return ray.remote(num_cpus=0.25)(AsyncTrajectoryCollectorImpl)


AsyncTrajectoryCollector = _make_actor_class()
"""``AsyncTrajectoryCollectorImpl`` as a Ray actor (``.options(num_cpus=async_grpo.collector_num_cpus)``)."""
