"""The throughput benchmark's pure parts: batch shapes, payload accounting and the ratio table."""

from __future__ import annotations

from benchmarks.tq_throughput import FIELDS, MiB, make_batch, merge_rounds, payload_bytes, report


def test_payload_bytes_counts_exactly_the_batch_bytes():
    for size, seed in ((MiB, 1), (2 * MiB, 7)):
        b = make_batch(size, seed)
        assert payload_bytes(size, seed) == sum(b[f].numel() * b[f].element_size() for f in (*FIELDS, "rewards"))


def test_report_computes_ratios_against_baselines_of_the_same_run():
    size = 8 * MiB

    def sys(put: float, get: float) -> dict:
        return {size: {"put": [1.0, put], "get": [1.0, get], "bytes": 8_000_000}}

    res = {"memcpy": {size: {"copy": [1.0, 20e9], "bytes": 8_000_000}}, "tq": sys(4e9, 10e9), "tq_tcp": sys(1e9, 2e9),
           "ray": sys(0.5e9, 2.5e9), "transferqueue": sys(0.5e9, 0.2e9), "control_ops": {"op": {"p50_ms": 0.1, "p99_ms": 0.2}}}
    table = report(res, [size])
    r = res["ratios"][0]
    assert (r["get_vs_memcpy"], r["get_vs_ray"], r["get_vs_transferqueue"]) == (0.5, 4.0, 50.0)
    assert (r["put_vs_transferqueue"], r["tcp_get_vs_transferqueue"]) == (8.0, 10.0)
    assert "| 8 MiB | 0.50x | 4.00x | 50.00x | 8.00x | 10.00x |" in table
    assert res["targets"]["get_vs_ray"] == {"target": 2.0, "worst": 4.0, "met": True}
    assert res["targets"]["get_vs_memcpy"]["met"] and res["targets"]["control_p99_ms"]["met"]
    res["tq"][size]["get"][1] = 3e9  # 1.2x Ray, 0.15x memcpy: both bars missed
    report(res, [size])
    assert not res["targets"]["get_vs_ray"]["met"] and not res["targets"]["get_vs_memcpy"]["met"]
    assert res["targets"]["get_vs_transferqueue"]["met"]


def test_a_skipped_system_reads_n_a_and_sets_no_target():
    size = 8 * MiB
    run = {size: {"put": [1.0, 4e9], "get": [1.0, 10e9], "bytes": 8_000_000}}
    res = {"memcpy": {size: {"copy": [1.0, 20e9], "bytes": 8_000_000}}, "tq": run, "tq_tcp": None, "ray": None,
           "transferqueue": None, "control_ops": {}}
    table = report(res, [size])
    assert "| 8 MiB | 0.50x | n/a | n/a | n/a | n/a |" in table
    assert set(res["targets"]) == {"get_vs_memcpy", "control_p99_ms"}  # never TQ measured against itself


def test_memcpy_ceiling_copies_every_byte_of_the_batch_a_producer_process_wrote():
    """The ceiling's first copy is checked against the batch (it raises otherwise), covers the whole
    payload, and small sizes run 3x the iterations."""
    from benchmarks.tq_throughput import bench_memcpy

    res = bench_memcpy([MiB], 1)[MiB]
    assert res["bytes"] == payload_bytes(MiB, 1000)
    assert len(res["copy"]) == 3 and all(r > 0 for r in res["copy"])


def test_rounds_pool_every_rounds_warm_iterations_behind_the_first_cold_one():
    size = 8 * MiB
    r1 = {size: {"put": [1.0, 10.0, 11.0], "get": [2.0, 20.0, 21.0], "bytes": 5, "form": "padded"}}
    r2 = {size: {"put": [3.0, 12.0, 13.0], "get": [4.0, 22.0, 23.0], "bytes": 5, "form": "jagged"}}
    m = merge_rounds([r1, r2])[size]
    assert m["put"] == [1.0, 10.0, 11.0, 12.0, 13.0]  # round 2's cold 3.0 is left out
    assert m["get"] == [2.0, 20.0, 21.0, 22.0, 23.0] and m["bytes"] == 5 and m["form"] == "jagged/padded"
    assert merge_rounds([r1]) == r1
