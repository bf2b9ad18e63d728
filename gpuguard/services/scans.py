"""Where /proc opener scans run, so that no user's requests can delay the watcher.

A scan for the processes holding a GPU node reads every descriptor of every candidate process:
a member keeping a node open in 5 processes of 19,900 descriptors each made each scan take
seconds, and 60 `gpuguard release` loops queued so many of them in asyncio's default thread
pool, which the NVML sample shared, that no tick ran for the whole flood. So:

- scans a user's request causes run in a small pool of their own, in lanes (_Lane): one scan at
  a time in each, and every request made while one runs joins the next one, never one under
  way (it may have read a process before that process got the node: a descriptor passed on, or
  a node opened under a grant that is gone again); each request is answered about its own nodes;
- a user's own processes (`for_user`) have a lane per uid; the walks of all of /proc that
  releases and logouts cause (`for_everyone`) one lane for all: 100 logouts of 4 users back to
  back, twice, had made 107 to 133 walks of about 100 ms each, two at a time on the 2 cores the
  logins needed; in one lane, 91 to 98 walks of about 50 ms, a third of the time;
- scans of the daemon's own work (the tick's logout release, openers ended after a revoke or an
  expiry, root's revoke) run in another pool (`for_daemon`), which users cannot fill;
- the NVML sample has its own thread (backends.sampler.Sampler).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial

from gpuguard.core.model import Device
from gpuguard.core.sample import Opener
from gpuguard.services.edges import OpenerSearch

USER_THREADS = 2    # users' scans at once, all users together (a walk of everyone's among them)
DAEMON_THREADS = 2  # the daemon's own

FindOpeners = Callable[[Collection[int], Collection[int] | None], list[Opener]]  # (units, uids)


class _Lane:
    """Scans of one kind (one uid's processes, or everyone's) one at a time, on `pool`."""

    def __init__(self, pool: Executor, scan: FindOpeners, uids: Collection[int] | None):
        self.pool = pool
        self.scan = scan
        self.uids = uids
        self._running = asyncio.Lock()
        # the scan not started yet that requests join: the nodes they ask about, and its result
        self._next: tuple[set[int], asyncio.Future[list[Opener]]] | None = None

    async def openers(self, units: Collection[int]) -> list[Opener]:
        if self._next is None or self._next[1].done():  # done unstarted: cancelled with its loop
            joined: set[int] = set()
            self._next = (joined, asyncio.ensure_future(self._run(joined)))
        joined, result = self._next
        joined.update(units)
        found = await asyncio.shield(result)
        wanted = set(units)
        return [opener for opener in found if opener.unit in wanted]

    async def _run(self, units: set[int]) -> list[Opener]:
        async with self._running:
            self._next = None  # from here on, requests join the scan after this one
            return await asyncio.get_running_loop().run_in_executor(self.pool, self.scan, frozenset(units), self.uids)

    def idle(self) -> bool:
        return (self._next is None or self._next[1].done()) and not self._running.locked()


class Scans:
    def __init__(self, find_openers: OpenerSearch | None, devices_of: Callable[[int], Iterable[Device]],
                 user_threads: int = USER_THREADS, daemon_threads: int = DAEMON_THREADS):
        """find_openers None: nothing beyond the sampled processes holds a node (a replay): every
        scan finds nobody, at once. devices_of: the nodes whose openers use a unit (Grants.opener_devices)."""
        self.find_openers = None if find_openers is None else partial(find_openers, devices_of=devices_of)
        self._users = ThreadPoolExecutor(user_threads, thread_name_prefix="scan-user")
        self._daemon = ThreadPoolExecutor(daemon_threads, thread_name_prefix="scan")
        # uid -> the lane of its own processes, None -> everyone's; each while it has scans
        self._lanes: dict[int | None, _Lane] = {}

    async def for_daemon(self, units: Collection[int], uids: Collection[int] | None) -> list[Opener]:
        if self.find_openers is None:
            return []
        return await asyncio.get_running_loop().run_in_executor(self._daemon, self.find_openers, units, uids)

    async def for_user(self, uid: int, units: Collection[int]) -> list[Opener]:
        """uid's processes holding these nodes, for what a request of uid's caused."""
        return await self._in_lane(uid, units)

    async def for_everyone(self, units: Collection[int]) -> list[Opener]:
        """Anyone's processes holding these nodes (a walk of all of /proc), for a user's release or
        logout: its cost is nearly all in reading every process, whatever the nodes."""
        return await self._in_lane(None, units)

    async def _in_lane(self, uid: int | None, units: Collection[int]) -> list[Opener]:
        if self.find_openers is None:
            return []
        lane = self._lanes.get(uid)
        if lane is None:
            lane = self._lanes[uid] = _Lane(self._users, self.find_openers, None if uid is None else {uid})
        try:
            return await lane.openers(units)
        finally:
            if lane.idle() and self._lanes.get(uid) is lane:
                del self._lanes[uid]

    def close(self) -> None:
        self._users.shutdown(wait=False, cancel_futures=True)
        self._daemon.shutdown(wait=False, cancel_futures=True)
