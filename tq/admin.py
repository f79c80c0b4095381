"""Operator calls that touch no tensor: a service's stats and its shutdown.

``tq-controller status`` and ``stop`` use :class:`ServiceAdmin` instead of a :class:`tq.TQClient`,
which imports torch (seconds on a small machine) and waits at its hello for every expected storage
unit; :meth:`tq.TQClient.stats` shares :func:`service_stats` with it.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import msgspec

from . import messages
from .errors import TQConnectionError
from .messages import ControllerOp, UnitOp
from .rpc import RpcChannel

UNIT_STATS_TIMEOUT_S = 2.0  # stats wait this long for each storage unit before showing it down


def unit_stats(unit_chans: Mapping[int, RpcChannel], units: Iterable[int], timeout: float) -> dict[int, messages.UnitStatsReply]:
    """The stats of every one of ``units`` that answers: all are asked before any answer is awaited,
    each for at most ``min(timeout, UNIT_STATS_TIMEOUT_S)``, so one that just died (not yet reported
    down by the controller) is left out instead of failing the caller."""
    timeout = min(timeout, UNIT_STATS_TIMEOUT_S)
    asked = []
    for unit in units:
        try:
            asked.append((unit, unit_chans[unit].send(UnitOp.STATS, messages.UnitStats(), timeout=timeout)))
        except TQConnectionError:
            pass
    answered = {}
    for unit, rid in asked:
        try:
            answered[unit] = unit_chans[unit].recv(rid, "stats", timeout=timeout)[0]
        except TQConnectionError:
            pass
    return answered


def service_stats(reply: messages.StatsReply, unit_chans: Mapping[int, RpcChannel], timeout: float) -> dict[str, Any]:
    """The controller's stats ``reply`` as plain data, with every unit's own stats under
    ``"unit_stats"``: a unit the controller reports down is not asked; one that does not answer
    (:func:`unit_stats`) is shown down."""
    answered = unit_stats(unit_chans, [u.unit_id for u in reply.units if u.alive is not False and u.unit_id in unit_chans], timeout)
    for u in reply.units:
        u.alive = u.unit_id in answered
    stats = msgspec.to_builtins(reply)
    stats["unit_stats"] = [msgspec.to_builtins(answered.get(u.unit_id, u)) for u in reply.units]
    return stats


def connect_units(unit_chans: dict[int, RpcChannel], units: Iterable[messages.UnitInfo], secret: bytes | None, timeout: float) -> None:
    """Give ``unit_chans`` a request channel to each of ``units`` that has none, or one to the
    address it moved to (a unit restarted elsewhere)."""
    for u in units:
        chan = unit_chans.get(u.unit_id)
        if chan is None or chan.address != u.address:
            if chan is not None:
                chan.close()
            unit_chans[u.unit_id] = RpcChannel(
                u.address, secret=secret, timeout=timeout, name=f"storage unit {u.unit_id}", replies=messages.UNIT_REPLY_DECODERS
            )


class ServiceAdmin:
    """Stats and shutdown of the TQ service at ``address`` (``secret``: the service's, if it has one)."""

    def __init__(self, address: str, *, secret: str | None = None, timeout: float = 10.0) -> None:
        self.address, self.timeout = address, timeout
        self._secret = secret.encode() if secret else None
        self._ctrl = RpcChannel(
            address, secret=self._secret, timeout=timeout, name="controller", replies=messages.CONTROLLER_REPLY_DECODERS
        )
        self._unit_chans: dict[int, RpcChannel] = {}

    def stats(self) -> dict[str, Any]:
        """As :meth:`tq.TQClient.stats`: the controller's stats plus every storage unit's."""
        reply: messages.StatsReply = self._ctrl.call(ControllerOp.STATS, messages.Stats())[0]
        connect_units(self._unit_chans, reply.units, self._secret, self.timeout)
        return service_stats(reply, self._unit_chans, self.timeout)

    def shutdown_service(self) -> None:
        """Stop the controller and its storage units."""
        self._ctrl.call(ControllerOp.SHUTDOWN, messages.Shutdown())

    def close(self) -> None:
        for chan in [self._ctrl, *self._unit_chans.values()]:
            chan.close()
        self._unit_chans.clear()

    def __enter__(self) -> ServiceAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
