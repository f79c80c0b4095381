"""Location tables: where every (key, field) row of a partition lives, shared with same-host readers.

The controller keeps one :class:`LocationTable` per partition: for each field an int64
``[capacity, LOC_COLUMNS]`` array of location records indexed by key slot (-1: not produced), stored
column by column (a plane per record word, so a reader reads only the words it needs). The
table lives in a shared-memory file, so a client on the controller's host can map it read-only
(:class:`LocationView`) and locate a meta's rows itself - a same-host get then costs no round trip to
the controller, only the copy out of the storage arena. The controller stays the only writer and
the only authority: a reader that finds anything unexpected simply asks it (``locate``).

File layout (little-endian int64 words)::

    header[HEADER_WORDS]                    see the H_* indices below
    keys[capacity]                          per slot, its key's fingerprint (0: none written)
    locs[columns, LOC_COLUMNS, capacity]    per field column, a plane per record word

Readers identify keys by slot, which a meta carries next to its keys (``KVBatchMeta.slots``) with
the table's ``incarnation``. A slot is never handed to another key within one incarnation: reusing
the slots of discarded keys, or clearing the partition, starts a new (random) incarnation, so a meta
from before can only miss the fast path, never read another key's rows. Slots are only a hint the
meta carries, though - a meta built by hand, or whose keys were replaced, may pair a key with another
key's slot - so the table also holds each slot's key fingerprint (a 64-bit hash of the key, written
when the slot is given to it, ``key_fingerprints``) and a reader reads a slot only where it is the
fingerprint of the key the meta pairs with it. Readers also need the fields'
schemas, which they learn from a ``locate`` reply; a field's schema is fixed until the partition is
cleared, and a field written after a clear with another schema than before bumps ``clears`` (before
its records are written), so schemas learnt under another ``clears`` count are not used. A clear
alone does not: a trainer clears its partition every step and writes the same fields again, and its
ranks keep reading the table without asking the controller first.

Consistency is a seqlock in two counters, both written only by the single-threaded controller:
- ``seq`` is odd while records are being written. A reader reads it, copies the records it needs,
  and keeps them only if ``seq`` was even and unchanged.
- ``frees`` is bumped after records are invalidated and *before* the storage units are told to free
  their bytes, so bytes can only be reused after the bump. A reader notes ``frees`` before it reads
  the records and checks it again after copying the rows out of the arena; if it moved, the copy
  may have raced a reuse and the read is redone through the controller.
Runs: a commit that lays a field's rows back to back in one block, in ascending consecutive slots,
gives them one run id (``LOC_RUN``; a counter of the table, never reused while it lives; -1 for rows
laid otherwise and for records restored from a snapshot). Every change of a record writes its run
word (a commit writes the new run, every other change writes the whole record), so rows of
consecutive slots that all carry one run id are rows of that commit, unchanged since, back to back: a
reader then reads only the run and offset words of each row (sizes are the offsets' differences).

A table that is replaced (grown, dropped, or its controller gone) is marked ``retired``; a dead
controller is noticed by ``alive_until``, which it renews with every heartbeat. A table replaced by a
bigger one (more slots or fields; same incarnation, clears and columns) names it in ``successor``,
written before ``retired``: a reader follows it without asking the controller (a first get of a
bigger batch than before would otherwise cost a ``locate`` round trip). The protocol relies on
the host's stores becoming visible in order (x86-64's total store order), so same-host readers use
the tables only there (:data:`SUPPORTED`). The read itself is one call into the C helper
(``tq._fastcopy.read_locations``); where it was not built, same-host gets ask the controller.
"""

from __future__ import annotations

import mmap
import os
import platform
import re
import secrets
from contextlib import contextmanager
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from .protocol import LOC_BLOCK, LOC_COLUMNS, LOC_NBYTES, LOC_OFFSET, LOC_ROW, LOC_RUN, LOC_UNIT
from . import liveness
from .arena import map_new_shm_file
from .pins import bump

try:
    from ._fastcopy import key_fingerprints as _key_fingerprints
    from ._fastcopy import read_locations as _read_locations
    from ._fastcopy import table_layout as _c_table_layout
