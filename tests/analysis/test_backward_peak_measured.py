"""A block's traced backward peak against what PyTorch's CPU allocator holds while the same block
runs its backward (`runtime.allocator_trace`): the eager engine releases what a node saved, and the
gradients handed to it, only when the node is done — a linear's saved input is still there while
its input gradient is made beside its weight gradient."""

from pathlib import Path

import numpy as np
import pytest
import torch

from mist.analysis.layer import analyze_layer
from mist.models.block import DecoderBlock
from mist.models.checkpointing import run_block
from mist.models.collectives import TPGroup
from mist.runtime.allocator_trace import AllocatorTrace
from mist.specs.loading import load_model

MODELS = Path(__file__).resolve().parents[2] / "benchmarks" / "models"
B, S = 2, 256


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("name", ["loop-gpt", "loop-llama"])
def test_a_blocks_backward_peak_is_the_traced_one(name, recompute):
    """Also a block checkpointed whole: its reentrant backward re-runs the forward and then runs a
    backward of its own, whose nodes release what they saved when they are done too (before the
    tracer hooked those nodes, the GPT block's traced peak was 4 MiB short)."""
    spec = load_model(str(MODELS / f"{name}.yaml"))
    torch.manual_seed(0)
    blk = DecoderBlock(spec, TPGroup(), True, torch.float32)
    for p in blk.parameters():
        torch.nn.init.normal_(p, std=0.02)
        p.grad = torch.zeros_like(p)  # the runtime's gradients are views of its flat buffers
    with torch.no_grad():  # builds what the process keeps once (Llama's rotary tables)
        blk(torch.randn(B, S, spec.hidden_size))
    trace = AllocatorTrace()
    x = torch.randn(B, S, spec.hidden_size, requires_grad=True)
    out = run_block(blk, x, recompute)
    g = torch.randn_like(out)
    trace.mark()
    out.backward(g)
    measured = trace.stop().peak_bytes
    la = analyze_layer(spec, "block", 1, True, "fp32", "cpu", recompute=recompute)
    predicted = float(la.bwd_peak(np.array([float(B)]), np.array([float(S)]))[0])
    # the traced peak has the saved activations and the output's gradient; the test also holds
    # the block's output (the next block's input in a stage, counted there)
    assert measured == predicted + out.untyped_storage().nbytes()
