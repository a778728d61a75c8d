"""Per-stage operation orders merged into one order that respects every dependency.

A pipeline schedule gives each stage (or rank) its own order of operations, and each operation
may wait for one operation of another stage (a forward for the upstream forward, a backward for
the downstream backward). `dependency_order` visits the stages round-robin and lets each run as
far as its next operation's dependency has run; any such merge gives every operation the same
start time, since a start depends only on its stage's previous end and its dependency's end.
The 1F1B, ZB-H1 and interleaved simulators all play their orders through it; `play_stages` is
the timed play of the non-interleaved ones (1F1B and ZB-H1), with one first and one last
micro-batch extra per stage on a side stream (`pipeline`'s semantics).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence

from mist.rules.pipeline_order import FORWARD

# depends(stage, op) -> the key of the operation it waits for, or None
Depends = Callable[[int, tuple], Hashable | None]
# key(stage, op) -> the hashable name `depends` uses for that operation
Key = Callable[[int, tuple], Hashable]


def dependency_order(
    orders: Sequence[Sequence[tuple]], depends: Depends, key: Key, what: str
) -> Iterator[tuple[int, tuple, Hashable | None]]:
    """(stage, op, key of what it waits for or None) of every op of `orders` (orders[i]: stage
    i's ops in its own order), each after its stage's previous op and after the op it waits for.
    Raises RuntimeError if some op can never run (the orders deadlock)."""
    seen: set = set()
    pos = [0] * len(orders)
    progress = True
    while progress:
        progress = False
        for i, order in enumerate(orders):
            while pos[i] < len(order):
                op = order[pos[i]]
                src = depends(i, op)
                if src is not None and src not in seen:
                    break
                seen.add(key(i, op))
                yield i, op, src
                pos[i] += 1
                progress = True
    if any(p < len(o) for p, o in zip(pos, orders)):
        raise RuntimeError(f"{what} schedule deadlocked")


def stage_key(stage: int, op: tuple) -> tuple:
    """The key of a non-interleaved stage's op (kind, micro-batch): (kind, stage, micro-batch)."""
    kind, m = op
    return (kind, stage, m)


def stage_waits(rule: Callable[[str, int, int, int], Hashable | None], stages: int) -> Depends:
    """`depends` of a non-interleaved schedule from its rule `rule(kind, stage, micro-batch,
    stages)` (`mist.rules.pipeline_order.depends_on`, `mist.rules.zero_bubble_order.depends_on`)."""
    return lambda i, op: rule(op[0], i, op[1], stages)


def play_stages(
    orders, depends: Depends, duration: Callable[[str, int], float], first_extra, last_extra, G: int, what: str
):
    """Start/end of every op (kind, micro-batch) of every stage and of the one-offs: (iteration
    time, events as (stage, kind, micro-batch, start, end)), kind an op's or "X" (first extra:
    runs from the start, the stage's first forward — kind "F", micro-batch 0 — waits for it) or
    "Y" (last extra: runs after the stage's last op, blocking nothing). `duration(kind, stage)`."""
    S = len(orders)
    events: list = [(i, "X", 0, 0.0, float(first_extra[i])) for i in range(S) if first_extra[i] > 0]
    done: dict = {}
    clock = [0.0] * S
    for i, (kind, m), src in dependency_order(orders, depends, stage_key, what):
        dep = 0.0 if src is None else done[src]
        if kind == FORWARD and m == 0:
            dep = max(dep, float(first_extra[i]))
        start = max(clock[i], dep)
        end = start + float(duration(kind, i))
        done[stage_key(i, (kind, m))] = end
        clock[i] = end
        events.append((i, kind, m, start, end))
    ends = []
    for i in range(S):
        y = float(last_extra[i])
        ends.append(clock[i] + y)
        if y > 0:
            events.append((i, "Y", G - 1, clock[i], clock[i] + y))
    return max(ends), events
