"""Scheduling bench rows: traces replayed by `gpuguard replay`, each policy beside static
reservation on the same pool in the same run, and the replay's own speed and memory.

    rows() -> [(name, value, target, ok)]   for the `make bench` runner; report(rows) prints them
                                            and returns how many missed
    python bench/scheduling.py              the rows alone, no root needed (exit 1 when one misses)
    python bench/scheduling.py --table      docs/scheduling.md's tables (markdown) instead

Policies (bench/scheduling-{default,exclusive,shared,timed}.toml; the files say what they are).
Traces: the Adobe notebook trace on 47 and 40 GPUs, and a generated heavy-tailed batch trace
(`gpuguard trace generate --profile batch`: 1/4/8-GPU jobs, lognormal durations, Zipf users;
$GPUGUARD_BENCH_JOBS jobs, 31,000 by default, over 30 days, fewer over fewer days) on the pools that static reservation
keeps 58 %, 68 % and 85 % busy. Targets, each against static reservation in the same run:
- exclusive (no sharing, no stops): p95 time to GPU (every job, censored waits included) no worse
  than static's, max wait at most 1.5 times static's, no more jobs dropped, no work lost;
- shared: at most max_sharers (2) jobs on a GPU (the memory rule), stretch reported;
- every policy: work lost, dropped jobs, per-user fairness (Jain over slowdown), stretch reported;
- baselines, in the same runs (reported): a Slurm-like multifactor priority with EASY backfill and a
  clairvoyant shortest-job-first (gpuguard/replay/baselines.py says what each is);
- replay speed: the generated 31,000-job month on 372 GPUs in < 20 s; its peak memory at most 1.5
  times that of a 3,000-job trace (flat: the trace is streamed, never held).
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
sys.path.insert(0, str(REPO))

from gpuguard.replay import engine, trace  # noqa: E402  (after the checkout is on the path)

DATA = Path(os.environ.get("GPUGUARD_DATA") or REPO.parent / "shared" / "data")
ADOBE = DATA / "adobe-notebook-sessions-2021-06-01.json"
POLICIES = {name: REPO / "bench" / f"scheduling-{name}.toml" for name in ("default", "exclusive", "shared", "timed")}
LOADS = (0.58, 0.68, 0.85)
JOBS = int(os.environ.get("GPUGUARD_BENCH_JOBS", "31000"))
SPEED_GPUS = 372

Row = tuple[str, str, str, bool]


def run_replay(path: Path, gpus: int, policy: Path, baselines: bool = False) -> tuple[dict, float, int]:
    """`gpuguard replay --json` in a child: its report, wall seconds and peak resident KiB
    (baselines: with the Slurm-like and the shortest-first baselines in the report too)."""
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "gpuguard", "replay", str(path), "--gpus", str(gpus),
                              "--config", str(policy), "--json", *(["--baselines"] if baselines else [])],
                             cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"gpuguard replay {path} exited {os.waitstatus_to_exitcode(status)}")
    return json.loads(out), time.perf_counter() - started, usage.ru_maxrss


def generate(path: Path, jobs: int, days: float | None = None) -> Path:
    """A batch trace of `jobs` jobs over `days` (by default as dense as the 31,000-job month)."""
    days = 30.0 * jobs / 31000 if days is None else days
    with open(path, "w") as out:
        subprocess.run([sys.executable, "-m", "gpuguard", "trace", "generate", "--profile", "batch", "--jobs",
                        str(jobs), "--users", "60", "--days", str(days)], cwd=REPO, stdout=out, check=True)
    return path


def pool_for(path: Path, load: float) -> int:
    """The largest pool that static reservation keeps at least `load` busy. Its busy share falls as
    the pool grows, once the pool takes the load at all (smaller, the queue grows without end), so
    the search stays between half and twice the pool the mean demand alone would need; where no
    pool there reaches `load`, the smallest (the table shows the busy share static reached)."""
    described = engine.describe(trace.read(path))
    demand = engine.static_reservation(trace.read(path), engine.MAX_POOL).demanded
    guess = max(1, round(demand / (described["hours"] * 3600) / load))

    def busy(gpus: int) -> float:
        return engine.static_reservation(trace.read(path), gpus).summary(gpus)["pool_busy"] or 0.0
    low, high = max(8, guess // 2), 2 * guess  # 8: the largest job
    while low < high:
        middle = (low + high + 1) // 2
        if busy(middle) >= load:
            low = middle
        else:
            high = middle - 1
    return low


def hours(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def policy_rows(label: str, name: str, ours: dict, static: dict) -> list[Row]:
    """The targets of one policy on one pool, each beside static reservation's value."""
    rows: list[Row] = []
    if name == "exclusive":
        rows += [
            (f"{label} exclusive: p95 time to GPU, every job (static {hours(static['wait_p95'])})",
             hours(ours["wait_p95"]), "<= static", ours["wait_p95"] <= static["wait_p95"]),
            (f"{label} exclusive: max wait (static {hours(static['wait_max'])})", hours(ours["wait_max"]),
             "<= 1.5x static", ours["wait_max"] <= 1.5 * static["wait_max"]),
            (f"{label} exclusive: jobs dropped (static {static['jobs_never_ran']})", str(ours["jobs_never_ran"]),
             "<= static", ours["jobs_never_ran"] <= static["jobs_never_ran"]),
            (f"{label} exclusive: GPU-hours lost to stops", f"{ours['gpu_seconds_lost'] / 3600:.0f}", "0",
             ours["gpu_seconds_lost"] == 0)]
    else:
        rows.append((f"{label} {name}: p95 time to GPU, every job (static {hours(static['wait_p95'])})",
                     hours(ours["wait_p95"]), "report", True))
        rows.append((f"{label} {name}: GPU-hours lost to stops ({100 * (ours['lost_of_demanded'] or 0):.1f}% of "
                     "demand)", f"{ours['gpu_seconds_lost'] / 3600:.0f}", "report", True))
        rows.append((f"{label} {name}: jobs dropped (static {static['jobs_never_ran']})",
                     str(ours["jobs_never_ran"]), "report", True))
    if name == "shared":
        rows.append((f"{label} shared: most jobs on one GPU", str(ours["most_sharers"]), "<= 2",
                     ours["most_sharers"] <= 2))
    rows.append((f"{label} {name}: Jain over per-user slowdown (static {static['jain_slowdown']})",
                 str(ours["jain_slowdown"]), "report", True))
    rows.append((f"{label} {name}: stretch p95 / shared GPU-hours", f"{ours['stretch_p95']} / "
                 f"{ours['gpu_seconds_shared'] / 3600:.0f}", "report", True))
    return rows


