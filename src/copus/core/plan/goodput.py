"""Vectorised goodput over every candidate plan (COPUS §3, Eqs. 1, 5–8; design §3–§4).

A `CandidateSet` holds every valid `(dp, tp, pp, micro_batch_size, num_microbatches)` for one
world size, model shape and global-batch range as parallel numpy arrays, so that a step-time
model, the memory model and the goodput formula score thousands of plans in one pass.

Batch grids (`batch_grid`):
- "multiples" (default): for each layout and micro-batch size, every global batch
  `B = dp · micro_batch_size · n` (n = 1, 2, ...) with `min_batch ≤ B ≤ max_batch`. Every
  reachable batch of every layout is a candidate; the count grows linearly with `max_batch`.
- "geometric": a geometric grid `min_batch · r^k` (r = 2^(1/steps_per_octave)), each value
  rounded up to a multiple of `dp · micro_batch_size` and kept if ≤ `max_batch`. Use it for
  very large batch ranges (thousands of GPUs).
Validity follows `core.plan.plan_problems`: dp·tp·pp = world, tp divides heads/KV heads/ffn/dim,
pp ≤ layers (via `layouts`), and num_microbatches ≥ pp when pp > 1.

Plan options (issue 25): `build_candidates(..., options=[{...}, ...])` crosses every plan with
each option set (AC mode, pipeline schedule + virtual stages, sequence parallel, reshard after
forward; `option_grid` builds the list) and keeps the valid ones (`plan_problems`); the set
then carries them as code columns (a schedule other than 1f1b only with pp ≥ 2: without a
pipeline the schedule is moot, and one spelling avoids duplicate candidates) and hands them to
the step-time and memory models as keywords, so every (layout, micro-batch, options) is
ranked in one vectorised pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from copus.core.stats.efficiency import lr_aware_factor, statistical_efficiency
from copus.core.specs.models import ModelShape
from copus.core.plan.plan import AC_MODES, PIPELINE_SCHEDULES, ParallelPlan, layouts

BATCH_GRIDS = ("multiples", "geometric")
_FIELDS = ("dp", "tp", "pp", "micro_batch_size", "num_microbatches")
_OPTIONS = (
    "activation_checkpointing",
    "pipeline_schedule",
    "virtual_stages",
    "sequence_parallel",
    "reshard_after_forward",
)
_DEFAULTS = {
    "activation_checkpointing": "none",
    "pipeline_schedule": "1f1b",
    "virtual_stages": 1,
    "sequence_parallel": False,
    "reshard_after_forward": True,
}


class StepTimePredictor(Protocol):
    """Anything with `predict(dp, tp, pp, micro_batch_size, num_microbatches) -> seconds/step`."""

    def predict(self, dp, tp, pp, micro_batch_size, num_microbatches) -> np.ndarray: ...


class MemoryPredictor(Protocol):
    def bytes_per_rank(self, dp, tp, pp, micro_batch_size, num_microbatches) -> np.ndarray: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class CandidateSet:
    """Every candidate plan as parallel int64 arrays (one entry per plan).

    `memory_bytes` is the memory model's per-rank prediction (NaN when no model was given).
    `options`: None (every plan with the default options), or one array per `_OPTIONS` name:
    AC-mode and schedule codes (indices into AC_MODES, PIPELINE_SCHEDULES), virtual stages and
    two boolean columns.
    """

    dp: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    micro_batch_size: np.ndarray
    num_microbatches: np.ndarray
    global_batch_size: np.ndarray
    memory_bytes: np.ndarray
    options: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.dp.shape[0])

    def plan(self, i: int) -> ParallelPlan:
        """The i-th candidate as a `ParallelPlan`."""
        return ParallelPlan(**{f: int(getattr(self, f)[i]) for f in _FIELDS}, **self.plan_options(i))

    def plan_options(self, i: int) -> dict:
        """The options of the i-th candidate as `ParallelPlan` keywords ({} without options)."""
        if self.options is None:
            return {}
        o = self.options
        return {
            "activation_checkpointing": AC_MODES[int(o["activation_checkpointing"][i])],
            "pipeline_schedule": PIPELINE_SCHEDULES[int(o["pipeline_schedule"][i])],
            "virtual_stages": int(o["virtual_stages"][i]),
            "sequence_parallel": bool(o["sequence_parallel"][i]),
            "reshard_after_forward": bool(o["reshard_after_forward"][i]),
        }

    def option_kwargs(self, indices: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The option columns as model keywords (of `indices` only); {} without options."""
        if self.options is None:
            return {}
        return {k: (v if indices is None else v[indices]) for k, v in self.options.items()}

    def plans(self, indices: Iterable[int]) -> list[ParallelPlan]:
        return [self.plan(int(i)) for i in indices]

    def index_of(self, plan: ParallelPlan) -> int | None:
        """Index of `plan` in the set, or None if it is not a candidate."""
        mask = np.ones(len(self), dtype=bool)
        for f in _FIELDS:
            mask &= getattr(self, f) == getattr(plan, f)
        codes = option_columns([plan.options])
        if self.options is not None:
            for k, v in self.options.items():
                mask &= v == codes[k][0]
        elif plan.options != _DEFAULTS:
            return None
        hits = np.flatnonzero(mask)
        return int(hits[0]) if hits.size else None

    def same_layout(self, plan: ParallelPlan) -> np.ndarray:
        """Boolean mask of the candidates with `plan`'s (dp, tp, pp)."""
        return (self.dp == plan.dp) & (self.tp == plan.tp) & (self.pp == plan.pp)

    def subset(self, mask: np.ndarray) -> CandidateSet:
        opts = None if self.options is None else {k: v[mask] for k, v in self.options.items()}
        return CandidateSet(
            **{f: getattr(self, f)[mask] for f in (*_FIELDS, "global_batch_size", "memory_bytes")}, options=opts
        )

    def predict_step_s(self, model: StepTimePredictor, indices: np.ndarray | None = None) -> np.ndarray:
        """Predicted seconds per optimizer step of every candidate, or of `indices` only."""
        cols = [getattr(self, f) for f in _FIELDS]
        if indices is not None:
            cols = [c[indices] for c in cols]
        out = np.asarray(model.predict(*cols, **self.option_kwargs(indices)), dtype=float)
        return np.broadcast_to(out, cols[0].shape).astype(float, copy=False)


