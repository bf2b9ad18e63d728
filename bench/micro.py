"""In-process rows: the allocator, the watcher's rules and the store, each against the simplest
code that does the same job."""
from __future__ import annotations

import sqlite3
import subprocess
import tempfile
from pathlib import Path

from env import Bench
from rows import per_call, row

from gpuguard import config as configuration
from gpuguard.backends.sim_registry import register_process
from gpuguard.backends.simulated import SimulatedBackend
from gpuguard.core import allocator, rules
from gpuguard.core.model import Grant, Quota
from gpuguard.services.store import Store


def bench_allocator() -> None:
    sim = configuration.SimulatedConfig(count=8)
    with tempfile.TemporaryDirectory(prefix="ggt-bench-") as tmp:
        backend = SimulatedBackend(sim, Path(tmp))
        try:
            gpus, topology = backend.gpus(), backend.topology()
        finally:
            backend.close()
    held = [Grant(2000, "other", 0, 0.0, None, 0.0)]
    ours = per_call(lambda: allocator.choose(gpus, topology, held, {}, 1000, 4), 200)
    baseline = per_call(lambda: [g.unit for g in gpus if g.unit not in {h.unit for h in held}][:4], 200)
    row("allocate 4 of 8 (NVLink pairs)", ours, baseline, 2000, "first four free")


def bench_watcher_rules(bench: Bench) -> None:
    """rules.decide for 8 GPUs x 50 processes, against taking that sample from the simulated NVML."""
    sim = configuration.SimulatedConfig(count=8)
    device_dir = bench.base / "rules-dev"
    device_dir.mkdir(mode=0o755)
    backend = SimulatedBackend(sim, device_dir)
    sleepers = [subprocess.Popen(["sleep", "600"]) for _ in range(400)]
    try:
        for i, proc in enumerate(sleepers):
            register_process(device_dir, proc.pid, i % 8, (i + 1) << 24, 50)
        sample_time = per_call(backend.processes, 10)
        procs = backend.processes()
    finally:
        for proc in sleepers:
            proc.kill()
            proc.wait()
        backend.close()
    grants = [Grant(1000 + m, f"u{m}", m, 0.0, 3600.0, 0.0) for m in range(8)]
    view = rules.View(
        procs=[rules.Proc(p.pid, 1000 + p.unit, p.pid, p.unit, p.used_memory) for p in procs],
        grants=grants, quotas={1000 + m: Quota(gpu_memory=8 << 30, max_time=3600) for m in range(8)},
        exempt=frozenset({0}))
    timing = rules.Timing(grace=30, kill_wait=10)
    decide_time = per_call(lambda: rules.decide(view, rules.State(), 100.0, timing), 50)
    row("watcher rules, 8 GPUs x 50 processes", decide_time, sample_time, 0.5, "the simulated NVML sample")


def bench_store(bench: Bench) -> None:
    with tempfile.TemporaryDirectory(prefix="ggt-bench-", dir=bench.base) as tmp:
        store = Store(Path(tmp) / "state.db")

        def cycle() -> None:
            store.add_grants(1000, "alice", [3], now=1.0, expires_at=None)
            store.remove_grants(1000, [3], now=2.0)

        ours = per_call(cycle, 100)
        store.close()
        raw = sqlite3.connect(Path(tmp) / "raw.db", isolation_level=None)
        raw.execute("PRAGMA journal_mode=WAL")
        raw.execute("PRAGMA synchronous=FULL")
        raw.execute("CREATE TABLE g (uid INTEGER, minor INTEGER, PRIMARY KEY (uid, minor))")

        def raw_cycle() -> None:
            raw.execute("BEGIN IMMEDIATE")
            raw.execute("INSERT INTO g VALUES (1000, 3)")
            raw.execute("COMMIT")
            raw.execute("BEGIN IMMEDIATE")
            raw.execute("DELETE FROM g WHERE uid = 1000 AND minor = 3")
            raw.execute("COMMIT")

        baseline = per_call(raw_cycle, 100)
        raw.close()
    row("store grant + release", ours, baseline, 3, "plain sqlite3, same pragmas")


def run(bench: Bench) -> None:
    bench_allocator()
    bench_watcher_rules(bench)
    bench_store(bench)
