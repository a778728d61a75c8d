"""Symbolic analysis of one layer: the decoder block, the pre layer (embedding) or the post layer
(final norm, LM head and loss), on one tensor-parallel shard.

`analyze_layer` traces once per (model, part, TP degree, attention kernel, dtype, target device,
checkpointing) and caches the result; b and s stay symbolic. Every total is a sympy expression
compiled once (lambdify) into a numpy function of (b, s) arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import lru_cache

import numpy as np
import sympy
import torch

from mist.analysis import disk_cache, lambdified
from mist.analysis.compiled import TrainingGraphs, capture, capture_training, trace_compiled
from mist.analysis.liveness import live_bytes, split_pass_bytes
from mist.analysis.records import ATTENTION, UNCOSTED, OpRecord, OpValues
from mist.analysis.tracer import FLASH_CPU, FLASH_CPU_BWD, HINT_B, HINT_S, label_recompute, run_trace
from mist.analysis.weight_pass import b_pass_bytes, saved_unread_by_w, weight_pass_bytes
from mist.models.block import DecoderBlock
from mist.models.checkpointing import run_block_as, select_parts, selective_modes
from mist.models.collectives import CPGroup, TPGroup
from mist.models.dtypes import torch_dtype
from mist.models.embedding import Embedding
from mist.models.head import Head
from mist.rules.compiled_blocks import SPLIT
from mist.rules.offload_split import MIN_SPLIT_NUMEL
from mist.specs.model import ModelSpec

PARTS = ("block", "pre", "post")
TARGETS = ("cuda", "cpu")

# The fused flash kernel a CUDA GPU runs for `scaled_dot_product_attention`. The CPU flash kernel
# traced here keeps the same tensors for backward (q, k, v, output and the fp32 log-sum-exp of
# b·heads·s); only the name differs. (The meta device would pick the math path instead and keep
# the b·heads·s² scores, which a GPU never does for these shapes.)
_CUDA_NAMES = {
    FLASH_CPU: "_scaled_dot_product_flash_attention",
    FLASH_CPU_BWD: "_scaled_dot_product_flash_attention_backward",
}


@dataclass
class LayerAnalysis:
    spec: ModelSpec
    part: str
    tp: int
    flash: bool
    dtype: str
    target: str
    recompute: bool | str
    records: list[OpRecord]
    params: int  # parameters of this shard
    saved_bytes: sympy.Expr  # activations kept for backward (unique storages)
    output_bytes: sympy.Expr
    fwd_live: list  # live activation bytes at each forward op (peak = max)
    bwd_live: list  # ... at each backward / recompute op
    # ... with the parameters' gradients held to the end of the backward (`liveness.live_bytes`)
    bwd_live_held: list = field(default_factory=list)
    flops: dict = field(default_factory=dict)  # phase -> sympy FLOPs
    # per-tensor view of the saved activations (see `saved_split`): numels and element sizes of
    # the tensors an offloading pack hook splits, and the storages it keeps whole (numel < 2)
    saved_numels: list = field(default_factory=list)
    saved_elts: list = field(default_factory=list)
    saved_whole: sympy.Expr = sympy.Integer(0)
    unit_batch: LayerAnalysis | None = None  # the exact b = 1 trace (memory at b = 1)
    sequence_parallel: bool = False  # traced with the TP group's sequence parallelism
    cp: int = 1  # traced as context-parallel rank 0 of cp
    compiled: bool | str = False  # a block as `mist.models.compiled` compiles it (`analyze_layer`)
    # bytes held from B to W beyond the saved activations, where the trace says (`Trace`)
    weight_grad_held: sympy.Expr | None = None
    # B as the ZB-H1 runtime runs it on a stage after the first, the graph kept to W: the live
    # bytes at its operators. An eager layer's without its W operators, holding what W reads
    # (`weight_pass.b_pass_bytes`); a split compiled block's B graph, its saved tensors handed to it
    # once (`liveness.split_pass_bytes`). None: a compiled block not split into B and W
    b_pass_live: list | None = None
    # the saved bytes that W does not read, gone by W under ZB-H1 (`runtime.activations`: an eager
    # layer's nodes that W does not run again release theirs in B; None: a compiled block not split)
    saved_unread_by_w: sympy.Expr | None = None
    # a layer's W as the ZB-H1 runtime runs it (an eager layer's: `weight_pass.weight_pass_bytes`;
    # a compiled block's: `liveness.split_pass_bytes`): the candidates for the most it adds over
    # what it starts with, and the bytes it releases (None: a compiled block not split into B and W)
    weight_pass_peak: list | None = None
    weight_pass_freed: sympy.Expr | None = None
    _fns: dict = field(default_factory=dict, repr=False)
    # the source of each evaluator in `_fns` (`mist.analysis.lambdified`): pickled with the
    # analysis, so that a process reading it from the disk cache need not print it again
    _sources: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------ evaluation
    def __getstate__(self):
        d = dict(self.__dict__)
        d["_fns"] = {}
        d["unit_batch"] = None  # cached under its own key
        return d

    def _fn(self, key: str, exprs):
        if key not in self._fns:
            source = self._sources.get(key)
            if source is not None:
                self._fns[key] = lambdified.load(source)
            else:
                self._fns[key], source = lambdified.make(exprs)
                if source is not None:
                    self._sources[key] = source
        return self._fns[key]

    def prepare(self) -> LayerAnalysis:
        """Make every evaluator the simulator reads (and with them their sources, which the disk
        cache then keeps); itself."""
        one = np.ones(1)
        for read in (
            self.saved,
            self.saved_split,
            self.output,
            self.fwd_peak,
            self.bwd_peak,
            self.bwd_peak_held,
            self.b_pass_peak,
            self.saved_unread,
        ):
            read(one, one)
        for phase in ("fwd", "bwd", "recompute"):
            self.op_values(phase, one, one)
        for phase in ("fwd", "bwd"):
            self.flops_of(phase, one, one)
        return self

    def _eval(self, key: str, exprs, b, s) -> np.ndarray:
        b, s = np.broadcast_arrays(np.asarray(b, dtype=np.float64), np.asarray(s, dtype=np.float64))
        vals = self._fn(key, exprs)(b, s)
        return np.stack([np.broadcast_to(np.asarray(v, dtype=np.float64), b.shape) for v in vals])

    def _mem(self, key: str, exprs, b, s) -> np.ndarray:
        v = self._eval(key, exprs(self), b, s).max(axis=0)
        if self.unit_batch is not None and np.any(np.asarray(b) == 1):
            v1 = self.unit_batch._eval(key, exprs(self.unit_batch), b, s).max(axis=0)
            v = np.where(np.broadcast_to(np.asarray(b) == 1, v.shape), v1, v)
        return v

    def saved(self, b, s) -> np.ndarray:
        return self._mem("saved", lambda a: [a.saved_bytes], b, s)

    def saved_split(self, b, s) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(numels [tensors, *b.shape], element sizes [tensors], whole-kept bytes [*b.shape]): the
        runtime's activation offload splits each saved tensor of ≥ 2 elements on its own (views
        of one storage each get their share), so its device bytes are Σ size·(n − round(n·r))
        plus the whole-kept storages — not (1 − r) of the unique storages."""
        la = self.unit_batch if (self.unit_batch is not None and np.all(np.asarray(b) == 1)) else self
        exprs = list(la.saved_numels) + [la.saved_whole]
        v = la._eval("saved_split", exprs, b, s)
        return v[:-1], np.asarray(la.saved_elts, dtype=np.float64), v[-1]

    def output(self, b, s) -> np.ndarray:
        return self._mem("output", lambda a: [a.output_bytes], b, s)

    def fwd_peak(self, b, s) -> np.ndarray:
        return self._mem("fwd_live", lambda a: a.fwd_live, b, s)

    def bwd_peak(self, b, s) -> np.ndarray:
        return self._mem("bwd_live", lambda a: a.bwd_live, b, s)

    def bwd_peak_held(self, b, s) -> np.ndarray:
        """The backward's peak where the runtime keeps each parameter gradient as autograd makes
        it until the layer's backward is done (then flattens them: `rules.grad_accumulation`)."""
        return self._mem("bwd_live_held", lambda a: a.bwd_live_held, b, s)

    def saved_unread(self, b, s) -> np.ndarray | None:
        """`saved_unread_by_w` at (b, s) (at b = 1 from the exact b = 1 trace, as `saved`)."""
        if self.saved_unread_by_w is None:
            return None
        return self._mem("saved_unread_by_w", lambda a: [a.saved_unread_by_w], b, s)

    def b_pass_peak(self, b, s) -> np.ndarray | None:
        """B's peak on a ZB-H1 stage after the first (`b_pass_live`); None where it has none."""
        if self.b_pass_live is None:
            return None
        return self._mem("b_pass_live", lambda a: a.b_pass_live, b, s)

    def flops_of(self, phase: str, b, s) -> np.ndarray:
        return self._eval("flops_" + phase, [self.flops.get(phase, sympy.Integer(0))], b, s)[0]

    def ops(self, phase: str) -> list[OpRecord]:
        return [r for r in self.records if r.phase == phase and r.kind not in UNCOSTED]

    def op_values(self, phase: str, b, s) -> list[OpValues]:
        """Each costed op of `phase` with its parameters and bytes evaluated at (b, s) arrays."""
        ops = self.ops(phase)
        exprs, keys = [], []
        for r in ops:
            for f in fields(r.params) if r.params is not None else ():
                v = getattr(r.params, f.name)
                if isinstance(v, sympy.Basic):
                    exprs.append(v)
                    keys.append((r.index, f.name))
            exprs.append(r.bytes_moved)
            keys.append((r.index, "bytes_moved"))
        vals = self._eval("ops_" + phase, exprs, b, s) if exprs else []
        table: dict = {}
        for (i, k), v in zip(keys, vals):
            table.setdefault(i, {})[k] = v
        out = []
        for r in ops:
            d = table.get(r.index, {})
            moved = d.pop("bytes_moved")
            params = replace(r.params, **d) if r.params is not None else None
            out.append(OpValues(op=r.op, kind=r.kind, bytes_moved=moved, params=params))
        return out


