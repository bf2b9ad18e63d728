"""Limits that hold against a user who gives GPUs back and asks again, end to end: a real daemon,
real users, real `gpuguard sim burn` processes, the CLI as the user runs it.

- idle_timeout counts from the last use: `release` then `request` gets a grant whose idle clock
  starts where the last one stopped (policy.idle_since);
- right after a time limit's revoke, `request` is refused with the cool-down, others are served
  meanwhile, and `request --wait` is served once the cool-down (reclaim_after) is over.

Every wait is a poll with a generous deadline; the checks read the times the daemon recorded.
"""
from __future__ import annotations

import json
import time

import pytest
from sim_helpers import stop_burn
from test_watcher import MARGIN, WATCHER, await_tick_done_after, events, session_gpu, whoami_json

from devtools.harness import wait_for

pytestmark = pytest.mark.gate


def test_release_and_request_do_not_restart_the_idle_clock(start_daemon, burns):
    idle = 10.0  # long enough for the release and the request to come before it, on a busy machine
    d = start_daemon(defaults={"gpus": 1}, watcher=WATCHER)
    alice = d.add_member()
    minor = session_gpu(d, alice)
    proc = burns(d.config_path, minor, "1GiB", user=alice)
    d.write_config(defaults={"gpus": 1, "idle_timeout": f"{idle}s"}, watcher=WATCHER)
    d.reload()
    await_tick_done_after(d, time.time(), timeout=MARGIN)  # the burn was seen with the limit in force
    stop_burn(proc)
    released = d.cli_as(alice, "release")
    assert released.returncode == 0, released.stderr
    asked = time.time()
    requested = d.cli_as(alice, "request", "--json")
    assert requested.returncode == 0, requested.stderr
    assert len(json.loads(requested.stdout)["gpus"]) == 1
    [grant] = whoami_json(d, alice)["grants"]
    assert grant["last_active"] < asked <= grant["granted_at"], grant  # idle since the burn ended, not since asked
    found = wait_for(lambda: events(d, alice, kind="release", rule="idle"), timeout=idle + MARGIN)
    assert found, whoami_json(d, alice)
    assert found[0]["time"] >= grant["last_active"] + idle and whoami_json(d, alice)["grants"] == []


def test_a_request_right_after_a_time_limit_waits_out_a_cool_down(start_daemon):
    cool = 4.0
    d = start_daemon(count=1, defaults={"gpus": 1, "max_time": "2s", "reclaim_after": f"{cool}s"}, watcher=WATCHER)
    alice, bob = d.add_member(), d.add_member()
    first = d.cli_as(alice, "request", "--json")
    assert first.returncode == 0, first.stderr
    revoked = wait_for(lambda: events(d, alice, kind="revoke", rule="time"), timeout=2 + MARGIN)
    assert revoked, whoami_json(d, alice)
    revoked_at = revoked[0]["time"]
    again = d.cli_as(alice, "request")
    assert again.returncode != 0 and "cool-down" in again.stderr, (again.returncode, again.stderr)
    assert whoami_json(d, alice)["grants"] == [] and d.call("status").get("queue", []) == []
    # The GPU is not held back from the others meanwhile.
    theirs = d.cli_as(bob, "request", "--json")
    assert theirs.returncode == 0 and json.loads(theirs.stdout)["gpus"] == [0], theirs.stderr
    assert d.cli_as(bob, "release").returncode == 0
    waited = d.cli_as(alice, "request", "--wait", "--json", timeout=cool + MARGIN)
    assert waited.returncode == 0, waited.stderr
    [grant] = whoami_json(d, alice)["grants"]
    assert grant["granted_at"] >= revoked_at + cool, (grant, revoked_at)
