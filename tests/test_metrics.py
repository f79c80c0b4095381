"""The Prometheus endpoint (tq/metrics.py): a real controller started with ``--metrics-port``, real
operations, a scrape over HTTP parsed with prometheus_client's own parser, names and values checked
against what the test did; and deploy/'s dashboard and scrape config checked against a live scrape."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import typing
import urllib.request
from typing import Any, Iterator

import msgspec
import pytest
import torch

from conftest import wait_until
from tq import TQClient, launch, messages
from tq.errors import AuthenticationError
from tq.metrics import METRICS, SCRAPE_TIMEOUT_S, MetricsServer, exported_names, families
from tq.rpc import RpcServer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "metrics-test-secret"
N_PUTS, KEYS_PER_PUT, ROW_BYTES, N_GETS = 5, 4, 100, 3


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """``python -m tq.controller --metrics-port 0`` with one storage unit and a secret: (address, metrics URL)."""
    ready = launch.new_ready_file("tq-metrics-test-")
    cmd = launch.controller_command(
        host="127.0.0.1", port=0, storage_units=1, capacity=32 << 20, shm_dir="/dev/shm", ready_file=ready, metrics_port=0
    )
    proc = subprocess.Popen(cmd, env=launch.service_env(SECRET), stdout=subprocess.DEVNULL)
    try:
        info = launch.await_ready_file(ready, alive=lambda: proc.poll() is None, timeout=60, what="the TQ controller")
        yield info["address"], info["metrics_url"]
    finally:
        launch.stop_process(proc, 15.0, tree=True)


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """``(sample name, its labels) -> value`` of one scrape, parsed by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_scrape_reports_what_the_test_did(service):
    address, url = service
    row_bytes = KEYS_PER_PUT * ROW_BYTES
    with TQClient(address, secret=SECRET, transport="tcp") as client:  # tcp: every byte goes through the unit's ops
        client.register_partition("m", reuse=True)  # the dashboard test may have made it
        metas = [
            client.put("m", [f"k{i}-{j}" for j in range(KEYS_PER_PUT)], {"x": torch.full((KEYS_PER_PUT, ROW_BYTES), i, dtype=torch.uint8)})
            for i in range(N_PUTS)
        ]
        for i in range(N_GETS):
            assert int(client.get(metas[i], ["x"])["x"][0, 0]) == i
    with pytest.raises(AuthenticationError):  # no secret: refused at the handshake
        TQClient(address, timeout=5.0)

    assert wait_until(lambda: value(scrape(url), "tq_auth_failures_total", server="controller") >= 1, timeout=10)
    s = scrape(url)
    ctl, unit = {"server": "controller"}, {"server": "unit-0"}
    # one or two: a client the server hangs up on tries once more before it calls it a refusal
    assert value(s, "tq_auth_failures_total", **ctl) in (1, 2)
    assert value(s, "tq_rejected_messages_total", **ctl) == value(s, "tq_auth_failures_total", **ctl)
    assert value(s, "tq_auth_failures_total", **unit) == 0
    # op counts, errors and latency histograms, by server and op
    for server, op, n in (
        ("controller", "commit", N_PUTS),
        ("controller", "locate", N_GETS),
        ("controller", "create_partition", 1),
        ("unit-0", "store", N_PUTS),
        ("unit-0", "fetch", N_GETS),
    ):
        assert value(s, "tq_op_requests_total", server=server, op=op) == n, (server, op)
        assert value(s, "tq_op_errors_total", server=server, op=op) == 0
        assert value(s, "tq_op_latency_seconds_count", server=server, op=op) == n
        buckets = sorted(
            (
                (float(dict(lb)["le"]), v)
                for (name, lb), v in s.items()
                if name == "tq_op_latency_seconds_bucket" and dict(lb)["server"] == server and dict(lb)["op"] == op
            )
        )
        assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1] == (float("inf"), n)
        assert 0 < value(s, "tq_op_latency_seconds_sum", server=server, op=op) < 10 * n
    # bytes: the column bytes went in as store frames and out as fetch frames (plus headers)
    assert N_PUTS * row_bytes < value(s, "tq_op_received_bytes_total", server="unit-0", op="store") < N_PUTS * (row_bytes + 4096)
    assert N_GETS * row_bytes < value(s, "tq_op_sent_bytes_total", server="unit-0", op="fetch") < N_GETS * (row_bytes + 4096)
    assert value(s, "tq_committed_bytes_total") == N_PUTS * row_bytes
    assert value(s, "tq_read_bytes_total", unit="0") == N_GETS * row_bytes
    assert value(s, "tq_unit_stored_bytes_total", unit="0") == N_PUTS * row_bytes
    assert value(s, "tq_unit_served_bytes_total", unit="0") == N_GETS * row_bytes
    # what the service holds
    assert value(s, "tq_partitions") == 1
    assert value(s, "tq_partition_keys", partition="m") == N_PUTS * KEYS_PER_PUT
    assert value(s, "tq_partition_bytes", partition="m") == N_PUTS * row_bytes
    assert value(s, "tq_unit_live_bytes", unit="0") == N_PUTS * row_bytes
    assert value(s, "tq_unit_blocks", unit="0") == N_PUTS
    assert value(s, "tq_unit_capacity_bytes", unit="0") == 32 << 20
    assert N_PUTS * row_bytes <= value(s, "tq_unit_used_bytes", unit="0") <= 32 << 20
    assert value(s, "tq_units") == 1 and value(s, "tq_unit_up", unit="0") == 1
    assert value(s, "tq_unit_held_bytes", unit="0") == 0  # no writer paused past its lease
    assert value(s, "tq_parked_waits") == 0
    assert value(s, "tq_journal_bytes", **ctl) == 0 and value(s, "tq_journal_bytes", **unit) > 0  # no --journal-dir
    assert value(s, "tq_local_connections", **unit) >= 1  # the controller reaches its same-host unit that way
    # nothing exported that the module does not declare (the dashboard test relies on the list)
    assert {name for name, _ in s} <= exported_names()


