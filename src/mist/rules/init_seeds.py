"""The seeded initialisation of a model's parameters.

One generator seeded with the run's seed walks the full (single-process, unsharded) model's
parameters in `named_parameters()` order. Every matrix (two or more dimensions) takes the next
draws of a standard normal scaled by `INIT_STD`, in fp32; every vector takes a constant and draws
nothing: 1 for the weights of the norms, 0 for every bias. A tied head shares the embedding's
parameter and draws nothing of its own.

The single-process model (`mist.models.init_weights`) applies the rule directly; a sharded stage
(`mist.runtime.sharding.init_stage_params`) walks the same parameters on the meta device, draws
the same numbers in the same order and keeps its own slices, so that every layout starts from the
same weights.
"""

from __future__ import annotations

INIT_STD = 0.02
NORM_WEIGHTS = ("norm1.weight", "norm2.weight", "norm.weight")  # name endings of norm weights


def draws_normal(ndim):
    """Whether a parameter with `ndim` dimensions takes normal draws (else a constant)."""
    return ndim >= 2


def init_constant(name: str) -> float:
    """The constant a parameter named `name` that draws nothing takes: 1 for norm weights, else 0."""
    return 1.0 if name.endswith(NORM_WEIGHTS) else 0.0
