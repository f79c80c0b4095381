"""Same-host gets through the controller's shared location tables (tq/locations.py).

The table itself is tested directly (its seqlock, incarnations, retirement, lease); the service tests
run a real controller and storage units and check that a same-host get of a meta the service handed
out skips the controller, and that every way the table can go stale - discarded keys whose slots are
reused, a cleared partition whose field changed dtype, an overwritten field, a free racing the copy -
falls back to asking it instead of returning wrong bytes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import tempfile
import time

import numpy as np
import pytest
import torch

from tq import KVBatchMeta, TQClient
from tq.errors import KeyNotFoundError
from tq.locations import (
    H_CAPACITY,
    H_CLEARS,
    H_COLUMNS,
    H_INCARNATION,
    H_RETIRED,
    H_UNITS_VERSION,
    FEW_ROWS,
    HEADER_WORDS,
    SUPPORTED,
    LocationTable,
    LocationView,
    key_fingerprints,
    remove_orphans,
    take_records,
)
from tq import protocol
from tq.protocol import LOC_COLUMNS, LOC_NBYTES, LOC_RUN

if SUPPORTED:
    from tq._fastcopy import read_locations

from conftest import pid_namespace_start, python_command, python_pid, unique_keys

pytestmark = pytest.mark.skipif(not SUPPORTED, reason="same-host location tables are used on x86-64 only")


# ----------------------------------------------------------------------------- the table itself
@pytest.fixture()
def table(tmp_path):
    t = LocationTable(str(tmp_path), capacity=4, columns=2)
    t.set_status(units_version=1, down_units=0, alive_until_ns=time.monotonic_ns() + 10**10)
    _name_slots(t)
    yield t
    t.close()


def _names(slots) -> list[str]:
    """The keys the tests' tables give their slots (see _name_slots)."""
    return [f"k{s}" for s in slots]


def _keys(slots) -> np.ndarray:
    """The fingerprints of those keys, as a reader passes them."""
    return key_fingerprints(_names(slots))


def _name_slots(t: LocationTable) -> None:
    """Give every slot of ``t`` its key ``k{slot}`` (the controller writes a key's fingerprint when
    it gives the key a slot; a reader reads a slot only for its key)."""
    t.set_keys(slice(0, t.capacity), _names(range(t.capacity)))


def _record(unit: int, offset: int) -> list[int]:
    return [unit, 7, 0, 16, offset, -1]  # -1: not a run (read record by record)


def _ids(t: LocationTable, units_version: int = 1) -> tuple[int, int, int]:
    return t.incarnation, int(t.header[H_CLEARS]), units_version


def _view(t: LocationTable) -> LocationView:
    d = t.descriptor()
    return LocationView(d["path"], d["columns"])


def test_reader_sees_records_written_before_it_mapped_and_after(table):
    table.loc("x")[0] = _record(0, 4096)
    view = _view(table)
    rows = view.read(["x"], [0], _keys([0]), *_ids(table))
    assert (rows.unit, rows.end, rows.longest, rows.totals) == (0, 4096 + 16, (16,), (16,))
    assert rows.offsets.tolist() == [[4096]] and rows.sizes.tolist() == [[16]]
    with table.writing():
        table.loc("x")[1] = _record(0, 8192)
        table.loc("y")[:2] = [[0, 7, 0, 24, 64, -1], [0, 7, 0, 32, 96, -1]]
    view.add_columns(table.descriptor()["columns"])
    rows = view.read(["x", "y"], (1, 0), _keys((1, 0)), *_ids(table))
    assert rows.offsets.tolist() == [[8192, 4096], [96, 64]] and rows.sizes.tolist() == [[16, 16], [32, 24]]
    assert (rows.end, rows.longest, rows.totals) == (8192 + 16, (16, 32), (32, 56))


def test_reader_makes_each_fields_jagged_offsets_in_the_same_read(table):
    """Offsets in rows of each field (bytes per row: a power of two is shifted, 12 divided), from the
    first row asked, as if the rows lay back to back; none for a field asked with 0."""
    table.loc("x")[:3] = [[0, 7, 0, 16, 0, -1], [0, 7, 1, 48, 16, -1], [0, 7, 2, 0, 64, -1]]
    table.loc("y")[:3] = [[0, 8, 0, 36, 0, -1], [0, 8, 1, 12, 36, -1], [0, 8, 2, 24, 48, -1]]
    view = _view(table)
    rows = view.read(["x", "y", "x"], [1, 2, 0], _keys([1, 2, 0]), *_ids(table), row_bytes=[4, 12, 0])
    assert rows.row_offsets[0].tolist() == [0, 12, 12, 16]  # 48, 0, 16 bytes in rows of 4
    assert rows.row_offsets[1].tolist() == [0, 1, 3, 6]  # 12, 24, 36 bytes in rows of 12
    assert rows.sizes.tolist() == [[48, 0, 16], [12, 24, 36], [48, 0, 16]]  # as without them
    assert view.read(["x"], [0], _keys([0]), *_ids(table)).row_offsets is None