except ImportError:  # no compiler at install time: no key plane is written and every get asks the controller
    _read_locations = _c_table_layout = _key_fingerprints = None

# A commit of up to this many rows is checked (controller) and written (write_rows) with Python ints:
# a NumPy call on a few elements costs 3-5 us warm and several times that in the controller's loop,
# whose caches the other processes' work between two requests evicts; a list operation a tenth
FEW_ROWS = 64
MAGIC = 0x5451_4C4F_4354_0003  # "TQLOCT" v3: planes per record word, runs, key fingerprints
(
    H_MAGIC,
    H_CAPACITY,
    H_COLUMNS,
    H_SEQ,
    H_FREES,
    H_INCARNATION,
    H_RETIRED,
    H_UNITS_VERSION,
    H_DOWN_UNITS,
    H_ALIVE_UNTIL,
    H_CLEARS,
    H_PIN_EPOCH,
    H_SUCCESSOR,
) = range(13)
HEADER_WORDS = 16
KEY_WORDS = 1  # the key plane: one fingerprint word per slot
ALIVE_S = 3.0  # a table whose controller has not renewed it (every second) for this long is not trusted
#: Same-host readers use the tables only where stores are seen in program order (see module
#: docstring), and through the C reader (one call, right after copies that evicted the caches).
SUPPORTED = platform.machine().lower() in ("x86_64", "amd64") and _read_locations is not None
_LAYOUT = {
    "H_MAGIC": H_MAGIC,
    "H_CAPACITY": H_CAPACITY,
    "H_COLUMNS": H_COLUMNS,
    "H_SEQ": H_SEQ,
    "H_FREES": H_FREES,
    "H_INCARNATION": H_INCARNATION,
    "H_RETIRED": H_RETIRED,
    "H_UNITS_VERSION": H_UNITS_VERSION,
    "H_DOWN_UNITS": H_DOWN_UNITS,
    "H_ALIVE_UNTIL": H_ALIVE_UNTIL,
    "H_CLEARS": H_CLEARS,
    "H_PIN_EPOCH": H_PIN_EPOCH,
    "H_SUCCESSOR": H_SUCCESSOR,
    "HEADER_WORDS": HEADER_WORDS,
    "KEY_WORDS": KEY_WORDS,
    "LOC_UNIT": LOC_UNIT,
    "LOC_BLOCK": LOC_BLOCK,
    "LOC_NBYTES": LOC_NBYTES,
    "LOC_OFFSET": LOC_OFFSET,
    "LOC_RUN": LOC_RUN,
    "LOC_COLUMNS": LOC_COLUMNS,
}
if _c_table_layout is not None and _c_table_layout() != _LAYOUT:  # the C reader hard-codes the layout
    raise ImportError(f"tq._fastcopy was built for another location-table layout: {_c_table_layout()}")


class LocatedRows(NamedTuple):
    """A same-host read of a location table: the rows' storage unit, the ``frees`` count they were
    read under, the end of the furthest row, per field its longest row, its bytes in all and whether
    its rows lie back to back in key order, and
    the ``[fields, keys]`` offsets and sizes of the rows in the unit's arena, and the blocks they lie
    in (one per run of rows in the same block: few, and each block at least once); where asked, per
    field the offsets of its rows laid back to back, in rows of the field (a jagged result's)."""

    unit: int
    frees: int
    end: int
    longest: tuple[int, ...]
    totals: tuple[int, ...]
    adjacent: tuple[bool, ...]
    offsets: np.ndarray
    sizes: np.ndarray
    blocks: np.ndarray
    row_offsets: np.ndarray | None = None  # [fields, keys + 1]: each field's jagged offsets, if asked


PREFIX = "tq-loc-"  # table files are named tq-loc-<controller pid>-<random id, 16 hex digits>
NAME = re.compile(r"tq-loc-[0-9]+-[0-9a-f]{16}")


