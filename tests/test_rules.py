"""The rules shared by the runtime and the simulator (`mist.rules`): each gives the same results on
Python numbers and on numpy arrays, and both sides apply it (the runtime's buffers, hooks and
schedules agree with the simulator's predictions through it)."""

import ast
import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import mist.rules
from mist.models import CausalLM, init_weights
from mist.rules import (
    flat_units,
    grad_accumulation,
    init_seeds,
    offload_split,
    optimizer_step,
    pipeline_order,
)
from mist.runtime import activations, optimizer, sharding
from mist.runtime.buffers import SplitBuffer, split_point
from mist.runtime.flat import Comms, FlatUnit
from mist.runtime.memory import MemoryAccount
from mist.runtime.param_role import ParamRole
from mist.runtime.schedule import Links, PipelineSchedule
from mist.simulate import pipeline, stage, states
from mist.simulate.precision import Precision
from mist.specs.model import ModelSpec

RULES = Path(mist.rules.__file__).parent
RATIOS = (0.0, 0.1, 0.25, 0.3, 0.5, 0.75, 1.0)


def test_rules_are_a_leaf_without_torch():
    """Every rule module imports only the standard library, numpy and other rules."""
    for path in RULES.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top == "numpy" or name.startswith("mist.rules"), (path, name)


# ------------------------------------------------------------------ offload split
def test_offload_split_on_ints_and_arrays():
    ns = np.arange(0, 41)
    for r in RATIOS:
        dev = offload_split.device_elements(ns.astype(np.float64), r)
        for n in ns:
            d = offload_split.device_elements(int(n), r)
            assert isinstance(d, int)
            buf = SplitBuffer(int(n), r, torch.float32, "cpu")
            assert d == dev[n] == split_point(int(n), r) == buf.dev_len
            assert d + offload_split.host_elements(int(n), r) == n
    # halves round to even on both sides: 2·0.25 = 0.5 → 0, 6·0.25 = 1.5 → 2
    assert offload_split.host_elements(2, 0.25) == 0 and offload_split.host_elements(6, 0.25) == 2
    assert list(offload_split.host_elements(np.array([2.0, 6.0]), 0.25)) == [0.0, 2.0]
    assert list(offload_split.splits_saved(np.array([0, 1, 2, 5]), 0.5)) == [False, False, True, True]
    assert offload_split.splits_saved(1, 0.5) is False and offload_split.splits_saved(2, 0.0) is False


@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.5, 1.0])
def test_saved_tensor_split_is_what_the_runtime_packs(ratio):
    """The runtime's pack hook keeps (and moves to the host) exactly the bytes the rule sums."""
    shapes = [(3, 5), (7,), (1,), (2, 3, 3), (1, 1), (11,)]
    dtypes = [torch.float32, torch.float16, torch.float32, torch.bfloat16, torch.float32, torch.int64]
    tensors = [torch.ones(s, dtype=d) for s, d in zip(shapes, dtypes)]
    mem = MemoryAccount()
    mgr = activations.SavedTensorManager("cpu", mem, is_weight=lambda t: False)
    mgr.ratio = ratio
    for t in tensors:
        mgr.pack(t)
    numel = np.array([t.numel() for t in tensors], dtype=np.float64)
    elt = np.array([t.element_size() for t in tensors], dtype=np.float64)
    split = offload_split.splits_saved(numel, ratio) | (ratio == 0)
    full = float(sum(t.untyped_storage().nbytes() for t in tensors))
    whole = float((numel * elt)[~split].sum())
    n, e = numel[split, None], elt[split, None]  # [tensors, one candidate]
    kept = offload_split.kept_saved_bytes(n, e, whole, full, np.array([ratio]))
    host = offload_split.offloaded_saved_bytes(n, e, np.array([ratio]))
    assert kept[0] == mem.activations
    assert host[0] == mgr.offloaded_bytes
    # the simulator's block terms go through the same sums
    ix = np.array([0])
    assert stage._kept_saved(full, n, e, np.array([whole]), ix, ratio)[0] == kept[0]
    assert stage._offloaded_saved(n, e, ix, ratio)[0] == host[0]


# ------------------------------------------------------------------ flat units
GRID = list(itertools.product([1, 7, 64, 1001], [1, 2, 3, 4], [0, 1, 2, 3], [1, 2]))


