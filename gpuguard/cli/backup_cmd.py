"""`gpuguard backup FILE` and `gpuguard restore FILE`: the daemon's state into one file and back
(the file and what it holds: gpuguard.services.backup)."""
from __future__ import annotations

import argparse
import errno
import socket
import time
from pathlib import Path

from gpuguard.cli import CommandError, load_config, require_root, summary
from gpuguard.core.errors import EXIT_FAILED, EXIT_OK


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    backup = subparsers.add_parser(
        "backup", help=summary("backup"),
        description="Write the state (the grants, the queue, sessions, usage and events in state.db, with the "
                    "drains and held requests) into FILE, a tar.gz, replaced whole if it exists. The daemon "
                    "goes on serving: SQLite's online backup copies one consistent snapshot. "
                    "Example: sudo gpuguard backup /root/gpuguard-$(date +%F).tar.gz")
    backup.add_argument("file", metavar="FILE", help="the backup to write")
    backup.set_defaults(func=run_backup)

    restore = subparsers.add_parser(
        "restore", help=summary("restore"),
        description="Check FILE whole, then replace state.db, the drains and the held requests by its copies. "
                    "Refused, changing nothing, while the daemon runs or for a backup from a newer gpuguard "
                    "(exit 1), and for a file that is no gpuguard backup or is damaged (exit 2). "
                    "Example: sudo systemctl stop gpuguard; sudo gpuguard restore /root/gpuguard-2026-12-06.tar.gz; "
                    "sudo systemctl start gpuguard")
    restore.add_argument("file", metavar="FILE", help="a file `gpuguard backup` wrote")
    restore.set_defaults(func=run_restore)


def run_backup(args: argparse.Namespace) -> int:
    from gpuguard import __version__
    from gpuguard.services import backup
    require_root("backup")
    state_dir = load_config(args).paths.state_dir
    manifest = backup.write(state_dir, Path(args.file), __version__)
    print(f"gpuguard: backed up {state_dir} (schema {manifest.schema}: {', '.join(manifest.files)}) to {args.file}")
    return EXIT_OK


def run_restore(args: argparse.Namespace) -> int:
    from gpuguard.services import backup
    require_root("restore")
    paths = load_config(args).paths
    if _answers(paths.socket):
        raise CommandError(f"the gpuguard daemon is running (it answers on {paths.socket}): stop it first "
                           "(systemctl stop gpuguard), restore, then start it", EXIT_FAILED)
    manifest = backup.restore(Path(args.file), paths.state_dir)
    made = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(manifest.created))
    print(f"gpuguard: restored {paths.state_dir} from {args.file} (made {made} on {manifest.host} by gpuguard "
          f"{manifest.gpuguard}, schema {manifest.schema}); start the daemon")
    return EXIT_OK


def _answers(path: Path) -> bool:
    """Whether a daemon listens on the socket, as a starting daemon asks it (Server.claim)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return False
            raise CommandError(f"cannot tell whether the daemon runs: {path}: {exc.strerror}", EXIT_FAILED) from None
    return True
