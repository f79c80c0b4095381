"""The data movement of one GRPO training step at scale, legacy vs TQ, with the model's compute replaced
by a no-op that reads every byte a rank received.

    python -m benchmarks.dataplane_scale                  # the CPU sweep (DP up to 8; ~10 minutes on 2 cores)
    python -m benchmarks.dataplane_scale --large          # the large sweep (DP up to 16, batch up to 4096, 16k tokens)
    python -m benchmarks.dataplane_scale --quick          # 3 small points, DP 1 and 2 (seconds, for CI)

Both paths run the real code the trainers run, only the ranks' compute is gone:

- legacy (``trainer.grpo``'s step): the rollout actor's ``rollout`` returns the padded batch to the
  driver through Ray; ``policy.Policy.get_logprobs`` ships each DP rank its shard (``input_ids``,
  ``input_lengths``) and gathers the ``[n, L]`` log-probs back; the driver adds them and the advantages
  to the batch; ``Policy.train`` ships each rank its shard of every training column.
- TQ (``trainer.grpo_sync``'s step): the rollout actor puts the jagged columns into TQ and returns a
  ``KVBatchMeta``; ``TQPolicy.get_logprobs_from_meta`` sends each rank its meta shard, the rank fetches
  its inputs and writes ``prev_logprobs`` back; the driver writes ``advantages``;
  ``TQPolicy.train_from_meta``: each rank fetches its training columns; ``finish_step`` clears the keys.

The DP ranks are ``policy.worker.DPPolicyWorker`` with the model left out (:class:`NoComputeWorker`:
its log-prob pass reads its inputs and returns zeros of the real shape, its training pass reads every
column); the rollout actor (:class:`RolloutSource`) builds the batch before the step and hands it over
as ``rollout`` / ``rollout_to_tq`` do. The training columns are ``input_ids`` (int64), ``input_lengths``,
``prev_logprobs``, ``advantages``, ``sample_mask``, ``fields - 1`` more float32 per-token columns and
``images`` uint8 ``[k, 3, 448, 448]`` per sample when ``images = k > 0`` (the log-prob pass reads what
the trainers' does: ``input_ids`` and ``input_lengths``). Response lengths are uniform in
``[L/2, L]``; the legacy batch is padded to the longest.

Per step (medians over the timed steps; one warm-up step per path and point): the step's wall time;
*data movement* = that minus the slowest rank's no-op (the byte-reading pass); the driver's own part
(sending calls, fetching results, its TQ calls); the slowest rank's fetch + write-back; each rank's
fetch; the driver's bytes received and sent (pickled sizes, ``policy.traffic.DriverTraffic``); the
driver's peak RSS over the step (``VmHWM`` reset before it) above its RSS before it; aggregate GB/s
(bytes the ranks read / data movement). A separate get sweep times one rank's padded TQ get of the
same bytes split over 1..32 per-token fields, and the ``transferqueue`` package's ``kv_batch_get``
on the same columns (when installed: ``pip install -e '.[bench]'``).

Targets (each a ratio from this run): TQ data movement >= 5x lower than legacy's at the largest point;
TQ per-rank fetch within +-25% of DP=1's up to the largest DP (per-rank shard fixed; meaningful where
the host has a core per rank); TQ driver bytes and peak RSS growth independent of payload (slope vs
payload bytes <= 1% and <= 5%; legacy's grow with it); TQ get with 32 fields >= 0.8x its 1-field GB/s.

Each run writes a fresh ``logs/dataplane_scale/<timestamp>/`` (``.json``, ``.md``, ``_fetch.png``);
``--publish`` copies them over ``benchmarks/results/dataplane_scale_<machine>.*``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import textwrap
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from benchmarks.outputs import RunOutput, add_output_args, code_version, cpu_model, open_run
from policy.worker import DPPolicyWorker

MiB = 1 << 20
IMAGE_SHAPE = (3, 448, 448)
GROUP = 8  # samples per prompt (advantages are group baselines)
PATHS = ("legacy", "tq")


@dataclass(frozen=True)
class Point:
    """One step's shape: ``batch`` samples of up to ``response`` tokens, ``fields`` per-token training
    columns (``input_ids`` and ``fields - 1`` float32), ``images`` uint8 3x448x448 images per sample."""

    dp: int
    batch: int
    response: int
    fields: int = 4
    images: int = 0

    @property
    def key(self) -> str:
        return f"dp{self.dp}_b{self.batch}_L{self.response}_f{self.fields}_i{self.images}"

    def payload_bytes(self) -> int:
        """Unpadded bytes of the rollout's columns (mean length 3/4 of ``response``)."""
        tokens = self.batch * self.response * 3 // 4
        return tokens * (8 + 4 * (self.fields - 1)) + self.batch * (self.images * int(np.prod(IMAGE_SHAPE)) + 16)


