"""DPPolicyWorker: one data-parallel training rank (a Ray actor), shared by Policy and TQPolicy.

Each rank holds a full model replica, AdamW, the LR schedule and a frozen reference model, and joins
a torch.distributed group (gloo on CPU, NCCL on GPU). Gradients are accumulated over the rank's
micro-batches and all-reduced with SUM once per optimizer step; losses are globally normalized (see
:mod:`policy.loss`), so the update equals the full-batch one for any DP size and micro-batching.

Two entry points per operation, with one implementation behind them:

- legacy: the driver ships a :class:`BatchedDataDict` shard (plus the shard's ``extra_info`` with its
  micro-batch plan) and gets tensors back;
- TQ: the driver ships a :class:`~tq.KVBatchMeta` shard; the worker fetches only the fields it needs
  from the data plane, writes its results back under the same keys and returns a small dict.

Every data-carrying entry point accumulates per-rank seconds - TQ gets and write-backs, compute, and
(when the driver stamps its calls with ``sent_at``, its ``time.time()`` at sending; see
:class:`~policy.traffic.DriverTraffic`) the call's arguments arriving (``dispatch_s``) - which
:meth:`DPPolicyWorker.pop_timings` returns (benchmarks, per-step metrics).

The only collectives are per optimizer step (valid-count and gradient all-reduces, metrics), never per
micro-batch, so the empty micro-batches that equalize plans across ranks are skipped safely.
"""

from __future__ import annotations

import copy
import math
import os
import socket
import time
from collections import defaultdict
from datetime import timedelta
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from common.batched_data_dict import BatchedDataDict
from common.fields import LP_SEED_FIELDS, REDUCTION_INPUT_FIELDS, tensor_nbytes
from common.models import DTYPES, load_model, load_tokenizer
from tq.connection import TQConnection
from tq.meta import KVBatchMeta

from .config import PolicyConfig
from .logprobs import per_sample_reductions
from .loss import metric_reduction, reduce_metrics
from .micro_batching import MicroBatchPlan, forward_backward, local_valid_counts, logprobs_for_plan, plan_from_extra_info
from .optim import build_optimizer, build_scheduler

__all__ = ["DPPolicyWorker", "LOGPROB_INPUT_FIELDS", "copy_and_pad", "fetch_padded"]

# The subset of LP_SEED_FIELDS a log-prob pass reads (the masks do not change log-probs).
LOGPROB_INPUT_FIELDS = tuple(f for f in LP_SEED_FIELDS if f in ("input_ids", "input_lengths"))
_GRAD_BUCKET_ELEMS = 32 << 20  # flatten gradients into all-reduce buckets of at most this many elements


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def fetch_padded(
    client: Any, meta: KVBatchMeta, fields: Sequence[str], pad_value: Mapping[str, Any], device: torch.device
) -> dict[str, Any]:
    """A shard's ``fields`` on ``device``, jagged ones padded as ``client.get(meta, fields,
    layout="padded", pad_value=pad_value)`` pads them (``meta.pad_length``; other fields 0).

    On the CPU that is the padded get itself (one copy, by TQ's row copier). On a GPU rank the rows
    go to the device unpadded and the padding is written there (:func:`copy_and_pad`): the padded
    get would send rows and padding alike over PCIe."""
    if device.type == "cpu":
        return client.get(meta, list(fields), layout="padded", pad_value=dict(pad_value), wait_timeout=client.timeout)
    return copy_and_pad(client, meta, fields, pad_value, device)


