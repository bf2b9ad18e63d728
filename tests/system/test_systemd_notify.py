"""What the daemon tells systemd (Type=notify): READY=1 with a STATUS= line, STATUS= after a reload,
WATCHDOG=1 pings while WatchdogSec= is set, STOPPING=1. (`gpuguard reload`, the unit's
ExecReload=, failing for a broken config: test_daemon.) The fixture's NOTIFY_SOCKET stands in for systemd.
"""
from __future__ import annotations

import os

import pytest

from devtools.harness import wait_for
from gpuguard.backends.systemd import watchdog_period


def test_watchdog_period_is_half_the_timeout_and_only_for_its_own_process() -> None:
    assert watchdog_period({"WATCHDOG_USEC": "60000000"}) == 30.0
    assert watchdog_period({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": str(os.getpid())}) == 30.0
    assert watchdog_period({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "1"}, pid=2) is None
    assert watchdog_period({}) is None
    assert watchdog_period({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_period({"WATCHDOG_USEC": "soon"}) is None


@pytest.mark.gate
def test_ready_status_watchdog_and_stopping(start_daemon) -> None:
    d = start_daemon(env={"WATCHDOG_USEC": "200000"})
    notes = d.notifications()
    ready = notes.index("READY=1")
    assert notes[ready + 1].startswith("STATUS=serving 4 GPUs, 0 grants, gate ggt-"), notes
    assert any(note.startswith("STATUS=starting") for note in notes[:ready])
    assert wait_for(lambda: d.notifications().count("WATCHDOG=1") >= 3)

    d.open_session(d.add_member())
    d.reload()
    assert [n for n in d.notifications() if n.startswith("STATUS=")][-1].startswith("STATUS=serving 4 GPUs, 1 grants")
    assert d.stop() == 0
    assert "STOPPING=1" in d.notifications()


@pytest.mark.gate
def test_no_watchdog_pings_unless_systemd_asks(start_daemon) -> None:
    d = start_daemon()  # the test run's own environment has no WATCHDOG_USEC
    assert "WATCHDOG_USEC" not in os.environ
    d.reload()  # a round trip: the loop has turned since READY=1
    assert "WATCHDOG=1" not in d.notifications()

