"""Benchmark: bytes of the dataset each rank hashes at start, and the cost of reading a step's rows.

Hypothesis: with every rank hashing every shard (`before`, the previous `verify_folder`, kept
verbatim below), a rank reads the whole dataset D at every start of a read-only folder and at
the first start of a writable one; dealing the shards by size (`after`, `shards.hash_shares`)
bounds it by D/W + one shard, and the verified stamp (in the cache for a read-only folder) makes
the next start read nothing. Rows: one `os.pread` per row (`before`) against one vectorised
gather per shard from a memory map (`after`, `ShardedTokens.windows`).

Run: a prepared folder of byte tokens (uint16, many shards) is written once under runs/; each
rank's work is run in this process with `share=(rank, W)` (what that rank does; the agreement
among ranks only exchanges short strings), counting the bytes passed to sha256. The read-only
case simulates a read-only mount (`os.access` → False for the folder) with an empty cache.
Row reads: a batch of random windows, before and after interleaved, median over repeats.

Writes bench/results/data_integrity.json and .md.
Run: python bench/data_integrity.py [--mb 48] [--shard-tokens 1048576] [--repeats 7]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import time
from pathlib import Path

import numpy as np

from copus.runtime.data import shards

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "data_integrity"
WORK = ROOT / "runs" / "bench_data_integrity"


def make_folder(mb: int, shard_tokens: int) -> Path:
    from copus.runtime.data.prepare import prepare

    folder = WORK / f"p{mb}-{shard_tokens}"
    if shards.is_prepared(folder):
        return folder
    WORK.mkdir(parents=True, exist_ok=True)
    src = WORK / "text.jsonl"
    rng = np.random.default_rng(0)
    words = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit"]
    with open(src, "w") as fh:
        size = 0
        while size < mb * 2**20:
            line = json.dumps({"text": " ".join(rng.choice(words, 400))}) + "\n"
            fh.write(line)
            size += len(line)
    prepare([str(src)], folder, progress=False, shard_tokens=shard_tokens)
    return folder


def old_verify_folder(root: Path, sha) -> None:
    """The previous `verify_folder` (every rank hashes every shard whose stamp is stale; a
    read-only folder is never stamped), hashing with `sha`."""
    index = json.loads((root / shards.INDEX).read_text())
    try:
        stamp = json.loads((root / shards.VERIFIED).read_text())
    except (OSError, ValueError):
        stamp = {}
    fresh = {}
    for entry in index["shards"] + list(index.get("docs", {}).values()):
        f = root / entry["file"]
        st = f.stat()
        seen = [st.st_size, st.st_mtime_ns, entry["sha256"]]
        if stamp.get(entry["file"]) != seen and sha(f) != entry["sha256"]:
            raise ValueError(f"{entry['file']} fails its sha256")
        fresh[entry["file"]] = seen
    if fresh != stamp and os.access(root, os.W_OK):
        (root / shards.VERIFIED).write_text(json.dumps(fresh, sort_keys=True))


class Counter:
    """sha256 of a file, counting the bytes read for it."""

    def __init__(self) -> None:
        self.bytes = 0

    def __call__(self, path, chunk: int = 1 << 22) -> str:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            while block := fh.read(chunk):
                self.bytes += len(block)
                h.update(block)
        return h.hexdigest()


def reset(folder: Path, cache: Path) -> None:
    (folder / shards.VERIFIED).unlink(missing_ok=True)
    shutil.rmtree(cache, ignore_errors=True)


def per_rank_bytes(folder: Path, world: int, read_only: bool, cache: Path) -> dict:
    """Bytes hashed by each rank at a first and a second start, before and after."""
    real_access = os.access
    if read_only:
        os.access = lambda p, mode: False if Path(p) == folder and mode == os.W_OK else real_access(p, mode)
    try:
        out = {}
        for name in ("before", "after"):
            reset(folder, cache)
            starts = []
            for start in range(2):
                counts = []
                for rank in range(world):  # ranks run at once; rank 0 stamps after all
                    sha = Counter()
                    if name == "before":
                        if start == 0:  # at once: no rank sees another's stamp
                            (folder / shards.VERIFIED).unlink(missing_ok=True)
                        old_verify_folder(folder, sha)
                    else:
                        shards.file_sha256, saved = sha, shards.file_sha256
                        try:
                            shards.verify_folder(folder, share=((rank + 1) % world, world))
                        finally:
                            shards.file_sha256 = saved
                    counts.append(sha.bytes)
                starts.append(counts)
            out[name] = {"first_start": starts[0], "second_start": starts[1]}
        return out
    finally:
        os.access = real_access
        reset(folder, cache)


def old_batch(ds, ids: np.ndarray) -> np.ndarray:
    """The previous `WindowDataset.batch`: one positional read per row."""
    tok = ds.tokens
    out = np.empty((ids.size, ds.seq_len + 1), dtype=np.int64)
    fds: dict[int, int] = {}
    for row, i in enumerate(ids.tolist()):
        start, n = i * ds.seq_len, ds.seq_len + 1
        parts, pos, end = [], start, start + n
        k = int(np.searchsorted(tok._starts, pos, side="right")) - 1
        while pos < end:
            shard = tok.shards[k]
            take = min(end, shard.start + shard.num_tokens) - pos
            if k not in fds:
                fds[k] = os.open(shard.path, os.O_RDONLY)
            raw = os.pread(fds[k], take * tok.dtype.itemsize, (pos - shard.start) * tok.dtype.itemsize)
            parts.append(np.frombuffer(raw, dtype=tok.dtype))
            pos += take
            k += 1
        out[row] = (parts[0] if len(parts) == 1 else np.concatenate(parts)).astype(np.int64)
    for fd in fds.values():
        os.close(fd)
    return out


def row_reads(folder: Path, rows: int, seq_len: int, repeats: int) -> dict:
    ds = shards.open_split(folder, "train", seq_len)
    rng = np.random.default_rng(1)
    times: dict[str, list[float]] = {"before": [], "after": []}
    for rep in range(repeats):
        ids = rng.integers(0, len(ds), size=rows)
        for name in ("before", "after") if rep % 2 == 0 else ("after", "before"):
            t0 = time.perf_counter()
            got = old_batch(ds, ids) if name == "before" else ds.batch(ids)
            times[name].append(time.perf_counter() - t0)
            if name == "after":
                assert np.array_equal(got, old_batch(ds, ids))
    med = {k: float(np.median(v)) for k, v in times.items()}
    growth = {}
    for name in ("before", "after"):  # resident file pages over 200 batches
        fresh = shards.open_split(folder, "train", seq_len)
        base, peak = rss_file(), 0
        for _ in range(200):
            ids = rng.integers(0, len(fresh), size=rows)
            old_batch(fresh, ids) if name == "before" else fresh.batch(ids)
            peak = max(peak, rss_file() - base)
        fresh.tokens.close()
        growth[name] = peak
    return {
        "rows": rows,
        "seq_len": seq_len,
        "median_s": med,
        "repeats": times,
        "speedup": med["before"] / med["after"],
        "rss_file_growth_bytes": growth,
        "release_bytes": shards.RELEASE_BYTES,
    }


def rss_file() -> int:
    """This process's resident file-backed pages (bytes), from /proc/self/status."""
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=48)
    ap.add_argument("--shard-tokens", type=int, default=1 << 20)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    folder = make_folder(args.mb, args.shard_tokens)
    cache = WORK / "cache"
    os.environ["COPUS_CACHE_DIR"] = str(cache)
    index = json.loads((folder / shards.INDEX).read_text())
    entries = index["shards"] + list(index["docs"].values())
    total = sum(e["bytes"] for e in entries)
    cases = []
    for read_only in (False, True):
        for world in (1, 2, 4):
            got = per_rank_bytes(folder, world, read_only, cache)
            worst = max(got["after"]["first_start"])
            cases.append(
                {"world": world, "read_only": read_only, **got, "after_max_over_D_per_W": worst / (total / world)}
            )
    result = {
        "machine": platform.processor() or platform.machine(),
        "note": "2 CPU cores shared with other jobs",
        "command": f"python bench/data_integrity.py --mb {args.mb} --shard-tokens "
        f"{args.shard_tokens} --repeats {args.repeats}",
        "dataset_bytes": total,
        "files": len(entries),
        "largest_file": max(e["bytes"] for e in entries),
        "cases": cases,
        "row_reads": row_reads(folder, 256, 2048, args.repeats),
    }
    result["goal_ok"] = all(c["after_max_over_D_per_W"] <= 1.1 for c in cases)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    OUT.with_suffix(".md").write_text(table(result))
    print(table(result))


