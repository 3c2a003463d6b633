"""Checkpoints under damage: every file truncated, bit-flipped, emptied or deleted; manifests
missing or garbled; disk full at every fsync of a save (and on a real tiny tmpfs when this
machine lets us mount one); retention. In every case the damage is reported naming the file,
the previous good checkpoint is used, and it loads bit-exactly.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from copus.runtime.state import checkpoint as ckpt

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _model_opt(seed: int, width: int = 16):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Linear(width, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def _state(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt, options=OPTIONS)
    return {"model": msd, "optim": osd}


def _save(root: Path, step: int, keep: int = 0, width: int = 16) -> Path:
    model, opt = _model_opt(step, width)
    return ckpt.save(root, step, _state(model, opt), {"step": step}, keep=keep)


def _assert_loads_as(path: Path, step: int, width: int = 16) -> None:
    """`path` loads and holds exactly the weights and Adam state saved at `step`."""
    model, opt = _model_opt(999, width)
    state = _state(model, opt)
    assert ckpt.load(path, state) == {"step": step}
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=OPTIONS)
    ref_model, ref_opt = _model_opt(step, width)
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(ref_opt.state[a]["exp_avg_sq"], opt.state[b]["exp_avg_sq"])


def _damage(file: Path, how: str) -> None:
    raw = bytearray(file.read_bytes())
    if how == "truncate":
        file.write_bytes(raw[: max(len(raw) // 2, 1) - 1])
    elif how == "flip":
        raw[len(raw) // 3] ^= 0x01  # one bit
        file.write_bytes(raw)
    elif how == "empty":
        file.write_bytes(b"")
    elif how == "delete":
        file.unlink()
    else:
        raise AssertionError(how)


def _data_file(path: Path) -> str:
    return next(p.name for p in path.iterdir() if p.suffix == ".distcp")


@pytest.mark.parametrize("how", ["truncate", "flip", "empty", "delete"])
@pytest.mark.parametrize("which", [".metadata", "distcp", ckpt.TRAINER_STATE])
def test_damaged_file_is_named_and_previous_used(tmp_path, which, how):
    _save(tmp_path, 10)
    bad = _save(tmp_path, 20)
    name = _data_file(bad) if which == "distcp" else which
    _damage(bad / name, how)
    problem = ckpt.verify(bad)
    assert problem is not None and name in problem
    messages: list[str] = []
    assert ckpt.find_latest(tmp_path, log=messages.append) == tmp_path / "step-10"
    assert len(messages) == 1 and name in messages[0] and "using step-10" in messages[0]
    with pytest.raises(ckpt.CheckpointError, match=name.replace(".", r"\.")):
        ckpt.load(bad, _state(*_model_opt(0)))
    _assert_loads_as(tmp_path / "step-10", 10)


@pytest.mark.parametrize("manifest", ["missing", "garbage", "truncated", "wrong-size", "no-metadata-entry"])
def test_bad_manifest_is_named_and_previous_used(tmp_path, manifest):
    _save(tmp_path, 1)
    bad = _save(tmp_path, 2)
    file = bad / ckpt.MANIFEST
    data = json.loads(file.read_text())
    if manifest == "missing":
        file.unlink()
    elif manifest == "garbage":
        file.write_bytes(os.urandom(64))
    elif manifest == "truncated":
        file.write_text(file.read_text()[:40])
    elif manifest == "wrong-size":
        data["files"][ckpt.TRAINER_STATE]["bytes"] += 1
        file.write_text(json.dumps(data))
    else:
        del data["files"][".metadata"]
        file.write_text(json.dumps(data))
    problem = ckpt.verify(bad)
    assert problem is not None and str(bad) in problem
    assert ckpt.find_latest(tmp_path, log=lambda _: None) == tmp_path / "step-1"
    _assert_loads_as(tmp_path / "step-1", 1)


def test_all_damaged_means_no_checkpoint_and_every_problem_logged(tmp_path):
    for step in (1, 2, 3):
        path = _save(tmp_path, step)
        _damage(path / _data_file(path), "flip")
    messages: list[str] = []
    assert ckpt.find_latest(tmp_path, log=messages.append) is None
    assert len(messages) == 3 and all("no older good checkpoint" in m for m in messages)
    assert ckpt.find_latest(tmp_path / "nowhere") is None


def test_half_written_folders_are_never_candidates(tmp_path):
    _save(tmp_path, 1)
    (tmp_path / "tmp-step-9").mkdir()  # a save killed before the rename
    (tmp_path / "tmp-step-9" / ".metadata").write_bytes(b"partial")
    (tmp_path / "step-7").mkdir()  # renamed, then (impossibly) emptied
    assert [s for s, _ in ckpt.step_dirs(tmp_path)] == [7, 1]
    assert ckpt.find_latest(tmp_path, log=lambda _: None) == tmp_path / "step-1"
    _save(tmp_path, 2)
    assert not (tmp_path / "tmp-step-9").exists()  # stale temp folders are cleared


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_retention_keeps_the_newest_n(tmp_path, keep):
    (tmp_path / "notes").mkdir()  # not ours: never touched
    for step in range(1, 7):
        _save(tmp_path, step * 5, keep=keep)
        kept = [s for s, _ in ckpt.step_dirs(tmp_path)]
        assert kept == [5 * s for s in range(step, max(step - keep, 0), -1)]
    assert (tmp_path / "notes").is_dir()
    for _, path in ckpt.step_dirs(tmp_path):
        assert ckpt.verify(path) is None


def _count_fsyncs(tmp_path: Path) -> int:
    calls = []
    real = os.fsync

    def counting(fd):
        calls.append(fd)
        return real(fd)

    os.fsync = counting
    try:
        _save(tmp_path / "count", 1)
    finally:
        os.fsync = real
    return len(calls)


def test_disk_full_at_every_fsync_keeps_the_previous(tmp_path, monkeypatch):
    """ENOSPC raised at the k-th fsync of a save, for every k: the save fails loudly, the
    previous checkpoint stays the latest valid one, and the next save works."""
    total = _count_fsyncs(tmp_path)
    assert total >= 4  # data files, json, manifest, folder
    real = os.fsync
    for k in range(total):
        root = tmp_path / f"k{k}"
        _save(root, 1)
        seen = [0]

        def failing(fd, k=k, seen=seen):
            seen[0] += 1
            if seen[0] == k + 1:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd)

        monkeypatch.setattr(os, "fsync", failing)
        with pytest.raises((OSError, ckpt.CheckpointError)) as info:
            _save(root, 2)
        monkeypatch.setattr(os, "fsync", real)
        assert "No space left on device" in str(info.value), (k, info.value)
        latest = ckpt.find_latest(root, log=lambda _: None)
        # Failing the very last fsync (the parent folder, after the rename) may leave step-2
        # complete; anything earlier leaves step-1 as the latest.
        assert latest == root / ("step-2" if latest == root / "step-2" else "step-1")
        if latest == root / "step-2":
            assert k == total - 1, k
        _assert_loads_as(latest, int(latest.name.split("-")[1]))
        _save(root, 3)
        assert ckpt.find_latest(root) == root / "step-3"
        assert not list(root.glob("tmp-step-*"))


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", f"copus-{uuid.uuid4().hex[:6]}", str(path)],
        capture_output=True,
        timeout=10,
    )
    return out.returncode == 0


def test_real_disk_full_on_a_tiny_tmpfs(tmp_path):
    """A file system with room for one checkpoint but not two: the second save fails with
    ENOSPC and the first stays valid and loadable."""
    size = sum(f.stat().st_size for f in _save(tmp_path / "probe", 1, width=512).iterdir())
    mnt = tmp_path / "tiny"
    if not _mount_tmpfs(mnt, f"{(size * 3 // 2) // 4096 * 4096 + 8192}"):
        pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)")
    try:
        root = mnt / "ck"
        first = _save(root, 1, width=512)
        with pytest.raises((OSError, ckpt.CheckpointError)) as info:
            _save(root, 2, width=512)
        assert "No space left on device" in str(info.value)
        assert ckpt.find_latest(root, log=lambda _: None) == first
        _assert_loads_as(first, 1, width=512)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)


def test_killed_during_retention_never_leaves_a_half_deleted_checkpoint(tmp_path, monkeypatch):
    """Retention (and re-saving a step) deletes a folder; a kill in the middle of that delete
    must not leave a `step-N` with files missing."""
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    real = shutil.rmtree

    def killed_midway(path, ignore_errors=False):
        files = sorted(p for p in Path(path).rglob("*") if p.is_file()) if Path(path).exists() else []
        if files:
            files[0].unlink()  # some files gone ...
            raise KeyboardInterrupt("killed while deleting")  # ... then the process dies

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 3, keep=1)
    monkeypatch.setattr(ckpt.shutil, "rmtree", real)
    for _, path in ckpt.step_dirs(tmp_path):
        assert ckpt.verify(path) is None, path  # no half-deleted step-N
    assert ckpt.find_latest(tmp_path) == tmp_path / "step-3"
    _save(tmp_path, 4, keep=1)  # the next save clears the leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"]


def _rank0_finalize_fails(root: str) -> str:
    """On 2 gloo ranks: save step 1, then a save of step 2 whose rank-0 finishing phase hits
    ENOSPC (the manifest write). Returns this rank's error text (every rank must get one)."""
    import torch.distributed as dist

    from copus.runtime.state import checkpoint as ck

    model, opt = _model_opt(dist.get_rank())
    ck.save(root, 1, _state(model, opt), {"step": 1})
    if dist.get_rank() == 0:

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        ck.write_manifest = full  # read by checkpoint.finalize
    try:
        ck.save(root, 2, _state(model, opt), {"step": 2})
    except ck.CheckpointError as err:
        return str(err)
    return "saved"


def test_a_save_failing_on_rank_0_fails_on_every_rank_and_frees_its_space(tmp_path):
    from tests.runtime._workers import run_ranks

    errors = run_ranks(_rank0_finalize_fails, 2, str(tmp_path), timeout=120)
    assert all("checkpoint" in e and "step-2 not saved" in e for e in errors), errors
    assert "No space left on device" in errors[0]
    assert ckpt.find_latest(tmp_path, log=lambda _: None) == tmp_path / "step-1"
    assert not list(tmp_path.glob("tmp-step-*"))  # the partial save was removed
