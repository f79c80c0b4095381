"""Prometheus metrics of a TQ service: one HTTP endpoint on the controller for the whole service.

``tq-controller start --metrics-port N`` (or ``python -m tq.controller --metrics-port N``) serves
``http://<host>:N/metrics``. A scrape asks the controller for its stats and every storage unit the
controller reports up for theirs - the same ``stats`` requests ``tq-controller status`` makes, over the
service's own sockets (so the secret applies) - and turns them into metric families: the controller's
with ``server="controller"``, each unit's with ``server="unit-<id>"`` and per-unit gauges with
``unit="<id>"``. Storage units have no HTTP port of their own: their ports are picked at start and
change when a unit is restarted, which a static Prometheus config could not follow, while the
controller always knows where its units are. So one scrape target covers the service, and a unit that
is down shows as ``tq_unit_up{unit="1"} 0`` instead of as a failed target.

The serving loops pay only for plain integer counters (see :class:`tq.rpc.OpStats`): nothing is
locked or allocated per request. The endpoint runs in a process of its own (``python -m tq.metrics``,
started by the controller), so building a scrape's answer never holds the controller loop's GIL.
"""

from __future__ import annotations

import logging
import threading
from http.server import HTTPServer
from typing import Any, Iterable, Iterator, Mapping

from . import messages
from .errors import TQError
from .rpc import LATENCY_BUCKETS, RpcChannel

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0  # per request of a scrape: Prometheus' default scrape timeout is 10 s

# name -> (type, help) of every metric the endpoint exports (tests and deploy/ check against this).
METRICS: dict[str, tuple[str, str]] = {
    "tq_op_requests_total": ("counter", "Requests served, by server and operation"),
    "tq_op_errors_total": ("counter", "Requests answered with an error, by server and operation"),
    "tq_op_latency_seconds": ("histogram", "Time from receiving a request to sending its reply (a parked wait included)"),
    "tq_op_received_bytes_total": ("counter", "Bytes of request messages received, by server and operation"),
    "tq_op_sent_bytes_total": ("counter", "Bytes of reply messages sent, by server and operation"),
    "tq_rejected_messages_total": ("counter", "Messages and connections refused: malformed, unauthenticated or replayed"),
    "tq_auth_failures_total": ("counter", "Of the rejected: refused handshakes and requests failing the secret's checks"),
    "tq_uptime_seconds": ("gauge", "Seconds since the server started"),
    "tq_journal_bytes": ("gauge", "Size of the server's crash-recovery journal (0 without one)"),
    "tq_local_connections": ("gauge", "Open connections to the server's same-host Unix socket"),
    "tq_tcp_stream_connections": ("gauge", "Open connections to the server's TCP stream socket"),
    "tq_partitions": ("gauge", "Partitions registered"),
    "tq_partition_keys": ("gauge", "Keys held, by partition"),
    "tq_partition_bytes": ("gauge", "Bytes held, by partition"),
    "tq_committed_bytes_total": ("counter", "Bytes made visible by puts and field writes (bytes in)"),
    "tq_read_bytes_total": ("counter", "Bytes read by clients, by storage unit (bytes out)"),
    "tq_parked_waits": ("gauge", "Waits and waiting gets parked at the controller"),
    "tq_units": ("gauge", "Storage units registered"),
    "tq_unit_up": ("gauge", "1 if the storage unit answers, 0 if it is down"),
    "tq_unit_capacity_bytes": ("gauge", "Arena size of the storage unit"),
    "tq_unit_used_bytes": ("gauge", "Arena bytes allocated in the storage unit"),
    "tq_unit_live_bytes": ("gauge", "Bytes of live rows in the storage unit"),
    "tq_unit_blocks": ("gauge", "Blocks held by the storage unit"),
    "tq_unit_stored_bytes_total": ("counter", "Bytes stored into the storage unit"),
    "tq_unit_served_bytes_total": ("counter", "Bytes the storage unit sent to remote readers"),
    "tq_unit_parked_writes": ("gauge", "Writes parked at the storage unit waiting for room"),
    "tq_unit_tentative_blocks": ("gauge", "Blocks stored but not committed yet"),
    "tq_unit_held_bytes": ("gauge", "Arena bytes held for same-host writers paused past their allocation lease"),
}


def exported_names() -> set[str]:
    """Every sample name the endpoint can export (a histogram's ``_bucket``/``_sum``/``_count``, a
    counter's ``_total``), plus the process metrics prometheus_client adds."""
    names = {
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
    }
    for name, (kind, _) in METRICS.items():
        names |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
    return names


