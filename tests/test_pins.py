"""Pins (tq.pins): leases of same-host borrowed gets taken in shared memory - the protocol's two sides,
its journaling across a controller restart, and hostile pin files."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tq.pins import MAGIC, SUPPORTED, PinBoard, PinFile

pytestmark = pytest.mark.skipif(not SUPPORTED, reason="pins need the C helper tq._fastcopy")


EPOCH = 77  # the pin board of the tables made here (a controller writes its own in each of its tables)


def _table(tmp_path):
    from tq.locations import LocationTable

    return LocationTable(str(tmp_path), pin_epoch=EPOCH)


def _pin_file(directory, slots: int = 4) -> PinFile:
    pins = PinFile(str(directory), slots=slots)
    pins.epoch = EPOCH  # as registered with that board
    return pins


def test_a_pin_holds_only_if_the_table_freed_nothing_since_the_read(tmp_path):
    from tq.locations import H_CLEARS, H_RETIRED

    table = _table(tmp_path)
    pins = _pin_file(tmp_path)
    board = PinBoard(str(tmp_path))
    board.register(pins.path)
    try:
        frees, inc, clears = table.frees, table.incarnation, int(table.header[H_CLEARS])
        far = time.monotonic_ns() + 10**10
        pins.epoch = EPOCH + 1  # registered with another board (a controller started anew never heard of the file)
        assert pins.pin(far, 0, [3, 9], table._mm, frees, inc, clears) is None
        pins.epoch = EPOCH
        far = time.monotonic_ns() + 10**10
        got = pins.pin(far, 0, [3, 9], table._mm, frees, inc, clears)
        assert got is not None
        lease, slot = got
        [p] = board.pins()
        assert (p.lease, p.slot, p.unit, p.blocks) == (lease, slot, 0, (3, 9))
        table.freed()  # a free after the read: a reader pinning now must give its pin up
        for stale in ((frees, inc, clears), (frees + 1, inc + 1, clears), (frees + 1, inc, clears + 1)):
            assert pins.pin(far, 0, [4], table._mm, *stale) is None
        assert [q.lease for q in board.pins()] == [lease]  # refused pins left nothing behind
        assert pins.pin(far, 0, list(range(100)), table._mm, frees + 1, inc, clears) is None  # more blocks than a slot holds
        assert board.holds(pins.path, slot, lease, time.monotonic_ns()) == far
        assert board.holds(pins.path, slot, lease, far) is None  # run out
        pins.release(slot, lease)
        assert board.pins() == [] and board.holds(pins.path, slot, lease, time.monotonic_ns()) is None
        frees = table.frees
        assert pins.pin(far, 0, [4], table._mm, frees, inc, clears) is not None
        table.header[H_RETIRED] = 1  # a retired table (its frees count unchanged here) refuses pins too
        assert pins.pin(far, 0, [4], table._mm, frees, inc, clears) is None
    finally:
        table.close()
        pins.close()
        board.close()


def test_the_controller_keeps_a_pinned_block_across_a_restart_until_the_pin_is_given_up(tmp_path, loopback):
    """A reader's pin, taken over as a lease at a discard, is journaled: the restarted controller's
    retain keeps the discarded row, and frees it once the reader clears its slot."""
    from tq.locations import H_CLEARS

    apply, heard = loopback.apply, loopback.heard
    shm = tmp_path / "shm"
    shm.mkdir()
    pins = PinFile(str(shm))
    ctrl = loopback.start(journal_dir=str(tmp_path / "j"), shm_dir=str(shm))
    try:
        loopback.commit_two_rows(ctrl)
        reply = apply(ctrl, "pin_file", {"path": pins.path})
        assert reply.registered and reply.epoch == ctrl.pin_epoch != 0
        pins.epoch = reply.epoch
        table = ctrl.partitions["p"].table
        lease, slot = pins.pin(
            time.monotonic_ns() + 60 * 10**9, 0, [5], table._mm, table.frees, table.incarnation, int(table.header[H_CLEARS])
        )
        apply(ctrl, "discard", {"partition": "p", "keys": ["a"]})
        assert "free_rows" not in heard()
        assert ctrl.lease_book.leases[lease].pin == (pins.path, slot)
    finally:
        ctrl.close()  # as if killed: the journal and the pin file stay

    ctrl = loopback.start(journal_dir=str(tmp_path / "j"), shm_dir=str(shm))
    try:
        assert ctrl.lease_book.leases[lease].pin == (pins.path, slot) and pins.path in ctrl.pin_board.files
        assert ctrl._rows_on(0).tolist() == [[5, 0], [5, 1]]  # its retain keeps the discarded row
        heard()
        time.sleep(0.1)
        ctrl.on_tick(time.monotonic())  # still pinned: polled again, nothing freed
        assert lease in ctrl.lease_book.leases and "free_rows" not in heard(100)
        pins.release(slot, lease)
        time.sleep(0.1)
        ctrl.on_tick(time.monotonic())
        assert lease not in ctrl.lease_book.leases
        assert "free_rows" in heard() and ctrl._rows_on(0).tolist() == [[5, 1]]
    finally:
        ctrl.close()
        pins.close()


def test_pin_files_are_checked(tmp_path):
    """Only a pin file of this version, directly in the controller's directory, is read."""
    board = PinBoard(str(tmp_path))
    other = tmp_path / "elsewhere"
    other.mkdir()
    outside = PinFile(str(other))
    try:
        with pytest.raises(ValueError, match="not a tq-pin-"):
            board.register(outside.path)
        with pytest.raises(ValueError, match="not a tq-pin-"):
            board.register(str(tmp_path / "tq-loc-1-x"))
        fake = tmp_path / "tq-pin-1-fake"
        fake.write_bytes(b"\0" * 4096)
        with pytest.raises(ValueError, match="not a pin file"):
            board.register(str(fake))
        huge = np.zeros(8 + 8 * 64, dtype=np.int64)  # a header claiming 2**40 slots (a scan of each at every free)
        huge[:3] = [MAGIC, 1 << 40, 64]
        (tmp_path / "tq-pin-3-huge").write_bytes(huge.tobytes())
        with pytest.raises(ValueError, match="not a pin file"):
            board.register(str(tmp_path / "tq-pin-3-huge"))
        os.symlink(outside.path, tmp_path / "tq-pin-2-link")
        with pytest.raises(OSError):
            board.register(str(tmp_path / "tq-pin-2-link"))
        assert board.files == {}
    finally:
        outside.close()
        board.close()


