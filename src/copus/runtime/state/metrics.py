"""The run folder: what a training run writes, line by line, so a crash loses at most one line.

    <run_dir>/config.toml      the resolved configuration (every key)
    <run_dir>/metrics.jsonl    one JSON object per optimizer step (METRIC_KEYS, NaN/inf → null)
    <run_dir>/eval.jsonl       one per evaluation: step, samples, tokens, wall_s, val_loss
    <run_dir>/decisions.jsonl  one per policy decision: Decision.to_dict() + switch cost
    <run_dir>/tb/              TensorBoard scalars (optional)
    <run_dir>/summary.json, summary.txt   written by `RunWriter.summary()` at the end

    <run_dir>/run.json         the folder's state: running, stopped or finished (run_folder.py)

Only rank 0 writes; on other ranks every method is a no-op, so the trainer calls them
unconditionally. Each line is flushed when written (appends survive a crash or a restart).
One row per step: a resume first marks every log row after the checkpoint's step
`"superseded": true` (`supersede_after`; the rows stay, as a record of the lost attempt), and
every reader skips marked rows: `copus report` (`reporting.runs.read_jsonl`, which also drops
the duplicated rows of folders written before this rule), `last_wall_s`, bench/ scripts.

Console (stdout): one `copus: ...` line per event (decision, eval, checkpoint), written above the
tqdm bar on a terminal (`console`); without a usable terminal (not a tty, or 0 columns) a plain
progress line every `log.progress_interval_s` instead of the bar.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from copus.atomic import atomic_write_bytes

from copus.core.plan.layout_names import layout_name
from copus.core.plan.records import Decision, StepRecord

LOG_FILES = ("metrics.jsonl", "eval.jsonl", "decisions.jsonl")

# The keys every metrics.jsonl line has (design.md §2 vocabulary).
METRIC_KEYS = (
    "step",
    "samples",
    "tokens",
    "wall_s",
    "step_s",
    "loss",
    "lr",
    "global_batch_size",
    "micro_batch_size",
    "dp",
    "tp",
    "pp",
    "grad_sqnorm",
    "grad_trace_cov",
    "b_noise",
    "tokens_per_s",
    "mfu",
    "peak_memory_bytes",
)

TB_KEYS = (
    "loss",
    "lr",
    "global_batch_size",
    "micro_batch_size",
    "num_microbatches",
    "step_s",
    "tokens_per_s",
    "grad_sqnorm",
    "grad_trace_cov",
    "b_noise",
    "dp",
    "tp",
    "pp",
    "mfu",
    "peak_memory_bytes",
)


def json_safe(value: Any) -> Any:
    """Non-finite floats → None (JSON has no NaN/inf), recursively; numpy scalars → Python."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def json_line(obj: dict[str, Any]) -> str:
    return json.dumps(json_safe(obj), allow_nan=False, separators=(",", ":")) + "\n"


