"""Hugging Face checkpoints in and out of a plan's run: `--init-from DIR` and `--save-hf DIR`.

Reading (`check_hf_options` before any worker starts, `load_into` in every rank):
the checkpoint's config.json goes through `mist.specs.loading` and must give the plan's ModelSpec;
`mist.runtime.hf_layout.refusal` rejects what Mist's model would not compute exactly; every tensor
the model needs must be in the safetensors files (one ``model.safetensors``, or the shards that
``model.safetensors.index.json`` names) with the right shape. Then each rank fills only its fp32
master range of each of its stage's flat units (`FlatUnit.opt_lo`, `L`: its ZeRO shard for ZeRO ≥ 1,
the whole unit for ZeRO 0) on its tensor-parallel shard (`mist.runtime.sharding.tp_slice`). It
reads those rows (and, for row-parallel layers, those columns) through safetensors'
``get_slice(name)[...]``, one block at a time, copies each into the master and drops it; the
working weights then follow from the master as after an optimizer step (`update_weights`: the
ZeRO-1/2 all-gather, the ZeRO-3 shard store). No rank reads a tensor slice it does not own
(except the rest of the first and last row of a flat range that starts or ends mid-row).

Writing (`save_hf`): rank 0 gathers the fp32 master weights (`Trainer.full_state_dict`), puts each
Mist row block back where it came from, and writes sharded safetensors (at most
``max_shard_bytes`` each), ``model.safetensors.index.json`` when there is more than one, and
config.json (`hf_layout.hf_config`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mist.errors import MistInputError
from mist.plan import Plan
from mist.runtime import hf_layout
from mist.runtime.hf_layout import HFArch, Piece
from mist.runtime.sharding import tp_slice
from mist.specs.loading import load_model
from mist.specs.model import DROPOUT_FIELDS, ModelSpec

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
DEFAULT_SHARD_BYTES = 5 * 1000**3
# fields of the two ModelSpecs that must agree: all but the name, the dropout probabilities (how
# the plan trains, not what the weights compute), and the number of positions only where they
# are learned weights (gpt; added below)
_FIELDS = tuple(f for f in ModelSpec.field_names() if f not in ("name", "max_position_embeddings", *DROPOUT_FIELDS))


@dataclass(frozen=True)
class HFCheckpoint:
    """A checked checkpoint folder: its config, layout, and where each tensor is."""

    path: Path
    spec: ModelSpec
    arch: HFArch
    files: dict[str, Path]  # tensor name as the model spells it → its safetensors file
    names: dict[str, str]  # tensor name as the model spells it → as the file spells it
    itemsize: int  # bytes per element of the checkpoint's tensors (the largest dtype there)
    largest_tensor: int  # elements of its largest tensor


@dataclass(frozen=True)
class LoadStats:
    """What one rank read while loading, measured by the slice reader.

    owned_elements: checkpoint elements in the rank's master ranges; read_elements: elements read;
    peak_live_bytes: the most bytes of read blocks alive at once (each block's release is observed
    through a weak reference); largest_tensor_bytes: the checkpoint's largest tensor."""

    rank: int
    owned_elements: int
    read_elements: int
    read_bytes: int
    peak_live_bytes: int
    largest_tensor_bytes: int
    itemsize: int

    @property
    def owned_bytes(self) -> int:
        return self.owned_elements * self.itemsize


