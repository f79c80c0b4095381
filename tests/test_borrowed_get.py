"""Borrowed (zero-copy) gets: read-only views of the storage arena, pinned by a controller lease."""

from __future__ import annotations

import gc
import threading
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tq import TQClient
from tq.jagged import JaggedTensor

from conftest import pid_namespace_start, process_state, python_command, python_pid, unique_keys, wait_until


def _batch(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 300, (n,), generator=g)
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    return {
        "tokens": JaggedTensor(torch.randint(0, 50_000, (int(offsets[-1]),), generator=g, dtype=torch.int32), offsets),
        "reward": torch.randn(n, generator=g),
        "note": [f"sample {seed}-{i}" for i in range(n)],
    }


def _stats_until(c: TQClient, pred, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = c.stats()
        if pred(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def _used(st: dict) -> int:
    return sum(u["bytes_live"] for u in st["unit_stats"])


def _settled(c: TQClient, timeout: float = 5.0) -> dict:
    """Stats once the units' bytes stopped changing for 0.2 s: frees an earlier test set off (a pin
    given up is polled, then its rows go out with the controller's next flush) have landed, so this
    test's byte counts move only with its own puts and discards."""
    deadline = time.monotonic() + timeout
    last = now = c.stats()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = c.stats()
        if _used(now) == _used(last) and not now["rows_waiting_for_leases"]:
            break
        last = now
    return now


def test_borrowed_views_keep_their_bytes_while_another_client_discards_and_reputs(tq_server, client, partition):
    keys = unique_keys(64)
    batch = _batch(64, seed=1)
    meta = client.put(partition, keys, batch)
    with TQClient(tq_server.address, timeout=10.0) as reader:
        got = reader.get(meta, copy=False, layout="jagged")
        assert got.viewed == {"tokens", "reward"}  # the object column is copied
        tokens, reward = got["tokens"], got["reward"]
        assert torch.equal(tokens.values, batch["tokens"].values) and torch.equal(reward, batch["reward"])
        rows = got["tokens"].unbind()
        del got
        for round_ in range(6):  # the same keys again and again, plus others, into the space just freed
            client.discard(meta)
            other = client.put(partition, unique_keys(64), _batch(64, seed=100 + round_))
            meta = client.put(partition, keys, _batch(64, seed=200 + round_))
            client.discard(other)
        assert torch.equal(tokens.values, batch["tokens"].values), "a borrowed view changed under its reader"
        assert torch.equal(reward, batch["reward"])
        assert all(torch.equal(r, e) for r, e in zip(rows, batch["tokens"].unbind()))
        # the re-put keys read back their own, new bytes
        fresh = reader.get(meta, layout="jagged")
        assert torch.equal(fresh["tokens"].values, _batch(64, seed=205)["tokens"].values)


def test_a_key_rewritten_inside_a_put_is_read_with_its_new_row(tq_server, client, partition):
    """One put lays its rows back to back (a run the reader reads by its offsets alone); a key in its
    middle rewritten since must come back with its new row, from views and from copies alike. An end
    to end guard of the bytes, which any correct read passes: what the run read itself does is pinned
    in tests/test_locations.py (test_rows_of_one_run_are_read_by_their_run_and_offset_words)."""
    keys = unique_keys(8)
    batch = _batch(8, seed=11)
    meta = client.put(partition, keys, batch)
    new_row = torch.arange(7, dtype=torch.int32) + 1000
    client.write_back(meta.select([3]), {"tokens": JaggedTensor(new_row, torch.tensor([0, 7]))}, overwrite=True)
    want = [*batch["tokens"].unbind()[:3], new_row, *batch["tokens"].unbind()[4:]]
    with TQClient(tq_server.address, timeout=10.0) as reader:
        copied = reader.get(meta, ["tokens", "reward"], layout="list")
        with reader.get(meta, ["tokens", "reward"], copy=False, layout="list") as viewed:
            for got in (copied, viewed):
                assert all(torch.equal(r, w) for r, w in zip(got["tokens"], want)) and len(got["tokens"]) == 8
                assert torch.equal(got["reward"], batch["reward"])
        with reader.get(meta.select(list(range(4, 8))), ["tokens"], copy=False, layout="jagged") as tail:  # still one run
            assert tail.viewed == {"tokens"} and torch.equal(tail["tokens"].values, torch.cat(want[4:]))


@pytest.mark.parametrize("forgery", ["swapped", "other-key", "built-by-hand", "one-of-a-run"])
def test_a_meta_whose_slots_name_other_keys_never_reads_their_bytes(tq_server, client, partition, forgery):
    """Slots are hints a meta carries next to its keys (tq.locations): a meta whose keys and slots
    disagree - keys replaced with ``dataclasses.replace``, a meta built by hand with another meta's
    slots - must get its own keys' rows, copied or viewed. The location table now holds each slot's
    key fingerprint and a reader checks it; before, the reader trusted the slots and handed key a's
    reader key b's bytes."""
    import dataclasses

    from tq.meta import KVBatchMeta

    keys = unique_keys(6)
    values = torch.arange(6, dtype=torch.int64) * 10
    meta = client.put(partition, keys, {"x": values, "tokens": [torch.full((i + 1,), i) for i in range(6)]})
    for _ in range(2):  # the first learns the table (a locate), the second reads it
        assert client.get(meta, ["x"])["x"].tolist() == values.tolist()
    assert "_key_fingerprints" in meta.__dict__  # the meta keeps its keys' fingerprints now: a forgery must not reuse them
    if forgery == "swapped":
        forged, want = dataclasses.replace(meta, keys=tuple(reversed(keys))), [5, 4, 3, 2, 1, 0]
    elif forgery == "other-key":
        forged, want = dataclasses.replace(meta.select([0]), slots=(meta.slots[1],)), [0]
    elif forgery == "built-by-hand":
        forged, want = KVBatchMeta(partition, (keys[2], keys[3]), slot_table=meta.slot_table, slots=(meta.slots[3], meta.slots[2])), [2, 3]
    else:  # the keys of one put (one run of rows) in another order than their slots
        forged, want = dataclasses.replace(meta.select([1, 2, 3]), keys=(keys[2], keys[1], keys[3])), [2, 1, 3]
    with TQClient(tq_server.address, timeout=10.0) as reader:
        copied = reader.get(forged, ["x", "tokens"], layout="list")
        with reader.get(forged, ["x", "tokens"], copy=False, layout="list") as viewed:
            for got in (copied, viewed):
                assert got["x"].tolist() == [w * 10 for w in want]
                assert [t.tolist() for t in got["tokens"]] == [[w] * (w + 1) for w in want]


def test_keys_of_any_text_are_read_from_the_table_without_a_request(tq_server, client, partition):
    """The controller and a reader hash a key's UTF-8 alike, whatever its script: a meta of non-ASCII
    keys is read through the location table with no request (a fingerprint that differed would send
    every such get to the controller - right bytes, silently slower)."""
    keys = [f"ключ-{i}" for i in range(3)] + ["键-é-\U0001f600", "k\u00e9y"]
    meta = client.put(partition, keys, {"x": torch.arange(5)})
    with TQClient(tq_server.address, timeout=10.0) as reader:
        reader.get(meta, ["x"])  # learns the table and the schema from its locate
        before = _ops(client)
        assert reader.get(meta, ["x"])["x"].tolist() == [0, 1, 2, 3, 4]
        assert reader.get(meta.select([4, 3]), ["x"])["x"].tolist() == [4, 3]
        after = _ops(client)
    assert {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)} == {"stats": 1}


def _ops(c: TQClient) -> dict[str, int]:
    return {op: v["count"] for op, v in c.stats()["ops"].items()}


def test_a_same_host_borrowed_get_takes_a_pin_without_a_request(tq_server, client, partition):
    """Once the reader maps the partition's location table and has registered its pin file (one
    ``pin_file`` request, at its first borrowed get), a borrowed get sends nothing: it locates the rows
    in the table and pins their blocks in shared memory. A discard still frees nothing under it: the
    controller reads the pin first, and the rows wait until the pin is given up."""
    keys = unique_keys(200)
    batch = _batch(200, seed=5)
    meta = client.put(partition, keys, batch)
    with TQClient(tq_server.address, timeout=10.0) as reader:
        reader.get(meta, ["tokens", "reward"])  # the first get learns the table (and the schemas) from its locate
        first = _ops(client)  # other tests' readers registered pin files with this service too
        reader.get(meta, ["reward"], copy=False).release()  # the first borrowed get registers the pin file
        before = _ops(client)
        got = reader.get(meta, ["tokens", "reward"], copy=False, layout="jagged")
        after = _ops(client)
        assert got.viewed == {"tokens", "reward"}
        assert torch.equal(got["tokens"].values, batch["tokens"].values) and torch.equal(got["tokens"].offsets, batch["tokens"].offsets)
        assert torch.equal(got["reward"], batch["reward"])
        assert after.get("pin_file", 0) - first.get("pin_file", 0) == 1
        assert {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)} == {
            "stats": 1
        }  # no borrow, no locate, no lease request: only the stats call of _ops itself
        client.discard(meta)  # the controller reads the pin before it frees: the rows wait for it
        assert client.stats()["rows_waiting_for_leases"] > 0
        client.put(partition, unique_keys(200), _batch(200, seed=6))  # space is reused elsewhere, not under the views
        assert torch.equal(got["tokens"].values, batch["tokens"].values)
        got.release()
        assert _stats_until(client, lambda s: s["rows_waiting_for_leases"] == 0)["rows_waiting_for_leases"] == 0


