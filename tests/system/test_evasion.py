"""What a user trying to evade the watcher runs, against a real daemon: each stopped within its bound.

The hostile workloads are tests/hostile_procs.py, real processes of a real user registered in the
simulated NVML. Bounds are deadlines on waits (grace + kill_wait + a few intervals + a margin for a
busy machine), never timing assertions; what is asserted is who got which signal.
"""
from __future__ import annotations

import signal
from pathlib import Path

import pytest
from test_watcher import GRACE, INTERVAL, KILL_WAIT, MARGIN, WATCHER, events, session_gpu

from devtools.harness import wait_for

pytestmark = pytest.mark.gate

HOSTILE = Path(__file__).with_name("hostile_procs.py")
BOUND = INTERVAL + GRACE + KILL_WAIT + 4 * INTERVAL + MARGIN  # the documented bound, plus slack




def terms(d, user, rule: str) -> list[dict]:
    return events(d, user, rule=rule, action="term")


def test_decoys_newer_than_the_big_job_never_shield_it(start_daemon, burns, hostile):
    d = start_daemon(defaults={"gpus": 1, "gpu_memory": "4GiB"}, watcher=WATCHER)
    alice = d.add_member()
    minor = session_gpu(d, alice)
    big = burns(d.config_path, minor, "6GiB", user=alice)
    # Three 1 MiB processes, always newer than the big one, replaced faster than the watcher samples.
    hostile(alice, "decoys", d.device_dir, minor, "--life", INTERVAL * 2, "--keep", 3)
    assert big.wait(timeout=BOUND) == -signal.SIGTERM
    assert {e["pid"] for e in terms(d, alice, "memory")} == {big.pid}


def test_a_big_job_forking_faster_than_the_watcher_samples_is_stopped(start_daemon, hostile):
    d = start_daemon(defaults={"gpus": 1, "gpu_memory": "4GiB"}, watcher=WATCHER)
    alice = d.add_member()
    minor = session_gpu(d, alice)
    # 6 GiB itself, and children of 512 MiB that live half an interval: no two samples see the
    # same children, so neither warning nor signal may depend on which of them a sample shows.
    forker = hostile(alice, "forker", d.device_dir, minor, "6GiB", "--life", INTERVAL / 2, "--keep", 3)
    assert forker.wait(timeout=BOUND) == -signal.SIGTERM
    assert forker.pid in {e["pid"] for e in terms(d, alice, "memory")}


def test_memory_split_across_processes_loses_just_enough_of_them(start_daemon, hostile):
    d = start_daemon(defaults={"gpus": 1, "gpu_memory": "4GiB"}, watcher=WATCHER)
    alice = d.add_member()
    minor = session_gpu(d, alice)
    hostile(alice, "split", d.device_dir, minor, "1GiB", "--keep", 10)   # 10 GiB in ten processes
    assert wait_for(lambda: len(terms(d, alice, "memory")) >= 6, timeout=BOUND), events(d, alice)
    # The remaining four fit the quota: the episode is over, nobody else is signalled.
    assert wait_for(lambda: d.call("status")["gpus"][minor]["processes"] == 4, timeout=BOUND)
    assert len(terms(d, alice, "memory")) == 6


def test_rotating_strays_shorter_than_grace_are_stopped(start_daemon, hostile):
    d = start_daemon(defaults={"gpus": 1}, watcher=WATCHER)
    alice, bob = d.add_member(), d.add_member()
    minor = session_gpu(d, alice)
    # bob holds no grant on alice's GPU; each of his processes lives under half of grace.
    hostile(bob, "rotate", d.device_dir, minor, "--life", GRACE / 3)
    stopped = wait_for(lambda: terms(d, bob, "stray"), timeout=BOUND)
    assert stopped, events(d, bob)
    warnings = events(d, bob, rule="stray", action="warn")
    assert len(warnings) == 1 and warnings[0]["pid"] not in {e["pid"] for e in stopped}
