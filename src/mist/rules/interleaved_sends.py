"""When an interleaved rank of Mist's runtime waits for what it has sent, and the game that shows
those waits cannot block.

A send is non-blocking; what it sends stays allocated until the rank waits for it. On gloo (and
on a GPU's streams) such a wait returns only when the receiver has posted the matching receive,
so a wait made too early can close a cycle of ranks each waiting for the next. A 1F1B stage waits
for an output at once and for a gradient when it sends the next one (`runtime.p2p.Sends`); on an
interleaved order, whose last rank sends on to the first, both block.

An interleaved rank sends its activations to rank r + 1 and its input gradients to rank r − 1
(around the ring), and it waits:

- for each input gradient just before the first receive whose sender, in its own order, takes
  that gradient before sending the input (`gradient_waits`): the sender has then posted the
  gradient's receive before the one this rank waits on;
- for each output just before its third operation after the forward that sent it
  (`output_waits`): the receiving rank runs two fewer warm-up forwards than its sender, so it
  takes a micro-batch's activation about two of its operations later than it was sent.

`send_waits` plays every rank's order with these waits as rendezvous (`plays_through`); were a
shape to block, it falls back to waits that cannot (outputs when their gradients are back,
gradients at the end of the step), so the runtime and the memory model always use waits that
played through. In the shapes the tests play (2-12 ranks, 2-6 chunks, G up to 6p) none blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from mist.rules.interleaved_order import interleaved_one_f_one_b, interleaved_warmup
from mist.rules.pipeline_order import BACKWARD, FORWARD

ACTIVATION, GRADIENT = "activation", "gradient"  # what a send carries
RECEIVE, SEND = 0, 1  # where in an operation a wait is made: before its receive, before its send
OUTPUT_LAG = 3  # an output is waited for before this many operations after its forward's


def plays_through(orders, waits) -> bool:
    """Whether every rank gets through its operations when each receive blocks until its sender
    has sent and each wait until the receive it waits on is posted. `orders[r]`: rank r's
    (kind, micro-batch, model position) operations, kind `FORWARD` (receives from the position
    before, sends to the one after) or `BACKWARD` (the other way; other kinds exchange nothing);
    `waits[r]`: {(operation index, RECEIVE or SEND): ((ACTIVATION or GRADIENT, micro-batch,
    position it was sent from), …)}. The model's first position receives no activation and its
    last sends none. The game's outcome does not depend on the order it plays the ranks in: each
    rank runs its operations in sequence and every message has one sender and one receiver."""
    last = max((k for ops in orders for _, _, k in ops), default=0)
    pc, phase = [0] * len(orders), [RECEIVE] * len(orders)
    posted: set = set()  # (kind, micro-batch, receiving position)
    sent: set = set()  # (kind, micro-batch, sending position)

    def delivered(send) -> bool:
        kind, g, k = send
        return (kind, g, k + 1 if kind == ACTIVATION else k - 1) in posted

    while True:
        moved = False
        for r, ops in enumerate(orders):
            while pc[r] < len(ops):
                kind, g, k = ops[pc[r]]
                if not all(map(delivered, waits[r].get((pc[r], phase[r]), ()))):
                    break
                if kind == FORWARD:
                    gets, puts = (ACTIVATION, g, k - 1) if k > 0 else None, (ACTIVATION, g, k) if k < last else None
                elif kind == BACKWARD:
                    gets, puts = (GRADIENT, g, k + 1) if k < last else None, (GRADIENT, g, k) if k > 0 else None
                else:
                    gets = puts = None
                if phase[r] == RECEIVE and gets is not None:
                    posted.add((gets[0], g, k))
                    if gets not in sent:
                        break
                    phase[r], moved = SEND, True
                    continue
                if puts is not None:
                    sent.add(puts)
                pc[r], phase[r], moved = pc[r] + 1, RECEIVE, True
        if all(p == len(ops) for p, ops in zip(pc, orders)):
            return True
        if not moved:
            return False


def gradient_waits(rank: int, ranks: int, chunks: int, micro_batches: int) -> dict:
    """{(FORWARD, micro-batch, chunk) of an operation that receives its input: the (micro-batch,
    chunk) of the backwards whose sent input gradients rank `rank` waits for just before that
    receive} (see the module docstring). Its gradients go to and its inputs come from the same
    rank, r − 1 (rank 0's: the last rank)."""
    src = (rank - 1) % ranks
    where = {op: i for i, op in enumerate(interleaved_one_f_one_b(src, ranks, chunks, micro_batches))}

    def on_src(c: int) -> int:  # a chunk of this rank: the sender's chunk of the position before
        return (c * ranks + rank - 1) // ranks

    held: list[tuple[int, int]] = []
    waits: dict = {}
    for kind, g, c in interleaved_one_f_one_b(rank, ranks, chunks, micro_batches):
        if kind == FORWARD:
            if not _sends_gradient(rank, c):
                continue  # the model's first chunk receives no input
            sent_at = where[(FORWARD, g, on_src(c))]
            now = tuple(h for h in held if where[(BACKWARD, h[0], on_src(h[1]))] < sent_at)
            if now:
                waits[(FORWARD, g, c)] = now
                held = [h for h in held if h not in now]
        elif _sends_gradient(rank, c):
            held.append((g, c))
    return waits


def output_waits(rank: int, ranks: int, chunks: int, micro_batches: int) -> dict:
    """{(kind, micro-batch, chunk) of an operation: the (micro-batch, chunk) of the forwards whose
    sent outputs rank `rank` waits for before it} — each `OUTPUT_LAG` operations after its own,
    unless its backward comes first (which waits for it once its gradient is back: its receiver
    has taken it then)."""
    order = interleaved_one_f_one_b(rank, ranks, chunks, micro_batches)
    at = {op: i for i, op in enumerate(order)}
    waits: dict = {}
    for i, (kind, g, c) in enumerate(order):
        if kind == FORWARD and _sends_output(rank, ranks, chunks, c) and i + OUTPUT_LAG < at[(BACKWARD, g, c)]:
            waits.setdefault(order[i + OUTPUT_LAG], []).append((g, c))
    return {op: tuple(w) for op, w in waits.items()}


@dataclass(frozen=True)
class SendWaits:
    """Where one interleaved rank waits for its sends: `gradients` before the receive of the
    operations keyed, `outputs` before the operations keyed; an output not waited for so is when
    its gradient has come back, in its backward."""

    gradients: dict
    outputs: dict


@lru_cache(maxsize=256)
def send_waits(ranks: int, chunks: int, micro_batches: int) -> tuple[SendWaits, ...]:
    """Every rank's `SendWaits` for interleaved 1F1B: the module docstring's, if they play
    through; else outputs when their gradients are back and gradients at the end of the step."""
    G = micro_batches
    rules = tuple(
        SendWaits(gradient_waits(r, ranks, chunks, G), output_waits(r, ranks, chunks, G)) for r in range(ranks)
    )
    if plays_through(*_game(rules, ranks, chunks, G)):
        return rules
    return tuple(SendWaits({}, {}) for _ in range(ranks))


def _game(rules: tuple[SendWaits, ...], ranks: int, chunks: int, G: int):
    """The orders and waits of `plays_through` for these `rules`."""
    orders, waits = [], []
    for r, rule in enumerate(rules):
        order = interleaved_one_f_one_b(r, ranks, chunks, G)
        orders.append([(kind, g, c * ranks + r) for kind, g, c in order])
        w: dict = {}
        for i, op in enumerate(order):
            kind, g, c = op
            got = [(GRADIENT, gg, cc * ranks + r) for gg, cc in rule.gradients.get(op, ())]
            got += [(ACTIVATION, gg, cc * ranks + r) for gg, cc in rule.outputs.get(op, ())]
            if got:
                w[(i, RECEIVE)] = tuple(got)
            if kind == BACKWARD and _sends_output(r, ranks, chunks, c):
                w[(i, SEND)] = ((ACTIVATION, g, c * ranks + r),)
        waits.append(w)
    return orders, waits


@dataclass(frozen=True)
class HeldSends:
    """What an interleaved rank holds of its sends: the most earlier outputs while a forward runs,
    the most outputs (its own included) while a backward runs, and the most input gradients when
    a steady-state backward starts (through the steady state a forward follows each backward, so
    the micro-batches in flight stay at their peak there; 0 without one)."""

    outputs_forward: int
    outputs_backward: int
    gradients: int


@lru_cache(maxsize=1024)
def held_sends(rank: int, ranks: int, chunks: int, micro_batches: int) -> HeldSends:
    """Rank `rank`'s `HeldSends` under `send_waits`."""
    return _held(send_waits(ranks, chunks, micro_batches)[rank], rank, ranks, chunks, micro_batches)


@lru_cache(maxsize=1024)
def kept_outputs(rank: int, ranks: int, chunks: int, micro_batches: int) -> HeldSends:
    """Rank `rank`'s `HeldSends` on an engine that keeps every sent output until its backward and
    holds the input gradient it sent last: each micro-batch chunk in flight holds its output
    (not the model's last chunk's, which sends none)."""
    keep = SendWaits({}, {})
    return replace(_held(keep, rank, ranks, chunks, micro_batches), gradients=1)


@dataclass(frozen=True)
class HeldBeside:
    """What a rank holds beside one operation: the other micro-batches in flight per chunk
    (forwards run less backwards run, the operation's own left out), and the sent outputs and
    input gradients it has not waited for."""

    others: tuple[int, ...]
    outputs: int
    gradients: int


WAITS, KEEPS, FREES = "waits", "keeps", "frees"  # how an engine holds its sends (`held_beside`)


@lru_cache(maxsize=1024)
def held_beside(
    rank: int, ranks: int, chunks: int, micro_batches: int, chunk: int, sends: str
) -> tuple[tuple[HeldBeside, ...], tuple[HeldBeside, ...]]:
    """The distinct `HeldBeside` of rank `rank` as a forward of `chunk` starts and as a backward of
    it ends: what the unit that runs first in the chunk's forward and last in its backward (the
    embedding, in the model's first chunk) runs beside. `sends`: `WAITS` as Mist's runtime waits
    for them (`send_waits`); `KEEPS`, every output until its backward and the gradient sent last
    (`kept_outputs`); `FREES`, no output and the gradient sent last."""
    held = [0] * chunks
    fwd: dict[HeldBeside, None] = {}
    bwd: dict[HeldBeside, None] = {}
    for (kind, g, c), outputs, grads in _engine_walk(rank, ranks, chunks, micro_batches, sends):
        if kind == FORWARD:
            if c == chunk:
                fwd[_beside(held, len(outputs), len(grads), sends)] = None
            held[c] += 1
            continue
        held[c] -= 1
        if c == chunk:  # (its own output dropped with it)
            bwd[_beside(held, len(outputs - {(g, c)}), len(grads), sends)] = None
    return tuple(fwd), tuple(bwd)


@lru_cache(maxsize=1024)
def held_at_ops(
    rank: int, ranks: int, chunks: int, micro_batches: int, sends: str, chunk: int | None = None
) -> tuple[tuple[HeldBeside, ...], tuple[HeldBeside, ...]]:
    """The distinct `HeldBeside` of rank `rank` as each of its forwards starts and each of its
    backwards starts (of `chunk` only, if given), the operation's own micro-batch chunk counted in
    `others` (as the stage model prices a block's peaks: its chunk's saved activations whole, the
    block's transient in place of its own), and its own output where a backward holds it. What a
    block of any chunk peaks beside, state by state, where the rank's counts (`HeldSends`,
    `held_saved_peak`) are each the most at some operation, not all at the same one; with the
    model's last chunk, what the head does (it runs last in that chunk's forward and first in its
    backward). `sends` as in `held_beside`."""
    held = [0] * chunks
    fwd: dict[HeldBeside, None] = {}
    bwd: dict[HeldBeside, None] = {}
    for (kind, _, c), outputs, grads in _engine_walk(rank, ranks, chunks, micro_batches, sends):
        state = fwd if kind == FORWARD else bwd
        if kind == FORWARD:
            held[c] += 1
        if chunk is None or c == chunk:
            state[_beside(held, len(outputs), len(grads), sends)] = None
        if kind == BACKWARD:
            held[c] -= 1
    return tuple(fwd), tuple(bwd)


def _engine_walk(rank: int, ranks: int, chunks: int, G: int, sends: str):
    """`_walk` of the rank's order with its sends held as `sends` says: under `WAITS`, waited for
    by `send_waits`; else never waited for (`_beside` then counts them as the engine holds them)."""
    rule = send_waits(ranks, chunks, G)[rank] if sends == WAITS else SendWaits({}, {})
    return _walk(rule, rank, ranks, chunks, G)


def _beside(held: list[int], outputs: int, grads: int, sends: str) -> HeldBeside:
    if sends == WAITS:
        return HeldBeside(tuple(held), outputs, grads)
    return HeldBeside(tuple(held), outputs if sends == KEEPS else 0, 1)


def _walk(rule: SendWaits, rank: int, ranks: int, chunks: int, G: int):
    """Every operation of the rank's order with the sent outputs and input gradients it holds
    when the operation starts (its waits made): (op, outputs, gradients), each a set of
    (micro-batch, chunk); the sets are the walk's own, read before the next step."""
    outputs: set[tuple[int, int]] = set()
    grads: set[tuple[int, int]] = set()
    for op in interleaved_one_f_one_b(rank, ranks, chunks, G):
        kind, g, c = op
        outputs -= set(rule.outputs.get(op, ()))
        grads -= set(rule.gradients.get(op, ()))
        yield op, outputs, grads
        if kind == FORWARD:
            if _sends_output(rank, ranks, chunks, c):
                outputs.add((g, c))
            continue
        outputs.discard((g, c))  # (dropped with its backward, if not waited for before)
        if _sends_gradient(rank, c):
            grads.add((g, c))


def _held(rule: SendWaits, rank: int, ranks: int, chunks: int, G: int) -> HeldSends:
    steady = G * chunks - interleaved_warmup(rank, ranks, chunks, G)
    most_f = most_b = most_g = backwards = 0
    for (kind, _, _), outputs, grads in _walk(rule, rank, ranks, chunks, G):
        if kind == FORWARD:
            most_f = max(most_f, len(outputs))
            continue
        most_b = max(most_b, len(outputs))
        if backwards < steady:
            most_g = max(most_g, len(grads))
        backwards += 1
    return HeldSends(most_f, most_b, most_g)


def _sends_gradient(rank: int, chunk: int) -> bool:
    """Whether a backward of `chunk` on `rank` sends an input gradient (and its forward receives
    an input): all but the model's first chunk's."""
    return rank > 0 or chunk > 0


def _sends_output(rank: int, ranks: int, chunks: int, chunk: int) -> bool:
    """Whether a forward of `chunk` on `rank` sends its output: all but the model's last chunk's."""
    return rank < ranks - 1 or chunk < chunks - 1
