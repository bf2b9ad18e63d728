"""Usage accounting: seconds granted, busy and idle per user, GPU and hour, kept in memory and
written to the store once a minute (the report flushes first, so it includes the last tick)."""
from __future__ import annotations

import time
from collections.abc import Callable

from gpuguard.core import rules
from gpuguard.services.store import Store, hour_of

USAGE_FLUSH_EVERY = 60.0  # seconds of usage accounting kept in memory before it is written


class UsageMeter:
    def __init__(self, store: Store, name_of: Callable[[int], str]):
        self.store = store
        self.name_of = name_of  # uid -> user name, without waiting for NSS (lookups.KnownAccounts)
        self._usage: dict[tuple[int, int, int], list[float]] = {}  # (hour, uid, unit) -> [granted, busy, idle]
        self._flushed = time.monotonic()

    def add(self, view: rules.View, seconds: float, now: float) -> None:
        """What `view` shows for `seconds` up to `now`, counted in the hour of `now` (nothing for
        no seconds: a replay checks again at the same moment, and between its events no time passes
        unobserved)."""
        if seconds > 0:
            for (uid, unit), added in rules.usage(view, seconds).items():
                totals = self._usage.setdefault((hour_of(now), uid, unit), [0.0, 0.0, 0.0])
                for i, value in enumerate(added):
                    totals[i] += value
        if time.monotonic() - self._flushed >= USAGE_FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        for (hour, uid, unit), (granted, busy, idle) in self._usage.items():
            self.store.add_usage(uid, self.name_of(uid), unit, hour, granted=granted, busy=busy, idle=idle)
        self._usage.clear()
        self._flushed = time.monotonic()
