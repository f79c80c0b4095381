"""Exactly-once training across a driver crash (issue 16).

Each test runs a trainer as a real subprocess (``python -m trainer.grpo_sync`` / ``trainer.grpo_async``)
against a real ``tq-controller start --journal-dir`` service that outlives it, with a secret and
checkpointing on; SIGKILLs the driver after a checkpoint, once it has trained past it and while a
step's samples (sync) or the collector's buffer (async) are in TQ; then runs the documented resume
(the same command again) to the end, and checks:

- the prompt ledger (``prompts.jsonl``, ``trainer.ledger``): over the lineage (the steps up to the
  restored checkpoint, then the resumed run's) every prompt of every epoch was trained on exactly once;
- sync: the resumed run retrains the steps the dead run trained past its checkpoint with bit-identical
  metrics (the slow variant: the whole lineage equals an uninterrupted run); async: see the slow test;
- the service holds no key (and none of the trainer's partitions) at the end, and the dead driver left
  keys there that the resumed run freed;
- no process of either driver is left (the resumed run reaps the dead driver's Ray agents at start).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from trainer.checkpoint import latest_checkpoint
from trainer.ledger import check_exactly_once, coverage, read_lineage, read_loader
from tq import TQClient

SECRET = "crash-resume-secret"
PROMPTS, PER_STEP = 16, 4  # 4 steps per epoch


# Short runs: 16 prompts, 4 per step (4 steps an epoch), 4 samples each, one DP worker (start-up is
# most of these runs' time), checkpoints every 2 steps.
QUICK = [
    f"grpo.num_prompts_per_step={PER_STEP}",
    "grpo.num_generations_per_prompt=4",
    f"data.num_builtin_prompts={PROMPTS}",
    "policy.dp_size=1",
    "policy.train_global_batch_size=16",
    "policy.train_micro_batch_size=8",
    "policy.logprob_batch_size=16",
    "checkpointing.save_period=2",
]


def _args(root: Path, address: str, steps: int, *extra: str) -> list[str]:
    return [
        f"grpo.max_num_steps={steps}",
        "grpo.val_period=0",
        *extra,
        "checkpointing.enabled=true",
        f"checkpointing.checkpoint_dir={root}/ckpt",
        f"logger.log_dir={root}/logs",
        "logger.tensorboard=false",
        "logger.plot=false",
        "cluster.num_cpus=2",
        f"data_plane.address={address}",
        f"data_plane.secret={SECRET}",
    ]


@pytest.fixture()
def tq_service(tmp_path):
    """A ``tq-controller start --journal-dir`` service (own state file), stopped after the test."""
    state = tmp_path / "tq" / "controller.json"
    env = {**os.environ, "TQ_SECRET": SECRET}
    out = subprocess.run(
        [
            "tq-controller",
            "start",
            "--journal-dir",
            str(tmp_path / "tq" / "journal"),
            "--run-file",
            str(state),
            "--storage-units",
            "1",
            "--capacity",
            "256M",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr
    address = out.stdout.strip().splitlines()[-1]
    try:
        yield address
    finally:
        subprocess.run(["tq-controller", "stop", "--run-file", str(state)], env=env, capture_output=True, timeout=60)


def _held(address: str) -> dict[str, int]:
    with TQClient(address, secret=SECRET, timeout=10.0) as c:
        return {p["partition"]: p["keys"] for p in c.list_partitions()}


def _session_procs(sid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of session ``sid`` (a driver started with start_new_session)."""
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error, PermissionError):
            continue
    return out


def _kill_session(sid: int) -> None:
    for p in _session_procs(sid):
        try:
            p.kill()
        except psutil.Error:
            pass


def _ledger_steps(tmp_path: Path) -> list[int]:
    files = list((tmp_path / "logs").glob("*/prompts.jsonl"))
    if not files:
        return []
    steps = []
    for line in files[0].read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "event" not in row:
            steps.append(row["step"])
    return steps


