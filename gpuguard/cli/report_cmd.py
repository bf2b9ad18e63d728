"""`gpuguard report` (GPU-hours per user, GPU or day) and `gpuguard events` (what happened, filtered).

Root sees everyone's records, or one user's with --user; anyone else sees their own.
Times are read as the machine's local time: `2026-11-01`, `2026-11-01T09:00`, `2026-11`
(the month's start), or a duration back from now (`7d`, `12h`).
"""
from __future__ import annotations

import re
import sys
import time

from gpuguard.cli import CommandError, print_json, print_rows, summary
from gpuguard.cli.calls import ask
from gpuguard.core.errors import EXIT_OK, EXIT_USAGE
from gpuguard.core.unit_numbers import unit_label

TYPE_CHECKING = False  # not typing's, nor the model's: events and report start light
if TYPE_CHECKING:
    import argparse
    from typing import Any

HOUR = 3600.0
_FORMATS = ("%Y-%m-%d", "%Y-%m-%dT%H:%M", "%Y-%m-%d %H:%M", "%Y-%m")
_DAYS = {"today": -1, "yesterday": -1,
         **{day: number for number, day in enumerate(("monday", "tuesday", "wednesday", "thursday", "friday",
                                                        "saturday", "sunday"))}}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    report = subparsers.add_parser(
        "report", help=summary("report"),
        description="GPU-hours granted, busy and idle, the busy share and processes stopped by each rule, "
                    "counted by the hour. Root sees everyone; a user sees their own. "
                    "Examples: gpuguard report --since 2026-11 --until 2026-12; gpuguard report --by gpu --csv")
    _period_options(report, since_default="the start of this month")
    report.add_argument("--by", choices=("user", "gpu", "day"), default="user", help="one row per (default user)")
    _output_options(report, csv_help="print CSV with a header row (hours as decimals)")
    report.set_defaults(func=show_report)

    events = subparsers.add_parser("events", help=summary("events"),
                                   description="The event history: root sees everyone's, a user their own. "
                                               "Examples: gpuguard events --since today; "
                                               "sudo gpuguard events --user alice --rule memory")
    _period_options(events, since_default="the oldest kept")
    events.add_argument("--rule", metavar="RULE", help="only this rule (memory, time, idle, stray, admin, user, ...)")
    events.add_argument("--limit", type=event_limit, default=200, metavar="N", help="at most the newest N (default 200)")
    events.add_argument("--json", action="store_true", help="print JSON")
    events.set_defaults(func=show_events)


def event_limit(text: str) -> int:
    """argparse type of events --limit: 1 to the most one reply holds."""
    import argparse  # the full parser's: a plain `events` skips it (cli.QUICK)

    from gpuguard.protocol import MAX_EVENTS  # loaded already: the client's
    try:
        count = int(text)
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_EVENTS:
        raise argparse.ArgumentTypeError(f"{text} is not a number of events: give 1 to {MAX_EVENTS} (default 200; "
                                         "--since and --until for older ones)")
    return count


def _period_options(parser: argparse.ArgumentParser, since_default: str) -> None:
    parser.add_argument("--since", metavar="WHEN",
                        help=f"from (default {since_default}): 2026-11-01, 2026-11, 7d, today, yesterday, monday")
    parser.add_argument("--until", metavar="WHEN", help="to, not included (default now)")
    parser.add_argument("--user", metavar="NAME", help="only this user's (root; others see only their own)")


def _output_options(parser: argparse.ArgumentParser, csv_help: str) -> None:
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print JSON (seconds)")
    output.add_argument("--csv", action="store_true", help=csv_help)


