import argparse
import sys
import numpy as np
from copus.commands.simulate import _preset
from copus.core.sim.presets import get_preset
from copus.core.sim.simulator import Planner, compare_policies
import copus.core.stats.calibration_posterior as cp

preset, truth, ratio = sys.argv[1], sys.argv[2], float(sys.argv[3])
import copus.core.control.controller as cc  # noqa: E402 (after the argv read)

if len(sys.argv) > 4:
    cc.LR_RULE_FACTOR = False
orig = cp.CalibrationPosterior._close


def close(self):
    row = orig(self)
    if row is not None:
        x0, p = self.lr_fraction_weights()
        print(
            "win",
            row["batches"],
            "c=%.2f p05=%.2f p95=%.2f" % (row["c"], row["p05"], row["p95"]),
            "tuned=%.2f" % (1 - p.sum()),
            np.round(p, 2),
        )
    return row


cp.CalibrationPosterior._close = close
sim_args = argparse.Namespace(truth="fitted", crit_ratio=None, seed=0, reconfig="online", no_lr_aware=False)
pr = get_preset(preset)
sc = _preset(pr, sim_args, truth, ratio, 0)
cmp_ = compare_policies(sc, ("goodput",), planner=Planner(sc))
for r in cmp_.results:
    print(
        r.name,
        [
            (d.get("step"), d.get("plan", {}).get("global_batch_size") if isinstance(d.get("plan"), dict) else None)
            for d in []
        ],
    )
r = [x for x in cmp_.results if x.name == "goodput"][0]
print("steps", r.num_steps, "wall", round(r.wall_s), "final", r.final_loss)
for d in r.decisions:
    print(d.step, d.kind, d.plan.global_batch_size, d.plan.layout, d.purpose, (d.calibration or {}).get("c"))
