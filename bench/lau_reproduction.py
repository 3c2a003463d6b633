"""Lau et al.'s own comparison at small scale (issue 27): adaptive vs constant and ramped batches.

    nice -n 10 python bench/lau_reproduction.py [--samples 6144] [--seeds 0,1,2] \
        [--out bench/results/lau_reproduction.json] [--table docs/lau_results.md]

Lau et al. (arXiv 2412.21124, §5, App. C) train at an equal *sample* budget with AdamW, a
warm-up + cosine LR schedule in samples, no LR rule on a batch change, J = 4 workers, and compare
(i) constant batches, (ii) a stagewise ramp (2048-4096-8192 for 2.5 %-2.5 %-95 % of the data,
i.e. cap/4, cap/2, cap) and (iii) the norm test at every step with no smoothing and no growth
cap. Their claim: the adaptive schedule matches or beats the best constant batch at equal
samples with fewer steps than small constant batches, and beats the cap-sized constant.

Here, scaled down to run on a shared CPU: a 2-layer byte-level model (107k parameters, seq 32)
on copus's embedded text; J = 4 simulated workers of micro-batch 4 (start 16 = J·4, cap 256);
constant batches 16…256; the stagewise ramp 64-128-256; and the norm test at the paper's
η = 0.2 under the three readings of its statistic (core.stats.batch_tests):

    paper        eq. 5 as printed, (1/J) Σ_j ‖g_j − ḡ‖² over the J = 4 per-worker gradients
    micro-batch  the same over the J·K micro-batch gradients (b = 4)
    per-sample   b·J/(J−1)·(s̄ − q), the variance of one sample's gradient

All runs of one seed see the same data order, initialisation and LR schedule (in samples). Each
run records the validation loss (64 held-out sequences) every 256 samples. Output: per run the
curve, the final validation loss at equal samples, and the optimizer steps to reach each target
(the mean final losses of the constant batches); a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from copus.core.control.policies import NormTestPolicy, PolicySettings
from copus.core.plan.plan import ParallelPlan
from copus.core.plan.records import StepRecord
from copus.core.specs.models import ModelShape
from copus.runtime.data.stream import TokenDataset, load_text
from copus.runtime.data.tokenizer import ByteCodec
from copus.runtime.engine.engine import token_loss
from copus.runtime.engine.model import build_model, materialize

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ModelShape(
    name="lau-micro",
    n_layers=2,
    dim=64,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=128,
    vocab_size=256,
    seq_len=32,
    tie_embeddings=False,
    rope_theta=10000.0,
    norm_eps=1e-5,
)
J, MBS, START, CAP = 4, 4, 16, 256
EVAL_EVERY, EVAL_ROWS = 256, 64
LR, WARMUP_FRAC, MIN_LR_FRAC = 3e-3, 0.01, 0.1


def lr_at(samples: int, budget: int) -> float:
    """Linear warm-up over 1 % of the samples, cosine to LR/10 (Lau et al. App. C, in samples)."""
    warm = max(1, int(WARMUP_FRAC * budget))
    if samples < warm:
        return LR * (samples + 1) / warm
    frac = min(1.0, (samples - warm) / max(1, budget - warm))
    return LR * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * frac)))


def stagewise(samples: int, budget: int) -> int:
    """Lau et al.'s ramp 2048-4096-8192 over 2.5 %-2.5 %-95 % of the data, scaled to the cap."""
    if samples < 0.025 * budget:
        return CAP // 4
    return CAP // 2 if samples < 0.05 * budget else CAP


def step_stats(vectors: list[torch.Tensor], k: int) -> dict[str, tuple[float, int, float]]:
    """(s̄, J, b) over micro-batch and over per-worker gradients; ḡ is the mean of `vectors`
    (J·k micro-batch gradients, worker j owning vectors j·k … j·k + k − 1)."""
    micro = torch.stack(vectors)
    workers = micro.view(J, k, -1).mean(1)
    return {
        "micro": (float((micro * micro).sum(1).mean()), J * k, float(MBS)),
        "worker": (float((workers * workers).sum(1).mean()), J, float(MBS * k)),
    }


