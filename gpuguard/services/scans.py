"""Where /proc opener scans run, so that no user's requests can delay the watcher.

A scan for the processes holding a GPU node reads every descriptor of every candidate process:
a member keeping a node open in 5 processes of 19,900 descriptors each made each scan take
seconds, and 60 `gpuguard release` loops queued so many of them in asyncio's default thread
pool, which the NVML sample shared, that no tick ran for the whole flood. So:

- scans a user's request causes (`for_user`) run in a small pool of their own, at most one per
  uid at a time; a request that finds the same scan of its uid running shares its result;
- the walks of all of /proc that users' releases and logouts cause (`for_everyone`) run in that
  pool one at a time, and every such request made while one runs shares the next (never one
  under way, which may have read a process before a descriptor was passed to it): 100 logouts
  of 4 users back to back, twice, had made 107 to 133 walks of about 100 ms each, two at a time
  on the 2 cores the logins needed; shared, 91 to 98 walks of about 50 ms, a third of the time;
- scans of the daemon's own work (the tick's logout release, openers ended after a revoke or an
  expiry, root's revoke) run in another pool (`for_daemon`), which users cannot fill;
- the NVML sample has its own thread (backends.sampler.Sampler).
"""
from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from gpuguard.core.model import Device
from gpuguard.core.sample import Opener
from gpuguard.services.edges import OpenerSearch

USER_THREADS = 2    # users' scans at once, all users together (a walk of everyone's among them)
DAEMON_THREADS = 2  # the daemon's own


class Scans:
    def __init__(self, find_openers: OpenerSearch | None, devices_of: Callable[[int], Iterable[Device]],
                 user_threads: int = USER_THREADS, daemon_threads: int = DAEMON_THREADS):
        """find_openers None: nothing beyond the sampled processes holds a node (a replay): every
        scan finds nobody, at once. devices_of: the nodes whose openers use a unit (Grants.opener_devices)."""
        self.find_openers = None if find_openers is None else partial(find_openers, devices_of=devices_of)
        self._users = ThreadPoolExecutor(user_threads, thread_name_prefix="scan-user")
        self._daemon = ThreadPoolExecutor(daemon_threads, thread_name_prefix="scan")
        self._running: dict[tuple[int, frozenset[int]], asyncio.Future[list[Opener]]] = {}
        self._turns: dict[int, asyncio.Lock] = {}  # uid -> its one scan at a time
        self._queued: Counter[int] = Counter()     # scans of uid running or waiting for their turn
        self._walking = asyncio.Lock()             # one walk of everyone's processes at a time
        # the walk not started yet that requests join: the nodes they ask about, and its result
        self._next_walk: tuple[set[int], asyncio.Future[list[Opener]]] | None = None

    async def for_daemon(self, units: Collection[int], uids: Collection[int] | None) -> list[Opener]:
        if self.find_openers is None:
            return []
        return await asyncio.get_running_loop().run_in_executor(self._daemon, self.find_openers, units, uids)

    async def for_user(self, uid: int, units: Collection[int]) -> list[Opener]:
        """uid's processes holding these nodes, for what a request of uid's caused."""
        if self.find_openers is None:
            return []
        key = (uid, frozenset(units))
        running = self._running.get(key)
        if running is None:
            running = self._running[key] = asyncio.ensure_future(self._in_turn(uid, key[1], {uid}))
            running.add_done_callback(lambda _: self._running.pop(key, None))
        return await asyncio.shield(running)

    async def for_everyone(self, units: Collection[int]) -> list[Opener]:
        """Anyone's processes holding these nodes (a walk of all of /proc), for a user's release or
        logout. The walk this joins starts after the call, so it sees what a walk of the call's
        own would; its cost is nearly all in reading every process, whatever the nodes."""
        if self.find_openers is None:
            return []
        if self._next_walk is None:
            joined: set[int] = set()
            self._next_walk = (joined, asyncio.ensure_future(self._walk(joined)))
        joined, result = self._next_walk
        joined.update(units)
        found = await asyncio.shield(result)
        wanted = set(units)
        return [opener for opener in found if opener.unit in wanted]

    async def _walk(self, units: set[int]) -> list[Opener]:
        find_openers = self.find_openers
        assert find_openers is not None  # for_everyone answered at once without one
        async with self._walking:
            self._next_walk = None  # from here on, requests join the walk after this one
            return await asyncio.get_running_loop().run_in_executor(self._users, find_openers, frozenset(units), None)

    async def _in_turn(self, uid: int, units: frozenset[int], uids: Collection[int]) -> list[Opener]:
        find_openers = self.find_openers
        assert find_openers is not None  # for_user answered at once without one
        turn = self._turns.setdefault(uid, asyncio.Lock())
        self._queued[uid] += 1
        try:
            async with turn:
                return await asyncio.get_running_loop().run_in_executor(self._users, find_openers, units, uids)
        finally:
            self._queued[uid] -= 1
            if not self._queued[uid]:
                del self._queued[uid], self._turns[uid]

    def close(self) -> None:
        self._users.shutdown(wait=False, cancel_futures=True)
        self._daemon.shutdown(wait=False, cancel_futures=True)
