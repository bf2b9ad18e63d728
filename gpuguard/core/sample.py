"""One look at the GPUs, as the services judge it: which processes run where, and whose they are.

A sample covers the GPUs whose processes NVML could read. A GPU that failed is unknown, not
idle: nobody decides anything about it (`Sample.ok`). backends.sampler takes samples (NVML and
/proc, off the event loop); a replay makes them from its running jobs.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from gpuguard.core.model import GpuProcess, GpuUse, ProcessIdentity

if TYPE_CHECKING:
    from gpuguard.backends.nvml import MigLayout

MAX_AGE = 1.0  # seconds a sample is reused: process queries serialize on the driver lock


@dataclass(frozen=True)
class Sample:
    time: float
    processes: tuple[GpuProcess, ...]  # on the units in `units`
    owners: Mapping[int, ProcessIdentity]  # pid -> identity; pids that exited meanwhile are absent
    units: frozenset[int] = frozenset()  # units whose processes were read
    failed: Mapping[int, str] = field(default_factory=dict)  # minor -> NVML error, for GPUs not read
    use: Mapping[int, GpuUse] = field(default_factory=dict)  # unit -> memory and utilisation, units that answered
    layout: MigLayout | None = None  # the MIG modes and slices, read just before the processes

    def ok(self, unit: int) -> bool:
        """Whether this sample read `unit`'s processes: about any other unit it knows nothing."""
        return unit in self.units

    def uid_of(self, pid: int) -> int | None:
        identity = self.owners.get(pid)
        return identity.uid if identity else None

    def busy_slots(self) -> set[tuple[int, int]]:
        """(uid, unit) for every process NVML sees whose owner is known."""
        return {(uid, p.unit) for p in self.processes if (uid := self.uid_of(p.pid)) is not None}


class Opener(NamedTuple):
    pid: int
    uid: int
    unit: int