# ----------------------------------------------------------------------------- the no-compute rank
def touch(obj: Any) -> int:
    """Read every byte of every tensor in ``obj`` (a mapping or sequence of tensors, nested); returns
    the bytes read. The sum is kept nowhere: reading is the point (pages a get mapped are faulted in)."""
    if isinstance(obj, Mapping):
        return sum(touch(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(touch(v) for v in obj)
    if not isinstance(obj, torch.Tensor):
        return 0
    a = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    whole = a.size // 8 * 8
    if whole:
        a[:whole].view(np.uint64).sum()
    if a.size > whole:
        a[whole:].sum()
    return int(a.size)


class NoComputeWorker(DPPolicyWorker):
    """A ``DPPolicyWorker`` without a model: every data-moving entry point (legacy ``get_logprobs`` /
    ``train``, TQ ``get_logprobs_from_meta`` / ``train_from_meta`` with their fetches and write-backs)
    is the real one; the compute reads every byte received (``touch``) and returns results of the real
    shape (float32 ``[n, L]`` log-probs). No process group: the no-op needs no collectives."""

    def __init__(self, config: Any, rank: int, world_size: int, connection: Any = None) -> None:
        from policy.config import PolicyConfig

        self.cfg = config if isinstance(config, PolicyConfig) else PolicyConfig(**config)
        self.rank, self.world_size, self.connection = rank, world_size, connection
        torch.set_num_threads(1)
        self.device = torch.device("cpu")
        self.pad_token_id = 0
        self.reference = None
        self.step = 0
        self._tq = None
        self._dist = False
        self._timings = defaultdict(float)

    def init_distributed(self, master_addr: str, master_port: int) -> dict[str, Any]:
        import ray

        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "device": "cpu",
            "pid": os.getpid(),
            "node": ray.util.get_node_ip_address(),
        }

    def _logprobs(self, data: Mapping[str, torch.Tensor], plan: Any, reference: bool) -> torch.Tensor:
        t = time.perf_counter()
        self._timings["bytes"] += touch(data)
        out = torch.zeros(data["input_ids"].shape, dtype=torch.float32)
        self._timings["compute_s"] += time.perf_counter() - t
        return out

    def _train(self, steps: Sequence[tuple[Any, Any]], loss_fn: Any) -> dict[str, Any]:
        t = time.perf_counter()
        self._timings["bytes"] += sum(touch(dict(data)) for data, _ in steps)
        self.step += len(steps)
        self._timings["compute_s"] += time.perf_counter() - t
        return {"loss": 0.0, "num_optimizer_steps": len(steps), "step": self.step}

    def pop_timings(self) -> dict[str, Any]:
        touched = float(self._timings.get("bytes", 0.0))
        out = super().pop_timings()
        out["bytes"] = touched
        return out


class TouchLoss:
    """The loss function's only part the step uses: ``input_fields``, the training columns."""

    def __init__(self, input_fields: Sequence[str]) -> None:
        self.input_fields = tuple(input_fields)


def token_fields(point: Point) -> list[str]:
    """The per-token float32 columns beyond ``input_ids``."""
    return [f"tok{i:02d}" for i in range(1, point.fields)]


def train_fields(point: Point) -> list[str]:
    return [
        "input_ids",
        "input_lengths",
        "prev_logprobs",
        "advantages",
        "sample_mask",
        *token_fields(point),
        *(["images"] if point.images else []),
    ]


# ----------------------------------------------------------------------------- the rollout actor
class RolloutSource:
    """Stands in for the rollout actor: builds a batch before the step (generation is not measured),
    then hands it over as ``SyncRolloutActor`` does - returned padded through Ray (``rollout``) or put
    jagged into TQ under fresh keys, returning the meta and the per-sample rewards (``rollout_to_tq``)."""

    def __init__(self, connection: Any = None) -> None:
        torch.set_num_threads(1)
        self.client = connection.connect() if connection is not None else None
        self.jagged: dict[str, Any] = {}
        self.padded: dict[str, torch.Tensor] = {}

    def prepare(self, point: dict[str, Any], seed: int) -> int:
        """Build the point's batch (both forms); returns its unpadded bytes."""
        from tq import JaggedTensor

        p = Point(**point)
        rng = np.random.default_rng(seed)
        n = p.batch
        lengths = torch.from_numpy(rng.integers(p.response // 2, p.response + 1, size=n).astype(np.int64))
        offsets = torch.zeros(n + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)
        total, longest = int(offsets[-1]), int(lengths.max())
        pos = torch.arange(longest)
        valid = pos[None, :] < lengths[:, None]
        self.jagged, self.padded = {}, {}
        cols = {"input_ids": torch.from_numpy(rng.integers(1, 32000, size=total, dtype=np.int64))}
        for f in token_fields(p):
            cols[f] = torch.from_numpy(rng.standard_normal(total, dtype=np.float32))
        for name, values in cols.items():
            self.jagged[name] = JaggedTensor(values, offsets)
            dense = torch.zeros((n, longest), dtype=values.dtype)
            dense[valid] = values
            self.padded[name] = dense
        scalars = {"input_lengths": lengths, "sample_mask": torch.ones(n, dtype=torch.float32)}
        if p.images:
            scalars["images"] = torch.from_numpy(rng.integers(0, 256, size=(n, p.images, *IMAGE_SHAPE), dtype=np.uint8))
        self.jagged.update(scalars)
        self.padded.update(scalars)
        self.rewards = torch.from_numpy(rng.random(n, dtype=np.float32))
        return sum(touch(v.values if isinstance(v, JaggedTensor) else v) for v in self.jagged.values())

    def rollout(self) -> Any:
        """The legacy hand-over: the padded batch (with the rewards) as the method's result."""
        from common.batched_data_dict import BatchedDataDict

        return BatchedDataDict({**self.padded, "total_reward": self.rewards})

    def rollout_to_tq(self, partition: str, step: int) -> tuple[Any, dict[str, torch.Tensor], float]:
        """The TQ hand-over: put the jagged columns under fresh keys; ``(meta, carry, put seconds)``."""
        keys = [f"s{step}_{i}" for i in range(len(self.rewards))]
        t = time.perf_counter()
        meta = self.client.put(partition, keys, self.jagged, tags={"group_id": [i // GROUP for i in range(len(keys))]})
        return meta, {"total_reward": self.rewards}, time.perf_counter() - t

    def node(self) -> str:
        """The IP of the node this actor runs on."""
        import ray

        return ray.util.get_node_ip_address()

    def close(self) -> bool:
        if self.client is not None:
            self.client.close()
        return True


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO's group baseline (per-sample scalars; the driver's only math here)."""
    r = rewards.view(-1, GROUP)
    return (r - r.mean(1, keepdim=True)).reshape(-1)


# ----------------------------------------------------------------------------- one step of each path
def legacy_step(policy: Any, source: Any, point: Point, timeout: float) -> dict[str, float]:
    """``trainer.grpo``'s step, compute removed; returns the rollout's hand-over seconds (driver side)."""
    calls = policy.calls
    data = calls.get(calls.send(source.rollout), timeout)
    train = data.select_columns([f for f in train_fields(point) if f not in ("prev_logprobs", "advantages")])
    train["prev_logprobs"] = policy.get_logprobs(train)["logprobs"]
    train["advantages"] = group_advantages(data["total_reward"])
    del data
    policy.train(train, TouchLoss(train_fields(point)))
    return {}


def tq_step(policy: Any, source: Any, point: Point, timeout: float, step: int) -> dict[str, float]:
    """``trainer.grpo_sync``'s step, compute removed; returns the rollout actor's put seconds."""
    calls = policy.calls
    policy.prepare_step(point.batch, GROUP)
    meta, carry, put_s = calls.get(calls.send(source.rollout_to_tq, policy.train_partition, step), timeout)
    meta = policy.get_logprobs_from_meta(meta)
    meta = policy.write_to_dataplane(meta, {"advantages": group_advantages(carry["total_reward"])})
    policy.train_from_meta(meta, TouchLoss(train_fields(point)))
    policy.finish_step(meta)
    return {"rollout_put_s": put_s}


def _reset_peak_rss() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux >= 4.0); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss() -> tuple[int, int]:
    """``(VmRSS, VmHWM)`` of this process in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line[:5]] = int(line.split()[1]) * 1024
    return out["VmRSS"], out["VmHWM"]


def measure_step(path: str, policy: Any, source: Any, point: Point, timeout: float, step: int) -> dict[str, Any]:
    """Run one step of ``path`` and return its measurements."""
    policy.pop_driver_counters()
    policy.worker_timings()
    reset = _reset_peak_rss()
    rss0, _ = _rss()
    t = time.perf_counter()
    extra = legacy_step(policy, source, point, timeout) if path == "legacy" else tq_step(policy, source, point, timeout, step)
    step_s = time.perf_counter() - t
    _, hwm = _rss()
    drv = policy.pop_driver_counters()
    ranks = sorted(policy.worker_timings(), key=lambda r: r["rank"])
    compute = max(r["compute_s"] for r in ranks)
    moved = max(step_s - compute, 1e-9)
    rank_bytes = [r["bytes"] for r in ranks]
    return {
        "step_s": step_s,
        "data_movement_s": moved,
        "rank_compute_max_s": compute,
        "driver_s": drv.get("driver_send_s", 0.0) + drv.get("driver_get_s", 0.0) + drv.get("driver_tq_s", 0.0),
        "driver_bytes_in": drv["bytes_received"],
        "driver_bytes_out": drv["bytes_sent"],
        "rank_fetch_s": [r["fetch_s"] for r in ranks],
        "rank_write_back_s": [r["write_back_s"] for r in ranks],
        "slowest_rank_s": max(r["fetch_s"] + r["write_back_s"] for r in ranks),
        "rank_bytes": rank_bytes,
        "gb_s": sum(rank_bytes) / moved / 1e9,
        "rss_before": rss0,
        "peak_rss": hwm,
        "peak_rss_growth": hwm - rss0 if reset else float("nan"),
        **extra,
    }


# ----------------------------------------------------------------------------- a sweep on one Ray session
@dataclass(frozen=True)
class OnCluster:
    """Where a sweep runs instead of a Ray session and TQ service of its own: a running Ray cluster
    (``ray_address``) and TQ service (``connection``, storage units already placed), the rollout
    actor on the node with IP ``source_ip`` and the DP ranks spread over the nodes that have CPUs
    (``benchmarks.multinode`` runs the sweep this way on its emulated cluster)."""

    ray_address: str
    connection: Any  # tq.connection.TQConnection
    source_ip: str


def run_sweep(
    points: Sequence[Point],
    *,
    steps: int,
    storage_units: int = 1,
    cpus_per_rank: float = 1.0,
    timeout: float = 600.0,
    log: Any = print,
    rows_file: str | None = None,
    cluster: OnCluster | None = None,
) -> list[dict[str, Any]]:
    """Every point on both paths (one warm-up step each, then ``steps`` timed steps, the paths
    alternating step by step); DP groups are started once per DP size. Returns one row per (point, path),
    each also appended to ``rows_file`` (JSON lines) as it is measured, with the node of the rollout
    actor and of each rank."""
    import ray

    from policy.config import PolicyConfig
    from policy.policy import Policy, TQPolicy
    from policy.traffic import DriverTraffic
    from tq.connection import TQConnection
    from tq.server import TQServer

    server = None
    src_cls = ray.remote(num_cpus=0)(RolloutSource)
    spread: dict[str, Any] = {}
    if cluster is None:
        # Ray's default object store (30% of RAM) holds the legacy path's batches; the workers inherit PYTHONPATH.
        # Both paths' ranks are up at once (a legacy and a TQ group per DP size): logical CPUs for both.
        max_dp = max(p.dp for p in points)
        ray.init(address="local", num_cpus=int(2 * max_dp * cpus_per_rank + 2), include_dashboard=False, log_to_driver=False)
        server = TQServer(storage_units=storage_units, capacity=max(256 * MiB, 3 * max(p.payload_bytes() for p in points)))
        conn = TQConnection(server.address, timeout_s=timeout)
    else:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray.init(address=cluster.ray_address, log_to_driver=False)
        conn = cluster.connection
        node = next((n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == cluster.source_ip), None)
        if node is None:
            ray.shutdown()
            raise ValueError(f"no live Ray node has IP {cluster.source_ip} (the rollout actor's node)")
        src_cls = src_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        spread = {"scheduling_strategy": "SPREAD"}
    rows: list[dict[str, Any]] = []

    class LegacyPolicy(Policy):
        worker_cls = NoComputeWorker
        worker_options = spread

    class NoComputeTQPolicy(TQPolicy):
        worker_cls = NoComputeWorker
        worker_options = spread

    try:
        source = src_cls.remote(conn)
        source_node = ray.get(source.node.remote(), timeout=timeout)
        step_no = 0
        for dp in sorted({p.dp for p in points}):
            here = [p for p in points if p.dp == dp]
            cfg = PolicyConfig(dp_size=dp, num_cpus_per_worker=cpus_per_rank, ray_timeout_s=timeout)
            policies = {"legacy": LegacyPolicy(cfg, calls=DriverTraffic()), "tq": NoComputeTQPolicy(cfg, conn, calls=DriverTraffic())}
            rank_nodes = {path: [w.get("node") for w in pol.worker_info] for path, pol in policies.items()}
            try:
                for p in here:
                    cfg_p = cfg.model_copy(update={"train_global_batch_size": p.batch})
                    for pol in policies.values():
                        pol.config = cfg_p
                    payload = ray.get(source.prepare.remote(asdict(p), seed=p.batch + p.response), timeout=timeout)
                    per_path: dict[str, list[dict[str, Any]]] = {k: [] for k in PATHS}
                    for i in range(steps + 1):
                        order = PATHS if i % 2 == 0 else PATHS[::-1]
                        for path in order:
                            step_no += 1
                            m = measure_step(path, policies[path], source, p, timeout, step_no)
                            if i:  # the first step of each path is warm-up
                                per_path[path].append(m)
                    store_left = policies["tq"].store_bytes()
                    for path in PATHS:
                        row = summarize(p, path, per_path[path], payload)
                        row["store_bytes_after"] = store_left if path == "tq" else 0
                        row["source_node"], row["rank_nodes"] = source_node, rank_nodes[path]
                        rows.append(row)
                        if rows_file:
                            with open(rows_file, "a") as f:
                                f.write(json.dumps(row) + "\n")
                        log(
                            f"  {p.key:>28s} {path:6s}: data movement {row['data_movement_s']:.3f}s "
                            f"(step {row['step_s']:.3f}s), driver {row['driver_bytes'] / MiB:.2f} MiB, "
                            f"peak RSS +{row['peak_rss_growth'] / MiB:.0f} MiB, fetch/rank max {1e3 * row['rank_fetch_max_s']:.1f} ms, "
                            f"{row['gb_s']:.2f} GB/s"
                        )
            finally:
                for pol in policies.values():
                    pol.shutdown()
        ray.get(source.close.remote(), timeout=60)
    finally:
        ray.shutdown()
        if server is not None:
            server.shutdown()
    return rows


def _med(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def summarize(p: Point, path: str, steps: list[dict[str, Any]], payload: int) -> dict[str, Any]:
    """Medians over the timed steps of one (point, path)."""
    keys = (
        "step_s",
        "data_movement_s",
        "rank_compute_max_s",
        "driver_s",
        "driver_bytes_in",
        "driver_bytes_out",
        "slowest_rank_s",
        "gb_s",
        "peak_rss",
        "peak_rss_growth",
        "rss_before",
    )
    row: dict[str, Any] = {"point": p.key, "path": path, **asdict(p), "payload_bytes": payload, "steps": len(steps)}
    row.update({k: _med([s[k] for s in steps]) for k in keys})
    row["driver_bytes"] = row["driver_bytes_in"] + row["driver_bytes_out"]
    per_rank = [_med([s["rank_fetch_s"][r] for s in steps]) for r in range(p.dp)]
    row["rank_fetch_s"] = per_rank
    row["rank_fetch_max_s"] = max(per_rank)
    row["rank_fetch_mean_s"] = statistics.fmean(per_rank)
    row["rank_bytes"] = [_med([s["rank_bytes"][r] for s in steps]) for r in range(p.dp)]
    row["rollout_put_s"] = _med([s.get("rollout_put_s", 0.0) for s in steps])
    row["all_steps"] = steps
    return row


# ----------------------------------------------------------------------------- get vs number of fields
def field_columns(n: int, length: int, fields: int, seed: int) -> tuple[dict[str, Any], torch.Tensor]:
    """``fields`` jagged float32 columns holding together 32 floats per token (``[L_i, 32 / fields]`` each)."""
    from tq import JaggedTensor

    rng = np.random.default_rng(seed)
    lengths = torch.from_numpy(rng.integers(length // 2, length + 1, size=n).astype(np.int64))
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    width = 32 // fields
    cols = {
        f"f{i:02d}": JaggedTensor(
            torch.from_numpy(rng.standard_normal((int(offsets[-1]), width), dtype=np.float32)).squeeze(1)
            if width == 1
            else torch.from_numpy(rng.standard_normal((int(offsets[-1]), width), dtype=np.float32)),
            offsets,
        )
        for i in range(fields)
    }
    return cols, lengths


def get_sweep_tq(n: int, length: int, field_counts: Sequence[int], iters: int) -> dict[int, dict[str, float]]:
    """One rank's padded TQ get (what ``DPPolicyWorker._fetch`` does) of the same bytes in 1..32 fields.
    Every field count's batch is stored first and the gets then go round-robin over the counts, so a
    slow phase of a shared machine lands on all of them alike (on the 2-vCPU VM, five gets of one
    count after another swung the 32-field / 1-field ratio between 0.42x and 0.87x from run to run)."""
    from tq.server import TQServer

    per_count = n * length * 32 * 4
    with TQServer(storage_units=1, capacity=max(256 * MiB, (len(field_counts) + 2) * per_count)) as server:
        from tq import TQClient

        with TQClient(server.address) as c:
            stored = {}
            for k in field_counts:  # a partition per count: field f00 is 32 floats wide in one, 1 in another
                cols, _ = field_columns(n, length, k, seed=0)  # the same rows in every count
                c.register_partition(f"fields{k}", reuse=True)
                meta = c.put(f"fields{k}", [f"k{i}" for i in range(n)], cols)
                stored[k] = (meta, list(cols), sum(v.values.numel() * 4 for v in cols.values()))
                del cols
            times: dict[int, list[float]] = {k: [] for k in field_counts}
            for _ in range(iters + 1):  # the first round is the cold one, left out
                for k, (meta, names, _) in stored.items():
                    t = time.perf_counter()
                    got = c.get(meta, names, layout="padded")
                    times[k].append(time.perf_counter() - t)
                    del got
            for k in field_counts:
                c.drop_partition(f"fields{k}")
    out = {}
    for k, (_, _, nbytes) in stored.items():
        best = _med(times[k][1:])
        out[k] = {"bytes": nbytes, "get_s": best, "gb_s": nbytes / best / 1e9}
    return out


def get_sweep_transferqueue(n: int, length: int, field_counts: Sequence[int], iters: int) -> dict[int, dict[str, float]] | str:
    """The same gets from the ``transferqueue`` package (its defaults; ``kv_batch_get``, rows padded as
    ``benchmarks.tq_throughput`` pads them); a string saying why where it cannot run."""
    try:
        import ray
        import transfer_queue
        from tensordict import TensorDict
    except ImportError as exc:
        return f"transferqueue not installed ({exc.name}): pip install -e '.[bench]'"
    from benchmarks.tq_throughput import pad_fields
    from tq.bufferpool import HostBufferPool

    pool = HostBufferPool()
    out: dict[int, dict[str, float]] = {}
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, object_store_memory=512 * MiB)
    try:
        transfer_queue.init()
        for k in field_counts:
            cols, _ = field_columns(n, length, k, seed=0)  # the same rows in every count
            keys = [f"k{k}_{i}" for i in range(n)]
            nested = {f: torch.nested.nested_tensor_from_jagged(v.values, v.offsets) for f, v in cols.items()}
            transfer_queue.kv_batch_put(keys=keys, partition_id="fields", fields=TensorDict(nested, batch_size=n))
            nbytes = sum(v.values.numel() * 4 for v in cols.values())
            times = []
            for _ in range(iters + 1):
                t = time.perf_counter()
                td = transfer_queue.kv_batch_get(keys=keys, partition_id="fields")
                padded = pad_fields({f: (td[f].values(), td[f].offsets().numpy()) for f in cols}, pool)
                times.append(time.perf_counter() - t)
                del td, padded
            transfer_queue.kv_clear(keys=keys, partition_id="fields")
            best = _med(times[1:])
            out[k] = {"bytes": nbytes, "get_s": best, "gb_s": nbytes / best / 1e9}
    except Exception as exc:  # noqa: BLE001 - a third-party system: report why, keep the run
        return f"transferqueue failed: {type(exc).__name__}: {exc}"
    finally:
        try:
            transfer_queue.close()
        finally:
            ray.shutdown()
    return out


# ----------------------------------------------------------------------------- sweeps and targets
def build_sweep(kind: str) -> dict[str, list[Point]]:
    """Named sub-sweeps: ``dp`` (ranks grow, per-rank shard fixed), ``payload`` (response length grows),
    ``fields`` (per-token columns), ``multimodal`` (images per sample)."""
    if kind == "quick":
        return {
            "dp": [Point(1, 16, 128, 2), Point(2, 32, 128, 2)],
            "payload": [Point(2, 32, 128, 2), Point(2, 32, 512, 2)],
            "fields": [],
            "multimodal": [Point(2, 16, 128, 2, 1)],
        }
    if kind == "large":
        return {
            "dp": [Point(d, 256 * d, 2048) for d in (1, 2, 4, 8, 16)],
            "payload": [Point(8, 2048, s) for s in (1024, 4096, 16384)],
            "fields": [Point(8, 1024, 4096, f) for f in (1, 8, 32)],
            "multimodal": [Point(8, 512, 1024, 2, k) for k in (1, 4)],
        }
    return {
        "dp": [Point(d, 128 * d, 1024) for d in (1, 2, 4, 8)],
        "payload": [Point(2, 256, 1024), Point(2, 256, 4096), Point(2, 2048, 1024), Point(2, 256, 16384)],
        "fields": [Point(2, 256, 1024, f) for f in (1, 8, 32)],
        "multimodal": [Point(2, 128, 1024, 2, k) for k in (1, 2, 4)],
    }


def unique(sweeps: Mapping[str, Sequence[Point]]) -> list[Point]:
    seen: dict[str, Point] = {}
    for pts in sweeps.values():
        for p in pts:
            seen.setdefault(p.key, p)
    return sorted(seen.values(), key=lambda p: (p.dp, p.payload_bytes()))


def _row(rows: Sequence[dict[str, Any]], p: Point, path: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["point"] == p.key and r["path"] == path), None)


def _slope(rows: Sequence[dict[str, Any]], pts: Sequence[Point], path: str, key: str) -> float:
    """Growth of ``key`` per byte of payload from the smallest to the largest point of ``pts``."""
    a, b = _row(rows, pts[0], path), _row(rows, pts[-1], path)
    return (b[key] - a[key]) / max(1, b["payload_bytes"] - a["payload_bytes"])


def check_targets(
    rows: Sequence[dict[str, Any]], sweeps: Mapping[str, Sequence[Point]], gets: Mapping[str, Any], cores: int
) -> list[dict[str, Any]]:
    """The four targets as ratios of this run's measurements (``passed`` None: not measurable here)."""
    out = []
    both = [p for p in unique(sweeps) if _row(rows, p, "legacy") and _row(rows, p, "tq")]
    if both:
        big = max(both, key=lambda p: (p.payload_bytes(), p.dp))
        a, b = _row(rows, big, "legacy"), _row(rows, big, "tq")
        r = a["data_movement_s"] / b["data_movement_s"]
        out.append(
            {
                "target": "TQ data movement >= 5x lower than legacy at the largest point",
                "point": big.key,
                "value": f"legacy {a['data_movement_s']:.3f} s / TQ {b['data_movement_s']:.3f} s = {r:.1f}x",
                "ratio": r,
                "passed": r >= 5.0,
            }
        )
    dps = [p for p in sweeps.get("dp", []) if _row(rows, p, "tq")]
    if len(dps) > 1 and dps[0].dp == 1:
        base = _row(rows, dps[0], "tq")["rank_fetch_mean_s"]
        rel = {p.dp: _row(rows, p, "tq")["rank_fetch_mean_s"] / base for p in dps}
        enough = cores >= max(rel) + 1
        out.append(
            {
                "target": "TQ per-rank fetch within +-25% of DP=1's (fixed shard per rank)",
                "point": ", ".join(p.key for p in dps),
                "value": ", ".join(f"DP={d}: {r:.2f}x" for d, r in rel.items()) + f" ({cores} cores)",
                "relative": rel,
                "passed": all(abs(r - 1) <= 0.25 for r in rel.values()) if enough else None,
                "note": "" if enough else f"n/a: {cores} cores cannot give each of {max(rel)} ranks a core",
            }
        )
    pay = [p for p in sweeps.get("payload", []) if _row(rows, p, "tq") and _row(rows, p, "legacy")]
    if len(pay) > 1:
        sb = {path: _slope(rows, pay, path, "driver_bytes") for path in PATHS}
        sr = {path: _slope(rows, pay, path, "peak_rss_growth") for path in PATHS}
        out.append(
            {
                "target": "TQ driver bytes independent of payload (slope <= 0.01 byte per payload byte)",
                "point": f"{pay[0].key} .. {pay[-1].key}",
                "value": f"TQ {sb['tq']:.5f}, legacy {sb['legacy']:.2f} bytes per payload byte",
                "slope": sb,
                "passed": sb["tq"] <= 0.01,
            }
        )
        out.append(
            {
                "target": "TQ driver peak RSS independent of payload (slope <= 0.05)",
                "point": f"{pay[0].key} .. {pay[-1].key}",
                "value": f"TQ {sr['tq']:.4f}, legacy {sr['legacy']:.2f} bytes of peak RSS growth per payload byte",
                "slope": sr,
                "passed": sr["tq"] <= 0.05 if sr["tq"] == sr["tq"] else None,
            }
        )
    tq_gets = gets.get("tq")
    if isinstance(tq_gets, dict) and 1 in tq_gets and 32 in tq_gets:
        r = tq_gets[32]["gb_s"] / tq_gets[1]["gb_s"]
        other = gets.get("transferqueue")
        theirs = (
            f"; transferqueue {other[32]['gb_s'] / other[1]['gb_s']:.2f}x" if isinstance(other, dict) and 1 in other and 32 in other else ""
        )
        out.append(
            {
                "target": "TQ get with 32 fields >= 0.8x its 1-field GB/s (same bytes)",
                "point": "get sweep",
                "value": f"{tq_gets[32]['gb_s']:.2f} / {tq_gets[1]['gb_s']:.2f} GB/s = {r:.3f}x{theirs}",
                "ratio": r,
                "passed": r >= 0.8,
            }
        )
    return out


# ----------------------------------------------------------------------------- reports
def _mib(b: float) -> str:
    return f"{b / MiB:.3f}" if abs(b) < 10 * MiB else f"{b / MiB:.0f}"


def step_table(rows: Sequence[dict[str, Any]], points: Sequence[Point]) -> list[str]:
    """The markdown table of ``points``' rows, legacy then TQ, with TQ's data-movement ratio."""
    lines = [
        "| DP | batch | response (max) | token fields | images | payload MiB | path | data movement s | driver s "
        "| slowest rank s | driver MiB in / out | driver peak RSS + MiB | fetch per rank ms (mean / max) | GB/s | legacy / TQ |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        a = _row(rows, p, "legacy")
        for path in PATHS:
            r = _row(rows, p, path)
            if r is None:
                continue
            speed = f"{a['data_movement_s'] / r['data_movement_s']:.1f}x" if path == "tq" and a else ""
            lines.append(
                f"| {p.dp} | {p.batch} | {p.response} | {p.fields} | {p.images} | {_mib(r['payload_bytes'])} | {path} "
                f"| {r['data_movement_s']:.3f} | {r['driver_s']:.3f} | {r['slowest_rank_s']:.3f} "
                f"| {_mib(r['driver_bytes_in'])} / {_mib(r['driver_bytes_out'])} | {r['peak_rss_growth'] / MiB:.0f} "
                f"| {1e3 * r['rank_fetch_mean_s']:.1f} / {1e3 * r['rank_fetch_max_s']:.1f} | {r['gb_s']:.2f} | {speed} |"
            )
    return lines


def markdown(result: dict[str, Any]) -> str:
    rows, sweeps = result["rows"], {k: [Point(**p) for p in v] for k, v in result["sweeps"].items()}
    lines = [
        f"# Data plane at scale: one GRPO step's data movement, legacy vs TQ{' (quick)' if result['quick'] else ''}",
        "",
        f"Machine: {result['machine']}; code {result['code'].get('commit', '?')}. {result['steps']} timed steps per "
        f"(point, path) after one warm-up, medians"
        + (f"; {result['wall_s'] / 60:.1f} min in all. " if result["wall_s"] == result["wall_s"] else ". ")
        + (f"**Cut short** by its time limit: not measured {', '.join(result['cut_short'])}. " if result.get("cut_short") else "")
        + "Compute is a no-op that reads every byte a rank received; *data movement* = step wall time minus the "
        "slowest rank's no-op. Driver bytes: pickled sizes received / sent. Peak RSS: the driver's, above its RSS "
        "before the step. Fetch: per rank and step (legacy: Ray delivering the shard with the call; TQ: its gets).",
        "",
    ]
    for name, pts in sweeps.items():
        if pts:
            lines += [f"## {name}", "", *step_table(rows, pts), ""]
    gets = result["gets"]
    lines += [
        "## One rank's get: the same bytes in 1..32 per-token fields",
        "",
        f"{gets['n']} samples of up to {gets['length']} tokens, 32 float32 per token in all "
        "(``[L_i, 32 / fields]`` per field), padded; median of the "
        + (f"{gets['iters']} warm gets of each, TQ's copies on up to {gets['copy_threads']} threads." if "iters" in gets else "warm gets."),
        "",
        "| fields | MiB | TQ get s | TQ GB/s | transferqueue get s | transferqueue GB/s |",
        "|---|---|---|---|---|---|",
    ]
    theirs = gets.get("transferqueue")
    for k, v in sorted((int(k), v) for k, v in gets["tq"].items()):
        o = theirs.get(k) or theirs.get(str(k)) if isinstance(theirs, dict) else None
        lines.append(
            f"| {k} | {_mib(v['bytes'])} | {v['get_s']:.4f} | {v['gb_s']:.2f} | "
            + (f"{o['get_s']:.4f} | {o['gb_s']:.2f} |" if o else "n/a | n/a |")
        )
    if isinstance(theirs, str):
        lines += ["", f"transferqueue: {theirs}"]
    lines += ["", "## Targets", "", "| target | points | measured | result |", "|---|---|---|---|"]
    for t in result["targets"]:
        verdict = t.get("note") or "n/a" if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
        lines.append(f"| {t['target']} | {t['point']} | {t['value']} | {verdict} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], out: RunOutput) -> None:
    """Per-rank fetch vs DP and data movement vs payload, one line per path."""
    try:
        import matplotlib
    except ImportError:  # a bare host (the GPU machines' Python): the tables are the result
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    sweeps = {k: [Point(**p) for p in v] for k, v in result["sweeps"].items()}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for path, style in (("legacy", "o-"), ("tq", "s-")):
        pts = [(p.dp, 1e3 * r["rank_fetch_mean_s"]) for p in sweeps.get("dp", []) if (r := _row(rows, p, path))]
        if pts:
            axes[0].plot(*zip(*pts), style, label=path)
        pts = [(r["payload_bytes"] / MiB, r["data_movement_s"]) for p in sweeps.get("payload", []) if (r := _row(rows, p, path))]
        if pts:
            axes[1].plot(*zip(*pts), style, label=path)
    axes[0].set(xlabel="DP ranks (fixed shard per rank)", ylabel="fetch per rank per step (ms, mean)", ylim=(0, None))
    axes[1].set(xlabel="payload per step (MiB)", ylabel="data movement per step (s)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(result["machine"], 120), fontsize=8)
    fig.tight_layout()
    fig.savefig(out.path("_fetch.png"), dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.dataplane_scale",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="3 small points, DP 1 and 2, 1 timed step (seconds, for CI)")
    g.add_argument("--large", action="store_true", help="DP up to 16, batch up to 4096, 16k tokens (a host with >= 32 cores)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per (point, path) after the warm-up (default 3; --quick 1)")
    p.add_argument("--sweeps", default=None, help="only these sub-sweeps, comma-separated: dp,payload,fields,multimodal")
    p.add_argument("--storage-units", type=int, default=1, help="TQ storage units (default 1)")
    p.add_argument("--cpus-per-rank", type=float, default=1.0, help="Ray logical CPUs per DP rank (default 1)")
    p.add_argument("--skip-transferqueue", action="store_true", help="leave the transferqueue package out of the get sweep")
    g = p.add_argument_group("re-rendering a run cut short (its rows came back, its report did not)")
    g.add_argument("--from-rows", default=None, help="the run's dataplane_scale_rows.jsonl; with the run's --quick/--large")
    g.add_argument("--gets", default=None, help='the run\'s get sweep as it printed it: JSON {"tq": {fields: {...}}, ...}')
    g.add_argument("--host", default=None, help="the measuring host, e.g. '32 CPUs (Intel Xeon) of a 2x H100 machine'")
    g.add_argument("--host-cores", type=int, default=None, help="the measuring host's cores (the per-rank fetch target needs it)")
    add_output_args(p, "dataplane_scale")
    return p


def from_rows(kind: str, steps: int, rows_path: str, gets_json: str | None, host: str, cores: int) -> dict[str, Any]:
    """The result of a run cut short, from the rows it wrote (the sweep keeps the points that ran)."""
    with open(rows_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    done = {r["point"] for r in rows}
    sweeps = {k: [p for p in v if p.key in done] for k, v in build_sweep(kind).items()}
    gets = {"n": 0, "length": 0, "tq": {}}
    if gets_json:
        gets.update(json.loads(gets_json))
        gets["tq"] = {int(k): v for k, v in gets["tq"].items()}
    missing = [p.key for v in build_sweep(kind).values() for p in v if p.key not in done]
    result = {
        "kind": kind,
        "quick": kind == "quick",
        "steps": steps,
        "cores": cores,
        "machine": host,
        "code": code_version(),
        "sweeps": {k: [asdict(p) for p in v] for k, v in sweeps.items()},
        "rows": rows,
        "gets": gets,
        "wall_s": float("nan"),
        "cut_short": sorted(set(missing)),
    }
    result["targets"] = check_targets(rows, sweeps, gets, cores)
    return result


def run(
    kind: str,
    steps: int,
    *,
    sweep_names: Sequence[str] | None = None,
    storage_units: int = 1,
    cpus_per_rank: float = 1.0,
    transferqueue: bool = True,
    log: Any = print,
    rows_file: str | None = None,
) -> dict[str, Any]:
    """Run sweep ``kind`` (``quick``, ``cpu`` or ``large``) and the get sweep; returns the result dict."""
    sweeps = build_sweep(kind)
    if sweep_names is not None:
        sweeps = {k: (v if k in sweep_names else []) for k, v in sweeps.items()}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    t0 = time.perf_counter()
    n, length, iters = {"quick": (32, 256, 2), "cpu": (256, 1024, 40), "large": (1024, 4096, 9)}[kind]
    counts = (1, 32) if kind == "quick" else (1, 2, 8, 32)
    points = unique(sweeps)
    log(f"dataplane_scale: {len(points)} points x 2 paths, {steps} timed steps each, {cores} cores")
    rows = run_sweep(points, steps=steps, storage_units=storage_units, cpus_per_rank=cpus_per_rank, log=log, rows_file=rows_file)
    from tq.client import copy_threads

    gets: dict[str, Any] = {
        "n": n,
        "length": length,
        "iters": iters,
        "copy_threads": copy_threads(),
        "tq": get_sweep_tq(n, length, counts, iters),
    }
    if transferqueue:
        gets["transferqueue"] = get_sweep_transferqueue(n, length, counts, iters)
    log(f"get sweep: {json.dumps({k: v for k, v in gets.items() if k in ('tq', 'transferqueue')}, default=str)[:600]}")
    result = {
        "kind": kind,
        "quick": kind == "quick",
        "steps": steps,
        "cores": cores,
        "machine": f"{cores} CPUs ({cpu_model()})",
        "code": code_version(),
        "sweeps": {k: [asdict(p) for p in v] for k, v in sweeps.items()},
        "rows": rows,
        "gets": gets,
        "wall_s": time.perf_counter() - t0,
    }
    result["targets"] = check_targets(rows, sweeps, gets, cores)
    return result


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    kind = "quick" if a.quick else "large" if a.large else "cpu"
    steps = a.steps if a.steps is not None else (1 if a.quick else 3)
    if steps < 1:
        print("error: --steps must be >= 1", file=sys.stderr)
        return 2
    names = a.sweeps.split(",") if a.sweeps else None
    unknown = set(names or ()) - {"dp", "payload", "fields", "multimodal"}
    if unknown:
        print(f"error: --sweeps: unknown sub-sweeps {sorted(unknown)} (have dp, payload, fields, multimodal)", file=sys.stderr)
        return 2
    out = open_run("dataplane_scale", a.run_dir)
    if a.from_rows:
        if not (a.host and a.host_cores):
            print("error: --from-rows needs --host and --host-cores (the measuring machine)", file=sys.stderr)
            return 2
        result = from_rows(kind, steps, a.from_rows, a.gets, a.host, a.host_cores)
    else:
        result = run(
            kind,
            steps,
            sweep_names=names,
            storage_units=a.storage_units,
            cpus_per_rank=a.cpus_per_rank,
            transferqueue=not a.skip_transferqueue,
            rows_file=out.path("_rows.jsonl"),
        )
    with open(out.path(".json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    md = markdown(result)
    with open(out.path(".md"), "w") as f:
        f.write(md)
    plot(result, out)
    print(md)
    out.finish(a.publish, a.machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
