"""The users' commands' start-up: `gpuguard whoami` and `gpuguard status` against a daemon, whole
processes as a user runs them (the venv's console script), against an empty `python3 -I -S`,
the two run in turn and compared by their CPU time (user + system of the finished child), which
a loaded machine disturbs less than the wall clock. Target: 3x (issue 19)."""
from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

from env import Bench
from rows import row

RUNS = 21
CLI = Path(sys.executable).parent / "gpuguard"


def cpu_of(argv: list[str]) -> float:
    """CPU seconds (user + system) of one run of argv to its exit."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, stdout=subprocess.DEVNULL, check=True, env={"PATH": os.environ["PATH"]})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def cli_rows(bench: Bench) -> None:
    config = bench.write_config("cli")
    empty = [sys.executable, "-I", "-S", "-c", "pass"]
    with bench.daemon(config):
        for command in ("whoami", "status"):
            ours, baseline = [], []
            for _ in range(RUNS):  # in turn, so that a drift in the machine's load hits both
                ours.append(cpu_of([str(CLI), "--config", str(config), command]))
                baseline.append(cpu_of(empty))
            row(f"`gpuguard {command}` start to exit, CPU", statistics.median(ours), statistics.median(baseline), 3.0,
                "python3 -I -S -c pass")