def last_wall_s(path: Path, tail_bytes: int = 1 << 16) -> float:
    """wall_s of the last complete line of a metrics.jsonl (0.0 if none): reads only the tail."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - tail_bytes))
            lines = fh.read().splitlines()
    except OSError:
        return 0.0
    for line in reversed(lines):
        try:
            row = json.loads(line)
            value = None if row.get("superseded") else row.get("wall_s")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            return float(value)
    return 0.0


def step_row(record: StepRecord, wall_s: float, tokens_per_s: float | None = None, **extra: Any) -> dict[str, Any]:
    """One metrics.jsonl row. tokens_per_s defaults to global_batch_size·seq_len / step_s, with
    seq_len = tokens / samples (both cumulative, so it holds after a resume). `mfu` (model FLOPs
    utilisation, `runtime/train/perf.py`) and `peak_memory_bytes` (the fullest rank's peak
    so far) come from the trainer in `extra`; null when not given."""
    plan = record.plan
    if tokens_per_s is None:
        seq_len = record.tokens / record.samples if record.samples else 0.0
        tokens_per_s = plan.global_batch_size * seq_len / record.step_s if record.step_s > 0 else float("nan")
    row = {
        "step": record.step,
        "samples": record.samples,
        "tokens": record.tokens,
        "wall_s": wall_s,
        "step_s": record.step_s,
        "loss": record.loss,
        "lr": record.lr,
        "global_batch_size": plan.global_batch_size,
        "micro_batch_size": plan.micro_batch_size,
        "num_microbatches": plan.num_microbatches,
        "dp": plan.dp,
        "tp": plan.tp,
        "pp": plan.pp,
        "grad_sqnorm": record.grad_sqnorm,
        "grad_trace_cov": record.grad_trace_cov,
        "b_noise": record.b_noise,
        "b_noise_rel_err": record.b_noise_rel_err,
        "tokens_per_s": tokens_per_s,
        "skipped": record.skipped,
        "mfu": None,
        "peak_memory_bytes": None,
    }
    row.update(extra)
    return row


class RunWriter:
    """Writes a run folder (rank 0 only): config, per-step metrics, evals, decisions, TensorBoard,
    a tqdm progress bar and the final summary.

    The progress bar counts steps when `total_steps` > 0, else tokens when `total_tokens` > 0; it
    is shown only when `progress` is true and stderr is a terminal."""

    def __init__(
        self,
        run_dir: str | Path,
        rank0: bool = True,
        tensorboard: bool = False,
        progress: bool = False,
        total_steps: int = 0,
        total_tokens: int = 0,
        wall_offset_s: float | None = None,
        progress_interval_s: float = 30.0,
        trackers: list[Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.rank0 = rank0
        if wall_offset_s is None:  # a resumed run continues the clock of its metrics.jsonl
            wall_offset_s = last_wall_s(self.run_dir / "metrics.jsonl") if rank0 else 0.0
        self._t0 = time.monotonic() - wall_offset_s
        self._files: dict[str, Any] = {}
        self._tb = None
        self._bar = None
        self._bar_unit = "step" if total_steps > 0 else "token"
        self._bar_pos = 0
        self.last_step: dict[str, Any] | None = None
        self.last_eval: dict[str, Any] | None = None
        self.batch_timeline: list[dict[str, Any]] = []  # each change of global/micro batch
        self.plan_timeline: list[dict[str, Any]] = []  # each change of (dp, tp, pp)
        self.switches: list[dict[str, Any]] = []  # decisions with their measured cost
        self.first_step: int | None = None
        self._totals = (total_steps, total_tokens)
        self._plain_every_s: float | None = None  # plain progress lines (no usable terminal)
        self._plain_last = -math.inf
        if not rank0:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # lazy: heavy import

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))
        if trackers:  # W&B / MLflow get what TensorBoard gets (runtime/state/trackers.py)
            from copus.runtime.state.trackers import with_trackers

            self._tb = with_trackers(self._tb, trackers)
        if progress and not usable_terminal():
            self._plain_every_s = float(progress_interval_s)
        elif progress:
            from tqdm import tqdm

            total = total_steps if total_steps > 0 else (total_tokens or None)
            self._bar = tqdm(
                total=total,
                unit=self._bar_unit,
                unit_scale=self._bar_unit == "token",
                leave=True,
                file=sys.stderr,
                dynamic_ncols=True,
            )

    # ----------------------------------------------------------------------------------- files

    def console(self, line: str) -> None:
        """Print one line to stdout, above the progress bar when there is one (rank 0)."""
        if not self.rank0:
            return
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def set_state(self, state: str, **info: Any) -> None:
        """run.json: the folder's state (`run_folder.write_state`), rank 0."""
        if self.rank0:
            from copus.runtime.state.run_folder import write_state

            write_state(self.run_dir, state, **info)

    def supersede_after(self, step: int) -> int:
        """Mark every log row with step > `step` superseded (a resume from checkpoint `step`):
        each file is rewritten atomically (tmp, fsync, rename); the wall clock continues from
        the last row kept. Returns the number of rows marked (rank 0; 0 elsewhere)."""
        if not self.rank0:
            return 0
        for fh in self._files.values():
            fh.close()
        self._files.clear()
        marked = sum(supersede_jsonl(self.run_dir / name, step) for name in LOG_FILES)
        self._t0 = time.monotonic() - last_wall_s(self.run_dir / "metrics.jsonl")
        if marked:
            self.console(
                f"copus: resume from step {step}: {marked} log rows written after that checkpoint are marked superseded"
            )
        return marked

    def wall_s(self) -> float:
        """Seconds since this writer was created, plus the wall_s already in the run folder."""
        return time.monotonic() - self._t0

    def _append(self, name: str, obj: dict[str, Any]) -> None:
        fh = self._files.get(name)
        if fh is None:
            path = self.run_dir / name
            # a line cut short by a crash must not swallow the next one
            needs_newline = path.exists() and path.stat().st_size > 0 and _last_byte(path) != b"\n"
            fh = self._files[name] = open(path, "a", encoding="utf-8")
            if needs_newline:
                fh.write("\n")
        fh.write(json_line(obj))
        fh.flush()

    def write_config(self, config: Any) -> None:
        """config.toml from a `copus.config.Config` or a TOML string (atomic replace)."""
        if not self.rank0:
            return
        if not isinstance(config, str):
            from copus.config import config_to_toml

            config = config_to_toml(config)
        tmp = self.run_dir / "config.toml.tmp"
        tmp.write_text(config, encoding="utf-8")
        tmp.replace(self.run_dir / "config.toml")

    def log_step(
        self, record: StepRecord, wall_s: float | None = None, tokens_per_s: float | None = None, **extra: Any
    ) -> dict[str, Any] | None:
        """Append one metrics.jsonl line (extra keys allowed), TensorBoard, progress bar."""
        if not self.rank0:
            return None
        row = step_row(record, self.wall_s() if wall_s is None else wall_s, tokens_per_s, **extra)
        self._append("metrics.jsonl", row)
        self._track_timelines(row)
        if self._tb is not None:
            for key in TB_KEYS:
                v = row.get(key)
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(f"train/{key}", v, record.step)
        self._advance_bar(row)
        self._plain_progress(row)
        self.last_step = row
        return row

    def _track_timelines(self, row: dict[str, Any]) -> None:
        if self.first_step is None:
            self.first_step = row["step"]
        batch = (row["global_batch_size"], row["micro_batch_size"])
        last = self.batch_timeline[-1] if self.batch_timeline else None
        if last is None or (last["global_batch_size"], last["micro_batch_size"]) != batch:
            self.batch_timeline.append(
                {k: row[k] for k in ("step", "tokens", "wall_s", "global_batch_size", "micro_batch_size")}
            )
        layout = (row["dp"], row["tp"], row["pp"])
        last = self.plan_timeline[-1] if self.plan_timeline else None
        if last is None or (last["dp"], last["tp"], last["pp"]) != layout:
            self.plan_timeline.append({k: row[k] for k in ("step", "tokens", "wall_s", "dp", "tp", "pp")})

    def _advance_bar(self, row: dict[str, Any]) -> None:
        if self._bar is None:
            return
        self._bar.set_postfix_str(
            f"loss {_fmt(row['loss'], '.4f')} | {_fmt(row['tokens_per_s'], ',.0f')} tok/s | "
            f"B {row['global_batch_size']} {row_layout(row)} "
            f"| b_noise {_fmt(row['b_noise'], '.1f')}{_perf_text(row, ' | ')}",
            refresh=False,
        )
        pos = row["step"] if self._bar_unit == "step" else row["tokens"]
        self._bar.update(max(0, pos - self._bar_pos))
        self._bar_pos = pos

    def _plain_progress(self, row: dict[str, Any]) -> None:
        """Without a usable terminal: one plain line every `log.progress_interval_s`."""
        if self._plain_every_s is None:
            return
        now = time.monotonic()
        if now - self._plain_last < self._plain_every_s:
            return
        self._plain_last = now
        self.console(progress_line(row, *self._totals))

    def log_eval(
        self,
        step: int,
        val_loss: float,
        *,
        samples: int = 0,
        tokens: int = 0,
        wall_s: float | None = None,
        **extra: Any,
    ) -> None:
        """Append one eval.jsonl line: step, samples, tokens, wall_s, val_loss (+ extra)."""
        if not self.rank0:
            return
        row = {
            "step": step,
            "samples": samples,
            "tokens": tokens,
            "wall_s": self.wall_s() if wall_s is None else wall_s,
            "val_loss": val_loss,
            **extra,
        }
        self._append("eval.jsonl", row)
        if self._tb is not None and math.isfinite(val_loss):
            self._tb.add_scalar("eval/val_loss", val_loss, step)
        self.console(f"copus: step {step}: val_loss {_fmt(val_loss, '.4f')}")
        self.last_eval = row

    def log_decision(
        self, decision: Decision, *, switch_s: float | None = None, wall_s: float | None = None, **extra: Any
    ) -> None:
        """Append one decisions.jsonl line: Decision.to_dict() + wall_s + measured switch cost
        (`switch_s`, seconds the batch change or reconfiguration took, None if not measured)."""
        if not self.rank0:
            return
        row = {
            **decision.to_dict(),
            "wall_s": self.wall_s() if wall_s is None else wall_s,
            "switch_s": switch_s,
            **extra,
        }
        self._append("decisions.jsonl", row)
        self.switches.append(
            {
                k: row[k]
                for k in (
                    "step",
                    "kind",
                    "dp",
                    "tp",
                    "pp",
                    "micro_batch_size",
                    "global_batch_size",
                    "switch_s",
                    "reason",
                )
            }
        )
        if self._tb is not None and switch_s is not None:
            self._tb.add_scalar(f"switch/{decision.kind}_s", switch_s, decision.step)

    def log_event(self, row: dict[str, Any]) -> None:
        """Append a controller event (probe result, audit; it has an "event" key) to
        decisions.jsonl, with the wall time."""
        if self.rank0:
            self._append("decisions.jsonl", {**row, "wall_s": self.wall_s()})

    # --------------------------------------------------------------------------------- summary

    def summary(self, wall_s: float | None = None, **extra: Any) -> dict[str, Any]:
        """Write summary.json and summary.txt, print the text to stderr, return the dict."""
        if not self.rank0:
            return {}
        last = self.last_step or {}
        data = {
            "steps": last.get("step", 0),
            "samples": last.get("samples", 0),
            "tokens": last.get("tokens", 0),
            "wall_s": self.wall_s() if wall_s is None else wall_s,
            "final_loss": last.get("loss"),
            "final_lr": last.get("lr"),
            "final_val_loss": (self.last_eval or {}).get("val_loss"),
            "final_b_noise": last.get("b_noise"),
            "batch_timeline": self.batch_timeline,
            "plan_timeline": self.plan_timeline,
            "switches": self.switches,
            "switch_s_total": sum(s["switch_s"] or 0.0 for s in self.switches),
            **extra,
        }
        data = json_safe(data)
        text = summary_text(data)
        (self.run_dir / "summary.json").write_text(json.dumps(data, indent=2) + "\n")
        (self.run_dir / "summary.txt").write_text(text)
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        print(text, file=sys.stderr, end="")
        return data

    def close(self) -> None:
        for fh in self._files.values():
            fh.close()
        self._files.clear()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(-1, 2)
        return fh.read(1)


