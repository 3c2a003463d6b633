"""Pure logic of copus: no torch import anywhere below this package (tests/core/test_layout.py checks).

Packages, each importing only those listed before it:
    stats/    noise scale, efficiency, critical batch, batch tests (numbers only)
    specs/    model shapes, Hugging Face configs, hardware, topology
    plan/     parallel plans, layouts, records, goodput and the plan search
    cost/     step-time and memory models, their fit
    control/  the controller, policies, exploration, audits
    sim/      the simulator and its ground truths
"""
