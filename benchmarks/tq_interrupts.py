"""A storm of interrupts against one client: does a call cut short anywhere leave the client working?

A SIGALRM handler raises an exception (as a Ctrl-C does) at a random point, 20 us to 2 ms into each
call - a 2-key put, a ``write_back`` into 2 registered keys, a ``discard`` of 2 keys, a listing
(``get_meta``), a copying get or a borrowed get (``copy=False``) - and after every call, interrupted or
not, the same client must put and get a row bit-exact, every key the call left must hold exactly its
bytes, and a discard must have left both keys or neither; an exception Python ignores (one raised in a finalizer, where
cleanup then never ran) fails the run too. At the end every partition is cleared and, once a borrowed
get's lease term and a unit's allocation lease have passed, what the client still holds is counted:
pins in its pin file that no view tracks, leases the controller still counts, bytes its storage unit
keeps for it - memory an interrupt leaked until the process exits (docs/reliability.md, "A Ctrl-C in
the middle of a call").

    python -m benchmarks.tq_interrupts --seconds 60
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import random
import signal
import sys
import time
from typing import Any

import torch

from benchmarks.outputs import add_output_args, code_version, open_run

SIZES = (1, 64, 4096, 1 << 16)  # bytes a row of each put (two rows a put)


class Interrupt(Exception):
    """What the storm's signal handler raises (a stand-in for KeyboardInterrupt)."""


