"""`copus plan` against the only published measurements: COPUS's plan shifts (arXiv 2604.26687).

COPUS §3.3 / Table 1 / Table 2 (copus-notes §2.3, §3.3): on each cluster the throughput-optimal
layout at B = 16 (the "pessimistic" CBS baseline, COPUS's start) and at the large batches that
dominate training (the "optimistic" CBS baseline, COPUS's end) were *measured*. Goal (issue 15):
`copus plan` ranks each of them first or within 3 % of the first (step time at a fixed batch).
Nothing here is fitted per test: one hardware profile per cluster (core/specs/hardware.py) prices all
of them; docs/cost-model.md lists every factor and its source.
"""

from copus.cli import main
from copus.commands.plan import plan_rows
from copus.core.sim.presets import get_preset

TOLERANCE = 0.03


def _args(preset, batch: int):
    import argparse

    p = argparse.ArgumentParser()
    from copus.commands.plan import add_arguments

    add_arguments(p)
    # COPUS searched only dp, tp, pp (copus-notes §5: "sequence parallelism and activation
    # checkpointing are not searched"), on Megatron's default 1F1B: its measured layouts are
    # compared under those options (issue 25 added the others as plan dimensions)
    return p.parse_args(
        [
            "--model",
            preset.model,
            "--gpus",
            str(preset.world_size),
            "--hardware",
            preset.hardware,
            "--global-batch",
            str(batch),
            "--by-layout",
            "--top",
            "100",
            "--activation-checkpointing",
            "none",
            "--pipeline-schedule",
            "1f1b",
            "--sequence-parallel",
            "off",
        ]
    )


def _gap(preset, batch: int, layout: tuple[int, int, int]) -> float:
    """Predicted step-time deficit of `layout`'s best plan against the best plan at `batch`."""
    rows = plan_rows(_args(preset, batch))
    best = {r.plan.layout: r.step_s for r in rows}
    assert layout in best, f"{layout} is not a feasible plan at B={batch}"
    return best[layout] / rows[0].step_s - 1.0


def _check(name: str, start, end, large_batch: int) -> None:
    preset = get_preset(name)
    assert preset.cbs_layouts == (start, end)
    gaps = {"start": _gap(preset, 16, start), "end": _gap(preset, large_batch, end)}
    assert gaps["start"] <= TOLERANCE and gaps["end"] <= TOLERANCE, gaps
    # and the shift is real: the start layout is clearly worse at the large batch
    assert _gap(preset, large_batch, start) > TOLERANCE


def test_3b_on_8_h100_nvlink_pairs():
    """DP2·TP1·PP4 at B=16 → DP8·TP1·PP1 at large batches (COPUS Fig. 1, Table 2)."""
    _check("3b-8xh100", (2, 1, 4), (8, 1, 1), 1024)


def test_13b_on_16_h100():
    """TP2·PP8·DP1 at B=16 → TP1·PP4·DP4 (Table 2, 20 min)."""
    _check("13b-16xh100", (1, 2, 8), (4, 1, 4), 1024)


def test_32b_on_32_h100():
    """TP2·PP16·DP1 at B=16 → TP2·PP8·DP2 (Table 2, 37 min); 512 is the 32B row's largest batch."""
    _check("32b-32xh100", (1, 2, 16), (2, 2, 8), 512)


def test_7b_on_32_mi210():
    """TP4·PP4·DP2 at B=16; DP8·TP1·PP4 tuned for large batches (optimistic CBS, Table 1);
    COPUS itself switched to TP1·PP8·DP4 at 15 min, in the intermediate-batch regime
    (copus-notes §3.3: "neither extreme"): within 3 % there at B=128."""
    _check("7b-32xmi210", (2, 4, 4), (8, 1, 4), 1024)
    preset = get_preset("7b-32xmi210")
    assert preset.published_layouts[-1] == (4, 1, 8)
    assert _gap(preset, 128, (4, 1, 8)) <= TOLERANCE


def test_plan_by_layout_prints_each_layout_once(capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                "llama-3.2-3b",
                "--gpus",
                "8",
                "--hardware",
                "h100-nvlink-pairs",
                "--global-batch",
                "16",
                "--by-layout",
                "--top",
                "50",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()[3:]
    layouts = [tuple(int(x) for x in line.split()[1:4]) for line in lines]
    assert len(layouts) == len(set(layouts)) > 5
    assert "+0.0%" in lines[0]


# COPUS Table 1 (copus-notes §3.2): a static-batch run still training at the minute it reached
# its last target had processed at most its token budget, so its throughput ≤ budget / minute.
BOUNDS = [
    ("3b-8xh100", 328e6, [(16, 102.7), (32, 73.1), (64, 67.3), (128, 55.7)]),
    ("13b-16xh100", 328e6, [(32, 91.0), (64, 86.7), (128, 105.2)]),
    ("32b-32xh100", 123e6, [(64, 74.2), (128, 61.2)]),
    ("7b-32xmi210", 215e6, [(32, 77.2), (64, 57.9), (128, 65.6)]),
]


def test_predicted_throughput_never_exceeds_what_the_token_budget_allows():
    """The model's best plan at each published static batch is no faster than budget / minute
    (the roofline at the cards' sustained clocks; an optimistic prior would break these)."""
    for name, budget, rows in BOUNDS:
        preset = get_preset(name)
        for batch, minute in rows:
            best = plan_rows(_args(preset, batch))[0]
            tokens_per_s = best.samples_per_s * 2048
            assert tokens_per_s <= budget / (minute * 60.0) * 1.001, (name, batch, tokens_per_s)
