"""Scans: the walks of all of /proc that users' releases and logouts ask for go one at a time,
and so do the scans of one user's own processes; every request made while one runs shares the
next, never one under way. The scan itself is the daemon's (sampler.node_openers), tested on a
real /proc in tests/system/test_passed_holders.py; here a scan of made-up rows that waits for
the test."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Collection, Coroutine, Iterable
from typing import Any

import pytest

from gpuguard.core.sample import Opener
from gpuguard.services.scans import Scans

WAIT = 10.0  # seconds any step may take before the test gives up (never reached when it passes)


class Proc:
    """find_openers over made-up processes (pid, uid, unit), read as the call begins: each call
    recorded (its nodes; `walks`: those of everyone's, uids None) and, when `held(uids)`, held
    until `go` is set."""

    def __init__(self, rows: list[tuple[int, int, int]],
                 held: Callable[[Collection[int] | None], bool] = lambda uids: uids is None):
        self.rows = rows
        self.held = held
        self.calls: list[frozenset[int]] = []
        self.walks: list[frozenset[int]] = []
        self.go = threading.Event()

    def __call__(self, units: Iterable[int], uids: Collection[int] | None,
                 devices_of: Callable[[int], Iterable[tuple[int, int]]]) -> list[Opener]:
        seen, units = list(self.rows), set(units)  # what /proc holds as the scan reads it
        self.calls.append(frozenset(units))
        if uids is None:
            self.walks.append(frozenset(units))
        if self.held(uids):
            assert self.go.wait(WAIT)
        return [Opener(pid, uid, unit) for pid, uid, unit in seen if unit in units and (uids is None or uid in uids)]


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(int(WAIT / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never came true")


def _run(scans: Scans, proc: Proc, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    try:
        asyncio.run(asyncio.wait_for(main(), WAIT * 3))
    finally:  # no walk left waiting on the test, no pool left running
        proc.go.set()
        scans.close()


ROWS = [(100 + unit, 2000 + unit, unit) for unit in range(8)]  # one opener per GPU, of a uid of its own


def test_logouts_during_a_walk_share_the_next_one() -> None:
    proc = Proc(ROWS)
    scans = Scans(proc, devices_of=lambda unit: ())

    async def main() -> None:
        first = asyncio.ensure_future(scans.for_everyone({0}))
        await _until(lambda: len(proc.walks) == 1)
        # 14 logouts of 7 users while it runs, each asking about its own GPUs
        later = [asyncio.ensure_future(scans.for_everyone({1 + n % 7})) for n in range(14)]
        await asyncio.sleep(0.05)
        assert len(proc.walks) == 1  # none of them started a walk of its own
        proc.go.set()
        assert await first == [Opener(100, 2000, 0)]
        answers = await asyncio.gather(*later)
        # one more walk, of every node they asked about; each answered about its own only
        assert proc.walks == [frozenset({0}), frozenset(range(1, 8))]
        assert answers == [[Opener(101 + n % 7, 2001 + n % 7, 1 + n % 7)] for n in range(14)]

    _run(scans, proc, main)
    assert not scans._lanes


@pytest.mark.parametrize("own", [False, True], ids=["everyone's", "the user's own"])
def test_a_scan_under_way_does_not_answer_a_request_made_after_it_began(own: bool) -> None:
    """A process that got the node after the scan read it (passed on, or opened under a grant
    asked for again and released again) would be missed."""
    proc = Proc(ROWS[:1], held=lambda uids: True)
    scans = Scans(proc, devices_of=lambda unit: ())

    def scan() -> Coroutine[Any, Any, list[Opener]]:
        return scans.for_user(2000, {0}) if own else scans.for_everyone({0})

    async def main() -> None:
        first = asyncio.ensure_future(scan())
        await _until(lambda: len(proc.calls) == 1)
        proc.rows = ROWS[:1] + [(999, 2000, 0)]  # opened after the first scan began
        second, third = asyncio.ensure_future(scan()), asyncio.ensure_future(scan())
        await asyncio.sleep(0.05)
        assert len(proc.calls) == 1  # the second waits for the first to end
        proc.go.set()
        assert await first == [Opener(100, 2000, 0)]
        assert await second == await third == [Opener(100, 2000, 0), Opener(999, 2000, 0)]
        assert len(proc.calls) == 2  # the third shared the second's

    _run(scans, proc, main)
    assert not scans._lanes  # no uid's lane is kept once its scans are done


def test_a_users_own_scan_is_not_held_behind_a_walk_of_everyones() -> None:
    proc = Proc(ROWS)
    scans = Scans(proc, devices_of=lambda unit: ())

    async def main() -> None:
        walk = asyncio.ensure_future(scans.for_everyone({0}))
        await _until(lambda: len(proc.walks) == 1)
        assert await scans.for_user(2003, {3}) == [Opener(103, 2003, 3)]  # while the walk is held
        assert not walk.done()
        proc.go.set()
        assert await walk == [Opener(100, 2000, 0)]

    _run(scans, proc, main)


def test_a_failed_walk_fails_those_who_joined_it_and_the_next_walks_again() -> None:
    proc = Proc(ROWS)
    broken = threading.Event()
    real = proc.__call__

    def walk(units: Iterable[int], uids: Collection[int] | None,
             devices_of: Callable[[int], Iterable[tuple[int, int]]]) -> list[Opener]:
        if uids is None and not broken.is_set():
            broken.set()
            raise OSError("/proc went away")
        return real(units, uids, devices_of)

    scans = Scans(walk, devices_of=lambda unit: ())
    proc.go.set()

    async def main() -> None:
        failed = await asyncio.gather(scans.for_everyone({0}), scans.for_everyone({1}), return_exceptions=True)
        assert [type(answer) for answer in failed] == [OSError, OSError]
        assert await scans.for_everyone({2}) == [Opener(102, 2002, 2)]

    _run(scans, proc, main)
