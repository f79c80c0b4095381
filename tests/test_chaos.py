"""Chaos (issue 16), the CI version: ``benchmarks.tq_chaos`` with 4 clients for 36 seconds (about a minute).

Real processes against a service started with a journal dir on a fixed port, while the fault driver
SIGKILLs and SIGSTOPs storage units and the controller (restarting a killed controller the operator's
way). Nothing a put or write-back acknowledged may be lost, no read may return bytes that were not
written there, no client call may hang past its timeout, every fault kind is injected and recovered
from, and afterwards no process and no shared-memory file of the run is left. The long run (8 clients,
10 minutes, >= 50 faults of every kind) is ``python -m benchmarks.tq_chaos``.
"""

from __future__ import annotations

import os

import psutil
import pytest

from benchmarks.tq_chaos import HANG_MARGIN_S, KINDS, drain_lines, run_chaos, summary

TIMEOUT = 2.0


@pytest.mark.timeout(240)
@pytest.mark.long
# the open run in the slow set: the signed run goes through the same code and checks every signature
# too (a minute of CI each; the published chaos runs are open)
@pytest.mark.parametrize("secret", [pytest.param(None, marks=pytest.mark.slow), "chaos-ci-s3cret"], ids=["open", "secret"])
def test_short_chaos_loses_nothing_and_leaves_nothing(tmp_path, monkeypatch, secret):
    """Run with a secret for every process of the run (``TQ_SECRET``, which the controller, its units
    and every client take) - so every request is signed and checked, and a same-host connection that
    fails the check or sends nothing authenticated is closed, under faults - and (slow set) without."""
    if secret is None:
        monkeypatch.delenv("TQ_SECRET", raising=False)
    else:
        monkeypatch.setenv("TQ_SECRET", secret)
    lines: list[str] = []
    report = run_chaos(
        duration=36.0,
        clients=4,
        faults_min=2,
        seed=3,
        run_dir=str(tmp_path / "run"),
        units=2,
        capacity=256 << 20,
        client_timeout=TIMEOUT,
        warmup_s=2.0,
        recovery_timeout=15.0,
        final_timeout=15.0,
        commit_lease_s=5.0,  # blocks whose commit a fault lost are reclaimed within seconds of the final discard
        drain_bound_s=15.0,  # the commit lease + 10 s; a slab may take its whole 60 s allocation lease (not waited for here)
        log=lines.append,
    )
    print("\n".join(lines) + "\n" + summary(report))
    notes = report["notes"][:20] + report["driver_anomalies"] + report["run_errors"]
    assert report["total_calls"] > 500 and report["verified_rows"] > 1000, notes  # it did real work
    assert report["borrowed_view_rows_rechecked"] > 100, notes  # borrowed views held over later ops and faults
    assert report["big_tcp_gets"] >= 1, notes  # a TCP get past one fetch request's bytes (several parts), under faults
    assert report["big_tcp_puts"] >= 1, notes  # and a TCP put as big (in lanes, on a host with the cores)
    assert report["clients_crashed"] == 0 and report["clients_missing"] == 0 and report["internal_errors"] == 0, notes

    # the hard invariants
    assert report["lost_acked_writes"] == 0, notes
    assert report["wrong_bytes_reads"] == 0, notes
    assert report["longest_call_s"] <= TIMEOUT + HANG_MARGIN_S, (report["longest_call_kind"], report["ops"])
    assert report["longest_in_flight_s"] <= TIMEOUT + HANG_MARGIN_S and report["clients_killed"] == 0
    for kind in KINDS:
        assert report["faults"][kind]["injected"] >= 1, report["fault_log"]
    assert report["unrecovered"] is None and all(r["recovery_s"] is not None for r in report["fault_log"]), report["fault_log"]

    # after the final discard every block is freed within the commit lease + 10 s (else a leak); a slab
    # granted just before its writer gave up (a unit SIGSTOP) stays until its 60 s allocation lease
    # ends, which the benchmark's own bound covers - too long to wait for here
    d = report["drain_after_discard"]
    assert not d["end"]["rows_waiting_for_leases"], drain_lines(d)
    for u in d["end"]["units"]:
        assert u["alive"] and u["blocks"] == 0 and u["bytes_used"] == 0 and u["pending_allocs"] == 0, drain_lines(d)

    # shut down cleanly; nothing of the run is left
    sd = report["shutdown"]
    assert not report["run_errors"] and sd["controller_exit_code"] == 0, (report["run_errors"], sd)
    assert sd["processes_left"] == [] and sd["shm_files_left"] == [], sd
    assert sd["processes_after_cleanup"] == [] and sd["shm_files_after_cleanup"] == [], sd
    assert not os.path.exists(sd["shm_dir"])
    for p in psutil.process_iter(["cmdline"]):
        assert sd["shm_dir"] not in (p.info["cmdline"] or []), p
    left = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"tq-loc-{pid}-") for pid in sd["controller_pids"])]
    assert left == [], left


def test_a_run_dir_holding_an_earlier_runs_state_is_refused_before_anything_starts(tmp_path):
    """A reused --run-dir would restart the service from the old run's journal (its partitions back,
    the canary's registration refused): refused at once, naming the directory."""
    (tmp_path / "state").mkdir()
    with pytest.raises(ValueError, match="holds an earlier run's service state"):
        run_chaos(duration=5.0, run_dir=str(tmp_path), log=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]
