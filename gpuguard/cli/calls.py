"""What the user and admin commands share: asking the daemon.

The socket is found from the config's `socket =` line only (daemon_socket): what a command shows
comes from the daemon, so the admin's files (half-edited, or readable by root only) never stop
a user's command."""
from __future__ import annotations

import os

from gpuguard import client, daemon_socket

TYPE_CHECKING = False  # not typing's: whoami and status start in a few ms more than python itself
if TYPE_CHECKING:
    import argparse
    from pathlib import Path
    from typing import Any

TIMEOUT = 30.0  # revoke and release scan /proc for holders; status of a busy server is large


def socket_of(args: argparse.Namespace) -> tuple[str, str | None]:
    """The daemon's socket, and what was wrong with the config when it did not say (see ask)."""
    return daemon_socket.find(args.config, os.environ)


def ask(args: argparse.Namespace, op: str, **fields: Any) -> dict[str, Any]:
    """One request to the daemon on the configured socket; the reply's fields without the envelope."""
    socket, problem = socket_of(args)
    try:
        reply = client.call(socket, op, timeout=TIMEOUT, **{k: v for k, v in fields.items() if v is not None})
    except client.DaemonUnreachable as exc:
        if problem:  # the default socket was tried for lack of a better one: say why
            raise client.DaemonUnreachable(f"{exc} (the default socket: {problem})") from None
        raise
    return {key: value for key, value in reply.items() if key not in ("v", "ok")}


def held_path(args: argparse.Namespace) -> Path:
    """The caller's held-devices file (backends.visible_devices), beside the configured socket."""
    from pathlib import Path  # only once no daemon answered: whoami and env start without it

    from gpuguard.backends.visible_devices import directory_for
    return directory_for(Path(socket_of(args)[0])) / str(os.getuid())


def held_devices(args: argparse.Namespace) -> list[str] | None:
    """What the held-devices file says the caller holds (None: no file), read without the daemon."""
    from gpuguard.backends.visible_devices import held
    path = held_path(args)
    return held(path.parent, int(path.name))
