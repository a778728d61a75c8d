"""How many cores one CPU worker process gets: a CPU "cluster" of K worker processes on one
machine is K devices of ⌊cores / K⌋ intra-op threads each. `mist train` runs its CPU ranks so and
`mist profile --device cpu --processes K` measures one such device, so that the profile describes
the ranks that will run the plan."""

from __future__ import annotations

import os


def threads_per_worker(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, int(workers)))
