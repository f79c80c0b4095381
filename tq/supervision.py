"""The controller's side of its storage units: connections, heartbeats, the block ledger that makes
commits fenced (see :mod:`tq.controller`), and supervision - a unit that dies is reported down at once
and restarted on its arena.

:class:`UnitSupervision` is a part of :class:`~tq.controller.Controller` (a mixin): it owns the
controller's unit state (``units``, ``unit_socks``, ``unit_seen``, ``ledgers``, ``children``,
``_restarts``, ``_restarting``), set up in ``Controller.__init__``, and reads ``partitions`` (what live
keys still reference, for a ``retain``) and ``journal`` (fences and low-water marks are journaled).
Everything it sends goes out fire-and-forget from the server loop and never blocks it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from . import messages, protocol, rpc, stream_transport
from .arena import arena_in_use
from .errors import InvalidRequestError
from .locations import ALIVE_S, LocationTable
from .protocol import LOC_BLOCK as BLOCK, LOC_ROW as ROW, LOC_UNIT as UNIT

log = logging.getLogger("tq.controller")

HEARTBEAT_S = 1.0  # the controller pings every storage unit this often
UNIT_TIMEOUT_S = 3.0  # a unit silent for longer is reported down: reads of its keys wait for it (UNIT_LOST_S)
# A unit silent for longer is given up on: reads of its keys fail fast. Until then a reader waits for
# it within its own timeout - a network partition or a stalled host heals, and failing at the first
# few seconds of silence ended a GRPO job over a 10 s network cut that Ray itself rides out (Ray
# declares a node dead after 5 failed health checks, 3 s apart, each allowed 10 s: 20-60 s).
UNIT_LOST_S = 30.0
ADOPTED_CHECK_S = 0.2  # how often the pids of units taken back from the journal are checked
UNIT_SEND_HWM = 1000  # messages queued per storage unit before sends to it are dropped (then a retain)
UNIT_STREAM_MAX_QUEUED = 64 << 20  # the same bound, in bytes, for a unit reached over its Unix socket
# While commits keep coming, their adopts and claims go to a unit at most this often, several in one
# message: a unit served a 1-key put's adopt or claim in about the time it took to serve the write
# itself, on the CPUs the writers need. The first flush after a quiet spell goes at once.
UNIT_FLUSH_S = 0.002
# Requests to units go out fire-and-forget, each with its op's number as request id, which the reply
# echoes: so a reply is decoded into the reply type of the op it answers.
_OP_RIDS = {op: rid for rid, op in enumerate(messages.UnitOp, 1)}
_REPLY_DECODERS = {rid: messages.UNIT_REPLY_DECODERS[op.value] for op, rid in _OP_RIDS.items()}


@dataclass
class UnitLedger:
    """What the controller knows of one storage unit's blocks that are not settled yet (ids at or
    above the unit's reported ``low_water``): committed ones whose claim the unit has not confirmed,
    fenced ones, claims to send, and whether the unit missed messages and needs a ``retain``."""

    low_water: int = 0
    pending: dict[int, int] = field(default_factory=dict)  # block -> commit digest, until settled
    fenced: set[int] = field(default_factory=set)
    claims: list[int] = field(default_factory=list)
    frees: list[np.ndarray] = field(default_factory=list)  # [n, 2] (block, row) pairs to free
    resync: bool = False
    # committed blocks carved out of slabs, until settled (the unit adopted them), and those to send
    adopts: dict[int, messages.AdoptBlock] = field(default_factory=dict)
    adopt_queue: list[int] = field(default_factory=list)

    def settled(self, block: int) -> bool:
        """Claimed or freed long ago, or fenced: no commit of this block may be applied any more."""
        return block < self.low_water or block in self.fenced


def block_rows(rows: np.ndarray, bufs: list[Any]) -> dict[str, Any]:
    """The ``blocks`` and ``rows`` args of a unit's free_rows / retain for ``[n, 2]`` (block, row) pairs."""
    return {"blocks": protocol.pack_array(rows[:, 0], bufs), "rows": protocol.pack_array(rows[:, 1], bufs)}