def usable_terminal() -> bool:
    """Whether stderr is a terminal that reports a width (some pseudo-terminals report 0
    columns, where tqdm draws nothing): the progress bar is shown only then."""
    try:
        return sys.stderr.isatty() and os.get_terminal_size(sys.stderr.fileno()).columns > 0
    except (OSError, ValueError):
        return False


def row_layout(row: dict[str, Any]) -> str:
    """A metrics row's plan in the canonical spelling (`core.plan.layout_name`)."""
    return layout_name(row["dp"], row["tp"], row["pp"], row["micro_batch_size"], row.get("num_microbatches"))


def progress_line(row: dict[str, Any], total_steps: int = 0, total_tokens: int = 0) -> str:
    """The plain progress line: step, tokens (and % of the run), loss, throughput, plan."""
    done = (
        f" ({row['tokens'] / total_tokens:.0%})"
        if total_tokens > 0
        else f" ({row['step'] / total_steps:.0%})"
        if total_steps > 0
        else ""
    )
    return (
        f"copus: step {row['step']}, {row['tokens']:,} tokens{done}, loss "
        f"{_fmt(row['loss'], '.4f')}, {_fmt(row['tokens_per_s'], ',.0f')} tokens/s, "
        f"B {row['global_batch_size']} {row_layout(row)}{_perf_text(row, ', ')}, "
        f"{_fmt(row['wall_s'], '.0f')} s"
    )


