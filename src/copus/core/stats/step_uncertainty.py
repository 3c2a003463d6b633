"""How sure the goodput controller is of a step time: the throughput side's confidence bound.

The statistical side acts on a lower confidence bound of φ (`core.gns.lower_bound`, issue 14).
This module gives the throughput side the same treatment (docs/statistics.md §7). A decision
compares goodput(best) with goodput(current). Both step times are uncertain:

- **measured plan**: the median of its n kept step times. Its relative standard error is
  se = 1.2533 · σ / √n (the median's efficiency against the mean for a normal sample;
  Kenney & Keeping 1962), with σ = 1.4826 · MAD / median (the robust relative spread of one
  step). A plan measured for only a few probe steps can show a tiny MAD by chance, so σ is
  floored at the spread of the current plan (`noise_floor`), which has the most steps and
  measures what the machine does now.
- **unmeasured plan**: the model's prediction. Its error is what the model's predictions
  missed by when they were checked: `realised / predicted − 1` of every probe and audit so
  far (out of sample: each prediction was made before the plan ran). The median absolute miss;
  `PRIOR_MODEL_ERROR` before the first check.

The log goodput ratio then has standard deviation u = sqrt(u_current² + u_best²) (independent
errors; relative errors ≈ log errors when small), and the controller switches only when

    gain > margin + z · u

z = `controller.step_confidence` (1.645: a one-sided 95 % bound; 0 = COPUS's rule, the
margin alone). With a stable machine and a model that predicted well, u → 0 and the rule is
COPUS's. On a noisy machine it refuses the switches that the noise alone would justify.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

PRIOR_MODEL_ERROR = 0.10  # before any prediction was checked: the planner's typical miss
MEDIAN_EFFICIENCY = 1.2533  # sqrt(pi/2): se(median) / se(mean) for a normal sample
MAD_TO_SIGMA = 1.4826  # sigma = 1.4826 * MAD for a normal sample


def relative_spread(times: Sequence[float]) -> float:
    """σ/median of one step time, robustly: 1.4826 · MAD / median; NaN with < 2 times."""
    x = np.asarray([t for t in times if math.isfinite(t) and t > 0], dtype=float)
    if x.size < 2:
        return float("nan")
    med = float(np.median(x))
    return MAD_TO_SIGMA * float(np.median(np.abs(x - med))) / med


def median_error(times: Sequence[float], noise_floor: float = 0.0) -> float:
    """Relative standard error of the median of `times`: 1.2533 · max(σ, floor) / √n."""
    n = sum(1 for t in times if math.isfinite(t) and t > 0)
    if n == 0:
        return float("nan")
    sigma = relative_spread(times)
    sigma = noise_floor if not math.isfinite(sigma) else max(sigma, noise_floor)
    return MEDIAN_EFFICIENCY * sigma / math.sqrt(n)


def model_error(misses: Sequence[float], prior: float = PRIOR_MODEL_ERROR) -> float:
    """The model's out-of-sample relative error: median |realised/predicted − 1| of its
    checked predictions; `prior` before the first."""
    m = [abs(x) for x in misses if math.isfinite(x)]
    return float(np.median(m)) if m else prior


def required_gain(margin: float, u_current: float, u_best: float, z: float) -> float:
    """margin + z · sqrt(u_current² + u_best²): the gain a switch must show (module docstring)."""
    if margin < 0 or z < 0:
        raise ValueError(f"margin={margin}, z={z} are invalid; allowed: both >= 0")
    u = math.hypot(u_current if math.isfinite(u_current) else 0.0, u_best if math.isfinite(u_best) else 0.0)
    return margin + z * u
