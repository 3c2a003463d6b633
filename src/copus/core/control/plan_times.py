"""The planning controller's programme (`core.control.planner`): the expected seconds from now to
the run's end on each layout, under each hypothesis c, over the forecast noise scale.

- **Rates**: a plan at batch B with step time s adds ΔE/s = B·cφ/(cφ + B)/s effective samples per
  second (McCandlish et al. 2018, Eq. 2.11), times the run's LR rule's factor (`lr_factor`: under
  the sqrt rule 2x − x², McCandlish Eqs. 2.5–2.7; docs/robust-goodput.md §6.14) and COPUS Eq. 8's
  sqrt(B) factor when configured.
- **Frontier**: per layout only the batches that can be its best at some cφ (more samples/s than
  every smaller batch); E(B) falls with B, so any other is beaten everywhere.
- **End of the run**: E_end, where the forecast run at each point's best batch B* has spent the
  samples left (ΔS = ΔE·(cφ + B*)/cφ).
- **Programme** (the same as `core.sim.oracle.switch_aware_minutes`, over the forecast): on a
  geometric grid of E from E_now to E_end, r_L(E) = the best ΔE/s of layout L at cφ(E); backward,
  g_L(E_m) = min(h_L, C + min_L' h_L'), h_L = (E_m+1 − E_m)/r_L(E_m+½) + g_L(E_m+1), C = the
  measured switch cost.

`PlanTimes` is a mixin of `PlanningController`: it reads the controller's `candidates`, `_ids`,
`_keys`, `grid_points`, `reconfig_cost_s`, `search_options`, `posterior`, `lr_rule` and
`hypothesis_x0` (the x0 of each joint hypothesis of c, or None).
Pure numpy; no torch.
"""

from __future__ import annotations

import numpy as np

from copus.core.stats.lr_progress import sqrt_rule_factor


