"""A network partition between two emulated hosts (network namespaces), and its healing: a writer on
the cut-off node and a reader of its rows on the head fail at their timeouts while the link is down, a
reader whose timeout outlasts the cut waits it out, all succeed again within seconds of it coming back
(not after TCP's retransmission back-off), and every acknowledged write reads back bit-exact
(``benchmarks/tq_partition.py``). Skipped where namespaces cannot be made."""

from __future__ import annotations

import pytest

from benchmarks import tq_partition
from conftest import cannot_make_netns

WHY = cannot_make_netns()


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
@pytest.mark.timeout(240)
@pytest.mark.long
def test_a_partitioned_node_is_served_again_within_seconds_of_the_link_coming_back(tmp_path):
    # 15 s down: the old connections' next retransmission would come ~10 s after the heal. Back
    # within 5 s, not the benchmark's 3 (0.4-1.7 s measured, ~2.2 s at worst by design): CI shares
    # its two cores with another test worker
    r = tq_partition.run(cut_s=15.0, after_s=6.0, timeout=5.0, run_dir=tmp_path)
    failed = [(name, got, want) for name, got, want, met in tq_partition.targets(r, recovery_bar_s=5.0) if not met]
    assert not failed, (failed, r["roles"])


_SLOW_CLIENT = r"""
import sys, time, torch
from tq import TQClient
with TQClient(sys.argv[1], timeout=60.0, transport="tcp") as c:
    c.register_partition("slow")
    for chan in [c._ctrl, *c._unit_chans.values()]:
        chan.use_stream(None)  # ZMQ only: its heartbeats are what this checks
    x = torch.randint(0, 255, (2, 8 << 20), dtype=torch.uint8)
    t = time.monotonic()
    meta = c.put("slow", ["a", "b"], {"x": x})
    put_s = time.monotonic() - t
    t = time.monotonic()
    assert torch.equal(c.get(meta, ["x"])["x"], x)
    print(f"put {put_s:.1f} s, get {time.monotonic() - t:.1f} s")
"""


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
@pytest.mark.timeout(180)
@pytest.mark.long
def test_a_message_longer_on_the_wire_than_the_heartbeat_timeout_still_arrives_over_zmq(tmp_path):
    """ZMTP heartbeats drop a connection that hears nothing for rpc.ZMQ_SILENT_S (3 s); a 16 MiB put
    and get over ZMQ on a 20 Mbit/s link take ~7 s each on the wire, and must not be taken for
    silence (a reported libzmq behaviour with big messages: zeromq/libzmq#2709)."""
    import sys

    from tq import rpc

    with tq_partition.service_on_two_hosts(tmp_path, units_on=(0,), link_rate="20mbit") as (cluster, address, env):
        rc = cluster.run(1, [sys.executable, "-c", _SLOW_CLIENT, address], tmp_path / "client.log", 150, env)
        out = (tmp_path / "client.log").read_text()
    assert rc == 0, out
    put_s, get_s = (float(w) for w in out.replace(",", "").split()[1::3])
    assert min(put_s, get_s) > rpc.ZMQ_SILENT_S, out  # the link was as slow as meant


_CUT_DISCARDER = r"""
import json, sys, time, torch
from pathlib import Path
from tq import KVBatchMeta, TQClient
from tq.errors import TQConnectionError
address, run = sys.argv[1], Path(sys.argv[2])

def wait_for(name):
    while not (run / name).exists():
        time.sleep(0.01)

out = {}
# a client per request: a request whose outcome is unknown is settled before its client's next one
# (which would not be sent into the cut)
clients = [TQClient(address, timeout=2.0, transport="tcp") for _ in range(5)]
c, c2, c3, c4, c5 = clients
PIDS = "defgh"

def listing(client, pid):
    m = client.get_meta(pid)
    return [sorted(m.keys), {k: list(v) for k, v in sorted(m.tags.items())}]

with c, c2, c3, c4, c5:
    for pid in PIDS:
        c.register_partition(pid)
        c.put(pid, ["a", "b"], {"x": torch.ones(2, 8)})
    for client, pid in zip(clients[1:], PIDS[1:]):
        client.get_meta(pid)  # connected before the cut: their requests go into these connections
    (run / "ready").write_text("1")
    wait_for("cut")
    calls = (
        ("discard", lambda: c.discard(KVBatchMeta("d", ("a",)))),
        ("clear", lambda: c2.clear_partition("e")),
        ("reuse", lambda: c3.register_partition("f", reuse=True)),
        ("mint", lambda: c4.register_keys("g", ["c"])),
        ("tags", lambda: c5.set_tags(KVBatchMeta("h", ("a", "b"), tags={"t": (1, 2)}))),
    )
    for op, call in calls:
        try:
            call()
            out[op] = "returned"
        except TQConnectionError as exc:
            out[op] = f"raised: {exc}"
    (run / "sent").write_text("1")
    wait_for("healed")
    for client in clients:
        client.timeout = client._ctrl.timeout = 10.0
    out["listed"] = [listing(client, pid) for client, pid in zip(clients, PIDS)]
    time.sleep(12.0)  # past the cut-off requests' next TCP retransmissions
    out["listed_later"] = [listing(c, pid) for pid in PIDS]
    out["killed_listed_later"] = [listing(c, pid) for pid in "kl"]
(run / "out.json").write_text(json.dumps(out))
"""


