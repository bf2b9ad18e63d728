"""The daemon's log lines: `gpuguard level=info event=grant user=alice gpus=3`.

One `key=value` line per event on stderr (the journal under systemd adds time and unit),
so that admins can grep and machines can parse them. Values with spaces are quoted.
An exception's traceback goes on the same line, its newlines escaped as \\n.

When stderr is the journal ($JOURNAL_STREAM names stderr's device and inode, as systemd sets
it), each line starts with its sd-daemon(3) priority, `<3>` for an error, so `journalctl -p err`
shows gpuguard's errors; a traceback then goes on a line of its own at debug priority (`<7>`),
whole, so the error line stays short and the traceback is still one journal entry.
"""
from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import TextIO

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
    return " ".join(f"{key}={_value(value)}" for key, value in fields.items() if value is not None)


def _value(value: object) -> str:
    if isinstance(value, (list, tuple, set, frozenset)):
        value = ",".join(str(v) for v in value)
    text = str(value)
    if not text or any(c in text for c in ' "=\n'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def event(level: int, name: str, /, exc_info: bool = False, **fields: object) -> None:
    """Log one event: `event("grant", user="alice", gpus=[3])` -> `event=grant user=alice gpus=3`."""
    logger.log(level, "%s", pairs(event=name, **fields), exc_info=exc_info, extra={"event_name": name})


def setup(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter() if stderr_is_journal() else KeyValueFormatter())
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
