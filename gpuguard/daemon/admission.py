"""Which connections the daemon takes, so that no local user can use up its descriptors.

Every connection costs the daemon a descriptor until it ends, and the daemon's descriptors
(RLIMIT_NOFILE) also serve its own work: run out, and logins get no answer, NSS cannot open
/etc/passwd (every user becomes "unknown"), NVML cannot be sampled. So connections are kept
in bounds that no local user, nor all of them together, can pass:

- non-root connections, on the socket and the metrics endpoint together, stay below `limit`,
  which leaves a reserve of descriptors (a quarter, at least RESERVE_MIN) for root's connections
  (the PAM module's logins and closes, admin commands) and the daemon's own files;
- one uid holds at most `per_uid` of them at once;
- the subuids of a user's ranges in /etc/subuid (those a user namespace of theirs may use:
  65,536 each) hold at most `no_account` together, per owner, and are known without asking NSS:
  a namespace's root could otherwise connect as a new uid each time and keep the one NSS thread
  and the `pending` slots full, so that members not looked up yet were refused;
- other uids without a passwd entry (a namespace root made, ranges NSS gives) share
  `no_account` between all of them; a uid not yet looked up counts in `pending` until NSS has
  answered for it;
- the metrics endpoint (TCP: the kernel names no peer uid) holds at most `metrics`.

Budget's decisions are pure; AccountKinds asks NSS, once per uid for a while, off the loop.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from gpuguard.backends import accounts
from gpuguard.core.errors import NssFailure

RESERVE_MIN = 128       # descriptors kept for root and the daemon, whatever the limit
PER_UID = 64            # a user flooding the socket runs out of slots, root (logins) never does
NO_ACCOUNT = 16         # all uids without a passwd entry together
PENDING = 256           # connections whose uid NSS has not classified yet, all uids together
METRICS = 32            # a Prometheus server uses one; a few agents and curl besides

ROOT = ("root",)
METRICS_KEY = ("metrics",)
NO_ACCOUNT_KEY = ("no account",)
Key = tuple[object, ...]  # ("uid", 1000), ("root",): who a connection counts against


def uid_key(uid: int) -> Key:
    return ("uid", uid)


def subuids_key(owner: str) -> Key:
    """A connection from one of owner's subuid ranges (their user namespaces)."""
    return ("subuids of", owner)


def pending_key(uid: int) -> Key:
    """A connection of uid waiting for NSS to say whether uid has an account."""
    return ("pending", uid)


