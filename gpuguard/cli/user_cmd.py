"""What every user runs: `gpuguard whoami`, `env`, `request`, `release` (`status` is status_cmd)."""
from __future__ import annotations

import os
import sys
import time

from gpuguard.cli import CommandError, fraction_size, gpu_count, print_json, print_rows, summary, unit_arg
from gpuguard.cli.calls import ask, held_devices, held_path
from gpuguard.cli.requesting import take, timeout_of
from gpuguard.client import DaemonUnreachable
from gpuguard.core.errors import EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE
from gpuguard.core.messages import clock, cuda_export, gpu_label, queue_why, stale_devices
from gpuguard.core.quantities import format_duration, format_gpu_hours, format_size
from gpuguard.core.unit_numbers import unit_label

TYPE_CHECKING = False  # not typing's: whoami starts within a few ms of Python itself
if TYPE_CHECKING:
    import argparse
    from typing import Any

def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    whoami = subparsers.add_parser("whoami", help=summary("whoami"),
                                   description="Your GPUs (with CUDA_VISIBLE_DEVICES), quota, place in the queue "
                                               "and why you wait, sessions and recent events. "
                                               "Example: gpuguard whoami")
    whoami.add_argument("--user", metavar="NAME", help="another user's (root only)")
    whoami.add_argument("--json", action="store_true", help="print JSON")
    whoami.set_defaults(func=show_whoami)

    env = subparsers.add_parser("env", help=summary("env"),
                                description='The line that sets CUDA_VISIBLE_DEVICES to your GPUs now, for a shell '
                                            'older than your grant (tmux, screen). Example: eval "$(gpuguard env)"')
    env.add_argument("--json", action="store_true",
                     help='print JSON: {"cuda_visible_devices": "GPU-...,GPU-..." (null: leave it unset), "uuids", '
                          '"exempt", "daemon": "up" or "down"}')
    env.set_defaults(func=show_env)

    request = subparsers.add_parser("request", help=summary("request"),
                                    description="Get GPUs now, up to your quota; with --wait, wait in the queue "
                                                "until they are yours (^C leaves it). Examples: gpuguard request "
                                                "--gpus 2; gpuguard request --wait --timeout 1h30m")
    amount = request.add_mutually_exclusive_group()
    amount.add_argument("--gpus", type=gpu_count, metavar="N", help="how many GPUs in all (default: your quota)")
    amount.add_argument("--memory", type=fraction_size, metavar="SIZE",
                        help="a fraction of one GPU instead: this much of its memory, shared with other "
                             "fractions, e.g. 20GiB (default: your quota's fraction_memory, if any)")
    request.add_argument("--wait", action="store_true",
                         help="when they are not free, wait in the queue until they are (exit 0 once granted)")
    request.add_argument("--timeout", metavar="DURATION",
                         help="with --wait: give up after this long, e.g. 30m (exit 1, leaving the queue)")
    request.add_argument("--cancel", action="store_true",
                         help="leave the queue instead (the same as gpuguard cancel)")
    request.add_argument("--json", action="store_true", help="print JSON")
    request.set_defaults(func=run_request)

    cancel = subparsers.add_parser("cancel", help=summary("cancel"),
                                   description="Take your waiting requests out of the queue, a login's place "
                                               "included, like Slurm's scancel; root: another user's, who is "
                                               "told. Examples: gpuguard cancel; sudo gpuguard cancel --user bob")
    cancel.add_argument("--user", metavar="NAME", help="another user's requests (root only)")
    cancel.set_defaults(func=run_cancel)

    fairshare = subparsers.add_parser(
        "fairshare", help=summary("fairshare"),
        description="Each user's recent usage (GPU-hours, halving every scheduler.half_life), share and usage "
                    "divided by share, in the order the queue serves them after priority: lower usage per share "
                    "goes first. Example: gpuguard fairshare")
    fairshare.add_argument("--json", action="store_true", help="print JSON (usage in GPU-seconds)")
    fairshare.set_defaults(func=show_fairshare)

    release = subparsers.add_parser("release", help=summary("release"),
                                    description="Give GPUs back and leave the queue. Without --gpu the idle ones "
                                                "go and each one a process of yours still uses stays (named with "
                                                "the pids); with --gpu, all named or none. Examples: gpuguard "
                                                "release; gpuguard release --gpu 3")
    release.add_argument("--gpu", type=unit_arg, action="append", dest="units", metavar="GPU",
                         help="only this GPU or MIG slice (repeatable; default: all of yours)")
    release.add_argument("--json", action="store_true", help="print JSON")
    release.set_defaults(func=run_release)


