"""`gpuguard prefs`: a user's own settings, kept in their home and read by their login shells.

One so far, `request-without-terminal`. By default only a session with a terminal takes GPUs at
login (policy.login_takes_gpus): PAM cannot tell `ssh host cmd` from scp, sftp or rsync. Set, a
login shell of an SSH session without a terminal asks for GPUs when the user holds none
(etc/profile.d/gpuguard.sh and its fish twin): `ssh -T host`, and VS Code Remote-SSH's server,
which reads its environment from a login shell, so its terminals, notebooks and debuggers see
the GPUs. scp, sftp, rsync and `ssh host cmd` run no login shell, so they still take none. A
setting is a file in the user's config directory, so that the shell snippets read it with one
test and ask no daemon.
"""
from __future__ import annotations

import os
from pathlib import Path

from gpuguard.cli import CommandError, summary
from gpuguard.core.errors import EXIT_FAILED

TYPE_CHECKING = False  # not typing's: the CLI's start-up imports no more than a command needs
if TYPE_CHECKING:
    import argparse

# Each setting and what it does, as `gpuguard prefs` lists them.
PREFS = {
    "request-without-terminal": "a login shell over SSH without a terminal (VS Code Remote-SSH, ssh -T) asks for "
                                "GPUs when you hold none",
}
VALUES = ("on", "off")


def prefs_dir() -> Path:
    """Where the settings are: $XDG_CONFIG_HOME/gpuguard, or ~/.config/gpuguard (the snippets' path)."""
    configured = os.environ.get("XDG_CONFIG_HOME", "")
    return (Path(configured) if os.path.isabs(configured) else Path.home() / ".config") / "gpuguard"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    prefs = subparsers.add_parser(
        "prefs", help=summary("prefs"),
        description="Show your settings, or change one. request-without-terminal on: a login shell over SSH "
                    "without a terminal (VS Code Remote-SSH's server, ssh -T host) asks for GPUs when you hold "
                    "none, so VS Code's terminals and notebooks see them; scp, sftp and rsync still take none. "
                    "Example: gpuguard prefs set request-without-terminal on")
    actions = prefs.add_subparsers(dest="action", metavar="ACTION")
    show = actions.add_parser("show", help="list the settings and their values (the default)",
                              description="List your settings, each with its value and what it does. "
                                          "Example: gpuguard prefs show")
    show.set_defaults(func=show_prefs)
    change = actions.add_parser("set", help="change a setting: gpuguard prefs set KEY on|off",
                                description="Turn a setting on or off. "
                                            "Example: gpuguard prefs set request-without-terminal on")
    change.add_argument("key", choices=sorted(PREFS), metavar="KEY", help=", ".join(sorted(PREFS)))
    change.add_argument("value", choices=VALUES, metavar="on|off")
    change.set_defaults(func=set_pref)
    prefs.set_defaults(func=show_prefs)


def show_prefs(args: argparse.Namespace) -> int:
    folder = prefs_dir()
    for key, meaning in PREFS.items():
        print(f"{key} = {'on' if (folder / key).exists() else 'off'}    ({meaning})")
    return 0


def set_pref(args: argparse.Namespace) -> int:
    path = prefs_dir() / args.key
    try:
        if args.value == "on":
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            path.touch()
        else:
            path.unlink(missing_ok=True)
    except OSError as exc:
        raise CommandError(f"prefs: cannot change {path}: {exc.strerror}", EXIT_FAILED) from None
    print(f"{args.key} = {args.value}")
    return 0
