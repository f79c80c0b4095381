"""Math environment: 1/0 rewards from verifying the final answer with ``math-verify``.

The answer is extracted from the last assistant message (``\\boxed{...}`` first, then LaTeX, then a
plain expression - math-verify's default extraction) and compared to ``metadata[i]["ground_truth"]``
symbolically and numerically. Junk never raises: an empty, unparseable or wrong answer, a missing
ground truth, a verifier exception or a verifier timeout all score 0.

Every verification is bounded, wherever it runs. math-verify's timeouts use ``signal.alarm``, which
only works in a process's main thread - where Ray runs a (non-async) actor's methods, and where
in-process use (``num_workers=0``) verifies directly. Called from any other thread (an async
collector, ``RolloutManager``'s environment steps), verification goes to a persistent child process
that verifies on its main thread, each answer held to a deadline (``verify_math_answers``).

Verification runs on a pool of Ray actors (fractional CPUs) with ``num_workers > 0``: a batch is split
into contiguous chunks, one per actor, and reassembled in order. A whole batch (an actor's chunk) is
bounded by ``batch_timeout_s``: in process the answers left when it is spent score 0; an actor that
overruns it is replaced and its chunk scores 0.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import select
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from rollout.environments.common import ground_truth_of, last_assistant_content, reward_metrics
from rollout.environments.math_verify_core import verify_here
from rollout.interfaces import EnvironmentInterface, EnvironmentReturn, Message

logger = logging.getLogger(__name__)

MATH_TASK_NAME = "math"


def verify_math_answer(
    response: str, ground_truth: str, *, timeout_s: int | None = 5, max_response_chars: int = 10_000
) -> tuple[float, str | None]:
    """``(reward, extracted answer)`` for one response; never raises, and bounded in any thread.

    On the main thread math-verify's own timeouts (``timeout_s`` for each of parsing the ground
    truth, parsing the response and comparing) apply; off it the call goes to a verification child
    process (see ``verify_math_answers``). Only the last ``max_response_chars`` characters are
    parsed: the final answer is at the end, and the regex-based extraction is slow on very long junk.
    """
    return verify_math_answers([(response, ground_truth)], timeout_s=timeout_s, max_response_chars=max_response_chars)[0]


def verify_math_answers(
    pairs: Sequence[tuple[Any, Any]], *, timeout_s: int | None = 5, max_response_chars: int = 10_000, budget_s: float | None = None
) -> list[tuple[float, str | None]]:
    """``verify_math_answer`` of each ``(response, ground_truth)`` pair (a None ground truth scores 0).

    math-verify bounds a verification with ``signal.alarm``, which only works on a process's main
    thread; without it one pathological answer (``9^{9^{9^{9}}}``) holds the GIL for minutes. So:
    on the main thread the pairs are verified here; off it (a rollout thread, an async collector)
    they go to a persistent child process that verifies on its main thread, with math-verify's
    timeouts, and the caller holds each answer to a deadline of its own (a child that misses it is
    killed and replaced, the answer scores 0). ``budget_s`` bounds the whole batch: once spent, the
    answers not yet verified score 0 (with a warning), so a batch of hostile answers costs at most
    about ``budget_s``, not ``timeout_s`` each.
    """
    results: list[tuple[float, str | None]] = [(0.0, None)] * len(pairs)
    todo = [
        (k, r[-max_response_chars:], g)
        for k, (r, g) in enumerate(pairs)
        if isinstance(r, str) and isinstance(g, str) and r.strip() and g.strip()
    ]
    if not todo:
        return results
    if threading.current_thread() is threading.main_thread():
        done = _verify_on_main_thread(todo, timeout_s, max_response_chars, budget_s)
    else:
        done = _shared_pool().verify([(r, g) for _, r, g in todo], timeout_s, max_response_chars, budget_s)
    if len(done) < len(todo):
        logger.warning(
            "math verification stopped after %d of %d answers (the batch's budget of %ss was spent, or it was shut down): "
            "the other %d score 0 unverified",
            len(done),
            len(todo),
            budget_s,
            len(todo) - len(done),
        )
    for (k, _, _), scored in zip(todo, done):
        results[k] = scored
    return results


def _verify_on_main_thread(
    todo: Sequence[tuple[int, str, str]], timeout_s: int | None, max_chars: int, budget_s: float | None
) -> list[tuple[float, str | None]]:
    """Verify in this (main) thread, each answer's timeout cut to what is left of the budget."""
    end = None if budget_s is None else time.monotonic() + budget_s
    done = []
    for _, r, g in todo:
        t = timeout_s
        if end is not None:
            left = end - time.monotonic()
            if left <= 0:
                break
            t = max(1, min(t or math.inf, math.ceil(left)))  # signal.alarm counts whole seconds
        done.append(verify_here(r, g, timeout_s=t, max_response_chars=max_chars))
    return done


