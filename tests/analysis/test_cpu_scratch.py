"""The temporaries a CPU kernel writes an operator's out= arguments through (`Trace.cpu_scratch`),
against what PyTorch's CPU allocator hands out inside the operator."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from mist.analysis.tracer import _Expr, cpu_out_scratch

N = 4096
CASES = [
    # (inputs, out dtype): an fp32 product written into bf16, the reverse, one dtype throughout,
    # and a 0-dimensional fp32 factor, which does not promote a bf16 tensor (no temporary)
    ((torch.float32, torch.float32), torch.bfloat16),
    ((torch.bfloat16, torch.bfloat16), torch.float32),
    ((torch.float32, torch.float32), torch.float32),
    ((torch.bfloat16, "scalar fp32"), torch.bfloat16),
    ((torch.bfloat16, "scalar fp32"), torch.float32),
]


def _inputs(kinds):
    return [torch.ones((), dtype=torch.float32) if k == "scalar fp32" else torch.ones(N, dtype=k) for k in kinds]


@pytest.mark.parametrize("kinds,out_dtype", CASES)
def test_the_scratch_is_what_the_cpu_kernel_allocates(kinds, out_dtype):
    ins = _inputs(kinds)
    out = torch.empty(N, dtype=out_dtype)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.mul(*ins, out=out)
    allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0 and e.name == "aten::empty")
    assert cpu_out_scratch(ins, [out], _Expr({})) == allocated
