"""The run's checkpoints: saving (synchronous, in the background, at interval or at the end)
and resuming from the latest good one, under any plan and world size.

`CheckpointMixin` (a part of `Trainer`): what a checkpoint holds (`dcp_state`: the engine's
tensors; `trainer_state`: everything else, as JSON), interval saves that may fail without ending
the run, and `resume`, which replans for the world it finds (`runtime/state/elastic.py`) and
loads the tensors resharded (`runtime/state/checkpoint.py`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from copus.core.plan.plan import ParallelPlan
from copus.core.plan.records import Decision
from copus.runtime.state import checkpoint as ckpt
from copus.runtime.train.progress import Progress, TrainingError, plan_from_dict, plan_to_dict


class CheckpointMixin:
    """The checkpoint and resume methods of `Trainer` (runtime/train/trainer.py), which builds
    the state they use: cfg, engine, plan, shape, world, run_id, restarted, ckpt_dir, saver,
    boundary, failed_saves, progress, sampler, tokenizer, gns, policy, lr, prober, memory,
    mesh_cache, hardware, writer, and its `_make_engine` and `log`."""

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
        (`async_checkpoint.AsyncCheckpointer`); the previous background save is finished first (a
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
