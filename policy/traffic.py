"""How the driver calls actors (:class:`ActorCalls`), and the opt-in instrumentation that counts it
(:class:`DriverTraffic`).

The policies and trainers send every actor call and wait for every result through one
:class:`ActorCalls`. By default it only does that. :class:`DriverTraffic` wraps the same calls with
measurements for benchmarks and the driver-traffic tests (trainers: ``logger.data_movement_metrics``):
the pickled bytes of every argument sent and result fetched (it re-pickles them to count, which costs
driver time), the seconds spent sending, fetching and in the driver's own TQ calls, and a ``sent_at``
stamp on every DP worker call so that each rank can time its shard's arrival. None of that runs unless
asked for, as NeMo-RL wraps its data-plane client in a metrics client only when observability is on.

Always on, because it is cheap (a ``perf_counter`` pair per TQ call and the ``nbytes`` of the tensors
passed, no pickling): the driver's seconds in its own TQ calls and the tensor bytes they write and
read (:meth:`ActorCalls.pop_dataplane`), which the TQ trainers log as ``dataplane/*`` every step.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import time
from collections import defaultdict
from typing import Any, Iterator

import numpy as np
import torch

from common.fields import tensor_nbytes

__all__ = ["ActorCalls", "DriverTraffic", "payload_nbytes"]


def _tensor_stub(shape: tuple[int, ...], dtype: str) -> None:  # pragma: no cover - never unpickled
    """Stands in for a tensor in :func:`payload_nbytes`' pickle stream (its bytes are counted apart)."""


class _ByteCounter(io.RawIOBase):
    def __init__(self) -> None:
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        size = memoryview(b).nbytes
        self.n += size
        return size


class _SizingPickler(pickle.Pickler):
    """Pickles to a byte counter; tensors and arrays are counted by their storage, not copied."""

    def __init__(self, sink: _ByteCounter) -> None:
        super().__init__(sink, protocol=5)
        self.data_bytes = 0

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            # What torch pickles: the whole storage (a view ships its base), not just the view.
            self.data_bytes += obj.untyped_storage().nbytes()
            return _tensor_stub, (tuple(obj.shape), str(obj.dtype))
        if isinstance(obj, np.ndarray):
            self.data_bytes += obj.nbytes
            return _tensor_stub, (obj.shape, str(obj.dtype))
        return NotImplemented


def payload_nbytes(obj: Any) -> int:
    """Bytes ``obj`` takes pickled (what Ray moves for a call's arguments or result).

    The pickle stream is produced and counted without being kept; each tensor counts its storage's
    bytes (torch pickles the whole storage, so a view counts its base) and each array its buffer,
    without copying them. Objects plain pickle refuses fall back to Ray's cloudpickle.
    """
    sink = _ByteCounter()
    pickler = _SizingPickler(sink)
    try:
        pickler.dump(obj)
    except Exception:  # e.g. a lambda or a locally defined class: what Ray would use
        import ray.cloudpickle

        return len(ray.cloudpickle.dumps(obj))
    return sink.n + pickler.data_bytes


