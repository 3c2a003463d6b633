"""Decisions during a run: the controller, the batch-size policies and their presets, exploration
probes, audits of the model's predictions, LR schedules.

May import: every core package except copus.core.sim (no torch).
"""
