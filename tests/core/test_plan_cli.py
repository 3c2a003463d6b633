"""`copus plan`: JSON schema and ordering, table output, one-line errors (exit 2)."""

import json
import subprocess
import sys

import pytest

from copus.cli import main
from copus.core.specs.resolve import get_model_shape
from copus.core.plan.plan import ParallelPlan, plan_problems

KEYS = [
    "dp",
    "tp",
    "pp",
    "micro_batch_size",
    "num_microbatches",
    "global_batch_size",
    "step_s",
    "samples_per_s",
    "memory_bytes",
    "goodput",
    # issue 25: the plan options and per-device figures
    "activation_checkpointing",
    "pipeline_schedule",
    "virtual_stages",
    "sequence_parallel",
    "reshard_after_forward",
    "runnable",
    "tokens_per_s_per_device",
    "mfu",
    "time",
]
BASE = ["plan", "--model", "llama-3.2-3b", "--gpus", "8", "--hardware", "h100-nvlink-pairs"]


def _run(*args):
    return subprocess.run([sys.executable, "-m", "copus", *BASE, *args], capture_output=True, text=True)


def _check_rows(rows, min_b, max_b):
    shape = get_model_shape("llama-3.2-3b")
    assert rows and all(list(r) == KEYS for r in rows)
    goodputs = [r["goodput"] for r in rows]
    assert goodputs == sorted(goodputs, reverse=True)
    for r in rows:
        plan = ParallelPlan(**{k: r[k] for k in KEYS[:5] + KEYS[10:15]})
        assert not plan_problems(plan, 8, shape)
        assert r["global_batch_size"] == plan.global_batch_size and min_b <= plan.global_batch_size <= max_b
        assert r["samples_per_s"] == pytest.approx(r["global_batch_size"] / r["step_s"])
        assert 0 < r["memory_bytes"] <= 80e9


def test_json_schema_and_order_subprocess():
    out = _run("--global-batch", "16", "--json", "--top", "7")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert len(rows) == 7
    _check_rows(rows, 16, 16)
    # fixed batch, unknown b_noise: goodput is throughput
    assert all(r["goodput"] == pytest.approx(r["samples_per_s"]) for r in rows)


