"""Simulate a whole plan: every stage's schedule, the 1F1B pipeline, memory, throughput, MFU.

`simulate_plan` returns the prediction (a `Prediction` record, whose `to_json()` is what `mist
simulate --json` prints); `plan_timeline`
returns the same iteration played event by event as a `Timeline` record (what `--timeline`
draws); `simulate_with_timeline` gives both from one evaluation of the stages.

An interleaved plan (`virtual_stages` v ≥ 2) is priced per model chunk for time — each chunk a
stage of the chunk pipeline (its own blocks, edges, p2p at both ends, the embedding on the first
chunk and the head on the last), played through the interleaved 1F1B order
(`simulate.interleaved`) — and per stage (pipeline rank) for memory: all its chunks' states, and
the saved activations of the micro-batch chunks in flight on it at its peak under that order,
each chunk's own (`interleaved.held_saved_peak`; rank 0 holds the most). A stage's reported times
are its chunks' sums.

A ZB-H1 plan (`schedule` "zb-h1") splits every stage's backward into B and W
(`zero_bubble.stage_weight_grad`, from the traced weight-gradient operators) and plays the
zero-bubble order (`zero_bubble.zb_recurrence`); its memory holds every micro-batch until its W,
with the output gradients of those past their B (`zero_bubble.zb_held`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from mist.hardware.host_memory import node_host_memory, node_usage
from mist.plan import Plan
from mist.rules.compiled_blocks import compile_mode
from mist.rules.deepspeed_buffers import deepspeed_held, optimizer_zero
from mist.rules.engine_held import EngineHeld
from mist.rules.interleaved_order import chunk_recompute
from mist.rules.megatron_buffers import megatron_held
from mist.rules.pipeline_outputs import holds_sends, keeps_sent_outputs
from mist.rules.zero_bubble_order import ZB_H1, lets_go_in_b
from mist.simulate.gpu_fit import ALLOCATOR_MARGIN, need_bytes, outside_words, usable_bytes
from mist.simulate.interleaved import interleaved_event_schedule, interleaved_rank_input, interleaved_recurrence
from mist.simulate.pipeline import event_schedule, iteration_time
from mist.simulate.precision import precision_for
from mist.simulate.prediction import HostMemory, Prediction, StagePrediction
from mist.simulate.stage import StageModel
from mist.simulate.stage_records import StageDetail, StageInput
from mist.simulate.zero_bubble import split_backward, stage_weight_grad, zb_event_schedule, zb_held, zb_recurrence


def stage_inputs(plan: Plan) -> list[StageInput]:
    """Every stage's input (of an interleaved plan without its in-flight count, which
    `_stage_results` takes from its chunks' saved activations)."""
    S, t = plan.num_stages, plan.training
    held = _engine_held(plan)
    zeros = [
        optimizer_zero(plan.engine, S, s.zero, t.param_dtype, t.grad_dtype, s.offload.optimizer) for s in plan.stages
    ]
    out = []
    for i, s in enumerate(plan.stages):
        out.append(
            StageInput(
                first=i == 0,
                last=i == S - 1,
                index=i,
                num_stages=S,
                layers=np.array([s.layers]),
                recompute=np.array([s.recompute_layers]),
                b=np.array([s.micro_batch]),
                dp=np.array([s.dp * s.cp]),  # the replicas a shard's gradients and states span
                tp=s.tp,
                # the states' sharding as the plan's engine runs it (`rules.deepspeed_buffers`)
                zero=np.array([zeros[i]]),
                offload_weights=np.array([s.offload.weights]),
                offload_grads=np.array([s.offload.grads]),
                offload_optimizer=np.array([s.offload.optimizer]),
                offload_activations=np.array([s.offload.activations]),
                G=plan.micro_batches,
                nodes=s.nodes,
                gpus_per_node=s.gpus_per_node,
                cluster_gpus_per_node=plan.cluster.gpus_per_node,
                keeps_outputs=keeps_sent_outputs(plan.engine, plan.virtual_stages),
                holds_sends=holds_sends(plan.engine, plan.virtual_stages),
                engine_buffers=held[i],
                all_reduces_grads=zeros[i] > s.zero,  # (BF16_Optimizer at ZeRO-0)
            )
        )
    return out