def test_a_reader_registers_a_new_pin_file_with_a_controller_that_never_heard_of_its_file(tq_server, client, partition):
    """Each controller writes its pin board's epoch into its tables; a reader whose pin file was
    registered under another epoch (a controller started anew, without a journal) pins nothing against
    them: it registers a new file first - else the new controller would free rows under its pins. So
    does a reader whose file the controller revoked."""
    from tq.pins import PIN_REVOKED_W

    batch = _batch(16, seed=15)
    meta = client.put(partition, unique_keys(16), batch)
    with TQClient(tq_server.address, timeout=10.0) as reader:
        reader.get(meta, ["reward"])
        reader.get(meta, ["reward"], copy=False).release()
        first = reader._leases.pins
        first.epoch += 1  # as if registered with the previous controller
        before = _ops(client).get("pin_file", 0)
        got = reader.get(meta, ["reward"], copy=False)
        assert _ops(client).get("pin_file", 0) == before + 1 and reader._leases.pins is not first
        assert got.viewed == {"reward"} and len(reader._leases._slots) == 1  # pinned, in the new file
        got.release()
        second = reader._leases.pins
        second._words[PIN_REVOKED_W] = 1  # as the controller revokes a file whose client looks gone
        got = reader.get(meta, ["reward"], copy=False)
        assert _ops(client).get("pin_file", 0) == before + 2 and reader._leases.pins not in (first, second)
        assert got.viewed == {"reward"} and len(reader._leases._slots) == 1
        client.discard(meta)
        assert client.stats()["rows_waiting_for_leases"] > 0 and torch.equal(got["reward"], batch["reward"])
        got.release()


