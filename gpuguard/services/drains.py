"""Drained GPUs: given to nobody new until resumed (`gpuguard drain GPU --reason ...`, `resume`).

A drain is the admin's, for maintenance or a failing GPU: current holders keep the GPU (they are
told) and the queue and logins skip it, whole GPU and MIG slices alike. Drains is their one
owner: it reads `<state_dir>/drained.json`, {minor: {"reason", "since"}} (state_files), at start,
and writes it at each change, so a restart keeps them; Grants reads which GPUs are drained.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from gpuguard.logs import event
from gpuguard.services import state_files

FILE = "drained.json"


@dataclass(frozen=True)
class Drain:
    reason: str
    since: float


class NotSaved(Exception):
    """A change in force now that could not be written: it is lost at the next restart."""


class Drains(Mapping[int, Drain]):
    """The drained GPUs by minor, read-only but through drain() and resume(), which save them."""

    def __init__(self, path: Path | None) -> None:
        """path None: kept in memory only (a replay's)."""
        self.path = path
        self._drains: dict[int, Drain] = _load(path) if path is not None else {}
        self.version = 0  # moves at every change: what the pool of open GPUs was built from

    def __getitem__(self, minor: int) -> Drain:
        return self._drains[minor]

    def __iter__(self) -> Iterator[int]:
        return iter(self._drains)

    def __len__(self) -> int:
        return len(self._drains)

    def drain(self, minors: Iterable[int], reason: str, now: float) -> None:
        """Give these GPUs to nobody new; raises NotSaved (in force all the same) when the file is not written."""
        self._drains.update((minor, Drain(reason, now)) for minor in minors)
        self._changed()

    def resume(self, minors: Iterable[int]) -> None:
        """Let these GPUs be given again; raises NotSaved as drain() does."""
        for minor in minors:
            self._drains.pop(minor, None)
        self._changed()

    def _changed(self) -> None:
        self.version += 1
        if self.path is None:
            return
        try:
            state_files.write(self.path, {str(minor): {"reason": d.reason, "since": d.since}
                                          for minor, d in sorted(self._drains.items())})
        except OSError as exc:
            raise NotSaved(exc.strerror or str(exc)) from None


def _load(path: Path) -> dict[int, Drain]:
    data = state_files.read(path) or {}
    try:
        return {int(minor): Drain(str(entry["reason"]), float(entry["since"])) for minor, entry in data.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        event(logging.ERROR, "drains_unreadable", path=path, error=str(exc), action="no GPU drained")
        return {}
