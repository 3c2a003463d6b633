"""The training loop of one rank (design §1, §5, §6).

config → plan → Engine → per step: global sample ids (one offset for the whole run) → this dp
rank's slice → `Engine.train_step` → `GnsEstimator.update` → `StepRecord` → metrics line (rank 0)
→ `policy.observe` on rank 0 → `Decision` broadcast → applied at the step boundary:
a batch change calls `Engine.set_plan` and rescales the LR; a layout change ("reconfigure") is
switched in the same processes (`runtime/state/reconfigure.py`) or, with controller.switch="checkpoint",
through a checkpoint (save, rebuild the engine under the new plan, load resharded).
Eval every `eval.interval_steps` on a fixed validation subset, checkpoints every
`checkpoint.interval_steps` and at the end, `resume` from the latest good checkpoint under any plan.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from copus.config import Config
from copus.core.stats.gns_tracking import make_estimator, resolve_estimator
from copus.core.specs.models import ModelShape
from copus.core.specs.resolve import get_model_shape
from copus.core.plan.plan import ParallelPlan, plan_problems
from copus.core.plan.records import Decision, StepRecord
from copus.runtime.state import checkpoint as ckpt
from copus.runtime.train import perf, stop
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
from copus.runtime.train.watchdog import stall_dump
from copus.runtime.train.progress import Progress, plan_from_dict, plan_to_dict  # noqa: F401 (re-exported)


__all__ = [
    "Trainer",
    "TrainingError",
    "default_micro_batch_size",
    "initial_plan",
    "make_run_policy",
    "validate_before_launch",
]


class TrainingError(RuntimeError):
    """The run cannot continue (e.g. too many consecutive non-finite steps)."""


@dataclass(frozen=True, slots=True)
class StepEnd:
    """What the ranks agree on at the end of a step, in ONE all-reduce MAX (`Trainer.step_end`):
    the slowest rank's step time and peak memory, a pending stop signal, a due time-based
    checkpoint, and whether rank 0's policy took a decision (then, and only then, it is
    broadcast)."""

    step_s: float
    peak_memory_bytes: float
    signum: int
    checkpoint_due: bool
    decided: bool
    peak_reserved_bytes: float = -1.0  # CUDA: max reserved since the plan began; -1 = n/a
    device_used_bytes: float = -1.0  # CUDA: total − free (mem_get_info); -1 = n/a


# ------------------------------------------------------------------------------------ trainer

Hook = Callable[[int, np.ndarray, np.ndarray], None]
PolicyFactory = Callable[[Config, ParallelPlan, int, ModelShape], Any]


class Trainer:
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
        self.saver = ckpt.AsyncCheckpointer() if cfg.checkpoint.background else None
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

    def warn_blind(self, plan: ParallelPlan, num_small: int) -> None:
        """Say once per plan that it measures no noise scale: J = num_small < 2 small gradients
        (dp = 1 and one micro-batch), so b_noise holds its last value while the plan runs."""
        if num_small >= 2 or plan in self.blind_plans:
            return
        self.blind_plans.add(plan)
        self.log(
            f"{plan.describe()} measures no noise scale (dp*num_microbatches = {num_small}; the estimate needs "
            ">= 2 small gradients): b_noise holds its last value while it runs; use a smaller micro-batch"
        )

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

    def local_ids(self, global_ids: np.ndarray) -> np.ndarray:
        from copus.runtime.data.stream import local_slice

        return local_slice(global_ids, self.engine.dp_rank, self.plan.dp)

    def batch_to_device(self, rows: np.ndarray) -> torch.Tensor:
        """This rank's token rows on the device. CUDA: through pinned memory and a
        non-blocking copy (a copy from pageable memory waits for the stream: a host sync)."""
        tokens = torch.from_numpy(rows.astype(np.int64))
        if self.device.type == "cuda":  # CUDA only: asynchronous host-to-device copy
            return tokens.pin_memory().to(self.device, non_blocking=True)
        return tokens

    def step_once(
        self,
        on_ids: Callable[[np.ndarray, np.ndarray], None] | None = None,
        observe: Callable[[StepRecord], Decision | None] | None = None,
    ) -> tuple[StepRecord, float]:
        """One optimizer step on the next global batch, written nowhere: the B sample ids at the
        progress's offset, this rank's slice, the LR at the token count, the timed engine step,
        the progress counters and, on a finite step, the GNS update. The run (`train_step`)
        and a calibration branch (`runtime.branching`) both take this step.
        `on_ids(global_ids, local_ids)` sees the ids before the step; `observe` (rank 0: the
        policy) sees the record with this rank's step time before the ranks agree.

        Blocking host syncs (design: at most 2 on a step without logging or decision): the
        engine's statistics all-reduce read once (loss, Σ‖g_j‖², ‖ḡ‖²: it decides whether the
        optimizer runs), and `step_end`'s one all-reduce MAX after the optimizer's work is done
        (`perf.wait_for_device`: on CUDA the clock stops after the optimizer's kernels, not at
        their launch). The record's step_s is the slowest rank's. Returns the record and the
        gradient norm (logged beside it)."""
        p, plan = self.progress, self.plan
        B, seq = plan.global_batch_size, self.shape.seq_len
        global_ids = self.sampler.ids(p.samples, B)
        local = self.local_ids(global_ids)
        if on_ids is not None:
            on_ids(global_ids, local)
        tokens = self.batch_to_device(self.train_set.batch(local))
        lr = self.lr.lr(p.tokens)
        t0 = time.perf_counter()
        out = self.engine.train_step(tokens, lr)
        perf.wait_for_device(self.device)
        local_s = time.perf_counter() - t0
        p.step += 1
        p.samples += B
        p.tokens += B * seq
        finite = bool(out.finite)
        if finite:
            self.gns.update(out.small_sqnorm, out.small_batch, out.big_sqnorm, B, p.tokens)
            self.warn_blind(plan, int(out.num_small))
        else:
            p.num_skipped += 1
        g = self.gns
        record = StepRecord(
            step=p.step,
            samples=p.samples,
            tokens=p.tokens,
            plan=plan,
            step_s=local_s,
            loss=float(out.loss),
            lr=lr,
            small_sqnorm=float(out.small_sqnorm),
            small_batch=float(out.small_batch),
            num_small=int(out.num_small),
            big_sqnorm=float(out.big_sqnorm),
            ip_sq_mean=out.ip_sq_mean,
            grad_sqnorm=g.grad_sqnorm,
            grad_trace_cov=g.grad_trace_cov,
            b_noise=g.b_noise,
            b_noise_rel_err=g.rel_err,
            skipped=not finite,
        )
        decision = observe(record) if observe is not None and self.rank == 0 else None
        end = self.step_end(local_s, decided=decision is not None)
        self.last_step_end = end
        p.train_s += end.step_s
        if observe is not None:
            self._decision = (p.step, decision)
        return replace(record, step_s=end.step_s), float(out.grad_norm)

    def step_end(self, step_s: float, decided: bool = False) -> StepEnd:
        """The end-of-step agreement (`StepEnd`): one all-reduce MAX of [step_s, peak memory,
        stop signal, checkpoint due, decided] and one read; no collective on one rank."""
        signum, due = self.boundary.local()
        values = [
            step_s,
            float(perf.peak_memory_bytes(self.device)),
            float(signum),
            float(due),
            float(decided),
            *perf.device_memory_readings(self.device),
        ]
        if self.world > 1:
            t = torch.tensor(values, dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            values = t.tolist()
        return StepEnd(
            step_s=values[0],
            peak_memory_bytes=values[1],
            signum=int(values[2]),
            checkpoint_due=bool(values[3]),
            decided=bool(values[4]),
            peak_reserved_bytes=values[5],
            device_used_bytes=values[6],
        )

    def boundary_flags(self) -> tuple[int, bool]:
        """(stop signal, time-based checkpoint due) at this step boundary, identical on every
        rank: the last step's `step_end` carried them (no collective of its own); without one
        (the run's first step), `Boundary.poll`. A signal that arrives after a step's end is
        acted on at the next boundary."""
        flags, self._flags = self._flags, None
        if flags is None:
            return self.boundary.poll(self.device)  # runtime/train/stop.py
        return flags.signum, flags.checkpoint_due

    def train_step(self) -> StepRecord:
        """One optimizer step of the run (`step_once`), observed by rank 0's policy, logged
        with its MFU and peak memory, with the non-finite guard."""
        p = self.progress
        hook = None
        if self.on_batch is not None:
            step = p.step + 1
            hook = lambda global_ids, local: self.on_batch(step, global_ids, local)  # noqa: E731
        record, grad_norm = self.step_once(hook, observe=self._observe)
        self._flags = self.last_step_end
        p.nonfinite_streak = p.nonfinite_streak + 1 if record.skipped else 0
        tokens_per_s = (
            record.plan.global_batch_size * self.shape.seq_len / record.step_s if record.step_s > 0 else float("nan")
        )
        self.writer.log_step(
            record,
            tokens_per_s=tokens_per_s,
            grad_norm=grad_norm,
            small_sqnorm=record.small_sqnorm,
            big_sqnorm=record.big_sqnorm,
            num_small=record.num_small,
            small_batch=record.small_batch,
            mfu=perf.mfu(tokens_per_s, self.shape, self.world, self.peak_flops),
            peak_memory_bytes=int(self.last_step_end.peak_memory_bytes),
            **_device_memory(self.last_step_end),
        )
        if p.nonfinite_streak >= self.cfg.train.max_nonfinite_steps:
            raise TrainingError(
                f"{p.nonfinite_streak} consecutive non-finite steps (train.max_nonfinite_steps="
                f"{self.cfg.train.max_nonfinite_steps}) at step {p.step}; lower train.lr or "
                "resume from an earlier checkpoint"
            )
        return record

    def _observe(self, record: StepRecord) -> Decision | None:
        """Rank 0: the policy observes the step; its events go to decisions.jsonl."""
        decision = self.policy.observe(record)
        for row in getattr(self.policy, "drain_events", list)():
            self.writer.log_event(row)  # probe results and audits (core.explore, core.audit)
        return decision

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

    # -- decisions ----------------------------------------------------------------------------

    def decide(self, record: StepRecord) -> Decision | None:
        """The decision rank 0's policy took on `record` (in `train_step`), on every rank: it is
        broadcast only when there is one (`StepEnd.decided`), so a step without a decision
        costs no collective here. A record the policy has not seen is observed now (and the
        result broadcast)."""
        taken, self._decision = self._decision, None
        if taken is None or taken[0] != record.step:
            box: list[Decision | None] = [self._observe(record) if self.rank == 0 else None]
        elif not (self.last_step_end is not None and self.last_step_end.decided):
            return None
        else:
            box = [taken[1]]
        if self.world > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def _where(self) -> tuple[ParallelPlan, int]:
        """The plan and step an out-of-memory error happened at (`MemoryGuard.guarded`)."""
        return self.plan, self.progress.step + 1

    def apply_decision(self, decision: Decision) -> bool:
        """Switch to `decision.plan` at this step boundary; return whether it was applied.

        Batch change (same dp, tp, pp): `Engine.set_plan` + LR rule factor for the new batch.
        Layout change: `reconfigure` (controller.switch: in the same processes, or through a
        checkpoint) unless controller.allow_reconfigure is false, then refused. Its measured cost
        (slowest rank) goes to the policy's `record_switch_cost` when it has one. Every outcome
        goes to decisions.jsonl with its reason (and the switch's phases and memory).
        """
        new, old = decision.plan, self.plan
        problems = plan_problems(new, self.world, self.shape)
        if not problems and self.memory.is_infeasible(new):
            problems = ["it ran out of device memory earlier in this run"]
        if problems:
            self.writer.log_decision(decision, applied=False, note=f"refused: {problems[0]}")
            return False
        if new == old:
            return False
        switch: dict | None = None
        t0 = time.perf_counter()
        if new.layout == old.layout:
            self.engine.set_plan(new)
        elif not self.cfg.controller.allow_reconfigure:
            self.writer.log_decision(decision, applied=False, note="refused: controller.allow_reconfigure=false")
            return False
        else:
            switch = self.reconfigure(new)
        self.plan = new
        if new.global_batch_size != old.global_batch_size:
            self.lr.on_batch_change(
                new.global_batch_size,
                step=self.progress.step,
                grad_sqnorm=self.gns.grad_sqnorm,
                grad_trace_cov=self.gns.grad_trace_cov,
            )
        cost_s = time.perf_counter() - t0
        if switch is not None:
            cost_s = max(cost_s, switch["wall_s"])
            if self.rank == 0 and hasattr(self.policy, "record_switch_cost"):
                self.policy.record_switch_cost(cost_s)
        self.writer.log_decision(
            decision, switch_s=cost_s, applied=True, lr_factor=self.lr.factor, **({"switch": switch} if switch else {})
        )
        perf.reset_peak_memory(self.device)  # the new plan's peak is its own (not the switch's)
        how = "" if switch is None else f"; {switch['method']} switch {switch['wall_s']:.2f} s"
        self.log(f"step {self.progress.step}: {old.describe()} -> {new.describe()} ({decision.reason}){how}")
        return True

    def reconfigure(self, plan: ParallelPlan) -> dict:
        """New (dp, tp, pp) by controller.switch: "in-process" (`reconfigure.switch_engine`: shards
        moved directly between the layouts, or staged through DCP in /dev/shm or the run folder
        when that cannot apply) or "checkpoint"; returns the SwitchReport dict."""
        from copus.runtime.state import reconfigure as rc

        self.log(f"reconfigure {self.plan.describe()} -> {plan.describe()}: start")

        if self.cfg.controller.switch == "checkpoint":
            report = rc.timed_switch(
                "checkpoint", self.plan, plan, self.device, lambda: self.reconfigure_through_checkpoint(plan)
            )
        else:
            self.engine, report = rc.switch_engine(self.engine, plan, self._make_engine, fallback_root=self.run_dir)
        # after either path: the old layout's sub-groups (NCCL communicators and their buffers) go with it
        released = self.mesh_cache.release_except(dp=plan.dp, tp=plan.tp, pp=plan.pp)
        return {**report.to_dict(), "groups_released": released}

    def reconfigure_through_checkpoint(self, plan: ParallelPlan) -> None:
        """New (dp, tp, pp): save, rebuild the engine for `plan`, load resharded (DCP)."""
        path = self.save_checkpoint()
        self.engine.close()
        self.engine = self._make_engine(plan, init=False)  # the checkpoint fills it
        state = self.dcp_state()
        ckpt.load(path, state, check=False)
        self.engine.load_state(state["model"], state["optim"])

    # -- checkpoints --------------------------------------------------------------------------

    def dcp_state(self) -> dict[str, Any]:
        """The engine's (model, optimizer) state dicts: what DCP saves, or fills on load."""
        model_sd, optim_sd = self.engine.state_dicts()
        return {"model": model_sd, "optim": optim_sd}

    def trainer_state(self) -> dict:
        """Everything but tensors, as JSON data (rank 0's view)."""
        from copus.runtime.data.run_data import tokenizer_state

        return {
            "progress": asdict(self.progress),
            "plan": plan_to_dict(self.plan),
            "world_size": self.world,
            "sampler": {
                "offset": self.progress.samples,
                "seed": self.sampler.seed,
                "num_samples": self.sampler.num_samples,
            },
            "gns": self.gns.state_dict(),
            "policy": self.policy.state_dict(),
            "lr": self.lr.state_dict(),
            "rng": ckpt.rng_state(),
            "probe": self.prober.state_dict() if self.prober is not None else None,
            "model": self.cfg.model.name,
            "tokenizer": tokenizer_state(self.tokenizer, self.shape),
            "run_id": self.run_id,
        }

    def periodic_checkpoint(self) -> None:
        """An interval save that may fail (disk full, quota, I/O error) without ending the run:
        the failure is logged, the previous checkpoints stay intact (`checkpoint.save`), and
        training goes on; `checkpoint.max_failed_saves` failures in a row stop the run."""
        try:
            if self.saver is not None:
                self.background_checkpoint()
            else:
                self.save_checkpoint()
        except ckpt.CheckpointError as err:
            self.failed_saves += 1
            self.total_failed_saves += 1
            limit = self.cfg.checkpoint.max_failed_saves
            if self.failed_saves >= limit:
                raise TrainingError(
                    f"{self.failed_saves} checkpoint saves failed in a row "
                    f"(checkpoint.max_failed_saves={limit}); last: {err}"
                ) from None
            self.log(
                f"step {self.progress.step}: {err}; training continues "
                f"({self.failed_saves}/{limit} failed saves in a row)"
            )
            return
        self.failed_saves = 0

    def background_checkpoint(self) -> Path:
        """checkpoint.background: stage this step's state and write it while training goes on
        (`checkpoint.AsyncCheckpointer`); the previous background save is finished first (a
        failure of it is this call's CheckpointError)."""
        t0 = time.perf_counter()
        self.wait_for_checkpoint()
        path = self.saver.save(
            self.ckpt_dir, self.progress.step, self.dcp_state(), self.trainer_state(), keep=self.cfg.checkpoint.keep
        )
        self.log(f"checkpoint {path.name} staged in {time.perf_counter() - t0:.2f} s, writing in the background")
        self.boundary.saved(self.progress.step)
        return path

    def wait_for_checkpoint(self) -> None:
        """Finish the pending background save, if any (collective)."""
        if self.saver is not None and self.saver.pending:
            t0 = time.perf_counter()
            path = self.saver.wait()
            self.log(f"checkpoint {path.name} finished (waited {time.perf_counter() - t0:.2f} s)")

    def save_checkpoint(self) -> Path:
        t0 = time.perf_counter()
        self.wait_for_checkpoint()
        path = ckpt.save(
            self.ckpt_dir, self.progress.step, self.dcp_state(), self.trainer_state(), keep=self.cfg.checkpoint.keep
        )
        self.log(f"checkpoint {path.name} saved in {time.perf_counter() - t0:.2f} s")
        self.boundary.saved(self.progress.step)
        return path

    def resume(self, *, required: bool = True) -> bool:
        """Load the latest good checkpoint under any plan and world size; return whether one
        was loaded. `required`: none is a TrainingError (--resume). Otherwise only a checkpoint
        of this run is loaded (`same_run`), e.g. after torchrun restarted the workers because a
        host died or joined. The plan is `resume_plan`'s; the tensors are loaded resharded into
        an engine built for it (DCP); progress (the global sample offset), GNS, policy and LR
        state come back as saved, the RNG state only at the same world size.
        """
        problems: list[str] = []
        path = ckpt.agree_on_latest(self.ckpt_dir, self.log, problems)
        if path is None:
            if required:
                newest = f" (newest: {problems[0]}; {len(problems)} rejected, none deleted)" if problems else ""
                raise TrainingError(f"--resume: no valid checkpoint in {self.ckpt_dir}{newest}")
            return False
        state = json.loads((path / ckpt.TRAINER_STATE).read_text())
        if not required and not self.same_run(state):
            self.log(
                f"not resuming {path.name}: written by run {state.get('run_id')!r}, this "
                f"is {self.run_id!r} (pass --resume to continue it); starting at step 0"
            )
            return False
        from copus.runtime.data.run_data import check_resumed_tokenizer

        check_resumed_tokenizer(state.get("tokenizer"), self.tokenizer, str(path))
        saved = plan_from_dict(state["plan"])
        self.progress = Progress(**state["progress"])
        self.writer.supersede_after(self.progress.step)  # one row per step (metrics.py)
        self.boundary.saved(self.progress.step)
        self.gns.load_state_dict(state["gns"])
        self.policy.load_state_dict(state["policy"])
        self.lr.load_state_dict(state["lr"])
        if self.prober is not None and state.get("probe"):
            self.prober.load_state_dict(state["probe"], self.policy)
        decision = self.resume_plan(saved, int(state.get("world_size") or 0))
        self.engine_for(decision.plan if decision is not None else saved)
        tensors = self.dcp_state()
        ckpt.load(path, tensors, check=False)  # agree_on_latest verified it
        self.engine.load_state(tensors["model"], tensors["optim"])
        if state.get("world_size") == self.world:
            ckpt.set_rng_state(state["rng"])
        if self.plan.global_batch_size != saved.global_batch_size:
            self.lr.on_batch_change(
                self.plan.global_batch_size,
                step=self.progress.step,
                grad_sqnorm=self.gns.grad_sqnorm,
                grad_trace_cov=self.gns.grad_trace_cov,
            )
        if decision is not None:
            self.writer.log_decision(
                decision, applied=True, resumed_from=path.name, world_size=self.world, lr_factor=self.lr.factor
            )
            self.log(f"resume: {saved.describe()} -> {self.plan.describe()} ({decision.reason})")
        self.log(
            f"resumed from {path.name}: step {self.progress.step}, "
            f"{self.progress.tokens} tokens, plan {self.plan.describe()}"
        )
        return True

    def same_run(self, state: dict) -> bool:
        """Whether a checkpoint's trainer state belongs to this run: the same elastic run id
        (torchrun --rdzv-id), or, for a checkpoint without one, a restarted worker."""
        saved_id = state.get("run_id")
        if saved_id is not None and self.run_id is not None:
            return saved_id == self.run_id
        return self.restarted

    def engine_for(self, plan: ParallelPlan) -> None:
        """An engine for `plan` (its fallback if it ran out of memory earlier in this run):
        the current one if its layout matches, else a new one without initial weights (only
        `resume` calls this, and a checkpoint load follows)."""
        plan = self.memory.feasible(plan)
        if self.engine is not None and self.engine.plan.layout == plan.layout:
            self.engine.set_plan(plan)
        else:
            if self.engine is not None:
                self.engine.close()
            self.engine = self._make_engine(plan, init=False)
            self.mesh_cache.release_except(dp=plan.dp, tp=plan.tp, pp=plan.pp)
        self.plan = plan

    def resume_plan(self, saved: ParallelPlan, saved_world: int) -> Decision | None:
        """`runtime.elastic.resume_plan` for this run: None keeps the checkpoint's plan."""
        from copus.runtime.state.elastic import resume_plan

        return resume_plan(
            self.cfg,
            saved=saved,
            saved_world=saved_world,
            world=self.world,
            shape=self.shape,
            policy=self.policy,
            b_noise=self.gns.b_noise,
            initial=self.plan,
            hardware=self.hardware,
            step=self.progress.step,
        )

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


def _device_memory(end: StepEnd) -> dict:
    """The metrics row's CUDA-only memory fields (absent off CUDA)."""
    if end.peak_reserved_bytes < 0:
        return {}
    return {"peak_reserved_bytes": int(end.peak_reserved_bytes), "device_used_bytes": int(end.device_used_bytes)}


def _json_float(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None
