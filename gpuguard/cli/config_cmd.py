"""`gpuguard config check [PATH]`: exactly the validation the daemon runs at start and reload."""
from __future__ import annotations

import argparse

from gpuguard import config


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("config", help="check configuration files")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser("check", help="validate a config file and its quotas file")
    check.add_argument("path", nargs="?", help="file to check (default: the active config)")
    check.set_defaults(func=check_config)


def check_config(args: argparse.Namespace) -> int:
    loaded = config.load(args.path or args.config)
    print(f"{loaded.source}: ok ({len(loaded.quotas.users)} user and "
          f"{len(loaded.quotas.groups)} group quotas from {loaded.paths.quotas})")
    return 0
