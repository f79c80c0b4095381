"""Policy vs TQPolicy on GPUs: the log-prob and train paths of both policies, bf16, real Ray actors.

Builds a ~110M-parameter decoder (the tiny Qwen2 config scaled up, random init), one DP worker per GPU
(NCCL), and runs one GRPO step on the same synthetic batch through the legacy ``Policy`` (driver-side
batch shipped through Ray) and through ``TQPolicy`` (KVBatchMeta shards, workers fetch from TQ). It
checks both compute the same log-probs, metrics and updated weights, and times each pass.

    python -m benchmarks.policy_gpu_check --samples 256 --max-len 1024

Results go to a fresh ``logs/policy_gpu_check/<timestamp>/policy_gpu_check.json``; ``--publish`` also
writes ``benchmarks/results/policy_gpu_check_<gpu>.json`` (e.g. ``_h200``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from benchmarks.outputs import add_output_args, open_run
from common.models import MODEL_113M


def build_parser() -> argparse.ArgumentParser:
    """The command line (every option with its help)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=256, help="samples in the synthetic GRPO batch (default 256)")
    p.add_argument("--max-len", type=int, default=1024, help="longest sample in tokens; lengths range from a quarter of it (default 1024)")
    p.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="autocast dtype of both policies (default bfloat16)"
    )
    p.add_argument("--dp", type=int, default=0, help="DP ranks (default: one per visible GPU)")
    add_output_args(p, "policy_gpu_check")
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)

    import ray

    from policy.loss import ClippedPGLossFn
    from policy.policy import Policy, PolicyConfig, TQPolicy
    from policy.synthetic import synthetic_batch, to_tq_columns
    from policy.traffic import DriverTraffic
    from tq import TQConnection, TQServer

    gpus = a.dp or torch.cuda.device_count()
    if torch.cuda.device_count() == 0:
        raise SystemExit("no CUDA device: this check is for GPU machines")
    run = open_run("policy_gpu_check", a.run_dir)
    say = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    ray.init(num_cpus=os.cpu_count(), num_gpus=gpus, include_dashboard=False, log_to_driver=True)
    say(f"ray up, {gpus} GPU worker(s)")
    tiny = MODEL_113M
    # Both policies live at once, one worker per GPU each: half a GPU per worker so Ray can place them.
    cfg = PolicyConfig(
        dp_size=gpus,
        dtype=a.dtype,
        tiny_overrides=tiny,
        num_gpus_per_worker=0.5,
        num_cpus_per_worker=1,
        train_global_batch_size=a.samples,
        train_micro_batch_size=16,
        logprob_batch_size=32,
        learning_rate=1e-5,
        deterministic=True,
        seed=3,
        reference_model_on_cpu=False,
    )
    loss = ClippedPGLossFn({"reference_policy_kl_penalty": 0.01})
    batch = synthetic_batch(a.samples, min_len=a.max_len // 4, max_len=a.max_len, prompt_len=32, seed=1)
    fields = ("input_ids", "input_lengths", "token_mask", "sample_mask", "generation_logprobs")
    out: dict = {
        "device": torch.cuda.get_device_name(0),
        "gpus": gpus,
        "torch": torch.__version__,
        "samples": a.samples,
        "max_len": a.max_len,
        "tokens": int(batch["input_lengths"].sum()),
        "dtype": a.dtype,
    }
    with (
        TQServer(storage_units=1, capacity=4 << 30) as server,
        Policy(cfg, calls=DriverTraffic()) as legacy,
        TQPolicy(cfg, TQConnection(server.address), calls=DriverTraffic()) as tqp,
    ):
        out["params_m"] = sum(v.numel() for v in legacy.get_weights().values()) / 1e6
        say(f"policies up: {out['params_m']:.0f}M parameters")
        data = batch.select_columns(fields + ("advantages",))
        t = {}
        t0 = time.perf_counter()
        data["prev_logprobs"] = legacy.get_logprobs(data)["logprobs"]
        t["legacy_logprobs_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        data["reference_policy_logprobs"] = legacy.get_reference_policy_logprobs(data)["reference_logprobs"]
        t["legacy_ref_logprobs_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        m_legacy = legacy.train(data, loss)
        t["legacy_train_s"] = time.perf_counter() - t0

        say(f"legacy done: {t}")
        tqp.prepare_step(a.samples, 4)
        keys = [f"p{i // 4}_g{i % 4}" for i in range(a.samples)]
        meta = tqp.client.put(tqp.train_partition, keys, to_tq_columns(batch.select_columns(fields)))
        t0 = time.perf_counter()
        meta = tqp.get_logprobs_from_meta(meta)
        t["tq_logprobs_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        meta = tqp.get_reference_policy_logprobs_from_meta(meta)
        t["tq_ref_logprobs_s"] = time.perf_counter() - t0
        meta = tqp.write_to_dataplane(meta, {"advantages": batch["advantages"]})
        t0 = time.perf_counter()
        m_tq = tqp.train_from_meta(meta, loss)
        t["tq_train_s"] = time.perf_counter() - t0
        got = tqp.client.get(meta, ["prev_logprobs"], pad_to=data["input_ids"].shape[1])["prev_logprobs"]
        wl, wt = legacy.get_weights(), tqp.get_weights()
        out.update(t)
        out["logprobs_equal"] = bool(torch.equal(got, data["prev_logprobs"]))
        out["metrics_equal"] = m_legacy == m_tq
        out["weights_equal"] = all(torch.equal(wl[k], wt[k]) for k in wl)
        out["max_weight_diff"] = max(float((wl[k].float() - wt[k].float()).abs().max()) for k in wl)
        out["loss"] = float(m_legacy["loss"])
        tqp.finish_step(meta)
    ray.shutdown()
    with open(run.path(".json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    run.finish(a.publish, a.machine, gpu=True)


if __name__ == "__main__":
    main()
