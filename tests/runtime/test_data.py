"""copus.runtime.data.stream: text loading, tokenizers, windows, the global sample stream and dp slices."""

import gzip
import json

import numpy as np
import pytest
import tokenizers.trainers

from copus.config import load_config
from copus.runtime.data.stream import (
    ByteCodec,
    GlobalSampler,
    TokenDataset,
    build_datasets,
    build_tokenizer,
    load_text,
    local_slice,
    split_train_val,
    train_bpe,
)

# ----------------------------------------------------------------------------------- load_text


def test_embedded_corpus_slice():
    text = load_text("embedded", max_chars=20_000)
    assert len(text) == 20_000
    assert text.startswith("A Midsummer Night's Dream")


def test_embedded_corpus_crosses_files_with_a_separator():
    full_first = 5_001_331  # characters of shakespeare_plays.txt (SOURCES.md)
    text = load_text("embedded", max_chars=full_first + 40)
    assert len(text) == full_first + 40
    assert text[full_first : full_first + 2] == "\n\n"
    assert "[Emma by Jane Austen 1816]" in text[full_first:]


def test_file_gz_and_sorted_folder(tmp_path):
    (tmp_path / "b.txt").write_text("second ünïcode\n", encoding="utf-8")
    with gzip.open(tmp_path / "a.txt.gz", "wt", encoding="utf-8") as fh:
        fh.write("first\n")
    (tmp_path / "ignored.json").write_text("{}")
    assert load_text(str(tmp_path / "b.txt")) == "second ünïcode\n"
    assert load_text(str(tmp_path / "a.txt.gz")) == "first\n"
    assert load_text(str(tmp_path)) == "first\n\n\nsecond ünïcode\n"
    assert load_text(str(tmp_path), max_chars=8) == "first\n\n\n"


def test_load_text_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match="nope.txt.*no such file"):
        load_text(str(missing))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="empty.txt.*empty"):
        load_text(str(empty))
    bad_gz = tmp_path / "bad.txt.gz"
    bad_gz.write_bytes(b"this is not gzip")
    with pytest.raises(ValueError, match="bad.txt.gz.*cannot be read"):
        load_text(str(bad_gz))
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="latin.txt.*UTF-8"):
        load_text(str(latin))
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(ValueError, match="folder.*no .txt"):
        load_text(str(folder))
    other = tmp_path / "data.csv"
    other.write_text("a,b\n")
    with pytest.raises(ValueError, match="data.csv"):
        load_text(str(other))


# ---------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = ByteCodec()
    text = "Hamlet: to be, or not — ☃ 漢字\n"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and tok.vocab_size == 256
    assert len(ids) == len(text.encode("utf-8")) and ids.max() < 256
    assert tok.decode(ids) == text


def test_bpe_trains_offline_caches_and_is_deterministic(tmp_path, monkeypatch):
    text = load_text("embedded", max_chars=200_000)
    first = train_bpe(text, 400, cache_dir=tmp_path / "a")
    files = list((tmp_path / "a").glob("bpe-*.json"))
    assert len(files) == 1
    assert first.vocab_size == 400
    ids = first.encode(text)
    assert ids.dtype == np.int32 and ids.max() < 400
    assert len(ids) < 0.8 * len(text.encode("utf-8"))  # merges compress
    assert first.decode(ids) == text  # lossless

    # the second call loads the cached file: training is made impossible and it still works
    def no_training(*args, **kwargs):
        raise AssertionError("retrained instead of loading the cache")

    monkeypatch.setattr(tokenizers.trainers, "BpeTrainer", no_training)
    again = train_bpe(text, 400, cache_dir=tmp_path / "a")
    assert np.array_equal(again.encode(text), ids)
    monkeypatch.undo()
    # a corrupt cache entry is rebuilt
    files[0].write_text("{not json")
    assert np.array_equal(train_bpe(text, 400, cache_dir=tmp_path / "a").encode(text), ids)
    # an independent training run (fresh cache) gives the same merges and the same ids
    other = train_bpe(text, 400, cache_dir=tmp_path / "b")
    assert np.array_equal(other.encode(text), ids)
    model = json.loads(next((tmp_path / "b").glob("bpe-*.json")).read_text())["model"]
    assert len(model["merges"]) == 400 - 257  # 256 bytes + <|endoftext|> + merges
    # a different vocabulary size is a different cache entry
    train_bpe(text, 300, cache_dir=tmp_path / "b")
    assert len(list((tmp_path / "b").glob("bpe-*.json"))) == 2
    # build_tokenizer dispatch
    assert build_tokenizer("byte").vocab_size == 256
    assert build_tokenizer("bpe", text, 400, tmp_path / "b").vocab_size == 400
    with pytest.raises(ValueError, match="data.tokenizer='words'"):
        build_tokenizer("words", text)


# ------------------------------------------------------------------------------------ datasets


def test_token_dataset_windows():
    tokens = np.arange(23, dtype=np.int32)
    ds = TokenDataset(tokens, seq_len=5)
    assert len(ds) == (23 - 1) // 5 == 4
    assert ds[0].tolist() == [0, 1, 2, 3, 4, 5]
    assert ds[3].tolist() == [15, 16, 17, 18, 19, 20]
    batch = ds.batch([3, 0])
    assert batch.shape == (2, 6) and batch.dtype == np.int32
    assert batch[0].tolist() == ds[3].tolist() and batch[1].tolist() == ds[0].tolist()
    with pytest.raises(IndexError):
        ds[4]
    with pytest.raises(IndexError):
        ds.batch([0, 4])
    assert len(TokenDataset(np.arange(5, dtype=np.int32), seq_len=5)) == 0


