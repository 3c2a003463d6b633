"""Applying a decision at a step boundary: a batch change in the running engine, or a layout
switch (`reconfigure`) in the same processes or through a checkpoint.

`SwitchMixin` (a part of `Trainer`): every outcome, applied or refused, goes to decisions.jsonl
with its reason; a layout switch's measured cost (slowest rank) goes to the policy.
"""

from __future__ import annotations

import time

from copus.core.plan.plan import ParallelPlan, plan_problems
from copus.core.plan.records import Decision
from copus.runtime.state import checkpoint as ckpt
from copus.runtime.train import perf


class SwitchMixin:
    """The plan-switching methods of `Trainer` (runtime/train/trainer.py), which builds the
    state they use: cfg, engine, plan, shape, world, memory, lr, gns, policy, writer, progress,
    mesh_cache, run_dir, device, and its `_make_engine`, `dcp_state` and `save_checkpoint`."""

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
