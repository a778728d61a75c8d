"""What the optimizer and the gradient norm need to know about one parameter of a flat unit,
beyond its shape: whether AdamW decays it, and which of its local elements are copies that
another rank already counts (replicated on the TP group, or KV heads repeated over TP ranks).

`Trainer` decides it per parameter from the model and the TP layout; `FlatUnit` shifts the
ranges into its flat buffer (`ParamInfo`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParamRole:
    decay: bool  # AdamW weight decay applies (matrices, not norms/biases)
    norm_skip: tuple[int, int] | None = None  # local element range [a, b) left out of the gradient norm
    kv_range: tuple[int, int] | None = None  # local element range of KV-head copies (grads summed over the KV group)
