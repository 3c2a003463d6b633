"""Step times measured by `copus profile`, read back as (plan, step_s) pairs for the controller.

`copus profile` writes one JSON row per plan (dp, tp, pp, micro_batch_size, num_microbatches,
step_s = the median of its timed steps, step_s_all = every timed step). A goodput run given
that file (`controller.profile`) ranks the profiled plans by these measured medians instead of
its step-time model (COPUS §4.4: a measured table with the model as fallback). Pure logic.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from copus.core.plan.plan import ParallelPlan

KEYS = ("dp", "tp", "pp", "micro_batch_size", "num_microbatches", "step_s")


def profile_observations(
    rows: list[dict], world_size: int, source: str = "profile"
) -> list[tuple[ParallelPlan, float]]:
    """(plan, median step seconds) of every row; one-line ValueError naming the bad row."""
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{source}: allowed: a non-empty JSON list of `copus profile` rows")
    out = []
    for i, row in enumerate(rows):
        missing = [k for k in KEYS if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(
                f"{source} row {i}: missing {', '.join(missing)}; allowed: rows written by `copus profile`"
            )
        dp, tp, pp = (int(row[k]) for k in ("dp", "tp", "pp"))
        if dp * tp * pp != world_size:
            raise ValueError(
                f"{source} row {i}: dp*tp*pp={dp * tp * pp} (dp={dp}, tp={tp}, pp={pp}); "
                f"allowed: the run's world size {world_size}"
            )
        step_s = float(row["step_s"])
        if not (math.isfinite(step_s) and step_s > 0):
            raise ValueError(f"{source} row {i}: step_s={row['step_s']!r}; allowed: a number > 0")
        plan = ParallelPlan(
            dp=dp,
            tp=tp,
            pp=pp,
            micro_batch_size=int(row["micro_batch_size"]),
            num_microbatches=int(row["num_microbatches"]),
        )
        out.append((plan, step_s))
    return out


def read_profile(path: str | Path, world_size: int) -> list[tuple[ParallelPlan, float]]:
    """`profile_observations` of a profile.json file; one-line ValueError when unreadable."""
    p = Path(path)
    try:
        rows = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"controller.profile={str(path)!r}: no such file; allowed: a profile.json written by `copus profile`"
        ) from None
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(
            f"controller.profile={str(path)!r}: not readable JSON ({err}); "
            "allowed: a profile.json written by `copus profile`"
        ) from None
    return profile_observations(rows, world_size, source=f"controller.profile={str(path)!r}")