def test_rows_of_one_run_are_read_by_their_run_and_offset_words(table):
    """Consecutive slots that all carry one run id are one commit's rows, back to back: the reader
    takes their sizes from the offsets. A slot of the run changed since (the controller writes the
    whole record, run word included) sends it back to reading every record."""
    sizes, offsets = [16, 48, 0, 20], [100, 116, 164, 164]
    table.loc("x")[:4] = [[0, 7, i, sizes[i], offsets[i], 9] for i in range(4)]
    view = _view(table)
    whole = view.read(["x"], [0, 1, 2, 3], _keys([0, 1, 2, 3]), *_ids(table), row_bytes=[4])
    assert whole.offsets.tolist() == [offsets] and whole.sizes.tolist() == [sizes]
    assert (whole.adjacent, whole.totals, whole.longest, whole.end) == ((True,), (84,), (48,), 184)
    assert whole.blocks.tolist() == [7] and whole.row_offsets.tolist() == [[0, 4, 16, 16, 21]]
    assert view.read(["x"], range(0, 4), _keys(range(0, 4)), *_ids(table), row_bytes=[4]).row_offsets.tolist() == whole.row_offsets.tolist()
    assert view.read(["x"], range(2, 2 + table.capacity), _keys(range(2, 2 + table.capacity)), *_ids(table)) is None  # past the table's end
    viewing = view.read(["x"], range(0, 4), _keys(range(0, 4)), *_ids(table), row_bytes=[4], views=True)  # a borrowed get's read
    assert viewing.offsets[0, 0] == 100 and (viewing.totals, viewing.end, viewing.adjacent) == ((84,), 184, (True,))
    assert viewing.row_offsets.tolist() == whole.row_offsets.tolist() and viewing.longest == (0,)  # no sizes made
    table.loc("x")[1, LOC_NBYTES] = 1000  # not a write the controller makes: shows which words are read
    assert view.read(["x"], [1, 2], _keys([1, 2]), *_ids(table)).sizes.tolist() == [[48, 0]]  # a run: offsets only
    assert view.read(["x"], [1, 3], _keys([1, 3]), *_ids(table)).sizes.tolist() == [[1000, 20]]  # not consecutive: records
    table.loc("x")[1, LOC_NBYTES] = 48
    with table.writing():
        table.loc("x")[2] = -1  # discarded
    assert view.read(["x"], [0, 1, 2, 3], _keys([0, 1, 2, 3]), *_ids(table)) is None
    with table.writing():
        table.loc("x")[2] = [0, 8, 0, 12, 4096, 10]  # put again, elsewhere, by another commit
    rows = view.read(["x"], [0, 1, 2, 3], _keys([0, 1, 2, 3]), *_ids(table))
    assert rows.offsets.tolist() == [[100, 116, 4096, 164]] and rows.sizes.tolist() == [[16, 48, 12, 20]]
    assert rows.adjacent == (False,) and rows.blocks.tolist() == [7, 8, 7]


def test_gathering_a_few_records_does_not_copy_the_table(tmp_path):
    """A locate gathers its keys' records plane by plane: a gather along the slot axis of the planes'
    record view would copy the whole table first (O(capacity) per 1-key locate)."""
    import tracemalloc

    t = LocationTable(None, capacity=1 << 20, columns=1)  # 48 MiB of planes for the field
    try:
        t.loc("x")[[5, 700_000]] = [[0, 7, 0, 16, 64, 3], [1, 8, 2, 24, 96, 4]]
        out = np.empty((2, LOC_COLUMNS), dtype=np.int64)
        tracemalloc.start()
        take_records(t.loc("x"), np.array([700_000, 5]), out)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert out.tolist() == [[1, 8, 2, 24, 96, 4], [0, 7, 0, 16, 64, 3]]
        assert peak < 1 << 20, f"gathering 2 records allocated {peak} bytes"
    finally:
        t.close()


