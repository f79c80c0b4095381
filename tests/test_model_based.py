"""Model-based test of the data plane: random sequences of puts, write-backs (new fields and
overwrites), discards, clears and gets - every layout, copied and borrowed, same-host and TCP, metas
from puts (slots: the location-table fast paths, runs and range slots) and from ``get_meta``,
subsets, permutations and concatenations of them - against a plain dict of what every key holds.

The invariant is the one readers rely on most: a get returns exactly the bytes its keys hold now, or
fails with a TQ error; never another key's bytes, an overwritten value, or a discarded key's. Two
storage units, so puts land on either and gets span both.

A third machine runs the same ops against a crash-recoverable service (journal dir, fixed port) while
SIGKILLing storage units and the controller between ops, SIGSTOPping either during one op of a
client with a short timeout, and filling the controller's journal disk before a write: nothing
acknowledged is lost or changed, an op that raised left all or nothing behind (a write the journal
refused, nothing), no op hangs, and a late reply is never taken for a later request's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
import itertools
import os
import signal
import time
import uuid

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

from conftest import free_port, no_room_to_grow, pid_alive, room_to_grow, wait_until
from tq import JaggedTensor, KVBatchMeta, TQClient, TQServer
from tq.errors import CapacityError, JournalError, TQConnectionError, TQError

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


STALL_CLIENT_TIMEOUT = 1.0  # seconds: the timeout of the client whose ops meet a stopped process


class _RecoverableService:
    """A service started as an operator starts a crash-recoverable one (fixed port, journal dir, two
    storage units) that the fault machine below SIGKILLs piece by piece and brings back."""

    def __init__(self, state_dir: str) -> None:
        self.port, self.state_dir = free_port(), state_dir
        self.server = self._start()
        self.address = self.server.address
        self.unit_kills: dict[int, list[float]] = {}  # unit id -> kill times (the controller restarts a unit 3 times a minute)
        self.pids: set[int] = set()  # every unit process seen, to be sure none outlives the test

    def _start(self) -> TQServer:
        return TQServer(port=self.port, storage_units=2, capacity=64 << 20, journal_dir=self.state_dir)

    def units(self, admin: TQClient) -> dict[int, dict]:
        units = {u["unit_id"]: u for u in admin.stats()["units"]}
        self.pids.update(u["pid"] for u in units.values())
        return units

    def killable_units(self, admin: TQClient) -> list[int]:
        now = time.monotonic()
        return [uid for uid in self.units(admin) if sum(now - t < 60 for t in self.unit_kills.get(uid, ())) < 2]

    def kill_unit(self, admin: TQClient, uid: int) -> None:
        """SIGKILL one storage unit; return once the controller has restarted it on its arena."""
        old = self.units(admin)[uid]["pid"]
        os.kill(old, signal.SIGKILL)
        self.unit_kills.setdefault(uid, []).append(time.monotonic())
        assert wait_until(lambda: (u := self.units(admin)[uid])["pid"] != old and u["alive"], timeout=30), f"unit {uid} not restarted"

    def kill_controller(self) -> None:
        """SIGKILL the controller and start it again the same way (its units outlive it and rejoin)."""
        self.server.proc.kill()
        self.server.proc.wait(10)
        self.server = self._start()
        self.unit_kills.clear()  # a new incarnation counts its units' restarts afresh

    def fill_journal_disk(self) -> None:
        """Make the controller's journal unable to grow, as a full disk does (its file size limit)."""
        no_room_to_grow(self.server.proc.pid, os.path.join(self.state_dir, "controller.journal"))

    def restart_stopped_controller(self) -> int:
        """Start the controller again once it stopped by itself (room on its disk again); its exit code."""
        code = self.server.proc.wait(10)
        self.server = self._start()
        self.unit_kills.clear()
        return code

    def limit_unit_journals(self, admin: TQClient) -> dict[int, dict]:
        """Make every storage unit's journal unable to grow (a full disk); the units as they were."""
        units = self.units(admin)
        for u in units.values():
            no_room_to_grow(u["pid"], u["arena_path"] + ".journal")
        return units

    def lift_unit_journal_limits(self, units: dict[int, dict], admin: TQClient) -> None:
        """Room again: a unit still running gets its limit back; one that stopped must be restarted."""
        for uid, u in units.items():
            room_to_grow(u["pid"])
            self.unit_kills.setdefault(uid, []).append(time.monotonic())  # counted whether it stopped or not
        # a unit whose write failed before its limit was lifted exits within about a second (its reply's linger)
        wait_until(lambda: all(not pid_alive(u["pid"]) for u in units.values()), timeout=1.5)
        stopped = [uid for uid, u in units.items() if not pid_alive(u["pid"])]
        for uid in stopped:
            assert wait_until(lambda uid=uid: (u := self.units(admin)[uid])["pid"] != units[uid]["pid"] and u["alive"], timeout=30), (
                f"unit {uid} not restarted after it stopped"
            )

    def close(self) -> None:
        self.server.shutdown()
        if not wait_until(lambda: not any(pid_alive(p) for p in self.pids), timeout=10):
            for p in self.pids:
                if pid_alive(p):
                    os.kill(p, signal.SIGKILL)


