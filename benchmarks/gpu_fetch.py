"""A GPU rank's fetch of a GRPO batch from TQ, four ways, in one process, alternating.

The batch is tq_throughput's (jagged ``input_ids``, ``generation_logprobs``, ``prev_logprobs``,
``token_mask``, per-sample ``rewards``), put by this process on a one-unit service of this host;
each way ends with every field on the GPU, jagged ones padded to their longest row:
  borrowed        ``get(layout="jagged", copy=False)``: the rows viewed in the arena, their bytes sent
                  to the GPU from there (pageable memory), padded on the GPU (the GPU rank's fetch
                  before ``pin_memory``).
  pinned jagged   ``get(layout="jagged", pin_memory=True)``: the rows copied by TQ's row copier into
                  page-locked memory, sent to the GPU, padded there (``policy.worker.copy_and_pad``).
  padded          the padded host get, then ``.to("cuda")`` (pageable).
  pinned padded   the padded host get into page-locked memory, then ``.to("cuda", non_blocking=True)``.
Every way's first result is checked against the first way's; times are medians over ``--rounds``
warm rounds, the order of the ways reversed every other round.

    python -m benchmarks.gpu_fetch --sizes-mib 32 256 --publish      # needs a CUDA device

Results go to a fresh ``logs/gpu_fetch/<timestamp>/``; ``--publish`` also writes
``benchmarks/results/gpu_fetch_<gpu>.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import torch

from benchmarks.outputs import add_output_args, code_version, open_run
from benchmarks.tq_throughput import FIELDS, MiB, make_batch, payload_bytes, tq_columns

WAYS = ("borrowed", "pinned jagged", "padded", "pinned padded")


def fetch_ways(client: Any, meta: Any, device: torch.device) -> dict[str, Callable[[], dict[str, torch.Tensor]]]:
    """Each way of :data:`WAYS` as a call returning the batch's fields on ``device``."""
    from policy.worker import copy_and_pad
    from tq import JaggedTensor

    fields = [*FIELDS, "rewards"]

    def borrowed() -> dict[str, torch.Tensor]:
        with client.get(meta, fields, layout="jagged", copy=False) as got:  # copies done before the borrow ends
            return {k: v.to_padded(device=device) if isinstance(v, JaggedTensor) else v.to(device, copy=True) for k, v in got.items()}

    return {
        "borrowed": borrowed,
        "pinned jagged": lambda: copy_and_pad(client, meta, fields, {}, device),
        "padded": lambda: {k: v.to(device) for k, v in client.get(meta, fields).items()},
        "pinned padded": lambda: {k: v.to(device, non_blocking=True) for k, v in client.get(meta, fields, pin_memory=True).items()},
    }


def bench(sizes: list[int], rounds: int) -> dict[str, Any]:
    """Per batch size, each way's median seconds and GB/s of unpadded payload."""
    from tq import TQClient, TQServer

    device = torch.device("cuda", 0)
    out: dict[str, Any] = {}
    with TQServer(storage_units=1, capacity=max(sizes) * 3 + 256 * MiB) as server, TQClient(server.address, timeout=120) as client:
        client.register_partition("fetch")
        for size in sizes:
            b = make_batch(size, 7)
            meta = client.put("fetch", [f"s{size}_{i}" for i in range(len(b["rewards"]))], tq_columns(b))
            payload = payload_bytes(size, 7)
            times: dict[str, list[float]] = {w: [] for w in WAYS}
            ref = None
            for r in range(rounds + 1):
                ways = list(fetch_ways(client, meta, device).items())
                for name, fn in ways if r % 2 else ways[::-1]:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    got = fn()
                    torch.cuda.synchronize()
                    if r == 0:  # untimed warm-up; every way's result checked against the first
                        ref = ref or {k: v.cpu() for k, v in got.items()}
                        if not all(torch.equal(got[k].cpu(), ref[k]) for k in ref):
                            raise AssertionError(f"{name}: a different batch came back")
                    else:
                        times[name].append(time.perf_counter() - t0)
                    del got
            client.discard(meta)
            med = {w: statistics.median(t) for w, t in times.items()}
            out[str(size)] = {
                "samples": len(b["rewards"]),
                "payload_bytes": payload,
                "median_s": med,
                "gbps": {w: payload / s / 1e9 for w, s in med.items()},
                "over_borrowed": {w: med["borrowed"] / s for w, s in med.items()},
            }
    return out


def report(res: dict[str, Any]) -> list[str]:
    """The markdown table of a run."""
    lines = [
        "# A GPU rank's fetch of a GRPO batch",
        "",
        f"`{res['command']}` ({res['started']}; {res['gpu']}; code {res['code']['commit']})",
        "",
        "Medians of warm rounds, ways alternating; ms (GB/s of unpadded payload; speed-up over borrowed).",
        "",
        "| batch | payload MB | " + " | ".join(WAYS) + " |",
        "|---|---|" + "---|" * len(WAYS),
    ]
    for size, r in res["sizes"].items():
        cells = [f"{r['median_s'][w] * 1e3:.2f} ({r['gbps'][w]:.1f}; {r['over_borrowed'][w]:.2f}x)" for w in WAYS]
        lines.append(f"| {int(size) // MiB} MiB | {r['payload_bytes'] / 1e6:.0f} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[32, 256], help="batch sizes in MiB of payload (default 32 256)")
    p.add_argument("--rounds", type=int, default=11, help="timed rounds after one untimed (default 11)")
    add_output_args(p, "gpu_fetch")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (torch.cuda.is_available() is False)")
    if a.rounds < 1 or min(a.sizes_mib) < 1:
        p.error("--rounds and --sizes-mib must be >= 1")
    run = open_run("gpu_fetch", a.run_dir)
    res = {
        "command": " ".join(["python -m benchmarks.gpu_fetch", *(sys.argv[1:] if argv is None else argv)]),
        "started": time.strftime("%Y-%m-%d %H:%M"),
        "gpu": torch.cuda.get_device_name(0),
        "code": code_version(),
        "sizes": bench([s * MiB for s in a.sizes_mib], a.rounds),
    }
    run.write_report(res, report(res))
    run.finish(a.publish, a.machine, gpu=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
