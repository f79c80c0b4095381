"""Legacy vs TQ training paths, measured side by side: step time and its breakdown, driver traffic and
memory, bytes in the store and each DP rank's fetch time, over a sweep of batch size, sequence length
and DP ranks.

    python -m benchmarks.compare_paths                    # synthetic generation, the default CPU sweep
    python -m benchmarks.compare_paths --mode real        # the tiny model generates (smaller sweep)
    python -m benchmarks.compare_paths --quick            # 2 points, 2 steps each (< 2 minutes on 2 cores)
    python -m benchmarks.compare_paths --gpu              # one CUDA GPU: a 113M-parameter decoder in bf16

Both trainers (``trainer.grpo``: rollouts come back to the driver, which ships each DP rank its shard
through Ray; ``trainer.grpo_sync``: the driver passes ``KVBatchMeta`` handles and the ranks fetch from
TQ) run the same GRPO config at every sweep point, interleaved (the order alternates from point to
point), each (path, point) in a fresh process so its peak RSS and Ray state are its own.

Modes: ``synthetic`` generates with ``generation.backend=synthetic`` (random tokens of exactly the
requested response length, no model), so generation costs almost nothing and the step is the policy's
passes plus data movement; ``real`` generates with the tiny model (responses end at EOS, so lengths vary).

Per step (the trainers' own instrumentation, see ``trainer.base``): wall time and its phases
(``timing/generation``, ``logprobs``, ``training``, ``refit``); the data movement inside them - the
driver fetching finished results (``driver_get``), its TQ calls (``driver_tq``), the slowest rank's
fetch (``worker_fetch``: Ray delivering the shard with the call on the legacy path - from the driver
sending it to the rank starting on it -, the TQ gets on the TQ path) and TQ write-backs, and the
rollout's TQ put; the slowest rank's compute (forward, backward, optimizer); the driver's bytes
received and sent (pickled sizes of what it ``ray.get``s and of the arguments of its calls, plus its
TQ reads and writes); the driver's peak RSS; the bytes held in TQ at the end of the step; each rank's
fetch seconds. The first step of each run is warm-up and left out of the medians.

``--quick`` runs the 8x batch pair only; ``--points`` / ``--custom-points`` pick points;
``--from-json`` re-renders the reports of an earlier run. ``--gpu`` needs CUDA (it stops with an error
naming it otherwise) and uses ``common.models.MODEL_113M`` with one DP rank per GPU.

Each run writes a fresh ``logs/compare_paths[_real]/<timestamp>/`` (or ``--run-dir``): ``<name>.json``
(everything, per step), ``<name>.md`` (tables and target checks), ``<name>.log`` (every trainer's
output) and the plots ``<name>_step_time.png`` / ``_driver_bytes.png`` / ``_fetch.png``, where ``<name>`` is
``compare_paths`` or ``compare_paths_real``. ``--publish`` also copies them over
``benchmarks/results/<name>_<machine>.*`` (the files the README cites; ``<machine>`` e.g. ``cpu2``, ``h100x4``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from benchmarks.outputs import RunOutput, add_output_args, open_run

PATHS = ("legacy", "tq")
LABEL = {"legacy": "legacy (trainer.grpo)", "tq": "TQ (trainer.grpo_sync)"}
MiB = 1 << 20
PROMPT_TOKENS = 64  # data.processor.max_seq_length: the built-in prompts are ~6 tokens
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Point:
    """One sweep point: ``prompts x generations`` samples of ``response_len`` generated tokens, ``dp`` ranks."""

    prompts: int
    generations: int
    response_len: int
    dp: int

    @property
    def batch(self) -> int:
        return self.prompts * self.generations

    @property
    def key(self) -> str:
        return f"b{self.batch}_L{self.response_len}_dp{self.dp}"

    @property
    def tokens(self) -> int:
        """Generated tokens per step (the size of the step's bulk data)."""
        return self.batch * self.response_len


# ----------------------------------------------------------------------------- sweeps
def build_sweep(mode: str, quick: bool = False, gpu: bool = False, gpus: int = 1) -> dict[str, list[Point]]:
    """Named sweeps: ``batch`` (batch grows 8x at a fixed length and DP), ``seq`` (response length
    grows at a fixed batch), ``dp`` (DP ranks grow at a fixed per-rank shard). Points may be shared."""
    G = 8
    if quick:  # the 8x batch pair only (peak RSS growth, bytes and step time), short responses
        return {"batch": [Point(4, G, 256, 2), Point(32, G, 256, 2)], "seq": [], "dp": []}
    if gpu:
        L = 2048 if mode == "synthetic" else 512
        dps = [d for d in (1, 2, 4) if d <= gpus]
        return {
            "batch": [Point(p, G, L, 1) for p in (8, 16, 32, 64)],
            "seq": [Point(16, G, s, 1) for s in ((512, 1024, 2048, 3968) if mode == "synthetic" else (256, 512, 1024))],
            "dp": [Point(8 * d, G, L, d) for d in dps] if len(dps) > 1 else [],
        }
    if mode == "synthetic":
        L = 1024
        return {
            "batch": [Point(p, G, L, 2) for p in (4, 8, 16, 32)],
            "seq": [Point(4, G, s, 2) for s in (256, 1024, 4096)],
            "dp": [Point(4 * d, G, L, d) for d in (1, 2, 4)],
        }
    L = 128  # real mode: the tiny random model ends responses at EOS after ~100 tokens on average
    return {
        "batch": [Point(p, G, L, 2) for p in (4, 8, 16, 32)],
        "seq": [Point(4, G, s, 2) for s in (32, 128, 512)],
        "dp": [Point(4 * d, G, L, d) for d in (1, 2, 4)],
    }


def parse_points(spec: str) -> list[Point]:
    """``"2x4x64@1,16x4x64@1"`` (prompts x generations x response tokens @ DP ranks) as points."""
    out = []
    for item in spec.split(","):
        try:
            shape, dp = item.strip().split("@")
            prompts, gens, length = (int(v) for v in shape.split("x"))
            out.append(Point(prompts, gens, length, int(dp)))
        except ValueError:
            raise ValueError(f"bad point {item!r}: expected PROMPTSxGENERATIONSxTOKENS@DP, e.g. 8x8x1024@2") from None
    return out


def unique_points(sweeps: dict[str, list[Point]]) -> list[Point]:
    seen: dict[str, Point] = {}
    for pts in sweeps.values():
        for p in pts:
            seen.setdefault(p.key, p)
    return sorted(seen.values(), key=lambda p: (p.tokens, p.dp))


def overrides(point: Point, mode: str, steps: int, log_dir: str, gpu: bool) -> list[str]:
    """Trainer config overrides (on the offline default) for one sweep point."""
    from common.models import MODEL_113M

    n, L = point.batch, point.response_len
    positions = 1 << max(10, (PROMPT_TOKENS + L - 1).bit_length())
    tiny = {**(MODEL_113M if gpu else {}), "max_position_embeddings": max(positions, MODEL_113M["max_position_embeddings"] if gpu else 0)}
    tiny_yaml = json.dumps(tiny)
    ov = [
        f"grpo.num_prompts_per_step={point.prompts}",
        f"grpo.num_generations_per_prompt={point.generations}",
        f"grpo.max_num_steps={steps}",
        "grpo.val_period=0",
        f"grpo.max_new_tokens={L}",
        f"generation.max_new_tokens={L}",
        f"generation.backend={'synthetic' if mode == 'synthetic' else 'hf'}",
        f"generation.tiny_overrides={tiny_yaml}",
        f"policy.tiny_overrides={tiny_yaml}",
        f"policy.dp_size={point.dp}",
        f"policy.train_global_batch_size={n}",
        f"data.num_builtin_prompts={max(200, 2 * point.prompts)}",
        f"data.processor.max_seq_length={PROMPT_TOKENS}",
        "logger.tensorboard=false",
        "logger.plot=false",
        "logger.progress=false",
        f"logger.log_dir={log_dir}",
        "logger.data_movement_metrics=true",
        "checkpointing.enabled=false",
        f"data_plane.capacity_bytes={max(256 * MiB, 64 * n * (PROMPT_TOKENS + L))}",
    ]
    if gpu:
        share = 0.5 if mode == "real" else 1.0  # real mode: the generation actor shares the GPU
        ov += [
            "policy.dtype=bfloat16",
            f"policy.num_gpus_per_worker={share}",
            "policy.num_cpus_per_worker=1",
            "policy.reference_model_on_cpu=false",
            "policy.train_micro_batch_size=8",
            "policy.logprob_batch_size=16",
            "policy.learning_rate=1e-5",
        ]
        if mode == "real":
            ov += [
                "generation.device=cuda",
                "generation.dtype=bfloat16",
                "generation.ray_workers=1",
                "generation.num_gpus_per_worker=0.5",
                "generation.num_cpus_per_worker=1",
            ]
    else:
        ov += [
            "policy.train_micro_batch_size=16",
            "policy.logprob_batch_size=32",
            f"cluster.num_cpus={max(2, point.dp)}",
        ]  # logical CPUs: 4 ranks x 0.5 + the rollout actor
    return ov


# ----------------------------------------------------------------------------- one run (child process)
KEPT_PREFIXES = (
    "timing/",
    "fetch/",
    "driver_",
    "step_time_s",
    "store_bytes",
    "rollout/tq_put_seconds",
    "generation/generated_tokens",
    "rollout/mean_response_length",
    "rollout/mean_input_length",
    "loss",
    "reward",
)


def run_one(path: str, overrides_: Sequence[str]) -> dict[str, Any]:
    """Train ``path``'s trainer on the overrides in this process; per-step metrics plus RSS figures."""
    import psutil
    import ray

    from trainer.base import peak_rss_bytes
    from trainer.config import parse_cli
    from trainer.grpo import GRPOTrainer
    from trainer.grpo_sync import GRPOSyncTrainer

    cls = {"legacy": GRPOTrainer, "tq": GRPOSyncTrainer}[path]
    cfg = parse_cli(list(overrides_))
    t0 = time.perf_counter()
    trainer = cls(cfg)
    try:
        startup_s = time.perf_counter() - t0
        rss_start = psutil.Process().memory_info().rss
        peak_start = peak_rss_bytes()
        history = trainer.fit()
    finally:
        trainer.shutdown()
        ray.shutdown()
    steps = [{k: float(v) for k, v in h.items() if k.startswith(KEPT_PREFIXES) and isinstance(v, (int, float))} for h in history]
    return {
        "path": path,
        "startup_s": startup_s,
        "rss_after_startup_bytes": rss_start,
        "peak_rss_after_startup_bytes": peak_start,
        "peak_rss_bytes": peak_rss_bytes(),
        "steps": steps,
    }


def _spawn(path: str, point: Point, ov: list[str], log_path: str, timeout_s: float) -> dict[str, Any]:
    """Run one (path, point) in a fresh Python process; its output goes to ``log_path``."""
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        out_path = f.name
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.compare_paths",
        "--child",
        json.dumps({"path": path, "overrides": ov}),
        "--child-out",
        out_path,
    ]
    t0 = time.perf_counter()
    with open(log_path, "ab") as log:
        log.write(f"\n===== {path} {point.key}\n".encode())
        log.flush()
        env = {
            **os.environ,
            "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": os.pathsep.join(x for x in (ROOT, os.environ.get("PYTHONPATH")) if x),
        }
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    try:
        if proc.returncode != 0:
            tail = open(log_path, errors="replace").read()[-3000:]
            raise RuntimeError(f"{path} at {point.key} exited with {proc.returncode}; log tail:\n{tail}")
        with open(out_path) as f:
            res = json.load(f)
    finally:
        os.unlink(out_path)
    res["process_wall_s"] = wall
    return res


