"""Whether local accounts may still log in with a password, from /etc/shadow.

The web view asks this for the users it has logins of (gpuguard.web.app, Web.sweep): an account
locked (`usermod -L`, `passwd -l`: the hash starts with "!") or expired (`usermod -e`, `chage -E`)
since its login must not keep its open pages. Read as the web's account, which the unit puts in
the shadow group for pam_unix anyway. Accounts without a line here (LDAP, SSSD) are not judged.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

SHADOW = Path("/etc/shadow")
DAY = 86400


def ended(users: Iterable[str], path: Path = SHADOW, now: float | None = None) -> dict[str, str]:
    """user -> why its password login has ended ("locked" or "expired"), for those of `users`
    it has; an unreadable file judges nobody (OSError is the caller's to log)."""
    wanted = set(users)
    today = int((time.time() if now is None else now) // DAY)
    reasons = {}
    for line in path.read_text(errors="replace").splitlines():
        fields = line.split(":")
        if len(fields) < 8 or fields[0] not in wanted:
            continue
        why = reason(fields[1], fields[7], today)
        if why is not None:
            reasons[fields[0]] = why
    return reasons


def reason(password: str, expire: str, today: int) -> str | None:
    """shadow(5): a hash starting with "!" is locked; the account expires on day `expire` since
    the epoch (empty: never), so from that day on it is expired."""
    if password.startswith("!"):
        return "locked"
    if expire.strip().isdigit() and today >= int(expire):
        return "expired"
    return None
