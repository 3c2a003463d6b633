"""`copus report` shows the controller's probes and decision audits (issue 15)."""

import json

from copus.reporting.report import write_report
from copus.reporting.runs import load_run


def test_probes_and_audits_are_tables_and_not_counted_as_decisions(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.toml").write_text('[batch]\npolicy = "goodput"\n')
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
                    dp=4,
                    tp=1,
                    pp=1,
                    b_noise=5.0,
                    tokens_per_s=1000.0,
                )
            )
            + "\n"
            for s in range(1, 9)
        )
    )
    rows = [
        dict(
            step=2, kind="reconfigure", purpose="probe", dp=1, tp=1, pp=4, global_batch_size=8, reason="probe 1/1: pp4"
        ),
        dict(
            event="probe_result",
            step=4,
            probe_step=2,
            plan="pp4 mb2×4 (B=8)",
            before="dp4 mb2×1 (B=8)",
            predicted_step_s=0.2,
            measured_step_s=0.3,
            before_step_s=0.25,
            gain=-0.1667,
            verdict="revert",
        ),
        dict(
            step=4,
            kind="reconfigure",
            purpose="revert",
            dp=4,
            tp=1,
            pp=1,
            global_batch_size=8,
            reason="probe result: back",
        ),
        dict(
            event="audit",
            step=7,
            decision_step=4,
            kind="batch",
            before="dp4 (B=8)",
            after="dp4 (B=16)",
            predicted_step_s=0.4,
            realised_step_s=0.9,
            step_error=1.25,
            realised_vs_before=-0.35,
            verdict="undo",
        ),
    ]
    (run / "decisions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = write_report([load_run(run)], tmp_path / "out", [2.5]).read_text()
    assert "| r | goodput | 8 |" in md
    assert "reconfigure (probe) -> dp1.tp1.pp4" in md and "reconfigure (revert) -> dp4.tp1.pp1" in md
    assert "| 2 | 4 | pp4 mb2×4 (B=8) | 0.200 | 0.300 | dp4 mb2×1 (B=8) | 0.250 | -16.7% | revert |" in md
    assert "| 4 | 7 | batch | dp4 (B=8) -> dp4 (B=16) | 0.400 | 0.900 | +125% | -35.0% | undo |" in md
    from copus.reporting.report import summary_rows

    assert summary_rows([load_run(run)], [])[0]["num_decisions"] == 2
