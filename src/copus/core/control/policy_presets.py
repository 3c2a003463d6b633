"""Named policy variants: `batch.policy = "goodput-copus"` is the goodput controller with the
COPUS paper's settings (arXiv 2604.26687 §3, §6.1; copus-notes.md), kept to compare against.

A preset only supplies defaults: a key the user sets explicitly (file or `--set`) wins, and the
run folder's config.toml records every resolved value. `goodput-copus` is the paper's algorithm
alone: no accuracy gate on the noise scale, c = 2, the 10 % margin on an amortised gain, ≤ 2×
growth per decision, the batch never shrinks (`core.control.controller.Controller`). `goodput`
itself is the planning controller (`core.control.planner`, docs/robust-goodput.md): c learnt in
the run (`gns.calibration = "auto"`), no LR-aware sqrt(B) factor (docs/statistics.md §4), the
tracking GNS estimator, and one rule in place of COPUS's thresholds.

`batch.policy = "norm-test-lau"` is the norm test with Lau et al.'s schedule (arXiv 2412.21124,
Algorithm 1 and App. C; lau-notes §1.5): tested at every step on that step's statistics alone
(interval 1, no warm-up, so no averaging window), no growth cap (the batch jumps straight to
⌈T⌉, rounded up to a multiple of dp·micro_batch_size, clipped at batch.max), no LR rule on a
batch change, and η = 0.2 (their MicroLlama runs use 0.15–0.275) in the per-sample form, the
reading in which the batch can grow from their start of 256 (docs/lau.md: eq. 5 as printed over
4 workers asks for E[T] ≲ 3/η² = 75). `norm-test` keeps copus's own settings: a 10-step window
checked every 10 steps after a 10-step warm-up, ≤ 2× per decision, η = 0.5, sqrt LR rule.

A norm-test policy with `batch.norm_test_form = "paper"` (per-worker gradients) sets
`gns.small = "rank"` unless the user set it; `copus.config.check_norm_test_form` rejects an explicit clash.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

POLICY_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "goodput-copus": {
        "gns": {
            "calibration": 2.0,  # c = 2 on tr(Σ) (COPUS §1.2)
            "estimator": "ema",  # separate EMAs, per step (COPUS §3.2)
            "decay": 0.95,
            "decay_late": 0.99,
            "decay_switch_tokens": 8_000_000,
            "confidence": 0.0,  # point estimate, as soon as there is one:
            "max_rel_err": 1e9,  # the paper has no accuracy gate (issue 26)
            "recovery_steps": 0,
        },  # no hold after a batch change
        "controller": {
            "lr_aware": True,  # goodput × sqrt(B) (COPUS Eqs. 7-8)
            "margin": 0.10,
        },  # 10 % switching margin (§6.1), batch and layout
        "train": {"lr_rule": "sqrt"},  # LR ∝ sqrt(B) (COPUS Eq. 9)
        "batch": {"max_growth": 2.0},  # ≤ 2× per decision (§6.1)
    },
    "norm-test-lau": {
        "batch": {
            "interval_steps": 1,  # the test at every step (Lau et al. App. C) ...
            "warmup_steps": 0,  # ... from the first step, on that step alone
            "max_growth": float("inf"),  # no growth cap: b_{k+1} = ⌈T_k⌉ (Algorithm 1)
            "norm_test_form": "per-sample",
            "norm_test_eta": 0.2,
        },
        "train": {"lr_rule": "none"},  # "optimizer scaling rule: None" (App. C)
    },
}


def apply_policy_preset(data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` ({section: {key: value}}) with the preset of its `batch.policy` filled in under
    the user's own keys; unchanged (a shallow copy) for a policy without a preset."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
    batch = out.get("batch")
    name = batch.get("policy") if isinstance(batch, Mapping) else None
    preset = POLICY_PRESETS.get(name) if isinstance(name, str) else None
    for section, values in (preset or {}).items():
        current = out.setdefault(section, {})
        if isinstance(current, Mapping):
            out[section] = {**values, **current}
    batch = out.get("batch")
    form = batch.get("norm_test_form") if isinstance(batch, Mapping) else None
    gns = out.get("gns", {})
    if (
        form == "paper"
        and isinstance(name, str)
        and name.startswith("norm-test")
        and isinstance(gns, Mapping)
        and "small" not in gns
    ):
        out["gns"] = {**gns, "small": "rank"}  # eq. 5 is over per-worker gradients
    return out
