"""The capability minors that guard MIG slices (/proc/driver/nvidia-caps/mig-minors).

To run on a MIG slice a process needs its GPU's node, /dev/nvidia<minor>, and two capability
nodes of the `nvidia-caps` character driver (major allocated at load: see /proc/devices): the
GPU instance's `gpu<minor>/gi<G>/access` and the compute instance's `gpu<minor>/gi<G>/ci<C>/access`,
as /dev/nvidia-caps/nvidia-cap<N>. The driver lists every possible one in mig-minors, one
`<name> <minor>` per line (its static table: `config`, `monitor`, then GPUs 0-31 x GI 0-14 x
(GI access, CI 0-7 access)); `gpu<N>` there is the GPU's minor number. `config` and `monitor`
(create and destroy instances, see every slice) are never anyone's to be granted, and nothing
here hands them out.
"""
from __future__ import annotations

from pathlib import Path

MIG_MINORS = Path("/proc/driver/nvidia-caps/mig-minors")
# nvidia-caps gets a major allocated when it loads; simulated capability nodes use 120, from the
# range 120-127 that the kernel's devices.txt reserves for local/experimental use and never
# allocates dynamically, so a simulated node never reaches a real driver.
SIMULATED_CAPS_MAJOR = 120


def parse_mig_minors(text: str) -> dict[str, int]:
    """`name -> minor` of each well-formed line (others, e.g. from a newer driver, are skipped)."""
    minors = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            minors[parts[0]] = int(parts[1])
    return minors


def read_mig_minors(path: Path = MIG_MINORS) -> dict[str, int]:
    """The capability minors the driver lists; empty when it lists none (nvidia-caps not loaded).
    Raises OSError when the file cannot be read."""
    try:
        return parse_mig_minors(path.read_text())
    except FileNotFoundError:
        return {}


def slice_caps(minors: dict[str, int], parent: int, gpu_instance: int, compute_instance: int) -> tuple[int, int] | None:
    """(GI access minor, CI access minor) of a slice; None unless the driver lists both."""
    gi = minors.get(f"gpu{parent}/gi{gpu_instance}/access")
    ci = minors.get(f"gpu{parent}/gi{gpu_instance}/ci{compute_instance}/access")
    return (gi, ci) if gi is not None and ci is not None else None
