"""Overlap of two costs that run concurrently (COPUS, arXiv 2604.26687, §4.2).

    overlap(a, b) = (a^γ + b^γ)^(1/γ)

γ = 1 is no overlap (a + b); γ → ∞ is perfect overlap (max(a, b)). Shared by the step-time
models in `throughput.py` and `megatron_cost.py`.
"""

from __future__ import annotations

import numpy as np


def gamma_sum(a: np.ndarray, b: np.ndarray, gamma: float) -> np.ndarray:
    """(a^γ + b^γ)^(1/γ), computed stably as m·((a/m)^γ + (b/m)^γ)^(1/γ) with m = max(a, b)."""
    m = np.maximum(a, b)
    safe = np.where(m > 0, m, 1.0)
    return np.where(m > 0, safe * ((a / safe) ** gamma + (b / safe) ** gamma) ** (1.0 / gamma), 0.0)