def copy_and_pad(
    client: Any, meta: KVBatchMeta, fields: Sequence[str], pad_value: Mapping[str, Any], device: torch.device
) -> dict[str, Any]:
    """:func:`fetch_padded` off the CPU: the rows copied unpadded by TQ's row copier (several
    threads) into page-locked memory (``pin_memory``, on CUDA), sent to ``device`` at the bus's
    speed, padded there. Borrowing the rows from the arena instead skips the host copy but sends
    from pageable memory, which CUDA stages at a fraction of the bus's speed: on one H200, 6.5 GB/s
    from pageable memory against 54.6 pinned, and this fetch 1.64x / 2.50x the borrowing one at
    34 / 269 MB (``benchmarks/gpu_fetch.py``, docs/gpu.md)."""
    from tq import JaggedTensor

    got = client.get(meta, list(fields), layout="jagged", pin_memory=device.type == "cuda", wait_timeout=client.timeout)
    out: dict[str, Any] = {}
    for name, v in got.items():
        if isinstance(v, JaggedTensor):
            longest = int(v.lengths.max()) if len(v) else 0
            out[name] = v.to_padded(meta.pad_length(longest), pad_value.get(name, 0), device=device)
        else:  # torch keeps a pinned source's block until a non-blocking copy out of it ran
            out[name] = v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
    return out