def show_whoami(args: argparse.Namespace) -> int:
    try:
        reply = ask(args, "whoami", user=args.user)
    except DaemonUnreachable as exc:
        if args.user is not None or (uuids := held_devices(args)) is None:
            raise
        if args.json:
            print_json({"daemon": "unreachable", "error": exc.line(), "held": uuids})
        else:
            print(f"GPUs (from {held_path(args)}): {', '.join(uuids)}")
            print(cuda_export(uuids))
        print(f"gpuguard: the gpuguard service is down ({exc.line()}); what you hold comes from the file "
              "the PAM module reads, the rest (quota, queue, events) once it is back", file=sys.stderr)
        return EXIT_UNREACHABLE
    if args.json:
        print_json(reply)
        return EXIT_OK
    standing = ("exempt: every GPU is open to you" if reply["exempt"] else
                f"member of {reply['group']}" if reply["member"] else
                f"not in {reply['group']}: no GPUs (ask your admin)")
    print(f"{reply['user']} (uid {reply['uid']}): {standing}")
    quota = reply["quota"]
    if reply["member"] or reply["exempt"]:  # a quota a non-member never gets would only mislead
        print(f"quota: {quota['gpus']} GPU{'s' if quota['gpus'] != 1 else ''}, memory {format_size(quota['gpu_memory'])}"
              f" per GPU, time {format_duration(quota['max_time'])}, idle release "
              f"{format_duration(quota['idle_timeout'])}, sharing {'yes' if quota['sharing'] else 'no'}"
              f"{_mig_terms(quota)}{_fraction_terms(quota)}{_fleet_terms(quota)}")
    if reply["grants"]:
        print("GPUs:")
        print_rows([["  GPU", "NAME", "UUID", "MEMORY", "SINCE", "UNTIL", "HOW"]] + [
            [f"  {gpu_label(g['minor'], g.get('index'))}", g["name"] or "?", g["uuid"] or "?",
             memory_against(g.get("memory_used"), g.get("memory_limit")), clock(g["granted_at"]),
             clock(g["expires_at"]) if g["expires_at"] else "-",
             g["origin"] + (", shared" if g["shared"] else "")] for g in reply["grants"]])
        print(cuda_export(_uuids(reply)))
        for g in reply["grants"]:
            if line := fraction_line(g):
                print(line)
            if g.get("drained"):
                reason = f" ({g['drained']['reason']})" if g["drained"]["reason"] else ""
                print(f"GPU {unit_label(g['minor'])} is drained{reason}: yours until you release it, then given to "
                      "nobody until an admin resumes it")
    elif reply["member"]:
        print("GPUs: none (you are in the queue, below)" if reply.get("queue") else
              "GPUs: none (gpuguard request --wait queues for one)")
    if reply.get("queue"):
        q = reply["queue"]
        when = f"; expected by {clock(q['estimate'])}" if q["estimate"] is not None else ""
        print(f"queue: number {q['position']} of {q['waiting']}, for {q['gpus']} GPU{'s' if q['gpus'] != 1 else ''}, "
              f"since {clock(q['since'])}{when}")
        boost = f"; ahead of all younger requests from {clock(q['boost_at'])}" if q.get("boost_at") else ""
        (usage,) = format_gpu_hours(q.get("usage", 0.0))
        print(f"  your place comes from: priority {q.get('priority', 0)}, recent usage {usage} GPU-hours "
              f"(after your share), waiting since {clock(q['since'])}{boost}")
        for ahead in q["ahead"]:
            print(f"  ahead of you: {ahead['user']}: {ahead['why']}")
        for line in queue_why(q, time.time()):
            print(f"  {line}")
    if not reply["exempt"] and args.user is None and (note := stale_devices(os.environ.get("CUDA_VISIBLE_DEVICES"),
                                                                             _uuids(reply))):
        print(note)
    if reply["sessions"]:
        print("sessions:")
        for s in reply["sessions"]:
            origin = " ".join(part for part in (s["service"], s["tty"], s["rhost"] and f"from {s['rhost']}") if part)
            print(f"  {clock(s['opened_at'])}  {origin}")
    if reply["events"]:
        print("recent events:")
        for e in reply["events"]:
            where = f" GPU {unit_label(e['minor'])}" if e["minor"] is not None else ""
            print(f"  {clock(e['time'])}  {e['kind']}{where}: {e['message']}")
    return EXIT_OK


