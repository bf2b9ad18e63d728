"""Where the daemon's sockets are, for its clients: the PAM hook and the users' commands.

The daemon has two doors. The users' socket (`paths.socket`, 0666: identity comes from
SO_PEERCRED) takes everyone's requests; root's door (`root_door`: the same name in a `root/`
directory beside it, mode 0700) takes only root's, so logins (the PAM module and the hook) and
admins' commands never queue behind another user's connections: a flood can fill the kernel's
listen queue of the users' socket, never that of root's.

Only `paths.socket` is read, not the config through gpuguard.config: full validation and the
quotas file cost every command tens of milliseconds, and a user's command must not depend on
the admin's files (an edit in progress, a typo in quotas.toml, a `chmod 600`): everything else a
client shows comes from the daemon. A plain `socket = "..."` line in [paths] is read by
plain_socket; tomllib (~7 ms to import, with typing) reads anything else. A config that cannot
be read, or says nothing usable, means the default socket.
"""
from __future__ import annotations

import os
import re

TYPE_CHECKING = False  # not typing's: it costs every login (pam_hook) a few ms
if TYPE_CHECKING:
    from collections.abc import Mapping

# The same defaults as gpuguard.config (a test keeps them equal), without importing it.
DEFAULT_CONFIG = "/etc/gpuguard/gpuguard.toml"
DEFAULT_SOCKET = "/run/gpuguard/gpuguard.sock"
ROOT_DIRECTORY = "root"  # pam_gpuguard.c names it too


def root_door(socket: str) -> str:
    """Root's socket for the users' socket path: /run/gpuguard/root/gpuguard.sock."""
    return os.path.join(os.path.dirname(socket), ROOT_DIRECTORY, os.path.basename(socket))


def find(config_path: str | None, environ: Mapping[str, str]) -> tuple[str, str | None]:
    """(the socket path, None) from the config named by config_path, $GPUGUARD_CONFIG or the
    default path; (DEFAULT_SOCKET, what was wrong) when that config does not say it usably."""
    path = config_path or environ.get("GPUGUARD_CONFIG") or DEFAULT_CONFIG
    try:
        with open(path, "rb") as file:
            text = file.read().decode()
        value = plain_socket(text)
        if value is UNSURE:
            from gpuguard.core.compat import tomllib  # tomli on Python 3.10
            value = tomllib.loads(text).get("paths", {}).get("socket", DEFAULT_SOCKET)
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:  # TOMLDecodeError is a ValueError
        return DEFAULT_SOCKET, f"cannot read {path} ({exc})"
    if not isinstance(value, str) or not value:
        return DEFAULT_SOCKET, f"{path}: paths.socket is not a path"
    return value, None


UNSURE = object()
_TABLE = re.compile(r"\[\s*([A-Za-z0-9_.\s-]+?)\s*\]\s*(?:#.*)?")
_PLAIN_SOCKET = re.compile(r"""socket\s*=\s*(?:"([^"\\\x00-\x1f]*)"|'([^'\x00-\x1f]*)')\s*(?:#.*)?""")
_ELSEWHERE = re.compile(r"^\s*(?:paths\s*[.=]|\[\s*\[|.*(?:\"\"\"|\'\'\'))", re.MULTILINE)


def plain_socket(text: str) -> object:
    """paths.socket when the file says it plainly: one `socket = "..."` (or '...') line without
    escapes in a [paths] table, no multi-line strings, arrays of tables or paths keys elsewhere.
    DEFAULT_SOCKET when such a file does not say it; UNSURE for anything else (tomllib decides)."""
    if _ELSEWHERE.search(text):
        return UNSURE
    table = ""
    for line in (raw.strip() for raw in text.splitlines()):
        if line.startswith("["):
            if not (header := _TABLE.fullmatch(line)):
                return UNSURE
            table = re.sub(r"\s+", "", header.group(1))
        elif table == "paths" and re.match(r"""["']?socket\b""", line):
            if not (plain := _PLAIN_SOCKET.fullmatch(line)):
                return UNSURE
            return plain.group(1) if plain.group(1) is not None else plain.group(2)
    return DEFAULT_SOCKET
