"""The watcher's pure decisions about GPUs whose processes could not be read (View.failed)."""
from __future__ import annotations

from dataclasses import replace

from gpuguard.core import rules
from gpuguard.core.model import Grant, Quota
from gpuguard.core.rules import KILL, MEMORY, RELEASE, REVOKE, STRAY, TERM, TIME, WARN, Proc, State, Timing, View

GiB = 1 << 30
ALICE, BOB = 1001, 1002
T = Timing(grace=30.0, kill_wait=10.0)
NOW = 100_000.0
QUOTA = Quota(gpu_memory=4 * GiB, idle_timeout=600.0)


def grant(uid: int, unit: int, expires_at: float | None = None, last_active: float = NOW - 3600) -> Grant:
    return Grant(uid, f"u{uid}", unit, NOW - 7200, expires_at, last_active)


def view(procs, grants, failed=()) -> View:
    return View(procs, grants, {g.uid: QUOTA for g in grants}, (), failed)


def test_nothing_is_decided_about_a_failed_gpu():
    over_1 = Proc(11, ALICE, 110, 1, 6 * GiB)
    grants = [grant(ALICE, 1), grant(BOB, 2, expires_at=NOW - 1), grant(BOB, 3)]  # 2 expired, 3 idle for an hour
    actions = rules.decide(view([over_1], grants, failed={2, 3}), State(), NOW, T)
    assert [(a.kind, a.rule, a.unit) for a in actions] == [(WARN, MEMORY, 1)]
    readable = rules.decide(view([over_1], grants), State(), NOW, T)  # control: the same, all read
    assert {(a.kind, a.rule, a.unit) for a in readable} == {(WARN, MEMORY, 1), (REVOKE, TIME, 2), (RELEASE, "idle", 3)}


def test_what_is_known_about_a_failed_gpu_is_kept_and_its_idle_clock_restarts():
    stopping = Proc(21, BOB, 210, 2, 6 * GiB)
    stray = Proc(22, ALICE, 220, 2, GiB)
    grants = [grant(BOB, 2)]
    state = State(over={(BOB, 2): NOW - 100}, stray={(ALICE, 2): rules.StrayEpisode(NOW - 100, NOW - 100)},
                  stopping={stopping.key: rules.Stopping(BOB, 2, MEMORY, NOW - 5)})
    blind = rules.advance(view([], grants, failed={2}), state, [], NOW)
    assert (blind.over, blind.stray, blind.stopping) == (state.over, state.stray, state.stopping)
    assert blind.seen == {(BOB, 2): NOW}  # not seen while unread is no evidence of idleness
    # Read again: the episode goes on where it was (SIGKILL after kill_wait, no second SIGTERM) ...
    later = NOW + 10
    actions = rules.decide(view([stopping, stray], grants), blind, later, T)
    assert [(a.kind, a.proc.pid) for a in actions] == [(KILL, 21), (TERM, 22)]
    assert all(a.rule in (MEMORY, STRAY) for a in actions)
    # ... and the grant is not released as idle at once.
    assert rules.decide(view([], grants), replace(blind, stopping={}), later, T) == []


def test_a_failed_gpu_counts_granted_time_only():
    grants = [grant(ALICE, 1), grant(BOB, 2)]
    assert rules.usage(view([], grants, failed={2}), 10.0) == {(ALICE, 1): (10.0, 0.0, 10.0), (BOB, 2): (10.0, 0.0, 0.0)}
