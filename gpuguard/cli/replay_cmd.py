"""`gpuguard replay TRACE`: replay a workload through gpuguard's policy and static reservation;
`gpuguard trace convert|generate`: make trace files. Any user, no root, no daemon."""
from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from pathlib import Path

from gpuguard import config as configuration
from gpuguard.cli import CommandError, print_json, print_rows, summary
from gpuguard.core.errors import EXIT_OK, EXIT_USAGE
from gpuguard.core.quantities import format_duration

TYPE_CHECKING = False  # not typing's: importing it costs every command a few ms
if TYPE_CHECKING:
    from typing import Any


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # "simulate", the command's name before, is kept for one release (scripts and notes use it).
    parser = subparsers.add_parser("replay", aliases=["simulate"],
                                   help=summary("replay"),
                                   description="Replay a trace through the daemon's own services on a virtual clock, "
                                               "beside static reservation on the same pool. "
                                               "Example: gpuguard replay trace.csv --gpus 48 --config policy.toml")
    parser.add_argument("trace", type=Path, metavar="TRACE",
                        help="a trace CSV, Slurm's sacct -P output or the Adobe notebook JSON (gzipped or not)")
    parser.add_argument("--gpus", type=int, metavar="N", help="GPUs in the pool (default: the config's GPU count)")
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help="the policy to replay (default: as for the daemon; gpuguard's defaults if none)")
    parser.add_argument("--json", action="store_true", help="print JSON (durations in seconds)")
    parser.add_argument("--baselines", action="store_true",
                        help="also a Slurm-like multifactor priority with backfill and a clairvoyant "
                             "shortest-job-first on the same pool (docs/scheduling.md)")
    parser.add_argument("--fractions", action="store_true",
                        help="also the policy with fractional requests: a 1-GPU job whose gpu_memory is under a "
                             "GPU's (80 GiB) asks for that much of one GPU, placed by FGD, best-fit and first-fit "
                             "in turn, beside the policy with every job on whole GPUs (docs/scheduling.md)")
    parser.set_defaults(func=run_replay)

    tracing = subparsers.add_parser("trace", help=summary("trace"))
    actions = tracing.add_subparsers(dest="action", metavar="ACTION", required=True)
    convert = actions.add_parser("convert", help="write a trace (e.g. the Adobe JSON) as trace CSV on stdout",
                                 description="Write a trace (the Adobe notebook JSON, or Slurm's sacct -P output) as "
                                             "trace CSV on stdout. Example: gpuguard trace convert sacct.txt > trace.csv")
    convert.add_argument("trace", type=Path, metavar="TRACE")
    convert.set_defaults(func=run_convert)
    generate = actions.add_parser("generate", help="write a synthetic trace CSV on stdout",
                                  description="Write a synthetic trace CSV on stdout. "
                                              "Example: gpuguard trace generate --jobs 3000 --users 40 > trace.csv")
    generate.add_argument("--jobs", type=int, default=1000, metavar="N")
    generate.add_argument("--users", type=int, default=20, metavar="N")
    generate.add_argument("--seed", type=int, default=1, metavar="N")
    generate.add_argument("--profile", choices=("interactive", "batch", "fractional"), default="interactive",
                          help="interactive: logins with bursts (default); batch: a cluster's 1/4/8-GPU jobs with "
                               "heavy-tailed durations, each waiting as long as it takes; fractional: batch jobs, "
                               "some asking for part of one GPU (--fractional, --mix)")
    generate.add_argument("--days", type=float, default=30.0, metavar="N", help="batch: the span of arrivals")
    generate.add_argument("--assign", choices=("zipf", "round-robin"), default="zipf",
                          help="batch: users Zipf-skewed (default) or in turn")
    generate.add_argument("--fractional", type=float, default=0.44, metavar="SHARE",
                          help="fractional: the share of jobs that ask for part of one GPU (default 0.44)")
    generate.add_argument("--mix", choices=("spread", "small"), default="spread",
                          help="fractional: their sizes, 10-90%% of a GPU alike (spread, default) or mostly small")
    generate.set_defaults(func=run_generate)


def policy_config(path: str | None) -> configuration.Config:
    """The config a replay uses: the one named, else the daemon's; with none at all, gpuguard's
    defaults, except that a user may have as many GPUs as a job asks (else nothing of interest runs)."""
    if path is None and not configuration.default_path().exists():
        from dataclasses import replace
        defaults = configuration.Config()
        return replace(defaults, defaults=replace(defaults.defaults, gpus=configuration.MAX_GPUS))
    return configuration.load(path)


def run_replay(args: argparse.Namespace) -> int:
    from gpuguard.replay import baselines, engine, trace  # here: the full parser (--help) loads this module

    config = policy_config(getattr(args, "config", None))
    gpus = args.gpus if args.gpus is not None else config.gpu.simulated.count
    if not 1 <= gpus <= engine.MAX_POOL:
        raise CommandError(f"--gpus must be between 1 and {engine.MAX_POOL}, got {gpus}", EXIT_USAGE)
    notes: Counter[str] = Counter()
    report = engine.compare(lambda: trace.read(args.trace, notes), config, gpus, args.fractions)
    if args.baselines:
        report["slurm"] = baselines.multifactor(trace.read(args.trace), gpus).summary(gpus)
        report["shortest_first"] = baselines.shortest_first(trace.read(args.trace), gpus).summary(gpus)
    report["trace_notes"] = dict(notes)
    _say_notes(notes)
    if args.json:
        print_json(report)
        return EXIT_OK
    print_report(report)
    return EXIT_OK


