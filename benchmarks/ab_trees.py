"""Control-op latency of two source trees in one run: benchmarks/tq_throughput.py's control table
(``control_ops``: 1-key puts and gets, waits, get_meta ...) against the code of tree A and of tree B.

Each tree runs in a process of its own (its ``tq`` and ``benchmarks`` first on ``PYTHONPATH``, as
``python -c "import tq; print(tq.__file__)"`` would show) with its own one-unit service started from
that tree, so client and servers are all A's or all B's. As in benchmarks/metrics_overhead.py, both
services are up at once and every op's timed calls alternate between them - here in chunks of
``--chunk`` calls, A-B-B-A... (a chunk is timed in its tree's process; the other waits on a pipe) - so
a slow phase of a shared machine lands on both. Each op's p50/p99 is the median over ``--rounds``; every
round starts both services afresh, the first one alternating.

    git worktree add /tmp/base main && cp tq/_fastcopy*.so /tmp/base/tq/   # tree A: the code before
    python -m benchmarks.ab_trees --a /tmp/base --b . --name typed_replies_ab --publish

Target: B's summed p99 at most 5% above A's (no regression of the control ops).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

TARGET = 1.05  # B's summed p99 / A's
_MARK = "@ab "  # the worker's lines to the runner (its service's processes print on the same stdout)


# ----------------------------------------------------------------------------- paired summaries
def paired_rows(
    tables: dict[str, list[dict[str, dict[str, float]]]], a: str, b: str
) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Per op, the medians over rounds of ``a``'s and ``b``'s p50/p99 and the p99 ratio b/a; and the
    summed p99s with their ratio (no single noisy op decides). ``tables[side]``: one table per round."""

    def med(side: str, op: str, key: str) -> float:
        return statistics.median(t[op][key] for t in tables[side])

    rows: dict[str, dict[str, float]] = {}
    for op in tables[a][0]:
        rows[op] = {f"{k}_{s}": med(s, op, k) for k in ("p50_ms", "p99_ms") for s in (a, b)}
        rows[op]["p50_ratio"] = rows[op][f"p50_ms_{b}"] / rows[op][f"p50_ms_{a}"]
        rows[op]["p99_ratio"] = rows[op][f"p99_ms_{b}"] / rows[op][f"p99_ms_{a}"]
    total = {s: sum(v[f"p99_ms_{s}"] for v in rows.values()) for s in (a, b)}
    total["ratio"] = total[b] / total[a]
    return rows, total


def paired_table(rows: dict[str, dict[str, float]], total: dict[str, float], a: str, b: str) -> list[str]:
    """The markdown table of :func:`paired_rows`."""
    lines = [
        f"| op | p50 {a} ms | p50 {b} ms | p50 {b}/{a} | p99 {a} ms | p99 {b} ms | p99 {b}/{a} |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {n} | {v[f'p50_ms_{a}']:.3f} | {v[f'p50_ms_{b}']:.3f} | {v['p50_ratio']:.3f} | "
        f"{v[f'p99_ms_{a}']:.3f} | {v[f'p99_ms_{b}']:.3f} | {v['p99_ratio']:.3f} |"
        for n, v in rows.items()
    ]
    lines.append(f"| **sum of the p99s** | | | | {total[a]:.3f} | {total[b]:.3f} | **{total['ratio']:.3f}** |")
    return lines


# ----------------------------------------------------------------------------- one tree's process
def worker() -> None:
    """Serve timing requests (JSON lines on stdin) with this tree's control table and service."""
    import tq
    from tq import TQServer

    from benchmarks.tq_throughput import CONTROL_WARMUP, MiB, control_ops

    def say(obj: dict[str, Any]) -> None:
        sys.stdout.write(_MARK + json.dumps(obj) + "\n")
        sys.stdout.flush()

    with TQServer(storage_units=1, capacity=64 * MiB) as server, control_ops(server.address) as (ops, reset):
        say({"ops": list(ops), "tq": os.path.dirname(os.path.abspath(tq.__file__))})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["do"] == "stop":
                break
            fn = ops.get(cmd.get("op"))
            if cmd["do"] == "warm":
                for _ in range(CONTROL_WARMUP):
                    fn()
                say({})
            elif cmd["do"] == "time":
                lat = []
                for _ in range(cmd["n"]):
                    t0 = time.perf_counter()
                    fn()
                    lat.append(time.perf_counter() - t0)
                say({"lat": lat})
            elif cmd["do"] == "reset":
                reset()
                say({})
    say({"stopped": True})


