"""Two decisions of Inductor that set how many bytes a compiled graph's fused kernels move.

Mist prices each maximal run of pointwise and reduction operators between two library calls as
one fused kernel (`mist.analysis.compiled`). Inductor departs from that in two ways, both priced:

**Fusion across a library call** (`fuse_runs`). Inductor's scheduler fuses by dependency, not by
graph order: a run that reads a value an earlier run computes becomes one kernel with it, when
the library calls between them that depend on the earlier run can wait until after the later one
(none of them feeds it). Under selective recomputation, the GELU re-run for fc2's weight gradient
and the GELU backward after fc2's input gradient are one kernel (fc1's output read once, the
recomputed activation and the input gradient written), and the weight-gradient GEMM runs after
it; likewise a recomputed attention core's dropout and its backward draw their mask once.

**Values recomputed where they are read** (`recomputed_values`). Inductor lowers pointwise
operators to loop bodies that it inlines into the loops that read them; a value becomes a buffer
("realized") only when it must: a library call or a collective reads it, the graph returns it, a
reduction computes it, or a heuristic finds recomputing it in each reader too costly
(`torch._inductor.ir.StorageBox.should_realize_on_reuse` and `has_exceeded_max_reads`, PyTorch
2.11–2.13; the thresholds are read from `torch._inductor.config`):

* read by more than one operator, and its inlined body has more than `realize_opcount_threshold`
  operations (30 on a GPU, 50 on a CPU) or reads more than `realize_reads_threshold` buffers (4);
* on a CPU only: read by more than one operator, and its body computes exp, log, sigmoid or tanh;
* its body reads more than `realize_acc_reads_threshold` buffers (8 on a GPU, 12 on a CPU).

A value left unrealized that a later, unfused kernel reads (the residual sum that the second norm
reads, read again by the block's last addition after the MLP) is computed again there from the
buffers it came from, not stored and read back. An operation count here is the operators of the
inlined body plus its loads, which is how Inductor's counter sees them up to index arithmetic and
constants. Horizontal fusion (two runs that only read the same buffer) is not modelled.
"""

from __future__ import annotations

import torch
import torch.fx

# operators Inductor lowers to pointwise loop bodies (inlinable); everything else that is not a
# library call is a reduction or a layout operator (cat, index_put, scatter, seeds), kept in memory
POINTWISE = {
    "abs",
    "add",
    "clamp",
    "clamp_max",
    "clamp_min",
    "clone",
    "convert_element_type",
    "cos",
    "div",
    "eq",
    "erf",
    "exp",
    "exp2",
    "expm1",
    "fma",
    "fmod",
    "full",
    "ge",
    "gt",
    "inductor_lookup_seed",
    "inductor_random",
    "iota",
    "le",
    "log",
    "log1p",
    "log2",
    "logical_and",
    "logical_not",
    "logical_or",
    "lt",
    "maximum",
    "minimum",
    "mul",
    "ne",
    "neg",
    "pow",
    "reciprocal",
    "relu",
    "rsqrt",
    "sigmoid",
    "sign",
    "sin",
    "sqrt",
    "sub",
    "tanh",
    "where",
}
# the operators whose reuse a CPU realizes whatever its size (`should_realize_on_reuse`)
_CPU_HEAVY = {"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"}


def _thresholds(target: str) -> tuple[int, int, int]:
    """(operations, reads on reuse, accumulated reads) above which Inductor realizes a value."""
    import torch._inductor.config as cfg  # lazy: Inductor only where blocks are compiled

    def setting(name: str, cpu: tuple[str, int], gpu: tuple[str, int]) -> int:
        """A threshold the user set, else the device kind's default (the name, its value if absent)."""
        v = getattr(cfg, name, None)
        if v is None:
            attr, fallback = cpu if target == "cpu" else gpu
            v = getattr(cfg, attr, fallback)
        return int(v)

    ops = setting(
        "realize_opcount_threshold", ("realize_cpu_opcount_threshold", 50), ("_realize_opcount_threshold_default", 30)
    )
    acc = setting(
        "realize_acc_reads_threshold",
        ("realize_cpu_acc_reads_threshold", 12),
        ("_realize_acc_reads_threshold_default", 8),
    )
    return ops, int(cfg.realize_reads_threshold), acc


