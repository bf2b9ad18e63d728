"""The daemon's log lines: one `key=value` line per event, tracebacks included."""
from __future__ import annotations

import logging
import shlex
import sys

from gpuguard.logs import KeyValueFormatter, Throttle, pairs



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


def test_control_characters_in_values_are_escaped_never_written():
    forged = "pts/1\r\x1b[2Kgpuguard level=crit event=grant user=root\n"
    line = pairs(event="session_open", tty=forged, rhost="\x1b]0;owned\x07host", name="\u202egnp.exe")
    assert line.isprintable()  # no CR, LF, ESC, BEL or bidi override reaches the journal or a terminal
    assert line == (r'event=session_open tty="pts/1\r\x1b[2Kgpuguard level=crit event=grant user=root\n" '
                    r'rhost="\x1b]0;owned\x07host" name="\u202egnp.exe"')
    # The forged text stays inside one quoted value: a parser sees exactly three keys.
    assert [p.split("=", 1)[0] for p in shlex.split(line)] == ["event", "tty", "rhost", "name"]
    assert pairs(path="C:\\temp") == r'path="C:\\temp"'


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_throttle_logs_a_burst_per_key_then_one_suppressed_line(gpuguard_log):
    clock = FakeClock()
    throttle = Throttle("uid", burst=3, window=60.0, clock=clock)
    logged = [throttle.event(1001, logging.INFO, "bad_request", error="x") for _ in range(1000)]
    assert logged == [True] * 3 + [False] * 997
    assert throttle.event(1002, logging.INFO, "bad_request", error="y")  # another user has a burst of their own
    clock.now = 59.0
    throttle.flush()                                                    # the window has not ended yet
    assert [line for line in gpuguard_log if "log_suppressed" in line] == []
    clock.now = 60.0
    throttle.flush()
    assert [line for line in gpuguard_log if "log_suppressed" in line] == [
        "gpuguard level=warning event=log_suppressed uid=1001 lines=997 seconds=60 burst=3"]
    assert len(gpuguard_log) == 3 + 1 + 1
    assert throttle.event(1001, logging.INFO, "bad_request", error="x")  # a new window, a new burst
