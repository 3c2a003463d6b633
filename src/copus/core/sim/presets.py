"""The four configurations COPUS evaluated (arXiv 2604.26687, §6.1 and Table 1), as presets.

Settings shared by all four (COPUS §6.1; /work/shared/papers/copus-notes.md §3.1): WikiText-103,
sequence length 2048, start at B = 16, AdamW (0.9, 0.95), LR ∝ sqrt(B), 10% switching margin,
≤ 2× batch growth per decision, GNS calibration c = 2, GNS EMA 0.95 for the first 8M tokens
then 0.99. `published_*` fields are copied from Table 1 (minutes to each target loss; None =
not reached) so that `copus simulate --preset all` can print them next to the simulation.

Ground truths (`truths`, core.trajectory): `initial_loss` = ln(vocab_size), `final_loss` = 1.0
(fixed), α_B = 0.21 (Kaplan et al. 2020); `progress_scale_samples`, `loss_exponent` and
`bcrit_star_tokens` are a least-squares fit (log time) of the *static* rows of Table 1, each
static batch run on its fastest memory-feasible plan under the analytic step-time model
(`copus.core.cost.throughput`, Megatron cost model of core/cost/megatron_cost.py). The LR model (lr-tuned
or sqrt-lr with its x0) and B_crit/b_noise are then chosen on the static + CBS rows
(`core.truth_fit`). COPUS rows are not used, so the simulated speed-ups are a prediction, not a
fit. Refit with `python bench/simulate_scale.py --calibrate [--grid fine]` when the step-time
model changes. Static-row RMS log-time error of the lr-tuned truth: 3B 0.088, 13B 0.054, 32B
0.005 (one static row: under-determined), 7B 0.093.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from copus.core.sim.trajectory import LR_TUNED, SQRT_LR, TrajectoryParams

FITTED = "fitted"  # a preset's best-fitting truth (Preset.trajectory)


@dataclass(frozen=True, slots=True, kw_only=True)
class Preset:
    """One COPUS evaluation setting and its published results."""

    name: str
    description: str
    model: str
    hardware: str
    world_size: int
    token_budget: int
    target_losses: tuple[float, ...]
    trajectory: TrajectoryParams  # the default ground truth (the best-fitting one)
    initial_batch: int = 16
    max_batch: int = 1024
    # The simulation may run past the published budget: its throughput differs from the paper's,
    # and a target must not be missed only because the budget ran out first.
    sim_budget_factor: float = 3.0
    static_batches: tuple[int, ...] = (16, 32, 64, 128, 1024)
    batch_grid: str = "multiples"  # core.plan.goodput grid; "geometric" for huge clusters
    # (dp, tp, pp) of the two CBS baselines: tuned for B=16 ("pessimistic") and for the large
    # batches that dominate training ("optimistic"), COPUS Table 1 row labels.
    cbs_layouts: tuple[tuple[int, int, int], tuple[int, int, int]] = ((1, 1, 1), (1, 1, 1))
    # COPUS's own parallelism trajectory (Table 2 / §6.3), for comparison with the simulation.
    published_layouts: tuple[tuple[int, int, int], ...] = ()
    published_minutes: dict[str, tuple[float | None, ...]] = field(default_factory=dict)
    published_speedup_pct: tuple[float, ...] = ()
    published_avg_speedup_pct: float = 0.0
    published_reconfig_s: tuple[float, ...] = ()
    published_switch_min: tuple[float, ...] = ()  # Table 2 "triggered at" of each switch
    # Named ground truths (core.trajectory LR_MODELS), each fitted to the baseline rows;
    # `trajectory` is the one of them that fits the static + CBS rows best.
    truths: dict[str, TrajectoryParams] = field(default_factory=dict)

    def truth(self, name: str | None = None) -> TrajectoryParams:
        """The ground truth `name` (None or "fitted": the default, `trajectory`)."""
        if name in (None, FITTED):
            return self.trajectory
        if name not in self.truths:
            allowed = ", ".join([FITTED, *self.truths])
            raise ValueError(f"truth {name!r} is invalid for preset {self.name}; allowed: {allowed}")
        return self.truths[name]

    def default_truth_name(self) -> str:
        """The name under which `trajectory` is also in `truths` ("fitted" if it is not)."""
        return next((n for n, t in self.truths.items() if t == self.trajectory), FITTED)


# Ground-truth B_crit / b_noise (the simple noise scale the estimator measures) of the LR_TUNED
# truth. The static rows cannot identify it (they never read the GNS); of 1, 2, 4, 8, 16 it is the
# value whose CBS rows (fixed layout, GNS-driven batch) land closest to Table 1's (RMS log-time
# error 0.12 / 0.11 / 0.13 / 0.09 for 3B / 13B / 32B / 7B at 4, against 0.15 / 0.12 / 0.15 / 0.08
# at COPUS's c = 2; docs/cost-model.md). COPUS rows are not used: its speed-ups stay a prediction.
GNS_TO_BCRIT = 4.0
LR_WARMUP_TOKENS = 8_000_000  # COPUS §6.1: linear warm-up over the first 8M tokens


def _traj(vocab: int, **kw) -> TrajectoryParams:
    return TrajectoryParams(initial_loss=math.log(vocab), final_loss=1.0, **kw)


def _truths(vocab: int, *, tuned: dict, sqrt_lr: dict) -> dict[str, TrajectoryParams]:
    """The two named truths of a preset (core.trajectory LR_MODELS), each fitted to Table 1's
    static rows (loss curve) and CBS rows (LR model), never to its COPUS rows.

    LR_TUNED: E(B), LR re-tuned for every B, B_crit = 4·b_noise (the truth before 2026-12-01).
    SQRT_LR:  η0·sqrt(B/16) from one base LR (Adam form p = ½, 8M-token warm-up), x0 and
              B_crit/b_noise from the grid of `bench/simulate_scale.py --calibrate --grid fine`
              (bench/results/truth_fit_{full,fine}.json; docs/cost-model.md).
    """
    return {
        LR_TUNED: _traj(vocab, gns_calibration=GNS_TO_BCRIT, **tuned),
        SQRT_LR: _traj(vocab, lr_model=SQRT_LR, lr_opt_exponent=0.5, lr_warmup_tokens=LR_WARMUP_TOKENS, **sqrt_lr),
    }


# RMS log-time error over the static + CBS rows (docs/cost-model.md): lr-tuned 0.093 / 0.070 /
# 0.108 / 0.092, sqrt-lr 0.070 / 0.102 / 0.158 / 0.066 for 3B / 13B / 32B / 7B, fitted under the
# plain-FLOP step-time model. The roofline model (core/cost/compute.py) moved the MI210 prices by
# 2x, so 7B is refitted under it (`bench/simulate_scale.py --calibrate --grid full`,
# bench/results/truth_fit_full.json: lr-tuned 0.121, sqrt-lr 0.123 (static rows 0.060)); the
# H100 presets' static rows stay within 0.08 and keep their fits. Each preset's
# default (`Preset.trajectory`, `copus simulate --truth fitted`) is the better of the two.
_T3B = _truths(
    128256,
    tuned=dict(progress_scale_samples=70.08, loss_exponent=0.2406, bcrit_star_tokens=4.039e8),
    sqrt_lr=dict(
        lr_fraction_x0=0.85,
        gns_calibration=2.0,
        progress_scale_samples=100.68,
        loss_exponent=0.25174,
        bcrit_star_tokens=9.889e8,
    ),
)
_T13B = _truths(
    32000,
    tuned=dict(progress_scale_samples=30.77, loss_exponent=0.2363, bcrit_star_tokens=7.471e7),
    sqrt_lr=dict(
        lr_fraction_x0=0.55,
        gns_calibration=2.0,
        progress_scale_samples=15.699,
        loss_exponent=0.22446,
        bcrit_star_tokens=4.7803e7,
    ),
)
_T32B = _truths(
    152064,
    tuned=dict(progress_scale_samples=83.29, loss_exponent=0.2556, bcrit_star_tokens=2.508e8),
    sqrt_lr=dict(
        lr_fraction_x0=0.3,
        gns_calibration=4.0,
        progress_scale_samples=5.161,
        loss_exponent=0.22824,
        bcrit_star_tokens=1.3893e7,
    ),
)
_T7B = _truths(
    32000,  # refitted under the roofline step-time model (core/cost/compute.py)
    tuned=dict(progress_scale_samples=4.754, loss_exponent=0.1815, bcrit_star_tokens=2.529e7),
    sqrt_lr=dict(
        lr_fraction_x0=0.6,
        gns_calibration=2.0,
        progress_scale_samples=2.598,
        loss_exponent=0.1726,
        bcrit_star_tokens=2.081e7,
    ),
)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="3b-8xh100",
            description="LLaMA-3.2-3B on 1x8 H100 (NVLink pairs)",
            model="llama-3.2-3b",
            hardware="h100-nvlink-pairs",
            world_size=8,
            token_budget=328_000_000,
            target_losses=(4.0, 3.5, 3.2, 3.0, 2.75),
            trajectory=_T3B[SQRT_LR],
            truths=_T3B,
            static_batches=(16, 32, 64, 128, 1024),
            cbs_layouts=((2, 1, 4), (8, 1, 1)),
            published_layouts=((2, 1, 4), (4, 1, 2), (8, 1, 1)),
            published_minutes={
                "COPUS": (10.6, 18.7, 28.7, 37.5, 54.9),
                "CBS (DP2,TP1,PP4)": (11.5, 22.8, 37.9, 55.1, 83.7),
                "CBS (DP8,TP1,PP1)": (13.6, 21.6, 31.4, 41.4, 59.0),
                "Static GBS=16": (12.4, 26.9, 46.2, 69.4, 102.7),
                "Static GBS=32": (11.1, 20.8, 32.6, 47.0, 73.1),
                "Static GBS=64": (13.1, 21.7, 33.3, 45.0, 67.3),
                "Static GBS=128": (20.8, 30.7, 42.5, 55.7, None),
                "Static GBS=1024": (None, None, None, None, None),
            },
            published_speedup_pct=(4.3, 10.1, 8.6, 9.4, 7.0),
            published_avg_speedup_pct=7.9,
            published_reconfig_s=(30.0, 56.0),
            published_switch_min=(3.0, 22.0),
        ),
        Preset(
            name="13b-16xh100",
            description="LLaMA-2-13B on 2x8 H100",
            model="llama-2-13b",
            hardware="h100-nvlink-pairs",
            world_size=16,
            token_budget=328_000_000,
            target_losses=(4.0, 3.5, 3.0, 2.75, 2.5),
            trajectory=_T13B[LR_TUNED],
            truths=_T13B,
            static_batches=(32, 64, 128, 1024),
            cbs_layouts=((1, 2, 8), (4, 1, 4)),
            published_layouts=((1, 2, 8), (4, 1, 4)),
            published_minutes={
                "COPUS": (10.4, 18.4, 38.0, 55.8, 81.4),
                "CBS (DP1,TP2,PP8)": (10.7, 19.4, 39.5, 59.9, 88.9),
                "CBS (DP4,TP1,PP4)": (14.2, 23.8, 43.5, 62.3, 89.0),
                "Static GBS=32": (11.7, 19.3, 38.3, 58.8, 91.0),
                "Static GBS=64": (18.9, 26.6, 43.2, 60.5, 86.7),
                "Static GBS=128": (32.2, 42.8, 61.9, 79.6, 105.2),
                "Static GBS=1024": (None, None, None, None, None),
            },
            published_speedup_pct=(3.4, 4.4, 0.7, 5.1, 6.1),
            published_avg_speedup_pct=3.9,
            published_reconfig_s=(42.0,),
            published_switch_min=(20.0,),
        ),
        Preset(
            name="32b-32xh100",
            description="Qwen-2.5-32B on 4x8 H100",
            model="qwen-2.5-32b",
            hardware="h100-nvlink-pairs",
            world_size=32,
            token_budget=123_000_000,
            target_losses=(4.5, 4.0, 3.8, 3.5, 3.2),
            trajectory=_T32B[LR_TUNED],
            truths=_T32B,
            static_batches=(64, 128, 512),
            cbs_layouts=((1, 2, 16), (2, 2, 8)),
            published_layouts=((1, 2, 16), (2, 2, 8)),
            published_minutes={
                "COPUS": (20.5, 33.0, 38.7, 55.8, 76.5),
                "CBS (DP1,TP2,PP16)": (21.3, 35.4, 43.5, 60.5, 85.7),
                "CBS (DP2,TP2,PP8)": (24.8, 38.4, 46.8, 62.9, 87.4),
                "Static GBS=64": (39.2, 51.5, 59.1, 74.2, None),
                "Static GBS=128": (61.2, None, None, None, None),
                "Static GBS=512": (None, None, None, None, None),
            },
            published_speedup_pct=(3.7, 6.8, 11.1, 7.8, 10.7),
            published_avg_speedup_pct=8.0,
            published_reconfig_s=(52.0,),
            published_switch_min=(37.0,),
        ),
        Preset(
            name="7b-32xmi210",
            description="LLaMA-2-7B on 4x8 MI210",
            model="llama-2-7b",
            hardware="mi210",
            world_size=32,
            token_budget=215_000_000,
            target_losses=(4.0, 3.5, 3.2, 3.0, 2.8),
            trajectory=_T7B[SQRT_LR],
            truths=_T7B,
            static_batches=(32, 64, 128, 1024),
            cbs_layouts=((2, 4, 4), (8, 1, 4)),
            published_layouts=((2, 4, 4), (4, 1, 8)),
            published_minutes={
                "COPUS": (11.1, 20.7, 31.4, 42.1, 63.7),
                "CBS (DP2,TP4,PP4)": (11.1, 21.1, 32.5, 46.2, 71.6),
                "CBS (DP8,TP1,PP4)": (17.6, 31.9, 44.9, 57.1, 80.8),
                "Static GBS=32": (13.8, 24.1, 36.7, 51.9, 77.2),
                "Static GBS=64": (19.2, 30.1, 42.4, 57.9, None),
                "Static GBS=128": (34.9, 65.6, None, None, None),
                "Static GBS=1024": (None, None, None, None, None),
            },
            published_speedup_pct=(-0.5, 1.9, 3.5, 8.9, 11.0),
            published_avg_speedup_pct=5.0,
            published_reconfig_s=(49.0,),
            published_switch_min=(15.0,),
        ),
    )
}


# ------------------------------------------------------------------ a long pre-training truth

# OLMo-1B-like (Merrill et al. 2025, "Critical Batch Size Revisited", §3.3 Fig. 2 and §4 Table 1;
# /work/shared/papers/cbs-notes.md §1), in sequences of 2048 tokens: the critical batch starts
# near zero, grows fast then slowly, and passes 4096 sequences (2048 of their 4096-token documents)
# near 168B tokens and 8192 near 503B. Loss L(E) = 1 + (ln 32000 − 1)(1 + E/E0)^(−α) through
# L = 2.8 at 168B tokens and 2.59 at 608B (their final pre-training loss), with E taken as the
# samples seen (E0 = 3 samples, α = 0.0963); B_crit = B*/L^(1/α_B) through 4096 sequences at
# L = 2.8 and 8192 at 2.62 (α_B = 0.096, B* = 3.8e11 tokens): B_crit ≈ 1 sequence at L = 6, ≈ 100
# at 4.0, ≈ 1000 at 3.2. Kaplan's α_B = 0.21 would need a far larger loss drop than OLMo's for one
# doubling. B_crit / b_noise = GNS_TO_BCRIT (Merrill: the noise scale under-reads the critical
# batch; the grid moves the ratio). LR re-tuned per batch (their √2 rule per doubling).
_TOLMO = {
    LR_TUNED: _traj(
        32000,
        progress_scale_samples=3.0,
        loss_exponent=0.0963,
        bcrit_star_tokens=3.8e11,
        bcrit_exponent=0.096,
        gns_calibration=GNS_TO_BCRIT,
    )
}
_TOLMO[SQRT_LR] = _TOLMO[LR_TUNED].with_(
    lr_model=SQRT_LR, lr_opt_exponent=0.5, lr_fraction_x0=0.7, lr_ref_batch=256.0, lr_warmup_tokens=2e9
)

OLMO_LONG = Preset(
    name="olmo-long",
    description="OLMo-1B-like long pre-training on 32x8 H100 (TinyLlama 1.1B "
    "shape; Merrill et al. 2025's critical-batch growth)",
    model="tinyllama-1.1b",
    hardware="h100-sxm",
    world_size=256,
    token_budget=200_000_000_000,
    target_losses=(4.0, 3.5, 3.2, 3.0, 2.8),
    trajectory=_TOLMO[LR_TUNED],
    truths=_TOLMO,
    initial_batch=256,
    max_batch=16384,
    sim_budget_factor=2.0,
    static_batches=(256, 1024, 4096, 16384),
    batch_grid="geometric",
    cbs_layouts=(),
)
# not in PRESETS (COPUS's four, with published rows): `get_preset` finds it
LONG_PRESETS: dict[str, Preset] = {OLMO_LONG.name: OLMO_LONG}
COPUS_PRESETS = tuple(PRESETS)


def get_preset(name: str) -> Preset:
    """Look up a preset; ValueError names the bad value and the allowed ones."""
    try:
        return PRESETS[name] if name in PRESETS else LONG_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; allowed: {', '.join([*PRESETS, *LONG_PRESETS])}, all") from None
