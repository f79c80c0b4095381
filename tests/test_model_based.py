"""Model-based test of the data plane: random sequences of puts, write-backs (new fields and
overwrites), discards, clears and gets - every layout, copied and borrowed, same-host and TCP, metas
from puts (slots: the location-table fast paths, runs and range slots) and from ``get_meta``,
subsets, permutations and concatenations of them - against a plain dict of what every key holds.

The invariant is the one readers rely on most: a get returns exactly the bytes its keys hold now, or
fails with a TQ error; never another key's bytes, an overwritten value, or a discarded key's. Two
storage units, so puts land on either and gets span both.
"""

from __future__ import annotations

import dataclasses
import itertools
import uuid

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

from tq import JaggedTensor, KVBatchMeta, TQClient
from tq.errors import TQError

# field -> how its rows look: jagged token-aligned rows, fixed-shape rows, or Python objects
FIELDS = {
    "tok": "jagged_i64",
    "lp": "jagged_f32",
    "b16": "jagged_bf16",
    "msk": "jagged_bool",
    "pair": "jagged_i32x2",  # two int32 a token: a row is 8 bytes a token
    "r": "scalar_f32",
    "emb": "vec3_f32",
    "u8": "vec5_u8",
    "txt": "object",
}
# pad values a padded get may ask for, by field kind (besides the default 0): each fills its dtype exactly
PADS = {
    "jagged_i64": (-1, 7),
    "jagged_f32": (0.5, -2.0),
    "jagged_bf16": (0.5, -3.0),
    "jagged_bool": (True,),
    "jagged_i32x2": (-1, 9),
}
LAYOUTS = ("padded", "jagged", "list")


def _row(kind: str, rng: np.random.Generator) -> object:
    n = int(rng.integers(1, 40))
    if kind == "jagged_i64":
        return torch.from_numpy(rng.integers(-(2**40), 2**40, size=n))
    if kind == "jagged_f32":
        return torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    if kind == "jagged_bf16":
        return torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(torch.bfloat16)
    if kind == "jagged_bool":
        return torch.from_numpy(rng.integers(0, 2, size=n).astype(bool))
    if kind == "jagged_i32x2":
        return torch.from_numpy(rng.integers(-(2**31), 2**31, size=(n, 2)).astype(np.int32))
    if kind == "scalar_f32":
        return torch.tensor(float(rng.standard_normal()), dtype=torch.float32)
    if kind == "vec3_f32":
        return torch.from_numpy(rng.standard_normal(3).astype(np.float32))
    if kind == "vec5_u8":
        return torch.from_numpy(rng.integers(0, 256, size=5).astype(np.uint8))
    return f"s{int(rng.integers(0, 10**9))}" * int(rng.integers(0, 4))


def _column(kind: str, rows: list) -> object:
    """The rows as the column a user passes: a JaggedTensor or a list of tensors for jagged fields
    (both forms), a stacked tensor for fixed-shape ones, the list itself for objects."""
    if kind.startswith("jagged"):
        if len(rows) % 2:  # odd batches as a JaggedTensor, even ones as a list of tensors
            lengths = torch.tensor([len(r) for r in rows])
            offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
            offsets[1:] = torch.cumsum(lengths, 0)
            return JaggedTensor(torch.cat(rows), offsets)
        return list(rows)
    if kind == "object":
        return list(rows)
    return torch.stack(rows)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(a, b)


def _check_field(kind: str, layout: str, got: object, want: list, where: str, pad_len: int | None = None, pad: object = 0) -> None:
    """``got`` is exactly the rows ``want`` in ``layout``; padded: ``pad_len`` long (default: the
    longest row), the rest of every row ``pad``."""
    if kind == "object":
        assert list(got) == want, where
        return
    if not kind.startswith("jagged"):
        assert _same(got, torch.stack(want)), where
        return
    if layout == "list":
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert _same(g, w), f"{where}, row {i}"
        return
    if layout == "jagged":
        assert isinstance(got, JaggedTensor), where
        assert got.lengths.tolist() == [len(w) for w in want], where
        assert _same(got.values, torch.cat(want)), where
        return
    pad_len = max(len(w) for w in want) if pad_len is None else pad_len
    assert tuple(got.shape) == (len(want), pad_len, *want[0].shape[1:]), where
    for i, w in enumerate(want):
        assert _same(got[i, : len(w)], w), f"{where}, row {i}"
        assert (got[i, len(w) :] == torch.tensor(pad, dtype=w.dtype)).all(), f"{where}, row {i}: padding is not {pad!r}"


