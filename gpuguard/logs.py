"""The daemon's log lines: `gpuguard level=info event=grant user=alice gpu=3 expires_at=2026-12-01T18:56:00+0100`.

One `key=value` line per event on stderr (the journal under systemd adds time and unit),
so that admins can grep and machines can parse them. Values with spaces, quotes, `=` or
backslashes are quoted, and every control character in a value is escaped (`\\r`, `\\x1b`):
a value a user chose (a PAM TTY, a process name) can never start a line of its own, pose as
another key, or send escape sequences to an admin's terminal. An exception's traceback goes
on the same line, its newlines escaped as \\n.

Log lines a client can cause (bad requests, refused connections) go through a Throttle, so
that a flood of them costs a few lines per user and a count, not the journal's rate limit.

When stderr is the journal ($JOURNAL_STREAM names stderr's device and inode, as systemd sets
it), each line starts with its sd-daemon(3) priority, `<3>` for an error, so `journalctl -p err`
shows gpuguard's errors; a traceback then goes on a line of its own at debug priority (`<7>`),
whole, so the error line stays short and the traceback is still one journal entry.
"""
from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, TextIO

from gpuguard.core.escape import printable

logger = logging.getLogger("gpuguard")


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = _head(record)
        if exc := _exception_of(record):
            # One line per event: the traceback's newlines are escaped like any value's.
            line += " " + pairs(exception=_summary(exc), traceback=_traceback(exc))
        return line


class JournalFormatter(logging.Formatter):
    """The same lines with sd-daemon priority prefixes; a traceback on a debug line of its own."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"<{_priority(record.levelno)}>{_head(record)}"
        if exc := _exception_of(record):
            line += " " + pairs(exception=_summary(exc))
            line += f"\n<{_priority(logging.DEBUG)}>gpuguard level=debug " + pairs(
                event="traceback", of=getattr(record, "event_name", None), traceback=_traceback(exc))
        return line


def _head(record: logging.LogRecord) -> str:
    return f"gpuguard level={record.levelname.lower()} {record.getMessage()}"


def _exception_of(record: logging.LogRecord) -> BaseException | None:
    return record.exc_info[1] if record.exc_info else None


def _summary(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _traceback(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))


def _priority(level: int) -> int:
    """syslog(3) priority of a logging level: 2 crit, 3 err, 4 warning, 6 info, 7 debug."""
    return next((priority for bound, priority in _PRIORITIES if level >= bound), 7)


def stderr_is_journal(stream: TextIO | None = None, environ: dict[str, str] | None = None) -> bool:
    """Whether `stream` (stderr) is the journal stream systemd connected: $JOURNAL_STREAM is
    "DEVICE:INODE" of it. A stderr redirected since (a pipe, a file) no longer matches."""
    stream = stream or sys.stderr
    device, _, inode = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "").partition(":")
    try:
        status = os.fstat(stream.fileno())
    except (OSError, ValueError):  # no descriptor (closed, or a StringIO)
        return False
    return device.isdigit() and inode.isdigit() and (status.st_dev, status.st_ino) == (int(device), int(inode))


def pairs(**fields: object) -> str:
    """`key=value ...`; a time (a key ending in `_at`, epoch seconds) as local ISO 8601 to the second."""
    return " ".join(f"{key}={_iso(value) if key.endswith('_at') else _value(value)}"
                    for key, value in fields.items() if value is not None)


def _iso(value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _value(value)
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(value))


def _value(value: object) -> str:
    if isinstance(value, (list, tuple, set, frozenset)):
        value = ",".join(str(v) for v in value)
    text = str(value)
    if not text or any(c in text for c in ' "=\\') or not text.isprintable():
        return '"' + printable(text.replace("\\", "\\\\").replace('"', '\\"')) + '"'
    return text


def event(level: int, name: str, /, exc_info: bool = False, **fields: object) -> None:
    """Log one event: `event("grant", user="alice", gpu=[3])` -> `event=grant user=alice gpu=3`
    (`gpu=` names GPUs, `gpus=` counts them)."""
    if logger.isEnabledFor(level):  # the line is not built for nobody (a replay logs no INFO)
        logger.log(level, "%s", pairs(event=name, **fields), exc_info=exc_info, extra={"event_name": name})


def setup(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter() if stderr_is_journal() else KeyValueFormatter())
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
            named: dict[str, Any] = {self.key: key}
            event(logging.WARNING, "log_suppressed", **named, lines=window.suppressed,
                  seconds=round(self.clock() - window.start), burst=self.burst)
