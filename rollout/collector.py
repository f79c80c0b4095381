"""``LLMCollector`` (the shape torchrl users know) and ``TQReplayBuffer`` (finished groups kept in TQ).

The collector pulls prompts from a resumable dataloader, rolls each out as a group of
``group_size`` completions (``RolloutManager``: completions and up to ``max_concurrent_groups``
groups in flight), and either yields batches or writes the groups into a replay buffer::

    collector = LLMCollector(generation=cfg, dataloader=loader, environments={"builtin_add": "builtin_add"},
                             limits={"max_seq_len": 64, "max_new_tokens": 2}, group_size=4,
                             dialog_turns_per_batch=32, total_dialog_turns=320)
    for batch in collector:            # a BatchedDataDict of whole groups
        ...                            # train on it, then:
        collector.update_policy_weights_(policy.state_dict())

Counting follows torchrl: a *dialog turn* is one assistant turn (a conversation that could not
generate counts as one). A batch holds whole groups - GRPO baselines need every sample of a prompt -
so it holds at least ``dialog_turns_per_batch`` turns (more only when conversations run several
turns). ``yield_completed_trajectories=True`` yields each group as soon as it is complete.
With a ``replay_buffer`` every batch is written to it and iteration yields ``None`` (as torchrl's
collectors do); ``start()`` does the same in a background thread until ``shutdown()``.

Every sample carries ``policy_version``: the oldest weight version that generated any of its tokens
(a batch column, and a TQ tag in the buffer), so a consumer reads a sample's staleness as its own
version minus that.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from common.batched_data_dict import BatchedDataDict
from tq.connection import TQConnection

from .builders import as_records
from .interfaces import EnvironmentInterface
from .manager import PromptGroupRecord, RolloutManager, aggregate_rollout_metrics
from .multi_turn import RolloutLimits, completion_scalars, completions_to_columns, padded_columns

log = logging.getLogger(__name__)

REPLAY_PARTITION = "replay"
_BELL_FIELD = "rb_changed"  # written to a waiter's bell key when the buffer changes (see TQReplayBuffer)


class CollectorExhausted(RuntimeError):
    """The collector already collected ``total_dialog_turns``."""


class WriteAborted(RuntimeError):
    """A write waiting for room in a full replay buffer was called off (the collector shut down)."""


def group_sample_scalars(groups: Sequence[PromptGroupRecord]) -> dict[str, Any]:
    """Per-sample ids and scalars of groups, in group order: ``keys``, ``uids``, ``prompt_ids``,
    ``task_name``, ``policy_version`` and ``completion_scalars``."""
    completions = [c for g in groups for c in g.completions]
    scalars = completion_scalars(completions)
    return {
        "keys": [k for g in groups for k in g.keys],
        "uids": [g.uid for g in groups for _ in g.completions],
        "prompt_ids": torch.tensor([g.prompt_id for g in groups for _ in g.completions], dtype=torch.int64),
        "task_name": [g.task_name for g in groups for _ in g.completions],
        "policy_version": scalars["weight_version"].clone(),
        **scalars,
    }


# ------------------------------------------------------------------------------------ replay buffer
class TQReplayBuffer:
    """A FIFO replay buffer of finished groups, stored in a TQ partition.

    ``extend(groups)`` writes each call's samples in one put under their groups' keys, tagged
    ``uid``, ``group_id`` (prompt id) and ``policy_version``. ``sample(n)`` hands out the ``n`` oldest
    samples not yet handed out, as a ``KVBatchMeta`` (data stays in TQ; read it with a client), and
    ``release(meta)`` frees them. ``capacity`` counts samples held (handed out but not yet released
    included): a full buffer makes ``extend`` wait for room - backpressure - up to
    ``write_timeout_s``, then raise; nothing is ever dropped.

    The bookkeeping lives in TQ (tags), so any process may write or sample by the partition's name;
    one consumer samples at a time. The object pickles without its connection (e.g. into a Ray actor).

    Waiting (for samples, or for room) is parked on the TQ controller, not polled: a waiter mints a
    *bell* key in the partition ``"<partition_id>.bells"`` and waits for its field ``rb_changed``;
    every ``extend``, ``release`` and ``clear`` rings the bells (writes that field), so the waiter
    wakes once per change of the buffer, from any process.
    """

    def __init__(
        self,
        connection: TQConnection,
        *,
        capacity: int,
        partition_id: str = REPLAY_PARTITION,
        write_timeout_s: float = 60.0,
        read_timeout_s: float = 60.0,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not isinstance(connection, TQConnection):
            raise TypeError(f"TQReplayBuffer needs a tq.TQConnection, got {type(connection).__name__}")
        self.connection, self.partition_id, self.capacity = connection, partition_id, int(capacity)
        self.write_timeout_s, self.read_timeout_s = write_timeout_s, read_timeout_s
        self._client: Any = None
        self._seq = 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None  # sockets do not travel; the copy reconnects on first use
        return state

    @property
    def client(self) -> Any:
        """The TQ client (connected, and the partition registered, on first use)."""
        if self._client is None:
            from tq.errors import PartitionExistsError

            self._client = self.connection.connect()
            try:
                self._client.register_partition(self.partition_id)
            except PartitionExistsError:  # another writer / consumer made it: share it
                pass
        return self._client

    @property
    def bells_partition(self) -> str:
        """The partition of the waiters' bell keys."""
        return f"{self.partition_id}.bells"

    def wake_waiters(self) -> None:
        """Ring every bell: each parked waiter of this buffer (any process) re-checks what it waits for."""
        from tq.errors import KeyNotFoundError, PartitionNotFoundError

        for _ in range(3):  # a waiter that leaves between the listing and the ring fails the write: list again
            try:
                bells = self.client.get_meta(self.bells_partition)
            except PartitionNotFoundError:  # nobody ever waited on this buffer
                return
            if not len(bells):
                return
            try:
                self.client.write_back(bells, {_BELL_FIELD: torch.ones(len(bells), dtype=torch.int8)}, overwrite=True)
                return
            except KeyNotFoundError:
                continue

    def _wait_until(
        self, condition: Callable[[], bool], timeout_s: float, what: Callable[[], str], abort: Callable[[], bool] | None = None
    ) -> None:
        """Return once ``condition()`` is true; ``TimeoutError(what())`` after ``timeout_s``,
        ``WriteAborted`` once ``abort()`` is true (checked at each wake-up, and at least every second).

        Each round mints a fresh bell *before* checking, so a change made after the check rings it
        (no lost wake-up), then parks one ``wait`` on the controller until the bell rings.
        """
        from tq.errors import PartitionExistsError, TQError, TQTimeoutError

        deadline = time.monotonic() + timeout_s
        if condition():
            return
        try:
            self.client.register_partition(self.bells_partition)
        except PartitionExistsError:
            pass
        while True:
            bell = self.client.mint_keys(self.bells_partition, [uuid.uuid4().hex], 1)
            try:
                while True:
                    if condition():
                        return
                    if abort is not None and abort():
                        raise WriteAborted(what())
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(what())
                    try:
                        self.client.wait(bell, [_BELL_FIELD], timeout=min(left, 1.0) if abort is not None else left)
                        break  # rung: a new bell, then check again
                    except TQTimeoutError:
                        continue
            finally:
                try:
                    self.client.discard(bell)
                except TQError:  # already gone (the bells were cleared): nothing to free
                    pass

    def close(self) -> None:
        """Close the TQ connection (the data stays in TQ)."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def _all(self) -> Any:
        return self.client.get_meta(self.partition_id)

    def _ready_positions(self, meta: Any) -> list[int]:
        taken = meta.tags.get("rb_taken", (None,) * len(meta))
        seq = meta.tags.get("rb_seq", (0,) * len(meta))
        return sorted((i for i in range(len(meta)) if not taken[i]), key=lambda i: seq[i])

    def stored(self) -> int:
        """Samples held in TQ (ready, plus handed out and not yet released)."""
        return len(self._all())

    def __len__(self) -> int:
        """Samples ready to be sampled."""
        return len(self._ready_positions(self._all()))

    def extend(self, groups: PromptGroupRecord | Sequence[PromptGroupRecord], *, abort: Callable[[], bool] | None = None) -> Any:
        """Write finished groups (one put); waits for room while the buffer is full (``write_timeout_s``,
        or until ``abort()`` is true: ``WriteAborted``). Returns their meta."""
        groups = [groups] if isinstance(groups, PromptGroupRecord) else list(groups)
        completions = [c for g in groups for c in g.completions]
        n = len(completions)
        if n == 0:
            raise ValueError("extend needs at least one completion")
        if n > self.capacity:
            raise ValueError(f"{n} samples can never fit a replay buffer of capacity {self.capacity}")
        held = [self.stored()]

        def room() -> bool:
            held[0] = self.stored()
            return held[0] + n <= self.capacity

        self._wait_until(
            room,
            self.write_timeout_s,
            lambda: (
                f"replay buffer {self.partition_id!r} stayed full for {self.write_timeout_s:.0f}s: {held[0]} of "
                f"{self.capacity} samples held, {n} to write (sample() and release() make room)"
            ),
            abort,
        )
        scalars = group_sample_scalars(groups)
        # rb_seq orders samples oldest first: wall-clock ns, kept strictly increasing for this writer
        first = max(time.time_ns(), self._seq + 1)
        self._seq = first + n - 1
        tags = {
            "uid": scalars["uids"],
            "group_id": scalars["prompt_ids"].tolist(),
            "policy_version": scalars["policy_version"].tolist(),
            "rb_seq": list(range(first, first + n)),
        }
        meta = self.client.put(self.partition_id, scalars["keys"], completions_to_columns(completions), tags=tags)
        self.wake_waiters()
        return meta

    def sample(self, n: int, *, timeout_s: float | None = None) -> Any:
        """The ``n`` oldest samples not handed out yet (whole groups stay together when ``n`` is a multiple
        of the group size), waiting up to ``timeout_s`` (default ``read_timeout_s``) for them to arrive.
        Returns their ``KVBatchMeta`` (with their tags and fields); ``release`` it when done."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        timeout_s = self.read_timeout_s if timeout_s is None else timeout_s
        found: list[Any] = [None, []]

        def enough() -> bool:
            found[0] = self._all()
            found[1] = self._ready_positions(found[0])
            return len(found[1]) >= n

        self._wait_until(
            enough,
            timeout_s,
            lambda: f"replay buffer {self.partition_id!r} has {len(found[1])} samples ready, {n} asked for, after waiting {timeout_s:.0f}s",
        )
        meta = found[0].select(found[1][:n])
        self.client.set_tags(meta.stamp_tags(rb_taken=True))
        return meta

    def release(self, meta: Any) -> int:
        """Free sampled keys (their data and the room they held); returns how many were freed."""
        freed = self.client.discard(meta)
        self.wake_waiters()
        return freed

    def clear(self) -> int:
        """Free everything in the buffer; returns how many samples were freed."""
        freed = self.client.clear_partition(self.partition_id)
        self.wake_waiters()
        return freed


