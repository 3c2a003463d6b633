"""Named policy variants: `batch.policy = "goodput-copus"` is the goodput controller with the
COPUS paper's settings (arXiv 2604.26687 §3, §6.1; copus-notes.md), kept to compare against.

A preset only supplies defaults: a key the user sets explicitly (file or `--set`) wins, and
the run folder's config.toml records every resolved value. `goodput-copus` is the paper's
algorithm alone (issue 26): none of copus's additions — no accuracy gate on the noise scale, no
layout probes, no audits, no confidence bounds, no hold. `goodput` itself uses the plain
defaults of `copus.config`, which differ from the paper where measurement or the sources say
so (docs/statistics.md, docs/robust-goodput.md): c learnt in the run (`gns.calibration =
"auto"`, a posterior over c) instead of c = 2, no
LR-aware sqrt(B) factor (§4: it counts the LR benefit twice, and mispredicts the ratios), the
tracking GNS estimator with a sample-tied decay instead of one per-step EMA 0.95 → 0.99,
decisions on the lower confidence bound of the noise scale, a recovery hold after each
batch change, and switches only when the gain clears the margin plus the step times' measured
uncertainty (`core.step_uncertainty`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

POLICY_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "goodput-copus": {
        "gns": {"calibration": 2.0,            # c = 2 on tr(Σ) (COPUS §1.2)
                "estimator": "ema",            # separate EMAs, per step (COPUS §3.2)
                "decay": 0.95, "decay_late": 0.99, "decay_switch_tokens": 8_000_000,
                "confidence": 0.0,             # point estimate, as soon as there is one:
                "max_rel_err": 1e9,            # the paper has no accuracy gate (issue 26)
                "recovery_steps": 0},          # no hold after a batch change
        "controller": {"lr_aware": True,       # goodput × sqrt(B) (COPUS Eqs. 7-8)
                       "margin": 0.10,         # 10 % switching margin (§6.1) ...
                       "batch_margin": 0.10,   # ... for batch changes too
                       "step_confidence": 0.0,  # ... and nothing for the step times' noise
                       "explore_max_probes": 0,  # no layout probes (copus's, issue 15)
                       "audit_steps": 0},        # no audits of decisions (copus's, issue 15)
        "train": {"lr_rule": "sqrt"},          # LR ∝ sqrt(B) (COPUS Eq. 9)
        "batch": {"max_growth": 2.0},          # ≤ 2× per decision (§6.1)
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
    return out
