"""PyTorch modules of the three model families: what `analysis` traces and `runtime` runs."""

from mist.models.block import DecoderBlock
from mist.models.causal_lm import CausalLM, init_weights
from mist.models.collectives import TPGroup, observe_collectives
from mist.models.embedding import Embedding
from mist.models.head import Head

__all__ = ["DecoderBlock", "CausalLM", "Embedding", "Head", "TPGroup", "observe_collectives", "init_weights"]
