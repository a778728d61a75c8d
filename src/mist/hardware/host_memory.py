"""Host (CPU) memory of a node: the capacity that offloaded states and activations must fit in.

Offloading moves bytes from the GPU to the host, it does not make them disappear: every GPU's
offloaded weight, gradient and optimizer tails, its offloaded saved activations and the fp32
gradient copies of its CPU AdamW live in the RAM of its node (pinned on GPUs, so the kernel cannot
swap them out). A node's plan fits when the sum over its GPUs stays within the node's RAM.

The capacity is, in order: the cluster's `host_memory_gib` (the user's machine, per node); the
profile's own `host_memory_per_gpu` (written by `mist profile` on a GPU: this machine's RAM per
visible GPU); the RAM per GPU of the cloud machine that is typical for the GPU kind (below, from
the providers' published machine types, GiB); else unknown, and then nothing is checked.
The whole RAM is the bound: what the OS and the training processes themselves need comes off it
(pass a smaller `--host-memory` to keep room), so a plan over it can certainly not run.
"""

from __future__ import annotations

from mist.units import GiB

#: profile name -> (GiB of RAM per GPU, machine it comes from)
TYPICAL_NODES = {
    "l4": (48, "GCP g2-standard-96: 8 L4, 384 GiB"),
    "a100-sxm4-40gb": (85, "GCP a2-highgpu-8g: 8 A100 40GB, 680 GiB"),
    "a10g": (96, "AWS g5.48xlarge: 8 A10G, 768 GiB"),
    "v100-sxm2-32gb": (96, "AWS p3dn.24xlarge: 8 V100 32GB, 768 GiB"),
    "h100": (256, "AWS p5.48xlarge: 8 H100, 2048 GiB"),
    "h200": (256, "AWS p5e.48xlarge: 8 H200, 2048 GiB"),
}


def node_host_memory(cluster, profile) -> tuple[float | None, str]:
    """(bytes of host RAM per node or None when unknown, where the number comes from)."""
    k = cluster.gpus_per_node
    if cluster.host_memory_gib is not None:
        return cluster.host_memory_gib * GiB, f"cluster host_memory_gib {cluster.host_memory_gib:g}"
    own = getattr(profile, "host_memory_per_gpu", None)
    if own:
        return own * k, f"profile {profile.name}: {own / GiB:.1f} GiB per GPU × {k}"
    if profile.name in TYPICAL_NODES:
        per_gpu, machine = TYPICAL_NODES[profile.name]
        return per_gpu * GiB * k, f"typical {profile.name} node ({machine}): {per_gpu} GiB per GPU × {k}"
    return None, f"unknown for {profile.name} (set host_memory_gib / --host-memory to check it)"


def node_usage(stage_gpus: list[int], per_gpu_bytes: list[float], gpus_per_node: int) -> list[float]:
    """Host bytes of each node: stages take consecutive ranks in plan order (as the runtime lays
    them out, `mist.runtime.layout`), node j holds ranks [j·K, (j+1)·K)."""
    ranks = [b for n, b in zip(stage_gpus, per_gpu_bytes) for _ in range(n)]
    return [sum(ranks[j : j + gpus_per_node]) for j in range(0, len(ranks), gpus_per_node)]