def table(r: dict) -> str:
    mib = 2**20
    lines = [
        f"Dataset D = {r['dataset_bytes'] / mib:.1f} MiB in {r['files']} files; bytes hashed "
        "per rank at start (max over ranks).",
        "",
        "| folder | world | D/world MiB | before: 1st / 2nd start MiB | after: 1st / 2nd start MiB "
        "| after / (D/world) |",
        "|---|---|---|---|---|---|",
    ]
    for c in r["cases"]:
        b, a = c["before"], c["after"]
        lines.append(
            f"| {'read-only' if c['read_only'] else 'writable'} | {c['world']} | "
            f"{r['dataset_bytes'] / c['world'] / mib:.1f} | "
            f"{max(b['first_start']) / mib:.1f} / {max(b['second_start']) / mib:.1f} | "
            f"{max(a['first_start']) / mib:.1f} / {max(a['second_start']) / mib:.1f} | "
            f"{c['after_max_over_D_per_W']:.3f} |"
        )
    rr = r["row_reads"]
    lines += [
        "",
        f"A batch of {rr['rows']} random windows of {rr['seq_len'] + 1} tokens: "
        f"one pread per row {rr['median_s']['before'] * 1e3:.1f} ms, one gather per shard "
        f"{rr['median_s']['after'] * 1e3:.1f} ms (×{rr['speedup']:.1f}; medians, interleaved).",
        f"Resident file pages grown over 200 such batches: before "
        f"{rr['rss_file_growth_bytes']['before'] / mib:.1f} MiB, after "
        f"{rr['rss_file_growth_bytes']['after'] / mib:.1f} MiB (release threshold "
        f"{rr['release_bytes'] / mib:.0f} MiB).",
        f"({r['note']}; command: `{r['command']}`)",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
