"""The host's processes as the services see them (edges.Processes): who a process is (/proc) and
signalling it through a pidfd after re-checking that (backends.signals)."""
from __future__ import annotations

from collections.abc import Collection

from gpuguard.backends import procfs, signals
from gpuguard.core.model import ProcessIdentity, SignalResult


class HostProcesses:
    def identity(self, pid: int) -> ProcessIdentity | None:
        return procfs.process_identity(pid)

    def command(self, pid: int) -> str:
        return signals.command(pid)

    def state(self, identity: ProcessIdentity) -> str | None:
        return signals.state(identity)

    def send(self, identity: ProcessIdentity, sig: int, exempt: Collection[int] = ()) -> SignalResult:
        return signals.send(identity, sig, exempt)