def test_a_unit_started_without_the_flag_records_metrics_once_registered(tmp_path):
    """A unit started as tq.ray_placement starts one (``python -m tq.storage`` with no ``--metrics``)
    learns from its registration that the service exports metrics: its latency histogram is served."""
    ready = launch.new_ready_file("tq-metrics-test-")
    ctl = subprocess.Popen(
        launch.controller_command(
            host="127.0.0.1", port=0, storage_units=0, capacity=8 << 20, shm_dir="/dev/shm", ready_file=ready, metrics_port=0
        ),
        env=launch.service_env(SECRET),
        stdout=subprocess.DEVNULL,
    )
    unit = None
    try:
        info = launch.await_ready_file(ready, alive=lambda: ctl.poll() is None, timeout=60, what="the TQ controller")
        unit_ready = str(tmp_path / "unit.json")
        cmd = launch.storage_unit_command(
            unit_id=0, bind="tcp://127.0.0.1:0", controller=info["address"], capacity=8 << 20, shm_dir="/dev/shm", ready_file=unit_ready
        )
        assert "--metrics" not in cmd
        unit = subprocess.Popen(cmd, env=launch.service_env(SECRET))
        launch.await_ready_file(unit_ready, alive=lambda: unit.poll() is None, timeout=30, what="the storage unit")
        with TQClient(info["address"], secret=SECRET, transport="tcp") as client:
            client.register_partition("u")
            meta = client.put("u", ["a", "b"], {"x": torch.ones(2, 8)})
            assert client.get(meta, ["x"])["x"].sum() == 16
        s = scrape(info["metrics_url"])
        assert value(s, "tq_op_latency_seconds_count", server="unit-0", op="store") == 1
        assert value(s, "tq_op_latency_seconds_count", server="unit-0", op="fetch") == 1
    finally:
        if unit is not None:
            launch.stop_process(unit, 10.0)
        launch.stop_process(ctl, 15.0, tree=True)


def test_dashboard_and_scrape_config_use_exported_names(service):
    """Every metric an expression of deploy/grafana/tq-dashboard.json names is in a live scrape."""
    import yaml

    address, url = service
    # at least one sample of every op and counter the panels read. Run after the scrape test (file
    # order), the service has them; under xdist this test may get a service of its own, which then
    # gets a put and a get over TCP (the controller counts read bytes at its locate) - never before
    # the scrape test on one service, whose counts are exact
    exported = lambda name: any(n == name for n, _ in scrape(url))  # noqa: E731
    with TQClient(address, secret=SECRET, transport="tcp") as client:
        client.register_partition("m", reuse=True)
        if not exported("tq_read_bytes_total"):
            client.get(client.put("m", ["d0"], {"x": torch.ones(1, 4)}), ["x"])
    assert wait_until(lambda: exported("tq_read_bytes_total"), timeout=10)
    live = {name for name, _ in scrape(url)}
    with open(os.path.join(REPO, "deploy", "grafana", "tq-dashboard.json")) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [
        v["query"]["query"] if isinstance(v.get("query"), dict) else v.get("query", "")
        for v in dashboard.get("templating", {}).get("list", [])
        if v.get("type") == "query"
    ]
    assert len(exprs) >= 10
    used = {m for e in exprs for m in re.findall(r"\b(?:tq|process)_[a-z0-9_]+\b", e)}
    assert used and used <= live, f"not exported: {sorted(used - live)}"
    assert {n.removesuffix("_bucket") for n in used if n.endswith("_bucket")} == {"tq_op_latency_seconds"}
    with open(os.path.join(REPO, "deploy", "prometheus.yml")) as f:
        config = yaml.safe_load(f)
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "tq")
    assert job.get("metrics_path", "/metrics") == "/metrics" and job["static_configs"][0]["targets"]


def _zeroed(cls: type, **given: Any) -> Any:
    """The reply struct ``cls`` with the ``given`` fields and every other field zero or empty."""

    def empty(t: Any) -> Any:
        origin = typing.get_origin(t)
        return origin() if origin in (list, dict) else None if origin is typing.Union else t()

    return cls(**{f: given[f] if f in given else empty(t) for f, t in typing.get_type_hints(cls).items()})


