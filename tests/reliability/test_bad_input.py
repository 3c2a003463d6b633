"""Bad input never costs a traceback: ≥ 40 malformed configs and CLI arguments, table-driven.

Every case must end with exit code 2 and exactly one stderr line `copus <cmd>: error: ...` that
names the bad value (and, where a rule exists, what is allowed), before any worker starts.
Most cases call `copus.cli.main` in-process (fast) with the launcher replaced by a trap that
fails the test if a worker would start; a few run `python -m copus` for real to prove the exit
code and the absence of a traceback end to end.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from copus.cli import main

# Files the cases refer to as {name}; written by the `files` fixture.
FILES: dict[str, bytes | None] = {
    "bad_syntax.toml": b"[train\nlr = 3e-3\n",
    "code.toml": b"import os\nos.system('touch PWNED')\n",
    "dunder.toml": b"[train]\nlr = __import__('os').system('touch PWNED')\n",
    "unknown_section.toml": b"[trainer]\nlr = 1e-3\n",
    "unknown_key.toml": b"[train]\nlearning_rate = 1e-3\n",
    "not_table.toml": b"train = 5\n",
    "wrong_type.toml": b'[train]\nlr = "fast"\n',
    "neg_batch.toml": b"[batch]\ninitial = -8\n",
    "array.toml": b"[parallel]\nnproc = [1, 2]\n",
    "binary.txt": b"\xff\xfe\x00\x80 not utf-8 \xc3\x28",
    "broken.txt.gz": b"\x1f\x8b\x08\x00 this is not a gzip stream",
    "empty.txt": b"   \n\n",
    "corpus.pdf": b"%PDF-1.4",
    "a_folder": None,  # a directory (empty)
    "profile4.json": b'[{"dp": 4, "tp": 1, "pp": 1, "micro_batch_size": 2, "num_microbatches": 1, "step_s": 0.1}]',
    "profile_no_step.json": b'[{"dp": 2, "tp": 1, "pp": 1, "micro_batch_size": 2, "num_microbatches": 1}]',
}


def _pwned(root: Path) -> bool:
    return (root / "PWNED").exists()


# (id, argv, needles that must all appear in the one error line)
TRAIN = [
    ("initial-zero", ["--set", "batch.initial=0"], ["batch.initial=0", "allowed"]),
    ("lr-negative", ["--set", "train.lr=-1"], ["train.lr=-1", "allowed"]),
    ("lr-nan", ["--set", "train.lr=nan"], ["train.lr=nan", "allowed"]),
    ("lr-inf", ["--set", "train.lr=inf"], ["train.lr=inf", "allowed"]),
    ("lr-string", ["--set", "train.lr=fast"], ["train.lr='fast'", "allowed"]),
    ("max-steps-negative", ["--max-steps", "-5"], ["train.max_steps=-5", "allowed"]),
    ("max-tokens-negative", ["--max-tokens", "-1"], ["train.max_tokens=-1", "allowed"]),
    ("max-steps-float", ["--set", "train.max_steps=1.5"], ["train.max_steps=1.5", "integer"]),
    ("max-steps-bool", ["--set", "train.max_steps=true"], ["train.max_steps=True", "integer"]),
    ("no-run-length", ["--set", "train.max_steps=0", "--set", "train.max_tokens=0"], ["train.max_tokens=0", "allowed"]),
    ("nproc-zero", ["--nproc", "0"], ["parallel.nproc=0", "allowed"]),
    ("nproc-negative", ["--nproc", "-2"], ["parallel.nproc=-2", "allowed"]),
    ("nproc-not-int", ["--nproc", "two"], ["--nproc", "'two'", "int"]),
    ("seed-negative", ["--seed", "-1"], ["train.seed=-1", "allowed"]),
    ("seed-not-int", ["--seed", "abc"], ["--seed", "'abc'"]),
    (
        "schedule-not-monotone",
        ["--policy", "schedule", "--set", "batch.schedule=0:8,64K:16,128K:8"],
        ["entry '128K:8'", "non-decreasing"],
    ),
    (
        "schedule-not-divisible",
        ["--nproc", "2", "--policy", "schedule", "--set", "batch.schedule=0:8,64K:9"],
        ["entry '64K:9'", "not a multiple of dp=2", "allowed"],
    ),
    (
        "schedule-unknown-unit",
        ["--policy", "schedule", "--set", "batch.schedule=0:8", "--set", "batch.schedule_unit=bytes"],
        ["batch.schedule_unit='bytes'", "'samples', 'tokens'"],
    ),
    ("schedule-bad-suffix", ["--policy", "schedule", "--set", "batch.schedule=0:8,5Q:16"], ["'5Q'", "K, M, B or T"]),
    (
        "schedule-without-policy",
        ["--set", "batch.schedule=0:8,1M:16"],
        ["batch.schedule='0:8,1M:16'", "batch.policy='schedule'"],
    ),
    (
        "schedule-start-not-initial",
        ["--policy", "schedule", "--set", "batch.schedule=0:16,1M:32"],
        ["batch.initial=8", "first batch 16"],
    ),
    ("nccl-timeout-zero", ["--set", "train.nccl_timeout_s=0"], ["train.nccl_timeout_s=0", "allowed", "(0.0, inf)"]),
    ("nccl-timeout-negative", ["--set", "train.nccl_timeout_s=-30"], ["train.nccl_timeout_s=-30", "allowed"]),
    (
        "memory-margin-one",
        ["--set", "parallel.memory_margin=1.0"],
        ["parallel.memory_margin=1.0", "allowed", "(0.0, 1.0)"],
    ),
    (
        "memory-margin-zero",
        ["--set", "parallel.memory_margin=0"],
        ["parallel.memory_margin=0", "allowed", "(0.0, 1.0)"],
    ),
    (
        "controller-start-unknown",
        ["--set", "controller.start='fastest'"],
        ["controller.start='fastest'", "planned", "initial"],
    ),
    (
        "controller-profile-missing",
        ["--set", "controller.profile='{tmp}/no/profile.json'"],
        ["controller.profile=", "no/profile.json", "no such file", "allowed"],
    ),
    ("controller-profile-not-json", ["--set", "controller.profile='{bad_syntax.toml}'"], ["not readable JSON"]),
    (
        "controller-profile-other-world",
        ["--nproc", "2", "--set", "controller.profile='{profile4.json}'"],
        ["row 0", "dp*tp*pp=4", "world size 2"],
    ),
    (
        "controller-profile-no-step-time",
        ["--nproc", "2", "--set", "controller.profile='{profile_no_step.json}'"],
        ["row 0", "missing step_s", "copus profile"],
    ),
    ("unknown-flag", ["--batch-size", "64"], ["--batch-size"]),
    ("unknown-policy", ["--policy", "fastest"], ["batch.policy='fastest'", "goodput"]),
    ("policy-not-str", ["--set", "batch.policy=42"], ["batch.policy=42", "goodput"]),
    ("unknown-model", ["--model", "gpt-17"], ["model.name='gpt-17'", "tiny"]),
    ("unknown-section", ["--set", "nosuch.key=1"], ["nosuch", "allowed"]),
    ("unknown-key", ["--set", "train.nosuch=1"], ["train.nosuch", "allowed"]),
    ("set-no-equals", ["--set", "batch.max"], ["'batch.max'", "section.key=value"]),
    ("set-no-dot", ["--set", "train=1"], ["'train=1'", "section.key=value"]),
    ("set-two-dots", ["--set", "a.b.c=1"], ["'a.b.c=1'", "section.key=value"]),
    ("progress-not-bool", ["--set", "log.progress=1"], ["log.progress=1", "true or false"]),
    ("min-over-max", ["--set", "batch.min=64", "--set", "batch.max=32"], ["batch.min=64", "batch.max=32"]),
    ("initial-over-max", ["--set", "batch.initial=512"], ["batch.initial=512", "batch.max"]),
    ("ramp-to-over-max", ["--set", "batch.ramp_to=100000"], ["batch.ramp_to=100000", "allowed"]),
    (
        "batch-not-multiple-of-dp",
        ["--nproc", "2", "--set", "batch.initial=9", "--set", "batch.min=1"],
        ["batch.initial=9", "multiple of dp=2"],
    ),
    ("nproc-3-batch-8", ["--nproc", "3"], ["batch.initial=8", "multiple of dp=3"]),
    ("tp-over-heads", ["--nproc", "4", "--set", "parallel.tp=4"], ["tp=4", "n_heads"]),
    ("tp-not-dividing-world", ["--nproc", "2", "--set", "parallel.tp=3"], ["tp", "3", "2"]),
    ("pp-over-layers", ["--nproc", "8", "--set", "parallel.pp=8", "--set", "batch.initial=16"], ["pp=8"]),
    ("dp-times-tp-pp-not-world", ["--nproc", "2", "--set", "parallel.dp=3"], ["dp", "3"]),
    (
        "mbs-not-divisor",
        ["--nproc", "2", "--set", "parallel.micro_batch_size=3"],
        ["parallel.micro_batch_size=3", "divisor"],
    ),
    ("tokenizer-unknown", ["--set", "data.tokenizer=sentencepiece"], ["data.tokenizer='sentencepiece'", "'bpe'"]),
    ("bpe-vocab-too-small", ["--set", "data.bpe_vocab_size=100"], ["data.bpe_vocab_size=100", "allowed"]),
    (
        "bpe-vocab-over-model",
        [
            "--set",
            "data.tokenizer=bpe",
            "--set",
            "data.bpe_vocab_size=100000",
            "--set",
            "model.name=tinyllama-1.1b",
        ],  # tiny/small follow the BPE
        ["data.bpe_vocab_size=100000", "vocab_size"],
    ),
    (
        "tokenizer-file-missing",
        ["--set", "data.tokenizer='{tmp}/no/tokenizer.json'"],
        ["data.tokenizer=", "no such tokenizer file"],
    ),
    ("val-fraction-zero-with-eval", ["--set", "data.val_fraction=0"], ["data.val_fraction=0", "eval.interval_steps"]),
    ("decay-one", ["--set", "gns.decay=1.0"], ["gns.decay=1.0", "allowed"]),
    ("beta1-one", ["--set", "train.beta1=1"], ["train.beta1=1", "allowed"]),
    ("backend-unknown", ["--set", "parallel.backend=mpi"], ["parallel.backend='mpi'", "'gloo'"]),
    ("dtype-unknown", ["--set", "train.dtype=fp16"], ["train.dtype='fp16'", "'bf16'"]),
    ("keep-zero", ["--set", "checkpoint.keep=0"], ["checkpoint.keep=0", "allowed"]),
    ("growth-below-one", ["--set", "batch.max_growth=0.5"], ["batch.max_growth=0.5", "allowed"]),
    ("schedule-unknown", ["--set", "train.lr_schedule=exp"], ["train.lr_schedule='exp'", "'cosine'"]),
    ("max-restarts-negative", ["--max-restarts", "-1"], ["--max-restarts=-1", "allowed"]),
    ("resume-without-run-dir", ["--resume"], ["--resume", "--run-dir"]),
    ("resume-without-checkpoints", ["--resume", "--run-dir", "{a_folder}"], ["--resume", "a_folder", "checkpoints"]),
    (
        "run-dir-is-a-file",
        ["--run-dir", "{bad_syntax.toml}"],
        ["--run-dir", "bad_syntax.toml", "is an existing file", "allowed"],
    ),
    # config files
    ("config-missing", ["--config", "{tmp}/missing.toml"], ["missing.toml", "cannot be read"]),
    ("config-is-folder", ["--config", "{a_folder}"], ["a_folder", "cannot be read"]),
    ("config-bad-syntax", ["--config", "{bad_syntax.toml}"], ["bad_syntax.toml", "not valid TOML"]),
    ("config-python-code", ["--config", "{code.toml}"], ["code.toml", "not valid TOML"]),
    ("config-dunder-import", ["--config", "{dunder.toml}"], ["dunder.toml", "not valid TOML"]),
    ("config-unknown-section", ["--config", "{unknown_section.toml}"], ["[trainer]", "allowed"]),
    ("config-unknown-key", ["--config", "{unknown_key.toml}"], ["train.learning_rate", "allowed"]),
    ("config-section-not-table", ["--config", "{not_table.toml}"], ["train=5", "table"]),
    ("config-wrong-type", ["--config", "{wrong_type.toml}"], ["train.lr='fast'", "allowed"]),
    ("config-negative-batch", ["--config", "{neg_batch.toml}"], ["batch.initial=-8", "allowed"]),
    ("config-array", ["--config", "{array.toml}"], ["parallel.nproc=[1, 2]", "allowed"]),
    # training corpus
    ("corpus-missing", ["--set", "data.source='{tmp}/no/such/corpus.txt'"], ["corpus.txt", "no such file", "allowed"]),
    ("corpus-not-utf8", ["--set", "data.source='{binary.txt}'"], ["binary.txt", "UTF-8"]),
    ("corpus-broken-gzip", ["--set", "data.source='{broken.txt.gz}'"], ["broken.txt.gz", "UTF-8"]),
    ("corpus-empty", ["--set", "data.source='{empty.txt}'"], ["empty.txt", "empty"]),
    ("corpus-wrong-kind", ["--set", "data.source='{corpus.pdf}'"], ["corpus.pdf", "allowed"]),
    ("corpus-empty-folder", ["--set", "data.source='{a_folder}'"], ["a_folder", ".txt"]),
    ("corpus-empty-string", ["--set", "data.source=''"], ["data.source=''", "non-empty"]),
]

OTHER = [
    ("plan-gpus-zero", ["plan", "--gpus", "0"], ["--gpus=0", "allowed"]),
    ("plan-unknown-model", ["plan", "--model", "nosuch"], ["'nosuch'", "allowed"]),
    ("plan-mbs-not-ints", ["plan", "--micro-batch-sizes", "a,b"], ["'a,b'", "allowed"]),
    ("plan-b-noise-nan", ["plan", "--b-noise", "nan"], ["--b-noise=nan", "allowed"]),
    ("plan-unknown-hardware", ["plan", "--hardware", "abacus"], ["'abacus'", "allowed"]),
    ("simulate-negative-tokens", ["simulate", "--tokens", "-1"], ["-1", "allowed"]),
    ("simulate-unknown-policy", ["simulate", "--policies", "foo"], ["'foo'", "allowed"]),
    ("simulate-reconfig-choice", ["simulate", "--reconfig", "teleport"], ["'teleport'", "choose"]),
    ("report-missing-run", ["report", "{tmp}/no-run"], ["no-run", "not a folder"]),
    ("calibrate-missing-run", ["calibrate", "{tmp}/no-run"], ["no-run", "config.toml"]),
    ("calibrate-tokens-zero", ["calibrate", "{tmp}", "--tokens", "0"], ["--tokens=0", "allowed"]),
    ("unknown-command", ["fly"], ["'fly'", "choose"]),
]

ALL = [(i, ["train", *argv], needles) for i, argv, needles in TRAIN] + OTHER


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, str]:
    out = {"tmp": str(tmp_path)}
    for name, content in FILES.items():
        path = tmp_path / name
        if content is None:
            path.mkdir()
        else:
            path.write_bytes(content)
        out[name] = str(path)
    return out


def _fill(argv: list[str], files: dict[str, str]) -> list[str]:
    """Replace each `{name}` by the path of that fixture file (names may contain dots)."""
    out = []
    for a in argv:
        for name, path in files.items():
            a = a.replace("{" + name + "}", path)
        out.append(a)
    return out


def _no_launch(*_args, **_kwargs):
    raise AssertionError("a worker was about to start: the input was not rejected up front")


@pytest.fixture()
def cli(monkeypatch, tmp_path, capsys):
    """`copus.cli.main` in-process; returns (exit code, stderr). Launching is a test failure."""
    from copus.runtime.train import launch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch, "launch", _no_launch)

    def call(argv: list[str]) -> tuple[int, str]:
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse errors
            code = exc.code
        return code, capsys.readouterr().err

    return call


def test_table_is_big_enough():
    assert len(ALL) >= 40
    assert len({i for i, _, _ in ALL}) == len(ALL)


def _assert_one_line(code: int, err: str, command: str, needles: list[str]) -> None:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1, f"expected one line, got:\n{err}"
    assert lines[0].startswith(f"copus {command}: error:") or lines[0].startswith("copus: error:"), lines[0]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


@pytest.mark.parametrize("argv,needles", [c[1:] for c in ALL], ids=[c[0] for c in ALL])
def test_bad_input_one_line_exit_2(cli, files, argv, needles):
    argv = _fill(argv, files)
    code, err = cli(argv)
    _assert_one_line(code, err, argv[0], _fill(needles, files))
    assert not _pwned(Path(files["tmp"]))


# A few real processes: exit status, stderr and no traceback exactly as a user sees them.
SUBPROCESS = ["lr-negative", "nproc-not-int", "config-python-code", "corpus-missing", "tp-over-heads"]


def test_real_processes_exit_2_without_traceback(files, tmp_path):
    by_id = {i: (argv, needles) for i, argv, needles in ALL}
    for case in SUBPROCESS:
        argv, needles = by_id[case]
        argv = _fill(argv, files)
        run_dir = tmp_path / f"run-{case}"
        out = subprocess.run(
            [sys.executable, "-m", "copus", *argv, "--run-dir", str(run_dir)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        _assert_one_line(out.returncode, out.stderr, argv[0], needles)
        assert out.stdout == "", out.stdout
        assert not run_dir.exists(), case  # nothing was started
    assert not _pwned(tmp_path)


def test_the_default_run_and_good_inputs_pass_validation(monkeypatch, tmp_path, capsys):
    """The control group: valid command lines reach the launcher (every default is valid)."""
    from copus.runtime.train import launch

    calls = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch, "launch", lambda cfg, run_dir, **kw: calls.append(cfg) or {})
    for argv in (
        ["train"],
        ["train", "--nproc", "1", "--max-steps", "3", "--policy", "ramp"],
        ["train", "--set", "parallel.reshard_after_forward=true", "--seed", "7"],
    ):
        assert main(argv) == 0, capsys.readouterr().err
    assert len(calls) == 3 and calls[0].parallel.nproc == 2 and calls[2].train.seed == 7
