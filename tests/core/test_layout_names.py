"""One canonical ASCII spelling of a layout and a plan; every older spelling still parses."""

from __future__ import annotations

import pytest

from copus.core.plan.layout_names import layout_name, parse_layout
from copus.core.plan.plan import ParallelPlan


def test_layouts_and_plans_are_written_one_way_in_ascii():
    assert layout_name(2, 1, 2) == "dp2.tp1.pp2"
    assert layout_name(2, 1, 2, 8, 1) == "dp2.tp1.pp2 mb8x1"
    plan = ParallelPlan(dp=2, tp=1, pp=2, micro_batch_size=8, num_microbatches=3)
    assert plan.describe() == "dp2.tp1.pp2 mb8x3 (B=48)"
    assert plan.describe().isascii()
    single = ParallelPlan(dp=1, tp=1, pp=1, micro_batch_size=4, num_microbatches=2)
    assert single.describe() == "dp1.tp1.pp1 mb4x2 (B=8)"


@pytest.mark.parametrize(
    "text,want",
    [
        ("dp2.tp1.pp2", (2, 1, 2)),
        ("dp2.pp2", (2, 1, 2)),
        ("pp4", (1, 1, 4)),
        ("4x1x1", (4, 1, 1)),
        ("2x2x1", (2, 2, 1)),
        ("2×1×2", (2, 1, 2)),
        ("dp2·tp1·pp1", (2, 1, 1)),
        ("DP2,TP1,PP1", (2, 1, 1)),
        ("tp2.dp2", (2, 2, 1)),
        ("single", (1, 1, 1)),
        (" Dp8 ", (8, 1, 1)),
    ],
)
def test_every_spelling_parses(text, want):
    assert parse_layout(text) == want
    assert parse_layout(layout_name(*want)) == want  # the canonical form round-trips


@pytest.mark.parametrize("text", ["", "dp0", "dp2.dp2", "2x1", "0x1x1", "dp2 mb4", "fsdp2", "dp2.tp"])
def test_bad_spellings_name_the_text_and_the_syntax(text):
    with pytest.raises(ValueError, match="is invalid; allowed: dpX.tpY.ppZ"):
        parse_layout(text)


def test_the_layout_map_and_profile_take_any_spelling():
    import argparse

    from copus.commands.profile import select_plans
    from copus.core.plan.layout_map import parse_layout_map
    from copus.core.specs.resolve import get_model_shape

    assert parse_layout_map("1x1x4@8, dp2·pp2@32, dp4.tp1.pp1@64") == parse_layout_map("pp4@8,dp2.pp2@32,dp4@64")
    args = argparse.Namespace(
        nproc=4, global_batch="8", micro_batch_sizes="2", layouts="4x1x1, dp2.pp2", sample=0, seed=0, model="tiny"
    )
    plans = select_plans(args, get_model_shape("tiny"))
    assert {p.layout for p in plans} == {(4, 1, 1), (2, 1, 2)}
    args.layouts = "4x1x1,dp2.dp2"
    with pytest.raises(ValueError, match="--layouts item 'dp2.dp2': layout 'dp2.dp2' is invalid"):
        select_plans(args, get_model_shape("tiny"))
