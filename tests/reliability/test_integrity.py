"""Integrity off the critical path (issue 23): every rank hashes the checkpoint files it wrote,
in parallel, and verifies a share of them on resume; a prepared dataset is hashed once and then
checked by size and mtime. Damage is still detected (tests/reliability/test_checkpoints.py has
the full damage matrix)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from copus.runtime.state import checkpoint as ckpt
from copus.runtime.state import checkpoint_integrity as ci
from tests.runtime._workers import run_ranks


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    return {"model": model.state_dict()}


def _save_and_count(root: str) -> dict:
    """2 ranks: save steps 1 and 2 with `_sha256` counted per rank during step 2."""
    import torch.distributed as dist

    from copus.runtime.state import checkpoint as ck
    from copus.runtime.state import checkpoint_integrity as ci

    ck.save(root, 1, _state(1), {"step": 1})
    hashed: list[str] = []
    original = ci._sha256

    def counting(path):
        hashed.append(Path(path).name)
        return original(path)

    ci._sha256 = counting
    try:
        ck.save(root, 2, _state(2), {"step": 2})
    finally:
        ci._sha256 = original
    return {"rank": dist.get_rank(), "hashed": hashed}


def _agree(root: str) -> dict:
    import torch.distributed as dist

    from copus.runtime.state import checkpoint as ck
    from copus.runtime.state import checkpoint_integrity as ci

    hashed: list[str] = []
    original = ci._sha256

    def counting(path):
        hashed.append(Path(path).name)
        return original(path)

    ci._sha256 = counting
    logged: list[str] = []
    try:
        found = ck.agree_on_latest(root, logged.append)
    finally:
        ci._sha256 = original
    return {"rank": dist.get_rank(), "found": str(found), "hashed": hashed, "logged": logged}


def test_checksums_come_from_the_writes_and_resume_verifies_a_share(tmp_path):
    """Saving reads no file back (every checksum is computed while writing) and the manifest's
    checksums are right; on resume the ranks split the verification."""
    saved = run_ranks(_save_and_count, 2, str(tmp_path), timeout=120)
    step2 = tmp_path / "step-2"
    files = sorted(json.loads((step2 / ckpt.MANIFEST).read_text())["files"])
    assert ckpt.verify(step2) is None  # hashes from disk agree
    assert {r["rank"]: r["hashed"] for r in saved} == {0: [], 1: []}  # nothing re-read
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", ckpt.TRAINER_STATE} <= set(files)
    assert not list(step2.glob("*.hashes.json"))  # side files removed
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


def _save_sharded(root: str) -> None:
    """Each rank saves its own 64 Ki floats (its own `__<rank>_0.distcp`), steps 1 and 2."""
    import torch.distributed as dist

    from copus.runtime.state import checkpoint as ck

    rank = dist.get_rank()
    for step in (1, 2):
        torch.manual_seed(10 * step + rank)
        ck.save(root, step, {"model": {f"w{rank}": torch.randn(1 << 16)}}, {"step": step})


def _agree_bytes(root: str) -> dict:
    """`agree_on_latest` with the bytes this rank hashed per checkpoint and the problems."""

    from copus.runtime.state import checkpoint as ck
    from copus.runtime.state import checkpoint_integrity as ci

    hashed: dict[str, int] = {}
    original = ci._sha256

    def counting(path):
        key = Path(path).parent.name
        hashed[key] = hashed.get(key, 0) + Path(path).stat().st_size
        return original(path)

    ci._sha256 = counting
    logged: list[str] = []
    problems: list[str] = []
    try:
        found = ck.agree_on_latest(root, logged.append, problems)
    finally:
        ci._sha256 = original
    return {"found": str(found), "hashed": hashed, "logged": logged, "problems": problems}


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def _total(folder: Path) -> tuple[int, int]:
    sizes = [e["bytes"] for e in json.loads((folder / ckpt.MANIFEST).read_text())["files"].values()]
    return sum(sizes), max(sizes)


def test_resume_hashes_about_a_world_th_of_the_bytes_per_rank_and_still_falls_back(tmp_path):
    """Saved by 4 ranks, verified on resume by 4 and then by 2: each rank hashes ≈ total/world
    bytes (at most total/world + the largest file, every byte once in all); a corrupt newest
    checkpoint falls back to the previous one; when every checkpoint is corrupt none is found,
    each problem is reported and nothing is deleted."""
    run_ranks(_save_sharded, 4, str(tmp_path), timeout=240)
    step1, step2 = tmp_path / "step-1", tmp_path / "step-2"
    total, largest = _total(step2)
    agreed = run_ranks(_agree_bytes, 4, str(tmp_path), timeout=240)
    assert {a["found"] for a in agreed} == {str(step2)}
    per_rank = [a["hashed"].get("step-2", 0) for a in agreed]
    assert sum(per_rank) == total  # every byte once
    assert max(per_rank) <= min(1.1 * total / 4, total / 4 + largest)
    assert min(per_rank) >= 0.9 * total / 4
    # the newest corrupt: resume at world 2 falls back to step-1, each rank hashing ≈ half of each
    _flip(step2 / "__2_0.distcp")
    agreed = run_ranks(_agree_bytes, 2, str(tmp_path), timeout=240)
    assert {a["found"] for a in agreed} == {str(step1)}
    (line,) = agreed[0]["logged"]
    assert "__2_0.distcp fails its sha256" in line and "using step-1" in line
    for step in ("step-1", "step-2"):
        total, largest = _total(tmp_path / step)
        per_rank = [a["hashed"].get(step, 0) for a in agreed]
        assert sum(per_rank) == total and max(per_rank) <= min(1.1 * total / 2, total / 2 + largest)
    # every checkpoint corrupt: none, both problems named on every rank, nothing deleted
    _flip(step1 / "__0_0.distcp")
    agreed = run_ranks(_agree_bytes, 2, str(tmp_path), timeout=240)
    assert {a["found"] for a in agreed} == {"None"}
    for a in agreed:
        assert len(a["problems"]) == 2 and "__2_0.distcp" in a["problems"][0] and "__0_0.distcp" in a["problems"][1]
    assert step1.is_dir() and step2.is_dir() and len(list(step2.iterdir())) == 7


def test_the_launcher_checks_the_structure_and_hashes_nothing(tmp_path, monkeypatch):
    """`--resume auto` (the launcher, one process) reads no checkpoint byte: a checkpoint with
    its manifest and every file at its size is resumed (its workers verify the checksums); a
    truncated or unfinished one is not."""
    from copus.commands.train import has_complete_checkpoint

    root = tmp_path / "run" / "checkpoints"
    ckpt.save(root, 1, _state(1), {"step": 1})
    calls: list[Path] = []
    original = ci._sha256
    monkeypatch.setattr(ci, "_sha256", lambda p: calls.append(p) or original(p))
    _flip(root / "step-1" / "__0_0.distcp")  # corrupt but complete: the workers will find it
    assert has_complete_checkpoint(tmp_path / "run") and calls == []
    with open(root / "step-1" / "__0_0.distcp", "ab") as f:
        f.write(b"x")  # a size the manifest does not list
    assert not has_complete_checkpoint(tmp_path / "run") and calls == []


def test_prepared_folder_is_hashed_once_then_checked_by_size_and_mtime(tmp_path, monkeypatch):
    import os

    from copus.runtime.data import shards
    from copus.runtime.data.prepare import prepare

    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " + "lorem ipsum " * 40}) + "\n" for i in range(60)))
    out = tmp_path / "p"
    prepare([str(src)], out, progress=False)
    calls: list[str] = []
    original = shards.file_sha256
    monkeypatch.setattr(shards, "file_sha256", lambda p: calls.append(Path(p).name) or original(p))
    shards.verify_folder(out)
    first = len(calls)
    assert first >= 1 and (out / shards.VERIFIED).exists()
    shards.verify_folder(out)
    assert len(calls) == first  # second start: no byte re-read
    shard = out / "train-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0xFF
    shard.write_bytes(bytes(raw))  # a rewrite changes the mtime
    try:
        shards.verify_folder(out)
    except ValueError as err:
        assert "train-00000.bin fails its sha256" in str(err)
    else:
        raise AssertionError("corruption not detected")
    # a stamp that does not match the file (same size, other mtime) is never trusted
    os.utime(shard, ns=(1, 1))
    raw[10] ^= 0xFF
    shard.write_bytes(bytes(raw))  # repaired: verifies again, stamp updated
    shards.verify_folder(out)


def _prepared(tmp_path, shard_tokens: int = 997) -> Path:
    from copus.runtime.data.prepare import prepare

    src = tmp_path / "a.jsonl"
    src.write_text(
        "".join(json.dumps({"text": f"document {i} " + "lorem ipsum dolor " * 30}) + "\n" for i in range(120))
    )
    out = tmp_path / "p"
    prepare([str(src)], out, progress=False, shard_tokens=shard_tokens)
    return out


def _counting(monkeypatch) -> dict:
    from copus.runtime.data import shards

    hashed = {"bytes": 0, "files": []}
    real = shards.file_sha256

    def count(p, *a):
        hashed["bytes"] += Path(p).stat().st_size
        hashed["files"].append(Path(p).name)
        return real(p, *a)

    monkeypatch.setattr(shards, "file_sha256", count)
    return hashed


def test_each_rank_hashes_only_its_share_of_the_dataset(tmp_path, monkeypatch):
    """world 1, 2, 4: the shares are disjoint, cover every file, and each rank hashes at most
    dataset/world + the largest file; the folder is stamped only once every share matched."""
    from copus.runtime.data import shards

    out = _prepared(tmp_path)
    index = json.loads((out / shards.INDEX).read_text())
    entries = index["shards"] + list(index["docs"].values())
    total, largest = sum(e["bytes"] for e in entries), max(e["bytes"] for e in entries)
    assert len(index["shards"]) >= 8
    for world in (1, 2, 4):
        seen: list[str] = []
        for rank in range(world):
            hashed = _counting(monkeypatch)
            shards.verify_folder(out, share=(rank, world))
            assert hashed["bytes"] <= total / world + largest
            seen += hashed["files"]
            (out / shards.VERIFIED).unlink(missing_ok=True)  # every rank starts unstamped
        assert sorted(seen) == sorted(e["file"] for e in entries)


def test_a_read_only_folder_is_split_and_stamped_in_the_cache(tmp_path, monkeypatch):
    """A folder this process cannot write (a read-only mount; simulated by `os.access`, as root
    ignores file modes): each rank hashes its share, rank 0 stamps in the cache folder, and the
    next start hashes nothing."""
    import os

    from copus.runtime.data import shards

    out = _prepared(tmp_path)
    monkeypatch.setenv("COPUS_CACHE_DIR", str(tmp_path / "cache"))
    real_access = os.access
    monkeypatch.setattr(
        shards.os, "access", lambda p, mode: False if Path(p) == out and mode == os.W_OK else real_access(p, mode)
    )
    hashed = _counting(monkeypatch)
    shards.verify_folder(out, share=(1, 2))  # rank 1: its share, no stamp
    first = hashed["bytes"]
    shards.verify_folder(out, share=(0, 2))  # rank 0 stamps (in the cache)
    assert 0 < first < hashed["bytes"]
    assert shards.stamp_path(out).is_file() and not (out / shards.VERIFIED).exists()
    assert str(shards.stamp_path(out)).startswith(str(tmp_path / "cache"))
    before = hashed["bytes"]
    for rank in range(2):
        shards.verify_folder(out, share=(rank, 2))
    assert hashed["bytes"] == before  # next start: nothing re-read


def _verify_on_ranks(folder: str) -> str:
    from copus.runtime.data import shards
    from copus.runtime.data.run_data import agree_on_problem, rank_share

    try:
        shards.verify_folder(folder, share=rank_share(), agree=agree_on_problem)
    except ValueError as err:
        return str(err)
    return ""


def test_a_bad_shard_in_one_share_fails_every_rank_with_one_line(tmp_path):
    """The damaged shard is hashed by rank 1 only; both ranks raise the same line naming it,
    and the folder is not stamped."""
    from copus.runtime.data import shards

    out = _prepared(tmp_path)
    index = json.loads((out / shards.INDEX).read_text())
    entries = index["shards"] + list(index["docs"].values())
    owner = shards.hash_shares([e["bytes"] for e in entries], 2)
    victim = out / next(e["file"] for e, r in zip(entries, owner) if r == 1 and e["file"].startswith("train-0"))
    raw = bytearray(victim.read_bytes())
    raw[3] ^= 0x10
    victim.write_bytes(bytes(raw))
    errors = run_ranks(_verify_on_ranks, 2, str(out), timeout=120)
    assert errors[0] == errors[1] != ""
    assert "\n" not in errors[0] and victim.name in errors[0] and "sha256" in errors[0]
    assert not (out / shards.VERIFIED).exists()


def test_windows_are_gathered_per_shard_as_read_does(tmp_path):
    """`batch` (one gather per shard, boundary-crossing rows read apart) = row-by-row `read`."""
    import numpy as np

    from copus.runtime.data import shards

    out = _prepared(tmp_path, shard_tokens=301)
    ds = shards.open_split(out, "train", seq_len=64)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, len(ds), size=200)
    expected = np.stack([ds.tokens.read(int(i) * 64, 65) for i in ids])
    got = ds.batch(ids)
    assert got.dtype == np.int64 and np.array_equal(got, expected)
    crossing = [i for i in range(len(ds)) if (i * 64) // 301 != (i * 64 + 64) // 301]
    assert crossing and np.array_equal(ds.batch(crossing), np.stack([ds[i] for i in crossing]))
    ds.tokens.close()
    assert np.array_equal(ds.batch(ids[:3]), expected[:3])  # maps reopen after close


def _async_saves(root: str) -> dict:
    """2 ranks: an asynchronous save, the tensors changed at once (training goes on), a second
    save that waits for the first; nothing is read back for hashing."""
    from copus.runtime.state import checkpoint as ck
    from copus.runtime.state import checkpoint_integrity as ci
    from copus.runtime.state.async_checkpoint import AsyncCheckpointer

    hashed: list[str] = []
    original = ci._sha256
    ci._sha256 = lambda p: hashed.append(Path(p).name) or original(p)
    saver = AsyncCheckpointer()
    state = _state(10)  # replicated: rank 0 writes it
    snapshot = {k: v.clone() for k, v in state["model"].items()}
    try:
        first = saver.save(root, 1, state, {"step": 1})
        with torch.no_grad():
            for v in state["model"].values():
                v.add_(1.0)  # the next step, during the write
        second = saver.save(root, 2, state, {"step": 2})  # waits for step 1 first
        saver.close()
    finally:
        ci._sha256 = original
    loaded = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    ck.load(first, loaded, check=False)
    same = all(torch.equal(loaded["model"][k], snapshot[k]) for k in snapshot)
    return {"first": str(first), "second": str(second), "hashed": hashed, "snapshot_kept": same}


def test_async_saves_hash_while_writing_and_keep_the_staged_values(tmp_path):
    out = run_ranks(_async_saves, 2, str(tmp_path), timeout=180)
    assert all(o["snapshot_kept"] for o in out)  # staged before training changed them
    assert all(o["hashed"] == [] for o in out)  # no byte re-read for hashing
    for name in ("step-1", "step-2"):
        assert ckpt.verify(tmp_path / name) is None  # complete, checksums right
    assert not list(tmp_path.glob("tmp-step-*"))
    assert json.loads((tmp_path / "step-2" / ckpt.TRAINER_STATE).read_text()) == {"step": 2}