def _run_with_kill(
    module: str, args: list[str], tmp_path: Path, address: str, partition: str, timeout: float = 240, min_checkpoint: int = 1
):
    """Start the trainer, SIGKILL it once it has checkpointed (step >= ``min_checkpoint``), trained past
    the checkpoint, and holds keys in ``partition``; return (killed driver's pid, its checkpoint step,
    the steps it had logged, the keys it left in TQ)."""
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, (
                f"the run ended (code {proc.returncode}) before it could be killed: " + (tmp_path / "killed.log").read_text()[-3000:]
            )
            assert time.monotonic() < deadline, "no checkpoint and step past it in time: " + (tmp_path / "killed.log").read_text()[-3000:]
            ck = latest_checkpoint(tmp_path / "ckpt")
            if ck is not None and int(ck.name.split("_")[1]) >= min_checkpoint:
                ck_step = int(ck.name.split("_")[1])
                if max(_ledger_steps(tmp_path), default=0) > ck_step:
                    # Look with the driver stopped: a step it finished between the look and the kill
                    # would have cleared the keys (seen once in a full run).
                    os.kill(proc.pid, signal.SIGSTOP)
                    if _held(address).get(partition, 0) > 0:
                        os.kill(proc.pid, signal.SIGKILL)  # the driver only: what it started is left to fend for itself
                        break
                    os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.02)
        proc.wait(30)
        left = _held(address)
    except BaseException:
        _kill_session(proc.pid)
        raise
    finally:
        log.close()
    ck = latest_checkpoint(tmp_path / "ckpt")
    return proc.pid, int(ck.name.split("_")[1]), _ledger_steps(tmp_path), left


