"""ZB-H1 in the tuner (`tune.zero_bubble`): searched in Mist's full space, priced as
`mist simulate` prices the plan, and only over strategies the runtime can split."""

from dataclasses import replace

from mist.hardware import load_profile
from mist.rules.zero_bubble_order import zb_h1_problem
from mist.simulate.plan_sim import simulate_plan
from mist.simulate.precision import precision_for
from mist.specs.presets import get_preset
from mist.specs.training import ClusterSpec, TrainingSpec
from mist.tune.intra import StageTables
from mist.tune.search import tune
from mist.tune.space import get_space
from mist.tune.zero_bubble import best_zero_bubble

MODEL = get_preset("gpt3-1.3b")
CLUSTER = ClusterSpec(gpu="l4", nodes=1, gpus_per_node=4)
TRAINING = TrainingSpec(seq_len=2048, global_batch=32)


def _space(schedules):
    # a 4-stage pipeline, plain (non-interleaved) schedules, no seed search: a small, fast space
    return replace(get_space("full"), schedules=schedules, pp_values=(4,), virtual_stages=(1,), seed_space=None)


def test_full_space_searches_zero_bubble():
    assert "zb-h1" in get_space("full").schedules and get_space("mist-paper").schedules == ("1f1b",)
    prof = load_profile("l4")
    one = tune(MODEL, CLUSTER, TRAINING, prof, _space(("1f1b",)))
    zb = tune(MODEL, CLUSTER, TRAINING, prof, _space(("1f1b", "zb-h1")))
    assert one.plan.schedule == "1f1b" and zb.plan.schedule == "zb-h1"
    # the bubble W fills is worth more than what the extra memory of ZB-H1 costs here
    assert zb.iteration_time_s < one.iteration_time_s
    for s in zb.plan.stages:
        args = (s.zero, s.offload.weights, s.offload.activations, s.recompute_layers)
        assert zb_h1_problem(*args, s.recompute_attention, s.recompute_activation) is None
    assert zb.predicted.fits
    # the tuner's own price of the plan it chose is the simulator's, to the last bit
    G = zb.plan.micro_batches
    tables = StageTables(
        MODEL, prof, 2048, True, _space(("zb-h1",)), 4, G, 1, 1, 4, 32, False, precision_for(TRAINING, prof)
    )
    found = best_zero_bubble(tables, MODEL.num_layers)
    assert found.strategies == list(zb.plan.stages)
    assert found.time == simulate_plan(zb.plan, prof).iteration_time_s
