"""The legacy-vs-TQ benchmark: the synthetic generation backend, the driver-traffic instrumentation, the
target checks, and one tiny end-to-end run of ``benchmarks.compare_paths`` (both trainers, real Ray
actors and a real TQ service, in fresh processes)."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from benchmarks import compare_paths as cp
from policy.traffic import payload_nbytes
from rollout.generation import GenerationBackendConfig, make_generation_backend
from rollout.generation.synthetic import SyntheticGenerationBackend

PROMPTS = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]


# ----------------------------------------------------------------------------- synthetic backend
def _backend(**kw) -> SyntheticGenerationBackend:
    return make_generation_backend(GenerationBackendConfig(backend="synthetic", **kw))


def test_synthetic_backend_emits_the_requested_lengths_and_dtypes():
    b = _backend()
    assert isinstance(b, SyntheticGenerationBackend)
    out = b.generate(PROMPTS * 3, max_new_tokens=300)
    assert [t.numel() for t in out.response_ids] == [300] * 6
    assert all(t.dtype == torch.int64 for t in out.response_ids)
    assert all(lp.dtype == torch.float32 and lp.shape == t.shape for lp, t in zip(out.logprobs, out.response_ids))
    lps = torch.cat(out.logprobs)
    assert bool((lps < 0).all()) and bool(torch.isfinite(lps).all())
    ids = torch.cat(out.response_ids)
    assert not bool(torch.isin(ids, torch.tensor(b.stop_token_ids)).any())  # full length: no stop token
    assert out.finish_reasons == ["length"] * 6 and out.weight_version == 0

    ranged = _backend(synthetic_min_new_tokens=10).generate(PROMPTS * 50, max_new_tokens=40)
    lengths = [t.numel() for t in ranged.response_ids]
    assert min(lengths) >= 10 and max(lengths) <= 40 and len(set(lengths)) > 5
    for t, reason in zip(ranged.response_ids, ranged.finish_reasons):  # shorter ones end with a stop token
        assert reason == ("length" if t.numel() == 40 else "stop")
        assert (int(t[-1]) in b.stop_token_ids) == (reason == "stop")


def test_synthetic_backend_is_deterministic_for_a_seed_and_refit_records_the_version():
    a, b, c = _backend(seed=3), _backend(seed=3), _backend(seed=4)
    outs = [x.generate(PROMPTS, max_new_tokens=64) for x in (a, b, c)]
    assert all(torch.equal(p, q) for p, q in zip(outs[0].response_ids, outs[1].response_ids))
    assert all(torch.equal(p, q) for p, q in zip(outs[0].logprobs, outs[1].logprobs))
    assert not all(torch.equal(p, q) for p, q in zip(outs[0].response_ids, outs[2].response_ids))
    second = a.generate(PROMPTS, max_new_tokens=64)  # the next call draws anew...
    assert not torch.equal(second.response_ids[0], outs[0].response_ids[0])
    state = a.sampling_state()
    again = _backend(seed=3)
    again.load_sampling_state(state)  # ...and a restored backend continues where the first one is
    assert torch.equal(again.generate(PROMPTS, max_new_tokens=64).response_ids[0], a.generate(PROMPTS, max_new_tokens=64).response_ids[0])
    a.update_weights({"w": torch.zeros(2)}, 7)
    assert a.weight_version == 7 and a.generate(PROMPTS, max_new_tokens=4).weight_version == 7
    with pytest.raises(ValueError, match="backend='synthetic'"):
        SyntheticGenerationBackend(GenerationBackendConfig(backend="hf"))


def test_refits_ship_no_weights_to_a_backend_that_loads_none():
    """Only backends with a model load weights; for the synthetic one the trainer's refit payload is an
    empty mapping, built without asking the policy for anything (its step time then holds no weight
    transfer the generator would ignore). The weight-shipping path runs in every end-to-end trainer test."""
    from types import SimpleNamespace

    from trainer.base import GRPOTrainerBase
    from trainer.config import MasterConfig

    assert [GenerationBackendConfig(backend=b).loads_weights for b in ("hf", "vllm", "synthetic")] == [True, True, False]
    cfg = MasterConfig.model_validate({"generation": {"backend": "synthetic"}})
    assert GRPOTrainerBase.refit_weights(SimpleNamespace(cfg=cfg, policy=None)) == {}


# ----------------------------------------------------------------------------- instrumentation
def test_payload_nbytes_counts_pickled_bytes_and_whole_storages():
    x = {"a": torch.zeros(1000), "b": [torch.ones(10, dtype=torch.int64), "text"], "c": 3}
    assert abs(payload_nbytes(x) - len(pickle.dumps(x))) < 2048  # the same as pickling, tensors included
    base = torch.zeros(100_000)
    assert payload_nbytes(base[:10]) >= 400_000  # torch pickles a view's whole storage, and so do we


# ----------------------------------------------------------------------------- target checks
def _row(point, path, *, step, bytes_, rss, fetch=0.01, tokens=None, batch=None):
    p = next(p for p in POINTS if p.key == point)
    return {
        "point": point,
        "path": path,
        "tokens": tokens or p.tokens,
        "batch": batch or p.batch,
        "step_s": step,
        "driver_bytes": bytes_,
        "peak_rss_bytes": rss,
        "fetch_rank_mean_s": fetch,
        "data_share": 0.1,
    }


POINTS = [cp.Point(2, 8, 64, 1), cp.Point(16, 8, 64, 1), cp.Point(4, 8, 64, 2), cp.Point(8, 8, 64, 4)]
SWEEPS = {"batch": POINTS[:2], "seq": [], "dp": [POINTS[0], POINTS[2], POINTS[3]]}


def test_check_targets_passes_and_fails_as_the_numbers_say():
    MiB = 1 << 20
    good = [
        _row("b16_L64_dp1", "legacy", step=1.0, bytes_=10 * MiB, rss=500 * MiB),
        _row("b16_L64_dp1", "tq", step=0.5, bytes_=0.05 * MiB, rss=400 * MiB, fetch=0.010),
        _row("b128_L64_dp1", "legacy", step=8.0, bytes_=80 * MiB, rss=600 * MiB),
        _row("b128_L64_dp1", "tq", step=4.0, bytes_=0.4 * MiB, rss=420 * MiB),
        _row("b32_L64_dp2", "legacy", step=2.0, bytes_=20 * MiB, rss=500 * MiB),
        _row("b32_L64_dp2", "tq", step=1.0, bytes_=0.1 * MiB, rss=400 * MiB, fetch=0.011),
        _row("b64_L64_dp4", "legacy", step=4.0, bytes_=40 * MiB, rss=500 * MiB),
        _row("b64_L64_dp4", "tq", step=2.0, bytes_=0.2 * MiB, rss=400 * MiB, fetch=0.012),
    ]
    checks = cp.check_targets(good, SWEEPS)
    assert [c["passed"] for c in checks] == [True] * 5, checks
    assert checks[0]["point"] == "b128_L64_dp1" and checks[0]["ratio"] == pytest.approx(0.005)
    assert checks[1]["tq_growth"] == pytest.approx(0.05) and checks[1]["legacy_growth"] == pytest.approx(0.2)
    assert checks[3]["ratio"] == pytest.approx(2.0)
    assert checks[4]["relative"] == {1: 1.0, 2: pytest.approx(1.1), 4: pytest.approx(1.2)}

    bad = [dict(r) for r in good]
    for r in bad:
        if r["path"] == "tq" and r["point"] == "b128_L64_dp1":
            r.update(driver_bytes=2 * MiB, peak_rss_bytes=500 * MiB, step_s=7.0)  # 2.5%, +25%, only 1.14x
        if r["path"] == "tq" and r["point"] == "b32_L64_dp2":
            r.update(step_s=2.2)  # slower than legacy here
        if r["path"] == "tq" and r["point"] == "b64_L64_dp4":
            r.update(fetch_rank_mean_s=0.0126)  # 1.26x DP=1's
    checks = cp.check_targets(bad, SWEEPS)
    assert [c["passed"] for c in checks] == [False] * 5, checks
    assert "b32_L64_dp2" in checks[2]["value"]

    partial = cp.check_targets(good[:2], {"batch": POINTS[:1], "seq": [], "dp": []})  # one point only
    assert [c["passed"] for c in partial] == [True, None, True, True, None]


# ----------------------------------------------------------------------------- GPU preset
def test_gpu_preset_builds_a_valid_config_of_a_100m_model_and_fails_clearly_without_cuda(tmp_path, capsys):
    from common.models import MODEL_113M, build_tiny_tokenizer, tiny_config
    from trainer.config import parse_cli

    for mode in ("synthetic", "real"):
        pts = cp.unique_points(cp.build_sweep(mode, gpu=True, gpus=1))
        cfg = parse_cli(cp.overrides(pts[-1], mode, 3, str(tmp_path), gpu=True))
        assert cfg.policy.dtype == "bfloat16" and cfg.policy.num_gpus_per_worker > 0 and cfg.policy.device == "cuda"
        assert cfg.policy.tiny_overrides["hidden_size"] == MODEL_113M["hidden_size"]
        assert cfg.policy.tiny_overrides == cfg.generation.tiny_overrides
        assert 64 + max(p.response_len for p in pts) <= cfg.policy.tiny_overrides["max_position_embeddings"]
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        tok = build_tiny_tokenizer()
        model = AutoModelForCausalLM.from_config(tiny_config(len(tok), **cfg.policy.tiny_overrides))
    assert sum(p.numel() for p in model.parameters()) >= 100e6
    if not torch.cuda.is_available():
        assert cp.main(["--gpu", "--run-dir", str(tmp_path / "gpu")]) == 2
        assert "CUDA" in capsys.readouterr().err


# ----------------------------------------------------------------------------- end to end
# slow: 90 s of both trainers; the benchmark's own runs exercise it, and the parity and driver-bytes tests stay in CI
@pytest.mark.slow
def test_compare_paths_runs_both_trainers_and_writes_json_markdown_and_plots(tmp_path):
    """One step of each trainer on the synthetic backend (fresh processes): the driver's bytes sent
    are counted (legacy ships the data, TQ only handles), every rank's fetch time is in the metrics,
    the TQ store held the step's data, and the JSON / markdown / PNG outputs are written."""
    out = tmp_path / "cp"
    assert cp.main(["--custom-points", "2x4x64@2", "--steps", "1", "--run-dir", str(out)]) == 0
    result = json.loads((out / "compare_paths.json").read_text())
    steps = {r["path"]: r["steps"][0] for r in result["runs"]}
    assert set(steps) == {"legacy", "tq"}
    for path, m in steps.items():
        assert m["step_time_s"] > 0 and {"fetch/rank0_s", "fetch/rank1_s"} <= set(m), (path, sorted(m))
        assert m["timing/worker_compute"] > 0 and m["driver_bytes_sent"] > 0
    legacy, tq = steps["legacy"], steps["tq"]
    assert legacy["driver_bytes_sent"] > 2 * tq["driver_bytes_sent"]  # shards through Ray vs KVBatchMeta handles
    assert legacy["driver_bytes_received"] > 3 * tq["driver_bytes_received"]
    assert legacy["timing/worker_dispatch"] > 0 and tq["timing/worker_tq_get"] > 0
    assert tq["store_bytes"] > 8 * 64 * 8  # at least the input ids of 8 samples of 64+ tokens
    assert len(result["targets"]) == 5 and result["summary"][0]["fetch_per_rank_s"]
    md = (out / "compare_paths.md").read_text()
    assert "| legacy |" in md and "| tq |" in md and "Targets" in md
    for name in ("step_time", "driver_bytes"):
        png = (out / f"compare_paths_{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


# ----------------------------------------------------------------------------- outputs
def test_a_rerun_leaves_the_published_results_alone_and_publish_replaces_them(tmp_path, capsys):
    """Re-rendering the published CPU run (what ``--from-json`` does, in seconds) writes a fresh run
    directory under logs/ and leaves benchmarks/results/ as it was; ``--publish`` is what replaces the
    published set (shown on a copy). Before, a run wrote over the README's files."""
    import os
    import shutil

    from benchmarks.outputs import REPO, RESULTS_DIR, open_run, snapshot

    published = os.path.join(RESULTS_DIR, "compare_paths_cpu2.json")
    logs = os.path.join(REPO, "logs", "compare_paths")
    before, runs_before = snapshot(RESULTS_DIR), set(os.listdir(logs)) if os.path.isdir(logs) else set()
    try:
        assert cp.main(["--from-json", published]) == 0
        assert snapshot(RESULTS_DIR) == before
        new = set(os.listdir(logs)) - runs_before
        assert len(new) == 1
        run = os.path.join(logs, new.pop())
        assert {"compare_paths.json", "compare_paths.md", "compare_paths_step_time.png"} <= set(os.listdir(run))
        assert run in capsys.readouterr().out
    finally:
        for name in set(os.listdir(logs)) - runs_before if os.path.isdir(logs) else ():
            shutil.rmtree(os.path.join(logs, name))
    copy = tmp_path / "copy.json"
    shutil.copyfile(published, copy)
    results = tmp_path / "results"
    out = open_run("compare_paths", str(tmp_path / "run"), log=lambda _: None)
    cp.write_reports(json.loads(copy.read_text()), out)
    assert sorted(os.path.basename(p) for p in out.finish(True, "cpu2", results_dir=str(results))) == [
        "compare_paths_cpu2.json",
        "compare_paths_cpu2.md",
        "compare_paths_cpu2_driver_bytes.png",
        "compare_paths_cpu2_fetch.png",
        "compare_paths_cpu2_step_time.png",
    ]