def slots_index(slots: np.ndarray | list[int]) -> slice | np.ndarray | list[int]:
    """``slots`` (an array or a list) as an index of the table's rows: a slice when they run
    consecutively upwards (a put's fresh keys, a batch read or discarded as it was put), which NumPy
    reads and writes at memory speed, else ``slots`` itself (3,000 slots: a gather or scatter by index
    cost a commit or a discard ~0.1 ms per column)."""
    n = len(slots)
    if not n:
        return slots
    first, last = int(slots[0]), int(slots[-1])
    if last - first != n - 1:
        return slots
    if n > 2 and not (bool((np.diff(slots) == 1).all()) if isinstance(slots, np.ndarray) else slots == list(range(first, last + 1))):
        return slots
    return slice(first, last + 1)


def _table_path(directory: str, pid: int, table_id: int) -> str:
    return os.path.join(directory, f"{PREFIX}{pid}-{table_id:016x}")


def remove_orphans(directory: str) -> int:
    """Retire and unlink the tables of controllers that are gone (killed before they could); returns
    how many. A controller restarted on the same state runs this before serving anything, so no reader
    trusts its predecessor's table once the new one can free bytes. A controller holds a lock on each
    of its tables for as long as it runs (:func:`tq.liveness.create_held`): a table is judged by that,
    not by the pid in its name, which may be another pid namespace's (a controller of another
    container sharing the directory) or reused."""
    return liveness.remove_gone(directory, NAME, retire=_retire_file)


def _retire_file(path: str) -> None:
    """Mark the table at ``path`` retired, as its controller would have (if it is one)."""
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size < 8 * HEADER_WORDS:
            return
        mm = mmap.mmap(fd, 8 * HEADER_WORDS)
    finally:
        os.close(fd)
    header = np.frombuffer(mm, dtype=np.int64)
    if header[H_MAGIC] == MAGIC:
        _mark_retired(header)
    del header
    mm.close()


def _mark_retired(header: np.ndarray) -> None:
    """Readers of this table must stop trusting it, and any copy they have in flight."""
    header[H_RETIRED] = 1
    bump(header, H_FREES)


def _nbytes(capacity: int, columns: int) -> int:
    return 8 * (HEADER_WORDS + capacity * (KEY_WORDS + columns * LOC_COLUMNS))


def key_fingerprints(keys: Sequence[str]) -> np.ndarray:
    """Each key's fingerprint as the table's key plane holds it (int64; needs the C helper)."""
    out = np.empty(len(keys), dtype=np.int64)
    _key_fingerprints(keys, out)
    return out


def new_incarnation() -> int:
    """A random positive 63-bit id: stale metas match a new incarnation with probability 2**-63."""
    return secrets.randbits(63) or 1


def take_records(records: np.ndarray, slots: np.ndarray, out: np.ndarray) -> None:
    """Gather the ``[capacity, LOC_COLUMNS]`` records of ``slots`` into ``out`` (``[len(slots),
    LOC_COLUMNS]``). The records are a view of a field's planes: each plane is gathered on its own -
    ``np.take`` along the slot axis of the view would first copy the whole table (a 1-key locate of a
    million-slot partition read 48 MB)."""
    np.take(records.T, slots, axis=1, out=out.T)


