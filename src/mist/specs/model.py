"""ModelSpec: the architecture of a decoder-only transformer (GPT, Llama or Falcon family)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from mist.checks import is_int, is_number
from mist.errors import MistInputError

FAMILIES = ("gpt", "llama", "falcon")
GELU_APPROXIMATIONS = ("tanh", "none")  # torch.nn.functional.gelu's `approximate`
DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout")

# The largest value each integer field may take: sanity bounds far above any trained model's
# (Llama 3 405B: 126 layers, hidden 16,384, vocabulary 128,256), below what would overflow a
# tensor's size or the search's arrays.
LIMITS = {
    "num_layers": 4096,
    "hidden_size": 1 << 20,
    "num_heads": 1 << 16,
    "num_kv_heads": 1 << 16,
    "ffn_hidden_size": 1 << 22,
    "vocab_size": 1 << 24,
    "max_position_embeddings": 1 << 24,
}


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of one model.

    gpt:    LayerNorm, GELU MLP (ffn usually 4h), learned positions, sequential attention → MLP.
    llama:  RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention.
    falcon: one LayerNorm feeding attention and MLP in parallel, GELU MLP, rotary, MQA/GQA.
    """

    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    tie_embeddings: bool = False
    bias: bool = False
    rotary_fraction: float = 1.0
    norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    name: str = "custom"
    rope_theta: float = 10000.0  # rotary base (llama, falcon); changes the values, not the cost
    # the GELU of gpt and falcon MLPs, as torch's F.gelu(approximate=...): "tanh" (GPT-2's
    # gelu_new) or "none" (the exact erf form, Falcon's "gelu"); the same kernel cost
    gelu_approximate: str = "tanh"
    # dropout probabilities in training (Megatron-LM's --attention-dropout, --hidden-dropout):
    # on the attention probabilities (materialised attention only), and on the attention and MLP
    # outputs before each residual add (falcon: once on their sum) and on the embedding output
    # (Megatron-LM's embedding dropout); `mist.models.dropout`
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0

    def __post_init__(self) -> None:
        self.check()

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Raise MistInputError unless every field is in range and the fields fit each other."""
        if self.family not in FAMILIES:
            raise MistInputError(f"Unknown model family {self.family!r}; expected one of {', '.join(FAMILIES)}.")
        for f, most in LIMITS.items():
            v = getattr(self, f)
            if not is_int(v):
                raise MistInputError(f"Model field {f} must be an integer, got {v!r}.")
            if v <= 0:
                raise MistInputError(f"Model field {f} must be positive, got {v}.")
            if v > most:
                raise MistInputError(f"Model field {f} must be at most {most:,} (Mist's limit), got {v:,}.")
        if self.hidden_size % self.num_heads:
            raise MistInputError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}.")
        if self.num_heads % self.num_kv_heads:
            raise MistInputError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}.")
        if not 0.0 <= self.rotary_fraction <= 1.0:
            raise MistInputError(f"rotary_fraction must lie in [0, 1], got {self.rotary_fraction}.")
        if self.uses_rotary and int(self.head_dim * self.rotary_fraction) % 2:
            raise MistInputError(
                f"rotary_fraction {self.rotary_fraction} of head_dim {self.head_dim} "
                "gives an odd number of rotary dimensions."
            )
        eps = self.norm_eps
        if not is_number(eps) or not 0 < eps < math.inf:
            raise MistInputError(f"norm_eps must be a positive finite number, got {self.norm_eps}.")
        if self.gelu_approximate not in GELU_APPROXIMATIONS:
            raise MistInputError(
                f"gelu_approximate must be one of {', '.join(GELU_APPROXIMATIONS)}, got {self.gelu_approximate!r}."
            )
        if not is_number(self.rope_theta) or not 1 < self.rope_theta < math.inf:
            raise MistInputError(f"rope_theta must be a finite number above 1, got {self.rope_theta}.")
        for f in DROPOUT_FIELDS:
            p = getattr(self, f)
            if not is_number(p) or not 0.0 <= p < 1.0:
                raise MistInputError(f"{f} must be a probability in [0, 1), got {p!r}.")

    def check_tp(self, tp: int) -> None:
        """Raise if the model cannot be split `tp` ways (heads, KV heads, FFN, vocabulary)."""
        if tp <= 0:
            raise MistInputError(f"Tensor-parallel degree must be positive, got {tp}.")
        for what, v in (
            ("num_heads", self.num_heads),
            ("ffn_hidden_size", self.ffn_hidden_size),
            ("vocab_size", self.vocab_size),
        ):
            if v % tp:
                raise MistInputError(f"Tensor-parallel degree {tp} does not divide {what} {v}.")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise MistInputError(
                f"Tensor-parallel degree {tp} and num_kv_heads {self.num_kv_heads} must divide one another."
            )

    def check_attention(self, flash: bool) -> None:
        """Raise if the attention kernel cannot run this model's attention dropout: Mist traces
        flash attention on the CPU, whose kernel has no dropout (PyTorch falls back to the math
        path), so a flash plan with attention dropout would not be the kernel a GPU runs."""
        if flash and self.attention_dropout > 0:
            raise MistInputError(
                f"Flash attention cannot be planned with attention_dropout {self.attention_dropout}: "
                "pass --no-flash (materialised attention) or set attention_dropout to 0."
            )

    def check_seq_len(self, seq_len: int) -> None:
        """Raise if sequences of `seq_len` tokens do not fit the model (a gpt model has only
        max_position_embeddings learned positions; rotary models have no such bound)."""
        if self.family == "gpt" and seq_len > self.max_position_embeddings:
            raise MistInputError(
                f"Sequence length {seq_len} exceeds the model's {self.max_position_embeddings} learned positions."
            )

    # ------------------------------------------------------------ properties
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def uses_rotary(self) -> bool:
        return self.family in ("llama", "falcon")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_fraction) if self.uses_rotary else 0

    @property
    def has_dropout(self) -> bool:
        return self.attention_dropout > 0 or self.hidden_dropout > 0

    @property
    def gated_mlp(self) -> bool:
        return self.family == "llama"

    @property
    def parallel_block(self) -> bool:
        return self.family == "falcon"

    def block_params(self) -> int:
        """Parameters of one decoder block (full, not sharded)."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        kv = self.num_kv_heads * d
        attn = h * (h + 2 * kv) + h * h
        mlp = (3 if self.gated_mlp else 2) * h * f
        if self.bias:
            attn += h + 2 * kv + h
            mlp += (2 * f if self.gated_mlp else f) + h
        norm_w = h if self.family == "llama" else 2 * h  # RMSNorm: weight; LayerNorm: weight+bias
        norms = norm_w * (1 if self.parallel_block else 2)
        return attn + mlp + norms

    def embedding_params(self, seq_len: int = 0) -> int:
        """Word (and, for gpt, learned position) embedding parameters."""
        n = self.vocab_size * self.hidden_size
        if self.family == "gpt":
            n += self.max_position_embeddings * self.hidden_size
        return n

    def head_params(self) -> int:
        """Final norm plus LM head (0 head parameters when tied to the embedding)."""
        h = self.hidden_size
        norm = h if self.family == "llama" else 2 * h
        return norm + (0 if self.tie_embeddings else self.vocab_size * h)

    def total_params(self) -> int:
        return self.num_layers * self.block_params() + self.embedding_params() + self.head_params()

    def to_dict(self) -> dict:
        d = asdict(self)
        for f in DROPOUT_FIELDS:  # a model without dropout is written as before it existed
            if d[f] == 0.0:
                del d[f]
        return d

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
