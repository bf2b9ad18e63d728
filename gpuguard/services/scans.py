"""Where /proc opener scans run, so that no user's requests can delay the watcher.

A scan for the processes holding a GPU node reads every descriptor of every candidate process:
a member keeping a node open in 5 processes of 19,900 descriptors each made each scan take
seconds, and 60 `gpuguard release` loops queued so many of them in asyncio's default thread
pool, which the NVML sample shared, that no tick ran for the whole flood. So:

- scans a user's request causes (`for_user`) run in a small pool of their own, at most one per
  uid at a time; a request that finds the same scan of its uid running shares its result;
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

USER_THREADS = 2    # users' scans at once, all users together
DAEMON_THREADS = 2  # the daemon's own


class Scans:
    def __init__(self, find_openers: OpenerSearch | None, devices_of: Callable[[int], Iterable[Device]],
                 user_threads: int = USER_THREADS, daemon_threads: int = DAEMON_THREADS):
        """find_openers None: nothing beyond the sampled processes holds a node (a replay): every
        scan finds nobody, at once. devices_of: the nodes whose openers use a unit (Grants.opener_devices)."""
        self.find_openers = None if find_openers is None else partial(find_openers, devices_of=devices_of)
        self._users = ThreadPoolExecutor(user_threads, thread_name_prefix="scan-user")
        self._daemon = ThreadPoolExecutor(daemon_threads, thread_name_prefix="scan")
        self._running: dict[tuple[int, frozenset[int], bool], asyncio.Future[list[Opener]]] = {}
        self._turns: dict[int, asyncio.Lock] = {}  # uid -> its one scan at a time
        self._queued: Counter[int] = Counter()     # scans of uid running or waiting for their turn

    async def for_daemon(self, units: Collection[int], uids: Collection[int] | None) -> list[Opener]:
        if self.find_openers is None:
            return []
        return await asyncio.get_running_loop().run_in_executor(self._daemon, self.find_openers, units, uids)

    async def for_user(self, uid: int, units: Collection[int], everyone: bool = False) -> list[Opener]:
        """uid's processes (everyone: anyone's, a walk of all of /proc) holding these nodes, for
        what a request of uid's caused."""
        if self.find_openers is None:
            return []
        key = (uid, frozenset(units), everyone)
        running = self._running.get(key)
        if running is None:
            running = self._running[key] = asyncio.ensure_future(self._in_turn(uid, key[1], None if everyone else {uid}))
            running.add_done_callback(lambda _: self._running.pop(key, None))
        return await asyncio.shield(running)

    async def _in_turn(self, uid: int, units: frozenset[int], uids: Collection[int] | None) -> list[Opener]:
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
