"""A per-epoch random permutation of range(n) computed on demand, in O(1) memory.

`data.GlobalSampler` materialises each epoch's permutation (8 bytes per sample: 640 MB for 80 M
windows of a 10 GB corpus). `FeistelSampler` has the same contract — position p of the stream is
sample perm_e(p mod n) of epoch e = p // n — but evaluates perm_e pointwise: a balanced Feistel
network of 6 rounds on 2h-bit integers (2^2h ≥ n) is a bijection of [0, 2^2h) for any round
function (Luby & Rackoff 1988), and cycle-walking (re-apply until the value is < n) restricts it
to a bijection of [0, n) (Black & Rogaway 2002). Each round function is splitmix64 keyed by
(seed, epoch, round). Expected walk length < 4 since n > 2^2h / 4.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def epoch_walk(offset: int, count: int, num_samples: int, ids_of: Callable[[int, int, int], np.ndarray]) -> np.ndarray:
    """Sample ids of global positions [offset, offset + count): position p is element
    p mod num_samples of epoch p // num_samples; `ids_of(epoch, start, stop)` gives one epoch's
    slice. Shared by every sampler, so the offset arithmetic exists once."""
    if offset < 0 or count < 0:
        raise ValueError(f"offset={offset}, count={count}: allowed: integers >= 0")
    out, pos, end = [], offset, offset + count
    while pos < end:
        epoch, start = divmod(pos, num_samples)
        take = min(end - pos, num_samples - start)
        out.append(ids_of(epoch, start, start + take))
        pos += take
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
ROUNDS = 6


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Steele et al. 2014) on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class FeistelSampler:
    """Stream of sample ids; the state is the global sample offset (design §6)."""

    kind = "feistel"

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples!r}: allowed: an integer >= 1")
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.half = max(1, (int(num_samples - 1).bit_length() + 1) // 2)
        self._mask = np.uint64((1 << self.half) - 1)

    def _keys(self, epoch: int) -> list[np.uint64]:
        base = _splitmix(np.asarray([self.seed], dtype=np.uint64))[0]
        return [
            _splitmix(np.asarray([base ^ np.uint64(epoch * ROUNDS + r + 1)], dtype=np.uint64))[0] for r in range(ROUNDS)
        ]

    def _feistel(self, x: np.ndarray, keys: list[np.uint64]) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self._mask
        for k in keys:
            left, right = right, left ^ (_splitmix(right ^ k) & self._mask)
        return (left << h) | right

    def permute(self, epoch: int, j: np.ndarray) -> np.ndarray:
        """perm_epoch(j) for j in [0, n): a bijection of [0, n)."""
        keys = self._keys(epoch)
        x = np.asarray(j, dtype=np.uint64)
        n = np.uint64(self.num_samples)
        out = self._feistel(x, keys)
        walk = out >= n
        while walk.any():
            out[walk] = self._feistel(out[walk], keys)
            walk = out >= n
        return out.astype(np.int64)

    def epoch(self, offset: int) -> int:
        return offset // self.num_samples

    def ids(self, offset: int, count: int) -> np.ndarray:
        return epoch_walk(
            offset, count, self.num_samples, lambda epoch, start, stop: self.permute(epoch, np.arange(start, stop))
        )
