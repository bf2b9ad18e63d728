"""Drained GPUs: given to nobody new until resumed (`gpuguard drain GPU --reason ...`, `resume`).

A drain is the admin's, for maintenance or a failing GPU: current holders keep the GPU (they are
told) and the queue and logins skip it, whole GPU and MIG slices alike. Drains are kept in
`<state_dir>/drained.json`, {minor: {"reason", "since"}} (state_files), so a restart keeps them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from gpuguard.logs import event
from gpuguard.services import state_files

FILE = "drained.json"


@dataclass(frozen=True)
class Drain:
    reason: str
    since: float


def load(path: Path) -> dict[int, Drain]:
    data = state_files.read(path) or {}
    try:
        return {int(minor): Drain(str(entry["reason"]), float(entry["since"])) for minor, entry in data.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        event(logging.ERROR, "drains_unreadable", path=path, error=str(exc), action="no GPU drained")
        return {}


def save(path: Path, drains: dict[int, Drain]) -> None:
    state_files.write(path, {str(minor): {"reason": d.reason, "since": d.since} for minor, d in sorted(drains.items())})
