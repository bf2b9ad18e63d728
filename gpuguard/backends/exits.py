"""Being told when processes exit, without polling: a pidfd becomes readable when its process
ends (Linux 5.3+), so the daemon's event loop watches it like a socket (loop.add_reader).

Used for processes that keep a logged-out user's grant (procfs.openers_of found them): instead
of looking in /proc for them again every tick, the release check waits until one of them ends.
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Collection

from gpuguard.backends import procfs

Cancel = Callable[[], None]
# Pidfds one watch opens at most: a user may keep thousands of processes on a node, each a
# descriptor of the daemon's otherwise. The first of these to end is as good a sign as any
# (the caller checks again then, and in any case within its own re-check time).
WATCHED = 8


class ExitWatch:
    def watch(self, pids: Collection[int], uid: int, on_exit: Callable[[], None]) -> Cancel | None:
        """Call on_exit once, on the running loop, when the first of these processes of uid
        exits (of the first WATCHED of them, by pid). Returns what cancels the watch, or None
        (nothing watched) when one of them is gone already or is no longer uid's (its pid may
        name another process by now), or a pidfd could not be had (the descriptors ran out)."""
        loop = asyncio.get_running_loop()
        pidfds: list[int] = []

        def cancel() -> None:
            for pidfd in pidfds:
                loop.remove_reader(pidfd)
                os.close(pidfd)
            pidfds.clear()

        def exited() -> None:
            if pidfds:  # two may end in one loop iteration: tell once
                cancel()
                on_exit()

        for pid in sorted(pids)[:WATCHED]:
            identity = procfs.process_identity(pid)
            try:
                if identity is None or identity.uid != uid:
                    raise ProcessLookupError(pid)
                pidfds.append(os.pidfd_open(pid))
                # Still the same process once the pidfd names it: not a reused pid.
                if procfs.process_identity(pid) != identity:
                    raise ProcessLookupError(pid)
            except OSError:  # gone (ProcessLookupError), or no descriptor left (EMFILE): none kept open
                cancel()
                return None
            loop.add_reader(pidfds[-1], exited)
        return cancel