class LocationTable:
    """The controller's side: per-field location records of one partition, in shared memory when
    ``directory`` is given (else private memory, and no reader can map it)."""

    def __init__(self, directory: str | None, capacity: int = 16, columns: int = 4, pin_epoch: int = 0) -> None:
        self.directory = directory
        self.columns: dict[str, int] = {}  # field -> column; kept across clears (fields tend to return)
        self.views: dict[str, np.ndarray] = {}  # fields in use -> their [capacity, LOC_COLUMNS] records
        self.path: str | None = None
        self._mm: mmap.mmap | None = None
        self._held: int | None = None  # a descriptor holding the lock that says the table is in use
        self.header = np.zeros(HEADER_WORDS, dtype=np.int64)
        self.header[H_PIN_EPOCH] = pin_epoch  # the pin board readers' pins must be registered with (tq.pins)
        self._last_run = 0  # run ids handed out (see the module docstring), kept across growth and clears
        self._keys: np.ndarray | None = None  # the key plane (fingerprint per slot)
        self._allocate(capacity, columns, incarnation=new_incarnation())

    # -- storage
    def _allocate(self, capacity: int, columns: int, incarnation: int) -> None:
        """Map a fresh table (all records -1), copy the current records into it, retire the old one."""
        size = _nbytes(capacity, columns)
        path, mm = None, None
        table_id = new_incarnation()  # also random, positive and 63 bits
        if self.directory is not None:
            path = _table_path(self.directory, os.getpid(), table_id)
            # held while this table is in use: a controller starting meanwhile must not take it for an
            # orphan (remove_orphans); a full tmpfs fails here, before anything changed
            fd, mm = map_new_shm_file(path, size)
            words = np.frombuffer(mm, dtype=np.int64)
        else:
            words = np.empty(size // 8, dtype=np.int64)
        header, keys = words[:HEADER_WORDS], words[HEADER_WORDS : HEADER_WORDS + capacity]
        locs = words[HEADER_WORDS + capacity :].reshape(columns, LOC_COLUMNS, capacity)
        locs.fill(-1)
        keys.fill(0)
        if self._keys is not None:
            n = min(capacity, self._keys.shape[0])
            keys[:n] = self._keys[:n]
        old = self.header
        header[:] = old
        header[H_CAPACITY], header[H_COLUMNS], header[H_INCARNATION] = capacity, columns, incarnation
        header[H_RETIRED], header[H_SUCCESSOR], header[H_MAGIC] = 0, 0, MAGIC
        for name, col in self.columns.items():
            if name in self.views:
                n = min(capacity, self.views[name].shape[0])
                locs[col].T[:n] = self.views[name][:n]
        # Readers learn the new path from a later locate reply or from the old table's successor word,
        # both set only now that it is complete. Never called inside writing(): the seq copied over is even.
        in_use = list(self.views)
        if path is not None:
            self.header[H_SUCCESSOR] = table_id  # before it is retired: readers seeing that see this
        self._retire_storage()
        self.header, self._keys, self._locs, self.path, self._mm = header, keys, locs, path, mm
        self._held = fd if path is not None else None
        self.views = {name: locs[self.columns[name]].T for name in in_use}

    def _retire_storage(self) -> None:
        if self._mm is None and self.path is None:
            return
        _mark_retired(self.header)
        self.views, self.header = {}, self.header.copy()  # drop views into the old mapping
        self._locs = self._keys = None  # type: ignore[assignment]
        if self.path is not None:
            try:
                os.unlink(self.path)  # readers that mapped it keep their mapping until they drop it
            except FileNotFoundError:
                pass
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still referenced somewhere; the mapping dies with it
                pass
        if self._held is not None:  # only once unlinked: unlocked, it would be an orphan to retire
            os.close(self._held)
            self._held = None

    @property
    def capacity(self) -> int:
        return int(self.header[H_CAPACITY])

    @property
    def frees(self) -> int:
        """How many times records were invalidated before bytes were freed (see the seqlock above)."""
        return int(self.header[H_FREES])

    @property
    def incarnation(self) -> int:
        return int(self.header[H_INCARNATION])

    def grow(self, capacity: int) -> None:
        """Make room for ``capacity`` slots (at least doubling, so growth stays amortised)."""
        if capacity > self.capacity:
            self._allocate(max(capacity, 2 * self.capacity), int(self.header[H_COLUMNS]), self.incarnation)

    def write_rows(
        self,
        name: str,
        slots: np.ndarray,
        unit: int | np.ndarray,
        block: int | np.ndarray,
        rows: np.ndarray,
        nbytes: np.ndarray,
        offsets: np.ndarray,
        *,
        one_block: bool,
    ) -> None:
        """Write the records of a commit's rows of field ``name`` (inside :meth:`writing`). They are a
        run - a new run id, see the module docstring - when they lie in one block (``one_block``), in
        ascending consecutive slots, back to back; else their run word is -1. The only partial write
        of records: every other change writes whole records, run word included."""
        loc = self.loc(name)
        if one_block and len(slots) <= FEW_ROWS:  # record by record: NumPy's indexing costs more on a few
            ss, nbl, offl = slots.tolist(), nbytes.tolist(), offsets.tolist()
            if len(ss) == 1 or (all(b - a == 1 for a, b in zip(ss, ss[1:])) and all(o + n == p for o, n, p in zip(offl, nbl, offl[1:]))):
                self._last_run += 1
                run = self._last_run
            else:
                run = -1
            for s, row, n, off in zip(ss, rows.tolist(), nbl, offl):
                loc[s] = (unit, block, row, n, off, run)  # LOC_UNIT .. LOC_RUN, in order
            return
        at = slots_index(slots)
        loc[at, LOC_UNIT] = unit
        loc[at, LOC_BLOCK] = block
        loc[at, LOC_ROW] = rows
        loc[at, LOC_NBYTES], loc[at, LOC_OFFSET] = nbytes, offsets
        run = one_block and isinstance(at, slice) and (len(slots) == 1 or bool((offsets[1:] == offsets[:-1] + nbytes[:-1]).all()))
        if run:
            self._last_run += 1
        loc[at, LOC_RUN] = self._last_run if run else -1

    def set_keys(self, at: slice | np.ndarray | list[int], keys: Sequence[str]) -> None:
        """Write the fingerprints of ``keys``, just given the slots ``at`` addresses (before any record
        of theirs, and after a new incarnation when the slots are reused): a reader reads a slot only
        for its key. Without the C helper none is written, and no reader uses the table."""
        if _key_fingerprints is not None and keys:
            self._keys[at] = key_fingerprints(keys)

    def restore_rows(self, name: str, records: np.ndarray) -> None:
        """Write field ``name``'s records from a snapshot (``[slots, columns]``, maybe of fewer columns
        than now) from slot 0 on, with no runs: run ids are counted by the table that handed them out,
        and a restored one could equal a run this table hands out next, next to it in the slots."""
        loc = self.loc(name)
        loc[: records.shape[0], : records.shape[1]] = records
        loc[:, LOC_RUN] = -1

    def loc(self, name: str) -> np.ndarray:
        """The records of field ``name`` (a new field starts all -1): a ``[capacity, LOC_COLUMNS]`` view
        of its planes."""
        view = self.views.get(name)
        if view is None:
            col = self.columns.get(name)
            if col is None:
                col = len(self.columns)
                if col >= int(self.header[H_COLUMNS]):  # may fail (a full tmpfs): the field is not added then
                    self._allocate(self.capacity, 2 * col, self.incarnation)
                self.columns[name] = col
            view = self.views[name] = self._locs[col].T  # all -1: fresh, or reset with the partition
        return view

    # -- the seqlock (see module docstring)
    @contextmanager
    def writing(self) -> Iterator[None]:
        """Bracket a change of records: readers that overlap it discard what they read."""
        self.header[H_SEQ] += 1
        try:
            yield
        finally:
            self.header[H_SEQ] += 1

    def freed(self) -> None:
        """Call after invalidating records and before telling units to free their bytes (and before
        reading readers' pins: the bump is atomic and fenced, see tq.pins)."""
        bump(self.header, H_FREES)

    def new_incarnation(self) -> None:
        """Slots are about to be reused: metas minted before can no longer use this table."""
        self.header[H_INCARNATION] = new_incarnation()

    def reset(self) -> None:
        """Clear every record (partition cleared); the field columns stay assigned. Readers keep the
        schemas they learnt: a field written again with another schema calls :meth:`schemas_changed`."""
        with self.writing():
            self._locs.fill(-1)
            self.views = {}
            self.new_incarnation()
        self.freed()

    def schemas_changed(self) -> None:
        """A field is about to be written with another schema than readers may have learnt for it
        (its partition was cleared since): call inside :meth:`writing`, before its records."""
        self.header[H_CLEARS] += 1

    def set_status(self, units_version: int, down_units: int, alive_until_ns: int) -> None:
        """What a reader must check about the service: units' version, down units (bit mask), liveness."""
        h = self.header
        h[H_UNITS_VERSION], h[H_DOWN_UNITS], h[H_ALIVE_UNTIL] = units_version, down_units, alive_until_ns

    def descriptor(self) -> dict | None:
        """What a same-host reader needs to map this table (None when it is not shared)."""
        if self.path is None:
            return None
        return {"path": self.path, "clears": int(self.header[H_CLEARS]), "columns": {n: self.columns[n] for n in self.views}}

    def close(self) -> None:
        """Retire and unlink the table (partition dropped or controller closing)."""
        self._retire_storage()
        self.path = None
        self._mm = None


class LocationView:
    """A reader's read-only mapping of one :class:`LocationTable` file."""

    def __init__(self, path: str, columns: dict[str, int]) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < 8 * HEADER_WORDS:
                raise ValueError(f"location table {path} is truncated ({size} bytes)")
            self._mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.header = memoryview(self._mm).cast("q")[:HEADER_WORDS]  # plain ints: cheap to check after a copy
        capacity, ncols = int(self.header[H_CAPACITY]), int(self.header[H_COLUMNS])
        if self.header[H_MAGIC] != MAGIC or capacity < 0 or ncols < 0 or _nbytes(capacity, ncols) != size:
            raise ValueError(f"{path} is not a location table of this version")
        self.path, self.capacity, self._ncols = path, capacity, ncols
        self.columns: dict[str, int] = {}
        self.add_columns(columns)

    def successor(self) -> LocationView | None:
        """The table that replaced this retired one when it was grown, mapped with the columns known
        here; None if it was retired for another reason, or replaced again since (its file is gone)."""
        table_id = int(self.header[H_SUCCESSOR]) if self.header[H_RETIRED] else 0
        if table_id <= 0:
            return None
        pid = os.path.basename(self.path)[len(PREFIX) :].split("-", 1)[0]
        try:
            return LocationView(_table_path(os.path.dirname(self.path), int(pid), table_id), self.columns)
        except (OSError, ValueError):
            return None

    def add_columns(self, columns: dict[str, int]) -> None:
        """Learn where more fields' records are (from a later locate reply)."""
        ncols = self._ncols
        self.columns.update({f: c for f, c in columns.items() if isinstance(c, int) and 0 <= c < ncols})

    def read(
        self,
        fields: list[str],
        slots: Sequence[int],
        keys: np.ndarray,
        incarnation: int,
        clears: int,
        units_version: int,
        row_bytes: Sequence[int] | None = None,
        views: bool = False,
    ) -> LocatedRows | None:
        """Where the rows (``fields`` x ``slots``) lie, when they are all on one storage unit and the
        table can be trusted for them: each slot holds the key ``keys`` pairs with it (``keys``: the
        keys' fingerprints, :func:`key_fingerprints`), the table not retired, its controller alive, ``incarnation`` and
        ``clears`` (when the reader learnt the fields' schemas) still current, the units still at
        ``units_version``, every row produced and its unit up, and no write overlapping the read.
        None otherwise: the reader asks the controller. ``row_bytes`` (bytes per row unit, per field;
        0 for none): also the fields' jagged offsets, made in the same pass; with them, ``views`` (a
        borrowed get, which views rows lying back to back where they are): a field whose rows are one
        run gets only its first offset, no sizes and longest row 0."""
        cols = [self.columns.get(f) for f in fields]
        if None in cols:
            return None
        planes = np.empty((3, len(cols), len(slots)), dtype=np.int64)
        if row_bytes is None:
            got = _read_locations(self._mm, cols, slots, keys, incarnation, clears, units_version, planes)
            row_offsets = None
        else:
            row_offsets = np.empty((len(cols), len(slots) + 1), dtype=np.int64)
            got = _read_locations(self._mm, cols, slots, keys, incarnation, clears, units_version, planes, row_bytes, row_offsets, views)
        if got is None:
            return None
        *got, runs = got
        return LocatedRows(*got, planes[0], planes[1], planes[2].ravel()[:runs], row_offsets)

    @property
    def mapping(self) -> mmap.mmap:
        """The table's bytes (header first), as mapped here."""
        return self._mm

    def unchanged(self, frees: int) -> bool:
        """No bytes were freed since ``frees`` was read, so rows copied since are intact."""
        return self.header[H_FREES] == frees and not self.header[H_RETIRED]

    def close(self) -> None:
        self.header = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass
