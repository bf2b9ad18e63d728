"""Which GPUs of this machine are gpuguard's, and which belong to Slurm or Kubernetes. Pure.

The gate sits on the cgroup v2 root, so it judges opens inside Slurm job cgroups and containers
too: a GPU another system hands out must be left out of the gate's managed ranges, out of the
node ACLs and out of allocation, or its jobs are locked out. `[coexist]` says which: `slurm =
"auto"` reads gres.conf (facts gathered by backends/slurm.py), a list names Slurm's GPUs,
`k8s_gpus` names the Kubernetes device plugin's. With `slurm` not set, a host that is a Slurm
node (a root slurmd running and a gres.conf present) is refused: guessing either way is wrong
(all GPUs gpuguard's locks jobs out; all Slurm's leaves them unguarded).
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuguard.config import CoexistConfig
from gpuguard.core.compat import StrEnum
from gpuguard.core.errors import EXIT_NOT_CONFIGURED, GpuguardError
from gpuguard.core.gres import NodeGpus
from gpuguard.core.messages import number_list
from gpuguard.core.model import NVIDIA_MAJOR, Device, Gpu, unit_label


class Owner(StrEnum):
    GPUGUARD = "gpuguard"
    SLURM = "slurm"
    K8S = "k8s"


class CoexistError(GpuguardError):
    """The daemon will not start until the admin says who owns which GPU (exit 6)."""

    code = EXIT_NOT_CONFIGURED


@dataclass(frozen=True)
class SlurmFacts:
    """What backends/slurm.py found on this host."""

    node: str                             # this host's Slurm NodeName
    slurmd_running: bool                  # a root process named slurmd runs
    gres_conf_present: bool
    gres: NodeGpus | None = None          # what gres.conf says about this node; None: absent or unreadable
    gres_error: str | None = None         # why gres.conf could not be read (one line)
    scontrol_gpus: int | None = None      # GPUs `scontrol show node` gives this node; None: not asked, no answer
    gres_conf: str = ""                   # the gres.conf slurmd reads (a configless one's cache); "": coexist.gres_conf


@dataclass(frozen=True)
class Ownership:
    foreign: Mapping[int, Owner] = field(default_factory=dict)  # GPU minor -> its owner, for those not gpuguard's
    caps: frozenset[int] = frozenset()    # MIG capability minors gres.conf names (of Slurm's GPUs)
    how: tuple[str, ...] = ()             # how each owner was found, in words, for logs and config check

    def owner(self, minor: int) -> Owner:
        return self.foreign.get(minor, Owner.GPUGUARD)

    def unmanaged(self, caps_major: int | None, mig_minors: Mapping[str, int]) -> list[Device]:
        """The device nodes the gate must leave alone: the foreign GPUs' nodes, and with an
        nvidia-caps major every capability of theirs in the driver's table (`gpu<N>/gi../access`:
        their MIG slices) and those gres.conf names."""
        devices = [(NVIDIA_MAJOR, minor) for minor in sorted(self.foreign)]
        if caps_major is not None:
            mine = {f"gpu{minor}" for minor in self.foreign}
            caps = {cap for name, cap in mig_minors.items() if name.split("/", 1)[0] in mine} | self.caps
            devices += [(caps_major, cap) for cap in sorted(caps)]
        return devices

    def summary(self) -> str:
        return "; ".join(self.how) if self.how else "every GPU is gpuguard's"


def decide(config: CoexistConfig, facts: SlurmFacts | None, present: Collection[int]) -> Ownership:
    """Who owns which GPU. present: the GPU minors this machine has (AutoDetect takes them all);
    facts: None when the config needs none (`slurm` a list or "off"). Raises CoexistError."""
    slurm, caps, how = _slurm_gpus(config, facts, present)
    k8s = set(config.k8s_gpus)
    if both := sorted(slurm & k8s):
        raise CoexistError(f"GPU {both[0]} is Slurm's ({how[0]}) and in coexist.k8s_gpus too: one system owns a GPU")
    if k8s:
        how.append(f"Kubernetes: GPUs {number_list(sorted(k8s))} (coexist.k8s_gpus)")
    foreign = {minor: Owner.SLURM for minor in slurm} | {minor: Owner.K8S for minor in k8s}
    return Ownership(foreign=dict(sorted(foreign.items())), caps=frozenset(caps), how=tuple(how))


def _slurm_gpus(config: CoexistConfig, facts: SlurmFacts | None,
                present: Collection[int]) -> tuple[set[int], frozenset[int], list[str]]:
    if isinstance(config.slurm, tuple):
        return set(config.slurm), frozenset(), [f"Slurm: GPUs {number_list(config.slurm)} (coexist.slurm)"]
    if config.slurm == "off":
        return set(), frozenset(), []
    assert facts is not None, "slurm auto or unset needs the facts"
    gres_conf = facts.gres_conf or str(config.gres_conf)
    if config.slurm is None:
        if facts.slurmd_running and facts.gres_conf_present:
            raise CoexistError(
                f"this is a Slurm node (slurmd runs, {gres_conf} exists) and [coexist] slurm is not set: "
                'set slurm = "auto" to leave the GPUs of gres.conf to Slurm, or "off" to manage them all; '
                "not starting rather than lock Slurm's jobs out")
        return set(), frozenset(), []
    # "auto"
    if facts.gres_error is not None:
        raise CoexistError(f"coexist.slurm = auto: {facts.gres_error}")
    gres = facts.gres or NodeGpus(autodetect=False)
    where = f"{gres_conf}, node {facts.node}"
    if gres.autodetect:
        return set(present), gres.caps, [f"Slurm: every GPU ({number_list(sorted(present))}: AutoDetect in {where})"]
    if gres.counted:
        raise CoexistError(f"{gres.counted[0]}: Slurm gets GPUs on node {facts.node} by Count without File=, so "
                           "which ones is unknown: name them (File=/dev/nvidia[0-3]) or list them in coexist.slurm")
    if facts.scontrol_gpus is not None and facts.scontrol_gpus > len(gres.minors):
        named = f"names only {number_list(sorted(gres.minors))}" if gres.minors else "names none"
        raise CoexistError(f"scontrol show node {facts.node} gives it {facts.scontrol_gpus} GPUs but "
                           f"{gres_conf} {named}: name them all with File= or list them in coexist.slurm")
    if not gres.minors:
        return set(), gres.caps, [f"Slurm: no GPU ({where} names none)"]
    return set(gres.minors), gres.caps, [f"Slurm: GPUs {number_list(sorted(gres.minors))} ({where})"]


def check_some_left(ownership: Ownership, present: Collection[int]) -> None:
    """A daemon with no GPU of its own would queue every login forever: refuse instead."""
    if present and set(present) <= set(ownership.foreign):
        raise CoexistError(f"every GPU here belongs to another system ({ownership.summary()}): nothing for "
                           "gpuguard to hand out; stop and disable it on this node")


def status_entries(gpus: Iterable[Gpu], ownership: Ownership) -> list[dict[str, Any]]:
    """`gpuguard status` entries of the GPUs another system owns: the keys of reporting.status_gpus,
    with nothing gpuguard does not know (holders and processes are the owner's business)."""
    return [{"minor": gpu.unit, "label": unit_label(gpu.unit), "profile": None, "index": gpu.index,
             "uuid": gpu.uuid, "name": gpu.name, "memory_total": gpu.memory_total, "memory_used": None,
             "utilization": None, "holders": [], "processes": None, "process_list": None,
             "owner": str(ownership.owner(gpu.unit))} for gpu in sorted(gpus, key=lambda gpu: gpu.unit)]