# A client killed while its requests are in a cut: no client is left to settle them (as above), so
# only TCP can keep them from the controller - the kernel retransmits a dead process's unacknowledged
# bytes for up to ~100 s (tcp_orphan_retries), long after the heal.
_KILLED_CLIENT = r"""
import sys, threading, time, torch
from pathlib import Path
from tq import KVBatchMeta, TQClient
address, run = sys.argv[1], Path(sys.argv[2])
c, over_zmq = (TQClient(address, timeout=3.0, transport="tcp") for _ in range(2))
over_zmq._ctrl.use_stream(None)
for pid in "kl":
    c.register_partition(pid)
    c.put(pid, ["a", "b"], {"x": torch.ones(2, 8)})
cut = threading.Event()

def call_in_cut(call, *args):
    call.__self__.get_meta("k")  # this thread's connection, made before the cut: its request goes into it
    connected.release()
    cut.wait()
    call(*args)

connected = threading.Semaphore(0)
calls = (
    (c.register_keys, ("k", ["c"])),
    (c.discard, (KVBatchMeta("l", ("a",)),)),
    (over_zmq.set_tags, (KVBatchMeta("k", ("a", "b"), tags={"t": (1, 2)}),)),
)
for call, args in calls:
    threading.Thread(target=call_in_cut, args=(call, *args), daemon=True).start()
for _ in calls:
    connected.acquire()
(run / "killed-ready").write_text("1")
while not (run / "cut").exists():
    time.sleep(0.01)
cut.set()
time.sleep(0.5)
(run / "killed-sending").write_text("1")
time.sleep(60)  # killed by the test before its calls time out
"""


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
@pytest.mark.timeout(180)
@pytest.mark.long
def test_a_request_that_timed_out_in_a_cut_is_not_applied_after_its_client_listed_the_partition(tmp_path):
    """A discard, a clear_partition, a register_partition(reuse=True) - which clears -, a register_keys
    and a set_tags sent into a network cut time out; each request stays in its closed TCP connection,
    retransmitted with back-off, and reaches the controller seconds after the link is back. The
    client's next request (a listing, right after the heal) settles them: what it lists stays so.
    Before the fixes the listing showed the partition as it was and the late requests then changed it
    - removed its keys (aa3bc39), added an empty key or rewrote its tags (6346793): requests that had
    raised, applied after their client had seen the partition without them. And a register_keys, a
    discard and a set_tags (over ZMQ) of a client killed while they wait in the cut never reach the
    controller: before the fix the dead process's kernel delivered them after the heal."""
    import json
    import os
    import signal
    import sys
    import time

    def await_file(name: str, log: str = "client.log") -> None:
        deadline = time.monotonic() + 90
        who = killed if log == "killed.log" else proc
        while not (tmp_path / name).exists():
            assert who.poll() is None and time.monotonic() < deadline, (tmp_path / log).read_text()
            time.sleep(0.05)

    with tq_partition.service_on_two_hosts(tmp_path, units_on=(0,)) as (cluster, address, env):
        killed = cluster.spawn(1, [sys.executable, "-c", _KILLED_CLIENT, address, str(tmp_path)], tmp_path / "killed.log", env)
        proc = cluster.spawn(1, [sys.executable, "-c", _CUT_DISCARDER, address, str(tmp_path)], tmp_path / "client.log", env)
        await_file("ready")
        await_file("killed-ready", "killed.log")
        cluster.cut(1)
        (tmp_path / "cut").write_text("1")
        await_file("killed-sending", "killed.log")
        os.killpg(killed.pid, signal.SIGKILL)  # its register_keys and discard in the cut, unanswered
        assert killed.wait(10) == -signal.SIGKILL, (tmp_path / "killed.log").read_text()
        await_file("sent")
        time.sleep(1.0)  # the requests' next retransmissions come after the heal
        cluster.heal(1)
        (tmp_path / "healed").write_text("1")
        proc.wait(60)
    assert proc.returncode == 0, (tmp_path / "client.log").read_text()
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["listed"] == out["listed_later"], out
    # the killed client's mint, discard and set_tags (over ZMQ) never reached the controller: its
    # connections gave up on them at its timeout (TCP_USER_TIMEOUT), ~8 s before the heal
    assert out["killed_listed_later"] == [[["a", "b"], {}], [["a", "b"], {}]], out
    assert all(out[op].startswith("raised") and "unknown" in out[op] for op in ("discard", "clear", "reuse", "mint", "tags")), out
