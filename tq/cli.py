"""``tq-controller``: start, stop and inspect a TQ service (controller + local storage units).

::

    tq-controller start [--host 127.0.0.1] [--port 0] [--storage-units 1] [--capacity 4G] [--journal-dir DIR] [--fsync never|interval|always]
                        [--stream-port N] [--metrics-port N] [--foreground]
    tq-controller status [--json | --watch [--interval 2]]
    tq-controller stop

``start`` runs ``python -m tq.controller`` as a detached process (its own session, so closing the
terminal does not kill it) and records ``{address, pid, log}`` in a *run file* - by default
``$TQ_RUN_DIR/controller.json`` with ``TQ_RUN_DIR`` defaulting to ``~/.cache/tq`` - which ``status``
and ``stop`` read when no ``--address`` is given. The run file only says where a running service is;
the service's own data (partitions, keys) is journaled in ``--journal-dir`` when one is given, for
crash recovery. Errors print one line to stderr and exit non-zero: 1 for "not running / unreachable /
failed", 2 for a refused request (bad arguments, already running, a non-loopback bind without a
secret). Output cut short by its reader (``tq-controller status --json | head``) ends quietly with
exit code 141 (128 + SIGPIPE), as Unix tools do. ``status --watch`` redraws the tables every
``--interval`` seconds (on a terminal in place, otherwise one after the other) until Ctrl-C (exit 0).
``--metrics-port`` serves Prometheus metrics (see :mod:`tq.metrics` and docs/observability.md);
``--stream-port`` fixes the TCP port clients of other hosts stream their requests to (for a firewall).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Sequence

from . import argtypes, launch, messages
from .errors import AuthenticationError, InvalidRequestError, TQError
from .messages import CONTROLLER_REPLY_DECODERS, ControllerOp, Stats

EXIT_FAILED = 1
EXIT_REFUSED = 2
STATUS_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 15.0
SHUTDOWN_RPC_TIMEOUT_S = 3.0
START_TIMEOUT_S = 60.0
WATCH_INTERVAL_S = 2.0
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # what a Unix tool killed by SIGPIPE reports


class CLIError(Exception):
    """A failure to report as one line on stderr with exit code ``code`` (no traceback)."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------------------------------- helpers
parse_size = argtypes.size


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``: a short human-readable byte count."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def default_run_file() -> str:
    """``$TQ_RUN_DIR/controller.json`` (``TQ_RUN_DIR`` defaults to ``~/.cache/tq``; the deprecated
    ``TQ_STATE_DIR`` is still read when ``TQ_RUN_DIR`` is unset)."""
    run_dir = os.environ.get("TQ_RUN_DIR")
    if not run_dir and os.environ.get("TQ_STATE_DIR"):
        print("tq-controller: TQ_STATE_DIR is deprecated, use TQ_RUN_DIR", file=sys.stderr, flush=True)
        run_dir = os.environ["TQ_STATE_DIR"]
    return os.path.join(run_dir or os.path.join(os.path.expanduser("~"), ".cache", "tq"), "controller.json")


