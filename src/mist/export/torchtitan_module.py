"""The Python config module `mist export --to torchtitan` writes when the CLI alone cannot carry a plan.

torchtitan 0.3.0 selects its configuration with `--module M --config F`: `F` is a function in `M`
that returns a `Trainer.Config`. The launch script's `--section.key` overrides cover parallelism,
batches, precision, offload and all-or-nothing activation checkpointing; two things exist only in
Python: a llama3 model whose dimensions are not one of torchtitan's registry flavours, and
checkpointing of some blocks but not others (Mist's per-stage recompute counts). For those this
module writes `mist_torchtitan_plan.py`, whose `mist_plan()` starts from torchtitan's own
`llama3_8b()` (optimizer, data loader, checkpointing defaults) and replaces the model and/or the
checkpointing policy.
"""

from __future__ import annotations

from mist.specs.model import ModelSpec

MODULE_NAME = "mist_torchtitan_plan"
CONFIG_NAME = "mist_plan"

_HEADER = '''\
"""torchtitan 0.3.0 config for a Mist plan (written by `mist export --to torchtitan`).

Launch with run_torchtitan.sh, which puts this folder on PYTHONPATH and passes
`--module {module} --config {config}` plus the plan's `--section.key` overrides.
"""

from dataclasses import dataclass, field

from torchtitan.trainer import Trainer
from torchtitan.models.llama3.config_registry import llama3_8b
'''

_MODEL = '''
from functools import partial

import torch.nn as nn

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.config_utils import (
    decoder_vocab_size,
    get_attention_config,
    make_ffn_config,
    make_gqa_config,
)
from torchtitan.models.common.param_init import depth_scaled_std
from torchtitan.models.llama3 import parallelize_llama
from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec

# the plan's model ({name})
DIM, N_LAYERS, N_HEADS, N_KV_HEADS = {dim}, {layers}, {heads}, {kv_heads}
FFN_DIM, VOCAB, NORM_EPS, TIE = {ffn}, {vocab}, {eps!r}, {tie}
MAX_SEQ_LEN, ROPE_THETA = {max_seq}, {rope_theta!r}


def _normal(std):
    return {{"weight": partial(nn.init.trunc_normal_, std=std), "bias": nn.init.zeros_}}


def _block(layer_id):
    ones = {{"weight": nn.init.ones_}}
    return Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=DIM, eps=NORM_EPS, param_init=ones),
        ffn_norm=RMSNorm.Config(normalized_shape=DIM, eps=NORM_EPS, param_init=ones),
        attention=make_gqa_config(
            dim=DIM,
            n_heads=N_HEADS,
            n_kv_heads=N_KV_HEADS,
            wqkv_param_init=_normal(0.02),
            wo_param_init=_normal(depth_scaled_std(0.02, layer_id)),
            inner_attention=get_attention_config("flex"),
            fuse_qkv=True,
            rope=ComplexRoPE.Config(dim=DIM // N_HEADS, max_seq_len=MAX_SEQ_LEN, theta=ROPE_THETA),
        ),
        feed_forward=make_ffn_config(
            dim=DIM,
            hidden_dim=FFN_DIM,
            w1_param_init=_normal(0.02),
            w2w3_param_init=_normal(depth_scaled_std(0.02, layer_id)),
        ),
    )


def model_spec():
    """A llama3 ModelSpec with the plan's dimensions."""
    model = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        enable_weight_tying=TIE,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_normal(1.0)),
        norm=RMSNorm.Config(normalized_shape=DIM, eps=NORM_EPS, param_init={{"weight": nn.init.ones_}}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_normal(DIM**-0.5)),
        layers=[_block(i) for i in range(N_LAYERS)],
    )
    return ModelSpec(
        name="llama3",
        flavor="mist",
        model=model,
        parallelize_fn=parallelize_llama,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=Llama3StateDictAdapter,
    )
'''

_AC = '''
from torchtitan.distributed.activation_checkpoint import FullAC


class MistBlocksAC(FullAC):
    """Full activation checkpointing of the listed decoder blocks only (global layer ids, as
    in `layers.<id>`): Mist recomputes the last `recompute_layers` blocks of each stage."""

    @dataclass(kw_only=True, slots=True)
    class Config(FullAC.Config):
        layer_ids: list[int] = field(default_factory=list)

    def _wrap_block(self, module, *, base_fqn=None):
        layer_id = int(str(base_fqn).rsplit(".", 1)[-1])
        if layer_id in self.config.layer_ids:
            return super()._wrap_block(module, base_fqn=base_fqn)
        return module


# the blocks the plan recomputes whole, by stage: {by_stage}
RECOMPUTED_LAYERS = {layer_ids}
'''

_CONFIG_HEAD = '''

def {config}() -> Trainer.Config:
    """torchtitan's llama3_8b defaults with what the plan needs in Python; the launch script
    overrides parallelism, batches, precision and offload on the command line."""
    config = llama3_8b()
'''

_CONFIG_MODEL = """    config.model_spec = model_spec()
    config.loss = ChunkedLossWrapper.Config(
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(config.model_spec))
    )
"""

_CONFIG_AC = """    config.activation_checkpoint = MistBlocksAC.Config(layer_ids=list(RECOMPUTED_LAYERS))
"""


def module_text(model: ModelSpec | None, seq_len: int, recomputed: list[list[int]] | None) -> str:
    """The module's source: the model when `model` is given (not a registry flavour), the
    per-block checkpointing policy when `recomputed` (global layer ids by stage) is given."""
    parts = [_HEADER.format(module=MODULE_NAME, config=CONFIG_NAME)]
    if model is not None:
        parts.append(_model_text(model, seq_len))
    if recomputed is not None:
        flat = [i for ids in recomputed for i in ids]
        parts.append(_AC.format(by_stage=recomputed, layer_ids=flat))
    parts.append(_CONFIG_HEAD.format(config=CONFIG_NAME))
    if model is not None:
        parts.append(_CONFIG_MODEL)
    if recomputed is not None:
        parts.append(_CONFIG_AC)
    parts.append("    return config\n")
    return "".join(parts)


def _model_text(m: ModelSpec, seq_len: int) -> str:
    return _MODEL.format(
        name=m.name,
        dim=m.hidden_size,
        layers=m.num_layers,
        heads=m.num_heads,
        kv_heads=m.num_kv_heads,
        ffn=m.ffn_hidden_size,
        vocab=m.vocab_size,
        eps=float(m.norm_eps),
        tie=bool(m.tie_embeddings),
        max_seq=max(m.max_position_embeddings, seq_len),
        rope_theta=m.rope_theta,
    )
