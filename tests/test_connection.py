"""TQConnection, the one data-plane connection value: validated at construction, picklable with its
secret (resolved once, where it is built), and the only way policy/rollout/trainer get a client."""

from __future__ import annotations

import pickle

import pytest

from tq import TQConnection, TQServer
from tq.errors import AuthenticationError, InvalidRequestError, TQConnectionError


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"address": "localhost:5555"}, "address"),
        ({"address": "tcp://127.0.0.1:0"}, r"address must be a controller's 'tcp://HOST:PORT' \(port 1..65535\)"),  # was accepted
        ({"address": "tcp://127.0.0.1"}, "address"),
        ({"address": 5555}, "address"),
        ({"address": "tcp://127.0.0.1:1", "timeout_s": 0}, "timeout_s"),
        ({"address": "tcp://127.0.0.1:1", "timeout_s": float("inf")}, "timeout_s"),
        ({"address": "tcp://127.0.0.1:1", "capacity_wait_s": -1}, "capacity_wait_s"),
        ({"address": "tcp://127.0.0.1:1", "transport": "udp"}, "transport"),
        ({"address": "tcp://127.0.0.1:1", "secret": b"bytes"}, "secret"),
    ],
)
def test_bad_settings_fail_at_construction_naming_the_field(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        TQConnection(**kwargs)


def test_the_secret_is_resolved_once_where_built_pickled_along_and_never_printed(monkeypatch):
    monkeypatch.setenv("TQ_SECRET", "from-the-driver")
    conn = TQConnection("tcp://127.0.0.1:1")
    assert conn.secret == "from-the-driver"
    monkeypatch.setenv("TQ_SECRET", "a-worker-of-its-own")  # a worker's environment does not matter
    copy = pickle.loads(pickle.dumps(conn))
    assert copy == conn and copy.secret == "from-the-driver"
    assert "from-the-driver" not in repr(conn)
    assert conn.replace(timeout_s=2.0).timeout_s == 2.0 and conn.replace(timeout_s=2.0).secret == "from-the-driver"
    monkeypatch.delenv("TQ_SECRET")
    none = TQConnection("tcp://127.0.0.1:1")  # built where there is no secret: it has none, wherever it goes
    monkeypatch.setenv("TQ_SECRET", "a-worker-of-its-own")
    assert none.secret == "" and none.replace(timeout_s=1.0).secret == "" and pickle.loads(pickle.dumps(none)).secret == ""


def test_connect_signs_with_the_value_s_secret_only(monkeypatch):
    """Against a secret-protected service: the value's secret gets in with no TQ_SECRET in the
    environment; a value without one is refused even where the environment has the right secret."""
    monkeypatch.delenv("TQ_SECRET", raising=False)
    with TQServer(storage_units=1, capacity=16 << 20, secret="s3cret") as server:
        with TQConnection(server.address, secret="s3cret", timeout_s=10.0).connect() as client:
            assert client.list_partitions() == []
        bare = TQConnection(server.address, timeout_s=2.0)  # built with no secret anywhere
        monkeypatch.setenv("TQ_SECRET", "s3cret")
        with pytest.raises((AuthenticationError, TQConnectionError)):
            bare.connect().close()


def test_a_client_handed_to_a_ray_task_is_refused_naming_the_connection_to_pass(ray_session):
    """A client is one process's connection; passed to another process (a Ray task's argument, a
    pickle) it is refused with the fix - the TQConnection - instead of a weakref deep inside it."""
    ray = ray_session
    with TQServer(storage_units=1, capacity=16 << 20) as server:
        conn = TQConnection(server.address)
        with conn.connect() as client:
            with pytest.raises(TypeError, match=r"TQClient .* does not pickle: pass a tq.TQConnection"):
                pickle.dumps(client)
            with pytest.raises(TypeError, match=r"does not pickle: pass a tq.TQConnection"):
                ray.get(ray.remote(num_cpus=0.1)(lambda c: c).remote(client), timeout=60)

        @ray.remote(num_cpus=0.1)
        def partitions(c: TQConnection) -> list:
            with c.connect() as own:
                return own.list_partitions()

        assert ray.get(partitions.remote(conn), timeout=60) == []  # what to pass instead
