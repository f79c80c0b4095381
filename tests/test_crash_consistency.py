"""Crash consistency of the data plane (issue 16): faults injected from outside with signals, checked
through the public API only.

- A put whose commit outlives the client's timeout (controller stopped) never leaves its keys aliasing
  storage that a later put reuses: the keys are absent or read exactly the bytes that put wrote.
- A controller restarted from its journal supervises the storage units it took back: one killed
  before or after the restart is restarted on its arena and serves its keys again.
- A storage unit gone for good does not freeze the controller, however much work queues up for it;
  the work is not lost: when the unit comes back its frees are applied.

Real controller and storage-unit processes, real sockets; every process started here is stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from conftest import (
    free_port,
    inject_bug,
    no_room_to_grow,
    pid_alive,
    pid_namespace_start,
    process_state,
    room_to_grow,
    python_command,
    python_pid,
    shut_down,
    wait_until,
)
from tq import TQClient, TQServer, launch, protocol
from tq.errors import InvalidRequestError, KeyNotFoundError, StorageUnitError, TQConnectionError, TQError


def _read_or_absent(c: TQClient, pid: str, key: str) -> torch.Tensor | None:
    """The key's ``x`` if it exists (None if absent); any other failure is raised."""
    try:
        meta = c.get_meta(pid, [key])
    except KeyNotFoundError:
        return None
    return c.get(meta, ["x"])["x"]


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_put_whose_commit_times_out_never_aliases_a_later_put(transport):
    """SIGSTOP the controller for longer than the client's timeout while a put commits: the put raises
    TQConnectionError; after SIGCONT the controller applies the queued commit. Then other puts of the
    same size run (reusing any storage that was freed). The failed put's key must be absent or read
    exactly its own bytes - before the fix it read a later put's bytes (same host) or raised
    'freed or never stored' (TCP)."""
    with TQServer(storage_units=1, capacity=16 << 20) as server:
        c = TQClient(server.address, timeout=1.0, transport=transport)
        steady = TQClient(server.address, timeout=10.0, transport=transport)
        try:
            c.register_partition("p")
            mine = torch.full((1, 4096), 7.0)
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(TQConnectionError):
                    c.put("p", ["lost"], {"x": mine})
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            for i in range(8):  # later puts of the same size: would reuse a freed block
                steady.put("p", [f"later{i}"], {"x": torch.full((1, 4096), float(100 + i))})
            for client in (c, steady):
                got = _read_or_absent(client, "p", "lost")
                assert got is None or torch.equal(got, mine), f"the failed put's key reads other bytes: {got[0, :4]}"
            # the client's own retry of the same put is safe: it lands, or is refused as a duplicate
            try:
                c.timeout = 10.0
                c._ctrl.timeout = 10.0
                c.put("p", ["lost"], {"x": mine})
            except TQError as exc:
                assert "already" in str(exc), exc
            assert torch.equal(_read_or_absent(steady, "p", "lost"), mine)
            for i in range(8):
                assert torch.equal(steady.get(steady.get_meta("p", [f"later{i}"]), ["x"])["x"], torch.full((1, 4096), float(100 + i)))
        finally:
            c.close()
            steady.close()


def test_restarted_controller_supervises_the_units_it_took_back(tmp_path):
    """Kill the controller (journal on), kill a unit while it is down, start the controller again: the
    dead unit is restarted on its arena and serves its keys; then kill the other unit: restarted too.
    Before the fix neither was ever restarted (alive: False for good, arena left in /dev/shm)."""
    port = free_port()
    state = str(tmp_path / "state")
    first = TQServer(port=port, storage_units=2, capacity=32 << 20, journal_dir=state)
    c = TQClient(first.address, timeout=10.0, transport="tcp")
    second = None
    unit_pids: list[int] = []
    try:
        c.register_partition("p")
        data = {i: torch.randn(3, 5) + i for i in range(4)}
        metas = {i: c.put("p", [f"k{i}_{j}" for j in range(3)], {"x": d}) for i, d in data.items()}
        units = c.stats()["units"]
        unit_pids = [u["pid"] for u in units]
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        os.kill(unit_pids[0], signal.SIGKILL)  # dies while no controller runs
        second = TQServer(port=port, storage_units=2, capacity=32 << 20, journal_dir=state)

        def all_readable() -> bool:
            try:
                return all(torch.equal(c.get(m, ["x"])["x"], data[i]) for i, m in metas.items())
            except (StorageUnitError, TQConnectionError):
                return False

        assert wait_until(all_readable, timeout=20), [(u["unit_id"], u["alive"], u["pid"]) for u in c.stats()["units"]]
        now = {u["unit_id"]: u for u in c.stats()["units"]}
        assert now[0]["pid"] != unit_pids[0] and now[0]["alive"]
        unit_pids.append(now[0]["pid"])
        os.kill(now[1]["pid"], signal.SIGKILL)  # and one killed under the restarted controller
        time.sleep(0.5)
        assert wait_until(all_readable, timeout=20), [(u["unit_id"], u["alive"], u["pid"]) for u in c.stats()["units"]]
        now = {u["unit_id"]: u for u in c.stats()["units"]}
        assert now[1]["pid"] != unit_pids[1] and now[1]["alive"]
        unit_pids.append(now[1]["pid"])
        c.clear_partition("p")
        assert wait_until(lambda: all(u.get("bytes_used") == 0 for u in c.stats()["unit_stats"]), timeout=10)
    finally:
        c.close()
        shut_down((second, first), unit_pids)


@pytest.mark.parametrize("mode", ["put", "write_back"])
def test_a_write_to_a_stalled_controller_gives_up_within_its_timeout(mode):
    """The client timeout bounds the whole write - store, commit and the probe that asks whether a
    silent commit landed - not each request: with the controller stopped, a write with a 2 s timeout
    fails within it (plus scheduling slack). Before, the commit alone waited 2 s and its abort probe
    0.5 s more (the chaos benchmark's 2.5-3.0 s calls)."""
    timeout = 2.0
    with TQServer(storage_units=1, capacity=16 << 20) as server:
        c = TQClient(server.address, timeout=timeout, transport="tcp")
        try:
            c.register_partition("p")
            meta = c.put("p", ["k"], {"x": torch.ones(1, 64)})
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with pytest.raises(TQConnectionError) as err:
                    if mode == "put":
                        c.put("p", ["k2"], {"x": torch.ones(1, 64)})
                    else:
                        c.write_back(meta, {"y": torch.ones(1, 8)})
                took = time.monotonic() - t0
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            assert took <= timeout + 0.4, f"{mode} took {took:.2f}s with a {timeout:g}s timeout: {err.value}"
            assert "unknown" in str(err.value) or "did not land" in str(err.value), err.value
        finally:
            c.close()


def _start_unit(address: str, **options: object) -> tuple[subprocess.Popen, dict]:
    """A storage unit started by hand (as a Ray actor would), registered with ``address``."""
    ready = launch.new_ready_file("tq-unit-test-")
    proc = subprocess.Popen(
        launch.storage_unit_command(
            unit_id=0, bind="tcp://127.0.0.1:0", controller=address, capacity=16 << 20, shm_dir="/dev/shm", ready_file=ready, **options
        )
    )
    info = launch.await_ready_file(ready, alive=lambda: proc.poll() is None, timeout=30, what="the storage unit")
    return proc, info


