"""What the Prometheus metrics cost: benchmarks/tq_throughput.py's control table (its own function,
``bench_control_ops``: p50/p99 of 1-key puts and gets, waits, get_meta ...) against a service started
without metrics and one started with them (``TQ_METRICS_PORT``, which the table's embedded TQServer
passes on as ``--metrics-port``: histograms and bytes recorded per op, the endpoint scraped every second
by another process, 15x Prometheus' default rate), in one run. The two take turns ``--rounds`` times in A-B-B-A order, so a
slow phase of a shared machine does not land on one of them; each op's p50/p99 is the median over rounds.

    python -m benchmarks.metrics_overhead                 # --control-iters 2000, 4 rounds
    python -m benchmarks.metrics_overhead --publish       # also benchmarks/results/metrics_overhead_<machine>.*

Target: the control ops' p99 with metrics at most 5% above it without.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
from typing import Any

from benchmarks.outputs import add_output_args, code_version, cpu_model, open_run
from benchmarks.tq_throughput import bench_control_ops

TARGET = 1.05  # p99 with metrics / p99 without
SCRAPE_EVERY_S = 1.0  # default; Prometheus' own default is 15 s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The scraper is a process of its own, as Prometheus is: it must not compete with the timed client for its GIL.
_SCRAPER = """
import signal, sys, time, urllib.error, urllib.request
url, every, n = sys.argv[1], float(sys.argv[2]), 0
signal.signal(signal.SIGTERM, lambda *_: (print(n, flush=True), sys.exit(0)))
while True:
    time.sleep(every)
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            n += b"tq_op_latency_seconds_bucket" in r.read()
    except (urllib.error.URLError, ConnectionError):  # the table's service is not up yet, or gone
        pass
"""


class Scraper:
    """Scrapes ``url`` every ``every_s`` seconds from another process; ``stop`` returns how many scrapes
    returned TQ metrics."""

    def __init__(self, url: str, every_s: float) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _SCRAPER, url, str(every_s)], stdout=subprocess.PIPE, text=True)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        out, _ = self.proc.communicate(timeout=30)
        return int(out.strip() or 0)


def run_table(metrics: bool, iters: int, scrape_every_s: float) -> tuple[dict[str, dict[str, float]], int]:
    """tq_throughput's control table against a service with or without metrics; (table, scrapes)."""
    if not metrics:
        os.environ.pop("TQ_METRICS_PORT", None)
        return bench_control_ops(iters), 0
    port = _free_port()
    os.environ["TQ_METRICS_PORT"] = str(port)
    scraper = Scraper(f"http://127.0.0.1:{port}/metrics", scrape_every_s)
    try:
        table = bench_control_ops(iters)
    finally:
        scrapes = scraper.stop()
        os.environ.pop("TQ_METRICS_PORT", None)
    return table, scrapes


