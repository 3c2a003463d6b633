"""README.md is the product page: at most 10 KB; every command it shows is run end to end by a
named test (a README edit that adds a command without one fails here) and parses with copus's
own argument parser; every figure of its Results table is the number in the committed bench
JSON that the row names; no diary language."""

from __future__ import annotations

import ast
import json
import math
import re
import shlex
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "results"

E2E = "tests/runtime/test_commands_e2e.py"
TRAIN_CLI = "tests/runtime/test_train_cli.py"
HF = "tests/runtime/test_hf_roundtrip.py::test_hf_in_train_export_bf16_and_transformers_agrees"

# Every command the README shows -> the tests that run it (or its tiny-settings twin) end to end.
COVERED: dict[str, list[str]] = {
    "copus train": [
        f"{E2E}::test_train_writes_the_run_folder",
        f"{TRAIN_CLI}::test_no_arguments_gives_the_default_small_run",
    ],
    "copus train --print-config": [
        f"{E2E}::test_print_config_prints_toml_that_loads_and_starts_nothing",
        f"{TRAIN_CLI}::test_print_config_prints_the_resolved_toml_that_loads_back",
    ],
    "copus train --run-dir DIR --resume auto": [f"{TRAIN_CLI}::test_resume_auto_starts_fresh_then_resumes"],
    "copus train --init-from HF_FOLDER": [HF],
    "copus plan --model llama-3.2-3b --gpus 8 --hardware h100-nvlink-pairs --global-batch 16 --by-layout": [
        "tests/core/test_published_shifts.py::test_plan_by_layout_prints_each_layout_once"
    ],
    "copus profile --nproc 4 --global-batch 8,32,128": [
        "tests/runtime/test_profile.py::test_profile_writes_json_and_csv"
    ],
    "copus simulate --preset all": [f"{E2E}::test_simulate_preset_all_as_the_readme_writes_it"],
    "copus report RUN_DIR --out report/": [f"{E2E}::test_report_on_a_trained_run_writes_plots_and_table"],
    "copus prepare INPUT --out DIR": [
        f"{E2E}::test_prepare_writes_verified_token_shards",
        "tests/runtime/test_prepared_training.py::test_prepared_folder_exactly_once_across_batch_and_dp_changes_and_dp2_export",
    ],
    "copus export RUN_DIR --out DIR --dtype bfloat16": [HF],
    "copus calibrate RUN_DIR --steps 50,150 --multipliers 0.5,1,2,4,8": [
        f"{E2E}::test_calibrate_branches_each_checkpoint_and_writes_its_table"
    ],
    "copus train --nproc 4 --policy ramp --max-tokens 300000 --set parallel.layouts=pp4@8,dp2.pp2@32,dp4@128 "
    "--set batch.ramp_to=128 --set batch.ramp_kind=stepwise --set batch.ramp_steps=4 --set batch.ramp_samples=1200": [
        f"{TRAIN_CLI}::test_layout_map_switches_layout_in_process_when_the_ramp_crosses_it"
    ],
    "torchrun --nproc_per_node 2 examples/own_loop.py --policy norm-test --steps 60": [
        "tests/runtime/test_adapt.py::test_example_runs_under_torchrun_and_its_batch_grows"
    ],
}
PLACEHOLDERS = {"RUN_DIR": "run", "DIR": "out", "HF_FOLDER": "hf", "INPUT": "in.txt"}


def _text() -> str:
    return README.read_text()


def _section(title: str) -> str:
    return _text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _bash_commands(text: str) -> list[str]:
    """Each command of the ```bash blocks: continuation lines joined, `a && b` split."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            out += [c.strip() for c in line.split("&&") if c.strip()]
    return out


def readme_commands() -> list[str]:
    """The README's copus and example commands, normalised (`.venv/bin/copus` -> `copus`)."""
    table = [
        re.match(r"\| `([^`]+)`", row).group(1)
        for row in _section("Commands").splitlines()
        if row.startswith("| `copus ")
    ]
    cmds = [re.sub(r"^\.venv/bin/copus\b", "copus", c) for c in _bash_commands(_text()) + table]
    return [" ".join(c.split()) for c in cmds if c.startswith("copus ") or " examples/" in c]


def _table_rows(section: str) -> list[list[str]]:
    rows = [r for r in section.splitlines() if r.startswith("|")][2:]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", r)[1:-1]] for r in rows]