def test_a_reader_out_of_pin_slots_leases_by_request(tq_server, client, partition):
    """Pins are a fixed number of slots per client: with every slot holding a borrowed get, the next
    one asks the controller for its lease (``borrow``), and is as safe."""
    from tq.pins import SLOTS

    batch = _batch(8, seed=12)
    meta = client.put(partition, unique_keys(8), batch)
    with TQClient(tq_server.address, timeout=10.0) as reader:
        reader.get(meta, ["reward"])
        held = [reader.get(meta, ["reward"], copy=False) for _ in range(SLOTS)]
        assert all(h.viewed == {"reward"} for h in held) and len(reader._leases._slots) == SLOTS  # all pins
        before = _ops(client)
        extra = reader.get(meta, ["reward"], copy=False)
        assert _ops(client).get("borrow", 0) == before.get("borrow", 0) + 1 and extra.viewed == {"reward"}
        client.discard(meta)
        for h in held:
            h.release()
        assert client.stats()["rows_waiting_for_leases"] > 0  # the borrow's lease still holds the block
        assert torch.equal(extra["reward"], batch["reward"])
        extra.release()
        assert _stats_until(client, lambda s: s["rows_waiting_for_leases"] == 0)["rows_waiting_for_leases"] == 0


def test_a_free_between_the_table_read_and_the_lease_is_never_viewed(tq_server, client, partition):
    """The race the ``borrow`` request closes: rows located in the shared table are overwritten and
    their space reused by other keys before the lease is asked for. The lease is refused (the table's
    frees count moved), the reader locates again, and it views the keys' current bytes - never the
    reused space's."""
    keys = unique_keys(32)
    first = _batch(32, seed=6)
    meta = client.put(partition, keys, {"tokens": first["tokens"]})
    with TQClient(tq_server.address, timeout=10.0) as reader:
        reader.get(meta, ["tokens"])  # learn the table
        view = reader._tables[partition][0]
        read = view.read
        raced = []

        def read_then_race(*args, **kwargs):
            rows = read(*args, **kwargs)
            if not raced:  # after the read, before the lease: free the rows and fill their space again
                raced.append(True)
                client.discard(meta)
                client.put(partition, unique_keys(32), {"tokens": _batch(32, seed=7)["tokens"]})
                client.put(partition, keys, {"tokens": _batch(32, seed=8)["tokens"]})
            return rows

        view.read = read_then_race
        got = reader.get(meta, ["tokens"], copy=False, layout="jagged")
        assert raced and got.viewed == {"tokens"}
        assert torch.equal(got["tokens"].values, _batch(32, seed=8)["tokens"].values), "viewed freed and reused storage"
        got.release()


def test_a_partition_dropped_and_made_again_between_the_read_and_the_lease_is_never_viewed(tq_server, client, partition):
    """The same race across tables: the partition is dropped and registered again under its name, and
    the new one's first put fills the space the old rows freed - both tables have freed nothing since
    they were made, so only the table's incarnation tells them apart. The reader's keys are gone: the
    get fails naming them, and never views the new partition's bytes."""
    from tq.errors import TQError

    keys = unique_keys(16)
    meta = client.put(partition, keys, {"tokens": _batch(16, seed=10)["tokens"]})
    with TQClient(tq_server.address, timeout=10.0) as reader:
        reader.get(meta, ["tokens"])  # learn the table
        view = reader._tables[partition][0]
        read = view.read

        def read_then_race(*args, **kwargs):
            rows = read(*args, **kwargs)
            view.read = read  # once
            client.drop_partition(partition)
            client.register_partition(partition)
            client.put(partition, unique_keys(16), {"tokens": _batch(16, seed=11)["tokens"]})
            return rows

        view.read = read_then_race
        with pytest.raises(TQError, match="not|unknown|no "):
            got = reader.get(meta, ["tokens"], copy=False, layout="jagged")
            assert not torch.equal(got["tokens"].values, _batch(16, seed=11)["tokens"].values), "viewed another partition's bytes"


