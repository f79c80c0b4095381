"""A network partition between two emulated hosts, and its healing: what TQ's clients see.

Two network namespaces joined by veth pairs (``benchmarks.multinode.NetnsCluster``; no Ray): the
controller and storage unit 0 on the head, storage unit 1 on a worker node. While the link is up:

- a writer on the worker node puts one 64 KiB row after another (into its node's unit over shared
  memory, each commit to the controller over TCP), logging every acknowledged key;
- a reader on the head gets the last 16 of those rows over TCP and checks every byte;
- a patient reader does the same with a timeout longer than the cut (``--cut-s`` + PATIENT_MARGIN_S);
- another reader on the head gets rows of the head's own unit (written before the cut) and checks them;
- a reader on the worker node gets those rows too (the head's unit, over TCP), with the patient
  reader's timeout: cut off from both the unit and the controller, as a DP rank on a cut-off node.

Then the worker node's switch port is blocked (its veth taken off the hub's bridge: both sides keep
their link up and every packet is dropped without a reset, as when a switch fails) for ``--cut-s``
seconds and opened again; one second into the cut the head discards the older half of the writer's
rows (the controller sends their frees into a connection about to be dropped). The run ends
``--after-s`` seconds after the heal; a last check from the head reads every acknowledged key not
discarded and waits for the worker's unit to hold exactly the live keys' bytes. Every call has the
client's timeout (``--timeout``) but the patient reader's. Targets: no acknowledged write lost and no
wrong byte read; the discarded rows freed; no call longer than its timeout (+0.5 s); the head's own
rows readable throughout; no failed get of the patient readers - a read waits for a silent unit within
its timeout, until the controller gives the unit up (``--unit-lost-s``, 30 s: the default cut is
shorter); and, once the link is back, the writer and the readers across the cut succeeding
again within ``RECOVERY_BAR_S`` - not after TCP's retransmission back-off of a connection that held a
request when the packets stopped (it doubles from 0.2 s up to 2 minutes: 25 s after a 30 s partition,
measured before the fix; docs/reliability.md). Needs root and ``ip``/``unshare``; exits 2 where
namespaces cannot be made.

    python -m benchmarks.tq_partition                       # 20 s partition, 15 s after (~1 min)
    python -m benchmarks.tq_partition --cut-s 120 --publish # also writes benchmarks/results/tq_partition_<machine>.*
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from benchmarks.multinode import NetnsCluster, SetupError, _killpg, _wait_port
from benchmarks.outputs import add_output_args, code_version, cpu_model, open_run

REPO = Path(__file__).resolve().parent.parent
TQ_PORT = 5555
ROW_BYTES = 64 << 10
READ_KEYS = 16  # rows of each get
HOME_ROWS = 64  # rows of the head's unit, written before the cut
PAUSE_S = 0.02  # between a worker's calls
# a dropped connection is made again within two 1 s connect tries (rpc.reconnect_when_silent: a try
# whose SYN went before the heal times out), then the controller's next ping is answered
RECOVERY_BAR_S = 3.0
CALL_SLACK_S = 0.5
ROLES_START_S = 90.0  # for every role's first successful call, before the cut
FREED_WAIT_S = 15.0  # ... and this long for the worker's unit to free what was discarded (frees go at once)
CHECK_WAIT_S = 150.0  # the last check waits this long for a unit still reported down (TCP's back-off is at most 120 s)
ROLES = ("writer", "reader", "patient", "home", "cut_reader")
PATIENT = ("patient", "cut_reader")  # readers whose timeout outlasts the cut
PATIENT_MARGIN_S = 10.0  # their timeout is the cut's length plus this


def row_bytes(key: str) -> Any:
    """The bytes of key ``key``'s row (a function of the key, so any process can check them)."""
    import numpy as np
    import torch

    seed = int.from_bytes(key.encode(), "little") % (1 << 63)
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 255, size=(1, ROW_BYTES), dtype=np.uint8))


