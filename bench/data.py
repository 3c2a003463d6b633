"""Data-path benchmark: `copus prepare` throughput, training memory, loader vs trainer speed.

1. prepare throughput: a generated .jsonl corpus of `--mb` MB (random words of a Zipf-weighted
   20k-word vocabulary, documents of 40–800 words) is prepared with a BPE tokenizer of 4096 tokens
   (trained beforehand on 8 MB of it, so only tokenization is timed) with 1 and 2 workers, side
   by side, and with the byte tokenizer; MB/s of input and tokens/s, median over `--repeats`.
2. training resident memory: a 1-process `copus` trainer (model tiny, byte tokenizer, so the
   model is identical) runs `--steps` steps on (a) the embedded corpus and (b) a byte-prepared
   folder of the generated corpus; peak RSS (VmHWM) of each, in fresh processes. Goal: (b) ≤ (a)
   + 50 MB although (b) holds `--mb` MB of text instead of ~10 MB.
3. loader vs trainer: windows/s of the prepared folder's loader (sampler ids + shard reads,
   batches of 64) against the trainer's samples/s from run (b). Goal: ≥ 20×.

Usage: python bench/data.py [--mb 1024] [--rss-mb N] [--repeats 1] [--steps 30] [--out FILE]
Writes bench/results/data.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

CHILD = r"""
import json, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3], RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
from copus.config import load_config
from copus.runtime.train.launch import worker
cfg = load_config(None, [f"data.source='{sys.argv[1]}'", "train.max_steps=" + sys.argv[4],
      "eval.interval_steps=0", "log.progress=false", "log.tensorboard=false",
      "checkpoint.interval_steps=0", "batch.policy='constant'", "train.lr_schedule='constant'"])
result = worker(cfg, sys.argv[2], False)
status = {k: int(v.split()[0]) for k, v in (l.split(":", 1) for l in open("/proc/self/status"))
          if k in ("VmHWM", "VmRSS")}
print(json.dumps({"result": {k: result.get(k) for k in ("steps", "samples", "train_s", "error")},
                  "vm_hwm_kb": status["VmHWM"], "vm_rss_kb": status["VmRSS"]}))
"""


def make_corpus(path: Path, mb: int, seed: int = 0) -> int:
    """A .jsonl of ~`mb` MB: 64 MB of random documents, repeated with distinct ids."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    words = ["".join(rng.choice(letters, size=rng.integers(1, 9))) for _ in range(20_000)]
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    block: list[str] = []
    size = 0
    while size < min(mb, 64) * 1_000_000:
        n = int(rng.integers(40, 800))
        doc = " ".join(words[i] for i in rng.choice(len(words), size=n, p=weights)) + "."
        line = json.dumps({"text": doc}) + "\n"
        block.append(line)
        size += len(line)
    body = "".join(block)
    written = 0
    with open(path, "w") as fh:
        rep = 0
        while written < mb * 1_000_000:
            chunk = body.replace('{"text": "', '{"text": "' + f"r{rep} ", 1) if rep else body
            fh.write(chunk)
            written += len(chunk)
            rep += 1
    return path.stat().st_size


def bench_prepare(corpus: Path, tok: Path, work: Path, workers: int, repeats: int) -> dict:
    from copus.runtime.data.prepare import prepare

    times, meta = [], None
    for r in range(repeats):
        out = work / f"prep-w{workers}-{r}"
        t0 = time.perf_counter()
        meta = prepare([str(corpus)], out, tokenizer=str(tok), workers=workers, progress=False, log=lambda _: None)
        times.append(time.perf_counter() - t0)
        shutil.rmtree(out)
    wall = statistics.median(times)
    tokens = meta["splits"]["train"]["num_tokens"] + meta["splits"]["val"]["num_tokens"]
    size = corpus.stat().st_size
    return {
        "workers": workers,
        "wall_s": wall,
        "mb_per_s": size / 1e6 / wall,
        "tokens_per_s": tokens / wall,
        "tokens": tokens,
        "times_s": times,
    }


