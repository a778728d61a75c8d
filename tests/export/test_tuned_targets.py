"""`mist tune --target X` then `mist export --to X`, for 3 models × 3 clusters per framework: the
tuned plan exports exactly (no approximation) and the framework's own code accepts the files with
the plan's layout — Megatron-LM's argument validation, DeepSpeed's config class, torchtitan's
config manager, device meshes and meta-device model (the checks of the per-framework tests)."""

from dataclasses import replace

import pytest
from test_deepspeed import check_against_plan as check_deepspeed
from test_deepspeed import require_deepspeed, run_checks
from test_megatron import _case, _check_against_plan, exported, megatron_validate
from test_torchtitan import check_layout, check_meshes, check_model
from torchtitan_checks import parse, require_torchtitan

from mist.export import deepspeed as ds
from mist.export import megatron as mg
from mist.export import torchtitan as tt
from mist.hardware import load_profile
from mist.specs.presets import get_preset
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.run import TARGET_SPACES, run_space

# the paper's llama-2.7b rotates a quarter of each head; torchtitan's llama3 rotates all of it
LLAMA_ROPE = replace(get_preset("llama-2.7b"), rotary_fraction=1.0, name="llama-2.7b-rope")
MODELS = {
    "megatron": ("gpt3-1.3b", "llama-2.7b-rope", "llama3-8b"),
    "deepspeed": ("gpt3-1.3b", "llama3-8b", "falcon-1.3b"),
    "torchtitan": ("llama-2.7b-rope", "llama3-8b", "llama2-7b"),
}
CLUSTERS = (("l4", 1, 4), ("a100", 1, 8), ("h200", 2, 8))
# seconds per search: what is checked is that the plan a target's space picks exports exactly and
# that the framework accepts it, not how good the plan is (a search at its budget keeps the best
# plan of the candidates it costed; a short budget still costs at least one batch of them)
BUDGET_S = 1

_tuned: dict = {}


def tuned_plans(target: str) -> dict:
    """{case name: the plan `mist tune --target` picks} for the target's 9 cases."""
    if target not in _tuned:
        plans = {}
        for m in MODELS[target]:
            model = LLAMA_ROPE if m == LLAMA_ROPE.name else get_preset(m)
            for gpu, nodes, gpn in CLUSTERS:
                training = TrainingSpec(seq_len=2048, global_batch=8 * nodes * gpn)
                res = run_space(
                    TARGET_SPACES[target], model, ClusterSpec(gpu, nodes, gpn), training, load_profile(gpu), BUDGET_S
                )
                assert res.plan is not None, res.infeasible_reason
                plans[f"{m}-{nodes * gpn}x{gpu}"] = res.plan
        _tuned[target] = plans
    return _tuned[target]


@pytest.mark.extended("tests/export/test_megatron.py::test_tuned_plans_export_and_megatron_accepts_them")
def test_megatron_accepts_every_tuned_plan(tmp_path):
    plans = tuned_plans("megatron")
    cases = []
    for name, plan in plans.items():
        assert mg.problems(plan) == [], name
        done, _ = exported(plan, tmp_path, name)
        cases.append(_case(plan, list(done.args), dict(done.env)))
    for (name, plan), r in zip(plans.items(), megatron_validate(cases)):
        _check_against_plan(name, plan, r)
        assert r["grads_fp32"], name  # the space costs fp32 gradients, as Megatron keeps them


def test_deepspeed_accepts_every_tuned_plan(tmp_path):
    require_deepspeed()
    plans = tuned_plans("deepspeed")
    for name, plan in plans.items():
        assert ds.problems(plan) == [], name
        (tmp_path / name).mkdir()
        done = ds.write(plan, tmp_path / name)
        assert set(done.files) == {"ds_config.json", "launch.sh", "mist_deepspeed.py"}
        # the split the helper module carries: [embedding, blocks..., norm + head] cut at the stages
        bounds = ds.pipeline_parts(plan)
        specs = [b - a for a, b in zip(bounds, bounds[1:])]
        specs[0] -= 1
        specs[-1] -= 1
        assert specs == [s.layers for s in plan.stages], name
    checked = run_checks([(n, ds.ds_config(p), p.stages[0].dp) for n, p in plans.items()], tmp_path)
    for name, plan in plans.items():
        check_deepspeed(checked[name], plan)


def test_torchtitan_accepts_every_tuned_plan(tmp_path):
    require_torchtitan()
    for name, plan in tuned_plans("torchtitan").items():
        assert tt.problems(plan) == [], name
        out = tmp_path / name
        out.mkdir()
        cfg = parse(tt.write(plan, out).args, out)
        check_layout(cfg, plan)
        check_meshes(cfg, plan)
        check_model(cfg, plan)


@pytest.mark.parametrize(
    "target",
    [
        pytest.param(
            t,
            marks=pytest.mark.extended("tests/export/test_tuned_targets.py::test_the_cases_span_pipelines_and_sharding")
            if t == "megatron"
            else (),
        )
        for t in TARGET_SPACES
    ],
)
def test_the_cases_span_pipelines_and_sharding(target):
    """The tuned plans are not all one shape: the matrix checks more than one layout per target."""
    plans = tuned_plans(target).values()
    assert len({(p.num_stages, p.stages[0].dp, p.stages[0].tp, p.stages[0].zero) for p in plans}) >= 3


def test_zero_bubble_plans_are_refused_and_approximated_as_1f1b():
    """Megatron-LM and DeepSpeed do not run ZB-H1: each names the schedule, and its nearest plan
    runs 1F1B (torchtitan runs it from a schedule file: `test_torchtitan.py`)."""
    from dataclasses import replace

    from mist.export import deepspeed, megatron
    from mist.plan import Plan, StageStrategy
    from mist.specs.loading import load_model
    from mist.specs.training import ClusterSpec, TrainingSpec

    stages = tuple(StageStrategy(16, 1, 4, 1, 4, 1, zero=1) for _ in range(2))
    one = Plan(
        load_model("llama3-8b"),
        ClusterSpec("h100", 1, 8),
        TrainingSpec(seq_len=2048, global_batch=32, grad_dtype="fp32"),
        8,
        stages,
    )
    zb = replace(one, schedule="zb-h1")
    for target in (megatron, deepspeed):
        assert not any("schedule" in p for p in target.problems(one))
        assert any("zb-h1 schedule" in p for p in target.problems(zb)), target.NAME
        assert target.nearest(zb).schedule == "1f1b"
