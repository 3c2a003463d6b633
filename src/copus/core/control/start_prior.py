"""The critical batch a run is expected to have before it has measured anything: the prior
the planning controller chooses its start layout by (docs/robust-goodput.md §6.16).

Kaplan et al. 2020 give the loss of a data-limited model as a function of the tokens seen,
and the critical batch as a function of the loss:

    L(D) = (D_c / D)^α_D,          D_c = 5.4·10^13 tokens, α_D = 0.095     (Eq. 1.2)
    B_crit(L) = B* / L^(1/α_B),    B* = 2·10^8 tokens,     α_B = 0.21      (Eq. 1.4)

so B_crit grows with the tokens seen as D^(α_D/α_B) = D^0.45. The start layout is a bet on
how fast the batch will have to grow; this prior puts the bet where the grid's truths
(fitted to published runs) put their growth over the first ~10^3–10^4 samples, within 2–4×,
where the previous prior (B_crit at L = ln V, growing as E^0.8 from the first step: the slope
of the run's middle, not of its start) overstated it by about 10× and started 3B on the layout
it needs only at B ≈ 700. The level is uncertain by two octaves (sd of log2), whether or not
c is known: the start is chosen by the expected time over that uncertainty. Pure Python.
"""

from __future__ import annotations

from statistics import NormalDist

DATA_SCALE_TOKENS = 5.4e13  # D_c, Kaplan et al. 2020 Eq. 1.2
DATA_EXPONENT = 0.095  # α_D
BCRIT_TOKENS = 2.0e8  # B*, Eq. 1.4
BCRIT_EXPONENT = 0.21  # α_B
GROWTH_SLOPE = DATA_EXPONENT / BCRIT_EXPONENT  # d log B_crit / d log D ≈ 0.45
LEVEL_OCTAVES = 2.0  # the prior's sd of log2 B_crit: the prior over c's (core.stats.calibration_posterior)


def prior_critical_batch(samples: float, seq_len: int) -> float:
    """B_crit in samples after `samples` sequences of `seq_len` tokens:
    B*/L^(1/α_B) at L = (D_c/D)^α_D, D = samples·seq_len (module docstring); at least 1."""
    tokens = max(float(samples) * max(int(seq_len), 1), 1.0)
    loss = (DATA_SCALE_TOKENS / tokens) ** DATA_EXPONENT
    return max(BCRIT_TOKENS / loss ** (1.0 / BCRIT_EXPONENT) / max(int(seq_len), 1), 1.0)


def level_hypotheses(points: int = 5) -> tuple[list[float], list[float]]:
    """(multipliers, weights): `points` equal-mass quantiles of the prior's log-normal
    uncertainty in the level of B_crit, 2^(LEVEL_OCTAVES·z_k), z_k = Φ⁻¹((k + ½)/points): the
    guess is a guess whether or not c is known."""
    n = max(int(points), 1)
    z = [NormalDist().inv_cdf((k + 0.5) / n) for k in range(n)]
    return [2.0 ** (LEVEL_OCTAVES * x) for x in z], [1.0 / n] * n
