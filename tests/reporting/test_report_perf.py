"""`copus report` and the console show MFU and peak memory (issue 23)."""

import json
import math

from copus.reporting.report import markdown_table, summary_rows
from copus.reporting.runs import load_run
from copus.runtime.state.metrics import progress_line


def _run(tmp_path, mfus, peaks):
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.toml").write_text('[batch]\npolicy = "constant"\n')
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps(
                dict(
                    step=s,
                    samples=8 * s,
                    tokens=1024 * s,
                    wall_s=float(s),
                    loss=3.0,
                    global_batch_size=8,
                    micro_batch_size=2,
                    num_microbatches=1,
                    dp=4,
                    tp=1,
                    pp=1,
                    b_noise=5.0,
                    tokens_per_s=1000.0,
                    mfu=m,
                    peak_memory_bytes=p,
                )
            )
            + "\n"
            for s, (m, p) in enumerate(zip(mfus, peaks), start=1)
        )
    )
    return load_run(run)


def test_report_has_median_mfu_and_largest_peak(tmp_path):
    run = _run(tmp_path, [0.30, None, 0.40, 0.42], [2**30, 3 * 2**30, 2 * 2**30, None])
    (row,) = summary_rows([run], [])
    assert row["mfu"] == 0.40 and row["peak_memory_gib"] == 3.0
    table = markdown_table([row], [])
    assert "| MFU | peak GiB |" in table and "| 40.0% | 3.00 |" in table


def test_report_without_the_columns_shows_dashes(tmp_path):
    (row,) = summary_rows([_run(tmp_path, [None, None], [None, None])], [])
    assert math.isnan(row["mfu"]) and math.isnan(row["peak_memory_gib"])
    assert "| – | – |" in markdown_table([row], [])


def test_progress_line_shows_mfu_and_peak():
    row = dict(
        step=3,
        tokens=3072,
        loss=2.5,
        tokens_per_s=1500.0,
        global_batch_size=8,
        dp=2,
        tp=1,
        pp=1,
        micro_batch_size=4,
        num_microbatches=1,
        wall_s=9.0,
        mfu=0.412,
        peak_memory_bytes=int(37.9 * 2**30),
    )
    line = progress_line(row)
    assert "MFU 41.2%" in line and "peak 37.9 GiB" in line
    assert "MFU" not in progress_line({**row, "mfu": None, "peak_memory_bytes": None})


def test_mfu_formula_is_torchtitans():
    """F = 6·(N − V·d) + 12·L·d·seq (torchtitan's get_num_flop_per_token, PaLM App. B); MFU =
    tokens/s · F / (devices · peak)."""
    from copus.core.specs.resolve import get_model_shape
    from copus.runtime.train import perf

    s = get_model_shape("tinyllama-1.1b")
    f = 6 * (s.num_params() - 32000 * 2048) + 12 * 22 * 2048 * 2048
    assert s.model_flops_per_token() == f and 7.0e9 < f < 8.0e9
    assert perf.mfu(50_000.0, s, 8, 989e12) == 50_000.0 * f / (8 * 989e12)
    assert math.isnan(perf.mfu(0.0, s, 8, 989e12))
