"""Drained GPUs: given to nobody new until resumed (`gpuguard drain GPU --reason ...`, `resume`).

A drain is the admin's, for maintenance or a failing GPU: current holders keep the GPU (they are
told) and the queue and logins skip it, whole GPU and MIG slices alike. Drains are kept in
`<state_dir>/drained.json`, {minor: {"reason", "since"}}, rewritten atomically, so a restart
keeps them; a file that cannot be read drains nothing and is logged.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gpuguard.logs import event

FILE = "drained.json"


@dataclass(frozen=True)
class Drain:
    reason: str
    since: float


def load(path: Path) -> dict[int, Drain]:
    try:
        data = json.loads(path.read_text())
        return {int(minor): Drain(str(entry["reason"]), float(entry["since"])) for minor, entry in data.items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        event(logging.ERROR, "drains_unreadable", path=path, error=str(exc), action="no GPU drained")
        return {}


def save(path: Path, drains: dict[int, Drain]) -> None:
    text = json.dumps({str(minor): {"reason": d.reason, "since": d.since} for minor, d in sorted(drains.items())})
    fd, temporary = tempfile.mkstemp(prefix=f".{FILE}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
