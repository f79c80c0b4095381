"""Crash safety of the journal (issue 16, bug 4): checksummed records, a torn or corrupt tail
truncated on open before anything is appended after it, and an explicit fsync policy.

Real files throughout; crashes are made by writing the bytes a crash leaves (a torn frame, a
flipped byte, zeros, garbage), by SIGKILLing real processes, and by a real file-size limit. fsync
calls are counted by wrapping ``os.fsync`` (the real one still runs).
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zlib

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import free_port, pid_alive, wait_until
from tq import TQClient, TQServer
from tq.journal import Journal

RECORDS = [["S", 1, 0, 4096, 3, [["x", "f32", 0, b"\x00" * 8]], b""], ["F", 1], {"op": "mint", "n": 2}, "tail-" * 20]


def _raw_frame(body: bytes) -> bytes:
    """A frame in the documented format around arbitrary ``body`` bytes (a valid CRC)."""
    head = struct.pack("<I", len(body))
    return head + struct.pack("<I", zlib.crc32(body, zlib.crc32(head))) + body


def _write(path, records) -> list[int]:
    """Append ``records`` through a Journal; the file size after each one (where each record ends)."""
    j = Journal(str(path))
    ends = []
    for r in records:
        j.append(r)
        ends.append(os.path.getsize(path))
    j.close()
    return ends


def _add(path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def _replay(path) -> list:
    return list(Journal.replay(str(path)))


def test_record_format_is_length_crc_body(tmp_path):
    """The on-disk layout is the one the module documents: <I length><I crc32(length + body)> body."""
    path = tmp_path / "j"
    _write(path, [RECORDS[0], RECORDS[1]])
    bodies = [msgpack.packb(r, use_bin_type=True) for r in RECORDS[:2]]
    assert path.read_bytes() == b"".join(_raw_frame(b) for b in bodies)


def test_torn_tail_is_truncated_before_appending_and_survives_a_second_crash(tmp_path):
    """The reported bug: a torn tail survived once, then a record appended after it and a second
    crash made the journal unreadable. Now the open cuts the torn bytes off first."""
    path = tmp_path / "j"
    ends = _write(path, RECORDS[:2])
    whole = _raw_frame(msgpack.packb(["torn", b"x" * 100], use_bin_type=True))
    _add(path, whole[:60])  # first crash, mid-write
    assert _replay(path) == RECORDS[:2]

    j = Journal(str(path))
    assert os.path.getsize(path) == ends[-1] and j.truncated_bytes == 60
    j.append(RECORDS[2])
    j.close()
    _add(path, whole[:9])  # second crash, just past the header
    assert _replay(path) == RECORDS[:3]

    j = Journal(str(path))
    assert j.truncated_bytes == 9
    j.append(RECORDS[3])
    j.close()
    assert _replay(path) == RECORDS


def test_flipped_byte_in_a_body_ends_replay_at_the_record_before_it(tmp_path):
    """A byte flipped inside a record's payload still decodes as msgpack; only the CRC catches it.
    Replay stops before that record (dropping the good ones after it) and the next open truncates there."""
    path = tmp_path / "j"
    ends = _write(path, RECORDS)
    data = bytearray(path.read_bytes())
    at = data.index(b"tail-", ends[2])  # inside the string payload of record 3
    data[at + 7] ^= 0x20
    path.write_bytes(bytes(data))
    body = bytes(data[ends[3] - len(msgpack.packb(RECORDS[3])) : ends[3]])
    assert msgpack.unpackb(body, raw=False) != RECORDS[3]  # still valid msgpack
    assert _replay(path) == RECORDS[:3]

    data = bytearray(path.read_bytes())
    data[ends[0] + 10] ^= 0x01  # now one in record 1: replay ends after record 0
    path.write_bytes(bytes(data))
    assert _replay(path) == RECORDS[:1]
    j = Journal(str(path))
    assert j.truncated_bytes == ends[-1] - ends[0] and os.path.getsize(path) == ends[0]
    j.append("after")
    j.close()
    assert _replay(path) == [RECORDS[0], "after"]


@pytest.mark.parametrize(
    "body", [b"\xc1", b"\x01\x02", b"", b"\x93\x01\x02"], ids=["never-used-byte", "extra-data", "empty", "short-array"]
)
def test_checksummed_body_that_is_not_one_msgpack_value_ends_the_prefix(tmp_path, body):
    """A frame whose length and CRC are right but whose body is not exactly one msgpack value
    (the ExtraData of the bug report among them) ends the valid prefix without raising."""
    path = tmp_path / "j"
    ends = _write(path, RECORDS[:2])
    _add(path, _raw_frame(body) + _raw_frame(msgpack.packb("unreachable")))
    assert _replay(path) == RECORDS[:2]
    j = Journal(str(path))
    assert j.truncated_bytes == len(_raw_frame(body)) + len(_raw_frame(msgpack.packb("unreachable")))
    assert os.path.getsize(path) == ends[-1]
    j.append(RECORDS[2])
    j.close()
    assert _replay(path) == RECORDS[:3]


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x05\x00\x00\x00" + b"\xde\xad\xbe\xef" + b"\x92\x01\x02\x03\x04",  # a length that fits, a wrong CRC
        b"\x00" * 64,  # the zero-filled tail a power loss can leave
        bytes(range(256)),
    ],
    ids=["plausible-length", "zeros", "bytes"],
)
def test_garbage_tail_fails_the_crc_and_is_truncated(tmp_path, garbage):
    path = tmp_path / "j"
    ends = _write(path, RECORDS[:3])
    _add(path, garbage)
    assert _replay(path) == RECORDS[:3]
    j = Journal(str(path))
    assert j.truncated_bytes == len(garbage) and os.path.getsize(path) == ends[-1]
    j.append(RECORDS[3])
    j.close()
    assert _replay(path) == RECORDS


@pytest.mark.parametrize("size", range(8))
def test_empty_file_and_file_shorter_than_a_header(tmp_path, size):
    path = tmp_path / "j"
    path.write_bytes(b"\x07\x00\x00\x00\x01\x02\x03"[:size])
    assert _replay(path) == []
    j = Journal(str(path))
    opened_size = os.path.getsize(path)
    j.append("first")
    j.close()
    assert _replay(path) == ["first"]
    assert opened_size == 0 and j.truncated_bytes == size
    assert _replay(tmp_path / "missing") == []


def test_rewrite_then_append_then_crash_then_replay(tmp_path):
    """A compacted log takes appends; a torn tail after them is truncated like any other; a reopened
    log counts its complete records as appended (towards the next compaction)."""
    path = tmp_path / "j"
    _write(path, RECORDS)
    j = Journal(str(path))
    j.append("dropped by the rewrite")
    j.rewrite([["__snapshot__", {"n": 4}]])
    assert j.appended == 0 and not os.path.exists(str(path) + ".tmp")
    j.append(["after", 1])
    assert j.appended == 1
    j.close()
    _add(path, _raw_frame(msgpack.packb(["torn"]))[:-1])
    assert _replay(path) == [["__snapshot__", {"n": 4}], ["after", 1]]
    j = Journal(str(path))
    assert j.truncated_bytes == len(_raw_frame(msgpack.packb(["torn"]))) - 1
    # reopened, it counts the complete records it holds: a compaction waiting for a number of records
    # counts on from them across restarts (tests/test_crash_consistency.py shows why)
    assert j.appended == 2
    j.append(["after", 2])
    assert j.appended == 3
    j.close()
    assert _replay(path) == [["__snapshot__", {"n": 4}], ["after", 1], ["after", 2]]


def test_rewrite_whose_records_raise_keeps_the_old_log(tmp_path):
    """A rewrite that fails half-way leaves the old log in place and in use, and no temporary file."""
    path = tmp_path / "j"
    _write(path, RECORDS[:2])
    j = Journal(str(path))

    def records():
        yield "half"
        raise RuntimeError("snapshot failed")

    with pytest.raises(RuntimeError, match="snapshot failed"):
        j.rewrite(records())
    assert not os.path.exists(str(path) + ".tmp")
    j.append(RECORDS[2])
    j.close()
    assert _replay(path) == RECORDS[:3]


_CHILD_FSIZE = r"""
import resource, signal, sys
from tq.journal import Journal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
path = sys.argv[1]
j = Journal(path)
j.append(["small", 1])
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
try:
    j.append(["big", b"x" * 10000])  # the first 4096 bytes are written, then the write fails
