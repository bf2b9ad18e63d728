"""Utilisation and memory over time, from the daemon's samples, kept downsampled in the store
(core.use_history: the rings, what a sample adds, the series).

Cheap on the tick, which runs under floods too: a sample adds to the minute counted in memory
(a few dictionary updates per GPU and per user). The store is written once a minute, in one
transaction: that minute's buckets; and when the minute closes ten minutes or an hour, those
buckets summed from the finer ring by one SQL statement each, and once an hour the rows of series
gone for a ring's span dropped. A restart loses at most the minute being counted (close() writes
it as far as it got); buckets that closed while no daemon ran are summed at the first sample.

Reads end at the minute being counted: the last bucket of a day or a week is summed at read
time from the finer rings and that minute, so every chart ends now.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from gpuguard.core.model import Gpu, unit_label
from gpuguard.core.sample import Sample
from gpuguard.core.use_history import GPU, LEVELS, TICKS, USER, Bucket, Key, Point, Stats, level_of, readings, series
from gpuguard.services.store import Store

MINUTE = LEVELS[0]


@dataclass(frozen=True)
class Trace:
    """A span's series: the start of each bucket (oldest first) and each series' point there."""

    step: int
    starts: list[int]
    ticks: list[int]                       # samples in each bucket (0: the daemon did not sample)
    series: dict[Key, list[Point | None]]

    @property
    def uids(self) -> list[int]:
        return [key for kind, key in self.series if kind == USER]

    def reply(self, gpus: Mapping[int, Gpu], name_of: Callable[[int], str]) -> dict[str, Any]:
        """As the `use_history` operation answers: the buckets' starts (`start`, every `step`
        seconds), and per GPU and per user four lists, one entry a bucket (null: not known):
        `util` and `memory` the bucket's means, `util_peak` and `memory_peak` its largest sample
        (percent with one decimal, bytes)."""
        found: dict[str, list[dict[str, Any]]] = {GPU: [], USER: []}
        for (kind, key), points in self.series.items():
            entry: dict[str, Any] = {"util": [_round(p.util if p else None, 1) for p in points],
                                     "util_peak": [_round(p.util_peak if p else None, 1) for p in points],
                                     "memory": [_round(p.memory if p else None) for p in points],
                                     "memory_peak": [_round(p.memory_peak if p else None) for p in points]}
            if kind == GPU:
                gpu = gpus.get(key)
                entry = {"minor": key, "label": unit_label(key), "name": gpu.name if gpu else None,
                         "memory_total": gpu.memory_total if gpu else None, **entry}
            else:
                entry = {"uid": key, "user": name_of(key), **entry}
            found[kind].append(entry)
        return {"step": self.step, "start": self.starts[0], "ticks": self.ticks, "gpus": found[GPU],
                "users": sorted(found[USER], key=lambda u: u["user"])}


class UseHistory:
    def __init__(self, store: Store):
        self.store = store
        self._minute: Bucket | None = None  # the minute being counted
        # step -> the start of the first bucket of that step not summed yet (None: none to sum)
        self._summed: dict[int, int | None] = {}
        ranges = {level.step: store.use_bucket_range(level.step) for level in LEVELS}
        for i, level in enumerate(LEVELS[1:], start=1):
            kept = ranges[level.step]
            finer = [found[0] for each in LEVELS[:i] if (found := ranges[each.step])]
            self._summed[level.step] = kept[1] + level.step if kept else level.start_of(min(finer)) if finer else None

    def add(self, sample: Sample, holders: Iterable[int]) -> None:
        """One sample of the GPUs, and the uids holding grants then (a holder without a process counts 0)."""
        start = MINUTE.start_of(sample.time)
        if self._minute is None:
            self._write(None, start)  # buckets that closed while no daemon ran
        elif self._minute.start != start:
            self._write(self._minute, start)
        if self._minute is None or self._minute.start != start:
            self._minute = Bucket(start)
        processes = [(uid, p.unit, p.used_memory) for p in sample.processes if (uid := sample.uid_of(p.pid)) is not None]
        self._minute.add(readings(sample.use, processes, holders))

    def close(self) -> None:
        """Write the minute counted so far (the daemon stops)."""
        if self._minute is not None:
            self._write(self._minute, self._minute.start)
            self._minute = None

    def _write(self, minute: Bucket | None, now: int) -> None:
        """`minute` written, then the coarser buckets closed by the minute starting at `now` summed."""
        rows = [] if minute is None else [
            (MINUTE.step, kind, key, MINUTE.slot(minute.start), minute.start, *stats.row())
            for (kind, key), stats in minute.series.items()]
        sums, prune = [], []
        for finer, level in pairwise(LEVELS):
            closed = level.start_of(now)  # the buckets of this level starting before it are whole
            since = self._summed[level.step]
            if since is None:  # nothing kept yet: from the first finer bucket on
                since = self._summed[level.step] = level.start_of(minute.start) if minute else None
            if since is not None and since < closed:
                sums.append((level.step, level.length, finer.step, since, closed))
                self._summed[level.step] = closed
                if level is LEVELS[-1]:  # once an hour: series not seen for a ring's span go
                    prune = [(each.step, each.start_of(now) - each.seconds) for each in LEVELS]
        if rows or sums:
            self.store.add_use_buckets(rows, sums, prune)

    def read(self, span: str, uids: Collection[int] | None, now: float) -> Trace:
        """The span's buckets up to the minute being counted (or `now`'s when none is), the users'
        of `uids` only (None: everyone's)."""
        level = level_of(span)
        minute = self._minute.start if self._minute is not None else MINUTE.start_of(now)
        last = level.start_of(minute)
        starts = [last - level.step * i for i in reversed(range(level.length))]
        buckets: dict[int, dict[Key, Stats]] = {}
        for kind, key, start, *sums in self.store.use_buckets(level.step, starts[0], last, uids):
            buckets.setdefault(start, {})[(kind, key)] = Stats(*sums)
        # The last bucket, still filling: the finer rings' buckets in it, then the minute counted.
        partial: dict[Key, Stats] = {}
        since = last
        for finer in reversed(LEVELS[:LEVELS.index(level)]):
            until = finer.start_of(minute)
            for kind, key, _, *sums in self.store.use_buckets(finer.step, since, until, uids):
                partial.setdefault((kind, key), Stats()).merge(Stats(*sums))
            since = until
        if self._minute is not None:
            for (kind, key), stats in self._minute.series.items():
                if kind != USER or uids is None or key in uids:
                    partial.setdefault((kind, key), Stats()).merge(stats)
        if partial:
            buckets[last] = partial
        ticks = [buckets.get(start, {}).get((TICKS, 0), Stats()).n for start in starts]
        return Trace(level.step, starts, ticks, series(buckets, starts))


def _round(value: float | None, digits: int | None = None) -> float | int | None:
    if value is None:
        return None
    return round(value) if digits is None else round(value, digits)
