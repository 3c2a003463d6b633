"""The sqrt-lr truth's factor 2x − x² (after the warm-up) over the run: at each loss, B_crit (sequences)
and the factor at B = 16…256, for the preset's own seq_len (its model shape) and R = B_crit/b_noise."""

import sys
import numpy as np
from copus.core.sim.presets import get_preset
from copus.core.sim.trajectory import Trajectory
from copus.core.specs.resolve import get_model_shape

pr = get_preset(sys.argv[1])
seq = get_model_shape(pr.model).seq_len
p = pr.truth("sqrt-lr")
if len(sys.argv) > 2:
    p = p.with_(gns_calibration=float(sys.argv[2]))
tr = Trajectory(p, seq)
print(f"{pr.name} seq {seq} x0 {p.lr_fraction_x0} R {p.gns_calibration}")
Ls = [tr.loss(e) for e in np.geomspace(1e3, pr.token_budget / seq * 3, 6)]
for L in Ls:
    bc = tr.critical_batch(L)
    print(
        f"L={L:.2f} Bc={bc:.0f} "
        + " ".join(f"{B}:{tr.progress_per_step(B, L) / (B * bc / (bc + B)):.2f}" for B in (16, 32, 64, 128, 256))
    )