# ----------------------------------------------------------------------------- checking
def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name → file, from the index or the single file's header."""
    index = path / INDEX
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
            assert isinstance(wm, dict)
        except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
            raise MistInputError(f"Checkpoint index {index} is not a JSON file with a weight_map.") from None
        files = {str(k): path / str(v) for k, v in wm.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise MistInputError(
                    f"Checkpoint {path} names the shard {f.name} in its index, but the file is missing."
                )
        return files
    single = path / SINGLE
    if not single.is_file():
        raise MistInputError(f"Checkpoint {path} holds no safetensors weights ({SINGLE} or {INDEX}).")
    with _open(single) as f:
        return {k: single for k in f.keys()}


def _safetensors():
    """The safetensors package (an optional dependency: `pip install mist-llm[hf]`)."""
    try:
        import safetensors.torch  # lazy: only --init-from / --save-hf need it
    except ImportError:
        raise MistInputError(
            "--init-from and --save-hf need the safetensors package (pip install safetensors)."
        ) from None
    return safetensors


def _open(file: Path):
    try:
        return _safetensors().safe_open(str(file), framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise MistInputError(f"Checkpoint file {file} is not a readable safetensors file ({e}).") from None


def _diff(got: ModelSpec, want: ModelSpec) -> list[str]:
    fields = list(_FIELDS) + (["max_position_embeddings"] if want.family == "gpt" else [])
    out = []
    for f in fields:
        a, b = getattr(got, f), getattr(want, f)
        same = math.isclose(a, b, rel_tol=1e-9) if isinstance(a, float) else a == b
        if not same:
            out.append(f"{f} {a} (plan: {b})")
    return out


def open_checkpoint(path_arg: str, plan: Plan) -> HFCheckpoint:
    """Check the checkpoint folder against the plan (one sentence on any mismatch)."""
    path = Path(path_arg).expanduser()
    if not path.is_dir():
        raise MistInputError(f"--init-from {path_arg} is not a folder.")
    if not (path / "config.json").is_file():
        raise MistInputError(f"Checkpoint {path} holds no config.json.")
    spec = load_model(str(path))
    cfg = json.loads((path / "config.json").read_text())
    why = hf_layout.refusal(cfg, spec, plan.training.seq_len, str(path))
    if why:
        raise MistInputError(why)
    diff = _diff(spec, plan.model)
    if diff:
        raise MistInputError(f"Checkpoint {path} does not match the plan's model: {', '.join(diff)}.")
    arch = hf_layout.arch_of_config(cfg)
    files = _weight_files(path)
    names: dict[str, str] = {}
    itemsize, largest = 0, 0
    missing = []
    headers: dict[Path, object] = {}
    with contextlib.ExitStack() as stack:
        for t in hf_layout.hf_tensors(plan.model, arch).values():
            # checkpoints saved from the base model spell names without "model." / "transformer."
            name = t.name if t.name in files else t.name.split(".", 1)[1]
            if name not in files:
                missing.append(t.name)
                continue
            f = files[name]
            if f not in headers:
                headers[f] = stack.enter_context(_open(f))
            sl = headers[f].get_slice(name)  # type: ignore[attr-defined]
            shape = tuple(sl.get_shape())
            if shape != t.shape:
                raise MistInputError(
                    f"Checkpoint {path} holds {name} with shape {list(shape)}, but the plan's model needs {list(t.shape)}."
                )
            names[t.name] = name
            itemsize = max(itemsize, _dtype_bytes(sl.get_dtype()))
            largest = max(largest, math.prod(shape))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise MistInputError(f"Checkpoint {path} lacks the tensor {missing[0]}{more}, which the plan's model needs.")
    return HFCheckpoint(path, spec, arch, {k: files[v] for k, v in names.items()}, names, itemsize, largest)


def _dtype_bytes(name: str) -> int:
    bits = re.search(r"(\d+)", name)
    return int(bits.group(1)) // 8 if bits else 1


def check_hf_options(plan: Plan, cfg) -> None:
    """Before the workers start: the checkpoint of --init-from fits the plan, and --save-hf can
    write the plan's model (`cfg`: a TrainConfig)."""
    if cfg.init_from is not None or cfg.save_hf is not None:
        _safetensors()
    if cfg.init_from is not None:
        open_checkpoint(cfg.init_from, plan)
    if cfg.save_hf is not None:
        why = hf_layout.save_refusal(plan.model)
        if why:
            raise MistInputError(why)


# ----------------------------------------------------------------------------- reading
class SliceReader:
    """Reads row blocks of checkpoint tensors with safetensors' `get_slice` and measures them."""

    def __init__(self, ckpt: HFCheckpoint):
        self.ckpt = ckpt
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, object] = {}
        self.read_elements = self.read_bytes = 0
        self.live = self.peak_live = 0

    def __enter__(self) -> SliceReader:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _released(self, nbytes: int) -> None:
        self.live -= nbytes

    def read(self, piece: Piece, lo: int, hi: int, cols: tuple[int, int] | None) -> torch.Tensor:
        """Rows [lo, hi) of the piece's HF tensor as Mist rows (columns `cols` of a matrix)."""
        f = self.ckpt.files[piece.hf_name]
        if f not in self._handles:
            self._handles[f] = self._stack.enter_context(_open(f))
        name = self.ckpt.names[piece.hf_name]
        sl = self._handles[f].get_slice(name)  # type: ignore[attr-defined]
        c = slice(None) if cols is None else slice(*cols)
        if len(sl.get_shape()) == 1:
            t = sl[lo:hi]
        elif piece.transposed:  # stored [in, out]: Mist rows are its columns (copied row-major,
            t = sl[c, lo:hi].t().contiguous()  # the block that lives on is the one measured)
        else:
            t = sl[lo:hi, c]
        n = t.numel() * t.element_size()
        self.read_elements += t.numel()
        self.read_bytes += n
        self.live += n
        self.peak_live = max(self.peak_live, self.live)
        weakref.finalize(t, self._released, n)
        return t


def _runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """Contiguous runs of `rows` as (first row, end row, index of the first in `rows`)."""
    out: list[tuple[int, int, int]] = []
    for i, r in enumerate(rows):
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1, out[-1][2])
        else:
            out.append((r, r + 1, i))
    return out


