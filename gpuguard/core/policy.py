"""Who gets GPUs and on what terms: pure decisions over names, no lookups.

The caller resolves a user's groups (backends.accounts) and passes names in, so these
rules run in unit tests and in simulation exactly as in the daemon.
"""
from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace
from typing import Any

from gpuguard.config import MIN_GPU_MEMORY, QUOTA_KEYS, AccessConfig, Config, SessionsConfig
from gpuguard.core.compat import StrEnum
from gpuguard.core.model import Gpu, Origin, Quota

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
    return sessions.grant == "all" or service in sessions.services or is_terminal(tty)


def is_terminal(tty: str) -> bool:
    """Whether a session's PAM_TTY names a terminal (where its login line is read)."""
    return bool(_TERMINAL.fullmatch(tty))


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
    """For each quota key an admin sets (QUOTA_KEYS), where the user's value comes from: "user NAME",
    "group NAME" or "defaults"."""
    chosen = _chosen(user, groups, config)
    return {key: chosen[key][0] if key in chosen else "defaults" for key in QUOTA_KEYS}


def quota_for(user: str, groups: Collection[str], config: Config) -> Quota:
    """The user's quota, field by field: the user's own entry, else a group's, else the defaults."""
    chosen: dict[str, Any] = {name: value for name, (_, value) in _chosen(user, groups, config).items()}
    return replace(config.defaults, **chosen)


def may_share(quota: Quota) -> bool:
    """Sharing a GPU is only safe when a memory quota bounds what each sharer can take."""
    return quota.sharing and quota.gpu_memory is not None


# --- fractions: part of one GPU's memory (gpuguard request --memory)

# CUDA's MPS serves at most 48 clients on one GPU (Volta and later): more fractions than that on a
# GPU could not all run at once, whatever their memory. Memory is what bounds them below that.
FRACTIONS_PER_GPU = 48


def fraction_terms(quota: Quota, memory: int) -> Quota:
    """The terms one ask for a fraction of `memory` bytes is served on (and waits on, in its queue
    row): one unit, a whole GPU shared with other fractions while the memory promised to them all
    fits it (allocator.room_to_share), promised `memory` (Grant.memory), which the watcher holds
    its processes to. Never a MIG slice: the hardware cuts those, not a promise."""
    return replace(quota, sharing=True, gpu_memory=memory, fraction=memory, slices=0,
                   max_sharers=FRACTIONS_PER_GPU)


def fraction_bounds(quota: Quota, largest_gpu: int) -> tuple[int, int]:
    """The smallest and largest fraction a user on `quota` may ask for on a server whose largest
    whole GPU has `largest_gpu` bytes: from min_fraction_memory (else the least a CUDA context
    needs) to the least of max_fraction_memory, their gpu_memory quota and that GPU's memory."""
    most = min(m for m in (quota.max_fraction_memory, quota.gpu_memory, largest_gpu) if m is not None)
    return quota.min_fraction_memory or MIN_GPU_MEMORY, most


def fraction_limit(quota: Quota) -> int:
    """How many fractions a user on `quota` may hold at once: max_fractions, never more than gpus;
    none when the quota takes no whole GPUs (a fraction is of one)."""
    if not quota.whole_gpus:
        return 0
    return quota.gpus if quota.max_fractions is None else min(quota.max_fractions, quota.gpus)


def expires_at(quota: Quota, now: float) -> float | None:
    return None if quota.max_time is None else now + quota.max_time


def grant_origin(asked: Origin, logged_in: bool) -> Origin:
    """What a grant made for an ask (or a queue row) of this origin is: a login's, or any grant
    made while its user has a session (a request from a login shell), ends with the user's
    sessions; one asked with no session open (cron, systemd-run) stays until released."""
    return Origin.SESSION if asked == Origin.SESSION or logged_in else Origin.REQUEST


# --- limits that hold across a release and a new grant

def idle_since(quota: Quota, now: float, held: Iterable[float], ended: tuple[float, float] | None) -> float:
    """Where a new grant's idle clock starts: at the last use of any GPU its user held within the
    last idle_timeout, else now. held: the last use of each GPU they hold; ended: of the grants
    that ended since an idle release, the last use and when the latest ended. So `release` then
    `request` does not restart the clock, however often: a grant whose user has not used a GPU for
    idle_timeout is released at the next tick. An idle release itself is a fresh start (the store
    forgets `ended` then): the GPU went back, and a user may ask again as anyone may."""
    if quota.idle_timeout is None:
        return now
    uses = list(held)
    if ended is not None and now - ended[1] < quota.idle_timeout:
        uses.append(ended[0])
    return min(now, max(uses, default=now))


def unit_kind(gpu: Gpu) -> str:
    """What a cool-down is about: the GPU's model, and for a MIG slice its profile too."""
    return gpu.name if gpu.slice is None else f"{gpu.name} {gpu.slice.profile}"


def cool_downs(quota: Quota, now: float, time_limited: Mapping[str, float]) -> dict[str, float]:
    """After a time limit took a unit of a kind from a user (`time_limited`: kind -> when), they are
    given no unit of that kind again for reclaim_after, so max_time bounds a turn instead of
    restarting at once: kind -> when its cool-down ends, for those not over (none without reclaim_after)."""
    if quota.reclaim_after is None:
        return {}
    ends = {kind: at + quota.reclaim_after for kind, at in time_limited.items()}
    return {kind: end for kind, end in ends.items() if now < end}


def fleet_room(quota: Quota, elsewhere: int, here: int) -> int | None:
    """GPUs left of the user's fleet quota (GPUs on every server of a fleet together), holding
    `elsewhere` on the other servers and `here` on this one: 0 or less when all are held; None
    without a fleet quota."""
    return None if quota.fleet_gpus is None else quota.fleet_gpus - elsewhere - here


def fleet_quota_held(quota: Quota, elsewhere: int | None, here: int) -> bool:
    """Whether the user holds all of their fleet quota: `elsewhere` as last seen (None: not known,
    or no fleet)."""
    room = None if elsewhere is None else fleet_room(quota, elsewhere, here)
    return room is not None and room <= 0