# ------------------------------------------------------------------------ the processes on the nodes
def worker(role: str, address: str, out: str, stop: str, timeout: float) -> None:
    """One role's loop until ``stop`` exists, a JSON line per call to ``out``: ``writer`` puts rows
    ``w<i>`` into partition "net"; ``reader`` and ``patient`` get the last READ_KEYS of them; ``home``
    and ``cut_reader`` get the rows of partition "home" (written by :func:`write_home`)."""
    import torch

    from tq import TQClient

    with open(out, "w") as f, TQClient(address, timeout=timeout) as c:
        i = 0
        while not os.path.exists(stop):
            time.sleep(PAUSE_S)
            rec: dict[str, Any] = {"t": time.time()}
            try:
                if role == "writer":
                    rec["key"] = key = f"w{i}"
                    i += 1  # a failed put's outcome is unknown: the next put takes a fresh key
                    c.put("net", [key], {"x": row_bytes(key)})
                else:
                    part = "net" if role in ("reader", "patient") else "home"
                    meta = c.get_meta(part).slice(-READ_KEYS)
                    if not meta.keys:  # the writer's first row is not in yet
                        continue
                    x = c.get(meta, ["x"])["x"]
                    rec["bad"] = [k for j, k in enumerate(meta.keys) if not torch.equal(x[j : j + 1], row_bytes(k))]
                rec["ok"] = True
            except Exception as exc:  # noqa: BLE001 - what a call raised is the result
                rec.update(ok=False, error=type(exc).__name__, message=str(exc)[:300])
            rec["s"] = time.time() - rec["t"]
            f.write(json.dumps(rec) + "\n")
            f.flush()


def write_home(address: str, timeout: float) -> None:
    """Rows of partition "home" on the head's own unit (the writer runs on the head)."""
    import torch

    from tq import TQClient

    with TQClient(address, timeout=timeout) as c:
        c.register_partition("home")
        c.register_partition("net")
        keys = [f"h{i}" for i in range(HOME_ROWS)]
        c.put("home", keys, {"x": torch.cat([row_bytes(k) for k in keys])})