def run(policy: str, seed: int, budget: int, data: TokenDataset, val: torch.Tensor, eta: float) -> dict:
    torch.manual_seed(seed)
    model = materialize(build_model(SHAPE), "cpu", seed=seed)
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(1000 + seed))
    form = policy.split(":", 1)[1] if policy.startswith("norm-test") else None
    test = None
    if form is not None:
        s = PolicySettings(
            initial=START,
            min=START,
            max=CAP,
            interval_steps=1,
            warmup_steps=0,
            max_growth=float("inf"),
            norm_test_form=form,
            norm_test_eta=eta,
        )
        test = NormTestPolicy(s, ParallelPlan(dp=J, tp=1, pp=1, micro_batch_size=MBS, num_microbatches=1))
    batch = int(policy.split("-")[1]) if policy.startswith("constant") else START
    samples = steps = 0
    curve, batches, next_eval = [], [], 0
    t0 = time.perf_counter()
    while samples < budget:
        if policy == "stagewise":
            batch = stagewise(samples, budget)
        batch = min(batch, budget - samples) // (J * MBS) * (J * MBS) or J * MBS
        if samples >= next_eval:
            curve.append({"samples": samples, "steps": steps, "val": evaluate(model, val)})
            next_eval += EVAL_EVERY
        k = batch // (J * MBS)
        ids = order[samples : samples + batch]
        tokens = torch.from_numpy(data.batch(ids.numpy())).long()
        vectors, loss_sum = [], 0.0
        for chunk in tokens.chunk(J * k):
            loss = token_loss(model(chunk[:, :-1]), chunk[:, 1:])
            grads = torch.autograd.grad(loss, params)
            vectors.append(torch.cat([g.flatten() for g in grads]))
            loss_sum += float(loss.detach())
        gbar = torch.stack(vectors).mean(0)
        offset = 0
        for p in params:
            p.grad = gbar[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(samples, budget)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps += 1
        samples += batch
        batches.append(batch)
        if test is not None:
            stats = step_stats(vectors, k)["worker" if form == "paper" else "micro"]
            plan = ParallelPlan(dp=J, tp=1, pp=1, micro_batch_size=MBS, num_microbatches=k)
            if form == "paper":  # the record's small gradients are per-worker (gns.small="rank")
                plan = ParallelPlan(dp=J, tp=1, pp=1, micro_batch_size=MBS * k, num_microbatches=1)
            rec = StepRecord(
                step=steps,
                samples=samples,
                tokens=samples * SHAPE.seq_len,
                plan=plan,
                step_s=1.0,
                loss=loss_sum / (J * k),
                small_sqnorm=stats[0],
                num_small=stats[1],
                small_batch=stats[2],
                big_sqnorm=float(gbar @ gbar),
            )
            decision = test.observe(rec)
            if decision is not None:
                batch = decision.plan.global_batch_size
    curve.append({"samples": samples, "steps": steps, "val": evaluate(model, val)})
    return {
        "policy": policy,
        "seed": seed,
        "steps": steps,
        "samples": samples,
        "final_val": curve[-1]["val"],
        "mean_batch": samples / steps,
        "batches": batches,
        "curve": curve,
        "wall_s": time.perf_counter() - t0,
    }


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: torch.Tensor) -> float:
    return float(token_loss(model(val[:, :-1]), val[:, 1:]))


def steps_to(curve: list[dict], target: float) -> int | None:
    """Optimizer steps at the first evaluation with val ≤ target (None: never reached)."""
    return next((c["steps"] for c in curve if c["val"] <= target), None)


def summarise(runs: list[dict]) -> dict:
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    by = {p: [r for r in runs if r["policy"] == p] for p in policies}
    consts = [p for p in policies if p.startswith("constant")]
    targets = {p: statistics.mean(r["final_val"] for r in by[p]) for p in consts}
    rows = {}
    for p in policies:
        finals = [r["final_val"] for r in by[p]]
        rows[p] = {
            "final_val_mean": statistics.mean(finals),
            "final_val_sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "steps_mean": statistics.mean(r["steps"] for r in by[p]),
            "mean_batch": statistics.mean(r["mean_batch"] for r in by[p]),
            "steps_to": {t: [steps_to(r["curve"], v) for r in by[p]] for t, v in targets.items()},
        }
    best = min(consts, key=lambda p: rows[p]["final_val_mean"])
    cap = f"constant-{CAP}"
    claim = {}
    for p in policies:
        if not p.startswith("norm-test"):
            continue
        r = rows[p]
        small = [c for c in consts if int(c.split("-")[1]) < r["mean_batch"]]
        claim[p] = {
            "beats_cap_constant": cap in rows and r["final_val_mean"] < rows[cap]["final_val_mean"],
            "matches_best_constant": r["final_val_mean"] <= rows[best]["final_val_mean"] + rows[best]["final_val_sd"],
            "fewer_steps_than": [c for c in small if r["steps_mean"] < rows[c]["steps_mean"]],
            "grew": r["mean_batch"] > START,
        }
    return {"targets": targets, "best_constant": best, "rows": rows, "claim": claim}


