"""Integrity off the critical path (issue 23): every rank hashes the checkpoint files it wrote,
in parallel, and verifies a share of them on resume; a prepared dataset is hashed once and then
checked by size and mtime. Damage is still detected (tests/reliability/test_checkpoints.py has
the full damage matrix)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from copus.runtime.state import checkpoint as ckpt
from tests.runtime._workers import run_ranks


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    return {"model": model.state_dict()}


def _save_and_count(root: str) -> dict:
    """2 ranks: save steps 1 and 2 with `_sha256` counted per rank during step 2."""
    import torch.distributed as dist

    from copus.runtime.state import checkpoint as ck

    ck.save(root, 1, _state(1), {"step": 1})
    hashed: list[str] = []
    original = ck._sha256

    def counting(path):
        hashed.append(Path(path).name)
        return original(path)

    ck._sha256 = counting
    try:
        ck.save(root, 2, _state(2), {"step": 2})
    finally:
        ck._sha256 = original
    return {"rank": dist.get_rank(), "hashed": hashed}


def _agree(root: str) -> dict:
    import torch.distributed as dist

    from copus.runtime.state import checkpoint as ck

    hashed: list[str] = []
    original = ck._sha256

    def counting(path):
        hashed.append(Path(path).name)
        return original(path)

    ck._sha256 = counting
    logged: list[str] = []
    try:
        found = ck.agree_on_latest(root, logged.append)
    finally:
        ck._sha256 = original
    return {"rank": dist.get_rank(), "found": str(found), "hashed": hashed, "logged": logged}


def test_each_rank_hashes_its_own_files_and_verifies_a_share(tmp_path):
    saved = run_ranks(_save_and_count, 2, str(tmp_path), timeout=120)
    step2 = tmp_path / "step-2"
    files = sorted(json.loads((step2 / ckpt.MANIFEST).read_text())["files"])
    assert ckpt.verify(step2) is None
    by_rank = {r["rank"]: set(r["hashed"]) for r in saved}
    assert by_rank[1] and all(n.startswith("__1_") for n in by_rank[1])   # its own DCP files
    assert not any(n.startswith("__1_") for n in by_rank[0])               # rank 0 skips them
    # resume: the two ranks split the checksums; together they cover every file once
    agreed = run_ranks(_agree, 2, str(tmp_path), timeout=120)
    assert {a["found"] for a in agreed} == {str(step2)}
    shares = [set(a["hashed"]) for a in agreed]
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    assert shares[0] | shares[1] == set(files)
    # damage a file in rank 1's share: both ranks reject step-2 and agree on step-1
    victim = step2 / sorted(shares[1])[0]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))
    agreed = run_ranks(_agree, 2, str(tmp_path), timeout=120)
    assert {a["found"] for a in agreed} == {str(tmp_path / "step-1")}
    (line,) = agreed[0]["logged"]
    assert victim.name in line and "sha256" in line and "using step-1" in line


def test_prepared_folder_is_hashed_once_then_checked_by_size_and_mtime(tmp_path, monkeypatch):
    import os

    from copus.runtime.data import shards
    from copus.runtime.data.prepare import prepare

    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " + "lorem ipsum " * 40}) + "\n"
                           for i in range(60)))
    out = tmp_path / "p"
    prepare([str(src)], out, progress=False)
    calls: list[str] = []
    original = shards.file_sha256
    monkeypatch.setattr(shards, "file_sha256", lambda p: calls.append(Path(p).name) or original(p))
    shards.verify_folder(out)
    first = len(calls)
    assert first >= 1 and (out / shards.VERIFIED).exists()
    shards.verify_folder(out)
    assert len(calls) == first                       # second start: no byte re-read
    shard = out / "train-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0xFF
    shard.write_bytes(bytes(raw))                    # a rewrite changes the mtime
    try:
        shards.verify_folder(out)
    except ValueError as err:
        assert "train-00000.bin fails its sha256" in str(err)
    else:
        raise AssertionError("corruption not detected")
    # a stamp that does not match the file (same size, other mtime) is never trusted
    os.utime(shard, ns=(1, 1))
    raw[10] ^= 0xFF
    shard.write_bytes(bytes(raw))                    # repaired: verifies again, stamp updated
    shards.verify_folder(out)