class ActorCalls:
    """Sends actor calls and fetches their results, bounded, naming an actor's death; counts only the
    driver's own TQ calls, cheaply (:meth:`pop_dataplane`)."""

    _dataplane: dict[str, float] | None = None

    def _dp(self) -> dict[str, float]:
        if self._dataplane is None:
            self._dataplane = defaultdict(float)
        return self._dataplane

    def send(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """``method.remote(*args, **kwargs)`` (an actor method)."""
        return method.remote(*args, **kwargs)

    def send_to_worker(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """:meth:`send` for a DP worker's data-carrying method (it accepts a ``sent_at`` stamp)."""
        return self.send(method, *args, **kwargs)

    @staticmethod
    def _wait(refs: Any, timeout: float) -> None:
        """Return once every ref is finished, without fetching (``GetTimeoutError`` after ``timeout``)."""
        import ray
        from ray.exceptions import GetTimeoutError

        waited = refs if isinstance(refs, list) else [refs]
        _, pending = ray.wait(waited, num_returns=len(waited), timeout=timeout, fetch_local=False)
        if pending:
            raise GetTimeoutError()

    @staticmethod
    def _fetch(refs: Any, timeout: float) -> Any:
        import ray

        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.RayError:
            # When an actor dies its peers fail too (a rank blocked in a collective with it sees the
            # connection close), and ray.get raises whichever failed ref comes first: name the death.
            for ref in refs if isinstance(refs, list) else [refs]:
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayActorError:
                    raise
                except Exception:  # noqa: BLE001 - a symptom; the first error is raised below
                    pass
            raise

    def get(self, refs: Any, timeout: float, *, count: bool = True) -> Any:
        """``ray.get`` of ``refs`` once all are finished (``ray.exceptions.GetTimeoutError`` after
        ``timeout`` s); an actor's death is raised in preference to its peers' failures. ``count``
        matters to :class:`DriverTraffic` only."""
        self._wait(refs, timeout)
        return self._fetch(refs, timeout)

    @contextlib.contextmanager
    def driver_tq(self, sent: Any = None) -> Iterator[None]:
        """Wraps one of the driver's own TQ calls (sending ``sent``): its seconds and the tensor bytes
        of ``sent`` go to :meth:`pop_dataplane`."""
        dp = self._dp()
        dp["bytes_written"] += tensor_nbytes(sent)
        t = time.perf_counter()
        try:
            yield
        finally:
            dp["seconds"] += time.perf_counter() - t

    def received(self, obj: Any) -> None:
        """The driver received ``obj`` from a TQ read: its tensor bytes go to :meth:`pop_dataplane`."""
        self._dp()["bytes_read"] += tensor_nbytes(obj)

    def pop_dataplane(self) -> dict[str, float]:
        """The driver's TQ calls since the last pop, then reset: ``seconds`` in them, ``bytes_written``
        and ``bytes_read`` (tensor bytes; keys, tags and metas not counted)."""
        out = {k: float(self._dp().get(k, 0.0)) for k in ("seconds", "bytes_written", "bytes_read")}
        self._dataplane = None
        return out

    @property
    def instrumented(self) -> bool:
        """Whether :meth:`pop` reports anything."""
        return False

    def pop(self) -> dict[str, float]:
        """Counters since the last pop (none here)."""
        return {}


class DriverTraffic(ActorCalls):
    """:class:`ActorCalls` measured: the pickled bytes of the arguments the driver sends and of the
    results it fetches, and the seconds it spends sending calls, fetching finished results and in its
    own TQ calls (``timing``); DP worker calls carry ``sent_at``. Opt-in: counting re-pickles every
    call's payload. A trainer and its policy each keep one; the trainer pops both per step."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0
        self.timing: dict[str, float] = defaultdict(float)

    def send(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """``method.remote(*args, **kwargs)``, counting the arguments' bytes and the time the call takes
        to leave the driver (serialization) as ``driver_send_s``."""
        self.bytes_sent += payload_nbytes((args, kwargs))
        t = time.perf_counter()
        ref = method.remote(*args, **kwargs)
        self.timing["driver_send_s"] += time.perf_counter() - t
        return ref

    def send_to_worker(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """:meth:`send` with ``sent_at=time.time()``: the worker times its shard's arrival (``dispatch_s``)."""
        return self.send(method, *args, sent_at=time.time(), **kwargs)

    def get(self, refs: Any, timeout: float, *, count: bool = True) -> Any:
        """:meth:`ActorCalls.get`; the wait fetches nothing, so ``driver_get_s`` is the time to bring the
        results to the driver, not the remote work. With ``count`` their pickled size adds to
        ``bytes_received``."""
        self._wait(refs, timeout)
        t = time.perf_counter()
        out = self._fetch(refs, timeout)
        self.timing["driver_get_s"] += time.perf_counter() - t
        if count:
            self.bytes_received += payload_nbytes(out)
        return out

    @contextlib.contextmanager
    def driver_tq(self, sent: Any = None) -> Iterator[None]:
        """Times a driver TQ call into ``timing["driver_tq_s"]``, counting ``sent``'s bytes as sent."""
        if sent is not None:
            self.bytes_sent += payload_nbytes(sent)
        t = time.perf_counter()
        try:
            with super().driver_tq(sent):
                yield
        finally:
            self.timing["driver_tq_s"] += time.perf_counter() - t

    def received(self, obj: Any) -> None:
        super().received(obj)
        self.bytes_received += payload_nbytes(obj)

    @property
    def instrumented(self) -> bool:
        return True

    def pop(self) -> dict[str, float]:
        """``bytes_sent``, ``bytes_received`` and the ``timing`` seconds since the last pop, then reset."""
        out = {"bytes_sent": float(self.bytes_sent), "bytes_received": float(self.bytes_received), **self.timing}
        self._reset()
        return out
