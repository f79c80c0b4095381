"""Stream sockets (tq.stream_transport): the stream framing, and real controller and storage-unit
processes serving clients over their Unix sockets (this host's; also the controller reaching its
units) and their TCP stream sockets (other hosts') - also when the peer is hostile, stops reading,
dies, or reached the wrong server.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tq.client
from conftest import free_port, raw_exchange, shut_down, unique_keys, wait_until
from tq import TQClient, TQServer, protocol
from tq.errors import (
    AuthenticationError,
    MalformedMessageError,
    MessageTooLargeError,
    ReplayError,
    StorageUnitError,
    TQConnectionError,
)
from tq.stream_transport import RECV_CHUNK, ClientStream, parse_tcp_address, tcp_address

MiB = 1 << 20
pytestmark = pytest.mark.skipif(not os.uname().sysname == "Linux", reason="abstract Unix sockets are Linux's")


# ----------------------------------------------------------------------------- framing (pure)
def _message(frames: list[bytes]) -> bytes:
    return protocol.stream_prefix(frames) + b"".join(frames)


def test_stream_reader_cuts_messages_wherever_the_bytes_split():
    msgs = [[b"head", b"", b"x" * 70_000], [b"h2", b"mac", b"", b"tail"], [b"only"]]
    stream = b"".join(_message(m) for m in msgs)
    for chunk in (1, 3, 4096, len(stream)):
        reader = protocol.StreamReader()
        got = []
        for i in range(0, len(stream), chunk):
            got += reader.feed(stream[i : i + chunk])
        assert [[bytes(f) for f in m] for m in got] == msgs
        assert reader.pending == 0
    frame = protocol.StreamReader().feed(_message([b"abc"]))[0][0]
    frame[0] = ord("z")  # writable, as a received ZMQ frame is (a decoder may reuse it in place)


def test_stream_reader_receives_a_large_message_straight_into_its_buffer():
    """Once a large message's prefix came, the rest of it is received into the message's own buffer
    (no chunk copied into it); a small one's is not offered; what follows is read as before."""
    big, small = [b"h", bytes(range(256)) * 1024], [b"next"]
    wire = _message(big) + _message(small)
    reader = protocol.StreamReader()
    cut = 100
    assert reader.feed(wire[:cut]) == [] and reader.pending > 0
    into = reader.body_left(RECV_CHUNK)
    assert into is not None and into.nbytes == len(_message(big)) - cut
    into[:1000] = wire[cut : cut + 1000]
    assert reader.received(1000) == []
    rest = reader.body_left(RECV_CHUNK)
    end = len(_message(big))
    rest[:] = wire[cut + 1000 : end]
    assert [bytes(f) for f in reader.received(rest.nbytes)[0]] == big
    assert reader.body_left(1) is None  # between messages: nothing to receive into
    assert [[bytes(f) for f in m] for m in reader.feed(wire[end:])] == [small]
    reader.feed(_message([b"x" * 100])[:20])
    assert reader.body_left(RECV_CHUNK) is None  # too little left to be worth a receive of its own
    with pytest.raises(ValueError, match="received 200 bytes"):
        reader.received(200)


def test_stream_reader_receives_a_body_into_the_buffer_its_allocator_gives():
    """A transport hands the reader its pool's allocator: each message's body is one buffer of it,
    asked for at the message's whole size, and the frames are views of that buffer."""
    made: list[np.ndarray] = []

    def alloc(n: int) -> np.ndarray:
        made.append(np.empty(n, np.uint8))
        return made[-1]

    msgs = [[b"h", bytes(range(256)) * 64], [b"next", b"x" * 10]]
    got = protocol.StreamReader(alloc=alloc).feed(b"".join(_message(m) for m in msgs))
    assert [[bytes(f) for f in m] for m in got] == msgs
    assert [a.size for a in made] == [sum(len(f) for f in m) for m in msgs]
    assert all(np.shares_memory(np.frombuffer(f, np.uint8), a) for m, a in zip(got, made) for f in m if len(f))


def test_big_replies_are_received_into_pooled_buffers_that_the_next_one_reuses(server):
    """A remote client's big reply lands in a buffer of the process's receive pool, which it goes
    back to once the get copied out of it - so the next big reply reuses its pages (a fresh buffer
    per message, faulted in page by page, before)."""
    import gc

    import tq.stream_transport as transport

    transport.trim_receive_buffers()
    with TQClient(server.address, transport="tcp") as c:
        c.register_partition("recv-pool")
        value = torch.arange(2 * (1 << 20), dtype=torch.int32).reshape(1, -1)  # 8 MiB in one row
        meta = c.put("recv-pool", ["big"], {"x": value})
        assert torch.equal(c.get(meta, ["x"])["x"], value)
        gc.collect()
        held = transport._bodies.cached_bytes
        assert held >= 8 << 20  # the reply's buffer, idle in the pool
        for _ in range(3):
            assert torch.equal(c.get(meta, ["x"])["x"], value)
        gc.collect()
        assert transport._bodies.cached_bytes == held  # reused, not one more per get
    assert transport.trim_receive_buffers() == held and transport._bodies.cached_bytes == 0


def test_stream_reader_refuses_what_no_peer_sends_before_buffering_it():
    with pytest.raises(MalformedMessageError, match="declares 0 frames"):
        protocol.StreamReader().feed(struct.pack("<I", 0))
    with pytest.raises(MalformedMessageError, match="declares 4097 frames"):
        protocol.StreamReader().feed(struct.pack("<I", protocol.MAX_STREAM_FRAMES + 1))
    huge = struct.pack("<IQ", 1, protocol.MAX_FRAME_BYTES + 1)
    with pytest.raises(MessageTooLargeError, match="frame of"):
        protocol.StreamReader().feed(huge)  # refused from the prefix: the frame's bytes never came
    with pytest.raises(MessageTooLargeError, match="exceeds the limit of 1000"):
        protocol.StreamReader(max_message_bytes=1000).feed(struct.pack("<IQQ", 2, 600, 600))


# ----------------------------------------------------------------------------- a real service
@pytest.fixture(scope="module")
def server():
    with TQServer(storage_units=1, capacity=64 * MiB) as srv:
        yield srv


def _hello(address: str, secret: bytes | None = None) -> dict:
    reply = raw_exchange(address, protocol.request("hello", 1, {"timeout": 5.0}, [], secret), secret=secret)
    return protocol.raise_for_reply(reply)


def _local_connections(server: TQServer) -> int:
    with TQClient(server.address, transport="tcp") as remote:  # adds none itself
        return remote.stats()["local_connections"]


def test_same_host_clients_and_units_talk_over_the_unix_socket(server):
    """A same-host client's requests reach the controller over its Unix socket, and the controller
    reaches its unit over the unit's; a 'tcp' client (acting as a remote one) uses neither."""
    info = _hello(server.address)
    assert info["local_address"].startswith("@tq-")
    assert info["units"][0]["local_address"].startswith("@tq-")
    with TQClient(server.address, transport="tcp") as remote:
        remote.register_partition("lt-remote", reuse=True)
        st = remote.stats()
        base = st["local_connections"]
        assert [u["local_connections"] for u in st["unit_stats"]] == [1]  # the controller's connection
    with TQClient(server.address) as local:
        local.register_partition("lt-local", reuse=True)
        meta = local.put("lt-local", unique_keys(4), {"x": torch.arange(4.0)})
        assert local.get(meta, ["x"])["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert local.stats()["local_connections"] == base + 1
        big = local.put("lt-local", unique_keys(1), {"y": torch.zeros(1, 512 * 1024)})  # 2 MiB: a slab of its own
        assert local.get(big, ["y"])["y"].shape == (1, 512 * 1024)
        assert [u["local_connections"] for u in local.stats()["unit_stats"]] == [2]  # the controller's and ours
    assert wait_until(lambda: _local_connections(server) == base, timeout=5.0)  # closed: the server dropped it


def _raw_connect(address: str) -> socket.socket:
    """A bare connection to a server's stream socket (a TCP one past its token), nothing sent yet."""
    if address.startswith("tcp://"):
        host, port, token = parse_tcp_address(address)
        s = socket.create_connection((host, port), 5.0)
        s.sendall(protocol.stream_preamble(token))
        assert s.recv(1) == protocol.STREAM_ACCEPTED
        return s
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + address[1:])
    return s