def test_borrow_requests_are_checked(tq_server, client, partition):
    from tq import messages
    from tq.errors import InvalidRequestError
    from tq.messages import ControllerOp as Op

    meta = client.put(partition, unique_keys(4), _batch(4, seed=9))
    client.get(meta)
    frees = client._tables[partition][0].header[4]  # H_FREES
    ask = dict(
        partition=partition,
        unit=0,
        blocks=[0],
        incarnation=meta.slot_table,
        frees=int(frees),
        units_version=client._units_version,
        lease_s=5.0,
    )
    for stale in ({"frees": int(frees) + 1}, {"incarnation": meta.slot_table + 1}, {"units_version": client._units_version + 1}):
        assert client._call(Op.BORROW, messages.Borrow(**{**ask, **stale})).lease is None  # the table moved since the read
    with pytest.raises(InvalidRequestError, match="storage unit 7"):
        client._call(Op.BORROW, messages.Borrow(**{**ask, "unit": 7}))
    with pytest.raises(InvalidRequestError, match=r"blocks\[0\]"):
        client._call(Op.BORROW, messages.Borrow(**{**ask, "blocks": [-1]}))
    granted = client._call(Op.BORROW, messages.Borrow(**ask))
    assert granted.lease is not None
    with pytest.raises(InvalidRequestError, match=f"lease id {granted.lease} is in use"):  # a reader's chosen id
        client._call(Op.BORROW, messages.Borrow(**{**ask, "lease_id": granted.lease}))
    with pytest.raises(InvalidRequestError, match="lease_id"):
        client._call(Op.BORROW, messages.Borrow(**{**ask, "lease_id": 0}))
    chosen = client._call(Op.BORROW, messages.Borrow(**{**ask, "lease_id": 12345}))
    assert chosen.lease == 12345
    client._call(Op.LEASES, messages.Leases(release=[granted.lease, chosen.lease]))


def test_lease_ends_when_the_views_are_collected_and_the_rows_are_freed(tq_server, client, partition):
    prior = _used(_settled(client))
    meta = client.put(partition, unique_keys(32), _batch(32, seed=2))
    with TQClient(tq_server.address, timeout=10.0, lease_s=3.0) as reader:
        got = reader.get(meta, ["tokens"], copy=False, layout="list")
        one_row = got["tokens"][5]  # a view of a view keeps the lease too
        before = _used(_stats_until(client, lambda s: _used(s) > prior))  # the unit adopts the block after the commit
        client.discard(meta)
        st = client.stats()
        assert st["leases"] >= 1 and st["rows_waiting_for_leases"] > 0
        assert _used(st) == before  # discarded, not freed: a reader still views the rows
        del got
        gc.collect()
        time.sleep(0.5)
        assert client.stats()["rows_waiting_for_leases"] > 0
        del one_row
        gc.collect()
        st = _stats_until(client, lambda s: s["rows_waiting_for_leases"] == 0 and _used(s) < before, timeout=5.0)
        assert st["rows_waiting_for_leases"] == 0 and _used(st) < before


def test_a_lease_keeper_whose_thread_died_is_replaced_and_the_collected_views_leases_still_end(tq_server, client, partition):
    """The keeper's thread was started at a client's first borrowed get; a Ctrl-C landing inside that
    Thread.start() could kill the new thread in CPython's bootstrap (KeyError in _limbo, seen in the
    interrupt storm) while the keeper took it for running: no lease of the client was renewed or given
    up again. The thread starts with the client, and one found dead is replaced."""
    prior = _used(_settled(client))
    meta = client.put(partition, unique_keys(8), _batch(8, seed=3))
    with TQClient(tq_server.address, timeout=10.0, lease_s=20.0) as reader:  # no lease runs out within the test
        assert reader._leases._thread is not None and reader._leases._thread.is_alive()  # running before any borrowed get
        dead = threading.Thread(target=lambda: None)  # what a start cut short leaves: a thread that is not running
        dead.start()
        dead.join()
        reader._leases._thread = dead
        got = reader.get(meta, ["tokens"], copy=False, layout="list")
        before = _used(_stats_until(client, lambda s: _used(s) > prior))
        client.discard(meta)
        assert client.stats()["rows_waiting_for_leases"] > 0
        del got
        gc.collect()  # the views' lease is the keeper thread's to give up
        st = _stats_until(client, lambda s: s["rows_waiting_for_leases"] == 0 and _used(s) < before, timeout=2.0)
        assert st["rows_waiting_for_leases"] == 0 and reader._leases._thread is not dead


