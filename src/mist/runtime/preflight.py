"""Before any worker allocates: does this node have the RAM that the plan's states will take?

A plan that does not fit a node's memory should fail with one sentence, not bring the machine into
the out-of-memory killer halfway through building its states. What lands in this node's RAM:

- on GPUs, the host part of every local rank's states (the offloaded tails of its weights,
  gradients and optimizer states);
- on CPU workers, all of every local rank's states (the "device" is the host too).

The bytes are those of `mist.simulate.states` over the flat units the runtime builds (a decoder
block per unit, the embedding and the head not offloaded), with each block's parameters taken as
its unsharded count over tp: a lower bound (norms and KV-head copies are replicated), so a refusal
is never wrong. Activations come on top and are not counted here.
"""

from __future__ import annotations

from mist.dtypes import DTYPE_BYTES
from mist.errors import MistInputError
from mist.plan import Plan
from mist.simulate.precision import Precision
from mist.simulate.states import unit_host_states, unit_states
from mist.units import GiB


def _stage_bytes(plan: Plan, i: int, host_only: bool) -> float:
    """Lower bound on the state bytes one rank of stage i keeps in host RAM."""
    s, m, S = plan.stages[i], plan.model, plan.num_stages
    pb = DTYPE_BYTES[plan.training.param_dtype]
    prec = Precision(weight_bytes=pb, grad_bytes=plan.training.grad_bytes)
    G, o = plan.micro_batches, s.offload
    units = [(m.block_params() / s.tp, o.weights, o.grads, o.optimizer)] * s.layers
    if i == 0:
        units.append((m.embedding_params() / s.tp, 0.0, 0.0, 0.0))
    if i == S - 1:
        units.append((m.head_params() / s.tp, 0.0, 0.0, 0.0))
        if m.tie_embeddings and S > 1:  # the last stage's copy of the tied word embedding
            units.append((m.vocab_size * m.hidden_size / s.tp, 0.0, 0.0, 0.0))
    total = 0.0
    for params, offload_weights, offload_grads, offload_optimizer in units:
        host = unit_host_states(params, s.dp * s.cp, s.zero, offload_weights, offload_grads, offload_optimizer, G, prec)
        total += float(sum(host[:3]))
        if not host_only:
            total += float(
                sum(
                    unit_states(params, s.dp * s.cp, s.zero, offload_weights, offload_grads, offload_optimizer, G, prec)
                )
            )
    return total


def node_state_bytes(plan: Plan, ranks, device_type: str) -> float:
    """State bytes in the RAM of the node that runs global `ranks` (stages take consecutive ranks)."""
    owner = [i for i, s in enumerate(plan.stages) for _ in range(s.gpus)]
    per_stage = {}
    total = 0.0
    for r in ranks:
        i = owner[r]
        if i not in per_stage:
            per_stage[i] = _stage_bytes(plan, i, host_only=device_type == "cuda")
        total += per_stage[i]
    return total


def available_memory() -> int | None:
    """MemAvailable of this machine in bytes (None where /proc/meminfo cannot tell)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_node_memory(plan: Plan, ranks, device_type: str, available: int | None = None) -> None:
    """Raise MistInputError when the node's available RAM cannot hold the states of its ranks."""
    available = available_memory() if available is None else available
    if available is None:
        return
    need = node_state_bytes(plan, ranks, device_type)
    if need > available:
        what = (
            "the offloaded parts of their weights, gradients and optimizer states"
            if device_type == "cuda"
            else "their weights, gradients and optimizer states"
        )
        raise MistInputError(
            f"This node has {available / GiB:.1f} GiB of memory available, but the plan's {len(ranks)} "
            f"rank(s) here need at least {need / GiB:.1f} GiB of it for {what} (activations come on top)."
        )
