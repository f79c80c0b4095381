"""Helpers for checking what TQ returns, byte for byte (as ``torch.testing`` is for tensors).

Used by the soak and chaos benchmarks and by the tests: a sample's value is reduced to a digest of its
dtype, shape and raw bytes, so a reader can tell another key's bytes from its own.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack

from .jagged import JaggedTensor

__all__ = ["digest", "rows_of"]


def digest(value: Any) -> str:
    """sha256 of one sample's value: dtype, shape and raw bytes of a tensor; msgpack of an object."""
    import torch

    h = hashlib.sha256()
    if isinstance(value, torch.Tensor):
        t = value.detach().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(msgpack.packb(value, use_bin_type=True))
    return h.hexdigest()


def rows_of(column: Any) -> list[Any]:
    """Per-sample values of a column as given to ``put`` or returned by ``get`` (a list, a
    :class:`~tq.jagged.JaggedTensor` or a tensor whose first dim is the sample)."""
    if isinstance(column, (list, tuple)):
        return list(column)
    if isinstance(column, JaggedTensor):
        return column.unbind()
    return [column[i] for i in range(column.shape[0])]
