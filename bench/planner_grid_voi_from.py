"""Diagnostic of docs/robust-goodput.md §6.9 (not a rule): `bench/planner_grid.py` with the VoI
experiments on but allowed only from step MIN_STEP (environment) on.

    MIN_STEP=300 PYTHONPATH=src python bench/planner_grid_voi_from.py --seeds 0 --presets ... --out ...
"""

import os
import runpy
import sys

import copus.core.control.experiments as em
import copus.core.control.planner as pm

em.EXPERIMENTS = True
_first = int(os.environ["MIN_STEP"])
_orig = pm.PlanningController._experiments
pm.PlanningController._experiments = lambda self: _orig(self) and self.last_decision_step >= _first
sys.argv[0] = "bench/planner_grid.py"
runpy.run_path(os.path.join(os.path.dirname(__file__), "planner_grid.py"), run_name="__main__")
