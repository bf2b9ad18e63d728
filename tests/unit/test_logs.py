"""The daemon's log lines: one `key=value` line per event, tracebacks included."""
from __future__ import annotations

import io
import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import NoReturn

import pytest

from devtools.harness import log_lines
from gpuguard import logs
from gpuguard.logs import JournalFormatter, KeyValueFormatter, Throttle, pairs, stderr_is_journal


def failing_step() -> NoReturn:
    raise KeyError("gpu 3")


def test_values_with_spaces_quotes_and_newlines_stay_on_one_line():
    assert pairs(event="grant", user="alice", gpu=[1, 3], note=None) == "event=grant user=alice gpu=1,3"
    assert pairs(error='a "b"\nc') == r'error="a \"b\"\nc"'


def test_times_are_iso_not_epoch_floats(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        assert pairs(event="grant", expires_at=1796135696.328396, since=5.5) == (
            "event=grant expires_at=2026-12-01T14:34:56+0000 since=5.5")
    finally:
        monkeypatch.undo()
        time.tzset()


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


@pytest.fixture
def gpuguard_log() -> Iterator[list[str]]:
    with log_lines() as lines:
        yield lines


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


def record_of_failure() -> logging.LogRecord:
    try:
        failing_step()
    except KeyError:
        return logging.LogRecord("gpuguard", logging.ERROR, __file__, 1, "%s", ("event=tick_failed",),
                                 exc_info=sys.exc_info())


def test_journal_lines_carry_their_priority_and_the_traceback_goes_whole_on_a_debug_line():
    formatter = JournalFormatter()
    for level, prefix in [(logging.DEBUG, "<7>"), (logging.INFO, "<6>"), (logging.WARNING, "<4>"),
                          (logging.ERROR, "<3>"), (logging.CRITICAL, "<2>")]:
        record = logging.LogRecord("gpuguard", level, __file__, 1, "%s", ("event=grant user=alice",), None)
        assert formatter.format(record) == f"{prefix}gpuguard level={logging.getLevelName(level).lower()} " \
                                           "event=grant user=alice"
    record = record_of_failure()
    record.event_name = "tick_failed"
    error, trace = formatter.format(record).split("\n")  # exactly two journal entries
    assert error == "<3>gpuguard level=error event=tick_failed exception=\"KeyError: 'gpu 3'\""
    assert trace.startswith('<7>gpuguard level=debug event=traceback of=tick_failed traceback="Traceback')
    assert "in failing_step" in trace and r"\n" in trace


def test_stderr_is_the_journal_only_when_journal_stream_names_its_device_and_inode(tmp_path):
    with open(tmp_path / "stream", "w") as stream, open(tmp_path / "other", "w") as other:
        status, elsewhere = os.fstat(stream.fileno()), os.fstat(other.fileno())
        assert stderr_is_journal(stream, {"JOURNAL_STREAM": f"{status.st_dev}:{status.st_ino}"})
        assert not stderr_is_journal(stream, {"JOURNAL_STREAM": f"{elsewhere.st_dev}:{elsewhere.st_ino}"})
        assert not stderr_is_journal(stream, {})
        assert not stderr_is_journal(stream, {"JOURNAL_STREAM": "garbage"})
    assert not stderr_is_journal(io.StringIO(), {"JOURNAL_STREAM": "1:2"})


def test_the_daemon_logging_picks_the_journal_format_from_its_real_stderr(tmp_path):
    code = ("import logging\nfrom gpuguard import logs\nlogs.setup()\n"
            "logs.event(logging.ERROR, 'reload_failed', error='bad file')\nlogs.event(logging.INFO, 'ready')\n")
    lines = {}
    for mode in ("journal", "plain"):
        path = tmp_path / mode
        path.touch()
        status = os.stat(path)
        env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
        if mode == "journal":
            env["JOURNAL_STREAM"] = f"{status.st_dev}:{status.st_ino}"
        with open(path, "w") as stderr:
            subprocess.run([sys.executable, "-c", code], stderr=stderr, env=env, check=True)
        lines[mode] = path.read_text().splitlines()
    assert lines["journal"] == ['<3>gpuguard level=error event=reload_failed error="bad file"',
                                "<6>gpuguard level=info event=ready"]
    assert lines["plain"] == ['gpuguard level=error event=reload_failed error="bad file"',
                              "gpuguard level=info event=ready"]


def test_an_event_below_the_level_is_not_built_and_one_at_it_is_logged():
    built = []

    class Field:
        def __str__(self) -> str:
            built.append(1)
            return "3"

    gpuguard_logger = logging.getLogger("gpuguard")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    level = gpuguard_logger.level
    gpuguard_logger.addHandler(handler)
    try:
        gpuguard_logger.setLevel(logging.WARNING)
        logs.event(logging.INFO, "grant", gpu=Field())
        assert built == [] and stream.getvalue() == ""
        gpuguard_logger.setLevel(logging.INFO)
        logs.event(logging.INFO, "grant", gpu=Field())
        assert built == [1] and stream.getvalue() == "event=grant gpu=3\n"
    finally:
        gpuguard_logger.removeHandler(handler)
        gpuguard_logger.setLevel(level)