def _load_param(reader: SliceReader, pieces, name, shape, a, b, spec, tp, rank, write) -> None:
    """Elements [a, b) of this rank's local parameter `name` (flat, row-major): read them and
    `write(local flat position, values)` block by block."""
    C = math.prod(shape[1:]) if len(shape) > 1 else 1
    r0, r1 = a // C, -(-b // C)
    sl = tp_slice(name, spec, tp, rank)
    cols = None
    if sl is None or sl[0] == 1:
        rows = list(range(r0, r1))
        if sl is not None:
            idx = sl[1]
            cols = (int(idx[0]), int(idx[-1]) + 1)
    else:
        rows = sl[1][r0:r1].tolist()
    for x, y, first in _runs(rows):
        for pc in pieces:
            p, q = max(x, pc.m_lo), min(y, pc.m_lo + pc.n)
            if p >= q:
                continue
            block = reader.read(pc, pc.hf_lo + p - pc.m_lo, pc.hf_lo + q - pc.m_lo, cols).reshape(-1)
            start = (r0 + first + p - x) * C  # local flat position of the block's first element
            lo, hi = max(a, start), min(b, start + block.numel())
            write(lo, block[lo - start : hi - start])
            del block


@torch.no_grad()
def load_into(trainer, path: str) -> list[LoadStats] | None:
    """Fill the trainer's units from the checkpoint (collective); every rank's stats on rank 0."""
    plan, spec = trainer.plan, trainer.plan.model
    ckpt = open_checkpoint(path, plan)
    pieces = hf_layout.mist_pieces(spec, ckpt.arch)
    tp, rank = trainer.tp.size, trainer.groups.tp_rank
    owned = 0
    with SliceReader(ckpt) as reader:
        for u in trainer.units:
            lo, hi = u.opt_lo, u.opt_lo + u.L
            for info in u.infos:
                a, b = max(lo, info.offset) - info.offset, min(hi, info.offset + info.numel) - info.offset
                if a >= b:
                    continue
                owned += b - a

                def write(pos: int, values: torch.Tensor, u=u, info=info) -> None:
                    u.master.write(info.offset + pos - u.opt_lo, values)

                _load_param(reader, pieces[info.name], info.name, tuple(info.shape), a, b, spec, tp, rank, write)
        stats = LoadStats(
            trainer.groups.rank,
            owned,
            reader.read_elements,
            reader.read_bytes,
            reader.peak_live,
            ckpt.largest_tensor * ckpt.itemsize,
            ckpt.itemsize,
        )
    for u in trainer.units:  # the working weights from the master, as after an optimizer step
        u.update_weights()
    if trainer.groups.world == 1:
        return [stats]
    every = [None] * trainer.groups.world if trainer.groups.rank == 0 else None
    dist.gather_object(stats, every, dst=0)
    return every


