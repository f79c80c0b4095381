"""Tests for tq.meta.KVBatchMeta."""

from __future__ import annotations

import pickle

import dataclasses

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tq.meta import KVBatchMeta


def make_meta(n: int = 6, *, partition: str = "train@0", lens: bool = True, **extra) -> KVBatchMeta:
    return KVBatchMeta(
        partition_id=partition,
        keys=[f"k{i}" for i in range(n)],
        fields=["input_ids", "logprobs"],
        sequence_lengths=[10 * (i + 1) for i in range(n)] if lens else None,
        tags={"group_id": [i // 2 for i in range(n)], "src": [f"s{i}" for i in range(n)]},
        extra_info={"global_forward_pad_seqlen": 128, **extra},
    )


def assert_consistent(sub: KVBatchMeta, orig: KVBatchMeta) -> None:
    """Every per-sample column of ``sub`` matches ``orig`` for the same key."""
    pos = {k: i for i, k in enumerate(orig.keys)}
    idx = [pos[k] for k in sub.keys]
    if orig.sequence_lengths is None:
        assert sub.sequence_lengths is None
    else:
        assert sub.sequence_lengths == tuple(orig.sequence_lengths[i] for i in idx)
    assert set(sub.tags) == set(orig.tags)
    for name, vals in orig.tags.items():
        assert sub.tags[name] == tuple(vals[i] for i in idx)
    assert sub.partition_id == orig.partition_id
    assert sub.fields == orig.fields
    assert sub.extra_info == orig.extra_info


# --------------------------------------------------------------- construction
def test_construction_normalises_to_tuples_and_copies_dicts():
    tags = {"group_id": [0, 0, 1]}
    extra = {"pad_to_multiple": 8}
    m = KVBatchMeta("p", ["a", "b", "c"], ["f"], np.array([1, 2, 3]), tags, extra)
    assert m.keys == ("a", "b", "c")
    assert m.fields == ("f",)
    assert m.sequence_lengths == (1, 2, 3)
    assert all(type(v) is int for v in m.sequence_lengths)
    assert m.tags == {"group_id": (0, 0, 1)}
    tags["group_id"].append(5)
    tags["new"] = [1, 2, 3]
    extra["x"] = 1
    assert m.tags == {"group_id": (0, 0, 1)}
    assert m.extra_info == {"pad_to_multiple": 8}
    assert len(m) == m.size == 3


def test_defaults():
    m = KVBatchMeta("p", ["a"])
    assert m.fields == () and m.sequence_lengths is None and m.tags == {} and m.extra_info == {}
    # default dicts are not shared between instances
    assert KVBatchMeta("p", ["b"]).tags is not m.tags


def test_numpy_tag_values_become_python_primitives():
    m = KVBatchMeta("p", ["a", "b"], tags={"x": np.array([1, 2]), "y": [np.float32(0.5), None]})
    assert m.tags["x"] == (1, 2) and all(type(v) is int for v in m.tags["x"])
    assert m.tags["y"] == (0.5, None) and type(m.tags["y"][0]) is float


def test_duplicate_keys_rejected():
    with pytest.raises(ValueError, match="duplicate key 'b'"):
        KVBatchMeta("p", ["a", "b", "c", "b"])


def test_duplicate_fields_rejected():
    with pytest.raises(ValueError, match="duplicate field 'f'"):
        KVBatchMeta("p", ["a"], fields=["f", "g", "f"])


def test_wrong_tag_length_rejected():
    with pytest.raises(ValueError, match="tag 'group_id' has 3 values for 4 keys"):
        KVBatchMeta("p", ["a", "b", "c", "d"], tags={"group_id": [0, 0, 1]})


def test_wrong_sequence_length_count_rejected():
    with pytest.raises(ValueError, match="sequence_lengths has 2 values for 3 keys"):
        KVBatchMeta("p", ["a", "b", "c"], sequence_lengths=[1, 2])


def test_negative_sequence_length_rejected():
    with pytest.raises(ValueError, match="-1 for key 'b' is negative"):
        KVBatchMeta("p", ["a", "b"], sequence_lengths=[1, -1])


def test_non_int_sequence_length_rejected():
    with pytest.raises(TypeError, match="key 'b'.*float"):
        KVBatchMeta("p", ["a", "b"], sequence_lengths=[1, 2.0])


@pytest.mark.parametrize("bad", [[1, 2], {"x": 1}, b"raw", object()])
def test_bad_tag_value_type_rejected(bad):
    with pytest.raises(TypeError, match="tag 'bad' value at index 1 has type"):
        KVBatchMeta("p", ["a", "b"], tags={"bad": [1, bad]})


def test_bad_key_and_partition_types_rejected():
    with pytest.raises(TypeError, match="key at index 1"):
        KVBatchMeta("p", ["a", 2])
    with pytest.raises(TypeError, match="partition_id"):
        KVBatchMeta(3, ["a"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="keys must be a sequence"):
        KVBatchMeta("p", "abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tag 't' must be a sequence"):
        KVBatchMeta("p", ["a", "b"], tags={"t": "xy"})


def test_names_are_1_to_max_name_chars_characters():
    """A key, partition id, field or tag name that is empty or over MAX_NAME_CHARS is refused naming
    which one and its length (a prompt passed as a key would otherwise be journaled and held per key);
    the bound itself is a name."""
    from tq.meta import MAX_NAME_CHARS

    ok = "k" * MAX_NAME_CHARS
    meta = KVBatchMeta(ok, ["a", ok], [ok], tags={ok: [1, 2]})
    assert meta.keys[1] == meta.partition_id == meta.fields[0] == ok
    long = ok + "k"
    for args, kwargs, match in [
        (("p", ["a", ""]), {}, "key at index 1 '' has 0 characters; a name has 1 to 1024"),
        (("p", ["a", long]), {}, "key at index 1 'kkkkkkkkkkkk...kkkkkkkkkkkkk' has 1025 characters"),
        ((long, ["a"]), {}, "partition_id 'kkk.*' has 1025 characters"),
        (("", ["a"]), {}, "partition_id '' has 0 characters"),
        (("p", ["a"], [long]), {}, "field 'kkk.*' has 1025 characters"),
        (("p", ["a"]), {"tags": {"": [1]}}, "tag name '' has 0 characters"),
    ]:
        with pytest.raises(ValueError, match=match):
            KVBatchMeta(*args, **kwargs)
    with pytest.raises(ValueError, match="tag name '' has 0"):
        meta.stamp_tags(**{"": 1})


def test_int_tags_must_fit_in_64_bits():
    """msgpack (the wire, the journal) carries ints in [-2**63, 2**64 - 1]: a tag outside is refused
    by the meta naming it, not by msgpack's OverflowError at the put."""
    edge = KVBatchMeta("p", ["a", "b", "c"], tags={"t": [-(2**63), 2**64 - 1, None]})
    assert msgpack.unpackb(msgpack.packb(edge.tags["t"])) == [-(2**63), 2**64 - 1, None]
    with pytest.raises(ValueError, match=r"tag 't' value at index 1 \(18446744073709551616\) does not fit in 64 bits"):
        KVBatchMeta("p", ["a", "b"], tags={"t": [1, 2**64]})
    with pytest.raises(ValueError, match=r"tag 't' value at index 2 .* does not fit"):
        KVBatchMeta("p", ["a", "b", "c"], tags={"t": ["x", None, -(2**63) - 1]})
    with pytest.raises(ValueError, match="tag 'u' scalar 18446744073709551616 does not fit"):
        edge.stamp_tags(u=2**64)


def test_frozen():
    m = make_meta()
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.keys = ("x",)  # type: ignore[misc]


# -------------------------------------------------------------------- methods
def test_select_int_list_keeps_given_order():
    m = make_meta()
    s = m.select([4, 0, 2])
    assert s.keys == ("k4", "k0", "k2")
    assert_consistent(s, m)


def test_select_numpy_int_array():
    m = make_meta()
    s = m.select(np.array([5, 1], dtype=np.int32))
    assert s.keys == ("k5", "k1")
    assert_consistent(s, m)


@pytest.mark.parametrize("as_array", [False, True])
def test_select_boolean_mask(as_array):
    m = make_meta()
    mask = [True, False, False, True, True, False]
    s = m.select(np.array(mask) if as_array else mask)
    assert s.keys == ("k0", "k3", "k4")
    assert_consistent(s, m)


def test_select_empty():
    m = make_meta()
    s = m.select([])
    assert len(s) == 0 and s.sequence_lengths == () and s.tags == {"group_id": (), "src": ()}


@pytest.mark.parametrize("bad", [[0, 6], [-1], np.array([7])])
def test_select_out_of_range(bad):
    with pytest.raises(IndexError, match="out of range"):
        make_meta().select(bad)


def test_select_mask_wrong_length():
    with pytest.raises(IndexError, match="mask has length 2"):
        make_meta().select([True, False])


def test_select_repeated_index_rejected():
    with pytest.raises(ValueError, match="duplicate key 'k1'"):
        make_meta().select([1, 1])


def test_select_keys():
    m = make_meta()
    s = m.select_keys(["k3", "k1"])
    assert s.keys == ("k3", "k1")
    assert_consistent(s, m)
    with pytest.raises(KeyError, match="nope"):
        m.select_keys(["k1", "nope", "nope2"])


def test_slice():
    m = make_meta()
    s = m.slice(1, 4)
    assert s.keys == ("k1", "k2", "k3")
    assert_consistent(s, m)
    assert m.slice(4).keys == ("k4", "k5")


def test_drop():
    m = make_meta()
    d = m.drop(["k0", "k4"])
    assert d.keys == ("k1", "k2", "k3", "k5")
    assert_consistent(d, m)
    with pytest.raises(KeyError, match="'zz'"):
        m.drop(["k1", "zz"])


@pytest.mark.parametrize("n,k", [(6, 1), (6, 4), (6, 6), (7, 3), (10, 4)])
def test_chunk_sizes_like_array_split(n, k):
    m = make_meta(n)
    chunks = m.chunk(k)
    assert [len(c) for c in chunks] == [len(a) for a in np.array_split(np.arange(n), k)]
    assert sum((c.keys for c in chunks), ()) == m.keys
    for c in chunks:
        assert_consistent(c, m)


@pytest.mark.parametrize("k", [0, 7, -1])
def test_chunk_invalid(k):
    with pytest.raises(ValueError, match="chunks"):
        make_meta(6).chunk(k)


def test_concat_of_chunks_equals_original():
    m = make_meta(7)
    assert KVBatchMeta.concat(m.chunk(3)) == m


def test_concat_rules():
    m = make_meta(6)
    a, b = m.chunk(2)
    b2 = b.with_extra_info(other=1)
    c = KVBatchMeta.concat([a, b2])
    assert c.extra_info == a.extra_info  # from the first
    # sequence_lengths None if any is None
    b_nolen = dataclasses.replace(b, sequence_lengths=None)
    assert KVBatchMeta.concat([a, b_nolen]).sequence_lengths is None
    # fields: same set required, first order kept
    b_swapped = b.with_fields(list(reversed(b.fields)))
    assert KVBatchMeta.concat([a, b_swapped]).fields == a.fields
    with pytest.raises(ValueError, match="different fields"):
        KVBatchMeta.concat([a, b.add_fields(["extra"])])
    with pytest.raises(ValueError, match="different tags"):
        KVBatchMeta.concat([a, b.stamp_tags(more=1)])
    other = dataclasses.replace(b, partition_id="val@0")
    with pytest.raises(ValueError, match="'train@0'.*'val@0'"):
        KVBatchMeta.concat([a, other])
    with pytest.raises(ValueError, match="duplicate key"):
        KVBatchMeta.concat([a, a])
    with pytest.raises(ValueError, match="at least one"):
        KVBatchMeta.concat([])


def test_with_fields_and_add_fields():
    m = make_meta()
    assert m.with_fields(["x"]).fields == ("x",)
    assert m.add_fields(["rewards", "input_ids", "adv"]).fields == (
        "input_ids",
        "logprobs",
        "rewards",
        "adv",
    )
    with pytest.raises(ValueError, match="duplicate field"):
        m.with_fields(["x", "x"])


def test_stamp_tags_scalar_and_sequence():
    m = make_meta(3)
    s = m.stamp_tags(step=7, policy="v1", group_id=[9, 8, 7], mask=np.array([True, False, True]))
    assert s.tags["step"] == (7, 7, 7)
    assert s.tags["policy"] == ("v1",) * 3
    assert s.tags["group_id"] == (9, 8, 7)  # overwritten
    assert s.tags["mask"] == (True, False, True)
    assert s.tags["src"] == m.tags["src"]  # kept
    assert m.stamp_tags(none=None).tags["none"] == (None, None, None)
    with pytest.raises(ValueError, match="tag 'x' has 2 values for 3 keys"):
        m.stamp_tags(x=[1, 2])
    with pytest.raises(TypeError, match="tag 'x'"):
        m.stamp_tags(x=object())


def test_with_extra_info_merges():
    m = make_meta()
    e = m.with_extra_info(pad_to_multiple=64, global_forward_pad_seqlen=256)
    assert e.extra_info == {"global_forward_pad_seqlen": 256, "pad_to_multiple": 64}


def test_extra_info_propagates_to_derived_metas():
    m = make_meta(6, micro_batches=[[0, 1]])
    for d in [
        m.select([1, 2]),
        m.select_keys(["k0"]),
        m.slice(0, 2),
        m.drop(["k1"]),
        *m.chunk(3),
        m.with_fields(["a"]),
        m.add_fields(["z"]),
        m.stamp_tags(t=1),
    ]:
        assert d.extra_info == m.extra_info


def test_total_tokens():
    m = make_meta(4)
    assert m.total_tokens == 10 + 20 + 30 + 40
    with pytest.raises(ValueError, match="sequence_lengths"):
        make_meta(4, lens=False).total_tokens


def test_not_hashable():
    with pytest.raises(TypeError):
        hash(make_meta())


# --------------------------------------------------------------- immutability
def test_operations_do_not_mutate_original():
    m = make_meta(6, plan=[[0, 1], [2]])
    snapshot = m.to_dict()
    m.select([0, 1])
    m.select_keys(["k2"])
    m.slice(1, 3)
    m.drop(["k0"])
    m.chunk(3)
    m.with_fields(["x"])
    m.add_fields(["y"])
    m.stamp_tags(group_id=0, new="a")
    m.with_extra_info(global_forward_pad_seqlen=1, z=2)
    KVBatchMeta.concat(m.chunk(2))
    m.to_msgpack()
    assert m.to_dict() == snapshot


# -------------------------------------------------------------- serialisation
def test_to_dict_is_plain_python():
    d = make_meta(3).to_dict()
    assert d == {
        "partition_id": "train@0",
        "keys": ["k0", "k1", "k2"],
        "fields": ["input_ids", "logprobs"],
        "sequence_lengths": [10, 20, 30],
        "tags": {"group_id": [0, 0, 1], "src": ["s0", "s1", "s2"]},
        "extra_info": {"global_forward_pad_seqlen": 128},
    }
    assert KVBatchMeta.from_dict(d) == make_meta(3)


def test_from_dict_missing_required():
    with pytest.raises(ValueError, match="keys"):
        KVBatchMeta.from_dict({"partition_id": "p"})


def test_msgpack_round_trip():
    m = make_meta(5, micro_batches=[[0, 2], [1], [3, 4]], mode="packed", nested={"a": [1.5, None]})
    m = m.stamp_tags(score=[0.5, -1.0, None, 2.0, 3.25], ok=True)
    data = m.to_msgpack()
    assert isinstance(data, bytes)
    assert KVBatchMeta.from_msgpack(data) == m
    # the payload is plain msgpack a non-Python consumer can read
    raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    assert raw["keys"] == list(m.keys)


def test_msgpack_round_trip_no_lengths_no_tags():
    m = KVBatchMeta("p", ["a", "b"])
    assert KVBatchMeta.from_msgpack(m.to_msgpack()) == m


def test_msgpack_rejects_unserialisable_extra_info_naming_key():
    m = make_meta(2).with_extra_info(bad_entry=object())
    with pytest.raises(TypeError, match="bad_entry"):
        m.to_msgpack()


tag_value = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=5),
)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 30),
    data=st.data(),
)
def test_msgpack_and_chunk_concat_properties(n, data):
    keys = data.draw(st.lists(st.text(min_size=1, max_size=8), min_size=n, max_size=n, unique=True))
    lens = data.draw(st.none() | st.lists(st.integers(0, 10_000), min_size=n, max_size=n))
    ntags = data.draw(st.integers(0, 3))
    tags = {f"t{j}": data.draw(st.lists(tag_value, min_size=n, max_size=n)) for j in range(ntags)}
    m = KVBatchMeta("part", keys, ["f1", "f2"], lens, tags, {"x": 1})
    assert KVBatchMeta.from_msgpack(m.to_msgpack()) == m
    assert KVBatchMeta.from_dict(m.to_dict()) == m
    if n:
        k = data.draw(st.integers(1, n))
        chunks = m.chunk(k)
        assert max(map(len, chunks)) - min(map(len, chunks)) <= 1
        assert KVBatchMeta.concat(chunks) == m
        mask = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
        sel = m.select(mask)
        assert sel.keys == tuple(key for key, b in zip(keys, mask) if b)
        assert_consistent(sel, m)
        perm = data.draw(st.permutations(range(n)))
        assert m.select(np.array(perm)).select_keys(keys) == m


