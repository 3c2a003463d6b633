"""Seed-0 comparison: main's per-seed-0 figures (3-seed file) vs a one-seed run."""

import json
import sys
import statistics as st

main = {(d["preset"], d["truth"], d["crit_ratio"]): d for d in map(json.loads, open(sys.argv[1]))}
new = {(d["preset"], d["truth"], d["crit_ratio"]): d for d in map(json.loads, open(sys.argv[2]))}
rows = []
for k, d in new.items():
    m = main[k]["variants"]["goodput"]
    n = d["variants"]["goodput"]
    rows.append((k, m["per_seed_pct"][0], m["per_seed_capture"][0], n["per_seed_pct"][0], n["per_seed_capture"][0]))
print("| cell | main seed 0 % (capture) | lr seed 0 % (capture) | Δ pp |")
print("|---|---|---|---|")
for k, mp, mc, np_, nc in rows:
    flag = " **" if abs(np_ - mp) > 0.5 else ""
    print(f"| {k[0]} {k[1]} R={k[2]:g} | {mp:+.2f} ({mc:.2f}) | {np_:+.2f} ({nc:.2f}) | {np_ - mp:+.2f}{flag} |")
for name, i, j in (("main", 1, 2), ("lr", 3, 4)):
    caps = [r[j] for r in rows]
    pct = [r[i] for r in rows]
    print(
        f"{name}: cells {len(rows)} median capture {st.median(caps):.2f} min {min(caps):.2f} "
        f"cells<0.5 {sum(c < 0.5 for c in caps)} behind>1% {sum(p < -1 for p in pct)} mean % {st.mean(pct):+.2f}"
    )