_COLLECTED_MID_REQUEST = """
import gc, sys, time
import torch
from tq import TQClient
c = TQClient(sys.argv[1], timeout=10.0, lease_s=3.0)
meta = c.put(sys.argv[2], [f"{sys.argv[2]}-{i}" for i in range(8)], {"reward": torch.arange(8.0)})
c.get(meta, ["reward"])  # the first read learns the partition's location table: the next ones read it here
for i in range(2):  # a pin (same host), then - pins given up and refused - a lease by request
    got = c.get(meta, ["reward"], copy=False)
    assert got.viewed == {"reward"} and bool(c._leases._slots) == (i == 0), (i, c._leases._slots)
    cycle = [got]
    cycle.append(cycle)  # freed only by the cyclic collector, which runs at any allocation of any thread
    del got, cycle
    gc.disable()
    with c._leases._lock:  # the collector running while this thread is inside the keeper (a renewal, a new hold)
        gc.collect()
    gc.enable()
    if i == 0:  # the keeper's thread gives the pin up - soon, not before this line (it needs the GIL)
        deadline = time.monotonic() + 10.0
        while c._leases._slots and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not c._leases._slots, ("pin not given up", c._leases._slots)
        c._leases.retire(c._leases.pins)
        c._pins_refused = True  # as with a controller that reads no pins
print("collected", flush=True)
c.close()
"""


def test_views_collected_while_their_thread_is_inside_the_lease_keeper_do_not_deadlock(tq_server, client, partition):
    """A borrowed get's lease ends when its views are collected - by a finalizer, which runs wherever
    the collector happens to run: also in the middle of the client's own lease bookkeeping, on the
    thread that holds its lock. The finalizer took that lock too, so the thread waited on itself
    forever (likely the chaos benchmark's reader stuck for 765 s). It now only queues the lease for
    the keeper's thread; the leases - a pin and one by request - still end."""
    out = subprocess.run(
        [sys.executable, "-c", _COLLECTED_MID_REQUEST, tq_server.address, partition],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ},
    )
    assert out.returncode == 0 and out.stdout.strip() == "collected", out.stderr[-2000:]
    assert _stats_until(client, lambda s: s["leases"] == 0)["leases"] == 0


def test_explicit_release_and_the_copy_fallbacks(tq_server, client, partition):
    keys = unique_keys(16)
    batch = _batch(16, seed=3)
    meta = client.put(partition, keys, batch)
    assert _stats_until(client, lambda s: s["leases"] == 0)["leases"] == 0  # an earlier test's may still be running out
    with TQClient(tq_server.address, timeout=10.0) as reader:
        with reader.get(meta, copy=False) as got:  # padded jagged rows need padding: copied
            assert got.viewed == {"reward"}
            assert torch.equal(got["reward"], batch["reward"])
        assert client.stats()["leases"] == 0  # the explicit release ends the lease at once
        rev = meta.select(list(range(15, -1, -1)))  # rows not back to back in the order asked: copied
        got = reader.get(rev, ["reward"], copy=False)
        assert got.viewed == frozenset() and torch.equal(got["reward"], batch["reward"].flip(0))
    with TQClient(tq_server.address, timeout=10.0, transport="tcp") as remote:  # no arena to view: a copy
        got = remote.get(meta, copy=False, layout="jagged")
        assert got.viewed == frozenset() and torch.equal(got["tokens"].values, batch["tokens"].values)


_HOLDER = """
import sys, time
from tq import TQClient
from tq.meta import KVBatchMeta
c = TQClient(sys.argv[1], timeout=10.0, lease_s=1.0)
got = c.get(KVBatchMeta(sys.argv[2], tuple(sys.argv[3:])), ["reward"], copy=False)
assert got.viewed == {"reward"}
print("borrowed", flush=True)
time.sleep(60)
"""


def test_a_dead_holders_lease_runs_out(tq_server, client, partition):
    prior = _used(_settled(client))
    meta = client.put(partition, unique_keys(8), _batch(8, seed=4))
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, tq_server.address, partition, *meta.keys], stdout=subprocess.PIPE, env={**os.environ}
    )
    try:
        assert holder.stdout.readline().strip() == b"borrowed"
        before = _used(_stats_until(client, lambda s: _used(s) > prior))  # the unit adopts the block after the commit
        client.discard(meta)
        time.sleep(1.5)  # past one term: the live holder renewed it
        assert client.stats()["rows_waiting_for_leases"] > 0
        holder.send_signal(signal.SIGKILL)
        holder.wait(5)
        st = _stats_until(client, lambda s: s["rows_waiting_for_leases"] == 0 and _used(s) < before, timeout=5.0)
        assert st["rows_waiting_for_leases"] == 0 and _used(st) < before
    finally:
        holder.kill()
        holder.wait(5)


_PAUSED_HOLDER = """
import os, signal, sys
from tq import TQClient
from tq.meta import KVBatchMeta
c = TQClient(sys.argv[1], timeout=10.0, lease_s=1.0)
got = c.get(KVBatchMeta(sys.argv[2], tuple(sys.argv[3:])), ["reward"], copy=False)
before = got["reward"].clone()
print("borrowed", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # paused (a debugger, a frozen cgroup) past its lease term
print("same" if bool((got["reward"] == before).all()) else "changed", flush=True)
"""


