"""One driver per checkpoint directory, and what a killed driver leaves running.

A driver killed with SIGKILL runs no clean-up. What it had started then goes as follows (measured
with Ray 2.60 on Linux, a local Ray started by ``ray.init()``): Ray's GCS server, raylet, monitors
and every worker process (the policy workers, rollout actors, the async collector) exit within a
second or two - Ray's own fate sharing - but the raylet's ``DashboardAgent`` and ``RuntimeEnvAgent``
(about 90 MB each) stay, re-parented to init, for about a minute. A TQ service the driver bootstrapped
itself (``data_plane.address`` unset) is its child too.

So every driver that checkpoints writes ``<checkpoint_dir>/driver.json``: its pid, host and start
time, and the processes it started (pid and start time of each, refreshed after start-up and at every
checkpoint). The next driver on that directory (the documented resume) reads it first:

- if that driver is still running (same pid and start time, same host), it refuses to start: two
  drivers on one lineage would train the same prompts twice and overwrite each other's checkpoints;
- if it is gone, it kills whatever of its recorded processes still runs (matched by pid *and* start
  time, so a recycled pid is never touched) before starting its own Ray, and says how many.

A clean exit removes the file.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import psutil

FILE_NAME = "driver.json"


class DriverConflictError(RuntimeError):
    """Another live driver trains from the same checkpoint directory."""


def _same_process(pid: int, create_time: float) -> psutil.Process | None:
    """The process ``pid`` if it still runs and started at ``create_time`` (not a zombie), else None."""
    try:
        p = psutil.Process(int(pid))
        if abs(p.create_time() - float(create_time)) > 0.05 or p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


class DriverRecord:
    """This driver's entry in ``<checkpoint_dir>/driver.json`` (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        me = psutil.Process()
        self.row: dict[str, Any] = {
            "pid": me.pid,
            "create_time": me.create_time(),
            "host": socket.gethostname(),
            "boot_time": psutil.boot_time(),
            "argv": sys.argv,
            "processes": [],
        }

    @classmethod
    def claim(cls, checkpoint_dir: str | os.PathLike) -> "DriverRecord":
        """Take the checkpoint directory for this driver: refuse if a live driver holds it, reap what a
        dead one left running, then record this one."""
        path = Path(checkpoint_dir) / FILE_NAME
        rec = cls(path)
        old = _read(path)
        if old is not None and old.get("pid") != rec.row["pid"]:
            if old.get("host") != rec.row["host"]:
                print(
                    f"warning: {path} names a driver on host {old.get('host')!r}; not checking whether it still runs",
                    file=sys.stderr,
                    flush=True,
                )
            elif old.get("boot_time") == rec.row["boot_time"] and _same_process(old.get("pid", -1), old.get("create_time", -1)):
                raise DriverConflictError(
                    f"another driver (pid {old['pid']}) is training from checkpoint_dir {str(Path(checkpoint_dir))!r} "
                    f"(recorded in {path}); stop it first - two drivers on one checkpoint dir would train prompts twice"
                )
            elif old.get("boot_time") == rec.row["boot_time"]:
                reaped = reap(old.get("processes", []))
                if reaped:
                    print(
                        f"reaped {reaped} processes left running by the previous driver (pid {old.get('pid')}, killed without clean-up)",
                        flush=True,
                    )
        path.parent.mkdir(parents=True, exist_ok=True)
        rec._write()
        return rec

    def note_processes(self) -> None:
        """Record every process this driver has started so far (its descendants)."""
        try:
            kids = psutil.Process().children(recursive=True)
        except psutil.Error:
            return
        seen = {(p["pid"], p["create_time"]) for p in self.row["processes"]}
        for k in kids:
            try:
                item = (k.pid, k.create_time())
            except psutil.Error:
                continue
            if item not in seen:
                seen.add(item)
                self.row["processes"].append({"pid": item[0], "create_time": item[1]})
        # Forget the ones that have exited (a long run starts and stops many).
        self.row["processes"] = [p for p in self.row["processes"] if _same_process(p["pid"], p["create_time"])]
        self._write()

    def release(self) -> None:
        """A clean exit: nothing of this driver is left for a successor to reap."""
        old = _read(self.path)
        if old is not None and old.get("pid") == self.row["pid"] and old.get("create_time") == self.row["create_time"]:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.row))
        os.replace(tmp, self.path)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        row = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return row if isinstance(row, dict) else None


def reap(processes: list[dict[str, Any]], timeout_s: float = 5.0) -> int:
    """SIGKILL each recorded process that still runs (pid and start time both match); returns how many."""
    alive = [(x["pid"], x["create_time"]) for x in processes if _same_process(x.get("pid", -1), x.get("create_time", -1)) is not None]
    for pid, ct in alive:
        p = _same_process(pid, ct)
        if p is not None:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_same_process(pid, ct) for pid, ct in alive):
        time.sleep(0.05)
    return len(alive)
