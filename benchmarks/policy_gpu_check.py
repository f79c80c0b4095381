"""Policy vs TQPolicy on GPUs: the log-prob and train paths of both policies, bf16, real Ray actors.

Builds a ~110M-parameter decoder (the tiny Qwen2 config scaled up, random init), one DP worker per GPU
(NCCL), and runs one GRPO step on the same synthetic batch through the legacy ``Policy`` (driver-side
batch shipped through Ray) and through ``TQPolicy`` (KVBatchMeta shards, workers fetch from TQ). It
checks both compute the same log-probs, metrics and updated weights, and times each pass. Then it
times a GPU rank's fetch of a larger batch both ways in the same process, alternating: the padded get
on the host then copied to the GPU (what a rank did before), against ``policy.worker.fetch_padded``
(rows copied unpadded into page-locked memory, sent to the GPU, padded there; up to edca89b it
borrowed them from the arena), and checks both give the same tensors.

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

from benchmarks.outputs import add_output_args, code_version, open_run
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
    p.add_argument("--fetch-samples", type=int, default=1024, help="samples of the fetch comparison's batch (default 1024; 0: skip it)")
    p.add_argument(
        "--fetch-max-len", type=int, default=4096, help="longest sample of that batch; lengths from a quarter of it (default 4096)"
    )
    add_output_args(p, "policy_gpu_check")
    return p


def fetch_ab(client, partition: str, samples: int, max_len: int, rounds: int = 15) -> dict:
    """A GPU rank's fetch of one batch, two ways, alternating (medians of ``rounds`` warm ones each):
    the host's padded get then ``.to("cuda")``, and :func:`policy.worker.fetch_padded` on the GPU."""
    from common.fields import tensor_nbytes
    from policy.synthetic import synthetic_batch, to_tq_columns
    from policy.worker import LOGPROB_INPUT_FIELDS, fetch_padded

    fields = (*LOGPROB_INPUT_FIELDS, "token_mask", "sample_mask", "generation_logprobs")
    batch = synthetic_batch(samples, min_len=max_len // 4, max_len=max_len, prompt_len=32, seed=2)
    columns = to_tq_columns(batch.select_columns(fields))
    meta = client.put(partition, [f"f{i}" for i in range(samples)], columns)
    pad, dev = {"input_ids": 0}, torch.device("cuda", 0)

    def host() -> dict:
        got = client.get(meta, list(fields), layout="padded", pad_value=pad)
        return {k: v.to(dev) for k, v in got.items()}

    def on_device() -> dict:
        return fetch_padded(client, meta, fields, pad, dev)

    times: dict[str, list[float]] = {"host": [], "device": []}
    for i in range(rounds + 1):
        for name, fn in (("host", host), ("device", on_device)) if i % 2 else (("device", on_device), ("host", host)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = fn()
            torch.cuda.synchronize()
            if i:  # the first round warms both up
                times[name].append(time.perf_counter() - t0)
            del got
    a, b = host(), on_device()
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    client.discard(meta)
    return {
        "fetch_samples": samples,
        "fetch_max_len": max_len,
        "fetch_jagged_bytes": tensor_nbytes(dict(columns)),
        "fetch_padded_bytes": tensor_nbytes(a),
        "fetch_host_pad_s": med["host"],
        "fetch_device_pad_s": med["device"],
        "fetch_host_over_device": med["host"] / med["device"],
        "fetch_equal": all(torch.equal(a[k], b[k]) for k in fields),
    }


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)

    import ray

    from policy.logprobs import per_sample_reductions
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
    # Both policies live at once, rank r of each on GPU r: half a GPU per worker, both in bundle r of
    # one placement group (Ray alone would pack a policy's two half-GPU ranks onto one GPU).
    pg = ray.util.placement_group([{"GPU": 1, "CPU": 2}] * gpus)
    ray.get(pg.ready(), timeout=120)
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
        "code": code_version(),
    }
    with (
        TQServer(storage_units=1, capacity=4 << 30) as server,
        Policy(cfg, calls=DriverTraffic(), placement_group=pg) as legacy,
        TQPolicy(cfg, TQConnection(server.address), calls=DriverTraffic(), placement_group=pg) as tqp,
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
        meta = tqp.get_logprobs_from_meta(meta, with_reductions=True)  # as trainer.grpo_sync asks
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
        # the per-sample reductions the ranks wrote with the log-probs, against the legacy driver's
        want = per_sample_reductions(data)
        red = tqp.client.get(meta, list(want))
        out["reductions_equal"] = all(torch.equal(red[k], want[k]) for k in want)
        out["metrics_equal"] = m_legacy == m_tq
        out["weights_equal"] = all(torch.equal(wl[k], wt[k]) for k in wl)
        out["max_weight_diff"] = max(float((wl[k].float() - wt[k].float()).abs().max()) for k in wl)
        out["loss"] = float(m_legacy["loss"])
        tqp.finish_step(meta)
        if a.fetch_samples:
            tqp.prepare_step(a.fetch_samples, 4)
            out.update(fetch_ab(tqp.client, tqp.train_partition, a.fetch_samples, a.fetch_max_len))
            say(f"fetch: host pad {out['fetch_host_pad_s'] * 1e3:.2f} ms, device pad {out['fetch_device_pad_s'] * 1e3:.2f} ms")
    ray.shutdown()
    with open(run.path(".json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    run.finish(a.publish, a.machine, gpu=True)


if __name__ == "__main__":
    main()