def recording_cost_ns(n: int = 200_000) -> dict[str, float]:
    """Nanoseconds a server's loop spends per request on its own bookkeeping (``RpcServer._record`` and
    the request's byte count), metrics off and on: the part of the overhead no scrape adds to."""
    import time

    import zmq

    from tq.rpc import Call, RpcServer

    server = RpcServer("bench", "tcp://127.0.0.1:0", secret=None, max_message_bytes=1 << 20)
    frames_in = [zmq.Frame(b"h" * 120), zmq.Frame(b"m" * 32)]
    frames_out = [b"r" * 80, b"m" * 32]
    out = {}
    try:
        for metrics in (False, True, False, True):  # twice each, the second pass kept (warm)
            server.metrics = metrics
            t0 = time.perf_counter()
            for _ in range(n):
                call = Call(b"id", 1, "op", time.perf_counter(), sum(map(len, frames_in)) if server.metrics else 0)
                server._record(call, frames_out, ok=True)
            out["on" if metrics else "off"] = (time.perf_counter() - t0) / n * 1e9
    finally:
        server.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--control-iters", type=int, default=2000, help="timed calls per op, service and round")
    p.add_argument("--rounds", type=int, default=4, help="rounds; each runs both services (A-B, then B-A)")
    p.add_argument(
        "--scrape-every",
        type=float,
        default=SCRAPE_EVERY_S,
        metavar="S",
        help="seconds between scrapes of the metrics service (Prometheus' default: 15)",
    )
    add_output_args(p, "metrics_overhead")
    a = p.parse_args()
    if a.control_iters < 100 or a.rounds < 1 or a.scrape_every <= 0:
        p.error("--control-iters must be >= 100 (a p99 needs them), --rounds >= 1 and --scrape-every > 0")
    out = open_run("metrics_overhead", a.run_dir)
    tables: dict[bool, list[dict[str, dict[str, float]]]] = {False: [], True: []}
    scrapes = 0
    for r in range(a.rounds):
        for metrics in (False, True) if r % 2 == 0 else (True, False):
            table, n = run_table(metrics, a.control_iters, a.scrape_every)
            tables[metrics].append(table)
            scrapes += n
            print(
                f"round {r + 1}/{a.rounds}, metrics {'on' if metrics else 'off'}: "
                f"worst p99 {max(v['p99_ms'] for v in table.values()):.3f} ms",
                flush=True,
            )
    record_ns = recording_cost_ns()
    if not scrapes:
        raise SystemExit("metrics_overhead: no scrape of the metrics service returned TQ metrics: nothing was measured")

    def med(metrics: bool, op: str, key: str) -> float:
        return statistics.median(t[op][key] for t in tables[metrics])

    rows: dict[str, dict[str, Any]] = {}
    for op in tables[False][0]:
        rows[op] = {f"{k}_{m}": med(flag, op, k) for k in ("p50_ms", "p99_ms") for m, flag in (("off", False), ("on", True))}
        rows[op]["p99_ratio"] = rows[op]["p99_ms_on"] / rows[op]["p99_ms_off"]
    total_off, total_on = (sum(v[f"p99_ms_{m}"] for v in rows.values()) for m in ("off", "on"))
    ratio = total_on / total_off  # the table's p99s summed: no single noisy op decides
    worst = max(v["p99_ratio"] for v in rows.values())
    machine = f"{platform.node()} - {len(os.sched_getaffinity(0))} usable CPUs ({cpu_model()}), Python {platform.python_version()}"
    res = {
        "machine": machine,
        "code": code_version(),
        "control_iters": a.control_iters,
        "rounds": a.rounds,
        "scrapes": scrapes,
        "scrape_every_s": a.scrape_every,
        "ops": rows,
        "per_round": {"off": tables[False], "on": tables[True]},
        "p99_sum_ms": {"off": total_off, "on": total_on, "ratio": ratio},
        "record_ns_per_request": record_ns,
        "worst_op_p99_ratio": worst,
        "target": {"p99_ratio_max": TARGET, "met": ratio <= TARGET},
    }
    lines = [
        "# Metrics overhead: tq_throughput's control ops without and with `--metrics-port`\n",
        f"Machine: {machine}. {a.rounds} rounds x {a.control_iters} calls per op and service, services alternating "
        f"A-B/B-A, medians over rounds; the metrics service scraped every {a.scrape_every:g} s ({scrapes} scrapes).\n",
        "| op | p50 off ms | p50 on ms | p99 off ms | p99 on ms | p99 on/off |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {n} | {v['p50_ms_off']:.3f} | {v['p50_ms_on']:.3f} | {v['p99_ms_off']:.3f} | {v['p99_ms_on']:.3f} | {v['p99_ratio']:.3f} |"
        for n, v in rows.items()
    ]
    lines += [
        f"| **sum of the p99s** | | | {total_off:.3f} | {total_on:.3f} | **{ratio:.3f}** |",
        "",
        f"Target: the control table's p99 with metrics at most {TARGET:.2f}x without: "
        f"{'met' if ratio <= TARGET else 'NOT met'} ({ratio:.3f}x; the worst single op {worst:.3f}x).",
        "",
        f"A server's own bookkeeping per request (count, latency window; with metrics also the histogram "
        f"and bytes in/out), timed alone: {record_ns['off']:.0f} ns off, {record_ns['on']:.0f} ns on.",
    ]
    with open(out.path(".json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(out.path(".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    out.finish(a.publish, a.machine)


if __name__ == "__main__":
    main()
