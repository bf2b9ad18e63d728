"""The gate's cost on open(2), timed by bench/openloop.c as a user with no exemption.

- /dev/null with the gate attached (10 and 10,000 map entries) against no gate attached;
- a granted GPU node at 10,000 map entries against 10 (the open fails with ENXIO past the gate:
  no driver here, which is what is timed).
"""
from __future__ import annotations

import os
import stat
import statistics
import subprocess

from env import Bench
from rows import row

from gpuguard.backends.gate import Gate
from gpuguard.core.model import NVIDIA_MAJOR

OPENS, REPEATS, ROUNDS = 50_000, 5, 3


def open_time(bench: Bench, path: str) -> list[float]:
    result = subprocess.run([str(bench.helpers["openloop"]), path, str(OPENS), str(REPEATS)],
                            user=bench.uid(bench.outsider), capture_output=True, text=True, check=True, cwd="/")
    return [int(line) / 1e9 for line in result.stdout.split()]


def gate_rows(bench: Bench) -> None:
    node = bench.base / "gate-nvidia0"
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(NVIDIA_MAJOR, 0))
    os.chmod(node, 0o666)
    uid = bench.uid(bench.outsider)
    fillers = [(100_000 + i, (NVIDIA_MAJOR, i % 8)) for i in range(9_999)]  # other users' grants
    times: dict[str, list[float]] = {key: [] for key in ("none", "null 10", "null 10000", "node 10", "node 10000")}
    for _ in range(ROUNDS):  # in turns: no gate, then a gate with few and with many entries
        times["none"] += open_time(bench, "/dev/null")
        with Gate(f"ggt-bench-{bench.tag}-gate") as gate:
            try:
                gate.attach({0})
                gate.grant(uid, (NVIDIA_MAJOR, 0))
                for filler_uid, dev in fillers[:9]:
                    gate.grant(filler_uid, dev)
                times["null 10"] += open_time(bench, "/dev/null")
                times["node 10"] += open_time(bench, str(node))
                for filler_uid, dev in fillers[9:]:
                    gate.grant(filler_uid, dev)
                times["null 10000"] += open_time(bench, "/dev/null")
                times["node 10000"] += open_time(bench, str(node))
            finally:
                gate.detach()
    med = {key: statistics.median(values) for key, values in times.items()}
    row("gate: open /dev/null, 10 entries", med["null 10"], med["none"], 1.10, "no gate attached")
    row("gate: open /dev/null, 10,000 entries", med["null 10000"], med["none"], 1.10, "no gate attached")
    row("gate: open a granted node, 10,000 vs 10 entries", med["node 10000"], med["node 10"], 1.1, "10 entries")
