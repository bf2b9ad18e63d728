"""Scheduling bench rows: the Adobe notebook trace replayed by `gpuguard simulate`, beside static
reservation on the same pool in the same run, and the replay's own speed and memory.

    rows() -> [(name, value, target, ok)]   for the `make bench` runner; report(rows) prints them
                                            and returns how many missed
    python bench/scheduling.py              the rows alone, no root needed (exit 1 when one misses)

Rows, for each policy (bench/scheduling-{shared,exclusive,timed}.toml; the files say what they are):
- adobe 47 GPUs: every job runs, p95 time to GPU <= 60 s, Jain >= 0.9; static reservation's p95 beside it.
- adobe 40 GPUs: p95 time to GPU <= 15 min.
- replay speed: the 48-hour trace in < 10 s; a generated 30,000-job trace in < 60 s, and its peak
  memory at most 1.5 times that of a 3,000-job trace (flat: the trace is streamed, never held).
The Adobe rows need ../shared/data (or $GPUGUARD_DATA); without it they are left out, said so.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("GPUGUARD_DATA") or REPO.parent / "shared" / "data")
ADOBE = DATA / "adobe-notebook-sessions-2021-06-01.json"
POLICIES = {name: REPO / "bench" / f"scheduling-{name}.toml" for name in ("shared", "exclusive", "timed")}

Row = tuple[str, str, str, bool]


def simulate(trace: Path, gpus: int, policy: Path) -> tuple[dict, float, int]:
    """`gpuguard simulate --json` in a child: its report, wall seconds and peak resident KiB."""
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "gpuguard", "simulate", str(trace), "--gpus", str(gpus),
                              "--config", str(policy), "--json"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"gpuguard simulate {trace} exited {child.returncode}")
    return json.loads(out), time.perf_counter() - started, usage.ru_maxrss


def minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f} min"


def adobe_rows() -> list[Row]:
    rows: list[Row] = []
    for name, policy in POLICIES.items():
        on47, _, _ = simulate(ADOBE, 47, policy)
        ours, static = on47["policy"], on47["static"]
        rows.append((f"adobe 47 GPUs {name}: jobs never run", str(ours["jobs_never_ran"]), "0",
                     ours["jobs_never_ran"] == 0))
        rows.append((f"adobe 47 GPUs {name}: p95 time to GPU (static {minutes(static['wait_p95'])})",
                     minutes(ours["wait_p95"]), "<= 1.0 min", ours["wait_p95"] <= 60))
        rows.append((f"adobe 47 GPUs {name}: Jain granted/demanded (static {static['jain']:.3f})",
                     f"{ours['jain']:.3f}", ">= 0.9", ours["jain"] >= 0.9))
        rows.append((f"adobe 47 GPUs {name}: pool busy (static {100 * static['pool_busy']:.1f}%)",
                     f"{100 * ours['pool_busy']:.1f}%", "report", True))
        rows.append((f"adobe 47 GPUs {name}: jobs stopped by a rule", str(ours["kills"]), "report", True))
        on40, _, _ = simulate(ADOBE, 40, policy)
        ours, static = on40["policy"], on40["static"]
        rows.append((f"adobe 40 GPUs {name}: p95 time to GPU (static {minutes(static['wait_p95'])})",
                     minutes(ours["wait_p95"]), "<= 15.0 min", ours["wait_p95"] <= 900))
        rows.append((f"adobe 40 GPUs {name}: pool busy (static {100 * static['pool_busy']:.1f}%)",
                     f"{100 * ours['pool_busy']:.1f}%", "report", True))
    report, seconds, _ = simulate(ADOBE, 47, POLICIES["shared"])
    rows.append(("replay speed: 48-hour Adobe trace, both policies", f"{seconds:.1f} s", "< 10 s", seconds < 10))
    return rows


def generated_rows() -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="ggt-bench-") as tmp:
        sizes = {}
        for jobs in (3000, 30000):
            path = Path(tmp) / f"{jobs}.csv"
            with open(path, "w") as out:
                subprocess.run([sys.executable, "-m", "gpuguard", "trace", "generate", "--jobs", str(jobs),
                                "--users", "60"], cwd=REPO, stdout=out, check=True)
            sizes[jobs] = simulate(path, 48, POLICIES["exclusive"])
    _, seconds, peak = sizes[30000]
    _, _, small = sizes[3000]
    return [("replay speed: generated 30,000-job trace, both policies", f"{seconds:.1f} s", "< 60 s", seconds < 60),
            ("replay memory: 30,000 jobs / 3,000 jobs (peak RSS)", f"{peak / small:.2f}x ({peak // 1024} MiB)",
             "<= 1.5x", peak <= 1.5 * small)]


def rows() -> list[Row]:
    found = adobe_rows() if ADOBE.exists() else [(f"adobe rows: {ADOBE} not found (set GPUGUARD_DATA)", "-", "-", True)]
    return found + generated_rows()


def report(results: list[Row]) -> int:
    """Print the rows as a table; how many missed their target."""
    width = max(len(name) for name, *_ in results)
    print(f"{'scheduling':<{width}}  {'value':>18}  {'target':>12}")
    for name, value, target, ok in results:
        print(f"{name.ljust(width)}  {value:>18}  {target:>12}{'' if ok else '  MISSED'}")
    return sum(not ok for *_, ok in results)


def main() -> int:
    return 1 if report(rows()) else 0


if __name__ == "__main__":
    sys.exit(main())
