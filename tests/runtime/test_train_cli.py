"""`copus train`: flags → config, validation before spawning (exit 2, one line), 2-process smoke."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from copus.cli import build_parser
from copus.commands.train import DEFAULT_RUN, resolve_config


def _args(*argv: str):
    return build_parser().parse_args(["train", *argv])


def test_no_arguments_gives_the_default_small_run():
    cfg = resolve_config(_args())
    assert cfg.parallel.nproc == DEFAULT_RUN[("parallel", "nproc")] == 2
    assert cfg.train.max_tokens == DEFAULT_RUN[("train", "max_tokens")]
    assert cfg.model.name == "tiny" and cfg.data.source == "embedded"


def test_flags_and_set_override_and_win(tmp_path):
    conf = tmp_path / "c.toml"
    conf.write_text("[parallel]\nnproc = 4\n[batch]\npolicy = 'gns'\n")
    cfg = resolve_config(
        _args(
            "--config",
            str(conf),
            "--set",
            "batch.initial=16",
            "--max-steps",
            "7",
            "--policy",
            "norm-test",
            "--seed",
            "3",
        )
    )
    assert cfg.parallel.nproc == 4  # named in the file: no command default
    assert cfg.batch.policy == "norm-test"  # flag wins over the file
    assert cfg.batch.initial == 16 and cfg.train.seed == 3
    assert cfg.train.max_steps == 7 and cfg.train.max_tokens == 0  # steps named: no token cap


def test_model_config_json_and_seq_len_flags(tmp_path, monkeypatch):
    (tmp_path / "tiny.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 128,
                "vocab_size": 256,
            }
        )
    )
    monkeypatch.chdir(tmp_path)
    cfg = resolve_config(_args("--model", "tiny.json", "--seq-len", "64"))
    assert cfg.model.name == str(tmp_path / "tiny.json")  # absolute: workers find the same file
    assert cfg.model.seq_len == 64


def test_resume_reads_the_run_folder_config(tmp_path):
    (tmp_path / "config.toml").write_text("[train]\nmax_steps = 5\nseed = 11\n")
    cfg = resolve_config(_args("--run-dir", str(tmp_path), "--resume", "--max-steps", "9"))
    assert cfg.train.seed == 11 and cfg.train.max_steps == 9


def test_print_config_prints_the_resolved_toml_that_loads_back(tmp_path, capsys):
    from copus.cli import main
    from copus.config import load_config

    conf = tmp_path / "c.toml"
    conf.write_text("[batch]\npolicy = 'gns'\n")
    argv = ["--config", str(conf), "--set", "batch.initial=16", "--max-steps", "7"]
    assert main(["train", *argv, "--print-config"]) == 0
    text = capsys.readouterr().out
    assert "[batch]" in text and 'policy = "gns"' in text and "initial = 16" in text
    (tmp_path / "printed.toml").write_text(text)
    assert load_config(str(tmp_path / "printed.toml")) == resolve_config(_args(*argv))


def test_print_config_reports_a_bad_key_with_exit_2(tmp_path):
    out = _copus_train("--set", "train.lr_shedule=1", "--print-config", cwd=tmp_path)
    assert out.returncode == 2 and "did you mean train.lr_schedule?" in out.stderr
    assert out.stdout == ""


def test_resume_auto_decides_from_the_folder(tmp_path):
    from copus.commands.train import has_complete_checkpoint, holds_failed_attempt, set_aside

    run = tmp_path / "run"
    assert not has_complete_checkpoint(run) and not holds_failed_attempt(run)  # new folder
    (run / "checkpoints" / "step-4").mkdir(parents=True)  # a partial save only
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert not has_complete_checkpoint(run) and holds_failed_attempt(run)
    target = set_aside(run)
    assert sorted(p.name for p in run.iterdir()) == ["previous-attempts"]
    assert (target / "metrics.jsonl").is_file() and target.name == "1"
    assert holds_failed_attempt(run)  # a second requeue before any save: attempt 2
    (run / "run.json").write_text("{}")
    assert set_aside(run).name == "2"


def test_resume_bad_value_is_one_line():
    out = subprocess.run(
        [sys.executable, "-m", "copus", "train", "--run-dir", "x", "--resume", "always"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--resume 'always': allowed: --resume, or --resume auto" in out.stderr


def _copus_train(*argv: str, cwd: Path, timeout: float = 120):
    return subprocess.run(
        [sys.executable, "-m", "copus", "train", *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--set", "batch.initial=0"], "batch.initial=0"),
        (["--set", "train.lr=-1"], "train.lr=-1"),
        (["--set", "nosuch.key=1"], "nosuch"),
        (["--set", "parallel.tp=4", "--nproc", "4"], "tp=4 must divide n_heads=6"),
        (["--nproc", "2", "--set", "batch.initial=9", "--set", "batch.min=1"], "batch.initial=9"),
        (["--policy", "fastest"], "batch.policy='fastest'"),
        (["--config", "missing.toml"], "missing.toml"),
        (
            ["--nproc", "2", "--policy", "ramp", "--set", "parallel.layouts=dp4@8"],
            "layout dp4.tp1.pp1: dp*tp*pp=4*1*1=4 must equal the world size 2",
        ),
        (["--nproc", "2", "--set", "parallel.layouts=dp2@8"], "batch-only policy"),
        (["--nproc", "2", "--policy", "ramp", "--set", "parallel.layouts=dp2@16"], "no layout for batch.initial=8"),
        (["--policy", "ramp", "--set", "parallel.layouts=dp2"], "entry 'dp2' is invalid"),
        (["--model", "absent.json"], "absent.json' cannot be read"),
        (["--seq-len", "-4"], "model.seq_len=-4"),
        (["--set", "train.dtype=fp16"], "train.dtype='fp16'"),
        (["--set", "parallel.activation_checkpointing=partial"], "parallel.activation_checkpointing='partial'"),
    ],
)
def test_bad_config_exits_2_with_one_line_and_spawns_nothing(tmp_path, argv, needle):
    run_dir = tmp_path / "run"
    out = _copus_train(*argv, "--run-dir", str(run_dir), cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("copus train: error:"), out.stderr
    assert needle in lines[0] and "Traceback" not in out.stderr
    assert not run_dir.exists()  # nothing was started


def test_compile_without_inductor_exits_2_and_spawns_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")  # inductor's CPU backend finds no compiler
    run_dir = tmp_path / "run"
    out = _copus_train("--set", "train.compile=true", "--run-dir", str(run_dir), cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.compile=true is unavailable here" in lines[0], out.stderr
    assert "allowed: train.compile=false" in lines[0]
    assert not run_dir.exists()


@pytest.mark.slow
def test_layout_map_switches_layout_in_process_when_the_ramp_crosses_it(tmp_path):
    """`parallel.layouts` with the ramp: pp2 for B < 16, dp2 from 16; the ramp doubles the batch
    after 32 samples, and the trainer switches layout in the same processes (no restart)."""
    run_dir = tmp_path / "run"
    out = _copus_train(
        "--nproc",
        "2",
        "--max-steps",
        "8",
        "--run-dir",
        str(run_dir),
        "--policy",
        "ramp",
        "--set",
        "parallel.layouts=pp2@8,dp2@16",
        "--set",
        "batch.ramp_to=16",
        "--set",
        "batch.ramp_kind=stepwise",
        "--set",
        "batch.ramp_steps=1",
        "--set",
        "batch.ramp_samples=32",
        "--set",
        "batch.warmup_steps=0",
        "--set",
        "batch.interval_steps=1",
        "--set",
        "data.max_chars=200000",
        "--set",
        "eval.interval_steps=0",
        "--set",
        "checkpoint.interval_steps=0",
        "--set",
        "log.progress=false",
        "--set",
        "log.tensorboard=false",
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))  # one lineage: no restart
    layouts = [(r["dp"], r["tp"], r["pp"], r["global_batch_size"]) for r in rows]
    switch_at = next(i for i, r in enumerate(rows) if r["dp"] == 2)
    assert layouts[:switch_at] == [(1, 1, 2, 8)] * switch_at and switch_at >= 4
    assert layouts[switch_at:] == [(2, 1, 1, 16)] * (8 - switch_at)
    samples = 0
    for r in rows:  # every sample once
        samples += r["global_batch_size"]
        assert r["samples"] == samples
    decisions = [json.loads(x) for x in (run_dir / "decisions.jsonl").read_text().splitlines()]
    applied = [d for d in decisions if d.get("applied")]
    assert len(applied) == 1 and applied[0]["kind"] == "reconfigure"
    assert "from parallel.layouts (dp1.tp1.pp2@8, dp2.tp1.pp1@16)" in applied[0]["reason"]
    assert applied[0]["switch"]["method"] == "direct" and applied[0]["switch_s"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_plan"]["dp"] == 2 and summary["steps"] == 8


@pytest.mark.slow
def test_resume_auto_starts_fresh_then_resumes(tmp_path):
    """A requeue script's command, run three times: a folder whose first attempt died before any
    checkpoint starts fresh (the attempt set aside); once a checkpoint exists it resumes."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text('{"state": "running"}')  # died before any save
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    common = [
        "--nproc",
        "1",
        "--run-dir",
        str(run_dir),
        "--resume",
        "auto",
        "--policy",
        "constant",
        "--set",
        "data.max_chars=100000",
        "--set",
        "eval.interval_steps=0",
        "--set",
        "checkpoint.interval_steps=2",
        "--set",
        "log.progress=false",
        "--set",
        "log.tensorboard=false",
    ]
    out = _copus_train(*common, "--max-steps", "2", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "starting fresh" in out.stderr
    assert (run_dir / "previous-attempts" / "1" / "metrics.jsonl").read_text().startswith('{"step": 1, "loss": 9.0}')
    out = _copus_train(*common, "--max-steps", "3", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # resumed at step 2, not restarted
    # every checkpoint corrupt (complete, checksums wrong): the launcher hashes nothing, the
    # workers find it; one line, exit 1, nothing deleted or set aside
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"))
    for folder in ckpts:
        victim = folder / "__0_0.distcp"
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        victim.write_bytes(bytes(raw))
    out = _copus_train(*common, "--max-steps", "4", cwd=tmp_path, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("copus train: error:")]
    assert "no valid checkpoint" in line and "__0_0.distcp fails its sha256" in line and "none deleted" in line
    assert sorted((run_dir / "checkpoints").glob("step-*")) == ckpts
    assert not (run_dir / "previous-attempts" / "2").exists()


def test_init_from_sets_model_and_tokenizer_unless_named(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "intermediate_size": 96,
                "vocab_size": 256,
                "head_dim": 24,
            }
        )
    )
    from copus.runtime.state.export import byte_tokenizer_json

    (hf / "tokenizer.json").write_text(byte_tokenizer_json())
    cfg = resolve_config(_args("--init-from", str(hf)))
    assert cfg.model.init_from == str(hf) and cfg.model.name == str(hf / "config.json")
    assert cfg.data.tokenizer == str(hf)
    cfg = resolve_config(_args("--init-from", str(hf), "--set", "data.tokenizer='byte'"))
    assert cfg.data.tokenizer == "byte"
    with pytest.raises(ValueError, match=r"model.init_from=.*allowed: a folder whose config.json has n_layers=4"):
        resolve_config(_args("--init-from", str(hf), "--model", "tiny"))
    with pytest.raises(ValueError, match="model.init_from="):
        resolve_config(_args("--init-from", str(tmp_path / "absent")))


