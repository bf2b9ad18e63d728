"""`gpuguard where` and `gpuguard status --fleet`: the fleet of servers sharing one PostgreSQL.

Both ask the local daemon, which reads the fleet database (users hold no database password).
A node silent past its lease shows as lost; a view the daemon could not refresh says since when.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Any

from gpuguard.cli import print_json, print_rows
from gpuguard.cli.calls import ask
from gpuguard.core.errors import EXIT_OK
from gpuguard.core.messages import clock
from gpuguard.core.quantities import format_duration


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    where = subparsers.add_parser(
        "where", help="which server of the fleet has GPUs for you now, near your data",
        description="The servers of the fleet, best first for you: free GPUs you may take now (within your "
                    "fleet quota), data locality (same node, same rack, another rack), queue depth; and the ssh line. "
                    "Example: gpuguard where --gpus 2 --data /data/imagenet")
    where.add_argument("--gpus", type=int, default=1, metavar="N", help="GPUs you want (default 1)")
    where.add_argument("--data", metavar="PATH", help="your data's path, as [fleet.data] names storage")
    where.add_argument("--json", action="store_true", help="print JSON")
    where.set_defaults(func=show_where)


def show_where(args: argparse.Namespace) -> int:
    data = os.path.abspath(args.data) if args.data else None
    reply = ask(args, "where", gpus=args.gpus, data=data)
    if args.json:
        print_json(reply)
        return EXIT_OK
    quota = "no fleet quota" if reply["fleet_gpus"] is None else f"fleet quota {reply['fleet_gpus']}"
    print(f"{reply['user']}: {quota}, {reply['held']} held; {staleness(reply)}")
    choices = reply["choices"]
    if not choices:
        print("no server of the fleet is reachable")
        return 1
    rows = [["NODE", "RACK", "FREE", "YOURS NOW", "QUEUE", *(["DATA"] if data else [])]]
    rows += [[c["node"], c["rack"] or "-", str(c["free"]), str(c["may_take"]), str(c["queued"]),
              *([c["locality"]] if data else [])] for c in choices]
    print_rows(rows)
    best = choices[0]
    if best["may_take"] >= reply["wanted"]:
        print(f"\n{best['ssh']}")
        return EXIT_OK
    print(f"\nno server has {reply['wanted']} GPU{'s' if reply['wanted'] != 1 else ''} for you now; the shortest queue: "
          f"{best['ssh']}")
    return 1


def show_fleet(args: argparse.Namespace) -> int:
    """`gpuguard status --fleet`: every server's GPUs, holders, queue and staleness in one table."""
    reply = ask(args, "fleet_status")
    if args.json:
        print_json(reply)
        return EXIT_OK
    print(f"fleet seen from {reply['node']}: {staleness(reply)}")
    if reply.get("name_clash"):  # another server was refused under this one's name (a daemon before: none)
        print(f"warning: {reply['name_clash']}")
    rows = [["NODE", "RACK", "SEEN", "QUEUE", "GPU", "NAME", "OWNER", "HOLDERS"]]
    for node in reply["nodes"]:
        silent = node["silent_for"]
        seen = ("ok" if not node["lost"] else f"lost {format_duration(round(silent))} ago" if math.isfinite(silent) else
                "lost (its last heartbeat's time is not a time)")
        head = [node["name"], node["rack"] or "-", seen,
                f"{node['queued']} ({node['queued_gpus']} GPUs)" if node["queued"] else "0"]
        for i, gpu in enumerate(node["gpus"] or [None]):
            lead = head if i == 0 else ["", "", "", ""]
            if gpu is None:
                rows.append([*lead, "-", "", "", ""])
            else:
                rows.append([*lead, str(gpu["minor"]), gpu["name"], gpu["owner"], " ".join(gpu["holders"]) or "-"])
    print_rows(rows)
    return EXIT_OK


def staleness(reply: dict[str, Any]) -> str:
    if reply["stale_since"] is not None:
        why = reply.get("offline_reason") or "unreachable"  # a daemon of a release before sends none
        return f"database not used ({why}), stale since {clock(reply['stale_since'])}"
    if reply["view_stale"]:
        return "the fleet view could not be refreshed; showing the last one"
    return "up to date"