def test_json_over_a_batch_range_with_b_noise(capsys):
    assert (
        main(
            [
                *BASE,
                "--global-batch",
                "16",
                "--max-batch",
                "256",
                "--b-noise",
                "100",
                "--micro-batch-sizes",
                "1,2,4",
                "--top",
                "50",
                "--json",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    _check_rows(rows, 16, 256)
    assert {r["micro_batch_size"] for r in rows} <= {1, 2, 4}
    assert len({r["global_batch_size"] for r in rows}) > 1


def test_memory_limit_prunes(capsys):
    main([*BASE, "--global-batch", "64", "--top", "1000", "--json"])
    full = json.loads(capsys.readouterr().out)
    main([*BASE, "--global-batch", "64", "--top", "1000", "--json", "--memory-gb", "25"])
    small = json.loads(capsys.readouterr().out)
    assert 0 < len(small) < len(full) and all(r["memory_bytes"] <= 25e9 for r in small)


def test_table_output(capsys):
    assert main([*BASE, "--global-batch", "16", "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "samples/s" in out[1] and "goodput" in out[1] and "mem GB" in out[1]
    assert len(out) == 3 + 3


@pytest.mark.parametrize(
    "args,match",
    [
        (["--gpus", "0"], "--gpus=0"),
        (["--global-batch", "0"], "--global-batch=0"),
        (["--micro-batch-sizes", "1,x"], "--micro-batch-sizes"),
        (["--b-noise", "-3"], "--b-noise=-3"),
        (["--hardware", "tpu"], "unknown hardware 'tpu'"),
        (["--hardware", "tpu", "--peak-tflops", "100"], "--memory-gib X"),
        (["--peak-tflops", "-1"], "--peak-tflops=-1.0"),
        (["--pipeline-schedule", "zigzag"], "--pipeline-schedule"),
        (["--model", "nope"], "unknown model 'nope'"),
        (["--memory-gb", "0.5"], "no plan"),
        (["--max-batch", "4"], "--max-batch=4"),
    ],
)
def test_bad_values_exit_2_with_one_line(capsys, args, match):
    assert main([*BASE, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1


def test_bad_value_subprocess_exit_code():
    out = _run("--gpus", "0")
    assert out.returncode == 2 and "--gpus=0" in out.stderr and "Traceback" not in out.stderr


def test_copus_plan_does_not_import_torch():
    code = (
        "import sys\nfrom copus.cli import main\n"
        f"assert main({[*BASE, '--top', '2']!r}) == 0\n"
        "assert 'torch' not in sys.modules, 'copus plan imported torch'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_config_fills_the_flags_not_given_and_flags_win(tmp_path, capsys):
    conf = tmp_path / "run.toml"
    conf.write_text(
        "[model]\nname = 'llama-2-7b'\nseq_len = 1024\n[parallel]\nnproc = 16\n"
        "micro_batch_size = 2\n[batch]\ninitial = 32\nmax = 64\n"
    )
    assert main(["plan", "--config", str(conf), "--hardware", "h100-sxm", "--json", "--top", "50"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["micro_batch_size"] for r in rows} == {2}  # parallel.micro_batch_size
    assert {r["dp"] * r["tp"] * r["pp"] for r in rows} == {16}  # parallel.nproc
    assert min(r["global_batch_size"] for r in rows) >= 32 and max(r["global_batch_size"] for r in rows) <= 64
    assert main(["plan", "--config", str(conf), "--gpus", "8", "--global-batch", "64", "--top", "1"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert head.startswith("llama-2-7b (seq 1024) on 8 x h100-sxm") and "global batch 64..64" in head


def test_config_errors_are_one_line(tmp_path):
    conf = tmp_path / "run.toml"
    conf.write_text("[batch]\nmaxx = 3\n")
    out = subprocess.run([sys.executable, "-m", "copus", "plan", "--config", str(conf)], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "did you mean batch.max?" in out.stderr


# COPUS's eight start/end layouts (Table 2; core/sim/presets.py), typed as docs/cost-model.md
# types them: `copus plan --model M --gpus N --hardware HW --global-batch B --by-layout --top 5`.
PUBLISHED = [
    ("llama-3.2-3b", 8, "h100-nvlink-pairs", 16, (2, 1, 4)),
    ("llama-3.2-3b", 8, "h100-nvlink-pairs", 1024, (8, 1, 1)),
    ("llama-2-13b", 16, "h100-nvlink-pairs", 16, (1, 2, 8)),
    ("llama-2-13b", 16, "h100-nvlink-pairs", 1024, (4, 1, 4)),
    ("qwen-2.5-32b", 32, "h100-nvlink-pairs", 16, (1, 2, 16)),
    ("qwen-2.5-32b", 32, "h100-nvlink-pairs", 512, (2, 2, 8)),
    ("llama-2-7b", 32, "mi210", 16, (2, 4, 4)),
    ("llama-2-7b", 32, "mi210", 1024, (8, 1, 4)),
]


@pytest.mark.parametrize("model,gpus,hw,batch,layout", PUBLISHED)
def test_published_layouts_first_or_within_3_percent_as_documented(capsys, model, gpus, hw, batch, layout):
    argv = [
        "plan",
        "--model",
        model,
        "--gpus",
        str(gpus),
        "--hardware",
        hw,
        "--global-batch",
        str(batch),
        "--by-layout",
        "--top",
        "5",
        "--json",
    ]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    mine = [r for r in rows if (r["dp"], r["tp"], r["pp"]) == layout]
    assert mine, f"{layout} not in the top 5 layouts: {[(r['dp'], r['tp'], r['pp']) for r in rows]}"
    assert mine[0]["samples_per_s"] >= 0.97 * rows[0]["samples_per_s"]
    # the runtime's defaults: the engine's schedules only
    assert {r["pipeline_schedule"] for r in rows} <= {"1f1b", "gpipe"}


def test_time_split_sums_to_the_step_and_names_each_cost(capsys):
    for extra in ([], ["--hardware", "h100-sxm", "--model", "llama-2-7b", "--gpus", "16"]):
        assert main([*BASE, "--global-batch", "64", "--top", "30", "--json", *extra]) == 0
        rows = json.loads(capsys.readouterr().out)
        for r in rows:
            assert sum(r["time"].values()) == pytest.approx(r["step_s"], rel=1e-9)
            assert all(v >= -1e-12 for v in r["time"].values())
        assert any(r["time"]["bubble_s"] > 0 for r in rows if r["pp"] > 1)
        assert all(r["time"]["recompute_s"] > 0 for r in rows if r["activation_checkpointing"] != "none")


def test_time_split_in_the_table(capsys):
    assert main([*BASE, "--global-batch", "16", "--top", "3", "--time-split"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[6].startswith("where the step time goes") and len(lines) == 7 + 3
    assert all("compute" in line and "bubble" in line for line in lines[7:])  # pp > 1 rows at B = 16


def test_interleaved_is_ranked_only_on_request_and_marked_not_runnable(capsys):
    assert main([*BASE, "--model", "llama-2-7b", "--global-batch", "32", "--top", "1000", "--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert {r["pipeline_schedule"] for r in default} == {"1f1b", "gpipe"}
    assert all(r["runnable"] for r in default)  # llama-2-7b: untied embeddings
    assert (
        main(
            [
                *BASE,
                "--model",
                "llama-2-7b",
                "--global-batch",
                "32",
                "--top",
                "1000",
                "--json",
                "--pipeline-schedule",
                "all",
            ]
        )
        == 0
    )
    every = json.loads(capsys.readouterr().out)
    inter = [r for r in every if r["pipeline_schedule"] == "interleaved-1f1b"]
    assert inter and not any(r["runnable"] for r in inter)
    assert all(r["runnable"] for r in every if r["pipeline_schedule"] != "interleaved-1f1b")
    # tied embeddings split by a pipeline: the engine refuses them, the table says so
    assert main([*BASE, "--global-batch", "16", "--top", "1000", "--json"]) == 0
    tied = json.loads(capsys.readouterr().out)
    assert all(r["runnable"] == (r["pp"] == 1) for r in tied)
    assert main([*BASE, "--global-batch", "16", "--top", "40"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert " run " in lines[1] and any(" no " in line for line in lines[3:])


def test_default_precision_is_the_runtimes_mixed_precision_policy(capsys):
    args = [*BASE, "--global-batch", "16", "--top", "1000", "--json", "--by-layout"]
    assert main(args) == 0
    default = json.loads(capsys.readouterr().out)
    assert main([*args, "--param-dtype", "bf16"]) == 0
    assert json.loads(capsys.readouterr().out) == default
    assert (
        main(
            [
                "plan",
                "--model",
                "llama-2-7b",
                "--gpus",
                "8",
                "--hardware",
                "h100-sxm",
                "--global-batch",
                "16",
                "--top",
                "5",
                "--json",
            ]
        )
        == 0
    )
    bf16 = json.loads(capsys.readouterr().out)
    assert (
        main(
            [
                "plan",
                "--model",
                "llama-2-7b",
                "--gpus",
                "8",
                "--hardware",
                "h100-sxm",
                "--global-batch",
                "16",
                "--top",
                "5",
                "--json",
                "--param-dtype",
                "fp32",
            ]
        )
        == 0
    )
    fp32 = json.loads(capsys.readouterr().out)
    assert bf16[0]["memory_bytes"] < fp32[0]["memory_bytes"]  # bf16 all-gathers, no fp32 weight copies


def test_custom_hardware_from_its_figures(capsys):
    figures = [
        "--peak-tflops",
        "989",
        "--memory-gib",
        "74.5",
        "--hbm-gbps",
        "3350",
        "--intra-node-gbps",
        "450",
        "--inter-node-gbps",
        "50",
    ]
    common = ["plan", "--model", "llama-2-7b", "--gpus", "16", "--global-batch", "32", "--top", "3", "--json"]
    assert main([*common, "--hardware", "my-h100", *figures]) == 0
    custom = json.loads(capsys.readouterr().out)
    assert main([*common, "--hardware", "h100-sxm"]) == 0
    known = json.loads(capsys.readouterr().out)
    # the H100 SXM's own figures: the same ranking, step times within the default latency's
    # difference (a custom profile's collective step latency is 10 µs, the SXM's 8 µs)
    assert [(r["dp"], r["tp"], r["pp"]) for r in custom] == [(r["dp"], r["tp"], r["pp"]) for r in known]
    assert custom[0]["step_s"] == pytest.approx(known[0]["step_s"], rel=0.01)
    # a figure overrides a known profile: half the peak, slower steps
    assert main([*common, "--hardware", "h100-sxm", "--peak-tflops", "494.5"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["step_s"] > 1.3 * known[0]["step_s"]
