"""Authentication from the outside (issue 16): a captured signed request cannot be replayed, and a peer
without the secret cannot make a server hold the large message it announces.

Real controller and storage-unit processes with a secret, real sockets: requests are built with the
protocol's own request builder and sent from plain ZMQ DEALER sockets; the pre-auth attacks speak raw
ZMTP over a plain TCP socket.
"""

from __future__ import annotations

import hashlib
import socket
import struct
import threading
import time
import uuid

import numpy as np
import psutil
import pytest
import torch
import zmq

from conftest import raw_exchange, wait_until
from tq import TQClient, TQServer, protocol
from tq.errors import AuthenticationError, ReplayError
from tq.messages import Args, ReplyDecoder
from tq.rpc import RpcChannel, RpcServer

SECRET = "issue16-s3cret"
KEY = SECRET.encode()
MiB = 1 << 20


@pytest.fixture(scope="module")
def server():
    with TQServer(storage_units=1, capacity=64 * MiB, secret=SECRET) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with TQClient(server.address, secret=SECRET, timeout=10.0) as c:
        yield c


def _pid() -> str:
    return f"auth-{uuid.uuid4().hex[:8]}"


def _ok(reply: protocol.Message | None):
    assert reply is not None, "no reply"
    return protocol.raise_for_reply(reply)


def _x(client: TQClient, meta) -> list[float]:
    return client.get(meta)["x"].tolist()


# ----------------------------------------------------------------------------- replay
def test_captured_clear_partition_replayed_later_is_refused(server, client):
    pid = _pid()
    client.register_partition(pid)
    client.put(pid, ["old"], {"x": torch.tensor([1.0])})
    captured = [bytes(f) for f in protocol.request("clear_partition", 1, {"partition": pid}, [], KEY)]
    assert _ok(raw_exchange(server.address, captured, secret=KEY)) == {"keys_cleared": 1}  # the genuine request
    new = client.put(pid, ["new"], {"x": torch.tensor([2.0])})
    rejected = client.stats()["rejected_messages"]
    # The same bytes again, later, from a fresh socket that has the connection credentials.
    reply = raw_exchange(server.address, captured, secret=KEY)
    with pytest.raises(ReplayError, match="replay"):
        _ok(reply)
    assert _x(client, new) == [2.0]  # the newer data survived
    assert client.stats()["rejected_messages"] == rejected + 1
    client.drop_partition(pid)


@pytest.mark.parametrize("skew", [-1, 1], ids=["past", "future"])
def test_request_outside_the_time_window_is_refused(server, client, monkeypatch, skew):
    pid = _pid()
    client.register_partition(pid)
    meta = client.put(pid, ["k"], {"x": torch.tensor([3.0])})
    real = time.time_ns
    with monkeypatch.context() as m:  # a request stamped 2 windows off this host's clock
        m.setattr(time, "time_ns", lambda: real() + skew * int(2 * protocol.REPLAY_WINDOW_S * 1e9))
        frames = protocol.request("clear_partition", 1, {"partition": pid}, [], KEY, protocol.Sender())
    with pytest.raises(ReplayError, match="window"):
        _ok(raw_exchange(server.address, frames, secret=KEY))
    assert _x(client, meta) == [3.0]
    client.drop_partition(pid)


@pytest.mark.parametrize("target", ["controller", "unit"])
def test_sequence_going_back_is_refused_and_a_fresh_sender_is_accepted(server, client, target):
    address = server.address if target == "controller" else client._units[0].address
    sender = protocol.Sender()
    first = protocol.request("stats", 1, {}, [], KEY, sender)
    second = protocol.request("stats", 2, {}, [], KEY, sender)
    assert _ok(raw_exchange(address, second, secret=KEY))  # seq 2: accepted
    with pytest.raises(ReplayError, match="replay"):
        _ok(raw_exchange(address, first, secret=KEY))  # seq 1 of the same sender, after 2: refused
    assert _ok(raw_exchange(address, protocol.request("stats", 3, {}, [], KEY, protocol.Sender()), secret=KEY))  # a new sender


def test_replay_guard_forgets_senders_older_than_the_window():
    guard = protocol.ReplayGuard(window_s=0.2)
    headers = []
    for _ in range(100):
        h: dict = {}
        protocol.Sender().stamp(h)
        guard.check(h)
        headers.append(h)
    assert len(guard) == 100
    time.sleep(0.3)
    h = {}
    protocol.Sender().stamp(h)
    guard.check(h)
    assert len(guard) == 1  # bounded memory: the 100 stale senders are forgotten...
    with pytest.raises(ReplayError, match="window"):
        guard.check(headers[0])  # ...and their requests are still refused, by the timestamp
    with pytest.raises(ReplayError, match="lacks"):
        guard.check({"op": "stats"})
    assert "sid" not in protocol.decode(protocol.request("stats", 1, {}, [], None), None).header  # no secret: no stamp


