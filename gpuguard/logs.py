"""The daemon's log lines: `gpuguard level=info event=grant user=alice gpus=3`.

One `key=value` line per event on stderr (the journal under systemd adds time and unit),
so that admins can grep and machines can parse them. Values with spaces are quoted.
An exception's traceback goes on the same line, its newlines escaped as \\n.
"""
from __future__ import annotations

import logging
import sys
import traceback

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
    if not text or any(c in text for c in ' "=\n'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
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
