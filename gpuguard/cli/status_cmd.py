"""`gpuguard status`: who holds which GPU, how much of it they use, and what runs there.

One block per GPU, after gpustat's one-line-per-GPU summary and nvitop's memory bars and
process table: the GPU line (utilisation, memory bar, holders), a line of its fractions (the
memory promised to its sharers, and what is left) when it is shared, one line per holder (a bar
of their memory against their quota or fraction, time left), one line per process (pid, user,
memory, name).
Colour and Unicode bars on a terminal (NO_COLOR or TERM=dumb turn colour off), plain ASCII when
piped; --json for everything the daemon says, --csv (a header, or --no-header) one line per GPU.
"""
from __future__ import annotations

import os
import sys
from collections import namedtuple

from gpuguard.cli import CommandError, no_such_user, print_json, print_rows, summary
from gpuguard.cli.calls import ask
from gpuguard.core.errors import EXIT_OK, EXIT_USAGE, GpuguardError
from gpuguard.core.messages import clock, gpu_label, number_list
from gpuguard.core.quantities import format_size

TYPE_CHECKING = False  # not typing's, nor dataclasses: `status` starts within a few ms of Python itself
if TYPE_CHECKING:
    import argparse
    from typing import Any

BAR_WIDTH = 20
CSV_COLUMNS = ("gpu", "name", "uuid", "utilization_percent", "memory_used_bytes", "memory_total_bytes",
               "holders", "processes", "time_left_seconds", "owner")
WATCH_DEFAULT = 2.0  # seconds, as watch(1)'s
WATCH_MIN = 1.0
CLEAR = "\033[H\033[2J"  # cursor home, erase the screen: a redraw in place, as watch(1) does
_COLOURS = {"bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33", "cyan": "36"}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from argparse import SUPPRESS  # only when the full parser is built: `status` itself skips argparse

    status = subparsers.add_parser(
        "status", help=summary("status"),
        description="Each GPU with its holders, their memory against their quota, time left and processes, "
                    "then the queue with the time waited and why each request waits. "
                    "Examples: gpuguard status; gpuguard status -u alice; gpuguard status --csv",
        epilog=f"--csv columns: {','.join(CSV_COLUMNS)} (holders space-separated; empty when unknown or none)")
    status.add_argument("-u", "--user", metavar="NAME", help="only the GPUs this user holds or runs processes on")
    status.add_argument("--fleet", action="store_true",
                        help="every server of the fleet: GPUs, holders, queue, staleness (with --json too)")
    # its old name, for one release: said on stderr, hidden from --help
    status.add_argument("--cluster", action="store_true", dest="old_fleet", help=SUPPRESS)
    output = status.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print JSON")
    output.add_argument("--csv", action="store_true", help="print CSV, one line per GPU, after a header line")
    status.add_argument("--no-header", action="store_true", help="with --csv: leave out the header line")
    status.add_argument("--watch", nargs="?", type=watch_interval, const=WATCH_DEFAULT, metavar="SECONDS",
                        help=f"redraw every SECONDS (default {WATCH_DEFAULT:g}, at least {WATCH_MIN:g}) until ^C")
    status.set_defaults(func=show_status)


def watch_interval(text: str) -> float:
    """argparse type of --watch: seconds between redraws, a second or more (each asks the daemon)."""
    import argparse
    import math
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < WATCH_MIN:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds: give {WATCH_MIN:g} or more, "
                                         f"e.g. --watch 5 (or --watch alone: every {WATCH_DEFAULT:g}s)")
    return seconds


class Style(namedtuple("Style", "colour unicode")):  # colour: bool, unicode: bool
    __slots__ = ()

    @classmethod
    def for_stdout(cls) -> Style:
        tty = sys.stdout.isatty()
        colour = tty and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"
        return cls(colour=colour, unicode=tty and (sys.stdout.encoding or "").lower().replace("-", "") == "utf8")

    def paint(self, text: str, *names: str) -> str:
        if not self.colour or not names or not text:
            return text
        return f"\033[{';'.join(_COLOURS[n] for n in names)}m{text}\033[0m"

    def bar(self, used: int | None, limit: int | None) -> str:
        """[#####.....] of used against limit; full and red when over, yellow from 80%."""
        if used is None or not limit:
            return " " * (BAR_WIDTH + 2)
        share = used / limit
        filled = min(BAR_WIDTH, round(share * BAR_WIDTH))
        full, empty = ("█", "░") if self.unicode else ("#", ".")
        colour = "red" if share > 1 else "yellow" if share >= 0.8 else "green"
        return "[" + self.paint(full * filled, colour) + empty * (BAR_WIDTH - filled) + "]"


