"""The receiving end of a refit inside vLLM: methods mixed into each vLLM GPU worker.

``VllmWeightSyncExtension`` is passed to the engine as ``worker_extension_cls``; the backend reaches
its methods through ``collective_rpc``. With vLLM's default ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` the
workers live in the engine-core process and ``collective_rpc`` arguments cross a msgpack channel that
does not rebuild tensors nested in lists (they arrive as ``[dtype, shape, data]`` lists), so every
method here takes only a weight bucket (``common.weight_sync``: plain values) and builds the tensors
itself:

- ``"bytes"``: the bucket carries the bytes (the fallback: CPU senders, tests);
- ``"cuda_ipc"``: the bucket carries a CUDA IPC handle of the colocated policy's GPU buffer, which the
  worker maps once and reads in place (a GPU-to-GPU copy per refit, nothing through the CPU);
- ``"nccl"``: the worker joins the sender's stateless NCCL group (vLLM's ``StatelessProcessGroup`` +
  ``PyNcclCommunicator``, once) and receives the buffer by broadcast from rank 0 (separate GPUs).

Every load ends with a device synchronisation, so when the RPC returns the sender may reuse its buffer.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from common.weight_sync import bucket_views, bytes_bucket_views, open_cuda_ipc


class VllmWeightSyncExtension:
    """Refit methods of a vLLM worker (``self`` is vLLM's GPU worker at run time)."""

    def _tqrl_model(self) -> torch.nn.Module:
        get_model = getattr(self, "get_model", None)
        return get_model() if get_model is not None else self.model_runner.model  # type: ignore[attr-defined]

    def _tqrl_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def tqrl_load_bucket(self, bucket: Mapping[str, Any]) -> int:
        """Load one weight bucket into this worker's model; returns the number of tensors loaded."""
        transport = bucket["transport"]
        if transport == "bytes":
            weights = bytes_bucket_views(bucket)
        elif transport == "cuda_ipc":
            weights = bucket_views(self._tqrl_ipc_buffer(bucket), bucket)
        elif transport == "nccl":
            weights = bucket_views(self._tqrl_nccl_receive(bucket), bucket)
        else:
            raise ValueError(f"unknown weight transport {transport!r}")
        self._tqrl_model().load_weights(weights=weights)
        torch.cuda.synchronize()  # the sender may overwrite its buffer once this returns
        return len(weights)

    def _tqrl_ipc_buffer(self, bucket: Mapping[str, Any]) -> torch.Tensor:
        # The sender keeps one buffer for the job, so its handle is opened once and cached here.
        key = (bytes(bucket["ipc"][4]), int(bucket["ipc"][6]))  # the allocation's handle and the offset in it
        cache = self.__dict__.setdefault("_tqrl_ipc_buffers", {})
        if key not in cache:
            cache.clear()  # a new buffer (the sender reallocated): drop the stale mapping
            cache[key] = open_cuda_ipc(bucket["ipc"], self._tqrl_device())
        return cache[key]

    def _tqrl_nccl_receive(self, bucket: Mapping[str, Any]) -> torch.Tensor:
        group = bucket["group"]
        comm = self.__dict__.get("_tqrl_comm")
        if comm is None or self.__dict__.get("_tqrl_group_key") != (group["host"], group["port"]):
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            rank = int(group["rank_offset"]) + int(getattr(self, "rank", 0))
            pg = StatelessProcessGroup.create(host=group["host"], port=int(group["port"]), rank=rank, world_size=int(group["world_size"]))
            comm = PyNcclCommunicator(pg, device=self._tqrl_device())
            self.__dict__["_tqrl_comm"], self.__dict__["_tqrl_group_key"] = comm, (group["host"], group["port"])
        flat = self.__dict__.get("_tqrl_nccl_buffer")
        if flat is None or flat.numel() != bucket["nbytes"]:
            flat = self.__dict__["_tqrl_nccl_buffer"] = torch.empty(bucket["nbytes"], dtype=torch.uint8, device=self._tqrl_device())
        comm.broadcast(flat, src=0, stream=torch.cuda.current_stream())
        return flat

    def tqrl_weight_checksum(self, name: str) -> float:
        """Sum of one parameter (vLLM's name), for checks that a refit landed."""
        params = dict(self._tqrl_model().named_parameters())
        return float(params[name].float().sum().item())


__all__ = ["VllmWeightSyncExtension"]