def _remove_arena_files(unit: dict) -> None:
    """Remove a unit's arena and its journal, what of them exists."""
    for path in (unit["arena_path"], f"{unit['arena_path']}.journal"):
        try:
            os.unlink(path)
        except (OSError, TypeError):
            pass


class UnitSupervision:
    """Storage units as the controller sees them (see module docstring)."""

    def _down_units(self) -> int:
        """Units reported down, as a bit mask (units from 62 on share the last bit)."""
        now = time.monotonic()
        down = 0
        for unit in range(len(self.units)):
            if self._unit_down_for(unit, now):
                down |= 1 << min(unit, 62)
        return down

    def _publish_status(self, *tables: LocationTable) -> None:
        """Tell same-host readers of the location tables which units are down and that we are alive."""
        self._published_down = down = self._down_units()
        alive_until = time.monotonic_ns() + int(ALIVE_S * 1e9)
        for table in tables or [p.table for p in self.partitions.values()]:
            table.set_status(self.units_version, down, alive_until)

    def _connect_unit(self, uid: int, address: str, local_address: str | None = None) -> None:
        """Connect to a (re)registered unit: over ZMQ, and over its Unix socket where it is on this host
        (``local_address``; then every message goes that way while the connection holds, so they keep
        their order)."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, UNIT_SEND_HWM)  # bounded: past it, sends fail (never block) - see _send_to_unit
        # across a network partition: the unit is heard within about a second of the network's return,
        # not at TCP's next retransmission (5.9 s after an 8 s partition, 25 s after a 30 s one)
        rpc.reconnect_when_silent(sock)
        self.secure_client_socket(sock)  # a unit with a secret refuses connections without its credentials
        try:
            sock.connect(address)  # first: a bad address must not cost the unit its current socket
        except zmq.ZMQError as exc:
            sock.close(0)
            raise InvalidRequestError(f"cannot connect to storage unit address {address!r}: {exc}") from None
        old = self.unit_socks.pop(uid, None)
        if old is not None:
            self.remove_socket(old)
        self.unit_socks[uid] = sock
        self.add_socket(sock, lambda frames: self._on_unit_reply(uid, frames))
        self.unit_seen[uid] = time.monotonic()
        self._close_unit_stream(uid)
        if local_address is not None and stream_transport.supported():
            try:
                sock = stream_transport.connect(local_address, 1.0)
            except (OSError, ValueError):  # another host or network namespace: ZMQ it is
                return
            self.unit_streams[uid] = stream_transport.StreamPeer(
                sock, self, lambda _, frames: self._on_unit_reply(uid, frames), lambda s, exc: self._unit_stream_ended(uid, s, exc)
            )

    def _unit_stream_ended(self, unit: int, stream: stream_transport.StreamPeer, exc: Exception) -> None:
        """The unit is gone (or restarting): what it did not read is lost, so it gets a retain once it
        answers again; its messages go over ZMQ until it registers again."""
        log.info("storage unit %d: its same-host connection ended (%s)", unit, exc)
        if self.unit_streams.get(unit) is stream:
            del self.unit_streams[unit]
        self.ledgers[unit].resync = True

    def _close_unit_stream(self, unit: int, last: list[Any] | None = None) -> None:
        """Close the unit's Unix-socket connection; its messages go over ZMQ from now on. With a
        ``last`` message (the controller stopping), what waits and it are written first, within a
        second (as ZMQ's linger); else what waits is dropped (a gone or replaced unit gets a retain)."""
        stream = self.unit_streams.pop(unit, None)
        if stream is not None and last is not None:
            stream.finish(last, timeout=1.0)
        elif stream is not None:
            stream.close()

    def _rows_on(self, unit: int) -> np.ndarray:
        """(block, row) pairs of ``unit`` that live keys still reference, int64 ``[n, 2]``."""
        found = [np.empty((0, 2), dtype=np.int64)]
        for part in self.partitions.values():
            live = part.live_slots()
            for loc in part.locs.values():
                rec = loc[live]
                found.append(rec[rec[:, UNIT] == unit][:, [BLOCK, ROW]])
        return np.unique(np.concatenate(found), axis=0)

    def _on_unit_reply(self, unit: int, frames: list) -> None:
        now = time.monotonic()
        if self._unit_down_for(unit, now) and unit in self.unit_socks:
            # back after a silence: what was sent meanwhile may have gone down with a dropped connection
            self.ledgers[unit].resync = True
        self.unit_seen[unit] = now  # any reply is a heartbeat
        try:
            reply = protocol.decode_reply(frames, self.secret)
            protocol.raise_for_error(reply)
            decoder = _REPLY_DECODERS.get(reply.rid)
            result = decoder.decode(reply.result) if decoder is not None else None  # None: to a shutdown sent on close
        except Exception as exc:
            log.warning("storage unit %d refused a request: %s", unit, exc)
            return
        if type(result) is messages.PingReply:
            self._on_unit_heartbeat(unit, result)
        elif type(result) in (messages.AdoptReply, messages.RetainReply):  # journaled by the unit:
            adopts = self.ledgers[unit].adopts  # their layouts are not needed any more
            for b in result.adopted:
                adopts.pop(b, None)
        if self.ledgers[unit].resync:
            self._resync(unit)

    def _on_unit_heartbeat(self, unit: int, beat: messages.PingReply) -> None:
        """Settle what the unit reports: blocks below its low-water mark are settled (forget them);
        tentative blocks past their lease are claimed if committed, else fenced and freed."""
        if self._raise_water(unit, beat.low_water):
            self._journal(["__water__", {"unit": unit, "low_water": beat.low_water}, []])
        if unit < len(self.units):
            self.units[unit]["free_bytes"] = beat.free_bytes
        if beat.expired:
            led = self.ledgers[unit]
            led.claims.extend(b for b in beat.expired if b in led.pending and b not in led.adopts)
            led.adopt_queue.extend(b for b in beat.expired if b in led.adopts)  # its adopt never arrived: again
            self._fence(unit, [b for b in beat.expired if b not in led.pending])

    def _raise_water(self, unit: int, low_water: int) -> bool:
        led = self.ledgers[unit]
        if low_water <= led.low_water:
            return False
        led.low_water = low_water
        led.pending = {b: d for b, d in led.pending.items() if b >= low_water}
        led.adopts = {b: a for b, a in led.adopts.items() if b >= low_water}
        led.fenced = {b for b in led.fenced if b >= low_water}
        return True

    def _fence(self, unit: int, blocks: list[int]) -> None:
        """Decide that these stored blocks of ``unit`` never become visible: remember it (journaled
        first), then have the unit free them. A commit naming one later is refused. Blocks fenced
        before are only freed again (the unit still reports them: the first free did not reach it)."""
        led = self.ledgers[unit]
        blocks = [b for b in blocks if b not in led.pending and b >= led.low_water]  # not committed nor settled
        if not blocks or self._replaying:
            return
        new = [b for b in blocks if b not in led.fenced]
        if new:
            led.fenced.update(new)
            self._journal(["__fence__", {"unit": unit, "blocks": new}, []])
        self._send_to_unit(unit, messages.UnitOp.FREE_BLOCKS, messages.FreeBlocks(blocks=blocks), [])

    def _resync(self, unit: int) -> None:
        """Send the unit the whole list of what it must keep (and the blocks committed on it): covers
        every free and claim it missed (down, restarted, or its queue was full)."""
        led = self.ledgers[unit]
        bufs: list[Any] = []
        args = messages.Retain(
            **block_rows(self._rows_on(unit), bufs),
            claimed=protocol.pack_array(np.array(sorted(led.pending), dtype=np.int64), bufs),
            adopts=list(led.adopts.values()) or None,
        )
        led.resync = False
        self._send_to_unit(unit, messages.UnitOp.RETAIN, args, bufs)  # sets resync again if it could not go out

    def _unit_lost(self, down_for_s: float) -> bool:
        """Whether a unit down for ``down_for_s`` (see :meth:`_unit_down_for`) is given up on: its
        process ended, or it has been silent for ``unit_lost_s``."""
        return down_for_s >= self.unit_lost_s

    def _unit_down_for(self, unit: int, now: float) -> float:
        """Seconds since the unit last answered, if that is past ``UNIT_TIMEOUT_S`` (``messages.UNIT_ENDED_S``
        once its process ended); else 0."""
        age = now - self.unit_seen.get(unit, now)
        return min(age, messages.UNIT_ENDED_S) if age > UNIT_TIMEOUT_S else 0.0

    def _reap_children(self) -> None:
        """Storage units this controller started that died (e.g. SIGKILL): see :meth:`_unit_died`."""
        for proc in [p for p in self.children if p.poll() is not None]:
            self.children.remove(proc)
            unit = next((u for u in self.units if u.get("pid") == proc.pid), None)
            if unit is not None:
                self._unit_died(unit, f"(pid {proc.pid}) exited with code {proc.returncode}")

    def _check_adopted_units(self) -> None:
        """Units an earlier incarnation of this controller started (taken back from the journal) are
        not our children, so we cannot wait on them: a unit holds its arena's lock for as long as its
        process lives, so a free lock means it died (a recycled pid cannot fool this)."""
        children = {p.pid for p in self.children}
        for unit in self.units:
            uid = unit["unit_id"]
            if (
                unit.get("managed")
                and unit.get("host") == self.host
                and unit.get("pid") not in children
                and uid not in self._restarting
                and not arena_in_use(unit["arena_path"])
            ):
                self._unit_died(unit, f"(pid {unit.get('pid')}) is gone")

    def _unit_died(self, unit: dict, how: str) -> None:
        """Report the unit down at once and restart it on its arena so it recovers what it held; after
        3 crashes within a minute, give up and remove the arena."""
        now = time.monotonic()
        uid = unit["unit_id"]
        log.error("storage unit %d %s", uid, how)
        self.unit_seen[uid] = float("-inf")
        self._publish_status()
        if arena_in_use(unit["arena_path"]):
            # another unit process owns the arena (e.g. restarted by our previous incarnation just
            # before it died): it rejoins by itself, and a second one on the same arena must not run
            log.warning("storage unit %d: its arena is owned by another process, which will rejoin", uid)
            self._restarting[uid] = None
            return
        recent = [t for t in self._restarts.get(uid, []) if now - t < 60.0]
        if self.restart_unit is not None and len(recent) < 3 and os.path.exists(unit["arena_path"]):
            self._restarts[uid] = [*recent, now]
            proc = self.restart_unit(uid, unit["arena_path"])
            self.children.append(proc)
            self._restarting[uid] = proc
            return
        unit["managed"] = False  # given up: not restarted again
        _remove_arena_files(unit)

    def remove_arenas_of(self, stopped: list[subprocess.Popen]) -> None:
        """After a shutdown: remove the arena and journal of every unit of this host whose process
        (one of ``stopped``, all ended) left them and that no process holds - a unit restarted just
        before the shutdown that got its SIGTERM while still starting (importing, or replaying its
        journal) dies without cleaning up, and nothing would start on that arena again."""
        pids = {p.pid for p in stopped}
        for unit in self.units:
            restarted = self._restarting.get(unit["unit_id"])
            if unit.get("pid") in pids or (restarted is not None and restarted.pid in pids):
                if unit.get("host") == self.host and unit.get("arena_path") and not arena_in_use(unit["arena_path"]):
                    _remove_arena_files(unit)

    def _heartbeat(self, now: float) -> None:
        if now >= self._next_adopted_check:  # a dead unit is restarted within this, not a heartbeat
            self._next_adopted_check = now + ADOPTED_CHECK_S
            self._check_adopted_units()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + HEARTBEAT_S
        for unit in self.unit_socks:
            self._send_to_unit(unit, messages.UnitOp.PING, messages.Ping(), [])
        for uid, proc in list(self._restarting.items()):
            if proc is None and not arena_in_use(self.units[uid]["arena_path"]):
                del self._restarting[uid]  # the process that owned its arena is gone before it rejoined
            elif proc is not None and proc.poll() is not None:  # died before it rejoined: restarted again
                del self._restarting[uid]
        self._publish_status()  # renews the location tables' lease too

    def _send_to_unit(self, unit: int, op: messages.UnitOp, args: messages.Args, buffers: list) -> None:
        """Fire and forget, never blocking: a unit that is gone or stalled must not stall this loop.
        A dropped free or claim is not lost: the unit gets a ``retain`` once it answers again."""
        if self._replaying:
            return
        stream = self.unit_streams.get(unit)
        if stream is not None:
            if stream.queued > UNIT_STREAM_MAX_QUEUED:  # not reading: as past the HWM below
                if op != messages.UnitOp.PING and not self.ledgers[unit].resync:
                    log.warning("storage unit %d is not taking messages: its frees wait for it to answer again", unit)
                    self.ledgers[unit].resync = True
                return
            if stream.send(protocol.request(op, _OP_RIDS[op], args, buffers, self.secret)):
                return
            # the write found the unit gone (a retain is due): this message goes over ZMQ
        sock = self.unit_socks.get(unit)
        if sock is None:
            return
        try:
            sock.send_multipart(protocol.request(op, _OP_RIDS[op], args, buffers, self.secret), flags=zmq.NOBLOCK)
        except zmq.Again:
            if op != messages.UnitOp.PING and not self.ledgers[unit].resync:
                log.warning("storage unit %d is not taking messages: its frees wait for it to answer again", unit)
                self.ledgers[unit].resync = True

    def _flush_units(self, now: float | None = None) -> None:
        """Send each unit the adopts, claims and frees of the ops applied (and journaled) since the last
        flush. From the loop's tick (``now``): at most once per UNIT_FLUSH_S; without ``now``: at once."""
        if now is not None and now < self._next_unit_flush:
            return
        sent = False
        for unit, led in self.ledgers.items():
            if led.adopt_queue:
                adopts = [led.adopts[b] for b in dict.fromkeys(led.adopt_queue) if b in led.adopts]
                self._send_to_unit(unit, messages.UnitOp.ADOPT, messages.Adopt(blocks=adopts), [])
                led.adopt_queue, sent = [], True
            if led.claims:
                bufs: list[Any] = []
                blocks = protocol.pack_array(np.array(led.claims, dtype=np.int64), bufs)
                self._send_to_unit(unit, messages.UnitOp.CLAIM, messages.Claim(blocks=blocks), bufs)
                led.claims, sent = [], True
            if led.frees:  # after the adopts and claims: a free may be of a block committed in this batch
                bufs = []
                self._send_to_unit(unit, messages.UnitOp.FREE_ROWS, messages.FreeRows(**block_rows(np.concatenate(led.frees), bufs)), bufs)
                led.frees, sent = [], True
        if sent:
            self._next_unit_flush = (time.monotonic() if now is None else now) + UNIT_FLUSH_S

    def _unit_flush_due(self) -> float | None:
        """When the loop must wake to flush what waits for the units (None: nothing waits)."""
        if any(led.adopt_queue or led.claims or led.frees for led in self.ledgers.values()):
            return self._next_unit_flush
        return None

    def _flush_frees_now(self) -> None:
        """Flush before the reply to an op that freed rows (everything pending, in order): a writer
        told that a discard is done may put into its space at once, and that request must not reach
        the unit before the free does. Ops that free nothing leave their messages to the tick."""
        if any(led.frees for led in self.ledgers.values()):
            self._flush_units()