def read_run_file(path: str) -> dict[str, Any] | None:
    """What the run file at ``path`` records, or None when there is no (readable) run file."""
    try:
        with open(path) as f:
            state = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CLIError(f"cannot read run file {path}: {exc}") from None
    return state if isinstance(state, dict) else None


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def controller_running(pid: int | None) -> bool:
    """Whether ``pid`` runs (not a zombie) and is a TQ controller.

    The command-line check guards against a recycled pid: after a reboot or a crash the recorded pid may
    belong to an unrelated process, which ``stop`` must never signal.
    """
    if not launch.pid_running(pid):
        return False
    import psutil

    try:
        return "tq.controller" in " ".join(psutil.Process(pid).cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _secret(args: argparse.Namespace) -> str | None:
    return args.secret if args.secret else os.environ.get("TQ_SECRET") or None


def _resolve_target(args: argparse.Namespace) -> tuple[str, dict[str, Any] | None, str]:
    """(address, what the run file records or None, run file path) for ``stop``/``status``."""
    run_file = args.run_file or default_run_file()
    state = read_run_file(run_file)
    if args.address:
        # The recorded pid only belongs to this address if the run file records the same address.
        return args.address, state if state and state.get("address") == args.address else None, run_file
    if not state or not isinstance(state.get("address"), str):
        raise CLIError(f"no TQ controller is recorded in {run_file} (start one with `tq-controller start`, or pass --address)")
    return state["address"], state, run_file


# ---------------------------------------------------------------------------------------------- status table
def op_counts(stats: dict[str, Any]) -> dict[tuple[str, str], int]:
    """``(server, op) -> requests served`` over the controller and every unit that answered (for rates)."""
    out = {("controller", op): st.get("count", 0) for op, st in stats.get("ops", {}).items()}
    for u in stats.get("unit_stats", []):
        out.update({(f"unit {u.get('unit_id')}", op): st.get("count", 0) for op, st in u.get("ops", {}).items()})
    return out


def render_status(stats: dict[str, Any], *, address: str | None = None, rates: dict[tuple[str, str], float] | None = None) -> Any:
    """A rich renderable of a service's stats (as returned by :meth:`tq.TQClient.stats` or
    :meth:`tq.admin.ServiceAdmin.stats`).

    Sections: a summary line (uptime, throughput, metrics endpoint), partitions (keys, fields, bytes
    held), storage units (health, address, used / arena size, blocks, bytes stored / read) and
    per-operation counts with p50/p99 latency for the controller and every unit; with ``rates``
    (``(server, op) -> requests/s``, see :func:`op_counts`) also each op's rate.
    """
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    title = f"TQ service at {address}" if address else "TQ service"
    summary = Text.assemble(
        (title, "bold"),
        f"  uptime {stats.get('uptime_s', 0.0):.0f}s",
        f"  metrics {stats['metrics_url']}\n" if stats.get("metrics_url") else "\n",
        f"put throughput (60s) {format_bytes(stats.get('put_bytes_per_s_60s', 0.0))}/s",
        f"  committed total {format_bytes(stats.get('bytes_committed_total', 0))}",
        f"  parked waits {stats.get('parked_waits', 0)}",
        f"  rejected messages {stats.get('rejected_messages', 0)}",
        f"  same-host connections {stats.get('local_connections', 0)}",
        f"  TCP stream connections {stats.get('tcp_stream_connections', 0)}",
    )

    parts = Table(title="Partitions", title_justify="left", expand=False)
    for col, justify in (("partition", "left"), ("keys", "right"), ("fields (schema, produced)", "left"), ("bytes held", "right")):
        parts.add_column(col, justify=justify)  # type: ignore[arg-type]
    for p in stats.get("partitions", []):
        fields = ", ".join(f"{name} ({spec.get('schema')}, {spec.get('produced')})" for name, spec in p.get("fields", {}).items())
        parts.add_row(str(p.get("partition")), str(p.get("keys")), fields or "-", format_bytes(p.get("bytes", 0)))
    if not stats.get("partitions"):
        parts.add_row("(none)", "", "", "")

    units = Table(title="Storage units", title_justify="left", expand=False)
    for col, justify in (
        ("unit", "right"),
        ("health", "left"),
        ("address", "left"),
        ("host", "left"),
        ("used / arena", "right"),
        ("blocks", "right"),
        ("stored total", "right"),
        ("read total", "right"),
        ("pid", "right"),
    ):
        units.add_column(col, justify=justify, no_wrap=col == "health")  # type: ignore[arg-type]
    health = {u.get("unit_id"): _health(u) for u in stats.get("units", [])}
    # unit_stats come from the units themselves; fall back to the controller's registry if absent.
    unit_rows = sorted(stats.get("unit_stats") or stats.get("units", []), key=lambda u: u.get("unit_id", 0))
    for u in unit_rows:
        used, size = u.get("bytes_used"), u.get("arena_size", 0)
        share = f" ({100 * used / size:.0f}%)" if used is not None and size else ""
        units.add_row(
            str(u.get("unit_id")),
            health.get(u.get("unit_id"), "[green]up[/]"),
            str(u.get("address")),
            str(u.get("host", "")).split("/", 1)[0],
            f"{format_bytes(used)} / {format_bytes(size)}{share}" if used is not None else f"? / {format_bytes(size)}",
            str(u.get("blocks", "?")),
            format_bytes(u.get("bytes_stored_total", 0)),
            format_bytes(stats.get("bytes_read_total", {}).get(str(u.get("unit_id")), 0)),  # counted by the controller
            str(u.get("pid", "")),
        )
    if not unit_rows:
        units.add_row("", "", "(none registered)", "", "", "", "", "", "")

    ops = Table(title="Operations", title_justify="left", expand=False)
    columns = [("server", "left"), ("op", "left"), ("count", "right"), ("errors", "right")]
    columns += [("req/s", "right")] if rates is not None else []
    for col, justify in (*columns, ("p50 ms", "right"), ("p99 ms", "right")):
        ops.add_column(col, justify=justify)  # type: ignore[arg-type]
    servers = [("controller", stats.get("ops", {}))] + [
        (f"unit {u.get('unit_id')}", u.get("ops", {})) for u in sorted(stats.get("unit_stats", []), key=lambda u: u.get("unit_id", 0))
    ]
    for server, table in servers:
        for op, st in sorted(table.items()):
            rate = [f"{rates.get((server, op), 0.0):.1f}"] if rates is not None else []
            ops.add_row(
                server,
                op,
                str(st.get("count", 0)),
                str(st.get("errors", 0)),
                *rate,
                f"{st.get('p50_ms', 0.0):.2f}",
                f"{st.get('p99_ms', 0.0):.2f}",
            )
    return Group(summary, parts, units, ops)


def _console(file: Any = None) -> Any:
    """A rich Console on ``file`` (default stdout), at least 120 columns wide when not a TTY, whose
    broken pipe raises BrokenPipeError: rich would exit 1 itself; main exits as a Unix tool does."""
    from rich.console import Console

    class PipeConsole(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError

    out = file if file is not None else sys.stdout
    width = None if out.isatty() else max(120, shutil.get_terminal_size((120, 40)).columns)
    return PipeConsole(file=out, width=width, highlight=False)


def _health(unit: dict[str, Any]) -> str:
    """A unit's health column: up; UNREACHABLE while its controller has not heard from it for a while
    (a partition, a stalled process: reads of its rows wait for it); DOWN once given up on (they fail
    at once) - with why, where the controller says (not when the unit only missed the stats call)."""
    if unit.get("alive", True):
        return "[green]up[/]"
    seconds = unit.get("down_for_s")
    why = f" ({messages.unit_down_reason(seconds)})" if seconds else ""
    return f"[bold red]{'UNREACHABLE' if unit.get('lost') is False else 'DOWN'}[/]{why}"


def print_status(stats: dict[str, Any], *, address: str | None = None, file: Any = None) -> None:
    """Print :func:`render_status` to ``file`` (default stdout), at least 120 columns wide when not a TTY."""
    _console(file).print(render_status(stats, address=address))


# ---------------------------------------------------------------------------------------------- commands
def cmd_start(args: argparse.Namespace) -> int:
    """Start a controller and its storage units; record and print its address."""
    from .server import check_bind_allowed

    secret = _secret(args)
    try:
        check_bind_allowed(f"tcp://{args.host}:{args.port}", secret.encode() if secret else None)
        argtypes.unit_capacity(args.storage_units, args.capacity)
    except (AuthenticationError, InvalidRequestError) as exc:
        raise CLIError(str(exc), EXIT_REFUSED) from None

    run_file = os.path.abspath(args.run_file or default_run_file())
    state = read_run_file(run_file)
    if state and controller_running(state.get("pid")):
        raise CLIError(
            f"a TQ controller is already running at {state.get('address')} (pid {state.get('pid')}, recorded in "
            f"{run_file}); stop it with `tq-controller stop` or use another --run-file",
            EXIT_REFUSED,
        )
    os.makedirs(os.path.dirname(run_file), exist_ok=True)
    _remove(run_file)  # stale: its controller is gone
    log_path = os.path.splitext(run_file)[0] + ".log"
    ready_file = os.path.splitext(run_file)[0] + ".ready"
    launch.remove_ready_file(ready_file)

    env = launch.service_env(secret)
    cmd = launch.controller_command(
        host=args.host,
        port=args.port,
        storage_units=args.storage_units,
        capacity=args.capacity,
        shm_dir=args.shm_dir,
        ready_file=ready_file,
        fsync=args.fsync,
        journal_dir=args.journal_dir,
        metrics_port=args.metrics_port,
        stream_port=args.stream_port,
        unit_lost_s=args.unit_lost_s,
    )

    if args.foreground:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        log_path = ""
    else:
        with open(log_path, "ab") as log:
            log.write(f"--- tq-controller start {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(cmd)}\n".encode())
            log.flush()
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ready = _await_service(proc, ready_file, args.storage_units, secret, log_path)
    except BaseException:
        launch.stop_process(proc, STOP_TIMEOUT_S, tree=True)
        raise
    address = ready["address"]
    launch.write_json(
        run_file,
        {
            "address": address,
            "pid": proc.pid,
            "log": log_path or None,
            "metrics_url": ready.get("metrics_url"),
            "storage_units": args.storage_units,
            "started_at": time.time(),
        },
    )
    print(address, flush=True)
    if ready.get("metrics_url"):  # stdout is the address alone (ADDR=$(tq-controller start))
        print(f"tq-controller start: Prometheus metrics at {ready['metrics_url']}", file=sys.stderr, flush=True)
    if not args.foreground:
        return 0
    return _run_foreground(proc, run_file)


def _await_service(proc: subprocess.Popen, ready_file: str, units: int, secret: str | None, log_path: str) -> dict[str, Any]:
    """Wait (bounded) until the controller wrote its ready file and all its storage units registered;
    returns what the ready file holds (address, pid, metrics URL)."""
    from .rpc import RpcChannel

    see_log = f" (see {log_path})" if log_path else ""

    def failed(message: str) -> CLIError:
        last = _last_log_line(log_path)
        return CLIError(f"{message}{see_log}" + (f"; last log line: {last}" if last else ""))

    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        ready = launch.await_ready_file(ready_file, alive=lambda: proc.poll() is None, timeout=START_TIMEOUT_S, what="the TQ controller")
        address = ready["address"]
    except TQError as exc:
        code = f" (exit code {proc.returncode})" if proc.poll() is not None else ""
        raise failed(f"{exc}{code}") from None
    # Poll until every unit registered; a unit that died meanwhile (e.g. no room in --shm-dir) fails
    # the start at once, instead of after the whole timeout.
    import psutil

    # The controller's own stats op, not a TQClient: a client's hello is parked until the units
    # registered, which is what this loop watches for.
    chan = RpcChannel(
        address, secret=secret.encode() if secret else None, timeout=5.0, name="controller", replies=CONTROLLER_REPLY_DECODERS
    )
    try:
        while True:
            registered = len(chan.call(ControllerOp.STATS, Stats())[0].units)
            if registered >= units:
                return ready
            try:  # the storage units among the controller's children (the metrics endpoint is one too)
                running = [c for c in psutil.Process(proc.pid).children() if launch.pid_running(c.pid) and "tq.storage" in c.cmdline()]
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                running = []
            if proc.poll() is not None or len(running) < units:
                raise failed(f"a storage unit exited before registering ({registered} of {units} registered)")
            if time.monotonic() > deadline:
                raise failed(f"only {registered} of {units} storage units registered within {START_TIMEOUT_S:.0f}s")
            time.sleep(0.1)
    finally:
        chan.close()


def _last_log_line(log_path: str, max_bytes: int = 8192) -> str:
    """The last non-empty line of the log (usually the error that ended a process), or ''."""
    if not log_path:
        return ""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - max_bytes))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _run_foreground(proc: subprocess.Popen, run_file: str) -> int:
    """Wait on the controller; on SIGTERM/Ctrl-C stop it (bounded) and remove the run file."""
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    code: int | None = None
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:  # the controller got the same SIGINT from the terminal
                proc.terminate()
    finally:
        launch.stop_process(proc, STOP_TIMEOUT_S, tree=True)
        _remove(run_file)
    return 0 if code in (0, -signal.SIGTERM, -signal.SIGINT) else EXIT_FAILED  # a signal we sent: a clean stop