def test_commits_lay_runs_and_a_restored_table_has_none(loopback):
    """A commit's field is a run when its rows lie back to back in one block in ascending consecutive
    slots (a new id each time); otherwise, and for records restored from a snapshot, its rows carry -1.
    A restored table holds its keys' fingerprints again."""
    ctrl = loopback.start()
    try:
        loopback.commit_two_rows(ctrl)  # a, b: slots 0, 1 at offsets 0, 8 of block 5 - one run

        def commit(keys: list[str], offsets: list[int], block: int) -> None:
            bufs: list = []
            rows = {
                "schema": ["tensor", "int64", []],
                "row_nbytes": protocol.pack_array(np.full(len(keys), 8), bufs),
                "arena_offsets": protocol.pack_array(np.array(offsets), bufs),
            }
            args = {"partition": "p", "keys": keys, "mode": "put", "blocks": [[0, block, len(keys)]], "fields": {"x": rows}}
            loopback.apply(ctrl, "commit", args, bufs)

        commit(["c", "d"], [64, 72], 6)  # slots 2, 3 back to back: a run
        commit(["e", "f"], [200, 100], 7)  # not in slot order: none
        commit(["g"], [300], 8)  # a single row is a run
        runs = ctrl.partitions["p"].loc("x")[:7, LOC_RUN].tolist()
        assert runs[0] == runs[1] >= 0 and runs[2] == runs[3] >= 0 and runs[6] >= 0
        assert len({runs[0], runs[2], runs[6]}) == 3 and runs[4:6] == [-1, -1]
        snap = ctrl._snapshot()
    finally:
        ctrl.close()
    ctrl = loopback.start()
    try:
        ctrl._restore(snap)
        loc = ctrl.partitions["p"].loc("x")
        assert loc[:7, LOC_RUN].tolist() == [-1] * 7 and loc[:7, protocol.LOC_OFFSET].tolist() == [0, 8, 64, 72, 200, 100, 300]
        # the restored keys' fingerprints are written again: a same-host reader reads them from the
        # table (not only through the controller), and only for their own keys
        table = ctrl.partitions["p"].table
        version = int(table.header[H_UNITS_VERSION])
        table.set_status(version, 0, alive_until_ns=time.monotonic_ns() + 10**10)
        ids = (table.incarnation, int(table.header[H_CLEARS]), version)
        assert _view(table).read(["x"], [0, 1], key_fingerprints(["a", "b"]), *ids).offsets.tolist() == [[0, 8]]
        assert _view(table).read(["x"], [0, 1], key_fingerprints(["b", "a"]), *ids) is None
    finally:
        ctrl.close()


@pytest.mark.parametrize("n", [3, FEW_ROWS + 5], ids=["record-by-record", "numpy"])
def test_a_commit_writes_the_same_records_whatever_its_size(loopback, n):
    """Up to FEW_ROWS rows a commit is checked and written with Python ints, above with NumPy: both
    write each row's whole record, give rows back to back in consecutive slots one new run, rows laid
    otherwise none, and refuse a slab commit whose rows are not back to back inside the slab's range."""
    from tq.errors import InvalidRequestError

    ctrl = loopback.start()
    try:
        loopback.commit_two_rows(ctrl)  # slots 0, 1: a run

        def commit(keys: list[str], sizes: np.ndarray, offsets: np.ndarray, block: int, slab: list | None = None) -> None:
            bufs: list = []
            rows = {
                "schema": ["tensor", "int64", []],
                "row_nbytes": protocol.pack_array(sizes, bufs),
                "arena_offsets": protocol.pack_array(offsets, bufs),
            }
            args = {"partition": "p", "keys": keys, "mode": "put", "blocks": [[0, block, len(keys)]], "fields": {"x": rows}}
            loopback.apply(ctrl, "commit", args | ({"slabs": [slab]} if slab else {}), bufs)

        sizes = np.arange(n, dtype=np.int64) % 3 * 8  # some rows empty
        packed = 4096 + np.concatenate([[0], np.cumsum(sizes)[:-1]])
        commit([f"k{i}" for i in range(n)], sizes, packed, 6, [1, 4096, int(sizes.sum())])
        commit([f"r{i}" for i in range(n)], sizes, packed[::-1].copy(), 7)  # offsets descend: no run
        loc = ctrl.partitions["p"].loc("x")
        run = int(loc[2, LOC_RUN])
        assert run > int(loc[0, LOC_RUN]) and run >= 0
        expect = [[0, 6, i, int(sizes[i]), int(packed[i]), run] for i in range(n)]
        assert loc[2 : 2 + n].tolist() == expect
        assert loc[2 + n : 2 + 2 * n, LOC_RUN].tolist() == [-1] * n
        assert loc[2 + n : 2 + 2 * n, protocol.LOC_OFFSET].tolist() == packed[::-1].tolist()
        gap = packed + (np.arange(n) == n - 1)  # the last row one byte off
        bad = (
            (gap, [2, 4096, 1 << 16], "a gap before the last row"),
            (packed, [2, 4104, 1 << 16], "starts before the slab"),
            (packed, [2, 4096, int(sizes.sum()) - 1], "ends past the slab"),
        )
        for block, (offsets, slab, why) in enumerate(bad, start=8):  # a refused commit's block is fenced
            with pytest.raises(InvalidRequestError, match="not back to back inside its slab range"):
                commit([f"bad{i}" for i in range(n)], sizes, offsets, block, slab)
            assert "bad0" not in ctrl.partitions["p"].index, why
    finally:
        ctrl.close()


