"""What each page shows, from the daemon's replies (pure: no I/O, the clock passed in).

The grid's states, in the order they win: a GPU another system owns (Slurm, Kubernetes), one
drained by its admin, free, over quota (a holder's processes use more than their `gpu_memory`),
held but idle (no process of its holders there for IDLE_SHOWN), held. Names a viewer may not see
(`[web] show_users = false`: other users', to anyone but admins) are replaced here, once, before
anything is drawn, so no page or fragment can leak them.
"""
from __future__ import annotations

import csv
import datetime
import io
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from gpuguard.core.model import unit_label

IDLE_SHOWN = 300.0  # seconds without a process of its holders before a held GPU shows as idle
HIDDEN = "another user"
STATE_WORDS = {"free": "free", "held": "held", "idle": "held, idle", "over": "over quota",
               "drained": "drained", "other": "owned by", "unknown": "not read"}
CSV_COLUMNS = ("by", "key", "granted_hours", "busy_hours", "idle_hours", "busy_share")


@dataclass(frozen=True)
class Viewer:
    """Who looks: a logged-in user (None: nobody logged in) and whether they are an admin."""

    user: str | None = None
    admin: bool = False

    def may_see(self, name: str, show_users: bool) -> bool:
        return show_users or self.admin or name == self.user

    def name(self, name: str | None, show_users: bool) -> str:
        if name is None:
            return "?"
        return name if self.may_see(name, show_users) else HIDDEN


@dataclass(frozen=True)
class Opener:
    user: str
    memory_used: int | None
    quota: int | None           # gpu_memory, None: no limit (or a MIG slice); a fraction's: its promise
    time_left: float | None     # seconds, None: no time limit
    idle_for: float | None      # seconds since a process of theirs was last seen there, None: busy now
    over: bool
    fraction: bool = False      # a shared grant: quota is the memory promised to it on this GPU


@dataclass(frozen=True)
class Process:
    pid: int
    user: str
    memory: int | None
    command: str


@dataclass(frozen=True)
class Cell:
    """One GPU or MIG slice on the grid."""

    server: str
    label: str
    name: str
    profile: str | None
    state: str                  # a key of STATE_WORDS
    owner: str | None           # the system that owns it when not gpuguard (slurm, k8s)
    holders: tuple[Opener, ...]
    memory_used: int | None
    memory_total: int
    utilization: int | None
    processes: tuple[Process, ...] | None  # None: NVML could not read them
    memory_promised: int = 0    # to its fractions (shared grants), reporting.fractions
    memory_left: int | None = None  # to promise to more sharers; None: unknown, or not said (the fleet's)

    @property
    def fractions(self) -> int:
        return sum(1 for holder in self.holders if holder.fraction)

    @property
    def words(self) -> str:
        if self.state == "other":
            return f"owned by {self.owner}"
        if self.state == "idle":
            idle = min(h.idle_for for h in self.holders if h.idle_for is not None)
            return f"held, idle {duration(idle)}"
        return STATE_WORDS[self.state]


@dataclass(frozen=True)
class Server:
    name: str
    cells: tuple[Cell, ...]
    error: str | None           # why it could not be read (then no cells), or why what it shows is stale
    counts: Mapping[str, int]   # state -> cells
    age: float | None = None    # seconds since the daemon sampled the GPUs (None: not said)


def server_view(name: str, status: Mapping[str, Any] | None, error: str | None, now: float,
                viewer: Viewer, show_users: bool) -> Server:
    if status is None:
        return Server(name, (), f"not read: {error or 'no answer'}", {})
    cells = tuple(cell(name, gpu, now, viewer, show_users) for gpu in status.get("gpus", ()))
    counts: dict[str, int] = {}
    for c in cells:
        counts[c.state] = counts.get(c.state, 0) + 1
    sampled = status.get("sampled_at")
    age = max(0.0, now - float(sampled)) if isinstance(sampled, (int, float)) else None
    return Server(name, cells, error, counts, age)  # an error beside a status: stale (a lost node's last word)


def cell(server: str, gpu: Mapping[str, Any], now: float, viewer: Viewer, show_users: bool) -> Cell:
    listed = gpu.get("process_list")
    busy_uids = {p["uid"] for p in listed or ()}
    holders = tuple(_holder(h, busy_uids, listed is not None, now, viewer, show_users) for h in gpu["holders"])
    processes = None if listed is None else tuple(
        Process(p["pid"], viewer.name(p["user"], show_users), p["memory"], p["command"]) for p in listed)
    owner = gpu.get("owner")  # the fleet's: which system owns the GPU (absent: gpuguard)
    if owner not in (None, "gpuguard"):
        state = "other"
    elif gpu.get("drained"):
        state = "drained"
    elif not holders:
        state = "free"
    elif any(h.over for h in holders):
        state = "over"
    elif all(h.idle_for is not None and h.idle_for >= IDLE_SHOWN for h in holders):
        state = "idle"
    else:
        state = "held"
    return Cell(server, gpu.get("label") or unit_label(gpu["minor"]), gpu["name"], gpu.get("profile"), state,
                owner if state == "other" else None, holders, gpu.get("memory_used"), gpu["memory_total"],
                gpu.get("utilization"), processes, gpu.get("memory_promised") or 0, gpu.get("memory_left"))