def cmd_stop(args: argparse.Namespace) -> int:
    """Shut a controller down (RPC, else SIGTERM to the recorded pid), wait for it, remove the run file."""
    from .admin import ServiceAdmin

    address, state, run_file = _resolve_target(args)
    pid = state.get("pid") if state else None
    alive = controller_running(pid)
    try:
        with ServiceAdmin(address, secret=_secret(args), timeout=SHUTDOWN_RPC_TIMEOUT_S) as admin:
            admin.shutdown_service()
    except TQError as exc:
        if not alive:
            if state:
                _remove(run_file)
            raise CLIError(
                f"no TQ controller is running at {address} ({exc})" + (f"; removed the stale run file {run_file}" if state else "")
            ) from None
        # Alive here but not answering us (wrong secret, wedged), or it stopped before its reply left:
        # the recorded pid is ours to stop (a controller already stopping takes SIGTERM as the same).
        launch.signal_tree(pid, signal.SIGTERM)
    if alive:
        if not launch.wait_pid_exit(pid, STOP_TIMEOUT_S):
            launch.signal_tree(pid, signal.SIGTERM)
            if not launch.wait_pid_exit(pid, 5.0):
                launch.signal_tree(pid, signal.SIGKILL)
                launch.wait_pid_exit(pid, 5.0)
    if state:
        _remove(run_file)
    print(f"stopped TQ controller at {address}" + (f" (pid {pid})" if pid else ""), flush=True)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Print the service's stats as tables (or raw JSON with ``--json``, or live with ``--watch``)."""
    from .admin import ServiceAdmin

    address, _, _ = _resolve_target(args)
    if args.watch:
        return _watch(args, address)
    try:
        with ServiceAdmin(address, secret=_secret(args), timeout=args.timeout) as admin:
            stats = admin.stats()
    except TQError as exc:
        hint = "" if _secret(args) else " (if the service uses a secret, pass --secret or set TQ_SECRET)"
        raise CLIError(f"TQ controller at {address} is not reachable: {exc}{hint}") from None
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True, default=str), flush=True)
    else:
        print_status(stats, address=address)
    return 0