BASELINES = {"slurm": "Slurm-like (baseline)", "shortest_first": "shortest first, clairvoyant (baseline)"}


def replays(path: Path, pools: dict[str, int]) -> list[tuple[str, str, int, dict, dict]]:
    """(label, policy, gpus, ours, static) for each pool and policy, then each baseline (computed
    with the first policy's run: they do not depend on the policy)."""
    done = []
    for label, gpus in pools.items():
        for index, (name, policy) in enumerate(POLICIES.items()):
            report, _, _ = run_replay(path, gpus, policy, baselines=index == 0)
            done.append((label, name, gpus, report["policy"], report["static"]))
            done += [(label, title, gpus, report[key], report["static"]) for key, title in BASELINES.items()
                     if key in report]
    return done


def adobe_replays() -> list[tuple[str, str, int, dict, dict]]:
    return replays(ADOBE, {"adobe 47 GPUs": 47, "adobe 40 GPUs": 40})


def generated_replays(directory: Path) -> list[tuple[str, str, int, dict, dict]]:
    path = generate(directory / "batch.csv", JOBS)
    pools = {}
    for load in LOADS:
        gpus = pool_for(path, load)
        pools[f"batch {JOBS} jobs, {gpus} GPUs (sized for static {100 * load:.0f}% busy)"] = gpus
    return replays(path, pools)


