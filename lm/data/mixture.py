"""Weighted mixtures of window sources, deterministic and exact at every prefix.

Weights are rounded to integer parts ``p_k`` (of at most ``RESOLUTION`` in total, divided by their gcd)
and laid out in a cycle of ``P = sum p_k`` slots in which source ``k`` takes ``p_k`` slots, spread
evenly (slot ``j`` goes to the source whose running share lags its weight most). Sample ``i`` lies in
cycle ``i // P`` at slot ``i mod P`` and reads the next sample of that slot's source, so any ``n``
samples hold within ``P`` samples of ``n * w_k`` from source ``k``, and the mixture is random-access:
resuming, or reading on several processes, needs only the sample index.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

RESOLUTION = 1000


def parse(spec: str) -> list[tuple[str, float]]:
    """``"GLOB_A:0.7,GLOB_B:0.3"`` as ``[("GLOB_A", 0.7), ("GLOB_B", 0.3)]``.

    Raises:
      ValueError: an entry without ``:weight``, or a weight that is not a positive number.
    """
    out = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        pattern, sep, weight = entry.rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not sep or not pattern or not value > 0 or math.isinf(value):
            raise ValueError(f"data.mixture entry {entry!r} must be GLOB:WEIGHT with a positive weight, e.g. 'data/a/train_*.bin:0.7'")
        out.append((pattern, value))
    if not out:
        raise ValueError(f"data.mixture={spec!r} names no source; write 'GLOB_A:0.7,GLOB_B:0.3'")
    return out


def integer_parts(weights: Sequence[float]) -> list[int]:
    """``weights`` as positive integers in the same proportions (to 1 / RESOLUTION), divided by their gcd."""
    total = sum(weights)
    parts = [max(1, round(RESOLUTION * w / total)) for w in weights]
    divisor = math.gcd(*parts)
    return [p // divisor for p in parts]


class Schedule:
    """Which source each mixture sample reads, for integer parts of ``weights`` (see the module docstring)."""

    def __init__(self, weights: Sequence[float]):
        self.parts = integer_parts(weights)
        period = sum(self.parts)
        slots, rank = np.zeros(period, np.int64), np.zeros(period, np.int64)
        taken = np.zeros(len(self.parts), np.int64)
        share = np.asarray(self.parts, np.float64) / period
        for j in range(period):
            k = int(np.argmax(share * (j + 1) - taken))
            slots[j], rank[j] = k, taken[k]
            taken[k] += 1
        self.period, self.slots, self.rank = period, slots, rank

    def locate(self, index: int) -> tuple[int, int]:
        """``(source, index in that source)`` of mixture sample ``index``."""
        cycle, slot = divmod(index, self.period)
        k = int(self.slots[slot])
        return k, cycle * self.parts[k] + int(self.rank[slot])

    def counts(self, n: int) -> np.ndarray:
        """Samples drawn from each source among the first ``n``."""
        cycles, rest = divmod(n, self.period)
        return cycles * np.asarray(self.parts) + np.bincount(self.slots[:rest], minlength=len(self.parts))


class Mixture:
    """A random-access mixture (a Grain data source) of random-access sources with the given weights.

    Each source is read in order ``0, 1, 2, ...`` (give it already shuffled, and unbounded, e.g. a Grain
    ``MapDataset.shuffle``, which reshuffles per epoch past its length).
    """

    def __init__(self, sources: Sequence, weights: Sequence[float]):
        self.sources = list(sources)
        self.schedule = Schedule(weights)

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, index: int):
        k, i = self.schedule.locate(index)
        return self.sources[k][i]
