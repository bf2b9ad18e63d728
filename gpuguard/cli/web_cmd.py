"""`gpuguard web`: the read-only web view ([web] in gpuguard.toml; etc/gpuguard-web.service)."""
from __future__ import annotations

import argparse
import logging
import os

from gpuguard import logs
from gpuguard.cli import CommandError, load_config, summary
from gpuguard.core.errors import EXIT_OK, EXIT_USAGE


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "web", help=summary("web"),
        description="Serve the web view on [web] listen (off unless set). Runs as its own account "
                    "([web] user), not root. Example: gpuguard web --listen 127.0.0.1:9448 (as [web] user)")
    parser.add_argument("--listen", metavar="ADDRESS:PORT", help="serve here instead of [web] listen")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpuguard.config import parse_listen
    config = load_config(args)
    try:
        listen = parse_listen(args.listen) if args.listen else config.web.listen
    except ValueError as exc:
        raise CommandError(f"--listen: {exc}", EXIT_USAGE) from None
    if listen is None:
        raise CommandError('the web view is off: set [web] listen (e.g. "127.0.0.1:9448") or give --listen',
                           EXIT_USAGE)
    if os.geteuid() == 0:
        raise CommandError(f"gpuguard web does not run as root: run it as {config.web.user} "
                           f"(sudo -u {config.web.user} gpuguard web; the package's gpuguard-web.service does)")
    logs.setup(logging.INFO)
    from gpuguard.web import wiring
    from gpuguard.web.sessions import SessionKeyError
    try:
        wiring.run(config, *listen)
    except (SessionKeyError, OSError) as exc:
        raise CommandError(f"cannot start: {getattr(exc, 'strerror', None) or exc}") from None
    return EXIT_OK
