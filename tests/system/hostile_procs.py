"""Hostile workloads on simulated GPUs, run as a test user: `PYTHON tests/hostile_procs.py KIND ...`.

Each stands in for what a user trying to evade the watcher would run, with real processes
that open the GPU's node (as CUDA does) and register in the simulated NVML (as
`gpuguard sim burn` does), forked from one interpreter so that they come faster than any
watcher interval. Every kind prints `ready` once its first process is registered, then runs
until killed (its process group: the runner starts it in a session of its own).

    decoys DEVICE_DIR MINOR      keeps KEEP tiny (1 MiB) processes on the GPU, each newer than
                                 anything else, replaced every LIFE seconds
    rotate DEVICE_DIR MINOR      one process (1 GiB) at a time, each living LIFE seconds
    forker DEVICE_DIR MINOR MEM  itself uses MEM, and forks children (512 MiB each) that live
                                 LIFE seconds, a new one every LIFE / KEEP seconds
    split DEVICE_DIR MINOR MEM   KEEP processes using MEM each, for good
    holder NODE                  opens NODE (no CUDA context: NVML never lists it), ignores
                                 SIGTERM, and holds it until SIGKILL
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from gpuguard.backends.sim_registry import register_process
from gpuguard.core.quantities import parse_size

MiB = 1 << 20


def _hold(node: Path) -> int:
    """Hold the node as CUDA does (revocation finds it in /proc/<pid>/fd); O_PATH skips the
    absent driver's open, which cannot succeed on simulated GPUs."""
    return os.open(node, os.O_PATH | os.O_CLOEXEC)


def _child(device_dir: Path, minor: int, memory: int, life: float) -> int:
    """Fork a process that uses `memory` on the GPU for `life` seconds; its pid."""
    pid = os.fork()
    if pid == 0:
        try:
            record = register_process(device_dir, os.getpid(), minor, memory, 100)
            if life == float("inf"):
                signal.pause()
            time.sleep(life)
            record.unlink(missing_ok=True)
        finally:
            os._exit(0)
    return pid


def _reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def _ready() -> None:
    print("ready", flush=True)


def keep_spawning(device_dir: Path, minor: int, memory: int, life: float, keep: int) -> None:
    """`keep` processes alive at any moment, a new one every life / keep seconds."""
    _child(device_dir, minor, memory, life)
    time.sleep(0.05)
    _ready()
    while True:
        time.sleep(life / keep)
        _reap()
        _child(device_dir, minor, memory, life)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=("decoys", "rotate", "forker", "split", "holder"))
    parser.add_argument("target", type=Path, help="device dir (holder: the node)")
    parser.add_argument("minor", type=int, nargs="?")
    parser.add_argument("memory", nargs="?", default="1GiB")
    parser.add_argument("--life", type=float, default=0.5)
    parser.add_argument("--keep", type=int, default=3)
    args = parser.parse_args(argv)
    if args.kind == "holder":
        _hold(args.target)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _ready()
        while True:
            signal.pause()
    node = args.target / f"nvidia{args.minor}"
    _hold(node)  # inherited by every child, like a CUDA program's forks
    if args.kind == "decoys":
        keep_spawning(args.target, args.minor, MiB, args.life, args.keep)
    elif args.kind == "split":
        for _ in range(args.keep):
            _child(args.target, args.minor, parse_size(args.memory), float("inf"))
        time.sleep(0.05)
        _ready()
        while True:
            signal.pause()
    elif args.kind == "rotate":
        keep_spawning(args.target, args.minor, 1 << 30, args.life, 1)
    else:
        record = register_process(args.target, os.getpid(), args.minor, parse_size(args.memory), 100)
        try:
            keep_spawning(args.target, args.minor, 512 * MiB, args.life, args.keep)
        finally:
            record.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
