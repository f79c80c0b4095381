"""Process liveness by a lock held on a file (tq/liveness.py): what a storage unit asks about a paused
writer that may live in another pid namespace. Real processes, a real directory."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import msgspec
import pytest

from tq import liveness, messages

_HOLDER = """
import sys
from tq import liveness
print(liveness.own_file(sys.argv[1]), flush=True)
sys.stdin.readline()  # hold it until told to go
"""


def test_a_file_is_alive_while_its_maker_runs_and_swept_once_it_exited(tmp_path):
    d = str(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, d], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        theirs = holder.stdout.readline().strip()
        mine = liveness.own_file(d)
        assert liveness.NAME.fullmatch(theirs) and mine != theirs and liveness.own_file(d) == mine  # one per process
        assert liveness.holder_alive(d, theirs) and liveness.holder_alive(d, mine)
        assert liveness.holder_alive(d, theirs)  # asking takes no lock that stays
        assert liveness.remove_gone(d) == 0
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(10)
        assert not liveness.holder_alive(d, theirs)  # the kernel dropped its lock with it
        assert sorted(os.listdir(d)) == sorted([theirs, mine])
        left = os.path.join(d, f".{liveness.PREFIX}{'c' * 32}.tmp")  # its maker was killed while making it
        making = os.path.join(d, f".{liveness.PREFIX}{'d' * 32}.tmp")  # being made now
        for path, age in ((left, 2 * liveness.TMP_AGE_S), (making, 0)):
            open(path, "w").close()
            os.utime(path, (time.time() - age, time.time() - age))
        assert liveness.remove_gone(d) == 2
        assert sorted(os.listdir(d)) == sorted([mine, os.path.basename(making)]) and not liveness.holder_alive(d, theirs)
    finally:
        if holder.poll() is None:
            holder.kill()


def test_a_killed_maker_is_gone_and_a_missing_file_is_gone(tmp_path):
    d = str(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, d], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    name = holder.stdout.readline().strip()
    assert liveness.holder_alive(d, name)
    holder.kill()
    holder.wait(10)
    assert not liveness.holder_alive(d, name)
    assert not liveness.holder_alive(d, "tq-live-" + "0" * 32)


def test_a_forked_child_makes_a_file_of_its_own(tmp_path):
    """A child forked after its parent made its file gets another (the parent's stays locked while
    either runs: the lock belongs to the open file, which the child shares)."""
    d = str(tmp_path)
    mine = liveness.own_file(d)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(w, liveness.own_file(d).encode())
        os._exit(0)
    os.close(w)
    childs = os.read(r, 64).decode()
    os.close(r)
    os.waitpid(pid, 0)
    assert childs != mine and liveness.NAME.fullmatch(childs)
    assert liveness.holder_alive(d, mine) and not liveness.holder_alive(d, childs)


@pytest.mark.parametrize("name", ["../../etc/passwd", "tq-live-" + "0" * 31, "tq-live-" + "G" * 32, "x" * 200])
def test_an_alloc_naming_anything_but_a_liveness_file_is_refused(name):
    """A unit joins the name to its shared-memory directory and opens it: only names of the form
    ``tq-live-<32 hex digits>`` are accepted."""
    raw = msgspec.msgpack.encode({"nbytes": 64, "writer_file": name})
    with pytest.raises(msgspec.ValidationError, match="writer_file"):
        msgspec.msgpack.decode(raw, type=messages.Alloc)
    ok = msgspec.msgpack.encode({"nbytes": 64, "writer_file": "tq-live-" + "ab" * 16})
    assert msgspec.msgpack.decode(ok, type=messages.Alloc).writer_file == "tq-live-" + "ab" * 16


_CLIENT = """
import sys, torch
from tq import TQClient
with TQClient(sys.argv[1], timeout=30.0) as c:
    c.register_partition("p")
    meta = c.put("p", ["a", "b"], {"x": torch.arange(6).view(2, 3)})  # same host: names its file to the unit
    x = c.get(meta, copy=False)["x"]  # borrowed: names its file to the controller with the lease
    assert x.tolist() == [[0, 1, 2], [3, 4, 5]]
"""


def test_a_service_leaves_no_liveness_file_of_its_clients_behind(tmp_path):
    """Clients make liveness files in the service's shared-memory directory (the storage unit's, for
    same-host puts; the controller's, for borrowed gets) and cannot unlink them when killed. Once
    they exited, the service sweeps them: a controller and units shut down cleanly leave none - even
    when they never ran as long as their periodic sweep."""
    import shutil
    import tempfile

    from tq import TQClient, TQServer

    shm_dir = tempfile.mkdtemp(prefix="tq-test-", dir="/dev/shm")
    try:
        with TQServer(storage_units=1, capacity=16 << 20, shm_dir=shm_dir) as server:
            with TQClient(server.address, timeout=30.0):  # returns once the storage unit has registered
                pass
            subprocess.run([sys.executable, "-c", _CLIENT, server.address], check=True, timeout=60)
            made = [n for n in os.listdir(shm_dir) if liveness.NAME.fullmatch(n)]
            assert made and not any(liveness.holder_alive(shm_dir, n) for n in made)
        assert os.path.isdir(shm_dir) and not [n for n in os.listdir(shm_dir) if n.startswith(liveness.PREFIX)]
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


def test_a_controller_sweeps_the_liveness_files_of_exited_readers_from_its_directory(tmp_path, loopback):
    """Readers of the controller's host name liveness files in the controller's directory (which no
    storage unit may share): the controller unlinks those of processes that exited, at its start
    and every ``liveness.SWEEP_S`` after; a running process's file stays."""
    d = str(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, d], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ctrl = None
    try:
        alive = holder.stdout.readline().strip()
        gone = subprocess.run([sys.executable, "-c", _HOLDER, d], input="\n", capture_output=True, text=True).stdout.strip()
        assert sorted(os.listdir(d)) == sorted([alive, gone])
        ctrl = loopback.start(shm_dir=d)
        ctrl.on_tick(time.monotonic())
        assert [n for n in os.listdir(d) if n.startswith(liveness.PREFIX)] == [alive]
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(10)
        ctrl.on_tick(time.monotonic())
        assert alive in os.listdir(d)  # not before the next sweep
        ctrl.on_tick(time.monotonic() + liveness.SWEEP_S)
        assert not [n for n in os.listdir(d) if n.startswith(liveness.PREFIX)]
    finally:
        if ctrl is not None:
            ctrl.close()
        if holder.poll() is None:
            holder.kill()


def test_a_storage_unit_shut_down_leaves_no_file_of_an_exited_writer(tmp_path):
    """A writer that exited since the unit's last sweep (``liveness.SWEEP_S``) leaves its file; the
    unit's clean shutdown unlinks it with the unit's own files: the directory is as it was before."""
    from tq.storage import StorageUnit

    d = str(tmp_path)
    unit = StorageUnit(0, "tcp://127.0.0.1:0", capacity=1 << 20, shm_dir=d)
    try:
        gone = subprocess.run([sys.executable, "-c", _HOLDER, d], input="\n", capture_output=True, text=True).stdout.strip()
        assert gone in os.listdir(d)
    finally:
        unit.close()
    assert os.listdir(d) == []
