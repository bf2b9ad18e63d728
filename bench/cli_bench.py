"""The users' commands' start-up: each one a user runs (`--help`, `whoami`, `status`, `env`,
`fairshare`, `events`, `report`, `gpus`, `quota show`) against a daemon, whole processes run by a
member as a user runs them (the venv's console script), against an empty `python3 -I -S`, the two
run in turn and compared by their CPU time (user + system of the finished child), which a loaded
machine disturbs less than the wall clock. Target: 3x (issues 19 and 38). `request`, `release`
and `run` change what the user holds, so each run would differ: their start is `whoami`'s, plus
the grant the daemon's rows time.
"""
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


# what a member runs; each a row
COMMANDS = (["--help"], ["whoami"], ["status"], ["env"], ["fairshare"], ["events"], ["report"], ["gpus"],
            ["quota", "show"])


def cpu_of(argv: list[str], user: str | None = None) -> float:
    """CPU seconds (user + system) of one run of argv (as `user`) to its exit."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, stdout=subprocess.DEVNULL, check=True, env={"PATH": os.environ["PATH"]}, user=user,
                   cwd="/")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def cli_rows(bench: Bench) -> None:
    config = bench.write_config("cli")
    empty = [sys.executable, "-I", "-S", "-c", "pass"]
    with bench.daemon(config):
        for command in COMMANDS:
            ours, baseline = [], []
            for run in range(RUNS):  # in turn, so that a drift in the machine's load hits both
                # each run another member's: the daemon limits each user's reports and events a second
                member = bench.members[run % len(bench.members)]
                ours.append(cpu_of([str(CLI), "--config", str(config), *command], member))
                baseline.append(cpu_of(empty, member))
            row(f"`gpuguard {' '.join(command)}` start to exit, CPU", statistics.median(ours),
                statistics.median(baseline), 3.0, "python3 -I -S -c pass")
