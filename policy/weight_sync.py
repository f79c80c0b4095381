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

``StandaloneWeightSender`` / ``nccl_refit`` drive the same sender outside a training worker, and
``token_mult_prob_error`` checks a refit end to end: how far the generator's log-probs are from the
policy's own (tests, benchmarks).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from common.models import build_tiny_tokenizer, load_model
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

    def nccl_bucket(self, model: torch.nn.Module, dtype: torch.dtype, version: int, group: Mapping[str, Any]) -> dict[str, Any]:
        """Cast the model's weights into the buffer; returns the ``"nccl"`` bucket receivers need to
        join ``group`` (``host``, ``port``, ``world_size``; this rank is 0) and receive it. Call
        :meth:`broadcast` while the receivers load the bucket."""
        missing = {"host", "port", "world_size"} - set(group)
        if missing:
            raise ValueError(f"an NCCL refit group needs {sorted(missing)}")
        bucket = self._fill(model, dtype, "nccl", version)
        bucket["group"] = {
            "host": str(group["host"]),
            "port": int(group["port"]),
            "world_size": int(group["world_size"]),
            "rank_offset": int(group.get("rank_offset", 1)),
        }
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

            pg = StatelessProcessGroup.create(host=group["host"], port=group["port"], rank=0, world_size=group["world_size"])
            self._comm, self._group_key = PyNcclCommunicator(pg, device=self._flat.device), key
        self._comm.broadcast(self._flat, src=0, stream=torch.cuda.current_stream(self._flat.device))
        torch.cuda.synchronize(self._flat.device)
        return int(self._flat.numel())


class StandaloneWeightSender:
    """A model and its bucket sender outside a training worker (run it as a Ray actor on its own GPU):
    a policy rank's sending side alone, for tests and benchmarks of the NCCL and CUDA IPC refits. ``name``: a model
    name or path, or the tiny model (``seed``), loaded in float32 like a policy's master weights."""

    def __init__(self, name: str, seed: int = 0) -> None:
        self.name = name
        self.model = load_model(name, tokenizer=build_tiny_tokenizer(), seed=seed, device="cuda")
        self.sender = WeightBucketSender()

    def reseed(self, seed: int) -> None:
        """New weights (the tiny model's seed-``seed`` init), as a training step would make."""
        self.model = load_model(self.name, tokenizer=build_tiny_tokenizer(), seed=seed, device="cuda")

    def group(self, world_size: int) -> dict[str, Any]:
        """This node's address and a free port for the refit group (this actor is rank 0)."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return {"host": ray.util.get_node_ip_address(), "port": port, "world_size": world_size}

    def bucket(self, version: int, group: dict[str, Any]) -> dict[str, Any]:
        """Cast the weights into the buffer; the ``"nccl"`` bucket for the receivers."""
        return self.sender.nccl_bucket(self.model, torch.bfloat16, version, group)

    def broadcast(self) -> int:
        """Send the buffer (blocks until the receivers take it)."""
        return self.sender.broadcast()

    def ipc_bucket(self, version: int) -> dict[str, Any]:
        """Cast the weights into the buffer; the ``"cuda_ipc"`` bucket for an engine on this GPU."""
        return self.sender.cuda_ipc_bucket(self.model, torch.bfloat16, version)


def nccl_refit(pool: Any, sender: Any, group: dict[str, Any], version: int) -> dict[str, Any]:
    """One refit of ``pool`` (a ``RayGenerationPool``) from ``sender`` (a ``StandaloneWeightSender`` actor)
    over NCCL: the sender broadcasts while the pool's workers receive; returns the bucket."""
    import ray

    bucket = ray.get(sender.bucket.remote(version, group), timeout=300)  # a wedged sender fails the refit, never freezes it
    sent = sender.broadcast.remote()  # rank 0 sends while the generation workers receive
    pool.update_weights(bucket, weight_version=version)
    if ray.get(sent, timeout=300) != bucket["nbytes"]:
        raise RuntimeError("the broadcast sent a different number of bytes than the bucket holds")
    return bucket


def token_mult_prob_error(policy: torch.nn.Module, prompts: list[torch.Tensor], out: Any) -> float:
    """NeMo-RL's token_mult_prob_error of generated responses: the mean over response tokens of
    ``exp|policy - generation|`` log-prob, the policy recomputing under bf16 autocast as training does."""
    errs = []
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for p, ids, lp_gen in zip(prompts, out.response_ids, out.logprobs):
            seq = torch.cat([p, ids]).to("cuda")[None]
            logits = policy(seq).logits.float()[0, len(p) - 1 : -1]
            lp = torch.log_softmax(logits, -1).gather(-1, seq[0, len(p) :, None])[:, 0].cpu()
            errs.append(torch.exp((lp - lp_gen).abs()))
    return float(torch.cat(errs).mean())


__all__ = ["StandaloneWeightSender", "WeightBucketSender", "nccl_refit", "token_mult_prob_error", "unique_named_tensors"]