def run_storm(seconds: float, seed: int, transport: str, settle_s: float | None = None) -> dict[str, Any]:
    """The storm (see the module docstring); returns its counts and the leak check, made ``settle_s``
    after clearing (default: a borrowed get's lease term and 5 s)."""
    from tq import TQClient, TQServer
    from tq.client import DEFAULT_LEASE_S
    from tq.storage import DEFAULT_ALLOC_LEASE_S

    settle_s = max(DEFAULT_LEASE_S, DEFAULT_ALLOC_LEASE_S) + 5.0 if settle_s is None else settle_s

    rng = random.Random(seed)
    armed = [False]

    def interrupt(*_: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise Interrupt

    ignored: list[str] = []

    def unraisable(u: Any) -> None:  # Python's report of an exception raised where none can propagate
        ignored.append(f"{type(u.exc_value).__name__} in {u.object!r}"[:200])

    previous, previous_hook = signal.signal(signal.SIGALRM, interrupt), sys.unraisablehook
    sys.unraisablehook = unraisable
    outcomes: collections.Counter[str] = collections.Counter()
    failed: list[str] = []
    try:
        with TQServer(storage_units=1, capacity=1 << 30) as server, TQClient(server.address, timeout=5.0, transport=transport) as c:
            for name in ["check", "ref", *(f"p{s}" for s in SIZES)]:
                c.register_partition(name)
            ref_value = torch.arange(4096, dtype=torch.uint8).reshape(2, 2048)
            ref = c.put("ref", ["r0", "r1"], {"x": ref_value})
            check_row = torch.full((1, 16), 7, dtype=torch.uint8)
            i, end = 0, time.monotonic() + seconds
            while time.monotonic() < end and len(failed) < 5:
                i += 1
                size, op = rng.choice(SIZES), rng.choice(["put", "write_back", "discard", "get_meta", "get", "borrow"])
                value = torch.full((2, size), i % 120, dtype=torch.uint8)
                part, keys = f"p{size}", [f"k{i}a", f"k{i}b"]
                target = None  # what a write-back or a discard works on, made before the interrupt is armed
                try:
                    if op == "write_back":
                        target = c.register_keys(part, keys)
                    elif op == "discard":
                        target = c.put(part, keys, {"x": value})
                except Exception as exc:  # noqa: BLE001
                    failed.append(f"before call {i}: {type(exc).__name__}: {exc}")
                    continue
                try:
                    try:
                        armed[0] = True
                        signal.setitimer(signal.ITIMER_REAL, rng.uniform(2e-5, 2e-3))
                        if op == "put":
                            c.put(part, keys, {"x": value})
                        elif op == "write_back":
                            c.write_back(target, {"x": value})
                        elif op == "discard":
                            c.discard(target)
                        elif op == "get_meta":
                            c.get_meta("ref")
                        elif op == "get":
                            if not torch.equal(c.get(ref, ["x"])["x"], ref_value):
                                failed.append(f"call {i}: a get returned other bytes")
                        else:
                            with c.get(ref, ["x"], copy=False) as got:
                                if not torch.equal(got["x"], ref_value):
                                    failed.append(f"call {i}: a borrowed get viewed other bytes")
                        armed[0] = False
                        outcomes[f"{op} done"] += 1
                    except Interrupt:
                        outcomes[f"{op} interrupted"] += 1
                except Interrupt:  # landed in the handler's own bookkeeping above
                    outcomes[f"{op} interrupted"] += 1
                finally:
                    armed[0] = False
                    signal.setitimer(signal.ITIMER_REAL, 0)
                try:  # the client works on, and what the call left is exactly its bytes
                    meta = c.put("check", [f"c{i}"], {"x": check_row})
                    if not torch.equal(c.get(meta, ["x"])["x"], check_row):
                        failed.append(f"after call {i}: the check read other bytes")
                    listed = set(c.get_meta(part).keys) if op in ("put", "write_back", "discard") else set()
                    left = [k for k in keys if k in listed]
                    if op == "discard" and len(left) == 1:
                        failed.append(f"call {i}: a discard left one key of two")
                    if op == "write_back":
                        written = c.get_meta(part, keys)
                        left = keys if "x" in written.fields else []
                    if left and not torch.equal(c.get(c.get_meta(part, left), ["x"])["x"], value[: len(left)]):
                        failed.append(f"call {i}: a {op} left other bytes")
                    if op == "write_back":
                        c.discard(written)  # the partition keeps only what puts left
                except Exception as exc:  # noqa: BLE001 - every failure is counted, with its type
                    failed.append(f"after call {i}: {type(exc).__name__}: {exc}")
            for name in ["check", "ref", *(f"p{s}" for s in SIZES)]:
                c.clear_partition(name)
            gc.collect()
            time.sleep(settle_s)  # past any lease term: what is held stays held
            stats = c.stats()
            unit = stats["unit_stats"][0]
            pins = c._leases.pins  # noqa: SLF001 - the client's own pin file, read for the leak count
            used = [] if pins is None or pins._slots is None else [int(x) for x in pins._slots[:, 0] if int(x)]  # noqa: SLF001
            tracked = set(c._leases._slots)  # noqa: SLF001
            leak = {
                "untracked_pins": sum(lease not in tracked for lease in used),
                "controller_leases": stats["leases"],
                "rows_waiting_for_leases": stats["rows_waiting_for_leases"],
                "unit_bytes_used": unit["bytes_used"],
                "unit_held_bytes": unit["held_bytes"],
            }
    finally:
        signal.signal(signal.SIGALRM, previous)
        sys.unraisablehook = previous_hook
    interrupted = sum(n for k, n in outcomes.items() if k.endswith("interrupted"))
    return {
        "seconds": seconds,
        "settle_s": settle_s,
        "seed": seed,
        "transport": transport,
        "calls": sum(outcomes.values()),
        "interrupted": interrupted,
        "outcomes": dict(sorted(outcomes.items())),
        "failed_checks": failed,
        "ignored_exceptions": ignored,
        "left_after_clear": leak,
        "ok": not failed and not ignored,
        "code": code_version(),
    }


def summary(r: dict[str, Any]) -> str:
    """The report's text."""
    leak = r["left_after_clear"]
    lines = [
        f"{r['calls']} calls in {r['seconds']:.0f} s ({r['transport']} transport, seed {r['seed']}), {r['interrupted']} of them interrupted",
        "outcomes: " + ", ".join(f"{k} {n}" for k, n in r["outcomes"].items()),
        f"failed checks: {len(r['failed_checks'])}" + "".join(f"\n  {f}" for f in r["failed_checks"]),
        f"exceptions Python ignored (raised in a finalizer): {len(r['ignored_exceptions'])}"
        + "".join(f"\n  {e}" for e in r["ignored_exceptions"][:5]),
        f"left after clearing every partition and {r['settle_s']:g} s (past every lease): "
        + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in leak.items()),
        f"code: {r['code']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="seconds of interrupted calls (default 60)")
    p.add_argument("--seed", type=int, default=0, help="seed of the operations, sizes and delays (default 0)")
    p.add_argument("--transport", choices=["auto", "tcp"], default="auto", help="the client's transport (default auto)")
    p.add_argument(
        "--settle-s",
        type=float,
        default=None,
        help="seconds between clearing and the leak count (default: a borrowed get's lease term or a unit's allocation lease, the longer, + 5)",
    )
    add_output_args(p, "tq_interrupts")
    a = p.parse_args(argv)
    if a.seconds <= 0:
        p.error("--seconds must be positive")
    out = open_run("tq_interrupts", a.run_dir)
    r = run_storm(a.seconds, a.seed, a.transport, a.settle_s)
    text = summary(r)
    with open(out.path(".json"), "w") as f:
        json.dump(r, f, indent=1, default=str)
    with open(out.path(".md"), "w") as f:
        f.write(
            f"# TQ client under a storm of interrupts\n\n`python -m benchmarks.tq_interrupts {' '.join(argv or sys.argv[1:])}`\n\n```\n{text}\n```\n"
        )
    print(text)
    out.finish(a.publish, a.machine)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
