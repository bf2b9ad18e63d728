"""The daemon's log lines: `gpuguard level=info event=grant user=alice gpus=3`.

One `key=value` line per event on stderr (the journal under systemd adds time and unit),
so that admins can grep and machines can parse them. Values with spaces are quoted.
"""
from __future__ import annotations

import logging
import sys

logger = logging.getLogger("gpuguard")


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"gpuguard level={record.levelname.lower()} {record.getMessage()}"
        if record.exc_info:
            # A traceback spans lines; keep the log one line per event and name the exception.
            line += " " + pairs(exception=f"{record.exc_info[0].__name__}: {record.exc_info[1]}")
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