def test_reader_refuses_records_being_written_unproduced_or_on_a_down_unit(table):
    table.loc("x")[:3] = [_record(0, 0), _record(0, 64), _record(1, 64)]
    view = _view(table)
    with table.writing():  # seq is odd: whatever is read may be torn
        assert view.read(["x"], [0], _keys([0]), *_ids(table)) is None
    assert view.read(["x"], [0, 1], _keys([0, 1]), *_ids(table)) is not None
    assert view.read(["x"], [0, 2], _keys([0, 2]), *_ids(table)) is None  # rows on two units: the controller's path
    assert view.read(["x"], [3], _keys([3]), *_ids(table)) is None  # not produced
    assert view.read(["x"], [4], _keys([4]), *_ids(table)) is None  # beyond the table
    assert view.read(["x"], [-1], _keys([-1]), *_ids(table)) is None
    assert view.read(["y"], [0], _keys([0]), *_ids(table)) is None  # a field this view does not know
    table.set_status(1, down_units=1 << 1, alive_until_ns=time.monotonic_ns() + 10**10)
    assert view.read(["x"], [0], _keys([0]), *_ids(table)) is not None  # unit 0 is fine
    assert view.read(["x"], [2], _keys([2]), *_ids(table)) is None  # unit 1 is down
    table.loc("x")[3] = _record(70, 0)  # units from 62 on share the mask's last bit
    table.set_status(1, down_units=1 << 62, alive_until_ns=time.monotonic_ns() + 10**10)
    assert view.read(["x"], [3], _keys([3]), *_ids(table)) is None and view.read(["x"], [0], _keys([0]), *_ids(table)) is not None
    table.loc("y")[:2] = [_record(1, 0), _record(0, 128)]  # a second field: every record of every field checked
    view = _view(table)
    assert view.read(["x", "y"], [0], _keys([0]), *_ids(table)) is None  # its row on another unit than the first field's
    assert view.read(["x", "y"], [1], _keys([1]), *_ids(table)) is not None
    table.loc("y")[1] = -1
    assert view.read(["x", "y"], [1], _keys([1]), *_ids(table)) is None  # not produced for the second field


def test_records_of_reused_slots_are_refused(table):
    """A meta's slots are reused for new keys (new incarnation) and their records written after its
    reader checked the table: the records it then reads belong to other keys and must be refused."""
    table.loc("x")[0] = _record(0, 0)
    view = _view(table)
    old = _ids(table)
    assert view.read(["x"], [0], _keys([0]), *old) is not None
    table.new_incarnation()  # the slot goes to a new key...
    with table.writing():
        table.loc("x")[0] = _record(1, 4096)  # ...which gets its own records
    assert view.read(["x"], [0], _keys([0]), *old) is None
    assert view.read(["x"], [0], _keys([0]), *_ids(table)).offsets.tolist() == [[4096]]


def test_a_slot_is_read_only_for_the_key_its_fingerprint_names(table, tmp_path):
    """A meta pairs each key with a slot; the reader reads a slot only where the table's key plane
    holds that key's fingerprint - a meta whose keys and slots disagree (swapped, another key's slot)
    goes to the controller, which locates by key. A grown table keeps the fingerprints; a table whose
    controller wrote none (0) matches no key."""
    table.loc("x")[:2] = [_record(0, 0), _record(0, 64)]
    view = _view(table)
    assert view.read(["x"], [0, 1], key_fingerprints(["k0", "k1"]), *_ids(table)).offsets.tolist() == [[0, 64]]
    assert view.read(["x"], [0, 1], key_fingerprints(["k1", "k0"]), *_ids(table)) is None  # swapped
    assert view.read(["x"], range(0, 2), key_fingerprints(["k0", "k0"]), *_ids(table)) is None  # one run, the second key another's
    assert view.read(["x"], [1], key_fingerprints(["k0"]), *_ids(table)) is None
    assert view.read(["x"], [0], key_fingerprints(["k0\x00"]), *_ids(table)) is None  # any byte counts
    with pytest.raises(UnicodeEncodeError):  # no UTF-8 form: a client leaves such a meta to the controller, which says why
        key_fingerprints(["\ud800"])
    with pytest.raises(ValueError, match="keys and slots differ"):
        view.read(["x"], [0, 1], key_fingerprints(["k0"]), *_ids(table))
    table.grow(40)
    assert _view(table).read(["x"], [1, 0], key_fingerprints(["k1", "k0"]), *_ids(table)).offsets.tolist() == [[64, 0]]
    bare = LocationTable(str(tmp_path), capacity=4, columns=1)  # no fingerprint written (set_keys never called)
    try:
        bare.set_status(units_version=1, down_units=0, alive_until_ns=time.monotonic_ns() + 10**10)
        bare.loc("x")[0] = _record(0, 0)
        assert _view(bare).read(["x"], [0], key_fingerprints(["k0"]), *_ids(bare)) is None
    finally:
        bare.close()


