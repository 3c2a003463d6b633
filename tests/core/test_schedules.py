import pytest
from hypothesis import given
from hypothesis import strategies as st

from copus.core.control.schedules import BatchSchedule, constant, linear_ramp, stepwise_ramp


def test_constant():
    s = constant(24, multiple=8)
    assert s(0) == s(10**9) == 24
    assert constant(20, multiple=8)(5) == 16  # rounded down to the multiple


def test_linear_ramp_values():
    s = linear_ramp(16, 64, 1000)
    assert [s(x) for x in (0, 250, 500, 1000, 5000)] == [16, 28, 40, 64, 64]
    s8 = linear_ramp(16, 64, 1000, multiple=8)
    assert [s8(x) for x in (0, 250, 500, 999, 1000)] == [16, 24, 40, 56, 64]


def test_stepwise_ramp_values():
    s = stepwise_ramp(16, 64, 1000, num_steps=4)
    assert [s(x) for x in (0, 249, 250, 499, 500, 750, 999, 1000, 10**6)] == [16, 16, 28, 28, 40, 52, 52, 64, 64]


def test_units():
    s = linear_ramp(8, 16, 1000, unit="tokens")
    assert s.at(samples=10**6, tokens=0) == 8 and s.at(samples=0, tokens=1000) == 16
    assert linear_ramp(8, 16, 1000).at(samples=1000, tokens=0) == 16


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(kind="cubic", start=8), "ramp_kind='cubic'"),
        (dict(kind="linear", start=8, end=4, duration=10), "ramp_to=4"),
        (dict(kind="linear", start=8, end=16, duration=0), "duration=0"),
        (dict(kind="stepwise", start=8, end=16, duration=10, num_steps=0), "ramp_steps=0"),
        (dict(start=8, unit="bytes"), "unit='bytes'"),
    ],
)
def test_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        BatchSchedule(**kw)


@given(
    kind=st.sampled_from(["linear", "stepwise"]),
    start=st.integers(1, 256),
    extra=st.integers(0, 4096),
    multiple=st.integers(1, 32),
    duration=st.integers(1, 10**6),
    steps=st.integers(1, 10),
    xs=st.lists(st.floats(0, 2e6), min_size=2, max_size=5),
)
def test_ramps_monotone_bounded_and_multiple(kind, start, extra, multiple, duration, steps, xs):
    s = BatchSchedule(kind=kind, start=start, end=start + extra, duration=duration, num_steps=steps, multiple=multiple)
    values = [s(x) for x in sorted(xs)]
    assert values == sorted(values)
    for v in values:
        assert v % multiple == 0
        assert v <= max(start + extra, multiple)
    assert s(duration) == max(multiple, (start + extra) // multiple * multiple)


# ------------------------------------------------------------------ token-denominated step schedules


def test_parse_step_schedule_tokens_suffixes_and_units():
    from copus.core.control.schedules import parse_step_schedule, parse_tokens

    assert parse_tokens("250B") == 2.5e11 and parse_tokens("4m") == 4e6 and parse_tokens("0") == 0
    s = parse_step_schedule("0:768, 250B:1536,500B:3072")
    assert s.entries == ((0.0, 768), (2.5e11, 1536), (5e11, 3072))
    assert s(0) == 768 and s(2.5e11 - 1) == 768 and s(2.5e11) == 1536 and s(1e15) == 3072
    # Llama 3 405B in tokens per batch, 8192-token sequences: 4M -> 8M at 252M -> 16M at 2.87T
    llama = parse_step_schedule("0:4194304,252M:8388608,2.87T:16777216", unit="tokens", seq_len=8192)
    assert llama.batches() == (512, 1024, 2048) and llama(3e12) == 2048
    assert parse_step_schedule(s.describe()) == s  # its description parses back


@pytest.mark.parametrize(
    "text,kw,needle",
    [
        ("0:768,250B:512", {}, "entry '250B:512' is invalid: the batch falls from 768"),
        ("0:8,1M:16,1M:32", {}, "entry '1M:32' is invalid: its threshold is not above"),
        ("1M:8", {}, "first entry must start at 0 tokens"),
        ("0:8,1X:16", {}, "token count '1X' is invalid"),
        ("0:8,1M", {}, "entry '1M' is invalid; allowed: 'TOKENS:BATCH'"),
        ("0:8,1M:1.5", {}, "entry '1M:1.5' is invalid: batch '1.5'"),
        ("0:8", {"unit": "bytes"}, "batch.schedule_unit='bytes' is invalid; allowed: samples, tokens"),
        ("0:1000", {"unit": "tokens", "seq_len": 128}, "not a multiple of seq_len=128"),
        ("", {}, "batch.schedule='' is invalid"),
    ],
)
def test_parse_step_schedule_rejects_with_one_line_naming_the_entry(text, kw, needle):
    from copus.core.control.schedules import parse_step_schedule

    with pytest.raises(ValueError) as err:
        parse_step_schedule(text, **kw)
    assert needle in str(err.value) and "\n" not in str(err.value)


def _record(step, tokens, plan):
    from copus.core.plan.records import StepRecord

    return StepRecord(
        step=step,
        samples=tokens // 128,
        tokens=tokens,
        plan=plan,
        step_s=1.0,
        loss=3.0,
        lr=1e-3,
        small_sqnorm=1.0,
        small_batch=1.0,
        num_small=2,
        big_sqnorm=1.0,
        grad_sqnorm=1.0,
        grad_trace_cov=1.0,
        b_noise=1.0,
        b_noise_rel_err=0.1,
    )


def test_schedule_policy_changes_at_the_token_count_and_resumes_mid_schedule():
    """The batch is a pure function of the tokens consumed: a policy rebuilt from nothing (a
    resumed run, any layout) at any token count lands on the same batch as the original."""
    from copus.core.control.policies import PolicySettings, make_policy
    from copus.core.plan.plan import ParallelPlan
    from copus.core.specs.resolve import get_model_shape

    shape = get_model_shape("tiny", 0)
    settings = PolicySettings(initial=8, min=8, max=64, schedule="0:8,4K:16,16K:32")
    plan = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=2, num_microbatches=2)
    policy = make_policy("schedule", settings, plan, 2, shape)
    tokens, trace = 0, []
    for step in range(1, 30):
        tokens += plan.global_batch_size * shape.seq_len
        d = policy.observe(_record(step, tokens, plan))
        if d is not None:
            plan = d.plan
        trace.append((tokens, plan.global_batch_size))
    assert all(b == (8 if t < 4096 else 16 if t < 16384 else 32) for t, b in trace)
    # resume at the 3rd step with the checkpoint's plan (B=8): the fresh policy moves to 16 at once
    fresh = make_policy(
        "schedule", settings, ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=2, num_microbatches=2), 2, shape
    )
    fresh.load_state_dict(policy.state_dict())
    old = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=2, num_microbatches=2)
    d = fresh.observe(_record(5, 5120, old))
    assert d is not None and d.plan.global_batch_size == 16 and d.plan.dp == 2
    # another layout (dp=4, micro-batch 4): the same batch at the same tokens
    other = make_policy(
        "schedule", settings, ParallelPlan(dp=4, tp=1, pp=1, micro_batch_size=1, num_microbatches=2), 4, shape
    )
    d = other.observe(_record(5, 20000, ParallelPlan(dp=4, tp=1, pp=1, micro_batch_size=1, num_microbatches=2)))
    assert d.plan.global_batch_size == 32 and d.plan.dp == 4


