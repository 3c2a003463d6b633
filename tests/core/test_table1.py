"""`copus simulate --preset`: Table 1 rows matched to simulated runs, goodput variants, Table 2."""

import dataclasses

import pytest

from copus.cli import main
from copus.core.sim.presets import Preset
from copus.core.sim.compare import compare_policies
from copus.core.sim.scenario import COPUS_FAITHFUL, GoodputVariant, preset_scenario
from copus.core.sim.table1 import table1_rows, timeline_rows
from copus.core.sim.trajectory import TrajectoryParams

# a made-up "paper" for a 3B run on 8 NVLink-pair H100s, short enough for a test
FAKE = Preset(
    name="fake-3b",
    description="fake",
    model="llama-3.2-3b",
    hardware="h100-nvlink-pairs",
    world_size=8,
    token_budget=25_000_000,
    target_losses=(7.0, 6.0),
    trajectory=TrajectoryParams(
        initial_loss=11.76, progress_scale_samples=265.0, loss_exponent=0.272, bcrit_star_tokens=1e9
    ),
    static_batches=(16, 64),
    max_batch=256,
    cbs_layouts=((2, 1, 4), (8, 1, 1)),
    published_layouts=((2, 1, 4), (8, 1, 1)),
    published_switch_min=(2.0,),
    published_minutes={
        "COPUS": (1.0, 2.0),
        "CBS (DP2,TP1,PP4)": (1.1, 2.4),
        "CBS (DP8,TP1,PP1)": (1.2, 2.2),
        "Static GBS=16": (1.3, None),
        "Static GBS=64": (None, 3.0),
    },
    published_speedup_pct=(9.1, 9.1),
    published_avg_speedup_pct=9.1,
    sim_budget_factor=1.0,
)
# COPUS's rule with a margin no gain clears: never switches (the planner has no margin to set)
STUBBORN = GoodputVariant(name="goodput", policy="goodput-copus", controller=(("margin", 1e6),))


@pytest.fixture(scope="module")
def comparison():
    sc = dataclasses.replace(
        preset_scenario(FAKE, variants=(COPUS_FAITHFUL, STUBBORN)),
        sim=dataclasses.replace(preset_scenario(FAKE).sim, reconfig_cost_s=5.0),
    )
    return compare_policies(sc, ("static", "cbs", "goodput"))


def test_published_rows_get_their_simulated_twins(comparison):
    rows = {r.label: r for r in table1_rows(FAKE, comparison)}
    assert list(rows) == [*FAKE.published_minutes, "goodput"]
    copus = comparison.run("goodput-copus")
    assert rows["COPUS"].simulated == tuple(copus.time_to_target_s[t] / 60 for t in (7.0, 6.0))
    cbs = [r for r in comparison.results if r.name == "cbs dp8.tp1.pp1"]
    assert cbs and cbs[0].timeline[0].plan.layout == (8, 1, 1)
    assert rows["CBS (DP8,TP1,PP1)"].simulated[0] == pytest.approx(cbs[0].time_to_target_s[7.0] / 60)
    assert rows["goodput"].published is None and rows["goodput"].simulated is not None


def test_variants_take_their_own_controller_settings(comparison):
    copus, stubborn = comparison.run("goodput-copus"), comparison.run("goodput")
    assert len(copus.decisions) > 0 and len(stubborn.decisions) == 0
    assert comparison.average_speedup_pct("goodput-copus") != comparison.average_speedup_pct("goodput")


def test_timeline_beside_table_2(comparison):
    rows = timeline_rows(FAKE, comparison.run("goodput-copus"))
    assert rows[0] == ("start DP2,TP1,PP4", rows[0][1]) and rows[0][1].startswith("start DP")
    assert rows[1][0] == "2 min -> DP8,TP1,PP1"


def test_simulate_preset_prints_both_tables(capsys, monkeypatch):
    from copus.core.sim import presets

    monkeypatch.setitem(presets.PRESETS, "fake-3b", FAKE)
    assert main(["simulate", "--preset", "fake-3b", "--policies", "static,cbs,goodput"]) == 0
    out = capsys.readouterr().out
    assert "published | simulated" in out and "Static GBS=64" in out and "   –|" in out
    assert "layout timeline, Table 2 (COPUS) | simulated COPUS" in out
    assert "avg +9.1% |" in out


def test_simulate_preset_truth_option_and_oracle_ceiling(capsys, monkeypatch):
    from copus.core.sim import presets
    from copus.core.sim.trajectory import SQRT_LR

    sqrt_truth = dataclasses.replace(FAKE.trajectory, lr_model=SQRT_LR, lr_fraction_x0=0.7, lr_opt_exponent=0.5)
    fake = dataclasses.replace(FAKE, truths={"lr-tuned": FAKE.trajectory, "sqrt-lr": sqrt_truth})
    monkeypatch.setitem(presets.PRESETS, "fake-3b", fake)
    assert main(["simulate", "--preset", "fake-3b", "--policies", "static,cbs,goodput", "--truth", "sqrt-lr"]) == 0
    out = capsys.readouterr().out
    assert "truth sqrt-lr)" in out and "oracle ceiling" in out
    assert main(["simulate", "--preset", "fake-3b", "--policies", "static,goodput"]) == 0
    assert "truth lr-tuned)" in capsys.readouterr().out  # the default: `trajectory`
    monkeypatch.setitem(presets.PRESETS, "fake-3b", FAKE)  # no named truths
    assert main(["simulate", "--preset", "fake-3b", "--truth", "sqrt-lr"]) == 2
    assert "truth 'sqrt-lr' is invalid" in capsys.readouterr().err
