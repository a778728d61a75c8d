"""The private and experimental PyTorch APIs Mist depends on, in one place.

PyTorch may change or drop these between releases without notice. Everything else in Mist imports
them from here, and tests/test_torch_compat.py checks that each one exists and still behaves as
Mist uses it, so a new PyTorch that breaks one fails there, by name, rather than somewhere deep in
a trace or a training step. `CHECKED_VERSIONS` lists the PyTorch releases that test passed on.

* `fused_adamw_` (`torch._fused_adamw_`): the fused AdamW kernel behind
  `torch.optim.AdamW(fused=True)` (CUDA, and CPU since 2.4) — one pass over parameter, moments
  and gradient, the decoupled weight decay included, instead of about eight elementwise kernels.
  `runtime.optimizer` calls it on the matrices' ranges with the weight decay and on the rest
  without, and falls back to the same arithmetic in plain tensor ops where `HAS_FUSED_ADAM` is
  false.
* `FakeTensorMode`, `unset_fake_temporarily` (`torch._subclasses.fake_tensor`): tensors with
  shapes, dtypes and storages but no data; `analysis.tracer` builds and runs a layer under it.
  `unset_fake_temporarily` makes a real tensor while the mode is active. `symbolic_fake_mode`
  makes one with a ShapeEnv and its dispatch cache off (`FakeTensorMode.cache_enabled`): in a
  trace with symbolic sizes almost no call repeats, so building cache entries cost more than they
  saved (a Llama-3 8B block's trace took 1.25 s with the cache, 0.56 s without).
* `ShapeEnv`, `DimDynamic`, `StatelessSymbolicContext` (`torch.fx.experimental.symbolic_shapes`):
  symbolic sizes, so a traced tensor's size is a sympy expression (`size.node.expr`) in the
  batch and sequence symbols. Imported on first use: they pull in sympy, which the runtime and
  the CLI's start-up do not need.
* `FloorDiv` (`torch.utils._sympy.functions`): the sympy function a ShapeEnv writes integer
  division of sizes with (a sequence split over the TP ranks, s // tp). Imported on first use.
* `TorchDispatchMode` (`torch.utils._python_dispatch`): sees every aten call (`func`, its
  arguments and outputs); the tracer records the ops with it.
* `pytree` (`torch.utils._pytree`): `tree_leaves` flattens an aten call's nested arguments.
* `storage_id` (`UntypedStorage._cdata`): the address of a tensor's storage object, which the
  tracer uses to tell buffers apart (views share it, fake tensors have one each).
* `allocation_events` (`_KinetoResults.experimental_event_tree`, `_EventType.Allocation`): the
  allocator's events that `torch.profiler` recorded with `profile_memory=True`, with the address
  of each block, which the public event list does not give, and the profiler's id of the thread
  that recorded it (`start_tid`); `runtime.allocator_trace` pairs each release with its
  allocation by the address and keeps the blocks of the rank's own thread by the id.
  `marked_time` finds a `record_function` range in the same tree, on the same clock.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    from torch.utils._sympy.functions import FloorDiv

#: PyTorch releases tests/test_torch_compat.py passed on (version without the local "+cpu" part).
CHECKED_VERSIONS = ("2.13.0",)

#: whether this PyTorch has the fused AdamW kernel
HAS_FUSED_ADAM = hasattr(torch, "_fused_adamw_")

_SYMBOLIC_SHAPES = "torch.fx.experimental.symbolic_shapes"
_LAZY = {
    "DimDynamic": _SYMBOLIC_SHAPES,
    "ShapeEnv": _SYMBOLIC_SHAPES,
    "StatelessSymbolicContext": _SYMBOLIC_SHAPES,
    "FloorDiv": "torch.utils._sympy.functions",
}

__all__ = [
    "CHECKED_VERSIONS",
    "HAS_FUSED_ADAM",
    "allocation_events",
    "marked_time",
    "DimDynamic",
    "FakeTensorMode",
    "FloorDiv",
    "ShapeEnv",
    "StatelessSymbolicContext",
    "TorchDispatchMode",
    "fused_adamw_",
    "pytree",
    "storage_id",
    "symbolic_fake_mode",
    "torch_release",
    "unset_fake_temporarily",
]


def __getattr__(name: str):
    """The names of `_LAZY`, imported from their module on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def torch_release() -> str:
    """The running PyTorch's version without its local part ("2.13.0+cpu" -> "2.13.0")."""
    return torch.__version__.split("+")[0]


