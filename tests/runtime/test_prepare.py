"""copus prepare and prepared folders: round trip, determinism, atomicity, checksums, bad input,
tokenizer/model agreement, the O(1)-memory sampler and validation sizing."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from copus.config import load_config
from copus.core.specs.resolve import get_model_shape
from copus.runtime.data import shards
from copus.runtime.data.stream import build_datasets, split_train_val
from copus.runtime.data.prepare import prepare
from copus.runtime.data.run_data import eval_note, eval_rows
from copus.runtime.data.sampler import FeistelSampler
from copus.runtime.data.tokenizer import ByteCodec, HfTokenizer, fit_vocab, train_bpe_tokenizer

DOCS = [f"doc {i}: " + "the quick brown fox jumps. " * (i % 5 + 1) + "é∑" for i in range(120)]


def _inputs(tmp_path: Path) -> list[str]:
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(DOCS[:80])))
    b = tmp_path / "b.jsonl.gz"
    with gzip.open(b, "wt", encoding="utf-8") as fh:
        fh.write("\n".join(json.dumps({"text": d}) for d in DOCS[80:]) + "\n")
    return [str(a), str(b)]


def _stream(folder: Path, split: str) -> np.ndarray:
    ds = shards.open_split(folder, split, seq_len=1)
    return ds.tokens.read(0, len(ds.tokens))


def _expected(tok, docs, fraction):
    """Direct tokenization: each document + separator, documents split by the held-out rule."""
    val = [int(np.floor((u + 1) * fraction) > np.floor(u * fraction)) for u in range(len(docs))]
    parts = {0: [], 1: []}
    for d, v in zip(docs, val):
        parts[v].append(np.concatenate([tok.encode(d), tok.separator()]))
    return np.concatenate(parts[0]), np.concatenate(parts[1]), sum(val)


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(train_bpe_tokenizer(iter(DOCS), 300).to_json())
    return path


def test_round_trip_equals_direct_tokenization_and_is_deterministic(tmp_path, bpe_file):
    """jsonl + jsonl.gz → shards (3 shards per split: windows cross shard ends) → windows equal
    a direct tokenization; 2 workers write byte-identical files to 1 worker's."""
    inputs = _inputs(tmp_path)
    tok = HfTokenizer.from_file(bpe_file)
    one = tmp_path / "one"
    meta = prepare(
        inputs, one, tokenizer=str(bpe_file), val_fraction=0.05, shard_tokens=700, progress=False, log=lambda _: None
    )
    train, val, n_val = _expected(tok, DOCS, 0.05)
    assert np.array_equal(_stream(one, "train"), train)
    assert np.array_equal(_stream(one, "val"), val)
    assert meta["splits"]["val"]["num_docs"] == n_val == 6
    assert meta["tokenizer"]["sha256"] == tok.sha256 and meta["tokenizer"]["eos_id"] == 0
    assert (
        meta["dtype"] == "uint16"
        and len([s for s in json.loads((one / "index.json").read_text())["shards"] if s["split"] == "train"]) >= 3
    )
    starts = shards.doc_starts(one, "train")
    assert len(starts) == 114 and starts[0] == 0 and (train[starts[1:] - 1] == tok.eos_id).all()
    ds = shards.open_split(one, "train", seq_len=32)
    ids = np.arange(len(ds))
    assert np.array_equal(ds.batch(ids), train[ids[:, None] * 32 + np.arange(33)])
    two = tmp_path / "two"
    prepare(
        inputs,
        two,
        tokenizer=str(bpe_file),
        val_fraction=0.05,
        shard_tokens=700,
        workers=2,
        progress=False,
        log=lambda _: None,
    )
    for f in sorted(one.iterdir()):
        assert f.read_bytes() == (two / f.name).read_bytes(), f.name


