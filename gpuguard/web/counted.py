"""Log lines for what anyone can send as often as they like (a login while delayed, a malformed
request): the first one at once, then at most one a minute, with how many came since. The
journal's cost is bounded however fast the requests come."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gpuguard.logs import event

EVERY = 60.0


class Counted:
    def __init__(self, name: str, level: int = logging.WARNING, every: float = EVERY,
                 clock: Callable[[], float] = time.monotonic):
        self.name, self.level, self.every, self.clock = name, level, every, clock
        self.total = 0
        self._since = 0
        self._logged = float("-inf")

    def add(self, **fields: object) -> None:
        """Count one; log a line (with this one's fields) when the last is `every` old."""
        self.total += 1
        self._since += 1
        now = self.clock()
        if now - self._logged >= self.every:
            event(self.level, self.name, False, count=self._since, total=self.total, **fields)
            self._since = 0
            self._logged = now
