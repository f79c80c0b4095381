"""A quick point of ``benchmarks.dataplane_scale``: both paths run one real step at two payload sizes
(DP=1, real Ray actors, a real TQ service) and their measured quantities are consistent - every byte
of the batch reaches the rank on both paths, legacy's driver bytes grow with the payload while TQ's
stay flat, and nothing is left in TQ. Real measurements, no timings asserted."""

from __future__ import annotations

import pytest

from benchmarks import dataplane_scale as ds


@pytest.mark.timeout(240)
@pytest.mark.long
def test_tq_driver_bytes_do_not_grow_with_payload_while_legacys_do():
    small, big = ds.Point(1, 16, 64, 2), ds.Point(1, 16, 1024, 2, images=1)
    rows = ds.run_sweep([small, big], steps=1, timeout=120, log=lambda *_: None)
    row = {(r["point"], r["path"]): r for r in rows}
    grown = big.payload_bytes() - small.payload_bytes()
    for p in (small, big):
        for path in ds.PATHS:
            r = row[p.key, path]
            # The rank read at least the whole unpadded batch (training columns + log-prob inputs).
            assert sum(r["rank_bytes"]) >= r["payload_bytes"] > 0
        assert row[p.key, "tq"]["store_bytes_after"] == 0  # finish_step cleared the step's keys
    legacy = row[big.key, "legacy"]["driver_bytes"] - row[small.key, "legacy"]["driver_bytes"]
    tq = row[big.key, "tq"]["driver_bytes"] - row[small.key, "tq"]["driver_bytes"]
    assert legacy > 2 * grown  # in with the rollout and out with the shards, at least
    assert abs(tq) < 0.01 * grown  # handles and per-sample scalars only
    assert row[big.key, "tq"]["driver_bytes"] < 0.01 * row[big.key, "legacy"]["driver_bytes"]


def test_the_get_sweep_reads_the_same_bytes_in_every_field_count():
    """The get sweep stores every count's batch at once (a partition each: a field's width differs
    between counts) and times round-robin gets of them."""
    out = ds.get_sweep_tq(n=8, length=32, field_counts=(1, 2, 32), iters=1)
    assert sorted(out) == [1, 2, 32]
    assert len({v["bytes"] for v in out.values()}) == 1 and all(v["gb_s"] > 0 for v in out.values())


def test_targets_are_computed_from_the_rows():
    """``check_targets`` on hand-made rows: the ratios and verdicts follow the numbers given."""
    pts = {"dp": [ds.Point(1, 8, 64), ds.Point(2, 16, 64)], "payload": [ds.Point(2, 16, 64), ds.Point(2, 16, 256)]}

    def row(p, path, moved, fetch, nbytes, rss):
        return {
            "point": p.key,
            "path": path,
            "data_movement_s": moved,
            "rank_fetch_mean_s": fetch,
            "driver_bytes": nbytes,
            "peak_rss_growth": rss,
            "payload_bytes": p.payload_bytes(),
        }

    rows = []
    for p in pts["dp"] + pts["payload"][1:]:
        big = p.payload_bytes()
        rows += [row(p, "legacy", 1.0, 0.5, 3 * big, big), row(p, "tq", 0.1, 0.01, 1000, 0)]
    gets = {"tq": {1: {"gb_s": 10.0}, 32: {"gb_s": 9.0}}}
    targets = ds.check_targets(rows, pts, gets, cores=4)
    out = {word: next(t for t in targets if word in t["target"]) for word in ("movement", "fetch", "32 fields")}
    assert out["movement"]["ratio"] == pytest.approx(10.0) and out["movement"]["passed"]
    assert out["fetch"]["passed"] is True
    assert out["32 fields"]["ratio"] == pytest.approx(0.9) and out["32 fields"]["passed"]
    slopes = [t for t in ds.check_targets(rows, pts, gets, cores=1) if "slope" in t]
    assert all(t["passed"] for t in slopes) and slopes[0]["slope"]["legacy"] == pytest.approx(3.0)
    assert next(t for t in ds.check_targets(rows, pts, gets, cores=1) if "fetch" in t["target"])["passed"] is None