def test_txt_and_parquet_inputs_with_byte_tokenizer(tmp_path):
    """A .txt file is cut into documents at blank lines: with bytes the stream is the text."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from copus.runtime.data import sources

    text = "\n\n".join(f"paragraph {i} " * 40 for i in range(400))
    (tmp_path / "t.txt").write_text(text)
    pq.write_table(pa.table({"body": DOCS[:10]}), tmp_path / "p.parquet")
    meta = prepare([str(tmp_path / "t.txt")], tmp_path / "txt", val_fraction=0.0, progress=False)
    assert meta["splits"]["train"]["num_docs"] == len(list(sources._txt_documents(tmp_path / "t.txt"))) > 1
    got = _stream(tmp_path / "txt", "train")
    assert ByteCodec().decode(got) == text + "\n\n"
    prepare([str(tmp_path / "p.parquet")], tmp_path / "pq", text_field="body", val_fraction=0, progress=False)
    assert ByteCodec().decode(_stream(tmp_path / "pq", "train")) == "".join(d + "\n\n" for d in DOCS[:10])


def test_jsonl_missing_field_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text here"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: no 'text' field \(found: body\)"):
        prepare([str(bad)], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupted_shard_is_detected_with_the_file_named(tmp_path, damage):
    out = tmp_path / "p"
    prepare(_inputs(tmp_path), out, progress=False)
    shard = out / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[100] ^= 0xFF
        match = "shard train-00000.bin fails its sha256"
    else:
        data = data[:-10]
        match = "shard train-00000.bin has .* bytes, the index says"
    shard.write_bytes(bytes(data))
    cfg = load_config(None, [f"data.source='{out}'"])
    with pytest.raises(ValueError, match=match):
        build_datasets(cfg.data, 32, 256)


def test_interrupted_prepare_never_looks_complete_and_reruns_clean(tmp_path, monkeypatch):
    from copus.runtime.data import prepare as prep

    inputs, out = _inputs(tmp_path), tmp_path / "p"

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prep, "_write_synced", crash)  # dies before meta.json
    with pytest.raises(KeyboardInterrupt):
        prepare(inputs, out, progress=False)
    assert not out.exists() and not shards.is_prepared(out)
    monkeypatch.undo()
    (tmp_path / ".p.partial").mkdir()  # as a kill -9 would leave it
    (tmp_path / ".p.partial" / "train-00000.bin").write_bytes(b"junk")
    logs: list[str] = []
    prepare(inputs, out, progress=False, log=logs.append)
    assert shards.is_prepared(out) and not (tmp_path / ".p.partial").exists()
    assert "starting clean" in logs[0]
    shards.verify_folder(out)
    before = {f.name: f.stat().st_mtime_ns for f in out.iterdir()}
    prepare(inputs, out, progress=False, log=logs.append)  # same inputs: nothing to do
    assert "up to date" in logs[-1]
    assert before == {f.name: f.stat().st_mtime_ns for f in out.iterdir()}


def _cli(capsys, *args: str) -> SimpleNamespace:
    """`copus ARGS` in-process (as the console script calls it): exit code and stderr."""
    from copus.cli import main

    capsys.readouterr()
    code = main(list(args))
    return SimpleNamespace(returncode=code, stderr=capsys.readouterr().err)


def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys):
    good = _inputs(tmp_path)[0]
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "notgz.txt.gz").write_bytes(b"this is not gzip data at all")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.md").write_text("mine")
    cases = [
        ([str(tmp_path / "notgz.txt.gz")], [], "notgz.txt.gz"),  # unreadable
        ([str(tmp_path / "empty.txt")], [], "empty.txt': the file is empty"),
        ([str(tmp_path / "missing.jsonl")], [], "no such file"),
        ([good], ["--tokenizer", str(tmp_path / "nope.json")], "--tokenizer="),
        ([good], ["--tokenizer", "bpe:12"], "bpe:N"),
    ]
    for inputs, extra, needle in cases:
        r = _cli(capsys, "prepare", *inputs, "--out", str(tmp_path / "out"), "--no-progress", *extra)
        assert r.returncode == 2, (inputs, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("copus prepare: error: "), lines
        assert needle in lines[0], lines
        assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()
    r = _cli(capsys, "prepare", good, "--out", str(tmp_path / "busy"), "--no-progress")
    assert r.returncode == 2 and "holds other files" in r.stderr
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == ["notes.md"]


def test_tokenizer_and_model_must_agree(tmp_path, bpe_file):
    out = tmp_path / "p"
    prepare(_inputs(tmp_path), out, tokenizer=str(bpe_file), progress=False)
    cfg = load_config(None, [f"data.source='{out}'", "data.tokenizer=byte"])
    with pytest.raises(
        ValueError,
        match=r"^data\.tokenizer='byte' \(sha256 byte\) differs from the "
        r"tokenizer .* \(sha256 [0-9a-f]{16}\)",
    ):
        build_datasets(cfg.data, 32, 256)
    # a published shape keeps its embedding: a larger tokenizer is refused with both sizes
    with pytest.raises(ValueError, match=r"has 300 tokens but model .* embeds 288"):
        build_datasets(load_config(None, [f"data.source='{out}'"]).data, 32, 288)
    train, val, tok = build_datasets(
        load_config(None, [f"data.source='{out}'", f"data.tokenizer='{bpe_file}'"]).data, 32, 256
    )
    assert tok.vocab_size == 300 and len(train) > 0
    tiny = fit_vocab(get_model_shape("tiny"), 300)  # byte-level shapes follow
    assert tiny.vocab_size == 320 and fit_vocab(get_model_shape("tiny"), 256).vocab_size == 256
    with pytest.raises(ValueError, match="has 40000 tokens but model 'tinyllama-1.1b' embeds 32000"):
        fit_vocab(get_model_shape("tinyllama-1.1b"), 40000)


def test_feistel_sampler_is_a_permutation_per_epoch():
    for n in (1, 2, 5, 97, 1000, 4097):
        s = FeistelSampler(n, seed=7)
        for epoch in range(2):
            ids = s.ids(epoch * n, n)
            assert sorted(ids.tolist()) == list(range(n))
        assert np.array_equal(
            s.ids(3, 40 if n > 40 else n), np.concatenate([s.ids(3, 1), s.ids(4, (40 if n > 40 else n) - 1)])
        )
    a, b = FeistelSampler(1000, 0).ids(0, 1000), FeistelSampler(1000, 0).ids(1000, 1000)
    assert not np.array_equal(a, b) and not np.array_equal(a, np.arange(1000))


def test_validation_is_sized_for_eval_num_samples_and_evaluation_adapts():
    tokens = np.arange(50_000, dtype=np.int32)
    _, val = split_train_val(tokens, 0.01, seq_len=128, min_val_windows=64)
    assert len(val) == 64  # 1% would be 3 windows
    _, val = split_train_val(tokens[:4000], 0.01, seq_len=128, min_val_windows=64)
    assert len(val) == (2000 - 1) // 128  # capped at half of the tokens
    assert eval_rows(32, 20, 2, 4, 1) == 8 and eval_note(8, 2, 20, 64).startswith(
        "validation on 16 windows: the held-out split has 20"
    )
    assert eval_rows(32, 1, 2, 4, 1) == 0 and "skipped" in eval_note(0, 2, 1, 64)
    assert eval_note(32, 2, 1000, 64) is None


def test_small_own_text_gets_validation_and_bpe_runs_on_tiny(tmp_path, monkeypatch):
    """412 KB of text with the default data.val_fraction (1% = 32 windows) still validates on
    eval.num_samples=64 windows; data.tokenizer=bpe on `tiny` grows the model's vocabulary."""
    from copus.runtime.data.stream import load_text
    from copus.runtime.data.run_data import build_run_data

    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "book.txt").write_text(load_text("embedded", 412_000))
    cfg = load_config(None, [f"data.source='{tmp_path / 'own'}'"])
    data = build_run_data(cfg, get_model_shape("tiny"))
    assert len(data.val) >= cfg.eval.num_samples == 64
    assert eval_note(eval_rows(32, len(data.val), 2, 4, 1), 2, len(data.val), 64) is None
    cfg = load_config(
        None,
        [f"data.source='{tmp_path / 'own'}'", "data.tokenizer=bpe", "data.bpe_vocab_size=500", "data.max_chars=100000"],
    )
    monkeypatch.setenv("COPUS_CACHE_DIR", str(tmp_path / "cache"))
    data = build_run_data(cfg, get_model_shape("tiny"))
    assert data.tokenizer.vocab_size == 500 and data.shape.vocab_size == 512
    assert int(data.train.tokens.max()) < 500


