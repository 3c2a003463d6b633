"""The trainer's memory safety (issue 23): the bound every plan is chosen under, and what an
out-of-memory error does.

- Bound: the memory model (`core/cost/memory.py`, in the runtime's precision) at the device's
  real capacity less `parallel.memory_margin` (`perf.memory_capacity_bytes`); the goodput
  controller prunes its candidates with it, and a start plan predicted over it gets one line.
- Out of memory (`torch.OutOfMemoryError` in a step or an evaluation, any rank): the plan goes to
  `<run_dir>/infeasible.jsonl`, one line names it and its micro-batch, and every rank stops
  within about a second (`runtime/state/infeasible.py`: the failing rank exits, `OomWatch` ends
  the others). A resume or elastic restart replaces a recorded plan by the same batch with a
  smaller micro-batch (`feasible`), the controller drops it (`forbid_in`) and a decision for it
  is refused (`is_infeasible`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from copus.core.plan.plan import ParallelPlan
from copus.core.specs.models import ModelShape
from copus.runtime.state import infeasible
from copus.runtime.train import perf

__all__ = ["MemoryGuard"]


class MemoryGuard:
    """One rank's view: the memory model, the usable bytes, the plans this run found infeasible."""

    def __init__(
        self,
        cfg,
        shape: ModelShape,
        device: torch.device,
        hardware,
        run_dir: Path,
        *,
        rank: int,
        world: int,
        log: Callable[[str], None],
        error: type[Exception] = RuntimeError,
    ) -> None:
        """`error`: what a stop on one rank raises (the trainer's TrainingError)."""
        self.model = perf.runtime_memory_model(cfg, shape, device.type)
        self.capacity = perf.memory_capacity_bytes(
            device, hardware, cfg.parallel.memory_budget_gb, cfg.parallel.memory_margin
        )
        self.margin = cfg.parallel.memory_margin
        self.run_dir, self.rank, self.world, self.log, self.error = run_dir, rank, world, log, error
        self.bad = infeasible.load(run_dir)  # plans that ran out of memory in this run
        self.watch: infeasible.OomWatch | None = None

    # -- before and between steps ---------------------------------------------------------------

    def feasible(self, plan: ParallelPlan) -> ParallelPlan:
        """`plan`, or its fallback when an out-of-memory event of this run covers it (the same
        layout and batch with a smaller micro-batch, `infeasible.fallback_plan`)."""
        if not self.bad:
            return plan
        new = infeasible.fallback_plan(plan, self.bad)
        if new is None:
            raise self.error(
                f"plan {plan.describe()} ran out of device memory earlier in this run "
                f"({self.run_dir / infeasible.RECORD_FILE}) and no smaller "
                "micro-batch remains; allowed: a plan with less memory per rank "
                "(more tp/pp, activation checkpointing)"
            )
        if new != plan:
            self.log(f"plan {plan.describe()} ran out of memory earlier in this run: {new.describe()} instead")
        return new

    def is_infeasible(self, plan: ParallelPlan) -> bool:
        return infeasible.is_infeasible(plan, self.bad)

    def forbid_in(self, policy: Any) -> None:
        """The goodput controller never chooses a plan that ran out of memory here."""
        forbid = getattr(policy, "forbid", None)
        if forbid is not None and self.bad:
            forbid(self.is_infeasible)

    def check(self, plan: ParallelPlan) -> None:
        """One line when the memory model predicts `plan` over the usable memory."""
        need = perf.predicted_memory_bytes(self.model, plan)
        if need > self.capacity:
            self.log(
                f"plan {plan.describe()} is predicted to need {need / 2**30:.1f} GiB per "
                f"rank, over the {self.capacity / 2**30:.1f} GiB usable "
                f"(parallel.memory_margin={self.margin}); it may run out of memory"
            )

    def start_watch(self) -> None:
        """Every rank of a multi-rank run: end this process when another rank ran out of memory.
        Rank 0 removed an earlier attempt's marker before its first collective (`clear_marker`)."""
        if self.world > 1:
            self.watch = infeasible.OomWatch(self.run_dir, self.rank).start()

    def clear_marker(self) -> None:
        if self.rank == 0:
            (self.run_dir / infeasible.STOP_FILE).unlink(missing_ok=True)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()

    # -- during a step ----------------------------------------------------------------------------

    def guarded(self, fn: Callable[[], Any], where: Callable[[], tuple[ParallelPlan, int]]) -> Any:
        """`fn()`, with an out-of-memory error turned into a stop of every rank; `where()` gives
        the plan and the step it happened at."""
        try:
            return fn()
        except torch.OutOfMemoryError as err:
            plan, step = where()
            self.out_of_memory(plan, step, err)
            raise  # not reached

    def out_of_memory(self, plan: ParallelPlan, step: int, err: BaseException) -> None:
        """Print one line, record `plan`, end this rank (one rank: raise `error`). The line goes
        out before the record: the record is what ends the peers (`OomWatch`), and the elastic
        agent then kills this rank too, which could otherwise happen before the line is out."""
        line = (
            f"copus: rank {self.rank} ran out of device memory at step {step} under plan "
            f"{plan.describe()} (micro-batch {plan.micro_batch_size}, "
            f"{plan.num_microbatches} micro-batches; predicted "
            f"{perf.predicted_memory_bytes(self.model, plan) / 2**30:.1f} GiB of "
            f"{self.capacity / 2**30:.1f} GiB usable); recorded as infeasible in "
            f"{self.run_dir / infeasible.RECORD_FILE}, a resume will not pick it again"
        )
        if self.world > 1:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        infeasible.record(self.run_dir, plan, step=step, rank=self.rank, message=str(err))
        if self.world == 1:
            raise self.error(line.removeprefix("copus: ")) from None
        os._exit(infeasible.EXIT_CODE)  # peers are blocked in a collective: OomWatch ends them
