"""tq.compat.transfer_queue beyond TransferQueue's own KV tests (tests/compat/): the parked-wait option,
values TransferQueue users store (strings, dicts, scalars, jagged rows, bf16), overwrites, mixed new and
existing keys, errors that name the problem before anything is written, attaching to a running service
with and without a secret, data_parser, and the module alias. Real service processes, no Ray."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

pytest.importorskip("tensordict")
from tensordict import NonTensorStack, TensorDict  # noqa: E402

import tq.compat.transfer_queue as tq  # noqa: E402
from tq import TQClient, TQServer  # noqa: E402
from tq.errors import TQTimeoutError  # noqa: E402


@pytest.fixture()
def kv(tq_server, monkeypatch):
    """The drop-in attached to the module's service (conftest) by address; every partition dropped afterwards."""
    monkeypatch.delenv("TQ_ADDRESS", raising=False)
    conf = tq.init({"data_plane": {"address": tq_server.address, "timeout_s": 10.0}})
    assert conf.data_plane.address == tq_server.address
    yield tq
    client = tq.get_client()
    for p in client.list_partitions():
        client.drop_partition(p["partition"])
    tq.close()


def test_values_round_trip_in_transfer_queue_types(kv):
    keys = ["k0", "k1", "k2"]
    rows = [torch.arange(n, dtype=torch.int64) for n in (3, 1, 4)]
    fields = TensorDict(
        {
            "responses": torch.nested.as_nested_tensor(rows, layout=torch.jagged),
            "reward": torch.tensor([0.5, -1.0, 2.0]),
            "logprobs": torch.randn(3, 5).to(torch.bfloat16),
            "prompt": NonTensorStack("a", "bb", "ccc"),
            "info": NonTensorStack({"turns": 1}, {"turns": 2}, {"turns": [1, 2]}),
        },
        batch_size=3,
    )
    meta = kv.kv_batch_put(keys, "p", fields, tags=[{"step": 1}] * 3)
    assert meta.fields == sorted(fields.keys()) and meta.tags == [{"step": 1}] * 3
    out = kv.kv_batch_get_by_meta(meta)
    assert out.batch_size == torch.Size([3])
    assert out["responses"].is_nested and [r.tolist() for r in out["responses"].unbind()] == [r.tolist() for r in rows]
    assert not out["reward"].is_nested and torch.equal(out["reward"], fields["reward"])  # per-sample scalars stay dense
    assert out["logprobs"].dtype == torch.bfloat16
    assert torch.equal(torch.stack(list(out["logprobs"].unbind())), fields["logprobs"])  # bit-exact
    assert out["prompt"] == ["a", "bb", "ccc"]
    assert out.get("info").tolist() == [{"turns": 1}, {"turns": 2}, {"turns": [1, 2]}]


def test_overwrite_and_mixed_new_and_existing_keys(kv):
    kv.kv_batch_put(
        ["a", "b"], "p", TensorDict({"x": torch.tensor([[1, 1], [2, 2]])}, batch_size=2), tags=[{"v": 1, "keep": "yes"}, {"v": 1}]
    )
    # "b" exists (its x is overwritten), "c" is new; both get field y; a's tags are untouched
    meta = kv.kv_batch_put(
        ["b", "c"],
        "p",
        TensorDict({"x": torch.tensor([[5, 5], [6, 6]]), "y": torch.tensor([7, 8])}, batch_size=2),
        tags=[{"v": 2}, {"v": 2}],
    )
    assert meta.fields == ["x", "y"] and meta.tags == [{"v": 2}, {"v": 2}]
    got = kv.kv_batch_get(["a", "b", "c"], "p", select_fields="x")
    assert [r.tolist() for r in got["x"].unbind()] == [[1, 1], [5, 5], [6, 6]]
    assert kv.kv_list("p")["p"] == {"a": {"v": 1, "keep": "yes"}, "b": {"v": 2}, "c": {"v": 2}}
    # a tag-only put on a new key registers it with no fields
    meta = kv.kv_put("d", "p", tag={"status": "pending"})
    assert meta.fields == [] and kv.kv_list("p")["p"]["d"] == {"status": "pending"}


