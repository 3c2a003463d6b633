"""Load a copus run folder (metrics.jsonl, eval.jsonl, decisions.jsonl, config.toml) into plain lists."""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True)
class Run:
    """One run folder, its per-step metrics, evaluations and decisions."""

    path: Path
    name: str
    config: dict = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)  # summary.json, when the run wrote one

    @property
    def policy(self) -> str:
        return str(self.config.get("batch", {}).get("policy", "?"))

    def series(self, key: str, rows: list[dict] | None = None) -> list[float]:
        """Column `key` as floats (None/missing → NaN)."""
        out = []
        for row in self.steps if rows is None else rows:
            v = row.get(key)
            out.append(float("nan") if v is None else float(v))
        return out


def read_jsonl(path: Path, *, include_superseded: bool = False) -> list[dict]:
    """Lines of a JSON-lines file; a truncated last line (crash mid-write) is ignored, and so
    are rows a resume marked `"superseded": true` (runtime/state/metrics.py) unless
    `include_superseded` (every attempt's rows in file order, as bench/faults.py needs).
    The one reader of run folders for `copus report` and the benches."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if include_superseded or not (isinstance(row, dict) and row.get("superseded")):
            rows.append(row)
    return rows


def latest_rows(rows: list[dict], *, keep_same_step: bool = False) -> list[dict]:
    """One row per step: where the step count goes back (a resume appended after rows the
    checkpoint did not hold, in folders written before `RunWriter.supersede_after`), the earlier
    rows with step >= the new row's step are superseded and dropped (`keep_same_step`: only
    step > it, for decisions.jsonl, where a resume logs its own decision at the checkpoint's
    step). Rows without a step are kept."""
    out: list[dict] = []
    for row in rows:
        step = row.get("step")
        if isinstance(step, int):
            while (
                out
                and isinstance(out[-1].get("step"), int)
                and (out[-1]["step"] > step or (out[-1]["step"] == step and not keep_same_step))
            ):
                out.pop()
        out.append(row)
    return out


def load_run(path: str | Path) -> Run:
    """Read a run folder; ValueError naming the folder when it holds no metrics."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"run folder {str(p)!r} does not exist or is not a folder")
    steps = latest_rows(read_jsonl(p / "metrics.jsonl"))
    if not steps:
        raise ValueError(f"run folder {str(p)!r} has no metrics.jsonl lines; allowed: a copus run folder")
    config = {}
    if (p / "config.toml").exists():
        config = tomllib.loads((p / "config.toml").read_text())
    summary: dict = {}
    try:
        summary = json.loads((p / "summary.json").read_text())
    except (OSError, ValueError):
        pass
    return Run(
        path=p,
        name=p.name,
        config=config,
        steps=steps,
        summary=summary,
        evals=latest_rows(read_jsonl(p / "eval.jsonl")),
        decisions=latest_rows(read_jsonl(p / "decisions.jsonl"), keep_same_step=True),
    )


def first_time_below(times: list[float], losses: list[float], target: float) -> float:
    """Wall time at which `losses` first reach `target` (NaN if never)."""
    for t, v in zip(times, losses):
        if not math.isnan(v) and v <= target:
            return t
    return float("nan")


def plan_label(row: dict) -> str:
    """A row's layout, canonically: `dp2.tp1.pp2` (core/plan/layout_names.py)."""
    from copus.core.plan.layout_names import layout_name

    return layout_name(*(int(row.get(k, 1) or 1) for k in ("dp", "tp", "pp")))


def plan_segments(run: Run) -> list[tuple[float, float, str]]:
    """(start wall_s, end wall_s, layout label) for each stretch of steps under one layout."""
    segs: list[tuple[float, float, str]] = []
    for row in run.steps:
        label, t = plan_label(row), float(row.get("wall_s") or 0.0)
        if segs and segs[-1][2] == label:
            segs[-1] = (segs[-1][0], t, label)
        else:
            segs.append((t, t, label))
    return segs
