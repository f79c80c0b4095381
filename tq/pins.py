"""Pins: leases of same-host borrowed gets taken in shared memory, with no request on the way.

A borrowed get (``TQClient.get(..., copy=False)``) must keep the blocks it views from being freed.
Asking the controller for a lease (``borrow``) costs a round trip - most of a borrowed get on the same
host. A pin takes the lease where the reader already is, in shared memory:

* Each client that borrows registers one **pin file** with the controller (``pin_file``, once, journaled):
  a header and ``SLOTS`` slots of ``(lease id, deadline, unit, block count, blocks...)``, written only
  by that client, in the controller's shared-memory directory. The client holds a shared ``flock``
  on the file while it lives: the controller tells a paused client (its pins past their deadline
  still hold) from a gone one by that lock (tq.liveness), in any pid namespace.
* **Reader** (after it located its rows in the partition's location table under a ``frees`` count):
  writes the blocks into a free slot, publishes the lease id, full fence, then reads the table's
  ``frees`` (and retirement, incarnation, clears) again. Unchanged: the pin holds. Changed: it clears
  the slot and asks for a lease by request instead.
* **Controller** (before any unit is told to free rows): bumps the table's ``frees`` (one atomic add),
  full fence, then reads every registered pin file. Each pin it finds becomes a lease in its
  :class:`~tq.leases.LeaseBook` (journaled, as a ``borrow`` lease is), so the rows freed in its blocks
  wait for it.
Either the reader sees the bump or the controller sees the pin, never neither (each side stores, fences,
then loads the other's word): a pin that held was seen by every later free. A pin also holds only
against a table carrying the epoch of the pin board its file was registered with (each controller
writes its own into its tables): a controller started anew without a journal never heard of older
files, so a reader registers a new one with it first.

The reader renews a pin by writing a later deadline into its slot and releases it by clearing the
slot; the controller polls the pins it holds as leases (``POLL_S``) and ends one whose slot was cleared,
reused or whose deadline passed - a reader that died pins nothing for longer than one term. The
fences and whole-slot reads are in C (``tq._fastcopy``); where it was not built, or a get's rows lie in
more blocks than a slot holds, borrowed gets lease by request as before.
"""

from __future__ import annotations

import collections
import mmap
import os
import re
import uuid
from dataclasses import dataclass

import numpy as np

from .arena import map_new_shm_file
from .liveness import holder_alive, remove_gone
from .leases import new_lease_id

try:
    from ._fastcopy import bump_word as _bump_word
    from ._fastcopy import pin as _pin
    from ._fastcopy import pin_layout as _c_pin_layout
    from ._fastcopy import read_pins as _read_pins
except ImportError:  # no C helper: no pins (borrowed gets lease by request)
    _pin = _read_pins = _bump_word = _c_pin_layout = None

PIN_MAGIC_W, PIN_SLOTS_W, PIN_WORDS_W, PIN_OWNER_W, PIN_REVOKED_W, PIN_HEADER = 0, 1, 2, 3, 4, 8
P_LEASE, P_DEADLINE, P_UNIT, P_COUNT, P_BLOCKS, PIN_WORDS = 0, 1, 2, 3, 4, 64
MAX_BLOCKS = PIN_WORDS - P_BLOCKS  # a get whose rows lie in more blocks leases by request
SLOTS = 256  # borrowed gets a client holds through pins at once; more lease by request
MAX_SLOTS = 4096  # a pin file claiming more is refused (the controller reads every slot at every free)
MAGIC = 0x5451_50494E_0001  # "TQ" "PIN" v1
PREFIX = "tq-pin-"  # pin files are named tq-pin-<client pid>-<random> (the pid only informs)
NAME = re.compile(r"tq-pin-[0-9]+-[0-9a-f]{16}")
POLL_S = 0.05  # how often the controller looks at the pins it holds as leases (a released pin's rows wait this long)
SUPPORTED = _pin is not None

if _c_pin_layout is not None and _c_pin_layout() != {
    "PIN_MAGIC_W": PIN_MAGIC_W,
    "PIN_SLOTS_W": PIN_SLOTS_W,
    "PIN_WORDS_W": PIN_WORDS_W,
    "PIN_OWNER_W": PIN_OWNER_W,
    "PIN_REVOKED_W": PIN_REVOKED_W,
    "PIN_HEADER": PIN_HEADER,
    "P_LEASE": P_LEASE,
    "P_DEADLINE": P_DEADLINE,
    "P_UNIT": P_UNIT,
    "P_COUNT": P_COUNT,
    "PIN_WORDS": PIN_WORDS,
}:
    raise ImportError(f"tq._fastcopy was built for another pin-file layout: {_c_pin_layout()}")


