"""backends.exits: told when a real process exits, through a pidfd on the event loop."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from gpuguard.backends.exits import WATCHED, ExitWatch


def test_told_once_when_the_first_watched_process_exits() -> None:
    first, second = subprocess.Popen(["sleep", "300"]), subprocess.Popen(["sleep", "300"])
    told: list[str] = []

    async def run() -> None:
        done = asyncio.Event()
        cancel = ExitWatch().watch([first.pid, second.pid], os.getuid(), lambda: (told.append("exit"), done.set()))
        assert cancel is not None
        await asyncio.sleep(0.1)
        assert told == []  # both still run
        first.kill()
        await asyncio.wait_for(done.wait(), 30)
        second.kill()
        await asyncio.sleep(0.2)  # the second exit is not told: the watch ended with the first

    try:
        asyncio.run(run())
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait()
    assert told == ["exit"]


def test_nothing_watched_for_a_process_that_is_gone_or_not_the_users() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    other = subprocess.Popen(["sleep", "300"])

    async def run() -> tuple:
        watch = ExitWatch()
        return (watch.watch([gone.pid], os.getuid(), lambda: None),
                watch.watch([other.pid], os.getuid() + 1, lambda: None))

    try:
        assert asyncio.run(run()) == (None, None)
    finally:
        other.kill()
        other.wait()


def test_a_cancelled_watch_tells_nothing() -> None:
    proc = subprocess.Popen(["sleep", "300"])
    told: list[int] = []

    async def run() -> None:
        cancel = ExitWatch().watch([proc.pid], os.getuid(), lambda: told.append(1))
        assert cancel is not None
        cancel()
        proc.kill()
        await asyncio.sleep(0.2)

    try:
        asyncio.run(run())
    finally:
        proc.kill()
        proc.wait()
    assert told == []


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_watch_of_many_processes_holds_a_few_descriptors() -> None:
    """A user's thousands of holders are not each a descriptor of the daemon's: the first WATCHED
    by pid are watched (the release check looks again within its own time anyway)."""
    procs = [subprocess.Popen(["sleep", "300"]) for _ in range(WATCHED + 12)]
    told: list[str] = []

    async def run() -> int:
        before = _open_descriptors()
        done = asyncio.Event()
        cancel = ExitWatch().watch([p.pid for p in procs], os.getuid(), lambda: (told.append("exit"), done.set()))
        assert cancel is not None
        opened = _open_descriptors() - before
        min(procs, key=lambda p: p.pid).kill()  # one of those watched
        await asyncio.wait_for(done.wait(), 30)
        assert _open_descriptors() == before  # the watch closed its pidfds as it told
        return opened

    try:
        assert asyncio.run(run()) == WATCHED
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert told == ["exit"]


RUN_OUT = """
import asyncio, os, resource, sys
from gpuguard.backends.exits import ExitWatch
pids = [int(p) for p in sys.argv[1:]]
async def run():
    before = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (before + 3, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    watched = ExitWatch().watch(pids, os.getuid(), lambda: None)
    print(watched is None, len(os.listdir("/proc/self/fd")) - before)
asyncio.run(run())
"""


def test_a_watch_that_runs_out_of_descriptors_keeps_none_open() -> None:
    procs = [subprocess.Popen(["sleep", "300"]) for _ in range(WATCHED)]
    try:
        out = subprocess.run([sys.executable, "-c", RUN_OUT, *(str(p.pid) for p in procs)], capture_output=True,
                             text=True, check=True).stdout
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert out.split() == ["True", "0"]  # nothing watched (the check looks again), no pidfd left open
