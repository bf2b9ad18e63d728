"""The daemon's log lines: `gpuguard level=info event=grant user=alice gpus=3`.

One `key=value` line per event on stderr (the journal under systemd adds time and unit),
so that admins can grep and machines can parse them. Values with spaces, quotes, `=` or
backslashes are quoted, and every control character in a value is escaped (`\\r`, `\\x1b`):
a value a user chose (a PAM TTY, a process name) can never start a line of its own, pose as
another key, or send escape sequences to an admin's terminal. An exception's traceback goes
on the same line, its newlines escaped as \\n.

Log lines a client can cause (bad requests, refused connections) go through a Throttle, so
that a flood of them costs a few lines per user and a count, not the journal's rate limit.
"""
from __future__ import annotations

import logging
import sys
import time
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from gpuguard.messages import printable

logger = logging.getLogger("gpuguard")


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"gpuguard level={record.levelname.lower()} {record.getMessage()}"
        if record.exc_info:
            # One line per event: the traceback's newlines are escaped like any value's.
            kind, exc, trace = record.exc_info
            line += " " + pairs(exception=f"{kind.__name__}: {exc}",
                                traceback="".join(traceback.format_exception(kind, exc, trace)).rstrip())
        return line


def pairs(**fields: object) -> str:
    return " ".join(f"{key}={_value(value)}" for key, value in fields.items() if value is not None)


def _value(value: object) -> str:
    if isinstance(value, (list, tuple, set, frozenset)):
        value = ",".join(str(v) for v in value)
    text = str(value)
    if not text or any(c in text for c in ' "=\\') or not text.isprintable():
        return '"' + printable(text.replace("\\", "\\\\").replace('"', '\\"')) + '"'
    return text


def event(level: int, name: str, /, exc_info: bool = False, **fields: object) -> None:
    """Log one event: `event("grant", user="alice", gpus=[3])` -> `event=grant user=alice gpus=3`."""
    logger.log(level, "%s", pairs(event=name, **fields), exc_info=exc_info)


def setup(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False


@dataclass
class _Window:
    start: float
    logged: int = 0
    suppressed: int = 0


class Throttle:
    """At most `burst` log lines per key (a uid) in each `window` seconds; the lines over that
    are counted instead, and one `event=log_suppressed` line per key and window tells how many:
    at the key's first line after its window, or at flush(), which the owner calls every window."""

    def __init__(self, key: str, burst: int = 10, window: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.key, self.burst, self.window, self.clock = key, burst, window, clock
        self._windows: dict[Hashable, _Window] = {}

    def event(self, key: Hashable, level: int, name: str, /, exc_info: bool = False, **fields: object) -> bool:
        """Log like event() unless key is over its burst in this window; whether it was logged."""
        now = self.clock()
        window = self._windows.get(key)
        if window is None or now - window.start >= self.window:
            if window is not None:
                self._summary(key, window)
            window = self._windows[key] = _Window(now)
        if window.logged >= self.burst:
            window.suppressed += 1
            return False
        window.logged += 1
        event(level, name, exc_info=exc_info, **{self.key: key}, **fields)
        return True

    def flush(self) -> None:
        """Sum up and forget the windows that have ended (so the table holds active keys only)."""
        now = self.clock()
        for key, window in list(self._windows.items()):
            if now - window.start >= self.window:
                self._summary(key, window)
                del self._windows[key]

    def _summary(self, key: Hashable, window: _Window) -> None:
        if window.suppressed:
            event(logging.WARNING, "log_suppressed", **{self.key: key}, lines=window.suppressed,
                  seconds=round(self.clock() - window.start), burst=self.burst)