def test_construction_of_large_meta_is_cheap():
    # smoke test only (no timing assertion): 10k keys with a few tags
    n = 10_000
    m = KVBatchMeta(
        "p",
        [f"k{i}" for i in range(n)],
        ["a"],
        list(range(n)),
        {"g": list(range(n)), "s": ["x"] * n, "f": [0.5] * n},
    )
    assert len(m.chunk(8)) == 8 and m.total_tokens == n * (n - 1) // 2


# ----------------------------------------------------------------------------- storage slots
def test_slots_follow_the_keys_through_every_operation():
    m = KVBatchMeta("p", ["a", "b", "c", "d"], ["x"], [1, 2, 3, 4], slot_table=99, slots=[10, 11, 12, 13])
    assert m.select([2, 0]).slots == (12, 10)
    assert m.slice(1, 3).slots == range(11, 13)  # consecutive slots are kept as a range
    assert m.drop(["b"]).slots == (10, 12, 13)
    assert [c.slots for c in m.chunk(2)] == [range(10, 12), range(12, 14)]
    assert KVBatchMeta.concat(m.chunk(2)).slots == m.slots == range(10, 14)
    assert m.with_fields(["y"]).stamp_tags(w=1).slots == m.slots
    back = KVBatchMeta.from_msgpack(m.to_msgpack())
    assert (back.slot_table, back.slots) == (99, m.slots)
    assert m == KVBatchMeta("p", ["a", "b", "c", "d"], ["x"], [1, 2, 3, 4])  # not part of equality


