"""The value-of-information maths of the planner's batch experiments (core.control.experiment_value)."""

import math

import numpy as np

from copus.core.control import experiment_value as ev


def test_expected_information_is_zero_without_separation_and_log_k_with_full_separation():
    w = np.full(5, 0.2)
    assert ev.expected_information(w, np.zeros((5, 5))) == 0.0
    full = np.full((5, 5), 400.0) - 400.0 * np.eye(5)
    assert math.isclose(ev.expected_information(w, full), math.log(5), rel_tol=1e-9)
    assert 0.0 < ev.expected_information(w, 0.05 * full) < math.log(5)


def test_the_ledger_scales_a_pair_by_what_its_read_windows_realised():
    """η = min(1, Σ realised / Σ predicted): a window that left the posterior's mass in the
    hypotheses' cells where it was realised nothing; one that put it all in one cell realised
    log K; a window the posterior did not read is dropped; other pairs stay at 1."""
    edges = ev.cell_edges(np.array([1.0, 2.0, 4.0, 8.0, 16.0]))
    assert edges == [math.sqrt(2), math.sqrt(8), math.sqrt(32), math.sqrt(128)]
    unchanged = {e: (i + 1) / 5 for i, e in enumerate(edges)}
    ledger = ev.InformationLedger()
    ledger.opened("16>32", 0.5, edges, rows=3)
    assert ledger.closed(unchanged.get, rows=4) == 0.0
    assert ledger.scale("16>32") == 0.0 and ledger.scale("16>22") == 1.0
    ledger.opened("16>32", 2.0, edges, rows=4)
    assert math.isclose(ledger.closed(lambda c: 0.0 if c < 3 else 1.0, rows=5), math.log(5))  # all mass in cell 2
    assert math.isclose(ledger.scale("16>32"), math.log(5) / 2.5)
    ledger.opened("16>32", 10.0, edges, rows=5)
    assert ledger.closed(unchanged.get, rows=5) is None  # not read: dropped
    assert math.isclose(ledger.scale("16>32"), math.log(5) / 2.5)
    twin = ev.InformationLedger()
    twin.load_state_dict(ledger.state_dict())
    assert twin.totals == ledger.totals and twin.pending is None
