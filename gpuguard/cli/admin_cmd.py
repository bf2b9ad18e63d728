"""What admins run: `gpuguard grant`, `revoke`, `reload`, `drain`, `resume` (the daemon refuses them to
anyone but root)."""
from __future__ import annotations

import argparse

from gpuguard.cli import print_json, summary, unit_arg
from gpuguard.cli.calls import ask
from gpuguard.core.errors import EXIT_OK

TYPE_CHECKING = False  # not typing's: importing it costs every command a few ms
if TYPE_CHECKING:
    from typing import Any


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    grant = subparsers.add_parser("grant", help=summary("grant"),
                                  description="Give a user GPUs, kept until released, revoked or expired. "
                                              "Examples: sudo gpuguard grant alice --gpus 2 --for 8h; "
                                              "sudo gpuguard grant alice --gpu 3")
    grant.add_argument("user")
    which = grant.add_mutually_exclusive_group(required=True)
    which.add_argument("--gpus", type=int, metavar="N", help="this many GPUs, chosen by the allocator")
    which.add_argument("--gpu", type=unit_arg, action="append", dest="units", metavar="GPU",
                       help="this GPU or MIG slice, e.g. 3 or 3/gi1/ci0 (repeatable)")
    grant.add_argument("--for", dest="duration", metavar="DURATION",
                       help="how long, e.g. 8h (default: the user's max_time)")
    grant.add_argument("--json", action="store_true", help="print JSON")
    grant.set_defaults(func=run_grant)

    revoke = subparsers.add_parser("revoke", help=summary("revoke"),
                                   description="Take GPUs back; processes still on them are ended (warned first "
                                               "when NVML sees them). Examples: sudo gpuguard revoke alice; "
                                               "sudo gpuguard revoke alice --gpu 3")
    revoke.add_argument("user")
    revoke.add_argument("--gpu", type=unit_arg, action="append", dest="units", metavar="GPU",
                        help="only this GPU or MIG slice (repeatable; default: all of the user's)")
    revoke.add_argument("--json", action="store_true", help="print JSON")
    revoke.set_defaults(func=run_revoke)

    reload = subparsers.add_parser("reload", help=summary("reload"),
                                   description="Re-read gpuguard.toml and quotas.toml; a broken file is refused and "
                                               "the running config stays. Example: sudo gpuguard reload")
    reload.set_defaults(func=run_reload)

    drain = subparsers.add_parser(
        "drain", help=summary("drain"),
        description="Give these GPUs to nobody new (logins, requests and the queue skip them) until resumed; "
                    "their holders keep them and are told. Kept across restarts. "
                    "Example: sudo gpuguard drain 3 --reason 'ECC errors, RMA on Monday'")
    drain.add_argument("units", type=unit_arg, nargs="+", metavar="GPU", help="a GPU, as status shows it")
    drain.add_argument("--reason", default="", help="why, shown to holders and in status and whoami")
    drain.set_defaults(func=run_drain)

    hold = subparsers.add_parser(
        "hold", help=summary("hold"),
        description="A held request keeps its place in the queue but is not served, and holds no GPUs "
                    "free for itself, until released (like Slurm's scontrol hold). Kept across restarts. "
                    "Examples: sudo gpuguard hold bob; sudo gpuguard hold bob --off")
    hold.add_argument("user")
    hold.add_argument("--off", action="store_true", help="release the hold")
    hold.set_defaults(func=run_hold)

    resume = subparsers.add_parser("resume", help=summary("resume"),
                                   description="End a drain; the queue is served first. Example: sudo gpuguard resume 3")
    resume.add_argument("units", type=unit_arg, nargs="+", metavar="GPU")
    resume.set_defaults(func=run_resume)


def run_grant(args: argparse.Namespace) -> int:
    return _show(args, ask(args, "grant", user=args.user, gpus=args.gpus, units=args.units, **{"for": args.duration}))


def run_revoke(args: argparse.Namespace) -> int:
    return _show(args, ask(args, "revoke", user=args.user, units=args.units))


def run_reload(args: argparse.Namespace) -> int:
    print(f"gpuguard: {ask(args, 'reload')['message']}")
    return EXIT_OK


def run_drain(args: argparse.Namespace) -> int:
    print(ask(args, "drain", units=args.units, reason=args.reason or None)["message"])
    return EXIT_OK


def run_hold(args: argparse.Namespace) -> int:
    print(ask(args, "hold", user=args.user, off=args.off or None)["message"])
    return EXIT_OK


def run_resume(args: argparse.Namespace) -> int:
    print(ask(args, "resume", units=args.units)["message"])
    return EXIT_OK


def _show(args: argparse.Namespace, reply: dict[str, Any]) -> int:
    if args.json:
        print_json(reply)
    else:
        print(f"gpuguard: {reply['message']}")
    return EXIT_OK
