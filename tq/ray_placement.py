"""Multi-node placement of TQ storage units with Ray: one unit per node, next to the data's producers.

The controller runs anywhere (started with ``storage_units=0``, e.g. ``TQServer(storage_units=0)`` or
``tq-controller start --storage-units 0``); :func:`start_storage_units_on_ray_nodes` then pins one small
Ray actor to every alive node. Each actor starts a ``python -m tq.storage`` process bound to the
node's IP, and the unit registers itself with the controller. A process rather than a thread in the
actor: the unit gets its own interpreter (no GIL shared with the actor), and it shuts down gracefully,
removing its shared-memory arena, whichever way the actor ends (see :class:`_StorageUnitHost`).

Ray is imported inside the functions only: ``tq`` itself never needs Ray.

Clients: create :class:`~tq.TQClient` objects *after* this function returned. A client learns the
unit list from the controller when it connects; one created while no unit was registered yet has an
empty list and cannot put (it refreshes the list only when a ``get`` sees a newer one).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from typing import Any, Sequence

from . import launch
from .errors import AuthenticationError, TQConnectionError
from .server import _is_loopback
from .stream_transport import endpoint_host

DEFAULT_START_TIMEOUT_S = 60.0


class _StorageUnitHost:
    """The Ray actor body: owns one storage-unit process on its node.

    The unit is started *detached* (double fork through ``sh``, new session) rather than as a plain
    child: when an actor dies, Ray SIGKILLs the worker's child processes, which would leave the unit's
    shared-memory arena behind in ``/dev/shm`` (pages that stay allocated until reboot). Its lifetime
    is tied to the actor instead by a pipe: the unit watches the read end (``--watch-fd``) and stops
    gracefully, unlinking its arena, as soon as the actor's write end closes - on :meth:`stop`, on
    ``ray.kill``, on a crash or when the driver exits.
    """

    def __init__(self) -> None:
        self.pid: int | None = None
        self.info: dict[str, Any] | None = None
        self._watch_w: int | None = None

    def start(
        self, controller_address: str, unit_index: int, capacity: int, shm_dir: str, secret: str | None, timeout: float
    ) -> dict[str, Any]:
        """Start the unit on this node's IP (port 0) and wait until it registered; returns its description."""
        import ray

        ip = ray.util.get_node_ip_address()
        if not secret and not _is_loopback(ip):
            raise AuthenticationError(f"refusing to start a storage unit on {ip} without an auth secret: pass secret= (or set TQ_SECRET)")
        ready = launch.new_ready_file("tq-unit-ready-")
        watch_r, self._watch_w = os.pipe()  # both close-on-exec; only watch_r is passed on, explicitly
        cmd = launch.storage_unit_command(
            unit_id=unit_index,
            bind=f"tcp://{ip}:0",
            controller=controller_address,
            capacity=capacity,
            shm_dir=shm_dir,
            ready_file=ready,
            watch_fd=watch_r,
        )
        try:
            # The unit's output goes to the actor's stderr (Ray's worker log); sh prints the unit's pid.
            sh = subprocess.run(
                ["/bin/sh", "-c", f"{shlex.join(cmd)} 1>&2 & echo $!"],
                env=launch.service_env(secret),
                pass_fds=(watch_r,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                start_new_session=True,
                timeout=30,
                check=True,
                text=True,
            )
        finally:
            os.close(watch_r)
        self.pid = int(sh.stdout.split()[-1])
        try:
            info = launch.await_ready_file(
                ready, alive=self.alive, timeout=timeout, what=f"storage unit on {ip} (registering with {controller_address})"
            )
        except TQConnectionError as exc:
            self.stop()
            raise TQConnectionError(f"{exc}; its error is in this actor's Ray worker log") from None
        self.info = {**info, "node_ip": ip, "node_id": ray.get_runtime_context().get_node_id()}
        return self.info

    def describe(self) -> dict[str, Any] | None:
        """The unit's registration info (None before :meth:`start`)."""
        return self.info

    def alive(self) -> bool:
        """Whether the unit process still runs."""
        return launch.pid_running(self.pid)

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the unit (it frees its arena); SIGKILL after ``timeout``. Returns whether it exited."""
        if self._watch_w is not None:
            os.close(self._watch_w)  # EOF on the unit's watch pipe: it stops serving and cleans up
            self._watch_w = None
        if self.pid is None or launch.wait_pid_exit(self.pid, timeout):
            return True
        os.kill(self.pid, signal.SIGKILL)
        return False


def _alive_node_ids(nodes: Sequence[Any] | None) -> list[tuple[str, str]]:
    """(node id, node IP) of the requested nodes (default: every alive node)."""
    import ray

    alive = {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes() if n.get("Alive")}
    if nodes is None:
        return sorted(alive.items(), key=lambda kv: kv[1])
    out = []
    for n in nodes:
        node_id = n["NodeID"] if isinstance(n, dict) else str(n)
        if node_id not in alive:
            raise ValueError(f"Ray node {node_id} is not alive (alive nodes: {sorted(alive)})")
        out.append((node_id, alive[node_id]))
    return out


def start_storage_units_on_ray_nodes(
    controller_address: str,
    *,
    capacity_per_unit: int,
    shm_dir: str = "/dev/shm",
    secret: str | None = None,
    nodes: Sequence[Any] | None = None,
    timeout: float = DEFAULT_START_TIMEOUT_S,
) -> list[Any]:
    """Start one storage unit per Ray node and return once every unit registered with the controller.

    Args:
        controller_address: the controller's address; it must be reachable from every node (bind it
            to a non-loopback address, with a secret, for a multi-node cluster).
        capacity_per_unit: arena bytes of each unit.
        shm_dir: the tmpfs directory holding each unit's arena on its node.
        secret: the service's shared secret (default ``$TQ_SECRET``); required whenever a node's IP
            is not a loopback address, because the unit binds that IP.
        nodes: Ray node ids (hex strings or ``ray.nodes()`` entries); default every alive node.
        timeout: seconds to wait for all units to register.

    Returns:
        The actor handles (``ray.actor.ActorHandle``), one per node; pass them to
        :func:`stop_storage_units`. ``ray.get(handle.describe.remote())`` gives a unit's registration.

    The actors reserve no CPU (``num_cpus=0``), so they are placed even on a fully busy cluster, and
    are pinned with a hard ``NodeAffinitySchedulingStrategy``. Ray must already be initialised.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        raise RuntimeError("start_storage_units_on_ray_nodes needs ray.init() first")
    if capacity_per_unit <= 0:
        raise ValueError(f"capacity_per_unit must be positive, got {capacity_per_unit}")
    secret = secret if secret is not None else os.environ.get("TQ_SECRET") or None
    targets = _alive_node_ids(nodes)
    if not targets:
        raise RuntimeError("no alive Ray node to place storage units on")
    # Check every node before starting any unit, so a missing secret never leaves half the units up.
    exposed = [ip for _, ip in targets if ip and not _is_loopback(ip)]
    if exposed and not secret:
        raise AuthenticationError(
            f"storage units would bind non-loopback node IPs {exposed} without an auth secret: "
            "pass secret= (or set TQ_SECRET) and start the controller with the same secret"
        )

    ctrl_host = endpoint_host(controller_address)
    here = ray.util.get_node_ip_address()
    remote = sorted({ip for _, ip in targets if ip and ip != here})
    if _is_loopback(ctrl_host) and remote:
        raise ValueError(
            f"the controller at {controller_address} listens on loopback, which nodes {remote} cannot reach: "
            "start it on a routable address (with a secret)"
        )

    actor_cls = ray.remote(num_cpus=0, max_restarts=0)(_StorageUnitHost)
    handles = [
        actor_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote() for node_id, _ in targets
    ]
    refs = [h.start.remote(controller_address, i, int(capacity_per_unit), shm_dir, secret, timeout) for i, h in enumerate(handles)]
    try:
        # Bounded: the actors' own wait is ``timeout``; allow time for the actor processes to start.
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout + 60.0)
        if pending:
            raise TQConnectionError(f"{len(pending)} of {len(refs)} storage units did not start within {timeout + 60.0:.0f}s")
        ray.get(ready)
    except BaseException:
        stop_storage_units(handles)
        raise
    return handles


def stop_storage_units(handles: Sequence[Any], timeout: float = 15.0) -> None:
    """Stop the units gracefully (each frees its arena) and kill their actors. Bounded by ``timeout``.

    Units left registered with a running controller are then unreachable: stop them after the
    controller's users finished (or shut the controller down, which also stops its units).
    """
    import ray

    if not handles:
        return
    refs = [h.stop.remote() for h in handles]
    ray.wait(refs, num_returns=len(refs), timeout=timeout)
    for h in handles:
        try:
            ray.kill(h)
        except Exception:  # already dead: nothing left to stop
            pass