def option_columns(option_sets: Sequence[dict]) -> dict[str, np.ndarray]:
    """Option dicts (`ParallelPlan.options` keys, missing = default) as code / bool columns."""
    full = [{**_DEFAULTS, **o} for o in option_sets]
    unknown = {k for o in option_sets for k in o} - set(_OPTIONS)
    if unknown:
        raise ValueError(f"unknown plan options {sorted(unknown)}; allowed: {', '.join(_OPTIONS)}")
    for o in full:  # validates the names
        ParallelPlan(dp=1, tp=1, pp=1, micro_batch_size=1, num_microbatches=1, **o)
    return {
        "activation_checkpointing": np.array([AC_MODES.index(o["activation_checkpointing"]) for o in full]),
        "pipeline_schedule": np.array([PIPELINE_SCHEDULES.index(o["pipeline_schedule"]) for o in full]),
        "virtual_stages": np.array([int(o["virtual_stages"]) for o in full], dtype=np.int64),
        "sequence_parallel": np.array([bool(o["sequence_parallel"]) for o in full]),
        "reshard_after_forward": np.array([bool(o["reshard_after_forward"]) for o in full]),
    }


def option_grid(
    ac_modes: Sequence[str] = AC_MODES,
    schedules: Sequence[str] = ("1f1b",),
    virtual_stages: Sequence[int] = (2,),
    sequence_parallel: Sequence[bool] = (False,),
    reshard_after_forward: Sequence[bool] = (True,),
) -> list[dict]:
    """Every combination of the given choices (interleaved-1f1b once per v, the others with v = 1)."""
    out = []
    for ac in ac_modes:
        for sched in schedules:
            for v in virtual_stages if sched == "interleaved-1f1b" else (1,):
                for sp in sequence_parallel:
                    for raf in reshard_after_forward:
                        out.append(
                            {
                                "activation_checkpointing": ac,
                                "pipeline_schedule": sched,
                                "virtual_stages": int(v),
                                "sequence_parallel": bool(sp),
                                "reshard_after_forward": bool(raf),
                            }
                        )
    return out


def _option_valid(cols: dict[str, np.ndarray], option: dict[str, np.ndarray], shape: ModelShape | None) -> np.ndarray:
    """`plan_problems`' option rules, vectorised over plans for one option set (code scalars)."""
    tp, pp, m = cols["tp"], cols["pp"], cols["num_microbatches"]
    ok = np.ones(tp.shape, dtype=bool)
    if int(option["pipeline_schedule"]) != 0:  # without a pipeline the schedule is moot: 1f1b only
        ok &= pp >= 2
    if int(option["pipeline_schedule"]) == 2:
        v = int(option["virtual_stages"])
        ok &= (pp >= 2) & (m % np.maximum(pp, 1) == 0)
        if shape is not None:
            ok &= pp * v <= shape.n_layers
    if bool(option["sequence_parallel"]):
        ok &= tp >= 2
    return ok


