"""`gpuguard daemon`: the root agent, in the foreground (systemd Type=notify; see etc/gpuguard.service)."""
from __future__ import annotations

import argparse
import logging
import os

from gpuguard import logs
from gpuguard.cli import CommandError, load_config, summary
from gpuguard.core.errors import EXIT_OK


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("daemon", help=summary("daemon"),
                                   description="Hand out GPUs at login and enforce them. Logs go to stderr. Run by "
                                               "systemd (gpuguard.service); by hand for a trial: "
                                               "Example: sudo gpuguard --config ./gpuguard.toml daemon")
    parser.add_argument("--gate-name", default="gpuguard", metavar="NAME",
                        help="instance name of the BPF gate (default gpuguard; tests run gates of their own)")
    parser.add_argument("--debug", action="store_true", help="log debug events too")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        raise CommandError("the daemon runs as root: it attaches the gate and writes device ACLs")
    config = load_config(args)
    logs.setup(logging.DEBUG if args.debug else logging.INFO)
    # The daemon's imports (asyncio, pyroute2, pynvml, the gate) only for this command: every
    # other command, the pam_exec hook above all, starts faster without them.
    from gpuguard.backends import GateError, GpuError
    from gpuguard.daemon import main
    from gpuguard.daemon.server import ServerError
    from gpuguard.services.store import StoreError

    try:
        main.run(config, args.gate_name)
    except (GateError, GpuError, StoreError, ServerError, OSError) as exc:
        raise CommandError(f"cannot start: {exc}") from None
    return EXIT_OK
