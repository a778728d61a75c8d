"""The deterministic sampler: a seeded shuffle of the sequence indices in every epoch.

Epoch e visits the n training sequences in the order ``permutation(n)`` of a NumPy PCG64 generator
seeded with (seed, e). The sampler's position is (epoch, index): the next sequence is the
index-th of epoch e's order. A global batch of B sequences takes the next B (running on into the
next epoch), so it depends only on the position: the position is saved in each checkpoint and
`--resume` continues with exactly the batches the uninterrupted run would have trained on. The
global batch is then split over micro-batches and dp ranks by `data.split_micro_batches`, the same
for every layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplerPosition:
    epoch: int = 0
    index: int = 0


class EpochSampler:
    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._cached: tuple[int, np.ndarray] | None = None

    def order(self, epoch: int) -> np.ndarray:
        """The visiting order of epoch `epoch` (the last one used is kept)."""
        if self._cached is None or self._cached[0] != epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._cached = (epoch, rng.permutation(self.n))
        return self._cached[1]

    def take(self, pos: SamplerPosition, count: int) -> tuple[np.ndarray, SamplerPosition]:
        """The next `count` sequence indices from `pos`, and the position after them."""
        out, epoch, index = [], pos.epoch, pos.index
        while count:
            k = min(count, self.n - index)
            out.append(self.order(epoch)[index : index + k])
            count -= k
            index += k
            if index == self.n:
                epoch, index = epoch + 1, 0
        return np.concatenate(out) if out else np.zeros(0, np.int64), SamplerPosition(epoch, index)
