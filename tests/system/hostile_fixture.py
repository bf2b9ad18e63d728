"""The `hostile` fixture: hostile workloads (tests/hostile_procs.py) started as a user, killed at the end."""
from __future__ import annotations

import os
import select
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PYTHON, popen_as

HOSTILE = Path(__file__).with_name("hostile_procs.py")
READY_WITHIN = 20.0  # seconds for a workload's first process to register, on a busy machine


@pytest.fixture
def hostile() -> Iterator:
    """Start a hostile workload as a user (in a session of its own); all are killed at the end.
    script: another workload script (devtools/floods.py); before: argv in front (e.g. unshare)."""
    started: list[subprocess.Popen] = []

    def start(user, *args: str, script: Path = HOSTILE, before: tuple[str, ...] = (), env: dict | None = None,
              within: float = READY_WITHIN) -> subprocess.Popen:
        proc = popen_as(user, [*before, PYTHON, str(script), *map(str, args)], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, start_new_session=True,
                        env={**os.environ, **(env or {})})
        started.append(proc)
        ready, _, _ = select.select([proc.stdout], [], [], within)
        line = proc.stdout.readline() if ready else ""
        assert line == "ready\n", f"{args[0]} did not start: {line!r} {proc.stderr.read() if proc.poll() else ''}"
        return proc

    yield start
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(READY_WITHIN)
        proc.stdout.close()
        proc.stderr.close()