def fused_adamw_(
    ps: list[torch.Tensor],
    gs: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step in place on the fp32 tensors ps (parameters), ms and vs (moments), with
    gradients gs and decoupled weight decay; `step` counts from 1 (it sets the bias corrections)."""
    if not ps:
        return
    steps = [torch.tensor(float(step), dtype=torch.float32, device=ps[0].device) for _ in ps]
    torch._fused_adamw_(
        ps,
        gs,
        ms,
        vs,
        [],
        steps,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=False,
        maximize=False,
    )


def symbolic_fake_mode() -> FakeTensorMode:
    """A FakeTensorMode with a fresh ShapeEnv, only fake inputs, and no dispatch cache."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv  # lazy: pulls in sympy (module docstring)

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
    mode.cache_enabled = False
    return mode


def storage_id(t: torch.Tensor) -> int:
    """An identifier of the storage `t` lives in: equal for views of one buffer, distinct for
    buffers alive at the same time."""
    return t.untyped_storage()._cdata


def _event_nodes(prof: torch.profiler.profile):
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        yield node


def allocation_events(prof: torch.profiler.profile, thread_of: str | None = None) -> list[tuple[int, int, int]]:
    """The allocations and releases a stopped `torch.profiler.profile(profile_memory=True)`
    recorded, in time order: (time in ns, block address, bytes: positive when allocated, negative
    when released).

    `thread_of`: the name of a `record_function` range. Given, only the blocks allocated on the
    thread that recorded it are kept, with their releases (on whichever thread). The profiler also
    records the worker threads of gloo, which allocate their own copies of a collective's tensors
    there (an all-gather's flat output, while the caller has already gone on); those are not the
    traced code's. Where no such range was recorded, every thread's blocks are kept."""
    from torch._C._profiler import _EventType  # lazy: only a traced CPU run reads the profiler

    nodes = list(_event_nodes(prof))
    thread = next((n.start_tid for n in nodes if thread_of is not None and n.name == thread_of), None)
    events = [
        (n.start_time_ns, n.typed[1].ptr, n.typed[1].alloc_size, n.start_tid)
        for n in nodes
        if n.typed[0] == _EventType.Allocation
    ]
    events.sort(key=lambda e: e[0])
    out, elsewhere = [], set()  # addresses of live blocks another thread allocated
    for t, addr, nbytes, tid in events:
        if nbytes > 0 and thread is not None and tid != thread:
            elsewhere.add(addr)
            continue
        if addr in elsewhere:  # its release, or (released unseen) the address handed out again
            elsewhere.discard(addr)
            if nbytes < 0:
                continue
        out.append((t, addr, nbytes))
    return out


def marked_spans(prof: torch.profiler.profile, name: str) -> list[tuple[int, int]]:
    """(start, end) of every `torch.profiler.record_function(name)` range a stopped profiler
    recorded, in time order, on the clock of `allocation_events`."""
    return sorted((node.start_time_ns, node.end_time_ns) for node in _event_nodes(prof) if node.name == name)


def marked_time(prof: torch.profiler.profile, name: str) -> int | None:
    """When the first `torch.profiler.record_function(name)` range a stopped profiler recorded
    began, on the clock of `allocation_events` (None when there is none)."""
    spans = marked_spans(prof, name)
    return spans[0][0] if spans else None