def speed_rows(directory: Path) -> list[Row]:
    month = generate(directory / "month.csv", 31000)
    small = generate(directory / "small.csv", 3000, days=3.0)
    _, seconds, peak = run_replay(month, SPEED_GPUS, POLICIES["exclusive"])
    _, defaults, _ = run_replay(month, SPEED_GPUS, POLICIES["default"])
    _, little_seconds, little = run_replay(small, SPEED_GPUS, POLICIES["exclusive"])
    # Seconds per job of the month over those of 3 days as dense: event-driven, a job costs the
    # same whatever the length of the trace. (The seconds themselves move with this shared
    # machine's speed, by up to 40 % between hours for the same code.)
    per_job = (seconds / 31000) / (little_seconds / 3000)
    return [(f"replay speed: generated 31,000-job month on {SPEED_GPUS} GPUs, exclusive (no sharing, no stops),"
             " both policies", f"{seconds:.1f} s", "< 20 s", seconds < 20),
            ("replay speed: the same month, gpuguard's defaults, both policies", f"{defaults:.1f} s", "< 20 s",
             defaults < 20),
            ("replay cost per job: 31,000-job month / 3,000 jobs in 3 days (exclusive)", f"{per_job:.2f}x",
             "<= 1.5x", per_job <= 1.5),
            ("replay memory: 31,000 jobs / 3,000 jobs (peak RSS)", f"{peak / little:.2f}x ({peak // 1024} MiB)",
             "<= 1.5x", peak <= 1.5 * little)]


def rows() -> list[Row]:
    found: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="ggt-bench-") as tmp:
        runs = adobe_replays() if ADOBE.exists() else []
        if not runs:
            found.append((f"adobe rows: {ADOBE} not found (set GPUGUARD_DATA)", "-", "-", True))
        runs += generated_replays(Path(tmp))
        for label, name, _, ours, static in runs:
            found += policy_rows(label, name, ours, static)
        found += speed_rows(Path(tmp))
    return found


def markdown(runs: list[tuple[str, str, int, dict, dict]]) -> str:
    """docs/scheduling.md's table: one line per pool for static reservation, then one per policy."""
    lines = ["| trace, pool | policy | p95 time to GPU (ran) | max wait | mean / p95 completion | dropped | stopped | "
             "work lost | worst user's p95 | Jain slowdown | worst user's slowdown | stretch p95 | shared GPU-h | "
             "pool busy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def line(label: str, name: str, r: dict) -> str:
        lost = f"{r['gpu_seconds_lost'] / 3600:,.0f} GPU-h ({100 * (r['lost_of_demanded'] or 0):.1f}%)"
        return (f"| {label} | {name} | {hours(r['wait_p95'])} ({hours(r['ran_wait_p95'])}) | {hours(r['wait_max'])} | "
                f"{hours(r['jct_mean'])} / {hours(r['jct_p95'])} | {r['jobs_never_ran']} | {r['kills']:,} | {lost} | "
                f"{hours(r['user_wait_p95_worst'])} | {r['jain_slowdown']} | {r['slowdown_worst_user']} | "
                f"{r['stretch_p95']} | {r['gpu_seconds_shared'] / 3600:,.0f} | {100 * (r['pool_busy'] or 0):.1f}% |")
    seen = set()
    for label, name, _, ours, static in runs:
        if label not in seen:
            seen.add(label)
            lines.append(line(label, "static reservation", static))
        lines.append(line("", name, ours))
    return "\n".join(lines)


def report(results: list[Row]) -> int:
    """Print the rows as a table; how many missed their target."""
    width = max(len(name) for name, *_ in results)
    print(f"{'scheduling':<{width}}  {'value':>18}  {'target':>14}")
    for name, value, target, ok in results:
        print(f"{name.ljust(width)}  {value:>18}  {target:>14}{'' if ok else '  MISSED'}")
    return sum(not ok for *_, ok in results)


def main() -> int:
    if "--table" in sys.argv[1:]:
        with tempfile.TemporaryDirectory(prefix="ggt-bench-") as tmp:
            runs = (adobe_replays() if ADOBE.exists() else []) + generated_replays(Path(tmp))
        print(markdown(runs))
        return 0
    return 1 if report(rows()) else 0


if __name__ == "__main__":
    sys.exit(main())