def _user_exists(name: str) -> bool:
    """backends.accounts.user_exists without loading it (it brings the config module and the model:
    more than Python's own start)."""
    import pwd
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def show_status(args: argparse.Namespace) -> int:
    if args.watch is None:
        return show_once(args)
    if args.json or args.csv:
        raise CommandError("--watch redraws the table: leave out --json and --csv", EXIT_USAGE)
    return watch(args)


def watch(args: argparse.Namespace) -> int:
    """status every args.watch seconds, redrawn in place on a terminal, until ^C (exit 0). After the
    first, a failed draw (a daemon restarting) is said and the next one tried."""
    import time
    raw = getattr(sys.stdout, "stream", sys.stdout)  # under the escaping stdout: CLEAR is ours, not a user's
    tty = sys.stdout.isatty()
    first = True
    try:
        while True:
            sys.stdout.flush()
            raw.write(CLEAR if tty else "" if first else "\n")
            print(f"every {args.watch:g}s: gpuguard status (^C ends)  {clock(time.time())}\n")
            try:
                show_once(args)
            except GpuguardError as exc:
                if first:
                    raise
                print(f"gpuguard: {exc.line()}")
            first = False
            sys.stdout.flush()
            time.sleep(args.watch)
    except KeyboardInterrupt:
        print()
        return EXIT_OK


def show_once(args: argparse.Namespace) -> int:
    if args.old_fleet:
        print("gpuguard: status --cluster is now status --fleet (the old name works until the next release)",
              file=sys.stderr)
    if args.fleet or args.old_fleet:
        from gpuguard.cli import fleet_cmd
        return fleet_cmd.show_fleet(args)
    if args.no_header and not args.csv:
        raise CommandError("--no-header goes with --csv", EXIT_USAGE)
    if args.user is not None and not _user_exists(args.user):
        raise no_such_user(args.user, "-u", "--user")
    reply = ask(args, "status")
    gpus = [gpu for gpu in reply["gpus"] if args.user is None or involves(gpu, args.user)]
    if args.json:
        print_json({**reply, "gpus": gpus})
    elif args.csv:
        import csv
        writer = csv.writer(sys.stdout, lineterminator="\n")
        if not args.no_header:
            writer.writerow(CSV_COLUMNS)
        writer.writerows(csv_row(gpu, reply["now"]) for gpu in gpus)
    else:
        style = Style.for_stdout()
        for gpu in gpus:
            print("\n".join(gpu_lines(gpu, reply["now"], style)))
        if not gpus:
            print(f"{args.user} holds no GPU and runs nothing on one" if args.user else "no GPUs")
        if reply.get("queue"):
            print("\nqueue (served in this order; gpuguard whoami says why):")
            print_rows([["  #", "USER", "GPUS", "SINCE", "WAITED", "PRIORITY", "REASON"]] + [
                [f"  {q['position']}", q["user"], str(q["gpus"]), clock(q["since"]), time_left(q["waited"]),
                 str(q["priority"]), q["reason"]]
                for q in reply["queue"]])
        if "sessions" in reply:
            print(f"\n{len(reply['sessions'])} open session(s); exempt uids {number_list(reply['exempt'])}; "
                  f"enforcement: {'gate ' + reply['gate'] if reply['gate'] else 'ACLs only'}")
    return EXIT_OK


def involves(gpu: dict[str, Any], user: str) -> bool:
    return (any(h["user"] == user for h in gpu["holders"])
            or any(p["user"] == user for p in gpu["process_list"] or ()))