def _holder(h: Mapping[str, Any], busy_uids: set[int], read: bool, now: float, viewer: Viewer,
            show_users: bool) -> Opener:
    fraction = bool(h.get("shared") and h.get("memory"))
    used, quota = h.get("memory_used"), h.get("memory_limit")  # the watcher's: the promise or the quota, the smaller
    idle = None
    if read and h["uid"] not in busy_uids:  # idle only when NVML said so: an unread GPU is not idle
        idle = max(0.0, now - (h.get("last_active") or h["granted_at"]))
    expires = h.get("expires_at")
    return Opener(viewer.name(h["user"], show_users), used, quota,
                  None if expires is None else max(0.0, expires - now), idle,
                  bool(quota and used is not None and used > quota), fraction)


# --- the queue

@dataclass(frozen=True)
class Waiting:
    server: str
    position: int
    user: str
    gpus: int
    since: float
    priority: int
    why: str
    estimate: float | None      # when the GPUs it waits for should be free (grant expiries), None: unknown


def queue_rows(server: str, status: Mapping[str, Any], standings: Mapping[str, Mapping[str, Any] | None],
               viewer: Viewer, show_users: bool) -> list[Waiting]:
    """The server's queue in the order it is served, each with why it waits where it does: for the
    first, what it waits for; for the others, why the one just ahead goes first (whoami's reasons).
    standings: user -> their `whoami` queue place (missing: not asked)."""
    free = sum(1 for gpu in status.get("gpus", ()) if not gpu["holders"])
    rows = []
    for entry in status.get("queue", ()):
        standing = standings.get(entry["user"])
        ahead = (standing or {}).get("ahead") or []
        if entry["position"] == 1 or not ahead:
            why = f"first in line: wants {plural(entry['gpus'], 'GPU')}, {free} free"
        else:
            nearest = ahead[0]
            why = f"behind {viewer.name(nearest['user'], show_users)}: {nearest['why']}"
        rows.append(Waiting(server, entry["position"], viewer.name(entry["user"], show_users), entry["gpus"],
                            entry["since"], entry.get("priority", 0), why, (standing or {}).get("estimate")))
    return rows


# --- fair share

@dataclass(frozen=True)
class FairShare:
    """One user's fair-share standing on a server, as the queue counts it (the `fairshare` reply)."""

    hours: float        # recent GPU-hours, decayed: each hour counts half after every half-life
    share: float
    priority: int
    rank: int           # 1: served first among those waiting alike
    of: int             # users ranked: all with recent usage, grants or a queue place, and this one
    half_life: float    # seconds

    @property
    def per_share(self) -> float:
        return self.hours / self.share


def fair_share(user: str, quota: Mapping[str, Any] | None, reply: Mapping[str, Any] | None) -> FairShare | None:
    """The user's place in the daemon's `fairshare` order: higher priority first, then less usage per
    share, then name, as the queue serves. A user missing from it has no recent usage (their share
    and priority from whoami's quota). Only counts come out: no other user's name reaches the page.
    None: no reply (a source that does not know fair share)."""
    if reply is None:
        return None
    users = reply["users"]
    own = next((u for u in users if u["user"] == user), None)
    if own is None:
        if quota is None:
            return None
        own = {"user": user, "usage": 0.0, "share": quota["share"], "priority": quota["priority"],
               "normalized": 0.0}
    key = _fair_key(own)
    others = [u for u in users if u["user"] != user]
    rank = 1 + sum(1 for u in others if _fair_key(u) < key)
    return FairShare(own["usage"] / 3600, own["share"], own["priority"], rank, len(others) + 1,
                     reply["half_life"])


def _fair_key(u: Mapping[str, Any]) -> tuple[int, float, str]:
    return -u["priority"], u["normalized"], u["user"]


# --- usage

MAX_DAY_BARS = 62  # a by-day chart of a longer period is drawn in weeks

@dataclass(frozen=True)
class Usage:
    label: str
    granted_hours: float
    busy_hours: float | None  # None: the source does not know (the fleet database records grants only)
    idle_hours: float | None

    @property
    def busy_share(self) -> float | None:
        return self.busy_hours / self.granted_hours if self.granted_hours and self.busy_hours is not None else None


