"""Trace the planning controller's batch moves on one simulator cell (seed 0), one line per move:
step, batch before, batch after, plan, posterior median / p05 / p95 of c, "EXP" for a VoI
experiment (docs/robust-goodput.md §6.9).

    PYTHONPATH=src python bench/planner_trace.py 32b-32xh100 lr-tuned 1 [0]   # last arg 0: VoI experiments off

TRUE_PHI=1 in the environment: every record carries the truth's noise scale instead of the
estimator's (a diagnostic: is a misread window the noise-scale estimate or the loss fit?).
KNOWN_C=1: c fixed at the value the estimator needs, R·1.3, as `bench/planner_grid.py --settings
'{"calibration_mode": "fixed", "calibration": "R*1.3"}'` runs it (docs/robust-goodput.md §6.26).
"""

import argparse
import os
import sys

import copus.core.control.experiments as em
import copus.core.control.planner as pm
import copus.core.sim.simulator as sim_module
from copus.commands.simulate import _preset
from copus.core.plan.records import StepRecord
from copus.core.sim.presets import get_preset
from copus.core.sim.compare import compare_policies
from copus.core.sim.scenario import Planner
from copus.core.sim.trajectory import Trajectory

preset, truth, ratio = sys.argv[1], sys.argv[2], float(sys.argv[3])
em.EXPERIMENTS = len(sys.argv) <= 4 or bool(int(sys.argv[4]))  # on by default since §6.29
log = []
_orig = pm.PlanningController._decide


def _decide(self, record, plan, why, purpose):
    post = self.posterior.summary() if self.posterior else {}
    log.append(
        (
            record.step,
            record.plan.global_batch_size,
            plan.global_batch_size,
            plan.describe(),
            *(round(post.get(k, 0.0), 2) for k in ("median", "p05", "p95")),
            "EXP" if "experiment:" in why else "",
        )
    )
    return _orig(self, record, plan, why, purpose)


pm.PlanningController._decide = _decide
if os.environ.get("KNOWN_C") == "1":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import planner_grid

    planner_grid._override_default({"calibration_mode": "fixed", "calibration": "R*1.3"}, ratio)
sim_args = argparse.Namespace(truth="fitted", crit_ratio=None, seed=0, reconfig="online", no_lr_aware=False)
sc = _preset(get_preset(preset), sim_args, truth, ratio, 0)
if os.environ.get("TRUE_PHI") == "1":
    traj = Trajectory(sc.sim.trajectory, sc.shape.seq_len)
    sim_module.StepRecord = lambda **kw: StepRecord(**{**kw, "b_noise": traj.b_noise(kw["loss"])})
print("truth c =", sc.sim.trajectory.gns_calibration)
compare_policies(sc, ("goodput",), planner=Planner(sc))
for row in log:
    print(*row)