def test_errors_name_the_problem_and_write_nothing(kv):
    kv.kv_put("a", "p", {"x": torch.tensor([1, 2])})
    with pytest.raises(TypeError, match="tag 'bad'"):
        kv.kv_batch_put(["n1", "n2"], "p", TensorDict({"x": torch.ones(2, 2)}, batch_size=2), tags=[{"bad": [1]}, {}])
    assert set(kv.kv_list("p")["p"]) == {"a"}  # nothing of the refused put landed
    with pytest.raises(ValueError, match="not found"):
        kv.kv_batch_get(["a", "missing"], "p")  # TransferQueue would return a's row alone
    with pytest.raises(ValueError, match="not found"):
        kv.kv_batch_get("a", "no-such-partition")
    with pytest.raises(ValueError, match="not ready"):
        kv.kv_batch_get("a", "p", select_fields="never_written")
    with pytest.raises(ValueError, match="batch_size"):
        kv.kv_batch_put(["a", "b"], "p", TensorDict({"x": torch.ones(3, 1)}, batch_size=3))
    with pytest.raises(ValueError, match="nested TensorDict"):
        kv.kv_put("a", "p", TensorDict({"sub": TensorDict({"z": torch.ones(1)}, batch_size=1)}, batch_size=1))


def test_get_fails_at_once_by_default_and_parks_with_wait_timeout(kv):
    kv.kv_put("k", "p", {"prompt_ids": torch.tensor([1, 2, 3])})
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="not ready"):
        kv.kv_batch_get("k", "p", select_fields="response")  # TransferQueue's semantics: poll
    assert time.monotonic() - t0 < 1.0

    def produce():
        time.sleep(0.3)
        kv.kv_put("k", "p", {"response": torch.tensor([4, 5])})

    writer = threading.Thread(target=produce)
    writer.start()
    t0 = time.monotonic()
    out = kv.kv_batch_get("k", "p", select_fields=["prompt_ids", "response"], wait_timeout_s=5.0)
    waited = time.monotonic() - t0
    writer.join()
    assert 0.2 < waited < 4.0 and out["response"].unbind()[0].tolist() == [4, 5]
    with pytest.raises(TQTimeoutError):
        kv.kv_batch_get("k", "p", select_fields="never", wait_timeout_s=0.2)
    # a reader may come before the writer created the partition or the key
    threading.Timer(0.3, lambda: kv.kv_put("late", "fresh", {"x": torch.tensor([9])})).start()
    assert kv.kv_batch_get("late", "fresh", select_fields="x", wait_timeout_s=5.0)["x"].unbind()[0].tolist() == [9]


def test_async_twins_and_data_parser(kv):
    import asyncio

    def parse(batch):  # TransferQueue's contract: rewrite values in place, keys and counts unchanged
        batch["url"] = [f"fetched:{u}" for u in batch["url"]]

    async def run():
        meta = await kv.async_kv_batch_put(
            ["u0", "u1"], "p", TensorDict({"url": NonTensorStack("x", "y")}, batch_size=2), data_parser=parse
        )
        return await kv.async_kv_batch_get_by_meta(meta)

    assert asyncio.run(run())["url"] == ["fetched:x", "fetched:y"]


def test_init_starts_a_service_and_close_stops_it(monkeypatch):
    monkeypatch.delenv("TQ_ADDRESS", raising=False)
    conf = tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}, "data_plane": {"capacity_bytes": 32 << 20}})
    try:
        server = tq._STATE.server
        assert server is not None and conf.data_plane.address == server.address
        assert tq.init() is None  # already connected: nothing happens
        tq.kv_put("k", "p", {"x": torch.tensor([1])})
        assert tq.kv_list() == {"p": {"k": {}}}
    finally:
        tq.close()
    assert server.proc.wait(10) is not None
    with pytest.raises(RuntimeError, match="init"):
        tq.kv_list()
    with pytest.raises(ValueError, match="SimpleStorage"):
        tq.init({"backend": {"storage_backend": "MooncakeStore"}})


def _kv_in_a_forked_child(results) -> None:
    try:
        tq.kv_put("child", "p", {"x": torch.tensor([2])})  # connects this process to the parent's service
        got = [r.tolist() for r in tq.kv_batch_get(["parent", "child"], "p")["x"].unbind()]
        tq.close()  # the child's connection only: the service is the parent's
        results.put(got)
    except Exception as exc:
        results.put(repr(exc))


def test_a_forked_child_connects_itself_and_its_close_leaves_the_parents_service(monkeypatch):
    """A DataLoader worker or multiprocessing child forked after init() uses the API as its parent does:
    at its first call it opens a connection of its own (the parent's client is refused in a fork), and
    its close() - or exit - stops nothing of the parent's."""
    import multiprocessing

    monkeypatch.delenv("TQ_ADDRESS", raising=False)
    tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}, "data_plane": {"capacity_bytes": 32 << 20}})
    try:
        server = tq._STATE.server
        tq.kv_put("parent", "p", {"x": torch.tensor([1])})
        ctx = multiprocessing.get_context("fork")
        results = ctx.Queue()
        child = ctx.Process(target=_kv_in_a_forked_child, args=(results,))
        child.start()
        assert results.get(timeout=60) == [[1], [2]]
        child.join(30)
        assert child.exitcode == 0 and server.proc.poll() is None
        assert tq.kv_list() == {"p": {"parent": {}, "child": {}}}  # the parent's connection works on
    finally:
        tq.close()


