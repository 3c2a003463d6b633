"""The one way copus writes a layout, and the spellings it reads.

Written (every command, log line, summary and report): ASCII, all three degrees in the order
data.tensor.pipeline, and for a plan its micro-batching as `mb<micro_batch_size>x<num_microbatches>`:

    dp2.tp1.pp2              a layout (dp, tp, pp)
    dp2.tp1.pp2 mb8x1        a plan (ParallelPlan.describe adds "(B=16)")

Read (`parse_layout`; every command and key that takes a layout): the canonical form, any subset
in any order with omitted degrees 1 (`dp2.pp2`, `pp4`), the older spellings `4x1x1` (dp x tp x pp),
`dp2·tp1·pp1`, `DP2,TP1,PP1` (as the simulator wrote it) and `single` (1, 1, 1); case-insensitive.
"""

from __future__ import annotations

import re

Layout = tuple[int, int, int]
LAYOUT_SYNTAX = "dpX.tpY.ppZ (omitted degrees 1, e.g. dp2.pp2) or DPxTPxPP (e.g. 2x1x2)"
_TRIPLE = re.compile(r"^(\d+)\s*[x×]\s*(\d+)\s*[x×]\s*(\d+)$")
_DEGREE = re.compile(r"^(dp|tp|pp)(\d+)$")
_SEPARATORS = re.compile(r"[.·,_\s]+")


def layout_name(
    dp: int, tp: int, pp: int, micro_batch_size: int | None = None, num_microbatches: int | None = None
) -> str:
    """`dp2.tp1.pp2`, with micro-batching `dp2.tp1.pp2 mb8x1` (or `mb8` without the count)."""
    text = f"dp{dp}.tp{tp}.pp{pp}"
    if micro_batch_size is None:
        return text
    count = "" if num_microbatches is None else f"x{num_microbatches}"
    return f"{text} mb{micro_batch_size}{count}"


def parse_layout(text: str) -> Layout:
    """(dp, tp, pp) from any accepted spelling (module doc); ValueError names the text."""
    raw = text.strip().lower()
    if raw == "single":
        return (1, 1, 1)
    if m := _TRIPLE.match(raw):
        degrees = tuple(int(g) for g in m.groups())
        if min(degrees) >= 1:
            return degrees  # type: ignore[return-value]
    found: dict[str, int] = {}
    for part in filter(None, _SEPARATORS.split(raw)):
        m = _DEGREE.match(part)
        if m is None or m.group(1) in found or int(m.group(2)) < 1:
            found = {}
            break
        found[m.group(1)] = int(m.group(2))
    if not found:
        raise ValueError(
            f"layout {text!r} is invalid; allowed: {LAYOUT_SYNTAX}, each degree >= 1 and named at most once"
        )
    return (found.get("dp", 1), found.get("tp", 1), found.get("pp", 1))
