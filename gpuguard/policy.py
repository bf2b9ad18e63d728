"""Who gets GPUs and on what terms: pure decisions over names, no lookups.

The caller resolves a user's groups (backends.accounts) and passes names in, so these
rules run in unit tests and in simulation exactly as in the daemon.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import fields, replace

from gpuguard.config import AccessConfig, Config
from gpuguard.model import Quota

ROOT_UID = 0


def is_exempt(uid: int, user: str, groups: Collection[str], access: AccessConfig) -> bool:
    """Exempt accounts pass the gate unconditionally and never need (or get) a grant."""
    return uid == ROOT_UID or user in access.exempt_users or any(g in access.exempt_groups for g in groups)


def is_member(groups: Collection[str], access: AccessConfig) -> bool:
    """Only members of access.group are ever given GPUs."""
    return access.group in groups


def quota_for(user: str, groups: Collection[str], config: Config) -> Quota:
    """The user's quota, field by field: the user's own entry, else a group's, else the defaults.

    When several of the user's groups set the same field, the group written first in
    quotas.toml wins, so the admin decides by the order of the file (deterministic, unlike
    the order NSS happens to return groups in).
    """
    layers = [config.quotas.groups[name] for name in config.quotas.groups if name in groups]
    if user in config.quotas.users:
        layers.insert(0, config.quotas.users[user])
    merged = {}
    for quota_field in fields(Quota):
        for layer in layers:
            if quota_field.name in layer:
                merged[quota_field.name] = layer[quota_field.name]
                break
    return replace(config.defaults, **merged)


def may_share(quota: Quota) -> bool:
    """Sharing a GPU is only safe when a memory quota bounds what each sharer can take."""
    return quota.sharing and quota.gpu_memory is not None


def expires_at(quota: Quota, now: float) -> float | None:
    return None if quota.max_time is None else now + quota.max_time
