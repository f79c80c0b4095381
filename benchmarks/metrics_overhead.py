"""What the Prometheus metrics cost: benchmarks/tq_throughput.py's control table (its own operations,
``control_ops``: 1-key puts and gets, waits, get_meta ...) against a service started without metrics and
one started with them (``TQ_METRICS_PORT``, which the embedded TQServer passes on as ``--metrics-port``:
histograms and bytes recorded per op, the endpoint scraped every second by another process, 15x
Prometheus' default rate).

Two services of one configuration differ by more than 5% from one start to the next (which cores and
caches their processes land on), so the two are measured side by side, not one after the other: in
each round both are up at once and every op's timed calls alternate between them (off, on, on, off,
...), so a slow phase of the machine lands on both. With 12 or more usable CPUs each service's
processes (controller, unit, metrics endpoint, and the scraper with the metrics one) are pinned to
cores of their own, the client to others, and the services swap cores every round. Each op's p50/p99
is the median over ``--rounds``.

    python -m benchmarks.metrics_overhead                 # --control-iters 2000, 4 rounds
    python -m benchmarks.metrics_overhead --publish       # also benchmarks/results/metrics_overhead_<machine>.*

Target: the control ops' p99 with metrics at most 5% above it without.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import socket
import subprocess
import sys
import time
from typing import Iterator

import zmq

from benchmarks.ab_trees import paired_rows, paired_table
from benchmarks.outputs import add_output_args, code_version, cpu_model, open_run
from benchmarks.tq_throughput import CONTROL_WARMUP, MiB, control_ops, latency_summary

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


Placement = dict[str, set[int]]


def placements() -> list[Placement] | None:
    """Cores for the client and the two services, and the same with the services' cores swapped (for
    alternate rounds); None on a machine too small to give each its own (then nothing is pinned)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 12:
        return None
    client, a, b = set(cpus[1:3]), set(cpus[3:7]), set(cpus[7:11])  # cpu 0 takes most interrupts
    return [{"client": client, "off": a, "on": b}, {"client": client, "off": b, "on": a}]


@contextlib.contextmanager
def _cores(cores: set[int] | None) -> Iterator[None]:
    """Run the block (and every process it starts) on ``cores``; None: leave the affinity alone."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def paired_round(iters: int, scrape_every_s: float, place: Placement | None) -> tuple[dict[str, dict[str, dict[str, float]]], int]:
    """One round: a service without and one with metrics up at once, every control op's ``iters``
    timed calls alternating between them; ({"off": table, "on": table}, scrapes)."""
    from tq import TQServer

    where = (lambda who: place[who]) if place else (lambda who: None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_cores(where("client")))
        zmq.Context.instance()  # its I/O threads start now, on the client's cores
        servers, scraper = {}, None
        for mode in ("off", "on"):
            with _cores(where(mode)):  # the service's processes inherit these cores
                port = _free_port()
                if mode == "on":
                    os.environ["TQ_METRICS_PORT"] = str(port)
                try:
                    servers[mode] = stack.enter_context(TQServer(storage_units=1, capacity=64 * MiB))
                finally:
                    os.environ.pop("TQ_METRICS_PORT", None)
                if mode == "on":
                    scraper = Scraper(f"http://127.0.0.1:{port}/metrics", scrape_every_s)
        try:
            sides = {mode: stack.enter_context(control_ops(servers[mode].address)) for mode in ("off", "on")}
            tables: dict[str, dict[str, dict[str, float]]] = {"off": {}, "on": {}}
            for name in sides["off"][0]:
                calls = {mode: ops[name] for mode, (ops, _) in sides.items()}
                for _ in range(min(CONTROL_WARMUP, iters)):
                    calls["off"]()
                    calls["on"]()
                lat: dict[str, list[float]] = {"off": [], "on": []}
                for i in range(iters):
                    for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                        t0 = time.perf_counter()
                        calls[mode]()
                        lat[mode].append(time.perf_counter() - t0)
                for mode, (_, reset) in sides.items():
                    reset()
                    tables[mode][name] = latency_summary(lat[mode])
        finally:
            scrapes = scraper.stop() if scraper is not None else 0
    return tables, scrapes


def recording_cost_ns(n: int = 200_000) -> dict[str, float]:
    """Nanoseconds a server's loop spends per request on its own bookkeeping (``RpcServer._record`` and
    the request's byte count), metrics off and on: the part of the overhead no scrape adds to."""
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
    tables: dict[str, list[dict[str, dict[str, float]]]] = {"off": [], "on": []}
    scrapes = 0
    place = placements()
    for r in range(a.rounds):
        round_tables, n = paired_round(a.control_iters, a.scrape_every, place[r % 2] if place else None)
        tables["off"].append(round_tables["off"])
        tables["on"].append(round_tables["on"])
        scrapes += n
        worst = {m: max(v["p99_ms"] for v in t.values()) for m, t in round_tables.items()}
        print(f"round {r + 1}/{a.rounds}: worst p99 off {worst['off']:.3f} ms, on {worst['on']:.3f} ms", flush=True)
    record_ns = recording_cost_ns()
    if not scrapes:
        raise SystemExit("metrics_overhead: no scrape of the metrics service returned TQ metrics: nothing was measured")

    rows, total = paired_rows(tables, "off", "on")
    total_off, total_on, ratio = total["off"], total["on"], total["ratio"]  # the p99s summed: no single noisy op decides
    worst = max(v["p99_ratio"] for v in rows.values())
    machine = f"{platform.node()} - {len(os.sched_getaffinity(0))} usable CPUs ({cpu_model()}), Python {platform.python_version()}"
    res = {
        "machine": machine,
        "code": code_version(),
        "control_iters": a.control_iters,
        "rounds": a.rounds,
        "pinned": {k: sorted(v) for k, v in place[0].items()} if place else None,
        "scrapes": scrapes,
        "scrape_every_s": a.scrape_every,
        "ops": rows,
        "per_round": tables,
        "p99_sum_ms": {"off": total_off, "on": total_on, "ratio": ratio},
        "record_ns_per_request": record_ns,
        "worst_op_p99_ratio": worst,
        "target": {"p99_ratio_max": TARGET, "met": ratio <= TARGET},
    }
    pinning = (
        f"client on CPUs {sorted(place[0]['client'])}, the services on {sorted(place[0]['off'])} and {sorted(place[0]['on'])} "
        "(swapped every round)"
        if place
        else "nothing pinned (fewer than 12 CPUs)"
    )
    lines = [
        "# Metrics overhead: tq_throughput's control ops without and with `--metrics-port`\n",
        f"Machine: {machine}. {a.rounds} rounds x {a.control_iters} calls per op and service; both services up at "
        f"once, calls alternating between them; {pinning}; medians over rounds; the metrics service scraped every "
        f"{a.scrape_every:g} s ({scrapes} scrapes).\n",
        *paired_table(rows, total, "off", "on"),
        "",
        f"Target: the control table's p99 with metrics at most {TARGET:.2f}x without: "
        f"{'met' if ratio <= TARGET else 'NOT met'} ({ratio:.3f}x; the worst single op {worst:.3f}x).",
        "",
        f"A server's own bookkeeping per request (count, latency window; with metrics also the histogram "
        f"and bytes in/out), timed alone: {record_ns['off']:.0f} ns off, {record_ns['on']:.0f} ns on.",
    ]
    out.write_report(res, lines)
    out.finish(a.publish, a.machine)


if __name__ == "__main__":
    main()