@pytest.mark.parametrize("namespace", ["same", "own"], ids=["same-pid-namespace", "other-pid-namespace"])
def test_a_paused_holders_views_keep_their_bytes(tq_server, client, partition, namespace):
    """A same-host reader holding borrowed views is stopped for longer than its lease term, so it
    renews nothing; meanwhile the keys are discarded and their room is written again. A lease is for
    holders that are gone: while the holder's process lives its blocks stay pinned, and its views show
    the bytes they were handed when it resumes (they used to show whatever the next put wrote there).
    Also for a reader in another pid namespace sharing /dev/shm, told alive by the locks it holds on
    its pin file and liveness file: its pid names no process of the controller's namespace."""
    start = pid_namespace_start() if namespace == "own" else None
    if namespace == "own" and start is None:
        pytest.skip("cannot make a pid namespace here (needs root and util-linux's unshare)")
    meta = client.put(partition, unique_keys(8), _batch(8, seed=5))
    holder = subprocess.Popen(
        python_command(_PAUSED_HOLDER, [tq_server.address, partition, *meta.keys], start), stdout=subprocess.PIPE, text=True
    )
    pid = None
    try:
        assert holder.stdout.readline().strip() == "borrowed"
        pid = python_pid(holder)
        assert wait_until(lambda: process_state(pid) == "T")
        client.discard(meta)
        time.sleep(3.0)  # three terms with no renewal
        assert client.stats()["rows_waiting_for_leases"] > 0, "a paused holder's lease ran out"
        with TQClient(tq_server.address, timeout=10.0, transport="tcp") as tcp:  # each put takes the lowest free range
            for i in range(16):  # so the room the frees gave back is written again
                tcp.put(partition, unique_keys(8), _batch(8, seed=50 + i))
        os.kill(pid, signal.SIGCONT)
        out, _ = holder.communicate(timeout=30)
        assert out.strip() == "same", out
        assert _stats_until(client, lambda s: s["rows_waiting_for_leases"] == 0)["rows_waiting_for_leases"] == 0
    finally:
        holder.kill()
        holder.wait(5)


def test_lease_term_is_checked():
    with pytest.raises(Exception, match="lease_s"):
        TQClient("tcp://127.0.0.1:1", lease_s=0.0)


def test_leases_survive_a_controller_restart_from_its_journal(tmp_path, loopback):
    """A borrowed block's rows, discarded, stay pinned across a controller restart (the lease and the
    discard are journaled; the restarted controller's retain keeps them) until the lease ends."""
    from tq.leases import LeaseBook

    apply, heard = loopback.apply, loopback.heard
    ctrl = loopback.start(journal_dir=str(tmp_path), shm_dir=None)
    try:
        loopback.commit_two_rows(ctrl)
        reply, _ = apply(ctrl, "locate", {"partition": "p", "keys": ["a", "b"], "fields": ["x"], "lease_s": 60.0})
        lease = reply.lease
        apply(ctrl, "discard", {"partition": "p", "keys": ["a"]})
        assert "free_rows" not in heard()
    finally:
        ctrl.close()  # as if killed: the journal stays

    ctrl = loopback.start(journal_dir=str(tmp_path), shm_dir=None)
    try:
        assert lease in ctrl.lease_book.leases
        assert ctrl._rows_on(0).tolist() == [[5, 0], [5, 1]]  # its retain keeps the discarded row
        snap = LeaseBook.restore(ctrl.lease_book.snapshot())  # and so does a compacted journal
        assert list(snap.leases) == [lease] and snap.held_on(0).tolist() == [[5, 0]]
        heard()
        apply(ctrl, "leases", {"release": [lease]})
        assert "free_rows" in heard() and ctrl._rows_on(0).tolist() == [[5, 1]]
    finally:
        ctrl.close()


_LIVENESS_HOLDER = """
import sys
from tq import liveness
print(liveness.own_file(sys.argv[1]), flush=True)
sys.stdin.readline()
"""