def _machine_with_faults(service: _RecoverableService) -> type:
    """The model with storage units and the controller SIGKILLed between ops (and SIGSTOPped during
    one, see ``_stalled``). Once the service is back
    (every key held reads again), everything the model holds must read exactly as before the crash -
    no acknowledged row lost, no overwrite undone, no discarded key back, tags kept, metas handed out
    before still valid, borrowed views still reading what they read - and every later op must work."""

    class DataPlaneModelWithFaults(_machine(service.address)):  # type: ignore[misc, valid-type]
        @initialize(seed=st.integers(0, 2**32 - 1))
        def start(self, seed: int) -> None:
            super().start(seed)
            self.short = TQClient(service.address, timeout=STALL_CLIENT_TIMEOUT, transport="tcp")
            self.short_auto = TQClient(service.address, timeout=2 * STALL_CLIENT_TIMEOUT)
            self.clients.update(short=self.short, short_auto=self.short_auto)  # closed with the others

        def _recovered(self) -> None:
            """Wait (bounded) until every held key reads again: reads may fail with a TQ error while a
            restarted piece rejoins, never hang or return other bytes."""
            by_fields: dict[tuple[str, ...], list[str]] = {}
            for k, row in self.held.items():
                if row:
                    by_fields.setdefault(tuple(sorted(row)), []).append(k)

            def readable() -> bool:
                try:
                    for fields, keys in by_fields.items():
                        self.clients["tcp"].get(KVBatchMeta(self.pid, tuple(keys)), list(fields))
                except TQError:
                    return False
                return True

            assert wait_until(readable, timeout=30, interval=0.1), "held keys not readable 30 s after the fault"
            for fields, keys in by_fields.items():  # now exactly, on both transports, copied and borrowed
                meta = self.clients["auto"].get_meta(self.pid, keys)
                for transport in ("auto", "tcp"):
                    self._check_get(meta, list(fields), "list", True, transport)
                self._check_get(meta, list(fields), "jagged", False, "auto")
            for i in range(len(self.views)):
                self._check_view(i)
            self.listed()

        @precondition(lambda self: self.held)
        @rule(data=st.data())
        def kill_unit(self, data: st.DataObject) -> None:
            uid, admin = data.draw(st.integers(0, 1)), self.clients["tcp"]  # drawn first: the draws must not depend on the service
            if uid in service.killable_units(admin):
                service.kill_unit(admin, uid)
                self._recovered()

        @precondition(lambda self: self.held)
        @rule()
        def kill_controller(self) -> None:
            service.kill_controller()
            self._recovered()

        @precondition(lambda self: self.held)
        @rule(data=st.data(), op=st.sampled_from(["put", "write_back", "discard"]), transport=st.sampled_from(["auto", "tcp"]))
        def write_to_a_full_journal_disk(self, data: st.DataObject, op: str, transport: str) -> None:
            """A write the controller cannot journal fails and did not happen: the controller stopped
            at once, and restarted (room again) it holds what the model holds. The error is the
            JournalError naming the journal - or, when a record of the controller's own (a unit's
            heartbeat, say) hit the full disk first, no reply within the client's timeout. The full
            disk is the controller's file size limit, which also holds for its location tables in
            shared memory: a put or write-back that needed a table to grow (a new field's column,
            more slots) is refused as CapacityError naming the limit before anything changed, and
            the controller serves on."""
            client = self.short if transport == "tcp" else self.short_auto
            meta = self._live_meta(data)
            if meta is None:
                return
            field = data.draw(st.sampled_from(sorted(FIELDS)))
            service.fill_journal_disk()
            try:
                if op == "put":
                    client.put(self.pid, [next(self.names)], {field: _column(FIELDS[field], [_row(FIELDS[field], self.rng)])})
                elif op == "write_back":
                    rows = [_row(FIELDS[field], self.rng) for _ in meta.keys]
                    client.write_back(meta, {field: _column(FIELDS[field], rows)}, overwrite=True)
                else:
                    client.discard(meta)
            except CapacityError as exc:
                assert op in ("put", "write_back") and "file size limit" in str(exc), exc
                room_to_grow(service.server.proc.pid)
                assert service.server.proc.poll() is None  # refused, not stopped
                self._recovered()
                return
            except (JournalError, TQConnectionError):
                pass
            else:
                raise AssertionError(f"a {op} the controller could not journal succeeded")
            assert service.restart_stopped_controller() != 0
            self._recovered()

        @precondition(lambda self: self.held)
        @rule(n=st.integers(1, 4), fields=st.sets(st.sampled_from(sorted(FIELDS)), min_size=1), transport=st.sampled_from(["auto", "tcp"]))
        def put_to_units_with_full_journal_disks(self, n: int, fields: set, transport: str) -> None:
            """A put while no unit can journal: the unit it reaches stops and is restarted on its arena.
            It may fail (a TCP store or a same-host slab grant refused) or land whole - on the restarted
            unit, or committed before its unit adopts the block (a same-host put), which must then read
            back exactly once the unit is back. Its keys are discarded either way, so the model does
            not depend on which."""
            admin = self.clients["tcp"]
            if len(service.killable_units(admin)) < 2:  # a unit restarted 3 times a minute is given up
                return
            keys = [next(self.names) for _ in range(n)]
            rows = {f: [_row(FIELDS[f], self.rng) for _ in keys] for f in sorted(fields)}
            units = service.limit_unit_journals(admin)
            try:
                self.clients[transport].put(self.pid, keys, {f: _column(FIELDS[f], r) for f, r in rows.items()})
                failed = False
            except TQError:
                failed = True
            service.lift_unit_journal_limits(units, admin)
            meta = KVBatchMeta(self.pid, tuple(keys))
            present = set(self.clients["tcp"].get_meta(self.pid).keys) & set(keys)  # the controller decided at once
            assert present in (set(), set(keys)) if failed else present == set(keys), f"put left {sorted(present)} of {keys}"
            if present:
                assert wait_until(
                    lambda: self._reads_exactly(self.clients["tcp"], meta, rows, "put while the units' journals were full"),
                    timeout=30,
                    interval=0.1,
                ), "an acknowledged put not readable"
                self.clients["auto"].discard(meta)
            self.stale.append(meta)
            self._recovered()

        def _reads_exactly(self, client: TQClient, meta: KVBatchMeta, rows: dict[str, list], what: str) -> bool:
            """Whether ``meta``'s keys read exactly ``rows`` (field -> one row a key) through ``client``:
            False on a TQ error (a piece still rejoining); other bytes fail the test."""
            try:
                got = client.get(meta, sorted(rows), layout="list")
            except TQError:
                return False
            for f, want in rows.items():
                _check_field(FIELDS[f], "list", got[f], want, f"{what}, {f!r}")
            return True

        # -- stalls: a SIGSTOPped piece, and one op from a client with a short timeout meanwhile
        def _stalled(self, pid: int, op: Callable[[TQClient], object]) -> object | BaseException:
            """Run ``op`` on a 1 s-timeout TCP client while ``pid`` is stopped: its result, or the TQ
            error it raised - within its timeout (plus slack for set-up), never a hang."""
            os.kill(pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                try:
                    out: object | BaseException = op(self.short)
                except TQError as exc:
                    out = exc
                assert time.monotonic() - t0 < STALL_CLIENT_TIMEOUT + 3, f"op took {time.monotonic() - t0:.1f}s against a stalled process"
            finally:
                os.kill(pid, signal.SIGCONT)
            return out

        @precondition(lambda self: self.held)
        @rule(data=st.data(), controller=st.booleans())
        def get_while_stalled(self, data: st.DataObject, controller: bool) -> None:
            """A get while the controller or a unit is stopped fails (or reads exactly); the late reply
            of the request it gave up on must never be taken for the next get's (other keys') rows."""
            keys = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, max_size=4, unique=True))
            fields = sorted(set.intersection(*(set(self.held[k]) for k in keys)))
            if not fields:
                return
            pid = self._pid(controller, data.draw(st.integers(0, 1)))
            meta = KVBatchMeta(self.pid, tuple(keys))
            got = self._stalled(pid, lambda c: c.get(meta, fields, layout="list"))
            if not isinstance(got, BaseException):
                for f in fields:
                    _check_field(FIELDS[f], "list", got[f], [self.held[k][f] for k in keys], f"get of {f!r} during a stall")
            others = [k for k in sorted(self.held) if k not in keys and self.held[k]] or keys
            other = KVBatchMeta(self.pid, (others[0],))
            f = sorted(self.held[others[0]])[0]
            want = {f: [self.held[others[0]][f]]}
            assert wait_until(lambda: self._reads_exactly(self.short, other, want, "get after a stall"), timeout=10, interval=0.05), (
                "the short client read nothing 10 s after a stall"  # its late replies pending
            )
            self._recovered()

        @rule(
            n=st.integers(1, 4),
            fields=st.sets(st.sampled_from(sorted(FIELDS)), min_size=1),
            controller=st.booleans(),
            unit=st.integers(0, 1),
        )
        def put_while_stalled(self, n: int, fields: set, controller: bool, unit: int) -> None:
            """A put during a stall is acknowledged or raises; one that raised is unacknowledged, so once
            the service is back its keys are either all absent or all there with exactly its rows
            (never partly, never other bytes). Either way they are then discarded: what the model holds
            next must not depend on the timing (hypothesis replays a sequence's prefix and expects the
            same draws)."""
            pid = self._pid(controller, unit)
            keys = [next(self.names) for _ in range(n)]
            rows = {f: [_row(FIELDS[f], self.rng) for _ in keys] for f in sorted(fields)}
            columns = {f: _column(FIELDS[f], r) for f, r in rows.items()}
            got = self._stalled(pid, lambda c: c.put(self.pid, keys, columns))
            self._settle()  # a stalled controller may still apply the commit it timed out on
            present = set(self.clients["auto"].get_meta(self.pid).keys) & set(keys)
            failed = isinstance(got, BaseException)
            assert present in (set(), set(keys)) if failed else present == set(keys), (
                f"a put that {'raised' if failed else 'returned'} left {sorted(present)} of {keys}"
            )
            meta = KVBatchMeta(self.pid, tuple(keys))
            if present:
                for f, want in rows.items():
                    _check_field(FIELDS[f], "list", self.short.get(meta, [f], layout="list")[f], want, f"put during a stall, {f!r}")
                self.clients["auto"].discard(meta)
            self.stale.append(meta)
            self._recovered()

        @precondition(lambda self: self.held)
        @rule(data=st.data(), controller=st.booleans())
        def discard_while_stalled(self, data: st.DataObject, controller: bool) -> None:
            """A discard that raised during a stall leaves its keys all gone or all intact (then they
            are discarded again, so the model's state does not depend on the timing)."""
            keys = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, max_size=4, unique=True))
            pid = self._pid(controller, data.draw(st.integers(0, 1)))
            meta = KVBatchMeta(self.pid, tuple(keys))
            got = self._stalled(pid, lambda c: c.discard(meta))
            if isinstance(got, BaseException):
                self._settle()
                present = set(self.clients["auto"].get_meta(self.pid).keys) & set(keys)
                assert present in (set(), set(keys)), f"a failed discard left {sorted(present)} of {keys}"
                if present:
                    self._recovered()  # intact: every held key still reads exactly
                    assert self.clients["auto"].discard(meta) == len(keys)
            for k in keys:
                del self.held[k]
                self.scores.pop(k, None)
            self.stale.append(meta)
            self._recovered()

        def _pid(self, controller: bool, unit: int) -> int:
            """The controller's process, or storage unit ``unit``'s."""
            return service.server.proc.pid if controller else service.units(self.clients["tcp"])[unit]["pid"]

        def _settle(self) -> None:
            """Until the short client's requests are all answered: a call on its connection is served
            after everything it sent before (one connection, served in order)."""
            assert wait_until(lambda: self._answers(), timeout=15, interval=0.05), "the service did not answer after a stall"

        def _answers(self) -> bool:
            try:
                self.short.list_partitions()
            except TQError:
                return False
            return True

    return DataPlaneModelWithFaults