def test_tokenizer_from_a_hugging_face_folder(tmp_path):
    from copus.runtime.data.tokenizer import HfTokenizer, parse_spec
    from copus.runtime.state.export import byte_tokenizer_json
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(byte_tokenizer_json())
    tok.add_special_tokens(["<|im_end|>"])  # not one of EOS_NAMES: only tokenizer_config names it
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    spec = parse_spec(str(tmp_path))
    assert spec.path == str(tmp_path / "tokenizer.json")
    loaded = HfTokenizer.from_file(spec.path)
    assert loaded.eos_id == 256 and loaded.vocab_size == 257


def test_a_plan_that_measures_no_noise_scale_says_so_once(tmp_path):
    """One rank, one micro-batch of the whole batch: J = 1 small gradient, so the noise scale
    cannot update; the run says so once (not every step) and b_noise stays unmeasured."""
    run_dir = tmp_path / "run"
    out = _copus_train(
        "--nproc",
        "1",
        "--policy",
        "constant",
        "--max-steps",
        "3",
        "--set",
        "parallel.micro_batch_size=8",
        "--set",
        "data.max_chars=100000",
        "--run-dir",
        str(run_dir),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout + out.stderr
    assert text.count("dp1.tp1.pp1 mb8x1 (B=8) measures no noise scale (dp*num_microbatches = 1") == 1
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "step" in r]
    assert len(steps) == 3 and all(r.get("b_noise") is None for r in steps)