def tree_env(root: str) -> dict[str, str]:
    """The environment of a process running the tree at ``root``: the tree first on ``PYTHONPATH``, the
    rest of the caller's path after it (where the dependencies live off site-packages)."""
    root = os.path.abspath(root)
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != root]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([root, *rest]))


def add_ab_args(p: argparse.ArgumentParser, name: str, rounds: int) -> None:
    """What every two-tree A/B takes: ``--a`` / ``--b`` (the two source trees) and their labels,
    ``--rounds`` (default ``rounds``), ``--name`` (default ``name``) and the output options."""
    from benchmarks.outputs import add_output_args

    p.add_argument(
        "--a",
        required=True,
        metavar="DIR",
        help="tree A (the baseline): a checkout, or a `git archive` export (it names its commit), with tq/_fastcopy*.so built",
    )
    p.add_argument("--b", required=True, metavar="DIR", help="tree B (the change)")
    p.add_argument("--label-a", default="old", help="tree A's name in the table (default: old)")
    p.add_argument("--label-b", default="new", help="tree B's name in the table (default: new)")
    p.add_argument("--rounds", type=int, default=rounds, help=f"rounds; the tree that goes first alternates (default {rounds})")
    p.add_argument("--name", default=name, help=f"the run's name, and of its published files (default: {name})")
    add_output_args(p, "<name>")


def check_trees(p: argparse.ArgumentParser, a: argparse.Namespace) -> dict[str, str]:
    """The two trees by label, once both are source trees of this project and the labels differ
    (else the parser's error, at once)."""
    if a.label_a == a.label_b:
        p.error("--label-a and --label-b must differ")
    for d in (a.a, a.b):
        if not os.path.isfile(os.path.join(d, "tq", "__init__.py")):
            p.error(f"{d} is not a source tree of this project (no tq/__init__.py)")
    return {a.label_a: a.a, a.label_b: a.b}


def run_head(trees: dict[str, str]) -> dict[str, Any]:
    """The head of a two-tree run's result: the machine, the code running the run, and each tree's
    directory and commit (a `git archive` export names its own)."""
    from benchmarks.outputs import code_version, cpu_model

    return {
        "machine": f"{platform.node()} - {len(os.sched_getaffinity(0))} usable CPUs ({cpu_model()}), Python {platform.python_version()}",
        "code": code_version(),
        "trees": {label: {"dir": os.path.abspath(d), **code_version(d)} for label, d in trees.items()},
    }


