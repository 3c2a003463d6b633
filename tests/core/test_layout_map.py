"""parallel.layouts: parsing, validation, and a batch policy whose decisions follow the map."""

import pytest

from copus.core.plan.layout_map import (
    LayoutMap,
    LayoutMappedPolicy,
    check_layout_map,
    parse_layout_map,
    plan_in_layout,
)
from copus.core.specs.models import MODELS
from copus.core.plan.plan import ParallelPlan
from copus.core.control.policies import PolicySettings, RampPolicy
from tests.core.test_policies import Feed


def test_parse_gives_layouts_by_ascending_min_batch():
    m = parse_layout_map(" pp4@8, DP2.pp2@32 ,dp4@128")
    assert m == LayoutMap(((8, (1, 1, 4)), (32, (2, 1, 2)), (128, (4, 1, 1))))
    assert [m.layout_for(b) for b in (4, 8, 31, 32, 127, 128, 4096)] == [
        None,
        (1, 1, 4),
        (1, 1, 4),
        (2, 1, 2),
        (2, 1, 2),
        (4, 1, 1),
        (4, 1, 1),
    ]
    assert m.describe() == "dp1.tp1.pp4@8, dp2.tp1.pp2@32, dp4.tp1.pp1@128"
    assert parse_layout_map("") is None and parse_layout_map("  ") is None
    assert parse_layout_map("tp2.dp1@1").entries == ((1, (1, 2, 1)),)


@pytest.mark.parametrize(
    "text,match",
    [
        ("dp2", "entry 'dp2' is invalid"),
        ("dp2@", "entry 'dp2@' is invalid"),
        ("xp2@8", "entry 'xp2@8' is invalid"),
        ("dp2.dp2@8", "at most once"),
        ("dp0@8", "each >= 1"),
        ("dp2@16,pp2@8", r"minimum batches \[16, 8\]"),
        ("dp2@8,pp2@8", "strictly increasing"),
        ("dp2@0", ">= 1"),
    ],
)
def test_bad_maps_are_refused_naming_the_entry(text, match):
    with pytest.raises(ValueError, match=match):
        parse_layout_map(text)


def test_check_needs_the_whole_world_a_fitting_model_and_the_initial_batch():
    tiny = MODELS["tiny"]
    check_layout_map(parse_layout_map("pp4@8,dp2.tp2@32"), 4, 8, tiny)
    with pytest.raises(ValueError, match="must equal the world size 4"):
        check_layout_map(parse_layout_map("pp4@8,dp2@32"), 4, 8, tiny)
    with pytest.raises(ValueError, match="no layout for batch.initial=8"):
        check_layout_map(parse_layout_map("pp4@16"), 4, 8, tiny)
    with pytest.raises(ValueError, match="layout dp1.tp1.pp8"):
        check_layout_map(parse_layout_map("pp8@8"), 8, 8, tiny)  # tiny has 4 layers


def test_plan_in_layout_keeps_the_batch_and_the_micro_batch_when_it_can():
    p = ParallelPlan(dp=1, tp=1, pp=4, micro_batch_size=2, num_microbatches=16)  # B=32
    assert plan_in_layout(p, (2, 1, 2)) == ParallelPlan(dp=2, tp=1, pp=2, micro_batch_size=2, num_microbatches=8)
    p = ParallelPlan(dp=4, tp=1, pp=1, micro_batch_size=4, num_microbatches=1)  # B=16
    q = plan_in_layout(p, (1, 1, 4))  # 16 per dp rank, >= 4 micro-batches
    assert q.global_batch_size == 16 and q.num_microbatches >= 4 and q.micro_batch_size == 4
    with pytest.raises(ValueError, match="not a multiple of dp=4"):
        plan_in_layout(ParallelPlan(dp=1, tp=1, pp=2, micro_batch_size=3, num_microbatches=2), (4, 1, 1))


def test_mapped_ramp_switches_layout_when_and_only_when_the_batch_enters_a_new_range():
    start = ParallelPlan(dp=1, tp=1, pp=4, micro_batch_size=2, num_microbatches=4)  # B=8
    s = PolicySettings(
        initial=8,
        max=64,
        ramp_to=64,
        ramp_samples=1200,
        warmup_steps=0,
        interval_steps=1,
        ramp_kind="stepwise",
        ramp_steps=3,
    )
    policy = LayoutMappedPolicy(RampPolicy(s, start), parse_layout_map("pp4@8,dp2.pp2@32,dp4@64"))
    feed = Feed(start)
    decisions = feed.run(policy, 200)
    got = [(d.kind, d.plan.layout, d.plan.global_batch_size) for d in decisions]
    assert got[-1] == ("reconfigure", (4, 1, 1), 64)
    for d in decisions:
        want = policy.layouts.layout_for(d.plan.global_batch_size)
        assert d.plan.layout == want
        if d.kind == "reconfigure":
            assert "from parallel.layouts (dp1.tp1.pp4@8, dp2.tp1.pp2@32, dp4.tp1.pp1@64)" in d.reason
    kinds = [k for k, _, _ in got]
    assert kinds.count("reconfigure") == 2  # into dp2.pp2 and into dp4, once each
    assert policy.name == "ramp" and policy.state_dict()["name"] == "ramp"