def test_readme_is_a_page_not_a_notebook():
    text = _text()
    assert len(text.encode()) <= 10 * 1024, f"README.md is {len(text.encode())} bytes"
    for doc, body in (("README.md", text), ("docs/results.md", (ROOT / "docs" / "results.md").read_text())):
        for pattern in (r"\bissue \d+", r"\bfirst pass\b", r"\bsecond pass\b", r"\bthe authors\b"):
            assert not re.search(pattern, body, flags=re.I), f"{doc}: {pattern}"
    assert "within 3 %" not in text  # the plan ranking claim no test proves


def test_every_readme_command_is_run_by_a_named_test():
    cmds = readme_commands()
    assert "copus train" in cmds and "copus calibrate RUN_DIR --steps 50,150 --multipliers 0.5,1,2,4,8" in cmds
    missing = [c for c in cmds if c not in COVERED]
    assert not missing, f"README commands no test runs (add a test and list it in COVERED): {missing}"
    for cmd, tests in COVERED.items():
        assert cmd in cmds, f"COVERED lists a command the README no longer shows: {cmd}"
        for node in tests:
            path, name = node.split("::")
            tree = ast.parse((ROOT / path).read_text())
            assert name in {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}, node


def _argv(cmd: str) -> list[str]:
    return [PLACEHOLDERS.get(a, a) for a in shlex.split(cmd)[1:]]


@pytest.mark.parametrize(
    "cmd",
    sorted(set(COVERED) | {r[2].strip("`") for r in _table_rows(_section("Results")) if r[2].startswith("`copus ")}),
)
def test_readme_commands_parse_and_their_train_configs_validate(cmd):
    """Flags and values as the README writes them: copus's parser accepts them, and a train
    command's config resolves (the checks `copus train` makes before it starts a worker)."""
    if not cmd.startswith("copus "):
        return
    from copus.cli import build_parser
    from copus.commands.train import resolve_config

    parser = build_parser()
    args, unknown = parser.parse_known_args(_argv(cmd))
    assert not unknown, f"{cmd}: {unknown}"
    if args.command == "train" and not set(shlex.split(cmd)) & set(PLACEHOLDERS):
        resolve_config(args)


# ---------------------------------------------------------------------------- the results table

FIGURE = re.compile(r"^([−-]?[\d,]*\.?\d+)(?: ± ([\d,]*\.?\d+))?(?: ?[a-zA-Z%]+)?$")


def _number(text: str) -> tuple[float, int]:
    """'−0.59' -> (-0.59, 2 decimals); '11,334' -> (11334.0, 0)."""
    text = text.replace("−", "-").replace(",", "")
    return float(text), len(text.split(".")[1]) if "." in text else 0


def _lookup(data, key: str):
    for part in key.split("/"):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


def _matches(value: float, quoted: str) -> bool:
    number, decimals = _number(quoted)
    return math.isclose(round(value, decimals), number, abs_tol=1e-9)


def results_rows() -> list[tuple[str, list[str], str, str, list[str]]]:
    """(what, bold figures, command, JSON file, keys) per row of the README's Results table."""
    rows = []
    for what, figures, command, source in _table_rows(_section("Results")):
        ticks = re.findall(r"`([^`]+)`", source)
        rows.append((what, re.findall(r"\*\*(.+?)\*\*", figures), command.strip("`"), ticks[0], ticks[1:]))
    return rows


def test_the_results_table_has_rows_with_sources():
    rows = results_rows()
    assert len(rows) >= 8
    for what, figures, _, source, keys in rows:
        assert figures and source.endswith(".json") and len(figures) == len(keys), what


@pytest.mark.parametrize("row", results_rows(), ids=lambda r: r[3] + ":" + r[4][0])
def test_every_readme_figure_is_in_its_committed_bench_json(row):
    what, figures, command, source, keys = row
    data = json.loads((RESULTS / source).read_text())
    for quoted, key in zip(figures, keys):
        m = FIGURE.match(quoted.strip())
        assert m, f"{what}: cannot read the figure {quoted!r}"
        value = _lookup(data, key)
        if m.group(2):  # mean ± sd over seeds
            seeds = list(value.values()) if isinstance(value, dict) else list(value)
            assert None not in seeds, f"{key}: a seed has no value"
            assert _matches(statistics.mean(seeds), m.group(1)), (key, statistics.mean(seeds), quoted)
            assert _matches(statistics.stdev(seeds), m.group(2)), (key, statistics.stdev(seeds), quoted)
        else:
            assert _matches(float(value), m.group(1)), (key, value, quoted)
    if command.startswith("python bench/"):  # the command that produced the JSON
        script = command.split()[1]
        assert (ROOT / script).is_file(), script
        if "command" in data:
            assert data["command"].startswith(command.rstrip(" …")), (data["command"], command)
