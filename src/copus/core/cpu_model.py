"""Step time when ranks share cores (oversubscription: world > cores), issue 15 part 5.

`StepTimeModel` prices the critical path of one step as if every rank had its own processor:
with a pipeline, a stage idles during the fill and drain ((pp−1) stage-times per step). On a
CPU host with more ranks than cores, the ranks time-share the cores: an idle (bubbling or
waiting) rank gives its core to another one, and the step cannot end before the cores have done
all the ranks' work. So the step takes the longer of the two bounds,

    busy_s   = step_s − bubble_s            one rank's own work per step (compute, its share of
                                            the collectives, optimizer); a waiting rank blocks
                                            in gloo's socket read and uses no core
    shared_s = (world / cores) · busy_s     every rank's work spread over the cores
    step_s'  = max(step_s, shared_s)

(cf. the CPU lower bound `max(Σ_ranks CPU / cores, CPU of the busiest rank)` in
docs/plan-moves.md). With world ≤ cores it is `StepTimeModel` unchanged (shared_s = busy_s ≤
step_s). A smooth max `(a^κ + b^κ)^(1/κ)` fitted no better on the 4-rank profile (held-out
MAPE 10.2–10.6 % for κ = 3–16 vs 10.0 %) and would change the world ≤ cores case.
The coefficients are fitted by `core.fit.fit_model` as for the base model; `cores` is the
machine's (`os.cpu_count()` at the call site), not fitted.
"""

from __future__ import annotations

import numpy as np

from copus.core.hardware import HardwareProfile
from copus.core.models import ModelShape
from copus.core.throughput import StepTimeModel, StepTimeParams


class SharedCoreStepTimeModel(StepTimeModel):
    """`StepTimeModel` for `world` ranks time-sharing `cores` CPU cores (module docstring)."""

    def __init__(self, params: StepTimeParams, shape: ModelShape,
                 hardware: HardwareProfile | None = None, *, cores: int, **options) -> None:
        if not (isinstance(cores, int) and cores >= 1):
            raise ValueError(f"cores={cores!r} is invalid; allowed: an integer >= 1")
        super().__init__(params, shape, hardware, **options)
        self.cores = cores

    def with_params(self, params: StepTimeParams) -> SharedCoreStepTimeModel:
        return SharedCoreStepTimeModel(
            params, self.shape, self.hardware, cores=self.cores,
            world_size=self.world_size, dtype_bytes=self.dtype_bytes,
            param_bytes=self.param_bytes, activation_checkpointing=self.activation_checkpointing,
            reshard_after_forward=self.reshard_after_forward)

    def breakdown(self, dp, tp, pp, micro_batch_size, num_microbatches) -> dict[str, np.ndarray]:
        """The base terms plus "busy_s", "shared_s" and "critical_s"; "step_s" is the larger."""
        out = super().breakdown(dp, tp, pp, micro_batch_size, num_microbatches)
        world = np.asarray(dp, float) * np.asarray(tp, float) * np.asarray(pp, float)
        share = np.maximum(world / self.cores, 1.0)
        busy = out["step_s"] - out["bubble_s"]
        shared = share * busy
        out.update(busy_s=busy, shared_s=shared, critical_s=out["step_s"],
                   step_s=np.maximum(out["step_s"], shared))
        return out