def test_consecutive_slots_are_a_range_and_pickle_as_one():
    """A put's keys get consecutive slots: the meta keeps them as a range (three ints however many
    keys - what a same-host reader checks, and what a meta sent to a rank pickles), others as a tuple."""
    n = 10_000
    m = KVBatchMeta("p", [f"k{i}" for i in range(n)], slot_table=1, slots=list(range(7, 7 + n)))
    assert m.slots == range(7, 7 + n) and m.select([0, 2]).slots == (7, 9) and m.slice(5, 9).slots == range(12, 16)
    listed = KVBatchMeta("p", m.keys, slot_table=1, slots=[*range(8, 7 + n), 7])  # one slot out of order
    assert isinstance(listed.slots, tuple)
    assert len(pickle.dumps(listed)) - len(pickle.dumps(m)) > 2 * n  # the range pickles as its ends
    assert KVBatchMeta.from_dict(m.to_dict()).slots == m.slots


def test_what_a_client_caches_on_a_meta_is_neither_pickled_nor_copied_nor_compared():
    """A same-host client keeps a meta's key fingerprints on it (``_key_fingerprints``): derived from
    the keys, so a pickle sent to a rank (or a copy) leaves it out - 8 bytes a key more to every rank
    otherwise - and equality ignores it."""
    import copy

    import numpy as np

    m = KVBatchMeta("p", [f"k{i}" for i in range(1000)], slot_table=1, slots=range(1000))
    plain = pickle.dumps(m)
    object.__setattr__(m, "_key_fingerprints", np.arange(1000, dtype=np.int64))
    assert pickle.dumps(m) == plain and "_key_fingerprints" not in pickle.loads(plain).__dict__
    assert "_key_fingerprints" not in copy.deepcopy(m).__dict__ and "_key_fingerprints" not in copy.copy(m).__dict__
    assert m == pickle.loads(plain) and pickle.loads(plain).slots == range(1000)