class Tree:
    """A worker process running the code of one source tree (see :func:`worker`)."""

    def __init__(self, label: str, root: str) -> None:
        self.label, self.root = label, os.path.abspath(root)
        env = tree_env(self.root)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker"],
            cwd=self.root,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        hello = self._read()
        if hello.get("tq") != os.path.join(self.root, "tq"):
            self.close()
            raise SystemExit(f"ab_trees: tree {label} imported tq from {hello.get('tq')}, not from {self.root}")
        self.ops: list[str] = hello["ops"]

    def _read(self) -> dict[str, Any]:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if line.startswith(_MARK):
                return json.loads(line[len(_MARK) :])
        raise SystemExit(f"ab_trees: the worker of tree {self.label} ({self.root}) exited with code {self.proc.wait()}")

    def ask(self, **cmd: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask(do="stop")
            except (SystemExit, BrokenPipeError):
                pass
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def paired_round(trees: dict[str, str], iters: int, chunk: int, first: str) -> dict[str, dict[str, dict[str, float]]]:
    """One round: both trees' services up at once, every op's ``iters`` timed calls alternating between
    them in chunks (``first``'s first); {label: table}."""
    from benchmarks.tq_throughput import latency_summary

    labels = [first, *(x for x in trees if x != first)]
    sides: dict[str, Tree] = {}
    try:
        for label in labels:
            sides[label] = Tree(label, trees[label])
        ops = sides[labels[0]].ops
        if any(s.ops != ops for s in sides.values()):
            raise SystemExit(f"ab_trees: the trees time different control tables: {[s.ops for s in sides.values()]}")
        tables: dict[str, dict[str, dict[str, float]]] = {label: {} for label in labels}
        for op in ops:
            for s in sides.values():
                s.ask(do="warm", op=op)
            lat: dict[str, list[float]] = {label: [] for label in labels}
            for c in range(-(-iters // chunk)):
                n = min(chunk, iters - c * chunk)
                for label in labels if c % 2 == 0 else labels[::-1]:
                    lat[label] += sides[label].ask(do="time", op=op, n=n)["lat"]
            for label, s in sides.items():
                s.ask(do="reset", op=op)
                tables[label][op] = latency_summary(lat[label])
        return tables
    finally:
        for s in sides.values():
            s.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_ab_args(p, "ab_trees", rounds=4)
    p.add_argument("--control-iters", type=int, default=2000, help="timed calls per op, tree and round")
    p.add_argument("--chunk", type=int, default=100, help="timed calls of one tree before the other's turn")
    return p


def main() -> None:
    if sys.argv[1:] == ["--worker"]:
        worker()
        return
    from benchmarks.outputs import open_run

    p = build_parser()
    a = p.parse_args()
    if a.control_iters < 100 or a.chunk < 1 or a.rounds < 1:
        p.error("--control-iters must be >= 100 (a p99 needs them), --chunk and --rounds >= 1")
    trees = check_trees(p, a)
    out = open_run(a.name, a.run_dir)
    tables: dict[str, list[dict[str, dict[str, float]]]] = {label: [] for label in trees}
    for r in range(a.rounds):
        first = a.label_a if r % 2 == 0 else a.label_b
        round_tables = paired_round(trees, a.control_iters, a.chunk, first)
        for label, t in round_tables.items():
            tables[label].append(t)
        worst = {label: max(v["p99_ms"] for v in t.values()) for label, t in round_tables.items()}
        print(f"round {r + 1}/{a.rounds}: worst p99 " + ", ".join(f"{k} {v:.3f} ms" for k, v in worst.items()), flush=True)
    rows, total = paired_rows(tables, a.label_a, a.label_b)
    worst_op = max(v["p99_ratio"] for v in rows.values())
    res = {
        **run_head(trees),
        "control_iters": a.control_iters,
        "chunk": a.chunk,
        "rounds": a.rounds,
        "ops": rows,
        "per_round": tables,
        "p99_sum_ms": total,
        "worst_op_p99_ratio": worst_op,
        "target": {"p99_ratio_max": TARGET, "met": total["ratio"] <= TARGET},
    }
    la, lb = a.label_a, a.label_b
    lines = [
        f"# Control-op latency, two source trees: {la} ({res['trees'][la]['commit']}) vs {lb} ({res['trees'][lb]['commit']})\n",
        f"Machine: {res['machine']}. tq_throughput's control table; {a.rounds} rounds x {a.control_iters} calls per op and "
        f"tree, each tree's client and one-unit service in processes of their own, both up at once, calls "
        f"alternating between the trees in chunks of {a.chunk} (A-B-B-A); medians over rounds.\n",
        *paired_table(rows, total, la, lb),
        "",
        f"Target: the summed p99 of {lb} at most {TARGET:.2f}x {la}'s: {'met' if total['ratio'] <= TARGET else 'NOT met'} "
        f"({total['ratio']:.3f}x; the worst single op {worst_op:.3f}x).",
    ]
    out.write_report(res, lines)
    out.finish(a.publish, a.machine)


if __name__ == "__main__":
    main()