async def _run_groups(collector: "LLMCollector", target: int | None, deliver: Callable[[PromptGroupRecord], None]) -> None:
    """Run the collector's groups until ``target`` turns were delivered (None: until paused, stopped
    or done). A module function, not a method: a class with a coroutine method becomes an async
    actor under ``ray.remote``, whose methods could not run their own event loop."""
    running: set[asyncio.Task] = set()
    turns = 0
    try:
        while True:
            while len(running) < collector.manager.max_concurrent_groups and collector._may_start(target, turns, len(running)):
                with collector._lock:
                    record, uid, prompt_id = collector._take_prompt()
                running.add(asyncio.create_task(collector.manager.run_rollout(record, uid=uid, prompt_id=prompt_id)))
            if not running:
                return
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                group = task.result()
                deliver(group)
                turns += group.dialog_turns
    finally:
        for task in running:  # an error in one group: do not leave the others running
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)


# ------------------------------------------------------------------------------------ collector
class LLMCollector:
    """Collects GRPO groups from a dataloader with a generation backend; iterate it, or ``start()`` it.

    Args:
        generation: a backend, a backend config (built here), or generation actor handle(s).
        dataloader: a ``rollout.data.StatefulDataLoader`` (or anything with ``next_batch()``,
            ``state_dict()`` and ``load_state_dict()``) of ``DatumSpec`` batches.
        tokenizer: a tokenizer or its name (default: the generation config's).
        environments: task name -> environment (or name / ``{"name", **kwargs}``).
        limits: ``RolloutLimits`` or its fields.
        group_size: completions per prompt.
        dialog_turns_per_batch: assistant turns per yielded batch (required unless
            ``yield_completed_trajectories``).
        total_dialog_turns: stop after this many turns (-1: never).
        yield_completed_trajectories: yield each group as soon as it is complete.
        replay_buffer: a ``TQReplayBuffer`` to fill instead of yielding.
        max_concurrent_groups: groups in flight at once.
        timeout_s: bound on ``pause`` / ``shutdown`` waiting for in-flight groups, and on resolving
            a weights handle.
    """

    def __init__(
        self,
        *,
        generation: Any = None,
        dataloader: Any,
        tokenizer: Any = None,
        environments: Mapping[str, EnvironmentInterface | str | Mapping[str, Any]],
        limits: RolloutLimits | Mapping[str, Any],
        group_size: int = 1,
        dialog_turns_per_batch: int | None = None,
        total_dialog_turns: int = -1,
        yield_completed_trajectories: bool = False,
        replay_buffer: TQReplayBuffer | None = None,
        max_concurrent_groups: int = 2,
        seed: int | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        if not yield_completed_trajectories and (dialog_turns_per_batch is None or dialog_turns_per_batch < 1):
            raise ValueError("dialog_turns_per_batch (>= 1) is required unless yield_completed_trajectories=True")
        if total_dialog_turns == 0 or total_dialog_turns < -1:
            raise ValueError(f"total_dialog_turns must be -1 (no limit) or >= 1, got {total_dialog_turns}")
        for method in ("next_batch", "state_dict", "load_state_dict"):
            if not callable(getattr(dataloader, method, None)):
                raise TypeError(f"the dataloader needs a {method}() method (use rollout.data.StatefulDataLoader)")
        self.manager = RolloutManager(
            generation=generation,
            tokenizer=tokenizer,
            environments=environments,
            limits=limits,
            num_generations_per_prompt=group_size,
            max_concurrent_groups=max_concurrent_groups,
            seed=seed,
        )
        self.dataloader = dataloader
        self.group_size = group_size
        self.dialog_turns_per_batch = dialog_turns_per_batch
        self.total_dialog_turns = total_dialog_turns
        self.yield_completed_trajectories = yield_completed_trajectories
        self.replay_buffer = replay_buffer
        self.timeout_s = timeout_s
        self._policy_version = self.manager.generation.weight_version
        # The prompt stream: the loader's state before the batch being consumed, how many of its prompts
        # were taken, and that batch's rest. Prompts taken but not delivered are tracked until delivered
        # (in flight, or finished but held back by a full replay buffer when pausing) so a checkpoint
        # can hand them to the resumed collector.
        self._loader_state: dict[str, Any] | None = None
        self._pending: deque[dict[str, Any]] = deque()
        self._taken_in_batch = 0
        self._requeued: deque[dict[str, Any]] = deque()  # prompts a restored checkpoint hands back first
        self._in_flight: dict[str, dict[str, Any]] = {}  # uid -> prompt record
        self._held: list[tuple[dict[str, Any], PromptGroupRecord]] = []
        self._started = 0  # groups ever started (names them uniquely)
        self._start_index: dict[str, int] = {}  # uid -> start order, to order a batch's groups
        self.counters = {"dialog_turns": 0, "groups": 0, "samples": 0, "batches": 0}
        self.last_metrics: dict[str, float] = {}
        # Background collection (start / pause / resume / shutdown).
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # the prompt stream and counters: background thread vs. callers
        self._pause_lock = threading.Lock()  # orders pause() against the background loop's idle flag

    # ------------------------------------------------------------------ prompt stream
    def _take_prompt(self) -> tuple[dict[str, Any], str, int]:
        if self._requeued:
            record = self._requeued.popleft()
        else:
            if not self._pending:
                self._loader_state = self.dataloader.state_dict()
                self._pending = deque(as_records(self.dataloader.next_batch()))
                self._taken_in_batch = 0
                if not self._pending:
                    raise RuntimeError("the dataloader returned an empty batch")
            record = self._pending.popleft()
            self._taken_in_batch += 1
        idx = record.get("idx")
        prompt_id = int(idx) if isinstance(idx, int) and not isinstance(idx, bool) else self._started
        # Unique per collected group: the same prompt can be collected again (next epoch) while its
        # earlier group is still in the replay buffer, and keys must not collide.
        uid = f"{prompt_id}-{self._started}"
        self._start_index[uid] = self._started
        self._started += 1
        self._in_flight[uid] = record
        return record, uid, prompt_id

    def _count(self, group: PromptGroupRecord) -> None:
        """Account a delivered group (yielded, or written to the replay buffer)."""
        with self._lock:
            self._in_flight.pop(group.uid, None)
            self._start_index.pop(group.uid, None)
            self.counters["dialog_turns"] += group.dialog_turns
            self.counters["groups"] += 1
            self.counters["samples"] += len(group.completions)

    # ------------------------------------------------------------------ collection core
    def _done(self) -> bool:
        return 0 < self.total_dialog_turns <= self.counters["dialog_turns"]

    def _may_start(self, target: int | None, turns: int, in_flight: int) -> bool:
        # Every completion takes at least one turn, so in-flight groups will bring >= group_size each:
        # starting more than the target needs would take prompts the batch never uses.
        expected = turns + in_flight * self.group_size
        if target is not None and expected >= target:
            return False
        # A batch's groups are counted when it is delivered; background groups as each is written.
        uncounted = expected if target is not None else in_flight * self.group_size
        if 0 < self.total_dialog_turns <= self.counters["dialog_turns"] + uncounted:
            return False
        background = target is None
        return not (background and (self._stop.is_set() or self._paused.is_set()))

    def _collect_groups(self, target: int) -> list[PromptGroupRecord]:
        groups: list[PromptGroupRecord] = []
        t0 = time.perf_counter()
        asyncio.run(_run_groups(self, target, groups.append))
        # Groups finish in any order; a batch lists them in the order their prompts were taken.
        groups.sort(key=lambda g: self._start_index.pop(g.uid))
        self.last_metrics = aggregate_rollout_metrics(groups, time.perf_counter() - t0)
        self.last_metrics["max_requests_in_flight"] = float(self.manager.max_in_flight)
        return groups

    def _to_batch(self, groups: list[PromptGroupRecord]) -> Any:
        completions = [c for g in groups for c in g.completions]
        batch = BatchedDataDict(group_sample_scalars(groups))
        batch.update(padded_columns(completions, self.manager.tokenizer.pad_token_id))
        return batch

    # ------------------------------------------------------------------ iteration
    def next(self) -> Any:
        """Collect the next batch: a ``BatchedDataDict`` of whole groups (per-sample scalars - ``keys``,
        ``prompt_ids``, ``total_reward``, ``policy_version``, ... - and padded bulk
        columns), or ``None`` after writing it to the replay buffer. Raises ``CollectorExhausted``
        once ``total_dialog_turns`` were collected (a method, so it also works on a Ray actor)."""
        self._raise_if_failed()
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("the collector is collecting in the background (start()); shutdown() it first")
        if self._done():
            raise CollectorExhausted(f"collected {self.counters['dialog_turns']} of total_dialog_turns={self.total_dialog_turns}")
        target = 1 if self.yield_completed_trajectories else int(self.dialog_turns_per_batch)
        groups = self._collect_groups(target)
        if not groups:
            raise CollectorExhausted("no group could be started (total_dialog_turns reached)")
        batch = None
        if self.replay_buffer is not None:
            self.replay_buffer.extend(groups)
        else:
            batch = self._to_batch(groups)
        for group in groups:
            self._count(group)
        self.counters["batches"] += 1
        return batch

    def __iter__(self) -> Iterator[Any]:
        while not self._done():
            yield self.next()

    # ------------------------------------------------------------------ background collection
    def start(self) -> None:
        """Collect into the replay buffer in a background thread until ``shutdown()`` (or the total)."""
        if self.replay_buffer is None:
            raise RuntimeError("start() fills a replay buffer: construct the collector with replay_buffer=")
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("the collector is already running")
        self._stop.clear()
        self._paused.clear()
        self._thread = threading.Thread(target=self._background, name="llm-collector", daemon=True)
        self._thread.start()

    def _background(self) -> None:
        try:
            while not self._stop.is_set() and not self._done():
                with self._pause_lock:  # pause() sees either this round's idle.clear() or none
                    paused = self._paused.is_set()
                    if not paused:
                        self._idle.clear()
                if paused:
                    self._stop.wait(0.05)
                    continue
                try:
                    held, self._held = self._held, []
                    for record, group in held:  # written first: they are the oldest
                        self._write_group(group, record)
                    if not self._held:
                        asyncio.run(_run_groups(self, None, self._write_group))
                finally:
                    self._idle.set()
        except BaseException as exc:  # surfaced by the next call from the owner (pause, shutdown, next, ...)
            log.exception("background collection failed")
            self._error = exc
        finally:
            self._idle.set()

    def _write_group(self, group: PromptGroupRecord, record: dict[str, Any] | None = None) -> None:
        assert self.replay_buffer is not None
        try:  # blocks while the buffer is full: backpressure on generation
            self.replay_buffer.extend([group], abort=lambda: self._stop.is_set() or self._paused.is_set())
        except WriteAborted:
            # pause() / shutdown() while the buffer is full: hold the group (written on resume; a
            # checkpoint taken now hands its prompt to the resumed collector) instead of blocking.
            with self._lock:
                self._held.append((record if record is not None else self._in_flight.pop(group.uid), group))
            return
        self._count(group)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"background collection failed: {self._error!r}") from self._error

    def pause(self) -> None:
        """Stop starting groups and wait (up to ``timeout_s``) for the in-flight ones to finish; a finished
        group the full replay buffer cannot take yet is held and written on ``resume()``."""
        with self._pause_lock:
            self._paused.set()
        self._wake_writer()
        if not self._idle.wait(self.timeout_s):
            raise TimeoutError(f"in-flight groups did not finish within {self.timeout_s:.0f}s of pause()")
        self._raise_if_failed()

    def resume(self) -> None:
        """Start groups again after ``pause()``."""
        self._raise_if_failed()
        self._paused.clear()

    def _wake_writer(self) -> None:
        """A background write parked on a full replay buffer re-checks at once (and sees pause / stop)."""
        if self.replay_buffer is not None and self.is_running():
            self.replay_buffer.wake_waiters()

    def is_running(self) -> bool:
        """Whether background collection is running (paused counts as running)."""
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self) -> None:
        """Stop background collection (in-flight groups finish first, within ``timeout_s``), close the
        replay buffer's connection and shut down a generation backend the collector built. Groups
        held back by a full buffer are not written (a ``state_dict()`` keeps their prompts)."""
        self._stop.set()
        self._wake_writer()
        if self._thread is not None:
            self._thread.join(self.timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"the collector thread did not stop within {self.timeout_s:.0f}s")
            self._thread = None
        if self._held:
            log.warning("shutdown(): %d finished groups the full replay buffer could not take were not written", len(self._held))
        if self.replay_buffer is not None:
            self.replay_buffer.close()
        if self.manager.owns_generation and hasattr(self.manager.generation, "shutdown"):
            self.manager.generation.shutdown()
        self._raise_if_failed()

    # ------------------------------------------------------------------ weights and versions
    @property
    def policy_version(self) -> int:
        """The version of the weights the collector generates with (bumped by ``update_policy_weights_``)."""
        return self._policy_version

    def get_policy_version(self) -> int:
        """``policy_version`` as a method (for Ray actor handles)."""
        return self._policy_version

    def update_policy_weights_(self, weights: Any, version: int | None = None) -> int:
        """Refit generation with new policy weights; returns the new ``policy_version``.

        ``weights``: a state dict, a Ray ``ObjectRef`` of one (resolved within ``timeout_s``), or a
        callable returning one (e.g. ``policy.state_dict``). ``version`` defaults to the current one
        plus 1. Groups already in flight finish with the weights they started with for the turns
        generated before the refit; each sample's ``policy_version`` is the oldest it used.
        """
        if callable(weights) and not isinstance(weights, Mapping):
            weights = weights()
        try:
            import ray
        except ImportError:  # pragma: no cover - ray is a dependency
            ray = None
        if ray is not None and isinstance(weights, ray.ObjectRef):
            try:
                weights = ray.get(weights, timeout=self.timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"the weights ObjectRef did not resolve within {self.timeout_s:.0f}s") from None
        if not isinstance(weights, Mapping):
            raise TypeError(f"weights must be a state dict, an ObjectRef of one or a callable; got {type(weights).__name__}")
        version = self._policy_version + 1 if version is None else int(version)
        self.manager.generation.update_weights(weights, version)
        self._policy_version = version
        return version

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Dataloader position (a partly used loader batch included), prompts taken but not delivered
        (held back by a full replay buffer), counters and policy version.

        Taken between batches, or while paused, it resumes at exactly the next prompt.
        """
        if self.is_running() and not (self._paused.is_set() and self._idle.is_set()):
            raise RuntimeError("pause() the collector before state_dict(): groups are in flight")
        with self._lock:
            if self._in_flight:
                raise RuntimeError(f"{len(self._in_flight)} groups are in flight; take state_dict() between batches")
            partial = bool(self._pending)
            return {
                "dataloader": dict(self._loader_state if partial else self.dataloader.state_dict()),
                "taken_in_batch": self._taken_in_batch if partial else 0,
                "requeued_prompts": [record for record, _ in self._held] + list(self._requeued),
                "counters": dict(self.counters),
                "started": self._started,
                "policy_version": self._policy_version,
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()``. Weights are not part of it: refit with ``update_policy_weights_``."""
        if self.is_running():
            raise RuntimeError("shutdown() the background collection before load_state_dict()")
        with self._lock:
            self.dataloader.load_state_dict(state["dataloader"])
            self._pending, self._taken_in_batch, self._held, self._in_flight = deque(), 0, [], {}
            self._start_index = {}
            skip = int(state.get("taken_in_batch", 0))
            if skip:
                self._loader_state = self.dataloader.state_dict()
                self._pending = deque(as_records(self.dataloader.next_batch())[skip:])
                self._taken_in_batch = skip
            self._requeued = deque(state.get("requeued_prompts", []))
            self.counters = {**self.counters, **{k: int(v) for k, v in state.get("counters", {}).items()}}
            self._started = int(state.get("started", self.counters["groups"]))
            self._policy_version = int(state.get("policy_version", self._policy_version))
        if self._policy_version != self.manager.generation.weight_version:
            log.warning(
                "restored policy_version %d but generation runs weight version %d: refit it",
                self._policy_version,
                self.manager.generation.weight_version,
            )