def test_normal_traffic_from_many_threads_is_never_refused(client):
    """Every client socket and the controller's sockets to the units stamp their own sequences: busy
    concurrent use must not trip the replay check anywhere."""
    before = [client.stats()["rejected_messages"], client.stats()["unit_stats"][0]["rejected_messages"]]
    pid = _pid()
    client.register_partition(pid)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(20):
                meta = client.put(pid, [f"t{t}-{i}"], {"x": torch.tensor([float(i)])})
                assert _x(client, meta) == [float(i)]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    client.clear_partition(pid)
    client.drop_partition(pid)
    stats = client.stats()
    assert [stats["rejected_messages"], stats["unit_stats"][0]["rejected_messages"]] == before


# ----------------------------------------------------------------------------- connection gate
def test_servers_in_one_process_share_the_zap_handler_and_keep_their_own_secrets():
    servers = {
        name: RpcServer(name, "tcp://127.0.0.1:0", secret=secret, max_message_bytes=MiB)
        for name, secret in (("a", b"secret-a"), ("b", b"secret-b"), ("open", None))
    }
    threads = []

    class Echo(Args):
        n: str = ""

    replies = {"echo": ReplyDecoder("echo", Echo)}
    for srv in servers.values():
        srv.serve_ops({"echo": Echo}, {"echo": lambda args, buffers, call: args})
        threads.append(threading.Thread(target=srv.serve_forever, daemon=True))
        threads[-1].start()
    try:
        for name, secret in (("a", b"secret-a"), ("b", b"secret-b"), ("open", None)):
            with_own = RpcChannel(servers[name].address, secret=secret, timeout=5.0, name=name, replies=replies)
            assert with_own.call("echo", {"n": name})[0] == Echo(n=name)
            with_own.close()
        wrong = RpcChannel(servers["b"].address, secret=b"secret-a", timeout=5.0, name="b", replies=replies)
        t0 = time.monotonic()
        with pytest.raises(AuthenticationError, match="refused this client's credentials"):
            wrong.call("echo", {})
        assert time.monotonic() - t0 < 2.0  # told at once, not after the timeout
        wrong.close()
        assert wait_until(lambda: servers["b"].rejected == 1) and servers["a"].rejected == 0
    finally:
        for srv in servers.values():
            srv.stop()
        for t in threads:
            t.join(5)


# ----------------------------------------------------------------------------- pre-auth memory
def _greeting(mechanism: bytes) -> bytes:
    """A ZMTP 3.0 greeting: signature, version, mechanism, as-server, filler (64 bytes)."""
    return b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + mechanism.ljust(20, b"\0") + b"\0" + bytes(31)


def _unit_rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


@pytest.fixture
def unit(client):
    """The storage unit's pid and address, and checksummed data stored on it (checked afterwards)."""
    pid = _pid()
    client.register_partition(pid)
    data = torch.from_numpy(np.random.default_rng(16).integers(0, 255, size=(4, 256 * 1024), dtype=np.uint8))
    meta = client.put(pid, ["a", "b", "c", "d"], {"x": data})
    digest = hashlib.sha256(data.numpy().tobytes()).hexdigest()
    info = client.stats()["unit_stats"][0]
    yield info["pid"], client._units[0].address
    got = client.get(meta)["x"]  # the unit kept serving, data intact
    assert hashlib.sha256(got.numpy().tobytes()).hexdigest() == digest
    client.drop_partition(pid)


def _stream_huge_frame(address: str, mechanism: bytes, flags: int, unit_pid: int, *, send: int = 200 * MiB) -> tuple[int, int]:
    """Open a raw TCP connection, greet with ``mechanism``, start a frame (``flags``) that declares
    7 GiB and stream up to ``send`` bytes of it (less if the server hangs up). Returns the bytes
    streamed and how much the unit's RSS grew while the connection was still open."""
    host, port = address.split("://", 1)[1].rsplit(":", 1)
    rss0 = _unit_rss(unit_pid)
    sent = 0
    with socket.create_connection((host, int(port)), timeout=5.0) as s:
        s.settimeout(5.0)
        chunk = bytes(MiB)
        deadline = time.monotonic() + 60.0
        try:
            s.sendall(_greeting(mechanism))
            s.sendall(bytes([flags]) + struct.pack(">Q", 7 << 30))
            while sent < send and time.monotonic() < deadline:
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:  # the server hung up (broken pipe, reset) or stopped reading (timeout)
            pass
        time.sleep(0.3)  # let the server's I/O thread take in what is in flight
        grown = _unit_rss(unit_pid) - rss0
    return sent, grown


