"""Sessions opening and closing (the PAM module's session_open and session_close), as the
services see them: what a login does about GPUs, and what its logout starts.

A login opens its session first, whatever else happens. Then, by where its user stands: an
exempt user is added to the exempt set (NSS member lists may have missed them); a former member
loses what they held (reload_effects); a member holding GPUs already keeps them (a second
session reuses the grant); a member whose session takes GPUs (policy.login_takes_gpus) asks for
their quota's worth through the one path (asks.Asks.ask), waiting in the queue when nothing can
be had now. A logout closes the session; the user's last one ends their login's place in the
queue and starts the check whether their session grants can go (logout.LogoutRelease), in the
background, so the PAM module's reply waits for no NVML and no /proc.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from gpuguard.config import Config
from gpuguard.core import policy
from gpuguard.core.compat import StrEnum
from gpuguard.core.model import Account, Origin, Session
from gpuguard.logs import event
from gpuguard.services.asks import Answer, Ask, Asks, Waits
from gpuguard.services.edges import Clock, Processes
from gpuguard.services.exempt import Exempt
from gpuguard.services.logout import LogoutRelease
from gpuguard.services.queueing import Queue
from gpuguard.services.reload_effects import ReloadEffects
from gpuguard.services.store import Store


class Took(StrEnum):
    """What a login did about GPUs."""

    EXEMPT = "exempt"        # nothing: every GPU is open to them
    OUTSIDER = "outsider"    # nothing (what a former member held was taken back)
    KEPT = "kept"            # the GPUs the user held already (a second session)
    NOT_ASKED = "not_asked"  # nothing: the session takes no GPUs of its own (scp, sftp, `ssh host cmd`)
    NO_QUOTA = "no_quota"    # nothing: the quota allows none
    ASKED = "asked"          # the quota's worth, through Asks.ask (the answer says what came of it)


@dataclass(frozen=True)
class Login:
    session: Session
    took: Took
    answer: Answer | None = None  # Took.ASKED only


@dataclass(frozen=True)
class Logout:
    closed: Session | None   # None: no such session (closed already, or never known)
    held: frozenset[int]     # what the user held when it closed
    release_pending: bool    # the check whether those go has started


class Logins:
    def __init__(self, config: Callable[[], Config], store: Store, asks: Asks, queue: Queue, exempt: Exempt,
                 reload_effects: ReloadEffects, logout: LogoutRelease, processes: Processes, clock: Clock):
        self.config = config
        self.store = store
        self.asks = asks
        self.queue = queue
        self.exempt = exempt
        self.reload_effects = reload_effects
        self.logout = logout
        self.processes = processes
        self.clock = clock

    def open(self, account: Account, service: str, rhost: str, tty: str, pid: int, grant: str = "auto") -> Login:
        """Open a session of `account` for the PAM caller `pid`, and do what it does about GPUs.
        grant: the PAM stack's say (policy.LOGIN_GRANTS)."""
        store, now = self.store, self.clock()
        caller = self.processes.identity(pid)  # None: gone already, and the next tick drops the session
        start = caller.start_time if caller else None
        session = store.open_session(account.uid, account.name, service, rhost, tty, pid, now, start)
        event(logging.INFO, "session_open", user=account.name, session=session.id, service=service,
              rhost=rhost or None, tty=tty or None, pid=pid)
        eligible = self.asks.eligibility(account)
        if eligible == policy.Eligibility.EXEMPT:
            self.exempt.add(account.uid)  # a no-op unless joined since, or missed by NSS member lists
            return Login(session, Took.EXEMPT)
        if eligible == policy.Eligibility.OUTSIDER:
            self.reload_effects.expel_if_gone(account, self.config(), now)  # left the group since
            return Login(session, Took.OUTSIDER)
        if store.grants(account.uid):
            return Login(session, Took.KEPT)
        config = self.config()
        if not policy.login_takes_gpus(service, tty, grant, config.sessions):
            return Login(session, Took.NOT_ASKED)
        if policy.quota_for(account.name, account.groups, config).gpus == 0:
            return Login(session, Took.NO_QUOTA)
        answer = self.asks.ask(Ask(account, None, Origin.SESSION, Waits.IF_NOTHING,
                                   f"granted at login ({service or 'pam'})", pid=pid, pid_start=start), now)
        return Login(session, Took.ASKED, answer)

    def close(self, account: Account, pid: int) -> Logout:
        """Close uid's newest session opened by the PAM caller `pid`."""
        store = self.store
        held = frozenset(g.unit for g in store.grants(account.uid))
        closed = store.close_session(account.uid, pid)
        event(logging.INFO, "session_close", user=account.name, pid=pid, session=closed.id if closed else "unknown")
        last = not store.logged_in(account.uid)
        if last:  # a login's place in the queue ends with its last session
            self.queue.leave(q.waiter.id for q in store.queue(account.uid) if q.origin == Origin.SESSION)
        # Only the close that ended the user's last session starts the release check: a close of a
        # session already gone (dropped by the tick after its caller died, or never known) changes
        # nothing the tick will not see, and each check costs a GPU sample and a /proc scan.
        pending = bool(held) and closed is not None and last
        if pending:
            self.logout.after_logout(account.uid)
        return Logout(closed, held, pending)
