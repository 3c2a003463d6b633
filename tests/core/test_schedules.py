import pytest
from hypothesis import given
from hypothesis import strategies as st

from copus.core.control.schedules import BatchSchedule, constant, linear_ramp, stepwise_ramp


def test_constant():
    s = constant(24, multiple=8)
    assert s(0) == s(10 ** 9) == 24
    assert constant(20, multiple=8)(5) == 16  # rounded down to the multiple


def test_linear_ramp_values():
    s = linear_ramp(16, 64, 1000)
    assert [s(x) for x in (0, 250, 500, 1000, 5000)] == [16, 28, 40, 64, 64]
    s8 = linear_ramp(16, 64, 1000, multiple=8)
    assert [s8(x) for x in (0, 250, 500, 999, 1000)] == [16, 24, 40, 56, 64]


def test_stepwise_ramp_values():
    s = stepwise_ramp(16, 64, 1000, num_steps=4)
    assert [s(x) for x in (0, 249, 250, 499, 500, 750, 999, 1000, 10 ** 6)] == [
        16, 16, 28, 28, 40, 52, 52, 64, 64]


def test_units():
    s = linear_ramp(8, 16, 1000, unit="tokens")
    assert s.at(samples=10 ** 6, tokens=0) == 8 and s.at(samples=0, tokens=1000) == 16
    assert linear_ramp(8, 16, 1000).at(samples=1000, tokens=0) == 16


@pytest.mark.parametrize("kw,match", [
    (dict(kind="cubic", start=8), "ramp_kind='cubic'"),
    (dict(kind="linear", start=8, end=4, duration=10), "ramp_to=4"),
    (dict(kind="linear", start=8, end=16, duration=0), "duration=0"),
    (dict(kind="stepwise", start=8, end=16, duration=10, num_steps=0), "ramp_steps=0"),
    (dict(start=8, unit="bytes"), "unit='bytes'"),
])
def test_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        BatchSchedule(**kw)


@given(kind=st.sampled_from(["linear", "stepwise"]), start=st.integers(1, 256),
       extra=st.integers(0, 4096), multiple=st.integers(1, 32), duration=st.integers(1, 10 ** 6),
       steps=st.integers(1, 10), xs=st.lists(st.floats(0, 2e6), min_size=2, max_size=5))
def test_ramps_monotone_bounded_and_multiple(kind, start, extra, multiple, duration, steps, xs):
    s = BatchSchedule(kind=kind, start=start, end=start + extra, duration=duration,
                      num_steps=steps, multiple=multiple)
    values = [s(x) for x in sorted(xs)]
    assert values == sorted(values)
    for v in values:
        assert v % multiple == 0
        assert v <= max(start + extra, multiple)
    assert s(duration) == max(multiple, (start + extra) // multiple * multiple)
