"""The daemon's log lines: one `key=value` line per event, tracebacks included."""
from __future__ import annotations

import logging
import sys

from gpuguard.logs import KeyValueFormatter, pairs


def failing_step() -> None:
    raise KeyError("gpu 3")


def test_values_with_spaces_quotes_and_newlines_stay_on_one_line():
    assert pairs(event="grant", user="alice", gpus=[1, 3], note=None) == "event=grant user=alice gpus=1,3"
    assert pairs(error='a "b"\nc') == r'error="a \"b\"\nc"'


def test_an_exception_keeps_its_traceback_on_the_same_line():
    try:
        failing_step()
    except KeyError:
        record = logging.LogRecord("gpuguard", logging.ERROR, __file__, 1, "%s", ("event=tick_failed",),
                                   exc_info=sys.exc_info())
    line = KeyValueFormatter().format(record)
    assert "\n" not in line
    assert line.startswith("gpuguard level=error event=tick_failed exception=\"KeyError: 'gpu 3'\" traceback=\"")
    # where it failed, not just what: the frames, with newlines escaped
    assert r"Traceback (most recent call last):\n" in line
    assert "in failing_step" in line and r'raise KeyError(\"gpu 3\")' in line
