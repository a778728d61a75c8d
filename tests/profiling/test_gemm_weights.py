"""The GEMM grid's weights are drawn as the runtime initialises a model's: normal(0, INIT_STD)."""

import torch

from mist.profiling.compute import COLD_BYTES, cold_weights
from mist.profiling.timing import Device
from mist.rules.init_seeds import INIT_STD


def _rand(r, c):
    return torch.randn(r, c, generator=torch.Generator().manual_seed(0))


def test_cycled_weights_have_the_runtime_s_init_scale():
    cache: dict = {}
    ws = cold_weights(512, 1024, Device("cpu"), _rand, cache)
    assert len(ws) > 1 and all(w.shape == (512, 1024) for w in ws)
    std = torch.cat([w.reshape(-1) for w in ws]).std().item()
    assert abs(std / INIT_STD - 1) < 0.01, std


def test_a_weight_as_large_as_the_pool_is_one_tensor_of_the_same_scale():
    n = COLD_BYTES // 4 // 1024  # fp32: exactly COLD_BYTES
    cache: dict = {}
    (w,) = cold_weights(n, 1024, Device("cpu"), _rand, cache)
    assert w.shape == (n, 1024)
    assert abs(w.std().item() / INIT_STD - 1) < 0.01
    assert cold_weights(n, 1024, Device("cpu"), _rand, cache)[0] is w  # cached by shape
