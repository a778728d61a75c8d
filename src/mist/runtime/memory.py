"""Device-memory accounting for runs without a CUDA allocator to ask.

On GPUs the runtime reports `torch.cuda.max_memory_allocated`. On CPU runs everything lives in one
memory, so instead it reports what it can account for: the device-resident part of the states it
manages (working weights, gradient buffers, fp32 master weights and Adam moments), the full weight
buffers materialised at the moment, and the bytes of saved activations kept on the device by the
current micro-batch (unique storages, after activation offloading). Temporaries inside operators
and the activations re-created by recomputation during backward are not counted.
"""

from __future__ import annotations


class MemoryAccount:
    def __init__(self) -> None:
        self.persistent = 0  # states that live on the device for the whole run
        self.transient = 0  # materialised full weights, reduction buffers
        self.activations = 0  # saved activations of the micro-batch(es) in flight
        self.peak = 0
        self.activations_peak = 0

    def _update(self) -> None:
        self.peak = max(self.peak, self.persistent + self.transient + self.activations)

    def add_persistent(self, nbytes: int) -> None:
        self.persistent += nbytes
        self._update()

    def add_transient(self, nbytes: int) -> None:
        self.transient += nbytes
        self._update()

    def add_activations(self, nbytes: int) -> None:
        self.activations += nbytes
        self.activations_peak = max(self.activations_peak, self.activations)
        self._update()

    def reset_activations(self) -> None:
        self.activations = 0