def test_a_controller_names_a_bad_pin_file(tq_server, client):
    from tq import messages
    from tq.errors import InvalidRequestError
    from tq.messages import ControllerOp as Op

    with pytest.raises(InvalidRequestError, match="cannot read pin file '/etc/passwd'"):
        client._call(Op.PIN_FILE, messages.PinFile(path="/etc/passwd"))


_PIN_CLIENT = """
import sys
from tq.pins import PinFile
pins = PinFile(sys.argv[1])
print(pins.path, flush=True)
sys.stdin.readline()  # live until told to exit (without closing: the file stays, unlocked)
"""


def _pin_client(directory) -> tuple[subprocess.Popen, str]:
    """Another process that made a pin file in ``directory`` and holds it; and the file's path."""
    proc = subprocess.Popen([sys.executable, "-c", _PIN_CLIENT, str(directory)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_a_file_whose_client_is_gone_is_revoked_before_it_is_let_go(tmp_path):
    """The controller tells a pin file's client alive by the lock the client holds on the file (its
    pid may name another process, in another pid namespace, or a later one). Once the client is
    gone it revokes the file first and reads it once more, so no pin is lost: a pin held then keeps
    the file read; a pin tried after the revocation is refused (its client registers a new file)."""
    from tq.locations import H_CLEARS

    table = _table(tmp_path)
    pins = _pin_file(tmp_path)
    board = PinBoard(str(tmp_path))
    board.register(pins.path)
    try:
        state = (table.frees, table.incarnation, int(table.header[H_CLEARS]))
        far = time.monotonic_ns() + 10**10
        lease, slot = pins.pin(far, 0, [1], table._mm, *state)
        board.prune(far + 1)
        assert pins.path in board.files and not pins.revoked  # its client runs (this process): kept
        fcntl.flock(pins._lock_fd, fcntl.LOCK_UN)  # as when its client is gone
        board.prune(time.monotonic_ns())
        assert pins.path in board.files  # a live pin: still read, and the file is kept
        assert [p.lease for p in board.pins()] == [lease]
        board.prune(far + 1)  # past its deadline: revoked now
        assert pins.revoked and pins.pin(far, 0, [2], table._mm, *state) is None  # refused: may go unseen
        assert pins.path in board.files  # the pin of before is still read until it ends
        pins.release(slot, lease)
        board.prune(time.monotonic_ns())
        assert board.files == {} and not os.path.exists(pins.path)
    finally:
        table.close()
        pins.close()
        board.close()


def test_a_file_whose_client_exited_is_let_go(tmp_path):
    """Another process's pin file is kept while that process runs - stopped included - and let go
    (revoked and removed) once it exited without closing it."""
    proc, path = _pin_client(tmp_path)
    board = PinBoard(str(tmp_path))
    try:
        board.register(path)
        proc.send_signal(signal.SIGSTOP)
        board.prune(time.monotonic_ns())
        assert path in board.files and board.client_runs(path)
        proc.send_signal(signal.SIGCONT)
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(10)
        assert os.path.exists(path) and not board.client_runs(path)
        board.prune(time.monotonic_ns())
        assert board.files == {} and not os.path.exists(path)
    finally:
        if proc.poll() is None:
            proc.kill()
        board.close()


def test_a_starting_controller_removes_pin_files_nothing_reads_of_clients_that_are_gone(tmp_path, loopback):
    """Pin files of clients killed while no controller read them (or registered with one started
    since without a journal) are removed when a controller starts, however young (a client locks its
    file before it appears under its name), and so are files a client killed while making one left -
    not those of live clients, not files its journal registered (read until their pins end)."""
    old = time.time() - 3600

    def made(age_s: float, live: bool) -> str:
        proc, path = _pin_client(tmp_path)
        if not live:
            proc.kill()
            proc.wait(10)
        os.utime(path, (time.time() - age_s, time.time() - age_s))
        return proc, path

    (_, orphan), (_, young), (alive, live) = made(3600, False), made(0, False), made(3600, True)
    client, registered = made(0, True)  # registered by a live client, which is killed after
    left, making = (str(tmp_path / f".tq-pin-1-{c * 16}.tmp") for c in "ab")  # a maker killed meanwhile; one at it now
    for path, age in ((left, 3600), (making, 0)):
        open(path, "w").close()
        os.utime(path, (time.time() - age, time.time() - age))
    try:
        ctrl = loopback.start(journal_dir=str(tmp_path / "j"), shm_dir=str(tmp_path))
        loopback.apply(ctrl, "pin_file", {"path": registered}, tick=False)
        ctrl.close()
        client.kill()
        client.wait(10)
        os.utime(registered, (old, old))
        ctrl = loopback.start(journal_dir=str(tmp_path / "j"), shm_dir=str(tmp_path))  # replays its registration
        try:
            assert not any(os.path.exists(p) for p in (orphan, young, left))
            assert all(os.path.exists(p) for p in (live, registered, making))
        finally:
            ctrl.close()
    finally:
        alive.kill()
        alive.wait(10)


def test_a_running_controller_removes_the_pin_file_of_a_client_killed_before_it_registered_it(tmp_path, loopback):
    """A client killed between making its pin file and registering it leaves a file no controller
    reads: a running controller removes it at its next liveness sweep (not only at a restart), and
    keeps a live client's file whether registered or not."""
    from tq import liveness

    (killed, orphan), (alive, live) = _pin_client(tmp_path), _pin_client(tmp_path)
    ctrl = loopback.start(shm_dir=str(tmp_path))
    try:
        ctrl.on_tick(time.monotonic())
        killed.kill()
        killed.wait(10)
        ctrl.on_tick(time.monotonic())
        assert os.path.exists(orphan)  # not before the next sweep
        ctrl.on_tick(time.monotonic() + liveness.SWEEP_S)
        assert not os.path.exists(orphan) and os.path.exists(live)
    finally:
        ctrl.close()
        for p in (killed, alive):
            p.kill()
            p.wait(10)
