"""Activation checkpointing, exactly as the runtime applies it.

Whole blocks: reentrant checkpointing keeps only the block input (saved through
`save_for_backward`, so the saved-tensor hooks of `mist.analysis` and of the memory checks see it)
and re-runs the forward at the start of the block's backward.
The blocks that are not checkpointed whole may recompute parts of themselves (`SELECTIVE`):
  attention  — the block keeps its activations except those of the attention core, which keeps
               q, k and v and is re-run at the start of its own backward (`mist.models.attention`);
  activation — the MLP keeps fc1's output but not the activation's: fc2 re-runs the activation in
               its backward (`act_linear`; Korthikanti et al. 2022 recompute the cheap elementwise
               ops for the same reason: they hold memory out of proportion to their time).
With dropout in the model, the re-runs draw the masks of the forward (`mist.models.dropout`); the
re-run of `act_linear` has no dropout in it (the hidden dropout follows fc2), so nothing to replay.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mist.models.dropout import checkpoint

SELECTIVE = ("attention", "activation")


class _ActLinear(torch.autograd.Function):
    """act(x) Wᵀ keeping x (not act(x)) for backward. Backward re-runs act for the weight gradient
    and frees it before the input gradient, which `act.grad` takes from x alone (the kernels
    autograd would run): bit for bit the plain MLP's gradients, with one more tensor live at the
    backward's peak than in the plain MLP, the weight gradient (2·h·f/t bytes in 16 bits), which
    autograd can only take when the function returns."""

    @staticmethod
    def forward(ctx, x, weight, act):
        ctx.act = act
        ctx.save_for_backward(x, weight)
        return F.linear(act(x), weight)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gw = gx = None
        if ctx.needs_input_grad[1]:
            with torch.enable_grad():  # the re-run, as `mist.analysis` labels it (no graph: x is detached)
                a = ctx.act(x.detach())
            # under autocast the linear ran in g's dtype (its inputs cast to it, as here)
            gw = g.reshape(-1, g.shape[-1]).t().matmul(a.reshape(-1, a.shape[-1]).to(g.dtype))
            del a
        if ctx.needs_input_grad[0]:
            gx = ctx.act.grad(x, g.matmul(weight.to(g.dtype)).to(x.dtype))
        return gx, gw, None


def act_linear(x: torch.Tensor, weight: torch.Tensor, act) -> torch.Tensor:
    """F.linear(act(x), weight), with act(x) recomputed in backward instead of kept. `act` is a
    module with `grad(x, grad_out)`, the input gradient of act at x (`mist.models.mlp.Activation`)."""
    return _ActLinear.apply(x, weight, act)


def selective_modes(recompute) -> tuple[str, ...]:
    """The SELECTIVE parts named by an analysis `recompute` value ("attention+activation" etc.)."""
    if not isinstance(recompute, str):
        return ()
    parts = tuple(p for p in recompute.split("+") if p)
    if not parts or any(p not in SELECTIVE for p in parts):
        raise ValueError(f"unknown selective recomputation {recompute!r}; parts are {', '.join(SELECTIVE)}")
    return tuple(p for p in SELECTIVE if p in parts)


def selective_name(attention: bool, activation: bool):
    """The analysis `recompute` value of the blocks not checkpointed whole (False: none)."""
    name = "+".join(p for p, on in zip(SELECTIVE, (attention, activation)) if on)
    return name or False


def run_block_as(block: torch.nn.Module, x: torch.Tensor, recompute) -> torch.Tensor:
    """`run_block` by an analysis `recompute` value: False, True or the selective parts."""
    sel = selective_modes(recompute)
    return run_block(block, x, recompute is True, attention="attention" in sel, activation="activation" in sel)


def select_parts(block: torch.nn.Module, attention: bool, activation: bool) -> None:
    """Set which SELECTIVE parts of `block` recompute themselves in its backward."""
    block.attn.recompute_core, block.mlp.recompute_activation = attention, activation


def run_block(
    block: torch.nn.Module, x: torch.Tensor, recompute: bool, attention: bool = False, activation: bool = False
) -> torch.Tensor:
    select_parts(block, attention and not recompute, activation and not recompute)
    if not recompute:
        return block(x)
    return checkpoint(block, x, dropout=block.spec.has_dropout)
