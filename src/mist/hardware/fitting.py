"""Small robust fits shared by `mist profile` and the offline profile builders.

`fit_floor_plus_rate` fits t ≈ c + x / r (a fixed cost plus a rate) to measured times with
c ≥ 0 and r > 0, minimising the relative error of every point, so that small and large sizes
weigh alike.
"""

from __future__ import annotations

import numpy as np


def fit_floor_plus_rate(x, t, intercept=True):
    """Fit t ≈ c + x / r with c >= 0 (r > 0), minimizing relative error. Returns (r, c)."""
    from scipy.optimize import nnls  # lazy: keeps scipy out of `import mist.hardware`

    x = np.asarray(x, float)
    t = np.asarray(t, float)
    cols = [np.ones_like(x), x] if intercept else [x]
    a = np.stack(cols, axis=1) / t[:, None]
    coef, _ = nnls(a, np.ones_like(t))
    c = coef[0] if intercept else 0.0
    slope = coef[-1]
    return (1.0 / slope if slope > 0 else np.inf), float(c)
