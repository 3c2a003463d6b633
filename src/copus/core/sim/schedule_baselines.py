"""Practitioners' hand-set batch schedules, scaled to a simulated preset (baselines).

Published schedules (token thresholds over the run's token budget; batch over its final batch):

- Llama 3 405B (Llama Team 2024, §3.4.1): 4M tokens per batch, 8M after 252M tokens, 16M after
  2.87T tokens, of 15.6T: (0, ¼), (1.6e-5, ½), (0.184, 1).
- DeepSeek-V3 (DeepSeek-AI 2024, §4.2): 3,072 → 15,360 sequences, increased gradually over the
  first 469B of 14.8T tokens: a 0.2 → 1 ramp over the first 3.17 %, here in 8 equal steps.
- Megatron-LM step schedule "0:768,250B:1536,500B:3072", read over a 1T-token run:
  (0, ¼), (0.25, ½), (0.5, 1).

Scaling: thresholds are the same fractions of the preset's published token budget; batches the
same fractions of an anchor final batch, each snapped to the nearest menu batch in
[initial_batch, max_batch]. "tuned": the best anchor among the powers of two up to max_batch
(a practitioner who tuned the schedule's scale); "as published": anchored at the median static
batch (the untuned user). Each batch runs on its fastest plan and a layout change pays the
switch cost (`core.sim.egrid.fixed_runs_minutes`).
"""

from __future__ import annotations

import numpy as np

from copus.core.control.schedules import StepSchedule

PUBLISHED: dict[str, tuple[tuple[float, float], ...]] = {
    "llama3-405b": ((0.0, 0.25), (252e6 / 15.6e12, 0.5), (2.87e12 / 15.6e12, 1.0)),
    "deepseek-v3": tuple((469e9 / 14.8e12 * i / 8, 0.2 + 0.8 * i / 8) for i in range(9)),
    "megatron-step": ((0.0, 0.25), (0.25, 0.5), (0.5, 1.0)),
}


def median_static_batch(initial_batch: int, max_batch: int, menu_batches: np.ndarray) -> int:
    """The median of the power-of-two batches from `initial_batch` to `max_batch` (16…1024 →
    128), snapped to the menu: the batch an untuned user picks from the middle of the range."""
    pows, b = [], initial_batch
    while b <= max_batch:
        pows.append(b)
        b *= 2
    return _snap(pows[(len(pows) - 1) // 2 + (len(pows) % 2 == 0)], menu_batches)


def _snap(value: float, menu_batches: np.ndarray) -> int:
    """The menu batch nearest to `value` in log scale."""
    arr = np.asarray(menu_batches, dtype=float)
    return int(arr[int(np.argmin(np.abs(np.log(arr) - np.log(max(value, 1e-9)))))])


def scaled(name: str, final_batch: int, horizon_tokens: float, menu_batches: np.ndarray) -> StepSchedule:
    """Schedule `name` (PUBLISHED) ending at `final_batch`, thresholds over `horizon_tokens`."""
    entries: list[tuple[float, int]] = []
    for frac, ratio in PUBLISHED[name]:
        b = _snap(ratio * final_batch, menu_batches)
        t = float(round(frac * horizon_tokens))
        if entries and b <= entries[-1][1]:
            continue  # a step the menu cannot resolve
        if entries and t <= entries[-1][0]:
            entries[-1] = (entries[-1][0], b)
            continue
        entries.append((t, b))
    return StepSchedule(tuple(entries))


def doubling_batches(traj, initial_batch: int, max_batch: int, menu_batches: np.ndarray):
    """Merrill et al. 2025's rule with a perfect measurement of the critical batch: start at
    `initial_batch`, double whenever B_crit(L) > 2·B, i.e. B = initial·2^k with the smallest
    k ≥ 0 such that 2·B ≥ B_crit, capped at `max_batch`, each value snapped to the menu.
    Returns batch_of(tokens, progress) for `egrid.fixed_runs_minutes` (one run)."""
    from copus.core.sim.egrid import critical_batch_of_progress

    ladder, b = [], initial_batch
    while b <= max_batch:
        ladder.append(_snap(b, menu_batches))
        b *= 2
    ladder_arr = np.asarray(ladder, dtype=float)

    def batch_of(_tokens: np.ndarray, progress: np.ndarray) -> np.ndarray:
        bcrit = critical_batch_of_progress(traj, progress)
        k = np.ceil(np.log2(np.maximum(bcrit / (2.0 * initial_batch), 1.0)) - 1e-12)
        return ladder_arr[np.clip(k.astype(int), 0, len(ladder_arr) - 1)]

    return batch_of


def anchors(initial_batch: int, max_batch: int) -> list[int]:
    out, b = [], 2 * initial_batch
    while b <= max_batch:
        out.append(b)
        b *= 2
    return out


def schedule_runs(
    truth,
    seq_len: int,
    menu,
    targets: list[float],
    switch_cost_s: float,
    *,
    horizon_tokens: float,
    initial_batch: int,
    max_batch: int,
    median_batch: int,
) -> dict[str, dict]:
    """Per published schedule: its best anchor ("tuned") and its median anchor ("untuned"),
    minutes to each target."""
    from copus.core.sim.egrid import fixed_runs_minutes

    batches = np.unique(menu.batches)
    col = targets.index(min(targets))
    out: dict[str, dict] = {}
    for name in PUBLISHED:
        finals = sorted(set(anchors(initial_batch, max_batch)) | {median_batch})
        scheds = [scaled(name, f, horizon_tokens, batches) for f in finals]

        def batch_of(tokens: np.ndarray, _progress, scheds=scheds) -> np.ndarray:
            return np.array([s(t) for s, t in zip(scheds, tokens)], dtype=float)

        mins = fixed_runs_minutes(truth, seq_len, menu, batch_of, len(scheds), targets, switch_cost_s)
        final = np.where(np.isfinite(mins[:, col]), mins[:, col], np.inf)
        best, med = int(np.argmin(final)), finals.index(median_batch)
        out[name] = {
            k: {
                "final_batch": finals[i],
                "describe": scheds[i].describe(),
                "minutes": [None if not np.isfinite(v) else float(v) for v in mins[i]],
            }
            for k, i in (("tuned", best), ("untuned", med))
        }
    return out
