"""A compiled block (`mist.models.compiled`) keeps for backward exactly what the analysis of its
captured graphs predicts (`mist.analysis.compiled`): measured on real Inductor-compiled CPU blocks
with saved_tensors_hooks (unique storages, parameters excluded), tensor by tensor, with and without
whole-block recomputation, with flash and materialised attention; it computes what the eager block
computes, also with half of each saved storage offloaded to the host; and what the partitioner
keeps does not depend on the example sizes it is traced at."""

from collections import Counter
from dataclasses import replace

import pytest
import sympy
import torch

from mist.analysis import analyze_layer
from mist.analysis.compiled import capture, capture_training, trace_compiled
from mist.analysis.records import COLLECTIVE, B, S
from mist.models import DecoderBlock, TPGroup, init_weights
from mist.models.checkpointing import run_block, run_block_as, select_parts
from mist.models.compiled import compile_block
from mist.rules.compiled_blocks import SPLIT
from mist.rules.offload_split import MIN_SPLIT_NUMEL, kept_saved_bytes, offloaded_saved_bytes
from mist.runtime.activations import SavedTensorManager
from mist.runtime.memory import MemoryAccount
from mist.simulate.weight_grad import held_gradient_bytes
from mist.specs.model import ModelSpec

SPECS = {
    "gpt": ModelSpec(
        family="gpt",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=4,
        ffn_hidden_size=256,
        vocab_size=256,
        max_position_embeddings=128,
        bias=True,
    ),
    "llama": ModelSpec(
        family="llama",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=176,
        vocab_size=256,
        rotary_fraction=0.5,
    ),
    "falcon": ModelSpec(
        family="falcon",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=256,
        vocab_size=256,
        rotary_fraction=1.0,
    ),
}
SHAPES = [(1, 16), (3, 40)]


