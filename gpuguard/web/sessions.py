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
import itertools
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

    def device(self, user: str) -> str:
        """The device cookie of `user` (OWASP's defence against lockout): set at a login that
        succeeded, it tells a later login of that name from that browser, which no flood can
        forge, from the rest (slots.LoginSlots' trusted)."""
        return _b64(self._mac("device", user.encode()))

    def device_ok(self, cookie: str | None, user: str) -> bool:
        return bool(cookie) and hmac.compare_digest(str(cookie), self.device(user))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


OVERFLOW = ""  # the shared record of a client's names past its bound


@dataclass
class Failures:
    count: int
    last: float
    until: float  # no PAM conversation for this (user, client) before


class LoginDelay:
    """Failed logins counted per (user name, client): after `free` failures each further one
    makes that pair wait `base` seconds, doubled at each failure up to `most`; forgotten `forget`
    seconds after its last failure, and at a success. No lock anyone could trigger for another:
    alice's failures from one client do not delay alice from another, nor bob from it. The client
    is what the caller names (the web: the exact address; not its IPv6 /64, which on a campus or
    office LAN is hundreds of hosts: one host's failures as bob would delay bob on all of them).

    State is bounded: at most `per_user` clients per name, `per_client` names per client and
    `total` pairs in all. Past a name's bound, or the total, the record whose last failure is the
    oldest gives way: an attacker's failures from many addresses never delay the name from
    another address (a shared record would: the named user locked out from everywhere), and the
    guessing they buy is bounded by the PAM conversations at once (slots.LoginSlots), not here.
    Past a client's bound its further names share one record of that client's, so a flood of
    made-up names from one client delays that client only.

    Each client's failures across all names are counted too (`standing`, forgotten alike), under
    `standing_of(client)` (the web: slots.client_key, an IPv6 /64 as one, so that one host's
    2^64 addresses are not 2^64 fresh standings): the order in which waiting logins get a PAM
    conversation, never a delay of its own (a lock one user behind a shared address could set
    off for the others)."""

    def __init__(self, free: int = 3, base: float = 1.0, most: float = 300.0, forget: float = 900.0,
                 per_user: int = 64, per_client: int = 64, total: int = 10_000,
                 standing_of: Callable[[str], str] = str):
        self.free, self.base, self.most, self.forget = free, base, most, forget
        self.standing_of = standing_of
        self.per_user, self.per_client, self.total = per_user, per_client, total
        self._kept: dict[tuple[str, str], Failures] = {}  # in the order of their last failure
        self._by_user: dict[str, dict[str, None]] = {}    # a name's clients, alike
        self._clients: dict[str, int] = {}                # how many names each client has kept
        self._standing: dict[str, Failures] = {}          # a client's failures, all names; alike

    def wait(self, user: str, client: str, now: float) -> float:
        """Seconds until this name may be tried from this client (0: now)."""
        record = self._fresh(self._kept, self._key(user, client), now)
        return max(0.0, record.until - now) if record else 0.0

    def failed(self, user: str, client: str, now: float) -> Failures:
        self._count(self.standing_of(client), now)
        key = self._key(user, client)
        record = self._fresh(self._kept, key, now)
        if record is None:
            self._make_room(key, now)
            record = Failures(0, now, now)
            self._clients[key[1]] = self._clients.get(key[1], 0) + 1
        self._kept.pop(key, None)
        self._kept[key] = record  # the newest last
        if key[0] != OVERFLOW:
            clients = self._by_user.setdefault(key[0], {})
            clients.pop(key[1], None)
            clients[key[1]] = None
        record.count += 1
        record.last = now
        over = record.count - self.free
        record.until = now + (min(self.most, self.base * 2 ** (over - 1)) if over > 0 else 0.0)
        return record

    def succeeded(self, user: str, client: str) -> None:
        if (user, client) in self._kept:
            self._drop((user, client))

    def standing(self, client: str, now: float) -> int:
        """The failures of the client's standing_of, every name's, in the last `forget` seconds."""
        record = self._fresh(self._standing, self.standing_of(client), now)
        return record.count if record else 0

    def __len__(self) -> int:
        return len(self._kept)

    def _key(self, user: str, client: str) -> tuple[str, str]:
        if (user, client) in self._kept or self._clients.get(client, 0) < self.per_client:
            return user, client
        return OVERFLOW, client

    def _count(self, client: str, now: float) -> None:
        record = self._fresh(self._standing, client, now) or Failures(0, now, now)
        self._standing.pop(client, None)
        self._expire(self._standing, now)
        if len(self._standing) >= self.total:
            del self._standing[next(iter(self._standing))]
        record.count += 1
        record.last = record.until = now
        self._standing[client] = record

    def _make_room(self, key: tuple[str, str], now: float) -> None:
        """Room for a new record of `key`: the oldest of its name's past `per_user`, the oldest
        of all past `total` (the forgotten first)."""
        clients = self._by_user.get(key[0], {})
        if key[0] != OVERFLOW and len(clients) >= self.per_user:
            self._drop((key[0], next(iter(clients))))
        self._expire(self._kept, now)
        if len(self._kept) >= self.total:
            self._drop(next(iter(self._kept)))

    def _expire(self, table: dict[Any, Failures], now: float) -> None:
        """Forget the records at the front of `table` (the oldest first) that are `forget` old."""
        for key in list(itertools.takewhile(lambda key: now - table[key].last >= self.forget, table)):
            self._forget(table, key)

    def _fresh(self, table: dict[Any, Failures], key: Any, now: float) -> Failures | None:
        """The record of `key`, None (and forgotten) when its last failure is `forget` old."""
        record = table.get(key)
        if record is not None and now - record.last >= self.forget:
            self._forget(table, key)
            return None
        return record

    def _forget(self, table: dict[Any, Failures], key: Any) -> None:
        if table is self._kept:
            self._drop(key)
        else:
            del table[key]

    def _drop(self, key: tuple[str, str]) -> None:
        del self._kept[key]
        clients = self._by_user.get(key[0])
        if clients is not None:
            del clients[key[1]]
            if not clients:
                del self._by_user[key[0]]
        self._clients[key[1]] -= 1
        if not self._clients[key[1]]:
            del self._clients[key[1]]
