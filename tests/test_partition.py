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