def _retarget(records: list[OpRecord], target: str) -> list[OpRecord]:
    if target != "cuda":
        return records
    return [replace(r, op=_CUDA_NAMES[r.op]) if r.kind == ATTENTION and r.op in _CUDA_NAMES else r for r in records]


def analyze_layer(
    spec: ModelSpec,
    part: str = "block",
    tp: int = 1,
    flash: bool = True,
    dtype: str = "bf16",
    target: str = "cuda",
    recompute: bool | str = False,
    sequence_parallel: bool = False,
    cp: int = 1,
    compiled: bool | str = False,
) -> LayerAnalysis:
    """Trace and analyse one layer (cached per argument tuple). `recompute`: False, True (the
    block checkpointed whole), or the parts a block not checkpointed whole re-runs in backward,
    "attention", "activation" or "attention+activation" (`run_block(attention=, activation=)`).
    `sequence_parallel` (tp > 1): the layer's input is this rank's 1/tp of the sequence, sizes
    still in the whole sequence length S. `cp` > 1: the layer is context-parallel rank 0's of cp
    (`mist.models.context_parallel`; its input 1/cp of the sequence, flash attention only).
    `compiled`: a block as `mist.models.compiled` compiles it (`mist.analysis.compiled`; the
    embedding and the head run eager either way): True, or `SPLIT` with its backward as B and W
    (`mist.rules.compiled_blocks.compile_mode`)."""
    args = _normalized(spec, part, tp, flash, dtype, target, recompute, sequence_parallel, cp, compiled)
    la = _analyze(*args[:7], False, *args[7:])
    if la.unit_batch is None:
        la.unit_batch = _analyze(*args[:7], True, *args[7:])
    return la