def test_unit_gone_for_good_never_freezes_the_controller_and_its_frees_are_kept():
    """A unit the controller did not start (so it cannot restart it) is killed for good; 3,000
    single-key discards of keys it held follow. The controller keeps answering every one of them
    (before the fix its single thread blocked on a send to the dead unit once ~1,000 messages
    queued, and every request then timed out). When the unit is brought back on its arena, the frees
    that could not be sent are applied: it ends up holding nothing."""
    with TQServer(storage_units=0) as server:
        proc, info = _start_unit(server.address)
        back = None
        c = TQClient(server.address, timeout=5.0)
        try:
            c.register_partition("p")
            keys = [f"k{i}" for i in range(3000)]
            meta = c.put("p", keys, {"x": torch.arange(3000, dtype=torch.int64).reshape(-1, 1)})
            proc.kill()
            proc.wait(10)
            t0 = time.monotonic()
            for i in range(len(keys)):
                c.discard(meta.select([i]))
            assert time.monotonic() - t0 < 60
            stats = c.stats()  # still answering, and says the unit is down
            assert stats["units"][0]["alive"] is False and stats["partitions"][0]["keys"] == 0
            back, _ = _start_unit(server.address, recover_arena=info["arena_path"], rejoin=0)
            assert wait_until(lambda: c.stats()["unit_stats"][0].get("bytes_used") == 0, timeout=15), c.stats()["unit_stats"]
        finally:
            c.close()
            server.shutdown()
            for p in (proc, back):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait(10)
            for path in (info["arena_path"], info["arena_path"] + ".journal"):
                if os.path.exists(path):
                    os.unlink(path)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_put_goes_where_there_is_room_and_splits_when_no_unit_has_enough(transport):
    """Two 1 MiB units. Puts never fail while some unit has room for them (before: round robin sent
    a put to the full unit and it failed while the other was empty), and a batch that no single unit
    can hold is split over both and committed at once - every key readable, bit-exact."""
    with TQServer(storage_units=2, capacity=2 << 20) as server:
        c = TQClient(server.address, timeout=10.0, transport=transport)
        try:
            c.register_partition("p")
            row = 100 << 10  # 100 KiB rows
            data = {}
            for i in range(6):  # 6 x 300 KiB: at most 3 fit one unit, so a blind round robin fails
                keys = [f"a{i}_{j}" for j in range(3)]
                data[tuple(keys)] = torch.randint(0, 255, (3, row), dtype=torch.uint8)
                c.put("p", keys, {"x": data[tuple(keys)]})
            c.discard(c.get_meta("p", ["a0_0", "a0_1", "a0_2", "a1_0", "a1_1", "a1_2"]))  # ~300 KiB free per unit
            del data[("a0_0", "a0_1", "a0_2")], data[("a1_0", "a1_1", "a1_2")]
            keys = [f"big{j}" for j in range(5)]  # 500 KiB: fits neither unit alone
            data[tuple(keys)] = torch.randint(0, 255, (5, row), dtype=torch.uint8)
            c.put("p", keys, {"x": data[tuple(keys)]})
            located, msg = c._ctrl.call("locate", {"partition": "p", "keys": keys, "fields": ["x"]})
            assert set(protocol.unpack_array(located.loc, msg.buffers)[0, :, 0].tolist()) == {0, 1}  # split
            for keys, want in data.items():
                assert torch.equal(c.get(c.get_meta("p", list(keys)), ["x"])["x"], want)
            c.clear_partition("p")
            assert wait_until(lambda: all(u.get("bytes_used") == 0 for u in c.stats()["unit_stats"]), timeout=10)
        finally:
            c.close()


def test_a_discards_frees_go_to_the_units_before_its_reply(loopback):
    """A writer told that a discard is done may put into the freed space at once; the unit hears of
    the free from the controller, so the free is sent before the reply, not at the loop's next tick
    (the suite once failed a put that reached the unit first: CapacityError with the room promised)."""
    import zmq

    ctrl = loopback.start()
    try:
        loopback.commit_two_rows(ctrl)
        loopback.heard()  # the commit's claim
        pending_at_reply = []
        reply = ctrl.reply
        ctrl.reply = lambda call, *a, **k: (
            pending_at_reply.append(sum(len(led.frees) for led in ctrl.ledgers.values())),
            reply(call, *a, **k),
        )
        frames = protocol.request("discard", 7, {"partition": "p", "keys": ["a"]}, [], None)
        ctrl._serve_one([zmq.Frame(b"writer"), *(zmq.Frame(bytes(memoryview(f))) for f in frames)])  # no tick after it
        assert pending_at_reply == [0]  # nothing left to send when the reply went
        assert loopback.heard() == ["free_rows"]
    finally:
        ctrl.close()


def test_a_write_that_finds_no_room_waits_a_grace_for_frees_then_fails_saying_so():
    """With ``capacity_wait_s=0`` a write still waits FREE_GRACE_S at its unit for frees already
    decided (one arriving just after the write is served), then fails naming the wait."""
    from tq.client import FREE_GRACE_S
    from tq.errors import CapacityError

    with TQServer(storage_units=1, capacity=1 << 20) as server:
        c = TQClient(server.address, timeout=10.0, transport="tcp")
        try:
            c.register_partition("p")
            c.put("p", ["full"], {"x": torch.zeros(1, 900 << 10, dtype=torch.uint8)})
            t0 = time.monotonic()
            with pytest.raises(CapacityError, match="waited"):
                c.put("p", ["more"], {"x": torch.zeros(1, 300 << 10, dtype=torch.uint8)})
            assert FREE_GRACE_S <= time.monotonic() - t0 < 5.0
        finally:
            c.close()


@pytest.mark.parametrize("column", ["sparse", "sparse-row", "meta", "meta-row", "np-datetime", "np-record", "np-object-2d"])
def test_unsupported_tensors_raise_a_tq_error_naming_the_field(client, partition, column):
    """Sparse and meta-device tensors (a whole column or one row of a jagged list) and numpy arrays
    torch cannot hold (dates, records, a 2-D array of objects) are refused with InvalidRequestError
    naming the field - before, torch's NotImplementedError/RuntimeError/TypeError leaked."""
    from tq.errors import InvalidRequestError

    value = {
        "sparse": torch.randn(2, 3).to_sparse(),
        "meta": torch.empty(2, 3, device="meta"),
        "sparse-row": [torch.randn(3), torch.randn(2).to_sparse()],
        "meta-row": [torch.randn(3), torch.empty(2, device="meta")],
        "np-datetime": np.zeros(2, dtype="datetime64[s]"),  # torch's TypeError leaked, naming no field
        "np-record": np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]),
        "np-object-2d": np.empty((2, 2), dtype=object),
    }[column]
    with pytest.raises(InvalidRequestError, match=r"field 'odd'"):
        client.put(partition, ["a", "b"], {"ok": torch.ones(2), "odd": value})
    assert client.get_meta(partition).keys == ()


