"""Column kinds and dtypes: the vocabulary shared by client, controller and storage units (no torch)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidRequestError

# dtype name -> (itemsize, numpy dtype used to move/fill the raw bytes). bfloat16 has no numpy dtype,
# so its bits travel as uint16; nothing on the server ever interprets values.
DTYPES: dict[str, tuple[int, np.dtype]] = {
    "float32": (4, np.dtype("float32")),
    "float16": (2, np.dtype("float16")),
    "bfloat16": (2, np.dtype("uint16")),
    "float64": (8, np.dtype("float64")),
    "int64": (8, np.dtype("int64")),
    "int32": (4, np.dtype("int32")),
    "int16": (2, np.dtype("int16")),
    "int8": (1, np.dtype("int8")),
    "uint8": (1, np.dtype("uint8")),
    "bool": (1, np.dtype("bool")),
}

TENSOR = "tensor"  # fixed per-sample shape (scalars included: shape ())
JAGGED = "jagged"  # per-sample leading dim varies (token-aligned), trailing dims fixed
OBJECT = "object"  # per-sample msgpack-able Python value (strings, message logs, ...)
KINDS = (TENSOR, JAGGED, OBJECT)

MAX_NDIM = 8


@dataclass(frozen=True)
class FieldSchema:
    """What a field's column holds: its kind, dtype and the per-sample shape after the jagged dim.

    For ``TENSOR`` fields ``shape`` is the whole per-sample shape; for ``JAGGED`` fields it is the
    trailing shape after the variable leading dim; ``OBJECT`` fields have dtype "object" and no shape.
    """

    kind: str
    dtype: str
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"unknown column kind {self.kind!r}; expected one of {KINDS}")
        if self.kind == OBJECT:
            if self.dtype != "object" or self.shape:
                raise InvalidRequestError("object columns have dtype 'object' and no shape")
            return
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"unsupported dtype {self.dtype!r}; supported: {sorted(DTYPES)}")
        if len(self.shape) > MAX_NDIM or any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise InvalidRequestError(f"invalid shape {self.shape!r}")

    @property
    def itemsize(self) -> int:
        """Bytes per element (1 for object columns, whose payload is msgpack bytes)."""
        return 1 if self.kind == OBJECT else DTYPES[self.dtype][0]

    @property
    def row_elems(self) -> int:
        """Elements per unit of the leading dim (per sample for TENSOR, per token for JAGGED)."""
        return math.prod(self.shape) if self.kind != OBJECT else 1

    def to_wire(self) -> list[Any]:
        return [self.kind, self.dtype, list(self.shape)]

    @classmethod
    def from_wire(cls, value: Any) -> "FieldSchema":
        if not (isinstance(value, (list, tuple)) and len(value) == 3):
            raise InvalidRequestError(f"field schema must be [kind, dtype, shape], got {value!r}")
        kind, dtype, shape = value
        if not isinstance(kind, str) or not isinstance(dtype, str) or not isinstance(shape, (list, tuple)):
            raise InvalidRequestError(f"field schema must be [kind, dtype, shape], got {value!r}")
        try:
            shape = tuple(shape)
            return _schema(cls, kind, dtype, shape, tuple(map(type, shape)))
        except TypeError:  # an unhashable shape entry: let the constructor name it
            return cls(kind, dtype, tuple(shape))

    def describe(self) -> str:
        if self.kind == OBJECT:
            return "object"
        dims = ", ".join(str(d) for d in self.shape)
        return f"{self.kind} {self.dtype}[{'*, ' if self.kind == JAGGED else ''}{dims}]".replace(", ]", "]")


@functools.lru_cache(maxsize=1024)
def _schema(cls: type[FieldSchema], kind: str, dtype: str, shape: tuple[Any, ...], types: tuple[type, ...]) -> FieldSchema:
    """Schemas are immutable and every read decodes the same few: build (and validate) each once.
    ``types`` (of the shape's entries) is part of the key, so ``(2,)`` never answers for ``(2.0,)``,
    which the constructor rejects."""
    return cls(kind, dtype, shape)