def discard_half(address: str, out: str, timeout: float) -> None:
    """From the head, during the partition: discard the older half of the writer's rows (all on the cut-off
    unit, whose frees the controller then sends into a connection that is about to be dropped)."""
    from tq import TQClient

    with TQClient(address, timeout=timeout) as c:
        meta = c.get_meta("net")
        gone = meta.slice(0, len(meta.keys) // 2)
        c.discard(gone)
    Path(out).write_text(json.dumps(list(gone.keys)))


def check_acknowledged(address: str, writer_log: str, discarded: str, out: str, timeout: float) -> None:
    """After the run, from the head: read every key the writer saw acknowledged (and the head did not
    discard) and check its bytes; then wait until the worker's unit holds exactly the bytes of the
    partition's live keys - the rows discarded during the partition freed there."""
    import torch

    from tq import TQClient
    from tq.errors import StorageUnitError

    gone = set(json.loads(Path(discarded).read_text()))
    acked = [r["key"] for r in map(json.loads, Path(writer_log).read_text().splitlines()) if r["ok"]]
    waited, t0 = None, time.monotonic()
    with TQClient(address, timeout=timeout) as c:
        meta = c.get_meta("net", [k for k in acked if k not in gone])  # raises naming an acknowledged key that is missing
        while True:
            try:
                x = c.get(meta, ["x"])["x"]
                break
            except StorageUnitError:  # still reported down: waited for (how long is reported)
                if time.monotonic() - t0 > CHECK_WAIT_S:
                    raise
                waited = time.sleep(0.2) or time.monotonic() - t0
        wrong = [k for j, k in enumerate(meta.keys) if not torch.equal(x[j : j + 1], row_bytes(k))]
        live = len(c.get_meta("net").keys) * ROW_BYTES  # with puts whose outcome was unknown and that landed
        t1 = time.monotonic()
        while (held := c.stats()["unit_stats"][1]["bytes_live"]) != live and time.monotonic() - t1 < FREED_WAIT_S:
            time.sleep(0.2)
        freed_s = time.monotonic() - t1
    report = {"acknowledged": len(acked) - len(gone & set(acked)), "read": len(meta.keys), "wrong": wrong, "waited_for_unit_s": waited}
    report.update(discarded=len(gone), live_bytes=live, unit_bytes_live=held, freed_after_s=round(freed_s, 2))
    Path(out).write_text(json.dumps(report))


# ------------------------------------------------------------------------ the run
@contextlib.contextmanager
def service_on_two_hosts(
    run_dir: Path, units_on: tuple[int, ...] = (0, 1), link_rate: str | None = None
) -> Iterator[tuple[NetnsCluster, str, dict[str, str]]]:
    """Two emulated hosts with a TQ service on them: the controller on the head (node 0) and storage
    unit ``i`` on node ``units_on[i]``. Yields ``(cluster, controller address, environment of the
    service's processes)``; everything is stopped and removed on the way out, whatever happened."""
    from tq import launch

    cluster = NetnsCluster(2, link_rate)
    env = {"TQ_SECRET": secrets.token_hex(16), "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    shm_dir = f"/dev/shm/{cluster.tag}"
    os.makedirs(shm_dir, exist_ok=True)
    head = cluster.ips[0]
    address = f"tcp://{head}:{TQ_PORT}"
    try:
        cluster.up()
        cmd = [sys.executable, "-m", "tq.controller", "--host", head, "--port", str(TQ_PORT), "--storage-units", "0"]
        cluster.spawn(0, cmd, run_dir / "controller.log", env)
        _wait_port(cluster, 0, head, TQ_PORT, 60, "tq controller")
        for uid, node in enumerate(units_on):
            ready = run_dir / f"unit{uid}.ready"
            cmd = launch.storage_unit_command(
                unit_id=uid,
                bind=f"tcp://{cluster.ips[node]}:0",
                controller=address,
                capacity=256 << 20,
                shm_dir=shm_dir,
                ready_file=str(ready),
            )
            unit = cluster.spawn(node, cmd, run_dir / f"unit{uid}.log", env)
            launch.await_ready_file(str(ready), alive=lambda: unit.poll() is None, timeout=60, what=f"storage unit {uid}")  # noqa: B023
        yield cluster, address, env
    finally:
        cluster.down()
        shutil.rmtree(shm_dir, ignore_errors=True)


def run(cut_s: float, after_s: float, timeout: float, run_dir: Path, log: Any = print) -> dict[str, Any]:
    """Set the two hosts up, run the three roles through a partition of ``cut_s`` seconds and
    ``after_s`` after it, check every acknowledged key, tear everything down; returns the report."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    stop = run_dir / "stop"
    report: dict[str, Any] = {"cut_s": cut_s, "after_s": after_s, "timeout_s": timeout}
    t0 = time.monotonic()
    with service_on_two_hosts(run_dir) as (cluster, address, env):
        report["ips"], node = cluster.ips, cluster.ips[1]
        me = [sys.executable, "-m", "benchmarks.tq_partition"]
        if cluster.run(0, [*me, "_home", "--address", address, "--timeout", str(timeout)], run_dir / "home-write.log", 60, env) != 0:
            raise RuntimeError(f"writing the head's rows failed (log: {run_dir / 'home-write.log'})")
        procs = {}
        timeouts = {role: cut_s + PATIENT_MARGIN_S if role in PATIENT else timeout for role in ROLES}
        report["timeouts_s"] = timeouts
        for role, n in (("writer", 1), ("reader", 0), ("patient", 0), ("home", 0), ("cut_reader", 1)):
            cmd = [
                *me,
                "_worker",
                role,
                "--address",
                address,
                "--out",
                str(run_dir / f"{role}.jsonl"),
                "--stop",
                str(stop),
                "--timeout",
                str(timeouts[role]),
            ]
            procs[role] = cluster.spawn(n, cmd, run_dir / f"{role}.log", env)
        # every role under way - a call of each done (the reader's once the writer's first rows are in)
        # - before the cut: a process still starting (importing torch on a busy machine) would meet it
        deadline = time.monotonic() + ROLES_START_S
        while not all(_has_succeeded(run_dir / f"{role}.jsonl") for role in ROLES):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                raise RuntimeError(f"the roles did not all get under way within {ROLES_START_S:g} s (logs: {run_dir}/*.log)")
            time.sleep(0.2)
        time.sleep(2.0)  # a few calls more
        report["cut_at"] = time.time()
        cluster.cut(1)
        log(f"link of {node} cut for {cut_s:.0f} s")
        time.sleep(1.0)  # before the controller drops its connection to the unit (UNIT_TIMEOUT_S)
        cmd = [*me, "_discard", "--address", address, "--out", str(run_dir / "discarded.json"), "--timeout", str(timeout)]
        if cluster.run(0, cmd, run_dir / "discard.log", 30, env) != 0:
            raise RuntimeError(f"the discard during the partition failed (log: {run_dir / 'discard.log'})")
        time.sleep(max(0.0, report["cut_at"] + cut_s - time.time()))
        cluster.heal(1)
        report["healed_at"] = time.time()
        log(f"link back; running {after_s:.0f} s more")
        time.sleep(after_s)
        stop.write_text("1")
        for role, p in procs.items():
            try:
                p.wait(timeouts[role] + 10)
            except subprocess.TimeoutExpired:
                _killpg(p, 9)
                report.setdefault("hung", []).append(role)
        check = run_dir / "check.json"
        cmd = [
            *me,
            "_check",
            "--address",
            address,
            "--writer-log",
            str(run_dir / "writer.jsonl"),
            "--discarded",
            str(run_dir / "discarded.json"),
        ]
        cmd += ["--out", str(check), "--timeout", "30"]
        if cluster.run(0, cmd, run_dir / "check.log", CHECK_WAIT_S + FREED_WAIT_S + 60, env) != 0:
            raise RuntimeError(f"the last check failed (log: {run_dir / 'check.log'})")
        report["check"] = json.loads(check.read_text())
        report["roles"] = {role: summarize(run_dir / f"{role}.jsonl", report["cut_at"], report["healed_at"]) for role in ROLES}
    report["total_s"] = round(time.monotonic() - t0, 1)
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    shm_dir = f"/dev/shm/{cluster.tag}"
    report["left_behind"] = [n for n in ns if n.startswith(cluster.tag)] + ([shm_dir] if os.path.exists(shm_dir) else [])
    return report


def _has_succeeded(path: Path) -> bool:
    """Whether a role's log holds a successful call (its lines whole: the role may be writing one)."""
    return path.exists() and any(json.loads(line)["ok"] for line in path.read_text().split("\n")[:-1])


def summarize(path: Path, cut_at: float, healed_at: float) -> dict[str, Any]:
    """One role's calls: counts, errors by type, the longest call, wrong reads, and when its first call
    that started after the link came back succeeded (seconds after the heal)."""
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    errors: dict[str, int] = {}
    for r in recs:
        if not r["ok"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    during = [r for r in recs if cut_at <= r["t"] < healed_at]
    ok_after = next((r["t"] + r["s"] - healed_at for r in recs if r["ok"] and r["t"] + r["s"] >= healed_at), None)
    return {
        "calls": len(recs),
        "failed": sum(not r["ok"] for r in recs),
        "errors": errors,
        "error_samples": {r["error"]: r["message"] for r in recs if not r["ok"]},
        "calls_during_cut": len(during),
        "failed_during_cut": sum(not r["ok"] for r in during),
        "longest_s": round(max((r["s"] for r in recs), default=0.0), 3),
        "wrong_reads": sorted({k for r in recs for k in r.get("bad", [])}),
        "recovered_after_s": None if ok_after is None else round(ok_after, 3),
    }


def targets(r: dict[str, Any], recovery_bar_s: float = RECOVERY_BAR_S) -> list[tuple[str, Any, str, bool]]:
    """(target, measured, wanted, met) rows of a report."""
    roles, chk = r["roles"], r["check"]
    over = max(v["longest_s"] - r["timeouts_s"][role] for role, v in roles.items())  # the longest call past its timeout
    wrong = len(chk["wrong"]) + sum(len(v["wrong_reads"]) for v in roles.values())
    rows = [
        ("acknowledged writes lost", chk["acknowledged"] - chk["read"], "0", chk["acknowledged"] == chk["read"]),
        ("wrong-bytes reads", wrong, "0", wrong == 0),
        (
            "rows discarded during the partition freed on the cut-off unit after it (its live bytes / the live keys')",
            f"{chk['unit_bytes_live']} / {chk['live_bytes']}",
            f"equal within {FREED_WAIT_S:g} s",
            chk["unit_bytes_live"] == chk["live_bytes"] and chk["discarded"] > 0,
        ),
        ("longest call past its timeout (s)", round(over, 3), f"<= {CALL_SLACK_S:g}", over <= CALL_SLACK_S),
        ("head's own rows: failed gets", roles["home"]["failed"], "0", roles["home"]["failed"] == 0),
        *(
            (
                f"{role} (timeout {r['timeouts_s'][role]:g} s): failed gets",
                f"{roles[role]['failed']} of {roles[role]['calls']} ({roles[role]['calls_during_cut']} started during the cut)",
                "0",
                roles[role]["failed"] == 0 and roles[role]["calls"] > 0,
            )
            for role in PATIENT
        ),
        (
            "the partition was felt (writer and reader failed calls during it)",
            f"{roles['writer']['failed_during_cut']} / {roles['reader']['failed_during_cut']}",
            ">= 1 each",
            roles["writer"]["failed_during_cut"] > 0 and roles["reader"]["failed_during_cut"] > 0,
        ),
    ]
    for role in ("writer", "reader", *PATIENT):
        rec = roles[role]["recovered_after_s"]
        rows.append(
            (
                f"{role}: first success after the link came back (s)",
                rec,
                f"<= {recovery_bar_s:g}",
                rec is not None and rec <= recovery_bar_s,
            )
        )
    rows.append(
        (
            "processes, namespaces and shm left",
            len(r["left_behind"]) + len(r.get("hung", [])),
            "0",
            not r["left_behind"] and not r.get("hung"),
        )
    )
    return rows


def render_md(r: dict[str, Any]) -> list[str]:
    lines = [
        "# TQ network partition",
        "",
        f"`python -m benchmarks.tq_partition --cut-s {r['cut_s']:g} --after-s {r['after_s']:g} --timeout {r['timeout_s']:g}` "
        f"({time.strftime('%Y-%m-%d %H:%M', time.localtime(r['cut_at']))}, {r['total_s']:.0f} s)",
        "",
        f"Machine: {r['machine']}; code: commit {r['code']['commit']}"
        + (f" (with changes to {', '.join(r['code']['dirty'])})" if r["code"].get("dirty") else ""),
        "",
        "Two emulated hosts (network namespaces): controller and unit 0 on the head, unit 1 on the worker node. The worker "
        "node's switch port is blocked (its veth taken off the bridge: every packet dropped, no reset, both links up) and opened again. writer: 1-row puts on the "
        "worker node (its own unit; commits over TCP); reader: gets of the writer's last rows from the head over TCP; "
        f"patient: the same gets with a timeout of {r['timeouts_s']['patient']:g} s; "
        "home: gets of the head's own rows; cut_reader: the same gets from the worker node (over TCP, "
        f"cut off from the unit and the controller), timeout {r['timeouts_s']['cut_reader']:g} s. Every other client's timeout "
        f"{r['timeout_s']:g} s.",
        "",
        "| role | calls | failed | during the cut: calls / failed | errors by type | longest call s | first success after the heal s |",
        "|---|---|---|---|---|---|---|",
    ]
    for role in ROLES:
        v = r["roles"][role]
        errs = ", ".join(f"{k} {n}" for k, n in sorted(v["errors"].items())) or "-"
        rec = "-" if v["recovered_after_s"] is None else f"{v['recovered_after_s']:.2f}"
        lines.append(
            f"| {role} | {v['calls']} | {v['failed']} | {v['calls_during_cut']} / {v['failed_during_cut']} | {errs} | {v['longest_s']:.2f} | {rec} |"
        )
    lines += ["", "Errors seen (one of each type):", ""]
    for role in ROLES:
        for kind, msg in r["roles"][role]["error_samples"].items():
            lines.append(f"- {role}, {kind}: {msg}")
    chk = r["check"]
    lines += [
        "",
        f"Last check from the head: {chk['read']} of {chk['acknowledged']} acknowledged keys read, {len(chk['wrong'])} with wrong bytes.",
        "",
    ]
    lines += ["| target | measured | want | result |", "|---|---|---|---|"]
    lines += [f"| {name} | {got} | {want} | {'PASS' if met else 'FAIL'} |" for name, got, want, met in targets(r)]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    w = sub.add_parser("_worker", help=argparse.SUPPRESS)
    w.add_argument("role", choices=ROLES)
    w.add_argument("--address", required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--stop", required=True)
    w.add_argument("--timeout", type=float, required=True)
    h = sub.add_parser("_home", help=argparse.SUPPRESS)
    h.add_argument("--address", required=True)
    h.add_argument("--timeout", type=float, required=True)
    c = sub.add_parser("_check", help=argparse.SUPPRESS)
    for flag in ("--address", "--writer-log", "--discarded", "--out"):
        c.add_argument(flag, required=True)
    c.add_argument("--timeout", type=float, required=True)
    d = sub.add_parser("_discard", help=argparse.SUPPRESS)
    for flag in ("--address", "--out"):
        d.add_argument(flag, required=True)
    d.add_argument("--timeout", type=float, required=True)
    p.add_argument(
        "--cut-s",
        type=float,
        default=20.0,
        help="seconds the worker node's link stays down (default 20: under the controller's --unit-lost-s, 30)",
    )
    p.add_argument("--after-s", type=float, default=15.0, help="seconds the run goes on after the link is back (default 15)")
    p.add_argument("--timeout", type=float, default=5.0, help="every client's timeout (s, default 5)")
    add_output_args(p, "tq_partition")
    a = p.parse_args(argv)
    if a.cmd == "_worker":
        worker(a.role, a.address, a.out, a.stop, a.timeout)
        return 0
    if a.cmd == "_home":
        write_home(a.address, a.timeout)
        return 0
    if a.cmd == "_check":
        check_acknowledged(a.address, a.writer_log, a.discarded, a.out, a.timeout)
        return 0
    if a.cmd == "_discard":
        discard_half(a.address, a.out, a.timeout)
        return 0
    out = open_run("tq_partition", a.run_dir)
    try:
        r = run(a.cut_s, a.after_s, a.timeout, Path(out.run_dir) / "work")
    except SetupError as exc:
        print(f"tq_partition: {exc}", file=sys.stderr)
        return 2
    r["machine"] = f"{os.cpu_count()} CPUs ({cpu_model()})"
    r["code"] = code_version()
    r["targets"] = [{"target": n, "measured": m, "want": w_, "met": ok} for n, m, w_, ok in targets(r)]
    r["ok"] = all(t["met"] for t in r["targets"])
    out.write_report(r, render_md(r))
    out.finish(a.publish, a.machine)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