def test_status_right_after_a_unit_dies_shows_it_down():
    """`tq-controller status` in the seconds after a storage unit is killed (before the controller's
    heartbeat marks it down) prints the unit as down instead of failing."""
    with TQServer(storage_units=2, capacity=8 << 20) as server:
        c = TQClient(server.address, timeout=10.0)
        try:
            victim = c.stats()["units"][1]
            os.kill(victim["pid"], signal.SIGSTOP)  # silent, not yet reported down (its process lives)
            try:
                t0 = time.monotonic()
                out = subprocess.run(
                    [sys.executable, "-m", "tq.cli", "status", "--json", "--address", server.address],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                assert out.returncode == 0, out.stderr
                assert time.monotonic() - t0 < 8
                stats = json.loads(out.stdout)
                shown = {u["unit_id"]: u for u in stats["unit_stats"]}
                assert shown[1]["alive"] is False and shown[0].get("blocks") is not None
            finally:
                os.kill(victim["pid"], signal.SIGCONT)
        finally:
            c.close()


def test_block_never_committed_is_reclaimed_after_its_lease_and_a_late_commit_is_refused():
    """A writer that stored a block and died before committing it: after the commit lease the unit
    asks the controller, which fences the block and has it freed (nothing else frees it); a commit
    naming it that arrives later is refused with FencedCommitError and makes nothing visible. A block
    committed meanwhile is claimed, not reclaimed, and a retried commit of it is answered again."""
    from tq.errors import FencedCommitError

    with TQServer(storage_units=1, capacity=8 << 20, commit_lease_s=1.0) as server:
        c = TQClient(server.address, timeout=10.0, transport="tcp")
        try:
            c.register_partition("p")
            unit = c._unit_chans[0]
            bufs: list = []
            spec = {
                "schema": ["tensor", "int64", []],
                "row_offsets": protocol.pack_array(np.array([0, 8], dtype=np.int64), bufs),
                "data": protocol.pack_array(np.arange(1, dtype=np.int64).view(np.uint8), bufs),
            }
            stored, _ = unit.call("store", {"n_rows": 1, "fields": {"x": spec}}, bufs)  # then the writer "dies"
            kept = c.put("p", ["kept"], {"x": torch.tensor([5])})
            # the kept block's claim reaches the unit after the commit's reply: wait for it, not for the lease
            assert wait_until(lambda: c.stats()["unit_stats"][0]["tentative_blocks"] == 1, timeout=5)
            assert wait_until(lambda: c.stats()["unit_stats"][0]["tentative_blocks"] == 0, timeout=10)
            cbufs: list = []
            commit = {
                "partition": "p",
                "keys": ["late"],
                "mode": "put",
                "blocks": [[0, stored.block, 1]],
                "fields": {
                    "x": {
                        "schema": ["tensor", "int64", []],
                        "row_nbytes": protocol.pack_array(np.array([8], dtype=np.int64), cbufs),
                        "arena_offsets": protocol.pack_array(np.array([stored.starts["x"]], dtype=np.int64), cbufs),
                    }
                },
            }
            with pytest.raises(FencedCommitError, match=f"block {stored.block} of storage unit 0 (was reclaimed|is settled)"):
                c._ctrl.call("commit", commit, cbufs)
            with pytest.raises(KeyNotFoundError):
                c.get_meta("p", ["late"])
            assert torch.equal(c.get(kept, ["x"])["x"], torch.tensor([5]))  # claimed: not reclaimed

            # A commit retried as a client whose reply was lost would: answered again, applied once,
            # and never resurrecting its keys once they were discarded.
            bufs = []
            spec["row_offsets"] = protocol.pack_array(np.array([0, 8], dtype=np.int64), bufs)
            spec["data"] = protocol.pack_array(np.array([42], dtype=np.int64).view(np.uint8), bufs)
            stored, _ = unit.call("store", {"n_rows": 1, "fields": {"x": spec}}, bufs)
            commit["keys"], commit["blocks"] = ["twice"], [[0, stored.block, 1]]
            cbufs = []
            commit["fields"]["x"]["row_nbytes"] = protocol.pack_array(np.array([8], dtype=np.int64), cbufs)
            commit["fields"]["x"]["arena_offsets"] = protocol.pack_array(np.array([stored.starts["x"]], dtype=np.int64), cbufs)
            first, _ = c._ctrl.call("commit", commit, cbufs)
            again, _ = c._ctrl.call("commit", commit, cbufs)
            assert first.duplicate is False and again.duplicate is True
            meta = c.get_meta("p", ["twice"])
            assert torch.equal(c.get(meta, ["x"])["x"], torch.tensor([42]))
            c.discard(meta)
            time.sleep(1.5)  # the block is freed and settled at the unit
            late, _ = c._ctrl.call("commit", commit, cbufs)
            assert late.duplicate is True
            with pytest.raises(KeyNotFoundError):
                c.get_meta("p", ["twice"])
            assert c.stats()["unit_stats"][0]["blocks"] == 1  # only 'kept'
        finally:
            c.close()


def test_a_units_restart_does_not_restart_the_commit_lease_of_its_tentative_blocks():
    """A block whose writer died before committing is asked about once its commit lease (counted from
    its store) runs out, however often its unit is restarted meanwhile. Before, a restarted unit gave
    each tentative block (and slab, and allocation) a fresh lease, so a unit killed more often than a
    lease is long never asked: its low-water mark stood still and the controller's ledger of the
    blocks above it grew for the whole run (the chaos benchmark's +20% service RSS)."""
    lease = 5.0
    with TQServer(storage_units=1, capacity=8 << 20, commit_lease_s=lease) as server:
        c = TQClient(server.address, timeout=10.0, transport="tcp")
        try:
            bufs: list = []
            spec = {
                "schema": ["tensor", "int64", []],
                "row_offsets": protocol.pack_array(np.array([0, 8], dtype=np.int64), bufs),
                "data": protocol.pack_array(np.arange(1, dtype=np.int64).view(np.uint8), bufs),
            }
            stored, _ = c._unit_chans[0].call("store", {"n_rows": 1, "fields": {"x": spec}}, bufs)  # then the writer "dies"
            stored_at = time.monotonic()
            old = c.stats()["units"][0]
            time.sleep(lease / 2)
            os.kill(old["pid"], signal.SIGKILL)
            assert wait_until(lambda: (u := c.stats()["units"][0])["pid"] != old["pid"] and u["alive"], timeout=15)
            back_at = time.monotonic()
            assert c.stats()["unit_stats"][0]["tentative_blocks"] == 1  # recovered, still waiting for its commit
            assert wait_until(lambda: c.stats()["unit_stats"][0]["blocks"] == 0, timeout=2 * lease)
            freed_at = time.monotonic()
            # asked at the first heartbeats past the original deadline (a fresh lease: back_at + lease)
            assert freed_at - max(back_at, stored_at + lease) < 2.5, (freed_at - stored_at, back_at - stored_at)
            assert wait_until(lambda: c.stats()["unit_ledgers"]["0"]["low_water"] > stored.block, timeout=3)
        finally:
            c.close()


def test_allocation_being_filled_survives_a_unit_restart_and_is_not_handed_out_again():
    """A same-host writer allocates a range and is filling it when its storage unit is SIGKILLed and
    restarted. The restarted unit still holds the allocation (journaled), so puts made meanwhile never
    get that range - before, they did and the slow writer's bytes would overwrite theirs - and the
    writer's store at the unit's new address succeeds and commits."""
    with TQServer(storage_units=1, capacity=8 << 20) as server:
        c = TQClient(server.address, timeout=10.0)
        try:
            c.register_partition("p")
            nbytes = 64 << 10
            alloc, _ = c._unit_chans[0].call("alloc", {"nbytes": nbytes})
            old = c.stats()["units"][0]
            os.kill(old["pid"], signal.SIGKILL)
            assert wait_until(lambda: (u := c.stats()["units"][0])["pid"] != old["pid"] and u["alive"], timeout=15)
            c._refresh_units()
            assert c.stats()["unit_stats"][0]["pending_allocs"] == 1
            others = [c.put("p", [f"o{i}"], {"x": torch.full((1, nbytes // 4), float(i))}) for i in range(6)]
            located, msg = c._ctrl.call("locate", {"partition": "p", "keys": [m.keys[0] for m in others], "fields": ["x"]})
            loc = protocol.unpack_array(located.loc, msg.buffers)[0]
            lo, hi = alloc.offset, alloc.offset + nbytes
            assert not any(o < hi and o + n > lo for o, n in zip(loc[:, 4].tolist(), loc[:, 3].tolist())), "range handed out again"
            mine = torch.full((1, nbytes // 4), -1.0)
            c._arena(0).view[lo:hi] = mine.view(torch.uint8).numpy().ravel()  # the writer finishes its copy
            bufs: list = []
            spec = {
                "schema": ["tensor", "float32", [nbytes // 4]],
                "offset": 0,
                "row_offsets": protocol.pack_array(np.array([0, nbytes], dtype=np.int64), bufs),
            }
            stored, _ = c._unit_chans[0].call("store", {"n_rows": 1, "fields": {"x": spec}, "alloc": alloc.alloc}, bufs)
            cbufs: list = []
            c._ctrl.call(
                "commit",
                {
                    "partition": "p",
                    "keys": ["slow"],
                    "mode": "put",
                    "blocks": [[0, stored.block, 1]],
                    "fields": {
                        "x": {
                            "schema": spec["schema"],
                            "row_nbytes": protocol.pack_array(np.array([nbytes], dtype=np.int64), cbufs),
                            "arena_offsets": protocol.pack_array(np.array([lo], dtype=np.int64), cbufs),
                        }
                    },
                },
                cbufs,
            )
            assert torch.equal(c.get(c.get_meta("p", ["slow"]), ["x"])["x"], mine)
            for i, m in enumerate(others):
                assert torch.equal(c.get(m, ["x"])["x"], torch.full((1, nbytes // 4), float(i)))
        finally:
            c.close()


def test_a_second_unit_process_can_never_take_over_a_live_units_arena():
    """Two unit processes on one arena would journal and free behind each other's back (a chaos run
    lost an acknowledged write this way: a controller killed while a unit it had restarted was
    rejoining, and its next incarnation restarted the unit a second time). The owner holds a lock:
    a second process started on the arena refuses to run, and the owner keeps serving, intact."""
    with TQServer(storage_units=1, capacity=8 << 20) as server:
        c = TQClient(server.address, timeout=10.0, transport="tcp")
        try:
            c.register_partition("p")
            meta = c.put("p", ["a"], {"x": torch.arange(5).reshape(1, 5)})
            owner = c.stats()["units"][0]
            second = subprocess.run(
                launch.storage_unit_command(
                    unit_id=0,
                    bind="tcp://127.0.0.1:0",
                    controller=server.address,
                    capacity=8 << 20,
                    shm_dir="/dev/shm",
                    recover_arena=owner["arena_path"],
                    rejoin=0,
                ),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert second.returncode != 0 and "in use by another storage-unit process" in second.stderr
            assert os.path.exists(owner["arena_path"]) and os.path.exists(owner["arena_path"] + ".journal")
            now = c.stats()["units"][0]
            assert now["pid"] == owner["pid"] and now["address"] == owner["address"]
            assert torch.equal(c.get(meta, ["x"])["x"], torch.arange(5).reshape(1, 5))
        finally:
            c.close()


def test_journal_stays_compact_under_a_long_run_of_puts_and_discards(tmp_path):
    """A controller journal that only sees puts and discards (no partition created or cleared) is
    compacted too, so a restart replays a bounded journal: before, it grew without bound (a 10-minute
    chaos run left 28,000 records and restarts took up to 6 s). A fenced request id survives the
    compaction (tq.request_book)."""
    from tq import messages
    from tq.controller import COMPACT_AFTER
    from tq.journal import Journal

    port = free_port()
    state = tmp_path / "state"
    server = TQServer(port=port, storage_units=1, capacity=16 << 20, journal_dir=str(state))
    c = TQClient(server.address, timeout=10.0)
    again = None
    try:
        c.register_partition("p")
        kept = c.put("p", ["kept"], {"x": torch.tensor([7])})
        assert c._ctrl.call("abort_requests", messages.AbortRequests(ids=[99]))[0].applied == [None]  # a fenced discard
        for i in range(COMPACT_AFTER + 300):  # over 2 * COMPACT_AFTER records (a commit and a discard each)
            c.discard(c.put("p", [f"k{i}"], {"x": torch.tensor([i])}))
        records = sum(1 for _ in Journal.replay(str(state / "controller.journal")))
        assert records <= 2 * COMPACT_AFTER, records
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        again = TQServer(port=port, storage_units=1, capacity=16 << 20, journal_dir=str(state))
        assert c.get_meta("p").keys == ("kept",)
        assert torch.equal(c.get(kept, ["x"])["x"], torch.tensor([7]))
        # the request book came back from the snapshot (and the records after it): the fence holds
        with pytest.raises(InvalidRequestError, match="given up on by its client"):
            c._ctrl.call("discard", messages.Discard(partition="p", keys=["kept"], request_id=99))
        assert c.get_meta("p").keys == ("kept",)
    finally:
        c.close()
        for s in (again, server):
            if s is not None:
                s.shutdown()


def test_a_controller_restarted_before_each_compaction_still_compacts_its_journal(tmp_path):
    """Killed and restarted every 1,200 journaled changes (under COMPACT_AFTER each time), the
    controller still compacts: the count towards the next compaction goes on from the records its
    restart replayed. Before, each restart counted from zero - a chaos run whose controller was
    killed every few seconds grew its journal to 5.6 MB, and a restart to 3.1 s."""
    from tq.controller import COMPACT_AFTER
    from tq.journal import Journal

    port = free_port()
    state = tmp_path / "state"
    servers = [TQServer(port=port, storage_units=1, capacity=16 << 20, journal_dir=str(state))]
    c = TQClient(servers[0].address, timeout=10.0)
    unit_pids = [u["pid"] for u in c.stats()["units"]]  # they outlive each killed controller
    try:
        c.register_partition("p")
        meta = c.put("p", ["k"], {"x": torch.tensor([1])})
        for life in range(4):
            for i in range(1200):  # one journal record each
                c.set_tags(meta.stamp_tags(step=[life * 1200 + i]))
            os.kill(servers[-1].proc.pid, signal.SIGKILL)
            servers[-1].proc.wait(10)
            servers.append(TQServer(port=port, storage_units=1, capacity=16 << 20, journal_dir=str(state)))
        records = sum(1 for _ in Journal.replay(str(state / "controller.journal")))
        assert records <= COMPACT_AFTER, records  # 4,800 changes: 4,803 records without a compaction
        assert c.get_meta("p").tags == {"step": (4799,)}
        assert torch.equal(c.get(meta, ["x"])["x"], torch.tensor([1]))
    finally:
        c.close()
        shut_down(tuple(reversed(servers)), unit_pids)


def test_frees_leave_the_controller_only_after_the_op_that_freed_them_is_journaled(tmp_path, loopback):
    """A controller killed between telling a unit to free a discarded key's rows and journaling the
    discard came back with the key pointing at freed, reused rows (5 wrong-bytes reads in a chaos
    run). The frees now wait for the journal: a unit (a plain socket here) hears nothing while the
    discard is applied but not yet journaled, and the free_rows once it is."""
    import msgspec

    from tq.journal import Journal

    ctrl = loopback.start(journal_dir=str(tmp_path), shm_dir=None)

    def heard() -> list[str]:
        return loopback.heard(ignore=("ping",))  # heartbeats aside

    def journaled() -> list[str]:
        return [op for op, _, _ in Journal.replay(str(tmp_path / "controller.journal"))]

    try:
        loopback.commit_two_rows(ctrl, tick=False)
        ctrl.on_tick(time.monotonic())  # the loop's tick, after every journaled op
        assert heard() == ["claim"]

        ctrl.handle("discard", {"partition": "p", "keys": ["a"]}, [], loopback.call)  # applied, not journaled yet
        assert heard() == [] and "discard" not in journaled()
        ctrl.on_applied("discard", msgspec.msgpack.encode({"partition": "p", "keys": ["a"]}), [])
        ctrl.on_tick(time.monotonic())
        assert heard() == ["free_rows"] and journaled()[-1] == "discard"
    finally:
        ctrl.close()


def test_a_location_table_that_cannot_grow_refuses_the_write_and_the_controller_serves_on():
    """A put of fields new to the partition needs columns of its location table (shared memory).
    Past the controller's file size limit (``ulimit -f``; the full-disk fault of these tests sets it on
    the whole process) that column cannot be made: the put is refused as CapacityError naming the
    limit, before anything changed - its key absent, the controller serving on - and lands once the
    limit is lifted. Before, the bare OSError reached the serving loop's catch-all (an internal
    error), found by the model-based crash test."""
    import resource

    from tq.errors import CapacityError

    with TQServer(storage_units=1, capacity=16 << 20) as srv, TQClient(srv.address, timeout=10.0) as c:
        c.register_partition("p")
        c.put("p", ["a"], {"x": torch.ones(1, 4)})
        wide = {f"y{i}": torch.full((1, 4), float(i)) for i in range(32)}
        resource.prlimit(srv.proc.pid, resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        try:
            with pytest.raises(CapacityError, match="file size limit"):
                c.put("p", ["b"], wide)  # more new fields than the table has columns for
            assert list(c.get_meta("p").keys) == ["a"] and srv.proc.poll() is None
        finally:
            room_to_grow(srv.proc.pid)
        meta = c.put("p", ["b"], wide)
        assert c.get(meta, ["y31"])["y31"].tolist() == [[31.0] * 4]


def test_a_controller_that_cannot_journal_a_change_stops_before_anything_else_sees_it(tmp_path):
    """The controller's journal cannot grow (a full disk). The change it could not journal was applied
    in memory; serving on let later journaled ops build on it (a discard of the unjournaled key, once
    the disk had room, made the restarted controller fail to replay its journal at all) and would send
    its frees to the units. So the writer gets a JournalError and the controller exits at once - no
    other request served, nothing sent - leaving its units running, as after a crash; restarted on the
    same dir it has every acknowledged key, bit-exact, and not the failed one."""
    from tq.errors import JournalError

    port, state = free_port(), tmp_path / "state"

    def start() -> TQServer:
        return TQServer(port=port, storage_units=1, capacity=32 << 20, journal_dir=str(state))

    servers = [start()]
    c = TQClient(servers[0].address, timeout=10.0, transport="tcp")
    unit_pids: list[int] = []
    try:
        c.register_partition("p")
        unit_pids = [u["pid"] for u in c.stats()["units"]]
        acked = {f"a{i}": torch.full((1, 4), float(i)) for i in range(3)}
        for k, v in acked.items():
            c.put("p", [k], {"x": v})
        no_room_to_grow(servers[0].proc.pid, state / "controller.journal")
        with pytest.raises(JournalError, match="could not journal 'commit'"):
            c.put("p", ["b"], {"x": torch.ones(1, 4)})
        assert servers[0].proc.wait(10) != 0  # stopped by itself, serving nothing more
        assert all(pid_alive(p) for p in unit_pids)  # its units outlive it, as after a crash

        servers.append(start())
        assert sorted(c.get_meta("p").keys) == sorted(acked)  # not "b"
        for k, v in acked.items():
            assert torch.equal(c.get(c.get_meta("p", [k]), ["x"])["x"], v)
        c.put("p", ["b"], {"x": torch.zeros(1, 4)})  # the name is free: the failed put never happened
        c.discard(c.get_meta("p", ["b", "a0"]))
        os.kill(servers[-1].proc.pid, signal.SIGKILL)  # and the journal replays again
        servers[-1].proc.wait(10)
        servers.append(start())
        assert sorted(c.get_meta("p").keys) == ["a1", "a2"]
        assert torch.equal(c.get(c.get_meta("p", ["a2"]), ["x"])["x"], acked["a2"])
    finally:
        c.close()
        shut_down(reversed(servers), unit_pids)


def test_a_storage_unit_that_cannot_journal_stops_and_comes_back_on_its_arena():
    """A storage unit whose journal cannot grow fails the request that needed it (StorageUnitError
    naming the journal) and exits as if it had crashed just before writing - arena and journal left
    in place - instead of serving on with changes a restart would not know (an arena range freed in
    memory only, say, is double-booked after a restart). Its controller restarts it on its arena:
    every acknowledged key reads back exactly, the failed put's key is absent, and puts work again."""
    with TQServer(storage_units=1, capacity=32 << 20) as server, TQClient(server.address, timeout=10.0, transport="tcp") as c:
        c.register_partition("p")
        acked = {f"a{i}": torch.full((2, 3), float(i)) for i in range(3)}
        for k, v in acked.items():
            c.put("p", [k, k + "'"], {"x": v})
        assert wait_until(lambda: c.stats()["unit_stats"][0]["tentative_blocks"] == 0)  # their claims journaled
        old = c.stats()["units"][0]
        no_room_to_grow(old["pid"], old["arena_path"] + ".journal")
        with pytest.raises(StorageUnitError, match="could not journal"):
            c.put("p", ["b", "b'"], {"x": torch.ones(2, 3)})  # a TCP put: the unit journals the stored block
        assert wait_until(lambda: (u := c.stats()["units"][0])["pid"] != old["pid"] and u["alive"], timeout=15)
        assert sorted(c.get_meta("p").keys) == sorted(k for a in acked for k in (a, a + "'"))
        for k, v in acked.items():
            assert torch.equal(c.get(c.get_meta("p", [k, k + "'"]), ["x"])["x"], v)
        c.put("p", ["b", "b'"], {"x": torch.zeros(2, 3)})
        assert torch.equal(c.get(c.get_meta("p", ["b", "b'"]), ["x"])["x"], torch.zeros(2, 3))


def test_a_parked_write_that_cannot_journal_when_room_frees_stops_its_unit_too():
    """A TCP write parked at a full unit is stored at the unit's tick once a discard frees room - not
    while a request is served. Its journal record failing there was answered with an OSError message
    and the unit served on with a stored block its journal lacked; now the unit stops and is restarted
    on its arena, as for a request (the journal may still take the discard's small free record, not
    the store's), and the writer gets the StorageUnitError naming the journal - or, when it sees the
    restart first, stores its batch again on the restarted unit."""
    with TQServer(storage_units=1, capacity=1 << 20) as server:
        c = TQClient(server.address, timeout=15.0, transport="tcp")
        patient = TQClient(server.address, timeout=15.0, transport="tcp", capacity_wait_s=10.0)
        try:
            c.register_partition("p")
            first = torch.randint(0, 255, (1, 600 << 10), dtype=torch.uint8)
            meta = c.put("p", ["first"], {"x": first})
            kept = c.put("p", ["kept"], {"k": torch.arange(5)[None]})
            old = c.stats()["units"][0]
            journal = old["arena_path"] + ".journal"
            assert wait_until(lambda: c.stats()["unit_stats"][0]["tentative_blocks"] == 0)  # the puts' claims journaled
            done: dict = {}
            second = {"x2": first[:, : 500 << 10], "y": [torch.arange(7)], "z": ["seven"]}

            def write() -> None:
                try:
                    done["meta"] = patient.put("p", ["second"], second)
                except TQError as exc:
                    done["error"] = exc

            writer = threading.Thread(target=write)
            writer.start()
            assert wait_until(lambda: c.stats()["unit_stats"][0]["parked_writes"] == 1, timeout=5)
            no_room_to_grow(old["pid"], journal, spare=48)  # room for a free record, not for a store's
            c.discard(meta)  # room frees: the parked write is retried at the unit's tick
            writer.join(15)
            assert wait_until(lambda: (u := c.stats()["units"][0])["pid"] != old["pid"] and u["alive"], timeout=15)
            assert torch.equal(c.get(kept, ["k"])["k"], torch.arange(5)[None])
            if "error" in done:  # told of the failed write
                assert isinstance(done["error"], StorageUnitError) and "could not journal" in str(done["error"]), done
                assert sorted(c.get_meta("p").keys) == ["kept"]
            else:  # or, seeing its unit restarted before that reply, stored it again there: it landed whole
                got = c.get(done["meta"], layout="list")
                assert torch.equal(got["x2"][0], second["x2"][0]) and torch.equal(got["y"][0], second["y"][0]) and got["z"] == ["seven"]
        finally:
            patient.close()
            c.close()


def test_a_storage_unit_failing_on_a_bug_keeps_its_data_for_its_restart(tmp_path, monkeypatch):
    """A managed storage unit whose loop raises (a bug, not a shutdown) exits as a crashed one would,
    arena and journal in place, and its controller restarts it on them: every acknowledged key reads
    back exactly. (It used to clean up as on a shutdown - removing the arena - so the controller found
    nothing to restart it on and every key it held was lost.)"""
    arm, fired = inject_bug(monkeypatch, tmp_path, "StorageUnit")
    with TQServer(storage_units=1, capacity=32 << 20) as server:
        c = TQClient(server.address, timeout=10.0)
        tcp = TQClient(server.address, timeout=10.0, transport="tcp")
        try:
            c.register_partition("p")
            acked = {f"a{i}": torch.full((2, 3), float(i)) for i in range(4)}
            metas = {k: (c if i % 2 else tcp).put("p", [k, k + "'"], {"x": v}) for i, (k, v) in enumerate(acked.items())}
            old = c.stats()["units"][0]
            open(arm, "w").close()
            assert wait_until(lambda: os.path.exists(fired), timeout=10)
            assert wait_until(lambda: not pid_alive(old["pid"]), timeout=10)
            assert wait_until(lambda: (u := c.stats()["units"][0])["pid"] != old["pid"] and u["alive"], timeout=15), c.stats()["units"]
            for client in (c, tcp):
                for k, v in acked.items():
                    assert torch.equal(client.get(metas[k])["x"], v)
            assert torch.equal(c.get(c.put("p", ["b"], {"x": torch.ones(1, 3)}))["x"], torch.ones(1, 3))
        finally:
            c.close()
            tcp.close()


def test_a_journaled_controller_failing_on_a_bug_leaves_its_units_running_for_its_restart(tmp_path, monkeypatch):
    """A controller with a journal whose loop raises exits as a crashed one would: its storage units
    keep running with their data (it used to stop them on the way out, and they removed their
    arenas), and the controller started again on the same journal takes them back - every acknowledged
    key reads back exactly from the same unit processes."""
    arm, fired = inject_bug(monkeypatch, tmp_path, "Controller")
    port, state = free_port(), str(tmp_path / "state")
    first = TQServer(port=port, storage_units=2, capacity=32 << 20, journal_dir=state)
    second = None
    c = TQClient(first.address, timeout=10.0)
    try:
        c.register_partition("p")
        acked = {f"a{i}": torch.full((3, 2), float(i)) for i in range(4)}
        metas = {k: c.put("p", [k, k + "'", k + "''"], {"x": v}) for k, v in acked.items()}
        units = c.stats()["units"]
        open(arm, "w").close()
        assert first.proc.wait(15) != 0 and os.path.exists(fired)
        time.sleep(0.5)  # a unit being stopped would be gone by now
        assert all(pid_alive(u["pid"]) and os.path.exists(u["arena_path"]) for u in units)
        second = TQServer(port=port, storage_units=2, capacity=32 << 20, journal_dir=state)
        for k, v in acked.items():
            assert torch.equal(c.get(metas[k])["x"], v)
        assert sorted(u["pid"] for u in c.stats()["units"]) == sorted(u["pid"] for u in units)
    finally:
        c.close()
        for server in (second, first):
            if server is not None:
                server.shutdown()


_PAUSED_WRITER = """
import os, signal, sys
import torch
import tq.client
from tq import TQClient

c = TQClient(sys.argv[1], timeout=30.0)
tag = sys.argv[2]
c.put("p", ["warm" + tag], {"w": torch.zeros(1, 4096, dtype=torch.uint8)})  # this client's slab on the unit
real = tq.client.write_chunks

def paused(*args, **kwargs):  # the process is stopped after it carved its block, before it copies
    print("carved", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    return real(*args, **kwargs)

tq.client.write_chunks = paused
try:
    c.put("p", ["late" + tag], {"x": torch.full((1, 256 << 10), 0xAA, dtype=torch.uint8)})
    print("late put acknowledged", flush=True)
except Exception as exc:
    print(f"late put failed: {type(exc).__name__}: {exc}", flush=True)
c.close()
"""


def _held_bytes(c: TQClient) -> int:
    return c.stats()["unit_stats"][0]["held_bytes"]


def _paused_writer(address: str, tag: str, pid_namespace_start: int | None = None) -> tuple[subprocess.Popen, int]:
    """A writer process stopped after carving its block for key ``late<tag>``, before copying into it
    (in a pid namespace of its own numbered from ``pid_namespace_start``, when given); and its pid here."""
    writer = subprocess.Popen(python_command(_PAUSED_WRITER, [address, tag], pid_namespace_start), stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "carved"
    pid = python_pid(writer)
    assert wait_until(lambda: process_state(pid) == "T")
    return writer, pid


@pytest.mark.parametrize("namespace", ["same", "own"], ids=["same-pid-namespace", "other-pid-namespace"])
def test_a_writer_paused_past_its_allocation_lease_never_writes_into_another_keys_bytes(namespace):
    """A same-host writer carves a block out of its slab and is stopped (SIGSTOP: a debugger, a
    frozen cgroup, a VM pause) before it copies, for longer than the unit's allocation lease. Its
    unit used to give the slab's range to the next put once the lease ran out, and the writer's copy
    on waking landed in that other key's bytes - which its reader then got (seen: 0xAA in a key
    written 0x55). The lease is for writers that are gone: the range of a writer whose process lives
    is held until it says it is done (its next allocation, or close) or exits. Its late commit is
    refused (its block was fenced with the lease), so its key stays absent. A writer in another pid
    namespace sharing /dev/shm (a container of the same pod) is told alive by the lock it holds on
    its liveness file: by its pid, which names no process of the unit's namespace, its range was
    freed under it."""
    start = pid_namespace_start() if namespace == "own" else None
    if namespace == "own" and start is None:
        pytest.skip("cannot make a pid namespace here (needs root and util-linux's unshare)")
    with TQServer(storage_units=0) as server:
        unit, info = _start_unit(server.address, alloc_lease=1.0)
        c = TQClient(server.address, timeout=10.0, transport="tcp")  # no slab of its own: only the writers' are held
        writers: list[subprocess.Popen] = []
        try:
            c.register_partition("p")
            writer, pid = _paused_writer(server.address, "0", start)
            writers.append(writer)
            # past its lease (1 s) the unit holds the range for the live writer (a gone one's is freed)
            assert wait_until(lambda: _held_bytes(c) > 0, timeout=10)
            victim = c.put("p", ["victim"], {"v": torch.full((1, 1 << 20), 0x55, dtype=torch.uint8)})
            os.kill(pid, signal.SIGCONT)
            out, _ = writers[0].communicate(timeout=30)
            assert torch.equal(c.get(victim)["v"], torch.full((1, 1 << 20), 0x55, dtype=torch.uint8)), out
            assert "late put failed: FencedCommitError" in out, out
            assert sorted(c.get_meta("p").keys) == ["victim", "warm0"]
            assert wait_until(lambda: _held_bytes(c) == 0), "the writer's close did not release its range"
            # a paused writer that is killed instead: its range is freed once the unit sees it gone
            writer, pid = _paused_writer(server.address, "1", start)
            writers.append(writer)
            assert wait_until(lambda: _held_bytes(c) > 0, timeout=10)
            os.kill(pid, signal.SIGKILL)
            writers[1].wait(10)
            assert wait_until(lambda: _held_bytes(c) == 0, timeout=10), "a dead writer's range stayed held"
        finally:
            c.close()
            for w in writers:
                if w.poll() is None:
                    w.kill()
            server.shutdown()
            launch.stop_process(unit, 10.0)  # SIGTERM first: the unit removes its arena (a SIGKILL left it in /dev/shm)
            assert not os.path.exists(info["arena_path"])


def _controller_channel(address: str, timeout: float = 10.0):
    from tq import messages
    from tq.rpc import RpcChannel

    return RpcChannel(address, secret=None, timeout=timeout, name="controller", replies=messages.CONTROLLER_REPLY_DECODERS)


def test_a_request_sent_again_is_answered_again_and_one_its_client_fenced_is_dropped(tmp_path):
    """A request id settles a discard, clear, drop, create, mint or set_tags across a lost reply and a
    controller crash: the same request again (a resend across a network cut) is answered as the first
    time, not refused for what it did itself; once its client fenced it (abort_requests), a copy that
    arrives late is dropped and nothing changes; the fences and the applied ids survive a crash
    (journaled)."""
    from tq import messages
    from tq.errors import InvalidRequestError

    port = free_port()
    state = str(tmp_path / "state")
    first = TQServer(port=port, storage_units=1, capacity=16 << 20, journal_dir=state)
    second = None
    c = TQClient(first.address, timeout=10.0, transport="tcp")
    chan = _controller_channel(first.address)
    unit_pids = [u["pid"] for u in c.stats()["units"]]

    def call(op: str, args) -> object:
        return chan.call(op, args)[0]

    def discard(keys: list[str], rid: int) -> object:
        return call("discard", messages.Discard(partition="p", keys=keys, request_id=rid))

    try:
        for pid in ("p", "q", "r"):
            c.register_partition(pid)
        c.put("p", ["a", "b", "c"], {"x": torch.arange(6.0).reshape(3, 2)})
        c.put("q", ["a"], {"x": torch.ones(1, 2)})
        c.put("r", ["a"], {"x": torch.ones(1, 2)})
        assert (discard(["a"], 11).discarded, discard(["a"], 11).duplicate) == (1, True)  # without the id: KeyNotFoundError
        cleared = [call("clear_partition", messages.ClearPartition(partition="q", request_id=21)) for _ in range(2)]
        assert [(r.keys_cleared, r.duplicate) for r in cleared] == [(1, False), (1, True)]
        dropped = [call("drop_partition", messages.DropPartition(partition="q", request_id=31)) for _ in range(2)]
        assert [(r.keys_cleared, r.duplicate) for r in dropped] == [(0, False), (0, True)]  # not PartitionNotFoundError
        made = [call("create_partition", messages.CreatePartition(partition="s", request_id=41)) for _ in range(2)]
        assert [(r.reused, r.duplicate) for r in made] == [(False, False), (False, True)]  # not PartitionExistsError
        minted = [call("mint", messages.Mint(partition="s", keys=["m"], request_id=51)) for _ in range(2)]
        assert [(r.minted, r.duplicate) for r in minted] == [(1, False), (1, True)]  # not DuplicateKeyError
        tagged = [call("set_tags", messages.SetTags(partition="s", keys=["m"], tags={"t": [1]}, request_id=61)) for _ in range(2)]
        assert [(r.keys, r.duplicate) for r in tagged] == [(1, False), (1, True)]
        fenced = call("abort_requests", messages.AbortRequests(ids=[11, 12, 22, 42, 52, 62]))
        # 11 had been applied (freeing 1 key); the rest never were, and never will be
        assert fenced.applied == [1, None, None, None, None, None]
        late = [
            ("discard", messages.Discard(partition="p", keys=["b"], request_id=12)),
            ("clear_partition", messages.ClearPartition(partition="r", request_id=22)),
            ("create_partition", messages.CreatePartition(partition="r", reuse=True, request_id=42)),
            ("mint", messages.Mint(partition="s", keys=["late"], request_id=52)),
            ("set_tags", messages.SetTags(partition="s", keys=["m"], tags={"t": [0]}, request_id=62)),
        ]
        for op, args in late:  # the late copies of the fenced requests
            with pytest.raises(InvalidRequestError, match="given up on by its client"):
                call(op, args)
        assert sorted(c.get_meta("p").keys) == ["b", "c"] and c.get_meta("r").keys == ("a",)
        assert c.get_meta("s").keys == ("m",) and c.get_meta("s").tags == {"t": (1,)}
        os.kill(first.proc.pid, signal.SIGKILL)  # the journal holds every id: a restart keeps them
        first.proc.wait(10)
        second = TQServer(port=port, storage_units=1, capacity=16 << 20, journal_dir=state)
        for op, args in late:
            with pytest.raises(InvalidRequestError, match="given up on by its client"):
                call(op, args)
        assert discard(["a"], 11).duplicate and call("drop_partition", messages.DropPartition(partition="q", request_id=31)).duplicate
        assert call("abort_requests", messages.AbortRequests(ids=[11, 21, 51, 61])).applied == [1, 1, 1, 1]
        assert torch.equal(c.get(c.get_meta("p", ["b", "c"]), ["x"])["x"], torch.tensor([[2.0, 3.0], [4.0, 5.0]]))
        assert c.get_meta("r").keys == ("a",)
        assert c.get_meta("s").keys == ("m",) and c.get_meta("s").tags == {"t": (1,)}
    finally:
        chan.close()
        c.close()
        shut_down((second, first), unit_pids)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_put_whose_outcome_is_unknown_is_settled_before_the_clients_next_request(transport):
    """A put's commit and the probe after it get no reply (in a network cut: the probe lost, the commit
    retransmitted later - here the test holds both back): the put raises saying its outcome is
    unknown, and the client's next request fences its blocks first - so the commit reaching the
    controller after that is refused, and the key never appears. Before, such a commit was applied
    whenever it came within the blocks' 30 s commit lease: a key listed absent, then present."""
    from tq.errors import TQError

    with TQServer(storage_units=1, capacity=16 << 20) as server:
        c = TQClient(server.address, timeout=1.0, transport=transport)
        held: list = []
        chan = _controller_channel(server.address)
        try:
            c.register_partition("p")
            meta_a = c.put("p", ["a"], {"x": torch.ones(1, 4)})
            assert torch.equal(c.get(meta_a, ["x"])["x"], torch.ones(1, 4))  # (same host: maps the location table)
            real_call = c._ctrl.call

            def held_back(op, args, *a, **kw):
                if op == "commit" or (op == "abort_blocks" and not probed):
                    probed.extend([True] if op == "abort_blocks" else [])  # the probe is lost, the commit held
                    held.append((args, a[0] if a else kw.get("buffers", ())))
                    raise TQConnectionError(f"no reply from controller to {op!r} (held back by this test)")
                return real_call(op, args, *a, **kw)

            probed: list = []
            c._ctrl.call = held_back
            with pytest.raises(TQConnectionError, match="outcome of this put is unknown"):
                c.put("p", ["b"], {"x": torch.full((1, 4), 2.0)})
            assert probed == [True]
            if transport == "auto" and c._tables.get("p"):  # a same-host get asks the controller nothing,
                os.kill(server.proc.pid, signal.SIGSTOP)  # so it settles nothing: it reads while the controller is away
                try:
                    assert torch.equal(c.get(meta_a, ["x"])["x"], torch.ones(1, 4))
                finally:
                    os.kill(server.proc.pid, signal.SIGCONT)
            c.timeout = c._ctrl.timeout = 10.0
            assert c.get_meta("p").keys == ("a",)  # the client's next request
            args, buffers = held[0]
            assert held[1][0].blocks  # (the lost probe)
            with pytest.raises(TQError):
                chan.call("commit", args, buffers)  # the commit arriving at last
            assert c.get_meta("p").keys == ("a",)
            c._ctrl.call = real_call
            c.put("p", ["b"], {"x": torch.full((1, 4), 3.0)})  # written again: its own bytes
            assert torch.equal(c.get(c.get_meta("p", ["b"]), ["x"])["x"], torch.full((1, 4), 3.0))
        finally:
            chan.close()
            c.close()


@pytest.mark.parametrize("settled_by", ["next request", "close"])
def test_a_discard_whose_outcome_is_unknown_is_settled_before_the_clients_next_request(settled_by):
    """A discard and the probe after it get no reply (in a network cut: the probe lost, the discard
    retransmitted later - here the test holds both back): the discard raises saying its outcome is
    unknown, and the client's next request fences it first (or its close, if there is none) - so the
    request reaching the controller after that is dropped and the key stays (as
    tests/test_partition.py shows in a real cut)."""
    from tq import KVBatchMeta

    with TQServer(storage_units=1, capacity=16 << 20) as server:
        c = TQClient(server.address, timeout=1.0, transport="tcp")
        held: list = []
        chan = _controller_channel(server.address)
        try:
            c.register_partition("p")
            c.put("p", ["a", "b"], {"x": torch.ones(2, 4)})
            real_call = c._ctrl.call

            def held_back(op, args, *a, **kw):
                if op == "discard" or (op == "abort_requests" and len(held) == 1):
                    held.append(args)
                    raise TQConnectionError(f"no reply from controller to {op!r} (held back by this test)")
                return real_call(op, args, *a, **kw)

            c._ctrl.call = held_back
            with pytest.raises(TQConnectionError, match="outcome of this discard is unknown"):
                c.discard(KVBatchMeta("p", ("a",)))
            assert len(held) == 2  # the discard and its lost probe
            if settled_by == "close":
                c.close()
                c = TQClient(server.address, timeout=10.0, transport="tcp")
            else:
                assert sorted(c.get_meta("p").keys) == ["a", "b"]  # the client's next request
            with pytest.raises(InvalidRequestError, match="given up on by its client"):
                chan.call("discard", held[0])  # the request arriving at last
            assert sorted(c.get_meta("p").keys) == ["a", "b"]
            assert torch.equal(c.get(c.get_meta("p", ["a"]), ["x"])["x"], torch.ones(1, 4))
        finally:
            chan.close()
            c.close()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_mint_applied_whose_reply_was_lost_returns_a_meta_its_keys_are_written_through(transport):
    """A register_keys applied by the controller whose reply is lost: its probe finds it applied, so the
    call returns a meta as the mint sent again would get it - without slots, its keys found by name -
    and write_back and get work on it (neither a raise for a mint that took effect nor a
    DuplicateKeyError when the caller tries again)."""
    with TQServer(storage_units=1, capacity=16 << 20) as server:
        c = TQClient(server.address, timeout=2.0, transport=transport)
        try:
            c.register_partition("p")
            real_call = c._ctrl.call

            def reply_lost(op, args, *a, **kw):
                reply = real_call(op, args, *a, **kw)
                if op == "mint":
                    raise TQConnectionError("no reply from controller to 'mint' (lost by this test)")
                return reply

            c._ctrl.call = reply_lost
            meta = c.register_keys("p", ["a", "b"])
            c._ctrl.call = real_call
            assert meta.keys == ("a", "b") and meta.slots is None
            c.write_back(meta, {"x": torch.arange(8.0).reshape(2, 4)})
            assert torch.equal(c.get(meta, ["x"])["x"], torch.arange(8.0).reshape(2, 4))
            assert c.get_meta("p").keys == ("a", "b")
        finally:
            c.close()