def families(stats: messages.StatsReply, unit_stats: Mapping[int, messages.UnitStatsReply]) -> list[Any]:
    """The metric families of a service: the controller's ``stats`` and those of the storage units
    that answered (by unit id; a unit the controller lists but that is missing here is down)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    def fam(name: str, labels: Iterable[str] = ()) -> Any:
        kind, help_ = METRICS[name]
        cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}[kind]
        # a counter family is named without its _total; prometheus_client adds it to the sample
        return cls(name.removesuffix("_total") if kind == "counter" else name, help_, labels=list(labels))

    out = {
        name: fam(name, labels)
        for name, labels in (
            ("tq_op_requests_total", ("server", "op")),
            ("tq_op_errors_total", ("server", "op")),
            ("tq_op_latency_seconds", ("server", "op")),
            ("tq_op_received_bytes_total", ("server", "op")),
            ("tq_op_sent_bytes_total", ("server", "op")),
            ("tq_rejected_messages_total", ("server",)),
            ("tq_auth_failures_total", ("server",)),
            ("tq_uptime_seconds", ("server",)),
            ("tq_journal_bytes", ("server",)),
            ("tq_local_connections", ("server",)),
            ("tq_tcp_stream_connections", ("server",)),
            ("tq_partitions", ()),
            ("tq_partition_keys", ("partition",)),
            ("tq_partition_bytes", ("partition",)),
            ("tq_committed_bytes_total", ()),
            ("tq_read_bytes_total", ("unit",)),
            ("tq_parked_waits", ()),
            ("tq_units", ()),
            *((name, ("unit",)) for name in METRICS if name.startswith("tq_unit_")),
        )
    }

    def server(label: str, st: messages.ServerStats) -> None:
        for op, o in st.ops.items():
            out["tq_op_requests_total"].add_metric([label, op], o.count)
            out["tq_op_errors_total"].add_metric([label, op], o.errors)
            if o.buckets is not None:  # recorded only with metrics on (a unit started without them has none)
                cumulative, total = [], 0
                for bound, n in zip((*LATENCY_BUCKETS, float("inf")), o.buckets):
                    total += n
                    cumulative.append((_le(bound), total))
                out["tq_op_latency_seconds"].add_metric([label, op], cumulative, o.sum_s)
                out["tq_op_received_bytes_total"].add_metric([label, op], o.bytes_in)
                out["tq_op_sent_bytes_total"].add_metric([label, op], o.bytes_out)
        out["tq_rejected_messages_total"].add_metric([label], st.rejected_messages)
        out["tq_auth_failures_total"].add_metric([label], st.auth_failures)
        out["tq_uptime_seconds"].add_metric([label], st.uptime_s)
        out["tq_journal_bytes"].add_metric([label], st.journal_bytes)
        out["tq_local_connections"].add_metric([label], st.local_connections)
        out["tq_tcp_stream_connections"].add_metric([label], st.tcp_stream_connections)

    server("controller", stats)
    out["tq_partitions"].add_metric([], len(stats.partitions))
    for p in stats.partitions:
        out["tq_partition_keys"].add_metric([p.partition], p.keys)
        out["tq_partition_bytes"].add_metric([p.partition], p.bytes)
    out["tq_committed_bytes_total"].add_metric([], stats.bytes_committed_total)
    for unit, nbytes in stats.bytes_read_total.items():
        out["tq_read_bytes_total"].add_metric([unit], nbytes)
    out["tq_parked_waits"].add_metric([], stats.parked_waits)
    out["tq_units"].add_metric([], len(stats.units))
    for u in stats.units:
        uid = str(u.unit_id)
        st = unit_stats.get(u.unit_id)
        out["tq_unit_up"].add_metric([uid], 1 if st is not None else 0)
        out["tq_unit_capacity_bytes"].add_metric([uid], u.arena_size)
        if st is None:
            continue
        server(f"unit-{uid}", st)
        for name, value in (
            ("tq_unit_used_bytes", st.bytes_used),
            ("tq_unit_live_bytes", st.bytes_live),
            ("tq_unit_blocks", st.blocks),
            ("tq_unit_stored_bytes_total", st.bytes_stored_total),
            ("tq_unit_served_bytes_total", st.bytes_served_total),
            ("tq_unit_parked_writes", st.parked_writes),
            ("tq_unit_tentative_blocks", st.tentative_blocks),
            ("tq_unit_held_bytes", st.held_bytes),
        ):
            out[name].add_metric([uid], value)
    return list(out.values())


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class ServiceCollector:
    """A prometheus_client collector asking a TQ service for its stats at every scrape (module
    docstring). Scrapes are served one at a time by one thread, so its channels keep one socket each."""

    def __init__(self, address: str, secret: bytes | None) -> None:
        self.secret = secret
        self.controller = RpcChannel(
            address, secret=secret, timeout=SCRAPE_TIMEOUT_S, name="controller", replies=messages.CONTROLLER_REPLY_DECODERS
        )
        self.units: dict[str, RpcChannel] = {}  # by address: a restarted unit gets a new channel

    def stats(self) -> tuple[messages.StatsReply, dict[int, messages.UnitStatsReply]]:
        """The controller's stats, and by unit id the stats of every unit it reports up that answers
        in time (with a reply of its type)."""
        stats: messages.StatsReply = self.controller.call(messages.ControllerOp.STATS, messages.Stats())[0]
        asked = []
        for u in stats.units:
            if u.alive is False:
                continue
            chan = self.units.get(u.address)
            if chan is None:
                chan = self.units[u.address] = RpcChannel(
                    u.address,
                    secret=self.secret,
                    timeout=SCRAPE_TIMEOUT_S,
                    name=f"storage unit {u.unit_id}",
                    replies=messages.UNIT_REPLY_DECODERS,
                )
            try:  # all asked before any answer is awaited: a scrape waits for the slowest, not the sum
                asked.append((u.unit_id, chan, chan.send(messages.UnitOp.STATS, messages.UnitStats())))
            except TQError:
                pass
        answered = {}
        for uid, chan, rid in asked:
            try:
                answered[uid] = chan.recv(rid, messages.UnitOp.STATS)[0]
            except TQError as exc:  # shown down
                log.info("metrics scrape: no stats from storage unit %s: %s", uid, exc)
        return stats, answered

    def collect(self) -> Iterator[Any]:
        try:
            stats, unit_stats = self.stats()
        except TQError as exc:  # the endpoint stays up; the scrape then lacks the tq_ metrics
            log.warning("metrics scrape: no stats from the TQ service: %s", exc)
            return
        yield from families(stats, unit_stats)

    def close(self) -> None:
        self.controller.close()
        for chan in self.units.values():
            chan.close()


class MetricsServer:
    """The HTTP endpoint (``/metrics``) of the TQ service at ``address``, served by one daemon thread;
    ``pid`` is the process whose CPU and memory the ``process_*`` metrics describe (the controller's)."""

    def __init__(self, host: str, port: int, address: str, secret: bytes | None, pid: int | None = None) -> None:
        from prometheus_client import CollectorRegistry, ProcessCollector
        from prometheus_client.exposition import MetricsHandler

        self.collector = ServiceCollector(address, secret)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        ProcessCollector(registry=registry, pid=(lambda: pid) if pid else (lambda: "self"))
        try:
            self.httpd = HTTPServer((host, port), MetricsHandler.factory(registry))
        except OSError as exc:
            self.collector.close()
            raise OSError(exc.errno, f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
        self.url = f"http://{host}:{self.httpd.server_address[1]}/metrics"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="tq-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close the socket and the channels."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5.0)
        self.collector.close()


def main(argv: list[str] | None = None) -> None:
    """``python -m tq.metrics``: the metrics endpoint as its own process, started by the controller
    (``--metrics-port``) so that building a scrape's answer never holds the controller loop's GIL.
    Writes ``{"url": ...}`` (or ``{"error": ...}``) to ``--ready-file``; serves until SIGTERM."""
    import argparse
    import os
    import signal

    from . import argtypes, launch

    p = argparse.ArgumentParser(description="Serve a TQ service's Prometheus metrics (normally started by the controller).")
    p.add_argument("--controller", required=True, help="the controller's address")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=argtypes.port, default=0)
    p.add_argument("--pid", type=argtypes.count, help="the process the process_* metrics describe (default: this one)")
    p.add_argument("--ready-file", required=True)
    a = p.parse_args(argv)
    secret = os.environ.get("TQ_SECRET")
    try:
        server = MetricsServer(a.host, a.port, a.controller, secret.encode() if secret else None, a.pid)
    except OSError as exc:
        launch.write_json(a.ready_file, {"error": exc.strerror})
        raise SystemExit(1) from None

    def stop(*_: Any) -> None:
        # Raise out of the wait rather than set an Event: a handler runs between two bytecodes of the
        # main thread, which may be holding that Event's lock just then (a set() would wait on it forever).
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    try:
        launch.write_json(a.ready_file, {"url": server.url})
        while True:
            signal.pause()
    finally:
        server.close()


if __name__ == "__main__":
    main()
