"""Load (issue 8), the CI version: ``benchmarks.tq_soak`` with 6 client processes for 20 seconds.

Real processes (spawned) against a real controller and storage units on loopback: random puts, gets,
write-backs, discards and clears of random shapes, every row read back checked against the sha256 of
what was written. Zero errors, zero corrupted or lost samples, and after the final clear the storage
units are back to zero bytes, blocks and allocations and the controller's RSS near its warm level.
The long run (32 processes, 10 minutes) is ``python -m benchmarks.tq_soak``.
"""

from __future__ import annotations

import pytest

from benchmarks.tq_soak import run_soak, summary


# slow since the chaos test (tests/test_chaos.py) runs the same ops under faults in CI
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_short_soak_loses_nothing_and_leaks_nothing():
    lines: list[str] = []
    report = run_soak(procs=6, duration=20.0, units=2, capacity=256 << 20, seed=1, sample_every=5.0, log=lines.append)
    print("\n".join(lines) + "\n" + summary(report))
    assert report["errors"] == 0, report["notes"]
    assert report["corrupted"] == 0 and report["lost"] == 0, report["notes"]
    assert report["verified_samples"] > 1000 and report["total_ops"] > 500  # it did real work
    assert set(report["ops"]) >= {"put", "get", "write_back", "discard", "meta"}
    assert report["leftover_keys"] == 0
    for unit in report["units_after_clear"]:
        assert unit["bytes_used"] == 0 and unit["blocks"] == 0 and unit["pending_allocs"] == 0, unit
    assert not report["leak"] and report["ok"]


# ----------------------------------------------------------------------------- findings
def test_finding_discard_releases_controller_memory():
    """A long-lived partition that is only ever discarded from (the async trainer's replay buffer) must
    not grow the controller: 160k keys put and discarded, none live, should cost no memory."""
    import psutil
    import torch

    from tq import TQClient, TQServer

    with TQServer(storage_units=1, capacity=64 << 20) as server, TQClient(server.address, timeout=30.0, transport="tcp") as c:
        c.register_partition("long-lived")
        controller = psutil.Process(server.proc.pid)
        column = {"x": torch.zeros(64, 1)}

        def churn(tag: str, rounds: int) -> None:
            for i in range(rounds):
                c.discard(c.put("long-lived", [f"{tag}{i}-{j}" for j in range(64)], column))

        churn("warm", 200)
        before = controller.memory_info().rss
        churn("k", 2500)
        growth = controller.memory_info().rss - before
        assert c.get_meta("long-lived").keys == ()
        assert growth < 4 << 20, f"controller RSS grew {growth / 2**20:.1f} MiB for 160000 discarded keys"
