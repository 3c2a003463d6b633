"""`--init-from` under 2-D layouts at 4 ranks: each rank's bytes read and the loss vs transformers.

A tiny random transformers Llama (head_dim 24, q/k/v/o biases; tests/runtime/test_hf_roundtrip.py)
is loaded by `load_hf_weights` into the engine under dp2·tp2, dp2·pp2 and tp2·pp2 (one 4-rank
gloo launch); each rank reports the bytes it read (its shard of every tensor) and the engine's
eval loss, which must equal transformers' loss on the same tokens. CPU only; a few minutes on
2 cores. Output: bench/results/hf_import_layouts.json and a table on stdout.

Usage: python bench/hf_import_layouts.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tests.runtime.test_hf_roundtrip as rt  # noqa: E402  (the test's model and tokens)
from tests.runtime._workers import run_ranks  # noqa: E402

LAYOUTS = [(2, 2, 1), (2, 1, 2), (1, 2, 2)]


def work(folder: str) -> dict:
    from copus.core.plan.plan import ParallelPlan
    from copus.core.specs.hf_config import load_shape
    from copus.runtime.engine.dist import MeshCache
    from copus.runtime.engine.engine import Engine, EngineSettings
    from copus.runtime.state.hf_import import load_hf_weights

    shape = load_shape(Path(folder) / "config.json", seq_len=rt.SEQ)
    cache, out = MeshCache("cpu"), {}
    for dp, tp, pp in LAYOUTS:
        plan = ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch_size=1, num_microbatches=4 // dp)
        eng = Engine(shape, plan, EngineSettings(), "cpu", cache, seed=123)
        read = load_hf_weights(eng.model, folder)
        n = 4 // dp
        out[f"dp{dp}.tp{tp}.pp{pp}"] = {
            "loss": eng.eval_loss(rt._tokens()[eng.dp_rank * n : (eng.dp_rank + 1) * n]),
            "read_bytes": read,
        }
        eng.close()
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = rt._hf_folder(Path(tmp))
        ref = rt._hf_loss(folder, rt._tokens())
        total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        res = run_ranks(work, 4, str(folder), timeout=900)
    rows = {
        k: {
            "loss_per_rank": [r[k]["loss"] for r in res],
            "transformers_loss": ref,
            "read_fraction_per_rank": [r[k]["read_bytes"] / total for r in res],
        }
        for k in res[0]
    }
    out = ROOT / "bench/results/hf_import_layouts.json"
    out.write_text(
        json.dumps({"command": "python bench/hf_import_layouts.py", "file_bytes": total, "layouts": rows}, indent=1)
        + "\n"
    )
    print("| layout | max abs(loss - transformers) | bytes read per rank / file |\n| --- | ---: | --- |")
    for k, v in rows.items():
        gap = max(abs(x - ref) for x in v["loss_per_rank"])
        print(f"| {k} | {gap:.2e} | {', '.join(f'{f:.3f}' for f in v['read_fraction_per_rank'])} |")


if __name__ == "__main__":
    main()