def _engine_held(plan: Plan) -> list[EngineHeld]:
    """Per stage, what its engine holds beyond Mist's runtime's states (`rules.deepspeed_buffers`,
    `rules.megatron_buffers`): from the stage's parameters on a rank and the largest of them, a
    weight matrix of a block (the MLP's h × f, or Q, K and V fused, as Megatron-style models hold
    them), or the word table (V × h) on a stage with the embedding or an untied head."""
    m, t, S = plan.model, plan.training, plan.num_stages
    h = m.hidden_size
    block_matrix = max(h * m.ffn_hidden_size, h * (h + 2 * m.num_kv_heads * m.head_dim))
    out = []
    for i, s in enumerate(plan.stages):
        table = i == 0 or (i == S - 1 and not m.tie_embeddings)
        params = s.layers * m.block_params() + (m.embedding_params() if i == 0 else 0)
        params += m.head_params() if i == S - 1 else 0
        largest = max(block_matrix, m.vocab_size * h if table else 0)
        if plan.engine == "megatron":
            out.append(
                megatron_held(
                    plan.engine, s.zero, s.dp * s.cp, t.param_dtype, t.grad_dtype, s.offload.optimizer, params / s.tp
                )
            )
            continue
        out.append(
            deepspeed_held(
                plan.engine,
                S,
                s.zero,
                s.dp * s.cp,
                t.param_dtype,
                t.grad_dtype,
                s.offload.optimizer,
                params / s.tp,
                largest / s.tp,
                # 1F1B: stage i runs min(S − i, G) forwards before its first backward
                forward_after_backward=plan.micro_batches > S - i,
                several_backwards=plan.micro_batches > 1,
            )
        )
    return out


def chunk_inputs(plan: Plan, rank_inputs: list[StageInput]) -> list[list[StageInput]]:
    """Per stage, one input per model chunk: a stage of the p·v-chunk pipeline (chunk c of rank
    r is its stage c·p + r) with the rank's strategy, the chunk's blocks and its share of the
    recomputed ones."""
    S, v = plan.num_stages, plan.virtual_stages
    out = []
    for r, (s, st) in enumerate(zip(plan.stages, rank_inputs)):
        rec = chunk_recompute(s.recompute_layers, s.chunks())
        out.append(
            [
                replace(
                    st,
                    first=r == 0 and c == 0,
                    last=r == S - 1 and c == v - 1,
                    index=c * S + r,
                    num_stages=S * v,
                    layers=np.array([n]),
                    recompute=np.array([rec[c]]),
                    in_flight=0,
                )
                for c, n in enumerate(s.chunks())
            ]
        )
    return out


def host_check(plan: Plan, profile, per_gpu_bytes: list[float]) -> HostMemory:
    """Host memory per node (every GPU's offloaded bytes, `StageResult.host`) against the node's RAM."""
    cap, source = node_host_memory(plan.cluster, profile)
    per_node = node_usage([s.gpus for s in plan.stages], per_gpu_bytes, plan.cluster.gpus_per_node)
    over = [(j, b) for j, b in enumerate(per_node) if cap is not None and b > cap]
    problems = (
        ()
        if cap is None
        else tuple(
            f"node {j} needs {b / 2**30:.2f} GiB of host memory for offloaded states and "
            f"activations, {(b - cap) / 2**30:.2f} GiB over its {cap / 2**30:.1f} GiB ({source})"
            for j, b in over
        )
    )
    return HostMemory(
        per_node_bytes=tuple(int(round(b)) for b in per_node),
        capacity_per_node_bytes=None if cap is None else int(cap),
        source=source,
        fits=not over,
        problems=problems,
    )


