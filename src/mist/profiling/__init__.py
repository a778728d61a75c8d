"""`mist profile`: measure the device this runs on and write a GPU profile (`GpuProfile` JSON)
that every `--gpu` option accepts as a path.

    from mist.profiling import run_profile
    prof = run_profile("cpu", processes=2, time_budget=60, progress=lambda f, msg: ...)
    prof.save("profile.json")

Modules: `timing` (timers, budget), `compute` (GEMM, attention, memory-bound ops, host, copies,
AdamW, capacity), `overlap` (interference pairs), `comm` (collectives over worker processes),
`runner` (phases and assembly, with the profile's own `links` / `dp_links` / `interference`),
`drift` (re-check a profile against this machine).
"""

from mist.profiling.runner import Settings, run_profile, settings_for, write_profile

__all__ = ["Settings", "run_profile", "settings_for", "write_profile"]