def test_concat_across_slot_tables_drops_the_slots():
    a = KVBatchMeta("p", ["a"], slot_table=1, slots=[0])
    b = KVBatchMeta("p", ["b"], slot_table=2, slots=[0])
    c = KVBatchMeta("p", ["c"])
    assert KVBatchMeta.concat([a, b]).slots is None and KVBatchMeta.concat([a, c]).slot_table is None
    assert KVBatchMeta.concat([a, KVBatchMeta("p", ["d"], slot_table=1, slots=[5])]).slots == (0, 5)


@pytest.mark.parametrize(
    "kwargs, err",
    [
        ({"slots": [0, 1]}, ValueError),  # no slot_table
        ({"slot_table": 1}, ValueError),  # no slots
        ({"slot_table": 1, "slots": [0]}, ValueError),  # one slot for two keys
        ({"slot_table": 1, "slots": [0, -1]}, TypeError),
        ({"slot_table": 1, "slots": [0, 1.0]}, TypeError),
        ({"slot_table": "1", "slots": [0, 1]}, TypeError),
    ],
)
def test_bad_slots_are_rejected(kwargs, err):
    with pytest.raises(err):
        KVBatchMeta("p", ["a", "b"], **kwargs)


def test_pad_length_is_pad_to_else_the_global_length_else_the_longest_rounded_up():
    m = KVBatchMeta("p", ("a", "b"))
    assert m.pad_length(13) == 13
    assert m.pad_length(13, pad_to=20) == 20
    g = m.with_extra_info(global_forward_pad_seqlen=30)
    assert g.pad_length(13) == 30 and g.pad_length(13, pad_to=16) == 16  # an explicit pad_to wins
    r = g.with_extra_info(pad_to_multiple=8)
    assert r.pad_length(13) == 32 and r.pad_length(13, pad_to=16) == 16
    assert m.with_extra_info(pad_to_multiple=8).pad_length(13) == 16


