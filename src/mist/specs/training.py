"""ClusterSpec (where to train) and TrainingSpec (how: sequence, batch, dtypes, attention)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mist.checks import is_int, is_number
from mist.dtypes import DTYPE_BYTES
from mist.errors import MistInputError

MAX_SEQ_LEN = 1 << 24  # tokens per sequence
MAX_GLOBAL_BATCH = 2**31 - 1  # sequences per optimizer step
MAX_HOST_MEMORY_GIB = 1 << 20  # RAM per node: 1 PiB


def _positive_int(what: str, v, most: int | None = None) -> None:
    if not is_int(v):
        raise MistInputError(f"{what} must be an integer, got {v!r}.")
    if v <= 0:
        raise MistInputError(f"{what} must be positive, got {v}.")
    if most is not None and v > most:
        raise MistInputError(f"{what} must be at most {most:,}, got {v:,}.")


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous GPU cluster: `nodes` machines with `gpus_per_node` GPUs of kind `gpu`."""

    gpu: str
    nodes: int = 1
    gpus_per_node: int = 1
    host_memory_gib: float | None = None  # RAM per node (None: the GPU kind's typical node)

    def __post_init__(self) -> None:
        if not isinstance(self.gpu, str) or not self.gpu:
            raise MistInputError("Cluster field gpu must be a non-empty GPU name or profile path.")
        _positive_int("Cluster field nodes", self.nodes)
        _positive_int("Cluster field gpus_per_node", self.gpus_per_node)
        h = self.host_memory_gib
        if h is not None and (not is_number(h) or not 0 < h <= MAX_HOST_MEMORY_GIB):
            raise MistInputError(
                f"Cluster field host_memory_gib must be a positive number of GiB, at most "
                f"{MAX_HOST_MEMORY_GIB:,} per node, got {h!r}."
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["host_memory_gib"] is None:  # plans without it read as before
            del d["host_memory_gib"]
        return d


@dataclass(frozen=True)
class TrainingSpec:
    """Sequence length, global batch, parameter/compute dtype, attention kernel choice, and the
    dtype gradients are accumulated and reduced in (`grad_dtype`: None means the parameter dtype;
    "fp32" accumulates the micro-batches' 16-bit gradients into an fp32 buffer and reduces that,
    as Megatron-LM does for bf16)."""

    seq_len: int
    global_batch: int = 1
    param_dtype: str = "bf16"
    compute_dtype: str = "bf16"
    flash_attention: bool = True
    grad_dtype: str | None = None
    # regional torch.compile of the decoder blocks (`mist.models.compiled`); eager blocks if false
    compile_blocks: bool = False

    def __post_init__(self) -> None:
        _positive_int("Training field seq_len", self.seq_len, MAX_SEQ_LEN)
        _positive_int("Training field global_batch", self.global_batch, MAX_GLOBAL_BATCH)
        for f in ("flash_attention", "compile_blocks"):
            if not isinstance(getattr(self, f), bool):
                raise MistInputError(f"Training field {f} must be true or false, got {getattr(self, f)!r}.")
        for f in ("param_dtype", "compute_dtype"):
            if getattr(self, f) not in DTYPE_BYTES:
                raise MistInputError(
                    f"Training field {f} must be one of {', '.join(DTYPE_BYTES)}, got {getattr(self, f)!r}."
                )
        if self.grad_dtype not in (None, self.param_dtype, "fp32"):
            raise MistInputError(
                f"Training field grad_dtype must be the parameter dtype ({self.param_dtype}) "
                f"or fp32, got {self.grad_dtype!r}."
            )

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def grad_bytes(self) -> int:
        return DTYPE_BYTES[self.grad_dtype or self.param_dtype]

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["grad_dtype"] is None:  # plans without it read as before
            del d["grad_dtype"]
        if not d["compile_blocks"]:  # as above: eager plans are written as they always were
            del d["compile_blocks"]
        return d