def _perf_text(row: dict[str, Any], sep: str) -> str:
    """ "MFU 41.2%" and "peak 37.9 GiB" when the row has them ("" otherwise)."""
    parts = []
    if isinstance(row.get("mfu"), (int, float)) and math.isfinite(row["mfu"]):
        parts.append(f"MFU {row['mfu']:.1%}")
    if isinstance(row.get("peak_memory_bytes"), (int, float)):
        parts.append(f"peak {row['peak_memory_bytes'] / 2**30:.1f} GiB")
    return "".join(sep + p for p in parts)


def supersede_jsonl(path: Path, step: int) -> int:
    """Add `"superseded": true` to the rows of a JSONL log with "step" > `step` (a line cut
    short by a crash is dropped); atomic rewrite, only when a row changes. Returns the number
    of rows newly marked."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError:
        return 0
    out, marked, changed = [], 0, False
    for line in lines:
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            changed = changed or bool(line.strip())
            continue
        if (
            isinstance(row, dict)
            and isinstance(row.get("step"), int)
            and row["step"] > step
            and not row.get("superseded")
        ):
            row["superseded"] = True
            marked += 1
            out.append(json_line(row).encode())
        else:
            out.append(line + b"\n")
    if not (marked or changed):
        return 0
    atomic_write_bytes(path, b"".join(out))
    return marked


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return format(v, spec)


def summary_text(s: dict[str, Any]) -> str:
    """The human-readable end-of-run summary (also summary.txt)."""
    lines = [
        f"copus: {s['steps']} steps, {s['tokens']:,} tokens, {_fmt(s['wall_s'], '.1f')} s "
        f"({_fmt(s['tokens'] / s['wall_s'] if s['wall_s'] else None, ',.0f')} tokens/s)",
        f"  final loss {_fmt(s['final_loss'], '.4f')}, val loss {_fmt(s['final_val_loss'], '.4f')}"
        f", b_noise {_fmt(s['final_b_noise'], '.1f')}"
        + (f" ({s['val_note']})" if s.get("val_note") and s["final_val_loss"] is None else ""),
        "  batch: "
        + (
            " -> ".join(f"{b['global_batch_size']}(mb{b['micro_batch_size']})@{b['step']}" for b in s["batch_timeline"])
            or "-"
        ),
        "  plans: "
        + (" -> ".join(f"{layout_name(p['dp'], p['tp'], p['pp'])}@{p['step']}" for p in s["plan_timeline"]) or "-"),
    ]
    for sw in s["switches"]:
        lines.append(
            f"  switch @{sw['step']}: {sw['kind']} -> "
            f"{layout_name(sw['dp'], sw['tp'], sw['pp'], sw['micro_batch_size'])} "
            f"B={sw['global_batch_size']}, cost {_fmt(sw['switch_s'], '.2f')} s"
        )
    return "\n".join(lines) + "\n"
