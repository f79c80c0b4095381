"""The driver-side policies: ``Policy`` (legacy, batches through Ray) and ``TQPolicy`` (handles only).

Both start the same :class:`~policy.worker.DPPolicyWorker` actors (one per DP rank) and shard with the
same function (:func:`policy.dispatch.shard_for_dp`), so for the same weights and batch they compute
bit-identical log-probs and updates. They differ only in how data reaches the workers:

- :class:`Policy` holds the batch on the driver as a :class:`BatchedDataDict`, ships each rank its
  shard through Ray and gathers log-probs back (NeMo-RL's data flow);
- :class:`TQPolicy` passes :class:`~tq.KVBatchMeta` shards; workers fetch their shard's columns from
  the TransferQueue and write results back; only small dicts come back through Ray.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch

from common.batched_data_dict import BatchedDataDict
from common.fields import TOKEN_FIELDS
from common.placement import bundle_count, in_bundle, ranks_sharing_a_gpu, shared_gpu_error
from tq.connection import TQConnection
from tq.meta import KVBatchMeta

from .config import DynamicBatchingConfig, PolicyConfig, SequencePackingConfig
from .dispatch import global_batches, index_meta, pad_multiple, shard_for_dp, shard_rows, stamp_pad_seqlen
from .traffic import ActorCalls
from .worker import DPPolicyWorker

__all__ = ["Policy", "TQPolicy", "PolicyConfig", "DynamicBatchingConfig", "SequencePackingConfig"]

TRAIN_PARTITION = "train"
VAL_PARTITION = "val"


class _WorkerGroup:
    """Starts the DP worker actors, forms their process group, and bounds every wait on them.

    ``calls`` sends the worker calls and fetches their results: :class:`~policy.traffic.ActorCalls`
    by default, a :class:`~policy.traffic.DriverTraffic` to measure the driver's traffic (benchmarks).
    ``connection`` is handed to every worker at start-up (the TQ path; None on the legacy path).
    ``worker_cls`` is the actor class of a rank (``benchmarks.dataplane_scale`` swaps in one whose
    compute is a no-op, keeping every data-moving call as it is); ``worker_options``, Ray actor options
    added to the ranks' resources (the benchmark spreads its ranks over an emulated cluster's nodes).
    ``placement_group``: a Ray placement group with a bundle per rank (rank ``r`` runs in bundle ``r``),
    so ranks asking for a fraction of a GPU each get a GPU of their own; without it, GPU ranks that Ray
    put on one GPU are refused before they form their group (:mod:`common.placement`).
    """

    worker_cls: type = DPPolicyWorker
    worker_options: Mapping[str, Any] = {}

    def __init__(
        self,
        config: PolicyConfig | Mapping[str, Any],
        *,
        calls: ActorCalls | None = None,
        connection: TQConnection | None = None,
        placement_group: Any = None,
    ) -> None:
        import ray

        if not ray.is_initialized():
            raise RuntimeError("call ray.init() before creating a policy")
        self.config = config if isinstance(config, PolicyConfig) else PolicyConfig(**config)
        cfg = self.config
        if placement_group is not None:
            bundle_count(placement_group, cfg.dp_size, f"policy.dp_size={cfg.dp_size}")
        actor_cls = ray.remote(self.worker_cls)
        options = dict(num_cpus=cfg.num_cpus_per_worker, num_gpus=cfg.num_gpus_per_worker, **self.worker_options)
        cfg_dict = cfg.model_dump()
        self.calls = calls if calls is not None else ActorCalls()
        self.workers = [
            actor_cls.options(**options, **in_bundle(placement_group, r)).remote(cfg_dict, r, cfg.dp_size, connection)
            for r in range(cfg.dp_size)
        ]
        try:
            if cfg.backend == "nccl" and cfg.dp_size > 1:  # before NCCL meets them (its error names no rank or fix)
                shared = ranks_sharing_a_gpu(self._get([w.placement.remote() for w in self.workers], "placement"))
                if shared:
                    raise ValueError(shared_gpu_error(shared, cfg.num_gpus_per_worker))
            addr, port = self._get(self.workers[0].master_address.remote(), "master_address")
            # All ranks must enter init_process_group together: launch all, then wait.
            self.worker_info = self._get([w.init_distributed.remote(addr, port) for w in self.workers], "init_distributed")
        except BaseException:
            self._kill()
            raise

    def _get(self, refs: Any, what: str, *, count: bool = True) -> Any:
        """:meth:`ActorCalls.get` bounded by ``ray_timeout_s``, with an error naming ``what``."""
        from ray.exceptions import GetTimeoutError

        try:
            return self.calls.get(refs, self.config.ray_timeout_s, count=count)
        except GetTimeoutError:
            raise TimeoutError(
                f"DP workers did not finish {what} within policy.ray_timeout_s={self.config.ray_timeout_s}s "
                "(not enough resources for the actors, or a rank stuck in a collective)"
            ) from None

    def _call(self, worker: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        """``worker.<method>.remote(*args, **kwargs)`` through :meth:`ActorCalls.send_to_worker`."""
        return self.calls.send_to_worker(getattr(worker, method), *args, **kwargs)

    def worker_timings(self) -> list[dict[str, Any]]:
        """Each rank's seconds since the last call (and resets them; see ``DPPolicyWorker.pop_timings``):
        ``fetch_s`` (getting its shards: Ray delivering them on the legacy path, TQ gets on the TQ
        path), ``dispatch_s`` (with :class:`~policy.traffic.DriverTraffic` only), ``tq_get_s``,
        ``write_back_s``, ``compute_s``; instrumentation, not counted."""
        return self._get([w.pop_timings.remote() for w in self.workers], "pop_timings", count=False)

    def pop_driver_counters(self) -> dict[str, float]:
        """The driver's traffic for this policy since the last call (see :meth:`ActorCalls.pop`)."""
        return self.calls.pop()

    def _kill(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []

    def shutdown(self) -> None:
        """Leave the process group on every rank and kill the actors (idempotent)."""
        if not self.workers:
            return
        from ray.exceptions import RayActorError

        try:
            self._get([w.shutdown.remote() for w in self.workers], "shutdown")
        except RayActorError:
            pass  # a rank already died (that is often why we are shutting down): kill the rest
        finally:
            self._kill()

    def get_weights(self) -> dict[str, torch.Tensor]:
        """Rank 0's state dict (CPU tensors), e.g. for refitting generation workers."""
        return self._get(self.workers[0].get_weights.remote(), "get_weights")

    def save_checkpoint(self, path: str) -> None:
        """Save model, optimizer and scheduler state under directory ``path`` (written by rank 0)."""
        self._get([w.save_checkpoint.remote(path) for w in self.workers], "save_checkpoint")

    def load_checkpoint(self, path: str) -> int:
        """Load a :meth:`save_checkpoint` directory on every rank; returns the optimizer step it holds."""
        return self._get([w.load_checkpoint.remote(path) for w in self.workers], "load_checkpoint")[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


class Policy(_WorkerGroup):
    """Legacy policy: the driver holds the batch and ships shards through Ray (NeMo-RL's ``Policy``)."""

    def _shards(self, data: BatchedDataDict, purpose: str) -> list[tuple[list[int], dict[str, Any]]]:
        lengths = data["input_lengths"].tolist()
        return [(shard_rows(s), dict(s.extra_info)) for s in shard_for_dp(index_meta(lengths), self.config, purpose)]

    def _logprobs(self, data: BatchedDataDict, reference: bool) -> torch.Tensor:
        data = BatchedDataDict(input_ids=data["input_ids"], input_lengths=data["input_lengths"])
        shards = self._shards(data, "logprob")
        results = self._get(
            [self._call(w, "get_logprobs", data.select_indices(rows), info, reference) for w, (rows, info) in zip(self.workers, shards)],
            "get_logprobs",
        )
        out = torch.zeros(data["input_ids"].shape, dtype=torch.float32)
        for (rows, _), res in zip(shards, results):  # back to the batch's order
            lp = res["logprobs"]
            out[torch.as_tensor(rows), : lp.shape[1]] = lp
        return out

    def get_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        """``{"logprobs": [n, L]}`` of the current policy (``input_ids`` + ``input_lengths`` are read)."""
        return BatchedDataDict(logprobs=self._logprobs(data, reference=False))

    def get_reference_policy_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        """``{"reference_logprobs": [n, L]}`` of the frozen reference model."""
        return BatchedDataDict(reference_logprobs=self._logprobs(data, reference=True))

    def train(self, data: BatchedDataDict, loss_fn: Any) -> dict[str, Any]:
        """One optimizer step per ``train_global_batch_size`` samples of ``data``; returns metrics.

        ``data`` holds the columns ``loss_fn.input_fields`` names (``DP_TRAIN_FIELDS`` for
        :class:`~policy.loss.ClippedPGLossFn`), padded ``[n, L]`` for token-aligned ones.
        """
        fields = list(dict.fromkeys(("input_ids", "input_lengths", *getattr(loss_fn, "input_fields", ()))))
        data = data.select_columns(fields)
        meta = index_meta(data["input_lengths"].tolist())
        per_rank: list[list[tuple[BatchedDataDict, dict[str, Any]]]] = [[] for _ in self.workers]
        for gb in global_batches(meta, self.config.train_global_batch_size):
            for r, shard in enumerate(shard_for_dp(gb, self.config, "train")):
                per_rank[r].append((data.select_indices(shard_rows(shard)), dict(shard.extra_info)))
        results = self._get([self._call(w, "train", p, loss_fn) for w, p in zip(self.workers, per_rank)], "train")
        return results[0]


class TQPolicy(_WorkerGroup):
    """TQ policy: the driver passes ``KVBatchMeta`` shards; workers move the data themselves.

    Args:
        config: the policy config.
        connection: the data plane; every worker gets it at start-up and this driver connects with it.
        calls: how worker calls are sent (see :class:`_WorkerGroup`).
        placement_group: a Ray placement group with a bundle per rank (see :class:`_WorkerGroup`).
    """

    def __init__(
        self,
        config: PolicyConfig | Mapping[str, Any],
        connection: TQConnection,
        *,
        calls: ActorCalls | None = None,
        placement_group: Any = None,
    ) -> None:
        if not isinstance(connection, TQConnection):
            raise TypeError(f"TQPolicy needs a tq.TQConnection (address, secret, timeout), got {type(connection).__name__}")
        super().__init__(config, calls=calls, connection=connection, placement_group=placement_group)
        self.connection = connection
        try:
            self.client = connection.connect()
        except BaseException:
            super().shutdown()
            raise
        self.train_partition = TRAIN_PARTITION
        self.step_size: tuple[int, int] | None = None

    def shutdown(self) -> None:
        """Shut the workers down and close the driver's TQ client."""
        try:
            super().shutdown()
        finally:
            if getattr(self, "client", None) is not None:
                self.client.close()
                self.client = None

    # ------------------------------------------------------------------ partitions and keys
    def prepare_step(self, num_samples: int, group_size: int) -> str:
        """Register the ``"train"`` partition, or clear and reuse it; returns its id.

        ``num_samples`` (prompts * ``group_size``) is checked against the DP size and kept for the step.
        """
        if group_size < 1 or num_samples < 1 or num_samples % group_size:
            raise ValueError(f"num_samples={num_samples} must be a positive multiple of group_size={group_size}")
        if num_samples < self.config.dp_size:
            raise ValueError(f"num_samples={num_samples} is fewer than policy.dp_size={self.config.dp_size}")
        with self.calls.driver_tq():
            self.client.register_partition(self.train_partition, reuse=True)
        self.step_size = (num_samples, group_size)
        return self.train_partition

    def prepare_val_partition(self) -> str:
        """Register (or clear and reuse) the ``"val"`` partition; returns its id."""
        self.client.register_partition(VAL_PARTITION, reuse=True)
        return VAL_PARTITION

    def discard_samples(self, meta_or_keys: KVBatchMeta | Sequence[str]) -> int:
        """Free samples dropped by the driver (e.g. dynamic sampling); keys default to the train partition."""
        meta = meta_or_keys if isinstance(meta_or_keys, KVBatchMeta) else KVBatchMeta(self.train_partition, tuple(meta_or_keys))
        if not len(meta):
            return 0
        with self.calls.driver_tq(sent=meta):
            return self.client.discard(meta)

    def finish_step(self, meta: KVBatchMeta | None = None, *, clear_partition: bool = True) -> int:
        """Free the step's keys (``meta``'s, then - by default - anything left in its partition)."""
        partition = meta.partition_id if meta is not None else self.train_partition
        if not clear_partition:
            return self.discard_samples(meta) if meta is not None else 0
        with self.calls.driver_tq():  # clearing frees the meta's keys too: one call, no discard first
            return self.client.clear_partition(partition)

    def store_bytes(self) -> int:
        """Bytes the TQ service holds right now (all partitions; instrumentation, not counted)."""
        return int(sum(p["bytes"] for p in self.client.list_partitions()))

    # ------------------------------------------------------------------ driver reads and writes
    def read_from_dataplane(self, meta: KVBatchMeta, fields: Sequence[str], *, allow_token_fields: bool = False) -> dict[str, Any]:
        """Read per-sample columns (rewards, masks, reductions) for the meta's keys, in key order.

        Token-aligned columns (``TOKEN_FIELDS``) are refused unless ``allow_token_fields``: the driver's
        traffic must grow with the number of samples, never with sequence length.
        """
        bulky = [f for f in fields if f in TOKEN_FIELDS]
        if bulky and not allow_token_fields:
            raise ValueError(
                f"read_from_dataplane refuses token-aligned fields {bulky} on the driver "
                "(workers reduce them; pass allow_token_fields=True to override)"
            )
        with self.calls.driver_tq(sent=meta):
            out = self.client.get(meta, list(fields), wait_timeout=self.connection.timeout_s)
        self.calls.received(out)
        return out

    def write_to_dataplane(self, meta: KVBatchMeta, columns: Mapping[str, Any], *, overwrite: bool = False) -> KVBatchMeta:
        """Write columns (e.g. ``advantages``, ``sample_mask``) for the meta's keys; returns the meta with
        them. ``overwrite`` replaces columns the keys already have (the rollout wrote ``sample_mask``)."""
        with self.calls.driver_tq(sent=(meta, dict(columns))):
            return self.client.write_back(meta, columns, overwrite=overwrite)

    # ------------------------------------------------------------------ worker passes
    def _with_lengths(self, meta: KVBatchMeta) -> KVBatchMeta:
        """The meta with sequence lengths (read as a per-sample column if missing) and the pad length stamped."""
        if meta.sequence_lengths is None:
            lengths = self.read_from_dataplane(meta, ["input_lengths"])["input_lengths"]
            meta = dataclasses.replace(meta, sequence_lengths=tuple(lengths.tolist()))
        return stamp_pad_seqlen(meta, pad_multiple(self.config))

    def _worker_shards(self, meta: KVBatchMeta, purpose: str) -> list[KVBatchMeta]:
        """``shard_for_dp`` shards without their tags: workers read keys, lengths and the micro-batch
        plan only, so the per-sample tags (uids, groups, versions) need not travel with every call."""
        return [dataclasses.replace(s, tags={}) for s in shard_for_dp(meta, self.config, purpose)]

    def _logprob_pass(self, meta: KVBatchMeta, reference: bool, reductions: bool = False) -> KVBatchMeta:
        meta = self._with_lengths(meta)
        shards = self._worker_shards(meta, "logprob")
        results = self._get(
            [self._call(w, "get_logprobs_from_meta", s, reference, reductions=reductions) for w, s in zip(self.workers, shards)],
            "get_logprobs_from_meta",
        )
        return meta.add_fields(results[0]["fields"])

    def get_logprobs_from_meta(self, meta: KVBatchMeta, *, with_reductions: bool = False) -> KVBatchMeta:
        """Workers compute ``prev_logprobs`` for their shard and write them back; returns the updated meta.

        ``with_reductions`` also writes ``PER_SAMPLE_REDUCTION_FIELDS`` in the same pass (one worker
        round trip instead of a separate :meth:`compute_per_token_reductions`; same values)."""
        return self._logprob_pass(meta, reference=False, reductions=with_reductions)

    def get_reference_policy_logprobs_from_meta(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Workers compute ``reference_policy_logprobs`` with the reference model and write them back."""
        return self._logprob_pass(meta, reference=True)

    def compute_per_token_reductions(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Workers write ``PER_SAMPLE_REDUCTION_FIELDS`` (per-sequence log-prob error, token counts)."""
        meta = self._with_lengths(meta)
        results = self._get(
            [self._call(w, "compute_per_token_reductions", s) for w, s in zip(self.workers, self._worker_shards(meta, "logprob"))],
            "compute_per_token_reductions",
        )
        return meta.add_fields(results[0]["fields"])

    def train_from_meta(self, meta: KVBatchMeta, loss_fn: Any) -> dict[str, Any]:
        """One optimizer step per ``train_global_batch_size`` samples; workers fetch and train; returns metrics."""
        meta = self._with_lengths(meta)
        per_rank: list[list[KVBatchMeta]] = [[] for _ in self.workers]
        for gb in global_batches(meta, self.config.train_global_batch_size):
            for r, shard in enumerate(self._worker_shards(gb, "train")):
                per_rank[r].append(shard)
        results = self._get([self._call(w, "train_from_meta", p, loss_fn) for w, p in zip(self.workers, per_rank)], "train_from_meta")
        return results[0]