class PlanTimes:
    """Rates, the frontier, E_end and the programme's seconds per layout (module docstring)."""

    def frontier(self, step_s: np.ndarray) -> np.ndarray:
        """Candidate indices that can be some layout's best at some noise scale, sorted by
        layout: per layout, by batch, those with more samples/s than every smaller batch (any
        other is beaten at every cφ by a smaller, faster one: E(B) falls with B)."""
        key = id(step_s)
        if self._frontier is not None and self._frontier[0] == key:
            return self._frontier[1]
        b = self.candidates.global_batch_size.astype(float)
        thr = np.where(np.isfinite(step_s) & (step_s > 0), b / np.where(step_s > 0, step_s, 1.0), 0.0)
        keep = []
        for lay in range(len(self._keys)):
            on = np.flatnonzero(self._ids == lay)
            on = on[np.lexsort((-thr[on], b[on]))]
            best = np.maximum.accumulate(thr[on])
            new = np.r_[True, best[1:] > best[:-1]] & (thr[on] > 0)
            keep.append(on[new])
        out = np.concatenate(keep) if keep else np.zeros(0, int)
        self._frontier = (key, out, np.flatnonzero(np.r_[True, np.diff(self._ids[out]) != 0]))
        return out

    def rates(self, bc: np.ndarray, step_s: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
        """ΔE per second of the candidates `idx` (default all) at each noise scale `bc`
        (shape (..., len(idx)))."""
        idx = np.arange(len(self.candidates)) if idx is None else idx
        b = self.candidates.global_batch_size[idx].astype(float)
        s = step_s[idx]
        bc = np.asarray(bc, dtype=float)[..., None]
        # r = b·bc/(bc + b)/s·lr_factor, in place (the planner calls this on (K, G, N') arrays
        # of ~10⁶ entries hundreds of times a run): the same operations in the same order, so
        # the same bits; a factor of exactly 1.0 (no LR rule modelled) is skipped (x·1.0 = x).
        r = b * bc
        np.divide(r, bc + b, out=r)
        np.divide(r, s, out=r)
        factor = self.lr_factor(bc, b)
        if not (isinstance(factor, float) and factor == 1.0):
            r = np.multiply(r, factor, out=r if np.shape(factor) == () else None)
        if self.search_options["lr_aware"]:  # COPUS Eq. 8's sqrt(B) factor, when configured
            np.multiply(r, np.sqrt(b / self.search_options["lr_ref_batch"]), out=r)
        ok = np.isfinite(r)
        positive = s > 0
        if not positive.all():
            ok &= positive
        if not ok.all():
            np.copyto(r, 0.0, where=~ok)
        return r

    def lr_factor(self, bc: np.ndarray, b: np.ndarray) -> np.ndarray | float:
        """The run's LR rule's factor on the progress per sample at batch `b` and B_crit `bc`
        (broadcast): under `lr_rule` "sqrt" with the posterior's x0 rows (`lr_fractions`), the
        posterior mean Σ_j p_j·(2x_j − x_j²) + (1 − Σ_j p_j)·1, x_j = x0_j·sqrt(B/B_ref)·
        [(1 + cφ/B)/(1 + cφ/B_ref)]^½ (McCandlish 2018 Eqs. 2.5–2.7; docs/robust-goodput.md
        §6.14); else 1 (the LR re-tuned for every B, or a rule the plan does not model)."""
        post = self.posterior
        if self.lr_rule != "sqrt" or post is None or not post.lr_fractions:
            return 1.0
        x0 = self.hypothesis_x0
        if x0 is not None and np.ndim(bc) >= 1 and np.shape(bc)[0] == len(x0) > 1:
            # joint hypotheses (`LR_JOINT`): hypothesis k's own row, 1 for the LR re-tuned rows
            xk = np.reshape(x0, (len(x0),) + (1,) * (np.ndim(bc) - 1))
            tuned = np.isnan(xk)
            f = sqrt_rule_factor(
                b,
                bc,
                np.where(tuned, 1.0, xk),
                post.lr_ref_batch,
                post.lr_opt_exponent,
                overshoot_only=post.lr_overshoot_only,
            )
            return np.where(tuned, 1.0, f)
        x0s, p = post.lr_fraction_weights()
        ref, expo = post.lr_ref_batch, post.lr_opt_exponent
        out = 1.0 - float(p.sum())
        for x0, pj in zip(x0s, p, strict=True):
            out = out + pj * sqrt_rule_factor(b, bc, float(x0), ref, expo, overshoot_only=post.lr_overshoot_only)
        return out

    def end_clock(
        self,
        e_now: np.ndarray,
        phi_now: np.ndarray,
        beta: np.ndarray,
        cs: np.ndarray,
        step_s: np.ndarray,
        samples_left: float,
    ) -> np.ndarray:
        """E_end per hypothesis: where the forecast run has spent `samples_left` samples, each
        stretch at the best plan's batch B* (ΔS = ΔE·(cφ + B*)/cφ): E grows more slowly per
        sample as the batch grows, faster as φ grows."""
        top = e_now + max(samples_left, 1.0)  # E ≤ samples: E(B) ≤ 1 per sample
        frac = np.linspace(0.0, 1.0, self.grid_points + 1)
        edges = e_now[:, None] * (top / e_now)[:, None] ** frac[None, :]
        mids = np.sqrt(edges[:, 1:] * edges[:, :-1])
        bc = (cs * phi_now)[:, None] * (mids / e_now[:, None]) ** beta[:, None]
        idx = self.frontier(step_s)
        b = self.candidates.global_batch_size[idx[np.argmax(self.rates(bc, step_s, idx), axis=-1)]]
        per_e = (bc + b) / bc / np.maximum(self.lr_factor(bc, b.astype(float)), 1e-3)  # samples per ΔE
        spent = np.cumsum(np.diff(edges, axis=1) * per_e, axis=1)
        return np.array([np.interp(samples_left, spent[k], edges[k, 1:], right=edges[k, -1]) for k in range(len(cs))])

    def layout_times(
        self,
        e_now: np.ndarray,
        e_end: np.ndarray,
        phi_now: np.ndarray,
        beta: np.ndarray,
        cs: np.ndarray,
        step_s: np.ndarray,
    ) -> np.ndarray:
        """h[k, L]: seconds from E_now to E_end starting on layout L (already there), under
        hypothesis k, switching later where the programme says so (module docstring)."""
        g_pts = self.grid_points
        edges, bc = self._grid(e_now, e_end, phi_now, beta, cs)
        idx = self.frontier(step_s)
        r = self.rates(bc, step_s, idx)  # (K, G, N')
        best = np.full(r.shape[:2] + (len(self._keys),), 0.0)
        best[..., self._ids[idx[self._frontier[2]]]] = np.maximum.reduceat(r, self._frontier[2], axis=2)
        de = np.diff(edges, axis=1)[..., None]
        seg = np.where(best > 0, de / np.where(best > 0, best, 1.0), np.inf)
        c = self.reconfig_cost_s
        g = np.zeros(best.shape[::2])
        h = g
        for m in range(g_pts - 1, -1, -1):
            h = seg[:, m, :] + g
            g = np.minimum(h, c + h.min(axis=1, keepdims=True))
        return h

    def _grid(self, e_now, e_end, phi_now, beta, cs) -> tuple[np.ndarray, np.ndarray]:
        """(edges (K, G+1), cφ at the midpoints (K, G)) of the geometric grid of E per c_k."""
        frac = np.linspace(0.0, 1.0, self.grid_points + 1)
        edges = e_now[:, None] * (e_end / e_now)[:, None] ** frac[None, :]
        mids = np.sqrt(edges[:, 1:] * edges[:, :-1])
        return edges, (cs * phi_now)[:, None] * (mids / e_now[:, None]) ** beta[:, None]

    def grid_rates(self, e_now, e_end, phi_now, beta, cs, step_s) -> tuple[np.ndarray, np.ndarray]:
        """(ΔE/s (K, G, N') of the frontier's plans on the grid, ΔE of each stretch (K, G)):
        what `experiment_value` prices a batch choice on (layouts free, switches not counted)."""
        edges, bc = self._grid(e_now, e_end, phi_now, beta, cs)
        return self.rates(bc, step_s, self.frontier(step_s)), np.diff(edges, axis=1)
