"""Scoring one answer with ``math-verify``, and the loop of a verification child process.

Kept free of torch and of the rest of the project: ``math_env`` runs this file as a script
(``python -P math_verify_core.py``) for verification off the main thread, and a child that imports
only math-verify starts in about a second.

The child's protocol, JSON lines: it writes ``"ready"`` once warmed up; each request line
``{"items": [[response, ground_truth | null], ...], "timeout_s": int | null, "max_chars": int}``
gets one ``[reward, answer | null]`` line per item, in order, each written as soon as it is scored
(so the parent can hold each item to its own deadline). The child exits at end of input.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)


def verify_here(
    response: str, ground_truth: str, *, timeout_s: int | None = 5, max_response_chars: int = 10_000
) -> tuple[float, str | None]:
    """``(reward, extracted answer)`` for one response, verified in this thread; never raises.

    math-verify's timeouts use ``signal.alarm``, so they only apply on the main thread; elsewhere
    this verifies without them (``math_env.verify_math_answer`` sends such calls to a child process).
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


def serve() -> None:
    """The child's loop (see the module docstring); verifies on its main thread, so with timeouts."""
    import json
    import os
    import sys

    # The protocol gets a private copy of stdout; fd 1 then points at stderr, so a library that
    # prints cannot corrupt the protocol stream.
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    verify_here("\\boxed{1}", "1")  # import math-verify and build its parsers before saying ready
    try:
        proto.write('"ready"\n')
        proto.flush()
        for line in sys.stdin:
            req = json.loads(line)
            for response, truth in req["items"]:
                scored = (
                    (0.0, None)
                    if truth is None
                    else verify_here(response, truth, timeout_s=req["timeout_s"], max_response_chars=req["max_chars"])
                )
                proto.write(json.dumps(scored) + "\n")
                proto.flush()
    except (BrokenPipeError, KeyboardInterrupt):  # the parent is gone (or killed us): nothing to report to
        pass


if __name__ == "__main__":
    serve()
