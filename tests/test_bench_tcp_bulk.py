"""benchmarks/tcp_bulk_ab.py: a real run of two trees (here the same one under two labels) writes its
table, and bad options fail at once naming what is wrong."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.outputs import REPO
from benchmarks.tcp_bulk_ab import MiB, summarize


def test_the_table_is_the_median_over_rounds_of_each_rounds_median():
    rounds = {
        "a": [{"1": [1.0, 2.0, 9.0]}, {"1": [3.0, 3.0, 3.0]}, {"1": [0.5, 1.0, 1.5]}],
        "b": [{"1": [4.0]}, {"1": [2.0]}, {"1": [6.0]}],
    }
    assert summarize(rounds, "a", "b") == {"1": {"a": 2.0, "b": 4.0, "ratio": 2.0}}


@pytest.mark.parametrize("op", ["get", "put"])
def test_a_run_of_two_labels_writes_both_trees_figures(tmp_path, op):
    """Puts with four TCP clients at once: each writes its own keys, read back and checked - into a
    service with room for all of them (4 x 40 MiB: it once had room for two batches whatever the
    clients, and the run failed)."""
    cmd = [sys.executable, "-m", "benchmarks.tcp_bulk_ab", "--a", REPO, "--b", REPO, "--label-a", "x", "--label-b", "y"]
    big, clients = (40, "4") if op == "put" else (3, "1")
    args = ["--op", op, "--readers", clients, "--sizes", f"1,{big}", "--iters", "2", "--rounds", "1", "--run-dir", str(tmp_path)]
    out = subprocess.run([*cmd, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads((tmp_path / "tcp_bulk_ab.json").read_text())
    assert set(res["sizes"]) == {str(MiB), str(big * MiB)}
    for row in res["sizes"].values():
        assert row["x"] > 0 and row["y"] > 0 and abs(row["ratio"] - row["y"] / row["x"]) < 1e-9
    table = (tmp_path / "tcp_bulk_ab.md").read_text()
    assert res["op"] == op and f"Bulk TCP {op}" in table and f"| {big} MiB |" in table


def test_bad_sizes_and_trees_fail_before_anything_runs(tmp_path):
    base = [sys.executable, "-m", "benchmarks.tcp_bulk_ab", "--run-dir", str(tmp_path)]
    bad = subprocess.run(
        [*base, "--a", REPO, "--b", REPO, "--label-a", "x", "--sizes", "16,lots"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "--sizes must be MiB counts" in bad.stderr
    bad = subprocess.run([*base, "--a", str(tmp_path), "--b", REPO, "--label-a", "x"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "is not a source tree of this project" in bad.stderr