def test_frees_invalidate_a_copy_in_flight(table):
    table.loc("x")[0] = _record(0, 0)
    view = _view(table)
    frees = view.read(["x"], [0], _keys([0]), *_ids(table)).frees
    assert view.unchanged(frees)
    with table.writing():
        table.loc("x")[0] = -1
    table.freed()
    assert not view.unchanged(frees)


def test_read_only_for_the_current_incarnation_clears_units_and_a_live_controller(table):
    table.loc("x")[0] = _record(0, 0)
    view = _view(table)

    def usable(inc: int, clears: int, units_version: int) -> bool:
        return view.read(["x"], [0], _keys([0]), inc, clears, units_version) is not None

    inc, clears = table.incarnation, int(table.header[H_CLEARS])
    assert usable(inc, clears, 1)
    assert not usable(inc, clears, 2)  # the client knows other units
    assert not usable(inc ^ 1, clears, 1)
    table.new_incarnation()
    assert not usable(inc, clears, 1)  # slots were reused: old metas go to the controller
    inc = table.incarnation
    table.reset()
    with table.writing():
        table.loc("x")[0] = _record(0, 0)
    assert view.header[H_INCARNATION] != inc and not usable(inc, clears, 1)
    assert usable(table.incarnation, clears, 1)  # cleared, "x" written again as before: schemas hold
    with table.writing():  # written again with another schema
        table.schemas_changed()
        table.loc("x")[0] = _record(0, 0)
    assert usable(table.incarnation, clears + 1, 1) and not usable(table.incarnation, clears, 1)
    table.set_status(1, 0, alive_until_ns=time.monotonic_ns() - 1)  # the controller stopped renewing
    assert not usable(table.incarnation, clears + 1, 1)


def test_growing_copies_records_and_retires_the_old_file(table):
    table.loc("x")[:3] = [_record(0, 64 * i) for i in range(3)]
    old_path, old = table.path, _view(table)
    table.grow(40)
    table.loc("a"), table.loc("b")  # more fields than columns: remapped again
    assert table.capacity >= 40 and table.path != old_path and not os.path.exists(old_path)
    assert old.header[H_RETIRED] == 1 and old.read(["x"], [0], _keys([0]), *_ids(table)) is None
    new = _view(table)
    assert new.read(["x"], [2, 0, 1], _keys([2, 0, 1]), *_ids(table)).offsets.tolist() == [[128, 0, 64]]
    assert new.read(["a"], [0], _keys([0]), *_ids(table)) is None  # new fields start unproduced
    path = table.path
    table.close()
    assert not os.path.exists(path) and new.header[H_RETIRED] == 1


def test_a_grown_table_names_its_successor_and_a_reader_follows_it(table):
    table.loc("x")[:3] = [_record(0, 64 * i) for i in range(3)]
    old = _view(table)
    assert old.successor() is None  # not retired
    table.grow(40)
    _name_slots(table)
    table.loc("x")[30] = _record(0, 4096)  # written after the growth: only in the successor
    new = old.successor()
    assert new is not None and new.path == table.path
    assert new.read(["x"], [2, 30], _keys([2, 30]), *_ids(table)).offsets.tolist() == [[128, 4096]]
    table.grow(100)  # replaced again: the first successor's file is gone, so is the way through it
    assert old.successor() is None and new.successor() is not None
    retired_otherwise = _view(table)
    table.close()  # a dropped partition's table names none: readers ask the controller
    assert retired_otherwise.header[H_RETIRED] == 1 and retired_otherwise.successor() is None


def test_a_file_that_is_not_a_table_is_refused(tmp_path):
    p = tmp_path / "junk"
    p.write_bytes(b"\0" * 4096)
    with pytest.raises(ValueError, match="not a location table"):
        LocationView(str(p), {})


@pytest.mark.parametrize("capacity", [2, 1 << 40, 1 << 62])
def test_the_c_reader_refuses_a_header_claiming_more_records_than_the_buffer_holds(capacity):
    """The C reader trusts no size in the header (no overflow either): it refuses, never reads past."""
    header = np.zeros(HEADER_WORDS + LOC_COLUMNS, dtype=np.int64)  # room for one record only
    header[H_CAPACITY], header[H_COLUMNS] = capacity, 1
    out = np.empty((3, 1, 1), dtype=np.int64)
    with pytest.raises(ValueError, match="truncated"):
        read_locations(header.tobytes(), [0], [capacity - 1], np.zeros(1, dtype=np.int64), 0, 0, 0, out)


