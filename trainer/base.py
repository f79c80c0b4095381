"""The GRPO training loop both trainers run: steps, validation schedule, refit, checkpoints, logging.

Subclasses (``trainer.grpo`` - driver-side batches, ``trainer.grpo_sync`` - the TQ path) supply only
how a step's data moves (:meth:`GRPOTrainerBase.train_step`, :meth:`GRPOTrainerBase.validate`); the
loop, the per-sample algorithm (``trainer.common``) and everything around it are shared.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time
from pathlib import Path
from abc import ABC, abstractmethod
from collections import defaultdict
from typing import Any, Mapping, Sequence

import ray
import torch
import yaml

from policy.loss import ClippedPGLossFn
from policy.traffic import ActorCalls, DriverTraffic
from rollout.actors import SyncRolloutActor
from rollout.data import DatasetError
from tq.errors import TQError

from .checkpoint import CheckpointError, find_resume_checkpoint, load_checkpoint, read_trainer_state, save_checkpoint, set_aside
from .common import (
    build_dataloader,
    build_datasets,
    check_cluster_fits,
    check_output_paths,
    colocation_group,
    init_ray,
    ray_auth_note,
    run_name,
)
from .config import DEFAULT_CONFIG, ConfigError, MasterConfig, check_local_paths, config_help, generation_colocated, parse_cli
from .driver import DriverRecord
from .ledger import PromptLedger
from .logger import MetricsLogger


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far: ``VmHWM`` on Linux (``getrusage``'s ``ru_maxrss``
    would start from the parent's RSS at fork), else ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024)


def _start_side_by_side(cfg: MasterConfig) -> bool:
    """Whether the rollout actor may start while the policy's DP workers start: yes unless both the
    generation workers and the policy take GPUs that may be the same ones (``refit_transport="nccl"``
    puts vLLM on other GPUs)."""
    g, p = cfg.generation, cfg.policy
    return g.num_gpus_per_worker == 0 or p.num_gpus_per_worker == 0 or g.refit_transport == "nccl"


class NothingToTrain(Exception):
    """The checkpoint a run resumes from is already at (or past) ``grpo.max_num_steps``."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler stopping the job): the run stops as on Ctrl-C (exit code 143)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    # Once: a repeated SIGTERM must not cut the clean stop short (SIGKILL still ends it at once).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


