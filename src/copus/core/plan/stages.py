"""Split a decoder's blocks into pipeline stages (pure: no torch).

Stage 0 also holds the token embeddings, the last stage the final norm and output head (plus the
loss). Both are extra work, the head most of all (a dim × vocab matmul), so when the blocks do not
divide evenly the extra blocks go to the *middle* stages first, then to the first stage, and the
last stage gets one only when every stage does (i.e. never: then the split is even).
Example: 6 blocks on 4 stages → [1, 2, 2, 1]; 5 on 2 → [3, 2]; 8 on 4 → [2, 2, 2, 2].
"""

from __future__ import annotations


def stage_sizes(n_layers: int, pp: int) -> list[int]:
    """Blocks per stage: ⌊L/pp⌋ each, the remainder L mod pp one each to middle stages, then stage 0."""
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp={pp!r} is invalid; allowed: an integer >= 1")
    if not isinstance(n_layers, int) or n_layers < pp:
        raise ValueError(f"n_layers={n_layers!r} is invalid for pp={pp}; allowed: an integer >= pp")
    sizes = [n_layers // pp] * pp
    order = list(range(1, pp - 1)) + [0] + ([pp - 1] if pp > 1 else [])
    for i in order[: n_layers % pp]:
        sizes[i] += 1
    return sizes


def split_layers(n_layers: int, pp: int) -> list[range]:
    """Contiguous block index ranges, one per stage, covering 0..n_layers-1 (see `stage_sizes`)."""
    out, start = [], 0
    for n in stage_sizes(n_layers, pp):
        out.append(range(start, start + n))
        start += n
    return out
