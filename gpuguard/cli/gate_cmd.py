"""`gpuguard gate status|attach|detach` and `gpuguard acl apply`: the kernel side, by hand.

The daemon attaches the gate and keeps the nodes right by itself; these are for checking,
for emergencies and uninstall, and for udev when the driver loads.
"""
from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from gpuguard import client
from gpuguard import config as configuration
from gpuguard.backends import accounts, devnodes, slurm
from gpuguard.cli import CommandError, load_config, print_json, require_root, summary
from gpuguard.core.errors import EXIT_OK, UnknownUser

if TYPE_CHECKING:
    from gpuguard.backends.gate import Gate


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gate = subparsers.add_parser("gate", help=summary("gate"))
    actions = gate.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, func, text in (
            ("status", gate_status, "is the gate attached, and who may open which GPU"),
            ("attach", gate_attach, "attach the gate (closes every GPU to all but exempt users)"),
            ("detach", gate_detach, "detach the gate: every user may open every GPU again")):
        action = actions.add_parser(name, help=text, description=f"{text[0].upper()}{text[1:]}. "
                                                                  f"Example: sudo gpuguard gate {name}")
        action.add_argument("--name", default="gpuguard", help=argparse.SUPPRESS)  # tests run gates of their own
        action.set_defaults(func=func)
    actions.choices["status"].add_argument("--json", action="store_true", help="print JSON")

    acl = subparsers.add_parser("acl", help=summary("acl"))
    acl_actions = acl.add_subparsers(dest="action", metavar="ACTION", required=True)
    acl_actions.add_parser("apply", help="have the daemon create missing driver nodes and re-apply ACLs",
                           description="Have the daemon create missing driver nodes and re-apply their ACLs (the "
                                       "udev rule runs it when the driver loads). Example: sudo gpuguard acl apply") \
        .set_defaults(func=acl_apply)


def _gate(args: argparse.Namespace, loaded: configuration.Config | None, strict: bool = True) -> Gate:
    """The gate over the device ranges of the config's GPUs (MIG capabilities included), less those
    Slurm or Kubernetes own (gpuguard.core.coexist: raises CoexistError when undecided, unless not
    strict); with no config, those of the loaded driver: an emergency must not wait for a config."""
    from gpuguard.backends import driver_minors, open_gate  # ctypes and the assembler: only for these commands
    from gpuguard.backends.gate import Gate
    from gpuguard.core.coexist import CoexistError, Ownership
    if loaded is None:
        return Gate(args.name)
    try:
        ownership = slurm.ownership(loaded.coexist, driver_minors(loaded), ask_scontrol=False)
    except CoexistError as exc:
        if strict:
            raise
        ownership = Ownership()
        print(f"gpuguard: {exc.line()}; judging the gate as if every GPU were gpuguard's", file=sys.stderr)
    return open_gate(loaded, args.name, ownership)


def gate_status(args: argparse.Namespace) -> int:
    require_root("gate status")
    try:
        loaded = load_config(args)
    except configuration.ConfigError as exc:
        loaded = None  # the ranges of the driver loaded: what a real server's config says too
        print(f"gpuguard: {exc}; judging the gate by the loaded driver's device ranges", file=sys.stderr)
    status = _gate(args, loaded, strict=False).status()
    if args.json:
        print_json(status)
        return EXIT_OK
    if not status["attached"]:
        print(f"gate {status['name']}: NOT attached (cgroup {status['cgroup']}): GPU nodes are not enforced by the kernel")
        return 1
    print(f"gate {status['name']}: attached to {status['cgroup']} as program {status['prog_id']}, "
          f"{status['entries']} entries, exempt uids {', '.join(map(str, status['exempt']))}")
    for uid, devices in sorted(status["users"].items(), key=lambda item: int(item[0])):
        print(f"  {_user_name(int(uid))}: {' '.join(devices)}")
    for problem in status["problems"]:  # the daemon repairs these within a few ticks; so does `gate attach`
        print(f"  problem: {problem}")
    return 1 if status["problems"] else EXIT_OK


def gate_attach(args: argparse.Namespace) -> int:
    require_root("gate attach")
    loaded = load_config(args)
    gate = _gate(args, loaded)
    gate.attach(accounts.exempt_uids(loaded.access))
    print(f"gate {args.name}: attached as program {gate.prog_id()}; start the daemon to restore grants")
    return EXIT_OK


def gate_detach(args: argparse.Namespace) -> int:
    require_root("gate detach")
    gate = _gate(args, None)
    if not gate.find():
        raise CommandError(f"gate {args.name}: not attached")
    gate.detach()
    print(f"gate {args.name}: detached: GPU nodes are now open to whoever their file permissions allow")
    return EXIT_OK


def acl_apply(args: argparse.Namespace) -> int:
    """Run by udev when the driver or one of its modules loads, or a GPU binds."""
    require_root("acl apply")
    loaded: configuration.Config | None = None
    try:
        loaded = load_config(args)
        paths = loaded.paths
    except configuration.ConfigError as exc:
        # A config in the middle of an edit must not leave new nodes unmade: the paths are
        # nearly always the defaults, and the daemon needs no config for this.
        paths = configuration.PathsConfig()
        print(f"gpuguard: {exc}; using the default paths", file=sys.stderr)
    try:
        print(client.call(str(paths.socket), "sync_nodes", timeout=10)["message"])
    except client.DaemonUnreachable:
        # NVML needs these nodes to start, and nothing else makes them (etc/modprobe.d/gpuguard.conf).
        # GPU nodes come out 0660 root:root: making them opens no GPU to anyone. Those of Slurm's or
        # Kubernetes' GPUs (coexist) come out 0666, as the driver makes them, so their jobs still start.
        minors = devnodes.driver_minors()
        made = devnodes.ensure_driver_nodes(paths.device_dir, minors, foreign=_foreign(loaded, minors))
        if made:
            print(f"created {', '.join(str(path) for path in made)}")
        print("gpuguard daemon not running: GPU nodes stay closed (0660 root:root) until it starts")
    return EXIT_OK


def _foreign(loaded: configuration.Config | None, minors: list[int]) -> frozenset[int]:
    """The GPUs Slurm or Kubernetes own; none (their nodes closed: fail closed) when that cannot be told."""
    from gpuguard.core.coexist import CoexistError
    if loaded is None:
        return frozenset()
    try:
        return frozenset(slurm.ownership(loaded.coexist, minors, ask_scontrol=False).foreign)
    except CoexistError as exc:
        print(f"gpuguard: {exc.line()}; every GPU node made 0660 root:root", file=sys.stderr)
        return frozenset()


def _user_name(uid: int) -> str:
    try:
        return f"{accounts.by_uid(uid).name} ({uid})"
    except UnknownUser:
        return str(uid)
