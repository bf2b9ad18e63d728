"""`gpuguard config check [PATH]`: exactly the validation the daemon runs at start and reload,
then warnings (exit 0) for what loads but likely is not meant (gpuguard/core/config_warnings.py), and who
owns which GPU beside Slurm and Kubernetes (gpuguard/core/coexist.py; undecided on a Slurm node: exit 6)."""
from __future__ import annotations

import argparse
import sys

from gpuguard import config
from gpuguard.backends import accounts, driver_minors, slurm
from gpuguard.cli import summary
from gpuguard.core import config_warnings


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("config", help=summary("config"))
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check", help="validate a config file and its quotas file",
        description="Load a config file and its quotas file exactly as the daemon does: errors exit 2, warnings "
                    "(a missing group, sharing without gpu_memory, ...) exit 0. "
                    "Examples: sudo gpuguard config check; gpuguard config check ./gpuguard.toml")
    check.add_argument("path", nargs="?", help="file to check (default: the active config)")
    check.set_defaults(func=check_config)


def check_config(args: argparse.Namespace) -> int:
    loaded = config.load(args.path or args.config)
    for line in config_warnings.warnings(loaded, accounts.user_exists, accounts.group_exists):
        print(f"gpuguard: warning: {line}", file=sys.stderr)
    # What the daemon would decide at start on this host: a Slurm node nobody decided about exits 6 here too.
    ownership = slurm.ownership(loaded.coexist, driver_minors(loaded))
    print(f"{loaded.source}: ok ({len(loaded.quotas.users)} user and "
          f"{len(loaded.quotas.groups)} group quotas from {loaded.paths.quotas})")
    if ownership.foreign:
        print(f"coexist: {ownership.summary()}")
    return 0
