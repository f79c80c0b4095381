"""The synchronous rollout actor: prompts in, samples written to TQ, per-sample scalars out.

``SyncRolloutImpl`` is the plain class (usable in-process); ``SyncRolloutActor`` is it as a Ray actor
reserving a fraction of a CPU (``SyncRolloutActor.options(num_cpus=...)`` to change). One step of the
sync TQ trainer (``../shared/DESIGN.md``, per-step lifecycle, step 2)::

    meta, carry, rollout_metrics, generation_metrics = ray.get(
        actor.rollout_to_tq.remote(batch, "train", group_size))

repeats each prompt ``group_size`` times, rolls every conversation out (``rollout.multi_turn``),
writes the bulk columns under keys ``"{uid}_g{i}"`` in one batched put, and returns the meta plus
``driver_carry``: per-sample scalars only, never a per-token tensor, so the driver's traffic grows
with the number of samples and not with sequence length. ``rollout(batch, group_size)`` runs the
same algorithm for the legacy trainer and returns the same columns as a driver-side batch.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Sequence

import torch

from common.batched_data_dict import BatchedDataDict
from common.fields import tensor_nbytes
from tq.connection import TQConnection

from .builders import (
    TRAIN_PARTITION,
    VAL_PARTITION,
    as_records,
    prompt_uids,
    resolve_environments,
    resolve_generation,
    resolve_tokenizer,
)
from .interfaces import EnvironmentInterface
from .multi_turn import (
    Completion,
    RolloutLimits,
    completion_scalars,
    completions_to_columns,
    padded_columns,
    run_multi_turn_rollout,
    validate_records,
)

log = logging.getLogger(__name__)

DEFAULT_NUM_CPUS = 0.25
_CARRY_TYPES = (type(None), bool, int, float, str)


def _carry_value(record: Mapping[str, Any], key: str, pos: int) -> Any:
    """A per-sample scalar named ``key`` from a prompt record (top level, then ``extra_env_info``)."""
    if key in record and key != "message_log":
        value = record[key]
    elif key in (record.get("extra_env_info") or {}):
        value = record["extra_env_info"][key]
    else:
        raise KeyError(f"carry key {key!r} is neither a field nor an extra_env_info entry of prompt {pos}")
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if type(value) not in _CARRY_TYPES:
        raise TypeError(
            f"carry key {key!r} of prompt {pos} is a {type(value).__name__}; driver_carry holds "
            "per-sample scalars only (None, bool, int, float, str)"
        )
    return value


class SyncRolloutImpl:
    """Batched multi-turn rollouts that write their samples to TQ (or return them, for the legacy path).

    Args:
        generation: a backend config (dict / ``GenerationBackendConfig``: built here), an existing
            backend, or generation actor handle(s) (``RayGenerationWorker``). Default: the tiny model.
        tokenizer_name: the tokenizer (default: the generation config's); required when
            ``generation`` is neither a config nor a backend that has a ``tokenizer``.
        environments: task name -> environment, environment name, or ``{"name", **kwargs}``.
        connection: the data plane, a ``tq.TQConnection`` (needed by ``rollout_to_tq`` only).
        limits: a ``RolloutLimits`` or its fields as a dict.
        seed: overrides the sampling seed of a generation backend built from a config.
        placement_group: the bundles the Ray generation workers of a config run in (colocated with
            the policy's ranks; see ``make_generation_backend``).
    """

    def __init__(
        self,
        *,
        generation: Any = None,
        tokenizer_name: str | None = None,
        environments: Mapping[str, EnvironmentInterface | str | Mapping[str, Any]],
        connection: TQConnection | None = None,
        limits: RolloutLimits | Mapping[str, Any],
        seed: int | None = None,
        placement_group: Any = None,
    ) -> None:
        self.tokenizer = resolve_tokenizer(tokenizer_name, generation)
        self.generation, self._owns_generation = resolve_generation(
            generation, tokenizer=self.tokenizer, seed=seed, placement_group=placement_group
        )
        self.task_to_env = resolve_environments(environments)
        self.limits = limits if isinstance(limits, RolloutLimits) else RolloutLimits(**limits)
        self.connection = connection
        self._client: Any = None
        self._known_partitions: set[str] = set()
        self._warm = False
        self.counters = {"batches": 0, "samples": 0, "prepare_calls": 0, "finish_calls": 0}

    # ------------------------------------------------------------------ lifecycle
    def ready(self) -> int:
        """The weight version generation runs at (a start-up barrier for the actor)."""
        return self.generation.weight_version

    def _client_or_raise(self) -> Any:
        if self._client is None:
            if self.connection is None:
                raise RuntimeError("rollout_to_tq needs a TQ service: construct the rollout actor with connection=")
            self._client = self.connection.connect()
        return self._client

    def prepare_for_generation(self) -> None:
        """Bring the generation engine up (once; it stays up until ``finish_generation``)."""
        if not self._warm:
            self.generation.prepare_for_generation()
            self.counters["prepare_calls"] += 1
            self._warm = True

    def finish_generation(self) -> None:
        """Release what generation holds (e.g. vLLM's KV cache) so training can use the memory."""
        if self._warm:
            self.generation.finish_generation()
            self.counters["finish_calls"] += 1
            self._warm = False

    def is_warm(self) -> bool:
        """Whether the generation engine is up (validation keeps it up across batches)."""
        return self._warm

    def update_weights(self, state_dict: Mapping[str, Any] | Sequence[Any], weight_version: int) -> int:
        """Refit the generation backend (a state dict, a weight bucket, or one bucket per Ray generation
        worker - see ``RayGenerationPool.update_weights``); returns the new weight version."""
        self.generation.update_weights(state_dict, weight_version)
        return self.generation.weight_version

    def generation_state(self) -> dict[str, Any] | None:
        """The backend's sampling position for checkpoints (None if it has none)."""
        fn = getattr(self.generation, "sampling_state", None)
        return fn() if fn is not None else None

    def load_generation_state(self, state: Mapping[str, Any] | None) -> None:
        """Restore :meth:`generation_state`, so a resumed run samples as the uninterrupted one would."""
        fn = getattr(self.generation, "load_sampling_state", None)
        if state is not None and fn is not None:
            fn(state)

    def weight_version(self) -> int:
        """Version of the weights generation runs with."""
        return self.generation.weight_version

    def get_counters(self) -> dict[str, int]:
        """Batches and samples rolled out, and how often the engine was brought up / released."""
        return dict(self.counters)

    def shutdown(self) -> None:
        """Close the TQ client and shut down a generation backend this actor built."""
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._owns_generation and hasattr(self.generation, "shutdown"):
            self.generation.shutdown()

    # ------------------------------------------------------------------ rollouts
    def _run(
        self, batch: Any, group_size: int, greedy: bool | None, uids: Sequence[Any] | None, validation: bool, keep_warm: bool
    ) -> tuple[list[dict[str, Any]], list[str], list[int], list[Completion], dict[str, float], dict[str, float]]:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        records = as_records(batch)
        if not records:
            raise ValueError("the prompt batch is empty")
        validate_records(records, self.task_to_env)  # before repeating: errors name the batch position
        uids, prompt_ids = prompt_uids(records, uids)
        repeated = [r for r in records for _ in range(group_size)]
        self.prepare_for_generation()
        try:
            finished, rollout_metrics, generation_metrics = run_multi_turn_rollout(
                self.generation,
                self.tokenizer,
                repeated,
                self.task_to_env,
                self.limits,
                prompt_ids=[p for p in prompt_ids for _ in range(group_size)],
                greedy=greedy,
            )
        finally:
            if not (validation or keep_warm):
                self.finish_generation()
        self.counters["batches"] += 1
        self.counters["samples"] += len(finished)
        completions = [Completion.from_record(r) for r in finished]
        return records, uids, prompt_ids, completions, rollout_metrics, generation_metrics

    def _carry(
        self,
        records: list[dict[str, Any]],
        uids: list[str],
        prompt_ids: list[int],
        completions: list[Completion],
        group_size: int,
        carry_keys: Sequence[str],
    ) -> dict[str, Any]:
        def per_sample(values: Sequence[Any]) -> list[Any]:
            return [v for v in values for _ in range(group_size)]

        carry: dict[str, Any] = {
            "keys": [f"{u}_g{i}" for u in uids for i in range(group_size)],
            "uids": per_sample(uids),
            "prompt_ids": torch.tensor(per_sample(prompt_ids), dtype=torch.int64),
            "task_name": per_sample([r["task_name"] for r in records]),
            **completion_scalars(completions),
        }
        for key in carry_keys:
            if key in carry:
                raise ValueError(f"carry key {key!r} would overwrite a driver_carry column of that name")
            carry[key] = per_sample([_carry_value(r, key, pos) for pos, r in enumerate(records)])
        return carry

    def rollout_to_tq(
        self,
        batch: Any,
        partition_id: str | None = None,
        group_size: int = 1,
        *,
        validation: bool = False,
        carry_keys: Sequence[str] = (),
        uids: Sequence[Any] | None = None,
        greedy: bool | None = None,
        keep_warm: bool = False,
        extra_tags: Mapping[str, Any] | None = None,
        carry_columns: Sequence[str] = (),
    ) -> tuple[Any, dict[str, Any], dict[str, float], dict[str, float]]:
        """Roll a prompt batch out ``group_size`` times per prompt and write the samples to TQ.

        Args:
            batch: prompts - a list of ``DatumSpec`` or ``collate_datums`` columns.
            partition_id: where to write (default ``"train"``, or ``"val"`` with ``validation``);
                created if missing, never cleared here.
            group_size: completions per prompt.
            validation: write to ``"val"`` and keep the engine warm for the next validation batch
                (``finish_generation`` releases it); otherwise it is released after the batch unless
                ``keep_warm``.
            carry_keys: extra per-sample scalars to return in ``driver_carry``, read from each prompt
                record or its ``extra_env_info`` (e.g. ``"ground_truth"``).
            uids: per-prompt ids keys are minted from (default: the dataset ``idx``).
            greedy: override ``limits.greedy``.
            keep_warm: keep the engine up after the batch (a caller generating batch after batch).
            extra_tags: more per-sample tags to write with the keys (e.g. the async collector's
                ``target_step``): each value is one scalar for every sample or a sequence of one per
                sample (in key order). They may not replace ``uid``, ``group_id`` or ``weight_version``.
            carry_columns: ``driver_carry`` entries to write to TQ as per-sample columns too (e.g.
                ``"response_lengths"``, ``"loss_multiplier"``), for consumers that read from TQ
                instead of receiving the carry.

        Returns:
            ``(meta, driver_carry, rollout_metrics, generation_metrics)``. ``meta`` (a ``KVBatchMeta``)
            names keys ``"{uid}_g{i}"`` (grouped by prompt, in batch order), the fields written -
            ``input_ids``, ``input_lengths``, ``generation_logprobs``, ``token_mask``, ``sample_mask``,
            ``total_reward``, ``truncated``, ``message_log`` (object column of ``{"role", "content"}``
            lists) - their ``sequence_lengths`` and tags ``uid``, ``group_id``, ``weight_version``.
            ``driver_carry`` holds per-sample scalars in key order: ``keys``, ``uids``, ``prompt_ids``
            (int64, groups a prompt's samples), ``task_name``, ``total_reward``, ``loss_multiplier``,
            ``truncated``, ``terminated``, ``env_error``, ``input_lengths``, ``response_lengths``,
            ``num_turns``, ``weight_version``, ``env_answer``, plus ``carry_keys``; ``meta`` also
            names the ``carry_columns`` and carries the ``extra_tags``.
        """
        partition_id = partition_id or (VAL_PARTITION if validation else TRAIN_PARTITION)
        _check_extras(extra_tags, carry_columns, carry_keys)  # before generating: a bad argument costs no rollout
        client = self._client_or_raise()
        records, uids, prompt_ids, completions, rollout_metrics, generation_metrics = self._run(
            batch, group_size, greedy, uids, validation, keep_warm
        )
        carry = self._carry(records, uids, prompt_ids, completions, group_size, carry_keys)
        from tq.errors import PartitionNotFoundError

        columns = completions_to_columns(completions)
        tags = {"uid": carry["uids"], "group_id": carry["prompt_ids"].tolist(), "weight_version": carry["weight_version"].tolist()}
        n = len(carry["keys"])
        columns.update({name: carry[name] for name in carry_columns})
        for name, value in (extra_tags or {}).items():
            if isinstance(value, (list, tuple)):
                if len(value) != n:
                    raise ValueError(f"extra_tags[{name!r}] has {len(value)} values for {n} samples")
                tags[name] = list(value)
            else:
                tags[name] = [value] * n
        self._ensure_partition(client, partition_id)
        t_put = time.perf_counter()
        try:
            meta = client.put(partition_id, carry["keys"], columns, tags=tags)
        except PartitionNotFoundError:  # dropped since this actor last wrote to it: make it again
            self._known_partitions.discard(partition_id)
            self._ensure_partition(client, partition_id)
            meta = client.put(partition_id, carry["keys"], columns, tags=tags)
        rollout_metrics["tq_put_seconds"] = time.perf_counter() - t_put
        rollout_metrics["tq_put_bytes"] = float(tensor_nbytes(columns))  # the message_log object column not counted
        return meta, carry, rollout_metrics, generation_metrics

    def _ensure_partition(self, client: Any, partition_id: str) -> None:
        if partition_id in self._known_partitions:
            return
        from tq.errors import PartitionExistsError

        try:
            client.register_partition(partition_id)
        except PartitionExistsError:  # the trainer registered it (and owns its clearing)
            pass
        self._known_partitions.add(partition_id)

    def rollout(
        self,
        batch: Any,
        group_size: int = 1,
        *,
        validation: bool = False,
        carry_keys: Sequence[str] = (),
        uids: Sequence[Any] | None = None,
        greedy: bool | None = None,
        keep_warm: bool = False,
    ) -> tuple[Any, dict[str, float], dict[str, float]]:
        """The legacy path: the same rollout as ``rollout_to_tq``, returned as a driver-side batch.

        Returns ``(batch, rollout_metrics, generation_metrics)``; ``batch`` is a ``BatchedDataDict``
        (a plain dict on checkouts without it) holding every ``driver_carry`` column plus the bulk
        columns padded on the right to the longest sample: ``input_ids`` ``[n, L]`` (pad token),
        ``token_mask`` (False), ``generation_logprobs`` (0), and ``input_lengths``, ``sample_mask``,
        ``message_log``.
        """
        records, uids, prompt_ids, completions, rollout_metrics, generation_metrics = self._run(
            batch, group_size, greedy, uids, validation, keep_warm
        )
        carry = self._carry(records, uids, prompt_ids, completions, group_size, carry_keys)
        out = BatchedDataDict(carry)
        out.update(padded_columns(completions, self.tokenizer.pad_token_id))
        return out, rollout_metrics, generation_metrics


_RESERVED_TAGS = ("uid", "group_id", "weight_version")


def _check_extras(extra_tags: Mapping[str, Any] | None, carry_columns: Sequence[str], carry_keys: Sequence[str]) -> None:
    """Reject extra tags / carry columns that would replace what ``rollout_to_tq`` writes itself, carry
    columns that name no ``driver_carry`` entry, and extra tags a meta would refuse (their names and
    values checked as the put checks them - only their count waits for the samples)."""
    from tq.meta import KVBatchMeta

    clash = [k for k in (extra_tags or {}) if k in _RESERVED_TAGS]
    if clash:
        raise ValueError(f"extra_tags {clash} would replace tags rollout_to_tq writes ({', '.join(_RESERVED_TAGS)})")
    for name, value in (extra_tags or {}).items():
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        KVBatchMeta("extra_tags", tuple(f"s{i}" for i in range(len(values))), tags={name: values})
    bulk = set(completions_to_columns([]))
    clash = [k for k in carry_columns if k in bulk]
    if clash:
        raise ValueError(f"carry_columns {clash} would replace bulk columns of that name ({sorted(bulk)})")
    known = {"keys", "uids", "prompt_ids", "task_name", *completion_scalars([]), *carry_keys}
    unknown = [k for k in carry_columns if k not in known]
    if unknown:
        raise ValueError(f"carry_columns {unknown} are not driver_carry entries (known: {sorted(known)})")


def _make_actor_class() -> Any:
    import ray

    return ray.remote(num_cpus=DEFAULT_NUM_CPUS)(SyncRolloutImpl)


SyncRolloutActor = _make_actor_class()
"""``SyncRolloutImpl`` as a Ray actor class (``SyncRolloutActor.remote(...)``; ``DEFAULT_NUM_CPUS`` CPUs)."""