def run_child(source: str, run_dir: Path, steps: int) -> dict:
    from copus.runtime.train.launch import free_port

    out = subprocess.run(
        [sys.executable, "-c", CHILD, source, str(run_dir), str(free_port()), str(steps)],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def loader_rate(folder: Path, batch: int = 64, seconds: float = 3.0) -> float:
    from copus.runtime.data.sampler import FeistelSampler
    from copus.runtime.data.shards import open_split

    ds = open_split(folder, "train", 128)
    sampler = FeistelSampler(len(ds), 0)
    n, offset, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        ds.batch(sampler.ids(offset, batch))
        offset += batch
        n += batch
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument(
        "--rss-mb", type=int, default=0, help="corpus size for the memory/loader part (byte tokenizer; default --mb)"
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "data.json"))
    args = ap.parse_args()
    from copus.runtime.data.prepare import prepare
    from copus.runtime.data.sources import documents
    from copus.runtime.data.tokenizer import train_bpe_tokenizer

    work = Path(tempfile.mkdtemp(prefix="copus-bench-data-"))
    try:
        corpus = work / "corpus.jsonl"
        size = make_corpus(corpus, args.mb)
        sample, chars = [], 0
        for doc in documents(corpus):
            sample.append(doc)
            chars += len(doc)
            if chars > 8_000_000:
                break
        tok = work / "tokenizer.json"
        tok.write_text(train_bpe_tokenizer(iter(sample), 4096).to_json())
        prep = [bench_prepare(corpus, tok, work, w, args.repeats) for w in (1, 2)]
        byte_dir = work / "byte"
        t0 = time.perf_counter()
        prepare([str(corpus)], byte_dir, tokenizer="byte", progress=False, log=lambda _: None)
        byte_s = time.perf_counter() - t0
        rss_mb = args.rss_mb or args.mb
        if rss_mb != args.mb:
            shutil.rmtree(byte_dir)
            corpus.unlink()
            make_corpus(corpus, rss_mb, seed=1)
            prepare([str(corpus)], byte_dir, tokenizer="byte", progress=False, log=lambda _: None)
            corpus.unlink()
        embedded = run_child("embedded", work / "run-embedded", args.steps)
        prepared = run_child(str(byte_dir), work / "run-prepared", args.steps)
        loader = loader_rate(byte_dir)
        r = prepared["result"]
        trainer_rate = r["samples"] / r["train_s"]
        load = os.getloadavg()
        res = {
            "corpus_bytes": size,
            "machine_load_1m": load[0],
            "cpus": os.cpu_count(),
            "prepare": prep,
            "speedup_2_workers": prep[0]["wall_s"] / prep[1]["wall_s"],
            "prepare_byte": {"workers": 1, "wall_s": byte_s, "mb_per_s": size / 1e6 / byte_s},
            "rss": {
                "prepared_corpus_mb": rss_mb,
                "embedded_hwm_mb": embedded["vm_hwm_kb"] / 1024,
                "prepared_hwm_mb": prepared["vm_hwm_kb"] / 1024,
                "delta_mb": (prepared["vm_hwm_kb"] - embedded["vm_hwm_kb"]) / 1024,
                "goal_delta_mb": 50,
            },
            "loader_samples_per_s": loader,
            "trainer_samples_per_s": trainer_rate,
            "loader_over_trainer": loader / trainer_rate,
            "goal_ratio": 20,
            "steps": args.steps,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"corpus {size / 1e6:.0f} MB jsonl, load {res['machine_load_1m']:.1f} on {res['cpus']} CPUs")
    print(f"{'workers':>8} {'wall s':>8} {'MB/s':>8} {'Mtok/s':>8}")
    for p in prep:
        print(f"{p['workers']:>8} {p['wall_s']:>8.1f} {p['mb_per_s']:>8.1f} {p['tokens_per_s'] / 1e6:>8.2f}")
    print(f"{'byte':>8} {byte_s:>8.1f} {size / 1e6 / byte_s:>8.1f}   (byte tokenizer, 1 worker)")
    rss = res["rss"]
    print(
        f"train RSS peak: embedded {rss['embedded_hwm_mb']:.0f} MB, prepared {rss_mb} MB corpus "
        f"{rss['prepared_hwm_mb']:.0f} MB (delta {rss['delta_mb']:+.0f} MB, goal <= +50)"
    )
    print(
        f"loader {loader:,.0f} samples/s vs trainer {trainer_rate:,.1f} samples/s: "
        f"{res['loader_over_trainer']:,.0f}x (goal >= 20x)"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
