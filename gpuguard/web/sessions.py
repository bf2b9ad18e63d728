"""Signed cookie sessions, CSRF tokens and the login rate limit.

A session is the user's name and its expiry, signed with HMAC-SHA256 under a key kept in a file
only the web's account reads (made at the first start): a browser can read its cookie but not
forge or extend one. Every signature has its own purpose in what is signed ("session", "csrf"),
so one kind of token never passes for another. A form that changes anything (the login, the
logout) carries a CSRF token bound to the browser: to a random cookie before login, to the
session after it.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from gpuguard.core.errors import GpuguardError

KEY_BYTES = 32
MAX_COOKIE = 1024  # a session cookie is about 150 bytes; anything far longer is not ours


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
    user: str
    expires: float
    nonce: str  # random per login: the logout form's CSRF token is bound to it


class Signer:
    def __init__(self, key: bytes):
        self._key = key

    def _mac(self, purpose: str, data: bytes) -> bytes:
        return hmac.new(self._key, purpose.encode() + b"\0" + data, hashlib.sha256).digest()

    def session(self, user: str, expires: float) -> str:
        """The cookie value of a login of `user` until `expires` (epoch seconds)."""
        body = json.dumps({"u": user, "e": expires, "n": secrets.token_urlsafe(12)}, separators=(",", ":")).encode()
        return _b64(body) + "." + _b64(self._mac("session", body))

    def login(self, cookie: str | None, now: float) -> Login | None:
        """The login a cookie holds, or None: absent, malformed, forged or expired."""
        if not cookie or len(cookie) > MAX_COOKIE or cookie.count(".") != 1:
            return None
        body_text, mac_text = cookie.split(".")
        try:
            body, mac = _unb64(body_text), _unb64(mac_text)
        except ValueError:
            return None
        if not hmac.compare_digest(mac, self._mac("session", body)):
            return None
        try:
            data = json.loads(body)
            login = Login(str(data["u"]), float(data["e"]), str(data["n"]))
        except (ValueError, KeyError, TypeError):
            return None
        return login if now < login.expires else None

    def csrf(self, bound_to: str) -> str:
        """The CSRF token of a form, bound to a cookie value of the browser's."""
        return _b64(self._mac("csrf", bound_to.encode()))

    def csrf_ok(self, token: str | None, bound_to: str | None) -> bool:
        return bool(token and bound_to) and hmac.compare_digest(str(token), self.csrf(str(bound_to)))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError) as exc:
        raise ValueError(str(exc)) from None


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
