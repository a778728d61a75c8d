"""Regional `torch.compile` of the decoder blocks: the one place that says how a block is compiled.

`mist.runtime` runs the blocks of a plan with `TrainingSpec.compile_blocks` through
`compile_block`, and `mist.analysis.compiled` traces the same call with a capturing
`inner_compile`, so the forward and backward graphs it prices are the ones AOTAutograd hands to
Inductor: the same decompositions, the same joint-graph passes, the same partitioner choosing
what is saved for backward and what is recomputed (the code that is traced is the code that
runs). Only Inductor's code generation (the kernels it writes for those graphs) is not traced.

The block's batch and sequence dimensions are marked dynamic, so one compile serves every
micro-batch size and sequence length and its graphs are symbolic in both, like the eager trace
(a size of 1 is specialised by dynamo, and a micro-batch of 1 gets its own graph, as it gets its
own trace). Nothing else is dynamic: dynamo's automatic dynamic shapes is off for the blocks,
so what a block compiles to does not depend on what the process compiled before. With it on, a
size or float of the spec that differed between two earlier compiles of the same code (a Falcon
block's rotary fraction, then a Llama block's, in one process or in the parent of a forked
worker) became a symbol in every later compile: a graph other than the captured one, and under
context parallelism one dynamo then failed to lift.

Inside the compiled region the blocks run plain tensor code where eager runs hand-fused
operators (`torch.compiler.is_compiling()` in `mist.models`: RMSNorm, rotary, SwiGLU): Inductor
fuses the plain code, and an opaque operator would stop it.

Under the ZB-H1 schedule (`split`, `mist.rules.compiled_blocks.compile_mode`) the backward graph
is compiled as two (`mist.models.weight_split`): B, the input gradient, and W, the weight
gradients, which the schedule runs later. So that W can run after B, the saved tensors B reads
stay whole: no backward reuses a saved tensor's buffer for its own results (AOTAutograd's
donated buffers are off), and no compile is taken from AOTAutograd's cache, which could hold a
backward compiled whole.
"""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext

import torch

from mist.models.weight_split import SplitBackward, split_backward, tensor_edges


def _fresh_compile_threads_after_fork() -> None:
    """Inductor compiles generated code on a thread pool that a forked child inherits without its
    threads (PyTorch resets only its process pool at fork): a child that compiles would wait
    forever on the parent's pool. The runtime forks its CPU workers; this gives them a new one."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is not None:
        async_compile.AsyncCompile.pool.cache_clear()


os.register_at_fork(after_in_child=_fresh_compile_threads_after_fork)


class CompiledBlock:
    """A decoder block compiled with Inductor: called on x [b, s, h] like the block, and run by
    `mist.models.checkpointing.run_block` like it (its `attn`, `mlp` and `spec` are the block's).
    The block's modules and parameters stay the block's: the compiled code reads them."""

    def __init__(self, block: torch.nn.Module, backend, split: bool = False):
        self.block, self.attn, self.mlp, self.spec = block, block.attn, block.mlp, block.spec
        self._compiled = torch.compile(block, backend=backend)
        self.split = split  # the backward as B and W graphs (`mist.models.weight_split`)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import torch._functorch.config as functorch_config  # lazy: as `compile_block`

        torch._dynamo.maybe_mark_dynamic(x, 0)
        torch._dynamo.maybe_mark_dynamic(x, 1)
        # past dynamo's recompile limit a block would silently run eager, unlike its prediction
        split = (
            functorch_config.patch(donated_buffer=False, enable_autograd_cache=False) if self.split else nullcontext()
        )
        with (
            torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, automatic_dynamic_shapes=False),
            split,
        ):
            return self._compiled(x)


def is_parameter(name: str) -> bool:
    """Whether an input of dynamo's graph of a block (by its name) is one of its parameters."""
    return "_parameters_" in name


def compile_block(block: torch.nn.Module, inner_compile=None, on_graph=None, split: bool = False) -> CompiledBlock:
    """`block`, compiled with Inductor; with `split`, its backward as B and W
    (`mist.models.weight_split`). `inner_compile` replaces Inductor's code generation of each
    partitioned graph (`compile_fx`'s argument of that name: the forward, the backward or B and
    W), and `on_graph(gm, example_inputs)` sees dynamo's graph first: the analysis's capture."""
    if inner_compile is None and on_graph is None and not split:
        return CompiledBlock(block, "inductor")
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner  # lazy: Inductor only where blocks are compiled

    inner = compile_fx_inner if inner_compile is None else inner_compile

    def backend(gm, example_inputs):
        if on_graph is not None:
            on_graph(gm, example_inputs)
        if not split:
            return compile_fx(gm, example_inputs, inner_compile=inner)
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        weights = [i for i, name in enumerate(names) if is_parameter(name)]
        edges = tensor_edges(example_inputs)

        def split_inner(g, inputs, **kwargs):
            if not kwargs.get("is_backward"):
                return inner(g, inputs, **kwargs)
            split = split_backward(g, weights)
            if split.n_outputs != len(names):
                raise RuntimeError(f"a compiled block's backward has {split.n_outputs} outputs for {len(names)} inputs")
            b_fn = inner(split.b_gm, inputs, **kwargs)
            crossing = [c.meta["val"] for c in split.crossing]
            w_fn = inner(split.w_gm, crossing, **{**kwargs, "static_input_idxs": ()})
            return SplitBackward(split, b_fn, w_fn, edges)

        return compile_fx(gm, example_inputs, inner_compile=split_inner)

    return CompiledBlock(block, backend, split)