@dataclass(frozen=True)
class Timeline:
    """One iteration of a plan played through an explicit 1F1B schedule (what `--timeline` draws).

    events: (stage, kind, micro-batch, start s, end s), kind "F" forward, "B" backward (under
    ZB-H1 its input-gradient pass, "W" the weight-gradient pass), "X" the
    first micro-batch's one-off, "Y" the last one's. channels: per stage, the standalone seconds of
    each transfer channel ("G2G", "C2G", "G2C", ...). stable: per stage, its stable forward and
    backward seconds. iteration_time_s is the closed form `simulate_plan` reports;
    event_iteration_time_s the same iteration played event by event."""

    iteration_time_s: float
    event_iteration_time_s: float
    events: tuple[tuple[int, str, int, float, float], ...]
    channels: tuple[dict[str, float], ...]
    stable: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class _WeightGrads:
    """Per stage the W seconds of a ZB-H1 plan's steady micro-batch (the rest of its backward is B)."""

    w: np.ndarray


@dataclass(frozen=True)
class _Chunks:
    """Per (rank, chunk) steady forward and backward and first/last extras of an interleaved plan."""

    fwd: np.ndarray
    bwd: np.ndarray
    first: np.ndarray
    last: np.ndarray


def _stage_results(plan: Plan, profile) -> tuple[list, _Chunks | _WeightGrads | None]:
    """Every stage's `StageResult` (one candidate each); for an interleaved plan its times are its
    chunks' sums, and the chunks' own times come with them."""
    t = plan.training
    models = []
    prec = precision_for(t, profile)
    inputs = stage_inputs(plan)
    for s in plan.stages:
        model = StageModel(
            plan.model,
            profile,
            s.tp,
            t.flash_attention,
            t.seq_len,
            prec,
            recompute_attention=s.recompute_attention,
            recompute_activation=s.recompute_activation,
            sequence_parallel=s.sequence_parallel,
            cp=s.cp,
            compiled=compile_mode(t.compile_blocks, plan.schedule),
        )
        models.append(model)
    if plan.schedule == ZB_H1:
        return _zero_bubble_results(plan, models, inputs)
    if plan.virtual_stages == 1:
        return [m.evaluate(st) for m, st in zip(models, inputs)], None
    per_chunk = [[m.evaluate(c) for c in cs] for m, cs in zip(models, chunk_inputs(plan, inputs))]
    # a rank's saved activations at its peak: its chunks' in flight under the interleaved order
    results = []
    for r, (m, st, cs) in enumerate(zip(models, inputs, per_chunk)):
        saved = np.array([float(c.saved_per_microbatch[0]) for c in cs])
        results.append(m.evaluate(interleaved_rank_input(st, r, plan.num_stages, plan.micro_batches, saved)))
    chunks = _Chunks(
        *(
            np.array([[float(getattr(c, k)[0]) for c in cs] for cs in per_chunk])
            for k in ("fwd", "T", "first_extra", "last_extra")
        )
    )
    chunks = replace(chunks, bwd=chunks.bwd - chunks.fwd)
    return [_rank_result(r, cs) for r, cs in zip(results, per_chunk)], chunks


def _zero_bubble_results(plan: Plan, models: list, inputs: list) -> tuple[list, _WeightGrads]:
    """Every stage's result under ZB-H1: W seconds and held output gradients from the trace, the
    in-flight micro-batches and held bytes of the zero-bubble order."""
    results, w = [], []
    for i, (m, st) in enumerate(zip(models, inputs)):
        wg = stage_weight_grad(m, st.b, st.layers, st.recompute, st.first, st.last, lets_go_in_b(plan.engine))
        saved = m.evaluate(st).saved_per_microbatch
        earlier, held = zb_held(i, plan.num_stages, plan.micro_batches, saved, wg)
        results.append(m.evaluate(replace(st, in_flight=earlier, waiting=held)))
        w.append(float(wg.with_grad_handling(results[-1].grads_per_microbatch)[0]))
    return results, _WeightGrads(np.array(w))