def _machine(address: str) -> type:
    class DataPlaneModel(RuleBasedStateMachine):
        """The service against a dict: key -> field -> row."""

        @initialize(seed=st.integers(0, 2**32 - 1))
        def start(self, seed: int) -> None:
            self.rng = np.random.default_rng(seed)
            self.clients = {t: TQClient(address, timeout=15.0, transport=t) for t in ("auto", "tcp")}
            self.pid = f"model-{uuid.uuid4().hex[:8]}"
            self.clients["auto"].register_partition(self.pid)
            self.held: dict[str, dict[str, object]] = {}  # key -> field -> row
            self.scores: dict[str, int] = {}  # key -> its "score" tag, where it has one
            self.metas: list[KVBatchMeta] = []  # metas handed out by puts and registrations (with slots)
            self.stale: list[KVBatchMeta] = []  # metas naming keys discarded or cleared since
            self.names = (f"k{i}" for i in itertools.count())
            self.views: list[tuple[object, list[str], str, list[str], dict[str, list]]] = []  # borrowed, held on

        def teardown(self) -> None:
            for batch, *_ in self.views:
                batch.release()
            try:
                self.clients["auto"].drop_partition(self.pid)
            finally:
                for c in self.clients.values():
                    c.close()

        # -- helpers
        def _live_meta(self, data: st.DataObject) -> KVBatchMeta | None:
            """A meta of live keys: a put's (or several concatenated) narrowed to its live keys, in
            its order or shuffled, or one made by ``get_meta``."""
            live = [m.select_keys([k for k in m.keys if k in self.held]) for m in self.metas]
            live = [m for m in live if m.size]
            if not live:
                return None
            how = data.draw(st.sampled_from(["put", "concat", "shuffled", "get_meta"]))
            if how == "get_meta":
                keys = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, max_size=8, unique=True))
                return self.clients[data.draw(st.sampled_from(["auto", "tcp"]))].get_meta(self.pid, keys)
            picked = data.draw(st.lists(st.sampled_from(range(len(live))), min_size=1, max_size=3, unique=True))
            meta = live[picked[0]]
            if how == "concat":  # metas concatenate when they name the same fields and tags
                meta = KVBatchMeta.concat([dataclasses.replace(live[i].with_fields(meta.fields), tags={}) for i in picked])
            if how == "shuffled":
                order = data.draw(st.permutations(range(meta.size)))
                meta = meta.select(list(order)[: data.draw(st.integers(1, meta.size))])
            return meta

        # -- rules
        @rule(n=st.integers(1, 6), fields=st.sets(st.sampled_from(sorted(FIELDS)), min_size=1), transport=st.sampled_from(["auto", "tcp"]))
        def put(self, n: int, fields: set, transport: str) -> None:
            keys = [next(self.names) for _ in range(n)]
            rows = {f: [_row(FIELDS[f], self.rng) for _ in keys] for f in sorted(fields)}
            scores = [int(x) for x in self.rng.integers(-100, 100, size=n)] if self.rng.random() < 0.5 else None
            columns = {f: _column(FIELDS[f], r) for f, r in rows.items()}
            meta = self.clients[transport].put(self.pid, keys, columns, tags={"score": scores} if scores else None)
            assert list(meta.keys) == keys
            for i, k in enumerate(keys):
                self.held[k] = {f: r[i] for f, r in rows.items()}
                if scores:
                    self.scores[k] = scores[i]
            self.metas.append(meta)

        @precondition(lambda self: self.held)
        @rule(data=st.data(), field=st.sampled_from(sorted(FIELDS)), overwrite=st.booleans(), transport=st.sampled_from(["auto", "tcp"]))
        def write_back(self, data: st.DataObject, field: str, overwrite: bool, transport: str) -> None:
            meta = self._live_meta(data)
            if meta is None:
                return
            rows = [_row(FIELDS[field], self.rng) for _ in meta.keys]
            has = [field in self.held[k] for k in meta.keys]
            if any(has) and not overwrite:
                with pytest.raises(TQError):
                    self.clients[transport].write_back(meta, {field: _column(FIELDS[field], rows)})
                return
            self.clients[transport].write_back(meta, {field: _column(FIELDS[field], rows)}, overwrite=overwrite)
            for k, r in zip(meta.keys, rows):
                self.held[k][field] = r

        def _whole_put(self, data: st.DataObject) -> KVBatchMeta | None:
            """A put's meta whose keys are all still held: its slots a range, its rows one run each."""
            whole = [m for m in self.metas if all(k in self.held for k in m.keys)]
            return data.draw(st.sampled_from(whole)) if whole else None

        @precondition(lambda self: self.metas)
        @rule(data=st.data(), transport=st.sampled_from(["auto", "tcp"]))
        def overwrite_part(self, data: st.DataObject, transport: str) -> None:
            """Rewrite one field of a slice of a put's keys (its first, middle or last ones): the
            put's other keys keep their rows, and a reader of the whole put must see both."""
            meta = self._whole_put(data)
            if meta is None:
                return
            start = data.draw(st.integers(0, meta.size - 1))
            part = meta.slice(start, data.draw(st.integers(start + 1, meta.size)))
            common = sorted(set.intersection(*(set(self.held[k]) for k in part.keys)))
            if not common:  # registered keys not written yet
                return
            field = data.draw(st.sampled_from(common))
            rows = [_row(FIELDS[field], self.rng) for _ in part.keys]
            self.clients[transport].write_back(part, {field: _column(FIELDS[field], rows)}, overwrite=True)
            for k, r in zip(part.keys, rows):
                self.held[k][field] = r

        @precondition(lambda self: self.metas)
        @rule(data=st.data(), layout=st.sampled_from(LAYOUTS), copy=st.booleans())
        def get_whole_put(self, data: st.DataObject, layout: str, copy: bool) -> None:
            """A same-host get of a whole put: the location table's run read, when its rows are intact."""
            meta = self._whole_put(data)
            common = sorted(set.intersection(*(set(self.held[k]) for k in meta.keys))) if meta is not None else []
            if common:
                self._check_get(meta, common, layout, copy, "auto", data)

        @precondition(lambda self: self.held)
        @rule(data=st.data(), transport=st.sampled_from(["auto", "tcp"]))
        def discard(self, data: st.DataObject, transport: str) -> None:
            meta = self._live_meta(data)
            if meta is None:
                return
            assert self.clients[transport].discard(meta) == meta.size
            for k in meta.keys:
                del self.held[k]
                self.scores.pop(k, None)
            self.stale.append(meta)

        @precondition(lambda self: len(self.metas) >= 4)  # not so often that little else gets built up
        @rule()
        def clear(self) -> None:
            self.clients["auto"].clear_partition(self.pid)
            self.stale.extend(self.metas)
            self.metas, self.held, self.scores = [], {}, {}

        @precondition(lambda self: self.held)
        @rule(data=st.data(), layout=st.sampled_from(LAYOUTS), copy=st.booleans(), transport=st.sampled_from(["auto", "tcp"]))
        def get(self, data: st.DataObject, layout: str, copy: bool, transport: str) -> None:
            meta = self._live_meta(data)
            if meta is None:
                return
            common = sorted(set.intersection(*(set(self.held[k]) for k in meta.keys)))
            if not common:
                return
            fields = data.draw(st.lists(st.sampled_from(common), min_size=1, unique=True))
            self._check_get(meta, fields, layout, copy, transport, data)

        def _check_get(
            self, meta: KVBatchMeta, fields: list[str], layout: str, copy: bool, transport: str, data: st.DataObject | None = None
        ) -> None:
            pad_to, pads = None, {}
            if data is not None and layout == "padded":  # a longer pad length and pad values of its own
                jagged = [f for f in fields if FIELDS[f].startswith("jagged")]
                longest = max((len(self.held[k][f]) for k in meta.keys for f in jagged), default=0)
                pad_to = longest + data.draw(st.integers(0, 9)) if jagged and data.draw(st.booleans()) else None
                pads = {f: data.draw(st.sampled_from((0, *PADS[FIELDS[f]]))) for f in jagged}
            got = self.clients[transport].get(meta, fields, layout=layout, copy=copy, pad_to=pad_to, pad_value=pads or 0)
            try:
                for f in fields:
                    where = (
                        f"get of {f!r} ({layout}, copy={copy}, {transport}, pad_to={pad_to}, pad={pads.get(f, 0)!r}) for {list(meta.keys)}"
                    )
                    _check_field(FIELDS[f], layout, got[f], [self.held[k][f] for k in meta.keys], where, pad_to, pads.get(f, 0))
            finally:
                if not copy:
                    got.release()

        @precondition(lambda self: self.held and len(self.views) < 3)
        @rule(data=st.data(), layout=st.sampled_from(LAYOUTS))
        def borrow_and_hold(self, data: st.DataObject, layout: str) -> None:
            """A borrowed get whose views are kept over the next ops (discards, overwrites, clears of
            their keys included) and checked again by ``check_held``."""
            meta = self._live_meta(data)
            if meta is None or not (common := sorted(set.intersection(*(set(self.held[k]) for k in meta.keys)))):
                return
            fields = data.draw(st.lists(st.sampled_from(common), min_size=1, unique=True))
            want = {f: [self.held[k][f] for k in meta.keys] for f in fields}
            batch = self.clients["auto"].get(meta, fields, layout=layout, copy=False)
            self.views.append((batch, fields, layout, list(meta.keys), want))
            self._check_view(len(self.views) - 1)

        @precondition(lambda self: self.views)
        @rule(data=st.data())
        def check_held(self, data: st.DataObject) -> None:
            """A held borrowed batch still reads what its keys held when it was taken; then released."""
            i = data.draw(st.integers(0, len(self.views) - 1))
            self._check_view(i)
            self.views.pop(i)[0].release()

        def _check_view(self, i: int) -> None:
            batch, fields, layout, keys, want = self.views[i]
            for f in fields:
                _check_field(FIELDS[f], layout, batch[f], want[f], f"held borrowed {f!r} ({layout}) of {keys}")

        @precondition(lambda self: self.stale)
        @rule(data=st.data(), transport=st.sampled_from(["auto", "tcp"]))
        def get_stale(self, data: st.DataObject, transport: str) -> None:
            """A meta naming a key no longer held reads nothing: a TQ error, whatever took its slot."""
            meta = data.draw(st.sampled_from(self.stale))
            assert any(k not in self.held for k in meta.keys)  # names are never reused
            with pytest.raises(TQError):
                self.clients[transport].get(meta, list(meta.fields) or sorted(FIELDS))

        @rule()
        def listed(self) -> None:
            meta = self.clients["auto"].get_meta(self.pid)
            assert set(meta.keys) == set(self.held)
            got = dict(zip(meta.keys, meta.tags.get("score", (None,) * meta.size)))
            assert {k: got[k] for k in self.scores} == self.scores

    return DataPlaneModel


