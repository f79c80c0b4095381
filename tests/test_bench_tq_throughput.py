"""The throughput benchmark: batch shapes, payload accounting, the shared padding code, the ratio table,
and a tiny real run (a TQ service, a producer process) that writes its own run directory."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from benchmarks.outputs import RESULTS_DIR, snapshot
from benchmarks.tq_throughput import FIELDS, MiB, Unavailable, main, make_batch, merge_rounds, pad_batch, padded, payload_bytes, report


def test_payload_bytes_counts_exactly_the_batch_bytes():
    for size, seed in ((MiB, 1), (2 * MiB, 7)):
        b = make_batch(size, seed)
        assert payload_bytes(size, seed) == sum(b[f].numel() * b[f].element_size() for f in (*FIELDS, "rewards"))


def test_baselines_pad_with_the_same_code_into_the_same_result_as_a_trainer_needs():
    """``pad_batch`` (TQ's C row copier, every field into one pooled buffer in one call as TQ's get copies,
    given to Ray and transferqueue) gives the padded tensors bit for bit, from read-only sources too
    (Ray's zero-copy views are read-only)."""
    from tq.bufferpool import HostBufferPool

    b = make_batch(MiB, 3)
    frozen = {}
    for f in (*FIELDS, "rewards"):
        arr = b[f].numpy().copy()
        arr.flags.writeable = False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch: the array is not writable (once per process)
            frozen[f] = torch.from_numpy(arr)
    got, want = pad_batch(frozen, b["offsets"], HostBufferPool()), padded(b)
    for f, t in want.items():
        assert got[f].dtype == t.dtype and torch.equal(got[f], t), f


def test_pad_fields_pads_each_field_to_its_own_longest_row_in_one_buffer():
    """Fields with their own offsets (transferqueue's nested tensors) each get their own width; every
    part starts on a cache line of the one pooled buffer."""
    from benchmarks.tq_throughput import pad_fields
    from tq.bufferpool import HostBufferPool
    from tq.jagged import JaggedTensor

    a_off, b_off = torch.tensor([0, 3, 4, 9]), torch.tensor([0, 1, 2, 4])
    a, b = torch.arange(9, dtype=torch.int64), torch.tensor([True, False, True, True])
    got = pad_fields({"a": (a, a_off.numpy()), "b": (b, b_off.numpy())}, HostBufferPool(min_pooled_bytes=0))
    assert torch.equal(got["a"], JaggedTensor(a, a_off).to_padded()) and got["a"].shape == (3, 5)
    assert torch.equal(got["b"], JaggedTensor(b, b_off).to_padded()) and got["b"].shape == (3, 2)
    assert got["b"].data_ptr() - got["a"].data_ptr() == 128  # one buffer: a's 120 bytes, b on the next cache line


def _system(size: int, put: float, get: float, **more: float) -> dict:
    return {size: {"put": [1.0, put], "get": [1.0, get], "bytes": 8_000_000, **{k: [1.0, v] for k, v in more.items()}}}


def test_report_computes_ratios_against_baselines_of_the_same_run():
    size = 8 * MiB
    res = {
        "memcpy": {size: {"copy": [10e9, 20e9], "pad": [5e9, 12.5e9], "bytes": 8_000_000}},
        "tq": {size: {"put": [3e9, 4e9], "get": [2.5e9, 10e9, 8e9, 10e9], "bytes": 8_000_000}},
        "tq_tcp": _system(size, 1e9, 2e9),
        "ray": _system(size, 0.5e9, 2.5e9, put_padded=0.4e9, get_views=20e9),
        "transferqueue": _system(size, 0.5e9, 0.2e9),
        "control_ops": {"put, 1 key (same host)": {"p50_ms": 0.3, "p99_ms": 0.6}},
        "unavailable": {},
    }
    table = report(res, [size])
    r = res["ratios"][0]
    assert (r["get_vs_memcpy"], r["get_vs_ray"], r["get_vs_transferqueue"]) == (0.5, 4.0, 50.0)
    assert (r["put_vs_transferqueue"], r["tcp_get_vs_transferqueue"], r["get_vs_ray_views"]) == (8.0, 10.0, 0.5)
    assert (r["get_vs_padding"], r["padding_vs_ray"]) == (0.8, 5.0)  # the padding alone: 12.5 GB/s
    assert "| 8 MiB | 0.50x | 0.80x | 4.00x | 5.00x | 0.50x | n/a | 50.00x | 8.00x | 8.00x | 10.00x |" in table
    assert "| 8 MiB | 8 | 20.00 | 12.50 | 4.00 | 10.00 |" in table  # memcpy, padding only, TQ put, TQ get
    assert "| 8 MiB | 10.00 | 2.50 |" in table  # cold gets: memcpy's and TQ's first iterations
    assert res["targets"]["get_vs_ray"] == {"target": 2.0, "worst": 4.0, "met": True, "bound": 5.0}
    assert not res["targets"]["control_p99_over_bar"]["met"]  # 0.6 ms: over the same-host 1-key put's 0.5 ms
    assert res["targets"]["cold_get_gbps"]["met"]
    assert res["targets"]["warm_get_floor"] == {"target": 0.5, "worst": 0.8, "met": True}
    res["tq_growing"] = {size: {"get": [2e9, 10e9, 4e9, 10e9], "bytes": 8_000_000}}  # a growing batch's outlier
    table = report(res, [size])
    assert res["targets"]["warm_get_floor"] == {"target": 0.5, "worst": 0.4, "met": False}
    assert "warm median 10.00 GB/s (the fixed 8 MiB batch: 10.00), slowest / median 0.40" in table
    del res["tq_growing"]
    res["transferqueue"][size].update(get_views=[1.0, 0.3e9], put_padded=[1.0, 1e9])  # the faster forms are compared
    table = report(res, [size])
    assert res["ratios"][0]["get_vs_transferqueue"] == pytest.approx(100 / 3) and "| 1.00 [padded] | 0.30 [views] |" in table
    assert res["ratios"][0]["put_vs_transferqueue"] == 4.0 and "| 0.50 [jagged] | 2.50 | 20.00 |" in table  # Ray
    res["tq"][size]["get"] = [1e9, 3e9, 0.5e9]  # 1.75 GB/s warm: under 2x Ray; cold 1 GB/s; an outlier
    res["control_ops"]["put, 1 key (same host)"]["p99_ms"] = 0.4  # within its 0.5 ms
    res["control_ops"]["put, 1 key (tcp)"] = {"p50_ms": 0.5, "p99_ms": 0.9}  # within the project's 1 ms
    res["tq"][size]["borrowed"] = [5e9, 30e9, 30e9]  # 1.5x Ray views
    report(res, [size])
    t = res["targets"]
    assert not any(t[k]["met"] for k in ("get_vs_ray", "get_vs_memcpy", "cold_get_gbps", "warm_get_floor"))
    res["memcpy"][size]["pad"] = [1.0, 4e9]  # a get that only padded would be 1.6x Ray: the report says so
    assert "get_vs_ray 0.70 vs 2.0 - NOT met (a get costing only its padding: 1.60 at that size)" in report(res, [size])
    assert t["control_p99_over_bar"]["met"] and t["control_p99_over_bar"]["worst"] == pytest.approx(0.9)
    assert t["borrowed_vs_ray_views"] == {"target": 1.0, "worst": 1.5, "met": True}
    assert t["get_vs_transferqueue"]["met"]


def test_a_system_that_did_not_run_reads_n_a_with_the_reason_and_sets_no_target():
    size = 8 * MiB
    res = {
        "memcpy": {size: {"copy": [1.0, 20e9], "bytes": 8_000_000}},
        "tq": _system(size, 4e9, 10e9),
        "tq_tcp": None,
        "ray": None,
        "transferqueue": None,
        "control_ops": {},
        "unavailable": {"transferqueue": "transferqueue not installed: pip install -e '.[bench]'"},
    }
    table = report(res, [size])
    assert "| 8 MiB | 0.50x | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a |" in table  # no padding-only run either
    assert "- transferqueue: n/a - transferqueue not installed: pip install -e '.[bench]'" in table
    assert set(res["targets"]) == {"get_vs_memcpy", "control_p99_over_bar", "cold_get_gbps", "warm_get_floor"}


def test_transferqueue_missing_says_how_to_install_it():
    try:
        import transfer_queue  # noqa: F401
    except ImportError:
        from benchmarks.tq_throughput import bench_transferqueue

        with pytest.raises(Unavailable, match=r"pip install -e '\.\[bench\]'"):
            bench_transferqueue([MiB], 1)
    else:
        pytest.skip("transferqueue is installed here")


def test_memcpy_ceiling_copies_every_byte_of_the_batch_a_producer_process_wrote():
    """The ceiling's first copy is checked against the batch (it raises otherwise), covers the whole
    payload, and small sizes run 3x the iterations."""
    from benchmarks.tq_throughput import bench_memcpy

    res = bench_memcpy([MiB], 1)[MiB]
    assert res["bytes"] == payload_bytes(MiB, 1000)
    assert len(res["copy"]) == 3 and all(r > 0 for r in res["copy"])
    assert len(res["pad"]) == 3 and all(r > 0 for r in res["pad"])  # its first padding is checked too


def test_padding_only_reads_the_columns_out_of_the_bytes_the_producer_wrote():
    from benchmarks.tq_throughput import _shm_columns, batch_bytes

    b = make_batch(MiB, 5)
    cols, offsets = _shm_columns(np.concatenate(batch_bytes(b)), MiB, 5)
    assert torch.equal(offsets, b["offsets"])
    assert all(torch.equal(cols[f], b[f]) for f in (*FIELDS, "rewards"))


def test_rounds_pool_every_rounds_warm_iterations_behind_the_first_cold_one():
    size = 8 * MiB
    r1 = {size: {"put": [1.0, 10.0, 11.0], "get": [2.0, 20.0, 21.0], "bytes": 5}}
    r2 = {size: {"put": [3.0, 12.0, 13.0], "get": [4.0, 22.0, 23.0], "bytes": 5}}
    m = merge_rounds([r1, r2])[size]
    assert m["put"] == [1.0, 10.0, 11.0, 12.0, 13.0]  # round 2's cold 3.0 is left out
    assert m["get"] == [2.0, 20.0, 21.0, 22.0, 23.0] and m["bytes"] == 5
    assert merge_rounds([r1]) == r1


def test_a_tiny_run_writes_its_run_dir_and_leaves_the_published_results_alone(tmp_path, capsys):
    before = snapshot(RESULTS_DIR)
    run = tmp_path / "run"
    assert (
        main(
            [
                "--sizes-mib",
                "1",
                "--iters",
                "1",
                "--rounds",
                "1",
                "--skip",
                "ray",
                "transferqueue",
                "tcp",
                "--control-iters",
                "20",
                "--run-dir",
                str(run),
            ]
        )
        == 0
    )
    assert snapshot(RESULTS_DIR) == before
    assert sorted(p.name for p in run.iterdir()) == ["tq_throughput.json", "tq_throughput.md"]
    res = json.loads((run / "tq_throughput.json").read_text())
    assert len(res["tq"][str(MiB)]["get"]) == 3 and res["ray"] is None
    assert len(res["tq_growing"][str(MiB)]["get"]) == 3  # the growing batch, from the largest size run
    assert res["unavailable"]["ray"] == "left out (--skip ray)"
    assert {"put, 1 key (same host)", "get, 1 key (tcp)"} <= set(res["control_ops"])
    assert all(np.isfinite(v["p99_ms"]) for v in res["control_ops"].values())
    out = capsys.readouterr().out
    assert str(run) in out and "benchmarks/results/ untouched" in out
    again = tmp_path / "again"  # the report rebuilt from the run's JSON is the same report
    assert main(["--from-json", str(run / "tq_throughput.json"), "--run-dir", str(again)]) == 0
    assert (again / "tq_throughput.md").read_text() == (run / "tq_throughput.md").read_text()
    assert snapshot(RESULTS_DIR) == before


def test_writers_report_rates_four_writers_against_one_warm():
    from benchmarks.tq_throughput import writers_report

    rows = [
        {"writers": n, "put_cold": 1e9 * n**0.5, "put_warm": w, "get_cold": 2e9, "get_warm": 4e9 * n}
        for n, w in ((1, 2e9), (2, 4e9), (4, 6e9))
    ]
    res = {"rows": rows, "puts_per_writer": 4, "batch_bytes": 32 * MiB, "cores": 32, "machine": "m", "profiles": {}}
    table = writers_report(res)
    assert "| 4 | 2.00 | 6.00 | 3.00x | 2.00 | 16.00 | 4.00x |" in table
    assert res["target"] == {"target": 2.5, "measured": 3.0, "met": True, "cores": 32}
    res["cores"] = 2
    assert "fewer than 8 cores" in writers_report(res)


def test_writers_report_has_the_one_key_put_table():
    from benchmarks.tq_throughput import writers_report

    rows = [{"writers": 1, "put_cold": 1e9, "put_warm": 2e9, "get_cold": 2e9, "get_warm": 4e9}]
    small = [{"writers": n, "puts_per_s": r, "p50_ms": 0.3 * n, "p99_ms": 0.9 * n} for n, r in ((1, 2500.0), (16, 8000.0))]
    res = {"rows": rows, "puts_per_writer": 4, "batch_bytes": 32 * MiB, "cores": 32, "machine": "m", "profiles": {}}
    assert "1-key puts" not in writers_report(res)
    res.update(small_rows=small, small_puts_per_writer=2000)
    table = writers_report(res)
    assert "| 16 | 8,000 | 3.20x | 4.800 | 14.400 |" in table and "| 1 | 2,500 | 1.00x | 0.300 | 0.900 |" in table


def test_the_writers_sweep_runs_one_key_puts_from_every_writer_count():
    """A real (tiny) sweep: its 1-key put pass counts what every writer did."""
    from benchmarks.tq_throughput import bench_writers

    res = bench_writers([1, 2], 1 * MiB, 1, small_puts=20)
    assert [r["writers"] for r in res["small_rows"]] == [1, 2] and res["small_puts_per_writer"] == 20
    assert all(r["puts_per_s"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"] for r in res["small_rows"])
    assert res["controller_ops"]["commit"]["count"] >= 3 * 20 + 3 * 50  # the small puts and their warm-ups committed
