"""The training loop of one rank (design §1, §5, §6).

config → plan → Engine → per step: global sample ids (one offset for the whole run) → this dp
rank's slice → `Engine.train_step` → `GnsEstimator.update` → `StepRecord` → metrics line (rank 0)
→ `policy.observe` on rank 0 → `Decision` broadcast → applied at the step boundary:
a batch change calls `Engine.set_plan` and rescales the LR; a layout change ("reconfigure") is
switched in the same processes (`runtime/state/reconfigure.py`) or, with controller.switch="checkpoint",
through a checkpoint (save, rebuild the engine under the new plan, load resharded).
Eval every `eval.interval_steps` on a fixed validation subset, checkpoints every
`checkpoint.interval_steps` and at the end, `resume` from the latest good checkpoint under any plan.

`Trainer` builds a rank's run (construction, below) and drives it (`run`); its parts live beside
it, one concept each: the step and its end-of-step agreement (`runtime/train/step.py`), applying
a decision (`runtime/train/switching.py`), checkpoints and resume (`runtime/train/checkpointing.py`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from copus.config import Config
from copus.core.stats.gns_tracking import make_estimator, resolve_estimator
from copus.core.specs.models import ModelShape
from copus.core.specs.resolve import get_model_shape
from copus.core.plan.plan import ParallelPlan
from copus.core.plan.records import Decision
from copus.runtime.state.async_checkpoint import AsyncCheckpointer
from copus.runtime.train import perf, stop
from copus.runtime.train.checkpointing import CheckpointMixin
from copus.runtime.train.memory_guard import MemoryGuard
from copus.runtime.train.setup import (
    default_micro_batch_size,
    elastic_run_id,
    initial_plan,
    make_run_policy,
    restart_count,
    run_hardware,
    validate_before_launch,
)
from copus.runtime.engine.optim import LearningRate, build_learning_rate
from copus.runtime.train.probe import Prober
from copus.runtime.train.step import StepEnd, StepMixin
from copus.runtime.train.switching import SwitchMixin
from copus.runtime.train.watchdog import stall_dump
from copus.runtime.train.progress import Progress, TrainingError, plan_from_dict, plan_to_dict  # noqa: F401 (re-exported)


__all__ = [
    "Trainer",
    "TrainingError",
    "default_micro_batch_size",
    "initial_plan",
    "make_run_policy",
    "validate_before_launch",
]


# ------------------------------------------------------------------------------------ trainer

Hook = Callable[[int, np.ndarray, np.ndarray], None]
PolicyFactory = Callable[[Config, ParallelPlan, int, ModelShape], Any]


class Trainer(StepMixin, SwitchMixin, CheckpointMixin):
    """One rank's training run. Build, then `run()`; every rank executes the same calls."""

    def __init__(
        self,
        cfg: Config,
        run_dir: str | Path,
        device: torch.device,
        *,
        resume: bool = False,
        auto_resume: bool = False,
        on_batch: Hook | None = None,
        policy_factory: PolicyFactory | None = None,
    ) -> None:
        """`resume`: continue from the latest good checkpoint (TrainingError if none);
        `auto_resume`: continue from it only if it belongs to this run (`resume`), else start
        fresh. `on_batch(step, global_ids, local_ids)` sees every step's samples (tests);
        `policy_factory` replaces the configured policy (tests, library use)."""
        from copus.runtime.engine.dist import MeshCache
        from copus.runtime.data.run_data import build_run_data

        self.cfg, self.run_dir, self.on_batch = cfg, Path(run_dir), on_batch
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = device
        run_data = build_run_data(cfg, get_model_shape(cfg.model.name, cfg.model.seq_len))
        self.train_set, self.val_set, self.tokenizer = run_data.train, run_data.val, run_data.tokenizer
        self.shape, self.sampler, self.val_note = run_data.shape, run_data.sampler, None
        self.blind_plans: set[ParallelPlan] = set()  # plans said to measure no noise scale
        self.run_id, self.restarted = elastic_run_id(), restart_count() > 0
        self.plan = initial_plan(cfg, self.world, self.shape)
        self.hardware = run_hardware(device.type, torch.cuda.get_device_name(device) if device.type == "cuda" else "")
        self.writer = self._make_writer()
        self.memory = MemoryGuard(
            cfg,
            self.shape,
            device,
            self.hardware,
            self.run_dir,
            rank=self.rank,
            world=self.world,
            log=self.log,
            error=TrainingError,
        )  # runtime/train/memory_guard.py
        self.plan = self.memory.feasible(self.plan)
        if policy_factory is not None:
            self.policy = policy_factory(cfg, self.plan, self.world, self.shape)
            self.memory.forbid_in(self.policy)
        else:
            self.policy = self._make_policy(self.plan)
        self.peak_flops = perf.device_peak_flops(device, self.hardware)  # None: peak unknown
        self._flags: StepEnd | None = None  # the last step's agreement, for the boundary
        self._decision: tuple[int, Decision | None] | None = None  # (step, rank 0's decision)
        self.last_step_end: StepEnd | None = None
        self.gns = make_estimator(
            resolve_estimator(cfg.gns.estimator, cfg.batch.policy),
            ref_batch=cfg.batch.initial,
            decay=cfg.gns.decay,
            decay_late=cfg.gns.decay_late,
            decay_switch_tokens=cfg.gns.decay_switch_tokens,
        )
        self.lr: LearningRate = build_learning_rate(cfg.train, cfg.batch.initial, self.shape.seq_len)
        self.progress = Progress()
        self.prober = Prober.from_config(cfg)  # gns.calibration = "probe" (runtime/train/probe.py)
        self.mesh_cache = MeshCache(self.device.type)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.boundary = stop.Boundary(stop.request, cfg.checkpoint.interval_s)
        self.engine: Any = None  # built by resume() under the plan it chooses
        self.failed_saves = self.total_failed_saves = 0  # interval saves that failed
        self.saver = AsyncCheckpointer() if cfg.checkpoint.background else None
        self._remove_stale_stages()
        self.memory.clear_marker()  # before any collective
        if not ((resume or auto_resume) and self.resume(required=resume)):
            if policy_factory is None:
                self._start_on_planned()
            self.engine = self._make_engine(self.plan, init=not self.cfg.model.init_from)
            self._init_from_hf()
        self.memory.check(self.plan)
        self.memory.start_watch()

    # -- construction -------------------------------------------------------------------------

    def _make_policy(self, plan: ParallelPlan):
        """The configured policy from `plan`, bounded by the device's memory."""
        policy = make_run_policy(
            self.cfg,
            plan,
            self.world,
            self.shape,
            self.hardware,
            memory_capacity_bytes=self.memory.capacity,
            memory_model=self.memory.model,
        )
        self.memory.forbid_in(policy)
        return policy

    def _start_on_planned(self) -> None:
        """controller.start = "planned": a fresh goodput run starts on the controller's fastest
        plan at batch.initial (`Controller.start_plan`; a configured parallel.micro_batch_size
        is kept), not on the configured one. Rank 0's choice is broadcast, so that ranks whose
        step-time priors differ (e.g. hosts with other core counts) build one engine."""
        start_plan = getattr(self.policy, "start_plan", None)
        if self.cfg.controller.start != "planned" or start_plan is None:
            return
        box = [start_plan(self.cfg.parallel.micro_batch_size or None)]
        if self.world > 1:
            dist.broadcast_object_list(box, src=0)
        plan = self.memory.feasible(box[0])
        if plan == self.plan:
            return
        self.log(
            f"start plan {plan.describe()} (the controller's fastest at batch.initial; "
            f"controller.start='initial' keeps {self.plan.describe()})"
        )
        self.plan, self.policy = plan, self._make_policy(plan)

    def _remove_stale_stages(self) -> None:
        """Each host's first local rank deletes the switch staging folders that killed workers
        of this host left (in /dev/shm they would hold RAM until reboot)."""
        if int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return
        from copus.runtime.state import reconfigure as rc

        for root in (rc.SHM_ROOT, self.run_dir):
            for path in rc.remove_stale_stages(root):
                self.log(f"removed staging folder {path} left by a killed worker")

    def _make_engine(self, plan: ParallelPlan, allocate: bool = True, init: bool = True):
        """An engine for `plan`; `init=False` draws no initial weights (a load follows)."""
        from copus.runtime.engine.engine import Engine, settings_from_config

        settings = settings_from_config(self.cfg, ip_extras=self.cfg.batch.policy == "inner-product-test")
        return Engine(
            self.shape,
            plan,
            settings,
            self.device,
            self.mesh_cache,
            seed=self.cfg.train.seed,
            allocate=allocate,
            init=init,
        )

    def _init_from_hf(self) -> None:
        """model.init_from: this rank's shards of a Hugging Face folder's weights (a fresh start
        only: a resumed run loads its checkpoint)."""
        if not self.cfg.model.init_from:
            return
        from copus.runtime.state.hf_import import load_hf_weights

        read = load_hf_weights(self.engine.model, self.cfg.model.init_from)
        self.log(f"init from {self.cfg.model.init_from}: {read / 2**20:.1f} MiB of weights read by rank {self.rank}")

    def _open_trackers(self) -> list:
        """W&B / MLflow runs on rank 0 when log.wandb / log.mlflow enable them."""
        if self.rank != 0 or not (self.cfg.log.wandb or self.cfg.log.mlflow):
            return []
        from copus.config import config_to_dict
        from copus.runtime.state.trackers import open_trackers

        return open_trackers(self.cfg.log, self.run_dir, config_to_dict(self.cfg))

    def _make_writer(self):
        from copus.runtime.state.metrics import RunWriter

        cfg = self.cfg
        writer = RunWriter(
            self.run_dir,
            rank0=self.rank == 0,
            tensorboard=cfg.log.tensorboard,
            progress=cfg.log.progress,
            total_steps=cfg.train.max_steps,
            total_tokens=cfg.train.max_tokens,
            progress_interval_s=cfg.log.progress_interval_s,
            trackers=self._open_trackers(),
        )
        writer.write_config(cfg)
        if self.rank == 0:  # present even when the policy never decides
            (self.run_dir / "decisions.jsonl").touch()
            from copus.runtime.data.run_data import save_tokenizer

            save_tokenizer(self.run_dir, self.tokenizer)  # for copus export
        return writer

    def log(self, message: str) -> None:
        if self.rank == 0:
            self.writer.console(f"copus: {message}")

    # -- main loop ----------------------------------------------------------------------------

    def done(self) -> bool:
        t, p = self.cfg.train, self.progress
        return (t.max_steps > 0 and p.step >= t.max_steps) or (t.max_tokens > 0 and p.tokens >= t.max_tokens)

    def run(self) -> dict:
        """Train until max_steps / max_tokens; checkpoint at the end; return the summary."""
        cfg = self.cfg
        if self.done():
            self.log(
                f"nothing to do: step {self.progress.step}, {self.progress.tokens} tokens "
                "already reach train.max_steps / train.max_tokens"
            )
            return self.finish()
        while not self.done():
            signum, checkpoint_due = self.boundary_flags()
            if signum:
                return stop.graceful_stop(self, signum)
            if checkpoint_due and self.boundary.saved_step != self.progress.step:
                self.periodic_checkpoint()
            with stall_dump():  # a rank left waiting in a collective shows where (watchdog.py)
                record = self.memory.guarded(self.train_step, self._where)
            step = record.step
            if cfg.eval.interval_steps and step % cfg.eval.interval_steps == 0:
                self.memory.guarded(self.evaluate, self._where)
            decision = self.decide(record)
            if self.prober is not None and self.prober.due(self, decision):
                self.prober.run(self, decision)  # continues from the best branch
                decision = None
            if decision is not None:  # before the checkpoint: it holds the new plan
                with stall_dump():
                    self.apply_decision(decision)
            if cfg.checkpoint.interval_steps and step % cfg.checkpoint.interval_steps == 0:
                self.periodic_checkpoint()
        if cfg.eval.interval_steps and self.progress.step % cfg.eval.interval_steps:
            self.evaluate()
        if not (cfg.checkpoint.interval_steps and self.progress.step % cfg.checkpoint.interval_steps == 0):
            self.save_checkpoint()
        return self.finish()

    def _where(self) -> tuple[ParallelPlan, int]:
        """The plan and step an out-of-memory error happened at (`MemoryGuard.guarded`)."""
        return self.plan, self.progress.step + 1

    def eval_rows(self) -> int:
        """Validation rows per dp rank: about eval.num_samples / dp, a multiple of the engine's
        eval micro-batch min(micro_batch_size, rows), and ≥ pp micro-batches under a pipeline."""
        from copus.runtime.data.run_data import eval_rows

        plan = self.plan
        return eval_rows(
            max(self.cfg.eval.num_samples // plan.dp, 1), len(self.val_set), plan.dp, plan.micro_batch_size, plan.pp
        )

    def evaluate(self) -> float:
        """Mean loss on the fixed validation subset: the first dp·eval_rows() windows."""
        from copus.runtime.data.run_data import eval_note

        rows, dp = self.eval_rows(), self.plan.dp
        note = eval_note(rows, dp, len(self.val_set), self.cfg.eval.num_samples)
        if note != self.val_note and note is not None:
            self.log(note)  # once (again only if it changes with the plan)
        self.val_note = note
        if rows <= 0:
            return math.nan
        local = np.arange(rows * dp).reshape(dp, rows)[self.engine.dp_rank]
        tokens = torch.from_numpy(self.val_set.batch(local).astype(np.int64)).to(self.device)
        loss = float(self.engine.eval_loss(tokens))
        self.writer.log_eval(
            self.progress.step, loss, samples=self.progress.samples, tokens=self.progress.tokens, num_samples=rows * dp
        )
        return loss

    # -- end ----------------------------------------------------------------------------------

    def finish(self) -> dict:
        self.wait_for_checkpoint()  # the last interval save is on disk before "finished"
        p = self.progress
        summary = {
            "steps": p.step,
            "samples": p.samples,
            "tokens": p.tokens,
            "num_skipped": p.num_skipped,
            "train_s": p.train_s,
            "failed_saves": self.total_failed_saves,
            "final_plan": plan_to_dict(self.plan),
            "b_noise": _json_float(self.gns.b_noise),
        }
        self.writer.summary(
            num_skipped=p.num_skipped, train_s=p.train_s, final_plan=plan_to_dict(self.plan), val_note=self.val_note
        )
        self.writer.set_state(
            "finished" if self.done() else "stopped", step=p.step, checkpoint=self.boundary.checkpoint_name()
        )
        return summary

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()
        self.memory.close()
        self.writer.close()
        self.engine.close()


def _json_float(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None
