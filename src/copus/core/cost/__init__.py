"""What a plan costs: step-time models (COPUS's, Megatron's, the CPU/gloo model), memory per device, and
the fit of their constants to measured steps.

May import: copus.core.specs, copus.core.stats, copus.core.plan.plan (no torch).
"""