class GRPOTrainerBase(ABC):
    """One run of GRPO. ``fit()`` trains ``grpo.max_num_steps`` steps (resuming from a checkpoint)."""

    name = "grpo"
    #: Whether step data moves through TQ (then every step logs the ``dataplane/*`` metrics).
    uses_dataplane = False

    def __init__(self, cfg: MasterConfig) -> None:
        self.cfg = cfg
        torch.manual_seed(cfg.grpo.seed)
        ck = cfg.checkpointing
        check_output_paths(cfg)
        # the prompts before Ray: a malformed dataset is named before anything starts
        train_ds, self.val_dataset = build_datasets(cfg)
        self.loader = build_dataloader(cfg, train_ds)
        # The checkpoint this run resumes from (None: a fresh start), read and checked against this
        # configuration before anything starts (damaged newer ones skipped, see _check_resume).
        self.resume_from, damaged = find_resume_checkpoint(ck.checkpoint_dir) if ck.enabled and ck.resume else (None, [])
        self._saved = self._check_resume(damaged)
        # One driver per checkpoint dir: refuses to start beside a live one, and reaps what a killed
        # predecessor left running (its Ray processes) before starting Ray again.
        self.driver_record = DriverRecord.claim(ck.checkpoint_dir) if ck.enabled else None
        try:
            for path, _ in damaged:  # out of the lineage (and of pruning), kept for inspection
                print(f"warning: moved the damaged checkpoint {path} to {set_aside(path)}", file=sys.stderr, flush=True)
            self._start()
        except BaseException:
            if self.driver_record is not None:  # what started is stopped on the way out (run's finally)
                self.driver_record.release()
            raise

    def _start(self) -> None:
        """Everything of ``__init__`` from Ray on: the actors, the logger and the resumed state."""
        cfg = self.cfg
        init_ray(cfg)
        if self.driver_record is not None:
            self.driver_record.note_processes()
        self.loss_fn = ClippedPGLossFn(cfg.loss)
        # The driver's own actor calls (the policy sends its worker calls and TQ reads/writes apart);
        # measured only with logger.data_movement_metrics (counting re-pickles every payload).
        self.calls = self.new_calls()
        self.step = 0
        # The rollout actor and the DP workers start side by side (each process spends seconds importing
        # torch and building its model) unless both put models on GPUs they may share: a colocated vLLM
        # sizes its KV cache from the device's free memory, measured while it starts, which a policy
        # loading onto that GPU meanwhile would skew.
        # Policy ranks asking for a fraction of a GPU each get a GPU each: a bundle per rank, shared
        # with the generation worker colocated on it (None where Ray's own placement is right).
        self.placement_group = colocation_group(cfg)
        rollout = None
        try:
            rollout = self._launch_rollout_actor() if _start_side_by_side(cfg) else None
            self.policy = self.build_policy()
            if rollout is None:
                rollout = self._launch_rollout_actor()
            self.get(rollout.ready.remote(), "rollout actor start-up")
        except BaseException:
            if rollout is not None:
                ray.kill(rollout)
            self._remove_placement_group()
            raise
        self.rollout = rollout
        self._pop_driver_counters()
        # A resumed run keeps logging into the run directory its checkpoint names (unless
        # logger.run_name says otherwise), so metrics.jsonl and prompts.jsonl hold the whole lineage.
        saved = self._saved
        name = cfg.logger.run_name or saved.get("run_name") or run_name(cfg, self.name)
        self.logger = MetricsLogger(cfg.logger, name, cfg.model_dump(mode="json"), resume_step=int(saved["step"]) if saved else None)
        self.ledger = PromptLedger(self.logger.run_dir)
        self._maybe_resume()
        self.start_step = self.step
        self.ledger.start(self.step, self.resume_from, self.loader.state_dict())
        if cfg.logger.progress:
            print("\n".join(self.startup_lines()), flush=True)

    def _launch_rollout_actor(self) -> Any:
        """Start the rollout actor (not awaited: its ``ready`` says when it is up)."""
        cfg = self.cfg
        return SyncRolloutActor.remote(
            generation=cfg.generation.model_dump(),
            environments={cfg.env.name: {"name": cfg.env.name, **({"num_workers": cfg.env.num_workers} if cfg.env.name == "math" else {})}},
            limits={
                "max_seq_len": cfg.data.processor.max_seq_length + cfg.grpo.max_rollout_turns * cfg.grpo.max_new_tokens,
                "max_new_tokens": cfg.grpo.max_new_tokens,
                "max_rollout_turns": cfg.grpo.max_rollout_turns,
            },
            seed=cfg.grpo.seed,
            placement_group=self.placement_group if generation_colocated(cfg) else None,
            **self.rollout_kwargs(),
        )

    def startup_lines(self) -> list[str]:
        """The start-up block: the resolved config's key facts and where the logs go."""
        cfg, g, p = self.cfg, self.cfg.grpo, self.cfg.policy
        resumed = f", resuming at step {self.step}" if self.step else ""
        val = "off"
        if g.val_period and self.val_dataset is not None:
            what = "held-out operand pairs (never trained on)" if cfg.data.dataset == "builtin" else f"prompts of {cfg.data.val_dataset}"
            val = f"every {g.val_period} steps, greedy, on {len(self.val_dataset)} {what}"
        return [
            f"{self.name}: {self.algorithm_line()}",
            f"  model       {p.model_name} ({p.dtype}, policy on {p.device}, {cfg.generation.backend} generation)",
            f"  steps       {g.max_num_steps} x {g.num_prompts_per_step} prompts x {g.num_generations_per_prompt} samples{resumed}; "
            f"optimizer batch {p.train_global_batch_size}, lr {p.learning_rate:g}",
            f"  DP          {p.dp_size} policy worker(s){self._placement_note()}",
            f"  data        {cfg.data.dataset} ({len(self.loader.dataset)} prompts); validation {val}",
            f"  data plane  {self.dataplane_line()}",
            f"  ray         {cfg.cluster.ray_address or 'local'}: {ray_auth_note()}",
            f"  logs        {self.logger.run_dir} (metrics.jsonl{', tensorboard/' if cfg.logger.tensorboard else ''}"
            f"{', curves.png at the end' if cfg.logger.plot else ''})",
        ]

    def _placement_note(self) -> str:
        """How the ranks were placed, when the trainer placed them (the start-up block's DP line)."""
        if self.placement_group is None:
            return ""
        with_gen = generation_colocated(self.cfg)
        return f", a GPU each (placement group of {self.placement_group.bundle_count} bundles{', shared with the generation workers' if with_gen else ''})"

    def algorithm_line(self) -> str:
        """What the run trains with (the start-up block's first line)."""
        kl = self.cfg.loss.reference_policy_kl_penalty
        return f"GRPO (synchronous, {self.path_name}){f', KL penalty {kl:g}' if kl else ''}"

    path_name = "legacy path: batches through the driver"

    def dataplane_line(self) -> str:
        """Where step data lives (the start-up block)."""
        return "none: rollouts come back to the driver as batches"

    @classmethod
    def check_config(cls, cfg: MasterConfig) -> None:
        """What this trainer needs of the configuration beyond the schema (raises :class:`ConfigError`)."""
        if cfg.async_grpo.enabled:  # this trainer would train synchronously, ignoring the async settings
            raise ConfigError(
                f"async_grpo.enabled is true: python -m trainer.{cls.name} trains synchronously; run python -m trainer.grpo_async "
                "(or set async_grpo.enabled=false)"
            )

    # ------------------------------------------------------------------ what the two paths implement
    @abstractmethod
    def build_policy(self) -> Any:
        """The policy (legacy ``Policy`` or ``TQPolicy``), sending its worker calls through :meth:`new_calls`,
        its ranks in :attr:`placement_group`'s bundles (if any)."""

    def rollout_kwargs(self) -> dict[str, Any]:
        """Extra constructor arguments of the rollout actor (the TQ path passes the TQ address)."""
        return {}

    @abstractmethod
    def train_step(self, batches: "BatchSource") -> dict[str, float]:
        """Roll out, compute advantages, log-probs, and train on one step's prompts; return metrics."""

    @abstractmethod
    def validate(self) -> dict[str, float]:
        """Greedy rollouts of the validation prompts; accuracy (and pass@k)."""

    # ------------------------------------------------------------------ shared machinery
    def new_calls(self) -> ActorCalls:
        """How the driver calls actors: measured (:class:`~policy.traffic.DriverTraffic`) with
        ``logger.data_movement_metrics``, plain otherwise."""
        return DriverTraffic() if self.cfg.logger.data_movement_metrics else ActorCalls()

    def send(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """``method.remote(*args, **kwargs)`` (an actor method), counted in the driver's traffic if measured."""
        return self.calls.send(method, *args, **kwargs)

    def get(self, refs: Any, what: str) -> Any:
        """``ray.get`` bounded by the policy's Ray timeout, counted in the driver's traffic if measured."""
        try:
            return self.calls.get(refs, self.cfg.policy.ray_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{what} did not finish within policy.ray_timeout_s={self.cfg.policy.ray_timeout_s}s") from None
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"{what} failed: an actor died ({exc.__class__.__name__}); the last checkpoint stays loadable") from None

    def refit_weights(self) -> Any:
        """What a refit ships: rank 0's weights as an object reference (they skip the driver), or an
        empty mapping when the generation backend loads none (synthetic), so that benchmarks on it
        measure data movement rather than a weight transfer the generator ignores. A CUDA IPC refit of
        several colocated generation workers ships one bucket per worker, each from the rank on its GPU."""
        if not self.cfg.generation.loads_weights:
            return {}
        g = self.cfg.generation
        if g.refit_transport == "cuda_ipc":  # a handle of a rank's GPU buffer, no copy
            if g.ray_workers == 0:  # the engine runs inside the rollout actor
                return self.policy.workers[0].get_weight_ipc_bucket.remote(g.dtype, self.step)
            # generation worker j runs beside rank j (bundle j): it maps that rank's buffer, on its own GPU
            return [self.policy.workers[j].get_weight_ipc_bucket.remote(g.dtype, self.step) for j in range(g.ray_workers)]
        return self.policy.workers[0].get_weights.remote()

    def refit_generation(self) -> None:
        """Push the policy's weights to the generator: rank 0 -> object store -> rollout actor. The
        driver only passes the object reference, never the weights."""
        if self.cfg.generation.refit_transport == "nccl":
            return self.refit_over_nccl(self.rollout)
        self.get(self.send(self.rollout.update_weights, self.refit_weights(), self.step), "generation refit")

    def refit_over_nccl(self, target: Any) -> None:
        """Refit ``target`` (an actor with ``update_weights``) by an NCCL broadcast from rank 0's GPU
        (``generation.refit_transport: nccl``): rank 0 casts its weights into its refit buffer, then
        sends it while the generation workers receive it (one stateless group, joined at the first refit)."""
        g, w0 = self.cfg.generation, self.policy.workers[0]
        if getattr(self, "_weight_group", None) is None:
            host, port = self.get(w0.master_address.remote(), "refit group address")
            self._weight_group = {"host": host, "port": port, "world_size": 1 + max(1, g.ray_workers) * g.vllm_tensor_parallel_size}
        bucket = w0.get_weight_nccl_bucket.remote(g.dtype, self.step, self._weight_group)
        self.get([self.send(target.update_weights, bucket, self.step), w0.broadcast_weight_bucket.remote()], "generation refit")

    def _pop_driver_counters(self) -> dict[str, float]:
        """The driver's traffic since the last call (trainer and policy together), then reset."""
        out = defaultdict(float, self.calls.pop())
        pop = getattr(self.policy, "pop_driver_counters", None)
        for k, v in (pop() if pop is not None else {}).items():
            out[k] += v
        return dict(out)

    def _pop_dataplane(self) -> dict[str, float]:
        """The driver's TQ calls since the last call (trainer and policy together), then reset."""
        out = self.calls.pop_dataplane()
        for k, v in self.policy.calls.pop_dataplane().items() if hasattr(self.policy, "calls") else ():
            out[k] += v
        return out

    @staticmethod
    def _dataplane_metrics(step: Mapping[str, Any], driver: Mapping[str, float], ranks: list[dict[str, Any]]) -> dict[str, float]:
        """A step's ``dataplane/*`` metrics: seconds in data-plane calls on the step's path - the
        driver's own TQ calls, the rollout's put (sync; the async collector's run beside the step)
        and the slowest DP rank's gets and write-backs - as seconds and as a fraction of the step
        time; and the tensor bytes written to and read from TQ (rollout, driver and every rank)."""
        rank_s = max((r["tq_get_s"] + r["write_back_s"] for r in ranks), default=0.0)
        put_s = float(step.get("rollout/tq_put_seconds", 0.0))
        seconds = driver["seconds"] + put_s + rank_s
        written = float(step.get("rollout/tq_put_bytes", 0.0)) + driver["bytes_written"] + sum(r["write_back_bytes"] for r in ranks)
        read = driver["bytes_read"] + sum(r["tq_get_bytes"] for r in ranks)
        return {
            "dataplane/frac_of_step": seconds / step["step_time_s"] if step.get("step_time_s") else 0.0,
            "dataplane/seconds": seconds,
            "dataplane/driver_s": driver["seconds"],
            "dataplane/rollout_put_s": put_s,
            "dataplane/slowest_rank_s": rank_s,
            "dataplane/bytes_written": written,
            "dataplane/bytes_read": read,
            "dataplane/bytes_moved": written + read,
        }

    def _data_movement_metrics(self, step: Mapping[str, Any]) -> dict[str, float]:
        """A step's data-movement metrics: on the TQ path ``dataplane/*`` (:meth:`_dataplane_metrics`),
        the driver's peak RSS, and with ``logger.data_movement_metrics``
        its bytes received / sent, its seconds sending, unpacking results and in TQ calls, each DP
        rank's fetch seconds, and the slowest rank's dispatch / TQ get / write-back / compute seconds."""
        c = self._pop_driver_counters()
        driver_tq = self._pop_dataplane()
        out = {"driver_peak_rss_bytes": float(peak_rss_bytes())}
        timings = getattr(self.policy, "worker_timings", None)
        ranks = timings() if timings is not None and (self.uses_dataplane or self.calls.instrumented) else None
        if self.uses_dataplane:
            out.update(self._dataplane_metrics(step, driver_tq, ranks or []))
        if not self.calls.instrumented:
            return out
        out.update(
            {
                "driver_bytes_received": c["bytes_received"],
                "driver_bytes_sent": c["bytes_sent"],
                **{f"timing/{k[:-2]}": c.get(k, 0.0) for k in ("driver_send_s", "driver_get_s", "driver_tq_s")},
            }
        )
        if ranks is not None:
            for r in ranks:
                out[f"fetch/rank{r['rank']}_s"] = r["fetch_s"]
            for k in ("fetch_s", "dispatch_s", "tq_get_s", "write_back_s", "compute_s"):
                out[f"timing/worker_{k[:-2]}"] = max(r[k] for r in ranks)  # the slowest rank
        return out

    #: Where this trainer's checkpoints keep the data loader's state (``_check_resume`` compares it).
    loader_state_key = "dataloader"

    def saved_loader_state(self, state: Mapping[str, Any]) -> Any:
        """The data loader's state in a checkpoint's trainer state (None if it holds none)."""
        return state.get(self.loader_state_key)

    def _check_resume(self, damaged: list[tuple[Path, str]]) -> dict[str, Any]:
        """Before anything starts: the trainer state of :attr:`resume_from` (``{}`` on a fresh start),
        checked against this configuration. A damaged newer checkpoint was skipped with a warning (as
        one interrupted while saving is); none intact, a data position saved with other loader
        settings, or another trainer's state is refused (:class:`CheckpointError` naming the
        checkpoint and the setting); a checkpoint already at ``grpo.max_num_steps`` raises
        :class:`NothingToTrain`."""
        ck, path = self.cfg.checkpointing, self.resume_from
        if path is None:
            if damaged:
                raise CheckpointError(
                    f"checkpointing.checkpoint_dir={ck.checkpoint_dir}: no intact checkpoint to resume from ("
                    + "; ".join(f"{p.name}: {why}" for p, why in damaged)
                    + "); move the damaged ones away, or start over in another checkpointing.checkpoint_dir"
                )
            return {}
        for p, why in damaged:
            print(f"warning: checkpoint {p} is damaged ({why}); resuming from the previous intact one, {path}", file=sys.stderr, flush=True)
        state = read_trainer_state(path)
        saved = self.saved_loader_state(state)
        if not isinstance(saved, dict):
            other = "trainer.grpo_async" if "collector" in state else "trainer.grpo or trainer.grpo_sync"
            raise CheckpointError(
                f"checkpoint {path} was written by {other}, which trainer.{self.name} cannot resume (it holds no "
                f"{self.loader_state_key!r} state); resume it with that trainer, or start over in another checkpointing.checkpoint_dir"
            )
        mine, data, g = self.loader.state_dict(), self.cfg.data, self.cfg.grpo
        prompts = f"data.num_builtin_prompts={data.num_builtin_prompts}" if data.dataset == "builtin" else f"data.dataset={data.dataset}"
        differs = {  # what the loader's position is only valid with, as the user would change it
            "batch_size": f"grpo.num_prompts_per_step={{}}, this run has grpo.num_prompts_per_step={g.num_prompts_per_step}",
            "dataset_len": f"{{}} training prompts, this run has {mine['dataset_len']} ({prompts})",
            "shuffle": f"data.shuffle={{}}, this run has data.shuffle={data.shuffle}",
            "drop_last": f"the loader's drop_last={{}}, this run has {mine['drop_last']}",
        }
        for key, text in differs.items():
            if key in saved and saved[key] != mine[key]:
                raise CheckpointError(
                    f"checkpoint {path} was saved with {text.format(saved[key])}: its data position holds only for the same "
                    "prompts and batches; resume with the checkpoint's setting, or start over in another checkpointing.checkpoint_dir"
                )
        step, last = int(state["step"]), self.cfg.grpo.max_num_steps
        if step >= last:
            raise NothingToTrain(
                f"nothing to train: checkpoint {path} is at step {step} and grpo.max_num_steps={last}; raise grpo.max_num_steps to train on"
            )
        return state

    def _maybe_resume(self) -> None:
        path = self.resume_from
        if path is None:
            return
        state = load_checkpoint(path, self.policy)
        self.step = int(state["step"])
        self.loader.load_state_dict(state["dataloader"])
        self.get(self.rollout.load_generation_state.remote(state.get("generation")), "restore generation state")
        self.refit_generation()
        print(f"resumed from {path} at step {self.step}", flush=True)

    def _checkpoint(self) -> None:
        generation = self.get(self.rollout.generation_state.remote(), "generation state")
        self._save_checkpoint({"dataloader": self.loader.state_dict(), "generation": generation})

    def _save_checkpoint(self, trainer_state: dict[str, Any]) -> None:
        """Write checkpoint ``self.step`` (the ledger's lines up to it reach the disk first)."""
        self.ledger.sync()
        save_checkpoint(
            self.cfg.checkpointing.checkpoint_dir, self.step, self.policy, {**trainer_state, "run_name": self.logger.run_dir.name}
        )
        if self.driver_record is not None:
            self.driver_record.note_processes()  # actors started since: a successor reaps them too

    def fit(self) -> list[dict[str, Any]]:
        """Train to ``grpo.max_num_steps``; returns the per-step training metrics."""
        g, ck = self.cfg.grpo, self.cfg.checkpointing
        history = []
        try:
            if g.val_period and g.val_at_start and self.step == 0 and self.val_dataset is not None:
                self.logger.log(0, self.validate(), prefix="val")
            self.logger.start(self.step, g.max_num_steps)
            while self.step < g.max_num_steps:
                self._pop_driver_counters()  # start the step's traffic count at zero
                self._pop_dataplane()
                t0 = time.perf_counter()
                batches = BatchSource(self.loader)
                metrics = self.train_step(batches)
                self.step += 1
                self.ledger.record(self.step, batches.trained, batches.dropped)
                t1 = time.perf_counter()
                self.refit_generation()
                metrics["timing/refit"] = time.perf_counter() - t1
                metrics["step_time_s"] = time.perf_counter() - t0
                metrics.update(self._data_movement_metrics(metrics))  # after the clock: instrumentation only
                self.logger.log(self.step, metrics)
                self.logger.progress(self.step, g.max_num_steps, metrics)
                history.append(metrics)
                if g.val_period and self.step % g.val_period == 0 and self.val_dataset is not None:
                    val = self.validate()
                    self.logger.log(self.step, val, prefix="val")
                    if self.cfg.logger.progress:
                        self.logger.write(
                            f"validation at step {self.step} ({len(self.val_dataset)} prompts): "
                            + ", ".join(f"{k} {v:.3f}" for k, v in val.items())
                        )
                if ck.enabled and self.step % ck.save_period == 0:
                    self._checkpoint()
            if ck.enabled and self.step % ck.save_period:
                self._checkpoint()
        except ray.exceptions.RayActorError as exc:  # from any wait on an actor: a step, metrics, validation, a checkpoint
            raise RuntimeError(
                f"training stopped after {self.step} completed steps: an actor died "
                f"({type(exc).__name__}: {str(exc).splitlines()[0]}); the last checkpoint stays loadable"
            ) from None
        finally:
            self.ledger.close()
            plot = self.logger.plot()
            self.logger.close()
            if plot is not None:
                print(f"curves: {plot}; metrics: {self.logger.run_dir / 'metrics.jsonl'}", flush=True)
        return history

    def _remove_placement_group(self) -> None:
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None

    def shutdown(self) -> None:
        """Stop the policy workers, the rollout actor and (if started here) the TQ service."""
        try:
            self.policy.shutdown()
        finally:
            ray.kill(self.rollout)
            self._remove_placement_group()
            self.ledger.close()
            if self.driver_record is not None:
                self.driver_record.release()


class BatchSource:
    """Prompt batches for one step (dynamic sampling may ask for several), and which of their prompts
    the step trained on (for the prompt ledger, ``trainer.ledger``)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.drawn = 0
        self.batches: list[tuple[int, list[int]]] = []  # (loader epoch, dataset idx of each prompt) per batch
        self.trained: list[tuple[int, int]] = []  # (epoch, idx) of the prompts trained on
        self.dropped: list[tuple[int, int]] = []  # drawn, rolled out, not trained on (dynamic sampling)

    def next(self) -> Any:
        self.drawn += 1
        batch = self.loader.next_batch()
        self.batches.append((int(self.loader.epoch), [int(r["idx"]) for r in batch]))
        return batch

    def settle(self, prompt_ids: Sequence[int]) -> None:
        """The step trains on the groups of ``prompt_ids`` (one per sample, ``dataset idx + 1_000_000 *
        batch number`` as the trainers number them): record those prompts as trained, the rest of the
        drawn ones as dropped."""
        kept = list(dict.fromkeys(int(p) for p in prompt_ids))
        self.trained = [(self.batches[p // 1_000_000][0], p % 1_000_000) for p in kept]
        taken = set(kept)
        self.dropped = [(e, i) for b, (e, idxs) in enumerate(self.batches) for i in idxs if i + 1_000_000 * b not in taken]

    def check_budget(self, kept: int, want: int, max_batches: int) -> None:
        """Dynamic sampling draws batches until ``want`` samples are kept; give up, naming the limit,
        once ``max_batches`` were drawn (``grpo.dynamic_sampling_max_gen_batches``)."""
        if self.drawn >= max_batches:
            raise RuntimeError(
                f"dynamic sampling kept {kept} of {want} samples after {self.drawn} generation batches "
                f"(grpo.dynamic_sampling_max_gen_batches={max_batches}): rewards do not vary enough"
            )


def usage(trainer_cls: type[GRPOTrainerBase], recipe: str) -> str:
    """``--help``: the command line, what the trainer does, and every configuration key."""
    doc = (sys.modules[trainer_cls.__module__].__doc__ or "").strip().split("\n\n")[0].replace("``", "")
    shown = recipe
    if Path(recipe).resolve().is_relative_to(DEFAULT_CONFIG.parents[2]):  # a recipe of this repository
        shown = str(Path(recipe).resolve().relative_to(DEFAULT_CONFIG.parents[2]))
    return "\n".join(
        [
            f"usage: python -m trainer.{trainer_cls.name} [--config FILE] [--print-config] [section.key=value ...]",
            "",
            doc,
            "",
            "options:",
            "  -h, --help          show this help (every configuration key) and exit",
            f"  --config FILE       the YAML recipe to start from (default: {shown}; others in trainer/configs/)",
            "  --print-config      print the resolved configuration (recipe + overrides, validated) as YAML and exit",
            "  section.key=value   override one key; the value is parsed as YAML (3e-4, true, null, [1, 2])",
            "",
            "configuration: key (type) = schema default  [recipe: what the recipe sets instead]",
            "",
            config_help(recipe),
        ]
    )


def run(trainer_cls: type[GRPOTrainerBase], argv: Sequence[str] | None = None, *, default_config: str | None = None) -> int:
    """Command-line entry: ``--help``, ``--print-config``, or parse the config, train and shut down
    cleanly (also on Ctrl-C). ``default_config``: the recipe without ``--config`` (default: the
    offline CPU recipe)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if default_config is not None and "--config" not in argv:
        argv = ["--config", str(default_config), *argv]
    if "-h" in argv or "--help" in argv:
        recipe = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else str(DEFAULT_CONFIG)
        try:
            print(usage(trainer_cls, recipe))
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    print_config = "--print-config" in argv
    try:
        cfg = parse_cli([a for a in argv if a != "--print-config"])
        trainer_cls.check_config(cfg)
        if print_config:  # a recipe may name paths of the machine it is for: printed without checking them
            print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
            return 0
        check_local_paths(cfg)
        check_output_paths(cfg)
        if not cfg.cluster.ray_address:  # before the TQ service starts; init_ray checks the GPUs too
            check_cluster_fits(cfg, {"CPU": cfg.cluster.num_cpus or os.cpu_count() or 1}, local=True, resources=("CPU",))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    trainer = None
    # SIGTERM stops the run as Ctrl-C does (init_ray keeps this handler over Ray's own).
    on_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        trainer = trainer_cls(cfg)
        history = trainer.fit()
        if history:
            first, last = history[0]["reward"], sum(h["reward"] for h in history[-5:]) / min(5, len(history))
            resumed = f" (resumed at step {trainer.start_step})" if trainer.start_step else ""
            val = [r for r in trainer.logger.history if r["split"] == "val" and "accuracy" in r]
            held = f"; validation accuracy {val[-1]['accuracy']:.3f} at step {val[-1]['step']}" if val else ""
            print(
                f"done: {len(history)} steps{resumed}, training reward {first:.3f} -> {last:.3f} (mean of the last 5 steps){held}",
                flush=True,
            )
        return 0
    except NothingToTrain as exc:
        print(exc, flush=True)
        return 0
    except KeyboardInterrupt as exc:
        kept = "; the last checkpoint stays loadable" if cfg.checkpointing.enabled else ""
        how = " (SIGTERM)" if isinstance(exc, Terminated) else ""
        print(f"interrupted{how}: stopping workers{kept}", file=sys.stderr, flush=True)
        return 143 if isinstance(exc, Terminated) else 130
    except (ConfigError, CheckpointError) as exc:  # found once the data or the cluster is known
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (DatasetError, TQError, FileNotFoundError, TimeoutError, ConnectionError, RuntimeError, NotImplementedError) as exc:
        if os.environ.get("TQ_DEBUG"):  # the traceback, for a bug report
            raise
        # raised in an actor, it comes wrapped with the actor's traceback: the error itself is the line
        print(f"error: {getattr(exc, 'cause', None) or exc}", file=sys.stderr)
        return 2 if isinstance(exc, DatasetError) else 1  # the user's data: like a bad setting
    finally:
        try:
            if trainer is not None:
                trainer.shutdown()
            ray.shutdown()
        finally:
            signal.signal(signal.SIGTERM, on_sigterm)
