"""gpuguard benchmarks (`sudo make bench`): every row a ratio to a baseline measured in the same run.

Absolute times on a shared machine say little; ratios to a baseline that suffers the same noise
say whether gpuguard's own work stays small. Each row prints with its target; the run exits 1
when a row misses. It starts real daemons on simulated GPUs (each with a gate of its own, under
the tests' gate lock), real users and PAM stacks, and up to 5,000 sleeping processes, all named
`ggt-bench-*` and removed afterwards. The rows and their baselines:

- micro.py: the allocator, the watcher's rules, the store;
- fraction_bench.py: fraction placement (FGD, best-fit, first-fit) replayed on generated fractional
  workloads, against best-fit and first-fit and against fractions off in the same run;
- pam_bench.py: the daemon's socket, the PAM module and the pam_exec hook (bench/pamloop.c),
  a login storm; at ~100 and at 5,000 host processes;
- watcher_bench.py: the daemon's CPU per tick at 500 and 5,000 processes, its own part of a
  tick, the metrics snapshot per tick, kill latency;
- gate_bench.py: open(2) with and without the gate (bench/openloop.c);
- cli_bench.py: the start-up of each command a user runs (`--help`, `whoami`, `status`, `events`, `gpus`, ...)
  against an empty `python3 -I -S`;
- flood_bench.py: the tick and logins under release, metrics-slowloris and subuid floods, and a
  logout's release among 10,000 root-owned processes, each against the same daemon without;
- fleet_bench.py: several servers on one PostgreSQL: logins with the database up and down,
  status --fleet, heartbeat load for 50 to 2,000 nodes.
- web_bench.py: the web view's grid for 50 servers x 8 GPUs and every page at 64 GPUs and 100 users,
  each against a static file of its size; the daemon's CPU while an admin keeps the Queue page open.

Small C helpers (bench/*.c) are built by the run with gcc. `--only SECTION` runs one section.
"""
from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import time
from contextlib import ExitStack

import env  # first: puts the checkout on sys.path
from rows import ROWS, format_row, table

from devtools.harness import bpffs_restored
from gpuguard import config as configuration

SECTIONS = ("micro", "fractions", "cli", "pam", "watcher", "floods", "logout", "gate", "fleet", "web")


def machine() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    return f"{os.cpu_count()} CPUs ({model}), Linux {platform.release()}, {env.host_processes()} processes at start"


def run_pam(bench: env.Bench) -> None:
    import pam_bench

    config = bench.write_config("pam")
    paths = configuration.load(config).paths
    echo = pam_bench.start_echo(bench)
    with bench.daemon(config) as daemon:
        pam_bench.socket_rows(bench, str(paths.socket), echo, daemon.pid)
        pam_bench.pam_rows(bench, str(paths.socket), config, echo, config.parent / "daemon.log")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=SECTIONS, action="append", help="run only these sections")
    sections = parser.parse_args().only or SECTIONS
    if os.geteuid() != 0:
        print("bench: run as root (sudo make bench): the rows use real daemons, gates, users and PAM")
        return 2
    # SIGTERM (a timeout, an impatient admin) unwinds like an error: users, gates, daemons go.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.monotonic()
    host = machine()
    print(f"bench: {host}", flush=True)
    with ExitStack() as stack:
        bench = env.Bench(stack)
        if "micro" in sections:
            import micro
            micro.run(bench)
        if "fractions" in sections:
            import fraction_bench
            fraction_bench.run()  # replays in this process: no daemon, gate or user
        stack.enter_context(bpffs_restored())
        if "cli" in sections:
            import cli_bench
            cli_bench.cli_rows(bench)  # from here on gates are attached, each under the gate lock
        if "pam" in sections:
            run_pam(bench)
        if "watcher" in sections:
            import watcher_bench
            watcher_bench.watcher_rows(bench)  # its daemon holds the gate lock (start_daemon)
            with env.gate_lock():  # a Daemon in this process, not start_daemon: its gate needs the lock
                watcher_bench.own_tick_rows(bench)
        if "floods" in sections:
            import flood_bench
            flood_bench.flood_rows(bench)  # its daemon holds the gate lock (start_daemon)
        if "logout" in sections:
            import flood_bench
            flood_bench.logout_rows(bench)
        if "gate" in sections:
            import gate_bench
            with env.gate_lock():  # the baseline too: no other run's gate attached while timing
                gate_bench.gate_rows(bench)
        if "fleet" in sections:
            import fleet_bench
            fleet_bench.run(bench)  # its daemons hold the gate lock one at a time (start_daemon)
        if "web" in sections:
            import web_bench
            web_bench.web_rows(bench)
    print(f"\n{table(ROWS)}\n\nbench: {len(ROWS)} rows in {time.monotonic() - started:.0f} s on {host}")
    missed = [r for r in ROWS if r.missed]
    for r in missed:
        print(f"bench: MISSED {format_row(r)}")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
