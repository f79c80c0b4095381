"""A real multi-node Ray cluster on one Linux machine: network namespaces joined by veth pairs.

Each emulated node is a network namespace with its own IP (and its own UTS hostname, so TQ sees
different hosts and streams bytes over TCP between them instead of mapping one another's arenas);
a hub namespace bridges them. ``ray start --head`` runs in the first, ``ray start --address`` in the
others: a real Ray cluster whose nodes see each other only over TCP. On it the script runs what a
user runs on several machines:

1. ``python -m tq.controller`` on the head's IP, with a secret (a non-loopback bind requires one);
2. one storage unit on every node (``tq.ray_placement.start_storage_units_on_ray_nodes``);
3. a cross-node transfer check: a Ray task on one worker node puts a batch (into its node's unit),
   tasks on the other worker node and on the same node read it back (TCP vs shared memory);
4. ``python -m trainer.grpo_sync`` connected to that Ray cluster and TQ service, with its DP ranks on
   different nodes (each worker node offers 2 logical CPUs and a DP worker asks for 1.5, so no node
   can hold two), reading their shards across nodes;
5. ``benchmarks.dataplane_scale``'s step (legacy vs TQ, the model replaced by a pass that reads every
   byte) across the nodes: the rollout actor on the head, one rank of each path on every worker node -
   every byte a rank reads crosses the network on both paths (legacy: rollout -> driver -> ranks
   through Ray's object transfer; TQ: the head's storage unit -> the ranks' gets over TCP).

``--partition-s S`` adds a cluster on which the GRPO job runs while its last worker node (a DP rank,
a storage unit) is cut off for S seconds - its switch port blocked, every packet dropped, nothing
reset - once a few steps are done; the job should ride a short cut out (TQ's reads wait for a silent
unit within their timeout), and the report says when the step in flight ended after the heal.

``--fault`` adds a cluster on which a worker node leaves mid-read: a reader on the head gets rows held
by the head's unit and by the last worker node's unit in a loop while every process of that node's
namespace (raylet, Ray workers, storage unit) is killed; it records the error the get in flight
raised and how long it took, then reads the head's rows back (they must be intact).

Everything it creates is removed at the end, whatever happens: processes (every pid left in its
namespaces is killed), namespaces, temporary and shared-memory dirs. Traffic goes only between the
namespaces it made (10.213.<n>.0/24, chosen per run). Needs root and ``ip``/``unshare``; it says so
and exits 2 where namespaces cannot be made.

    python -m benchmarks.multinode                     # 1 head + 2 worker nodes, 4 GRPO steps, the data-plane step (~2 min on 2 cores)
    python -m benchmarks.multinode --link-rate 10gbit  # tc-limited links
    python -m benchmarks.multinode --link-rate none,10gbit,25gbit --fault   # one cluster per rate, then the fault check
    python -m benchmarks.multinode --partition-s 10     # also a job through a 10 s cut of a worker node
    python -m benchmarks.multinode --publish           # also writes benchmarks/results/multinode_<machine>.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RAY_PORT = 6379
TQ_PORT = 5555
NODE_CPUS = 2  # logical CPUs a worker node offers: one DP worker (1.5) plus small actors (0.25 each)
DP_WORKER_CPUS = 1.5
DATAPLANE_RANK_CPUS = 1.0  # a legacy and a TQ rank share a worker node (both groups are up at once)
XFER_MIB = 64
FAULT_ROWS = 64  # rows of the fault check's batch on each of two units


class SetupError(RuntimeError):
    """The machine cannot host the emulated cluster (not root, no ``ip``/``unshare``, no netns)."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True, timeout=60)


