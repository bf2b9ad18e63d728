"""`gpuguard status`, `report` and `events` end to end: a real daemon, real users, the real CLI
(plain when piped, colour on a terminal), and who may read whose records (SO_PEERCRED)."""
from __future__ import annotations

import csv
import errno
import json
import os
import subprocess

import pytest
from conftest import PYTHON, run_as
from sim_helpers import GiB, burn, gpuguard

from devtools.harness import wait_for

pytestmark = pytest.mark.gate


def on_a_terminal(d, *args: str, **env: str) -> str:
    """The output of `gpuguard ARGS` (as root) with its stdout a pseudo-terminal."""
    master, slave = os.openpty()
    base = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    with subprocess.Popen(gpuguard(d.config_path, *args), stdout=slave, stderr=slave, stdin=subprocess.DEVNULL,
                          env={**base, "TERM": "xterm", "LANG": "C.UTF-8", **env}) as proc:
        os.close(slave)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError as exc:  # EIO: the terminal's other end closed
                assert exc.errno == errno.EIO
                break
            if not chunk:
                break
            chunks.append(chunk)
        os.close(master)
        assert proc.wait(30) == 0
    return b"".join(chunks).decode()


def test_status_shows_memory_against_the_quota_processes_and_time_left(start_daemon):
    d = start_daemon(defaults={"gpus": 1, "gpu_memory": "4GiB", "max_time": "2h"})
    alice, bob = d.add_member(), d.add_member()
    (minor,) = d.open_session(alice)["gpus"]
    (other,) = d.open_session(bob)["gpus"]
    with burn(d.config_path, minor, "3GiB", user=alice) as proc:
        wait_for(lambda: {g["minor"]: g for g in d.call("status")["gpus"]}[minor]["processes"] == 1)
        shown = d.cli_as(bob, "status")
        assert shown.returncode == 0, shown.stderr
        assert "\033" not in shown.stdout and "#" in shown.stdout  # piped: plain, ASCII bars
        lines = shown.stdout.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith(f"GPU {minor} "))
        gpu_line, holder_line, process_line = lines[start:start + 3]
        assert "3GiB / 80GiB" in gpu_line and alice.name in gpu_line
        assert alice.name in holder_line and "3GiB of 4GiB quota" in holder_line and "1h59m left" in holder_line
        assert process_line.split()[:3] == [str(proc.pid), alice.name, "3GiB"] and "python" in process_line

        header, *rows = csv.reader(d.cli_as(bob, "status", "--csv").stdout.splitlines())
        assert header == ["gpu", "name", "uuid", "utilization_percent", "memory_used_bytes", "memory_total_bytes",
                          "holders", "processes", "time_left_seconds", "owner"]
        assert [row[0] for row in rows] == ["0", "1", "2", "3"]
        bare = list(csv.reader(d.cli_as(bob, "status", "--csv", "--no-header").stdout.splitlines()))
        # the same rows, less the header; time_left_seconds may have ticked down between the two calls
        assert [r[:8] + r[9:] for r in bare] == [r[:8] + r[9:] for r in rows]
        assert all(0 <= int(a[8] or 0) - int(b[8] or 0) <= 2 for a, b in zip(rows, bare, strict=True))
        row = rows[minor]
        assert row[4:8] == [str(3 * GiB), str(80 * GiB), alice.name, "1"]
        assert 0 < int(row[8]) <= 7200

        only = d.cli_as(bob, "status", "-u", alice.name).stdout
        assert f"GPU {minor} " in only and f"GPU {other} " not in only
        listed = json.loads(d.cli_as(alice, "status", "--json").stdout)
        (gpu,) = [g for g in listed["gpus"] if g["minor"] == minor]
        assert [(p["pid"], p["user"], p["memory"]) for p in gpu["process_list"]] == [(proc.pid, alice.name, 3 * GiB)]

        coloured = on_a_terminal(d, "status")
        assert "\033[" in coloured and "█" in coloured  # a terminal: colour and Unicode bars
        uncoloured = on_a_terminal(d, "status", NO_COLOR="1")
        assert "\033[" not in uncoloured and "█" in uncoloured