def test_attach_by_environment_with_a_secret_and_close_leaves_the_service(monkeypatch):
    with TQServer(storage_units=1, capacity=16 << 20, secret="s3cret") as server:
        monkeypatch.setenv("TQ_ADDRESS", server.address)
        monkeypatch.setenv("TQ_SECRET", "s3cret")
        tq.kv_put("k", "p", {"x": torch.tensor([1])})  # no init(): attaches like a TransferQueue worker
        tq.close()
        with TQClient(server.address, secret="s3cret", timeout=5.0) as client:  # still serving
            assert client.get_meta("p").keys == ("k",)


def test_alias_as_transfer_queue(monkeypatch):
    monkeypatch.delitem(sys.modules, "transfer_queue", raising=False)
    tq.alias_as_transfer_queue()
    import transfer_queue

    assert transfer_queue is tq and transfer_queue.KVBatchMeta is tq.KVBatchMeta


def test_kv_batch_meta_operations():
    m = tq.KVBatchMeta(["a", "b", "c"], [{"i": 0}, {"i": 1}, {"i": 2}], "p", ["x"], {"pad": 8})
    assert [c.keys for c in m.chunk(2)] == [["a", "b"], ["c"]]
    assert tq.KVBatchMeta.concat(m.chunk(2)).keys == ["a", "b", "c"]
    assert m.select_keys(["c", "a"]).tags == [{"i": 2}, {"i": 0}]
    with pytest.raises(RuntimeError):
        m.select_keys(["z"])
    with pytest.raises(ValueError, match="duplicated"):
        tq.KVBatchMeta(["a", "a"], [{}, {}])
    native = m.native()
    assert native.keys == ("a", "b", "c") and native.tags == {"i": (0, 1, 2)} and native.extra_info == {"pad": 8}


def test_side_by_side_benchmark_runs_the_workload_through_the_drop_in(monkeypatch):
    from benchmarks import compat_side_by_side as bench

    monkeypatch.delenv("TQ_ADDRESS", raising=False)
    result = bench.bench_compat(samples=4, seq_len=8, steps=2)  # checks its read-back itself
    assert all(len(result["seconds"][op]) == 2 for op in bench.OPS)
    assert "| put_new |" in bench.summarize({"tq.compat": result})


def test_bad_settings_fail_before_anything_starts(monkeypatch):
    monkeypatch.delenv("TQ_ADDRESS", raising=False)
    for bad in ({"transport": "udp"}, {"timeout_s": 0}, {"wait_timeout_s": -1}):
        with pytest.raises(ValueError, match="transport|timeout_s|wait_timeout_s"):
            tq.init({"data_plane": bad})
        assert tq._STATE is None


