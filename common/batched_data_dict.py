"""BatchedDataDict: the legacy path's driver-side batch, a dict of per-sample columns.

Every value is either a tensor whose leading dimension is the batch (``[n]``, ``[n, L]``, ...) or a
Python list of ``n`` per-sample items (strings, message logs). Operations return new dicts and never
mutate their input; tensors are indexed (one copy per column), lists are rebuilt.

Pure: no I/O, no Ray, no model.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

__all__ = ["BatchedDataDict"]


def _as_index_tensor(indices: Sequence[int] | torch.Tensor) -> torch.Tensor:
    idx = torch.as_tensor(indices, dtype=torch.int64)
    if idx.dim() != 1:
        raise ValueError(f"indices must be 1-d, got shape {tuple(idx.shape)}")
    return idx


class BatchedDataDict(dict):
    """A dict of per-sample columns sharing one batch size (NeMo-RL's ``BatchedDataDict``).

    Columns are tensors with a leading batch dim or lists of per-sample items. Token-aligned columns
    are ``[n, L, ...]`` tensors padded on the right; :meth:`from_batches` pads them to a common ``L``.
    """

    # ------------------------------------------------------------------ info
    @property
    def size(self) -> int:
        """Number of samples; ``ValueError`` if the columns disagree (and 0 for an empty dict)."""
        sizes = {k: (v.shape[0] if isinstance(v, torch.Tensor) else len(v)) for k, v in self.items()}
        distinct = set(sizes.values())
        if len(distinct) > 1:
            raise ValueError(f"columns have different batch sizes: {sizes}")
        return distinct.pop() if distinct else 0

    # ------------------------------------------------------------------ subsets
    def select_indices(self, indices: Sequence[int] | torch.Tensor) -> "BatchedDataDict":
        """The samples at ``indices`` (in the order given; repeats allowed)."""
        idx = _as_index_tensor(indices)
        n = self.size
        if idx.numel() and (int(idx.min()) < -n or int(idx.max()) >= n):
            raise IndexError(f"index out of range for a batch of {n} samples")
        out = BatchedDataDict()
        idx_list = idx.tolist()
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                out[k] = v.index_select(0, idx.to(v.device))
            else:
                out[k] = [v[i] for i in idx_list]
        return out

    def slice(self, start: int, end: int) -> "BatchedDataDict":
        """The contiguous samples ``[start:end]`` (tensors are views, lists are copied)."""
        return BatchedDataDict({k: v[start:end] for k, v in self.items()})

    def shard_by_indices(self, shards: Sequence[Sequence[int]]) -> list["BatchedDataDict"]:
        """One sub-batch per index list (e.g. the keys of each DP shard, as sample positions)."""
        return [self.select_indices(list(s)) for s in shards]

    def chunk(self, n: int) -> list["BatchedDataDict"]:
        """``n`` contiguous pieces whose sizes differ by at most 1 (the first ``size % n`` are larger)."""
        total = self.size
        if not 1 <= n <= max(total, 1):
            raise ValueError(f"cannot split {total} samples into {n} chunks")
        base, rem = divmod(total, n)
        out, start = [], 0
        for i in range(n):
            stop = start + base + (1 if i < rem else 0)
            out.append(self.slice(start, stop))
            start = stop
        return out

    def repeat_interleave(self, repeats: int) -> "BatchedDataDict":
        """Repeat every sample ``repeats`` times in place order (a prompt batch -> its generation group)."""
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        out = BatchedDataDict()
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                out[k] = v.repeat_interleave(repeats, dim=0)
            else:
                out[k] = [item for item in v for _ in range(repeats)]
        return out

    # ------------------------------------------------------------------ combine / move
    @classmethod
    def from_batches(
        cls,
        batches: Sequence[Mapping[str, Any]],
        pad_value_dict: Mapping[str, float | int | bool] | None = None,
    ) -> "BatchedDataDict":
        """Concatenate batches along the batch dim.

        Tensors whose dim 1 differs between batches (token-aligned columns) are right-padded to the
        longest with ``pad_value_dict.get(key, 0)``; every batch must have the same keys.
        """
        batches = [b for b in batches]
        if not batches:
            raise ValueError("from_batches needs at least one batch")
        keys = list(batches[0].keys())
        for i, b in enumerate(batches[1:], start=1):
            if set(b.keys()) != set(keys):
                raise ValueError(f"batch {i} has keys {sorted(b)}, batch 0 has {sorted(keys)}")
        pads = dict(pad_value_dict or {})
        out = cls()
        for k in keys:
            vals = [b[k] for b in batches]
            if all(isinstance(v, torch.Tensor) for v in vals):
                if vals[0].dim() >= 2 and len({v.shape[1] for v in vals}) > 1:
                    width = max(v.shape[1] for v in vals)
                    vals = [
                        torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, width - v.shape[1]), value=pads.get(k, 0))
                        if v.shape[1] < width
                        else v
                        for v in vals
                    ]
                out[k] = torch.cat(vals, dim=0)
            elif any(isinstance(v, torch.Tensor) for v in vals):
                raise TypeError(f"column {k!r} is a tensor in some batches and a list in others")
            else:
                out[k] = [item for v in vals for item in v]
        return out

    def to(self, device: str | torch.device) -> "BatchedDataDict":
        """A copy with every tensor moved to ``device`` (lists are shared)."""
        return BatchedDataDict({k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.items()})

    def select_columns(self, keys: Iterable[str]) -> "BatchedDataDict":
        """Only the named columns (``KeyError`` naming a missing one)."""
        out = BatchedDataDict()
        for k in keys:
            if k not in self:
                raise KeyError(f"column {k!r} is missing (have {sorted(self)})")
            out[k] = self[k]
        return out
