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