def show_env(args: argparse.Namespace) -> int:
    try:
        reply = ask(args, "whoami")
    except DaemonUnreachable as exc:
        if (uuids := held_devices(args)) is None:
            raise
        # the grants outlive the daemon (the gate keeps them): the file the PAM module reads says which
        print(f"gpuguard: the gpuguard service is down ({exc.line()}); your GPUs from {held_path(args)}",
              file=sys.stderr)
        return _print_env(args, uuids, exempt=False, daemon="down")
    return _print_env(args, _uuids(reply), reply["exempt"], daemon="up")


def _print_env(args: argparse.Namespace, uuids: list[str], exempt: bool, daemon: str) -> int:
    if args.json:
        print_json({"cuda_visible_devices": None if exempt else ",".join(uuids), "uuids": uuids, "exempt": exempt,
                    "daemon": daemon})
    else:  # exempt users see every GPU: no variable to narrow them down
        print("unset CUDA_VISIBLE_DEVICES" if exempt else cuda_export(uuids))
    return EXIT_OK


def fraction_line(grant: dict[str, Any]) -> str:
    """`GPU 3: 20GiB of 80GiB, shared with bob (40GiB); 20GiB left` for a shared grant ("" otherwise)."""
    if not grant["shared"] or grant.get("memory_total") is None:
        return ""
    mine = "?" if grant.get("memory") is None else format_size(grant["memory"])
    others = ", ".join(f"{f['user']} ({'?' if f['memory'] is None else format_size(f['memory'])})"
                       for f in grant.get("shared_with") or ())
    left = grant.get("memory_left")
    return (f"GPU {gpu_label(grant['minor'], grant.get('index'))}: {mine} of {format_size(grant['memory_total'])}, "
            f"{'shared with ' + others if others else 'shared, nobody else on it yet'}; "
            f"{'?' if left is None else format_size(left)} left")


def memory_against(used: int | None, quota: int | None) -> str:
    """`12GiB of 20GiB`, `30GiB of 20GiB: OVER` (the watcher warns, then stops), `?` when not read."""
    if used is None:
        return "?"
    if quota is None:
        return format_size(used)
    return f"{format_size(used)} of {format_size(quota)}" + (": OVER" if used > quota else "")


def _mig_terms(quota: dict[str, Any]) -> str:
    """The quota's MIG terms, when they say more than "any unit will do" (the defaults)."""
    terms = []
    if not quota.get("whole_gpus", True):
        terms.append("MIG slices only")
    if quota.get("slices") is not None:
        terms.append(f"at most {quota['slices']} MIG slice{'s' if quota['slices'] != 1 else ''}")
    if quota.get("slice_profiles"):
        terms.append(f"slice profiles {', '.join(quota['slice_profiles'])}")
    return "".join(f", {term}" for term in terms)