def test_flat_unit_lengths_on_ints_and_arrays():
    n, dp, zero, G1 = (np.array(c, dtype=np.float64) for c in zip(*GRID))
    arrays = [flat_units.unit_lengths(n, dp, zero, G1 * 0 + g) for g in (1, 2)]
    for k, (ni, dpi, zi, g) in enumerate(GRID):
        ints = flat_units.unit_lengths(ni, dpi, zi, g)
        assert all(isinstance(v, int) for v in ints)
        assert ints == tuple(a[k] for a in arrays[g - 1])
        shard = flat_units.shard_len(ni, dpi)
        assert flat_units.padded_len(ni, dpi) == shard * dpi >= ni > (shard - 1) * dpi


def _unit(n, dp, rank, zero, G, wo=0.0, go=0.0, oo=0.0, dtype=torch.float32):
    lin = nn.Linear(n, 1, bias=False, dtype=dtype)
    params = [("w", lin.weight, [(lin, "weight")])]
    return FlatUnit(
        "u",
        params,
        [ParamRole(True)],
        dtype=dtype,
        device="cpu",
        comms=Comms(dp, rank, None),
        zero=zero,
        weights=wo,
        grads=go,
        optimizer=oo,
        micro_batches=G,
        memory=MemoryAccount(),
    )


@pytest.mark.parametrize("n,dp,zero,G", [c for c in GRID if c[0] in (7, 1001)])
def test_flat_unit_buffers_are_what_the_simulator_counts(n, dp, zero, G):
    """The runtime's buffers have the rule's lengths, and the simulator's bytes are theirs."""
    wo, go, oo = 0.3, 0.5, 0.25
    u = _unit(n, dp, dp - 1, zero, G, wo, go, oo)
    w_len, g_len, o_len = flat_units.unit_lengths(n, dp, zero, G)
    assert (u.shard_len, u.Np, u.L) == (flat_units.shard_len(n, dp), flat_units.padded_len(n, dp), o_len)
    assert u.opt_lo == flat_units.optimizer_start(u.shard_len, dp - 1, zero)
    assert (u.store.length, u.acc.length, u.master.length) == (w_len, g_len, o_len)
    prec = Precision(weight_bytes=4, grad_bytes=4)
    dev = states.unit_states(float(n), dp, zero, wo, go, oo, G, prec)
    host = states.unit_host_states(float(n), dp, zero, wo, go, oo, G, prec)
    assert [float(x) for x in dev] == [u.store.device_bytes, u.acc.device_bytes, 3 * u.master.device_bytes]
    assert [float(x) for x in host[:3]] == [u.store.host_bytes, u.acc.host_bytes, 3 * u.master.host_bytes]


@pytest.mark.parametrize("zero,wo", [(0, 0.0), (2, 0.0), (3, 0.0), (0, 0.5), (1, 1.0)])
def test_weights_persist_unless_sharded_or_offloaded(zero, wo):
    u = _unit(10, 2, 0, zero, 2, wo=wo)
    assert u.persistent == (not flat_units.materializes_weights(zero, wo))
    assert list(flat_units.materializes_weights(np.array([zero]), np.array([wo]))) == [not u.persistent]


@pytest.mark.parametrize(
    "zero,wo,oo", [(0, 0.5, 0.0), (0, 0.3, 0.75), (0, 0.75, 0.25), (3, 0.0, 0.5), (3, 0.5, 0.5), (3, 1.0, 0.1)]
)
def test_new_weights_cross_the_host_link_as_the_rule_says(zero, wo, oo):
    """A step writes the new working weights from the master into a store split between device
    and host: the elements that cross (the master's device part landing in the store's host tail,
    and the other way) are `update_crossing`'s, which the simulator prices."""
    u = _unit(1001, 1, 0, zero, 2, wo=wo, oo=oo)
    writes, real = [], u.store.write
    u.store.write = lambda lo, src: (writes.append((lo, src.numel())), real(lo, src))
    u.update_weights()
    d = u.master.dev_len
    out_n = sum(b - a for lo, n in writes if lo < d for part, a, b, _ in u.store.pieces(lo, lo + n) if part == "host")
    in_n = sum(b - a for lo, n in writes if lo >= d for part, a, b, _ in u.store.pieces(lo, lo + n) if part == "dev")
    assert sum(n for _, n in writes) == u.store.length
    assert (out_n, in_n) == tuple(int(x) for x in offload_split.update_crossing(u.store.length, wo, oo))


