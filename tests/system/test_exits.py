"""backends.exits: told when a real process exits, through a pidfd on the event loop."""
from __future__ import annotations

import asyncio
import os
import subprocess

from gpuguard.backends.exits import ExitWatch


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
