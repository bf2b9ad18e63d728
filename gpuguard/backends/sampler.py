"""Taking samples of the GPUs (core.sample.Sample): NVML's processes and their owners in /proc.

Taken off the event loop (NVML calls block on the driver lock and /proc reads add up),
once per tick, and shared by the release rule and the watcher so both judge the same moment.

A sample covers the GPUs whose processes NVML could read. A GPU that failed is unknown, not
idle: nobody decides anything about it (`Sample.ok`). Only when no GPU answers does taking a
sample fail. All samples go through the daemon's Sampler, which logs GPUs failing and
recovering once per change, and hands a user's request a sample younger than MAX_AGE instead
of a new one, so a looped command cannot make gpuguard poll NVML faster than once a second.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from gpuguard.backends import procfs, signals
from gpuguard.core.model import Device, GpuUse
from gpuguard.core.sample import MAX_AGE, Opener, Sample
from gpuguard.logs import event

if TYPE_CHECKING:
    from gpuguard.backends.nvml import MigLayout, ProcessQuery


class SampledGpus(Protocol):
    """What a sample reads (backends.nvml.NvmlBackend, or backends.owned.OwnedGpus: gpuguard's share of it)."""

    def layout(self) -> MigLayout: ...

    def query_processes(self) -> ProcessQuery: ...

    def use(self) -> dict[int, GpuUse]: ...


class Sampler:
    """Samples of one backend, taken in a thread of their own and one at a time: the /proc reads
    users' requests cause (a reused sample checked for exited processes, the names `status`
    shows) run in another small pool, so that no flood of requests delays the tick's sample."""

    def __init__(self, backend: SampledGpus) -> None:
        self.backend = backend
        self._nvml = ThreadPoolExecutor(1, thread_name_prefix="nvml")
        self._requests = ThreadPoolExecutor(2, thread_name_prefix="sample-proc")
        self.last: Sample | None = None
        self._taken_at = 0.0  # time.monotonic() when `last` was taken
        self._lock = asyncio.Lock()
        self._failed: Mapping[int, str] = {}  # GPUs failing as last logged
        self._identities = procfs.IdentityCache()  # the same GPU processes tick after tick
        # NVML errors since start, for metrics: per GPU minor, and "all" for a sample no GPU answered.
        self.errors: Counter[str] = Counter()

    async def take(self, max_age: float = MAX_AGE) -> Sample:
        """A sample whose NVML query is at most max_age seconds old (0: a new one). Raises the
        backend's GpuError when NVML fails as a whole: that must never read as 'no processes'."""
        loop = asyncio.get_running_loop()
        async with self._lock:  # concurrent requests wait for one sample rather than each taking one
            if self.last is None or time.monotonic() - self._taken_at >= max_age:
                started = time.monotonic()
                try:
                    self.last = await loop.run_in_executor(self._nvml, _take, self.backend, self._identities)
                except Exception:
                    self.errors["all"] += 1
                    raise
                self.errors.update(str(minor) for minor in self.last.failed)
                self._taken_at = started
                self._log_changes(self.last.failed)
                return self.last
            reused = self.last
        # Reused, less the processes that exited since: a job stopped a moment ago must not
        # block its user's release. /proc answers that cheaply, outside the lock; NVML is not asked again.
        return await loop.run_in_executor(self._requests, _without_exited, reused)

    async def commands(self, pids: Iterable[int]) -> dict[int, str]:
        """pid -> process name (escaped), read from /proc now, in a worker thread: only `gpuguard
        status` shows them, so the tick does not pay for them."""
        return await asyncio.get_running_loop().run_in_executor(
            self._requests, lambda: {pid: signals.command(pid) for pid in pids})

    async def take_or_log(self, action: str, max_age: float = MAX_AGE, **fields: Any) -> Sample | None:
        """take(), or None after logging why there is no sample and `action`, what the caller does instead."""
        try:
            return await self.take(max_age)
        except Exception as exc:  # GpuError and anything a broken driver throws: no data, no action
            event(logging.ERROR, "sample_failed", error=str(exc), action=action, **fields)
            return None

    def close(self) -> None:
        self._nvml.shutdown(wait=False, cancel_futures=True)
        self._requests.shutdown(wait=False, cancel_futures=True)

    def _log_changes(self, failed: Mapping[int, str]) -> None:
        """One line when a GPU starts failing (or fails differently) and one when it answers again."""
        for minor, error in failed.items():
            if self._failed.get(minor) != error:
                event(logging.ERROR, "gpu_failed", gpu=minor, error=error, action="left alone until it answers")
        for minor in sorted(self._failed.keys() - failed.keys()):
            event(logging.INFO, "gpu_recovered", gpu=minor)
        self._failed = failed


def _take(backend: SampledGpus, identities: procfs.IdentityCache) -> Sample:
    now = time.time()
    layout = backend.layout()  # first: the processes are placed on the slices it finds
    query = backend.query_processes()
    owners = identities.identities({p.pid for p in query.processes})
    return Sample(now, tuple(query.processes), owners, query.read, query.failed, backend.use(), layout)


def _without_exited(sample: Sample) -> Sample:
    alive = {pid: identity for pid, identity in sample.owners.items() if procfs.process_identity(pid) == identity}
    return replace(sample, processes=tuple(p for p in sample.processes if p.pid in alive), owners=alive)


def node_openers(units: Iterable[int], uids: Collection[int] | None,
                 devices_of: Callable[[int], Iterable[Device]], real_uids: procfs.RealUids | None = None,
                 pids_of: Callable[[Collection[int]], Collection[int] | None] | None = None) -> list[Opener]:
    """Processes of these users (None: of anyone, a walk of all of /proc) holding these units'
    nodes open per /proc (blocking: one pass over /proc for all). devices_of: the nodes whose
    holders use a unit (Grants.opener_devices).

    NVML lists processes with a CUDA context; a process that opened the node without one
    (or before creating it) shows up only here. Only the users' own processes are looked at
    (procfs.openers_of), so the cost follows their processes, not the host's. pids_of: their
    live pids from the process index (proc_events.ProcessIndex.pids_of; None from it: walk /proc).
    """
    units_of: dict[Device, list[int]] = {}  # two slices of one GPU instance share its capability node
    for unit in units:
        for device in devices_of(unit):
            units_of.setdefault(device, []).append(unit)
    found: set[Opener] = set()
    candidates = pids_of(uids) if pids_of is not None and uids is not None else None
    for device, pids in procfs.openers_of(list(units_of), uids, real_uids, candidates).items():
        for pid in pids:
            uid = procfs.user_of(pid)
            if uid is not None and (uids is None or uid in uids):
                found.update(Opener(pid, uid, unit) for unit in units_of[device])
    return sorted(found, key=lambda h: (h.unit, h.pid))
