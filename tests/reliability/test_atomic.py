"""copus.atomic: the one write-fsync-rename helper every durable file goes through."""

from __future__ import annotations

import json
import os

import pytest

from copus.atomic import atomic_write_json, atomic_write_text, atomic_writer, tmp_name


def test_a_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    atomic_write_json(path, {"step": 1, "loss": float("nan")})
    atomic_write_json(path, {"step": 2})
    assert json.loads(path.read_text()) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_crash_mid_write_keeps_the_old_file_whole(tmp_path):
    path = tmp_path / "run.json"
    atomic_write_text(path, "old\n")
    with pytest.raises(RuntimeError), atomic_writer(path, "w") as fh:
        fh.write("half of the new con")
        raise RuntimeError("killed")
    assert path.read_text() == "old\n"
    assert not tmp_name(path).exists() and sorted(os.listdir(tmp_path)) == ["run.json"]


def test_temporaries_are_per_process_and_hidden(tmp_path):
    t = tmp_name(tmp_path / "bpe-x.json")
    assert t.name.startswith(".bpe-x.json.") and t.name.endswith(f".{os.getpid()}.tmp")


def test_bad_mode_is_one_clear_error(tmp_path):
    with (
        pytest.raises(ValueError, match=r"mode='a' is invalid; allowed: 'wb', 'w'"),
        atomic_writer(tmp_path / "x", "a"),
    ):
        pass