except OSError:
    print("refused")
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
j.append(["small", 2])
j.close()
"""


def _count_writes(j: Journal) -> list[int]:
    """Have ``j``'s file record the size of every write made to it; the list they go to."""
    sizes: list[int] = []
    real = j._f

    class Counting:
        def write(self, b):
            sizes.append(len(b))
            return real.write(b)

        def __getattr__(self, name):
            return getattr(real, name)

    j._f = Counting()
    return sizes


def test_a_batch_writes_its_records_in_one_call_when_it_ends_raising_or_not(tmp_path):
    """Records appended inside ``batch()`` reach the file together when it ends, in order and
    framed as ever, also when the block raises; a nested batch writes with the outer one."""
    path = tmp_path / "j"
    j = Journal(str(path))
    j.append(["before"])
    size = os.path.getsize(path)
    with j.batch():
        for i in range(500):
            j.append(["F", i])
        with j.batch():
            j.append(["inner"])
        assert os.path.getsize(path) == size and j.appended == 1  # held
    assert _replay(path) == [["before"], *(["F", i] for i in range(500)), ["inner"]]
    assert j.appended == 502
    with pytest.raises(RuntimeError), j.batch():
        j.append(["applied", 1])
        raise RuntimeError("after the change was applied")
    assert _replay(path)[-1] == ["applied", 1]
    j.close()


