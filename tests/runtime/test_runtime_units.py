"""Runtime pieces without processes: TP slices and seeded init, data, buffers, schedule, hooks."""

import gc
import math
import weakref

import numpy as np
import pytest
import torch
from rt_helpers import SPECS, make_plan

from mist.errors import MistInputError
from mist.models import CausalLM, TPGroup, init_weights
from mist.runtime.activations import SavedTensorManager
from mist.runtime.buffers import SplitBuffer, split_point
from mist.runtime.data import SyntheticData, TokenFileData, byte_tokens, make_data, split_micro_batches
from mist.runtime.memory import MemoryAccount
from mist.runtime.optimizer import LossScaler, adamw_, lr_at
from mist.runtime.sharding import init_stage_params, tp_slice
from mist.runtime.stage_runner import StageModule
from mist.runtime.trainer import model_flops_per_step


def _stage_shards(spec, tp, seed, first_layer=0, layers=None, first=True, last=True):
    out = []
    for r in range(tp):
        m = StageModule(
            spec, TPGroup(tp, r), True, first, last, spec.num_layers if layers is None else layers, first_layer
        )
        local = {m.full_name(n): p for n, p in m.named_parameters()}
        init_stage_params(local, spec, tp, r, seed)
        out.append(local)
    return out


@pytest.mark.parametrize("family,tp", [("gpt", 1), ("gpt", 2), ("gpt", 4), ("llama", 2), ("falcon", 2), ("falcon", 4)])
def test_tp_shards_reassemble_the_seeded_full_model(family, tp):
    """Each rank's slices of the streamed init, put back with the same indices, are exactly the
    single-process `init_weights` model (every row/column covered; KV copies identical)."""
    spec = SPECS[family]
    full = CausalLM(spec, dtype=torch.float32)
    init_weights(full, 5)
    shards = _stage_shards(spec, tp, 5)
    for name, want in full.named_parameters():
        got = torch.full_like(want, float("nan"))
        for r, local in enumerate(shards):
            sl = tp_slice(name, spec, tp, r)
            if sl is None:
                assert torch.equal(local[name].detach(), want.detach()), name
                got = local[name].detach().clone()
            else:
                piece = local[name].detach()
                prev = got.index_select(sl[0], sl[1])
                # rows written by two ranks (KV-head copies) must agree
                seen = ~torch.isnan(prev)
                assert torch.equal(prev[seen], piece[seen]), name
                got.index_copy_(sl[0], sl[1], piece)
        assert torch.equal(got, want.detach()), name


def test_a_later_stage_gets_the_same_blocks():
    spec = SPECS["llama"]
    full = CausalLM(spec, dtype=torch.float32)
    init_weights(full, 1)
    (local,) = _stage_shards(spec, 1, 1, first_layer=1, layers=2, first=False, last=True)
    want = dict(full.named_parameters())
    assert set(local) == {n for n in want if not n.startswith(("embedding", "blocks.0."))}
    for n, p in local.items():
        assert torch.equal(p.detach(), want[n].detach()), n


def test_global_batch_split_is_layout_independent():
    data = SyntheticData(128, 8, 8, seed=2)
    batch = data.global_batch(0)
    assert torch.equal(batch, SyntheticData(128, 8, 8, seed=2).global_batch(0))
    assert not torch.equal(batch, data.global_batch(1))
    for G, dp in ((1, 1), (2, 2), (4, 2), (1, 4)):
        seqs = []
        for g in range(G):
            for d in range(dp):
                x, y = split_micro_batches(batch, G, dp, d)[g]
                assert torch.equal(x[:, 1:], y[:, :-1])
                seqs.append(torch.cat([x, y[:, -1:]], dim=1))
        assert torch.equal(torch.cat(seqs), batch)


