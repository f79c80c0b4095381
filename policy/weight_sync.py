"""The sending end of a refit: a policy rank's weights as weight buckets (``common.weight_sync``).

``WeightBucketSender`` keeps one flat GPU buffer for the job, in the generation engine's dtype (bf16
for a float32 master model: half the bytes to move, and no cast on the receiving side). A refit casts
the model's parameters into it (one device copy per tensor) and then either

- hands out a CUDA IPC handle of it (``cuda_ipc_bucket``): a colocated vLLM engine on the same GPU
  maps the buffer once and copies from it in place - nothing is pickled or goes through the CPU; or
- broadcasts it over NCCL (``nccl_bucket`` then ``broadcast``) to vLLM workers on other GPUs, in a
  stateless process group (vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator``; the sender is
  rank 0) that never touches the policy's own torch.distributed group.

Tied weights (``lm_head.weight`` aliasing ``model.embed_tokens.weight``) are sent once: the receiving
model ties them itself. The buffer must not be rewritten while a receiver still reads it: the trainer
refits synchronously, and receivers synchronise before their RPC returns.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from common.weight_sync import bucket_layout, cuda_ipc_handle, fill_bucket


def unique_named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's state dict with aliases of one storage (tied weights) kept once, first name wins."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = []
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out.append((name, t))
    return out


class WeightBucketSender:
    """One rank's refit buffer and, for NCCL, its communicator (create it in the process that owns the model)."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None
        self._layout: dict[str, Any] | None = None
        self._ipc: list[Any] | None = None
        self._comm: Any = None
        self._group_key: tuple[str, int] | None = None

    def _fill(self, model: torch.nn.Module, dtype: torch.dtype, transport: str, version: int) -> dict[str, Any]:
        named = unique_named_tensors(model)
        layout = bucket_layout(named, dtype, transport, version)
        device = named[0][1].device
        if device.type != "cuda":
            raise ValueError(f"a {transport} refit needs the policy on a GPU, its weights are on {device}")
        if self._flat is None or self._flat.numel() != layout["nbytes"] or self._flat.device != device:
            self._flat = torch.empty(layout["nbytes"], dtype=torch.uint8, device=device)
            self._ipc = None
        fill_bucket(self._flat, layout, (t for _, t in named))
        torch.cuda.synchronize(device)  # receivers read it from other processes / streams
        self._layout = layout
        return layout

    def cuda_ipc_bucket(self, model: torch.nn.Module, dtype: torch.dtype, version: int) -> dict[str, Any]:
        """Cast the model's weights into the buffer; returns a ``"cuda_ipc"`` bucket pointing at it."""
        bucket = self._fill(model, dtype, "cuda_ipc", version)
        if self._ipc is None:
            self._ipc = cuda_ipc_handle(self._flat)
        bucket["ipc"] = self._ipc
        return bucket

    def nccl_bucket(self, model: torch.nn.Module, dtype: torch.dtype, version: int,
                    group: Mapping[str, Any]) -> dict[str, Any]:
        """Cast the model's weights into the buffer; returns the ``"nccl"`` bucket receivers need to
        join ``group`` (``host``, ``port``, ``world_size``; this rank is 0) and receive it. Call
        :meth:`broadcast` while the receivers load the bucket."""
        missing = {"host", "port", "world_size"} - set(group)
        if missing:
            raise ValueError(f"an NCCL refit group needs {sorted(missing)}")
        bucket = self._fill(model, dtype, "nccl", version)
        bucket["group"] = {"host": str(group["host"]), "port": int(group["port"]),
                           "world_size": int(group["world_size"]), "rank_offset": int(group.get("rank_offset", 1))}
        return bucket

    def broadcast(self) -> int:
        """Send the buffer filled by :meth:`nccl_bucket` to every receiver (joins the group the first
        time: blocks until all receivers join too). Returns the bytes sent."""
        if self._flat is None or self._layout is None or self._layout["transport"] != "nccl":
            raise RuntimeError("broadcast needs nccl_bucket first")
        group = self._layout["group"]
        key = (group["host"], group["port"])
        if self._comm is None or self._group_key != key:
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            pg = StatelessProcessGroup.create(host=group["host"], port=group["port"], rank=0,
                                              world_size=group["world_size"])
            self._comm, self._group_key = PyNcclCommunicator(pg, device=self._flat.device), key
        self._comm.broadcast(self._flat, src=0, stream=torch.cuda.current_stream(self._flat.device))
        torch.cuda.synchronize(self._flat.device)
        return int(self._flat.numel())


__all__ = ["WeightBucketSender", "unique_named_tensors"]
