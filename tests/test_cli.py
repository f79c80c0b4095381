"""End to end tests of ``tq-controller`` (tq/cli.py), run as real subprocesses against a real service."""

from __future__ import annotations

import json
import shutil
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from tq import TQClient
from tq.cli import parse_size

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args: str, env: dict[str, str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tq.cli", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def _kill_recorded(state_file: str) -> None:
    """Teardown safety net: kill a controller (and its units) the test left running."""
    try:
        with open(state_file) as f:
            pid = json.load(f)["pid"]
        proc = psutil.Process(pid)
    except (OSError, ValueError, KeyError, psutil.NoSuchProcess):
        return
    procs = proc.children(recursive=True) + [proc]
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


@pytest.fixture()
def cli_env(tmp_path):
    """An environment whose TQ_STATE_DIR is a fresh temp dir, without a TQ_SECRET from outside."""
    env = dict(os.environ)
    env.pop("TQ_SECRET", None)
    env["TQ_STATE_DIR"] = str(tmp_path / "state")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    yield env
    _kill_recorded(os.path.join(env["TQ_STATE_DIR"], "controller.json"))


def test_parse_size():
    assert parse_size("4G") == 4 << 30
    assert parse_size("512M") == 512 << 20
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("64k") == 64 << 10
    assert parse_size("1000") == 1000
    with pytest.raises(Exception):
        parse_size("4X")


def test_start_status_put_stop(cli_env):
    state_file = os.path.join(cli_env["TQ_STATE_DIR"], "controller.json")
    started = run_cli("start", "--storage-units", "2", "--capacity", "128M", env=cli_env)
    assert started.returncode == 0, started.stderr
    address = started.stdout.strip().splitlines()[-1]
    assert address.startswith("tcp://127.0.0.1:")
    state = json.load(open(state_file))
    assert state["address"] == address and psutil.pid_exists(state["pid"])
    assert os.path.exists(state["log"])
    controller = psutil.Process(state["pid"])
    units = controller.children(recursive=True)
    assert len(units) == 2

    # A second start must refuse while the first one runs.
    again = run_cli("start", env=cli_env)
    assert again.returncode == 2
    assert "already running" in again.stderr and "Traceback" not in again.stderr

    table = run_cli("status", env=cli_env)
    assert table.returncode == 0, table.stderr
    for section in ("Partitions", "Storage units", "Operations", "put throughput", address):
        assert section in table.stdout
    assert "(none)" in table.stdout  # no partition yet

    raw = run_cli("status", "--json", env=cli_env)
    assert raw.returncode == 0, raw.stderr
    stats = json.loads(raw.stdout)
    assert len(stats["units"]) == 2 and stats["partitions"] == []
    assert {u["arena_size"] for u in stats["unit_stats"]} == {64 << 20}

    with TQClient(address, timeout=10.0) as client:
        client.register_partition("cli-test")
        client.put("cli-test", ["a", "b", "c"], {"input_ids": [torch.arange(n) for n in (3, 5, 7)], "rewards": torch.ones(3)})

    table = run_cli("status", env=cli_env)
    assert table.returncode == 0, table.stderr
    assert "cli-test" in table.stdout and "input_ids" in table.stdout and "rewards" in table.stdout
    stats = json.loads(run_cli("status", "--json", env=cli_env).stdout)
    (part,) = stats["partitions"]
    assert part["keys"] == 3 and part["bytes"] == (3 + 5 + 7) * 8 + 3 * 4
    assert stats["ops"]["commit"]["count"] == 1

    t0 = time.monotonic()
    stopped = run_cli("stop", env=cli_env)
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped" in stopped.stdout
    assert time.monotonic() - t0 < 25
    assert not os.path.exists(state_file)
    gone, alive = psutil.wait_procs([controller, *units], timeout=5)
    assert not alive, f"left running: {alive}"

    # Nothing recorded any more, and the old address no longer answers: both fail quickly with code 1.
    t0 = time.monotonic()
    after = run_cli("status", env=cli_env)
    assert after.returncode == 1 and "no TQ controller" in after.stderr
    after = run_cli("status", "--address", address, "--timeout", "2", env=cli_env)
    assert after.returncode == 1 and "not reachable" in after.stderr and "Traceback" not in after.stderr
    assert time.monotonic() - t0 < 20


def test_non_loopback_without_secret_refused(cli_env):
    r = run_cli("start", "--host", "0.0.0.0", env=cli_env)
    assert r.returncode == 2
    assert "without an auth secret" in r.stderr and "Traceback" not in r.stderr
    assert not os.path.exists(os.path.join(cli_env["TQ_STATE_DIR"], "controller.json"))


def test_stop_when_nothing_runs(cli_env):
    r = run_cli("stop", env=cli_env)
    assert r.returncode != 0
    assert "no TQ controller" in r.stderr and "Traceback" not in r.stderr


def test_stale_state_file(cli_env):
    """A state file whose controller died is reported (and cleaned) by stop, and does not block start."""
    os.makedirs(cli_env["TQ_STATE_DIR"])
    state_file = os.path.join(cli_env["TQ_STATE_DIR"], "controller.json")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(state_file, "w") as f:
        json.dump({"address": "tcp://127.0.0.1:1", "pid": dead.pid, "log": None}, f)
    r = run_cli("stop", env=cli_env)
    assert r.returncode == 1 and "stale state file" in r.stderr
    assert not os.path.exists(state_file)


def test_start_fails_fast_when_units_cannot_start(cli_env):
    """A unit that cannot start (arena larger than the tmpfs) fails start with the cause, leaving nothing."""
    too_big = str(2 * shutil.disk_usage("/dev/shm").total)
    t0 = time.monotonic()
    r = run_cli("start", "--capacity", too_big, env=cli_env)
    assert r.returncode == 1
    assert "storage unit exited before registering" in r.stderr and "CapacityError" in r.stderr
    assert "Traceback" not in r.stderr.splitlines()[0] and len(r.stderr.strip().splitlines()) == 1
    assert time.monotonic() - t0 < 30
    assert not os.path.exists(os.path.join(cli_env["TQ_STATE_DIR"], "controller.json"))