# ----------------------------------------------------------------------------- summaries
def _median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return float(statistics.median(xs)) if xs else float("nan")


DATA_PARTS = ("timing/driver_get", "timing/driver_tq", "timing/worker_fetch", "timing/worker_write_back", "rollout/tq_put_seconds")


def summarize_run(run: dict[str, Any], point: Point) -> dict[str, Any]:
    """Medians over the timed steps (all but the first, when there are several) of one (path, point)."""
    steps = run["steps"][1:] if len(run["steps"]) > 1 else run["steps"]

    def med(key: str) -> float:
        return _median(s.get(key, 0.0) for s in steps)

    ranks = sorted({k for s in steps for k in s if k.startswith("fetch/rank")}, key=lambda k: int(k[10:-2]))
    per_rank = [med(k) for k in ranks]
    data_s = _median(sum(s.get(k, 0.0) for k in DATA_PARTS) for s in steps)
    step_s = med("step_time_s")
    return {
        "point": point.key,
        "path": run["path"],
        **asdict(point),
        "batch": point.batch,
        "tokens": point.tokens,
        "steps_timed": len(steps),
        "step_s": step_s,
        "step_s_all": [s["step_time_s"] for s in run["steps"]],
        "generation_s": med("timing/generation"),
        "logprobs_s": med("timing/logprobs"),
        "training_s": med("timing/training"),
        "refit_s": med("timing/refit"),
        "driver_get_s": med("timing/driver_get"),
        "driver_send_s": med("timing/driver_send"),
        "driver_tq_s": med("timing/driver_tq"),
        "worker_fetch_s": med("timing/worker_fetch"),
        "worker_dispatch_s": med("timing/worker_dispatch"),
        "worker_tq_get_s": med("timing/worker_tq_get"),
        "worker_write_back_s": med("timing/worker_write_back"),
        "rollout_tq_put_s": med("rollout/tq_put_seconds"),
        "worker_compute_s": med("timing/worker_compute"),
        "data_movement_s": data_s,
        "data_share": data_s / step_s if step_s > 0 else float("nan"),
        "driver_bytes_received": med("driver_bytes_received"),
        "driver_bytes_sent": med("driver_bytes_sent"),
        "driver_bytes": med("driver_bytes_received") + med("driver_bytes_sent"),
        "peak_rss_bytes": run["peak_rss_bytes"],
        "peak_rss_growth_bytes": run["peak_rss_bytes"] - run["peak_rss_after_startup_bytes"],
        "store_bytes": med("store_bytes"),
        "fetch_per_rank_s": per_rank,
        "fetch_rank_mean_s": statistics.fmean(per_rank) if per_rank else float("nan"),
        "fetch_rank_max_s": max(per_rank) if per_rank else float("nan"),
        "mean_response_length": med("rollout/mean_response_length"),
        "startup_s": run["startup_s"],
        "process_wall_s": run.get("process_wall_s", float("nan")),
    }


