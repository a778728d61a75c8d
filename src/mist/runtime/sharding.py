"""Which slice of the full (unsharded) model each tensor-parallel rank holds, and seeded init.

For every parameter name of the full model, `tp_slice` gives the (dim, row/column indices) of the
full tensor that rank r of t holds, or None when the parameter is replicated on every TP rank:

- column-parallel linears hold output rows, row-parallel linears the matching input columns;
- the fused attention ``qkv`` is laid out [q heads | k heads | v heads] *per rank*, so rank r takes
  its q heads, its k heads and its v heads; with fewer KV heads than ranks a KV head is copied to
  the tp / num_kv_heads consecutive ranks whose query heads use it;
- the llama MLP ``fc1`` is [gate | up] per rank;
- vocab-parallel embedding and head hold vocabulary rows [r·V/t, (r+1)·V/t).

`init_stage_params` fills a stage's local modules with exactly the values `init_weights(full, seed)`
gives the single-process model, without building the full model (it walks the full model's
parameters on the meta device and draws the same random numbers in the same order: the rule of
`mist.rules.init_seeds`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from mist.models import CausalLM, TPGroup
from mist.models.causal_lm import normal_draw
from mist.rules.init_seeds import INIT_STD, draws_normal, init_constant
from mist.specs.model import ModelSpec


def _rows(start: int, stop: int) -> list[int]:
    return list(range(start, stop))


def kv_layout(spec: ModelSpec, tp: int, rank: int) -> tuple[int, int, int]:
    """(local query heads, local KV heads, first full KV head index) of TP rank `rank`."""
    hq = spec.num_heads // tp
    if spec.num_kv_heads >= tp:
        hk = spec.num_kv_heads // tp
        return hq, hk, rank * hk
    rep = tp // spec.num_kv_heads
    return hq, 1, rank // rep


def tp_slice(name: str, spec: ModelSpec, tp: int, rank: int):
    """(dim, LongTensor of indices into the full parameter) held by TP rank `rank`; None if replicated."""
    if tp == 1:
        return None
    h, d, f, V = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size, spec.vocab_size
    idx = None
    if name in ("embedding.word", "head.weight"):
        idx = (0, _rows(rank * V // tp, (rank + 1) * V // tp))
    elif re.search(r"\.attn\.qkv\.", name):
        hq, hk, k0 = kv_layout(spec, tp, rank)
        H, KV = spec.num_heads, spec.num_kv_heads
        q = _rows(rank * hq * d, (rank + 1) * hq * d)
        k = _rows(H * d + k0 * d, H * d + (k0 + hk) * d)
        v = _rows((H + KV) * d + k0 * d, (H + KV) * d + (k0 + hk) * d)
        idx = (0, q + k + v)
    elif re.search(r"\.attn\.dense\.weight$", name):
        idx = (1, _rows(rank * h // tp, (rank + 1) * h // tp))
    elif re.search(r"\.mlp\.fc1\.", name):
        part = _rows(rank * f // tp, (rank + 1) * f // tp)
        idx = (0, part + [f + i for i in part] if spec.gated_mlp else part)
    elif re.search(r"\.mlp\.fc2\.weight$", name):
        idx = (1, _rows(rank * f // tp, (rank + 1) * f // tp))
    if idx is None:
        return None
    dim, rows = idx
    return dim, torch.tensor(rows, dtype=torch.long)


def kv_replicated_rows(name: str, spec: ModelSpec, tp: int, rank: int) -> tuple[int, int] | None:
    """Local rows [a, b) of a qkv parameter holding KV heads copied to several TP ranks, else None."""
    if tp <= spec.num_kv_heads or not re.search(r"\.attn\.qkv\.", name):
        return None
    hq, hk, _ = kv_layout(spec, tp, rank)
    d = spec.head_dim
    return hq * d, (hq + 2 * hk) * d


def shard_full(name: str, full: torch.Tensor, spec: ModelSpec, tp: int, rank: int) -> torch.Tensor:
    sl = tp_slice(name, spec, tp, rank)
    return full if sl is None else full.index_select(sl[0], sl[1])


def full_meta_model(spec: ModelSpec, flash: bool = True) -> CausalLM:
    """The single-process model on the meta device: parameter names, shapes and init order."""
    return CausalLM(spec, TPGroup(), flash, dtype=torch.float32, device="meta")


def init_value(name: str, shape, gen: torch.Generator, std: float = INIT_STD) -> torch.Tensor | None:
    """The value `mist.models.init_weights` gives a parameter (None: a constant, no RNG draw)."""
    return normal_draw(shape, gen, std) if draws_normal(len(shape)) else None


def local_to_full_name(local_name: str, first_layer: int) -> str:
    """A stage module's parameter name → the full model's (block indices are global there)."""
    m = re.match(r"blocks\.(\d+)(.*)", local_name)
    return f"blocks.{int(m.group(1)) + first_layer}{m.group(2)}" if m else local_name


@torch.no_grad()
def init_stage_params(
    local_named: dict[str, nn.Parameter], spec: ModelSpec, tp: int, rank: int, seed: int, flash: bool = True
) -> None:
    """Copy into `local_named` (full-model names → local shards) the seeded full-model values.

    Draws the full model's random numbers in `init_weights` order (every rank draws them all, so
    every rank and layout sees the same values) and keeps only this rank's slices.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in full_meta_model(spec, flash).named_parameters():
        val = init_value(name, p.shape, gen)
        if name not in local_named:
            continue
        dst = local_named[name]
        if val is None:
            dst.fill_(init_constant(name))
        else:
            dst.copy_(shard_full(name, val, spec, tp, rank))