# ----------------------------------------------------------------------------- writing
def _shard_plan(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Tensor names in order, cut into shards of at most max_bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, n in sizes:
        if shards[-1] and used + n > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    return shards


@torch.no_grad()
def save_hf(state: dict[str, torch.Tensor], spec: ModelSpec, out: str | Path, max_shard_bytes: int) -> Path:
    """Write the full fp32 state dict of Mist's model as a Hugging Face checkpoint in `out`.

    The model files of an earlier save there (model*.safetensors, the index) are replaced; each
    file is written under a temporary name and renamed, so a reader sees whole files."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    arch = hf_layout.arch_of_spec(spec)
    tensors = hf_layout.hf_tensors(spec, arch)
    sources: dict[str, list[tuple[str, Piece]]] = {}
    for mist, pcs in hf_layout.mist_pieces(spec, arch).items():
        for pc in pcs:
            sources.setdefault(pc.hf_name, []).append((mist, pc))

    def assemble(name: str) -> torch.Tensor:
        t = torch.empty(tensors[name].shape, dtype=torch.float32)
        for mist, pc in sources[name]:
            block = state[mist][pc.m_lo : pc.m_lo + pc.n]
            if pc.transposed:
                t[:, pc.hf_lo : pc.hf_lo + pc.n] = block.t()
            else:
                t[pc.hf_lo : pc.hf_lo + pc.n] = block
        return t

    sizes = [(n, math.prod(t.shape) * 4) for n, t in tensors.items()]
    shards = _shard_plan(sizes, max_shard_bytes)
    k = len(shards)
    names = [SINGLE] if k == 1 else [f"model-{i + 1:05d}-of-{k:05d}.safetensors" for i in range(k)]
    weight_map = {}
    for fname, shard in zip(names, shards):
        part = {n: assemble(n) for n in shard}
        tmp = out / f".{fname}.tmp"
        _safetensors().torch.save_file(part, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / fname)
        weight_map.update({n: fname for n in shard})
        del part
    for old in out.iterdir():  # shards of an earlier save that this one does not have
        if (_SHARD.match(old.name) or old.name == SINGLE) and old.name not in names:
            old.unlink()
    index = out / INDEX
    if k > 1:
        total = sum(n for _, n in sizes)
        body = {"metadata": {"total_size": total}, "weight_map": weight_map}
        tmp = out / f".{INDEX}.tmp"
        tmp.write_text(json.dumps(body, indent=2))
        os.replace(tmp, index)
    elif index.exists():
        index.unlink()
    (out / "config.json").write_text(json.dumps(hf_layout.hf_config(spec), indent=2))
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer(tokenizer: str | None, out: str | Path) -> list[str]:
    """Copy the tokenizer the run trained with (a tokenizer.json, or a folder holding one) and the
    Hugging Face tokenizer files beside it into `out`, so the saved folder loads as a whole
    (`AutoTokenizer` and `AutoModelForCausalLM` from one path). Returns the names copied."""
    if not tokenizer:
        return []
    src = Path(tokenizer)
    folder = src if src.is_dir() else src.parent
    if not (folder / "tokenizer.json").is_file() and src.is_file():
        shutil.copyfile(src, Path(out) / "tokenizer.json")
        return ["tokenizer.json"]
    copied = []
    for name in TOKENIZER_FILES:
        if (folder / name).is_file() and (folder / name).resolve() != (Path(out) / name).resolve():
            shutil.copyfile(folder / name, Path(out) / name)
            copied.append(name)
    return copied


def save_from(trainer, out: str | Path, max_shard_bytes: int, tokenizer: str | None = None) -> Path | None:
    """Gather the trainer's weights to rank 0 and write them there, with the run's tokenizer
    files (collective)."""
    state = trainer.full_state_dict()
    if state is None:
        return None
    path = save_hf(state, trainer.plan.model, out, max_shard_bytes)
    copy_tokenizer(tokenizer, path)
    return path


__all__ = [
    "HFCheckpoint",
    "LoadStats",
    "open_checkpoint",
    "check_hf_options",
    "load_into",
    "save_hf",
    "save_from",
]
