"""The rules every export target shares, and the `mist export` command's refusals."""

from pathlib import Path

import pytest

from mist.cli import main
from mist.errors import MistInputError
from mist.export import TARGETS, export_plan
from mist.export.common import uniform_mesh_problems, without_offload
from mist.plan import load_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_heterogeneous_stages_are_named():
    plan = load_plan(EXAMPLES / "llama-7b-8xl4-mixed.json")  # stage 3: dp 1, tp 2, micro-batch 4
    problems = uniform_mesh_problems(plan, "DeepSpeed")
    assert problems == [
        "stage 3 has dp 1 but stage 0 has 2, and DeepSpeed runs one dp for the whole pipeline",
        "stage 3 has tp 2 but stage 0 has 1, and DeepSpeed runs one tp for the whole pipeline",
        "stage 3 has micro_batch 4 but stage 0 has 2, and DeepSpeed runs one micro_batch for the whole pipeline",
    ]


def test_uniform_pipeline_has_no_mesh_problem():
    assert uniform_mesh_problems(load_plan(EXAMPLES / "gpt3-1.3b-2xl4-pp2.json"), "Megatron-LM") == []


def test_without_offload_keeps_only_what_is_named():
    s = load_plan(EXAMPLES / "llama-7b-8xl4-mixed.json").stages[0]
    assert s.offload.optimizer == 0.875
    assert without_offload(s).offload.optimizer == 0.0
    assert without_offload(s, keep=("optimizer",)).offload.optimizer == 0.875


def test_unknown_target_is_one_sentence(tmp_path):
    plan = load_plan(EXAMPLES / "gpt3-1.3b-2xl4-pp2.json")
    with pytest.raises(MistInputError, match=r"^--to must be one of megatron, deepspeed, torchtitan, not 'nemo'\.$"):
        export_plan(plan, "nemo", tmp_path)


@pytest.mark.parametrize("target", ["megatron", "deepspeed", "torchtitan"])
def test_mixed_plan_is_refused_naming_the_stage(target, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["export", str(EXAMPLES / "llama-7b-8xl4-mixed.json"), "--to", target, "-o", str(tmp_path / "out")])
    assert e.value.code == 2
    text = " ".join(capsys.readouterr().err.split())
    assert text.startswith("error: ") and "cannot run this plan" in text and "--approximate" in text
    # every problem is listed, and stage 3's mesh is among them, named by stage
    problems = TARGETS[target].problems(load_plan(EXAMPLES / "llama-7b-8xl4-mixed.json"))
    assert any(p.startswith("stage 3 ") for p in problems), problems
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