def usage_rows(by: str, reports: Mapping[str, Mapping[str, Any]], viewer: Viewer, show_users: bool) -> list[Usage]:
    """One bar per key of `by` summed over the servers (user, day), or per server and GPU (gpu);
    `server`: one per server."""
    sums: dict[str, list[float | None]] = {}
    for server, report in sorted(reports.items()):
        rows = [report["total"]] if by == "server" else report["rows"]
        for row in rows:
            label = _usage_label(by, server, row["key"], len(reports) > 1, viewer, show_users)
            total = sums.setdefault(label, [0.0, 0.0, 0.0])
            for i, key in enumerate(("granted_seconds", "busy_seconds", "idle_seconds")):
                value, known = row[key], total[i]
                total[i] = None if value is None or known is None else known + value / 3600
    return [Usage(label, values[0] or 0.0, values[1], values[2]) for label, values in sums.items()]


@dataclass(frozen=True)
class OwnProcess:
    """One of a user's processes on a GPU, for their page."""

    server: str
    gpu: str
    pid: int
    command: str
    memory: int | None


def processes_of(user: str, servers: Iterable[tuple[str, Mapping[str, Any] | None]]) -> list[OwnProcess]:
    """The user's processes on each server's GPUs, from its `status` (None: not read)."""
    return [OwnProcess(server, str(gpu.get("label", gpu.get("minor"))), int(p["pid"]), str(p.get("command") or ""),
                    p.get("memory"))
            for server, status in servers if status is not None
            for gpu in status.get("gpus", ()) for p in gpu.get("process_list") or () if p.get("user") == user]


def largest_first(rows: Iterable[Usage]) -> list[Usage]:
    """Most GPU-hours granted first (then by label): a chart cut at its bar limit keeps the largest."""
    return sorted_usage(rows, "granted")


USAGE_SORTS = ("name", "granted", "busy", "share")


def sorted_usage(rows: Iterable[Usage], by: str) -> list[Usage]:
    """By label (`name`), or largest first by GPU-hours granted, busy, or busy share (unknown last)."""
    if by == "name":
        return sorted(rows, key=lambda r: natural(r.label))
    if by in ("busy", "share"):
        def value(r: Usage) -> float | None:
            return r.busy_hours if by == "busy" else r.busy_share
        return sorted(rows, key=lambda r: (value(r) is None, -(value(r) or 0.0), natural(r.label)))
    return sorted(rows, key=lambda r: (-r.granted_hours, natural(r.label)))


def by_period(days: Iterable[Usage], first: datetime.date, last: datetime.date) -> list[Usage]:
    """The by-day rows as one bar for every day from `first` to `last` (a day without usage at
    zero), so the chart always ends at the period's end; a period longer than MAX_DAY_BARS days
    in weeks (from Monday, labelled "week of" it), 53 bars for the longest."""
    known = {r.label: r for r in days}
    weekly = (last - first).days + 1 > MAX_DAY_BARS
    sums: dict[str, list[float | None]] = {}
    day = first
    while day <= last:
        label = f"week of {day - datetime.timedelta(day.weekday())}" if weekly else day.isoformat()
        total = sums.setdefault(label, [0.0, 0.0, 0.0])
        row = known.get(day.isoformat())
        if row is not None:
            for i, value in enumerate((row.granted_hours, row.busy_hours, row.idle_hours)):
                so_far = total[i]
                total[i] = None if value is None or so_far is None else so_far + value
        day += datetime.timedelta(1)
    return [Usage(label, values[0] or 0.0, values[1], values[2]) for label, values in sums.items()]


def _usage_label(by: str, server: str, key: Any, fleet: bool, viewer: Viewer, show_users: bool) -> str:
    if by == "server":
        return server
    if by == "user":
        return viewer.name(str(key), show_users)
    if by == "gpu":
        return f"{server} GPU {unit_label(int(key))}" if fleet else f"GPU {unit_label(int(key))}"
    return str(key)


def usage_csv(tables: Iterable[tuple[str, list[Usage]]]) -> str:
    """CSV with a header: one line per (grouping, key), hours as decimals."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for by, rows in tables:
        for r in rows:
            writer.writerow([by, _csv_safe(r.label), f"{r.granted_hours:.3f}", _hours(r.busy_hours),
                             _hours(r.idle_hours), "" if r.busy_share is None else f"{r.busy_share:.3f}"])
    return out.getvalue()


def _hours(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _csv_safe(text: str) -> str:
    """A cell a spreadsheet would run as a formula (=, +, -, @ first) is quoted with a leading '."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


# --- utilisation and memory over time