def _machine_with_registered_keys(address: str) -> type:
    """The model plus keys registered before they hold data, gets that wait for a field, and tags set
    later: kept apart so the core machine's steps go to the reads and rewrites it checks."""

    class DataPlaneModelWithRegisteredKeys(_machine(address)):  # type: ignore[misc, valid-type]
        @rule(n=st.integers(1, 4))
        def register(self, n: int) -> None:
            """Keys registered with no data yet (as a rollout mints them); write-backs fill them."""
            keys = [next(self.names) for _ in range(n)]
            meta = self.clients["auto"].register_keys(self.pid, keys)
            self.held.update({k: {} for k in keys})
            self.metas.append(meta)

        @precondition(lambda self: self.held)
        @rule(data=st.data(), transport=st.sampled_from(["auto", "tcp"]))
        def wait_for_missing(self, data: st.DataObject, transport: str) -> None:
            """A get that waits for a field no key of it has yet times out with a TQ error."""
            key = data.draw(st.sampled_from(sorted(self.held)))
            missing = sorted(set(FIELDS) - set(self.held[key]))
            if not missing:
                return
            meta = self.clients[transport].get_meta(self.pid, [key])
            with pytest.raises(TQError):
                self.clients[transport].get(meta, [data.draw(st.sampled_from(missing))], wait_timeout=0.05)

        @precondition(lambda self: self.held)
        @rule(data=st.data())
        def set_scores(self, data: st.DataObject) -> None:
            meta = self._live_meta(data)
            if meta is None:
                return
            scores = [int(x) for x in self.rng.integers(-100, 100, size=meta.size)]
            self.clients["auto"].set_tags(meta.stamp_tags(score=scores))
            self.scores.update(zip(meta.keys, scores))

    return DataPlaneModelWithRegisteredKeys


def test_random_op_sequences_read_exactly_what_each_key_holds(tq_server):
    """Quick run for CI: 50 sequences of up to 40 ops (the slow variant runs more)."""
    run_state_machine_as_test(
        _machine(tq_server.address),
        settings=settings(max_examples=50, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)),
    )


def test_random_op_sequences_with_registered_keys_waits_and_tags(tq_server):
    run_state_machine_as_test(
        _machine_with_registered_keys(tq_server.address),
        settings=settings(max_examples=15, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)),
    )


@pytest.mark.slow
@pytest.mark.parametrize("machine", [_machine, _machine_with_registered_keys])
def test_random_op_sequences_many(tq_server, machine):
    run_state_machine_as_test(
        machine(tq_server.address),
        settings=settings(max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=list(HealthCheck)),
    )