class NetnsCluster:
    """Namespaces ``<tag>-n0`` (head) .. ``<tag>-n<k>`` bridged in ``<tag>-hub``; addresses 10.213.<net>.<i+1>."""

    def __init__(self, nodes: int, link_rate: str | None) -> None:
        if nodes < 2:
            raise ValueError(f"--nodes must be >= 2 (a head and at least one worker node), got {nodes}")
        self.tag = f"tqmn{os.getpid() % 100000}"
        self.net = 20 + os.getpid() % 200
        self.nodes = nodes
        self.link_rate = link_rate
        self.ns = [f"{self.tag}-n{i}" for i in range(nodes)]
        self.hub = f"{self.tag}-hub"
        self.ips = [f"10.213.{self.net}.{i + 1}" for i in range(nodes)]
        self.procs: list[subprocess.Popen] = []
        self.made: list[str] = []
        self.qdiscs: list[str] = []  # ``tc qdisc show`` of each rate-limited link (the limit is in place)

    # -------------------------------------------------------------------- network
    def up(self) -> None:
        if os.geteuid() != 0:
            raise SetupError("needs root (network namespaces and veth pairs)")
        for tool in ("ip", "unshare"):
            if shutil.which(tool) is None:
                raise SetupError(f"needs the {tool!r} command")
        try:
            self._ip("netns", "add", self.hub)
        except subprocess.CalledProcessError as exc:
            raise SetupError(f"cannot create a network namespace: {exc.stderr.strip()}") from None
        self.made.append(self.hub)
        self._ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.hub, "link", "set", "br0", "up")
        self._ip("-n", self.hub, "link", "set", "lo", "up")
        for i, (ns, ip) in enumerate(zip(self.ns, self.ips)):
            self._ip("netns", "add", ns)
            self.made.append(ns)
            a, b = f"{self.tag}{i}a", f"{self.tag}{i}b"  # <= 15 chars
            self._ip("link", "add", a, "netns", ns, "type", "veth", "peer", "name", b, "netns", self.hub)
            self._ip("-n", ns, "link", "set", a, "name", "eth0")
            self._ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", self.hub, "link", "set", b, "master", "br0")
            self._ip("-n", self.hub, "link", "set", b, "up")
            if self.link_rate:
                _run(
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    "eth0",
                    "root",
                    "tbf",
                    "rate",
                    self.link_rate,
                    "burst",
                    "4mb",
                    "latency",
                    "50ms",
                )
                self.qdiscs.append(_run("ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", "eth0").stdout.strip())

    @staticmethod
    def _ip(*args: str) -> None:
        _run("ip", *args)

    # -------------------------------------------------------------------- processes
    def spawn(self, node: int, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``cmd`` inside node ``node``'s namespace with that node's hostname."""
        host = f"{self.tag}-node{node}"
        inner = f"hostname {host} && exec " + shlex.join(cmd)
        full = ["ip", "netns", "exec", self.ns[node], "unshare", "--uts", "sh", "-c", inner]
        out = open(log, "ab")
        p = subprocess.Popen(
            full, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True, env={**os.environ, **(env or {})}
        )
        self.procs.append(p)
        return p

    def run(self, node: int, cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> int:
        p = self.spawn(node, cmd, log, env)
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            _killpg(p, signal.SIGKILL)
            raise TimeoutError(f"{' '.join(cmd[:4])} ... did not finish within {timeout:.0f}s (log: {log})") from None

    def cut(self, node: int) -> None:
        """Block node ``node``'s switch port: its veth end taken off the hub's bridge, both links kept
        up, every packet dropped without a reset - as when a switch fails (netem and iptables are not
        on every kernel; this needs only ``ip``)."""
        self._ip("-n", self.hub, "link", "set", f"{self.tag}{node}b", "nomaster")

    def heal(self, node: int) -> None:
        """Open node ``node``'s switch port again (see :meth:`cut`)."""
        self._ip("-n", self.hub, "link", "set", f"{self.tag}{node}b", "master", "br0")

    def kill_node(self, node: int) -> int:
        """SIGKILL every process in node ``node``'s namespace (the node leaves); returns how many."""
        pids = _run("ip", "netns", "pids", self.ns[node], check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        return len(pids)

    def down(self) -> None:
        """Stop everything this cluster started and remove what it made (idempotent, bounded)."""
        for p in reversed(self.procs):  # ray start --block stops its Ray processes on SIGTERM
            _killpg(p, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _killpg(p, signal.SIGKILL)
        for i in range(len(self.ns)):  # anything still running in our namespaces (Ray workers, storage units)
            if self.ns[i] in self.made:
                self.kill_node(i)
        time.sleep(0.5)
        for ns in reversed(self.made):
            _run("ip", "netns", "del", ns, check=False)
        self.made.clear()


def forget_ray_cluster(address: str, temp_dir: str = "/tmp/ray") -> None:
    """Remove the note ``ray start --head`` leaves in Ray's temp dir (shared with this host: network
    namespaces do not separate files) while it still names our head, gone now: a later ``ray.init()``
    here would try to join it ("When connecting to an existing cluster, num_cpus ... must not be
    provided" - seen after a multinode run)."""
    path = os.path.join(temp_dir, "ray_current_cluster")
    try:
        with open(path) as f:
            if f.read().strip() == address:
                os.unlink(path)
    except OSError:
        pass


def _killpg(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _ray_started(p: subprocess.Popen, log: Path, timeout: float) -> bool:
    """Whether ``ray start --block`` (process ``p``, writing ``log``) reported its node running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "Ray runtime started" in log.read_text(errors="replace"):
            return True
        if p.poll() is not None:
            return False
        time.sleep(0.5)
    _killpg(p, signal.SIGKILL)
    return False


def _wait_port(cluster: NetnsCluster, node: int, ip: str, port: int, timeout: float, what: str) -> None:
    probe = f"import socket,sys; s=socket.socket(); s.settimeout(1); sys.exit(s.connect_ex(({ip!r},{port})))"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = _run("ip", "netns", "exec", cluster.ns[node], sys.executable, "-c", probe, check=False)
        if r.returncode == 0:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{what} not listening on {ip}:{port} within {timeout:.0f}s")


# ------------------------------------------------------------------------ in-cluster driver parts
def place_and_probe(ray_address: str, tq_address: str, shm_dir: str, capacity: int, out: str, nodes: int, fault: bool = False) -> None:
    """Runs on the head: place one storage unit per node, measure a cross-node get, keep the units up
    (they live as long as this driver) until SIGTERM. With ``fault``, also write partition ``"step"``:
    rows ``h*`` into the head's unit and rows ``w*`` into the last worker node's unit."""
    import numpy as np
    import ray
    import torch
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from tq import TQClient
    from tq.ray_placement import start_storage_units_on_ray_nodes, stop_storage_units

    ray.init(address=ray_address, log_to_driver=False)
    deadline = time.monotonic() + 180
    while sum(n["Alive"] for n in ray.nodes()) < nodes:  # worker nodes join after the head
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {sum(n['Alive'] for n in ray.nodes())} of {nodes} Ray nodes joined within 180s")
        time.sleep(0.5)
    handles = start_storage_units_on_ray_nodes(tq_address, capacity_per_unit=capacity, shm_dir=shm_dir)
    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeManagerAddress"])
    here = ray.util.get_node_ip_address()
    workers = [n for n in nodes if n["NodeManagerAddress"] != here]

    @ray.remote(num_cpus=0)
    def put_batch(nbytes: int) -> dict[str, Any]:
        c = TQClient(tq_address)
        c.register_partition("xfer", reuse=True)
        n = 64
        x = torch.from_numpy(np.random.default_rng(0).integers(0, 255, size=(n, nbytes // n), dtype=np.uint8))
        c.put("xfer", [f"k{i}" for i in range(n)], {"x": x})
        c.close()
        return {"host": socket.gethostname(), "sum": int(x.sum())}

    @ray.remote(num_cpus=0)
    def get_batch(reps: int) -> dict[str, Any]:
        c = TQClient(tq_address)
        meta = c.get_meta("xfer")
        best, total = float("inf"), 0
        for _ in range(reps):
            t0 = time.perf_counter()
            x = c.get(meta, ["x"])["x"]
            best = min(best, time.perf_counter() - t0)
            total = int(x.sum())
        c.close()
        return {"best_s": best, "nbytes": int(x.numel()), "sum": total, "host": socket.gethostname()}

    @ray.remote(num_cpus=0)
    def put_rows(prefix: str, n: int) -> dict[str, Any]:
        """``n`` rows of 64 KiB under keys ``<prefix><i>`` in partition "step" (this node's unit)."""
        c = TQClient(tq_address)
        try:
            c.register_partition("step")
        except Exception:  # noqa: BLE001 - the other writer made it first
            pass
        x = torch.from_numpy(np.random.default_rng(len(prefix) + ord(prefix[0])).integers(0, 255, size=(n, 64 << 10), dtype=np.uint8))
        c.put("step", [f"{prefix}{i}" for i in range(n)], {"x": x})
        c.close()
        return {"host": socket.gethostname(), "ip": ray.util.get_node_ip_address(), "sum": int(x.sum()), "rows": n}

    def on(node: dict, fn: Any, *args: Any) -> Any:
        return fn.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(*args)

    report: dict[str, Any] = {"nodes": [n["NodeManagerAddress"] for n in nodes], "units": len(handles)}
    if workers:  # write on a worker node; read on another node (a second worker, else the head) and on it
        reader = workers[1] if len(workers) > 1 else next(n for n in nodes if n["NodeManagerAddress"] == here)
        written = ray.get(on(workers[0], put_batch, XFER_MIB << 20), timeout=120)
        remote = ray.get(on(reader, get_batch, 5), timeout=120)
        local = ray.get(on(workers[0], get_batch, 5), timeout=120)
        assert remote["sum"] == written["sum"] == local["sum"], "cross-node get read other bytes"
        report["xfer"] = {
            "mib": XFER_MIB,
            "writer_host": written["host"],
            "cross_node": {"host": remote["host"], "best_s": remote["best_s"], "gb_s": remote["nbytes"] / remote["best_s"] / 1e9},
            "same_node": {"host": local["host"], "best_s": local["best_s"], "gb_s": local["nbytes"] / local["best_s"] / 1e9},
        }
        with TQClient(tq_address) as c:
            c.drop_partition("xfer")
    if fault and workers:
        head = next(n for n in nodes if n["NodeManagerAddress"] == here)
        report["fault_data"] = {
            "head": ray.get(on(head, put_rows, "h", FAULT_ROWS), timeout=120),
            "worker": ray.get(on(workers[-1], put_rows, "w", FAULT_ROWS), timeout=120),
        }
    Path(out).write_text(json.dumps(report))
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        time.sleep(0.2)
    stop_storage_units(handles)
    ray.shutdown()


def read_through_node_loss(tq_address: str, out: str, ready: str, budget_s: float = 120.0) -> None:
    """Runs on the head as a DP rank would: get partition "step" (rows on the head's unit and on a
    worker node's) again and again until a get fails - the worker node is killed meanwhile - then
    read the head's rows alone. Writes what happened to ``out``; never waits past ``budget_s``."""
    from tq import TQClient

    report: dict[str, Any] = {}
    with TQClient(tq_address, timeout=30.0) as c:
        meta = c.get_meta("step")
        gets, end = 0, time.monotonic() + budget_s
        while time.monotonic() < end:
            try:
                c.get(meta, ["x"])
            except Exception as exc:  # noqa: BLE001 - what the failing step sees is the result
                report.update(error_type=type(exc).__name__, error=str(exc), error_at=time.time())
                break
            gets += 1
            if gets == 1:
                Path(ready).write_text("1")
        report["gets_before_error"] = gets
        survivors = meta.select([k.startswith("h") for k in meta.keys])
        t = time.perf_counter()
        x = c.get(survivors, ["x"])["x"]
        report["survivors"] = {"rows": len(survivors), "sum": int(x.sum()), "get_s": time.perf_counter() - t}
        report["partitions_after"] = [p["partition"] for p in c.list_partitions()]
    Path(out).write_text(json.dumps(report))


def node_leaves(cluster: NetnsCluster, tq_address: str, data: dict[str, Any], run_dir: Path, env: dict[str, str]) -> dict[str, Any]:
    """Kill the last worker node (its raylet, workers and storage unit: every process in its namespace)
    while a reader on the head is getting rows from it; returns what the reader saw and when."""
    work = run_dir / "work"
    out, ready = work / "fault.json", work / "fault.ready"
    reader = cluster.spawn(
        0,
        [sys.executable, "-m", "benchmarks.multinode", "_read", "--tq-address", tq_address, "--out", str(out), "--ready", str(ready)],
        run_dir / "fault.log",
        env,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        if time.monotonic() > deadline or reader.poll() is not None:
            raise RuntimeError(f"the fault check's reader did not start reading (log: {run_dir / 'fault.log'})")
        time.sleep(0.1)
    time.sleep(0.5)  # a few gets in flight
    killed_at = time.time()
    victim = len(cluster.ns) - 1
    killed = cluster.kill_node(victim)
    try:
        reader.wait(150)
    except subprocess.TimeoutExpired:
        _killpg(reader, signal.SIGKILL)
        raise TimeoutError(f"the reader hung after node {victim} left (log: {run_dir / 'fault.log'})") from None
    if not out.exists():
        raise RuntimeError(f"the fault check's reader exited {reader.returncode} (log: {run_dir / 'fault.log'})")
    seen = json.loads(out.read_text())
    seen.update(
        node=cluster.ips[victim],
        processes_killed=killed,
        expected=data,
        error_after_s=round(seen["error_at"] - killed_at, 2) if "error_at" in seen else None,
    )
    return seen


def dataplane_points(dp: int, quick: bool) -> list[Any]:
    """The data-plane step's points across the cluster at ``dp`` ranks: 128 samples a rank of up to
    1k and 4k tokens (4 per-token fields) and 64 a rank with one 3x448x448 image each; ``quick``:
    one small point (CI)."""
    from benchmarks.dataplane_scale import Point

    if quick:
        return [Point(dp, 16 * dp, 256, 2)]
    return [Point(dp, 128 * dp, 1024, 4), Point(dp, 128 * dp, 4096, 4), Point(dp, 64 * dp, 1024, 2, images=1)]


def dataplane_across_nodes(ray_address: str, tq_address: str, out: str, dp: int, steps: int, quick: bool) -> None:
    """Runs on the head: ``benchmarks.dataplane_scale``'s legacy and TQ steps with the rollout actor on
    the head (the node of ``ray_address``) and the DP ranks spread over the worker nodes; writes the points and rows to ``out``."""
    from dataclasses import asdict

    from benchmarks.dataplane_scale import OnCluster, run_sweep
    from tq.connection import TQConnection

    points = dataplane_points(dp, quick)
    here = ray_address.rsplit(":", 1)[0]  # the head's IP: this driver's node
    rows = run_sweep(
        points,
        steps=steps,
        cpus_per_rank=DATAPLANE_RANK_CPUS,
        timeout=180.0,
        cluster=OnCluster(ray_address, TQConnection(tq_address, timeout_s=120.0), source_ip=here),
    )
    Path(out).write_text(json.dumps({"points": [asdict(p) for p in points], "rows": rows, "source_ip": here}))


def node_env(secret: str) -> dict[str, str]:
    """What every process of the emulated cluster gets on top of the caller's environment: the TQ
    secret, Ray's token authentication (it stays on, as a real cluster needs it: one token per run,
    given to every node and driver through the environment, as the TQ secret is) and this repository
    ahead of the caller's ``PYTHONPATH`` (kept: packages installed there must still import)."""
    return {
        "TQ_SECRET": secret,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        # The emulated hosts' names resolve nowhere: tell gloo (the DP ranks' CPU collectives) which
        # interface to use, as on any cluster whose hostnames do not resolve to the node's address.
        "GLOO_SOCKET_IFNAME": "eth0",
    }


# ------------------------------------------------------------------------ the whole run
def run(
    nodes: int,
    steps: int,
    link_rate: str | None,
    run_dir: Path,
    log: Any = print,
    fault: bool = False,
    dataplane_steps: int = 0,
    dataplane_quick: bool = False,
    partition_s: float = 0.0,
) -> dict[str, Any]:
    """Set the cluster up, run the transfer check, (``steps`` > 0) the GRPO job and (``dataplane_steps``
    > 0) the data-plane step across the nodes (:func:`dataplane_points`), tear down; returns the report.

    ``fault``: instead of the job, the last worker node leaves (every process in its namespace is
    killed) while a reader on the head gets rows from its storage unit (see :func:`node_leaves`).
    ``partition_s``: the last worker node is cut off for that long during the job (see
    :func:`run_grpo_job`)."""
    # Every file of a run is made afresh: the run waits for its helpers' output files to appear, so one
    # left by an earlier run into the same directory would be read as this run's result.
    shutil.rmtree(run_dir, ignore_errors=True)
    work = run_dir / "work"
    work.mkdir(parents=True)
    cluster = NetnsCluster(nodes, link_rate)
    secret = secrets.token_hex(16)
    env = node_env(secret)
    shm_dir = f"/dev/shm/{cluster.tag}"
    os.makedirs(shm_dir, exist_ok=True)
    head = cluster.ips[0]
    report: dict[str, Any] = {"nodes": nodes, "link_rate": link_rate, "ips": cluster.ips}
    t_start = time.monotonic()
    try:
        cluster.up()
        log(f"namespaces up: {', '.join(f'{ns}={ip}' for ns, ip in zip(cluster.ns, cluster.ips))}")
        ray_bin = shutil.which("ray") or "ray"
        common = ["--block", "--disable-usage-stats"]
        cluster.spawn(
            0,
            [
                ray_bin,
                "start",
                "--head",
                f"--node-ip-address={head}",
                f"--port={RAY_PORT}",
                "--num-cpus=0",
                "--include-dashboard=false",
                *common,
            ],
            run_dir / "ray-n0.log",
            env,
        )
        _wait_port(cluster, 0, head, RAY_PORT, 90, "Ray GCS")
        for i in range(1, nodes):  # one at a time: raylets starting together on a busy 2-core machine time out
            cmd = [
                ray_bin,
                "start",
                f"--address={head}:{RAY_PORT}",
                f"--node-ip-address={cluster.ips[i]}",
                f"--num-cpus={NODE_CPUS}",
                *common,
            ]
            for attempt in (1, 2):
                p = cluster.spawn(i, cmd, run_dir / f"ray-n{i}.log", env)
                if _ray_started(p, run_dir / f"ray-n{i}.log", 120):
                    break
                log(f"Ray node {i} failed to start (attempt {attempt}); see {run_dir / f'ray-n{i}.log'}")
            else:
                raise RuntimeError(f"Ray node {i} did not start; see {run_dir / f'ray-n{i}.log'}")
        cluster.spawn(
            0,
            [sys.executable, "-m", "tq.controller", "--host", head, "--port", str(TQ_PORT), "--storage-units", "0", "--shm-dir", shm_dir],
            run_dir / "controller.log",
            env,
        )
        _wait_port(cluster, 0, head, TQ_PORT, 60, "tq controller")
        tq_address = f"tcp://{head}:{TQ_PORT}"
        probe_out = work / "probe.json"
        cluster.spawn(
            0,
            [
                sys.executable,
                "-m",
                "benchmarks.multinode",
                "_place",
                "--ray-address",
                f"{head}:{RAY_PORT}",
                "--tq-address",
                tq_address,
                "--shm-dir",
                shm_dir,
                "--out",
                str(probe_out),
                "--nodes",
                str(nodes),
                *(["--fault"] if fault else []),
            ],
            run_dir / "placement.log",
            env,
        )
        deadline = time.monotonic() + 240
        while not probe_out.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"storage units not placed within 240s (log: {run_dir / 'placement.log'})")
            time.sleep(0.5)
        report["placement"] = json.loads(probe_out.read_text())
        report["tc"] = cluster.qdiscs
        log(f"storage units on {report['placement']['units']} nodes; transfer: {json.dumps(report['placement'].get('xfer'))}")
        if fault:
            report["fault"] = node_leaves(cluster, tq_address, report["placement"]["fault_data"], run_dir, env)
            log(
                f"node {report['fault']['node']} left: {report['fault'].get('error_type')} after "
                f"{report['fault'].get('error_after_s')} s: {report['fault'].get('error')}"
            )
            return report
        if steps > 0:
            report["train"] = run_grpo_job(cluster, steps, tq_address, secret, run_dir, env, partition_s)
            log(f"GRPO job: exit {report['train']['rc']}, {len(report['train']['steps'])} steps in {report['train']['wall_s']} s")
        if dataplane_steps > 0:
            out = work / "dataplane.json"
            cmd = [sys.executable, "-m", "benchmarks.multinode", "_dataplane", "--ray-address", f"{head}:{RAY_PORT}"]
            cmd += ["--tq-address", tq_address, "--out", str(out), "--dp", str(nodes - 1), "--steps", str(dataplane_steps)]
            rc = cluster.run(0, [*cmd, *(["--quick"] if dataplane_quick else [])], run_dir / "dataplane.log", timeout=600, env=env)
            if rc != 0 or not out.exists():
                raise RuntimeError(f"the data-plane step across nodes failed (exit {rc}); see {run_dir / 'dataplane.log'}")
            report["dataplane"] = json.loads(out.read_text())
            log(f"data-plane step across nodes: {len(report['dataplane']['rows'])} rows")
    finally:
        cluster.down()
        forget_ray_cluster(f"{head}:{RAY_PORT}")
        shutil.rmtree(shm_dir, ignore_errors=True)
        report["total_s"] = round(time.monotonic() - t_start, 1)
    return report


def run_grpo_job(
    cluster: NetnsCluster, steps: int, tq_address: str, secret: str, run_dir: Path, env: dict[str, str], partition_s: float = 0.0
) -> dict[str, Any]:
    """``trainer.grpo_sync`` on the head, connected to the cluster, one DP rank per worker node;
    returns its exit status, wall time and per-step metrics.

    ``partition_s`` > 0: once PARTITION_AFTER_STEP steps are done, the last worker node (a DP rank and
    a storage unit) is cut off (:meth:`NetnsCluster.cut`) for that long; the job must ride it out - a
    failed job is reported (its exit status and error line), not raised."""
    head, nodes = cluster.ips[0], len(cluster.ips)
    t0 = time.monotonic()
    train_cmd = [
        sys.executable,
        "-m",
        "trainer.grpo_sync",
        f"cluster.ray_address={head}:{RAY_PORT}",
        f"data_plane.address={tq_address}",
        f"data_plane.secret={secret}",
        f"grpo.max_num_steps={steps}",
        f"policy.dp_size={nodes - 1}",
        f"policy.num_cpus_per_worker={DP_WORKER_CPUS}",
        f"logger.log_dir={run_dir / 'train'}",
        "logger.run_name=multinode",
        "logger.data_movement_metrics=true",
        "logger.tensorboard=false",
        "logger.plot=false",
    ]
    metrics = run_dir / "train" / "multinode" / "metrics.jsonl"
    if not partition_s:
        rc = cluster.run(0, train_cmd, run_dir / "train.log", timeout=480, env=env)
        cut = None
    else:
        rc, cut = _job_through_partition(cluster, train_cmd, run_dir, env, metrics, partition_s)
    wall_s = round(time.monotonic() - t0, 1)
    if (rc != 0 and cut is None) or not metrics.exists():
        raise RuntimeError(f"the GRPO job failed (exit {rc}); see {run_dir / 'train.log'}")
    out = {"rc": rc, "wall_s": wall_s, "steps": _steps_of(metrics)}
    if cut is not None:
        log_lines = (run_dir / "train.log").read_text(errors="replace").splitlines()
        errors = [line for line in log_lines if line.startswith("error:")]
        # TQ reads held up by the cut log a warning when they start waiting (Ray may fold repeated lines)
        ansi = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the prefix of a worker's line
        cut["tq_read_waits"] = [ansi.sub("", line)[:300] for line in log_lines if "a read of its rows waits up to" in line]
        out.update(partition=cut, error=errors[-1][:600] if errors and rc != 0 else None)
    return out


PARTITION_AFTER_STEP = 4  # steps done before the partition: the job is warm, every path used
PARTITION_JOB_S = 900  # a job through a partition ends within this (Ray may wait minutes for an actor's death info)


def _steps_of(metrics: Path) -> list[dict[str, Any]]:
    """The step rows of a job's metrics.jsonl so far (its last line may be half written)."""
    if not metrics.exists():
        return []
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in rows if any(k.startswith("timing/") for k in r)]


def _job_through_partition(
    cluster: NetnsCluster, train_cmd: list[str], run_dir: Path, env: dict[str, str], metrics: Path, partition_s: float
) -> tuple[int, dict[str, Any]]:
    """Run the job, cut the last worker node off for ``partition_s`` once PARTITION_AFTER_STEP steps
    are done, heal it; returns the job's exit status and when each step ended around the cut."""
    node = len(cluster.ips) - 1
    p = cluster.spawn(0, train_cmd, run_dir / "train.log", env)
    deadline = time.monotonic() + PARTITION_JOB_S
    while len(_steps_of(metrics)) < PARTITION_AFTER_STEP:
        if p.poll() is not None or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    ended: list[float] = []  # when each step after the cut was seen done (0.2 s resolution)

    def watch(until: float) -> None:
        while time.time() < until and p.poll() is None:
            done, now = len(_steps_of(metrics)), time.time()
            ended.extend([now] * (done - PARTITION_AFTER_STEP - len(ended)))
            time.sleep(0.2)

    cut_at = time.time()
    cluster.cut(node)
    try:
        watch(cut_at + partition_s)
    finally:
        cluster.heal(node)
    healed_at = time.time()
    watch(healed_at + PARTITION_JOB_S)
    try:
        rc = p.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _killpg(p, signal.SIGKILL)
        rc = p.wait()
    done = len(_steps_of(metrics))
    while len(ended) < done - PARTITION_AFTER_STEP:  # the last ones, if the job ended between two looks
        ended.append(time.time())
    after = [round(t - healed_at, 2) for t in ended]
    return rc, {
        "node": cluster.ips[node],
        "cut_s": partition_s,
        "after_step": PARTITION_AFTER_STEP,
        "steps_ended_after_heal_s": after,  # of the steps after the cut, when each ended (negative: during it)
        "ended_after_heal_s": round(time.time() - healed_at, 1),
    }


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def _step_s(r: dict[str, Any]) -> float:
    return sum(v for k, v in r.items() if k in ("timing/generation", "timing/logprobs", "timing/training", "timing/refit"))


def _dataplane_ratio(d: dict[str, Any] | None) -> str:
    """Legacy's data movement over TQ's at the data-plane step's largest point, e.g. ``4.8x`` (the
    benchmark's own target computation)."""
    if not d:
        return "n/a"
    from benchmarks.dataplane_scale import Point, check_targets

    got = check_targets(d["rows"], {"nodes": [Point(**p) for p in d["points"]]}, {}, cores=0)
    return f"{got[0]['ratio']:.1f}x" if got else "n/a"


def render_section(report: dict[str, Any]) -> list[str]:
    """One cluster run (one link rate, the fault check, or a job through a partition) as markdown lines."""
    cut = report.get("train", {}).get("partition")
    if report.get("fault"):
        title = "A worker node leaves"
    elif cut:
        title = f"A worker node cut off for {cut['cut_s']:g} s mid-job"
    else:
        title = "Links " + (report["link_rate"] or "not rate-limited")
    lines = [
        f"## {title}",
        "",
        f"{report['nodes']} network namespaces (a head + {report['nodes'] - 1} worker nodes) bridged by veth pairs; "
        f"{report['total_s']} s in all." + (f" Every node's link: `{report['tc'][0]}`." if report.get("tc") else ""),
        "",
    ]
    x = report.get("placement", {}).get("xfer")
    if x:
        lines += [
            f"Storage units placed on {report['placement']['units']} nodes. A {x['mib']} MiB batch put on a worker node, "
            "read back bit-exact (best of 5 gets):",
            "",
            "| reader | path | get s | GB/s |",
            "|---|---|---|---|",
            f"| same node | shared memory | {x['same_node']['best_s']:.4f} | {x['same_node']['gb_s']:.2f} |",
            f"| other node | TCP over the veth bridge | {x['cross_node']['best_s']:.4f} | {x['cross_node']['gb_s']:.2f} |",
            "",
        ]
    t = report.get("train")
    if cut:
        steps = [_step_s(r) for r in t["steps"]]
        after, k = cut["steps_ended_after_heal_s"], cut["after_step"]
        # the step in flight at the heal: the first to end after it (one may have ended as the cut began)
        i = next((i for i, s in enumerate(after) if s >= 0), None)
        lines += [
            f"Once {k} steps were done, worker node {cut['node']} (a DP rank and a storage unit) was cut off for "
            f"{cut['cut_s']:g} s: its switch port blocked, every packet dropped without a reset, both links up. "
            f"The job: exit {t['rc']}, {len(t['steps'])} steps.",
            "",
        ]
        if i is not None and len(steps) > k + i:
            n = k + i
            lines.append(
                f"- the step in flight at the heal (step {n + 1}) took {steps[n]:.2f} s (the other steps' median "
                f"{_median(steps[:n] + steps[n + 1 :]):.2f} s) and ended {after[i]:.1f} s after the heal"
            )
        waits = cut.get("tq_read_waits", [])
        lines.append(
            f"- TQ reads held up by the cut (each logs that it waits for the silent unit): {len(waits)}"
            + (f", e.g. `{waits[0]}`" if waits else " - the cut met no read in flight this time (which phase it meets is chance)")
        )
        if t.get("error"):
            lines.append(f"- `{t['error']}` ({cut['ended_after_heal_s']} s after the heal)")
        lines.append("")
    if t:
        lines += [
            f"GRPO job (`trainer.grpo_sync`, tiny model, DP ranks on different nodes): exit {t['rc']}, "
            f"{len(t['steps'])} steps in {t['wall_s']} s (including start-up).",
            "",
            "| step | step s | data movement s | rank fetch s (max) | driver bytes in / out |",
            "|---|---|---|---|---|",
        ]
        for i, r in enumerate(t["steps"], 1):
            lines.append(
                f"| {i} | {_step_s(r):.2f} | {r.get('timing/data_movement', 0):.3f} | {r.get('timing/worker_fetch', 0):.3f} | "
                f"{int(r.get('driver_bytes_received', 0))} / {int(r.get('driver_bytes_sent', 0))} |"
            )
        lines.append("")
    d = report.get("dataplane")
    if d:
        from benchmarks.dataplane_scale import Point, step_table

        rows = d["rows"]
        nodes = {path: sorted({ip for r in rows if r["path"] == path for ip in r["rank_nodes"]}) for path in ("legacy", "tq")}
        lines += [
            "One GRPO step's data movement across the nodes (`benchmarks.dataplane_scale`'s legacy and TQ steps, the "
            f"model replaced by a pass that reads every byte; {rows[0]['steps']} timed steps per point and path after a "
            f"warm-up, medians): the rollout actor on the head ({d['source_ip']}), the DP ranks on the worker nodes "
            f"(legacy on {', '.join(nodes['legacy'])}, TQ on {', '.join(nodes['tq'])}), so every byte a rank reads "
            "crosses the network on both paths.",
            "",
            *step_table(rows, [Point(**p) for p in d["points"]]),
            "",
        ]
    f = report.get("fault")
    if f:
        e, s = f["expected"], f["survivors"]
        lines += [
            f"A reader on the head gets partition `step` ({e['head']['rows']} rows on the head's unit, "
            f"{e['worker']['rows']} on the unit of worker node {f['node']}) in a loop; every process of that "
            f"node's namespace (raylet, Ray workers, its storage unit: {f['processes_killed']}) is killed mid-loop.",
            "",
            f"- the get in flight failed after {f['error_after_s']} s ({f['gets_before_error']} gets before it) with "
            f"`{f.get('error_type')}: {f.get('error')}`",
            f"- the head's {s['rows']} rows read back afterwards: sum {'matches' if s['sum'] == e['head']['sum'] else 'DIFFERS'} "
            f"({s['get_s']:.3f} s); partitions still listed: {f['partitions_after']}",
            "",
        ]
    return lines


def render_md(reports: list[dict[str, Any]], machine: str, code: dict[str, Any]) -> str:
    """Every cluster run of one invocation as a markdown page (what the README quotes)."""
    lines = [
        "# Multi-node TQ on an emulated Ray cluster",
        "",
        f"`python -m benchmarks.multinode` on {machine}; code {code.get('commit', '?')}.",
        "",
    ]
    rated = [r for r in reports if not r.get("fault") and not r.get("train", {}).get("partition") and r.get("placement", {}).get("xfer")]
    if len(rated) > 1:
        lines += [
            "| links | cross-node get GB/s | same-node get GB/s | GRPO step s (median) | rank fetch s (median of max) "
            "| data movement legacy / TQ (largest point) |",
            "|---|---|---|---|---|---|",
        ]
        for r in rated:
            x, steps = r["placement"]["xfer"], r.get("train", {}).get("steps", [])[1:]  # step 1 warms up
            lines.append(
                f"| {r['link_rate'] or 'no limit'} | {x['cross_node']['gb_s']:.2f} | {x['same_node']['gb_s']:.2f} | "
                f"{_median([_step_s(s) for s in steps]):.2f} | {_median([s.get('timing/worker_fetch', 0) for s in steps]):.3f} | "
                f"{_dataplane_ratio(r.get('dataplane'))} |"
            )
        lines.append("")
    for r in reports:
        lines += render_section(r)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.outputs import add_output_args, code_version, cpu_model, machine_tag, open_run

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_place"]:  # internal: the placement driver the run starts inside the head namespace
        place = argparse.ArgumentParser(prog="python -m benchmarks.multinode _place")
        for flag in ("--ray-address", "--tq-address", "--shm-dir", "--out"):
            place.add_argument(flag, required=True)
        place.add_argument("--capacity", type=int, default=512 << 20)
        place.add_argument("--nodes", type=int, required=True)
        place.add_argument("--fault", action="store_true")
        a = place.parse_args(argv[1:])
        place_and_probe(a.ray_address, a.tq_address, a.shm_dir, a.capacity, a.out, a.nodes, a.fault)
        return 0
    if argv[:1] == ["_dataplane"]:  # internal: the data-plane step's driver, inside the head namespace
        dp = argparse.ArgumentParser(prog="python -m benchmarks.multinode _dataplane")
        for flag in ("--ray-address", "--tq-address", "--out"):
            dp.add_argument(flag, required=True)
        dp.add_argument("--dp", type=int, required=True)
        dp.add_argument("--steps", type=int, required=True)
        dp.add_argument("--quick", action="store_true")
        a = dp.parse_args(argv[1:])
        dataplane_across_nodes(a.ray_address, a.tq_address, a.out, a.dp, a.steps, a.quick)
        return 0
    if argv[:1] == ["_read"]:  # internal: the fault check's reader, inside the head namespace
        read = argparse.ArgumentParser(prog="python -m benchmarks.multinode _read")
        for flag in ("--tq-address", "--out", "--ready"):
            read.add_argument(flag, required=True)
        a = read.parse_args(argv[1:])
        read_through_node_loss(a.tq_address, a.out, a.ready)
        return 0
    ap = argparse.ArgumentParser(prog="python -m benchmarks.multinode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3, help="emulated nodes: a head (driver, controller) + worker nodes (default 3)")
    ap.add_argument("--steps", type=int, default=4, help="GRPO steps of the job (default 4; 0: only the cluster and the transfer check)")
    ap.add_argument(
        "--link-rate",
        default=None,
        help="tc rate limit of every node's link, e.g. 10gbit; a comma list runs a cluster per rate, "
        "'none' for no limit (e.g. none,10gbit,25gbit; default: none)",
    )
    ap.add_argument(
        "--dataplane-steps",
        type=int,
        default=3,
        help="timed steps of the data-plane step across the nodes, legacy vs TQ, per point (default 3; 0: not run)",
    )
    ap.add_argument(
        "--fault",
        action="store_true",
        help="also run the fault check on a cluster of its own: a worker node leaves while a reader gets its rows",
    )
    ap.add_argument(
        "--partition-s",
        type=float,
        default=0.0,
        help="also run the GRPO job on a cluster of its own with its last worker node cut off for this many "
        f"seconds once {PARTITION_AFTER_STEP} steps are done (the job must finish every step; default: not run)",
    )
    add_output_args(ap, "multinode")
    args = ap.parse_args(argv)
    rates = [None if r in ("", "none") else r for r in (args.link_rate or "none").split(",")]
    out = open_run("multinode", args.run_dir)
    reports = []
    try:
        for rate in rates:
            reports.append(
                run(args.nodes, args.steps, rate, Path(out.run_dir) / f"links-{rate or 'none'}", dataplane_steps=args.dataplane_steps)
            )
        if args.fault:
            reports.append(run(max(2, args.nodes), 0, None, Path(out.run_dir) / "fault", fault=True))
        if args.partition_s > 0:
            steps = max(args.steps, PARTITION_AFTER_STEP + 4)
            reports.append(run(max(2, args.nodes), steps, None, Path(out.run_dir) / "partition", partition_s=args.partition_s))
    except SetupError as exc:
        print(f"multinode: cannot emulate nodes on this machine: {exc}", file=sys.stderr)
        return 2
    code = code_version()
    machine = f"{os.cpu_count()} CPUs ({cpu_model()})"
    Path(out.path(".json")).write_text(json.dumps({"code": code, "machine": machine, "runs": reports}, indent=1))
    md = render_md(reports, machine, code)
    Path(out.path(".md")).write_text(md)
    print(md)
    out.finish(args.publish, args.machine or machine_tag())
    return 0 if all(r.get("train", {}).get("rc", 0) == 0 for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