def _rank_result(rank, chunks: list):
    """A rank's result with its memory from `rank` (the whole rank) and its times, FLOPs and
    channel volumes the sums of its chunks'."""

    def total(k):
        return sum(getattr(c, k) for c in chunks)

    def total_dict(k):
        return {n: sum(getattr(c, k)[n] for c in chunks) for n in getattr(chunks[0], k)}

    return replace(
        rank,
        T=total("T"),
        D=total("D"),
        fwd=total("fwd"),
        first_extra=total("first_extra"),
        last_extra=total("last_extra"),
        delta_breakdown=total_dict("delta_breakdown"),
        detail_of=lambda: StageDetail(
            time_breakdown=total_dict("time_breakdown"),
            memory_breakdown=rank.memory_breakdown,
            flops_per_microbatch=total("flops_per_microbatch"),
            channels=total_dict("channels"),
        ),
    )


def _pipeline(plan: Plan, results: list, chunks: _Chunks | _WeightGrads | None = None):
    """Per-stage stable time T, forward F, first and last extras X, Y, and the iteration time (of
    an interleaved plan: its chunks played through the interleaved order; of a ZB-H1 plan: B and
    W through the zero-bubble order)."""
    T = np.array([float(r.T[0]) for r in results])
    F = np.array([float(r.fwd[0]) for r in results])
    X = np.array([float(r.first_extra[0]) for r in results])
    Y = np.array([float(r.last_extra[0]) for r in results])
    if isinstance(chunks, _WeightGrads):
        f, b, w = split_backward(T, F, chunks.w)
        it = float(zb_recurrence(f, b, w, X, Y, plan.micro_batches))
    elif chunks is None:
        it = float(iteration_time(T, plan.micro_batches, first=X, last=Y, fwd=F))
    else:
        it = float(interleaved_recurrence(chunks.fwd, chunks.bwd, chunks.first, chunks.last, plan.micro_batches))
    return T, F, X, Y, it


def _stage_prediction(i: int, r, capacity: float, profile) -> tuple[StagePrediction, str | None]:
    """Stage i's prediction, and the sentence saying why it does not fit (or None)."""
    peak = float(r.peak[0])
    need = float(need_bytes(peak))
    ok = need <= capacity
    problem = None
    if not ok:
        problem = (
            f"stage {i} needs {need / 2**30:.2f} GiB (peak {peak / 2**30:.2f} GiB + "
            f"{ALLOCATOR_MARGIN:.0%} allocator margin), {(need - capacity) / 2**30:.2f} GiB "
            f"over the {capacity / 2**30:.1f} GiB of a {profile.name}{outside_words(profile)}"
        )
    memory = {k: int(round(float(v[0]))) for k, v in r.memory_breakdown.items()}
    host = {k: int(round(float(v[0]))) for k, v in r.host.items()}
    stage = StagePrediction(
        stable_time_s=float(r.T[0]),
        delta_time_s=float(r.D[0]),
        first_microbatch_extra_s=float(r.first_extra[0]),
        last_microbatch_extra_s=float(r.last_extra[0]),
        peak_memory_bytes=int(round(peak)),
        fwd_peak_bytes=int(round(float(r.fwd_peak[0]))),
        bwd_peak_bytes=int(round(float(r.bwd_peak[0]))),
        step_peak_bytes=int(round(float(r.step_peak[0]))),
        memory_breakdown=memory,
        # the two terms the runtime accounts tensor by tensor (see `mist.runtime.memory`)
        state_bytes=int(
            round(sum(float(r.memory_breakdown[k][0]) for k in ("weights_bytes", "grads_bytes", "optimizer_bytes")))
        ),
        saved_activation_peak_bytes=int(round(float(r.saved_peak[0]))),
        host_state_bytes=host["state_bytes"],
        host_optimizer_grad_bytes=host["optimizer_grad_bytes"],
        host_activation_peak_bytes=host["activation_peak_bytes"],
        host_peak_bytes=host["peak_bytes"],
        time_breakdown={k: float(v[0]) for k, v in r.time_breakdown.items()},
        delta_breakdown={k: float(v[0]) for k, v in r.delta_breakdown.items()},
        fits=bool(ok),
    )
    return stage, problem