def test_concurrent_upserts_and_clears_never_fail(kv):
    """kv_batch_put is an upsert: two writers registering the same new key, or a clear taking a key
    between the upsert's look-up and its write, raised DuplicateKeyError / KeyNotFoundError from the
    native client. The race lost is looked at again; every call succeeds and what is read is whole."""
    kv.kv_put("old", "p", {"x": torch.ones(2)})
    errors: list[str] = []

    def run(fn, rounds):
        try:
            for r in range(rounds):
                fn(r)
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(repr(exc))

    def upsert(r):
        kv.kv_batch_put(["old", f"new{r}"], "p", TensorDict({"x": torch.full((2, 2), float(r))}, batch_size=2))

    def put_shared(r):
        kv.kv_batch_put(["shared"], "q", TensorDict({"x": torch.full((1, 2), float(r))}, batch_size=1))

    def clear_shared(r):
        kv.kv_clear(["shared"], "q")

    for pair in ((upsert, upsert), (put_shared, clear_shared)):
        threads = [threading.Thread(target=run, args=(fn, 60)) for fn in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    got = kv.kv_batch_get([f"new{r}" for r in range(60)], "p", select_fields="x")
    assert [r.tolist() for r in got["x"].unbind()] == [[float(r)] * 2 for r in range(60)]


def test_values_the_drop_in_passed_on_wrongly_are_stored_or_refused_naming_them(kv):
    """numpy str keys (a verl uid array) reached the wire as np.str_ (msgpack's TypeError); a [n, L, 0]
    field read back as rows of shape (0, 0); 0-d rows were stacked with type promotion (2**40 + 1 read
    back as a float); a 2-D sparse field, keys given as an int, tags not a list of dicts and a
    per-call wait of True or "5" failed in library code, or passed where init() refuses them."""
    import numpy as np

    uids = np.array(["u0", "u1"])
    kv.kv_batch_put(uids, "p", TensorDict({"x": torch.ones(2, 3)}, batch_size=2))
    assert [r.tolist() for r in kv.kv_batch_get(uids, "p")["x"].unbind()] == [[1.0] * 3] * 2
    assert set(kv.kv_list("p")["p"]) == {"u0", "u1"} and kv.kv_put(np.str_("u2"), "p", {"x": torch.ones(3)}).keys == ["u2"]
    kv.kv_batch_put(["e0", "e1", "e2"], "p", TensorDict({"e": torch.zeros(3, 2, 0)}, batch_size=3))
    assert [r.shape for r in kv.kv_batch_get(["e0", "e1", "e2"], "p", select_fields="e")["e"].unbind()] == [(2, 0)] * 3
    from tq.errors import SchemaConflictError

    scalars = TensorDict({"s": NonTensorStack(torch.tensor(1.0), torch.tensor(2**40 + 1))}, batch_size=2)
    with pytest.raises(SchemaConflictError, match=r"field 's': row 1 is torch.int64"):
        kv.kv_batch_put(["s0", "s1"], "p", scalars)
    with pytest.raises(ValueError, match=r"field 'sp'.*sparse"):
        kv.kv_batch_put(["a0", "a1"], "p", TensorDict({"sp": torch.eye(2).to_sparse()}, batch_size=2))
    with pytest.raises(TypeError, match="keys must be a str or a list of str, got int"):
        kv.kv_batch_get(1, "p")
    for tags in (["notadict"], {"q": 1}):
        with pytest.raises(TypeError, match="tags must be a list of one dict"):
            kv.kv_batch_put(["t0"], "p", TensorDict({"x": torch.ones(1, 3)}, batch_size=1), tags=tags)
    for wait in (True, "5", -1.0, float("nan")):
        with pytest.raises(ValueError, match="wait_timeout_s must be None or seconds >= 0"):
            kv.kv_batch_get(uids, "p", wait_timeout_s=wait)
    assert set(kv.kv_list("p")["p"]) == {"u0", "u1", "u2", "e0", "e1", "e2"}  # nothing of the refused puts landed


def test_storage_units_zero_is_refused_not_taken_for_the_default(monkeypatch):
    monkeypatch.delenv("TQ_ADDRESS", raising=False)
    for conf, name in (
        ({"data_plane": {"storage_units": 0}}, "data_plane.storage_units"),
        ({"backend": {"SimpleStorage": {"num_data_storage_units": 0}}}, "num_data_storage_units"),
    ):
        with pytest.raises(ValueError, match=rf"{name} must be a whole number >= 1, got 0"):
            tq.init(conf)
        assert tq._STATE is None


def test_a_reused_ray_worker_follows_the_driver_to_the_service_it_started_again(ray_session, monkeypatch):
    """A Ray worker attaches to the service the driver's init() published through the job's handle
    actor. The driver's close() and a new init() publish another service; the worker (an actor here:
    the same process, as a reused task worker) kept its client of the stopped one, and every call
    waited out its timeout. Its next init() now sees the new service and connects to it."""
    ray = ray_session
    monkeypatch.delenv("TQ_ADDRESS", raising=False)

    @ray.remote(num_cpus=0.1)
    class Worker:
        def put_and_list(self, key: str) -> dict:
            import torch as _torch

            import tq.compat.transfer_queue as kv

            kv.init()
            kv.kv_put(key, "p", {"x": _torch.ones(2)})
            return kv.kv_list("p")["p"]

    conf = {"data_plane": {"storage_units": 1, "capacity_bytes": 32 << 20, "timeout_s": 5.0}}
    worker = Worker.remote()
    try:
        tq.init(conf)
        assert set(ray.get(worker.put_and_list.remote("first"), timeout=60)) == {"first"}
        tq.close()
        tq.init(conf)  # a new service: nothing of the first is in it
        assert set(ray.get(worker.put_and_list.remote("second"), timeout=60)) == {"second"}
        assert set(tq.kv_list("p")["p"]) == {"second"}
    finally:
        ray.kill(worker)
        tq.close()