@dataclass(frozen=True)
class AnalysisRequest:
    """The arguments of one `analyze_layer` call, as a record a worker process can take."""

    spec: ModelSpec
    part: str
    tp: int
    flash: bool
    dtype: str
    target: str
    recompute: bool | str = False
    sequence_parallel: bool = False
    cp: int = 1
    compiled: bool | str = False

    def run(self) -> LayerAnalysis:
        return analyze_layer(**{f.name: getattr(self, f.name) for f in fields(self)})

    def on_disk(self) -> bool:
        """Whether the disk cache holds both traces of this analysis (any b, and b = 1)."""
        args = _normalized(*(getattr(self, f.name) for f in fields(self)))
        return all(disk_cache.has(_key(*args[:7], ub, *args[7:])) for ub in (False, True))


def _normalized(spec, part, tp, flash, dtype, target, recompute, sequence_parallel, cp, compiled=False) -> tuple:
    """(spec, part, tp, flash, dtype, target, recompute, sp, cp, compiled) checked, with
    `recompute` in its canonical form, sequence parallelism only where tp > 1 and `compiled` only
    for a block."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}")
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}")
    if not isinstance(recompute, (bool, str)):
        raise ValueError(f"recompute must be False, True or a selective part, got {recompute!r}")
    parts = selective_modes(recompute)
    spec.check_tp(tp)
    spec.check_attention(flash)
    rc = ("+".join(parts) if parts else bool(recompute)) if part == "block" else False
    if cp > 1 and not flash:
        raise ValueError("context parallelism runs flash attention only")
    if compiled not in (False, True, SPLIT):
        raise ValueError(f"compiled must be False, True or {SPLIT!r}, got {compiled!r}")
    compiled = compiled if part == "block" else False
    sp = bool(sequence_parallel) and tp > 1
    return spec, part, tp, flash, dtype, target, rc, sp, cp, compiled


def _key(spec, part, tp, flash, dtype, target, recompute, unit_batch, sp=False, cp=1, compiled=False) -> tuple:
    """The disk-cache key of one trace (one without sequence or context parallelism or
    compilation keeps the key it always had)."""
    key = (spec, part, tp, flash, dtype, target, recompute, unit_batch) + ((True,) if sp else ())
    return (
        key
        + ((("cp", cp),) if cp > 1 else ())
        + (("compiled",) if compiled else ())
        + ((SPLIT,) if compiled == SPLIT else ())
    )


@lru_cache(maxsize=512)
def _analyze(
    spec, part, tp, flash, dtype, target, recompute, unit_batch, sp=False, cp=1, compiled=False
) -> LayerAnalysis:
    key = _key(spec, part, tp, flash, dtype, target, recompute, unit_batch, sp, cp, compiled)
    hit = disk_cache.load(key)
    if hit is not None:
        return hit
    la = _trace_and_analyze(spec, part, tp, flash, dtype, target, recompute, unit_batch, sp, cp, compiled)
    if disk_cache.enabled():  # (its evaluators made now, their sources kept with it)
        disk_cache.store(key, la.prepare())
    return la


def _group(tp, sp, cp) -> TPGroup:
    return TPGroup(tp, 0, None, sequence_parallel=sp, cp=CPGroup(cp, 0, None))


def _hint_s(spec, shards: int, cp: int) -> int:
    """The example sequence length a layer is traced at, of its input's 1/`shards` of the sequence."""
    # the example sequence length must fit the learned positions of a gpt model
    # (under sequence parallelism, of the whole sequence: the inputs hold 1/tp of it)
    hint_s = HINT_S if spec.max_position_embeddings > HINT_S * shards else max(2, spec.max_position_embeddings - 1)
    if shards > 1:
        hint_s = max(2, hint_s // shards)
    if hint_s == HINT_B:
        hint_s = 2
    if cp > 1:  # the rank's two chunks: an even local length (38, not the 37 of a whole sequence)
        hint_s = 2 * (hint_s // 2 + 1)
    return hint_s


def _compiled_input(block: DecoderBlock, selective: tuple, unit_batch: bool, hint_s: int, dtype) -> torch.Tensor:
    """`block` made ready for a capture, recomputing its `selective` parts itself, and its example
    input: real (empty) weights and a small real input, as dynamo compiles what it is given, and
    the captured graphs run nothing (`mist.analysis.compiled`)."""
    select_parts(block, "attention" in selective, "activation" in selective)
    b = 1 if unit_batch else HINT_B
    return torch.zeros((b, hint_s, block.spec.hidden_size), dtype=dtype).requires_grad_()


# (a capture holds 10-25 MiB of graphs and fake tensors at Llama-7B's sizes; a prefetch worker
# traces a family's analyses one after another, so two entries, any b and b = 1, serve it)
@lru_cache(maxsize=8)
def _training_graphs(spec, tp, flash, dtype, sp, cp, selective, unit_batch) -> TrainingGraphs:
    """One capture of a compiled block's training graphs, which its plain, fully recomputed and
    split-backward analyses share (`mist.analysis.compiled.capture`); `selective`: the parts it
    recomputes itself. `mist.analysis.prefetch` traces such analyses in one worker."""
    tdtype = torch_dtype(dtype)
    m = DecoderBlock(spec, _group(tp, sp, cp), flash, tdtype)
    shards = (tp if sp else 1) * cp
    x = _compiled_input(m, selective, unit_batch, _hint_s(spec, shards, cp), tdtype)
    return capture_training(m, x)


def _trace_and_analyze(
    spec, part, tp, flash, dtype, target, recompute, unit_batch, sp=False, cp=1, compiled=False
) -> LayerAnalysis:
    tdtype = torch_dtype(dtype)
    group = _group(tp, sp, cp)
    tp_shards = tp if sp else 1
    shards = tp_shards * cp  # of the whole sequence, in the layer's input
    h = spec.hidden_size
    holder = {}

    def build():
        if part == "block":
            m = DecoderBlock(spec, group, flash, tdtype)
        elif part == "pre":
            m = Embedding(spec, group, tdtype)
        else:
            m = Head(spec, group, tdtype)
        holder["m"] = m
        return m

    hint_s = _hint_s(spec, shards, cp)
    pre_hint = hint_s * tp_shards  # the pre layer's tokens: the rank's positions, whole over tp

    def make_inputs(sym):
        if part == "pre":
            return [sym((HINT_B, pre_hint if cp > 1 else hint_s * shards), torch.long, 2)]
        x = sym((HINT_B, hint_s, h), tdtype, 2).requires_grad_()
        if part == "post":
            if tp_shards > 1:  # the loss is over the rank's positions: a target sized from x's shard
                return [x, torch.zeros((x.shape[0], x.shape[1] * tp_shards), dtype=torch.long)]
            return [x, sym((HINT_B, hint_s), torch.long, 2)]
        return [x]

    def forward(m, inputs):
        if part == "block":
            return run_block_as(m, inputs[0], recompute)
        if part == "post":
            return m(inputs[0], inputs[1])
        return m(inputs[0])

    def backward(out, inputs):
        out.backward(torch.ones_like(out))

    def build_and_hook(trace):
        m = build()
        if recompute is True:
            label_recompute(trace, m)
        for sel in selective_modes(recompute):
            label_recompute(trace, m.attn.core if sel == "attention" else m.mlp.act)
        return m

    if compiled:
        m = build()
        selective = selective_modes(recompute)
        x = _compiled_input(m, selective, unit_batch, hint_s, tdtype)
        training = _training_graphs(spec, tp, flash, dtype, sp, cp, selective, unit_batch)
        trace, _ = trace_compiled(capture(m, x, recompute is True, compiled == SPLIT, training), tp, shards, target)
    else:
        trace, _ = run_trace(
            build_and_hook,
            make_inputs,
            forward,
            backward,
            unit_batch=unit_batch,
            seq_shards=cp if part == "pre" else shards,
        )
    records = [
        replace(
            r,
            saved_bytes=sympy.expand(
                sum((trace.saved[sid] for sid in trace.saved if trace.producer.get(sid) == r.index), sympy.Integer(0))
            ),
        )
        if r.phase == "fwd"
        else r
        for r in _retarget(trace.records, target)
    ]
    saved = sympy.expand(sum(trace.saved.values(), sympy.Integer(0)))
    split = [(n, e) for n, e, _ in trace.saved_calls if not (n.is_number and n < MIN_SPLIT_NUMEL)]
    whole = {sid: trace.saved[sid] for n, _, sid in trace.saved_calls if n.is_number and n < MIN_SPLIT_NUMEL}
    out_bytes = sympy.expand(sum((trace.storage_bytes[sid] for sid in trace.output_sids), sympy.Integer(0)))
    fwd_live, bwd_live = live_bytes(trace, cpu=target == "cpu")
    bwd_live_held = live_bytes(trace, hold_grads=True, cpu=target == "cpu")[1]
    flops = {}
    for r in records:
        flops[r.phase] = flops.get(r.phase, sympy.Integer(0)) + r.flops
    params = sum(p.numel() for p in holder["m"].parameters())
    if part == "post" and spec.tie_embeddings:
        params -= holder["m"].weight.numel()  # the tied table is the embedding's
    b_live = None
    unread = trace.saved_unread_by_w
    if not compiled:
        w_peak, w_freed = weight_pass_bytes(trace, records)
        unread = saved_unread_by_w(trace, records)
        b_live = b_pass_bytes(trace, records, cpu=target == "cpu")
    elif trace.weight_grad_held is not None:
        # a compiled block's W graph frees each value B handed it after its last use, and by its
        # end all of them: those B computed (`w_freed`) and the saved tensors W reads (B let go
        # of the rest: `simulate.layer_terms` adds them)
        b_live, w_peak = split_pass_bytes(trace, cpu=target == "cpu")
        w_freed = trace.weight_grad_held
    else:
        w_peak, w_freed = None, None
    return LayerAnalysis(
        spec=spec,
        part=part,
        tp=tp,
        flash=flash,
        dtype=dtype,
        target=target,
        recompute=recompute,
        records=records,
        params=params,
        saved_bytes=saved,
        output_bytes=out_bytes,
        fwd_live=fwd_live,
        bwd_live=bwd_live,
        bwd_live_held=bwd_live_held,
        flops={k: sympy.expand(v) for k, v in flops.items()},
        saved_numels=[sympy.expand(n) for n, _ in split],
        saved_elts=[e for _, e in split],
        saved_whole=sympy.expand(sum(whole.values(), sympy.Integer(0))),
        sequence_parallel=sp,
        cp=cp,
        compiled=compiled,
        weight_grad_held=trace.weight_grad_held,
        b_pass_live=b_live,
        saved_unread_by_w=unread,
        weight_pass_peak=w_peak,
        weight_pass_freed=w_freed,
    )


def warm(spec: ModelSpec, tps, flash: bool, dtype: str = "bf16", target: str = "cuda") -> None:
    """Trace (or load from the disk cache) every layer a search over `tps` will need."""
    for tp in tps:
        try:
            spec.check_tp(tp)
        except ValueError:
            continue
        for part in PARTS:
            analyze_layer(spec, part, tp, flash, dtype, target)
        analyze_layer(spec, "block", tp, flash, dtype, target, recompute=True)
        analyze_layer(spec, "block", tp, flash, dtype, target, recompute="activation")
        if not flash:  # the tuner searches attention recomputation only without flash attention
            analyze_layer(spec, "block", tp, flash, dtype, target, recompute="attention")
            analyze_layer(spec, "block", tp, flash, dtype, target, recompute="attention+activation")