def test_a_batch_writes_once_and_a_rewrite_inside_it_drops_what_it_already_holds(tmp_path):
    """One system call for the whole batch; a compaction inside it (a snapshot of the state those
    records changed) drops the records held so far and keeps those appended after it."""
    path = tmp_path / "j"
    j = Journal(str(path))
    calls = _count_writes(j)
    with j.batch():
        for i in range(100):
            j.append(["F", i])
    assert len(calls) == 1
    with j.batch():
        j.append(["gone", 1])
        j.rewrite([["snapshot"]])
        j.append(["after", 2])
    assert _replay(path) == [["snapshot"], ["after", 2]]
    j.close()


def test_a_storage_unit_journals_a_request_in_one_write(tmp_path):
    """A storage unit serves every request inside its journal's batch (``StorageUnit.applying``):
    fencing the 512 ids of a slab journals 513 records (each id, then the slab's close) in one write
    before the reply - one write each before."""
    import zmq

    from tq import messages, protocol
    from tq.rpc import Call
    from tq.storage import StorageUnit

    unit = StorageUnit(0, "tcp://127.0.0.1:0", capacity=8 << 20, shm_dir=str(tmp_path))
    try:
        grant = unit.handle("alloc", {"nbytes": 4 << 20, "ids": 512}, [], Call(b"", None, "alloc", 0.0))
        ids = list(range(grant.first_block, grant.first_block + 512))
        writes = _count_writes(unit.journal)
        frames = protocol.request("free_blocks", 1, messages.FreeBlocks(blocks=ids), [], None)
        unit._serve_one([zmq.Frame(b"\x00client"), *(zmq.Frame(bytes(memoryview(f))) for f in frames)])
        assert len(writes) == 1
        recs = list(Journal.replay(unit.journal.path))
        assert [r for r in recs if r[0] == "F"] == [["F", b] for b in ids] and recs[-1][0] == "Y"
    finally:
        unit.close()  # its journal and arena files go too


def test_failed_append_is_cut_back_to_the_last_complete_record(tmp_path):
    """A write that fails after writing part of a record (here a real file-size limit, as a full
    disk would) must not leave the partial record in front of the next append."""
    path = tmp_path / "j"
    out = subprocess.run([sys.executable, "-c", _CHILD_FSIZE, str(path)], check=True, timeout=30, capture_output=True, text=True).stdout
    assert _replay(path) == [["small", 1], ["small", 2]]
    assert out.split() == ["refused"]  # and the caller learnt that the record was not written
    assert Journal(str(path)).truncated_bytes == 0


_CHILD_SIGKILL = r"""
import os, signal, sys
from tq.journal import Journal
j = Journal(sys.argv[1], fsync="never")
for i in range(200):
    j.append(["rec", i, b"x" * i])
os.kill(os.getpid(), signal.SIGKILL)  # no close, no flush, no atexit
"""


