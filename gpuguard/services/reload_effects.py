"""What a change of the configuration (or of a user's groups) does to grants already given.

- A user no longer in the GPU group (removed from it, or the group renamed) loses their grants
  and their place in the queue at the next reload or at their next login, with a notice on
  their terminals and in `whoami`; an admin's revoke is no longer the only way.
- A lowered (or new) `idle_timeout` never releases a grant at once: a grant idle past the new
  limit gets the new limit again from the reload, at most IDLE_NOTICE, and its user is told
  when it will go unless they use it.

The rules stay pure and unchanged: the notice only moves the grant's last-active time, which
is what the idle rule reads.
"""
from __future__ import annotations

import logging

from gpuguard.config import Config
from gpuguard.core import policy
from gpuguard.core.errors import UnknownUser
from gpuguard.core.messages import clock, unit_list
from gpuguard.core.model import Account, Event, EventKind, Rule
from gpuguard.core.quantities import format_duration
from gpuguard.logs import event
from gpuguard.services.edges import Lookup
from gpuguard.services.release import Releases, Tell
from gpuguard.services.store import Store
from gpuguard.services.tickets import Tickets

IDLE_NOTICE = 600.0  # seconds a grant keeps after a reload made it idle past its limit (capped by the limit)


class ReloadEffects:
    def __init__(self, store: Store, releases: Releases, tickets: Tickets, lookup: Lookup, tell: Tell):
        self.store = store
        self.releases = releases
        self.tickets = tickets  # a former member's places in the queue end, their waiting clients told
        self.lookup = lookup
        self.tell = tell

    async def apply(self, old: Config, new: Config, now: float) -> None:
        """After a reload: expel former members, give idle grants their notice."""
        uids = {g.uid for g in self.store.grants()} | {q.waiter.uid for q in self.store.queue()}
        for uid in sorted(uids):
            try:
                account = await self.lookup.by_uid(uid)
                if not self.expel_if_gone(account, new, now):
                    self._idle_notice(account, policy.quota_for(account.name, account.groups, old).idle_timeout,
                                      policy.quota_for(account.name, account.groups, new).idle_timeout, now)
            except UnknownUser:
                continue  # a deleted account: an admin's revoke takes its grants (it has no sessions)
            except Exception:  # one user's failure (a gate error) must not spare the others
                event(logging.ERROR, "reload_effects_failed", exc_info=True, uid=uid)

    def expel_if_gone(self, account: Account, config: Config, now: float) -> bool:
        """Take the grants and the place in the queue of a user who is no longer a member (True)."""
        access = config.access
        if policy.eligibility(account.uid, account.name, account.groups, access) != policy.Eligibility.OUTSIDER:
            return False
        left = self.tickets.leave_all(account.uid)
        removed = self.releases.take_back(account.uid, None, now, kind=EventKind.REVOKE, rule=Rule.MEMBERSHIP,
                                          message=f"no longer in group {access.group}")
        if not removed and not left:
            return True
        taken = f"GPU {unit_list(g.unit for g in removed)} taken back" if removed else ""
        place = "your place in the queue ended" if left else ""
        text = (f"gpuguard: you are no longer in group {access.group}: {'; '.join(p for p in (taken, place) if p)}; "
                "ask your admin if this is a mistake")
        event(logging.INFO, "expelled", user=account.name, uid=account.uid, gpus=len(removed), queue=left,
              group=access.group)
        self.tell(account.uid, account.name, text)
        return True

    def _idle_notice(self, account: Account, old: float | None, new: float | None, now: float) -> None:
        if new is None or (old is not None and new >= old):
            return
        grace = min(new, IDLE_NOTICE)
        for grant in self.store.grants(account.uid):
            if now - grant.last_active < new - grace:
                continue  # not due within the notice anyway
            until = now + grace
            self.store.mark_active([(account.uid, grant.unit)], until - new)
            text = (f"gpuguard: your idle release is now {format_duration(new)}; GPU {unit_list([grant.unit])} "
                    f"has been unused for {format_duration(round(now - grant.last_active))}: it will be released "
                    f"at {clock(until)} unless a process of yours uses it - see gpuguard whoami")
            self.store.add_event(Event(now, account.uid, account.name, EventKind.WARNING, text, unit=grant.unit,
                                       rule=Rule.IDLE, action="warn",
                                       numbers={"idle_timeout": new, "release_at": until}))
            self.tell(account.uid, account.name, text)