def table(summary: dict, args: argparse.Namespace) -> str:
    consts = list(summary["targets"])
    head = (
        "| policy | final val loss (mean ± sd) | steps | mean batch | "
        + " | ".join(f"steps to {summary['targets'][c]:.3f} ({c})" for c in consts)
        + " |"
    )
    lines = [head, "|" + "---|" * (4 + len(consts))]
    for p, r in summary["rows"].items():
        cells = []
        for c in consts:
            hit = [x for x in r["steps_to"][c] if x is not None]
            n = len(r["steps_to"][c])
            cells.append(
                "–" if not hit else f"{statistics.mean(hit):.0f}" + ("" if len(hit) == n else f" ({len(hit)}/{n})")
            )
        lines.append(
            f"| {p} | {r['final_val_mean']:.4f} ± {r['final_val_sd']:.4f} | "
            f"{r['steps_mean']:.0f} | {r['mean_batch']:.0f} | " + " | ".join(cells) + " |"
        )
    lines.append("")
    lines.append(
        f"Budget {args.samples} samples, start {START}, cap {args.cap}, J = {J} "
        f"workers, seeds {args.seeds}, eta {args.eta}; best "
        f"constant: {summary['best_constant']}. Steps to a target (a constant's mean final "
        "loss): mean over the seeds that reached it, (k/n) when only k of n did, – none."
    )
    return "\n".join(lines) + "\n"


def dump(path: str, args: argparse.Namespace, runs: list[dict], summary: dict | None) -> None:
    """JSON with the summary indented and one line per run (curves and batches are long)."""
    head = {"args": vars(args)} | ({"summary": summary} if summary is not None else {})
    text = json.dumps(head, indent=1)[:-2] + ',\n "runs": [\n'
    text += ",\n".join("  " + json.dumps(r) for r in runs) + "\n ]\n}\n"
    Path(path).write_text(text)


def main() -> None:
    global CAP
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=6144)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--eta", type=float, default=0.2)
    ap.add_argument("--cap", type=int, default=CAP, help="largest batch (default 256)")
    ap.add_argument(
        "--text-chars",
        type=int,
        default=400_000,
        help="bytes of the embedded "
        "corpus to use (default 400000: 11875 training samples; the last 5 %% is "
        "the validation text)",
    )
    ap.add_argument(
        "--policies",
        default="constant-16,constant-32,constant-64,constant-128,"
        "constant-256,stagewise,norm-test:paper,norm-test:micro-batch,"
        "norm-test:per-sample",
    )
    ap.add_argument("--out", default=str(ROOT / "bench/results/lau_reproduction.json"))
    ap.add_argument("--table", default=str(ROOT / "docs/lau_results.md"))
    ap.add_argument(
        "--merge",
        default="",
        help="comma-separated JSON files of earlier runs "
        "(e.g. one per seed, run in parallel): summarise them, train nothing",
    )
    args = ap.parse_args()
    CAP = args.cap
    if args.merge:
        runs = [r for f in args.merge.split(",") for r in json.loads(Path(f).read_text())["runs"]]
        args.seeds = ",".join(sorted({str(r["seed"]) for r in runs}))
        summary = summarise(runs)
        dump(args.out, args, runs, summary)
        Path(args.table).write_text(table(summary, args))
        print(table(summary, args))
        return
    torch.set_num_threads(1)
    ids = ByteCodec().encode(load_text("embedded", max_chars=args.text_chars))
    split = int(0.95 * len(ids))
    data = TokenDataset(ids[:split], SHAPE.seq_len)
    if args.samples > len(data):
        raise SystemExit(
            f"--samples={args.samples} is invalid; allowed: <= {len(data)} training "
            f"samples at --text-chars={args.text_chars} (one pass, no repeats)"
        )
    held = TokenDataset(ids[split:], SHAPE.seq_len)
    val = torch.from_numpy(held.batch(list(range(EVAL_ROWS)))).long()
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for policy in args.policies.split(","):  # interleaved: every policy per seed
            r = run(policy, seed, args.samples, data, val, args.eta)
            print(
                json.dumps({k: r[k] for k in ("policy", "seed", "steps", "final_val", "mean_batch", "wall_s")}),
                flush=True,
            )
            runs.append(r)
            dump(args.out, args, runs, None)
    summary = summarise(runs)
    dump(args.out, args, runs, summary)
    Path(args.table).write_text(table(summary, args))
    print(table(summary, args))


if __name__ == "__main__":
    main()