def bump(words: np.ndarray, index: int) -> None:
    """``words[index] += 1`` as one atomic step followed by a full fence (plain where C is missing:
    then no reader pins)."""
    if _bump_word is not None:
        _bump_word(words, index)
    else:
        words[index] += 1


def _nbytes(slots: int) -> int:
    return 8 * (PIN_HEADER + slots * PIN_WORDS)


def _map(path: str) -> mmap.mmap:
    """A registered pin file, mapped writable for one word (revoked); refused unless of this version."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    header = np.frombuffer(mm, dtype=np.int64, count=PIN_HEADER) if size >= 8 * PIN_HEADER else None
    if (
        header is None
        or header[PIN_MAGIC_W] != MAGIC
        or header[PIN_WORDS_W] != PIN_WORDS
        or not 0 < header[PIN_SLOTS_W] <= MAX_SLOTS
        or _nbytes(int(header[PIN_SLOTS_W])) != size
    ):
        del header
        mm.close()
        raise ValueError(f"{path} is not a pin file of this version")
    del header
    return mm


class PinFile:
    """A client's pin file (the reader's side): one slot per borrowed get it holds through a pin."""

    def __init__(self, directory: str, slots: int = SLOTS) -> None:
        self.path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:16]}")
        # held (shared) while the client lives: the controller tells a paused client from a gone one
        # by this lock, in any pid namespace (tq.liveness); registered only once it is taken
        self._lock_fd, self._mm = map_new_shm_file(self.path, _nbytes(slots))
        self._words = np.frombuffer(self._mm, dtype=np.int64)
        self._words[PIN_SLOTS_W], self._words[PIN_WORDS_W], self._words[PIN_OWNER_W] = slots, PIN_WORDS, os.getpid()
        self._words[PIN_MAGIC_W] = MAGIC
        self._slots = self._words[PIN_HEADER:].reshape(slots, PIN_WORDS)
        self.owner = os.getpid()
        self.epoch = 0  # the pin board it is registered with (tables carry theirs): set on registration
        # free slots; a deque's append and pop need no lock, so a release is safe from a finalizer
        self._free = collections.deque(range(slots))

    def pin(
        self,
        deadline_ns: int,
        unit: int,
        blocks: list[int],
        table: mmap.mmap,
        frees: int,
        incarnation: int,
        clears: int,
        lease: int | None = None,
    ) -> tuple[int, int] | None:
        """Pin ``blocks`` of ``unit`` until ``deadline_ns`` if the table still has ``frees``,
        ``incarnation`` and ``clears`` once the pin is published; returns (lease id, slot), or None
        (nothing kept: lease by request). ``lease``: the id to pin under (default: a new one) - a
        caller cut short before it learnt the answer gives the pin up by it (:meth:`unpin`)."""
        if len(blocks) > MAX_BLOCKS or self._slots is None or os.getpid() != self.owner:  # a forked child: its own file
            return None
        try:
            slot = self._free.pop()
        except IndexError:
            return None
        lease = new_lease_id() if lease is None else lease
        try:
            held = _pin(self._mm, slot, lease, deadline_ns, unit, blocks, table, frees, incarnation, clears, self.epoch)
        except BaseException:  # a Ctrl-C as the pin returned: pinned or not, it is given up
            self.release(slot, lease)
            if slot not in self._free:
                self._free.append(slot)
            raise
        if not held:
            self._free.append(slot)
            return None
        return lease, slot

    def unpin(self, lease: int) -> None:
        """Give up the pin held under ``lease``, if any (whichever slot)."""
        slots = self._slots
        if slots is not None:
            for slot in np.flatnonzero(slots[:, P_LEASE] == lease).tolist():
                self.release(slot, lease)

    @property
    def revoked(self) -> bool:
        """The controller stopped reading this file (it took its client for gone): pin in a new one."""
        return self._words is None or bool(self._words[PIN_REVOKED_W])

    def renew(self, slot: int, lease: int, deadline_ns: int, now_ns: int) -> bool:
        """Move the pin's deadline on; False when it had passed already (the controller may have
        ended it and freed its rows: its views can no longer be trusted). A pin this process gave up
        already (a release cut short before its keeper forgot it) has nothing to renew: True."""
        row = self._slots[slot] if self._slots is not None else None
        if row is None or row[P_LEASE] != lease:
            return True
        ok = int(row[P_DEADLINE]) > now_ns
        row[P_DEADLINE] = deadline_ns
        return ok

    def release(self, slot: int, lease: int) -> None:
        """Give the pin up (its slot is free for the next one). Any thread, any time: one store."""
        slots = self._slots  # once: close() may drop it meanwhile (the mapping stays while a view lives)
        if slots is None or slots[slot, P_LEASE] != lease:
            return
        slots[slot, P_LEASE] = 0
        self._free.append(slot)

    def close(self) -> None:
        """Give every pin up and remove the file."""
        if self._slots is None:
            return
        self._slots[:, P_LEASE] = 0
        self._slots = self._words = None  # type: ignore[assignment]
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._lock_fd)
        try:
            self._mm.close()
        except BufferError:
            pass


@dataclass(frozen=True)
class Pin:
    """A pin read from a pin file: ``lease`` holds ``blocks`` of ``unit`` until ``deadline_ns``."""

    path: str
    slot: int
    lease: int
    deadline_ns: int
    unit: int
    blocks: tuple[int, ...]


class PinBoard:
    """The controller's side: the pin files its clients registered, read whole at every free."""

    def __init__(self, directory: str) -> None:
        self.directory = os.path.realpath(directory)
        self.files: dict[str, mmap.mmap] = {}

    def register(self, path: str) -> None:
        """Read ``path``'s pins from now on; it must be a pin file directly in the directory."""
        if os.path.dirname(path) != self.directory or not os.path.basename(path).startswith(PREFIX):
            raise ValueError(f"pin file {path!r} is not a {PREFIX}* file in {self.directory}")
        if path not in self.files:
            self.files[path] = _map(path)

    @staticmethod
    def owner(path: str) -> str:
        """What tells whether the client of pin file ``path`` still runs (a lease's holder, see
        tq.liveness.runs): the file's name - its client holds it locked while it lives."""
        return os.path.basename(path)

    def client_runs(self, path: str) -> bool:
        """Whether the client that made pin file ``path`` still runs (paused, maybe)."""
        return holder_alive(self.directory, os.path.basename(path))

    def pins(self) -> list[Pin]:
        """Every pin in use now, whatever its deadline (the caller compares)."""
        return [Pin(path, *p) for path, mm in self.files.items() for p in _read_pins(mm)]

    def deadline(self, path: str, slot: int, lease: int) -> int | None:
        """The pin's deadline if ``lease`` still holds ``slot`` of ``path`` (run out or not), else None."""
        mm = self.files.get(path)
        if mm is None:
            return None
        words = np.frombuffer(mm, dtype=np.int64, count=2, offset=8 * (PIN_HEADER + slot * PIN_WORDS))
        return int(words[P_DEADLINE]) if int(words[P_LEASE]) == lease else None

    def holds(self, path: str, slot: int, lease: int, now_ns: int) -> int | None:
        """The pin's deadline if ``lease`` still holds ``slot`` of ``path`` and has not run out, else None."""
        deadline = self.deadline(path, slot, lease)
        return deadline if deadline is not None and deadline > now_ns else None

    def prune(self, now_ns: int) -> None:
        """Stop reading the files of clients that closed them (unlinked) or are gone (the file is no
        longer locked: its client exited, however it ended; see tq.liveness), once nothing in them
        pins beyond ``now_ns``. A file is revoked first (atomic, fenced) and read once more: a pin
        published before the revocation is seen then (the file is kept), one after it is given up by
        its client, which registers a new file - so no pin is lost. A let-go file is unlinked."""
        for path, mm in list(self.files.items()):
            header = np.frombuffer(mm, dtype=np.int64, count=PIN_HEADER)
            if any(deadline > now_ns for _, _, deadline, _, _ in _read_pins(mm)):
                continue
            if self.client_runs(path):
                continue
            if not header[PIN_REVOKED_W]:
                _bump_word(header, PIN_REVOKED_W)
            if _read_pins(mm):  # published before the revocation: still read until it ends
                continue
            del self.files[path], header
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            mm.close()

    def remove_orphans(self) -> int:
        """Unlink the pin files of the directory that nothing reads and whose client is gone: not
        registered with this board and not locked by a client (a client locks its file before the file
        appears under its name: see tq.liveness.create_held); and files a client killed while making
        one left behind. A controller runs this at start, after its journal registered its files
        again: files of clients killed while no controller read them (or registered with a
        predecessor that had no journal) are removed instead of staying in shared memory. Returns
        how many."""
        return remove_gone(self.directory, NAME, keep=self.files.__contains__)

    def close(self) -> None:
        for mm in self.files.values():
            mm.close()
        self.files.clear()