def test_raw_peer_without_the_secret_cannot_make_a_unit_buffer_a_huge_frame(client, unit):
    unit_pid, address = unit
    rejected = client.stats()["unit_stats"][0]["rejected_messages"]
    sent, grown = _stream_huge_frame(address, b"NULL", 0x02, unit_pid)  # 0x02: a long message frame
    assert grown < 32 * MiB, f"the unit grew by {grown / MiB:.0f} MiB while a peer streamed {sent / MiB:.0f} MiB of a 7 GiB frame"
    assert sent < 200 * MiB  # it was cut off early
    assert client.stats()["unit_stats"][0]["rejected_messages"] > rejected  # and counted


def test_dealer_without_the_password_gets_nothing_in(client, unit):
    unit_pid, address = unit
    rss0 = _unit_rss(unit_pid)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)  # see conftest.raw_exchange: the send may find no connection left
    try:
        sock.connect(address)
        try:  # framed by hand: protocol.request itself refuses a frame over the limit
            sock.send_multipart(protocol.encode({"op": "stats", "rid": 1, "args": {}}, [np.zeros(100 * MiB, dtype=np.uint8)], None))
        except zmq.Again:  # refused before the frames were queued: nothing got in
            pass
        assert not sock.poll(3000, zmq.POLLIN), "a peer without the secret got a reply"
        grown = _unit_rss(unit_pid) - rss0
    finally:
        sock.close(0)
    assert grown < 32 * MiB, f"the unit grew by {grown / MiB:.0f} MiB"


def test_peer_announcing_plain_cannot_make_a_unit_buffer_a_huge_hello(client, unit):
    """libzmq reads a whole handshake command, up to ZMQ_MAXMSGSIZE, before the PLAIN mechanism sees it:
    with that limit per frame (protocol.MAX_FRAME_BYTES), a 7 GiB HELLO is refused from its length
    prefix. Failed on 9c4cb28 (the limit was 8 GiB + 64 MiB: the unit buffered what the peer sent)."""
    unit_pid, address = unit
    sent, grown = _stream_huge_frame(address, b"PLAIN", 0x06, unit_pid)  # 0x06: a long command frame
    assert grown < 32 * MiB, f"the unit grew by {grown / MiB:.0f} MiB while a peer streamed {sent / MiB:.0f} MiB of a 7 GiB HELLO"


def test_a_request_frame_over_the_limit_fails_on_the_client_naming_it():
    """A frame the servers would refuse at the socket (dropping the connection without a reply) is
    refused where it is built, naming the op, instead of ending in a timeout."""
    from tq import protocol
    from tq.errors import MessageTooLargeError

    big = np.zeros(protocol.MAX_FRAME_BYTES + 1, np.uint8)
    with pytest.raises(MessageTooLargeError, match="'commit'.*frame limit"):
        protocol.request("commit", 1, {"x": 1}, [big], None)
    assert len(protocol.request("commit", 1, {"x": 1}, [big[: protocol.MAX_FRAME_BYTES]], None)) == 3


def test_a_server_dying_mid_handshake_is_reported_unreachable_not_as_a_secret_mismatch():
    """A peer that hangs up during the first handshake and is then gone (a storage unit SIGKILLed
    while a client connects, seen in the chaos run): the client has no secret and the server wanted
    none, so the error is 'cannot reach', never 'requires an auth secret'."""
    from tq import messages
    from tq.errors import TQConnectionError

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    chan = RpcChannel(f"tcp://127.0.0.1:{port}", secret=None, timeout=1.5, name="controller", replies=messages.CONTROLLER_REPLY_DECODERS)
    try:
        rid = None

        def hang_up_once() -> None:
            conn, _ = listener.accept()  # mid-handshake: the client's greeting is on its way
            conn.close()
            listener.close()  # and gone: reconnects are refused

        t = threading.Thread(target=hang_up_once)
        t.start()
        with pytest.raises(TQConnectionError) as err:
            rid = chan.call(messages.ControllerOp.STATS, messages.Stats())
        t.join(5)
        assert not isinstance(err.value, AuthenticationError), err.value
        assert "cannot reach" in str(err.value) and rid is None
    finally:
        chan.close()
        listener.close()
