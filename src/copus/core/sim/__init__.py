"""The simulator: policies run against a ground-truth loss and step-time model in seconds; trajectories,
the COPUS cluster presets, fitted truths, Table 1 and the oracle ceiling.

May import: every other core package (no torch).
"""
