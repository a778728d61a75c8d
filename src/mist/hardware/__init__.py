"""GPU performance profiles: operator-time predictors, memory capacity and host link per GPU type.

    from mist.hardware import load_profile
    gpu = load_profile("h200")
    gpu.gemm_time(8192, 4096, 4096)            # seconds
    gpu.attention_time(2, 32, 8, 4096, 128, causal=True, backward=True)
    gpu.memory_op_time("native_layer_norm", 2 * 8192 * 4096 * 2)
    gpu.stream_time([[1e-5, 2e-6, 3e-4]], backward=False)

Profiles are JSON files in `profiles/`, built offline from the measurement data by the tools in
`tools/profile_build/` (not installed; see README.md beside this file).
"""

from mist.hardware.memory_ops import op_class
from mist.hardware.profile import GpuProfile
from mist.hardware.registry import available_profiles, load_profile

__all__ = ["GpuProfile", "available_profiles", "load_profile", "op_class"]