@pytest.mark.parametrize(
    "dtype,zero,go,oo",
    [
        (torch.float32, 0, 0.0, 0.0),
        (torch.float32, 0, 0.5, 0.25),
        (torch.float32, 0, 0.7, 0.1),
        (torch.float32, 0, 0.42, 0.4),  # the first piece read beyond the head: 25 elements
        (torch.float32, 1, 0.25, 0.5),
        (torch.bfloat16, 0, 0.0, 0.0),
        (torch.bfloat16, 2, 0.3, 0.6),
    ],
)
def test_the_steps_fp32_gradient_pieces_are_the_rules(monkeypatch, dtype, zero, go, oo):
    """The device AdamW reads a unit's gradient piece by piece: the fp32 pieces it allocates (the
    reads that are not views of the buffer) are at most `update_read_elements` long, and one that
    long exists; the simulator's step piece is 4 bytes each (a CPU's host AdamW converts in host
    memory: no device piece beyond d)."""
    monkeypatch.setattr(optimizer_step, "STEP_CHUNK", 64)
    u = _unit(1001, 1, 0, zero, 2, go=go, oo=oo, dtype=dtype)
    u.opt_grad = u.acc
    reads, real = [], u.acc.read

    def read(lo, hi, where, dt=None):
        out = real(lo, hi, where, dt)
        view = out.untyped_storage().data_ptr() in (
            u.acc.dev.untyped_storage().data_ptr(),
            u.acc.host.untyped_storage().data_ptr(),
        )
        reads.append((lo, hi, view))
        return out

    u.acc.read = read
    opt = optimizer.ShardedAdamW([u])
    opt._update(1.0, dict(step=1, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1))
    opt.close()
    d, g_dev = u.master.dev_len, u.acc.dev_len
    device_reads = [(lo, hi, view) for lo, hi, view in reads if lo < d]
    assert [(lo, hi) for lo, hi, _ in device_reads] == optimizer_step.chunks(0, d)
    largest = max((hi - lo for lo, hi, view in device_reads if not view), default=0)
    assert largest == optimizer_step.update_read_elements(d, g_dev, dtype == torch.float32)
    prec = Precision(weight_bytes=dtype.itemsize, grad_bytes=dtype.itemsize, target="cpu")
    assert float(states.unit_step_piece(1001.0, 1, zero, go, oo, 2, prec)) == 4 * largest
    arr = optimizer_step.update_read_elements(np.array([d, d]), np.array([g_dev, g_dev]), dtype == torch.float32)
    assert list(arr) == [largest, largest]


# ------------------------------------------------------------------ gradient accumulation
@pytest.mark.parametrize("dp,zero,G,go", list(itertools.product([2, 4], [0, 1, 2, 3], [1, 3], [0.0, 0.5])))
def test_in_place_accumulation_runtime_and_simulator(dp, zero, G, go):
    u = _unit(33, dp, 1, zero, G, go=go)
    by_len = grad_accumulation.accumulates_in_place(u.acc.length, u.Np, u.acc.length - u.acc.dev_len)
    by_level = grad_accumulation.accumulates_in_place_by_level(zero, go, G)
    assert u.in_place == by_len == by_level == bool(stage._in_place_grads(zero, go, G))
    arr = grad_accumulation.accumulates_in_place_by_level(np.array([zero]), np.array([go]), G)
    assert list(arr) == [by_level]


def test_in_place_with_one_rank_follows_the_lengths():
    """With dp = 1 a 'shard' is the whole buffer: the runtime accumulates it in place at every
    ZeRO level (the level form, which the simulator uses, assumes dp > 1)."""
    u = _unit(33, 1, 0, 2, 1)
    assert u.in_place and grad_accumulation.accumulates_in_place(u.acc.length, u.Np, 0)
    assert not grad_accumulation.accumulates_in_place_by_level(2, 0.0, 1)


