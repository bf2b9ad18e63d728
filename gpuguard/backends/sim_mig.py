"""Simulated MIG: the layout file, the driver's capability table and the capability nodes.

A GPU named like an H100 or H200 has MIG (mig_profiles: their real profiles and placements);
`[gpu.simulated] mig` gives the layout it starts with, and `gpuguard sim mig` changes it. The
layout lives in `device_dir/.gpuguard-sim/mig.json`, written by root (like the `fail` file, one
owned by anyone else is ignored) and read by the fake library on every call:
    {"0": [{"gpu_instance": 7, "compute_instance": 0, "profile": "1g.10gb", "start": 0,
            "uuid": "MIG-..."}, ...], "1": []}        GPU 1: MIG mode, no slices
Next to it is a `mig-minors` file in the driver's format and with its table, which the backend
reads instead of /proc/driver/nvidia-caps/mig-minors, and the current slices' capability nodes
are made in `device_dir/nvidia-caps/` (CAPS_MAJOR:minor, 0444 root:root, as nvidia-modprobe
makes them).
"""
from __future__ import annotations

import json
import os
import secrets
import stat
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from gpuguard.backends import GpuError, mig_caps
from gpuguard.backends.devnodes import caps_node, make_driver_node
from gpuguard.backends.sim_registry import REGISTRY_DIR, Registry, make_registry
from gpuguard.config import SimulatedConfig
from gpuguard.core import mig_profiles
from gpuguard.core.model import CI_SLOTS, GI_SLOTS

MIG_FILE = "mig.json"
MIG_MINORS_FILE = "mig-minors"
CAPS_MAJOR = mig_caps.SIMULATED_CAPS_MAJOR
DRIVER_CAPS_GPUS = 32  # the driver's mig-minors table covers gpu0..gpu31


@dataclass(frozen=True)
class SimSlice:
    gpu_instance: int
    compute_instance: int
    profile: str
    start: int  # first memory slice: also its place among the GPU's MIG devices
    uuid: str


Layout = dict[int, tuple[SimSlice, ...]]  # GPU minor -> its slices; a GPU listed is in MIG mode


def new_slices(gpu_name: str, profiles: list[str] | tuple[str, ...]) -> tuple[SimSlice, ...]:
    """Fresh GPU instances (one compute instance each) of these profiles where the driver would
    put them, each with a new random MIG UUID. Raises ValueError (one line) when they do not fit."""
    return tuple(SimSlice(placed.gpu_instance, 0, placed.profile.name, placed.start, f"MIG-{uuid.uuid4()}")
                 for placed in mig_profiles.place(gpu_name, profiles))


def driver_mig_minors() -> str:
    """mig-minors as the driver writes it: its static table (nv-caps.c), whatever the GPUs' state;
    minor 0 is the NVLink fabric-mgmt capability, listed elsewhere."""
    lines, minor = ["config 1", "monitor 2"], 3
    for gpu in range(DRIVER_CAPS_GPUS):
        for gi in range(GI_SLOTS - 1):  # GI ids 0..14
            lines.append(f"gpu{gpu}/gi{gi}/access {minor}")
            lines += [f"gpu{gpu}/gi{gi}/ci{ci}/access {minor + 1 + ci}" for ci in range(CI_SLOTS)]
            minor += 1 + CI_SLOTS
    return "\n".join(lines) + "\n"


_DRIVER_CAPS = mig_caps.parse_mig_minors(driver_mig_minors())


def read_layout(device_dir: Path) -> Layout:
    """The MIG layout of the simulated GPUs; empty when there is none or it is not root's.
    Raises ValueError for a malformed file."""
    return load_layout(device_dir / REGISTRY_DIR / MIG_FILE, root_owned_stat(device_dir / REGISTRY_DIR / MIG_FILE))


def root_owned_stat(path: Path) -> os.stat_result | None:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    return st if st.st_uid == 0 and stat.S_ISREG(st.st_mode) else None  # the directory is world-writable


def load_layout(path: Path, st: os.stat_result | None) -> Layout:
    if st is None:
        return {}
    try:
        data = json.loads(path.read_text())
        layout = {int(minor): tuple(SimSlice(**entry) for entry in entries) for minor, entries in data.items()}
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a MIG layout: {exc}") from None
    return layout


def write_layout(device_dir: Path, layout: Layout) -> None:
    """Replace the MIG layout (root only) and make the capability nodes of its slices."""
    directory = device_dir / REGISTRY_DIR
    data = {str(minor): [asdict(s) for s in slices] for minor, slices in sorted(layout.items())}
    write_root_file(directory / MIG_FILE, json.dumps(data, indent=1) + "\n")
    for minor, slices in layout.items():
        for sim_slice in slices:
            for cap in mig_caps.slice_caps(_DRIVER_CAPS, minor, sim_slice.gpu_instance,
                                           sim_slice.compute_instance) or ():
                make_driver_node(caps_node(device_dir, cap), (CAPS_MAJOR, cap), 0o444)


def write_root_file(path: Path, text: str) -> None:
    """Write atomically (readers see the old file or the new one), mode 0644."""
    temp = path.with_name(f".{path.name}-{secrets.token_hex(4)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as handle:
        os.fchmod(fd, 0o644)
        handle.write(text)
    os.rename(temp, path)


def start_mig(sim: SimulatedConfig, device_dir: Path) -> None:
    """As root: the driver's mig-minors file, and the configured layout unless one is in place."""
    if os.geteuid() != 0:
        return  # a user's view: whatever root has set up
    directory = device_dir / REGISTRY_DIR
    minors = directory / MIG_MINORS_FILE
    text = driver_mig_minors()
    if root_owned_stat(minors) is None or minors.read_text() != text:
        write_root_file(minors, text)
    current = read_layout(device_dir) if root_owned_stat(directory / MIG_FILE) else None
    if current is None:
        current = {minor: new_slices(sim.name, profiles) for minor, profiles in sim.mig}
    write_layout(device_dir, current)  # also (re)makes the capability nodes


def change_layout(sim: SimulatedConfig, device_dir: Path, minor: int,
                  profiles: list[str] | None) -> tuple[SimSlice, ...] | None:
    """As root, destroy GPU `minor`'s GPU instances and create ones of `profiles` in their place
    (new UUIDs; GI ids are the places', so the same place gives the same id again), or leave MIG
    mode (None). Returns the new slices. Raises ValueError for a layout that does not fit and
    GpuError while processes run on the GPU (the driver refuses to destroy instances in use)."""
    slices = None if profiles is None else new_slices(sim.name, profiles)
    make_registry(device_dir)
    start_mig(sim, device_dir)
    busy = Registry(device_dir / REGISTRY_DIR).processes(minor)
    if busy:
        raise GpuError(f"GPU {minor} is in use by pids {', '.join(str(p.pid) for p in busy)}: "
                       "end them before changing its MIG layout")
    layout = dict(read_layout(device_dir))
    if slices is None:
        layout.pop(minor, None)
    else:
        layout[minor] = slices
    write_layout(device_dir, layout)
    return slices


class LayoutReader:
    """The layout file, parsed again only when it was replaced (root writes it by rename)."""

    def __init__(self, path: Path):
        self.path = path
        self._key: tuple[int, int, int] | None = None
        self._layout: Layout = {}

    def layout(self) -> Layout:
        st = root_owned_stat(self.path)
        key = None if st is None else (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._key:
            self._layout, self._key = load_layout(self.path, st), key
        return self._layout
