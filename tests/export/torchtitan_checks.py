"""torchtitan's own code run on an export: its config manager parses the exported arguments, its
parallel dimensions match the world size and build device meshes on a fake process group, and
every module name of the pipeline split exists in the model it builds on the meta device.

torchtitan must be installed (`bash .ci/targets/torchtitan.sh`); `require_torchtitan` fails, not
skips, when it is not.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from mist.export.torchtitan_module import MODULE_NAME

INSTALL = "bash .ci/targets/torchtitan.sh"


def require_torchtitan() -> None:
    try:
        import torchtitan.config.manager  # noqa: F401
        import torchtitan.distributed.parallel_dims  # noqa: F401
    except ImportError as e:
        pytest.fail(f"torchtitan 0.3.0 is not installed ({e}); run `{INSTALL}` in this venv first.", pytrace=False)


def parse(args: tuple[str, ...] | list[str], out_dir: Path):
    """torchtitan's ConfigManager on the exported arguments, with the export folder importable
    (as the launch script's PYTHONPATH makes it) and no stale generated module."""
    from torchtitan.config.manager import ConfigManager

    sys.modules.pop(MODULE_NAME, None)
    sys.path.insert(0, str(out_dir))
    importlib.invalidate_caches()  # the module was written after the last import scan
    try:
        return ConfigManager().parse_args(list(args))
    finally:
        sys.path.remove(str(out_dir))


def build_meshes(parallelism, world: int) -> dict[str, list[int]]:
    """ParallelDims from the parsed config for `world` ranks, its meshes built on a fake process
    group as rank 0: the ranks of rank 0's group on each enabled axis."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as pdims
    from torchtitan.distributed.utils import init_fake_mode

    pdims.device_type = "cpu"  # torchtitan falls back to cuda on a machine without an accelerator
    dims = pdims.ParallelDims.from_config(parallelism, world)
    init_fake_mode(world, "fake_backend")
    try:
        dims.build_mesh()
        axes = {"pp": dims.pp_enabled, "tp": dims.tp_enabled, "batch": dims.dp_enabled, "cp": dims.cp_enabled}
        return {a: dims.get_mesh(a).mesh.flatten().tolist() for a, on in axes.items() if on}
    finally:
        dist.destroy_process_group()


def meta_model(config):
    """The model torchtitan builds for the parsed config, on the meta device, after its own
    config-time checks (tp against heads, weight tying under a pipeline, sequence length)."""
    import torch

    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        return model_config.build()


def unknown_fqns(model, parts: list[list[str]]) -> list[str]:
    names = {n for n, _ in model.named_modules()}
    return [f for part in parts for f in part if f not in names]
