"""Log-log interpolation on a regular grid of measured times, shared by GEMM and attention tables.

A table stores times (seconds) at the nodes of a grid whose axes are powers of two (or any
positive values). Lookups interpolate log2(time) linearly in log2(coordinates); that is a
piecewise power law between nodes, so a table with monotone nodes gives monotone lookups.

Outside the grid the *efficiency* is clamped, not the time: the query is moved to the nearest
grid point, the time found there is scaled by the work ratio (work ∝ Π coord_i ** exponent_i),
and a floor (the launch/host floor of the kernel) is applied. Inside the grid the table is
returned unchanged, so measured nodes are reproduced exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class LogGrid:
    """Times on a regular grid; lookups interpolate in log-log space (see module docstring)."""

    def __init__(
        self,
        axes: Sequence[Sequence[float]],
        times_s: np.ndarray,
        work_exponents: Sequence[float],
        floor_s: float,
    ) -> None:
        self.axes = [np.asarray(a, dtype=float) for a in axes]
        times = np.asarray(times_s, dtype=float)
        shape = tuple(len(a) for a in self.axes)
        if times.shape != shape:
            raise ValueError(f"table shape {times.shape} does not match axes {shape}")
        if not np.all(np.isfinite(times)) or np.any(times <= 0):
            raise ValueError("table times must be finite and positive (fill missing nodes first)")
        for a in self.axes:
            if len(a) < 2 or np.any(np.diff(a) <= 0) or a[0] <= 0:
                raise ValueError("each axis needs >= 2 positive, strictly increasing values")
        if len(work_exponents) != len(self.axes):
            raise ValueError("one work exponent per axis")
        self.times_s = times
        self.work_exponents = np.asarray(work_exponents, dtype=float)
        self.floor_s = float(floor_s)
        self._log_axes = [np.log2(a) for a in self.axes]
        # lazy: keeps scipy out of `import mist.hardware` (CLI start-up, spawned profiler processes)
        from scipy.interpolate import RegularGridInterpolator

        self._interp = RegularGridInterpolator(self._log_axes, np.log2(times), method="linear", bounds_error=True)

    def __call__(self, *coords) -> np.ndarray:
        """Time (s) at the given coordinates (arrays broadcast); zero where any coordinate <= 0."""
        arrays = np.broadcast_arrays(*[np.asarray(c, dtype=float) for c in coords])
        shape = arrays[0].shape
        valid = np.ones(shape, dtype=bool)
        for a in arrays:
            valid &= a > 0
        safe = [np.where(valid, a, 1.0) for a in arrays]
        logs = [np.log2(a) for a in safe]
        clamped = [np.clip(lg, ax[0], ax[-1]) for lg, ax in zip(logs, self._log_axes)]
        pts = np.stack([c.reshape(-1) for c in clamped], axis=-1)
        log_t = self._interp(pts).reshape(shape)
        excess = np.zeros(shape)
        for e, lg, c in zip(self.work_exponents, logs, clamped):
            excess = excess + e * (lg - c)
        t = np.exp2(log_t + excess)
        outside = np.zeros(shape, dtype=bool)
        for lg, c in zip(logs, clamped):
            outside |= lg != c
        t = np.where(outside, np.maximum(t, self.floor_s), t)
        return np.where(valid, t, 0.0)

    def inside(self, *coords) -> np.ndarray:
        """True where every coordinate lies within the grid's range."""
        arrays = np.broadcast_arrays(*[np.asarray(c, dtype=float) for c in coords])
        ok = np.ones(arrays[0].shape, dtype=bool)
        for a, ax in zip(arrays, self.axes):
            ok &= (a >= ax[0]) & (a <= ax[-1])
        return ok


def round_sig(values, digits: int = 5):
    """Round to `digits` significant digits (keeps profile JSON small and diff-friendly)."""
    arr = np.asarray(values, dtype=float)
    out = np.zeros_like(arr)
    nz = arr != 0
    mag = np.floor(np.log10(np.abs(arr[nz])))
    scale = 10.0 ** (digits - 1 - mag)
    out[nz] = np.round(arr[nz] * scale) / scale
    return out
