"""Lightweight batch handles for the TransferQueue data plane.

A :class:`KVBatchMeta` names a batch of samples stored in the data-plane
service without carrying any bulk tensor data: it holds the per-sample storage
keys, the column names (``fields``) the batch promises or asks for, optional
unpadded sequence lengths, small columnar per-sample ``tags`` and a free-form
``extra_info`` dict that is propagated unchanged to every derived meta.

The training driver passes these handles around (sharded per data-parallel
rank, see :mod:`tq.sharding`); each worker fetches its shard's columns from
storage by key.

This module is pure Python (plus numpy and msgpack): no I/O, no torch.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

__all__ = ["KVBatchMeta", "TAG_VALUE_TYPES"]

#: Exact Python types allowed as tag values.
TAG_VALUE_TYPES: tuple[type, ...] = (type(None), bool, int, float, str)
_TAG_TYPES = frozenset(TAG_VALUE_TYPES)


def _normalise_slots(value: Any, n: int) -> tuple[int, ...] | range:
    """``n`` slots as a tuple of ints >= 0, or as a ``range`` when they are consecutive: the same
    values in three ints, which a same-host reader checks without converting one int per key (and a
    meta pickles without them)."""
    slots = value if isinstance(value, range) else _as_tuple(value, "slots")
    if len(slots) != n:
        raise ValueError(f"slots has {len(slots)} values for {n} keys")
    if isinstance(slots, range) and (slots.step == 1 or n <= 1):
        if n and slots.start < 0:
            raise TypeError("slots must be ints >= 0")
        return range(slots.start, slots.start + n) if n else range(0)
    slots = tuple(slots)
    if not set(map(type, slots)) <= {int}:
        raise TypeError("slots must be ints >= 0")
    if n and 0 <= slots[0] and slots[-1] - slots[0] == n - 1 and slots == tuple(consecutive := range(slots[0], slots[-1] + 1)):
        return consecutive
    if slots and min(slots) < 0:
        raise TypeError("slots must be ints >= 0")
    return slots


#: The longest key, partition id, field or tag name, in characters (S3's key bound): a name is an id,
#: and one longer is a bug upstream (a prompt passed as a key) that would be journaled and held per key.
MAX_NAME_CHARS = 1024
#: The range of an int tag value: what msgpack (the wire and the journal) carries.
TAG_INT_RANGE = (-(1 << 63), (1 << 64) - 1)
#: The most fields a meta names, and a partition holds from its making (its location table keeps a
#: column of records per field for every slot).
MAX_FIELDS = 256
#: The most tag names a meta - and a partition - holds: the controller keeps a value per slot for
#: each; a per-sample value belongs in a tag's values, not in its name.
MAX_TAG_NAMES = 128
#: The longest str tag value, in characters: a tag is a small per-sample value the controller holds
#: and journals for every key; text longer than this (a prompt, a ground-truth program) is a column.
MAX_TAG_CHARS = 1 << 16


def check_names(names: Sequence[str], what: str) -> None:
    """``ValueError`` naming the first of ``names`` (str) that is empty, over MAX_NAME_CHARS or not
    UTF-8 text."""
    if names and not 0 < min(lens := list(map(len, names))) <= max(lens) <= MAX_NAME_CHARS:
        i = next(i for i, n in enumerate(lens) if not 0 < n <= MAX_NAME_CHARS)
        where = f" at index {i}" if len(names) > 1 else ""
        raise ValueError(f"{what}{where} {reprlib.repr(names[i])} has {lens[i]} characters; a name has 1 to {MAX_NAME_CHARS}")
    check_utf8(names, what)


def check_utf8(texts: Sequence[str], what: str) -> None:
    """``ValueError`` naming the first of ``texts`` that UTF-8 cannot encode (a lone surrogate, what
    ``os.fsdecode`` makes of a bad file name): the wire and the journal carry UTF-8, so such text is
    refused here, before a put stores a byte, not when its commit is encoded."""
    joined = "".join(texts)  # one pass: ~1 ms per 100k keys; ASCII (the usual case) needs no encode
    if joined.isascii():
        return
    try:
        joined.encode()
    except UnicodeEncodeError as exc:
        i = next(i for i, t in enumerate(texts) if not t.isascii() and not _encodes(t))
        where = f" at index {i}" if len(texts) > 1 else ""
        raise ValueError(
            f"{what}{where} {reprlib.repr(texts[i])} is not valid UTF-8 text ({exc.reason}: {exc.object[exc.start]!r})"
        ) from None


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def plain_strs(items: Iterable[Any]) -> list[Any]:
    """``items`` with each str subclass (numpy's ``np.str_``, a str enum) made a plain str - what the
    wire encodes - and anything else left as it is, for the caller's type check."""
    return [str.__str__(x) if isinstance(x, str) else x for x in items]


MAX_PAD_LENGTH = 1 << 31  # entries a padded row may have (longer than any sequence a model takes)


def is_pad_length(value: Any) -> bool:
    """Whether ``value`` can be a padded length: a whole number (not a bool) in [0, MAX_PAD_LENGTH]."""
    return not isinstance(value, bool) and isinstance(value, (int, np.integer)) and 0 <= value <= MAX_PAD_LENGTH


def _checked_slots(slot_table: Any, slots: Any, n: int) -> tuple[int, ...] | range | None:
    """``n`` keys' slots, normalised (see _normalise_slots), checked with their table."""
    if (slots is None) != (slot_table is None):
        raise ValueError("slots and slot_table are set together or not at all")
    if slots is None:
        return None
    if type(slot_table) is not int:
        raise TypeError(f"slot_table must be an int, got {type(slot_table).__name__}")
    return _normalise_slots(slots, n)


def _as_tuple(value: Any, what: str) -> tuple:
    """Normalise a list / tuple / numpy array / iterable to a tuple of Python objects."""
    if isinstance(value, tuple):
        return value
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{what} must be a sequence, not a {type(value).__name__}")
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got an array of shape {value.shape}")
        return tuple(value.tolist())
    if isinstance(value, Mapping):
        raise TypeError(f"{what} must be a sequence, not a mapping")
    if not isinstance(value, Iterable):
        raise TypeError(f"{what} must be a sequence, got {type(value).__name__}")
    return tuple(value)


def _first_duplicate(items: Sequence[Any]) -> Any:
    seen: set = set()
    for item in items:
        if item in seen:
            return item
        seen.add(item)
    return None  # pragma: no cover - only called when a duplicate exists


def _normalise_tag_values(name: str, values: Any, n: int) -> tuple:
    vals = _as_tuple(values, f"tag {name!r}")
    if len(vals) != n:
        raise ValueError(f"tag {name!r} has {len(vals)} values for {n} keys")
    types = set(map(type, vals))
    if not types <= _TAG_TYPES:
        if any(issubclass(t, np.generic) for t in types):
            vals = tuple(v.item() if isinstance(v, np.generic) else v for v in vals)
            types = set(map(type, vals))
        if not types <= _TAG_TYPES:
            for i, v in enumerate(vals):
                if type(v) not in _TAG_TYPES:
                    raise TypeError(
                        f"tag {name!r} value at index {i} has type {type(v).__name__}; tag values must be None, bool, int, float or str"
                    )
    if str in types:
        strs = vals if types == {str} else [v for v in vals if type(v) is str]
        if not "".join(strs).isascii():  # text the wire cannot carry, named by its index among all values
            for i, v in enumerate(vals):
                if type(v) is str:
                    check_utf8((v,), f"tag {name!r} value at index {i}")
        if max(map(len, strs)) > MAX_TAG_CHARS:
            i, v = next((i, v) for i, v in enumerate(vals) if type(v) is str and len(v) > MAX_TAG_CHARS)
            raise ValueError(
                f"tag {name!r} value at index {i} has {len(v)} characters, more than MAX_TAG_CHARS ({MAX_TAG_CHARS}): store text that long as a column"
            )
    if int in types:
        ints = vals if types <= {int, bool} else [v for v in vals if type(v) is int]
        if not TAG_INT_RANGE[0] <= min(ints) <= max(ints) <= TAG_INT_RANGE[1]:
            i, v = next((i, v) for i, v in enumerate(vals) if type(v) is int and not TAG_INT_RANGE[0] <= v <= TAG_INT_RANGE[1])
            raise ValueError(f"tag {name!r} value at index {i} ({v}) does not fit in 64 bits; int tags are in [-2**63, 2**64 - 1]")
    return vals


def _normalise_scalar_tag(name: str, value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    if type(value) not in _TAG_TYPES:
        raise TypeError(f"tag {name!r} scalar has type {type(value).__name__}; tag values must be None, bool, int, float or str")
    if type(value) is int and not TAG_INT_RANGE[0] <= value <= TAG_INT_RANGE[1]:
        raise ValueError(f"tag {name!r} scalar {value} does not fit in 64 bits; int tags are in [-2**63, 2**64 - 1]")
    if type(value) is str:
        check_utf8((value,), f"tag {name!r} scalar")
    if type(value) is str and len(value) > MAX_TAG_CHARS:
        raise ValueError(
            f"tag {name!r} scalar has {len(value)} characters, more than MAX_TAG_CHARS ({MAX_TAG_CHARS}): store text that long as a column"
        )
    return value


def _normalise_indices(indices: Any, n: int) -> list[int]:
    """Turn an int sequence / int array / boolean mask into a list of ints in [0, n)."""
    if isinstance(indices, (str, bytes, Mapping)):
        raise TypeError(f"indices must be a sequence of ints or a boolean mask, got {type(indices).__name__}")
    arr = np.asarray(indices)
    if arr.ndim != 1:
        if arr.size == 0:
            return []
        raise TypeError(f"indices must be 1-D, got shape {arr.shape}")
    if arr.dtype == np.bool_:
        if arr.shape[0] != n:
            raise IndexError(f"boolean mask has length {arr.shape[0]} but the meta has {n} keys")
        return np.flatnonzero(arr).tolist()
    if arr.size == 0:
        return []
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"indices must be integers or a boolean mask, got dtype {arr.dtype}")
    bad = (arr < 0) | (arr >= n)
    if bad.any():
        first = int(arr[int(np.argmax(bad))])
        raise IndexError(f"index {first} out of range for a meta with {n} keys")
    return arr.tolist()


@dataclass(frozen=True)
class KVBatchMeta:
    """Immutable handle for a batch of samples held in the data-plane service.

    Attributes:
        partition_id: storage partition holding the samples (e.g. ``"train@step12"``).
        keys: one storage key per sample; unique within a meta.
        fields: column names the handle promises (producer side) or asks for
            (consumer side); unique.
        sequence_lengths: unpadded length of each sample (ints >= 0), or ``None``.
        tags: columnar per-sample primitives, ``tag name -> tuple`` of
            ``len(keys)`` values, each ``None``/``bool``/``int``/``float``/``str``.
        extra_info: batch-level dict propagated unchanged to every derived
            meta (``select``, ``chunk``, shards, ...), e.g.
            ``global_forward_pad_seqlen`` or micro-batch plans.
        slot_table, slots: opaque storage handles set by the service on the
            metas it returns (the partition's slot-table incarnation and each
            key's slot), or ``None``. They follow the keys through every
            operation and let a reader on the service's host locate the rows
            without asking the controller; metas built by hand simply go the
            usual way. Not part of equality. Consecutive slots (a put's keys,
            a contiguous shard of them) are kept as a ``range``.

    Lists and numpy arrays passed to the constructor are normalised to tuples,
    dicts are copied, and everything is validated (``ValueError`` for wrong
    lengths / duplicates / negative lengths, ``TypeError`` for wrong types).
    All methods return new metas; instances are never mutated.  Instances are
    not hashable (they contain dicts).
    """

    partition_id: str
    keys: tuple[str, ...]
    fields: tuple[str, ...] = ()
    sequence_lengths: tuple[int, ...] | None = None
    tags: Mapping[str, tuple] = field(default_factory=dict)
    extra_info: Mapping[str, Any] = field(default_factory=dict)
    slot_table: int | None = field(default=None, compare=False)
    slots: tuple[int, ...] | range | None = field(default=None, compare=False)

    __hash__ = None  # type: ignore[assignment]

    def __getstate__(self) -> dict[str, Any]:
        """The fields, without what a client cached on this meta (``_key_fingerprints``, see
        ``TQClient``): derived from the keys, so neither compared nor pickled."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    # ------------------------------------------------------------------ init
    def __post_init__(self) -> None:
        set_ = object.__setattr__

        if not isinstance(self.partition_id, str):
            raise TypeError(f"partition_id must be a str, got {type(self.partition_id).__name__}")
        if type(self.partition_id) is not str:
            set_(self, "partition_id", str.__str__(self.partition_id))
        check_names((self.partition_id,), "partition_id")

        keys = _as_tuple(self.keys, "keys")
        if not set(map(type, keys)) <= {str}:
            keys = tuple(plain_strs(keys))
            for i, k in enumerate(keys):
                if not isinstance(k, str):
                    raise TypeError(f"key at index {i} has type {type(k).__name__}; keys must be str")
        n = len(keys)
        if len(set(keys)) != n:
            raise ValueError(f"duplicate key {_first_duplicate(keys)!r} in keys")
        check_names(keys, "key")
        set_(self, "keys", keys)

        fields = tuple(plain_strs(_as_tuple(self.fields, "fields")))
        for f in fields:
            if not isinstance(f, str):
                raise TypeError(f"field names must be str, got {type(f).__name__} ({f!r})")
        if len(set(fields)) != len(fields):
            raise ValueError(f"duplicate field {_first_duplicate(fields)!r} in fields")
        if len(fields) > MAX_FIELDS:
            raise ValueError(f"fields has {len(fields)} names, more than MAX_FIELDS ({MAX_FIELDS})")
        check_names(fields, "field")
        set_(self, "fields", fields)

        if self.sequence_lengths is not None:
            lens = _as_tuple(self.sequence_lengths, "sequence_lengths")
            if len(lens) != n:
                raise ValueError(f"sequence_lengths has {len(lens)} values for {n} keys")
            types = set(map(type, lens))
            if not types <= {int}:
                if any(issubclass(t, np.integer) for t in types):
                    lens = tuple(int(v) if isinstance(v, np.integer) else v for v in lens)
                for i, v in enumerate(lens):
                    if type(v) is not int:
                        raise TypeError(f"sequence_lengths value at index {i} (key {keys[i]!r}) has type {type(v).__name__}; expected int")
            if lens and min(lens) < 0:
                i = lens.index(min(lens))
                raise ValueError(f"sequence_lengths value {lens[i]} for key {keys[i]!r} is negative")
            if lens and max(lens) > MAX_PAD_LENGTH:
                i = lens.index(max(lens))
                raise ValueError(f"sequence_lengths value {lens[i]} for key {keys[i]!r} is more than {MAX_PAD_LENGTH} (MAX_PAD_LENGTH)")
            set_(self, "sequence_lengths", lens)

        if not isinstance(self.tags, Mapping):
            raise TypeError(f"tags must be a mapping, got {type(self.tags).__name__}")
        if len(self.tags) > MAX_TAG_NAMES:
            raise ValueError(
                f"tags has {len(self.tags)} names, more than MAX_TAG_NAMES ({MAX_TAG_NAMES}): a per-sample value belongs in a tag's values"
            )
        tags: dict[str, tuple] = {}
        for name, values in self.tags.items():
            if not isinstance(name, str):
                raise TypeError(f"tag names must be str, got {type(name).__name__} ({name!r})")
            name = str.__str__(name)
            check_names((name,), "tag name")
            tags[name] = _normalise_tag_values(name, values, n)
        set_(self, "tags", tags)

        if not isinstance(self.extra_info, Mapping):
            raise TypeError(f"extra_info must be a mapping, got {type(self.extra_info).__name__}")
        set_(self, "extra_info", dict(self.extra_info))

        set_(self, "slots", _checked_slots(self.slot_table, self.slots, n))

    # ------------------------------------------------------------ basic info
    @property
    def size(self) -> int:
        """Number of samples (keys) in the batch."""
        return len(self.keys)

    def __len__(self) -> int:
        """Number of samples (keys) in the batch."""
        return len(self.keys)

    @property
    def total_tokens(self) -> int:
        """Sum of ``sequence_lengths``; ``ValueError`` if they are unknown (``None``)."""
        if self.sequence_lengths is None:
            raise ValueError("total_tokens requires sequence_lengths, but they are None")
        return sum(self.sequence_lengths)

    # --------------------------------------------------------------- subsets
    def _take(self, idx: list[int]) -> KVBatchMeta:
        keys = self.keys
        lens = self.sequence_lengths
        return KVBatchMeta(
            partition_id=self.partition_id,
            keys=tuple([keys[i] for i in idx]),
            fields=self.fields,
            sequence_lengths=None if lens is None else tuple([lens[i] for i in idx]),
            tags={name: tuple([vals[i] for i in idx]) for name, vals in self.tags.items()},
            extra_info=self.extra_info,
            slot_table=self.slot_table,
            slots=None if self.slots is None else tuple([self.slots[i] for i in idx]),
        )

    def select(self, indices: Sequence[int] | Sequence[bool] | np.ndarray) -> KVBatchMeta:
        """Return the samples at ``indices``, in the order given.

        ``indices`` is a sequence / numpy array of ints in ``[0, len(self))``
        (negative indices are rejected) or a boolean mask of length
        ``len(self)``.  Keys, sequence lengths and every tag are subset
        together.  Raises ``IndexError`` for an out-of-range index or a mask of
        the wrong length, ``ValueError`` if an index repeats (keys must stay
        unique).
        """
        return self._take(_normalise_indices(indices, len(self.keys)))

    def _key_positions(self, keys: Iterable[str]) -> list[int]:
        if isinstance(keys, str):
            keys = [keys]
        pos = {k: i for i, k in enumerate(self.keys)}
        out = []
        for k in keys:
            i = pos.get(k)
            if i is None:
                raise KeyError(f"unknown key {k!r} (not in meta of partition {self.partition_id!r})")
            out.append(i)
        return out

    def select_keys(self, keys: Iterable[str]) -> KVBatchMeta:
        """Return the samples named by ``keys``, in the order given.

        Raises ``KeyError`` naming the first key not in this meta.
        """
        return self._take(self._key_positions(keys))

    def slice(self, start: int | None, stop: int | None = None) -> KVBatchMeta:
        """Return the contiguous samples ``[start:stop]`` (Python slice semantics)."""
        s = slice(start, stop)
        lens = self.sequence_lengths
        return KVBatchMeta(
            partition_id=self.partition_id,
            keys=self.keys[s],
            fields=self.fields,
            sequence_lengths=None if lens is None else lens[s],
            tags={name: vals[s] for name, vals in self.tags.items()},
            extra_info=self.extra_info,
            slot_table=self.slot_table,
            slots=None if self.slots is None else self.slots[s],
        )

    def drop(self, keys: Iterable[str]) -> KVBatchMeta:
        """Return this meta without ``keys``; remaining order is preserved.

        Raises ``KeyError`` naming the first key not in this meta.
        """
        removed = set(self._key_positions(keys))
        return self._take([i for i in range(len(self.keys)) if i not in removed])

    def chunk(self, n: int) -> list[KVBatchMeta]:
        """Split into ``n`` contiguous pieces whose sizes differ by at most 1.

        Like ``numpy.array_split``: the first ``len(self) % n`` pieces get one
        extra sample.  ``n`` must be in ``1..len(self)`` (``ValueError``
        otherwise), so no piece is empty.
        """
        total = len(self.keys)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"chunk count must be an int, got {type(n).__name__}")
        n = int(n)
        if not 1 <= n <= total:
            raise ValueError(f"cannot split {total} samples into {n} chunks (need 1 <= n <= {total})")
        base, rem = divmod(total, n)
        out = []
        start = 0
        for i in range(n):
            stop = start + base + (1 if i < rem else 0)
            out.append(self.slice(start, stop))
            start = stop
        return out

    # --------------------------------------------------------------- combine
    @staticmethod
    def concat(metas: Sequence[KVBatchMeta]) -> KVBatchMeta:
        """Concatenate metas of one partition into a single meta.

        All metas must share ``partition_id``, the same ``fields`` set and the
        same tag names (``ValueError`` naming the mismatch); keys must stay
        unique.  Fields order and ``extra_info`` come from the first meta;
        ``sequence_lengths`` are concatenated, or ``None`` if any is ``None``.
        """
        metas = list(metas)
        if not metas:
            raise ValueError("concat needs at least one meta")
        for m in metas:
            if not isinstance(m, KVBatchMeta):
                raise TypeError(f"concat expects KVBatchMeta instances, got {type(m).__name__}")
        first = metas[0]
        field_set = set(first.fields)
        tag_names = set(first.tags)
        for i, m in enumerate(metas[1:], start=1):
            if m.partition_id != first.partition_id:
                raise ValueError(
                    f"cannot concat metas of different partitions: {first.partition_id!r} (meta 0) and {m.partition_id!r} (meta {i})"
                )
            if set(m.fields) != field_set:
                raise ValueError(
                    f"cannot concat metas with different fields: {sorted(field_set)} (meta 0) and {sorted(m.fields)} (meta {i})"
                )
            if set(m.tags) != tag_names:
                raise ValueError(f"cannot concat metas with different tags: {sorted(tag_names)} (meta 0) and {sorted(m.tags)} (meta {i})")
        keys: tuple[str, ...] = tuple(k for m in metas for k in m.keys)
        if any(m.sequence_lengths is None for m in metas):
            lens = None
        else:
            lens = tuple(v for m in metas for v in m.sequence_lengths)  # type: ignore[union-attr]
        tags = {name: tuple(v for m in metas for v in m.tags[name]) for name in first.tags}
        # slots only mean something within one slot-table incarnation
        same_table = first.slots is not None and all(m.slot_table == first.slot_table and m.slots is not None for m in metas)
        return KVBatchMeta(
            partition_id=first.partition_id,
            keys=keys,
            fields=first.fields,
            sequence_lengths=lens,
            tags=tags,
            extra_info=first.extra_info,
            slot_table=first.slot_table if same_table else None,
            slots=tuple(s for m in metas for s in m.slots) if same_table else None,  # type: ignore[union-attr]
        )

    # ------------------------------------------------------ field / tag edits
    def with_slots(self, slot_table: int | None, slots: Any) -> KVBatchMeta:
        """This meta with its keys' slots in ``slot_table`` (what a write's reply names; None, None:
        none). Only the slots are checked: the rest was when this meta was made (a put checks its
        meta before it stores anything, then adds the slots)."""
        new = object.__new__(type(self))  # not __init__: nothing else is checked again
        new.__dict__.update(self.__dict__, slot_table=slot_table, slots=_checked_slots(slot_table, slots, len(self.keys)))
        return new

    def _replace(self, **changes: Any) -> KVBatchMeta:
        values = {
            "partition_id": self.partition_id,
            "keys": self.keys,
            "fields": self.fields,
            "sequence_lengths": self.sequence_lengths,
            "tags": self.tags,
            "extra_info": self.extra_info,
            "slot_table": self.slot_table,
            "slots": self.slots,
        }
        values.update(changes)
        return KVBatchMeta(**values)

    def with_fields(self, fields: Iterable[str]) -> KVBatchMeta:
        """Return a meta whose ``fields`` are replaced by ``fields``."""
        return self._replace(fields=_as_tuple(fields, "fields"))

    def add_fields(self, fields: Iterable[str]) -> KVBatchMeta:
        """Return a meta whose ``fields`` are the ordered union of the current ones and ``fields``."""
        new = list(self.fields)
        seen = set(new)
        for f in _as_tuple(fields, "fields"):
            if f not in seen:
                seen.add(f)
                new.append(f)
        return self._replace(fields=tuple(new))

    def stamp_tags(self, **tags: Any) -> KVBatchMeta:
        """Return a meta with ``tags`` added or overwritten.

        Each value is either a scalar primitive (``None``/``bool``/``int``/
        ``float``/``str``), broadcast to every key, or a sequence of
        ``len(self)`` primitives.
        """
        n = len(self.keys)
        new = dict(self.tags)
        for name, value in tags.items():
            if isinstance(value, str) or value is None or isinstance(value, (bool, int, float, np.generic)):
                new[name] = (_normalise_scalar_tag(name, value),) * n
            else:
                new[name] = _normalise_tag_values(name, value, n)
        return self._replace(tags=new)

    def pad_length(self, longest: int, pad_to: int | None = None) -> int:
        """The padded length of a jagged field of this batch whose longest row has ``longest`` entries:
        ``pad_to``, else ``extra_info["global_forward_pad_seqlen"]``, else ``longest``, rounded up to
        ``extra_info["pad_to_multiple"]`` - what a padded get pads to, wherever the padding is done."""
        target = pad_to if pad_to is not None else self.extra_info.get("global_forward_pad_seqlen")
        target = longest if target is None else target
        multiple = self.extra_info.get("pad_to_multiple")
        for name, value in (
            ("the pad length (pad_to, or extra_info['global_forward_pad_seqlen'])", target),
            ("extra_info['pad_to_multiple']", multiple),
        ):
            if value is not None and not is_pad_length(value):
                raise ValueError(f"{name} must be a whole number in [0, {MAX_PAD_LENGTH}], got {value!r}")
        return -(-target // multiple) * multiple if multiple else target

    def with_extra_info(self, **kv: Any) -> KVBatchMeta:
        """Return a meta whose ``extra_info`` is the current one updated with ``kv``."""
        return self._replace(extra_info={**self.extra_info, **kv})

    # ---------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain-Python dict (lists instead of tuples) suitable for msgpack / JSON."""
        return {
            "partition_id": self.partition_id,
            "keys": list(self.keys),
            "fields": list(self.fields),
            "sequence_lengths": None if self.sequence_lengths is None else list(self.sequence_lengths),
            "tags": {name: list(vals) for name, vals in self.tags.items()},
            "extra_info": dict(self.extra_info),
            **({} if self.slots is None else {"slot_table": self.slot_table, "slots": list(self.slots)}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVBatchMeta:
        """Inverse of :meth:`to_dict`; ``partition_id`` and ``keys`` are required."""
        missing = [k for k in ("partition_id", "keys") if k not in d]
        if missing:
            raise ValueError(f"meta dict is missing required entries: {missing}")
        return cls(
            partition_id=d["partition_id"],
            keys=d["keys"],
            fields=d.get("fields") or (),
            sequence_lengths=d.get("sequence_lengths"),
            tags=d.get("tags") or {},
            extra_info=d.get("extra_info") or {},
            slot_table=d.get("slot_table"),
            slots=d.get("slots"),
        )

    def to_msgpack(self) -> bytes:
        """Serialise with msgpack (``use_bin_type=True``).

        ``extra_info`` must be msgpack-serialisable; otherwise ``TypeError``
        names the offending key.  Note tuples inside ``extra_info`` come back
        as lists.
        """
        d = self.to_dict()
        try:
            return msgpack.packb(d, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            for k, v in self.extra_info.items():
                try:
                    msgpack.packb({k: v}, use_bin_type=True)
                except (TypeError, ValueError, OverflowError) as item_exc:
                    raise TypeError(f"extra_info[{k!r}] (type {type(v).__name__}) is not msgpack-serialisable: {item_exc}") from item_exc
            raise TypeError(f"meta is not msgpack-serialisable: {exc}") from exc

    @classmethod
    def from_msgpack(cls, data: bytes) -> KVBatchMeta:
        """Inverse of :meth:`to_msgpack`."""
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
        if not isinstance(d, Mapping):
            raise ValueError(f"msgpack payload is a {type(d).__name__}, expected a map")
        return cls.from_dict(d)
