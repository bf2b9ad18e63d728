"""The web view's password check, as root, one short process per login (gpuguard-web-login@.service).

`gpuguard web` runs as its own account with no capability and without the shadow group: what parses
the network must not be able to read every password hash. Then pam_unix cannot check another
user's password in its process: its setgid-shadow helper unix_chkpwd checks only the caller's own
password (pam_unix says "cannot retrieve authentication info" for anyone else), and under the unit's
NoNewPrivileges= (which its seccomp options imply anyway) the setgid bit does nothing, so not even
that. So the web asks this helper, over the socket that gpuguard-web-login.socket listens on
(LOGIN_SOCKET; systemd hands each accepted connection to a new process, as its stdin), whenever it
cannot read /etc/shadow itself (gpuguard.web.wiring). The sweep's question, which of its logged-in
users are locked or expired in /etc/shadow (backends/shadow.py), comes here for the same reason.

One request per connection, one line of JSON of at most MAX_REQUEST bytes, one line of answer:
{"op": "login", "user", "password", "client"} (client: PAM_RHOST) is answered "ok" or "no";
{"op": "ended", "users": [...]} a JSON object, user -> "locked" or "expired". Only the account of
`[web] user` may ask (the peer's uid, SO_PEERCRED): anyone else gets "no" without a PAM
conversation. The PAM service is `[web] pam_service`, authentication and account checks, as in
the web's own process; pam_unix's delay on a failure holds the connection, and the socket's
MaxConnections= bounds how many run at once.
"""
from __future__ import annotations

import json
import logging
import pwd
import socket
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuguard import config as configuration
from gpuguard.backends import shadow
from gpuguard.logs import event

LOGIN_SOCKET = Path("/run/gpuguard-web-login.sock")
MAX_REQUEST = 8192
TIMEOUT = 30.0  # pam_unix waits 2 s after a failure; MaxConnections= may queue a few


class HelperUnavailable(OSError):
    """The helper's socket is not there or did not answer (gpuguard-web-login.socket not running)."""


def _call(request: dict[str, Any], path: Path) -> bytes:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(TIMEOUT)
            connection.connect(str(path))
            connection.sendall(json.dumps(request).encode() + b"\n")
            reply = b""
            while chunk := connection.recv(65536):
                reply += chunk
    except OSError as exc:
        raise HelperUnavailable(f"{path}: {exc.strerror or exc}") from exc
    return reply


def ask(user: str, password: str, client: str, path: Path = LOGIN_SOCKET) -> bool:
    """The web's side: whether the helper's PAM accepts `user` with `password` from `client`."""
    try:
        return _call({"op": "login", "user": user, "password": password, "client": client}, path) == b"ok\n"
    except HelperUnavailable as exc:
        event(logging.ERROR, "web_login_helper_unavailable", error=str(exc),
              fix="systemctl enable --now gpuguard-web-login.socket")
        return False


def ended(users: Sequence[str], path: Path = LOGIN_SOCKET) -> dict[str, str]:
    """The web's side of shadow.ended: which of `users` are locked or expired (OSError: no answer)."""
    reply = _call({"op": "ended", "users": list(users)}, path)
    try:
        found = json.loads(reply)
    except ValueError as exc:
        raise HelperUnavailable(f"{path}: refused") from exc
    if not isinstance(found, dict):
        raise HelperUnavailable(f"{path}: refused")
    return {str(user): str(why) for user, why in found.items()}


def peer_uid(connection: socket.socket) -> int:
    _pid, uid, _gid = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                struct.calcsize("3i")))
    return int(uid)


def read_request(connection: socket.socket) -> dict[str, Any] | None:
    data = b""
    while b"\n" not in data and len(data) <= MAX_REQUEST:
        chunk = connection.recv(4096)
        if not chunk:
            break
        data += chunk
    try:
        request = json.loads(data.split(b"\n", 1)[0])
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    if request.get("op") == "login" and all(isinstance(request.get(k), str) for k in ("user", "password", "client")):
        return request
    if request.get("op") == "ended" and isinstance(request.get("users"), list) and all(
            isinstance(user, str) for user in request["users"]):
        return request
    return None


def answer(connection: socket.socket, settings: configuration.WebConfig) -> bytes:
    """The answer to the request on `connection`: "no" unless it is the web's."""
    from gpuguard.web.wiring import in_process_authenticate
    uid = peer_uid(connection)
    try:
        allowed = pwd.getpwnam(settings.user).pw_uid
    except KeyError:
        allowed = None
    if uid != allowed:
        event(logging.WARNING, "web_login_helper_refused", uid=uid, why=f"not [web] user {settings.user}")
        return b"no\n"
    request = read_request(connection)
    if request is None:
        event(logging.WARNING, "web_login_helper_refused", uid=uid, why="malformed request")
        return b"no\n"
    if request["op"] == "ended":
        return json.dumps(shadow.ended(request["users"])).encode() + b"\n"
    accepted = in_process_authenticate(settings.pam_service)(request["user"], request["password"], request["client"])
    return b"ok\n" if accepted else b"no\n"


def main() -> int:
    from gpuguard import logs
    logs.setup(logging.INFO)
    settings = configuration.load().web
    connection = socket.socket(fileno=sys.stdin.fileno())
    try:
        connection.sendall(answer(connection, settings))
    finally:
        connection.detach()
    return 0


if __name__ == "__main__":
    sys.exit(main())