def watch_footer(interval: float) -> Any:
    """The last line of a ``status --watch`` view: when it was drawn, how often, how to quit."""
    from rich.text import Text

    return Text(f"{time.strftime('%H:%M:%S')}  every {interval:g}s, Ctrl-C quits", style="dim")


def _watch(args: argparse.Namespace, address: str) -> int:
    """Redraw the status tables every ``--interval`` seconds, with request rates, until Ctrl-C (exit 0).

    On a terminal the view is redrawn in place; otherwise each view is printed after the previous one
    (a log). A controller that stops answering is shown as such and watched until it answers again; a
    refused secret ends the watch (waiting cannot fix it)."""
    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    from .admin import ServiceAdmin

    console = _console()
    live = Live(console=console, auto_refresh=False, redirect_stdout=False, redirect_stderr=False) if console.is_terminal else None
    client: ServiceAdmin | None = None
    previous: tuple[float, dict[tuple[str, str], int]] | None = None
    try:
        if live is not None:
            live.start()
        while True:
            now = time.monotonic()
            try:
                if client is None:
                    client = ServiceAdmin(address, secret=_secret(args), timeout=args.timeout)
                stats = client.stats()
            except AuthenticationError as exc:
                raise CLIError(f"TQ controller at {address} refused this client: {exc}") from None
            except TQError as exc:
                if client is not None:
                    client.close()
                client, previous = None, None
                view: Any = Group(
                    Text(f"TQ controller at {address} is not reachable: {exc}", style="bold red"), watch_footer(args.interval)
                )
            else:
                counts = op_counts(stats)
                rates = {k: (n - previous[1].get(k, 0)) / (now - previous[0]) for k, n in counts.items()} if previous else {}
                previous = (now, counts)
                view = Group(render_status(stats, address=address, rates=rates), watch_footer(args.interval))
            if live is not None:
                live.update(view, refresh=True)
            else:
                console.print(view)
                console.file.flush()  # a reader of the pipe sees each view as it is drawn
            time.sleep(args.interval)
    except KeyboardInterrupt:  # how a watch ends
        return 0
    finally:
        if live is not None:
            live.stop()
        if client is not None:
            client.close()