def _prediction(plan: Plan, profile, results: list, chunks: _Chunks | _WeightGrads | None) -> Prediction:
    t = plan.training
    _, _, _, _, it = _pipeline(plan, results, chunks)
    G = plan.micro_batches
    tokens = t.global_batch * t.seq_len
    # model FLOPs of one iteration: every stage's per-micro-batch FLOPs × its dp × G (no recompute)
    flops = sum(float(r.flops_per_microbatch[0]) * s.tp * s.dp * s.cp * G for r, s in zip(results, plan.stages))
    gpus = plan.cluster.world_size
    capacity = usable_bytes(profile)
    entries = [_stage_prediction(i, r, capacity, profile) for i, r in enumerate(results)]
    stages = [e for e, _ in entries]
    problems = [p for _, p in entries if p is not None]
    host = host_check(plan, profile, [st.host_peak_bytes for st in stages])
    fits = all(st.fits for st in stages) and host.fits
    problems += host.problems
    if isinstance(chunks, _WeightGrads):  # the part of each stage's backward that is W
        T, F, _, _, _ = _pipeline(plan, results, chunks)
        stages = [replace(st, weight_grad_time_s=float(w)) for st, w in zip(stages, split_backward(T, F, chunks.w)[2])]
    return Prediction(
        iteration_time_s=it,
        schedule=plan.schedule,
        throughput_samples_per_s=t.global_batch / it,
        tokens_per_s=tokens / it,
        mfu=flops / it / (gpus * profile.peak_flops),
        fits=bool(fits),
        memory_problems=tuple(problems),
        capacity_bytes=int(capacity),
        host_memory=host,
        gpu=profile.name,
        profile=profile.provenance,
        stages=tuple(stages),
    )


def _timeline(plan: Plan, results: list, chunks: _Chunks | _WeightGrads | None) -> Timeline:
    T, F, X, Y, it = _pipeline(plan, results, chunks)
    fwd, bwd = list(F), list(T - F)
    if isinstance(chunks, _WeightGrads):  # B and W of every stage on its lane
        f, b, w = split_backward(T, F, chunks.w)
        ev_time, events = zb_event_schedule(f, b, w, X, Y, plan.micro_batches)
    elif chunks is None:
        ev_time, events = event_schedule(fwd, bwd, list(X), list(Y), plan.micro_batches)
    else:  # (the events of every chunk of a rank on the rank's lanes)
        ev_time, chunk_events = interleaved_event_schedule(
            chunks.fwd.tolist(), chunks.bwd.tolist(), chunks.first.tolist(), chunks.last.tolist(), plan.micro_batches
        )
        events = [e[:5] for e in chunk_events]
    return Timeline(
        iteration_time_s=it,
        event_iteration_time_s=ev_time,
        events=tuple(events),
        channels=tuple({k: float(v[0]) for k, v in r.channels.items()} for r in results),
        stable=tuple((float(f), float(b)) for f, b in zip(fwd, bwd)),
    )


def simulate_plan(plan: Plan, profile) -> Prediction:
    """The prediction of `plan` on `profile`: iteration time, throughput, MFU, whether it fits, and
    per stage its times, memory and host memory (`to_json()`: what `mist simulate --json` prints)."""
    return _prediction(plan, profile, *_stage_results(plan, profile))


def plan_timeline(plan: Plan, profile) -> Timeline:
    """One iteration of `plan` on `profile` event by event (see `Timeline`)."""
    return _timeline(plan, *_stage_results(plan, profile))


def simulate_with_timeline(plan: Plan, profile) -> tuple[Prediction, Timeline]:
    """`simulate_plan` and `plan_timeline` from one evaluation of the stages."""
    results, chunks = _stage_results(plan, profile)
    return _prediction(plan, profile, results, chunks), _timeline(plan, results, chunks)
