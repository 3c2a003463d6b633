"""`gns.calibration = "probe"`: the trainer measures `c` itself with a short branch probe.

(Before issue 26 this was "auto"; "auto" now learns c without extra compute from the loss
around the run's own batch changes, core/stats/calibration_posterior.py.)

At the first step where the policy wants to grow the global batch, and then every
`gns.probe_interval_tokens` tokens, the trainer branches its current state at `k·B` for each
`gns.probe_multipliers` (runtime/train/branching.py: same samples — the run's own next ones —, same
tokens `gns.probe_tokens`, the run's LR rule applied to `k`, the same validation windows), then:

- fits B_noise over the branches' loss drops (McCandlish et al. 2018, Eq. 2.7; `core/critical_batch`)
  and sets the policy's calibration to the measured `c = B_noise_fit / b_noise` (online estimate
  at the probe's start) when the fit is finite; the prior is `AUTO_PRIOR` (1.0) until then;
- continues from the branch whose smoothed validation loss is lowest: its model, optimizer,
  progress (the global sample offset), GNS and LR state become the run's, and its steps are
  written to metrics.jsonl as ordinary steps. Its tokens are not wasted; the other branches'
  are the probe's cost. Every branch trained on the same samples [offset, offset + n), and the
  run continues at offset + n: each sample still trains the kept model exactly once.

The pending decision that triggered the probe is dropped (the probe already chose the batch);
the policy sees the chosen plan in the next step's record. Each probe is one decisions.jsonl
line (kind "batch" with a "probe" entry: what, when, measured, chosen, cost in seconds and
tokens; `switch_s` is the whole probe).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from copus.core.stats.critical_batch import fit_b_noise, measured_calibration, parse_probe_multipliers
from copus.core.control.policies import AUTO_CALIBRATION_PRIOR as AUTO_PRIOR  # noqa: F401 (c before the first probe: McCandlish's B_crit ≈ B_noise ≈ B_simple)
from copus.core.plan.records import Decision


def set_calibration(policy, c: float) -> bool:
    """Set `calibration` on the policy (or the policy a layout map wraps); whether it has one."""
    for target in (policy, getattr(policy, "inner", None)):
        if target is not None and hasattr(target, "calibration"):
            target.calibration = float(c)
            return True
    return False


@dataclass(slots=True, kw_only=True)
class Prober:
    """When to probe, and the measured `c` (saved in checkpoints as `state_dict`)."""

    multipliers: list[float]
    tokens: int
    interval_tokens: int
    c: float | None = None
    next_tokens: int | None = None  # None: waiting for the first growth
    history: list[dict] = field(default_factory=list)

    @classmethod
    def from_config(cls, cfg) -> Prober | None:
        g = cfg.gns
        if g.calibration != "probe":
            return None
        return cls(
            multipliers=parse_probe_multipliers(g.probe_multipliers),
            tokens=g.probe_tokens,
            interval_tokens=g.probe_interval_tokens,
        )

    def due(self, trainer, decision: Decision | None) -> bool:
        """First growth wanted, or the interval since the last probe has passed; and the
        probe fits in what is left of the run (train.max_tokens)."""
        p = trainer.progress
        if self.next_tokens is None:
            wanted = decision is not None and (decision.plan.global_batch_size > trainer.plan.global_batch_size)
        else:
            wanted = self.interval_tokens > 0 and p.tokens >= self.next_tokens
        left = trainer.cfg.train.max_tokens - p.tokens
        return wanted and (trainer.cfg.train.max_tokens <= 0 or left >= self.tokens)

    def run(self, trainer, trigger: Decision | None = None) -> dict:
        """Probe from the trainer's state, keep the best branch, set the measured c."""
        from copus.runtime.train import branching as br

        t0 = time.perf_counter()
        staged = br.stage(trainer)
        base = staged.plan.global_batch_size
        ks, batches = [], []
        for k in self.multipliers:  # skip k·B no plan of this layout can run
            try:
                plan = br.branch_plan(staged.plan, k * base, trainer.world, trainer.shape)
            except ValueError:
                continue
            if plan.global_batch_size <= trainer.cfg.batch.max:
                ks.append(k)
                batches.append(plan.global_batch_size)
        n = br.branch_samples(batches, self.tokens, trainer.shape.seq_len)
        marks = br.mark_samples(n, batches, 4)
        rows = br.fixed_eval_rows(trainer)
        start_loss = br.eval_loss(trainer, staged.plan, rows)
        b_noise = float(trainer.gns.b_noise)
        results, best, best_state = [], None, None
        for k, b in zip(ks, batches):
            spec = br.BranchSpec(
                multiplier=k, global_batch_size=b, repeat=0, offset=staged.progress["samples"], num_samples=n
            )
            res = br.run_branch(trainer, staged, spec, marks=marks, eval_rows=rows)
            results.append(res)
            if best is None or res.smoothed_loss < best.smoothed_loss:
                if best_state is not None:
                    best_state.close()
                best, best_state = res, br.stage(trainer)
        br.restore(trainer, best_state)
        best_state.close()
        staged.close()
        fit = fit_b_noise({float(r.spec.global_batch_size): start_loss - r.smoothed_loss for r in results})
        c = measured_calibration(fit.b_noise, b_noise)
        if math.isfinite(c):
            self.c = c
            set_calibration(trainer.policy, c)
        for record in best.records:
            trainer.writer.log_step(record)
        seq = trainer.shape.seq_len
        cost_s = time.perf_counter() - t0
        entry = {
            "step": staged.progress["step"],
            "tokens": staged.progress["tokens"],
            "trigger": trigger.reason if trigger is not None else "interval",
            "base_batch": base,
            "start_loss": start_loss,
            "b_noise_online": b_noise,
            "branches": [r.to_dict() for r in results],
            "b_noise_fit": fit.b_noise,
            "measured_c": c,
            "c_used": self.c,
            "chosen_batch": best.spec.global_batch_size,
            "chosen_multiplier": best.spec.multiplier,
            "cost_s": cost_s,
            "cost_tokens": sum(r.tokens for r in results) - best.tokens,
            "branch_tokens": n * seq,
        }
        self.history.append({k: v for k, v in entry.items() if k != "branches"})
        self.next_tokens = trainer.progress.tokens + self.interval_tokens
        decision = Decision(
            kind="batch",
            plan=trainer.plan,
            step=staged.progress["step"],
            reason=f"probe k={','.join(f'{k:g}' for k in ks)}: chose "
            f"B={best.spec.global_batch_size}, measured c={c:.3g}",
        )
        trainer.writer.log_decision(decision, applied=True, switch_s=cost_s, probe=entry)
        trainer.log(f"step {entry['step']}: {decision.reason} ({cost_s:.1f} s, {entry['cost_tokens']} extra tokens)")
        return entry

    def state_dict(self) -> dict:
        return {"c": self.c, "next_tokens": self.next_tokens, "history": list(self.history)}

    def load_state_dict(self, state: dict, policy=None) -> None:
        self.c = state.get("c")
        self.next_tokens = state.get("next_tokens")
        self.history = list(state.get("history", []))
        if policy is not None and self.c is not None:
            set_calibration(policy, self.c)
