"""Draw docs/img/status-watch.svg: the view ``tq-controller status --watch`` shows, of a real service
(2 storage units, metrics on) while a producer/trainer loop puts, writes back, gets and discards
batches through it - same-host and over TCP.

    python deploy/status_screenshot.py [--out docs/img/status-watch.svg]
"""

from __future__ import annotations

import argparse
import io
import os
import threading
import time

import torch
from rich.console import Console, Group

from tq import TQClient, TQServer
from tq.cli import op_counts, render_status, watch_footer

INTERVAL_S = 2.0


def load(address: str, stop: threading.Event) -> None:
    """A GRPO-shaped loop: rollouts put, rewards written back, the trainer's gets, discards."""
    with TQClient(address) as c, TQClient(address, transport="tcp") as tcp:
        c.register_partition("rollouts", reuse=True)
        step = 0
        while not stop.is_set():
            keys = [f"step{step}-{j}" for j in range(32)]
            meta = c.put("rollouts", keys, {"input_ids": [torch.randint(0, 32000, (128 + 8 * j,)) for j in range(32)]})
            meta = tcp.write_back(meta, {"rewards": torch.rand(32)})
            c.wait(meta, ["input_ids", "rewards"], timeout=5.0)
            c.get(meta, ["input_ids", "rewards"])
            if step >= 8:  # the trainer consumed the batch of 8 steps ago
                c.discard(c.get_meta("rollouts", [f"step{step - 8}-{j}" for j in range(32)]))
            step += 1
            time.sleep(0.01)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "img", "status-watch.svg"))
    a = p.parse_args()
    os.environ["TQ_METRICS_PORT"] = "0"  # the embedded service serves metrics (its URL is in the view)
    with TQServer(storage_units=2, capacity=256 << 20) as server:
        stop = threading.Event()
        worker = threading.Thread(target=load, args=(server.address, stop), daemon=True)
        worker.start()
        try:
            with TQClient(server.address) as client:
                time.sleep(3.0)
                before, t0 = op_counts(client.stats()), time.monotonic()
                time.sleep(INTERVAL_S)
                stats, t1 = client.stats(), time.monotonic()
        finally:
            stop.set()
            worker.join(30)
    rates = {k: (n - before.get(k, 0)) / (t1 - t0) for k, n in op_counts(stats).items()}
    console = Console(record=True, width=132, file=io.StringIO(), highlight=False)
    console.print(Group(render_status(stats, address=server.address, rates=rates), watch_footer(INTERVAL_S)))
    console.save_svg(a.out, title="tq-controller status --watch")
    print(f"wrote {os.path.normpath(a.out)}")


if __name__ == "__main__":
    main()