def parse_when(text: str, now: float) -> float:
    """Epoch seconds of a local date, date and time, month, a duration back from now, or the
    start of `today`, `yesterday` or the last `monday` ... `sunday` (today if it is that day)."""
    from datetime import datetime, timedelta  # here: a plain `events` reads no time (issue 38: its start)

    from gpuguard.core.quantities import UnitError, parse_duration
    midnight = datetime.fromtimestamp(now).replace(hour=0, minute=0, second=0, microsecond=0)
    word = text.strip().lower()
    if word in _DAYS:
        back = 0 if word == "today" else 1 if word == "yesterday" else (midnight.weekday() - _DAYS[word]) % 7
        return (midnight - timedelta(days=back)).timestamp()
    for fmt in _FORMATS:
        try:
            return datetime.strptime(text, fmt).timestamp()
        except ValueError:
            continue
    if re.fullmatch(r"\d+(\.\d+)?[smhdw]", text):
        try:
            return now - (parse_duration(text) or 0.0)
        except UnitError as exc:
            raise CommandError(str(exc), EXIT_USAGE) from None
    raise CommandError(f"not a time: {text!r} (write 2026-11-01, 2026-11-01T09:00, 2026-11, 7d, today, yesterday "
                       "or monday)", EXIT_USAGE)


def month_start(now: float) -> float:
    from datetime import datetime
    return datetime.fromtimestamp(now).replace(day=1, hour=0, minute=0, second=0, microsecond=0).timestamp()


def _period(args: argparse.Namespace, default_since: float | None) -> dict[str, float | None]:
    now = time.time()
    return {"since": parse_when(args.since, now) if args.since else default_since,
            "until": parse_when(args.until, now) if args.until else None}


def show_report(args: argparse.Namespace) -> int:
    reply = ask(args, "report", by=args.by, user=args.user, **_period(args, month_start(time.time())))
    if args.json:
        print_json(reply)
        return EXIT_OK
    rules = reply["rules"]  # the kills_RULE columns (reporting.report)
    if args.csv:
        import csv
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow([args.by, "gpu_hours_granted", "gpu_hours_busy", "gpu_hours_idle", "busy_share",
                         *(f"kills_{rule}" for rule in rules)])
        for row in reply["rows"]:
            writer.writerow([_key(args.by, row["key"]), *(f"{row[k] / HOUR:.3f}" for k in ("granted_seconds", "busy_seconds",
                                                                             "idle_seconds")),
                             "" if row["busy_share"] is None else f"{row['busy_share']:.3f}",
                             *(row["kills"].get(rule, 0) for rule in rules)])
        return EXIT_OK
    print(f"GPU use {_clock(reply['since'])} to {_clock(reply['until'])}, by {args.by} (GPU-hours)")
    if not reply["rows"]:
        print("no GPU was granted in this period")
        return EXIT_OK
    table = [[args.by.upper(), "GRANTED", "BUSY", "IDLE", "BUSY SHARE", "STOPPED"]]
    for row in [*reply["rows"], reply["total"]]:
        stopped = ", ".join(f"{rule} {n}" for rule, n in sorted(row["kills"].items()))
        table.append([_key(args.by, row["key"]), *(f"{row[k] / HOUR:.2f}" for k in ("granted_seconds", "busy_seconds",
                                                                            "idle_seconds")),
                      "-" if row["busy_share"] is None else f"{row['busy_share']:.0%}",
                      f"{row['kills_total']}" + (f" ({stopped})" if stopped else "")])
    print_rows(table)
    return EXIT_OK


def _key(by: str, key: Any) -> str:
    """A row's key as people read it: a GPU or MIG slice by its label (model.unit_label)."""
    return unit_label(key) if by == "gpu" and isinstance(key, int) else str(key)


def show_events(args: argparse.Namespace) -> int:
    reply = ask(args, "events", user=args.user, rule=args.rule, limit=args.limit, **_period(args, None))
    if args.json:
        print_json(reply["events"])
        return EXIT_OK
    if not reply["events"]:
        print("no events")
        return EXIT_OK
    rows = [["TIME", "USER", "KIND", "RULE", "GPU", "MESSAGE"]]
    for e in reply["events"]:
        rows.append([_clock(e["time"]), e["user"], e["kind"], e["rule"] or "-",
                     "-" if e["minor"] is None else unit_label(e["minor"]), _message(e["message"])])
    print_rows(rows)
    return EXIT_OK


def _message(text: str) -> str:
    return text.removeprefix("gpuguard: ")


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))
