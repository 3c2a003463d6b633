"""Peak memory of `copus export`: the whole-model export (a reference tree, e.g. main) against the
streamed one (this tree), on the same DCP checkpoint.

A Llama-shaped model (default ~150M parameters, 0.6 GB in fp32) is saved once as a copus
checkpoint (`ckpt.save`, one process). Each trial runs `export(...)` in a fresh Python process
and reports its peak resident memory above the process's own baseline after importing torch and
copus (ru_maxrss after the export minus RSS before it): what the export itself costs. Trials
alternate between the two trees (interleaved) and the medians are reported beside the model's
size and its largest tensor. The machine may be shared: figures are memory, not time, so load
barely moves them.

Usage: python bench/export_memory.py [--reference-src /work/main/src] [--repeats 3]
       [--layers 8 --dim 1024 --ffn 2816 --vocab 32000] [--out bench/results/export_memory.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, warnings
warnings.simplefilter("ignore")
import torch
from copus.runtime.state import export as ex
def rss():
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) for l in fh if l.startswith("VmRSS")) * 1024
base = rss()
kw = json.loads(sys.argv[3])
ex.export(sys.argv[1], sys.argv[2], **kw)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"base": base, "peak": peak}))
"""

SAVE = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
from copus.core.specs.resolve import get_model_shape
from copus.runtime.engine.model import build_model, materialize
from copus.runtime.state import checkpoint as ckpt
cfg = sys.argv[2]
shape = get_model_shape(cfg)
model = materialize(build_model(shape, "meta"), "cpu", seed=0)
sd = model.state_dict()
ckpt.save(sys.argv[1] + "/checkpoints", 1, {"model": sd}, {"model": cfg})
sizes = [t.numel() * t.element_size() for t in sd.values()]
print(json.dumps({"model_bytes": sum(sizes), "largest_tensor_bytes": max(sizes), "tensors": len(sizes)}))
"""


def _run(src: str, code: str, *argv: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code, *argv],
        env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reference-src", default="/work/main/src")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out", default=str(ROOT / "bench/results/export_memory.json"))
    args = ap.parse_args()
    ours = str(ROOT / "src")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "config.json"
        cfg.write_text(
            json.dumps(
                {
                    "model_type": "llama",
                    "num_hidden_layers": args.layers,
                    "hidden_size": args.dim,
                    "num_attention_heads": args.dim // 64,
                    "num_key_value_heads": args.dim // 256,
                    "intermediate_size": args.ffn,
                    "vocab_size": args.vocab,
                }
            )
        )
        run = Path(tmp) / "run"
        model = _run(ours, SAVE, str(run), str(cfg))
        trials = {"reference (whole model)": [], "this tree fp32 (streamed)": [], "this tree bf16 (streamed)": []}
        kwargs = {
            "reference (whole model)": (args.reference_src, {}),
            "this tree fp32 (streamed)": (ours, {"dtype": "float32"}),
            "this tree bf16 (streamed)": (ours, {"dtype": "bfloat16"}),
        }
        for r in range(args.repeats):
            for name, (src, kw) in kwargs.items():  # interleaved
                out = Path(tmp) / f"hf-{r}-{len(trials[name])}-{name.split()[0]}-{kw.get('dtype', 'x')}"
                m = _run(src, CHILD, str(run), str(out), json.dumps(kw))
                trials[name].append(m["peak"] - m["base"])
    rows = {k: {"median_extra_peak_bytes": statistics.median(v), "trials": v} for k, v in trials.items()}
    result = {
        "command": " ".join(["python", "bench/export_memory.py", *sys.argv[1:]]),
        **model,
        "shape": {"layers": args.layers, "dim": args.dim, "ffn": args.ffn, "vocab": args.vocab},
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    mb = 2**20
    lines = [
        f"model {model['model_bytes'] / mb:.0f} MiB fp32 in {model['tensors']} tensors, largest "
        f"{model['largest_tensor_bytes'] / mb:.0f} MiB; peak memory above the process baseline "
        f"(median of {args.repeats}, interleaved):",
        "",
        "| export | extra peak MiB | × model | × largest tensor |",
        "| --- | ---: | ---: | ---: |",
    ]
    for k, v in rows.items():
        p = v["median_extra_peak_bytes"]
        lines.append(
            f"| {k} | {p / mb:.0f} | {p / model['model_bytes']:.2f} | {p / model['largest_tensor_bytes']:.2f} |"
        )
    table = "\n".join(lines) + "\n"
    Path(args.out).with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
