"""Pipeline stage split: balanced, contiguous, extra blocks to the middle stages first."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from copus.core.plan.stages import split_layers, stage_sizes


@given(st.integers(1, 64), st.integers(1, 16))
def test_split_covers_all_blocks_contiguously_and_balanced(n_layers, pp):
    if pp > n_layers:
        with pytest.raises(ValueError, match="n_layers"):
            split_layers(n_layers, pp)
        return
    ranges = split_layers(n_layers, pp)
    assert len(ranges) == pp
    assert [i for r in ranges for i in r] == list(range(n_layers))
    sizes = [len(r) for r in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    if pp > 1:  # the head stage never holds more blocks than any other stage
        assert sizes[-1] == min(sizes)


def test_examples():
    assert stage_sizes(6, 4) == [1, 2, 2, 1]
    assert stage_sizes(5, 2) == [3, 2]
    assert stage_sizes(8, 4) == [2, 2, 2, 2]
    assert stage_sizes(7, 3) == [2, 3, 2]
    assert split_layers(4, 1) == [range(0, 4)]


@pytest.mark.parametrize("pp", [0, -1, 2.0])
def test_bad_pp(pp):
    with pytest.raises(ValueError, match="pp="):
        split_layers(4, pp)