def test_fsync_never_survives_sigkill_and_never_fsyncs(tmp_path, monkeypatch):
    """ "never": every appended record is in the page cache when append returns, so a SIGKILLed
    writer loses nothing; and nothing (open, append, rewrite, close) fsyncs."""
    path = tmp_path / "j"
    proc = subprocess.run([sys.executable, "-c", _CHILD_SIGKILL, str(path)], timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert _replay(path) == [["rec", i, b"x" * i] for i in range(200)]

    synced = _count_fsyncs(monkeypatch)
    j = Journal(str(tmp_path / "k"), fsync="never")
    j.append("a")
    j.rewrite(["b"])
    j.append("c")
    j.close()
    assert synced == [] and _replay(tmp_path / "k") == ["b", "c"]


def _count_fsyncs(monkeypatch) -> list[str]:
    """Record the path of every fd that ``os.fsync`` is called on; the real fsync still runs."""
    synced: list[str] = []
    real = os.fsync

    def counting_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    return synced


def test_fsync_always_syncs_every_record_the_rewrite_and_the_directory(tmp_path, monkeypatch):
    d = os.path.realpath(tmp_path)
    path = os.path.join(d, "j")
    synced = _count_fsyncs(monkeypatch)
    j = Journal(path, fsync="always")
    assert synced == [d]  # the new file's directory entry
    for i in range(3):
        j.append(i)
        assert synced[-1] == path and len(synced) == 2 + i  # before append returns
    j.rewrite(["snap"])
    assert synced[-2:] == [path + ".tmp", d]  # the new contents, then the rename
    j.append("x")
    j.close()
    assert synced == [d, path, path, path, path + ".tmp", d, path]
    assert _replay(path) == ["snap", "x"]

    del synced[:]
    _add(path, b"torn")
    j = Journal(path, fsync="always")
    assert j.truncated_bytes == 4 and synced == [path]  # the truncation is made durable too
    j.close()


def test_fsync_interval_syncs_at_most_once_per_interval_and_on_close(tmp_path, monkeypatch):
    d = os.path.realpath(tmp_path)
    path = os.path.join(d, "j")
    synced = _count_fsyncs(monkeypatch)
    j = Journal(path, fsync="interval", fsync_interval_s=3600)
    for i in range(5):
        j.append(i)
    assert synced == [d, path]  # the first append syncs (no sync for an interval), the next four wait
    j.close()
    assert synced == [d, path, path]  # close syncs the four

    del synced[:]
    j = Journal(path, fsync="interval", fsync_interval_s=0.2)
    j.append("a")
    j.append("b")
    assert synced == [path]
    time.sleep(0.25)
    j.append("c")  # the last sync is an interval old
    assert synced == [path, path]
    j.rewrite(["snap"])
    assert synced[2:] == [path + ".tmp", d]
    j.close()  # nothing new since the rewrite
    assert synced == [path, path, path + ".tmp", d]
    assert _replay(path) == ["snap"]


def test_unknown_fsync_policy_is_refused(tmp_path):
    with pytest.raises(ValueError, match="never, always, interval"):
        Journal(str(tmp_path / "j"), fsync="sometimes")
    with pytest.raises(ValueError, match="fsync_interval_s"):
        Journal(str(tmp_path / "j"), fsync="interval", fsync_interval_s=-1)


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(records=st.lists(_values, max_size=8), data=st.data())
def test_any_cut_replays_a_prefix_and_reopen_appends_after_it(records, data):
    """Cut the file at any byte (and maybe add garbage after the cut): replay yields a prefix of the
    records - exactly those whose frames survived the cut when nothing follows it - and a reopen
    plus append yields that prefix plus the new record."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "j")
        ends = _write(path, records)
        size = os.path.getsize(path)
        cut = data.draw(st.integers(0, size), label="cut")
        garbage = data.draw(st.binary(max_size=24), label="garbage")
        with open(path, "r+b") as f:
            f.truncate(cut)
        _add(path, garbage)

        got = _replay(path)
        kept = sum(e <= cut for e in ends)
        assert got == records[: len(got)] and len(got) >= kept
        if not garbage:
            assert len(got) == kept
        j = Journal(path)
        assert j.truncated_bytes == cut + len(garbage) - (ends[len(got) - 1] if got else 0)
        j.append(["new"])
        j.close()
        assert _replay(path) == got + [["new"]]


def test_controller_survives_two_crashes_with_garbage_journal_tails(tmp_path):
    """End to end: SIGKILL the controller, leave garbage after its journal (a torn record), restart
    it on the same address and journal dir, write more, crash and garble again, restart again: every
    key written comes back. Before the fix the second restart failed with msgpack's ExtraData."""
    port = free_port()
    journal = tmp_path / "controller.journal"
    garbage = b"\x40\x00\x00\x00junk!"  # claims a 64-byte record that is not there

    def start() -> TQServer:
        return TQServer(port=port, storage_units=1, capacity=64 << 20, journal_dir=str(tmp_path))

    def crash(server: TQServer) -> None:
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        _add(journal, garbage)

    servers = [start()]
    c = TQClient(servers[0].address, timeout=10.0)
    unit_pids: list[int] = []
    try:
        c.register_partition("p")
        m1 = c.put("p", ["k1"], {"x": torch.full((1, 3), 1.0)})
        unit_pids = [u["pid"] for u in c.stats()["units"]]
        crash(servers[0])

        servers.append(start())
        assert torch.equal(c.get(m1)["x"], torch.full((1, 3), 1.0))
        m2 = c.put("p", ["k2"], {"x": torch.full((1, 3), 2.0)})
        crash(servers[1])

        servers.append(start())
        assert torch.equal(c.get(m1)["x"], torch.full((1, 3), 1.0))
        assert torch.equal(c.get(m2)["x"], torch.full((1, 3), 2.0))
        assert set(c.get_meta("p", ["k1", "k2"]).keys) == {"k1", "k2"}
        assert garbage not in journal.read_bytes()  # both garbage tails were cut off
    finally:
        c.close()
        for server in reversed(servers):
            server.shutdown()
        # units started with a journal dir outlive a SIGKILLed controller; the live one stops them
        if not wait_until(lambda: not any(pid_alive(p) for p in unit_pids), timeout=10):
            for p in unit_pids:
                if pid_alive(p):
                    os.kill(p, signal.SIGKILL)


def test_controller_replays_requests_journaled_raw_and_as_maps(tmp_path):
    """The controller journals a request's args as the msgpack bytes it received and replays them through
    the op's typed decoder; a journal written before that (args as maps) replays the same way."""
    import msgspec

    from tq.controller import Controller

    journal = Journal(str(tmp_path / "controller.journal"))
    journal.append(["create_partition", {"partition": "old-style"}, []])  # args as a map
    journal.append(["create_partition", msgspec.msgpack.encode({"partition": "raw"}), []])
    journal.append(["mint", msgspec.msgpack.encode({"partition": "raw", "keys": ["a", "b"]}), []])
    journal.close()
    ctrl = Controller("tcp://127.0.0.1:0", journal_dir=str(tmp_path), shm_dir=None)
    try:
        assert sorted(ctrl.partitions) == ["old-style", "raw"]
        assert sorted(ctrl.partitions["raw"].index) == ["a", "b"]
    finally:
        ctrl.close()


def test_a_journaled_request_this_version_refuses_stops_the_replay_naming_it(tmp_path):
    """Only applied changes are journaled, so a record the typed decoder now refuses (a key longer
    than MAX_NAME_CHARS, which an older version accepted) cannot be skipped - the keys after it may
    build on it: the controller refuses to start with JournalError naming the journal, the record and
    why, not a traceback out of the decoder."""
    import msgspec

    from tq.controller import Controller
    from tq.errors import JournalError
    from tq.meta import MAX_NAME_CHARS

    journal = Journal(str(tmp_path / "controller.journal"))
    journal.append(["create_partition", msgspec.msgpack.encode({"partition": "p"}), []])
    journal.append(["mint", msgspec.msgpack.encode({"partition": "p", "keys": ["a", "k" * (MAX_NAME_CHARS + 1)]}), []])
    journal.close()
    with pytest.raises(
        JournalError,
        match=r"controller\.journal: record 2 \('mint'\) cannot be replayed \(mint: Expected `str` of length <= 1024 - at `\$\.keys\[1\]`\)",
    ):
        Controller("tcp://127.0.0.1:0", journal_dir=str(tmp_path), shm_dir=None)