def recomputed_values(
    gm: torch.fx.GraphModule, name, views: set[str], source, reductions: set[str], target: str
) -> set[str]:
    """Names of the pointwise nodes of `gm` that Inductor does not realize (see above).

    `name(node)`: the operator's name; `views`: operators that alias their first argument;
    `source(node)`: the node whose buffer an argument is (as for `fuse_runs`);
    `reductions`: the row reductions, which inline their pointwise inputs as pointwise operators
    do. Any other reader (a library call, a collective, a layout operator) takes a buffer."""
    max_ops, max_reuse_reads, max_reads = _thresholds(target)
    returned = set()
    for n in gm.graph.nodes:
        if n.op == "output":
            returned |= {a.name for a in n.all_input_nodes}

    def readers(n: torch.fx.Node) -> list[torch.fx.Node]:  # through views
        out = []
        for u in n.users:
            if u.op == "call_function" and name(u) in views:
                out.extend(readers(u))
            else:
                out.append(u)
        return out

    def returned_through_views(n: torch.fx.Node) -> bool:
        return n.name in returned or any(
            u.op == "call_function" and name(u) in views and returned_through_views(u) for u in n.users
        )

    reads: dict[str, frozenset[str]] = {}  # buffers each unrealized body reads
    ops: dict[str, int] = {}  # its operations
    heavy_of: dict[str, bool] = {}  # whether it computes one of _CPU_HEAVY
    inlined: set[str] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or name(n) not in POINTWISE or name(n) in views:
            continue
        r: set[str] = set()
        count = 1
        heavy = name(n) in _CPU_HEAVY
        for a in n.all_input_nodes:
            b = source(a)
            if b.name in inlined:
                r |= reads[b.name]
                count += ops[b.name]
                heavy = heavy or heavy_of[b.name]
            else:
                r.add(b.name)
                count += 1  # its load
        users = readers(n)
        realize = (
            returned_through_views(n)
            or any(u.op != "call_function" or name(u) not in POINTWISE | reductions for u in users)
            or len(r) > max_reads
            or (len(n.users) > 1 and (count > max_ops or len(r) > max_reuse_reads or (target == "cpu" and heavy)))
        )
        if not realize:
            inlined.add(n.name)
            reads[n.name], ops[n.name] = frozenset(r), count
            heavy_of[n.name] = heavy
    return inlined


def fuse_runs(items: list, source) -> list:
    """`items`, one kernel each in graph order — (what, nodes), "run" for a run of pointwise and
    reduction operators — with every run that a later run reads from fused into it where the
    kernels between them allow (see above), and the kernels that depend on the earlier run moved
    after the fused one. `source(node)`: the node whose buffer an argument is (through views and
    a library call's getitems)."""
    items = [(what, list(ns)) for what, ns in items]
    keys = [float(i) for i in range(len(items))]
    alive = [True] * len(items)
    item_of = {n.name: i for i, (_, ns) in enumerate(items) for n in ns}

    def deps(i: int) -> set[int]:
        out = set()
        for n in items[i][1]:
            for a in n.all_input_nodes:
                j = item_of.get(source(a).name)
                if j is not None and j != i:
                    out.add(j)
        return out

    def ancestors(i: int) -> set[int]:
        seen: set[int] = set()
        stack = list(deps(i))
        while stack:
            k = stack.pop()
            if k not in seen:
                seen.add(k)
                stack.extend(deps(k))
        return seen

    def fuse_one(j: int) -> bool:
        """Fuse into run j the latest earlier run it reads from that may be fused; whether one was."""
        for i in sorted(deps(j), key=lambda k: -keys[k]):
            if not alive[i] or items[i][0] != "run":
                continue
            between = [k for k in range(len(items)) if alive[k] and keys[i] < keys[k] < keys[j]]
            moved = [k for k in between if i in ancestors(k)]
            if set(moved) & ancestors(j):
                continue  # the later run needs a kernel that needs the earlier one
            items[j] = ("run", items[i][1] + items[j][1])
            alive[i] = False
            for n in items[i][1]:
                item_of[n.name] = j
            after = [keys[k] for k in range(len(items)) if alive[k] and keys[k] > keys[j]]
            step = ((min(after) if after else keys[j] + 1.0) - keys[j]) / (len(moved) + 1)
            for r, k in enumerate(sorted(moved, key=lambda k: keys[k])):
                keys[k] = keys[j] + (r + 1) * step
            return True
        return False

    for j in range(len(items)):
        while items[j][0] == "run" and fuse_one(j):
            pass
    return [items[k] for k in sorted((k for k in range(len(items)) if alive[k]), key=lambda k: keys[k])]