def batch_values(
    min_batch: int, max_batch: int, step: int, *, batch_grid: str = "multiples", steps_per_octave: int = 4
) -> np.ndarray:
    """Global batches reachable with `step = dp·micro_batch_size` samples per micro-step."""
    lo = -(-min_batch // step) * step
    if batch_grid == "multiples":
        return np.arange(lo, max_batch + 1, step, dtype=np.int64)
    if batch_grid == "geometric":
        octaves = np.log2(max(max_batch, 1) / max(min_batch, 1))
        k = np.arange(int(np.floor(octaves * steps_per_octave)) + 2)
        raw = np.ceil(min_batch * 2.0 ** (k / steps_per_octave) - 1e-9).astype(np.int64)
        vals = np.unique(-(-raw // step) * step)
        return vals[(vals >= min_batch) & (vals <= max_batch)]
    raise ValueError(f"batch_grid={batch_grid!r} is invalid; allowed: {', '.join(BATCH_GRIDS)}")


def _check_range(world_size: int, min_batch: int, max_batch: int, micro_batch_sizes: Sequence[int]) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} is invalid; allowed: an integer >= 1")
    if min_batch < 1 or max_batch < min_batch:
        raise ValueError(f"batch range [{min_batch}, {max_batch}] is invalid; allowed: 1 <= min_batch <= max_batch")
    if not micro_batch_sizes or any(int(m) != m or m < 1 for m in micro_batch_sizes):
        raise ValueError(
            f"micro_batch_sizes={list(micro_batch_sizes)!r} is invalid; allowed: a non-empty list of integers >= 1"
        )


def build_candidates(
    world_size: int,
    shape: ModelShape | None,
    *,
    min_batch: int,
    max_batch: int,
    micro_batch_sizes: Sequence[int] = (1, 2, 4, 8),
    batch_grid: str = "multiples",
    steps_per_octave: int = 4,
    memory_model: MemoryPredictor | None = None,
    memory_capacity_bytes: float | None = None,
    options: Sequence[dict] | None = None,
) -> CandidateSet:
    """Every valid plan for `world_size` ranks with global batch in [min_batch, max_batch].

    Plans whose predicted per-rank memory exceeds `memory_capacity_bytes` are pruned (needs
    `memory_model`); COPUS §4.4 prunes OOM configurations the same way, by measurement.
    With `options` (dicts of `ParallelPlan` option keywords, e.g. from `option_grid`) every
    plan is crossed with every option set that is valid for it.
    """
    _check_range(world_size, min_batch, max_batch, micro_batch_sizes)
    cols: dict[str, list[np.ndarray]] = {f: [] for f in _FIELDS}
    for dp, tp, pp in layouts(world_size, shape):
        for mbs in sorted({int(m) for m in micro_batch_sizes}):
            gbs = batch_values(min_batch, max_batch, dp * mbs, batch_grid=batch_grid, steps_per_octave=steps_per_octave)
            nmb = gbs // (dp * mbs)
            nmb = nmb[nmb >= pp] if pp > 1 else nmb
            for f, v in (("dp", dp), ("tp", tp), ("pp", pp), ("micro_batch_size", mbs)):
                cols[f].append(np.full(nmb.shape, v, dtype=np.int64))
            cols["num_microbatches"].append(nmb.astype(np.int64))
    arrays = {f: (np.concatenate(v) if v else np.zeros(0, np.int64)) for f, v in cols.items()}
    opts = None
    if options is not None:
        arrays, opts = _cross_options(arrays, option_columns(options), shape)
    gbs = arrays["dp"] * arrays["micro_batch_size"] * arrays["num_microbatches"]
    mem = np.full(gbs.shape, np.nan)
    if memory_model is not None and gbs.size:
        mem = np.broadcast_to(
            np.asarray(memory_model.bytes_per_rank(*(arrays[f] for f in _FIELDS), **(opts or {})), dtype=float),
            gbs.shape,
        ).copy()
    cands = CandidateSet(**arrays, global_batch_size=gbs, memory_bytes=mem, options=opts)
    if memory_capacity_bytes is not None:
        if memory_model is None:
            raise ValueError("memory_capacity_bytes needs a memory_model to prune with")
        cands = cands.subset(mem <= memory_capacity_bytes)
    return cands


def noise_measuring(candidates: CandidateSet) -> CandidateSet:
    """The candidates an adaptive controller may run: those whose step measures the noise scale.

    The estimator needs J ≥ 2 small gradients per step, J = dp·num_microbatches (one per
    micro-batch per dp rank; "rank" mode has J = dp and falls back to micro-batches at dp = 1),
    because B_simple = tr(Σ)/|G|² is solved from two batch sizes (McCandlish et al. 2018, App. A;
    design §3). A plan with dp = 1 and one micro-batch computes only the big gradient, so while
    it runs b_noise is frozen and every later decision rests on a stale reading. Such a plan is
    dropped wherever its layout hosts a measuring plan at the same global batch (e.g. tp2 mb8x2
    for tp2 mb16x1); it stays only where nothing at that batch measures.
    """
    c = candidates
    measuring = c.dp * c.num_microbatches >= 2
    if measuring.all():
        return c
    keys = np.stack([c.dp, c.tp, c.pp, c.global_batch_size], axis=1)
    twin = {tuple(k) for k in keys[measuring].tolist()}
    covered = np.array([tuple(k) in twin for k in keys.tolist()], dtype=bool)
    return c.subset(measuring | ~covered)


def _cross_options(
    arrays: dict[str, np.ndarray], table: dict[str, np.ndarray], shape: ModelShape | None
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Every plan × every option set (rows of `table`) that `_option_valid` admits."""
    out: dict[str, list[np.ndarray]] = {f: [] for f in (*_FIELDS, *_OPTIONS)}
    for j in range(len(table["activation_checkpointing"])):
        option = {k: v[j] for k, v in table.items()}
        ok = _option_valid(arrays, option, shape)
        for f in _FIELDS:
            out[f].append(arrays[f][ok])
        for k in _OPTIONS:
            out[k].append(np.full(int(ok.sum()), option[k], dtype=table[k].dtype))
    cat = {k: (np.concatenate(v) if v else np.zeros(0, np.int64)) for k, v in out.items()}
    return {f: cat[f] for f in _FIELDS}, {k: cat[k] for k in _OPTIONS}


def goodput(
    step_s: np.ndarray,
    global_batch_size: np.ndarray,
    b_noise: float,
    *,
    lr_aware: bool = True,
    ref_batch: float = 1.0,
    lr_ref_batch: float | None = None,
) -> np.ndarray:
    """Goodput = samples_per_s × E(B) [× sqrt(B / B_lr_ref) when LR-aware].

    E(B) = (b_noise + B0) / (b_noise + B) with B0 = `ref_batch` (COPUS Eq. 6 takes B0 = 1);
    the LR-aware factor is COPUS Eqs. 7–8 (Adam square-root rule), relative to `lr_ref_batch`
    (default `ref_batch`; the constant cancels in every comparison). `b_noise = inf` means
    "no statistical penalty" (E = 1): goodput is then throughput (× the LR factor).
    Non-finite or non-positive step times give goodput 0.
    """
    step = np.asarray(step_s, dtype=float)
    batch = np.asarray(global_batch_size, dtype=float)
    ok = np.isfinite(step) & (step > 0)
    samples_per_s = np.where(ok, batch / np.where(ok, step, 1.0), 0.0)
    out = samples_per_s * efficiency(b_noise, batch, ref_batch)
    if lr_aware:
        out = out * lr_aware_factor(batch, ref_batch if lr_ref_batch is None else lr_ref_batch)
    return out


def efficiency(b_noise: float, global_batch_size: np.ndarray, ref_batch: float = 1.0) -> np.ndarray:
    """E(B) as an array (`core.efficiency.statistical_efficiency`; `b_noise = inf` gives 1)."""
    batch = np.asarray(global_batch_size, dtype=float)
    return np.broadcast_to(statistical_efficiency(b_noise, batch, ref_batch), batch.shape)


def rank(scores: np.ndarray, step_s: np.ndarray | None = None, top: int | None = None) -> np.ndarray:
    """Indices sorted by goodput, best first (NaN last); ties broken by shorter step, then index.

    With `top`, only the best `top` indices (an O(n) partition, then a sort of those).
    """
    scores = -np.nan_to_num(np.asarray(scores, dtype=float), nan=-np.inf)
    idx = np.arange(scores.size)
    if top is not None and top < scores.size:
        kth = np.partition(scores, top - 1)[top - 1]
        idx = np.flatnonzero(scores <= kth)  # the top ones and anything tied with the last
        scores = scores[idx]
    order = np.argsort(scores, kind="stable")
    if step_s is not None:
        ordered = scores[order]
        tied = ordered[1:] == ordered[:-1]
        if tied.any():  # ties: re-sort only the tied runs by (score, step), stable (index order)
            pos = np.flatnonzero(np.r_[tied, False] | np.r_[False, tied])
            sub = order[pos]
            steps = np.nan_to_num(np.asarray(step_s, float)[idx][sub], nan=np.inf)
            key = np.empty(pos.size, dtype=complex)  # numpy sorts complex by (real, imag)
            key.real, key.imag = ordered[pos], steps
            order[pos] = sub[np.argsort(key, kind="stable")]
    return idx[order][:top]