class DPPolicyWorker:
    """One DP rank. Create through Ray (``ray.remote(DPPolicyWorker)``), one actor per rank.

    Args:
        config: :class:`PolicyConfig` (or its dict).
        rank / world_size: this rank and the DP size.
        connection: the data plane (the TQ path's entry points need it; the legacy path passes None).
    """

    def __init__(
        self, config: PolicyConfig | Mapping[str, Any], rank: int, world_size: int, connection: TQConnection | None = None
    ) -> None:
        self.cfg = config if isinstance(config, PolicyConfig) else PolicyConfig(**config)
        self.rank, self.world_size = rank, world_size
        self.connection = connection
        torch.set_num_threads(self.cfg.torch_num_threads or max(1, int(self.cfg.num_cpus_per_worker)))
        if self.cfg.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: set it first
            torch.use_deterministic_algorithms(True)
        self.device = torch.device("cuda", 0) if self.cfg.device == "cuda" else torch.device("cpu")
        self.tokenizer = load_tokenizer(self.cfg.tokenizer_name or self.cfg.model_name)
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        # Mixed precision: float32 master weights (AdamW updates of ~lr * 1e-3 vanish in bf16 weights),
        # forward passes autocast to ``dtype``.
        self.model = load_model(
            self.cfg.model_name,
            dtype="float32",
            device=self.device,
            seed=self.cfg.seed,
            tokenizer=self.tokenizer,
            tiny_overrides=self.cfg.tiny_overrides,
        )
        self.compute_dtype = DTYPES[self.cfg.dtype]
        self.reference: torch.nn.Module | None = None  # built once the weights are synced across ranks
        self.optimizer = build_optimizer(self.model, self.cfg)
        self.scheduler = build_scheduler(self.optimizer, self.cfg)
        self.step = 0  # optimizer steps taken
        self._tq: Any = None  # this rank's TQ client, opened on first use
        self._dist = False
        self._timings: dict[str, float] = defaultdict(float)

    # ------------------------------------------------------------------ setup
    def master_address(self) -> tuple[str, int]:
        """This node's IP and a free port, for rank 0 to host the process group's rendezvous."""
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    def placement(self) -> tuple[str, list[str]]:
        """(this rank's Ray node id, the GPU ids Ray assigned it): the group checks that no two ranks
        share a GPU before NCCL meets them (:mod:`common.placement`)."""
        import ray

        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]

    def init_distributed(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the process group (bounded by ``dist_timeout_s``), sync weights from rank 0, build the reference."""
        if self.world_size > 1:
            dist.init_process_group(
                backend=self.cfg.backend,
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=self.cfg.dist_timeout_s),
            )
            self._dist = True
            # Same seed gives the same init, but a broadcast makes it a guarantee (and covers hub loads).
            with torch.no_grad():
                for t in list(self.model.parameters()) + list(self.model.buffers()):
                    dist.broadcast(t.data, src=0)
        ref = copy.deepcopy(self.model)
        if self.cfg.reference_model_on_cpu:
            ref = ref.to("cpu")
        ref.eval().requires_grad_(False)
        self.reference = ref
        return {"rank": self.rank, "world_size": self.world_size, "device": str(self.device), "pid": os.getpid()}

    def shutdown(self) -> bool:
        """Close the TQ client and leave the process group."""
        if self._tq is not None:
            self._tq.close()
            self._tq = None
        if self._dist and dist.is_initialized():
            dist.destroy_process_group()
            self._dist = False
        return True

    # ------------------------------------------------------------------ data-movement timings
    def _arrived(self, sent_at: float | None, shard_in_args: bool) -> None:
        """Account the time from the driver sending this call to it starting here (``dispatch_s``): Ray
        moving and unpickling its arguments - the whole shard on the legacy path (``shard_in_args``:
        it is also this rank's fetch), a KVBatchMeta on the TQ path (the fetch is the TQ get after it)."""
        self._timings["calls"] += 1
        if sent_at is not None:
            waited = max(0.0, time.time() - sent_at)
            self._timings["dispatch_s"] += waited
            if shard_in_args:
                self._timings["fetch_s"] += waited

    def pop_timings(self) -> dict[str, Any]:
        """This rank's seconds since the last call, then reset: ``fetch_s`` (getting its shards: Ray
        delivering the call's arguments on the legacy path, TQ gets on the TQ path), ``dispatch_s``
        (every call's arrival), ``tq_get_s``, ``write_back_s`` (TQ), ``compute_s`` (forward, backward
        and optimizer passes and reductions, collectives included), ``calls``, and the tensor bytes
        of the TQ gets (as delivered: padded) and write-backs, ``tq_get_bytes`` / ``write_back_bytes``."""
        t, self._timings = self._timings, defaultdict(float)
        out = {
            k: float(t.get(k, 0.0))
            for k in ("fetch_s", "dispatch_s", "tq_get_s", "write_back_s", "compute_s", "calls", "tq_get_bytes", "write_back_bytes")
        }
        out["rank"] = self.rank
        return out

    def _client(self) -> Any:
        """This rank's TQ client, connected on first use with the connection given at start-up."""
        if self._tq is None:
            if self.connection is None:
                raise RuntimeError(
                    "this DP worker was started without a data-plane connection: the TQ entry "
                    "points need one (TQPolicy passes its TQConnection to every worker)"
                )
            self._tq = self.connection.connect()
        return self._tq

    def _autocast(self, device: torch.device):
        """Autocast to the configured compute dtype on ``device`` (a no-op for float32)."""
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32)

    # ------------------------------------------------------------------ collectives
    def _all_reduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        if self._dist:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        return t

    def _all_reduce_grads(self) -> None:
        """SUM-all-reduce every gradient, flattened into buckets (one collective per bucket, not per tensor)."""
        if not self._dist:
            return
        buckets: list[list[torch.Tensor]] = [[]]
        size = 0
        for p in self.model.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:  # every rank must contribute the same tensors in the same order
                p.grad = torch.zeros_like(p)
            if buckets[-1] and size + p.grad.numel() > _GRAD_BUCKET_ELEMS:
                buckets.append([])
                size = 0
            buckets[-1].append(p.grad)
            size += p.grad.numel()
        for bucket in buckets:
            if not bucket:
                continue
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat)
            for g, src in zip(bucket, torch.split(flat, [g.numel() for g in bucket])):
                g.copy_(src.view_as(g))

    def _reduce_metrics_across_ranks(self, metrics: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """All-reduce this rank's metrics (one collective per reduction kind) and bring them to the host."""
        names = sorted(metrics)
        out: dict[str, float] = {}
        for red, op in (("sum", "SUM"), ("min", "MIN"), ("max", "MAX")):
            keys = [k for k in names if metric_reduction(k) == red]
            if not keys:
                continue
            t = torch.stack([metrics[k].to(self.device, torch.float64) for k in keys])
            self._all_reduce(t, getattr(dist.ReduceOp, op))
            out.update(zip(keys, t.tolist()))
        return out

    # ------------------------------------------------------------------ shared implementations
    def _logprobs(self, data: Mapping[str, torch.Tensor], plan: MicroBatchPlan, reference: bool) -> torch.Tensor:
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("init_distributed must run before the first log-prob pass (it builds the reference)")
        dev = next(model.parameters()).device
        was_training = model.training
        model.eval()
        t = time.perf_counter()
        try:
            with self._autocast(dev):
                return logprobs_for_plan(
                    model, data["input_ids"].to(dev), data["input_lengths"].to(dev), plan, self.pad_token_id, self.cfg.logprob_temperature
                )
        finally:
            model.train(was_training)
            self._timings["compute_s"] += time.perf_counter() - t

    def _train(self, steps: Sequence[tuple[BatchedDataDict, MicroBatchPlan]], loss_fn: Any) -> dict[str, Any]:
        """One optimizer step per (shard of a global batch, plan); returns metrics reduced over ranks."""
        t0 = time.perf_counter()
        self.model.train()
        per_step = []
        for data, plan in steps:
            data = data.to(self.device)
            seqs, toks = local_valid_counts(data)
            counts = self._all_reduce(torch.stack([seqs, toks]).to(torch.float64)).to(torch.float32)
            self.optimizer.zero_grad(set_to_none=True)
            with self._autocast(self.device):
                mb_metrics = forward_backward(
                    self.model, data, plan, loss_fn, counts[0], counts[1], self.pad_token_id, self.cfg.logprob_temperature
                )
            self._all_reduce_grads()
            # Gradients are identical on every rank after the all-reduce, so is the clipping.
            max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
            if not math.isfinite(grad_norm):  # NaN/inf loss or gradients: stop before they reach the weights
                raise RuntimeError(self._non_finite_message(grad_norm, mb_metrics))
            lr = self.optimizer.param_groups[0]["lr"]
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            m = self._reduce_metrics_across_ranks(reduce_metrics(mb_metrics))
            m.update(grad_norm=grad_norm, lr=lr, global_valid_seqs=float(counts[0]), global_valid_toks=float(counts[1]))
            per_step.append(m)
        self.optimizer.zero_grad(set_to_none=True)
        # Several optimizer steps: average the per-step means, keep extremes of min/max.
        out: dict[str, Any] = {}
        for k in per_step[0]:
            vals = [m[k] for m in per_step]
            red = metric_reduction(k)
            out[k] = min(vals) if red == "min" else max(vals) if red == "max" else sum(vals) / len(vals)
        out["num_optimizer_steps"] = len(per_step)
        out["step"] = self.step
        self._timings["compute_s"] += time.perf_counter() - t0
        return out

    def _non_finite_message(self, grad_norm: float, mb_metrics: Sequence[Mapping[str, Any]]) -> str:
        """Why a training step was refused: the first micro-batch whose loss is non-finite (looked up
        only on this failure path), else the gradient norm (the same on every rank after the all-reduce)."""
        where = f"policy rank {self.rank}, optimizer step {self.step + 1}"
        for j, m in enumerate(mb_metrics):
            loss = m.get("loss")
            if loss is not None and not math.isfinite(float(loss)):
                return (
                    f"{where}: non-finite loss ({float(loss)}) in micro-batch {j + 1} of {len(mb_metrics)} (gradient norm "
                    f"{grad_norm}); the weights were not updated - check the rewards / advantages and the learning rate"
                )
        return (
            f"{where}: non-finite gradient norm ({grad_norm}) over {len(mb_metrics)} micro-batch(es) with finite losses on this rank; "
            "the weights were not updated - check the learning rate and the data"
        )

    def _plan(self, extra_info: Mapping[str, Any], n: int, purpose: str) -> MicroBatchPlan:
        size = self.cfg.train_micro_batch_size if purpose == "train" else self.cfg.logprob_batch_size
        return plan_from_extra_info(extra_info, n, size)

    # ------------------------------------------------------------------ legacy path
    def get_logprobs(
        self, data: BatchedDataDict, extra_info: Mapping[str, Any], reference: bool = False, sent_at: float | None = None
    ) -> BatchedDataDict:
        """Log-probs ``[n, L]`` (float32, CPU) of a shard; ``reference`` uses the frozen reference model."""
        self._arrived(sent_at, shard_in_args=True)
        lp = self._logprobs(data, self._plan(extra_info, data.size, "logprob"), reference)
        return BatchedDataDict(logprobs=lp.cpu())

    def train(
        self, shards: Sequence[tuple[BatchedDataDict, Mapping[str, Any]]], loss_fn: Any, sent_at: float | None = None
    ) -> dict[str, Any]:
        """One optimizer step per ``(shard of a global batch, its extra_info)``; returns metrics."""
        self._arrived(sent_at, shard_in_args=True)
        return self._train([(d, self._plan(info, d.size, "train")) for d, info in shards], loss_fn)

    # ------------------------------------------------------------------ TQ path
    def _fetch(self, meta: KVBatchMeta, fields: Sequence[str]) -> BatchedDataDict:
        client = self._client()
        t = time.perf_counter()
        cols = fetch_padded(client, meta, fields, {"input_ids": self.pad_token_id}, self.device)
        waited = time.perf_counter() - t
        self._timings["tq_get_s"] += waited
        self._timings["fetch_s"] += waited
        self._timings["tq_get_bytes"] += tensor_nbytes(cols)
        return BatchedDataDict(cols)

    def _write_back(self, meta: KVBatchMeta, columns: Mapping[str, Any]) -> None:
        t = time.perf_counter()
        self._client().write_back(meta, columns)
        self._timings["write_back_s"] += time.perf_counter() - t
        self._timings["write_back_bytes"] += tensor_nbytes(columns)

    def get_logprobs_from_meta(
        self,
        meta: KVBatchMeta,
        reference: bool = False,
        output_field: str | None = None,
        sent_at: float | None = None,
        reductions: bool = False,
    ) -> dict[str, Any]:
        """Fetch the shard's inputs, compute log-probs, write them back as ``output_field`` (jagged).

        ``output_field`` defaults to ``prev_logprobs`` (``reference_policy_logprobs`` with ``reference``).
        With ``reductions`` the same pass also fetches ``generation_logprobs`` / ``token_mask`` and writes
        the per-sample reductions of the new log-probs (what :meth:`compute_per_token_reductions` would
        write, bit for bit) in the same write-back, saving that pass's round trip and re-fetch.
        Returns only a small dict (samples and tokens processed, fields written).
        """
        from tq import JaggedTensor

        self._arrived(sent_at, shard_in_args=False)
        field = output_field or ("reference_policy_logprobs" if reference else "prev_logprobs")
        extra = tuple(f for f in REDUCTION_INPUT_FIELDS if f != "prev_logprobs") if reductions else ()
        data = self._fetch(meta, (*LOGPROB_INPUT_FIELDS, *extra))
        lp = self._logprobs(data, self._plan(meta.extra_info, len(meta), "logprob"), reference).cpu()
        lengths = data["input_lengths"].cpu()
        cols: dict[str, Any] = {field: JaggedTensor.from_padded(lp, lengths)}
        if reductions:  # on the CPU, as the legacy driver computes them (a GPU rank's fetch is on its GPU)
            t = time.perf_counter()
            cols.update(per_sample_reductions({"prev_logprobs": lp, **{f: data[f].cpu() for f in extra}}))
            self._timings["compute_s"] += time.perf_counter() - t
        self._write_back(meta, cols)
        return {"rank": self.rank, "samples": len(meta), "tokens": int(lengths.sum()), "field": field, "fields": sorted(cols)}

    def train_from_meta(self, metas: Sequence[KVBatchMeta], loss_fn: Any, sent_at: float | None = None) -> dict[str, Any]:
        """One optimizer step per meta (this rank's shard of each global batch); returns metrics only."""
        self._arrived(sent_at, shard_in_args=False)
        fields = list(dict.fromkeys(("input_ids", "input_lengths", *getattr(loss_fn, "input_fields", ()))))
        steps = [(self._fetch(m, fields), self._plan(m.extra_info, len(m), "train")) for m in metas]
        return self._train(steps, loss_fn)

    def compute_per_token_reductions(self, meta: KVBatchMeta, sent_at: float | None = None) -> dict[str, Any]:
        """Write per-sample reductions of the shard's per-token columns back to the data plane.

        Columns written: ``seq_logprob_error`` (mean ``|prev_logprobs - generation_logprobs|`` over
        ``token_mask``), ``seq_mult_prob_error`` (mean ``exp`` of it, NeMo-RL's filter statistic) and
        ``num_valid_tokens`` (``token_mask`` count), so the driver never reads per-token columns.
        """
        self._arrived(sent_at, shard_in_args=False)
        data = self._fetch(meta, REDUCTION_INPUT_FIELDS)
        t = time.perf_counter()
        cols = per_sample_reductions({k: v.cpu() for k, v in data.items()})  # on the CPU, as the legacy driver
        self._timings["compute_s"] += time.perf_counter() - t
        self._write_back(meta, cols)
        return {"rank": self.rank, "samples": len(meta), "fields": sorted(cols)}

    # ------------------------------------------------------------------ weights and checkpoints
    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's state dict as CPU tensors (for refit; call on rank 0)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def save_checkpoint(self, path: str) -> str | None:
        """Rank 0 writes model, optimizer and scheduler state under directory ``path``; all ranks sync."""
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            torch.save(self.model.state_dict(), os.path.join(path, "model.pt"))
            torch.save(
                {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "step": self.step},
                os.path.join(path, "optim.pt"),
            )
        if self._dist:
            dist.barrier()
        return path if self.rank == 0 else None

    def load_checkpoint(self, path: str) -> int:
        """Every rank loads the checkpoint at ``path`` (a filesystem all ranks see); returns its step."""
        state = torch.load(os.path.join(path, "model.pt"), map_location=self.device, weights_only=True)
        self.model.load_state_dict(state)
        opt = torch.load(os.path.join(path, "optim.pt"), map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(opt["optimizer"])
        self.scheduler.load_state_dict(opt["scheduler"])
        self.step = int(opt["step"])
        return self.step

    # ------------------------------------------------------------------ GPU refit senders (policy.weight_sync)
    def _weight_sender(self) -> Any:
        if getattr(self, "_refit_sender", None) is None:
            from .weight_sync import WeightBucketSender

            self._refit_sender = WeightBucketSender()
        return self._refit_sender

    def get_weight_ipc_bucket(self, dtype: str, version: int) -> dict[str, Any]:
        """This rank's weights cast into its GPU refit buffer, as a ``"cuda_ipc"`` weight bucket that a
        colocated vLLM engine maps and copies from (call on the rank beside that engine, on its GPU)."""
        return self._weight_sender().cuda_ipc_bucket(self.model, DTYPES[dtype], version)

    def get_weight_nccl_bucket(self, dtype: str, version: int, group: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's weights cast into its GPU refit buffer, as an ``"nccl"`` weight bucket; send it
        with :meth:`broadcast_weight_bucket` while the receivers load it (call on rank 0)."""
        return self._weight_sender().nccl_bucket(self.model, DTYPES[dtype], version, group)

    def broadcast_weight_bucket(self) -> int:
        """Broadcast the refit buffer to the NCCL weight group's receivers; returns the bytes sent."""
        return self._weight_sender().broadcast()