def test_val_split_is_disjoint_and_after_train():
    tokens = np.arange(10_000, dtype=np.int32)  # token value = position
    train, val = split_train_val(tokens, 0.1, seq_len=16)
    train_pos = set(train.batch(np.arange(len(train))).ravel().tolist())
    val_pos = set(val.batch(np.arange(len(val))).ravel().tolist())
    assert train_pos.isdisjoint(val_pos)
    assert max(train_pos) < min(val_pos)
    assert len(val) == (1000 - 1) // 16
    empty_train, empty_val = split_train_val(tokens, 0.0, seq_len=16)
    assert len(empty_val) == 0 and len(empty_train) == (10_000 - 1) // 16
    with pytest.raises(ValueError, match="too few"):
        split_train_val(np.arange(20, dtype=np.int32), 0.5, seq_len=16)


def test_build_datasets_from_config():
    cfg = load_config(None, ["data.max_chars=50000", "data.val_fraction=0.1"])
    train, val, tok = build_datasets(cfg.data, seq_len=64, vocab_size=256)
    assert tok.vocab_size == 256
    n = len(ByteCodec().encode(load_text("embedded", 50_000)))
    n_val = int(np.ceil(0.1 * n))
    assert len(train) == (n - n_val - 1) // 64 and len(val) == (n_val - 1) // 64
    assert train.tokens.dtype == np.int32
    assert np.array_equal(np.concatenate([train.tokens, val.tokens]), ByteCodec().encode(load_text("embedded", 50_000)))


def test_build_datasets_rejects_a_vocab_larger_than_the_model(tmp_path):
    cfg = load_config(
        None, ["data.max_chars=30000", "data.tokenizer=bpe", "data.bpe_vocab_size=300", "model.name=tinyllama-1.1b"]
    )
    with pytest.raises(ValueError, match=r"^data\.bpe_vocab_size=300: .*vocab_size=288"):
        build_datasets(cfg.data, seq_len=32, vocab_size=288, cache_dir=tmp_path)
    train, val, tok = build_datasets(cfg.data, seq_len=32, vocab_size=512, cache_dir=tmp_path)
    assert tok.vocab_size == 300 and train.tokens.max() < 300
    (cached,) = tmp_path.glob("bpe-*-tokens-*.npy")  # the encoding is cached too
    tokens = np.concatenate([train.tokens, val.tokens])
    assert np.array_equal(np.load(cached), tokens)
    assert tok.decode(tokens) == load_text("embedded", 30000)
    again, _, _ = build_datasets(cfg.data, seq_len=32, vocab_size=512, cache_dir=tmp_path)
    assert np.array_equal(again.tokens, train.tokens)


# ------------------------------------------------------------------------------------- sampler


def test_sampler_is_deterministic_and_seed_dependent():
    a, b = GlobalSampler(1000, seed=7), GlobalSampler(1000, seed=7)
    assert np.array_equal(a.ids(0, 1000), b.ids(0, 1000))
    assert np.array_equal(a.ids(123, 50), b.ids(0, 1000)[123:173])
    assert not np.array_equal(a.ids(0, 1000), GlobalSampler(1000, seed=8).ids(0, 1000))
    assert sorted(a.ids(0, 1000).tolist()) == list(range(1000))  # a permutation


def test_sampler_crosses_epochs():
    s = GlobalSampler(10, seed=3)
    stream = s.ids(5, 20)  # epoch 0 [5:10], epoch 1 all, epoch 2 [:5]
    assert np.array_equal(stream[:5], s.permutation(0)[5:])
    assert np.array_equal(stream[5:15], s.permutation(1))
    assert np.array_equal(stream[15:], s.permutation(2)[:5])
    assert not np.array_equal(s.permutation(0), s.permutation(1))
    assert s.epoch(25) == 2
    # a fresh sampler reproduces a far position without replaying the past
    assert np.array_equal(GlobalSampler(10, seed=3).ids(15, 10), stream[10:20])


def test_every_sample_once_across_changes_of_batch_and_dp():
    """Ranks take local slices of each step's global ids while B and dp change between steps;
    the union over ranks and steps of one epoch is every sample exactly once."""
    num_samples = 960
    sampler = GlobalSampler(num_samples, seed=11)
    schedule = [(8, 1), (8, 2), (16, 2), (16, 4), (32, 4), (48, 3), (24, 1), (64, 8)]
    seen: list[int] = []
    offset, i = 0, 0
    while offset < num_samples:
        global_batch_size, dp = schedule[i % len(schedule)]
        global_batch_size = min(global_batch_size, num_samples - offset)
        if global_batch_size % dp:
            dp = 1
        ids = sampler.ids(offset, global_batch_size)
        blocks = [local_slice(ids, r, dp) for r in range(dp)]
        assert all(len(bk) == global_batch_size // dp for bk in blocks)
        # micro-batches within a rank (any micro_batch_size dividing the block) change nothing
        for bk in blocks:
            seen.extend(bk.tolist())
        offset += global_batch_size
        i += 1
    assert sorted(seen) == list(range(num_samples))


def test_local_slice_is_contiguous_and_checked():
    ids = np.arange(12)
    assert local_slice(ids, 1, 3).tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="not a multiple of dp=5"):
        local_slice(ids, 0, 5)
    with pytest.raises(ValueError, match="dp_rank=3"):
        local_slice(ids, 3, 3)
