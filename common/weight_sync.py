"""Weight buckets: the one format in which a policy's new weights reach a generation engine (refit).

A bucket is a dict of plain values (ints, strings, lists, bytes: no tensors, no pickled objects), so
it crosses Ray, msgpack (vLLM's engine-core RPC) and any process boundary unchanged. It describes one
flat byte buffer holding many tensors back to back, each at an aligned offset::

    {"transport": "bytes" | "cuda_ipc" | "nccl", "version": int, "nbytes": int,
     "names": [str], "dtypes": [str], "shapes": [[int]], "offsets": [int],
     "data": bytes,              # transport "bytes": the buffer itself (CPU; the fallback, tests)
     "ipc": [...],               # transport "cuda_ipc": a CUDA IPC handle of the sender's GPU buffer
     "group": {...}}             # transport "nccl": where the receiver joins the sender's broadcast

The sender (``policy.weight_sync``) fills the buffer; the receiver (``rollout.generation.weight_sync``)
turns it back into ``(name, tensor)`` views with :func:`bucket_views` - one copy in, one copy out,
whatever the transport. Names are Hugging Face state-dict names, as the policy's model has them.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

TRANSPORTS = ("bytes", "cuda_ipc", "nccl")
ALIGN = 256  # every tensor starts at a multiple of this many bytes (any dtype's alignment, coalesced copies)
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool)
}


def is_weight_bucket(obj: Any) -> bool:
    """Whether ``obj`` is a bucket (rather than a plain state dict of tensors)."""
    return isinstance(obj, Mapping) and obj.get("transport") in TRANSPORTS and "offsets" in obj


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name buckets carry)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"weight buckets carry {sorted(_DTYPES)}, not {dtype}")
    return name


def bucket_layout(
    named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None, transport: str = "bytes", version: int = 0
) -> dict[str, Any]:
    """A bucket without its payload: where each tensor goes in the flat buffer, cast to ``dtype``
    (floating-point tensors only; ``None`` keeps each tensor's own dtype)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    names, dtypes, shapes, offsets = [], [], [], []
    nbytes = 0
    for name, t in named:
        dt = dtype if dtype is not None and t.dtype.is_floating_point else t.dtype
        names.append(name)
        dtypes.append(dtype_name(dt))
        shapes.append(list(t.shape))
        offsets.append(nbytes)
        nbytes += -(-t.numel() * dt.itemsize // ALIGN) * ALIGN
    return {
        "transport": transport,
        "version": int(version),
        "nbytes": nbytes,
        "names": names,
        "dtypes": dtypes,
        "shapes": shapes,
        "offsets": offsets,
    }


def bucket_views(flat: torch.Tensor, bucket: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into ``flat`` (a uint8 tensor of ``bucket["nbytes"]``), no copies."""
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < bucket["nbytes"]:
        raise ValueError(
            f"a bucket's buffer must be a 1-d uint8 tensor of >= {bucket['nbytes']} bytes, got {flat.dtype} of shape {tuple(flat.shape)}"
        )
    out = []
    for name, dt, shape, off in zip(bucket["names"], bucket["dtypes"], bucket["shapes"], bucket["offsets"]):
        dtype = _DTYPES[dt]
        n = 1
        for s in shape:
            n *= int(s)
        out.append((name, flat[off : off + n * dtype.itemsize].view(dtype).view([int(s) for s in shape])))
    return out


def fill_bucket(flat: torch.Tensor, bucket: Mapping[str, Any], tensors: Iterable[torch.Tensor]) -> None:
    """Copy ``tensors`` (in the bucket's order) into their slots of ``flat``, casting as the bucket says."""
    views = bucket_views(flat, bucket)
    tensors = list(tensors)
    if len(tensors) != len(views):
        raise ValueError(f"the bucket has {len(views)} slots, got {len(tensors)} tensors")
    with torch.no_grad():
        for (name, dst), src in zip(views, tensors):
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"{name}: shape {tuple(src.shape)} does not fit its slot {tuple(dst.shape)}")
            dst.copy_(src)


def bytes_buckets(
    state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None, limit: int = 512 << 20, version: int = 0
) -> list[dict[str, Any]]:
    """A state dict as ``"bytes"`` buckets of at most ``limit`` bytes each (one tensor at least): the
    fallback transport, for CPU senders and tests. Tensors are cast to ``dtype`` (floating point only)."""
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} is a {type(t).__name__}, not a tensor")
        nbytes = t.numel() * (dtype.itemsize if dtype is not None and t.dtype.is_floating_point else t.element_size())
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append((name, t.detach()))
        size += nbytes
    out = []
    for group in groups:
        if not group:
            continue
        bucket = bucket_layout(group, dtype, "bytes", version)
        flat = torch.empty(bucket["nbytes"], dtype=torch.uint8)
        fill_bucket(flat, bucket, (t.to("cpu") for _, t in group))
        bucket["data"] = flat.numpy().tobytes()
        out.append(bucket)
    return out


def bytes_bucket_views(bucket: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The CPU tensors of a ``"bytes"`` bucket (views of one writable copy of its data)."""
    if bucket.get("transport") != "bytes":
        raise ValueError(f"not a bytes bucket: transport {bucket.get('transport')!r}")
    return bucket_views(torch.frombuffer(bytearray(bucket["data"]), dtype=torch.uint8), bucket)


# ---------------------------------------------------------------------- CUDA IPC
# torch.multiprocessing's reduction of a CUDA tensor (``reduce_tensor``) is a rebuild function and a
# tuple of 15 arguments; three are classes / a dtype, the rest plain values. A bucket carries only the
# plain ones (the buffer is always a uint8 tensor), so no pickle is needed to send or open a handle.
_IPC_PLAIN = (1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14)


def cuda_ipc_handle(flat: torch.Tensor) -> list[Any]:
    """The CUDA IPC handle of a uint8 GPU buffer, as plain values (the sender keeps ``flat`` alive)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not flat.is_cuda or flat.dtype != torch.uint8:
        raise ValueError(f"a CUDA IPC bucket needs a uint8 CUDA buffer, got {flat.dtype} on {flat.device}")
    _, args = reduce_tensor(flat)
    return [list(a) if isinstance(a, torch.Size) else a for a in (args[i] for i in _IPC_PLAIN)]


def open_cuda_ipc(handle: list[Any], device: torch.device | int | None = None) -> torch.Tensor:
    """Map another process's buffer from :func:`cuda_ipc_handle` onto ``device`` (default: the current
    one; the same physical GPU as the sender's, which each process may number differently)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if isinstance(device, torch.device):
        device = device.index
    if device is None:
        device = torch.cuda.current_device()
    args: list[Any] = [torch.Tensor, None, None, None, torch.TypedStorage, torch.uint8] + [None] * 9
    for i, v in zip(_IPC_PLAIN, handle):
        args[i] = v
    args[1], args[2] = torch.Size(args[1]), tuple(args[2])
    args[6] = int(device)
    return rebuild_cuda_tensor(*args)


__all__ = [
    "ALIGN",
    "TRANSPORTS",
    "bucket_layout",
    "bucket_views",
    "bytes_bucket_views",
    "bytes_buckets",
    "cuda_ipc_handle",
    "dtype_name",
    "fill_bucket",
    "is_weight_bucket",
    "open_cuda_ipc",
]