@pytest.mark.parametrize("kind", ["local_address", "stream_address"], ids=["unix", "tcp"])
def test_hostile_bytes_on_a_stream_socket_close_that_connection_only(server, kind):
    """Garbage, an oversized frame, and a request cut short: each closes its own connection (counted
    as rejected) and the controller serves everyone else as before."""
    address = _hello(server.address)[kind]
    with TQClient(server.address) as client:
        before = client.stats()["rejected_messages"]
        for junk in (b"\xff" * 64, struct.pack("<IQ", 1, protocol.MAX_FRAME_BYTES + 1), struct.pack("<I", 10**6)):
            s = _raw_connect(address)
            s.sendall(junk)
            s.settimeout(5.0)
            assert s.recv(10) == b""  # closed by the server, without a reply
            s.close()
        cut = _raw_connect(address)  # half a request, then gone
        whole = _message(protocol.request("list_partitions", 1, {}, [], None))
        cut.sendall(whole[: len(whole) // 2])
        cut.close()
        client.register_partition("lt-hostile", reuse=True)
        assert "lt-hostile" in [p["partition"] for p in client.list_partitions()]
        assert client.stats()["rejected_messages"] == before + 3


@pytest.mark.parametrize("kind", ["local_address", "stream_address"])
def test_a_declared_but_unsent_message_costs_the_server_no_memory(server, kind):
    """A peer may declare a message as big as the server takes and send none of it: the server's
    buffer for it (a pooled receive buffer) is only reserved, its pages not allocated until bytes
    come - its memory stays put, and it serves everyone as before."""
    import psutil

    address = _hello(server.address)[kind]
    proc = psutil.Process(server.proc.pid)
    before = proc.memory_info().rss
    socks = []
    for _ in range(2):
        s = _raw_connect(address)
        s.sendall(struct.pack("<I4Q", 4, *[60 * MiB] * 4))  # 240 MiB to come (the controller takes 256 MiB)
        s.sendall(b"\x00" * 100)  # a little of it
        socks.append(s)
    with TQClient(server.address) as client:
        client.register_partition("declared", reuse=True)  # served meanwhile
        grown = proc.memory_info().rss - before
        assert grown < 64 * MiB, f"the controller grew {grown / MiB:.0f} MiB for messages never sent"
    for s in socks:
        s.close()


def test_a_peer_that_never_reads_its_replies_does_not_stall_the_controller(server):
    """Requests whose replies pile up unread (more than the socket buffer holds) are queued by the
    controller, which goes on serving other clients; the replies all arrive once the peer reads."""
    with TQClient(server.address) as client:
        client.register_partition("lt-slow", reuse=True)
        keys = unique_keys(20_000, "slow")
        client.put("lt-slow", keys, {"x": torch.zeros(len(keys))})
        stream = ClientStream(_hello(server.address)["local_address"], 5.0)
        n = 40  # each reply lists 20,000 keys (~400 KB): far past a Unix socket's buffer
        for rid in range(1, n + 1):
            stream.send(protocol.request("get_meta", rid, {"partition": "lt-slow"}, [], None), 5.0)
        t0 = time.monotonic()
        assert len(client.get_meta("lt-slow").keys) == len(keys)
        assert time.monotonic() - t0 < 5.0
        rids = [protocol.decode_reply(stream.recv(10.0), None).rid for _ in range(n)]
        assert rids == list(range(1, n + 1))
        stream.close()


def test_a_client_waiting_on_a_controller_that_dies_hears_it_at_once():
    """A call in flight over the Unix socket fails as soon as the controller's process is gone - not
    after its timeout, as over ZMQ, where a lost request looks like a slow one."""
    with TQServer(storage_units=1, capacity=16 * MiB) as srv, TQClient(srv.address, timeout=60.0) as client:
        client.register_partition("lt-dies")
        meta = client.mint_keys("lt-dies", ["u"], 1)
        failed: list[BaseException] = []

        def wait() -> None:
            try:
                client.wait(meta, ["never"], timeout=50.0)
            except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
                failed.append(exc)

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.5)  # parked in the controller
        os.kill(srv.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        t.join(20.0)
        assert not t.is_alive() and time.monotonic() - t0 < 10.0
        assert isinstance(failed[0], TQConnectionError) and "connection lost" in str(failed[0])


@pytest.mark.parametrize("kind", ["local_address", "stream_address"], ids=["unix", "tcp"])
def test_a_stream_socket_checks_the_secret_refuses_replays_and_drops_who_fails(kind):
    """No handshake authenticates a stream connection (ZMTP PLAIN does ZMQ's; a TCP stream's token only
    names the server), so each request's HMAC and stamp are checked; a connection whose request fails
    them gets its error and is closed - an unauthenticated process holds no more of the server than
    one reply."""
    secret = "local-s3cret"
    key = secret.encode()
    with TQServer(storage_units=1, capacity=16 * MiB, secret=secret) as srv:
        address = _hello(srv.address, key)[kind]

        def answered_then_dropped(request: list, expected: type[Exception]) -> None:
            stream = ClientStream(address, 5.0)
            stream.send(request, 5.0)
            with pytest.raises(expected):
                protocol.raise_for_error(protocol.decode_reply(stream.recv(5.0), None))
            with pytest.raises(TQConnectionError):  # closed by the server
                stream.recv(5.0)
            stream.close()

        answered_then_dropped(protocol.request("create_partition", 1, {"partition": "lt-unsigned"}, [], None), AuthenticationError)
        wrong = protocol.request("create_partition", 2, {"partition": "lt-wrong"}, [], b"not-the-secret", protocol.Sender())
        answered_then_dropped(wrong, AuthenticationError)
        stream = ClientStream(address, 5.0)
        signed = protocol.request("create_partition", 3, {"partition": "lt-signed"}, [], key, protocol.Sender())
        stream.send(signed, 5.0)
        protocol.raise_for_error(protocol.decode_reply(stream.recv(5.0), key))
        again = protocol.request("list_partitions", 4, {}, [], key, protocol.Sender())
        stream.send(again, 5.0)  # a signed connection stays open
        protocol.raise_for_error(protocol.decode_reply(stream.recv(5.0), key))
        stream.close()
        answered_then_dropped(signed, ReplayError)  # captured and sent again
        with TQClient(srv.address, secret=secret) as client:
            assert sorted(p["partition"] for p in client.list_partitions()) == ["lt-signed"]
            assert client.stats()["local_connections"] >= 1
            assert client.stats()["auth_failures"] >= 3


def test_with_a_secret_a_connection_that_never_authenticates_is_closed_after_the_handshake_time(monkeypatch):
    """With a secret, a same-host connection that sends no authenticated request within HANDSHAKE_S of
    being accepted is closed (an idle one would hold a descriptor of the server for as long as it
    liked; ZMQ gives its PLAIN handshake a time limit the same way). One that sent a signed request
    stays open past it. (The server's loop in this process, HANDSHAKE_S cut to 1.5 s: a TQServer's
    10 s cost the suite ~9 s.)"""
    import tq.stream_transport as lt
    from tq import messages
    from tq.rpc import RpcServer

    monkeypatch.setattr(lt, "HANDSHAKE_S", 1.5)
    key = b"idle-s3cret"
    server = RpcServer("idle", "tcp://127.0.0.1:0", secret=key, max_message_bytes=1 << 20)
    server.listen_streams()
    address = server.local.address
    server.serve_ops({"ping": messages.Ping}, {"ping": lambda args, buffers, call: {}})
    loop = threading.Thread(target=server.serve_forever, daemon=True)
    loop.start()
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    signed = None
    try:
        idle.connect("\0" + address[1:])
        signed = ClientStream(address, 5.0)
        signed.sender = protocol.Sender()
        signed.send(protocol.request("ping", 1, {}, [], key, signed.sender), 5.0)
        protocol.raise_for_error(protocol.decode_reply(signed.recv(5.0), key))
        t0 = time.monotonic()
        idle.settimeout(lt.HANDSHAKE_S + 5.0)
        assert idle.recv(10) == b""  # closed by the server
        assert lt.HANDSHAKE_S - 0.5 <= time.monotonic() - t0 <= lt.HANDSHAKE_S + 5.0
        signed.send(protocol.request("ping", 2, {}, [], key, signed.sender), 5.0)
        protocol.raise_for_error(protocol.decode_reply(signed.recv(5.0), key))  # still open
    finally:
        idle.close()
        if signed is not None:
            signed.close()
        server.stop()
        loop.join(5)


def test_a_first_request_left_unread_by_a_busy_loop_is_served_not_taken_for_idleness(monkeypatch):
    """The handshake time is checked at the loop's tick, after the requests of that turn: a connection
    whose first request came while the loop was busy past the time (in another request's handler) has
    it waiting unread - it is put off once and served, not closed as idle."""
    import tq.stream_transport as lt
    from tq import messages
    from tq.rpc import RpcServer

    monkeypatch.setattr(lt, "HANDSHAKE_S", 1.0)
    key = b"busy-s3cret"
    server = RpcServer("busy", "tcp://127.0.0.1:0", secret=key, max_message_bytes=1 << 20)
    server.listen_streams()
    address = server.local.address

    def ping(args: messages.Ping, buffers: list, call: object) -> dict:
        if getattr(call, "rid", None) == 1:
            time.sleep(1.5)  # the loop is busy past HANDSHAKE_S
        return {}

    server.serve_ops({"ping": messages.Ping}, {"ping": ping})
    loop = threading.Thread(target=server.serve_forever, daemon=True)
    loop.start()
    a, b = ClientStream(address, 5.0), ClientStream(address, 5.0)
    try:
        assert wait_until(lambda: len(server.local.peers) == 2)  # both accepted, the clock running
        a.sender, b.sender = protocol.Sender(), protocol.Sender()
        a.send(protocol.request("ping", 1, {}, [], key, a.sender), 5.0)
        time.sleep(0.3)  # the loop is in a's handler
        b.send(protocol.request("ping", 2, {}, [], key, b.sender), 5.0)
        protocol.raise_for_error(protocol.decode_reply(a.recv(5.0), key))
        protocol.raise_for_error(protocol.decode_reply(b.recv(5.0), key))  # served, not closed
    finally:
        a.close()
        b.close()
        server.stop()
        loop.join(5)


@pytest.mark.parametrize("apart", [False, True], ids=["one-read", "next-read"])
def test_every_request_a_peer_sent_before_it_went_away_is_served(apart):
    """A controller stopping sends its units its last messages and ``shutdown``, and closes its
    connection without reading the replies. A unit that reads the first fails to write its reply (the
    peer is gone) - and must still read and serve the rest, as ZMQ serves what a peer sent before it
    disconnected: only the replies are lost. ``next-read``: the shutdown (carrying a buffer bigger
    than one read) is still in the socket when the reply fails. (Found as a storage unit left running,
    its arena left in /dev/shm, after a journaled controller's clean stop on a loaded machine.)"""
    from tq import messages
    from tq.rpc import RpcServer

    server = RpcServer("unit-like", "tcp://127.0.0.1:0", secret=None, max_message_bytes=1 << 20)
    server.listen_streams()
    address = server.local.address
    served: list[str] = []

    def ping(args: messages.Ping, buffers: list, call: object) -> dict:
        served.append("ping")
        return {}

    def shutdown(args: messages.UnitShutdown, buffers: list, call: object) -> dict:
        served.append("shutdown")
        server.stop()
        return {"stopping": True}

    server.serve_ops({"ping": messages.Ping, "shutdown": messages.UnitShutdown}, {"ping": ping, "shutdown": shutdown})
    peer = ClientStream(address, 5.0)  # waits in the listen backlog: the loop is not running yet
    peer.send(protocol.request("ping", 1, {}, [], None), 5.0)
    pad = [np.zeros(RECV_CHUNK, np.uint8)] if apart else []  # the first read ends inside the shutdown
    peer.send(protocol.request("shutdown", 2, {}, pad, None), 5.0)
    peer.close()  # gone before the server reads either request
    loop = threading.Thread(target=server.serve_forever, daemon=True)
    loop.start()
    try:
        loop.join(5.0)
        assert served == ["ping", "shutdown"] and not loop.is_alive()  # it stopped on its own
    finally:
        server.stop()
        loop.join(5.0)


def test_a_peer_that_sends_requests_without_reading_replies_is_held_back_not_buffered():
    """A same-host peer that sends request after request and reads no reply: once MAX_QUEUED_MESSAGES
    replies wait for it, the controller reads no more of its requests (its own socket holds it back),
    so the controller's memory does not grow with what a peer leaves unread (200,000 unread requests
    grew it by 154 MiB before) - and it serves everyone else meanwhile, and every reply once the peer
    reads."""
    from tq.stream_transport import MAX_QUEUED_MESSAGES

    # a service of its own: the module's holds earlier tests' partitions, which made its 20,000
    # listings take 25 s of the test's 29 s in the file's run (the test alone: 1.6 s)
    with TQServer(storage_units=1, capacity=16 * MiB) as server, TQClient(server.address) as client:
        address = _hello(server.address)["local_address"]

        def served() -> int:
            return client.stats()["ops"].get("list_partitions", {}).get("count", 0)

        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect("\0" + address[1:])
        n = 20 * MAX_QUEUED_MESSAGES
        sender = threading.Thread(target=s.sendall, args=(_message(protocol.request("list_partitions", 1, {}, [], None)) * n,))
        before = served()
        sender.start()
        seen = [-1]

        def settled() -> bool:  # no more of the peer's requests served between two looks
            now = served()
            stable, seen[0] = now == seen[0], now
            return stable and now > before + MAX_QUEUED_MESSAGES

        assert wait_until(settled, timeout=20, interval=0.5)
        held = served() - before
        assert held < n // 2, held  # the rest waits in the peer's socket, not in the controller
        client.register_partition("lt-flood", reuse=True)  # others are served meanwhile
        assert "lt-flood" in [p["partition"] for p in client.list_partitions()]
        s.settimeout(30.0)
        reader, replies = protocol.StreamReader(), 0
        while replies < n:
            chunk = s.recv(1 << 16)
            assert chunk, f"closed after {replies} of {n} replies"
            replies += len(reader.feed(chunk))
        sender.join(30)
        s.close()
        assert replies == n and not sender.is_alive()


def test_a_fetch_of_many_big_parts_over_a_units_socket_gets_every_reply(monkeypatch):
    """A get read as frames from a same-host unit (a same-host get's last try, after its copies raced
    frees) sends all its ~16 MiB parts before reading a reply: 384 MiB waits at the unit, past
    MAX_QUEUED_BYTES, so the unit stops reading that connection and resumes as the client drains it -
    every part arrives, nothing is dropped."""
    import tq.client
    from tq.stream_transport import MAX_QUEUED_BYTES

    monkeypatch.setattr(tq.client, "SHM_READ_TRIES", 0)  # straight to the frames path
    monkeypatch.setattr(TQClient, "_locate_here", lambda self, *args: None)
    monkeypatch.setattr(protocol, "TCP_FETCH_STREAMS", 1)  # every part on one connection
    rows = torch.arange(24 * (MiB * 2), dtype=torch.float64).reshape(24, -1)  # 24 rows of 16 MiB
    assert rows.numel() * 8 > MAX_QUEUED_BYTES
    with TQServer(storage_units=1, capacity=512 * MiB) as srv, TQClient(srv.address, timeout=60.0) as c:
        c.register_partition("lt-big")
        meta = c.put("lt-big", [f"b{i}" for i in range(24)], {"x": rows})
        before = c.stats()["unit_stats"][0]["ops"].get("fetch", {}).get("count", 0)
        assert torch.equal(c.get(meta)["x"], rows)
        st = c.stats()["unit_stats"][0]
        assert st["ops"]["fetch"]["count"] - before >= 24 and st["local_connections"] >= 2  # the controller's and ours


def test_big_replies_to_several_streams_are_written_side_by_side(monkeypatch):
    """Replies of a MiB or more waiting for several connections at once are written each on its own
    thread, the loop's thread waiting for all (a TCP write's kernel copy was most of a unit's time
    serving big fetches, all of it on one thread) - and every reply arrives whole, in order."""
    import tq.stream_transport as lt
    from tq import messages
    from tq.rpc import RpcServer

    monkeypatch.setattr(lt, "PARALLEL_FLUSH_THREADS", 4)
    writers: set[int] = set()
    real_write = lt._write

    def probe(sock: socket.socket, views: list) -> None:  # the real write, noting the thread it ran on
        if sum(v.nbytes for v in views) >= lt.PARALLEL_FLUSH_BYTES:
            writers.add(threading.get_ident())
        real_write(sock, views)

    monkeypatch.setattr(lt, "_write", probe)
    payloads = [np.random.default_rng(i).integers(0, 255, 6 * MiB, dtype=np.uint8) for i in range(4)]
    server = RpcServer("wide", "tcp://127.0.0.1:0", secret=None, max_message_bytes=1 << 20)
    server.listen_streams()
    server.serve_ops({"ping": messages.Ping}, {"ping": lambda args, buffers, call: ({}, [payloads[call.rid % 4]])})
    listed: list[list[int]] = []  # the connections of each turn's writes side by side
    real_flush_beside = server._flush_beside

    def noted_flush_beside() -> None:
        listed.append([id(p) for p in server._beside])
        real_flush_beside()

    server._flush_beside = noted_flush_beside  # type: ignore[method-assign]
    loop = threading.Thread(target=server.serve_forever, daemon=True)
    loop.start()
    streams = [ClientStream(server.local.address, 5.0) for _ in range(4)]
    try:
        for rnd in range(3):
            for i, c in enumerate(streams):  # every stream asks twice before any reads: the replies wait
                c.send(protocol.request("ping", 4 * rnd + i, {}, [], None), 5.0)
                c.send(protocol.request("ping", 4 * rnd + i + 4, {}, [], None), 5.0)
            got: dict[int, list] = {}

            def read(i: int, c: ClientStream) -> None:
                got[i] = [protocol.decode_reply(c.recv(10.0), None) for _ in range(2)]

            readers = [threading.Thread(target=read, args=(i, c)) for i, c in enumerate(streams)]
            for t in readers:
                t.start()
            for t in readers:
                t.join(30)
            for i in range(4):
                assert [m.rid for m in got[i]] == [4 * rnd + i, 4 * rnd + i + 4]
                for m in got[i]:
                    assert np.array_equal(np.frombuffer(m.buffers[0], np.uint8), payloads[m.rid % 4])
        assert loop.ident in writers and len(writers) >= 2, writers
        # a connection is listed once a turn, also one written before its next request was served
        assert any(len(turn) > 1 for turn in listed) and all(len(set(turn)) == len(turn) for turn in listed)
    finally:
        for c in streams:
            c.close()
        server.stop()
        loop.join(5)


def test_big_messages_from_several_streams_are_read_side_by_side(monkeypatch):
    """Requests with a MiB or more still to come on several connections at once have their rest
    received each on its own thread, the loop's thread waiting for all (a TCP read's kernel copy was
    a unit's one thread's work for every writer) - every request arrives whole; a connection cut in
    the middle of its message ends alone, and the server keeps serving."""
    import hashlib

    import tq.stream_transport as lt
    from tq import messages
    from tq.rpc import RpcServer

    monkeypatch.setattr(lt, "PARALLEL_FLUSH_THREADS", 4)
    readers: set[int] = set()
    real_read_body = lt.StreamPeer.read_body

    def probe(self: lt.StreamPeer):  # the real read, noting the thread it ran on
        readers.add(threading.get_ident())
        return real_read_body(self)

    monkeypatch.setattr(lt.StreamPeer, "read_body", probe)
    payloads = [np.random.default_rng(i).integers(0, 255, 24 * MiB, dtype=np.uint8) for i in range(4)]
    server = RpcServer("wide-in", "tcp://127.0.0.1:0", secret=None, max_message_bytes=64 * MiB)
    server.listen_streams()

    def digest(args, buffers, call):  # what arrived, as the server read it
        return {}, [np.frombuffer(hashlib.sha256(buffers[0] if buffers else b"").digest(), np.uint8)]

    server.serve_ops({"ping": messages.Ping}, {"ping": digest})
    loop = threading.Thread(target=server.serve_forever, daemon=True)
    loop.start()
    streams = [ClientStream(server.local.address, 10.0) for _ in range(4)]
    try:
        cut = ClientStream(server.local.address, 10.0)  # half a big message, then gone
        wire = protocol.request("ping", 99, {}, [payloads[0]], None)
        cut.sock.settimeout(10.0)
        cut.sock.sendall(b"".join(bytes(v) for v in lt._wire(wire))[: 12 * MiB])
        got: dict[int, list] = {}

        def ask(i: int, c: ClientStream) -> None:  # a send blocks until the server has read it all
            c.send(protocol.request("ping", i, {}, [payloads[i]], None), 30.0)
            got[i] = [protocol.decode_reply(c.recv(30.0), None)]

        askers = [threading.Thread(target=ask, args=(i, c)) for i, c in enumerate(streams)]
        for t in askers:
            t.start()
        time.sleep(0.2)
        cut.close()
        for t in askers:
            t.join(60)
        for i in range(4):
            (m,) = got[i]
            assert m.rid == i and bytes(m.buffers[0]) == hashlib.sha256(payloads[i]).digest()
        assert loop.ident in readers and len(readers) >= 2, readers
        streams[0].send(protocol.request("ping", 7, {}, [], None), 5.0)  # still serving
        assert protocol.decode_reply(streams[0].recv(5.0), None).rid == 7
    finally:
        for c in streams:
            c.close()
        server.stop()
        loop.join(5)


def test_a_big_tcp_put_is_sent_in_lanes_over_several_streams_at_once(server, monkeypatch):
    """A remote put of more than one request's bytes (16 MiB) to a unit is sent in lanes of 8 MiB or
    more - each a block of its own, over its own connection on its own thread - and made visible by
    one commit: every row reads back whole and in key order."""
    monkeypatch.setattr(tq.client, "usable_cores", lambda: 16)  # lanes take half the client's cores: 8 here
    base = _tcp_streams(server)
    rows = torch.arange(40 * (MiB // 8), dtype=torch.float64).reshape(40, -1)  # 40 rows of 1 MiB: 5 lanes
    with TQClient(server.address) as reader, TQClient(server.address, transport="tcp", timeout=30.0) as remote:
        remote.register_partition("lt-put-lanes", reuse=True)
        stores = reader.stats()["unit_stats"][0]["ops"].get("store", {}).get("count", 0)
        keys = unique_keys(40)
        meta = remote.put("lt-put-lanes", keys, {"x": rows})
        assert reader.stats()["unit_stats"][0]["ops"]["store"]["count"] - stores == 5  # a block per lane
        assert _tcp_streams(server)[1] - base[1] == 5  # each over its own connection
        assert torch.equal(reader.get(meta)["x"], rows)
        assert torch.equal(reader.get(reader.get_meta("lt-put-lanes", keys[::-1]), ["x"])["x"], rows.flip(0))
        reader.discard(meta)


@pytest.mark.parametrize("failing", [0, 3], ids=["first-lane", "a-later-lane"])
def test_a_big_tcp_put_whose_lane_fails_gives_the_others_back_and_makes_nothing_visible(server, monkeypatch, failing):
    """One lane of a big TCP put failing (here the first, sent on the calling thread, or one on a pool
    thread) fails the put with that lane's error once every lane ended: the lanes stored are given
    back - their unit frees them - and none of the put's keys exists."""
    from tq.errors import TQConnectionError

    monkeypatch.setattr(tq.client, "usable_cores", lambda: 16)
    rows = torch.arange(40 * (MiB // 8), dtype=torch.float64).reshape(40, -1)  # 5 lanes of 8 rows
    real_store = TQClient._store

    def store(self, unit, encoded, start, stop):  # lane ``failing`` is lost on its way
        if start == 8 * failing:
            raise TQConnectionError("the lane's connection was lost")
        return real_store(self, unit, encoded, start, stop)

    monkeypatch.setattr(TQClient, "_store", store)
    with TQClient(server.address) as reader, TQClient(server.address, transport="tcp", timeout=30.0) as remote:
        reader.register_partition("lt-put-fails", reuse=True)
        used = reader.stats()["unit_stats"][0]["bytes_used"]
        stores = reader.stats()["unit_stats"][0]["ops"].get("store", {}).get("count", 0)
        with pytest.raises(TQConnectionError, match="lane's connection"):
            remote.put("lt-put-fails", unique_keys(40), {"x": rows})
        assert reader.stats()["unit_stats"][0]["ops"]["store"]["count"] - stores == 4  # the others were stored
        assert reader.list_partitions() and next(p for p in reader.list_partitions() if p["partition"] == "lt-put-fails")["keys"] == 0
        assert wait_until(lambda: reader.stats()["unit_stats"][0]["bytes_used"] == used, timeout=10)  # and freed


def test_refreshes_of_one_client_from_several_threads_leave_one_open_channel_per_unit(server, monkeypatch):
    """A put's lanes each run on a thread, and each may find its unit moved and refresh the client's
    units at once: the refreshes take turns, so a unit's channel is replaced once and every channel
    replaced is closed (two at once left one of the new channels open, never closed)."""
    from tq.messages import UNIT_REPLY_DECODERS
    from tq.rpc import RpcChannel

    made: list[RpcChannel] = []
    closed: set[int] = set()
    real_init, real_close = RpcChannel.__init__, RpcChannel.close

    def init(self: RpcChannel, *args, **kw) -> None:
        real_init(self, *args, **kw)
        made.append(self)

    def slow_close(self: RpcChannel) -> None:  # a close that takes a while, as a socket's linger may
        closed.add(id(self))
        time.sleep(0.05)
        real_close(self)

    with TQClient(server.address) as c:
        monkeypatch.setattr(RpcChannel, "__init__", init)
        monkeypatch.setattr(RpcChannel, "close", slow_close)
        c._unit_chans[0] = RpcChannel("tcp://127.0.0.1:9", secret=None, timeout=1.0, name="gone", replies=UNIT_REPLY_DECODERS)
        start = threading.Barrier(4)

        def refresh() -> None:
            start.wait()
            c._refresh_units()

        threads = [threading.Thread(target=refresh) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        current = c._unit_chans[0]
        assert current.address == c._units[0].address
        assert [ch for ch in made if ch is not current and id(ch) not in closed] == []  # none left open
        assert c.stats()["unit_stats"][0]["unit_id"] == 0  # and the channel kept serves


def test_a_call_whose_unit_restarts_twice_under_it_fails_with_storage_unit_error(monkeypatch):
    """A write (or a remote read) sent again at its unit's new address, whose unit then moves again
    before it is served, fails with StorageUnitError (a TQError naming the unit) - not with the
    client's private restart signal."""
    from tq.client import _UnitRestarted

    def always_moved(self, unit, chan):  # the controller reports the unit elsewhere at every check
        def check() -> None:
            raise _UnitRestarted(unit)

        return check

    with TQServer(storage_units=1, capacity=16 * MiB) as srv, TQClient(srv.address, timeout=10.0, transport="tcp") as client:
        client.register_partition("lt-moves")
        pid = client.stats()["unit_stats"][0]["pid"]
        monkeypatch.setattr(TQClient, "_unit_check", always_moved)
        meta = client.put("lt-moves", ["a"], {"x": torch.ones(1, 4)})
        os.kill(pid, signal.SIGSTOP)  # the store (the fetch) waits, so its checks run
        try:
            with pytest.raises(StorageUnitError, match="restarted again"):
                client.put("lt-moves", ["b"], {"x": torch.ones(1, 4)})
            with pytest.raises(StorageUnitError, match="restarted again"):
                client.get(meta)
        finally:
            os.kill(pid, signal.SIGCONT)


def test_waiting_for_another_threads_refresh_keeps_to_the_calls_time_budget(server):
    """A thread that must refresh the client's units while another thread of the client is at it
    waits for that one no longer than its own call's time: it fails with TQConnectionError then."""
    from tq.errors import TQConnectionError
    from tq.rpc import time_budget

    with TQClient(server.address) as c:
        held, done = threading.Event(), threading.Event()

        def slow_refresh() -> None:  # another thread's refresh, taking its time (a controller parking hello)
            with c._units_lock:
                held.set()
                done.wait(3.0)

        other = threading.Thread(target=slow_refresh)
        other.start()
        assert held.wait(5.0)
        t0 = time.monotonic()
        with time_budget(0.3), pytest.raises(TQConnectionError, match="no time left"):
            c._refresh_units()
        assert time.monotonic() - t0 < 2.0  # not the other thread's 3 s
        done.set()
        other.join(5)
        c._refresh_units()  # and once it is done, a refresh goes through


def test_a_big_tcp_get_reads_its_parts_over_several_streams_at_once(server, monkeypatch):
    """A remote get of more than one request's bytes from a unit (16 MiB) is read in lanes of 8 MiB or
    more, each over its own connection on its own thread (one thread's copy out of its socket was most
    of such a get), and the rows come back whole and in key order."""
    monkeypatch.setattr(tq.client, "usable_cores", lambda: 16)  # lanes take half the client's cores: 8 here
    base = _tcp_streams(server)
    rows = torch.arange(40 * (MiB // 8), dtype=torch.float64).reshape(40, -1)  # 40 rows of 1 MiB: 5 lanes
    with TQClient(server.address) as writer, TQClient(server.address, transport="tcp", timeout=30.0) as remote:
        writer.register_partition("lt-lanes", reuse=True)
        keys = unique_keys(40)
        meta = writer.put("lt-lanes", keys, {"x": rows})
        assert torch.equal(remote.get(meta)["x"], rows)
        order = list(range(39, -1, -1))
        assert torch.equal(remote.get(meta.select(order))["x"], rows[order])
        # a lane of 8 MiB each, on a connection of its pool thread: 5 - or a few more when the second
        # get's lanes went to threads other than the first's (seen with 16 cores: 6)
        assert 5 <= _tcp_streams(server)[1] - base[1] <= 8
        writer.discard(meta)
    assert wait_until(lambda: _tcp_streams(server) == base, timeout=5.0)


def test_puts_go_on_while_a_unit_dies_and_rejoins_over_its_new_socket():
    """The controller's connection to a unit ends with the unit; the restarted unit comes back with a new
    socket, which the controller connects to; nothing committed is lost."""
    with TQServer(storage_units=1, capacity=16 * MiB) as srv, TQClient(srv.address, timeout=30.0, capacity_wait_s=10.0) as client:
        client.register_partition("lt-unit")
        first = client.put("lt-unit", unique_keys(8, "a"), {"x": torch.arange(8.0)})
        st = client.stats()
        old = st["unit_stats"][0]["local_address"]
        os.kill(st["unit_stats"][0]["pid"], signal.SIGKILL)

        def rejoined() -> bool:
            try:
                u = client.stats()["unit_stats"]
            except TQConnectionError:
                return False
            return bool(u) and u[0]["local_address"] not in (None, old) and u[0]["local_connections"] >= 1

        assert wait_until(rejoined, timeout=30.0, interval=0.2)
        second = None
        for _ in range(100):  # the client learns of the restarted unit on its next write
            try:
                second = client.put("lt-unit", unique_keys(8, "b"), {"x": torch.arange(8.0) + 8})
                break
            except Exception:  # noqa: BLE001 - retried until the unit is back for this client
                time.sleep(0.2)
        assert second is not None
        assert client.get(first, ["x"])["x"].tolist() == list(np.arange(8.0))
        assert client.get(second, ["x"])["x"].tolist() == list(np.arange(8.0) + 8)


def test_a_client_that_cannot_reach_the_unix_socket_keeps_to_zmq(server):
    """As a client in another network namespace of the same host: the controller's socket name leads
    nowhere from there, so its requests go over ZMQ and still work."""
    base = _local_connections(server)
    with TQClient(server.address) as client:
        client._ctrl.use_stream("@tq-" + "0" * 32)  # what another namespace sees: nothing listens there
        client.register_partition("lt-elsewhere", reuse=True)
        meta = client.put("lt-elsewhere", unique_keys(2), {"x": torch.tensor([5.0, 6.0])})
        assert client.get(meta, ["x"])["x"].tolist() == [5.0, 6.0]
        assert client.stats()["local_connections"] == base


def test_a_controller_restarted_on_its_journal_is_reached_on_the_same_socket_again(tmp_path):
    """Killed and started again on its journal dir, the controller listens at the address its
    same-host clients had: their next calls connect to it again (not ZMQ from then on), and the data
    they put before the crash reads back through it."""
    port = free_port()
    state = str(tmp_path / "state")
    first = TQServer(port=port, storage_units=1, capacity=16 * MiB, journal_dir=state)
    second, units = None, []
    try:
        with TQClient(first.address, timeout=10.0) as client:
            client.register_partition("lt-restart")
            meta = client.put("lt-restart", unique_keys(3), {"x": torch.arange(3.0)})
            address = client._ctrl.stream_address
            units = [u["pid"] for u in client.stats()["units"]]
            os.kill(first.proc.pid, signal.SIGKILL)
            first.proc.wait(10)
            second = TQServer(port=port, storage_units=1, capacity=16 * MiB, journal_dir=state)
            assert _hello(second.address)["local_address"] == address

            def readable() -> bool:
                try:
                    return client.get(meta, ["x"])["x"].tolist() == [0.0, 1.0, 2.0]
                except TQConnectionError:
                    return False

            assert wait_until(readable, timeout=20)
            assert wait_until(lambda: client.stats()["local_connections"] >= 1, timeout=5)
            assert [u["pid"] for u in client.stats()["units"]] == units  # taken back, not restarted
            # the new controller's connection and this client's (its stats): the dead one's is gone
            assert client.stats()["unit_stats"][0]["local_connections"] == 2
    finally:
        shut_down((second, first), units)


def test_a_channel_taken_off_the_unix_socket_goes_on_over_zmq(server):
    """A channel told to stop using the socket (or that the server moved) sends and waits for its
    replies over ZMQ from the next call on - also for a thread that had a connection open."""
    with TQClient(server.address) as client:
        client.register_partition("lt-switch", reuse=True)
        meta = client.put("lt-switch", unique_keys(2), {"x": torch.tensor([1.0, 2.0])})
        address = client._ctrl.stream_address
        for switch in (None, address, None):
            client._ctrl.use_stream(switch)
            assert client.get(meta, ["x"])["x"].tolist() == [1.0, 2.0]
            client.wait(meta, ["x"], timeout=5.0)


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    count=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    sizes=st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 64), max_size=4),
    tail=st.binary(max_size=256),
)
def test_fuzz_stream_prefixes(server, count, sizes, tail):
    """Random prefixes (frame counts and sizes, small or absurd) and bytes on a fresh connection: the
    controller answers, or closes that connection, and keeps serving everyone else."""
    address = _hello(server.address)["local_address"]
    head = b"" if count is None else struct.pack("<I", count) + b"".join(struct.pack("<Q", n) for n in sizes)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + address[1:])
    try:
        s.sendall(head + tail)
        s.shutdown(socket.SHUT_WR)  # no more bytes: a message still waiting for its frames never completes
        s.settimeout(5.0)
        while s.recv(1 << 16):  # replies (errors), until the server closes the connection
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    finally:
        s.close()
    assert protocol.raise_for_reply(raw_exchange(server.address, protocol.request("list_partitions", 1, {}, [], None))) is not None


# ----------------------------------------------------------------------------- TCP stream sockets
def _tcp_streams(server: TQServer) -> tuple[int, int]:
    """Open TCP stream connections of the controller and of its unit."""
    with TQClient(server.address) as local:  # adds none itself
        st = local.stats()
    return st.get("tcp_stream_connections", 0), st["unit_stats"][0].get("tcp_stream_connections", 0)  # left out while 0


def test_remote_clients_talk_over_the_tcp_stream_sockets(server):
    """A client of another host (a 'tcp' client acts as one) sends its requests to the controller and
    to the unit over their TCP stream sockets, not ZMQ (its hello aside): a 12 MiB put and get - sent
    and received straight into their buffers - and an object column come back whole; the
    connections end with the client."""
    info = _hello(server.address)
    token = info["local_address"][len("@tq-") :]
    assert parse_tcp_address(info["stream_address"])[::2] == ("127.0.0.1", token)  # the server's token
    assert info["units"][0]["stream_address"].startswith("tcp://127.0.0.1:")
    base = _tcp_streams(server)
    with TQClient(server.address, transport="tcp") as remote:
        assert remote.stats()["stream_address"] == info["stream_address"]  # what an operator opens a firewall for
        remote.register_partition("lt-tcp", reuse=True)
        x = torch.arange(3 * MiB, dtype=torch.float32).reshape(3, MiB)
        meta = remote.put("lt-tcp", unique_keys(3), {"x": x, "t": ["a", "b", "c"]})
        got = remote.get(meta, ["x", "t"])
        assert torch.equal(got["x"], x) and got["t"] == ["a", "b", "c"]
        assert _tcp_streams(server) == (base[0] + 1, base[1] + 1)
        assert remote._unit_chans[0]._sockets == []  # no ZMQ socket was ever made to the unit
    assert wait_until(lambda: _tcp_streams(server) == base, timeout=5.0)


def test_a_tcp_stream_socket_answers_only_its_own_token(server):
    """A client that reached another server on a port (one reused after a restart) is refused at
    connect, before it sent a request - and keeps to ZMQ; bytes that are not a token close the
    connection unanswered. Each refusal is counted."""
    host, port, _ = parse_tcp_address(_hello(server.address)["stream_address"])
    wrong = tcp_address(host, port, "0" * 32)
    with TQClient(server.address, transport="tcp") as client:
        before = client.stats()["rejected_messages"]
        with pytest.raises(ConnectionRefusedError, match="token refused"):
            ClientStream(wrong, 5.0)
        s = socket.create_connection((host, port), 5.0)
        s.sendall(_message(protocol.request("list_partitions", 1, {}, [], None)))  # a request, no token
        s.settimeout(5.0)
        assert s.recv(10) == b""
        s.close()
        client._ctrl.use_stream(wrong)
        client.register_partition("lt-wrong-token", reuse=True)  # over ZMQ
        assert "lt-wrong-token" in [p["partition"] for p in client.list_partitions()]
        assert client._ctrl._local.stream is None and client._ctrl.stream_refused[0] == wrong
        assert client.stats()["rejected_messages"] == before + 3


def test_without_a_secret_a_tcp_connection_must_still_send_the_token_in_time(monkeypatch):
    """No secret to prove, but a connection that never sends the token (a port scanner, a stray
    client) is closed after the handshake time, and counted; one that did stays (kept alive)."""
    import tq.stream_transport as lt
    from tq import messages
    from tq.rpc import RpcServer

    monkeypatch.setattr(lt, "HANDSHAKE_S", 0.5)
    server = RpcServer("tokens", "tcp://127.0.0.1:0", secret=None, max_message_bytes=1 << 20)
    server.listen_streams()
    server.serve_ops({"ping": messages.Ping}, {"ping": lambda a, b, c: {}})
    loop = threading.Thread(target=server.serve_forever, daemon=True)
    loop.start()
    host, port, _ = parse_tcp_address(server.tcp.address)
    mute = socket.create_connection((host, port), 5.0)
    good = ClientStream(server.tcp.address, 5.0)
    try:
        mute.settimeout(5.0)
        assert mute.recv(10) == b""  # closed, once the handshake time passed
        assert wait_until(lambda: server.tcp.rejected == 1, timeout=5.0)
        good.send(protocol.request("ping", 1, {}, [], None), 5.0)
        protocol.raise_for_error(protocol.decode_reply(good.recv(5.0), None))  # still connected, served
        # kept alive: a client host that dies without a FIN is found within about two minutes
        (peer,) = server.tcp.peers
        assert peer.sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert peer.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == lt.TCP_KEEPALIVE[0]
    finally:
        mute.close()
        good.close()
        server.stop()
        loop.join(5)


def test_a_tcp_stream_socket_that_does_not_answer_is_left_alone_for_long(server, monkeypatch):
    """A stream address where a connect or the token's answer times out (a firewall dropping
    packets, a hung process) is given up within the connect time and not tried again for
    UNREACHABLE_RETRY_S - by any thread of the client: each try would cost that time - while the calls
    go on over ZMQ; each timeout in a row doubles the wait, up to UNREACHABLE_MAX_S."""
    import tq.stream_transport as lt

    monkeypatch.setattr(lt, "TCP_CONNECT_S", 0.3)
    hung = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # listens, never accepts nor answers
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    try:
        with TQClient(server.address, transport="tcp") as client:
            chan = client._ctrl
            chan.use_stream(tcp_address("127.0.0.1", hung.getsockname()[1], "1" * 32))
            t0 = time.monotonic()
            client.register_partition("lt-hung", reuse=True)
            assert time.monotonic() - t0 < 3.0
            assert chan.stream_refused[1] - time.monotonic() > lt.UNREACHABLE_RETRY_S - 5
            took: list[float] = []

            def call() -> None:
                t = time.monotonic()
                assert "lt-hung" in [p["partition"] for p in client.list_partitions()]
                took.append(time.monotonic() - t)

            threads = [threading.Thread(target=call) for _ in range(4)]  # other threads: no connect tried
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            assert len(took) == 4 and max(took) < 0.25, took
            waits = []
            for _ in range(6):  # the wait ran out: each try times out again
                chan.stream_refused = (chan.stream_refused[0], 0.0, chan.stream_refused[2])
                client.list_partitions()
                waits.append(chan.stream_refused[2])
            assert waits == [60.0, 120.0, 240.0, 480.0, 600.0, 600.0]
    finally:
        hung.close()


def test_a_tcp_stream_whose_reply_never_came_is_not_used_again_and_a_unix_one_is():
    """A request left unanswered over TCP may sit unacknowledged in its connection (a network
    partition: TCP retransmits it with a doubling back-off, and later requests on that connection
    wait behind it after the network heals - benchmarks/tq_partition.py): the call that gave up on
    its reply drops the stream, and the next call connects again. A Unix socket loses nothing: a
    same-host client keeps its stream."""
    with TQServer(storage_units=1, capacity=16 * MiB) as srv:
        with TQClient(srv.address, timeout=0.5, transport="tcp") as remote, TQClient(srv.address, timeout=0.5) as local:
            for c in (remote, local):
                c.list_partitions()
            before = {c: c._ctrl._local.stream for c in (remote, local)}
            assert before[remote].address.startswith("tcp://") and not before[local].address.startswith("tcp://")
            os.kill(srv.proc.pid, signal.SIGSTOP)
            try:
                for c in (remote, local):
                    with pytest.raises(TQConnectionError, match="no reply"):
                        c.list_partitions()
            finally:
                os.kill(srv.proc.pid, signal.SIGCONT)
            for c in (remote, local):
                c.list_partitions()
            assert remote._ctrl._local.stream is not before[remote] and remote._ctrl._local.stream is not None
            assert local._ctrl._local.stream is before[local]


def test_a_unit_that_does_not_answer_while_its_controller_hears_it_is_named_when_the_call_times_out():
    """A reader cut off from a unit that its controller still hears (an asymmetric partition; here the
    unit is stopped for less than the controller's UNIT_TIMEOUT_S) waits out its timeout and is told
    that the unit did not answer - not "no time left to ask controller", which the last liveness check,
    asked with none of the call's time left, used to raise instead."""
    with TQServer(storage_units=1, capacity=16 * MiB) as srv, TQClient(srv.address, timeout=1.0, transport="tcp") as client:
        client.register_partition("lt-mute")
        meta = client.put("lt-mute", unique_keys(2), {"x": torch.ones(2, 4)})
        pid = client.stats()["unit_stats"][0]["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(TQConnectionError) as err:
                client.get(meta, ["x"])
            took = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert "storage unit 0" in str(err.value) and "no reply" in str(err.value) and "controller" not in str(err.value), err.value
        assert took < 1.0 + 0.5
        assert torch.equal(client.get(meta, ["x"])["x"], torch.ones(2, 4))  # and it reads once the unit answers


def test_a_stream_connect_keeps_to_the_calls_time_left(server):
    """A stream connect that cannot complete (a partitioned network, a hung listener) takes no more
    than the call's time left - not the full connect time - and, cut short so, keeps the address off
    for RETRY_S only, not for the UNREACHABLE_RETRY_S a full timeout earns."""
    import tq.stream_transport as lt
    from tq.rpc import time_budget

    hung = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # listens, never accepts nor answers
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    try:
        with TQClient(server.address, timeout=10.0, transport="tcp") as client:
            chan = client._ctrl
            chan.use_stream(tcp_address("127.0.0.1", hung.getsockname()[1], "1" * 32))
            t0 = time.monotonic()
            with time_budget(0.4):
                try:
                    client.list_partitions()
                except TQConnectionError:  # the budget went on the connect: no time left for ZMQ
                    pass
            assert time.monotonic() - t0 < 0.4 + 0.5 < lt.TCP_CONNECT_S
            assert chan.stream_refused[2] == lt.RETRY_S
    finally:
        hung.close()


def test_a_remote_client_of_a_controller_restarted_on_its_journal_goes_on_over_its_tcp_stream(tmp_path):
    """Killed and started again on its journal dir, the controller listens on the TCP stream port it
    had. A remote client's next call is not lost on the dead connection (a write to a TCP peer that
    is gone succeeds: the client checks first, and sends over ZMQ); its calls then reach the new
    controller over the stream socket again."""
    port = free_port()
    state = str(tmp_path / "state")
    first = TQServer(port=port, storage_units=1, capacity=16 * MiB, journal_dir=state)
    second, units = None, []
    try:
        with TQClient(first.address, timeout=10.0, transport="tcp") as client:
            client.register_partition("lt-tcp-restart")
            meta = client.put("lt-tcp-restart", unique_keys(3), {"x": torch.arange(3.0)})
            address = client._ctrl.stream_address
            assert address.startswith("tcp://") and client._ctrl._local.stream is not None
            units = [u["pid"] for u in client.stats()["units"]]
            os.kill(first.proc.pid, signal.SIGKILL)
            first.proc.wait(10)
            second = TQServer(port=port, storage_units=1, capacity=16 * MiB, journal_dir=state)
            assert _hello(second.address)["stream_address"] == address
            assert client.get(meta, ["x"])["x"].tolist() == [0.0, 1.0, 2.0]  # the first call after: not lost

            def streamed() -> bool:
                client.get_meta("lt-tcp-restart")
                return client.stats().get("tcp_stream_connections", 0) >= 1

            assert wait_until(streamed, timeout=10)
    finally:
        shut_down((second, first), units)


@pytest.mark.parametrize("bad", ["tcp://127.0.0.1:0/short", "tcp://nohost", "@", "http://x:1/" + "0" * 32])
def test_a_stream_address_no_server_advertises_leaves_the_calls_on_zmq(server, bad):
    """An advertised stream address that does not parse (a peer's hello cannot be trusted to be
    well-formed) is not connected to: the calls go over ZMQ, and work."""
    with TQClient(server.address, transport="tcp") as client:
        client._ctrl.use_stream(bad)
        client.register_partition("lt-bad-address", reuse=True)
        assert getattr(client._ctrl._local, "stream", None) is None and client._ctrl.stream_refused[0] == bad


def _ended_with_rows_or_unit_error(reader: threading.Thread, got: dict, rows: torch.Tensor) -> None:
    """A get whose storage unit was killed under it ended: with every row (read from the unit restarted
    on its arena) or with StorageUnitError naming the unit - not a lost connection, not a hang."""
    reader.join(30)
    assert not reader.is_alive()
    if "error" in got:
        assert isinstance(got["error"], StorageUnitError) and "storage unit 0" in str(got["error"]), repr(got["error"])
    else:
        assert torch.equal(got["x"], rows)


def test_a_remote_read_from_a_unit_that_dies_mid_call_waits_for_the_controllers_verdict():
    """A remote get waits on a storage unit over its TCP stream; the unit is killed: the connection is
    reset at once. The get asks the controller, as a request waiting over ZMQ does, instead of
    failing with a bare lost connection: it reads the rows from the restarted unit, or fails with
    StorageUnitError naming the unit if it asked while the unit was down (on one host the controller
    knows at once; across hosts its heartbeats tell it seconds after the reset - the multinode
    test's worker node leaving got TQConnectionError 0.04 s after the kill)."""
    with TQServer(storage_units=1, capacity=16 * MiB) as srv, TQClient(srv.address, timeout=30.0, transport="tcp") as client:
        client.register_partition("lt-dies")
        x = torch.arange(4096.0).reshape(4, 1024)
        meta = client.put("lt-dies", unique_keys(4), {"x": x})
        pid = client.stats()["unit_stats"][0]["pid"]
        got: dict = {}
        warm, go = threading.Event(), threading.Event()

        def read() -> None:  # streams are per thread: this one's is open before the unit stops
            assert torch.equal(client.get(meta, ["x"])["x"], x)
            assert client._unit_chans[0]._local.stream is not None
            warm.set()
            go.wait(10)
            try:
                got["x"] = client.get(meta, ["x"])["x"]
            except Exception as exc:  # noqa: BLE001 - inspected below
                got["error"] = exc

        reader = threading.Thread(target=read)
        reader.start()
        assert warm.wait(10)
        os.kill(pid, signal.SIGSTOP)  # the fetch below waits on it
        go.set()
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)  # the connection resets now
        _ended_with_rows_or_unit_error(reader, got, x)


def test_a_big_tcp_gets_lanes_keep_to_the_gets_time_budget(server, monkeypatch):
    """Every request of a get shares its timeout (``time_budget``, per thread): a lane on a pool thread
    sends its requests within the calling thread's budget, not a fresh timeout per request."""
    from tq.messages import UnitOp
    from tq.rpc import RpcChannel, time_left

    monkeypatch.setattr(tq.client, "usable_cores", lambda: 16)
    seen: list[tuple[bool, float | None]] = []
    real_send = RpcChannel.send

    def probe(self: RpcChannel, op: str, *args, **kw):  # the real send, noting the budget it ran under
        if op == UnitOp.FETCH:
            seen.append((threading.current_thread() is threading.main_thread(), time_left()))
        return real_send(self, op, *args, **kw)

    monkeypatch.setattr(RpcChannel, "send", probe)
    rows = torch.arange(40 * (MiB // 8), dtype=torch.float64).reshape(40, -1)  # 5 lanes
    with TQClient(server.address) as writer, TQClient(server.address, transport="tcp", timeout=20.0) as remote:
        writer.register_partition("lt-budget", reuse=True)
        meta = writer.put("lt-budget", unique_keys(40), {"x": rows})
        assert torch.equal(remote.get(meta)["x"], rows)
        writer.discard(meta)
    assert sorted(main for main, _ in seen) == [False] * 4 + [True]
    assert all(left is not None and 0 < left <= 20.0 for _, left in seen), seen


def _get_in_child(address: str, meta_d: dict, total: float) -> None:
    from tq.meta import KVBatchMeta

    with TQClient(address, transport="tcp", timeout=20.0) as c:
        x = c.get(KVBatchMeta.from_dict(meta_d))["x"]
    os._exit(0 if float(x.numpy().sum()) == total else 3)  # numpy: torch's own threads are not safe after a fork


def test_a_child_forked_after_a_big_remote_get_reads_in_lanes_of_its_own(server, monkeypatch):
    """The threads a big TCP get's lanes run on are a pool of the process: a child forked after one
    inherits the pool without its threads - its first big get would wait forever for them. It makes
    its own pool and reads."""
    import multiprocessing

    monkeypatch.setattr(tq.client, "usable_cores", lambda: 16)  # lanes on any machine (the child inherits it)
    rows = torch.arange(20 * (MiB // 8), dtype=torch.float64).reshape(20, -1)  # 20 MiB: 2 lanes
    with TQClient(server.address) as writer, TQClient(server.address, transport="tcp", timeout=20.0) as remote:
        writer.register_partition("lt-fork", reuse=True)
        meta = writer.put("lt-fork", unique_keys(20), {"x": rows})
        assert torch.equal(remote.get(meta)["x"], rows)  # this process's lane pool is up
        child = multiprocessing.get_context("fork").Process(target=_get_in_child, args=(server.address, meta.to_dict(), float(rows.sum())))
        child.start()
        child.join(30)
        if child.is_alive():
            child.kill()
        assert child.exitcode == 0
        writer.discard(meta)


def test_a_big_remote_read_in_lanes_from_a_unit_that_dies_mid_call_ends_and_the_next_one_reads(monkeypatch):
    """A 40 MiB TCP get read in 5 lanes (5 threads, 5 connections) from a unit stopped and then killed
    while they wait: the get ends - with the rows from the restarted unit, or StorageUnitError naming
    it - instead of a lane waiting on forever; and the next get reads every row whole from the unit
    restarted on its arena, over fresh connections."""
    monkeypatch.setattr(tq.client, "usable_cores", lambda: 16)  # lanes on any machine
    rows = torch.arange(40 * (MiB // 8), dtype=torch.float64).reshape(40, -1)
    with TQServer(storage_units=1, capacity=128 * MiB) as srv, TQClient(srv.address, timeout=30.0, transport="tcp") as client:
        client.register_partition("lt-lanes-dies")
        meta = client.put("lt-lanes-dies", unique_keys(40), {"x": rows})
        assert torch.equal(client.get(meta)["x"], rows)  # the lanes' connections are open
        st = client.stats()["unit_stats"][0]
        pid = st["pid"]
        assert st["tcp_stream_connections"] == 5
        got: dict = {}

        def read() -> None:
            try:
                got["x"] = client.get(meta)["x"]
            except Exception as exc:  # noqa: BLE001 - inspected below
                got["error"] = exc

        os.kill(pid, signal.SIGSTOP)
        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.5)  # every lane's requests sent, its reply awaited
        os.kill(pid, signal.SIGKILL)
        _ended_with_rows_or_unit_error(reader, got, rows)
        assert wait_until(lambda: client.stats()["unit_stats"][0]["pid"] != pid, timeout=30)
        assert torch.equal(client.get(meta)["x"], rows)


def test_a_big_remote_put_in_lanes_to_a_unit_that_dies_mid_call_ends_and_leaves_all_or_nothing(monkeypatch):
    """A 40 MiB TCP put sent in 5 lanes (5 threads, 5 connections) to a unit stopped and then killed
    while they wait: the put ends soon - it landed (sent again to the unit restarted at a new address:
    its keys read its bytes) or it raised a TQError and none of its keys exists - instead of a lane
    waiting out its timeout on the unit's old address; and the next put of the same rows lands whole."""
    from tq.errors import TQError

    monkeypatch.setattr(tq.client, "usable_cores", lambda: 16)  # lanes on any machine
    rows = torch.arange(40 * (MiB // 8), dtype=torch.float64).reshape(40, -1)
    with (
        TQServer(storage_units=1, capacity=256 * MiB) as srv,
        TQClient(srv.address, timeout=30.0, transport="tcp") as client,
        TQClient(srv.address, timeout=30.0) as reader,
    ):
        client.register_partition("lt-put-dies")
        warm = client.put("lt-put-dies", unique_keys(40), {"x": rows})  # the lanes' connections are open
        client.discard(warm)
        pid = client.stats()["unit_stats"][0]["pid"]
        keys, got = unique_keys(40), {}

        def write() -> None:
            try:
                got["meta"] = client.put("lt-put-dies", keys, {"x": rows})
            except TQError as exc:
                got["error"] = exc

        os.kill(pid, signal.SIGSTOP)
        writer = threading.Thread(target=write)
        writer.start()
        time.sleep(0.5)  # every lane's request on its way, its reply awaited
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        writer.join(60)
        # within a third of its timeout: a lane whose channel another lane's refresh replaced sat out
        # all of it (20 s of 20) before, waiting on the unit's old address
        assert not writer.is_alive() and time.monotonic() - killed < 10, got
        assert wait_until(lambda: reader.stats()["unit_stats"][0]["pid"] != pid, timeout=30)
        listed = next(p for p in reader.list_partitions() if p["partition"] == "lt-put-dies")["keys"]
        if "meta" in got:  # it landed: every row reads back
            assert listed == 40 and torch.equal(reader.get(got["meta"])["x"], rows)
        else:  # it failed: nothing of it is visible
            assert listed == 0, got["error"]
        again = client.put("lt-put-dies", unique_keys(40), {"x": rows})
        assert torch.equal(reader.get(again)["x"], rows)


@pytest.mark.parametrize("bind", ["0.0.0.0", "*"])
def test_a_server_bound_to_every_interface_is_streamed_to_on_the_host_its_clients_reach_it_at(bind):
    """A server bound to every interface advertises its TCP stream at that wildcard, which names no
    host a remote client can reach: the client seeks it on the host it reaches the server's ZMQ
    socket at (not on its own host), and its calls go over the stream."""
    from tq import messages
    from tq.rpc import RpcChannel, RpcServer

    server = RpcServer("wildcard", f"tcp://{bind}:0", secret=None, max_message_bytes=1 << 20)
    server.listen_streams()
    assert parse_tcp_address(server.tcp.address)[0] == bind
    server.serve_ops(
        {"ping": messages.Ping}, {"ping": lambda a, b, c: messages.PingReply(unit_id=0, low_water=0, expired=[], free_bytes=0)}
    )
    loop = threading.Thread(target=server.serve_forever, daemon=True)
    loop.start()
    port = server.address.rsplit(":", 1)[1]
    chan = RpcChannel(f"tcp://127.0.0.1:{port}", secret=None, timeout=5.0, name="wildcard", replies=messages.UNIT_REPLY_DECODERS)
    try:
        chan.use_stream(server.tcp.address)
        assert parse_tcp_address(chan.stream_address)[0] == "127.0.0.1"
        chan.call("ping", messages.Ping())
        assert chan._local.stream is not None and len(server.tcp.peers) == 1
    finally:
        chan.close()
        server.stop()
        loop.join(5)


def test_a_big_store_sent_as_frames_is_copied_into_the_arena_on_several_threads(tmp_path, monkeypatch):
    """A remote client's put reaches its unit as frames, which the unit copies into its arena: on a
    host with the cores (faked here: the constant is half of them) that copy runs on several of the
    copier's threads, and every byte lands where the reply says (one thread before the change)."""
    import msgspec

    import tq.storage
    from tq import messages
    from tq.rowcopy import SHARE_BYTES
    from tq.rpc import Call
    from tq.schema import JAGGED, FieldSchema
    from tq.storage import StorageUnit

    if SHARE_BYTES > 1 << 40:
        pytest.skip("no C copier built: every copy is numpy's, on one thread")
    monkeypatch.setattr(tq.storage, "COPY_THREADS", 4)
    ran: list[int] = []
    real = tq.storage.write_chunks
    monkeypatch.setattr(tq.storage, "write_chunks", lambda *a: ran.append(real(*a)) or ran[-1])
    data = np.random.default_rng(7).integers(0, 256, max(24 << 20, 8 * SHARE_BYTES), dtype=np.uint8)
    half = data.size // 2
    buffers: list = []
    args = messages.Store(
        n_rows=2,
        fields={
            "x": messages.StoreField(
                schema=FieldSchema(JAGGED, "uint8", ()).to_wire(),
                row_offsets=protocol.pack_array(np.array([0, half, data.size], np.int64), buffers),
                data=[protocol.pack_array(data[: half + 5], buffers), protocol.pack_array(data[half + 5 :], buffers)],
            )
        },
    )
    unit = StorageUnit(0, "tcp://127.0.0.1:0", capacity=data.size + (8 << 20), shm_dir=str(tmp_path))
    try:
        views = [memoryview(np.ascontiguousarray(b)).cast("B") if not isinstance(b, bytes) else memoryview(b) for b in buffers]
        reply = unit.handle("store", msgspec.to_builtins(args), views, Call(b"", None, "store", 0.0))
        assert ran and max(ran) > 1  # the copy into the arena ran on more than one thread
        start = reply.starts["x"]
        assert np.array_equal(unit.arena.view[start : start + data.size], data)
    finally:
        unit.close()