def test_resume_with_another_tokenizer_is_refused(bpe_file):
    from copus.runtime.data.run_data import check_resumed_tokenizer

    tok = HfTokenizer.from_file(bpe_file)
    check_resumed_tokenizer({"sha256": tok.sha256}, tok, "ckpt")
    check_resumed_tokenizer(None, tok, "old-ckpt")  # checkpoints before this key
    with pytest.raises(
        ValueError,
        match=r"^ckpt was trained with tokenizer sha256 byte "
        r"\(vocab 256\), this run's data uses sha256 [0-9a-f]{16} "
        r"\(vocab 300\)",
    ):
        check_resumed_tokenizer({"sha256": "byte", "vocab_size": 256}, tok, "ckpt")


def test_export_bad_input_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("mine")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    for args, needle in [
        ((str(tmp_path / "nope"), "--out", str(tmp_path / "o")), "no such folder"),
        ((str(tmp_path / "run"), "--out", str(tmp_path / "o")), "no valid checkpoint"),
        ((str(tmp_path / "run"), "--step", "3", "--out", str(tmp_path / "o")), "no checkpoint step-3"),
        ((str(tmp_path / "run"), "--out", str(tmp_path / "busy")), "not an empty"),
    ]:
        r = _cli(capsys, "export", *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr
        assert not (tmp_path / "o").exists() and not (tmp_path / ".o.partial").exists()
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["x"]
