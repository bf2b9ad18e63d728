"""`gpuguard pam-hook`: the pam_exec fallback (see gpuguard.pam_hook and pam/README)."""
from __future__ import annotations

import argparse

from gpuguard import pam_hook


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "pam-hook", help="pam_exec session hook (fallback for pam_gpuguard.so; always exits 0)",
        description="Run by pam_exec in a PAM session stack: asks the daemon for the user's GPUs at "
                    "open_session and releases them at close_session. Cannot set CUDA_VISIBLE_DEVICES.")
    # Accept --config after the command too (`gpuguard pam-hook --config PATH`), as PAM lines read best.
    parser.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS,
                        help="config file (same as gpuguard --config)")
    pam_hook.add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return pam_hook.run(config_path=args.config, socket=args.socket, quiet=args.quiet)
