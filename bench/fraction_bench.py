"""Fraction placement bench rows (issue 41): generated fractional workloads replayed by
`gpuguard replay --fractions`, FGD beside best-fit and first-fit placement and beside the same
policy with fractions off (every job on whole GPUs), all in the same run on the same pool.

    rows() -> [(name, value, target, ok)]   as bench/scheduling.py's; report(rows) prints them and
                                            returns how many missed
    run()                                   the rows as bench/rows.py's (`make bench`, section
                                            "fractions"): each target a ratio to its baseline
    python bench/fraction_bench.py          the rows alone, no root needed (exit 1 when one misses)
    python bench/fraction_bench.py --table  docs/scheduling.md's table (markdown), then the rows

Workloads (trace.generate_fractional; generated, never a published production trace, which is
kept for evaluation): 44 % of the jobs ask for part of one 80 GiB GPU, their sizes 10-90 % of it
alike ("spread") or mostly small ("small": notebooks); the rest 1, 2, 4 or 8 whole GPUs;
lognormal durations (median 10 minutes, p99 about 5.5 hours); Zipf users. Each workload is
$GPUGUARD_BENCH_FRACTION_JOBS jobs (1,500 by default) over 2 days, seeds 1-3, on the pools that
static reservation keeps 60 % and 75 % busy (bench/scheduling.py's pool_for). Each row's values
are the mean over the seeds (one seed's queue is chaotic: a grant a minute earlier reorders it).
Targets, each in the same run:
- GPUs unallocatable while a fraction waits (engine's text: memory stranded on GPUs of fractions
  where the smallest waiting fraction does not fit, in GPUs' worth): FGD's at most best-fit's and
  first-fit's;
- whole-GPU jobs' p95 time to GPU (every whole-GPU job, censored waits included): with fractions
  placed by FGD no worse than with fractions off.
Reported: the same for best-fit and first-fit, fractional jobs' p95 wait, how many GPUs strand.
"""
from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from scheduling import Row, pool_for, report  # noqa: E402  (after the checkout is on the path)

from gpuguard import config as configuration  # noqa: E402
from gpuguard.replay import engine, trace  # noqa: E402

JOBS = int(os.environ.get("GPUGUARD_BENCH_FRACTION_JOBS", "1500"))
DAYS = 2.0
SEEDS = (1, 2, 3)
LOADS = (0.60, 0.75)
MIXES = {"spread": "sizes 10-90 % alike", "small": "mostly small sizes"}
PLACEMENTS = ("fgd", "best-fit", "first-fit")
COLUMNS = ("policy", *PLACEMENTS)  # "policy": fractions off
MEASURES = ("unallocatable_gpus", "stranding_gpus", "whole_wait_p95", "fraction_wait_p95", "fraction_waiting_of_span")

# (mix, load, gpus) -> column -> measure -> the mean over the seeds
Runs = dict[tuple[str, float, int], dict[str, dict[str, float]]]


def policy() -> configuration.Config:
    """gpuguard's defaults, with up to 8 GPUs a user (the largest job), as bench/scheduling-default.toml."""
    defaults = configuration.Config()
    return replace(defaults, defaults=replace(defaults.defaults, gpus=8))


def workload(directory: Path, mix: str, seed: int) -> Path:
    path = directory / f"fractional-{mix}-{seed}.csv"
    with open(path, "w") as out:
        trace.write_csv(trace.generate_fractional(JOBS, 60, seed, DAYS, mix=mix), out)
    return path


def replays(directory: Path, compare: Callable[..., dict] = engine.compare) -> Runs:
    """Every mix and load, each the mean over SEEDS of fractions off and each placement."""
    config = policy()
    found: Runs = {}
    for mix in MIXES:
        paths = [workload(directory, mix, seed) for seed in SEEDS]
        for load in LOADS:
            gpus = pool_for(paths[0], load)
            sums: dict[str, dict[str, float]] = {column: dict.fromkeys(MEASURES, 0.0) for column in COLUMNS}
            for path in paths:
                report = compare(lambda path=path: trace.read(path), config, gpus, True)
                for column in COLUMNS:
                    for measure in MEASURES:
                        sums[column][measure] += (report[column][measure] or 0.0) / len(paths)
            found[(mix, load, gpus)] = sums
    return found


