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


def read_jsonl(path: Path) -> list[dict]:
    """Lines of a JSON-lines file; a truncated last line (crash mid-write) is ignored."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def load_run(path: str | Path) -> Run:
    """Read a run folder; ValueError naming the folder when it holds no metrics."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"run folder {str(p)!r} does not exist or is not a folder")
    steps = read_jsonl(p / "metrics.jsonl")
    if not steps:
        raise ValueError(f"run folder {str(p)!r} has no metrics.jsonl lines; allowed: a copus run folder")
    config = {}
    if (p / "config.toml").exists():
        config = tomllib.loads((p / "config.toml").read_text())
    return Run(path=p, name=p.name, config=config, steps=steps,
               evals=read_jsonl(p / "eval.jsonl"), decisions=read_jsonl(p / "decisions.jsonl"))


def first_time_below(times: list[float], losses: list[float], target: float) -> float:
    """Wall time at which `losses` first reach `target` (NaN if never)."""
    for t, v in zip(times, losses):
        if not math.isnan(v) and v <= target:
            return t
    return float("nan")


def plan_label(row: dict) -> str:
    parts = [f"{k}{row.get(k, 1)}" for k in ("dp", "tp", "pp") if int(row.get(k, 1) or 1) > 1]
    return "·".join(parts) or "single"


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
