"""benchmarks/tq_interrupts.py: a short storm runs, interrupts calls, finds the client working after
each, and writes its run directory only (the published table is the full run's)."""

from __future__ import annotations

import json

from benchmarks import tq_interrupts


def test_a_short_storm_interrupts_calls_and_every_check_passes(tmp_path, capsys):
    rc = tq_interrupts.main(["--seconds", "3", "--settle-s", "0", "--run-dir", str(tmp_path)])
    assert rc == 0, capsys.readouterr().out
    r = json.loads((tmp_path / "tq_interrupts.json").read_text())
    assert r["ok"] and not r["failed_checks"] and not r["ignored_exceptions"] and r["interrupted"] > 0 and r["calls"] > r["interrupted"]
    assert {k.split()[0] for k in r["outcomes"]} == {"put", "write_back", "discard", "get_meta", "get", "borrow"}
    assert "interrupted" in (tmp_path / "tq_interrupts.md").read_text()
