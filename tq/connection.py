"""``TQConnection``: how a process reaches the data plane, as one frozen, picklable value.

The driver builds one from its configuration (the trainers: ``DataPlaneConfig.connection``) and hands
the same value to every actor and worker at start-up; each process opens its own client with
:meth:`TQConnection.connect`, the one place a :class:`~tq.client.TQClient` is built from settings.
So the address, the secret, the timeouts and the transport are decided once, on the driver, and a
worker never reads them from its own environment (a Ray worker's may differ from the driver's)::

    conn = TQConnection("tcp://10.0.0.5:5555", secret="s3cret", timeout_s=60.0)
    actor = MyActor.remote(conn)          # pickles: sockets are opened where it is used
    with conn.connect() as client:        # in the actor
        client.list_partitions()

Pure value: no sockets, no torch, no imports of the client until :meth:`connect`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .argtypes import address_value, optional_text
from .errors import InvalidRequestError

if TYPE_CHECKING:
    from .client import TQClient

__all__ = ["TQConnection"]

TRANSPORTS = ("auto", "tcp")


@dataclass(frozen=True)
class TQConnection:
    """Where the TQ service is and how to talk to it.

    Args:
        address: the controller's address, e.g. ``tcp://127.0.0.1:5555``.
        secret: the service's shared secret. ``None`` takes ``$TQ_SECRET`` of the process that builds
            the value (the driver), once: the value then carries it to every worker (``""``: none).
        timeout_s: seconds one client call may take (see :class:`~tq.client.TQClient`), and the
            default bound on waits for fields to be produced.
        transport: ``"auto"`` maps same-host storage arenas; ``"tcp"`` always streams bytes.
        capacity_wait_s: how long a write waits for room in a full storage unit (0: fail at once).
    """

    address: str
    secret: str | None = field(default=None, repr=False)  # never printed: reprs end up in logs; "" = none
    timeout_s: float = 60.0
    transport: Literal["auto", "tcp"] = "auto"
    capacity_wait_s: float = 0.0

    def __post_init__(self) -> None:
        try:
            address_value(self.address)
        except InvalidRequestError as exc:  # a port-0 or port-less one was accepted here, refused at connect
            raise InvalidRequestError(f"TQConnection.{exc}") from None
        for name in ("timeout_s", "capacity_wait_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
                or (name == "timeout_s" and value == 0)
            ):
                bound = "> 0" if name == "timeout_s" else ">= 0"
                raise InvalidRequestError(f"TQConnection.{name} must be a finite number {bound}, got {value!r}")
        if self.transport not in TRANSPORTS:
            raise InvalidRequestError(f"TQConnection.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.secret is None:
            # Resolved here, once, in the building process ("" = none, so that neither unpickling nor
            # replace() in another process looks at that process's environment again).
            object.__setattr__(self, "secret", os.environ.get("TQ_SECRET", ""))
        else:
            optional_text("TQConnection.secret", self.secret)

    def connect(self) -> "TQClient":
        """A new client on this connection (the caller closes it; it is thread-safe and long-lived)."""
        from .client import TQClient

        # never None: the client must not fall back to this process's own $TQ_SECRET
        return TQClient(
            self.address, secret=self.secret, timeout=self.timeout_s, transport=self.transport, capacity_wait_s=self.capacity_wait_s
        )

    def replace(self, **changes: Any) -> "TQConnection":
        """A copy with some settings changed (e.g. a short ``timeout_s`` for a liveness probe)."""
        return dataclasses.replace(self, **changes)
