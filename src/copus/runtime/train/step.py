"""One training step of a rank and the agreement at its end: the per-step hot path.

`StepMixin` (a part of `Trainer`): the step's global sample ids and this rank's slice, the timed
`Engine.train_step`, the GNS update, the `StepRecord`, rank 0's policy observing it, and ONE
all-reduce MAX at the end (`StepEnd`: slowest step time, peak memory, stop signal, checkpoint
due, decided); the decision is broadcast only when one was taken (`decide`). At most 2 blocking
host syncs on a step without evaluation, checkpoint or decision (tests/runtime/test_host_syncs.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from copus.core.plan.plan import ParallelPlan
from copus.core.plan.records import Decision, StepRecord
from copus.runtime.train import perf
from copus.runtime.train.progress import TrainingError


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


class StepMixin:
    """The step methods of `Trainer` (runtime/train/trainer.py), which builds the state they
    use: cfg, engine, plan, shape, sampler, train_set, lr, gns, policy, progress, writer,
    boundary, device, rank, world, peak_flops, on_batch, blind_plans, the last step's agreement
    (`_flags`, `_decision`, `last_step_end`) and `log`."""

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


def _device_memory(end: StepEnd) -> dict:
    """The metrics row's CUDA-only memory fields (absent off CUDA)."""
    if end.peak_reserved_bytes < 0:
        return {}
    return {"peak_reserved_bytes": int(end.peak_reserved_bytes), "device_used_bytes": int(end.device_used_bytes)}