def test_report_and_events_root_sees_everyone_a_user_only_themself(start_daemon):
    d = start_daemon(defaults={"gpus": 1})
    alice, bob = d.add_member(), d.add_member()
    d.open_session(alice)
    d.open_session(bob)
    first = wait_for(lambda: d.call("status")["sampled_at"])
    wait_for(lambda: d.call("status")["sampled_at"] > first + 1.0)  # a few ticks counted
    # Usage is written once a minute; a report writes what the watcher has counted so far first.

    everyone = json.loads(d.cli("report", "--since", "1d", "--json").stdout)
    assert {r["key"] for r in everyone["rows"]} == {alice.name, bob.name}
    assert all(r["granted_seconds"] > 0 and r["idle_seconds"] == r["granted_seconds"] for r in everyone["rows"])
    table = d.cli("report", "--since", "1d", "--by", "gpu")
    assert table.returncode == 0 and table.stdout.splitlines()[1].split()[:2] == ["GPU", "GRANTED"]
    header, *lines = d.cli("report", "--since", "1d", "--csv").stdout.splitlines()
    assert header.startswith("user,gpu_hours_granted,gpu_hours_busy,gpu_hours_idle,busy_share") and len(lines) == 2

    own = json.loads(d.cli_as(alice, "report", "--since", "1d", "--json").stdout)
    assert [r["key"] for r in own["rows"]] == [alice.name]
    refused = d.cli_as(alice, "report", "--user", bob.name)
    assert refused.returncode == 1 and "only root" in refused.stderr

    mine = json.loads(d.cli_as(alice, "events", "--json").stdout)
    assert mine and {e["user"] for e in mine} == {alice.name} and "grant" in {e["kind"] for e in mine}
    bobs = json.loads(d.cli("events", "--user", bob.name, "--rule", "session", "--json").stdout)
    assert bobs and {(e["user"], e["kind"]) for e in bobs} == {(bob.name, "grant")}
    bad = d.cli("events", "--since", "last tuesday")
    assert bad.returncode == 2 and "not a time" in bad.stderr
    # words people use for a start, and refusals instead of a silently empty answer
    assert json.loads(d.cli("events", "--since", "today", "--json").stdout) == json.loads(
        d.cli("events", "--json").stdout)  # everything happened today
    assert d.cli("report", "--since", "yesterday", "--csv").returncode == 0
    assert d.cli("report", "--since", "monday", "--csv").returncode == 0
    unknown_rule = d.cli("events", "--rule", "memroy")
    assert (unknown_rule.returncode, unknown_rule.stderr.count("\n")) == (2, 1)
    assert unknown_rule.stderr.startswith("gpuguard: --rule: no rule 'memroy' (rules: memory, time,")
    nobody = d.cli("status", "-u", "ggt-nosuchuser")
    assert (nobody.returncode, nobody.stderr) == (
        2, "gpuguard: -u ggt-nosuchuser: no user named ggt-nosuchuser on this host; check the spelling\n")
    assert d.cli("events", "--user", "ggt-nosuchuser").returncode == 2
    # report --csv: a column for every rule, whether or not anything was stopped
    header = d.cli("report", "--since", "1d", "--csv").stdout.splitlines()[0]
    assert header.endswith(",kills_memory,kills_time,kills_idle,kills_stray,kills_reclaim")


FLOOD_REPORTS = """
import sys
from gpuguard import client
refused = []
for _ in range(30):
    try:
        client.call(sys.argv[1], "report" if len(refused) % 2 else "events", timeout=30, since=0.0)
    except client.Refused as exc:
        refused.append(str(exc))
print(len(refused), refused[0] if refused else "")
"""


def test_a_users_reports_are_rate_limited_and_roots_are_not(start_daemon):
    d = start_daemon(defaults={"gpus": 1})
    alice = d.add_member()
    d.open_session(alice)
    result = run_as(alice, [PYTHON, "-c", FLOOD_REPORTS, d.socket])
    assert result.returncode == 0, result.stderr
    count, reason = result.stdout.split(" ", 1)
    assert int(count) > 0 and reason.startswith("too many reports at once from your user; try again in"), result.stdout
    assert all(d.call("report", since=0.0)["ok"] for _ in range(30))  # root's (and the web view's) are not