def label(mix: str, load: float, gpus: int) -> str:
    return f"fractions {mix}, {JOBS} jobs x {len(SEEDS)} seeds, {gpus} GPUs (static {100 * load:.0f}% busy)"


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def rows_of(runs: Runs) -> list[Row]:
    found: list[Row] = []
    for (mix, load, gpus), r in runs.items():
        where = label(mix, load, gpus)
        fgd, best, first, off = r["fgd"], r["best-fit"], r["first-fit"], r["policy"]
        found.append((f"{where}: GPUs unallocatable while a fraction waits, FGD (best-fit "
                      f"{best['unallocatable_gpus']:.3f}, first-fit {first['unallocatable_gpus']:.3f})",
                      f"{fgd['unallocatable_gpus']:.3f}", "<= both",
                      fgd["unallocatable_gpus"] <= min(best["unallocatable_gpus"], first["unallocatable_gpus"])))
        found.append((f"{where}: whole-GPU jobs' p95 wait, FGD (fractions off {hours(off['whole_wait_p95'])})",
                      hours(fgd["whole_wait_p95"]), "<= off", fgd["whole_wait_p95"] <= off["whole_wait_p95"]))
        found.append((f"{where}: whole-GPU jobs' p95 wait, best-fit / first-fit",
                      f"{hours(best['whole_wait_p95'])} / {hours(first['whole_wait_p95'])}", "report", True))
        found.append((f"{where}: fractional jobs' p95 wait, FGD / best-fit / first-fit / off",
                      " / ".join(hours(r[c]["fraction_wait_p95"]) for c in (*PLACEMENTS, "policy")), "report", True))
        found.append((f"{where}: GPUs stranding memory, FGD / best-fit / first-fit",
                      " / ".join(f"{r[c]['stranding_gpus']:.2f}" for c in PLACEMENTS), "report", True))
    return found


def rows() -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="ggt-bench-") as tmp:
        return rows_of(replays(Path(tmp)))


def markdown(runs: Runs) -> str:
    """docs/scheduling.md's table: per workload and pool, each placement and fractions off."""
    lines = ["| workload, pool | placement | GPUs unallocatable while a fraction waits | GPUs stranding | "
             "whole-GPU jobs' p95 wait | fractional jobs' p95 wait | time a fraction waits |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    names = {"fgd": "FGD", "best-fit": "best-fit", "first-fit": "first-fit", "policy": "fractions off"}
    for (mix, load, gpus), r in runs.items():
        for index, column in enumerate((*PLACEMENTS, "policy")):
            x = r[column]
            where = f"{mix} ({MIXES[mix]}), {gpus} GPUs (static {100 * load:.0f}% busy)" if index == 0 else ""
            fractions = column != "policy"
            lines.append(f"| {where} | {names[column]} | {x['unallocatable_gpus']:.3f} | "
                         f"{x['stranding_gpus']:.2f} | {hours(x['whole_wait_p95'])} | {hours(x['fraction_wait_p95'])} | "
                         f"{100 * x['fraction_waiting_of_span']:.0f}% |" if fractions else
                         f"| {where} | {names[column]} | - | - | {hours(x['whole_wait_p95'])} | "
                         f"{hours(x['fraction_wait_p95'])} | - |")
    return "\n".join(lines)


def run() -> None:
    """The targets as bench/rows.py's rows (`make bench`): FGD's value over its baseline's, at most 1."""
    from rows import row

    with tempfile.TemporaryDirectory(prefix="ggt-bench-") as tmp:
        runs = replays(Path(tmp))
    for (mix, load, gpus), r in runs.items():
        where = label(mix, load, gpus)
        fgd, baseline = r["fgd"]["unallocatable_gpus"], min(r["best-fit"]["unallocatable_gpus"],
                                                             r["first-fit"]["unallocatable_gpus"])
        # rows.Row shows its values as times: the values are in the name, and the ratio is what counts
        row(f"{where}: GPUs unallocatable while a fraction waits, FGD {fgd:.3f} vs {baseline:.3f}",
            fgd or 1e-9, baseline or 1e-9, 1.0, "the fewer of best-fit's and first-fit's, same run")
        row(f"{where}: whole-GPU jobs' p95 wait, FGD {hours(r['fgd']['whole_wait_p95'])} vs "
            f"{hours(r['policy']['whole_wait_p95'])}", r["fgd"]["whole_wait_p95"] or 1e-9,
            r["policy"]["whole_wait_p95"] or 1e-9, 1.0, "fractions off, same run")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="ggt-bench-") as tmp:
        runs = replays(Path(tmp))
    if "--table" in sys.argv[1:]:
        print(markdown(runs))
        print()
    return 1 if report(rows_of(runs)) else 0


if __name__ == "__main__":
    sys.exit(main())
