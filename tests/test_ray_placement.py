"""Storage units placed on Ray nodes (tq/ray_placement.py) serve a controller started without units."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch

from conftest import wait_until
from tq import JaggedTensor, TQClient, TQServer
from tq.errors import AuthenticationError

ray = pytest.importorskip("ray")

from tq.ray_placement import start_storage_units_on_ray_nodes, stop_storage_units  # noqa: E402

SECRET = "ray-placement-test-secret"


@pytest.fixture(scope="module")
def controller():
    # A secret: the single local node's IP is usually not loopback, and units bind that IP.
    server = TQServer(storage_units=0, secret=SECRET)
    yield server
    server.shutdown()


def test_missing_secret_refused_before_any_unit_starts(ray_session, controller):
    node_ip = ray.util.get_node_ip_address()
    if node_ip.startswith("127."):
        pytest.skip("the Ray node is on loopback, where no secret is required")
    with pytest.raises(AuthenticationError, match="without an auth secret"):
        start_storage_units_on_ray_nodes(controller.address, capacity_per_unit=16 << 20, secret=None)
    with TQClient(controller.address, secret=SECRET, timeout=10.0) as client:
        assert client.stats()["units"] == []


def test_units_on_ray_nodes_round_trip(ray_session, controller):
    node_ips = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    t0 = time.monotonic()
    handles = start_storage_units_on_ray_nodes(controller.address, capacity_per_unit=64 << 20, secret=SECRET)
    try:
        assert len(handles) == len(node_ips) == 1
        info = ray.get(handles[0].describe.remote(), timeout=30)
        assert info["node_ip"] in node_ips and info["address"].startswith(f"tcp://{info['node_ip']}:")
        print(f"units registered in {time.monotonic() - t0:.1f}s")

        # Created after the units registered, so hello lists them (see the module docstring).
        with TQClient(controller.address, secret=SECRET, timeout=10.0) as client:
            client.register_partition("ray")
            ids = [torch.randint(0, 100, (n,)) for n in (3, 9, 1, 6)]
            rewards = torch.tensor([0.5, -1.0, 2.0, 0.0])
            meta = client.put(
                "ray",
                ["u0_g0", "u0_g1", "u1_g0", "u1_g1"],
                {"input_ids": ids, "rewards": rewards},
                tags={"group": ["u0", "u0", "u1", "u1"]},
            )
            got = client.get(meta, layout="jagged")
            assert isinstance(got["input_ids"], JaggedTensor)
            for a, b in zip(got["input_ids"].unbind(), ids):
                assert torch.equal(a, b)
            assert torch.equal(got["rewards"], rewards)

            # the controller has the unit adopt the committed block after the put returns: asynchronously
            wait_until(lambda: client.stats()["unit_stats"][0]["blocks"] == 1)
            (unit,) = client.stats()["unit_stats"]
            assert unit["address"] == info["address"]
            assert unit["address"].split("://", 1)[1].rsplit(":", 1)[0] in node_ips
            assert unit["pid"] == info["pid"] and unit["blocks"] == 1, unit
            client.drop_partition("ray")

        # Across hosts bytes stream over TCP instead of shared memory: same data.
        with TQClient(controller.address, secret=SECRET, timeout=10.0, transport="tcp") as tcp_client:
            tcp_client.register_partition("ray-tcp")
            meta = tcp_client.put("ray-tcp", ["k0", "k1"], {"input_ids": ids[:2]})
            padded = tcp_client.get(meta, pad_to=12, pad_value=-1)["input_ids"]
            assert padded.shape == (2, 12) and torch.equal(padded[1, :9], ids[1]) and (padded[0, 3:] == -1).all()
            tcp_client.drop_partition("ray-tcp")
    finally:
        stop_storage_units(handles)
    _assert_gone(info)


def _assert_gone(info: dict, timeout: float = 15.0) -> None:
    """The unit process exited and removed its shared-memory arena."""
    proc = psutil.Process(info["pid"]) if psutil.pid_exists(info["pid"]) else None
    if proc is not None:
        gone, alive = psutil.wait_procs([proc], timeout=timeout)
        assert not alive, f"storage unit {info['pid']} still running"
    deadline = time.monotonic() + timeout
    while os.path.exists(info["arena_path"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(info["arena_path"]), "arena file left in shared memory"


def test_unit_dies_with_its_actor(ray_session, controller):
    """Killing the actor (no stop call) must not orphan the unit: it gets SIGTERM and cleans up."""
    handles = start_storage_units_on_ray_nodes(controller.address, capacity_per_unit=16 << 20, secret=SECRET)
    info = ray.get(handles[0].describe.remote(), timeout=30)
    ray.kill(handles[0])
    _assert_gone(info)