ROWS = [
    ("GPU-time granted", "gpu_seconds_granted", "hours"),
    ("GPU-time busy (one job's worth a GPU)", "gpu_seconds_busy", "hours"),
    ("  of it shared by 2+ jobs", "gpu_seconds_shared", "hours"),
    ("GPU-time of work lost to stops", "gpu_seconds_lost", "hours"),
    ("busy / granted", "busy_of_granted", "percent"),
    ("pool busy", "pool_busy", "percent"),
    ("time to GPU p50, every job", "wait_p50", "duration"),
    ("time to GPU p95, every job", "wait_p95", "duration"),
    ("time to GPU max, every job", "wait_max", "duration"),
    ("time to GPU p95, jobs that ran", "ran_wait_p95", "duration"),
    ("job completion time, mean", "jct_mean", "duration"),
    ("job completion time, p95", "jct_p95", "duration"),
    ("censored wait p95, jobs never run", "censored_wait_p95", "duration"),
    ("per-user p95: median user", "user_wait_p95_median", "duration"),
    ("per-user p95: worst user", "user_wait_p95_worst", "duration"),
    ("jobs that ran", "jobs_ran", "count"),
    ("jobs never ran", "jobs_never_ran", "count"),
    ("  of them over quota or pool", "jobs_over_quota", "count"),
    ("Jain fairness (per-user slowdown)", "jain_slowdown", "ratio"),
    ("worst user's mean slowdown", "slowdown_worst_user", "ratio"),
    ("Jain fairness (granted/demanded)", "jain", "ratio"),
    ("stretch (run / trace duration) p95", "stretch_p95", "ratio"),
    ("releases (idle, logout)", "releases", "count"),
    ("reclaims", "reclaims", "count"),
    ("time revokes", "revokes", "count"),
    ("jobs killed", "kills", "count"),
    ("most jobs on one GPU", "most_sharers", "count"),
]
# With --fractions (engine's text): whole-GPU jobs apart, and the GPUs a waiting fraction could not use
FRACTION_ROWS = [
    ("time to GPU p95, whole-GPU jobs", "whole_wait_p95", "duration"),
    ("time to GPU p95, fractional jobs", "fraction_wait_p95", "duration"),
    ("time a fraction waits, of the span", "fraction_waiting_of_span", "percent"),
    ("GPUs unallocatable while a fraction waits", "unallocatable_gpus", "ratio"),
    ("  GPUs stranding that memory", "stranding_gpus", "ratio"),
]


def _cell(value: float | int | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "hours":
        return f"{value / 3600:,.0f} GPU-h"
    if unit == "percent":
        return f"{100 * value:.1f}%"
    if unit == "duration":
        return f"{value / 3600:.1f}h" if value >= 3600 else format_duration(round(value)) if value >= 1 else "0s"
    if unit == "ratio":
        return f"{value:.3f}"
    return str(value)


def print_report(report: dict[str, Any]) -> None:
    print(f"{report['trace']['sessions']} sessions, {report['trace']['jobs']} jobs, "
          f"{report['trace']['hours']:.1f} hours, on {report['gpus']} GPUs; replayed in {report['seconds']:.1f}s")
    fractions = "fgd" in report
    columns = {"policy": "gpuguard, whole GPUs" if fractions else "gpuguard (configured)",
               "fgd": "fractions, FGD", "best-fit": "fractions, best-fit", "first-fit": "fractions, first-fit",
               "static": "static reservation", "slurm": "Slurm-like", "shortest_first": "shortest first (clairvoyant)"}
    shown = [key for key in columns if key in report]
    rows = [["", *(columns[key] for key in shown)]]
    for label, key, unit in ROWS + (FRACTION_ROWS if fractions else []):
        rows.append([label, *(_cell(report[column][key], unit) for column in shown)])
    print_rows(rows)


def run_convert(args: argparse.Namespace) -> int:
    from gpuguard.replay import trace

    notes: Counter[str] = Counter()
    jobs = trace.write_csv(trace.read(args.trace, notes), sys.stdout)
    print(f"gpuguard: {jobs} jobs written", file=sys.stderr)
    _say_notes(notes)
    return EXIT_OK


def _say_notes(notes: Counter[str]) -> None:
    """One line on stderr for what reading the trace left out or mended (trace.read's notes)."""
    if notes:
        print("gpuguard: trace read with changes: " + "; ".join(f"{count} {what}" for what, count in
                                                                sorted(notes.items())), file=sys.stderr)


def run_generate(args: argparse.Namespace) -> int:
    from gpuguard.replay import trace

    if args.jobs < 1 or args.users < 1:
        raise CommandError("--jobs and --users must be at least 1", EXIT_USAGE)
    if not 0 < args.days < math.inf:
        raise CommandError(f"--days must be a number more than 0, got {args.days:g}", EXIT_USAGE)
    if not 0 <= args.fractional <= 1:
        raise CommandError(f"--fractional must be a share from 0 to 1, got {args.fractional:g}", EXIT_USAGE)
    if args.profile == "batch":
        sessions = trace.generate_batch(args.jobs, args.users, args.seed, args.days, args.assign)
    elif args.profile == "fractional":
        sessions = trace.generate_fractional(args.jobs, args.users, args.seed, args.days, args.assign,
                                             args.fractional, args.mix)
    else:
        sessions = trace.generate(args.jobs, args.users, args.seed)
    trace.write_csv(sessions, sys.stdout)
    return EXIT_OK
