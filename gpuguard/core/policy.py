"""Who gets GPUs and on what terms: pure decisions over names, no lookups.

The caller resolves a user's groups (backends.accounts) and passes names in, so these
rules run in unit tests and in simulation exactly as in the daemon.
"""
from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import fields, replace
from typing import Any

from gpuguard.config import AccessConfig, Config, SessionsConfig
from gpuguard.core.compat import StrEnum
from gpuguard.core.model import Origin, Quota

ROOT_UID = 0


def is_exempt(uid: int, user: str, groups: Collection[str], access: AccessConfig) -> bool:
    """Exempt accounts pass the gate unconditionally and never need (or get) a grant."""
    return uid == ROOT_UID or user in access.exempt_users or any(g in access.exempt_groups for g in groups)


# PAM_TTY of a session with a terminal: a device path (su, login, sshd with a pty: /dev/pts/3) or
# a bare line name (tty1, pts/3). sshd without a pty says "ssh", cron "cron", most services nothing.
_TERMINAL = re.compile(r"(/dev/)?(tty|pts/|console)\S*")
LOGIN_GRANTS = ("auto", "always", "never")  # what a PAM stack may ask for (the module's grant= option)


def login_takes_gpus(service: str, tty: str, asked: str, sessions: SessionsConfig) -> bool:
    """Whether opening this session may give the user GPUs. A session that does not (scp, sftp,
    rsync, `ssh host cmd`, VS Code's server) still gets the GPUs the user holds already."""
    if asked != "auto":
        return asked == "always"
    return sessions.grant == "all" or service in sessions.services or bool(_TERMINAL.fullmatch(tty))


def is_member(groups: Collection[str], access: AccessConfig) -> bool:
    """Only members of access.group are ever given GPUs."""
    return access.group in groups


class Eligibility(StrEnum):
    """Where an account stands with gpuguard: what a login, a request and an admin's grant ask first."""

    EXEMPT = "exempt"    # passes the gate without a grant: never needs (or gets) one
    MEMBER = "member"    # of access.group: gets GPUs on the terms of their quota
    OUTSIDER = "outsider"  # neither: never given GPUs


def eligibility(uid: int, user: str, groups: Collection[str], access: AccessConfig) -> Eligibility:
    """The one eligibility check: exempt first (an exempt member is exempt), then membership."""
    if is_exempt(uid, user, groups, access):
        return Eligibility.EXEMPT
    return Eligibility.MEMBER if is_member(groups, access) else Eligibility.OUTSIDER


def _layers(user: str, groups: Collection[str], config: Config) -> list[tuple[str, dict[str, Any]]]:
    """The quota entries that apply to a user, strongest first, each with where it comes from.

    The user's own entry, then the entries of their groups in the order of quotas.toml: when
    several groups set the same field, the one written first wins, so the admin decides by the
    order of the file (deterministic, unlike the order NSS happens to return groups in).
    """
    own = [(f"user {user}", config.quotas.users[user])] if user in config.quotas.users else []
    return own + [(f"group {name}", entry) for name, entry in config.quotas.groups.items() if name in groups]


def _chosen(user: str, groups: Collection[str], config: Config) -> dict[str, tuple[str, object]]:
    """For each quota field the user's entries set: (where it comes from, its value), strongest layer first."""
    chosen: dict[str, tuple[str, object]] = {}
    for label, entry in _layers(user, groups, config):
        for name, value in entry.items():
            chosen.setdefault(name, (label, value))
    return chosen


def quota_sources(user: str, groups: Collection[str], config: Config) -> dict[str, str]:
    """For each quota field, where the user's value comes from: "user NAME", "group NAME" or "defaults"."""
    chosen = _chosen(user, groups, config)
    return {f.name: chosen[f.name][0] if f.name in chosen else "defaults" for f in fields(Quota)}


def quota_for(user: str, groups: Collection[str], config: Config) -> Quota:
    """The user's quota, field by field: the user's own entry, else a group's, else the defaults."""
    chosen: dict[str, Any] = {name: value for name, (_, value) in _chosen(user, groups, config).items()}
    return replace(config.defaults, **chosen)


def may_share(quota: Quota) -> bool:
    """Sharing a GPU is only safe when a memory quota bounds what each sharer can take."""
    return quota.sharing and quota.gpu_memory is not None


def expires_at(quota: Quota, now: float) -> float | None:
    return None if quota.max_time is None else now + quota.max_time


def grant_origin(asked: Origin, logged_in: bool) -> Origin:
    """What a grant made for an ask (or a queue row) of this origin is: a login's, or any grant
    made while its user has a session (a request from a login shell), ends with the user's
    sessions; one asked with no session open (cron, systemd-run) stays until released."""
    return Origin.SESSION if asked == Origin.SESSION or logged_in else Origin.REQUEST
