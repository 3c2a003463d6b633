"""The value-of-information maths of the planner's batch experiments (core.control.experiment_value)."""

from statistics import NormalDist

import numpy as np

from copus.core.control import experiment_value as ev

# two hypotheses of c, one stretch, two batches: each hypothesis' best batch runs at twice the
# other's rate, and the posterior is an exact tie between them
RATES = np.array([[[1.0, 0.5]], [[0.5, 1.0]]])
DE = np.array([[1.0], [1.0]])
W = np.array([0.5, 0.5])


def _d(z: float) -> np.ndarray:
    return np.array([[0.0, -z], [z, 0.0]])  # d_jk = sign(ρ_j − ρ_k)·z


def test_a_window_without_information_is_worth_nothing_at_a_tie():
    """docs/robust-goodput.md §6.29: at a tie, the expected outcome alone (one point) tilts the
    posterior toward the truth for any z > 0 and prices a window that reads almost nothing at
    the whole regret. Averaged over the window's outcome, the tie is broken the right way with
    probability Φ(z/2), so V = full·(2Φ(z/2) − 1): the equal-mass rule is within 1/Q of it."""
    full = 0.5 * (1.0 / 0.5 - 1.0)  # L_k(p) under either truth: the tie picks one batch
    assert np.isclose(ev.value(RATES, DE, W, _d(1e-4), points=1), full)
    for z in (1e-4, 0.3, 1.0, 2.0, 3.0, 6.0, 40.0):
        exact = full * (2.0 * NormalDist().cdf(z / 2.0) - 1.0)
        assert abs(ev.value(RATES, DE, W, _d(z)) - exact) <= full / ev.OUTCOME_POINTS + 1e-12, z
    assert ev.value(RATES, DE, W, _d(1e-4)) == 0.0


def test_separation_is_antisymmetric_and_zero_for_equal_hypotheses():
    d = ev.separation(np.array([4.0, 16.0, 64.0]), 256.0, 512.0, slope=1e-3, sigma=0.01, half=50)
    assert np.allclose(d, -d.T) and np.allclose(np.diag(d), 0.0)
    assert d[0, 1] < 0 < d[1, 0]  # ρ rises with cφ
    assert np.all(ev.separation(np.array([4.0, 16.0]), 256.0, 512.0, 1e-3, 0.01, 50, misfit=1.0) == 0.0)


def test_hypotheses_whose_lr_factors_cancel_their_bends_are_not_told_apart():
    """docs/robust-goodput.md §6.35: a move's bend under hypothesis k is E_k(B_x)/E_k(B_now) times its
    LR factor ratio; two hypotheses (c = 8 re-tuned, c = 1 with an LR gain) that predict the same
    bend have separation 0, the same pair without the factor is told apart."""
    bc = np.array([80.0, 10.0])
    rho = (bc + 16.0) / (bc + 32.0)
    lr = np.array([1.0, rho[0] / rho[1]])
    apart = ev.separation(bc, 16.0, 32.0, 0.01, 0.001, 35)
    same = ev.separation(bc, 16.0, 32.0, 0.01, 0.001, 35, lr_ratio=lr)
    assert abs(apart[0, 1]) > 1.0
    np.testing.assert_allclose(same, 0.0, atol=1e-9)