@pytest.fixture(scope="module")
def recoverable_service(tmp_path_factory):
    service = _RecoverableService(str(tmp_path_factory.mktemp("tq-state")))
    try:
        yield service
    finally:
        service.close()


# Without shrinking: it replays sequences with kills in them (seconds each) whose outcomes depend on
# timing, so it takes minutes and ends in hypothesis's Flaky errors; the failing sequence is reported as is.
# No example database either: replaying a saved sequence draws differently once the timing differs,
# and a second run of the suite in the same checkout failed with FlakyStrategyDefinition instead of
# testing anything (seen: four runs in a row after one run had saved a sequence).
FAULT_PHASES = (Phase.explicit, Phase.generate)


def _fault_settings(examples: int, steps: int) -> settings:
    """Hypothesis settings of the runs with faults: ``examples`` sequences of ``steps`` ops each."""
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=FAULT_PHASES,
        database=None,
    )


def test_random_op_sequences_with_crashes_lose_nothing(recoverable_service):
    """Quick run for CI: a few sequences with units and the controller SIGKILLed between ops and
    stopped during ops, and journals that cannot grow (14-16 s on the 2-vCPU VM; the slow variant
    runs 40 x 40)."""
    run_state_machine_as_test(
        _machine_with_faults(recoverable_service),
        settings=_fault_settings(examples=3, steps=20),
    )


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 1,600 steps with faults: past the suite's 300 s per test (it stopped there)
def test_random_op_sequences_with_crashes_many(recoverable_service):
    run_state_machine_as_test(
        _machine_with_faults(recoverable_service),
        settings=_fault_settings(examples=40, steps=40),
    )
