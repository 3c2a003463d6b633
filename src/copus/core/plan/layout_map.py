"""A user's layout-by-batch map (`parallel.layouts`): which (dp, tp, pp) to train with at which
global batch, for the batch-only policies.

COPUS's CBS baselines tune the plan for one batch and keep it; with a map, a batch policy
(`ramp`, `norm-test`, `gns`, ...) instead switches to the layout a user found fastest for each
batch range (e.g. from `copus profile` tables), in the running processes like the goodput
controller's switches (design §6). The goodput controller chooses layouts itself and does not take
a map. Syntax: comma-separated `LAYOUT@MIN_BATCH`, LAYOUT = `dpX[.tpY][.ppZ]` (omitted degrees 1)
or any spelling of `core.layout_names.parse_layout` (`2x1x2`), e.g. `"pp4@8, dp2.pp2@32, dp4@128"`:
pp4 for B in [8, 32), dp2.pp2 for [32, 128), dp4 from 128. Written back canonically
(`dp1.tp1.pp4@8, dp2.tp1.pp2@32, dp4.tp1.pp1@128`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from copus.core.plan.layout_names import layout_name, parse_layout
from copus.core.specs.models import ModelShape
from copus.core.plan.plan import ParallelPlan, default_micro_batch_size, plan_problems
from copus.core.plan.records import Decision, StepRecord

Layout = tuple[int, int, int]
_ENTRY = re.compile(r"^[^@]+@\d+$")
SYNTAX = "comma-separated LAYOUT@MIN_BATCH with LAYOUT like dp2.tp2.pp1, e.g. 'pp4@8,dp4@64'"


@dataclass(frozen=True, slots=True)
class LayoutMap:
    """Layouts by ascending minimum global batch: `entries[i] = (min_batch, (dp, tp, pp))`."""

    entries: tuple[tuple[int, Layout], ...]

    def layout_for(self, global_batch_size: int) -> Layout | None:
        """The layout of the last entry whose min_batch <= B (None below the first)."""
        found = None
        for min_batch, layout in self.entries:
            if min_batch <= global_batch_size:
                found = layout
        return found

    def describe(self) -> str:
        return ", ".join(f"{_name(layout)}@{b}" for b, layout in self.entries)


def _name(layout: Layout) -> str:
    return layout_name(*layout)


class LayoutMapError(ValueError):
    """A bad `parallel.layouts`: `problem` (what is wrong) and `allowed` (what would do)."""

    def __init__(self, text: str, problem: str, allowed: str) -> None:
        super().__init__(f"parallel.layouts={text!r}: {problem}; allowed: {allowed}")
        self.problem, self.allowed = problem, allowed


def _bad(text: str, problem: str, allowed: str) -> LayoutMapError:
    return LayoutMapError(text, problem, allowed)


def parse_layout_map(text: str) -> LayoutMap | None:
    """`parallel.layouts` → LayoutMap (None for ""); ValueError naming the bad entry."""
    if not text.strip():
        return None
    entries: list[tuple[int, Layout]] = []
    for raw in text.split(","):
        entry = raw.strip().lower()
        if not _ENTRY.match(entry):
            raise _bad(text, f"entry {raw.strip()!r} is invalid", SYNTAX)
        spec, min_batch = entry.split("@")
        try:
            layout = parse_layout(spec)
        except ValueError:
            raise _bad(
                text, f"entry {raw.strip()!r} is invalid", "each of dp, tp, pp at most once, each >= 1"
            ) from None
        entries.append((int(min_batch), layout))
    batches = [b for b, _ in entries]
    if batches != sorted(set(batches)) or batches[0] < 1:
        raise _bad(text, f"minimum batches {batches} are invalid", "strictly increasing, >= 1")
    return LayoutMap(tuple(entries))


def check_layout_map(layouts: LayoutMap, world_size: int, initial_batch: int, shape: ModelShape | None = None) -> None:
    """ValueError unless every layout uses the whole world, fits the model, and the first entry
    covers the initial batch."""
    text = layouts.describe()
    if layouts.entries[0][0] > initial_batch:
        raise _bad(
            text, f"no layout for batch.initial={initial_batch}", f"a first entry with MIN_BATCH <= {initial_batch}"
        )
    for _, layout in layouts.entries:
        dp, tp, pp = layout
        probe = ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch_size=1, num_microbatches=pp)
        problems = plan_problems(probe, world_size, shape)
        if problems:
            raise _bad(
                text,
                f"layout {_name(layout)}: {problems[0]}",
                f"layouts with dp*tp*pp = {world_size} that fit the model",
            )


def plan_in_layout(plan: ParallelPlan, layout: Layout) -> ParallelPlan:
    """`plan`'s global batch in `layout`: its micro-batch size when dp·mbs divides B and leaves
    >= pp micro-batches, else `default_micro_batch_size` (capped at the old one). ValueError when
    dp does not divide B."""
    dp, tp, pp = layout
    batch = plan.global_batch_size
    if batch % dp:
        raise ValueError(f"global batch {batch} is not a multiple of dp={dp} of layout {_name(layout)}")
    per_dp, mbs = batch // dp, plan.micro_batch_size
    if per_dp % mbs or per_dp // mbs < pp:
        mbs = default_micro_batch_size(per_dp, pp, cap=mbs)
    return ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=per_dp // mbs)


class LayoutMappedPolicy:
    """A batch policy whose decisions move to the mapped layout of their new batch.

    The inner policy decides the batch (from its own statistics); when the map's layout for the
    new batch differs from the current one, the Decision becomes a "reconfigure" to that layout
    (same global batch), with the map named in its reason. State is the inner policy's.
    """

    def __init__(self, inner: Any, layouts: LayoutMap) -> None:
        self.inner = inner
        self.layouts = layouts
        self.name = inner.name

    def observe(self, record: StepRecord) -> Decision | None:
        decision = self.inner.observe(record)
        if decision is None:
            return None
        layout = self.layouts.layout_for(decision.plan.global_batch_size)
        if layout is None or layout == decision.plan.layout:
            return decision
        try:
            plan = plan_in_layout(decision.plan, layout)
        except ValueError as err:
            return Decision(
                kind=decision.kind,
                plan=decision.plan,
                step=decision.step,
                b_noise=decision.b_noise,
                reason=f"{decision.reason}; layout map not applied: {err}",
            )
        kind = "batch" if layout == record.plan.layout else "reconfigure"
        return Decision(
            kind=kind,
            plan=plan,
            step=decision.step,
            b_noise=decision.b_noise,
            candidates=decision.candidates,
            reason=f"{decision.reason}; layout {plan.describe()} from parallel.layouts ({self.layouts.describe()})",
        )

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def __getattr__(self, item: str) -> Any:
        """Everything else (statistics, names) is the inner policy's."""
        inner = self.__dict__.get("inner")
        if inner is None:  # not built yet (e.g. while unpickling)
            raise AttributeError(item)
        return getattr(inner, item)
