"""End to end tests of ``tq-controller`` (tq/cli.py), run as real subprocesses against a real service."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch

from conftest import popen_ctrl_c, wait_until
from tq import TQClient
from tq.cli import parse_size

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args: str, env: dict[str, str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tq.cli", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _kill_recorded(run_file: str) -> None:
    """Teardown safety net: kill a controller (and its units) the test left running."""
    try:
        with open(run_file) as f:
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
    """An environment whose TQ_RUN_DIR is a fresh temp dir, without a TQ_SECRET from outside."""
    env = dict(os.environ)
    env.pop("TQ_SECRET", None)
    env["TQ_RUN_DIR"] = str(tmp_path / "state")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    yield env
    _kill_recorded(os.path.join(env["TQ_RUN_DIR"], "controller.json"))


def test_parse_size():
    assert parse_size("4G") == 4 << 30
    assert parse_size("512M") == 512 << 20
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("64k") == 64 << 10
    assert parse_size("1000") == 1000
    with pytest.raises(Exception):
        parse_size("4X")


def test_start_status_put_stop(cli_env):
    run_file = os.path.join(cli_env["TQ_RUN_DIR"], "controller.json")
    started = run_cli("start", "--storage-units", "2", "--capacity", "128M", "--metrics-port", "0", env=cli_env)
    assert started.returncode == 0, started.stderr
    address = started.stdout.strip().splitlines()[-1]
    assert address.startswith("tcp://127.0.0.1:")
    state = json.load(open(run_file))
    assert state["address"] == address and psutil.pid_exists(state["pid"])
    metrics_url = state["metrics_url"]
    assert metrics_url.startswith("http://127.0.0.1:") and f"Prometheus metrics at {metrics_url}" in started.stderr
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        assert "tq_units 2.0" in r.read().decode().splitlines()
    assert os.path.exists(state["log"])
    controller = psutil.Process(state["pid"])
    units = [c for c in controller.children(recursive=True) if "tq.storage" in c.cmdline()]
    assert len(units) == 2
    (endpoint,) = [c for c in controller.children() if "tq.metrics" in c.cmdline()]
    units.append(endpoint)  # stopped with the service as well

    # A second start must refuse while the first one runs.
    again = run_cli("start", env=cli_env)
    assert again.returncode == 2
    assert "already running" in again.stderr and "Traceback" not in again.stderr

    table = run_cli("status", env=cli_env)
    assert table.returncode == 0, table.stderr
    for section in ("Partitions", "Storage units", "Operations", "put throughput", address, metrics_url):
        assert section in table.stdout
    assert "(none)" in table.stdout  # no partition yet
    assert "same-host connections 0" in table.stdout  # status and the metrics endpoint ask over ZMQ

    raw = run_cli("status", "--json", env=cli_env)
    assert raw.returncode == 0, raw.stderr
    stats = json.loads(raw.stdout)
    assert len(stats["units"]) == 2 and stats["partitions"] == []
    assert {u["arena_size"] for u in stats["unit_stats"]} == {64 << 20}

    with TQClient(address, timeout=10.0) as client:
        client.register_partition("cli-test")
        client.put("cli-test", ["a", "b", "c"], {"input_ids": [torch.arange(n) for n in (3, 5, 7)], "rewards": torch.ones(3)})
        connected = run_cli("status", env=cli_env)  # this client's thread holds its same-host connection
        assert connected.returncode == 0 and "same-host connections 1" in connected.stdout, connected.stdout

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
    assert not os.path.exists(run_file)
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
    assert not os.path.exists(os.path.join(cli_env["TQ_RUN_DIR"], "controller.json"))


def test_stop_when_nothing_runs(cli_env):
    r = run_cli("stop", env=cli_env)
    assert r.returncode != 0
    assert "no TQ controller" in r.stderr and "Traceback" not in r.stderr


def test_stop_process_waits_for_the_exit_and_kills_a_process_that_ignores_sigterm():
    """``launch.stop_process`` (what stops every service this project starts): the exit code of a
    process that ends on SIGTERM; one that ignores it is SIGKILLed once the timeout is out; an ended
    one is reaped, not signalled. ``wait_exit`` raises TimeoutExpired while a process runs."""
    from tq import launch

    ignores = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
    polite = subprocess.Popen([sys.executable, "-c", "import time; print(1, flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    stubborn = subprocess.Popen([sys.executable, "-c", ignores], stdout=subprocess.PIPE)
    done = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    for p in (polite, stubborn):
        p.stdout.readline()  # running (and, for the stubborn one, ignoring SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):
        launch.wait_exit(polite, 0.05)
    launch.stop_process(polite, 10.0)
    launch.stop_process(stubborn, 0.3)
    assert launch.wait_exit(done, 10.0) == 3
    launch.stop_process(done, 10.0)
    assert (polite.returncode, stubborn.returncode, done.returncode) == (-signal.SIGTERM, -signal.SIGKILL, 3)


def test_stale_run_file(cli_env):
    """A run file whose controller died is reported (and cleaned) by stop, and does not block start."""
    os.makedirs(cli_env["TQ_RUN_DIR"])
    run_file = os.path.join(cli_env["TQ_RUN_DIR"], "controller.json")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(run_file, "w") as f:
        json.dump({"address": "tcp://127.0.0.1:1", "pid": dead.pid, "log": None}, f)
    r = run_cli("stop", env=cli_env)
    assert r.returncode == 1 and "stale run file" in r.stderr
    assert not os.path.exists(run_file)


def test_start_fails_fast_when_units_cannot_start(cli_env):
    """A unit that cannot start (arena larger than the tmpfs) fails start with the cause, leaving nothing."""
    too_big = str(2 * shutil.disk_usage("/dev/shm").total)
    t0 = time.monotonic()
    r = run_cli("start", "--capacity", too_big, env=cli_env)
    assert r.returncode == 1
    assert "storage unit exited before registering" in r.stderr and "CapacityError" in r.stderr
    assert "Traceback" not in r.stderr.splitlines()[0] and len(r.stderr.strip().splitlines()) == 1
    assert time.monotonic() - t0 < 30
    assert not os.path.exists(os.path.join(cli_env["TQ_RUN_DIR"], "controller.json"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["start", "--port", "99999"], "port must be in 0..65535"),
        (["start", "--port", "-1"], "port must be in 0..65535"),
        (["start", "--port", "http"], "invalid port 'http'"),
        (["start", "--stream-port", "70000"], "port must be in 0..65535"),
        (["start", "--storage-units", "-1"], "must be >= 0"),
        (["start", "--capacity", "0"], "size must be positive"),
        (["status", "--timeout", "0"], "finite number of seconds > 0"),
        (["status", "--timeout", "nan"], "finite number of seconds > 0"),
        (["clean", "--min-age", "-1"], "finite number of seconds >= 0"),
        (["clean", "--min-age", "nan"], "finite number of seconds >= 0"),
        (["status", "--address", "nonsense"], "address must be a controller's 'tcp://HOST:PORT'"),
        (["stop", "--address", "tcp://127.0.0.1:0"], "address must be a controller's 'tcp://HOST:PORT'"),
        (["start", "--storage-units", "1000000", "--capacity", "1M"], "one controller starts at most 256 storage units"),
        (["start", "--storage-units", "4", "--capacity", "2M"], "gives each unit 524288 bytes; a unit needs at least 1048576"),
    ],
)
def test_numeric_arguments_are_checked_at_parse_time(cli_env, argv, message):
    """A bad number is refused before anything starts (a port of 99999 used to listen on 34463; a
    malformed --address was a ZMQ traceback; --storage-units 1000000 --capacity 1M started a million
    one-byte storage units, a process each, until the machine ran out)."""
    r = run_cli(*argv, env=cli_env)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not os.path.exists(os.path.join(cli_env["TQ_RUN_DIR"], "controller.json"))


@pytest.mark.parametrize(
    "module, argv",
    [
        ("tq.controller", ["--port", "99999"]),
        ("tq.controller", ["--commit-lease", "-1"]),
        ("tq.controller", ["--storage-units", "100000", "--capacity", "1M"]),
        ("tq.storage", ["--unit-id", "-2", "--bind", "tcp://127.0.0.1:0", "--controller", "tcp://127.0.0.1:1", "--capacity", "1M"]),
        ("tq.storage", ["--unit-id", "0", "--bind", "tcp://127.0.0.1:0", "--controller", "tcp://127.0.0.1:1", "--capacity", "-5"]),
    ],
)
def test_service_modules_check_numbers_at_parse_time(cli_env, module, argv):
    r = subprocess.run([sys.executable, "-m", module, *argv], env=cli_env, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "error: " in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_deprecated_spellings_still_work(cli_env, tmp_path):
    """--state-file and TQ_STATE_DIR (renamed --run-file and TQ_RUN_DIR) work, with a note to move on."""
    legacy = str(tmp_path / "legacy.json")
    r = run_cli("stop", "--state-file", legacy, env=cli_env)
    assert r.returncode == 1 and legacy in r.stderr and "--state-file is deprecated, use --run-file" in r.stderr
    env = {k: v for k, v in cli_env.items() if k != "TQ_RUN_DIR"}
    env["TQ_STATE_DIR"] = str(tmp_path / "old-dir")
    r = run_cli("stop", env=env)
    assert r.returncode == 1 and "TQ_STATE_DIR is deprecated, use TQ_RUN_DIR" in r.stderr
    assert os.path.join(env["TQ_STATE_DIR"], "controller.json") in r.stderr


def test_status_tells_how_long_a_unit_reported_down_has_not_answered():
    """A unit the controller has not heard for a while (stalled here; cut off by a network partition
    alike) is shown UNREACHABLE with how long it has been silent - reads of its rows wait for it - and
    DOWN once given up on (past the controller's unit_lost_s), in the stats and the status table."""
    import io
    import signal as sig

    from tq import TQServer
    from tq.cli import print_status
    from tq.supervision import UNIT_TIMEOUT_S

    lost_s = UNIT_TIMEOUT_S + 2.5
    with TQServer(storage_units=2, capacity=16 << 20, unit_lost_s=lost_s) as server, TQClient(server.address, timeout=5.0) as client:
        pid = client.stats()["unit_stats"][1]["pid"]
        os.kill(pid, sig.SIGSTOP)
        try:
            time.sleep(UNIT_TIMEOUT_S + 0.5)
            silent = client.stats()
            deadline = time.monotonic() + 15
            while not (lost := client.stats())["units"][1].get("lost") and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            os.kill(pid, sig.SIGCONT)
        up, down = sorted(silent["units"], key=lambda u: u["unit_id"])
        assert up["alive"] and "down_for_s" not in up
        assert not down["alive"] and not down["lost"] and UNIT_TIMEOUT_S < down["down_for_s"] < lost_s
        out = io.StringIO()
        print_status(silent, file=out)
        assert f"UNREACHABLE (no answer for {down['down_for_s']:.1f}s)" in out.getvalue()
        gone = sorted(lost["units"], key=lambda u: u["unit_id"])[1]
        assert gone["lost"] and gone["down_for_s"] >= lost_s, gone
        out = io.StringIO()
        print_status(lost, file=out)
        assert f"DOWN (no answer for {gone['down_for_s']:.1f}s)" in out.getvalue()


@pytest.mark.parametrize("json_out", [True, False], ids=["json", "table"])
def test_status_into_a_closed_pipe_exits_quietly(cli_env, json_out):
    """``tq-controller status --json | head``: a reader that leaves early is no error worth a traceback."""
    from tq import TQServer

    with TQServer(storage_units=1, capacity=16 << 20) as server:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tq.cli", "status", "--address", server.address, *(["--json"] if json_out else [])],
            env=cli_env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        proc.stdout.close()  # the reader is gone before the first line is written
        err = proc.stderr.read()
        proc.wait(timeout=60)
    assert err == "" and proc.returncode == 141, (proc.returncode, err)


def _exit_code_or_stacks(proc: subprocess.Popen, timeout: float, stderr: Path) -> int:
    """``proc``'s exit code once it exits within ``timeout``; else fail with its threads' stacks
    (started with ``-X faulthandler``, it dumps them to ``stderr`` on SIGABRT): a process that does not
    stop on Ctrl-C is a freeze to diagnose, and under load it happened once without a trace."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        pytest.fail(f"pid {proc.pid} still ran {timeout:.0f}s after SIGINT; its stacks:\n{stderr.read_text()[-6000:]}")


def test_status_watch_redraws_until_ctrl_c(cli_env, tmp_path):
    """``status --watch``: into a pipe its reader closes it ends quietly (141, as ``| head``); into a
    file (not a TTY: one view after the other) it redraws with request rates, shows a controller that
    went away as unreachable and keeps watching, and ends on Ctrl-C with 0."""
    from tq import TQServer

    watch = [sys.executable, "-X", "faulthandler", "-m", "tq.cli", "status", "--watch", "--timeout", "1", "--interval"]
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with TQServer(storage_units=1, capacity=16 << 20) as server:
        piped = subprocess.Popen(
            [*watch, "0.1", "--address", server.address], env=cli_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert "TQ service at" in piped.stdout.readline()
        piped.stdout.close()
        assert piped.stderr.read() == "" and piped.wait(timeout=60) == 141

        with open(out, "w") as o, open(err, "w") as e:
            proc = popen_ctrl_c([*watch, "0.2", "--address", server.address], env=cli_env, cwd=REPO, stdout=o, stderr=e)
        try:
            assert wait_until(lambda: out.read_text().count("Operations") >= 2, timeout=60), err.read_text()
            view = out.read_text().split("Operations")[-1]
            assert "req/s" in view and "Ctrl-C quits" in view
            assert re.search(r"controller\s+.\s+stats\s+.\s+\d+\s+.\s+0\s+.\s+[1-9]", view), view  # a few stats/s
            server.shutdown()
            assert wait_until(lambda: "is not reachable" in out.read_text(), timeout=30), out.read_text()[-2000:]
            assert proc.poll() is None  # still watching, for the controller to come back
            proc.send_signal(signal.SIGINT)
            assert _exit_code_or_stacks(proc, 30, err) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "Traceback" not in err.read_text() and "KeyboardInterrupt" not in err.read_text(), err.read_text()


CTRL_C_LAUNCHERS = {
    "tq-controller start --foreground": [
        sys.executable,
        "-X",
        "faulthandler",
        "-m",
        "tq.cli",
        "start",
        "--foreground",
        "--storage-units",
        "2",
        "--capacity",
        "32M",
    ],
    # the trainer's way: a TQServer embedded in a Python program that stops on KeyboardInterrupt
    "embedded TQServer": [
        sys.executable,
        "-X",
        "faulthandler",
        "-c",
        (
            "import sys, time\n"
            "from tq import TQServer\n"
            "try:\n"
            "    with TQServer(storage_units=2, capacity=32 << 20) as s:\n"
            "        print(s.address, flush=True)\n"
            "        time.sleep(120)\n"
            "except KeyboardInterrupt:\n"
            "    sys.exit(130)\n"
        ),
    ],
}


@pytest.mark.parametrize("launcher", list(CTRL_C_LAUNCHERS))
def test_ctrl_c_stops_the_service_quietly(cli_env, launcher, tmp_path):
    """Ctrl-C sends SIGINT to the terminal's whole process group - launcher, controller and storage
    units: every one stops without a traceback, and the controller does not report its units' exits
    as crashes (it used to log "storage unit 0 ... exited with code -2" and print a unit's
    17-line KeyboardInterrupt traceback)."""
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as o, open(err, "w") as e:  # files, not pipes: nothing here can block on a read
        proc = popen_ctrl_c(
            CTRL_C_LAUNCHERS[launcher], env=cli_env, cwd=REPO, stdout=o, stderr=e, start_new_session=True
        )  # its own process group: our "terminal"
    try:
        # Started once the launcher printed the address (the controller prints "TQ_READY <address>" too).
        started = wait_until(
            lambda: any(ln.startswith("tcp://") for ln in out.read_text().splitlines()) or proc.poll() is not None, timeout=60.0
        )
        assert started and proc.poll() is None, err.read_text()
        group = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        assert len(group) >= 4  # launcher, controller, 2 units
        os.killpg(proc.pid, signal.SIGINT)
        _exit_code_or_stacks(proc, 30, err)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    gone, alive = psutil.wait_procs(group, timeout=10)
    assert not alive, f"left running: {alive}"
    stderr = err.read_text()
    assert proc.returncode in (0, 130), (proc.returncode, stderr)
    for noise in ("Traceback", "KeyboardInterrupt", "exited with code", "ERROR"):
        assert noise not in stderr, stderr


def test_clean_lists_then_removes_what_a_service_killed_whole_left_and_nothing_of_a_live_one(cli_env):
    """A service SIGKILLed whole (controller and units: an OOM kill, a node agent) leaves its arenas,
    journals and location table in shared memory - on purpose, a controller started again on its
    journal dir recovers them. ``clean`` lists them, leaves arenas written within ``--min-age`` (a
    crashed unit about to be restarted), removes them with ``--yes``, and never touches a running
    service's files: its data stays readable."""
    import tempfile

    import torch

    from tq import TQClient, TQServer
    from tq.arena import ARENA_NAME

    shm_dir = tempfile.mkdtemp(prefix="tq-test-", dir="/dev/shm")
    dead = TQServer(storage_units=1, capacity=8 << 20, shm_dir=shm_dir)
    live = None
    try:
        with TQClient(dead.address, timeout=30.0) as c:
            c.register_partition("p")
            c.put("p", ["a"], {"x": torch.arange(1000).view(1, -1)})
        # the units first: a unit outliving its controller even for a moment is sent SIGTERM (it dies
        # with its parent) and exits cleanly, removing its arena - seen once in CI with the controller
        # killed first, the unit's SIGKILL a few ms behind
        controller = psutil.Process(dead.proc.pid)
        victims = [*controller.children(recursive=True), controller]
        for p in victims:
            p.kill()
        psutil.wait_procs(victims, timeout=10)
        left = sorted(n for n in os.listdir(shm_dir) if ARENA_NAME.fullmatch(n))
        assert len(left) == 1 and os.path.exists(os.path.join(shm_dir, left[0] + ".journal"))
        live = TQServer(storage_units=1, capacity=8 << 20, shm_dir=shm_dir)
        with TQClient(live.address, timeout=30.0) as c:
            c.register_partition("p")
            meta = c.put("p", ["b"], {"x": torch.arange(7).view(1, -1)})
            theirs = sorted(n for n in os.listdir(shm_dir) if ARENA_NAME.fullmatch(n) and n not in left)
            assert len(theirs) == 1

            young = run_cli("clean", "--shm-dir", shm_dir, "--yes", env=cli_env)  # the dead arena is seconds old
            assert young.returncode == 0 and left[0] in os.listdir(shm_dir), young.stdout + young.stderr
            listed = run_cli("clean", "--shm-dir", shm_dir, "--min-age", "0", env=cli_env)
            assert listed.returncode == 0 and "--yes" in listed.stdout, listed.stdout + listed.stderr
            assert left[0] in listed.stdout and f"{left[0]}.journal" in listed.stdout and theirs[0] not in listed.stdout
            assert left[0] in os.listdir(shm_dir)  # listing removes nothing
            removed = run_cli("clean", "--shm-dir", shm_dir, "--min-age", "0", "--yes", env=cli_env)
            assert removed.returncode == 0 and "removed" in removed.stdout, removed.stdout + removed.stderr
            names = os.listdir(shm_dir)
            assert left[0] not in names and f"{left[0]}.journal" not in names and theirs[0] in names
            assert c.get(meta)["x"].tolist() == [list(range(7))]
    finally:
        if live is not None:
            live.shutdown()
        dead.shutdown()
        shutil.rmtree(shm_dir, ignore_errors=True)


def test_start_with_a_stream_port_listens_there_and_fails_naming_it_when_taken(cli_env):
    """``--stream-port``: the controller's TCP stream socket (what clients of other hosts use besides
    --port, e.g. to open in a firewall) listens on exactly that port; a port already taken fails the
    start at once, naming the option and the port, instead of moving to another port."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        refused = run_cli("start", "--storage-units", "0", "--stream-port", str(port), env=cli_env)
        assert refused.returncode != 0
        assert f"--stream-port {port}" in refused.stderr and "in use" in refused.stderr, refused.stderr
    finally:
        taken.close()
    with socket.socket() as probe:  # a free port, released for the controller
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = run_cli("start", "--storage-units", "1", "--capacity", "64M", "--stream-port", str(port), env=cli_env)
    assert started.returncode == 0, started.stderr
    try:
        with open(os.path.join(cli_env["TQ_RUN_DIR"], "controller.json")) as f:
            address = json.load(f)["address"]
        with TQClient(address, transport="tcp") as remote:
            assert remote.stats()["stream_address"].startswith(f"tcp://127.0.0.1:{port}/")
            remote.register_partition("sp")
            meta = remote.put("sp", ["a"], {"x": torch.ones(1, 2)})
            assert remote.get(meta, ["x"])["x"].tolist() == [[1.0, 1.0]]
            assert remote.stats()["tcp_stream_connections"] >= 1  # the calls went over that port
    finally:
        assert run_cli("stop", env=cli_env).returncode == 0
