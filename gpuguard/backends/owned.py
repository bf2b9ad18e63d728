"""The GPU backend as gpuguard's own GPUs only: those another system owns (gpuguard.core.coexist) left out.

Everything that reads the GPUs through it (allocation, the sampler, so the watcher and the
release rules, metrics) never sees a Slurm or Kubernetes GPU: no process there is a stray to
stop, no such GPU is handed out. Their inventory stays readable (foreign_gpus) for `status`.
"""
from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from gpuguard.backends import GpuError
from gpuguard.core.model import Gpu, GpuUse, Link, unit_parent

if TYPE_CHECKING:
    from gpuguard.backends.nvml import MigLayout, NvmlBackend, ProcessQuery


class OwnedGpus:
    def __init__(self, backend: NvmlBackend, foreign: Collection[int]):
        self.backend = backend
        self.foreign = frozenset(foreign)

    def _own(self, unit: int) -> bool:
        return unit_parent(unit) not in self.foreign

    @property
    def unavailable(self) -> list[str]:
        return self.backend.unavailable

    def gpus(self) -> list[Gpu]:
        return [gpu for gpu in self.backend.gpus() if self._own(gpu.unit)]

    def foreign_gpus(self) -> list[Gpu]:
        return [gpu for gpu in self.backend.gpus() if not self._own(gpu.unit)]

    def layout(self) -> MigLayout:
        seen = self.backend.layout()
        return seen._replace(slices=[s for s in seen.slices if self._own(s.unit)],
                             mig_gpus=frozenset(m for m in seen.mig_gpus if self._own(m)),
                             unread=frozenset(m for m in seen.unread if self._own(m)))

    def topology(self) -> dict[tuple[int, int], Link]:
        return {pair: link for pair, link in self.backend.topology().items() if self._own(pair[0]) and self._own(pair[1])}

    def query_processes(self) -> ProcessQuery:
        """As NvmlBackend's, for gpuguard's GPUs: GpuError when none of them could be read."""
        query = self.backend.query_processes()
        failed = {minor: error for minor, error in query.failed.items() if self._own(minor)}
        read = frozenset(unit for unit in query.read if self._own(unit))
        if failed and not {unit_parent(unit) for unit in read}:
            raise GpuError(next(iter(failed.values())))
        return query._replace(processes=[p for p in query.processes if self._own(p.unit)], read=read, failed=failed)

    def use(self) -> dict[int, GpuUse]:
        return {unit: use for unit, use in self.backend.use().items() if self._own(unit)}

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> OwnedGpus:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