def _saved(fn) -> tuple[int, list[int]]:
    """(bytes of the distinct non-parameter storages autograd keeps during fn(), the elements of
    each of those storages)."""
    seen, keep = {}, []

    def pack(t):
        keep.append(t)
        if not isinstance(t, torch.nn.Parameter):
            st = t.untyped_storage()
            seen.setdefault(st.data_ptr(), (st.nbytes(), t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(n for n, _ in seen.values()), [n // e for n, e in seen.values()]


# (family, flash attention): Llama's RMSNorm, rotary, SwiGLU and GQA with flash attention; GPT's
# LayerNorm, GELU, biases and learned positions with materialised attention. (Falcon's parallel
# block and the other pairings run compiled in tests/runtime/test_runtime_compiled.py, whose saved
# bytes the simulator matches through this analysis.)
BLOCKS = [("llama", True), ("gpt", False)]


@pytest.fixture(scope="module", params=BLOCKS, ids=[f"{f}-{'flash' if fl else 'bmm'}" for f, fl in BLOCKS])
def compiled(request):
    # one block's compiles at a time: dynamo's recompile limit counts every graph of
    # DecoderBlock.forward in the process, whichever model it belongs to
    torch._dynamo.reset()
    family, flash = request.param
    spec = SPECS[family]
    block = DecoderBlock(spec, TPGroup(), flash, torch.float32)
    init_weights(block, 0)
    return spec, block, compile_block(block), flash


@pytest.mark.parametrize("recompute", [False, True])
def test_saved_bytes_equal_the_compiled_runtime(compiled, recompute):
    spec, block, run, flash = compiled
    la = analyze_layer(spec, "block", 1, flash, "fp32", "cpu", recompute, compiled=True)
    # (checkpointed, the block keeps its input alone: one shape checks that)
    for b, s in SHAPES if not recompute else SHAPES[-1:]:
        x = torch.randn(b, s, spec.hidden_size, requires_grad=True)
        got, numels = _saved(lambda x=x: run_block(run, x, recompute))
        assert got == pytest.approx(float(la.saved(b, s)), abs=0.5), (b, s)
        # storage by storage, as an activation offload splits a compiled block's
        big, _, _ = la.saved_split(b, s)
        assert sorted(n for n in numels if n >= MIN_SPLIT_NUMEL) == sorted(round(float(n)) for n in big)


def test_offloaded_storages_come_back_with_their_strides(compiled):
    """Half of every saved storage offloaded, whole, as the runtime splits a compiled block's: the
    compiled backward (which asserts the strides its forward saved) gets every view back and
    computes the eager gradients, and the bytes kept on the device and moved to the host are the
    analysis's split of the same storages."""
    spec, block, run, flash = compiled
    ratio, (b, s) = 0.5, SHAPES[-1]
    la = analyze_layer(spec, "block", 1, flash, "fp32", "cpu", False, compiled=True)
    numel, elt, whole = la.saved_split(b, s)
    mem = MemoryAccount()
    saved = SavedTensorManager("cpu", mem, is_weight=lambda t: isinstance(t, torch.nn.Parameter))
    torch.manual_seed(2)
    x = torch.randn(b, s, spec.hidden_size, requires_grad=True)
    g = torch.randn(b, s, spec.hidden_size)
    with saved.hooks(), saved.layer(ratio, by_storage=True):
        out = run(x)
    assert mem.activations == float(kept_saved_bytes(numel, elt, whole, 0.0, ratio))
    assert saved.host_bytes == float(offloaded_saved_bytes(numel, elt, ratio)) > 0
    grads = torch.autograd.grad(out, [x, *block.parameters()], g)
    assert saved.host_bytes == 0  # every offloaded storage came back
    ref_grads = torch.autograd.grad(block(x), [x, *block.parameters()], g)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)


def test_compiled_block_computes_the_eager_block(compiled):
    spec, block, run, _ = compiled
    torch.manual_seed(1)
    x = torch.randn(2, 24, spec.hidden_size, requires_grad=True)
    g = torch.randn(2, 24, spec.hidden_size)
    ref = block(x)
    ref_grads = torch.autograd.grad(ref, [x, *block.parameters()], g)
    out = run(x)
    grads = torch.autograd.grad(out, [x, *block.parameters()], g)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)


def test_compiled_block_does_the_eager_block_s_matrix_work(compiled):
    """The same GEMM and attention FLOPs, forward and backward: compiling fuses the elementwise
    work between them and changes no library call's size."""
    spec, _, _, flash = compiled
    eager, comp = (analyze_layer(spec, "block", 1, flash, "fp32", "cpu", compiled=c) for c in (False, True))
    for phase in ("fwd", "bwd"):
        assert float(comp.flops_of(phase, 3, 40)) == float(eager.flops_of(phase, 3, 40)) > 0


def test_a_split_backward_prices_its_weight_gradient_graph_apart(compiled):
    """The backward as B and W (ZB-H1, `mist.models.weight_split`): the same forward and saved
    bytes and the same matrix work as the whole backward; W's records are the weight-gradient
    GEMMs (2·tokens·in·out FLOPs for each linear weight) and the reductions only they need; and a
    micro-batch holds from B to W at least the gradient of every linear's output (what an eager
    block holds: the weight GEMMs' dY operands)."""
    spec, block, _, flash = compiled
    whole, split, eager = (
        analyze_layer(spec, "block", 1, flash, "fp32", "cpu", compiled=c) for c in (True, SPLIT, False)
    )
    b, s = 3, 40
    assert float(split.saved(b, s)) == float(whole.saved(b, s))
    assert float(split.flops_of("bwd", b, s)) == float(whole.flops_of("bwd", b, s))
    w = [r for r in split.ops("bwd") if r.weight_grad]
    assert w and all(r.weight_grad is False for r in split.ops("bwd") if r not in w)
    linear = [p for n, p in block.named_parameters() if p.dim() == 2]
    w_flops = sympy.expand(sum((r.flops for r in w), sympy.Integer(0)))
    assert w_flops == sympy.expand(sum(2 * B * S * p.numel() for p in linear))
    assert {r.op for r in w} <= {"mm", "fused"} and sum(r.op == "mm" for r in w) == len(linear)
    held = float(held_gradient_bytes(split).subs({B: b, S: s}))
    assert held >= float(held_gradient_bytes(eager).subs({B: b, S: s})) > 0
    assert whole.weight_grad_held is None and all(r.weight_grad is None for r in whole.records)
    # where the ZB-H1 runtime keeps the graph from B to W, B starts with every saved tensor and
    # lets go of those W does not read (`runtime.activations`), ending with all it hands W; W's
    # graph frees those values as it goes, so it adds less than all the parameters' gradients it
    # returns together
    saved = float(split.saved(b, s))
    unread = float(split.saved_unread_by_w.subs({B: b, S: s}))
    assert 0 < unread < saved and whole.saved_unread_by_w is None
    assert float(split.b_pass_peak(b, s)) >= max(saved, saved - unread + held)
    assert whole.b_pass_peak(b, s) is None
    # an eager block's B (`weight_pass.b_pass_bytes`) ends holding what its W reads: the saved tensors
    # it does not let go of and the output gradients
    e_held = float(held_gradient_bytes(eager).subs({B: b, S: s}))
    e_kept = float(eager.saved(b, s)) - float(eager.saved_unread_by_w.subs({B: b, S: s}))
    assert float(eager.b_pass_peak(b, s)) >= e_kept + e_held > e_held
    params_bytes = 4 * sum(p.numel() for p in block.parameters())
    w_rise = max(float(c.subs({B: b, S: s})) for c in split.weight_pass_peak)
    assert 0 < w_rise < params_bytes
    assert float(split.weight_pass_freed.subs({B: b, S: s})) == held


def _fused_work(la, phase: str, kind: str):
    return sympy.expand(sum((getattr(r.params, kind) for r in la.ops(phase) if r.op == "fused"), sympy.Integer(0)))


def test_fused_kernels_count_the_elements_they_compute(compiled):
    """What a fused kernel computes (`FusedParams`, priced by a profile's measured seconds per
    element-operation): GPT's GELU evaluates one tanh per element of the MLP's hidden activation
    in the forward and again in the backward (the partitioner recomputes it rather than save it),
    its materialised softmax one exp per score; Llama's SiLU one exp per hidden element, and its
    rotary tables, inlined by Inductor into the loops over q and k, a cos per element of those
    loops (b·s-proportional), not one per table entry."""
    spec, _, _, flash = compiled
    la = analyze_layer(spec, "block", 1, flash, "fp32", "cpu", compiled=True)
    bs = B * S
    if spec.family == "gpt":
        assert _fused_work(la, "fwd", "tanh") == _fused_work(la, "bwd", "tanh") == spec.ffn_hidden_size * bs
        assert _fused_work(la, "fwd", "exp") == spec.num_heads * B * S**2
        assert _fused_work(la, "fwd", "welford") == 2 * spec.hidden_size * bs  # two LayerNorms
    else:
        assert _fused_work(la, "fwd", "exp").coeff(bs) >= spec.ffn_hidden_size
        rotated = (spec.num_heads + spec.num_kv_heads) * spec.head_dim * spec.rotary_fraction  # per token
        cos = _fused_work(la, "fwd", "cos")
        assert sympy.degree(cos, B) == 1 and cos.coeff(bs) >= rotated
        assert _fused_work(la, "fwd", "reduction") == 2 * spec.hidden_size * bs  # two RMSNorms
    for phase in ("fwd", "bwd"):
        assert _fused_work(la, phase, "arith").coeff(bs) > 0


def test_selective_recomputation_saves_what_the_analysis_says(compiled):
    """The attention core and the activation recomputed inside the compiled block (checkpointed
    regions that the partitioner re-runs in the backward graph, the attention kernel with the
    generator state it drew from): the saved bytes are the analysis's, storage by storage, fewer
    than without recomputation, and the gradients are the eager block's."""
    spec, block, run, flash = compiled
    rc, (b, s) = "attention+activation", SHAPES[-1]
    la = analyze_layer(spec, "block", 1, flash, "fp32", "cpu", rc, compiled=True)
    plain = analyze_layer(spec, "block", 1, flash, "fp32", "cpu", False, compiled=True)
    torch.manual_seed(3)
    x = torch.randn(b, s, spec.hidden_size, requires_grad=True)
    g = torch.randn(b, s, spec.hidden_size)
    out: list[torch.Tensor] = []
    try:
        got, numels = _saved(lambda: out.append(run_block_as(run, x, rc)))
    finally:
        select_parts(block, False, False)  # the other tests run the block plain
    assert got == pytest.approx(float(la.saved(b, s)), abs=0.5) and got < float(plain.saved(b, s))
    big, _, _ = la.saved_split(b, s)
    assert sorted(n for n in numels if n >= MIN_SPLIT_NUMEL) == sorted(round(float(n)) for n in big)
    grads = torch.autograd.grad(out[0], [x, *block.parameters()], g)
    ref_grads = torch.autograd.grad(block(x), [x, *block.parameters()], g)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_what_is_saved_does_not_depend_on_the_example_sizes(family):
    """The partitioner weighs tensors by the example sizes of the capture; with materialised
    attention the scores per token (heads·s) grow from half to 32 times the width h of the other
    activations between these example lengths, and the saved set (a polynomial in b and s) stays
    the same."""
    spec = SPECS[family]
    saved = []
    for s in (8, 512):
        block = DecoderBlock(spec, TPGroup(), False, torch.float32)
        trace, _ = trace_compiled(capture(block, torch.zeros(3, s, spec.hidden_size, requires_grad=True)))
        saved.append(sympy.expand(sum(trace.saved.values())))
    assert saved[0] == saved[1]
    assert saved[0].coeff(S**2) != 0  # the kept probabilities (or scores): materialised attention


# Dropout inside the compiled block: GPT's attention probabilities and hidden outputs with
# materialised attention, Llama's hidden outputs with flash attention.
DROPOUT = {
    "gpt": replace(SPECS["gpt"], attention_dropout=0.2, hidden_dropout=0.2),
    "llama": replace(SPECS["llama"], hidden_dropout=0.2),
}
DROPOUT_CASES = [("gpt", False), ("gpt", True), ("gpt", "attention+activation"), ("llama", "activation")]


def _train_step(run, block, x, g, recompute, seed: int):
    """(bytes and elements of the storages autograd keeps, [output, input gradient, parameter
    gradients]) of one forward and backward of the compiled block with the masks of `seed`."""
    out: list[torch.Tensor] = []
    torch.manual_seed(seed)
    try:
        got, numels = _saved(lambda: out.append(run_block_as(run, x, recompute)))
    finally:
        select_parts(block, False, False)
    out[0].backward(g)  # (not autograd.grad: whole-block recomputation is reentrant)
    values = [out[0].detach(), x.grad, *(p.grad for p in block.parameters())]
    x.grad = None
    block.zero_grad(set_to_none=True)
    return got, numels, values


@pytest.mark.parametrize(
    "family,recompute",
    [
        pytest.param(
            f,
            r,
            id=f"{f}-{r}",
            # (a GPT block's dropouts without recomputation are in its recomputed cases too)
            marks=pytest.mark.extended("tests/analysis/test_compiled_block.py::test_dropout_in_a_compiled_block")
            if (f, r) == ("gpt", False)
            else (),
        )
        for f, r in DROPOUT_CASES
    ],
)
def test_dropout_in_a_compiled_block(family, recompute):
    """Inductor draws the masks (seeds from the default generator when the forward starts, one
    uniform draw per dropped element): the block keeps for backward what the analysis of its graphs
    says, storage by storage, the masks and a recomputed region's seeds included; a re-run forward
    (whole-block or selective recomputation) draws the masks of the first run, so the output and
    every gradient are those of the block without recomputation under the same seed, and another
    seed draws other masks; the fused kernels count one random draw per element dropped, in the
    backward again for a recomputed attention core."""
    spec, flash = DROPOUT[family], family == "llama"
    torch._dynamo.reset()
    block = DecoderBlock(spec, TPGroup(), flash, torch.float32)
    init_weights(block, 0)
    run = compile_block(block)
    la = analyze_layer(spec, "block", 1, flash, "fp32", "cpu", recompute, compiled=True)
    b, s = SHAPES[-1]
    torch.manual_seed(4)
    x = torch.randn(b, s, spec.hidden_size, requires_grad=True)
    g = torch.randn(b, s, spec.hidden_size)
    got, numels, values = _train_step(run, block, x, g, recompute, seed=7)
    assert got == pytest.approx(float(la.saved(b, s)), abs=0.5)
    big, _, _ = la.saved_split(b, s)
    assert sorted(n for n in numels if n >= MIN_SPLIT_NUMEL) == sorted(round(float(n)) for n in big)
    if recompute:
        _, _, plain = _train_step(run, block, x, g, False, seed=7)
        for a, r in zip(values, plain):
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
    other = _train_step(run, block, x, g, recompute, seed=8)[2]
    assert not torch.allclose(other[0], values[0])
    dropped = 2 * spec.hidden_size * B * S + (spec.num_heads * B * S**2 if spec.attention_dropout > 0 else 0)
    assert _fused_work(la, "fwd", "random") == dropped
    again = spec.num_heads * B * S**2 if recompute == "attention+activation" else 0
    assert _fused_work(la, "bwd", "random") == again


def test_a_recomputed_attention_core_redraws_a_rank_s_own_masks_from_the_kept_seed():
    """Attention dropout on tp > 1 draws from the rank's own stream: `mist::rank_seed` takes the
    seed before the checkpointed core, and the partitioner re-runs the core's
    `mist::seeded_dropout` in the backward graph with it. So the compiled block keeps no b·heads·s²
    tensor (neither the probabilities nor their mask: the core is recomputed), the seed is kept
    (a host scalar: no kernel, no device traffic), and the draw runs once in the forward and once
    in the backward graph; without recomputation it runs once and its mask is kept."""
    spec = DROPOUT["gpt"]
    heads = spec.num_heads // 2
    rc = analyze_layer(spec, "block", 2, False, "fp32", "cpu", "attention", compiled=True)
    plain = analyze_layer(spec, "block", 2, False, "fp32", "cpu", compiled=True)
    saved, kept = sympy.expand(rc.saved_bytes), sympy.expand(plain.saved_bytes)
    assert saved.coeff(S**2) == 0
    assert kept.coeff(S**2) != 0
    for la, bwd in ((rc, 1), (plain, 0)):
        assert [r.op for r in la.ops("fwd")].count("rank_seed") == 1
        draws = {ph: [r for r in la.ops(ph) if r.op == "seeded_dropout"] for ph in ("fwd", "bwd")}
        assert (len(draws["fwd"]), len(draws["bwd"])) == (1, bwd)
        # (the probabilities read, the dropped ones and their bool mask written)
        assert sympy.expand(draws["fwd"][0].bytes_read) == 4 * heads * B * S**2
        assert sympy.expand(draws["fwd"][0].bytes_written) == 5 * heads * B * S**2
    seed = next(r for r in rc.ops("fwd") if r.op == "rank_seed")
    assert seed.bytes_read == seed.bytes_written == 0


def _collectives(la) -> Counter:
    """(phase, name, bytes, group size) of every collective in a layer analysis, counted."""
    return Counter(
        (r.phase, r.op, sympy.expand(r.params.bytes), r.params.group) for r in la.records if r.kind == COLLECTIVE
    )


# (family, tp, sequence parallelism, whole-block recomputation, cp): TP alone; SP with whole-block
# recomputation; CP alone; TP, SP and CP together (groups of 2 and 4). (The compiled gloo plans in
# tests/runtime/test_runtime_compiled.py run SP without CP, and CP with TP.)
TP_BLOCKS = [
    ("llama", 2, False, False, 1),
    ("falcon", 2, True, True, 1),
    ("llama", 1, False, False, 4),
    ("gpt", 2, True, False, 4),
]


@pytest.mark.parametrize(
    "family,tp,sp,recompute,cp",
    TP_BLOCKS,
    ids=[f"{f}-tp{t}-sp{int(p)}-rc{int(r)}-cp{c}" for f, t, p, r, c in TP_BLOCKS],
)
def test_parallel_collectives_are_the_eager_blocks(family, tp, sp, recompute, cp):
    """A tensor- or context-parallel compiled block's graphs hold its collectives, recorded as the
    eager trace announces them (name, bytes of the whole buffer, group size: tp for the tensor-,
    cp for the context-parallel ones). Without sequence or context parallelism they are the eager
    block's, one for one. With either, the joint graph's common-subexpression pass merges the
    backward's gather of a kept shard (sequence-parallel activations, context-parallel K/V) with
    the forward's gather of it, and the partitioner keeps the gathered tensor: the compiled block
    issues a subset of the eager block's all-gathers and every reduce-scatter and all-reduce."""
    kw = dict(tp=tp, flash=True, dtype="fp32", sequence_parallel=sp, recompute=recompute, cp=cp)
    eager = _collectives(analyze_layer(SPECS[family], "block", **kw))
    compiled = _collectives(analyze_layer(SPECS[family], "block", compiled=True, **kw))
    groups = {(op, g) for _, op, _, g in compiled}
    assert compiled and groups == {(op, g) for _, op, _, g in eager}
    assert (cp > 1) == (("all_gather", cp) in groups and ("reduce_scatter", cp) in groups)
    assert (tp > 1) == any(g == tp for _, g in groups)
    if recompute:
        assert any(phase == "recompute" for phase, *_ in compiled)
    if not sp and cp == 1:
        assert compiled == eager
        return
    assert {k for k in eager if k[1] != "all_gather"} == {k for k in compiled if k[1] != "all_gather"}
    assert all(compiled[k] == eager[k] for k in compiled if k[1] != "all_gather")
    assert all(0 < compiled[k] <= eager[k] for k in compiled)
    assert sum(compiled.values()) < sum(eager.values())


def test_a_compile_does_not_depend_on_what_the_process_compiled_before():
    """A Falcon block (rotary fraction 1.0), then a Llama block (0.5), compiled in one process
    without a reset: each is one dynamo graph, symbolic in the batch and the sequence and nothing
    else. (With dynamo's automatic dynamic shapes the Llama block recompiled with the rotary
    fraction a symbolic float: a graph other than the one `capture` prices, and under context
    parallelism one that dynamo then failed to lift.)"""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch.fx.experimental.symbolic_shapes import free_symbols

    symbols: list[set[str]] = []

    def note(gm, example_inputs):
        vals = (n.meta.get("example_value") for n in gm.graph.nodes)
        symbols.append({str(s) for v in vals if v is not None for s in free_symbols(v)})

    torch._dynamo.reset()
    try:
        for family in ("falcon", "llama"):
            block = DecoderBlock(SPECS[family], TPGroup(), True, torch.float32)
            # the graphs run as they are (no code generated): only dynamo's graphs are looked at
            run = compile_block(block, inner_compile=lambda gm, ex, **kw: make_boxed_func(gm.forward), on_graph=note)
            run(torch.randn(2, 16, 64, requires_grad=True)).sum().backward()
    finally:
        torch._dynamo.reset()
    assert len(symbols) == 2
    assert all(len(s) == 2 for s in symbols) and symbols[0] == symbols[1]


@pytest.mark.parametrize("target", ["cuda", "cpu"])
def test_a_recomputed_activation_is_one_kernel_with_its_backward(target):
    """Selective recomputation of GPT's GELU: Inductor's scheduler fuses the re-run (for fc2's
    weight gradient) with the GELU backward after fc2's input gradient into one kernel, and runs
    the weight-gradient GEMM after it (the CPU backend's generated code shows that kernel: fc1's
    output and the gradient read, the activation and its input gradient written;
    `mist.analysis.inductor_rules`). So the backward's fused kernels are as many as without the
    recomputation and move one b·s·ffn activation more (the recomputed one, written for the GEMM),
    not the re-run's fp32 intermediates (x², tanh, 0.5·x) stored and read back. (Without biases:
    the bias gradients' column sums share the backward's first run with the re-run, which Inductor
    gives a kernel of its own.)"""
    spec = replace(SPECS["gpt"], bias=False)
    plain = analyze_layer(spec, "block", 1, True, "fp16", target, compiled=True)
    again = analyze_layer(spec, "block", 1, True, "fp16", target, "activation", compiled=True)

    def fused(la):
        return [r for r in la.ops("bwd") if r.op == "fused"]

    def moved(la):
        return sympy.expand(sum((r.bytes_read + r.bytes_written for r in fused(la)), sympy.Integer(0)))

    assert len(fused(again)) == len(fused(plain))
    assert sympy.expand(moved(again) - moved(plain)) == 2 * B * S * spec.ffn_hidden_size
    assert _fused_work(again, "bwd", "tanh") == _fused_work(plain, "bwd", "tanh") == B * S * spec.ffn_hidden_size


def _runtime_graphs(block, x, recompute: bool, split: bool) -> list[str]:
    """The code of every graph AOTAutograd hands to Inductor when the runtime runs `block` at x:
    a checkpointed block's first run without grad, then its re-run with grad, and the backward
    (as B and W where `split`)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._functorch.aot_autograd import make_boxed_func

    graphs: list[str] = []

    def inner(gm, example_inputs, **kwargs):  # the graphs run as they are (no code generated)
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        torch._dynamo.reset()
        try:
            run = compile_block(block, inner_compile=inner, split=split)
            if recompute:
                with torch.no_grad():
                    run(x)
            run(x).backward(torch.ones(x.shape))
        finally:
            torch._dynamo.reset()
    return graphs


# (name, flash, GELU recomputed inside the block, spec, b): b = 1 is a graph of its own
CAPTURES = [("llama", True, False, SPECS["llama"], 1), ("gpt-dropout", False, True, DROPOUT["gpt"], 2)]


@pytest.mark.parametrize("name,flash,activation,spec,b", CAPTURES, ids=[c[0] for c in CAPTURES])
def test_a_captured_variant_is_put_together_from_the_runtime_s_own_graphs(name, flash, activation, spec, b):
    """`capture` compiles a block's training graphs once and puts the fully recomputed and the
    split-backward variants together from them (the inference forward captured alone, the
    backward split by the runtime's `split_backward`): each graph of a checkpointed block with a
    split backward (all four kinds) is, code for code, the one the runtime's compile of that
    variant hands to Inductor, with GPT's dropout masks and its GELU recomputed inside the block
    too."""
    block = DecoderBlock(spec, TPGroup(), flash, torch.float32)
    select_parts(block, False, activation)
    x = torch.zeros(b, 16, spec.hidden_size, requires_grad=True)
    cg = capture(block, x, recompute=True, split=True, training=capture_training(block, x))
    assert cg.inference is not None and cg.wgrad is not None
    ours = [cg.inference.code, cg.fw.code, cg.bw.code, cg.wgrad.code]
    assert ours == _runtime_graphs(block, x, recompute=True, split=True)


def test_a_compiled_block_s_variants_share_one_capture_in_a_worker(monkeypatch, tmp_path):
    """The prefetch hands a worker a compiled block's plain, fully recomputed and split-backward
    analyses as one task, and that worker captures the block's training graphs once per example
    batch (any b, and b = 1); selective recomputation and an eager block are tasks of their own."""
    from mist.analysis import layer
    from mist.analysis.layer import AnalysisRequest
    from mist.analysis.prefetch import _family, _trace

    monkeypatch.setenv("MIST_CACHE_DIR", str(tmp_path))
    base = AnalysisRequest(SPECS["llama"], "block", 1, True, "fp32", "cpu", compiled=True)
    family = (base, replace(base, recompute=True), replace(base, compiled=SPLIT))
    others = (replace(base, recompute="activation"), replace(base, compiled=False))
    assert {_family(r) for r in family} == {base}
    assert len({_family(r) for r in family + others}) == 3
    made = []
    real = layer.capture_training
    monkeypatch.setattr(layer, "capture_training", lambda *a: made.append(a) or real(*a))
    layer._analyze.cache_clear()
    layer._training_graphs.cache_clear()
    assert _trace(family) == 3 and all(r.on_disk() for r in family)
    assert len(made) == 2
