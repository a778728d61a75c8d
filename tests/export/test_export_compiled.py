"""Compiled blocks (`training.compile_blocks`) in the exports: torchtitan compiles each decoder
block as Mist does (`--compile.enable`, the model only), checked by torchtitan's own
ConfigManager; Megatron-LM and DeepSpeed run their own blocks, so they name the knob and their
nearest plan runs eager blocks."""

from dataclasses import replace

import pytest
from torchtitan_checks import parse, require_torchtitan

from mist.export import deepspeed as ds
from mist.export import megatron as mg
from mist.export import torchtitan as tt
from mist.plan import Plan, StageStrategy
from mist.specs.model import ModelSpec
from mist.specs.training import ClusterSpec, TrainingSpec

LLAMA = ModelSpec("llama", 8, 1024, 16, 4, 2816, 32000, norm_eps=1e-6, name="small-gqa")


def _plan(compiled: bool, sp: bool = False, zero: int = 0) -> Plan:
    st = StageStrategy(LLAMA.num_layers, 1, 8, 1, 4, 2, zero, 0, sequence_parallel=sp)
    training = TrainingSpec(seq_len=2048, global_batch=4, grad_dtype="fp32", compile_blocks=compiled)
    return Plan(model=LLAMA, cluster=ClusterSpec("h100", 1, 8), training=training, micro_batches=1, stages=(st,))


def test_torchtitan_compiles_the_blocks(tmp_path):
    require_torchtitan()
    for compiled in (True, False):
        plan = _plan(compiled, sp=True)  # (torchtitan's tensor parallelism shards the sequence)
        assert tt.problems(plan) == []
        out = tmp_path / str(compiled)
        out.mkdir()
        done = tt.write(plan, out)
        cfg = parse(done.args, out)
        assert cfg.compile.enable is compiled
        if compiled:
            assert cfg.compile.components == ["model"]


@pytest.mark.parametrize("target", [mg, ds], ids=["megatron", "deepspeed"])
def test_frameworks_with_their_own_blocks_name_compiled_blocks_and_run_eager_ones(target):
    # (DeepSpeed accumulates the plan's fp32 gradients only with ZeRO: `deepspeed._precision_problems`)
    plan = _plan(True, zero=1 if target is ds else 0)
    found = target.problems(plan)
    assert any("training.compile_blocks" in p for p in found), found
    near = target.nearest(plan)
    assert not near.training.compile_blocks and target.problems(near) == []
    assert target.problems(replace(plan, training=replace(plan.training, compile_blocks=False))) == []
