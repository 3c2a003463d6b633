"""The simulator truth's local effective c: the c that E(B) alone would need to match the truth's
progress per sample between two batches, over the run (docs/robust-goodput.md §6.35). Under the
`lr-tuned` truth it is the truth's c everywhere; under `sqrt-lr` the sqrt rule's LR gain adds to it.

    PYTHONPATH=src python bench/effective_c.py 32b-32xh100 sqrt-lr
"""

from __future__ import annotations

import argparse
import math
import sys

from copus.commands.simulate import _preset
from copus.core.sim.presets import get_preset
from copus.core.sim.trajectory import Trajectory

PAIRS = ((16, 32), (26, 52), (35, 70))
LOSSES = (9.0, 7.0, 5.5, 4.5, 4.0, 3.6, 3.3)


def effective_ratio(traj: Trajectory, loss: float, b1: float, b2: float) -> tuple[float, float]:
    """(r, c_eff/c): r = the progress per sample at b2 over b1; c_eff solves (c_eff·B_crit/c + b1)/
    (c_eff·B_crit/c + b2) = r (McCandlish et al. 2018 Eq. 2.11's E(B) ratio; inf when r ≥ 1)."""
    r = (traj.progress_per_step(b2, loss) / b2) / (traj.progress_per_step(b1, loss) / b1)
    bce = (b1 - r * b2) / (r - 1.0) if r < 1.0 else math.inf
    return r, bce / traj.critical_batch(loss)


def main() -> int:
    preset, truth = sys.argv[1], sys.argv[2]
    args = argparse.Namespace(truth="fitted", crit_ratio=None, seed=0, reconfig="online", no_lr_aware=False)
    sc = _preset(get_preset(preset), args, truth, 1.0, 0)
    traj = Trajectory(sc.sim.trajectory, sc.shape.seq_len)
    print(f"{preset} {truth}: x0 {sc.sim.trajectory.lr_fraction_x0}")
    for loss in LOSSES:
        cols = []
        for b1, b2 in PAIRS:
            r, ratio = effective_ratio(traj, loss, b1, b2)
            cols.append(f"{b1}->{b2}: r {r:.3f} c_eff/c {ratio:5.2f}")
        print(f"  loss {loss:4.1f} B_crit {traj.critical_batch(loss):7.1f}  " + "  ".join(cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
