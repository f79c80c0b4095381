"""Argument types shared by TQ's command lines (``tq-controller``, ``python -m tq.controller``/``tq.storage``).

Each is an ``argparse`` ``type=`` function: a bad value is refused at parse time with one line naming
what is wrong (``argparse`` prints it with the usage and exits 2), never passed on to fail later or -
as a port of 99999 did - to be silently taken modulo 65536.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import Any

from .errors import InvalidRequestError

_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid {what} {text!r}: expected a whole number") from None


def port(text: str) -> int:
    """A TCP port, 0..65535 (0: the OS picks a free one)."""
    value = _int(text, "port")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535 (0 picks a free one), got {value}")
    return value


def count(text: str) -> int:
    """A whole number >= 0 (e.g. a number of storage units, an id)."""
    value = _int(text, "count")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def directory(text: str) -> str:
    """A directory to keep files in: one that exists, or a path where one can be made (an existing
    file there was refused only deep in the start, as '--stream-port 0: File exists')."""
    if not text:
        raise argparse.ArgumentTypeError("must name a directory, got ''")
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    return text


def _seconds(text: str, *, zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds {'>=' if zero else '>'} 0, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    return _seconds(text, zero=False)


def seconds(text: str) -> float:
    """A finite number of seconds >= 0."""
    return _seconds(text, zero=True)


def size(text: str) -> int:
    """A byte count > 0 such as ``4294967296``, ``4G``, ``512M``, ``1.5GiB`` or ``64k`` (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected a number with an optional K/M/G/T suffix")
    value = int(float(m.group(1)) * _SUFFIXES[m.group(2).upper()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def deprecated_alias(new: str) -> type[argparse.Action]:
    """An ``argparse`` action for an old option spelling: stores like ``new`` and says it is deprecated."""

    class _Alias(argparse.Action):
        def __call__(
            self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None
        ) -> None:
            print(f"{parser.prog}: {option_string} is deprecated, use {new}", file=sys.stderr, flush=True)
            setattr(namespace, self.dest, values)

    return _Alias


def optional_text(name: str, value: Any) -> str | None:
    """``value`` if it is a str or None; else InvalidRequestError naming ``name`` (a secret or host of
    another type failed far from where it was passed: ``.encode`` or a subscript)."""
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(f"{name} must be a string, got {type(value).__name__}")
    return value


_ADDRESS = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]*]+):(\d{1,5})")  # host or [IPv6]:port


def address_value(address: Any) -> str:
    """``address`` if it is a controller's address, ``tcp://HOST:PORT``; else InvalidRequestError
    naming it (ZMQ took a malformed one for a server that never answers, or raised its own error)."""
    m = _ADDRESS.fullmatch(address) if isinstance(address, str) else None
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        raise InvalidRequestError(f"address must be a controller's 'tcp://HOST:PORT' (port 1..65535), got {address!r}")
    return address


def address(text: str) -> str:
    """A controller's address on a command line (see :func:`address_value`)."""
    try:
        return address_value(text)
    except InvalidRequestError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


MAX_LOCAL_UNITS = 256  # storage units one controller starts on its host: each is a process
MIN_UNIT_BYTES = 1 << 20  # the smallest arena a storage unit is started with


def unit_capacity(storage_units: int, capacity: int) -> int:
    """Each local storage unit's arena when ``capacity`` bytes are split over ``storage_units``, or
    InvalidRequestError naming both settings: ``--storage-units 1000000 --capacity 1M`` started a
    million processes of one byte each."""
    if storage_units > MAX_LOCAL_UNITS:
        raise InvalidRequestError(
            f"--storage-units {storage_units}: one controller starts at most {MAX_LOCAL_UNITS} storage units on its host "
            "(each is a process); run more units on other hosts (python -m tq.storage --controller ...)"
        )
    per_unit = capacity // max(storage_units, 1)
    if storage_units and per_unit < MIN_UNIT_BYTES:
        raise InvalidRequestError(
            f"--capacity {capacity} over --storage-units {storage_units} gives each unit {per_unit} bytes; "
            f"a unit needs at least {MIN_UNIT_BYTES} (1 MiB): raise --capacity or start fewer units"
        )
    return per_unit


def seconds_value(name: str, value: Any, most: float, *, zero: bool = True) -> float:
    """A number of seconds passed in Python (a client's timeout, a server's start timeout), or
    InvalidRequestError (a ValueError) naming ``name``: finite, at most ``most``, at least 0 (above 0
    without ``zero``) - an infinite or NaN time would fail later inside the transport, with an error
    that names none of it."""
    try:
        if isinstance(value, bool):  # float(True) is 1.0: a flag passed where a time belongs
            raise TypeError
        seconds = float(value)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"{name} must be a number of seconds, got {value!r}") from None
    if not (0.0 <= seconds <= most and (zero or seconds > 0.0)):  # NaN fails every comparison
        raise InvalidRequestError(f"{name} must be in {'[' if zero else '('}0, {most:g}] seconds, got {value!r}")
    return seconds