def test_token_files(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_bytes(bytes(range(256)) * 3)  # byte-level: any bytes are tokens
    assert byte_tokens(b"\x00\x7f\xff", 128).tolist() == [0, 127, 127]
    d = TokenFileData(txt, 300, 16, 4)
    b = d.global_batch(0)
    assert b.shape == (4, 17) and b.max() < 300
    assert torch.equal(b[0, :17], torch.arange(17))
    npy = tmp_path / "t.npy"
    np.save(npy, np.arange(100) % 50)
    assert make_data(str(npy), 64, 8, 2, 0).global_batch(3).shape == (2, 9)
    np.save(npy, np.arange(100))
    with pytest.raises(MistInputError, match="outside the model's vocabulary"):
        make_data(str(npy), 64, 8, 2, 0)
    with pytest.raises(MistInputError, match="fewer than one sequence"):
        make_data(str(txt), 300, 1000, 2, 0)
    with pytest.raises(MistInputError, match="does not exist"):
        make_data(str(tmp_path / "missing.txt"), 64, 8, 2, 0)


def test_synthetic_data_takes_every_seed():
    """Seeds up to 2**63 - 1 (what --seed allows) seed the generators; small seeds are unchanged."""
    top = SyntheticData(128, 8, 2, 2**63 - 1).global_batch(5)
    assert top.shape == (2, 9) and 0 <= int(top.min()) and int(top.max()) < 128
    g = torch.Generator().manual_seed(3 * 1_000_003 + 1)
    assert int(SyntheticData(128, 8, 2, 3).global_batch(0)[0, 0]) == int(torch.randint(128, (2,), generator=g)[0])


@pytest.mark.parametrize("ratio", [0.0, 0.3, 1.0])
def test_split_buffer(ratio):
    buf = SplitBuffer(10, ratio, torch.float32, torch.device("cpu"))
    assert buf.dev.numel() == split_point(10, ratio) and buf.host.numel() == 10 - buf.dev.numel()
    assert buf.dev.data_ptr() != buf.host.data_ptr() or buf.host.numel() == 0
    x = torch.arange(10.0)
    buf.copy_(x)
    buf.add_(x)
    assert torch.equal(buf.read(0, 10, "cpu"), 2 * x)
    assert torch.equal(buf.read(3, 9, "cpu"), 2 * x[3:9])
    buf.write(4, torch.zeros(3))
    assert buf.read(0, 10, "cpu").tolist() == [0, 2, 4, 6, 0, 0, 0, 14, 16, 18]


def test_lr_schedule_and_loss_scaler():
    lrs = [lr_at(s, 1.0, 4, 20, 0.1) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert lr_at(20, 1.0, 4, 20, 0.1) == pytest.approx(0.1)
    sc = LossScaler(True, init=8.0, interval=2)
    sc.update(True)
    assert sc.scale == 4.0
    sc.update(False)
    sc.update(False)
    assert sc.scale == 8.0
    assert LossScaler(False).scale == 1.0


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_adamw_matches_torch(impl):
    """Bit for bit PyTorch's fused AdamW (the kernel `adamw_` calls); PyTorch's unfused AdamW
    orders its arithmetic differently, so there the match is to fp32 rounding."""
    torch.manual_seed(0)
    p0, grads = torch.randn(50), [torch.randn(50) for _ in range(3)]
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **{impl: True})
    p, m, v = p0.clone(), torch.zeros(50), torch.zeros(50)
    for i, g in enumerate(grads):
        ref.grad = g.clone()
        opt.step()
        adamw_(
            p,
            m,
            v,
            g.clone(),
            step=i + 1,
            lr=1e-2,
            beta1=0.9,
            beta2=0.95,
            eps=1e-8,
            weight_decay=0.1,
            decay_ranges=[(0, 50)],
        )
    if impl == "fused":
        assert torch.equal(p, ref.detach())
    else:
        torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)


def test_activation_offload_roundtrip():
    mem = MemoryAccount()
    mgr = SavedTensorManager(torch.device("cpu"), mem, lambda t: False)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def f():
        return (torch.tanh(x @ w) * torch.sigmoid(x @ w)).sum()

    f().backward()
    want = w.grad.clone()
    w.grad = None
    mgr.ratio = 0.5
    with mgr.hooks():
        y = f()
    assert mgr.offloaded_bytes > 0
    y.backward()
    assert torch.equal(w.grad, want)


def test_offloaded_blocks_come_back_one_ahead_and_need_no_garbage_collector():
    """Backward brings a block's offloaded tensors back at its first unpack and starts on the
    block below (so its copies overlap this block's backward); with the garbage collector off,
    every offloaded piece is freed once backward is done with it (no reference cycle holds the
    device heads or the host tails); the gradients are those of a plain backward."""
    mem = MemoryAccount()
    mgr = SavedTensorManager(torch.device("cpu"), mem, lambda t: False)
    torch.manual_seed(0)
    ws = [torch.randn(8, 8, requires_grad=True) for _ in range(3)]
    x0 = torch.randn(4, 8)

    def run(ratio: float):
        x = x0
        for w in ws:
            with mgr.layer(ratio, by_storage=False):
                x = torch.tanh(x @ w) * torch.sigmoid(x @ w)
        return x.sum()

    run(0.0).backward()
    want = [w.grad.clone() for w in ws]
    for w in ws:
        w.grad = None
    made, order, fetched = [], {}, []
    offload, fetch = mgr._offload, mgr._fetch

    def spy_offload(flat, shape):
        packed = offload(flat, shape)
        made.extend((weakref.ref(packed.head), weakref.ref(packed.tail)))
        order.setdefault(id(packed.group), len(order))
        return packed

    def spy_fetch(group):
        fetched.append(order[id(group)])
        fetch(group)

    mgr._offload, mgr._fetch = spy_offload, spy_fetch
    gc.disable()
    try:
        mgr.new_micro_batch()
        with mgr.hooks():
            y = run(0.5)
        assert len(order) == 3 and len(made) >= 6
        y.backward()
        del y
        assert fetched == [2, 1, 0]
        assert [r for r in made if r() is not None] == []
    finally:
        gc.enable()
    for w, g in zip(ws, want):
        torch.testing.assert_close(w.grad, g)
    assert mgr.host_bytes == 0


def test_model_flops():
    plan = make_plan("llama", dp=2)
    m, t = plan.model, plan.training
    T = t.global_batch * t.seq_len
    assert model_flops_per_step(plan) == 6 * m.total_params() * T + 12 * m.num_layers * m.hidden_size * t.seq_len * T
    assert math.isfinite(model_flops_per_step(plan))