class _VerifierProcess:
    """One verification child (``math_verify_core.serve``) and the pipes to it."""

    def __init__(self, start_timeout_s: float) -> None:
        import subprocess

        # -P: the script's folder (rollout/environments, with its common.py) must not shadow packages.
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-u", str(Path(__file__).with_name("math_verify_core.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )
        self._buf = b""
        try:
            if self.read_line(time.monotonic() + start_timeout_s) != "ready":
                raise RuntimeError("unexpected first line")
        except Exception as exc:
            self.kill()
            raise RuntimeError(
                f"the math verification process did not start within {start_timeout_s:.0f}s "
                f"(exit code {self.proc.poll()}, {exc}); its stderr is above"
            ) from None

    def send(self, items: list[tuple[str, str]], timeout_s: int | None, max_chars: int) -> None:
        """Send one request (the child answers item by item)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"items": items, "timeout_s": timeout_s, "max_chars": max_chars}) + "\n").encode())

    def read_line(self, deadline: float) -> Any:
        """The next JSON line, or raise ``TimeoutError`` at ``deadline`` / ``EOFError`` if the child died."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("no answer in time")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError(f"exited with code {self.proc.wait()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        """Kill the child and reap it (idempotent)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


class _VerifierPool:
    """Up to ``size`` verification children shared by the threads of a process: a thread takes an idle
    one (or starts one), so one hostile answer holds up only its own child."""

    #: Seconds past math-verify's own three timeouts (ground truth, response, comparison) before the
    #: caller gives up on an answer and kills its child.
    GRACE_S = 5.0
    START_TIMEOUT_S = 60.0

    def __init__(self, size: int) -> None:
        self.pid = os.getpid()
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._idle: list[_VerifierProcess] = []
        self._busy: set[_VerifierProcess] = set()
        self._closed = False

    def verify(
        self, items: list[tuple[str, str]], timeout_s: int | None, max_chars: int, budget_s: float | None
    ) -> list[tuple[float, str | None]]:
        """Score ``items`` in order; fewer results than items when ``budget_s`` ran out first."""
        per_item = math.inf if timeout_s is None else 3 * timeout_s + self.GRACE_S
        with self._slots:
            proc = self._take()
            end = math.inf if budget_s is None else time.monotonic() + budget_s
            done: list[tuple[float, str | None]] = []
            try:
                while len(done) < len(items) and time.monotonic() < end and not self._closed:
                    reused = proc is not None
                    if proc is None:
                        proc = self._start()
                    try:
                        proc.send(items[len(done) :], timeout_s, max_chars)
                    except OSError:
                        self._drop(proc)
                        proc = None
                        if reused:  # an idle child that died meanwhile: the answer was never tried
                            continue
                        raise RuntimeError("the math verification process exited as it started") from None
                    try:
                        while len(done) < len(items):
                            reward, answer = proc.read_line(min(end, time.monotonic() + per_item))
                            done.append((float(reward), answer))
                    except (TimeoutError, EOFError, OSError, ValueError) as exc:
                        if len(done) < len(items) and time.monotonic() < end and not self._closed:
                            logger.warning(
                                "math verification: %s on the answer %r (ground truth %r); it scores 0 and the process is replaced",
                                f"no result within {per_item:.0f}s" if isinstance(exc, TimeoutError) else f"the process failed ({exc})",
                                items[len(done)][0][-80:],
                                items[len(done)][1][:80],
                            )
                            done.append((0.0, None))
                        self._drop(proc)
                        proc = None
            finally:
                if proc is not None:
                    self._give_back(proc)
        return done

    def _take(self) -> _VerifierProcess | None:
        with self._lock:
            proc = self._idle.pop() if self._idle else None
            if proc is not None:
                self._busy.add(proc)
            return proc

    def _start(self) -> _VerifierProcess:
        proc = _VerifierProcess(self.START_TIMEOUT_S)
        with self._lock:
            self._busy.add(proc)
        return proc

    def _give_back(self, proc: _VerifierProcess) -> None:
        with self._lock:
            self._busy.discard(proc)
            if not self._closed:
                self._idle.append(proc)
                return
        proc.kill()

    def _drop(self, proc: _VerifierProcess) -> None:
        with self._lock:
            self._busy.discard(proc)
        proc.kill()

    def num_processes(self) -> int:
        """Children started and not yet reaped (idle or busy)."""
        with self._lock:
            return len(self._idle) + len(self._busy)

    def close(self) -> None:
        """Kill every child (a busy one's caller then scores its remaining answers 0)."""
        with self._lock:
            self._closed = True
            idle, busy, self._idle = self._idle, list(self._busy), []
        for proc in idle:
            proc.kill()
        for proc in busy:  # only signalled: its caller reads EOF and reaps it, closing the pipes it reads
            proc.proc.kill()


_POOL: _VerifierPool | None = None
_POOL_LOCK = threading.Lock()


def _shared_pool() -> _VerifierPool:
    """The process's verification children (started on first use off the main thread, killed at exit)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.pid != os.getpid():  # a forked process must not share its parent's pipes
            _POOL = _VerifierPool(size=max(2, min(4, os.cpu_count() or 1)))
            atexit.register(_POOL.close)
        return _POOL


def shutdown_verifier_processes() -> None:
    """Kill this process's verification children now (they also exit with it); the next verification
    off the main thread starts new ones."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None:
        atexit.unregister(pool.close)
        pool.close()


#: Logical CPUs of one verification actor (``MathEnvironment``'s default; the trainers count it when
#: they size a run against its Ray cluster).
VERIFIER_NUM_CPUS = 0.25


class MathVerifyWorker:
    """Body of one verification actor (``MathEnvironment`` wraps it with ``ray.remote``)."""

    def __init__(self, timeout_s: int | None = 5, max_response_chars: int = 10_000, batch_timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.max_response_chars = max_response_chars
        self.batch_timeout_s = batch_timeout_s
        self.num_verified = 0

    def verify_batch(self, responses: list[str], ground_truths: list[str | None]) -> list[tuple[float, str | None]]:
        """Verify each ``(response, ground_truth)`` pair; a None ground truth scores 0."""
        self.num_verified += len(responses)
        return verify_math_answers(
            list(zip(responses, ground_truths)),
            timeout_s=self.timeout_s,
            max_response_chars=self.max_response_chars,
            budget_s=self.batch_timeout_s,
        )

    def stats(self) -> dict[str, int]:
        """How many samples this worker has verified (for load checks)."""
        return {"num_verified": self.num_verified}


class MathEnvironment(EnvironmentInterface):
    """Single-turn math environment over a pool of ``num_workers`` verification actors.

    ``num_workers=0`` verifies in the calling process (no Ray needed). Each step terminates every
    conversation; ``answers`` holds the extracted answer strings (None when nothing was extracted).
    Call ``shutdown()`` to release the actors.
    """

    def __init__(
        self,
        num_workers: int = 2,
        *,
        num_cpus_per_worker: float = VERIFIER_NUM_CPUS,
        verify_timeout_s: int = 5,
        batch_timeout_s: float = 120.0,
        max_response_chars: int = 10_000,
    ) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.num_cpus_per_worker = num_cpus_per_worker
        self.batch_timeout_s = batch_timeout_s
        self._worker_args = (verify_timeout_s, max_response_chars)
        # In process the batch budget is the worker's own (on Ray, ray.wait enforces it, see verify).
        self._local = MathVerifyWorker(*self._worker_args, batch_timeout_s=batch_timeout_s)
        self.workers: list[Any] = []
        if num_workers:
            import ray

            if not ray.is_initialized():
                raise RuntimeError("MathEnvironment with num_workers > 0 needs a running Ray (ray.init), or use num_workers=0")
            self.workers = [self._new_worker() for _ in range(num_workers)]

    def _new_worker(self) -> Any:
        import ray

        return ray.remote(MathVerifyWorker).options(num_cpus=self.num_cpus_per_worker).remote(*self._worker_args)

    def verify(self, responses: list[str], ground_truths: list[str | None]) -> list[tuple[float, str | None]]:
        """Verify a batch on the pool (contiguous chunks, results in input order)."""
        if not self.workers or not responses:
            return self._local.verify_batch(responses, ground_truths)
        import ray

        n = len(self.workers)
        bounds = [round(i * len(responses) / n) for i in range(n + 1)]
        chunks = [(i, lo, hi) for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])) if hi > lo]
        refs = [self.workers[i].verify_batch.remote(responses[lo:hi], ground_truths[lo:hi]) for i, lo, hi in chunks]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.batch_timeout_s)
        ready_set = set(ready)
        results: list[tuple[float, str | None]] = []
        for ref, (i, lo, hi) in zip(refs, chunks):
            part = None
            if ref in ready_set:
                try:
                    part = ray.get(ref, timeout=0)
                except Exception:  # the actor died (e.g. OOM on a pathological expression)
                    logger.warning("math verification worker %d failed; scoring its %d samples 0", i, hi - lo, exc_info=True)
            else:
                logger.warning("math verification worker %d exceeded %.0fs; scoring its %d samples 0", i, self.batch_timeout_s, hi - lo)
            if part is None:
                ray.kill(self.workers[i])
                self.workers[i] = self._new_worker()
                part = [(0.0, None)] * (hi - lo)
            results += part
        return results

    def step(self, message_log_batch: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        """Score the last assistant turn of each conversation; every conversation terminates."""
        if len(message_log_batch) != len(metadata):
            raise ValueError(f"{len(message_log_batch)} conversations but {len(metadata)} metadata entries")
        responses = [last_assistant_content(log) for log in message_log_batch]
        truths = [ground_truth_of(m) for m in metadata]
        scored = self.verify(responses, truths)
        rewards = torch.tensor([r for r, _ in scored], dtype=torch.float32)
        return EnvironmentReturn(
            observations=[
                {"role": "environment", "content": "Environment: correct" if r == 1.0 else "Environment: incorrect"} for r, _ in scored
            ],
            metadata=[dict(m) if isinstance(m, Mapping) else {} for m in metadata],
            next_stop_strings=[None] * len(scored),
            rewards=rewards,
            terminateds=torch.ones(len(scored), dtype=torch.bool),
            answers=[a for _, a in scored],
        )

    def global_post_process_and_metrics(self, batch: Mapping[str, Any]) -> tuple[Mapping[str, Any], dict[str, float]]:
        """Zero the rewards of responses that did not end properly; report accuracy (see ``reward_metrics``)."""
        return reward_metrics(batch)

    def shutdown(self) -> None:
        """Kill the verification actors and this process's verification children (idempotent)."""
        shutdown_verifier_processes()
        if self.workers:
            import ray

            for w in self.workers:
                try:
                    ray.kill(w)
                except Exception:  # already gone
                    pass
        self.workers = []