def _unit_info(unit_id: int, arena_size: int, address: str = "") -> messages.UnitInfo:
    return messages.UnitInfo(unit_id=unit_id, address=address, host=None, arena_path=None, arena_size=arena_size, pid=None, managed=True)


def test_a_unit_that_is_down_is_reported_down_not_dropped():
    """families() of a service whose unit 1 did not answer: up 0, its capacity still known."""
    stats = _zeroed(messages.StatsReply, units=[_unit_info(0, 10), _unit_info(1, 20)])
    unit_stats = {0: _zeroed(messages.UnitStatsReply, unit_id=0, bytes_used=5)}
    got = {(s.name, tuple(s.labels.values())): s.value for f in families(stats, unit_stats) for s in f.samples}
    assert got[("tq_unit_up", ("0",))] == 1 and got[("tq_unit_up", ("1",))] == 0
    assert got[("tq_unit_capacity_bytes", ("1",))] == 20 and ("tq_unit_used_bytes", ("1",)) not in got
    assert got[("tq_units", ())] == 2
    assert set(METRICS) >= {f.name + ("_total" if f.type == "counter" else "") for f in families(stats, unit_stats)}


@contextlib.contextmanager
def _server_answering_stats(name: str, result: Any) -> Iterator[str]:
    """A real RPC server (as another build of the service would be) answering ``stats`` with
    ``result``; yields its address."""
    srv = RpcServer(name, "tcp://127.0.0.1:0", secret=None, max_message_bytes=1 << 20)
    srv.serve_ops({"stats": messages.Stats}, {"stats": lambda args, buffers, call: result})
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv.address
    finally:
        srv.stop()
        t.join(5)


def test_a_controller_stats_reply_that_misfits_its_type_fails_the_scrape_fast_naming_op_and_field(caplog):
    """The endpoint stays up and serves its process metrics; the tq_ ones are left out and the log says
    which op's reply and which field did not fit (before: a TypeError deep in the scrape, and the HTTP
    connection dropped without an answer)."""
    bad = {**msgspec.to_builtins(_zeroed(messages.StatsReply)), "units": 5}
    with _server_answering_stats("controller", bad) as address:
        server = MetricsServer("127.0.0.1", 0, address, None)
        try:
            t0 = time.monotonic()
            s = scrape(server.url)
            assert time.monotonic() - t0 < SCRAPE_TIMEOUT_S
        finally:
            server.close()
    assert s and not any(name.startswith("tq_") for name, _ in s)
    assert re.search(r"reply to 'stats' does not fit its type: .*\$\.units", caplog.text), caplog.text


def test_a_unit_stats_reply_that_misfits_its_type_shows_the_unit_down():
    """A unit answering with the wrong shape is reported down, the controller's metrics are kept (before:
    its wrong values were exported, or the scrape failed)."""
    bad_unit = {**msgspec.to_builtins(_zeroed(messages.UnitStatsReply)), "blocks": "many"}
    with _server_answering_stats("storage unit 0", bad_unit) as unit_address:
        stats = _zeroed(messages.StatsReply, units=[_unit_info(0, 64, unit_address)], parked_waits=3)
        with _server_answering_stats("controller", stats) as address:
            server = MetricsServer("127.0.0.1", 0, address, None)
            try:
                s = scrape(server.url)
            finally:
                server.close()
    assert value(s, "tq_unit_up", unit="0") == 0 and value(s, "tq_unit_capacity_bytes", unit="0") == 64
    assert value(s, "tq_parked_waits") == 3 and ("tq_unit_blocks", frozenset({"unit": "0"})) not in s


@pytest.mark.parametrize("how", ["--metrics-port", "TQ_METRICS_PORT"])
def test_metrics_port_in_use_fails_fast_naming_it(how):
    """The flag, or the environment variable a program's embedded TQServer passes on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        flag = ["--metrics-port", str(port)] if how == "--metrics-port" else []
        env = {**launch.service_env(None), **({"TQ_METRICS_PORT": str(port)} if not flag else {})}
        r = subprocess.run(
            [sys.executable, "-m", "tq.controller", "--storage-units", "0", *flag], env=env, capture_output=True, text=True, timeout=60
        )
    assert r.returncode == 1 and f"cannot serve metrics on 127.0.0.1:{port}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_op_stats_window():
    """p50/p99 over the last LATENCY_WINDOW latencies (the ring wraps); the count over all."""
    import numpy as np

    from tq.rpc import LATENCY_WINDOW, OpStats

    lat = np.random.default_rng(0).exponential(1e-3, LATENCY_WINDOW + 904)
    st = OpStats()
    for x in lat.tolist():
        st.add(x)
    s = st.summary()
    recent = lat[-LATENCY_WINDOW:] * 1e3
    assert s["count"] == lat.size
    assert s["p50_ms"] == np.percentile(recent, 50, method="lower")
    assert s["p99_ms"] == np.percentile(recent, 99, method="lower")
    assert OpStats().summary() == {"count": 0, "errors": 0, "p50_ms": 0.0, "p99_ms": 0.0}
