"""Server-side sessions, CSRF tokens and the login limit.

A login is kept by the server (`Sessions`), the browser's cookie holds only its random id: the
server ends a login by dropping it, whatever the browser kept. CSRF tokens are HMAC-SHA256 under
a key kept in a file only the web's account reads (made at the first start). A form that changes
anything (the login, the logout, an admin's ending of a user's logins) carries a token bound to
the browser: to a random cookie before login, to the login's id after it.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from gpuguard.core.errors import GpuguardError

KEY_BYTES = 32


class SessionKeyError(GpuguardError):
    """The key file cannot be read or made."""


def load_key(path: Path) -> bytes:
    """The signing key in `path`, made (random, mode 0600) when there is none."""
    try:
        key = path.read_bytes()
    except FileNotFoundError:
        key = secrets.token_bytes(KEY_BYTES)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:  # another start made it meanwhile: use theirs
            return load_key(path)
        except OSError as exc:
            raise SessionKeyError(f"cannot make the session key {path}: {exc.strerror}") from None
        with os.fdopen(fd, "wb") as handle:
            handle.write(key)
        return key
    except OSError as exc:
        raise SessionKeyError(f"cannot read the session key {path}: {exc.strerror}") from None
    if len(key) < KEY_BYTES:
        raise SessionKeyError(f"the session key {path} is too short ({len(key)} bytes; remove it to make a new one)")
    return key


@dataclass(frozen=True)
class Login:
    """One login, kept by the server: the cookie holds only its id."""

    id: str          # random; the logout form's CSRF token is bound to it
    user: str
    admin: bool      # in the admin group when it logged in: a change ends the login (Web.sweep)
    expires: float


class Sessions:
    """The logins, in memory: a cookie is a random id looked up here, so a login ends when it is
    dropped (logout, an admin, or the account's lock, expiry or removal from the group) and a
    restart of the web ends them all. At most `per_user` logins per user (a new one drops that
    user's oldest): only a correct password makes one, so one user cannot grow it past that."""

    def __init__(self, per_user: int = 16):
        self.per_user = per_user
        self._by_id: dict[str, Login] = {}

    def open(self, user: str, admin: bool, expires: float) -> Login:
        own = [login for login in self._by_id.values() if login.user == user]
        for old in own[:max(0, len(own) - self.per_user + 1)]:  # insertion order: the oldest first
            del self._by_id[old.id]
        login = Login(secrets.token_urlsafe(32), user, admin, expires)
        self._by_id[login.id] = login
        return login

    def get(self, cookie: str | None, now: float) -> Login | None:
        """The login a cookie names, or None: absent, unknown, ended or expired."""
        login = self._by_id.get(cookie) if cookie else None
        if login is not None and now >= login.expires:
            del self._by_id[login.id]
            return None
        return login

    def end(self, login_id: str) -> None:
        self._by_id.pop(login_id, None)

    def end_user(self, user: str) -> int:
        """End every login of `user`; how many there were."""
        ended = [key for key, login in self._by_id.items() if login.user == user]
        for key in ended:
            del self._by_id[key]
        return len(ended)

    def live(self) -> list[Login]:
        return list(self._by_id.values())


class Signer:
    def __init__(self, key: bytes):
        self._key = key

    def _mac(self, purpose: str, data: bytes) -> bytes:
        return hmac.new(self._key, purpose.encode() + b"\0" + data, hashlib.sha256).digest()

    def csrf(self, bound_to: str) -> str:
        """The CSRF token of a form, bound to a cookie value of the browser's."""
        return _b64(self._mac("csrf", bound_to.encode()))

    def csrf_ok(self, token: str | None, bound_to: str | None) -> bool:
        return bool(token and bound_to) and hmac.compare_digest(str(token), self.csrf(str(bound_to)))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class LoginLimit:
    """At most `per_user` failed logins per user name and `per_address` per client address within
    `window` seconds; memory bounded by `max_keys` (the oldest keys go first)."""

    def __init__(self, per_user: int = 5, per_address: int = 20, window: float = 300.0, max_keys: int = 10_000):
        self.limits = {"user": per_user, "address": per_address}
        self.window = window
        self.max_keys = max_keys
        self._failures: dict[tuple[str, str], deque[float]] = {}

    def allowed(self, user: str, address: str, now: float) -> bool:
        return all(len(self._recent((kind, key), now)) < self.limits[kind]
                   for kind, key in (("user", user), ("address", address)))

    def failed(self, user: str, address: str, now: float) -> None:
        for key in (("user", user), ("address", address)):
            times = self._recent(key, now)
            times.append(now)
            self._failures.pop(key, None)
            self._failures[key] = times  # newest last: the oldest keys are the first dropped
        while len(self._failures) > self.max_keys:
            self._failures.pop(next(iter(self._failures)))

    def _recent(self, key: tuple[str, str], now: float) -> deque[float]:
        times = self._failures.get(key, deque())
        while times and now - times[0] >= self.window:
            times.popleft()
        return times