def test_a_lease_by_request_is_kept_while_its_holders_liveness_file_is_locked(tmp_path, loopback):
    """A reader on the controller's host names its liveness file with a lease it asks for (``locate``
    / ``borrow``): a term with no renewal while the file is locked extends the lease (the reader is
    paused), also after a restart from the journal; once the reader exited the lease ends. Its pid,
    which names no process here when it runs in another pid namespace, is not what decides."""
    shm = tmp_path / "shm"
    shm.mkdir()
    reader = subprocess.Popen([sys.executable, "-c", _LIVENESS_HOLDER, str(shm)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    name = reader.stdout.readline().strip()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    ctrl = None
    try:
        ctrl = loopback.start(journal_dir=str(tmp_path / "j"), shm_dir=str(shm))
        loopback.commit_two_rows(ctrl)
        ask = {"partition": "p", "keys": ["a", "b"], "fields": ["x"], "lease_s": 0.05, "holder": int(gone), "holder_file": name}
        lease = loopback.apply(ctrl, "locate", ask)[0].lease
        time.sleep(0.1)
        ctrl.on_tick(time.monotonic())
        assert lease in ctrl.lease_book.leases and ctrl.lease_book.leases[lease].holder == name  # past its term, kept
        ctrl.close()  # as if killed: the journal stays
        ctrl = loopback.start(journal_dir=str(tmp_path / "j"), shm_dir=str(shm))
        time.sleep(0.1)
        ctrl.on_tick(time.monotonic())
        assert lease in ctrl.lease_book.leases
        reader.stdin.write("\n")
        reader.stdin.flush()
        reader.wait(10)
        time.sleep(0.1)
        ctrl.on_tick(time.monotonic())
        assert lease not in ctrl.lease_book.leases
    finally:
        if ctrl is not None:
            ctrl.close()
        if reader.poll() is None:
            reader.kill()


def test_pinned_views_hold_their_bytes_while_a_writer_frees_and_reuses_concurrently():
    """The pin protocol under a real race: a writer thread puts a batch (every token = its round),
    discards the previous one and so keeps reusing the freed space, while a reader takes borrowed
    gets of whatever batch is newest - through pins, with the controller freeing concurrently in its
    own process. A view either fails (its keys were discarded before the read) or shows one round's
    bytes, unchanged for as long as it is held."""
    import threading

    from tq import TQServer
    from tq.errors import TQError

    stop = threading.Event()
    latest: list = []
    partition = "churn"

    def write() -> None:
        prev, r = None, 0
        with TQClient(server.address, timeout=10.0) as w:
            while not stop.is_set():
                r += 1
                lengths = torch.randint(50, 400, (32,))
                offsets = torch.zeros(33, dtype=torch.int64)
                offsets[1:] = torch.cumsum(lengths, 0)
                meta = w.put(
                    partition, unique_keys(32), {"tokens": JaggedTensor(torch.full((int(offsets[-1]),), r, dtype=torch.int32), offsets)}
                )
                latest[:] = [meta]
                if prev is not None:
                    w.discard(prev)
                prev = meta

    server = TQServer(storage_units=1, capacity=1 << 20)  # a small arena: freed space is reused within a few puts
    held = checked = 0
    try:
        with TQClient(server.address, timeout=10.0) as reader:
            reader.register_partition(partition)
            writer = threading.Thread(target=write, daemon=True)
            writer.start()
            deadline = time.monotonic() + 4.0
            while time.monotonic() < deadline:
                if not latest:
                    time.sleep(0.01)
                    continue
                meta = latest[0]
                try:
                    if partition not in reader._tables:
                        reader.get(meta, ["tokens"])  # learn the table
                    got = reader.get(meta, ["tokens"], copy=False, layout="jagged")
                except TQError:
                    continue  # discarded before the read
                if got.viewed != {"tokens"}:
                    got.release()
                    continue
                v = got["tokens"].values
                first = int(v[0])
                assert bool((v == first).all()), "a borrowed view shows bytes of two rounds"
                time.sleep(0.005)  # the writer frees and reuses meanwhile
                assert bool((v == first).all()), "a borrowed view changed under its reader"
                held += len(reader._leases._slots)  # this get's lease is a pin
                checked += 1
                got.release()
            stop.set()
            writer.join(10)
    finally:
        stop.set()
        server.shutdown()
    # a get whose read raced a free (or a grown table) leased by request or located instead: as safe
    assert checked >= 20 and held >= checked // 2, (checked, held)


def test_releasing_a_lease_while_the_controller_is_away_does_not_raise():
    """``release()`` of a lease taken by request, with the controller stopped (SIGSTOP): no error (the
    views are given up here at once); the lease is given up once the controller answers again."""
    from tq import TQServer

    server = TQServer(storage_units=1, capacity=8 << 20)
    try:
        with TQClient(server.address, timeout=10.0) as admin, TQClient(server.address, timeout=1.0, lease_s=3.0) as reader:
            admin.register_partition("p")
            meta = admin.put("p", unique_keys(8), _batch(8, seed=13))
            got = reader.get(meta, ["reward"], copy=False)  # no table learnt yet: a locate that takes the lease
            assert got.viewed == {"reward"} and admin.stats()["leases"] == 1
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                got.release()  # the request times out: no error, the keeper gives it up later
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            assert _stats_until(admin, lambda s: s["leases"] == 0, timeout=5.0)["leases"] == 0
    finally:
        server.shutdown()


def test_a_lease_whose_grant_never_reached_its_reader_is_given_up_before_its_term():
    """A borrowed get's locate times out (controller SIGSTOPped): the get fails, but the controller
    still grants the lease once it runs again. The reader chose the lease's id, so its keeper gives it
    up at its next renewal - well before the lease's own term (6 s here) would end it."""
    from tq import TQServer
    from tq.errors import TQConnectionError

    server = TQServer(storage_units=1, capacity=8 << 20)
    try:
        with TQClient(server.address, timeout=10.0) as admin, TQClient(server.address, timeout=1.0, lease_s=6.0) as reader:
            admin.register_partition("p")
            meta = admin.put("p", unique_keys(8), _batch(8, seed=14))
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(TQConnectionError):
                    reader.get(meta, ["reward"], copy=False)  # no table learnt yet: a locate that takes the lease
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            resumed = time.monotonic()
            st = _stats_until(admin, lambda s: s["leases"] == 0, timeout=4.0)
            assert st["leases"] == 0 and time.monotonic() - resumed < 4.0, st["leases"]
    finally:
        server.shutdown()


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_release_cut_short_by_a_ctrl_c_lets_the_rows_go_with_the_views(client, partition, monkeypatch, where):
    """A Ctrl-C landing inside an explicit ``release()`` of a borrowed result, before or after its pin
    is given up: the lease must still go with its views. (Before, the keeper forgot the lease before
    giving its pin up: cut short there, the pin of this live process held the rows for as long as it
    ran.) Cut short after the pin went, the keeper's renewals must not warn that the borrowed get
    "outlived its lease" (its views may show reused storage) for a result the reader released: the
    interrupt storm printed that at every renewal until the views were collected."""
    import warnings

    from tq.pins import PinFile

    meta = client.put(partition, unique_keys(2), {"x": torch.arange(8).reshape(2, 4)})
    client.get(meta, ["x"], copy=False).release()  # the first one locates (and learns the table); the next pins
    got = client.get(meta, ["x"], copy=False)
    if not got.viewed or not client._leases._slots:
        pytest.skip("no pinned views here (the controller reads no pin files)")
    real = PinFile.release

    def cut(self, slot, lease):  # the interrupt, at the call's first line or after its store
        if where == "after":
            real(self, slot, lease)
        monkeypatch.setattr(PinFile, "release", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(PinFile, "release", cut)
    with pytest.raises(KeyboardInterrupt):
        got.release()
    assert client._leases._slots  # still tracked: the keeper forgets it with its views
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        client._leases.flush()
    client.discard(meta)
    if where == "before":
        assert _settled(client, 1.0)["rows_waiting_for_leases"] > 0  # still pinned: the views live
    del got
    gc.collect()
    assert _stats_until(client, lambda st: not st["rows_waiting_for_leases"], 15.0)["rows_waiting_for_leases"] == 0


@pytest.mark.parametrize("how, where", [("pin", "hold"), ("locate", "hold"), ("pin", "count_read")])
def test_a_borrowed_get_cut_short_before_it_returns_gives_its_lease_up(client, partition, monkeypatch, how, where):
    """A Ctrl-C landing after a borrowed get took its lease (a pin, or a locate's lease) but before
    the keeper tracked it - as the keeper is handed it, or as the pinned read is counted (the storm's
    every untracked pin) - the get gives the lease up, so the rows go at their discard. (Before, the
    lease of this live process held them for as long as it ran.)"""
    from tq.client import TQClient, _LeaseKeeper

    meta = client.put(partition, unique_keys(2), {"x": torch.arange(8).reshape(2, 4)})
    if how == "pin":
        client.get(meta, ["x"], copy=False).release()  # the first one locates (and learns the table); the next pins
    owner, name = (_LeaseKeeper, "hold") if where == "hold" else (TQClient, "_count_read")
    real = getattr(owner, name)

    def cut(self, *args):
        monkeypatch.setattr(owner, name, real)
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, cut)
    with pytest.raises(KeyboardInterrupt):
        client.get(meta, ["x"], copy=False)
    gc.collect()
    client.discard(meta)
    assert _stats_until(client, lambda st: not st["rows_waiting_for_leases"], 15.0)["rows_waiting_for_leases"] == 0


@pytest.mark.parametrize("how", ["pin", "locate"])
def test_a_ctrl_c_while_the_views_are_collected_still_lets_the_rows_go(client, partition, how):
    """A Ctrl-C (any signal handler's exception) lands at the next Python line run; collecting a
    borrowed result's views ran Python (a ``weakref.finalize`` and the keeper's callback), and one cut
    short there lost its lease for good: the rows stayed held for as long as the process ran (the
    interrupt storm's "untracked pins"). Here the exception is raised in the first Python frame entered
    while the views are collected; the rows must still go at their discard."""
    meta = client.put(partition, unique_keys(2), {"x": torch.arange(8).reshape(2, 4)})
    if how == "pin":
        client.get(meta, ["x"], copy=False).release()  # the first one locates (and learns the table); the next pins
    else:
        client._pins_refused = True  # as with a controller that reads no pins: a lease by request
    got = client.get(meta, ["x"], copy=False)
    assert got.viewed == {"x"} and bool(client._leases._slots) == (how == "pin")
    entered: list[str] = []

    def interrupt(frame, event, arg):  # the interrupt, at the first Python frame entered
        if event == "call":
            sys.setprofile(None)
            entered.append(frame.f_code.co_qualname)
            raise KeyboardInterrupt

    client.discard(meta)
    assert _settled(client, 1.0)["rows_waiting_for_leases"] > 0  # the views live
    sys.setprofile(interrupt)
    try:
        del got  # the views' last reference: collected here
    finally:
        sys.setprofile(None)
    gc.collect()
    assert _stats_until(client, lambda st: not st["rows_waiting_for_leases"], 15.0)["rows_waiting_for_leases"] == 0, entered
