"""The private PyTorch APIs of `mist.torch_compat` exist and behave as Mist uses them.

A PyTorch release not in CHECKED_VERSIONS gets a warning, not a failure: the behaviour tests below
are what decide whether it still works (add the release to CHECKED_VERSIONS once they pass)."""

import warnings

import pytest
import torch

from mist import torch_compat as tc


def test_running_torch_is_a_checked_version():
    release = tc.torch_release()
    if release not in tc.CHECKED_VERSIONS:
        warnings.warn(
            f"PyTorch {release} is not among the versions mist.torch_compat was checked on "
            f"({', '.join(tc.CHECKED_VERSIONS)}); if the tests of tests/test_torch_compat.py "
            "pass, add it to CHECKED_VERSIONS.",
            UserWarning,
            stacklevel=1,
        )
    assert all(v.count(".") == 2 and "+" not in v for v in tc.CHECKED_VERSIONS)


def test_every_name_is_there():
    for name in tc.__all__:
        assert getattr(tc, name) is not None, name
    with pytest.raises(AttributeError):
        tc.no_such_name  # noqa: B018


@pytest.mark.skipif(not tc.HAS_FUSED_ADAM, reason="this PyTorch has no torch._fused_adamw_")
def test_fused_adamw_is_one_adamw_step():
    """Three steps of `fused_adamw_` over two tensors give torch.optim.AdamW's (single-tensor,
    unfused): one with weight decay, one without."""
    _check_fused_adam(torch.device("cpu"))


@pytest.mark.gpu
def test_fused_adamw_on_cuda_is_one_adamw_step():
    _check_fused_adam(torch.device("cuda"))


def _check_fused_adam(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    hp = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    for wd, n in ((0.1, 257), (0.0, 31)):
        p0 = torch.randn(n, generator=gen).to(device)
        grads = [torch.randn(n, generator=gen).to(device) for _ in range(3)]
        p, m, v = p0.clone(), torch.zeros(n, device=device), torch.zeros(n, device=device)
        for step, g in enumerate(grads, start=1):
            tc.fused_adamw_([p], [g], [m], [v], step=step, weight_decay=wd, **hp)

        ref = p0.clone().requires_grad_(True)
        opt = torch.optim.AdamW(
            [ref],
            lr=hp["lr"],
            betas=(hp["beta1"], hp["beta2"]),
            eps=hp["eps"],
            weight_decay=wd,
            foreach=False,
            fused=False,
        )
        for g in grads:
            ref.grad = g.clone()
            opt.step()
        torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(m, opt.state[ref]["exp_avg"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v, opt.state[ref]["exp_avg_sq"], rtol=1e-6, atol=1e-7)


def test_fake_tensors_with_symbolic_sizes():
    """Under FakeTensorMode with a ShapeEnv, dynamic dimensions are SymInts whose `node.expr` is
    a sympy symbol, sizes of results are expressions in them, and no data is allocated. The
    tracer's mode (`symbolic_fake_mode`) adds no entry to the dispatch cache."""
    import sympy

    mode = tc.symbolic_fake_mode()
    assert mode.shape_env is not None and mode.cache_enabled is False
    tc.FakeTensorMode.cache_clear()
    with mode:
        with tc.unset_fake_temporarily():
            real = torch.zeros((3, 5, 8))
            assert type(real) is torch.Tensor and real.sum().item() == 0.0
        dyn = [tc.DimDynamic.DYNAMIC] * 2 + [tc.DimDynamic.STATIC]
        x = mode.from_tensor(real, symbolic_context=tc.StatelessSymbolicContext(dynamic_sizes=dyn))
        b, s = x.shape[0], x.shape[1]
        assert isinstance(b, torch.SymInt) and isinstance(s, torch.SymInt) and x.shape[2] == 8
        eb, es = sympy.sympify(b.node.expr), sympy.sympify(s.node.expr)
        assert eb.is_Symbol and es.is_Symbol and eb != es
        y = (x @ torch.zeros((8, 4))).reshape(-1, 4)
        assert sympy.expand(sympy.sympify(y.shape[0].node.expr) - eb * es) == 0
        assert type(y).__name__ == "FakeTensor"
    assert len(tc.FakeTensorMode.cache) == 0 and tc.FakeTensorMode.cache_info().misses == 0


def test_dispatch_mode_sees_aten_calls_and_pytree_flattens_them():
    seen = []

    class Recorder(tc.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            leaves = tc.pytree.tree_leaves((args, kwargs or {}))
            seen.append(
                (func.namespace, func.overloadpacket.__name__, sum(isinstance(a, torch.Tensor) for a in leaves))
            )
            return out

    a, b = torch.ones(2, 3), torch.ones(3, 4)
    with Recorder():
        c = torch.mm(a, b)
    assert ("aten", "mm", 2) in seen and c.shape == (2, 4)
    assert tc.pytree.tree_leaves({"x": [1, (2, 3)], "y": 4}) == [1, 2, 3, 4]


def test_storage_id_tells_buffers_apart():
    x = torch.zeros(8)
    y = torch.zeros(8)
    assert tc.storage_id(x) == tc.storage_id(x[2:5]) == tc.storage_id(x.view(2, 4))
    assert tc.storage_id(x) != tc.storage_id(y)
    with tc.FakeTensorMode():
        f, g = torch.empty(4), torch.empty(4)
        assert tc.storage_id(f) == tc.storage_id(f[1:]) and tc.storage_id(f) != tc.storage_id(g)


def test_symbolic_shapes_stay_out_of_a_plain_import():
    """Importing the module does not import sympy's symbolic-shape machinery (the runtime's
    start-up does not need it)."""
    import subprocess
    import sys

    code = "import sys, mist.torch_compat; print('torch.fx.experimental.symbolic_shapes' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