_TABLE_MAKER = """
import sys
from tq.locations import LocationTable
table = LocationTable(sys.argv[1])  # a controller's table: held for as long as this process runs
print(table.path, flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("namespace", ["same", "own"], ids=["same-pid-namespace", "other-pid-namespace"])
def test_tables_of_controllers_that_are_gone_are_removed_at_start(tmp_path, namespace):
    """A controller starting retires and unlinks the tables its predecessors left (killed before they
    could), so no reader trusts them once it can free bytes - and only those: a controller that runs,
    even in another pid namespace sharing the directory (its pid names no process here), keeps its
    tables. A table is judged by the lock its controller holds on it, not by the pid in its name."""
    from tq import liveness
    from tq.controller import Controller

    start = pid_namespace_start() if namespace == "own" else None
    if namespace == "own" and start is None:
        pytest.skip("cannot make a pid namespace here (needs root and util-linux unshare)")
    d = str(tmp_path)
    makers = [
        subprocess.Popen(python_command(_TABLE_MAKER, [d], start), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        running, killed = (m.stdout.readline().strip() for m in makers)
        os.kill(python_pid(makers[1]), signal.SIGKILL)  # the maker itself, not the unshare above it
        makers[1].wait(10)
        views = {path: LocationView(path, {}) for path in (running, killed)}
        mine = LocationTable(d)
        left = tmp_path / f".tq-loc-1-{'e' * 16}.tmp"  # a maker killed while making one
        bare, arena = tmp_path / f"tq-loc-{os.getpid()}-{'a' * 16}", tmp_path / "tq-x.arena"  # no lock: no controller holds it
        for p in (left, bare, arena):
            p.write_bytes(b"x")
        os.utime(left, (time.time() - 2 * liveness.TMP_AGE_S,) * 2)
        assert remove_orphans(d) == 3
        assert sorted(os.listdir(d)) == sorted([os.path.basename(running), os.path.basename(mine.path), arena.name])
        assert views[killed].header[H_RETIRED] == 1  # a reader still holding it stops trusting it at once
        assert not views[running].header[H_RETIRED] and not mine.header[H_RETIRED]
        bare.write_bytes(b"x")
        ctrl = Controller("tcp://127.0.0.1:0", shm_dir=d)  # a controller sweeps when it starts
        try:
            assert not bare.exists() and os.path.exists(running) and os.path.exists(mine.path)
        finally:
            ctrl.close()
    finally:
        for m in makers:
            if m.poll() is None:
                m.stdin.write("\n")  # lets it go (under unshare, killing unshare would leave it running)
                m.stdin.flush()
                m.wait(10)


def test_private_tables_have_no_descriptor():
    t = LocationTable(None)
    t.loc("x")[0] = [0] * LOC_COLUMNS
    assert t.descriptor() is None


def test_a_service_keeps_its_location_tables_in_its_shm_dir():
    """``--shm-dir`` holds the controller's tables as well as the arenas: tables in /dev/shm regardless
    were swept as orphans by any other controller on the host once theirs died."""
    from tq import TQServer

    shm_dir = tempfile.mkdtemp(prefix="tq-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        with TQServer(storage_units=1, capacity=4 << 20, shm_dir=shm_dir) as server, TQClient(server.address) as c:
            c.register_partition("p")
            c.get(c.put("p", ["a"], {"x": torch.tensor([1])}))
            tables = [name for name in os.listdir(shm_dir) if name.startswith("tq-loc-")]
            assert len(tables) == 1, os.listdir(shm_dir)
            if "p" in c._tables:  # x86-64: the client reads it from there
                assert os.path.dirname(c._tables["p"][0].path) == shm_dir
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


# ----------------------------------------------------------------------------- through the service
def _locates(c: TQClient) -> int:
    return c.stats()["ops"].get("locate", {}).get("count", 0)


def test_same_host_get_of_a_service_meta_skips_the_controller(tq_server, client, partition):
    tcp = TQClient(tq_server.address, timeout=10.0, transport="tcp")
    try:
        keys = unique_keys(6)
        x = torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5)
        meta = client.put(partition, keys, {"x": x, "ids": [torch.arange(i + 1) for i in range(6)]})
        assert meta.slots is not None and meta.slot_table is not None
        client.get(meta)  # learns the partition's table
        n0 = _locates(client)
        for m in (meta, meta.select([4, 1]), KVBatchMeta.from_msgpack(meta.to_msgpack()), *meta.chunk(2)):
            got = client.get(m)
            assert torch.equal(got["x"], x[[keys.index(k) for k in m.keys]])
        assert _locates(client) == n0  # none of those asked the controller
        assert torch.equal(tcp.get(meta)["x"], x)
        assert _locates(client) == n0 + 1  # a tcp client always asks
        assert torch.equal(client.get(KVBatchMeta(partition, meta.keys, ("x",)))["x"], x)  # no slots: asks
        assert _locates(client) == n0 + 2
    finally:
        tcp.close()


def test_a_reader_follows_its_partitions_grown_table_with_no_locate(client, partition):
    """A first get of a bigger batch than before: the put grew the partition's table (a new file);
    the reader maps the successor its old table names instead of asking the controller."""
    small = client.put(partition, unique_keys(2), {"x": torch.zeros(2, 3), "ids": [torch.arange(2)] * 2})
    client.get(small)  # table and schemas learnt
    path = client._tables[partition][0].path
    vals = {"x": torch.arange(300 * 3, dtype=torch.float32).reshape(300, 3), "ids": [torch.arange(i % 7 + 1) for i in range(300)]}
    big = client.put(partition, unique_keys(300), vals)
    n0 = _locates(client)
    got = client.get(big, layout="jagged")
    assert torch.equal(got["x"], vals["x"]) and [t.tolist() for t in got["ids"].unbind()] == [t.tolist() for t in vals["ids"]]
    assert _locates(client) == n0 and client._tables[partition][0].path != path  # grown, followed, not asked
    assert torch.equal(client.get(small)["x"], torch.zeros(2, 3)) and _locates(client) == n0


def test_slots_reused_after_discard_never_read_another_keys_rows(client, partition):
    old = client.put(partition, unique_keys(4, "old"), {"x": torch.zeros(4, 3)})
    client.get(old)
    client.discard(old)
    new = client.put(partition, unique_keys(4, "new"), {"x": torch.ones(4, 3)})
    assert set(new.slots) == set(old.slots)  # the same slots, handed to new keys
    with pytest.raises(KeyNotFoundError):
        client.get(old)  # must ask the controller, which no longer knows the old keys
    n0 = _locates(client)
    assert torch.equal(client.get(new)["x"], torch.ones(4, 3))
    assert _locates(client) == n0  # the new meta is current: no round trip


def test_a_cleared_partition_whose_field_changed_dtype_is_read_with_the_new_schema(client, partition):
    keys = unique_keys(3)
    client.get(client.put(partition, keys, {"x": torch.full((3, 2), 1.5)}))  # float32, schema learnt
    client.clear_partition(partition)
    meta = client.put(partition, keys, {"x": torch.full((3, 2), 7, dtype=torch.int64)})
    got = client.get(meta)["x"]
    assert got.dtype == torch.int64 and torch.equal(got, torch.full((3, 2), 7, dtype=torch.int64))


def test_a_partition_cleared_and_written_again_alike_is_read_with_no_locate(client, partition):
    """A trainer clears its partition every step and writes the same fields: its ranks' first get of
    the next step reads the table (before, every rank located its shard through the controller)."""
    schemas = {"x": torch.zeros(3, 2), "ids": [torch.arange(n) for n in (1, 4, 2)]}
    client.get(client.put(partition, unique_keys(3), schemas))  # table and schemas learnt
    for step in range(3):
        client.clear_partition(partition)
        vals = {"x": torch.full((3, 2), float(step)), "ids": [torch.arange(n) + step for n in (2, 1, 3)]}
        meta = client.put(partition, unique_keys(3), vals)
        n0 = _locates(client)
        got = client.get(meta, layout="jagged")
        assert torch.equal(got["x"], vals["x"]) and [t.tolist() for t in got["ids"].unbind()] == [t.tolist() for t in vals["ids"]]
        assert _locates(client) == n0, step
    client.clear_partition(partition)  # then a field comes back as another dtype: read with its new schema
    meta = client.put(partition, unique_keys(3), {"x": torch.full((3, 2), 9, dtype=torch.int32)})
    got = client.get(meta)["x"]
    assert got.dtype == torch.int32 and torch.equal(got, torch.full((3, 2), 9, dtype=torch.int32))


def test_an_overwritten_field_reads_back_new_values(client, partition):
    meta = client.put(partition, unique_keys(4), {"x": torch.zeros(4, 8), "mask": torch.ones(4, dtype=torch.bool)})
    client.get(meta)
    meta = client.write_back(meta, {"mask": torch.tensor([True, False, True, False])}, overwrite=True)
    assert client.get(meta, ["mask"])["mask"].tolist() == [True, False, True, False]
    meta = client.write_back(meta, {"lp": torch.full((4, 2), 3.0)})  # a new field: learnt at its first get
    assert torch.equal(client.get(meta, ["x", "lp"])["lp"], torch.full((4, 2), 3.0))


def test_tables_are_unlinked_when_their_partition_is_dropped(client):
    pid = f"p-{os.urandom(4).hex()}"
    client.register_partition(pid)
    client.get(client.put(pid, unique_keys(2), {"x": torch.zeros(2)}))
    path = client._tables[pid][0].path
    assert os.path.exists(path)
    client.drop_partition(pid)
    assert not os.path.exists(path)


def _churn(address: str, partition: str, rounds: int, conn) -> None:
    """Put a batch whose every value is its round number, hand its meta over, discard it, repeat:
    the next put reuses the same slots and (first fit) the same arena bytes."""
    c = TQClient(address, timeout=30.0)
    keys = [f"churn-{i}" for i in range(16)]
    for r in range(rounds):
        meta = c.put(partition, [f"{k}-r{r}" for k in keys], {"x": torch.full((16, 16384), float(r))})
        conn.send(meta.to_dict())
        time.sleep(0.0005 * (r % 3))
        c.discard(meta)
    conn.send(None)
    c.close()


def test_frees_racing_a_copy_never_return_other_bytes(tq_server, client, partition):
    """A writer keeps discarding what the reader is copying and putting new values into the same
    bytes. Every get either returns its own round's values or fails with KeyNotFoundError (discarded
    before it asked) - never a mix. Without the frees check after the copy this returns mixed rows."""
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_churn, args=(tq_server.address, partition, 400, child))
    proc.start()
    ok = gone = 0
    try:
        while (d := parent.recv()) is not None:
            meta = KVBatchMeta.from_dict(d)
            r = float(d["keys"][0].rsplit("-r", 1)[1])
            try:
                got = client.get(meta)["x"]
            except KeyNotFoundError:
                gone += 1
                continue
            bad = (got != r).any(dim=1).nonzero().flatten().tolist()
            assert not bad, f"round {r}: rows {bad} hold other bytes: {torch.unique(got)[:6].tolist()}"
            ok += 1
    finally:
        proc.join(30)
    assert proc.exitcode == 0 and ok > 0


def test_a_free_between_locate_and_copy_is_caught(tq_server, client, partition):
    """The controller path: rows located, then discarded and their bytes rewritten by another client
    before this one copies them. The copy must be redone (and find the keys gone), not returned."""
    other = TQClient(tq_server.address, timeout=10.0)
    try:
        keys = unique_keys(4)
        client.get(client.put(partition, unique_keys(1, "warm"), {"x": torch.zeros(1, 1024)}))  # table mapped
        meta = client.put(partition, keys, {"x": torch.full((4, 1024), 1.0)})
        hand_built = KVBatchMeta(partition, meta.keys, ("x",))  # no slots: goes through locate
        fetch, raced = client._fetch, []

        def fetch_then_race(*args, **kwargs):
            got = fetch(*args, **kwargs)
            if not raced:  # between this locate and the copy: free the rows and reuse their bytes
                raced.append(True)
                other.discard(meta)
                for _ in range(4):
                    other.put(partition, unique_keys(4, "new"), {"x": torch.full((4, 1024), 2.0)})
            return got

        client._fetch = fetch_then_race
        with pytest.raises(KeyNotFoundError):
            client.get(hand_built)
        assert raced
    finally:
        other.close()


def test_slots_index_is_a_slice_exactly_when_the_slots_run_consecutively_upwards():
    """A commit's or a discard's slots index the table as a slice only when they are consecutive and
    ascending (then a slice reads and writes the same rows); any other order stays an index array."""
    from tq.locations import slots_index
    from tq.partition import put_at, rows_at

    for slots in ([5], [5, 6], [3, 4, 5, 6], list(range(100, 200))):
        for form in (slots, np.array(slots, np.int64)):
            assert slots_index(form) == slice(slots[0], slots[-1] + 1)
    for slots in ([], [6, 5], [0, 2, 1, 3], [0, 5, 2], [4, 4, 5], [7, 9]):
        for form in (slots, np.array(slots, np.int64)):
            at = slots_index(form)
            assert not isinstance(at, slice) and list(at) == slots
    rng = np.random.default_rng(0)
    for n in (1, 3, 64, 65, 300):  # put_at writes what a loop would, both ways round FEW_ROWS
        for slots in (list(range(10, 10 + n)), rng.permutation(400)[:n].tolist()):
            want, got = list(range(400)), list(range(400))
            values = [f"v{i}" for i in range(n)]
            for s, v in zip(slots, values):
                want[s] = v
            put_at(got, rows_at(np.array(slots, np.int64)), values)
            assert got == want
