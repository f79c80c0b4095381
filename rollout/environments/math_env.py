"""Math environment: 1/0 rewards from verifying the final answer with ``math-verify``.

The answer is extracted from the last assistant message (``\\boxed{...}`` first, then LaTeX, then a
plain expression - math-verify's default extraction) and compared to ``metadata[i]["ground_truth"]``
symbolically and numerically. Junk never raises: an empty, unparseable or wrong answer, a missing
ground truth, a verifier exception or a verifier timeout all score 0.

Verification runs on a pool of Ray actors (fractional CPUs): a batch is split into contiguous chunks,
one per actor, and reassembled in order. math-verify's timeouts use ``signal.alarm``, which only
works in a process's main thread - where Ray runs a (non-async) actor's methods. In-process use
(``num_workers=0``) keeps the timeouts only when called from the main thread; elsewhere it verifies
without them. A whole chunk is bounded by ``batch_timeout_s``: an actor that overruns it is replaced
and its chunk scores 0.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Mapping

import torch

from rollout.environments.common import ground_truth_of, last_assistant_content, reward_metrics
from rollout.interfaces import EnvironmentInterface, EnvironmentReturn, Message

logger = logging.getLogger(__name__)

MATH_TASK_NAME = "math"


def verify_math_answer(
    response: str, ground_truth: str, *, timeout_s: int | None = 5, max_response_chars: int = 10_000
) -> tuple[float, str | None]:
    """``(reward, extracted answer)`` for one response; never raises.

    Only the last ``max_response_chars`` characters are parsed: the final answer is at the end, and
    the regex-based extraction is slow on very long junk.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException  # a BaseException, so caught explicitly

    if not isinstance(response, str) or not isinstance(ground_truth, str) or not response.strip() or not ground_truth.strip():
        return 0.0, None
    if threading.current_thread() is not threading.main_thread():
        timeout_s = None  # signal.alarm is main-thread only; math-verify raises otherwise
    try:
        gold = parse("\\boxed{" + ground_truth + "}", extraction_config=[LatexExtractionConfig()], parsing_timeout=timeout_s)
        if not gold:  # not LaTeX: read it as a plain expression ("0.5", "x+1")
            gold = parse(ground_truth, extraction_config=[ExprExtractionConfig()], parsing_timeout=timeout_s)
        if not gold:
            logger.warning("ground truth %r cannot be parsed; scoring 0", ground_truth[:80])
            return 0.0, None
        pred = parse(response[-max_response_chars:], parsing_timeout=timeout_s)
        if not pred:
            return 0.0, None
        answer = str(pred[-1]) if isinstance(pred[-1], str) else str(pred[0])
        return (1.0 if verify(gold, pred, timeout_seconds=timeout_s) else 0.0), answer
    except (Exception, TimeoutException):  # a verifier failure is the response's loss, not the run's
        logger.debug("math verification failed", exc_info=True)
        return 0.0, None


class MathVerifyWorker:
    """Body of one verification actor (``MathEnvironment`` wraps it with ``ray.remote``)."""

    def __init__(self, timeout_s: int | None = 5, max_response_chars: int = 10_000) -> None:
        self.timeout_s = timeout_s
        self.max_response_chars = max_response_chars
        self.num_verified = 0

    def verify_batch(self, responses: list[str], ground_truths: list[str | None]) -> list[tuple[float, str | None]]:
        """Verify each ``(response, ground_truth)`` pair; a None ground truth scores 0."""
        self.num_verified += len(responses)
        return [
            verify_math_answer(r, g, timeout_s=self.timeout_s, max_response_chars=self.max_response_chars) if g is not None else (0.0, None)
            for r, g in zip(responses, ground_truths)
        ]

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
        num_cpus_per_worker: float = 0.25,
        verify_timeout_s: int = 5,
        batch_timeout_s: float = 120.0,
        max_response_chars: int = 10_000,
    ) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.num_cpus_per_worker = num_cpus_per_worker
        self.batch_timeout_s = batch_timeout_s
        self._worker_args = (verify_timeout_s, max_response_chars)
        self._local = MathVerifyWorker(*self._worker_args)
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
        """Kill the verification actors (idempotent)."""
        if self.workers:
            import ray

            for w in self.workers:
                try:
                    ray.kill(w)
                except Exception:  # already gone
                    pass
        self.workers = []