def _run(
    module: str, args: list[str], tmp_path: Path, timeout: float = 300, name: str = "resumed"
) -> tuple[subprocess.CompletedProcess, int]:
    """Run the trainer to its end; (its completed process, its pid)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException:
        _kill_session(proc.pid)
        proc.kill()
        raise
    (tmp_path / f"{name}.log").write_text(out)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out), proc.pid


def _metrics(root: Path) -> list[dict]:
    (f,) = list((root / "logs").glob("*/metrics.jsonl"))
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def _check_no_leftovers(address: str, *sids: int) -> None:
    assert _held(address) == {}, "the service still holds the trainer's partitions or keys"
    with TQClient(address, secret=SECRET, timeout=10.0) as c:
        units = c.stats().get("unit_stats", [])
    assert units and all(u.get("bytes_used") == 0 and u.get("blocks") == 0 for u in units), units  # no bytes held either
    deadline = time.monotonic() + 15
    while any(_session_procs(s) for s in sids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {s: [(p.pid, p.name()) for p in _session_procs(s)] for s in sids}
    for s in sids:
        _kill_session(s)
    assert not any(left.values()), f"processes left running: {left}"


def _crash_and_resume(
    module: str, partition: str, tmp_path: Path, address: str, steps: int, *extra: str, min_checkpoint: int = 1, timeout: float = 300
):
    """Kill a run mid-way, resume it to the end; check the lineage trained every prompt of every epoch
    exactly once and nothing is left behind. Returns (checkpoint step resumed from, steps the dead run logged)."""
    args = _args(tmp_path, address, steps, *extra)
    dead_pid, ck_step, dead_steps, left = _run_with_kill(module, args, tmp_path, address, partition, timeout, min_checkpoint)
    assert left.get(partition, 0) > 0, left  # the dead driver left keys behind
    done, new_pid = _run(module, args, tmp_path, timeout)
    assert done.returncode == 0, done.stdout[-4000:]
    assert f"resumed from {tmp_path}/ckpt/step_{ck_step} at step {ck_step}" in done.stdout
    assert "freed" in done.stdout and f"TQ partition {partition!r}" in done.stdout  # the dead driver's keys
    (run_dir,) = [p for p in (tmp_path / "logs").iterdir() if p.is_dir()]
    lineage = read_lineage(run_dir / "prompts.jsonl")
    loader = read_loader(run_dir / "prompts.jsonl")
    assert sorted(lineage) == list(range(1, steps + 1))
    epochs = steps * loader.batch_size // len(loader.epoch_indices(0))
    assert epochs >= 2 and steps * loader.batch_size % len(loader.epoch_indices(0)) == 0  # whole epochs only
    assert check_exactly_once(lineage, loader.epoch_indices, range(epochs)) == []
    cov = coverage(lineage)
    assert sorted(cov) == list(range(epochs))
    for e, c in cov.items():  # no dynamic sampling here: every row of the epoch trained on, once
        assert sorted(c["trained"].elements()) == sorted(loader.epoch_indices(e)) and not c["dropped"]
    report = subprocess.run([sys.executable, "-m", "trainer.ledger", str(run_dir)], capture_output=True, text=True)
    assert report.returncode == 0 and "problem" not in report.stdout, report.stdout
    _check_no_leftovers(address, dead_pid, new_pid)
    return ck_step, dead_steps


@pytest.mark.long
def test_sync_driver_killed_mid_run_resumes_exactly_once(tmp_path, tq_service):
    """kill -9 of ``python -m trainer.grpo_sync`` mid-step after a checkpoint; the same command resumes:
    every prompt trained once per epoch over the lineage, and the steps the dead run trained past its
    checkpoint come out bit-identical when retrained (the sync path is deterministic)."""
    steps = 8
    ck_step, dead_steps = _crash_and_resume("trainer.grpo_sync", "train", tmp_path, tq_service, steps, *QUICK)
    rows = _metrics(tmp_path)
    resume_at = next(i for i, r in enumerate(rows) if r["split"] == "resume")
    dead = {r["step"]: r for r in rows[:resume_at] if r["split"] == "train"}
    new = {r["step"]: r for r in rows[resume_at:] if r["split"] == "train"}
    assert sorted(new) == list(range(ck_step + 1, steps + 1))
    retrained = sorted(set(dead) & set(new))
    assert retrained and retrained[0] == ck_step + 1, (ck_step, sorted(dead))
    for t in retrained:
        for key in ("reward", "loss", "seq_logprob_error", "grad_norm"):
            assert dead[t][key] == new[t][key], (t, key, dead[t][key], new[t][key])


# slow: the sync test above runs the same kill-and-resume path in CI (80 s of the suite's 10 minutes)
@pytest.mark.slow
def test_async_driver_killed_mid_run_resumes_exactly_once(tmp_path, tq_service):
    """kill -9 of ``python -m trainer.grpo_async`` with the collector's buffer in TQ; the same command
    resumes: every prompt trained once per epoch over the lineage (the prompts the dead collector had
    pulled for later steps are regenerated, none lost), no trajectory older than the bound."""
    steps = 8
    _crash_and_resume("trainer.grpo_async", "async_replay", tmp_path, tq_service, steps, *QUICK, "async_grpo.max_trajectory_age_steps=1")
    rows = [r for r in _metrics(tmp_path) if r["split"] == "train"]
    assert all(0 <= r["async/trajectory_age_max"] <= 1 for r in rows)


# ----------------------------------------------------------------- resuming from a damaged or mismatched checkpoint
# One real run (the legacy trainer, 2 steps, a checkpoint each) makes step_1 and step_2; each test
# resumes from a copy. Everything refused or settled from the checkpoint's files alone is decided
# before Ray starts (these runs take a few seconds each).
TINY = [
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "data.num_builtin_prompts=16",
    "policy.dp_size=1",
    "policy.train_global_batch_size=16",
    "policy.train_micro_batch_size=8",
    "policy.logprob_batch_size=8",
    "grpo.val_period=0",
    "checkpointing.enabled=true",
    "checkpointing.save_period=1",
    "logger.tensorboard=false",
    "logger.plot=false",
    "cluster.num_cpus=2",
]


def _tiny(root: Path, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    args = [*TINY, f"checkpointing.checkpoint_dir={root}/ck", f"logger.log_dir={root}/logs", *extra]
    return subprocess.run([sys.executable, "-m", "trainer.grpo", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("two_checkpoints")
    r = _tiny(root, "grpo.max_num_steps=2", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in (root / "ck").iterdir()) == ["step_1", "step_2"]
    return root


@pytest.fixture()
def lineage(two_checkpoints, tmp_path) -> Path:
    """A copy of the two-checkpoint run to resume (and damage)."""
    import shutil

    shutil.copytree(two_checkpoints, tmp_path / "run")
    return tmp_path / "run"


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def _damage(step_dir: Path, what: str) -> None:
    if what == "trainer_state.json":
        f = step_dir / what
        f.write_text(f.read_text()[:20])  # truncated
    elif what == "rng.pt":
        (step_dir / what).write_bytes(b"")
    else:  # policy/model.pt, truncated
        f = step_dir / what
        f.write_bytes(f.read_bytes()[:5000])


def test_resuming_with_other_loader_settings_is_refused_naming_the_checkpoint_and_key(lineage):
    """grpo.num_prompts_per_step changed since the checkpoint: one line naming the checkpoint and the
    setting, before Ray starts (it was a ValueError naming neither, after the policy had loaded)."""
    r = _tiny(lineage, "grpo.max_num_steps=4", "grpo.num_prompts_per_step=8", "policy.train_global_batch_size=32")
    assert r.returncode == 2, r.stderr
    assert _lines(r.stderr) == [
        f"error: checkpoint {lineage}/ck/step_2 was saved with grpo.num_prompts_per_step=4, this run has grpo.num_prompts_per_step=8: "
        "its data position holds only for the same prompts and batches; resume with the checkpoint's setting, or start over "
        "in another checkpointing.checkpoint_dir"
    ]
    r = _tiny(lineage, "grpo.max_num_steps=4", "data.num_builtin_prompts=20")
    assert r.returncode == 2 and "16 training prompts, this run has 20 (data.num_builtin_prompts=20)" in r.stderr, r.stderr
    assert "ray" not in (r.stdout + r.stderr).lower()


@pytest.mark.parametrize("damaged", ["trainer_state.json", "rng.pt", "policy/model.pt"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(lineage, damaged):
    """step_2 complete but one of its files damaged (truncated JSON, an empty rng.pt, a truncated
    model.pt): a warning naming it and why, and the run resumes from step_1 - here it stops at once,
    saying there is nothing to train (grpo.max_num_steps=1), all before Ray starts. These were a
    JSONDecodeError / EOFError traceback, and a line naming no checkpoint."""
    _damage(lineage / "ck" / "step_2", damaged)
    r = _tiny(lineage, "grpo.max_num_steps=1")
    assert r.returncode == 0, r.stderr
    (warning,) = _lines(r.stderr)
    assert warning.startswith(f"warning: checkpoint {lineage}/ck/step_2 is damaged ({damaged} is ")
    assert warning.endswith(f"resuming from the previous intact one, {lineage}/ck/step_1"), warning
    assert _lines(r.stdout) == [
        f"nothing to train: checkpoint {lineage}/ck/step_1 is at step 1 and grpo.max_num_steps=1; raise grpo.max_num_steps to train on"
    ]


def test_no_intact_checkpoint_is_refused_and_max_steps_reached_is_said(lineage):
    """Every complete checkpoint damaged: refused naming the directory and each problem (not a silent
    fresh start over the lineage). grpo.max_num_steps at or below the checkpoint's step: one line
    saying there is nothing to train (it started everything, trained nothing and exited in silence)."""
    r = _tiny(lineage, "grpo.max_num_steps=2")
    assert r.returncode == 0 and "ray" not in (r.stdout + r.stderr).lower(), r.stderr
    assert _lines(r.stdout) == [
        f"nothing to train: checkpoint {lineage}/ck/step_2 is at step 2 and grpo.max_num_steps=2; raise grpo.max_num_steps to train on"
    ]
    _damage(lineage / "ck" / "step_2", "rng.pt")
    _damage(lineage / "ck" / "step_1", "trainer_state.json")
    r = _tiny(lineage, "grpo.max_num_steps=4")
    assert r.returncode == 2, r.stderr
    (line,) = _lines(r.stderr)
    assert line.startswith(f"error: checkpointing.checkpoint_dir={lineage}/ck: no intact checkpoint to resume from (step_2: rng.pt is ")
    assert "; step_1: trainer_state.json is unreadable" in line


# slow: the fallback itself is decided before Ray starts (the test above); this one trains on past it
@pytest.mark.slow
def test_a_run_resumed_past_a_damaged_checkpoint_trains_on_and_sets_it_aside(lineage):
    """A truncated model.pt in step_2: the run resumes from step_1, moves step_2 aside (out of the lineage
    and of pruning) and trains steps 2-3."""
    _damage(lineage / "ck" / "step_2", "policy/model.pt")
    r = _tiny(lineage, "grpo.max_num_steps=3", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {lineage}/ck/step_1 at step 1" in r.stdout
    assert f"moved the damaged checkpoint {lineage}/ck/step_2 to {lineage}/ck/corrupt_step_2" in r.stderr
    assert sorted(p.name for p in (lineage / "ck").iterdir() if p.is_dir()) == ["corrupt_step_2", "step_2", "step_3"]


# ---------------------------------------------------------------------------------------------- no Ray
def test_ledger_lineage_forgets_the_dead_runs_steps_past_its_checkpoint(tmp_path):
    from trainer.ledger import PromptLedger
    from trainer.logger import read_metrics_lineage

    led = PromptLedger(tmp_path)
    led.start(0, loader={"dataset_len": 4, "batch_size": 2, "seed": 0, "shuffle": False, "drop_last": True})
    for t, rows in ((1, [0, 1]), (2, [2, 3]), (3, [0, 1])):
        led.record(t, [(t > 2, i) for i in rows])
    led.start(2, checkpoint=tmp_path / "ck" / "step_2")  # killed after step 3; resumed from step 2
    led.record(3, [(1, 1), (1, 0)])
    led.record(4, [(1, 2)], dropped=[(1, 3)])  # dynamic sampling filtered prompt 3's group
    led.close()
    with open(tmp_path / "prompts.jsonl", "a") as f:
        f.write('{"step": 5, "trai')  # torn by a SIGKILL
    lineage = read_lineage(tmp_path / "prompts.jsonl")
    assert sorted(lineage) == [1, 2, 3, 4] and lineage[3]["trained"] == [[1, 1], [1, 0]]
    assert check_exactly_once(lineage, range(4), [0, 1]) == []
    assert read_loader(tmp_path / "prompts.jsonl").epoch_indices(1) == [0, 1, 2, 3]
    lineage[4]["trained"].append([1, 1])
    lineage.pop(2)
    assert check_exactly_once(lineage, range(4), [0, 1]) == [
        "steps [2] are missing from the lineage",
        "epoch 1: prompts [1] drawn more than once",
        "epoch 0: prompts [2, 3] never trained on",
    ]

    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"step": 1, "split": "train"},
                {"step": 2, "split": "train"},
                {"step": 3, "split": "train"},
                {"step": 2, "split": "resume"},
                {"step": 3, "split": "train", "x": 1},
                {"step": 4, "split": "train"},
            ]
        )
    )
    assert [(r["step"], r.get("x")) for r in read_metrics_lineage(tmp_path / "metrics.jsonl")] == [(1, None), (2, None), (3, 1), (4, None)]


def test_batch_source_records_what_dynamic_sampling_trained_and_dropped():
    """Two generation batches for one step: batch 0 keeps prompts 0 and 1 (2 and 3 had zero reward std),
    batch 1 brings 4, 5 and 6 of which 6 is surplus: trained 0, 1, 4, 5; dropped 2, 3, 6, 7."""
    from rollout.data import StatefulDataLoader
    from trainer.base import BatchSource

    src = BatchSource(StatefulDataLoader([{"idx": i} for i in range(8)], 4, shuffle=False))
    src.next(), src.next()
    group = 2
    kept = [0, 1, 1_000_000 + 4, 1_000_000 + 5]  # per sample, as the trainers number prompts across batches
    src.settle([p for p in kept for _ in range(group)])
    assert src.trained == [(0, 0), (0, 1), (0, 4), (0, 5)]
    assert src.dropped == [(0, 2), (0, 3), (0, 6), (0, 7)]


def test_driver_record_refuses_a_live_driver_and_reaps_a_dead_ones_processes(tmp_path, capsys):
    import socket

    from trainer.driver import FILE_NAME, DriverConflictError, DriverRecord

    def record(pid, ct, processes=()):
        (tmp_path / FILE_NAME).write_text(
            json.dumps(
                {
                    "pid": pid,
                    "create_time": ct,
                    "host": socket.gethostname(),
                    "boot_time": psutil.boot_time(),
                    "processes": [{"pid": p.pid, "create_time": psutil.Process(p.pid).create_time()} for p in processes],
                }
            )
        )

    live = subprocess.Popen(["sleep", "60"])  # stands in for a driver still running
    leftover = subprocess.Popen(["sleep", "60"])  # stands in for the Ray agent a killed driver left
    bystander = subprocess.Popen(["sleep", "60"])  # a recycled pid: same pid recorded, another start time
    try:
        record(live.pid, psutil.Process(live.pid).create_time())
        with pytest.raises(DriverConflictError, match=f"another driver \\(pid {live.pid}\\)"):
            DriverRecord.claim(tmp_path)
        live.kill()
        live.wait()
        record(live.pid, psutil.Process(leftover.pid).create_time() - 100, [leftover])
        data = json.loads((tmp_path / FILE_NAME).read_text())
        data["processes"].append({"pid": bystander.pid, "create_time": psutil.Process(bystander.pid).create_time() - 5})
        (tmp_path / FILE_NAME).write_text(json.dumps(data))
        rec = DriverRecord.claim(tmp_path)
        assert leftover.wait(5) == -signal.SIGKILL and bystander.poll() is None
        assert "reaped 1 processes left running by the previous driver" in capsys.readouterr().out
        assert json.loads((tmp_path / FILE_NAME).read_text())["pid"] == os.getpid()
        rec.release()
        assert not (tmp_path / FILE_NAME).exists()
    finally:
        for p in (live, leftover, bystander):
            p.kill()
            p.wait()


# ---------------------------------------------------------------------------------------------- slow
# The default offline recipe (200 prompts, 16 per step: 12 steps an epoch, 192 rows each), 396 steps =
# 33 epochs, checkpoints every 40 steps; killed after the checkpoint of step 80 or later. Since the
# built-in task holds out its validation pairs (874b7de) the recipe learns more slowly: the mean reward
# of the last 20 steps, uninterrupted, on the 2-vCPU VM (2026-11-28) - sync 0.67 at step 240 (the old
# length, under the 0.7 bar this test had), 0.80 at 360, 0.79 at 400; async 0.69 at 240, then 0.71-0.78
# from 280 to 400 (a plateau with noise).
LONG_STEPS = 396
LEARNED = 0.6  # the final reward both runs must pass (a random model: 0.01)


@pytest.mark.slow
@pytest.mark.parametrize("module, partition", [("trainer.grpo_sync", "train"), ("trainer.grpo_async", "async_replay")])
def test_killed_learning_run_ends_like_an_uninterrupted_one(tmp_path, tq_service, module, partition):
    """The default recipe for 396 steps, killed after step 80 and resumed, against the same run
    uninterrupted: every prompt of all 33 epochs trained once over the lineage; sync: every step's
    metrics bit-identical to the uninterrupted run's; async: the final reward (mean of the last 20
    steps) within 0.1 of the uninterrupted run's, both past ``LEARNED`` (from 0.01 at step 1)."""
    straight_dir = tmp_path / "straight"
    args = _args(straight_dir, tq_service, LONG_STEPS, "checkpointing.save_period=40")
    done, pid = _run(module, args, tmp_path, timeout=600, name="straight")
    assert done.returncode == 0, done.stdout[-4000:]
    _check_no_leftovers(tq_service, pid)
    straight = {r["step"]: r for r in _metrics(straight_dir) if r["split"] == "train"}

    crashed_dir = tmp_path / "crashed"
    crashed_dir.mkdir()
    _crash_and_resume(
        module, partition, crashed_dir, tq_service, LONG_STEPS, "checkpointing.save_period=40", min_checkpoint=80, timeout=600
    )
    from trainer.logger import read_metrics_lineage

    lineage = {r["step"]: r for r in read_metrics_lineage(next((crashed_dir / "logs").glob("*/metrics.jsonl"))) if r["split"] == "train"}
    assert sorted(lineage) == sorted(straight) == list(range(1, LONG_STEPS + 1))

    def final(rows):
        return sum(rows[t]["reward"] for t in range(LONG_STEPS - 19, LONG_STEPS + 1)) / 20

    if module == "trainer.grpo_sync":
        for t in straight:
            for key in ("reward", "loss", "seq_logprob_error", "grad_norm"):
                assert lineage[t][key] == straight[t][key], (t, key, lineage[t][key], straight[t][key])
    else:
        assert abs(final(lineage) - final(straight)) <= 0.1, (final(lineage), final(straight))
    assert final(lineage) > LEARNED and final(straight) > LEARNED, (final(lineage), final(straight))
