"""The usage report and the status view, built from what the store and the last sample hold (pure).

A report sums the hourly usage rows (store.usage_by) into GPU-hours granted, busy and idle,
the busy share, and processes stopped by each rule, per user, GPU or day, with a total.
The status view lists each GPU with its numbers, its holders and their quota, its fractions and
its processes; `fractions` says what of a GPU's memory is promised to its shared grants, for every
view that shows it (status, gpus, whoami, the web's grid, the metrics).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from gpuguard.core.model import Gpu, Grant, Quota, Rule, unit_label
from gpuguard.core.rules import WATCHER_RULES, memory_limit

if TYPE_CHECKING:  # the type only: sampling reads /proc, and this module stays pure
    from gpuguard.core.sample import Sample

GROUPINGS = ("user", "gpu", "day")
# The rules events are recorded under: the watcher's, a grant's origin, and the other ways a grant ends.
EVENT_RULES = tuple(rule.value for rule in Rule)


def report(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Rows with their busy share and kill total, the total over all rows, and the rules that are a
    report's kills_RULE columns: every watcher rule's whatever the data (scripts read columns by
    position too), then any other found."""
    rows = [_with_shares(row) for row in rows]
    kills: Counter[str] = Counter()
    for row in rows:
        kills.update(row["kills"])
    total = {key: sum(row[key] for row in rows) for key in ("granted_seconds", "busy_seconds", "idle_seconds")}
    return {"rows": rows, "total": _with_shares({"key": "total", **total, "kills": dict(kills)}),
            "rules": [*WATCHER_RULES, *sorted(set(kills) - set(WATCHER_RULES))]}


def _with_shares(row: Mapping[str, Any]) -> dict[str, Any]:
    granted, busy = row["granted_seconds"], row["busy_seconds"]
    return {**row, "busy_share": busy / granted if granted else None, "kills_total": sum(row["kills"].values())}


def fractions(gpu: Gpu, grants: Iterable[Grant]) -> dict[str, Any]:
    """A GPU's fractions: its shared grants, each with its holder and the memory promised to it
    (Grant.memory), the memory promised in all, and the memory left to promise: the GPU's memory
    less the promises; 0 while a whole (unshared) grant holds it, None while a sharer's promise is
    unknown (then nobody joins, allocator.room_to_share). A free GPU has all its memory left."""
    on = [g for g in grants if g.unit == gpu.unit]
    shared = sorted((g for g in on if g.shared), key=lambda g: (g.granted_at, g.user))
    promised = sum(g.memory or 0 for g in shared)
    left: int | None = max(0, gpu.memory_total - promised)
    if len(shared) < len(on):
        left = 0
    elif any(g.memory is None for g in shared):
        left = None
    return {"fractions": [{"user": g.user, "uid": g.uid, "memory": g.memory} for g in shared],
            "memory_promised": promised, "memory_left": left}


def status_gpus(gpus: Mapping[int, Gpu], grants: Iterable[Grant], sample: Sample | None,
                account_of: Callable[[int], tuple[str, Quota]], commands: Mapping[int, str]) -> list[dict[str, Any]]:
    """Per GPU: inventory, memory and utilisation, holders (with their memory quota and what their
    processes use there), and processes. Numbers a failed or missing sample cannot give are None."""
    grants = list(grants)
    view = []
    for unit, gpu in sorted(gpus.items()):
        read = sample is not None and sample.ok(unit)
        processes: list[dict[str, Any]] = []
        if sample is not None and read:
            for p in sample.processes:
                if p.unit == unit:
                    uid = sample.uid_of(p.pid)
                    processes.append({"pid": p.pid, "uid": uid, "user": account_of(uid)[0] if uid is not None else None,
                                      "memory": p.used_memory, "command": commands.get(p.pid, "")})
        use = sample.use.get(unit) if sample else None
        holders = []
        for g in grants:
            if g.unit == unit:
                used: list[int] = [p["memory"] for p in processes if p["uid"] == g.uid and p["memory"] is not None]
                holders.append({"user": g.user, "uid": g.uid, "shared": g.shared, "memory": g.memory, "origin": g.origin,
                                "granted_at": g.granted_at, "expires_at": g.expires_at, "last_active": g.last_active,
                                # a slice's memory is bounded by the hardware, not by the quota
                                "gpu_memory": None if gpu.slice else account_of(g.uid)[1].gpu_memory,
                                # what the watcher holds them to here: the fraction or the quota, the smaller
                                "memory_limit": memory_limit(g, account_of(g.uid)[1]),
                                "memory_used": sum(used) if read else None})
        view.append({
            "minor": unit, "label": unit_label(unit), "profile": gpu.slice.profile if gpu.slice else None,
            "index": gpu.index, "uuid": gpu.uuid, "name": gpu.name,
            "memory_total": gpu.memory_total, "memory_used": use.memory_used if use else None,
            "utilization": use.utilization if use else None, "holders": holders, **fractions(gpu, grants),
            "processes": len(processes) if read else None,  # None: unknown (not sampled, or failed)
            "process_list": processes if read else None,
            "owner": "gpuguard",
        })
    return view
