"""The shared small definitions: byte units, dtype sizes and their torch dtypes, the int checks,
and the sequence-length check of a model."""

import pytest
import torch

from mist.checks import is_int, is_number
from mist.dtypes import DTYPE_BYTES
from mist.errors import MistInputError
from mist.models.dtypes import TORCH_DTYPES, torch_dtype
from mist.specs.presets import get_preset
from mist.units import GiB, MiB


def test_units():
    assert (MiB, GiB) == (1024**2, 1024**3)


def test_every_dtype_name_has_its_torch_dtype_of_that_size():
    assert list(TORCH_DTYPES) == list(DTYPE_BYTES)
    for name, size in DTYPE_BYTES.items():
        assert torch.tensor([], dtype=torch_dtype(name)).element_size() == size
    with pytest.raises(KeyError):
        torch_dtype("fp8")


def test_bools_are_not_numbers():
    for v in (0, -3, 2**70):
        assert is_int(v) and is_number(v)
    for v in (1.5, float("nan"), float("inf")):
        assert not is_int(v) and is_number(v)
    for v in (True, False, None, "1", 1j, [1]):
        assert not is_int(v) and not is_number(v)


def test_sequence_length_against_learned_positions():
    gpt = get_preset("gpt3-1.3b")
    gpt.check_seq_len(gpt.max_position_embeddings)
    with pytest.raises(
        MistInputError,
        match=f"^Sequence length {gpt.max_position_embeddings + 1} exceeds the "
        f"model's {gpt.max_position_embeddings} learned positions.$",
    ):
        gpt.check_seq_len(gpt.max_position_embeddings + 1)
    llama = get_preset("llama2-7b")
    llama.check_seq_len(llama.max_position_embeddings * 4)  # rotary: no learned positions