AWAITING_RESTART_S = 60.0  # an unowned arena written this recently may be a crashed unit's, about to be restarted


def cmd_clean(args: argparse.Namespace) -> int:
    """List (and with ``--yes`` remove) what TQ processes that are gone left in ``--shm-dir``: the
    arenas and journals of storage units killed with their whole service (kept on purpose - a
    controller started again on the service's journal dir recovers them - so only the operator can
    let them go), and the location tables, pin files and liveness files of processes that exited."""
    from . import liveness, locations, pins
    from .arena import unowned_arenas

    d = args.shm_dir
    if not os.path.isdir(d):
        raise CLIError(f"--shm-dir {d} is not a directory")
    arenas = unowned_arenas(d, args.min_age)
    stored = [p for a in arenas for p in (a, a + ".journal") if os.path.exists(p)]
    files = [p for pattern in (locations.NAME, pins.NAME, liveness.NAME) for p in liveness.gone(d, pattern)]

    def size(path: str) -> int:
        try:
            return os.stat(path).st_blocks * 512  # what the file holds in tmpfs (arenas are sparse)
        except OSError:
            return 0

    held = {path: size(path) for path in stored + files}
    total = sum(held.values())
    for path, nbytes in held.items():
        print(f"{format_bytes(nbytes):>10}  {path}", flush=True)
    if not args.yes:
        print(
            f"{len(stored) + len(files)} files ({format_bytes(total)}) left by TQ processes that are gone; "
            f"{len(arenas)} storage-unit arenas among them hold data a controller started again on its "
            "journal dir would recover - run with --yes to remove them all",
            flush=True,
        )
        return 0
    for path in stored:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    # each as its own sweep does it (a table is retired first: a reader that still maps it stops trusting it)
    n = locations.remove_orphans(d) + liveness.remove_gone(d, pins.NAME) + liveness.remove_gone(d)
    print(f"removed {len(stored) + n} files ({format_bytes(total)}) from {d}", flush=True)
    return 0


