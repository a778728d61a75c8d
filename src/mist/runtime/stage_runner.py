"""One pipeline stage: its modules, its flat units, and how a micro-batch runs through them.

A stage holds the embedding (first stage), its decoder blocks and the head (last stage) on this
rank's TP shard. Every one of them is a `FlatUnit`. `StageRunner.forward` runs the units in order:
before a unit runs its weights are materialised (and the next unit's prefetched), after it they
are released again unless the unit is persistent; a hook on the unit's output re-materialises
them when backward reaches it (and prefetches the unit before). The last `recompute_layers`
blocks run under reentrant checkpointing (`run_block`), the others, with `recompute_attention`
and `recompute_activation`, re-run their attention core and their MLP activation in backward;
activation offloading applies to the
tensors saved by the decoder blocks. With `training.compile_blocks` the blocks run compiled
(`mist.models.compiled`); the embedding and the head stay eager. Gradient reduction happens in the units' own hooks.
A schedule object (`schedule.py`) decides the order of forwards and backwards.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from mist.models import DecoderBlock, Embedding, Head, TPGroup
from mist.models.checkpointing import run_block
from mist.models.compiled import compile_block
from mist.rules.compiled_blocks import SPLIT
from mist.runtime.activations import SavedTensorManager
from mist.runtime.flat import FlatUnit
from mist.runtime.sharding import local_to_full_name
from mist.specs.model import ModelSpec


class StageModule(nn.Module):
    """Embedding (first stage), decoder blocks, head (last stage) on one TP shard."""

    def __init__(
        self,
        spec: ModelSpec,
        tp: TPGroup,
        flash: bool,
        first: bool,
        last: bool,
        layers: int,
        first_layer: int,
        dtype=torch.float32,
        device="cpu",
    ):
        super().__init__()
        self.spec, self.first, self.last, self.first_layer = spec, first, last, first_layer
        self.embedding = Embedding(spec, tp, dtype, device) if first else None
        self.blocks = nn.ModuleList(DecoderBlock(spec, tp, flash, dtype, device) for _ in range(layers))
        self.head = Head(spec, tp, dtype, device) if last else None
        if spec.tie_embeddings and first and last:
            self.head.weight = self.embedding.word

    def full_name(self, local_name: str) -> str:
        name = local_to_full_name(local_name, self.first_layer)
        # a tied head without the embedding on its stage holds the embedding's values
        if name == "head.weight" and self.spec.tie_embeddings:
            return "embedding.word"
        return name

    def unit_modules(self) -> list[tuple[str, nn.Module]]:
        """(local name prefix, module) of every unit in forward order."""
        out = []
        if self.embedding is not None:
            out.append(("embedding", self.embedding))
        out += [(f"blocks.{i}", b) for i, b in enumerate(self.blocks)]
        if self.head is not None:
            out.append(("head", self.head))
        return out

    def owners(self) -> dict[int, list[tuple[nn.Module, str]]]:
        """id(parameter) → every (module, attribute) holding it (tied weights have two)."""
        own: dict[int, list] = {}
        for mod in self.modules():
            for attr, p in mod._parameters.items():
                if p is not None:
                    own.setdefault(id(p), []).append((mod, attr))
        return own


class StageRunner:
    def __init__(
        self,
        module: StageModule,
        units: list[FlatUnit],
        recompute_layers: int,
        recompute_attention: bool,
        recompute_activation: bool,
        activation_ratio: float,
        saved: SavedTensorManager,
        autocast_dtype=None,
        keep_last_for_backward: bool = True,
        compiled: bool | str = False,
    ):
        self.module, self.units = module, units
        # the blocks as they run: compiled with Inductor (`training.compile_blocks`; under ZB-H1
        # with the backward as B and W, `mist.rules.compiled_blocks.compile_mode`) or eager
        split = compiled == SPLIT
        self.blocks = [compile_block(b, split=split) for b in module.blocks] if compiled else list(module.blocks)
        self.compiled, self.split = bool(compiled), split
        self.recompute_layers, self.activation_ratio = recompute_layers, activation_ratio
        self.selective = dict(attention=recompute_attention, activation=recompute_activation)
        self.saved = saved
        self.autocast_dtype = autocast_dtype
        self.keep_last = keep_last_for_backward

    # ------------------------------------------------------------ per micro-batch
    def start_micro_batch(self, index: int, last: bool) -> None:
        self.saved.new_micro_batch()
        for u in self.units:
            u.start_micro_batch(index, last)

    def finish_micro_batch(self) -> None:
        for u in self.units:
            u.finish_micro_batch()
            u.release()
        self.saved.memory.reset_activations()

    def release_all(self) -> None:
        """After a forward without backward (evaluation): free every materialised weight."""
        for u in self.units:
            u.release()
        self.saved.memory.reset_activations()

    # ------------------------------------------------------------ pipeline (1F1B) split
    # With several micro-batches in flight the forward and the backward of one micro-batch are
    # separated: the saved-activation bookkeeping starts at its forward, the units' gradient
    # state at its backward; its activation bytes are released from the account after it.
    def begin_forward(self) -> int:
        self.saved.new_micro_batch()
        return self.saved.memory.activations

    def begin_backward(self, index: int, last: bool) -> None:
        for u in self.units:
            u.start_micro_batch(index, last)

    def end_backward(self, activation_bytes: int) -> None:
        for u in self.units:
            u.finish_micro_batch()
            u.release()
        mem = self.saved.memory
        mem.activations = max(mem.activations - activation_bytes, 0)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        dev = self.units[0].device.type
        return torch.autocast(dev, dtype=self.autocast_dtype)

    def _pre_backward(self, i: int):
        def hook(grad):
            u = self.units[i]
            u.materialize()
            u.wait()
            if i > 0:
                self.units[i - 1].materialize(prefetch=True)
            return grad

        return hook

    def _run(self, i: int, fn, ratio: float, block: bool = False):
        u = self.units[i]
        u.materialize()
        u.wait()
        if i + 1 < len(self.units):
            self.units[i + 1].materialize(prefetch=True)
        # (a split compiled block's saved tensors are read once, by its one backward call, under
        # ZB-H1; the eager embedding's and head's nodes may be run again by a weight pass)
        with self.saved.layer(ratio, by_storage=self.compiled, once=self.split and block):
            out = fn()
        prev_released = i > 0 and not self.units[i - 1].persistent
        if out.requires_grad and (not u.persistent or prev_released):
            out.register_hook(self._pre_backward(i))
        last = i == len(self.units) - 1
        if not u.keep_until_backward and not (last and self.keep_last):
            u.release()
        return out

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        """The stage's forward for one micro-batch: the loss on the last stage, else activations."""
        m = self.module
        i = 0
        with self.saved.hooks(), self._autocast():
            x = tokens
            if m.embedding is not None:
                x = self._run(i, lambda: m.embedding(tokens), 0.0)
                i += 1
            n = len(self.blocks)
            for j, blk in enumerate(self.blocks):
                recompute = j >= n - self.recompute_layers
                x = self._run(
                    i,
                    lambda blk=blk, x=x, rc=recompute: run_block(blk, x, rc, **self.selective),
                    self.activation_ratio,
                    block=True,
                )
                i += 1
            if m.head is not None:
                x = self._run(i, lambda x=x: m.head(x, targets), 0.0)
        return x