def _fraction_terms(quota: dict[str, Any]) -> str:
    """A quota's terms for fractions (request --memory), where the admin set any."""
    default, most = quota.get("fraction_memory"), quota.get("max_fractions")
    low, high = quota.get("min_fraction_memory"), quota.get("max_fraction_memory")
    if default is None and most is None and low is None and high is None:
        return ""
    terms = [f"{format_size(default)} by default" if default is not None else "",
             f"at most {most} at once" if most is not None else "",
             f"at least {format_size(low)}" if low is not None else "",
             f"at most {format_size(high)} each" if high is not None else ""]
    return ", fractions " + ", ".join(t for t in terms if t)


def _fleet_terms(quota: dict[str, Any]) -> str:
    """A fleet quota, which counts the GPUs held on every server of the fleet together."""
    fleet = quota.get("fleet_gpus")
    return "" if fleet is None else f", fleet quota {fleet} GPU{'s' if fleet != 1 else ''} on all servers together"


def _uuids(whoami: dict[str, Any]) -> list[str]:
    return [g["uuid"] for g in whoami["grants"] if g["uuid"]]


def run_cancel(args: argparse.Namespace) -> int:
    print(ask(args, "cancel", user=getattr(args, "user", None))["message"])
    return EXIT_OK


def show_fairshare(args: argparse.Namespace) -> int:
    reply = ask(args, "fairshare")
    if args.json:
        print_json(reply)
        return EXIT_OK
    print(f"recent GPU usage, halving every {format_duration(reply['half_life'])}; the queue serves higher "
          "priority first, then lower usage per share" + (" (here plus on the other servers)" if reply.get("fleet") else ""))
    if reply.get("fleet"):
        at = reply.get("elsewhere_at")
        print("usage on the other servers: " + (f"as of {clock(at)}" if at is not None else
                                                "not known yet (the fleet database has not answered)"))
    if not reply["users"]:
        print("no usage yet")
        return EXIT_OK
    if not reply.get("fleet"):
        print_rows([["USER", "PRIORITY", "SHARE", "GPU-HOURS", "PER SHARE"]] + [
            [u["user"], str(u["priority"]), f"{u['share']:g}", f"{u['usage'] / 3600:.2f}",
             f"{u['normalized'] / 3600:.2f}"] for u in reply["users"]])
        return EXIT_OK
    # the per-share numbers with as many decimals as it takes for those that differ to read differently
    per_share = format_gpu_hours(*(u["normalized"] for u in reply["users"]))
    print_rows([["USER", "PRIORITY", "SHARE", "HERE", "ELSEWHERE", "GPU-HOURS", "PER SHARE"]] + [
        [u["user"], str(u["priority"]), f"{u['share']:g}", f"{u['here'] / 3600:.2f}", f"{u['elsewhere'] / 3600:.2f}",
         f"{u['usage'] / 3600:.2f}", shown] for u, shown in zip(reply["users"], per_share, strict=True)])
    return EXIT_OK


def run_request(args: argparse.Namespace) -> int:
    if args.cancel:
        if args.wait or args.gpus is not None or args.memory is not None or args.timeout is not None:
            raise CommandError("--cancel goes alone (it leaves the queue)", EXIT_USAGE)
        return run_cancel(args)
    reply = take(args, args.gpus, args.wait, timeout_of(args), memory=args.memory)
    if args.json:
        print_json(reply)
        return EXIT_OK
    # the human line on stderr, the export alone on stdout: eval "$(gpuguard request --wait)"
    print(reply["message"], file=sys.stderr)
    print(cuda_export(filter(None, reply["cuda_visible_devices"].split(","))))
    return EXIT_OK


def run_release(args: argparse.Namespace) -> int:
    reply = ask(args, "release", units=args.units)
    if args.json:
        print_json(reply)
        return EXIT_OK
    print(reply["message"])
    return EXIT_OK
