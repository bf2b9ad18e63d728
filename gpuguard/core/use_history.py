"""Utilisation and memory over time, downsampled (pure): what one sample adds to a bucket, and
the series a chart draws from the buckets.

Three rings of fixed size (LEVELS): a minute's buckets for the last hour, ten minutes' for the
last day, an hour's for the last week. Every tick's sample goes into the minute being counted
(in memory); a minute written, the ten minutes and the hour it closes are summed from the finer
ring (services.use_history). A bucket keeps sums and counts, not means, so that coarser buckets
are exact sums of finer ones, and peaks (the largest single sample).

Series, per bucket:
- a GPU (or MIG slice), by unit: NVML's utilisation (percent) and memory used, over the samples
  in which it answered (`n`; utilisation over those that gave one: a MIG slice gives none);
- a user, by uid: the utilisation of the GPUs their processes are on, each GPU's shared out
  equally among the users with processes there, summed as `top` sums CPUs (100 = one GPU busy),
  and the memory of their processes; counted over every sample of the bucket (TICKS), so a user
  without a process or a grant in a sample counts 0 there;
- TICKS (key 0): how many samples the bucket has (0, no bucket: the daemon was not sampling).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from gpuguard.core.model import GpuUse

GPU, USER, TICKS = "gpu", "user", "tick"


@dataclass(frozen=True)
class Level:
    span: str     # what the ring covers, as the pages and the protocol name it
    step: int     # seconds per bucket
    length: int   # buckets kept

    @property
    def seconds(self) -> int:
        return self.step * self.length

    def start_of(self, moment: float) -> int:
        """The start of the bucket `moment` falls in (epoch seconds, a multiple of step)."""
        return int(moment // self.step) * self.step

    def slot(self, start: int) -> int:
        """Where the bucket starting at `start` is kept in the ring (replacing the one a span before)."""
        return (start // self.step) % self.length


LEVELS = (Level("hour", 60, 60), Level("day", 600, 144), Level("week", 3600, 168))
SPANS = tuple(level.span for level in LEVELS)
ROWS_PER_SERIES = sum(level.length for level in LEVELS)  # 372: the bound the docs state
Key = tuple[str, int]  # (GPU, unit), (USER, uid), (TICKS, 0)


def level_of(span: str) -> Level:
    return next(level for level in LEVELS if level.span == span)


class Reading(NamedTuple):
    """One series in one sample."""

    util: float | None  # percent; None: not known (a MIG slice)
    memory: float       # bytes
    total: float        # bytes the GPU has (0 for a user)


@dataclass
class Stats:
    """A bucket of one series: sums and counts over its samples, and peaks."""

    n: int = 0
    util_n: int = 0
    util_sum: float = 0.0
    util_peak: float | None = None
    mem_sum: float = 0.0
    mem_peak: float = 0.0
    total: float = 0.0

    def add(self, reading: Reading) -> None:
        self.n += 1
        if reading.util is not None:
            self.util_n += 1
            self.util_sum += reading.util
            self.util_peak = reading.util if self.util_peak is None else max(self.util_peak, reading.util)
        self.mem_sum += reading.memory
        self.mem_peak = max(self.mem_peak, reading.memory)
        self.total = max(self.total, reading.total)

    def merge(self, other: Stats) -> None:
        self.n += other.n
        self.util_n += other.util_n
        self.util_sum += other.util_sum
        if other.util_peak is not None:
            self.util_peak = other.util_peak if self.util_peak is None else max(self.util_peak, other.util_peak)
        self.mem_sum += other.mem_sum
        self.mem_peak = max(self.mem_peak, other.mem_peak)
        self.total = max(self.total, other.total)

    def row(self) -> tuple[int, int, float, float | None, float, float, float]:
        return self.n, self.util_n, self.util_sum, self.util_peak, self.mem_sum, self.mem_peak, self.total


@dataclass
class Bucket:
    """The minute being counted: every series seen in it."""

    start: int
    series: dict[Key, Stats] = field(default_factory=dict)

    def add(self, readings: Mapping[Key, Reading]) -> None:
        ticks = self.series.setdefault((TICKS, 0), Stats())
        ticks.n += 1
        for key, reading in readings.items():
            stats = self.series.get(key)
            if stats is None:
                stats = self.series[key] = Stats()
            stats.add(reading)


def readings(use: Mapping[int, GpuUse], processes: Iterable[tuple[int, int, int | None]],
             holders: Iterable[int]) -> dict[Key, Reading]:
    """One sample's readings: every unit that answered (`use`), and every user with a process
    (uid, unit, memory; memory None: NVML does not know, counted 0) or a grant (`holders`: uids)."""
    found: dict[Key, Reading] = {(GPU, unit): Reading(None if u.utilization is None else float(u.utilization),
                                                      float(u.memory_used), float(u.memory_total))
                                 for unit, u in use.items()}
    memory: dict[int, float] = dict.fromkeys(holders, 0.0)
    users_on: dict[int, set[int]] = {}
    for uid, unit, used in processes:
        memory[uid] = memory.get(uid, 0.0) + (used or 0)
        users_on.setdefault(unit, set()).add(uid)
    util: dict[int, float] = {}
    for unit, uids in users_on.items():
        gpu = use.get(unit)
        if gpu is not None and gpu.utilization is not None:
            for uid in uids:
                util[uid] = util.get(uid, 0.0) + gpu.utilization / len(uids)
    for uid, total in memory.items():
        found[(USER, uid)] = Reading(util.get(uid, 0.0), total, 0.0)
    return found


class Point(NamedTuple):
    """One bucket of a series as a chart draws it: means over the bucket, and peaks."""

    util: float | None
    util_peak: float | None
    memory: float
    memory_peak: float


def point(kind: str, stats: Stats, ticks: int) -> Point | None:
    """The bucket's means: a GPU's over the samples it answered in, a user's over all the
    bucket's samples (`ticks`). None: nothing known (a GPU that never answered)."""
    if kind == USER:
        if ticks <= 0:
            return None
        return Point(stats.util_sum / ticks, stats.util_peak, stats.mem_sum / ticks, stats.mem_peak)
    if stats.n <= 0:
        return None
    return Point(stats.util_sum / stats.util_n if stats.util_n else None, stats.util_peak,
                 stats.mem_sum / stats.n, stats.mem_peak)


def series(buckets: Mapping[int, Mapping[Key, Stats]], starts: Iterable[int]) -> dict[Key, list[Point | None]]:
    """Every series found in `buckets` (start -> key -> stats), as one point per start of `starts`
    (None where it has none: for a user in a bucket with samples, that is 0, not unknown)."""
    starts = list(starts)
    keys = {key for stats in buckets.values() for key in stats if key[0] != TICKS}
    found: dict[Key, list[Point | None]] = {}
    for key in sorted(keys):
        points: list[Point | None] = []
        for start in starts:
            bucket = buckets.get(start, {})
            ticks = bucket.get((TICKS, 0))
            stats = bucket.get(key)
            if stats is None:
                points.append(Point(0.0, 0.0, 0.0, 0.0) if key[0] == USER and ticks and ticks.n else None)
            else:
                points.append(point(key[0], stats, ticks.n if ticks else 0))
        found[key] = points
    return found
