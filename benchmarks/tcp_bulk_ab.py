"""Bulk TCP get (or put) throughput of two source trees in one run: a client reading big batches from a
one-unit service over its TCP stream socket (what a reader on another node does) - or, with ``--op
put``, writing them (what a rollout worker on another node does) - the code of tree A against the code
of tree B.

Each tree runs in a process of its own (its ``tq`` first on ``PYTHONPATH``) with its own one-unit
service, so client and servers are all A's or all B's. Rounds alternate which tree goes first; each
round, each tree puts one batch per size (jagged int32 rows, 64 samples) from a same-host writer and
reads it back ``--iters`` times after one untimed get, with ``--readers`` clients at once (aggregate
GB/s); with ``--op put`` each TCP client puts such a batch ``--iters`` times under fresh keys after one
untimed put (read back from the same host and checked; every put is discarded after its timing). A
size's figure is the median over rounds of each round's median.

    git worktree add /tmp/base main && cp tq/_fastcopy*.so /tmp/base/tq/   # tree A: the code before
    python -m benchmarks.tcp_bulk_ab --a /tmp/base --b . --name tcp_lanes_ab --publish

Reported, not a target: B's GB/s over A's per size (a change that reads faster on a host with cores to
spare may read the same on a 2-vCPU one, where client, unit and their threads share two cores).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

MiB = 1 << 20
_MARK = "@tcpbulk "  # the worker's result line (its service's processes print on the same stdout)


def worker(sizes: list[int], iters: int, readers: int, op: str = "get") -> dict[str, Any]:
    """One tree's run: per size, each timed get's (or put's) aggregate GB/s (all ``readers`` at once)."""
    import torch

    import tq
    from tq import JaggedTensor, TQClient, TQServer

    out: dict[str, Any] = {"tq": os.path.dirname(tq.__file__), "gbps": {}}
    with TQServer(storage_units=1, capacity=max(sizes) * max(2, readers + 1) + 64 * MiB) as srv, TQClient(srv.address) as writer:
        clients = [TQClient(srv.address, transport="tcp", timeout=120.0) for _ in range(readers)]
        try:
            writer.register_partition("bulk")
            with concurrent.futures.ThreadPoolExecutor(readers) as pool:
                for size in sizes:
                    n, row = 64, size // 64 // 4
                    values = torch.randint(0, 1000, (n * row,), dtype=torch.int32)
                    batch = {"tokens": JaggedTensor(values, torch.arange(0, n * row + 1, row))}
                    if op == "put":
                        out["gbps"][str(size)] = _puts(writer, clients, pool, batch, size, iters)
                        continue
                    meta = writer.put("bulk", [f"s{size}-{i}" for i in range(n)], batch)

                    def get(c: TQClient) -> Any:
                        return c.get(meta, ["tokens"], layout="jagged")

                    for got in pool.map(get, clients):  # untimed: each reader's connections and buffers
                        assert torch.equal(got["tokens"].values, values), "a TCP get returned other bytes"
                    del got
                    rates = []
                    for _ in range(iters):
                        t0 = time.perf_counter()
                        list(pool.map(get, clients)) if readers > 1 else get(clients[0])
                        rates.append(readers * size / (time.perf_counter() - t0) / 1e9)
                    out["gbps"][str(size)] = rates
                    writer.discard(meta)
        finally:
            for c in clients:
                c.close()
    return out


def _puts(
    writer: Any, clients: list[Any], pool: concurrent.futures.ThreadPoolExecutor, batch: dict[str, Any], size: int, iters: int
) -> list[float]:
    """Each TCP client puts ``batch`` under fresh keys, all at once: one untimed round (read back from
    the same host and checked), then ``iters`` timed; the aggregate GB/s of each timed round. Every
    round's keys are discarded after its timing."""
    import torch

    n = len(batch["tokens"])

    def put(c: Any, r: int, i: int) -> Any:
        return c.put("bulk", [f"p{size}-{r}-{i}-{k}" for k in range(n)], batch)

    rates = []
    for r in range(iters + 1):
        t0 = time.perf_counter()
        metas = list(pool.map(put, clients, [r] * len(clients), range(len(clients))))
        took = time.perf_counter() - t0
        if r == 0:
            for meta in metas:
                got = writer.get(meta, ["tokens"], layout="jagged")["tokens"].values
                assert torch.equal(got, batch["tokens"].values), "a TCP put stored other bytes"
        else:
            rates.append(len(clients) * size / took / 1e9)
        for meta in metas:
            writer.discard(meta)
    return rates


def run_tree(root: str, sizes: list[int], iters: int, readers: int, op: str = "get") -> dict[str, Any]:
    """:func:`worker` in a process importing the tree at ``root`` first."""
    from benchmarks.ab_trees import tree_env  # not at import: a worker runs with the other tree's benchmarks first

    root = os.path.abspath(root)
    env = tree_env(root)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", ",".join(map(str, sizes)), str(iters), str(readers), op]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            res = json.loads(line[len(_MARK) :])
            if res["tq"] != os.path.join(root, "tq"):
                raise SystemExit(f"tcp_bulk_ab: tree {root} imported tq from {res['tq']}")
            return res
    raise SystemExit(f"tcp_bulk_ab: the worker of {root} exited with code {proc.returncode}: {proc.stderr[-2000:]}")


def summarize(rounds: dict[str, list[dict[str, list[float]]]], a: str, b: str) -> dict[str, dict[str, float]]:
    """Per size: each tree's median over rounds of its round medians, and B / A."""
    rows = {}
    for size in rounds[a][0]:
        med = {label: statistics.median(statistics.median(r[size]) for r in rounds[label]) for label in (a, b)}
        rows[size] = {a: med[a], b: med[b], "ratio": med[b] / med[a]}
    return rows


def build_parser() -> argparse.ArgumentParser:
    from benchmarks.ab_trees import add_ab_args

    p = argparse.ArgumentParser(prog="python -m benchmarks.tcp_bulk_ab", description=__doc__.split("\n\n")[0])
    add_ab_args(p, "tcp_bulk_ab", rounds=3)
    p.add_argument("--sizes", default="16,64,256", help="batch sizes in MiB, comma-separated (default: 16,64,256)")
    p.add_argument("--op", choices=("get", "put"), default="get", help="what the TCP clients time (default: get)")
    p.add_argument("--iters", type=int, default=5, help="timed gets (puts) per size, tree and round (default 5)")
    p.add_argument("--readers", type=int, default=1, help="TCP clients reading (putting) at once (default 1)")
    return p


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        sizes, iters, readers = [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4])
        print(_MARK + json.dumps(worker(sizes, iters, readers, sys.argv[5])), flush=True)
        return
    from benchmarks.ab_trees import check_trees, run_head
    from benchmarks.outputs import open_run

    p = build_parser()
    a = p.parse_args()
    try:
        sizes = [int(x) * MiB for x in a.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes must be MiB counts separated by commas, got {a.sizes!r}")
    if not sizes or min(sizes) < MiB or a.iters < 1 or a.readers < 1 or a.rounds < 1:
        p.error("--sizes >= 1 MiB each, --iters, --readers and --rounds >= 1")
    trees = check_trees(p, a)
    out = open_run(a.name, a.run_dir)
    rounds: dict[str, list[dict[str, list[float]]]] = {label: [] for label in trees}
    for r in range(a.rounds):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for label in order:
            rounds[label].append(run_tree(trees[label], sizes, a.iters, a.readers, a.op)["gbps"])
        print(
            f"round {r + 1}/{a.rounds}: "
            + "; ".join(
                f"{label} " + ", ".join(f"{int(s) // MiB} MiB {statistics.median(v):.2f}" for s, v in rounds[label][-1].items())
                for label in trees
            ),
            flush=True,
        )
    la, lb = a.label_a, a.label_b
    rows = summarize(rounds, la, lb)
    res = {
        **run_head(trees),
        "iters": a.iters,
        "op": a.op,
        "readers": a.readers,
        "rounds": a.rounds,
        "sizes": rows,
        "per_round": rounds,
    }
    lines = [
        f"# Bulk TCP {a.op}, two source trees: {la} ({res['trees'][la]['commit']}) vs {lb} ({res['trees'][lb]['commit']})\n",
        f"Machine: {res['machine']}. Each tree's client and one-unit service in processes of their own, over the "
        f"unit's TCP stream socket on loopback; {a.readers} client(s) at once, {a.iters} timed {a.op}s per size "
        f"after one untimed; GB/s (aggregate), the median over {a.rounds} rounds of each round's median.\n",
        f"| batch | {la} GB/s | {lb} GB/s | {lb} / {la} |",
        "|---|---|---|---|",
        *(f"| {int(s) // MiB} MiB | {v[la]:.2f} | {v[lb]:.2f} | {v['ratio']:.2f}x |" for s, v in rows.items()),
    ]
    out.write_report(res, lines)
    out.finish(a.publish, a.machine)


if __name__ == "__main__":
    main()