@dataclass
class Budget:
    """Connections held, by kind; take() admits one or says why not (pure bookkeeping)."""

    limit: int  # non-root connections in all
    per_uid: int = PER_UID
    no_account: int = NO_ACCOUNT
    pending: int = PENDING
    metrics: int = METRICS
    held: Counter[Key] = field(default_factory=Counter)
    others: int = 0  # non-root connections held
    held_pending: int = 0  # of which waiting for NSS

    @classmethod
    def for_descriptors(cls, nofile: int, in_use: int = 0) -> Budget:
        """The budget for a process allowed `nofile` descriptors with `in_use` open already."""
        reserve = max(RESERVE_MIN, nofile // 4)
        return cls(limit=max(8, nofile - in_use - reserve))

    def take(self, key: Key) -> str | None:
        """Count a connection of this kind; None when admitted, else the reason it is not."""
        if key != ROOT:
            if self.others >= self.limit:
                return "the daemon has too many connections open; try again in a moment"
            cap, what = self._cap(key)
            if self._count(key) >= cap:
                return f"more than {cap} connections at once {what}"
            if key[0] == "pending":
                if self.held_pending >= self.pending:
                    return f"more than {self.pending} connections at once from users not looked up yet"
                self.held_pending += 1
            self.others += 1
        self.held[key] += 1
        return None

    def give_back(self, key: Key) -> None:
        self.held[key] -= 1
        if not self.held[key]:
            del self.held[key]
        if key != ROOT:
            self.others -= 1
        if key[0] == "pending":
            self.held_pending -= 1

    def _count(self, key: Key) -> int:
        """Connections counting against key's cap: a uid's own, waiting for NSS or not."""
        if key[0] in ("uid", "pending"):
            uid = key[1]
            assert isinstance(uid, int)  # both kinds of key carry a uid
            return self.held[uid_key(uid)] + self.held[pending_key(uid)]
        return self.held[key]

    def _cap(self, key: Key) -> tuple[int, str]:
        if key == METRICS_KEY:
            return self.metrics, "to the metrics endpoint"
        if key == NO_ACCOUNT_KEY:
            return self.no_account, "from uids without an account (user namespaces)"
        if key[0] == "subuids of":
            return self.no_account, "from your user namespaces' uids"
        return self.per_uid, "from your user"


KNOWN_FOR = 600.0    # seconds a uid with an account is remembered as one
UNKNOWN_FOR = 60.0   # and one without (an account may be created)
REMEMBERED = 4096    # uids remembered at most (a namespace has 65,536)
LOOKUP_TIMEOUT = 2.0


class AccountKinds:
    """Whether a uid has a passwd entry, asked of NSS in a thread of its own (a flood of new
    subuids queues there, not in the logins' lookups), once per uid at a time, remembered for a
    while. None: NSS failed or was too slow (not remembered; the caller treats it as no account)."""

    def __init__(self, has_account: Callable[[int], bool] = accounts.has_account,
                 clock: Callable[[], float] = time.monotonic):
        self._has_account = has_account
        self._clock = clock
        self._known: OrderedDict[int, tuple[bool, float]] = OrderedDict()  # uid -> (has one, until)
        self._asked: dict[int, asyncio.Future[bool | None]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="admission")

    def remembered(self, uid: int) -> bool | None:
        """The answer still valid for uid, without asking (None: ask())."""
        entry = self._known.get(uid)
        if entry is None or entry[1] < self._clock():
            return None
        return entry[0]

    async def ask(self, uid: int) -> bool | None:
        if (known := self.remembered(uid)) is not None:
            return known
        asked = self._asked.get(uid)
        if asked is None:
            asked = self._asked[uid] = asyncio.ensure_future(self._lookup(uid))
            asked.add_done_callback(lambda _: self._asked.pop(uid, None))
        return await asyncio.shield(asked)

    async def _lookup(self, uid: int) -> bool | None:
        loop = asyncio.get_running_loop()
        try:
            answer = await asyncio.wait_for(loop.run_in_executor(self._pool, self._has_account, uid), LOOKUP_TIMEOUT)
        except (asyncio.TimeoutError, NssFailure):
            return None
        self._known[uid] = (answer, self._clock() + (KNOWN_FOR if answer else UNKNOWN_FOR))
        self._known.move_to_end(uid)
        while len(self._known) > REMEMBERED:
            self._known.popitem(last=False)
        return answer

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class RateLimit:
    """At most `burst` actions per key at once, one more back every `every` seconds (a token
    bucket, pure: the caller gives the clock). For requests that each cost a /proc scan."""

    burst: int = 5
    every: float = 0.5
    _tokens: dict[object, tuple[float, float]] = field(default_factory=dict)  # key -> (tokens, at)

    def allow(self, key: object, now: float) -> float:
        """0 when the action may go now (and it is counted), else the seconds until it may."""
        tokens, at = self._tokens.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) / self.every)
        if tokens < 1:
            self._tokens[key] = (tokens, now)
            return (1 - tokens) * self.every
        if tokens - 1 >= self.burst - 1 and len(self._tokens) > 10000:
            self._forget_full(now)
        self._tokens[key] = (tokens - 1, now)
        return 0.0

    def _forget_full(self, now: float) -> None:
        """Keys whose bucket has refilled are as good as new: the table holds active keys only."""
        for key, (tokens, at) in list(self._tokens.items()):
            if tokens + (now - at) / self.every >= self.burst:
                del self._tokens[key]
