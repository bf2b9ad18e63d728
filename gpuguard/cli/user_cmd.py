"""What every user runs: `gpuguard whoami`, `env`, `request`, `release` (`status` is status_cmd)."""
from __future__ import annotations

import argparse
import os
from typing import Any

from gpuguard.cli import print_json, print_rows
from gpuguard.errors import EXIT_OK
from gpuguard.cli.calls import ask
from gpuguard.messages import clock, cuda_export, number_list, stale_devices
from gpuguard.units import format_duration, format_size


def register(subparsers: argparse._SubParsersAction) -> None:
    whoami = subparsers.add_parser("whoami", help="your GPUs, quota, sessions and recent events")
    whoami.add_argument("--user", metavar="NAME", help="another user's (root only)")
    whoami.add_argument("--json", action="store_true", help="print JSON")
    whoami.set_defaults(func=show_whoami)

    env = subparsers.add_parser("env", help="the export CUDA_VISIBLE_DEVICES=... line for your GPUs now",
                                description='For a shell older than your grant (tmux, screen): eval "$(gpuguard env)"')
    env.set_defaults(func=show_env)

    request = subparsers.add_parser("request", help="get GPUs now, up to your quota")
    request.add_argument("--gpus", type=int, metavar="N", help="how many GPUs in all (default: your quota)")
    request.add_argument("--json", action="store_true", help="print JSON")
    request.set_defaults(func=run_request)

    release = subparsers.add_parser("release", help="give GPUs back (refused while your processes use them)")
    release.add_argument("--gpu", type=int, action="append", dest="minors", metavar="MINOR",
                         help="only this GPU (repeatable; default: all of yours)")
    release.add_argument("--json", action="store_true", help="print JSON")
    release.set_defaults(func=run_release)


def show_whoami(args: argparse.Namespace) -> int:
    reply = ask(args, "whoami", user=args.user)
    if args.json:
        print_json(reply)
        return EXIT_OK
    standing = ("exempt: every GPU is open to you" if reply["exempt"] else
                f"member of {reply['group']}" if reply["member"] else
                f"not in {reply['group']}: no GPUs (ask your admin)")
    print(f"{reply['user']} (uid {reply['uid']}): {standing}")
    quota = reply["quota"]
    print(f"quota: {quota['gpus']} GPU{'s' if quota['gpus'] != 1 else ''}, memory {format_size(quota['gpu_memory'])}"
          f" per GPU, time {format_duration(quota['max_time'])}, idle release {format_duration(quota['idle_timeout'])}"
          f", sharing {'yes' if quota['sharing'] else 'no'}")
    if reply["grants"]:
        print("GPUs:")
        print_rows([["  GPU", "NAME", "UUID", "SINCE", "UNTIL", "HOW"]] + [
            [f"  {g['minor']}", g["name"] or "?", g["uuid"] or "?", clock(g["granted_at"]),
             clock(g["expires_at"]) if g["expires_at"] else "-",
             g["origin"] + (", shared" if g["shared"] else "")] for g in reply["grants"]])
        print(cuda_export(_uuids(reply)))
    elif reply["member"]:
        print("GPUs: none (gpuguard request gets one when one is free)")
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
            where = f" GPU {e['minor']}" if e["minor"] is not None else ""
            print(f"  {clock(e['time'])}  {e['kind']}{where}: {e['message']}")
    return EXIT_OK


def show_env(args: argparse.Namespace) -> int:
    reply = ask(args, "whoami")
    # Exempt users see every GPU: no variable to narrow them down.
    print("unset CUDA_VISIBLE_DEVICES" if reply["exempt"] else cuda_export(_uuids(reply)))
    return EXIT_OK


def _uuids(whoami: dict[str, Any]) -> list[str]:
    return [g["uuid"] for g in whoami["grants"] if g["uuid"]]


def run_request(args: argparse.Namespace) -> int:
    reply = ask(args, "request", gpus=args.gpus)
    if args.json:
        print_json(reply)
        return EXIT_OK
    print(reply["message"])
    print(cuda_export(filter(None, reply["cuda_visible_devices"].split(","))))
    return EXIT_OK


def run_release(args: argparse.Namespace) -> int:
    reply = ask(args, "release", minors=args.minors)
    if args.json:
        print_json(reply)
        return EXIT_OK
    left = f"; you still hold GPU {number_list(reply['gpus'])}" if reply["gpus"] else ""
    print(f"gpuguard: released GPU {number_list(reply['released'])}{left}")
    return EXIT_OK