def gpu_lines(gpu: dict[str, Any], now: float, style: Style) -> list[str]:
    if (owner := gpu.get("owner", "gpuguard")) != "gpuguard":  # Slurm's or Kubernetes': its holders are theirs
        title = style.paint(f"GPU {gpu['label']}", "bold")
        return [f"{title}  {gpu['name']}  " + style.paint(f"{owner}'s: not managed by gpuguard", "dim")]
    util = "  ?" if gpu["utilization"] is None else f"{gpu['utilization']:3d}"
    used = gpu["memory_used"]
    memory = f"{'?' if used is None else format_size(used)} / {format_size(gpu['memory_total'])}"
    holders = ", ".join(style.paint(h["user"], "bold", "cyan") for h in gpu["holders"]) or style.paint("free", "green")
    title = style.paint(f"GPU {gpu_label(gpu['minor'], gpu.get('index'))}", "bold")
    drained = gpu.get("drained")
    if drained is not None:
        holders += "  " + style.paint("DRAINED" + (f" ({drained['reason']})" if drained["reason"] else ""),
                                      "bold", "yellow")
    lines = [f"{title}  {gpu['name']}  {util}%  "
             f"{style.bar(used, gpu['memory_total'])} {memory:<17}  {holders}"]
    if line := fractions_line(gpu):
        lines.append(f"    {line}")
    for h in gpu["holders"]:
        fraction = h.get("memory") if h["shared"] else None
        quota = h.get("memory_limit")  # the watcher's: a sharer's promise, or the quota if that is less
        mine = "?" if h["memory_used"] is None else format_size(h["memory_used"])
        against = (f"{mine} of {format_size(quota)} {'fraction' if fraction == quota else 'quota'}" if quota else
                   f"{mine}, MIG slice (bounded in hardware)" if gpu["profile"] else f"{mine}, no memory quota")
        if quota and h["memory_used"] is not None and h["memory_used"] > quota:
            against += " " + style.paint("OVER", "bold", "red")
        until = (f"until {clock(h['expires_at'])} ({time_left(h['expires_at'] - now)} left)"
                 if h["expires_at"] else "no time limit")
        shared = ", shared" if h["shared"] else ""
        name = style.paint(f"{h['user']:<12}", "cyan")
        lines.append(f"    {name} {style.bar(h['memory_used'], quota)} "
                     f"{against}; {until}{shared}")
    if gpu["process_list"] is None:
        lines.append(style.paint("    processes unknown: NVML could not read this GPU", "yellow"))
    for p in gpu["process_list"] or ():
        memory = "?" if p["memory"] is None else format_size(p["memory"])
        lines.append(style.paint(f"      {p['pid']:>7}  {p['user'] or '?':<12} {memory:>9}  {p['command']}", "dim"))
    return lines


def fractions_line(gpu: dict[str, Any]) -> str:
    """`shared: alice 30GiB, bob 40GiB; 70GiB of 80GiB promised, 10GiB left` ("" when not shared)."""
    shares = gpu.get("fractions")  # absent: a daemon from before fractions, or another system's GPU
    if not shares:
        return ""
    left = gpu.get("memory_left")
    return (f"shared: {fraction_words(shares)}; {format_size(gpu['memory_promised'])} of "
            f"{format_size(gpu['memory_total'])} promised, {'?' if left is None else format_size(left)} left")


def fraction_words(shares: list[dict[str, Any]]) -> str:
    """`alice 30GiB, bob 40GiB`: each fraction's holder and the memory promised ("?": unknown)."""
    return ", ".join(f"{f['user']} {'?' if f['memory'] is None else format_size(f['memory'])}" for f in shares)


def csv_row(gpu: dict[str, Any], now: float) -> list[Any]:
    expiries = [h["expires_at"] for h in gpu["holders"] if h["expires_at"]]
    return [gpu["label"], gpu["name"], gpu["uuid"], _blank(gpu["utilization"]), _blank(gpu["memory_used"]),
            gpu["memory_total"], " ".join(h["user"] for h in gpu["holders"]), _blank(gpu["processes"]),
            round(max(0.0, min(expiries) - now)) if expiries else "", gpu.get("owner", "gpuguard")]


def _blank(value: Any) -> Any:
    return "" if value is None else value


def time_left(seconds: float) -> str:
    """2d03h, 5h07m, 42m, <1m: short enough for a status line."""
    minutes = int(max(0.0, seconds) // 60)
    if minutes < 1:
        return "<1m"
    days, rest = divmod(minutes, 24 * 60)
    hours, minutes = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m"