@pytest.mark.parametrize(
    "extra, what",
    [
        ({"global_forward_pad_seqlen": "x"}, "the pad length"),
        ({"global_forward_pad_seqlen": -4}, "the pad length"),
        ({"global_forward_pad_seqlen": 1 << 40}, "the pad length"),
        ({"pad_to_multiple": 2.5}, "pad_to_multiple"),
        ({"pad_to_multiple": True}, "pad_to_multiple"),
    ],
    ids=str,
)
def test_a_bad_pad_length_in_extra_info_is_a_value_error_naming_it(extra, what):
    """A string was a TypeError from a comparison, a float padded to a fraction."""
    with pytest.raises(ValueError, match=rf"{what}.*must be a whole number in \[0, 2147483648\]"):
        KVBatchMeta("p", ("a",)).with_extra_info(**extra).pad_length(13)


def test_with_slots_adds_the_slots_and_keeps_the_rest():
    m = KVBatchMeta("p", ("a", "b"), ("x",), (3, 4), {"t": (1, 2)}).with_extra_info(z=1)
    s = m.with_slots(7, [5, 6])
    assert (s.slot_table, s.slots) == (7, range(5, 7)) and s == m._replace(slot_table=7, slots=(5, 6))
    assert m.slots is None  # the original is unchanged
    with pytest.raises(ValueError, match="slots"):
        m.with_slots(7, [5])
    with pytest.raises(ValueError, match="together"):
        m.with_slots(None, [5, 6])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(partition_id="p\udcff", keys=["a"]), r"partition_id 'p\\udcff' is not valid UTF-8 text"),
        (dict(keys=["ok", "b\ud800"]), r"key at index 1 'b\\ud800' is not valid UTF-8 text \(surrogates not allowed"),
        (dict(keys=["a"], fields=["f\ud800"]), r"field 'f\\ud800' is not valid UTF-8"),
        (dict(keys=["a"], tags={"t\ud800": [1]}), r"tag name 't\\ud800' is not valid UTF-8"),
        (dict(keys=["a", "b"], tags={"t": [1, "x\udcff"]}), r"tag 't' value at index 1 'x\\udcff' is not valid UTF-8"),
    ],
)
def test_text_utf8_cannot_encode_is_refused_naming_it(kwargs, match):
    """The wire and the journal carry UTF-8: a lone surrogate (os.fsdecode's for a bad file name) is
    refused when the meta is built - a put's meta is built before it stores a byte."""
    kwargs = {"partition_id": "p", **kwargs}
    with pytest.raises(ValueError, match=match):
        KVBatchMeta(**kwargs)
    m = KVBatchMeta("p", ["a"], tags={"t": ["x"]})
    with pytest.raises(ValueError, match=r"tag 'u' scalar 'y\\ud800' is not valid UTF-8"):
        m.stamp_tags(u="y\ud800")


def test_str_subclasses_are_made_plain_str():
    """numpy's str (a verl uid array's items) passes isinstance(str) but the wire refuses it: a meta
    holds plain str for its partition id, keys, fields and tag names."""
    m = KVBatchMeta(np.str_("p"), list(np.array(["u0", "u1"])), fields=[np.str_("f")], tags={np.str_("t"): np.array(["a", "b"])})
    assert m == KVBatchMeta("p", ["u0", "u1"], ["f"], tags={"t": ["a", "b"]})
    assert {type(x) for x in (m.partition_id, *m.keys, *m.fields, *m.tags, *m.tags["t"])} == {str}
    assert KVBatchMeta.from_msgpack(m.to_msgpack()) == m