def test_schedule_policy_checks_every_entry_against_its_layout():
    from copus.core.control.policies import PolicySettings, make_policy
    from copus.core.plan.plan import ParallelPlan

    plan = ParallelPlan(dp=4, tp=1, pp=1, micro_batch_size=2, num_microbatches=1)
    policy = make_policy("schedule", PolicySettings(initial=8, schedule="0:8,1M:12"), plan)
    with pytest.raises(
        ValueError,
        match=r"entry '1M:12' is invalid on layout dp4.tp1.pp1: 12 is "
        r"not a multiple of dp\*micro_batch_size=4\*2",
    ):
        policy.check_layouts(None, 2)
    policy.check_layouts(None, 0)  # micro-batch chosen per batch: multiples of dp=4
    # a layout map sends B >= 12 to dp2.pp2: 12 = 2 x 6, >= 2 micro-batches: fine
    policy.check_layouts(lambda b: (2, 1, 2) if b >= 12 else (4, 1, 1), 0)
    with pytest.raises(ValueError, match="entry '1M:12' is invalid on layout dp8"):
        policy.check_layouts(lambda b: (8, 1, 1) if b >= 12 else (4, 1, 1), 0)


def test_doubling_rule_doubles_when_the_critical_batch_passes_twice_the_batch():
    """Merrill et al. 2025: B -> 2B once the measured critical batch (gns_c x b_noise) > 2B."""
    from dataclasses import replace

    from copus.core.control.policies import PolicySettings, make_policy
    from copus.core.plan.plan import ParallelPlan

    s = PolicySettings(
        initial=8, min=8, max=256, warmup_steps=0, interval_steps=1, confidence=0.0, recovery_steps=0, gns_c=2.0
    )
    plan = ParallelPlan(dp=2, tp=1, pp=1, micro_batch_size=2, num_microbatches=2)
    policy = make_policy("doubling", s, plan)
    rec = _record(1, 1024, plan)
    assert policy.observe(replace(rec, b_noise=7.9)) is None  # 15.8 < 16
    d = policy.observe(replace(rec, step=2, b_noise=100.0))  # 200 > 16: double, once
    assert d.plan.global_batch_size == 16