def _find(rows: list[dict[str, Any]], path: str, key: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["path"] == path and r["point"] == key), None)


def check_targets(rows: list[dict[str, Any]], sweeps: dict[str, list[Point]]) -> list[dict[str, Any]]:
    """The benchmark's targets, computed from summary rows (``summarize_run``'s) of both paths.

    1. driver bytes (received + sent) per step on the TQ path <= 1% of legacy's, at the largest point
       (the most generated tokens per step; ties: the larger batch);
    2. TQ driver peak RSS grows < 20% when the batch grows 8x (the batch sweep's first 8x pair), and
       legacy's grows more;
    3. TQ step time <= legacy's at every point, and >= 1.5x faster at the largest point;
    4. per-rank fetch time on the TQ path within +-25% of DP=1's at every DP of the DP sweep (fixed
       per-rank shard).

    Rows need ``point``, ``path``, ``tokens``, ``batch``, ``step_s``, ``driver_bytes``,
    ``peak_rss_bytes`` and ``fetch_rank_mean_s`` (``data_share`` is reported when present). Each
    check is ``{"target", "point", "value", "passed", ...}``; ``passed`` is None when the sweep lacks
    the points it needs.
    """
    out: list[dict[str, Any]] = []
    keys = sorted({r["point"] for r in rows})
    paired = [(k, _find(rows, "legacy", k), _find(rows, "tq", k)) for k in keys]
    paired = [(k, a, b) for k, a, b in paired if a is not None and b is not None]
    largest = max(paired, key=lambda t: (t[1]["tokens"], t[1]["batch"])) if paired else None
    if largest is not None:
        k, a, b = largest
        ratio = b["driver_bytes"] / a["driver_bytes"] if a["driver_bytes"] else float("inf")
        out.append(
            {
                "target": "TQ driver bytes/step <= 1% of legacy's at the largest point",
                "point": k,
                "value": f"{100 * ratio:.2f}% ({b['driver_bytes'] / MiB:.3f} vs {a['driver_bytes'] / MiB:.2f} MiB)",
                "ratio": ratio,
                "passed": bool(ratio <= 0.01),
            }
        )
    else:
        out.append(
            {
                "target": "TQ driver bytes/step <= 1% of legacy's at the largest point",
                "point": "",
                "value": "no point ran on both paths",
                "passed": None,
            }
        )

    batch = sorted(sweeps.get("batch", []), key=lambda p: p.batch)
    pair = next(((lo, hi) for lo in batch for hi in batch if hi.batch == 8 * lo.batch), None)
    name = "TQ driver peak RSS grows < 20% when the batch grows 8x (legacy's grows)"
    if pair is not None and all(_find(rows, pth, pt.key) for pth in PATHS for pt in pair):
        lo, hi = pair
        g = {pth: _find(rows, pth, hi.key)["peak_rss_bytes"] / _find(rows, pth, lo.key)["peak_rss_bytes"] - 1 for pth in PATHS}
        out.append(
            {
                "target": name,
                "point": f"{lo.key} -> {hi.key}",
                "value": f"TQ {100 * g['tq']:+.1f}%, legacy {100 * g['legacy']:+.1f}%",
                "tq_growth": g["tq"],
                "legacy_growth": g["legacy"],
                "passed": bool(g["tq"] < 0.20 and g["legacy"] > g["tq"]),
            }
        )
    else:
        out.append({"target": name, "point": "", "value": "no 8x batch pair in the sweep", "passed": None})

    if paired:
        ratios = {k: a["step_s"] / b["step_s"] for k, a, b in paired}
        slower = {k: r for k, r in ratios.items() if r < 1.0}
        out.append(
            {
                "target": "TQ step time <= legacy's at every point",
                "point": f"{len(ratios)} points",
                "value": f"legacy/TQ {min(ratios.values()):.2f}x .. {max(ratios.values()):.2f}x"
                + ("; TQ slower at " + ", ".join(f"{k} ({100 * (1 / r - 1):.1f}%)" for k, r in slower.items()) if slower else ""),
                "ratios": ratios,
                "passed": not slower,
            }
        )
        k, a, b = largest
        share = a.get("data_share")
        out.append(
            {
                "target": "TQ >= 1.5x faster at the largest point",
                "point": k,
                "value": f"legacy/TQ {ratios[k]:.2f}x ({a['step_s']:.3f} s vs {b['step_s']:.3f} s)"
                + (f"; legacy's measured data movement is {100 * share:.1f}% of its step" if share is not None else "")
                + (
                    f"; step minus the slowest rank's compute: {a['step_s'] - a['worker_compute_s']:.3f} s vs "
                    f"{b['step_s'] - b['worker_compute_s']:.3f} s"
                    if "worker_compute_s" in a and "worker_compute_s" in b
                    else ""
                ),
                "ratio": ratios[k],
                "passed": bool(ratios[k] >= 1.5),
            }
        )
    else:
        for name in ("TQ step time <= legacy's at every point", "TQ >= 1.5x faster at the largest point"):
            out.append({"target": name, "point": "", "value": "no point ran on both paths", "passed": None})

    dp = sorted(sweeps.get("dp", []), key=lambda p: p.dp)
    have = [p for p in dp if _find(rows, "tq", p.key)]
    name = "TQ per-rank fetch time within +-25% from DP=1 to the largest DP (fixed per-rank shard)"
    if len(have) >= 2 and have[0].dp == 1:
        base = _find(rows, "tq", have[0].key)["fetch_rank_mean_s"]
        rel = {p.dp: _find(rows, "tq", p.key)["fetch_rank_mean_s"] / base for p in have}
        legacy = {p.dp: (_find(rows, "legacy", p.key) or {}).get("fetch_rank_mean_s", float("nan")) for p in have}
        out.append(
            {
                "target": name,
                "point": ", ".join(p.key for p in have),
                "value": "TQ "
                + ", ".join(f"DP={d}: {1e3 * r * base:.1f} ms ({r:.2f}x)" for d, r in rel.items())
                + "; legacy "
                + ", ".join(f"DP={d}: {1e3 * v:.1f} ms" for d, v in legacy.items()),
                "relative": rel,
                "passed": all(abs(r - 1) <= 0.25 for r in rel.values()),
            }
        )
    else:
        out.append({"target": name, "point": "", "value": "no DP sweep from DP=1", "passed": None})
    return out