# ---------------------------------------------------------------------------------------------- entry point
def build_parser() -> argparse.ArgumentParser:
    """The ``tq-controller`` argument parser (subcommands start, stop, status, clean)."""
    p = argparse.ArgumentParser(prog="tq-controller", description="Start, stop and inspect a TransferQueue service.")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--run-file",
            metavar="FILE",
            help="where `start` records the running service's address, pid and log, and `status`/`stop` "
            "look it up (default: $TQ_RUN_DIR/controller.json, TQ_RUN_DIR=~/.cache/tq)",
        )
        sp.add_argument("--state-file", dest="run_file", action=argtypes.deprecated_alias("--run-file"), help=argparse.SUPPRESS)
        sp.add_argument("--secret", help="the service's shared secret (default: $TQ_SECRET)")

    s = sub.add_parser("start", help="start a controller and its storage units in the background")
    s.add_argument("--host", default="127.0.0.1", help="bind address (non-loopback needs a secret)")
    s.add_argument("--port", type=argtypes.port, default=0, help="controller port, 0..65535 (0: pick a free one)")
    s.add_argument("--stream-port", type=argtypes.port, default=0, metavar="PORT", help=launch.STREAM_PORT_HELP)
    s.add_argument("--storage-units", type=argtypes.count, default=1, help="local storage units (0: units join later, e.g. via Ray)")
    s.add_argument("--capacity", type=argtypes.size, default=4 << 30, help="total bytes over all units, e.g. 4G or 512M")
    s.add_argument("--shm-dir", default="/dev/shm", help="directory (tmpfs) holding the storage arenas")
    s.add_argument("--foreground", action="store_true", help="stay attached and stop the service on Ctrl-C")
    s.add_argument(
        "--journal-dir",
        type=argtypes.directory,
        metavar="DIR",
        help="crash recovery: the controller journals its partitions and keys here; started again on the "
        "same --port and --journal-dir after a crash, it recovers them and takes its storage units back",
    )
    s.add_argument(
        "--metrics-port",
        type=argtypes.port,
        metavar="PORT",
        help="serve Prometheus metrics of the controller and every storage unit at http://HOST:PORT/metrics "
        "(0: a free port; the URL is printed on stderr and shown by `status`)",
    )
    s.add_argument(
        "--fsync",
        choices=("never", "always", "interval"),
        default="never",
        help="when journals reach the disk: 'never' (the OS page cache: survives any process crash, "
        "which is what matters while the data itself lives in tmpfs), 'interval' (fsync about "
        "once a second) or 'always' (fsync every record)",
    )
    s.add_argument("--unit-lost-s", type=argtypes.positive_seconds, default=None, metavar="SECONDS", help=launch.UNIT_LOST_HELP)
    common(s)
    s.set_defaults(func=cmd_start)

    c = sub.add_parser("clean", help="list (--yes: remove) shared-memory files left by TQ processes that are gone")
    c.add_argument("--shm-dir", default="/dev/shm", help="the directory the services' --shm-dir named")
    c.add_argument("--yes", action="store_true", help="remove them (arenas of killed units included: their data is lost)")
    c.add_argument(
        "--min-age",
        type=argtypes.seconds,
        default=AWAITING_RESTART_S,
        metavar="SECONDS",
        help="leave arenas written this recently (a crashed unit's, about to be restarted by its controller)",
    )
    c.set_defaults(func=cmd_clean)

    for name, func, help_ in (("stop", cmd_stop, "shut the service down"), ("status", cmd_status, "show partitions, units and op stats")):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument(
            "--address", type=argtypes.address, help="controller address, tcp://HOST:PORT (default: the one recorded in the run file)"
        )
        common(sp)
        if name == "status":
            view = sp.add_mutually_exclusive_group()
            view.add_argument("--json", action="store_true", help="print the raw stats as JSON")
            view.add_argument("--watch", action="store_true", help="redraw the tables, with request rates, until Ctrl-C")
            sp.add_argument(
                "--interval", type=argtypes.positive_seconds, default=WATCH_INTERVAL_S, help="seconds between redraws with --watch"
            )
            sp.add_argument("--timeout", type=argtypes.positive_seconds, default=STATUS_TIMEOUT_S, help="seconds to wait for an answer")
        sp.set_defaults(func=func)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``tq-controller``; exits with the command's status (errors: one line on stderr)."""
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except CLIError as exc:
        print(f"tq-controller {args.command}: {exc}", file=sys.stderr, flush=True)
        code = exc.code
    except BrokenPipeError:
        code = _reader_went_away()
    except (TQError, OSError, ValueError) as exc:
        print(f"tq-controller {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        code = EXIT_FAILED
    except KeyboardInterrupt:
        code = 130
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # the last lines were still buffered when the reader left
        code = _reader_went_away()
    sys.exit(code)


def _reader_went_away() -> int:
    """stdout's reader closed the pipe (``... | head``): stop quietly, as a Unix tool does on SIGPIPE.

    stdout is pointed at /dev/null so that the interpreter's own flush at exit does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    main()
