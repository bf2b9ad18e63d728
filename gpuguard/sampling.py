"""One look at the GPUs: which processes run where, and whose they are.

Taken off the event loop (NVML calls block on the driver lock and /proc reads add up),
once per tick, and shared by the release rule and the watcher so both judge the same moment.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from gpuguard.backends import procfs
from gpuguard.model import NVIDIA_MAJOR, GpuProcess


@dataclass(frozen=True)
class Sample:
    time: float
    processes: tuple[GpuProcess, ...]
    owners: Mapping[int, procfs.ProcessIdentity]  # pid -> identity; pids that exited meanwhile are absent

    def uid_of(self, pid: int) -> int | None:
        identity = self.owners.get(pid)
        return identity.uid if identity else None

    def busy_minors(self, uid: int) -> set[int]:
        """GPUs on which NVML sees a process of uid."""
        return {p.minor for p in self.processes if self.uid_of(p.pid) == uid}


async def take(backend) -> Sample:
    """Raises the backend's GpuError: an NVML failure must never read as 'no processes'."""
    return await asyncio.to_thread(_take, backend)


def _take(backend) -> Sample:
    now = time.time()
    processes = tuple(backend.processes())
    owners = {pid: identity for pid in {p.pid for p in processes}
              if (identity := procfs.process_identity(pid)) is not None}
    return Sample(now, processes, owners)


class Holder(NamedTuple):
    pid: int
    uid: int
    minor: int


def node_holders(minors: Iterable[int]) -> list[Holder]:
    """Processes holding these GPUs' nodes open per /proc (blocking: a full /proc scan per GPU).

    NVML lists processes with a CUDA context; a process that opened the node without one
    (or before creating it) shows up only here.
    """
    found = []
    for minor in sorted(minors):
        for pid in procfs.holders((NVIDIA_MAJOR, minor)):
            uid = procfs.user_of(pid)
            if uid is not None:
                found.append(Holder(pid, uid, minor))
    return found