# ----------------------------------------------------------------------------- reports
def _mib(b: float) -> str:
    return f"{b / MiB:.3f}" if b < 10 * MiB else f"{b / MiB:.1f}"


def _ms(s: float) -> str:
    return f"{1e3 * s:.1f}"


def compact_table(rows: list[dict[str, Any]]) -> list[str]:
    """One row per point, both paths side by side (legacy / TQ)."""
    order = sorted({r["point"] for r in rows}, key=lambda k: next((r["tokens"], r["dp"]) for r in rows if r["point"] == k))
    lines = [
        "| batch | response tokens (max) | DP | step s | legacy / TQ | compute s | step - compute s | data movement s "
        "| driver MiB/step (received + sent) | TQ / legacy bytes | driver peak RSS MiB | TQ store MiB | fetch per rank ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k in order:
        a, b = _find(rows, "legacy", k), _find(rows, "tq", k)
        if a and b:
            mean = a.get("mean_response_length", a["response_len"])
            length = f"{a['response_len']}" + (f" (mean {mean:.0f})" if abs(mean - a["response_len"]) >= 1 else "")
            lines.append(
                f"| {a['batch']} | {length} | {a['dp']} | {a['step_s']:.3f} / {b['step_s']:.3f} "
                f"| {a['step_s'] / b['step_s']:.2f}x | {a['worker_compute_s']:.2f} / {b['worker_compute_s']:.2f} "
                f"| {a['step_s'] - a['worker_compute_s']:.3f} / {b['step_s'] - b['worker_compute_s']:.3f} "
                f"| {a['data_movement_s']:.3f} / {b['data_movement_s']:.3f} "
                f"| {_mib(a['driver_bytes'])} / {_mib(b['driver_bytes'])} | {100 * b['driver_bytes'] / a['driver_bytes']:.2f}% "
                f"| {a['peak_rss_bytes'] / MiB:.0f} / {b['peak_rss_bytes'] / MiB:.0f} | {_mib(b['store_bytes'])} "
                f"| {_ms(a['fetch_rank_mean_s'])} / {_ms(b['fetch_rank_mean_s'])} |"
            )
    return lines


def markdown(result: dict[str, Any]) -> str:
    rows, sweeps = result["summary"], {k: [Point(**p) for p in v] for k, v in result["sweeps"].items()}
    m = result["machine"]
    order = sorted({r["point"] for r in rows}, key=lambda k: next((r["tokens"], r["dp"]) for r in rows if r["point"] == k))
    lines = [
        f"# Legacy vs TQ training paths: {result['mode']} generation{' (quick)' if result['quick'] else ''}",
        "",
        f"Machine: {m['device']}; Python {m['python']}, torch {m['torch']}, Ray {m['ray']}. Model: {result['model']}. "
        f"{result['steps']} steps per run, the first excluded (medians of the others); each (path, point) in a "
        f"fresh process, the two paths interleaved. Whole sweep: {result['wall_s'] / 60:.1f} min.",
        "",
        "Per step, medians. *Compute*: the slowest rank's forward, backward and optimizer time (*step - compute*: "
        "everything else - generation, data movement, orchestration, waiting). *Data movement* "
        "(inside the phases): the driver fetching results + its TQ calls + the slowest rank's fetch and TQ "
        "write-backs + the rollout's TQ put. *Driver bytes*: pickled sizes of what the driver receives / sends. "
        "*Fetch*: per rank and step, Ray delivering the shard (legacy) or the TQ gets (TQ); mean over ranks / slowest.",
        "",
        "| batch (prompts x gens) | response tokens | DP | path | step s | generation s | log-probs s | training s "
        "| refit s | compute s | data movement s (share) | driver received MiB | driver sent MiB "
        "| driver peak RSS MiB (+ after start-up) | TQ store MiB | fetch per rank ms (mean / max) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k in order:
        for path in PATHS:
            r = _find(rows, path, k)
            if r is None:
                continue
            length = f"{r['response_len']}" + (
                f" (mean {r['mean_response_length']:.0f})" if abs(r["mean_response_length"] - r["response_len"]) >= 1 else ""
            )
            lines.append(
                f"| {r['batch']} ({r['prompts']}x{r['generations']}) | {length} | {r['dp']} | {path} | {r['step_s']:.3f} "
                f"| {r['generation_s']:.3f} | {r['logprobs_s']:.3f} | {r['training_s']:.3f} | {r['refit_s']:.3f} "
                f"| {r['worker_compute_s']:.3f} | {r['data_movement_s']:.3f} ({100 * r['data_share']:.1f}%) "
                f"| {_mib(r['driver_bytes_received'])} | {_mib(r['driver_bytes_sent'])} "
                f"| {r['peak_rss_bytes'] / MiB:.0f} (+{r['peak_rss_growth_bytes'] / MiB:.0f}) "
                f"| {_mib(r['store_bytes']) if path == 'tq' else '-'} | {_ms(r['fetch_rank_mean_s'])} / {_ms(r['fetch_rank_max_s'])} |"
            )
    lines += ["", "Side by side (legacy / TQ):", "", *compact_table(rows)]
    lines += ["", "Targets:", "", "| target | points | measured | result |", "|---|---|---|---|"]
    for t in result["targets"]:
        verdict = "n/a" if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
        lines.append(f"| {t['target']} | {t.get('point', '')} | {t['value']} | {verdict} |")
    lines += ["", "Sweeps: " + "; ".join(f"{name}: {', '.join(p.key for p in pts)}" for name, pts in sweeps.items() if pts), ""]
    return "\n".join(lines)


def plots(result: dict[str, Any], out: RunOutput) -> list[str]:
    """Step time and driver bytes vs batch size (batch sweep), fetch per rank vs DP; one line per path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["summary"]
    batch_keys = [Point(**p).key for p in result["sweeps"].get("batch", [])]
    dp_keys = [Point(**p).key for p in result["sweeps"].get("dp", [])]
    title = f"{result['mode']} generation, {result['machine']['device']}"
    files = []
    specs = [
        ("step_time", batch_keys, "batch", lambda r: r["step_s"], "step time (s, median)", False),
        ("driver_bytes", batch_keys, "batch", lambda r: r["driver_bytes"] / MiB, "driver bytes per step (MiB, received + sent)", True),
        ("fetch", dp_keys, "dp", lambda r: 1e3 * r["fetch_rank_mean_s"], "fetch per rank per step (ms, mean over ranks)", False),
    ]
    for name, keys, xkey, fn, ylabel, logy in specs:
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        for path, style in (("legacy", "o-"), ("tq", "s-")):
            pts = sorted((r[xkey], fn(r)) for r in rows if r["path"] == path and r["point"] in keys)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=LABEL[path])
        some = next(r for r in rows if r["point"] in keys)
        xs = sorted({r[xkey] for r in rows if r["point"] in keys})
        if xkey == "batch":
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("batch size (prompts x generations)" if xkey == "batch" else "DP ranks (fixed per-rank shard)")
        ax.set_ylabel(ylabel)
        if xkey == "batch":
            ax.set_title(f"{title}\n{some['response_len']} response tokens, DP={some['dp']}", fontsize=9)
        else:
            ax.set_title(f"{title}\n{some['response_len']} response tokens", fontsize=9)
            ax.set_ylim(bottom=0)
        if logy:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path_png = out.path(f"_{name}.png")
        fig.savefig(path_png, dpi=110)
        plt.close(fig)
        files.append(path_png)
    return files


# ----------------------------------------------------------------------------- main
def machine_info(gpu: bool) -> dict[str, Any]:
    import ray
    import torch

    device = f"{os.cpu_count()}-CPU {platform.machine()}"
    if gpu and torch.cuda.is_available():
        device = f"{torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} GPU) + {os.cpu_count()} CPUs"
    return {
        "device": device,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "platform": platform.platform(),
    }


def run_name(mode: str) -> str:
    """File-name stem of a run's outputs: ``compare_paths`` (synthetic generation) or ``compare_paths_real``."""
    return "compare_paths" if mode == "synthetic" else f"compare_paths_{mode}"


def build_parser() -> argparse.ArgumentParser:
    """The command line (every option with its help)."""
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1]
    )
    p.add_argument(
        "--mode",
        choices=("synthetic", "real"),
        default="synthetic",
        help="synthetic: random tokens of the requested length, no model (default); real: the tiny model generates",
    )
    p.add_argument("--quick", action="store_true", help="2 points, 2 steps each (< 2 minutes on 2 cores)")
    p.add_argument("--gpu", action="store_true", help="CUDA: a 113M-parameter decoder in bf16, one DP rank per GPU")
    p.add_argument(
        "--steps", type=int, default=None, help="steps per run (default 4; --mode real on CPU 8; --quick 2); the first is excluded"
    )
    p.add_argument("--points", default=None, help="only these points of the sweep, e.g. b64_L1024_dp2,b256_L1024_dp2")
    p.add_argument(
        "--custom-points",
        default=None,
        help="run these points instead of the sweep (as its batch sweep), e.g. 2x4x64@1,16x4x64@1 "
        "(prompts x generations x response tokens @ DP ranks)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per (path, point) run (default 900)")
    p.add_argument(
        "--from-json", default=None, help="only re-render the markdown and plots of an earlier run's JSON (into a fresh run directory)"
    )
    add_output_args(p, "compare_paths[_real]")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)

    if a.child:  # one (path, point) run in this fresh process
        spec = json.loads(a.child)
        res = run_one(spec["path"], spec["overrides"])
        with open(a.child_out, "w") as f:
            json.dump(res, f)
        return 0

    if a.from_json:
        with open(a.from_json) as f:
            result = json.load(f)
        sweeps = {k: [Point(**pt) for pt in v] for k, v in result["sweeps"].items()}
        result["targets"] = check_targets(result["summary"], sweeps)
        out = open_run(run_name(result["mode"]), a.run_dir)
        write_reports(result, out)
        out.finish(a.publish, a.machine, gpu=result.get("gpu", False))
        return 0

    gpus = 0
    if a.gpu:
        import torch

        if not torch.cuda.is_available():
            print(
                "error: --gpu needs a CUDA device, and torch.cuda.is_available() is False here "
                f"(torch {torch.__version__}); run without --gpu for the CPU sweep",
                file=sys.stderr,
            )
            return 2
        gpus = torch.cuda.device_count()
    steps = a.steps or (2 if a.quick else 8 if a.mode == "real" and not a.gpu else 4)  # real CPU steps are short and vary more
    if steps < 1:
        p.error("--steps must be >= 1")
    if a.custom_points:
        try:
            custom = parse_points(a.custom_points)
        except ValueError as exc:
            p.error(str(exc))
        sweeps = {"batch": custom, "seq": [], "dp": []}
    else:
        sweeps = build_sweep(a.mode, quick=a.quick, gpu=a.gpu, gpus=gpus)
    points = unique_points(sweeps)
    if a.points:
        wanted = set(a.points.split(","))
        unknown = wanted - {pt.key for pt in points}
        if unknown:
            p.error(f"unknown points {sorted(unknown)}; this sweep has {[pt.key for pt in points]}")
        points = [pt for pt in points if pt.key in wanted]
        sweeps = {k: [pt for pt in v if pt.key in wanted] for k, v in sweeps.items()}
    out = open_run(run_name(a.mode), a.run_dir)
    log_path = out.path(".log")
    open(log_path, "w").close()
    model = "113M-parameter decoder (common.models.MODEL_113M), bf16" if a.gpu else "tiny-random (2 layers, 64 wide), float32"
    print(
        f"compare_paths: mode={a.mode}{' (quick)' if a.quick else ''}{' gpu' if a.gpu else ''}, {len(points)} points x 2 paths, "
        f"{steps} steps each; run logs in {log_path}",
        flush=True,
    )

    t_start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, pt in enumerate(points):
            order = PATHS if i % 2 == 0 else PATHS[::-1]  # alternate which path goes first
            for path in order:
                res = _spawn(path, pt, overrides(pt, a.mode, steps, os.path.join(tmp, "logs"), a.gpu), log_path, a.timeout)
                res["point"] = asdict(pt)
                runs.append(res)
                s = summarize_run(res, pt)
                print(
                    f"  {pt.key:>18s} {path:6s}: step {s['step_s']:.3f}s, data movement {s['data_movement_s']:.3f}s, "
                    f"driver {s['driver_bytes'] / MiB:.3f} MiB, peak RSS {s['peak_rss_bytes'] / MiB:.0f} MiB, "
                    f"fetch/rank {_ms(s['fetch_rank_mean_s'])} ms  ({res['process_wall_s']:.0f}s wall)",
                    flush=True,
                )
    summary = [summarize_run(r, Point(**r["point"])) for r in runs]
    result = {
        "mode": a.mode,
        "quick": a.quick,
        "gpu": a.gpu,
        "steps": steps,
        "model": model,
        "machine": machine_info(a.gpu),
        "sweeps": {k: [asdict(pt) for pt in v] for k, v in sweeps.items()},
        "wall_s": time.perf_counter() - t_start,
        "summary": summary,
        "runs": runs,
    }
    result["targets"] = check_targets(summary, sweeps)
    write_reports(result, out)
    out.finish(a.publish, a.machine, gpu=a.gpu)
    return 0


def write_reports(result: dict[str, Any], out: RunOutput) -> None:
    """The run's ``.json``, ``.md`` and PNG plots; prints the markdown."""
    with open(out.path(".json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    md = markdown(result)
    with open(out.path(".md"), "w") as f:
        f.write(md)
    plots(result, out)
    print()
    print(md)
    print(f"({result['wall_s'] / 60:.1f} min)")


if __name__ == "__main__":
    sys.exit(main())