SPANS = ("hour", "day", "week")
# one bucket of a series: utilisation's mean and peak (percent; None: not known, as for a MIG
# slice), memory's mean and peak (bytes)
TrendPoint = tuple[float | None, float | None, float, float]
TREND_SORTS = ("name", "util", "util_peak", "memory", "memory_peak")


@dataclass(frozen=True)
class Trend:
    """One GPU's or one user's utilisation and memory over a span, one point a bucket (None:
    not known then): (utilisation mean, its peak, memory mean, its peak), percent and bytes. Its
    span's numbers are worked out once (a page reads each several times)."""

    server: str
    kind: str                   # "gpu" or "user"
    key: str                    # the GPU's label, the user's name
    title: str                  # "GPU 3", "alice", "gpu2 GPU 3" in a fleet
    model: str | None           # the GPU's name (NVIDIA H100 ...), None for a user
    memory_total: int | None    # the GPU's memory, None for a user (or a GPU gone since)
    start: float                # the first bucket's start, epoch seconds
    step: int                   # seconds a bucket
    points: tuple[TrendPoint | None, ...]
    ticks: tuple[int, ...]      # samples in each bucket: the weights of the span's means

    def _column(self, field: int) -> list[float | None]:
        return [None if p is None else p[field] for p in self.points]

    def _mean(self, values: Sequence[float | None]) -> float | None:
        weighed = [(v, w) for v, w in zip(values, self.ticks, strict=True) if v is not None and w]
        total = sum(w for _, w in weighed)
        return sum(v * w for v, w in weighed) / total if total else None

    @staticmethod
    def _peak(values: Sequence[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return max(known) if known else None

    @cached_property
    def util(self) -> float | None:
        return self._mean(self._column(0))

    @cached_property
    def util_peak(self) -> float | None:
        return self._peak(self._column(1))

    @cached_property
    def memory(self) -> float | None:
        return self._mean(self._column(2))

    @cached_property
    def memory_peak(self) -> float | None:
        return self._peak(self._column(3))

    @cached_property
    def latest(self) -> tuple[float | None, float | None] | None:
        """The newest bucket's utilisation and memory (None: nothing known in the span)."""
        last = next((p for p in reversed(self.points) if p is not None), None)
        return None if last is None else (last[0], last[2])

    @property
    def href_query(self) -> str:
        return f"server={self.server}&{self.kind}={self.key}"

    def sort_key(self, by: str) -> tuple[Any, ...]:
        """Largest first for the numbers (unknown last), by title for `name`."""
        if by == "name":
            return natural(self.title)
        value = getattr(self, by)
        return (value is None, -(value or 0.0), natural(self.title))


def trends(replies: Mapping[str, Mapping[str, Any]], viewer: Viewer) -> tuple[list[Trend], list[Trend]]:
    """Every server's GPUs, and the users the viewer may see (admins: everyone; anyone else: only
    themselves, as with usage), from each server's `use_history` reply."""
    gpus, users = [], []
    fleet = len(replies) > 1
    for server, reply in sorted(replies.items()):
        ticks = tuple(int(t) for t in reply["ticks"])
        start, step = float(reply["start"]), int(reply["step"])
        for g in reply.get("gpus", ()):
            label = str(g["label"])
            gpus.append(Trend(server, "gpu", label, f"{server} GPU {label}" if fleet else f"GPU {label}", g.get("name"),
                              g.get("memory_total"), start, step, _points(g), ticks))
        for u in reply.get("users", ()):
            name = str(u["user"])
            if viewer.admin or name == viewer.user:
                users.append(Trend(server, "user", name, f"{server} {name}" if fleet else name, None, None, start,
                                   step, _points(u), ticks))
    return gpus, users


def _points(entry: Mapping[str, Any]) -> tuple[TrendPoint | None, ...]:
    columns = zip(entry["util"], entry["util_peak"], entry["memory"], entry["memory_peak"], strict=True)
    return tuple(None if memory is None else (util, peak, float(memory), float(memory_peak or memory))
                 for util, peak, memory, memory_peak in columns)


def sorted_trends(rows: Iterable[Trend], by: str) -> list[Trend]:
    return sorted(rows, key=lambda t: t.sort_key(by if by in TREND_SORTS else "name"))


def natural(text: str) -> tuple[tuple[int, str], ...]:
    """GPU 2 before GPU 10: digits compare as numbers."""
    return tuple((int(part), "") if part.isdigit() else (-1, part) for part in re.split(r"(\d+)", text) if part)


# --- words

def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, 11th, 12th, 13th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def duration(seconds: float) -> str:
    """2d03h, 5h07m, 42m, 30s."""
    seconds = int(max(0.0, seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes = seconds // 60
    days, rest = divmod(minutes, 24 * 60)
    hours, minutes = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m"