# ------------------------------------------------------------------ 1F1B order
class _Recorder:
    """A stand-in stage runner that records the forwards and backwards a schedule runs."""

    def __init__(self):
        self.ops, self.w = [], torch.ones((), requires_grad=True)
        self.saved = type("Saved", (), {"memory": MemoryAccount()})()

    def begin_forward(self):
        return 0

    def forward(self, x, targets):
        self.ops.append(("F", int(x.detach())))
        return x * self.w

    def begin_backward(self, g, last):
        self.ops.append(("B", g))

    def end_backward(self, act):
        pass


def _runtime_order(i, stages, G):
    sched = PipelineSchedule(G, i, stages, Links(), "cpu")
    sched._recv_act = lambda g: torch.tensor(float(g), requires_grad=True)
    sched._recv_grad = lambda out, g: torch.ones(out.shape, dtype=out.dtype)  # (out: a sent output)
    sched._send_act = sched._send_grad = lambda *a: None
    runner = _Recorder()
    sched.run(runner, [(torch.tensor(float(g)), None) for g in range(G)])
    return runner.ops


@pytest.mark.parametrize("stages,G", [(1, 3), (2, 1), (3, 2), (4, 4), (4, 7)])
def test_one_order_for_runtime_and_simulator(stages, G):
    fwd, bwd = [1.0 + i for i in range(stages)], [2.0] * stages
    _, events = pipeline.event_schedule(fwd, bwd, [0.0] * stages, [0.0] * stages, G)
    for i in range(stages):
        order = list(pipeline_order.one_f_one_b(i, stages, G))
        assert sorted(order) == sorted([(k, g) for k in "FB" for g in range(G)])
        assert order == pipeline.one_f_one_b_order(i, stages, G) == _runtime_order(i, stages, G)
        assert order == [(k, m) for s, k, m, *_ in events if s == i and k in "FB"]
        # the warm-up, and the activations in flight at the stage's peak
        warm = pipeline_order.warmup_forwards(i, stages, G)
        assert warm == min(stages - 1 - i, G) and order[:warm] == [("F", g) for g in range(warm)]
        alive = np.cumsum([1 if k == "F" else -1 for k, _ in order])
        assert alive.max() - 1 == pipeline_order.earlier_in_flight(i, stages, G)


def test_pipeline_counts_on_arrays():
    i, S, G = np.meshgrid(np.arange(4), np.arange(1, 5), np.arange(1, 6), indexing="ij")
    warm = pipeline_order.warmup_forwards(i, S, G)
    flight = pipeline_order.earlier_in_flight(i, S, G)
    for k in np.ndindex(i.shape):
        args = (int(i[k]), int(S[k]), int(G[k]))
        assert warm[k] == pipeline_order.warmup_forwards(*args)
        assert flight[k] == pipeline_order.earlier_in_flight(*args)


# ------------------------------------------------------------------ seeded initialisation
def test_seeded_init_follows_the_rule_on_both_sides():
    spec = ModelSpec(
        family="gpt",
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=4,
        ffn_hidden_size=64,
        vocab_size=64,
        tie_embeddings=True,
        bias=True,
        max_position_embeddings=16,
        name="tiny-gpt",
    )
    model = CausalLM(spec, dtype=torch.float32)
    init_weights(model, 3)
    gen = torch.Generator().manual_seed(3)
    for name, p in model.named_parameters():
        val = sharding.init_value(name, p.shape, gen)
        assert (val is not None) == init_seeds.draws_normal(p.dim())
        want = val if val is not None else torch.full_like(p, init_seeds.init_constant(name))
        assert torch.equal(p.detach(), want), name
    assert init_seeds.init_constant("blocks.0.norm1.weight") == 1.0
    assert init_seeds.init_constant("blocks.0.norm1.bias") == 0.0
    assert init_seeds.init_constant("head.norm.weight") == 1.0
    assert list(init_seeds.draws_normal(np.array([0, 1, 2, 3]))) == [False, False, True, True]


def test_both_sides_import_each_rule():
    assert sharding.init_constant is init_seeds.init_constant
    assert activations.splits_saved is offload_split.splits_saved
    assert stage.kept_saved_bytes is offload_split.kept_saved_bytes
    assert stage.accumulates_in_place_by_level is grad_accumulation.accumulates_in_place_by_level
    assert pipeline.one_f_one_b is pipeline_order.one_f_one_b
    assert states.unit_lengths is flat_units.unit_lengths
    assert optimizer.chunks is optimizer_step.chunks
    assert states.update_read_elements is optimizer_step.update_read_elements
