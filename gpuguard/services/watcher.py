"""The watcher: memory quotas, time limits, idle release and stray use, enforced each tick.

The daemon's tick samples the GPUs (gpuguard.backends.sampler) and awaits `check(sample, now)`.
The decisions are gpuguard.core.rules (pure); this module is the edge around them:

    view of the sample -> decide -> (anything to do?) re-sample -> decide again -> act on
    what both decisions agree on -> remember (rules.advance) -> account usage

Acting means: signals through pidfds with the identity re-checked (backends.signals),
revoking and releasing through the release step (release.Releases: the grant manager closes the
gate, rewrites the ACLs and records the revoke/release event; the holders are ended, the user
charged, and the queue served once after the tick's batch of actions, which was decided on one
view), telling the user on their terminals (backends.notify), a log line, and an event in the
store that `gpuguard whoami` shows.

Everything here runs on the daemon's event-loop thread, as the store requires. The awaits
are the confirming re-sample (NVML and /proc in a worker thread), after which the grants are
read again, so a login or release during the re-sample is seen, and the NSS lookups of users
whose quota is not cached (lookups.KnownAccounts), made before any decision. The seconds each
tick observed go to the usage accounting (usage.UsageMeter).

A GPU whose processes a sample could not read is passed to the rules as failed: nothing is
decided about it (the sampler logs it failing and recovering).
"""
from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from operator import attrgetter
from typing import Any

from gpuguard.config import Config
from gpuguard.core import messages, rules
from gpuguard.core.model import Event, ProcessIdentity, SignalOutcome, unit_label
from gpuguard.core.rules import Action
from gpuguard.core.sample import Sample
from gpuguard.logs import event
from gpuguard.services.edges import GpuSampler, Processes, Terminals
from gpuguard.services.exempt import Exempt
from gpuguard.services.lookups import KnownAccounts
from gpuguard.services.release import Releases
from gpuguard.services.store import Store, hour_of
from gpuguard.services.usage import UsageMeter

ACTIVE_WRITE_EVERY = 30.0  # seconds: how stale grants.last_active may get in the store (memory is exact)
GAP_TICKS = 3              # a check this many intervals after the last one follows a gap in observation

_LEVEL = {rules.WARN: logging.WARNING, rules.REPORT: logging.WARNING, rules.TERM: logging.WARNING,
          rules.KILL: logging.WARNING, rules.UNKILLABLE: logging.ERROR}
_SIGNAL = {rules.TERM: signal.SIGTERM, rules.KILL: signal.SIGKILL}


class Watcher:
    def __init__(self, config: Callable[[], Config], store: Store, releases: Releases, exempt: Exempt,
                 sampler: GpuSampler, accounts: KnownAccounts, terminals: Terminals, processes: Processes,
                 usage: UsageMeter, demand: Callable[[], rules.Demand] = rules.Demand,
                 active_write_every: float | None = ACTIVE_WRITE_EVERY, gaps: bool = True) -> None:
        self.config = config  # the config in force, which a reload replaces
        self.store = store
        self.releases = releases
        self.exempt = exempt
        self.sampler = sampler
        self.accounts = accounts  # names and quotas, NSS asked off the loop
        self.terminals = terminals
        self.processes = processes  # who a process is, and signals through pidfds
        self.usage = usage
        self.demand = demand  # what the queue needs beyond the free units: what reclaim may take
        # How stale grants.last_active may get in the store; None: never written (a scratch store
        # nobody restarts from: the idle clocks are the watcher's memory, which is exact).
        self.active_write_every = active_write_every
        # Whether checks can miss what happened between them (a daemon's failed or late ticks); a
        # replay's cannot: its sample changes only with its events, which it tells the state of.
        self.gaps = gaps
        self.state = rules.State()
        self._last_check: float | None = None
        # the last view built, from what sample and at what version of the grants
        self._last_view: tuple[Sample, rules.View, int] | None = None
        self._procs: dict[tuple[int, int, int, int, int | None], rules.Proc] = {}  # its processes, by their fields

    # --- the tick

    def next_moment(self, sample: Sample | None = None, after: float | None = None) -> float | None:
        """The first moment after `after` (by default the last check's own time, so that a wait that
        ended while it sampled and acted is still due) at which a check of `sample` (by default the
        last one checked) could act, over the grants and the queue's demand now: rules.next_change
        (waits ending, time limits, idle and reclaim clocks). The daemon ticks then too, besides its
        regular ticks; a replay, which has no ticks of its own, checks then. Right after a check of
        the same sample over the same grants, that check's view is used (its quotas as resolved)."""
        if after is None:
            after = self._last_check if self._last_check is not None else float("-inf")
        if sample is None:
            if self._last_view is None:
                return None
            sample = self._last_view[0]
        view = self._standing_view(sample)
        if view is None:
            view = self._view(sample)
        else:
            wanted = self.demand()
            if wanted != _demand_of(view):
                view = replace(view, **demand_fields(wanted)).reusing(view)
        return rules.next_change(view, self.state, timing_of(self.config()), after)

    async def check(self, sample: Sample, now: float) -> list[Action]:
        """Decide on `sample`, confirm with a fresh one if anything would change, act. Returns
        the actions carried out. A failing re-sample means no action this tick (logged)."""
        started = time.monotonic()
        timing = timing_of(self.config())
        self._after_gap(now)
        await self.accounts.resolve(self._users(sample))
        view = self._view(sample)
        actions = rules.decide(view, self.state, now, timing)
        if actions:  # rare (changes only), so every one is confirmed, warnings included
            confirming = await self.sampler.take_or_log("no action this tick", max_age=0,
                                                        pending=len(actions))
            if confirming is None:
                return []
            # The same sample (a replay's), grants and demand: the same view, which decides the same.
            if self._standing_view(confirming) is not view or self.demand() != _demand_of(view):
                await self.accounts.resolve(self._users(confirming))
                first, view = view, self._view(confirming)  # grants read again: a request may have come in meanwhile
                if view != first:
                    actions = rules.confirmed(actions, rules.decide(view, self.state, now, timing))
        done = []
        with self.releases.batch(now):  # decided on one view: the queue is served after all of it
            for action in actions:
                try:
                    if self._act(action, now):
                        done.append(action)
                except Exception:  # one failing action (a gate error, a full disk) must not stop the others
                    event(logging.ERROR, "action_failed", exc_info=True, action=action.kind, rule=action.rule,
                          uid=action.uid, gpu=unit_label(action.unit), pid=action.proc.pid if action.proc else None)
        self.state = rules.advance(view, self.state, done, now)
        self._account(view, now)
        self._mark_active(view)
        self._last_check = now
        elapsed = time.monotonic() - started
        if elapsed > self.config().watcher.interval / 2:
            event(logging.WARNING, "watcher_slow", seconds=round(elapsed, 3), processes=len(view.procs))
        return done

    def _after_gap(self, now: float) -> None:
        """Ticks that failed (NVML errors) or were missed observed nothing: not being seen then is
        no evidence of idleness, so every grant's idle clock restarts after such a gap."""
        interval = self.config().watcher.interval
        if self.gaps and self._last_check is not None and now - self._last_check > GAP_TICKS * interval:
            slots = {(g.uid, g.unit) for g in self.store.grants()}
            self.state = replace(self.state, seen={**self.state.seen, **{slot: now for slot in slots}})
            event(logging.INFO, "watcher_gap", seconds=round(now - self._last_check, 1),
                  note="idle clocks restarted")

    def _view(self, sample: Sample) -> rules.View:
        """The sample, the grants and their users' quotas as the rules take them. The processes of
        the same sample as the view before are that view's, and the grants are the store's copy (the
        same objects while nothing changed): comparing two such views costs little."""
        last = self._last_view
        if last is not None and last[0] == sample:
            procs = last[1].procs
        else:
            made, self._procs = self._procs, {}
            procs = []
            for process in sample.processes:
                identity = sample.owners.get(process.pid)
                if identity is None:
                    continue  # exited between NVML and /proc: nothing to judge
                key = (process.pid, identity.uid, identity.start_time, process.unit, process.used_memory)
                proc = self._procs[key] = made.get(key) or rules.Proc(*key)  # most processes were there before
                procs.append(proc)
        grants, grants_version = self.store.grants_read(), self.store.grants_version
        quotas = {uid: self.accounts.of(uid)[1] for uid in set(map(_uid_of, grants))}
        # Not read: the GPUs that failed, and a granted one NVML could not reach at all (not in
        # the sample's units: Sample.ok).
        failed = frozenset(sample.failed).union(set(map(_unit_of, grants)).difference(sample.units))
        wanted = self.demand()
        view = rules.View(procs, grants, quotas, self.exempt.uids, failed, **demand_fields(wanted))
        if last is not None:
            view.reusing(last[1])
        self._last_view = (sample, view, grants_version)
        return view

    def _standing_view(self, sample: Sample) -> rules.View | None:
        """The last view built, if it is of this same sample (a replay's, which stands still between
        its events; the daemon's samples are new each time) and the grants now: only the demand may
        have moved since."""
        last = self._last_view
        if last is not None and last[2] == self.store.grants_version and last[0] == sample:
            return last[1]
        return None

    def _users(self, sample: Sample) -> set[int]:
        """Everyone the rules may judge: grant holders and the owners of the GPU processes."""
        return set(map(_uid_of, self.store.grants_read())).union(map(_uid_of, sample.owners.values()))

    # --- acting

    def _act(self, action: Action, now: float) -> bool:
        """Carry out one action; True when it happened (a signal to a process that already left
        did not), for rules.advance."""
        user = self.accounts.name_of(action.uid)
        proc = action.proc
        command = self.processes.command(proc.pid) if proc else ""
        text = messages.action_message(action, command)
        numbers = rules.Numbers(**action.numbers)
        if action.kind in _SIGNAL and proc is not None:  # signals always name their process
            identity = ProcessIdentity(proc.pid, proc.uid, proc.start_time)
            result = self.processes.send(identity, _SIGNAL[action.kind], self.exempt.uids)
            if not result.sent:
                event(logging.INFO if result.outcome is SignalOutcome.GONE else logging.WARNING,
                      f"{action.kind}_skipped", rule=action.rule, user=user, pid=proc.pid, gpu=unit_label(action.unit),
                      outcome=result.outcome.value, detail=result.detail)
                return False
            numbers["signal"] = action.signal or ""
            if action.kind == rules.TERM:
                self.store.add_kill(action.uid, user, action.unit, hour_of(now), action.rule)
        elif action.kind == rules.UNKILLABLE and proc is not None:
            numbers["state"] = self.processes.state(ProcessIdentity(proc.pid, proc.uid, proc.start_time)) or "unknown"
        elif action.kind in (rules.REVOKE, rules.RELEASE):
            removed = self.releases.take_back(action.uid, [action.unit], now, kind=action.kind.event,
                                              rule=action.rule, message=text)
            if not removed:
                return False  # released by someone else meanwhile
        self._record(action, user, command, text, numbers, now)
        return True

    def _record(self, action: Action, user: str, command: str, text: str, numbers: Mapping[str, Any],
                now: float) -> None:
        proc = action.proc
        if action.kind not in (rules.REVOKE, rules.RELEASE):  # the grant manager logged and stored those
            logged: dict[str, Any] = {k: _log_value(k, v) for k, v in numbers.items()}
            event(_LEVEL.get(action.kind, logging.INFO), action.kind, rule=action.rule, user=user, uid=action.uid,
                  gpu=unit_label(action.unit), pid=proc.pid if proc else None, command=command or None,
                  **logged)
            self.store.add_event(Event(
                now, action.uid, user, action.kind.event, text, unit=action.unit,
                pid=proc.pid if proc else None, command=command, rule=action.rule, action=action.kind,
                numbers=dict(numbers)))
        if action.kind != rules.REPORT and action.uid not in self.exempt.uids:
            ttys = self.store.ttys(action.uid)
            self.terminals.tell(user, action.uid, text, ttys)

    # --- bookkeeping

    def _account(self, view: rules.View, now: float) -> None:
        """Seconds granted / busy / idle per user and GPU since the last check (usage.UsageMeter)."""
        if self._last_check is not None:
            # A long pause (a stalled loop, failed samples) was not observed: count at most a few ticks.
            seconds = now - self._last_check
            self.usage.add(view, min(seconds, GAP_TICKS * self.config().watcher.interval) if self.gaps else seconds, now)

    def last_seen(self, uid: int, unit: int) -> float | None:
        """The last tick a process of this user was seen on this unit, while they hold it (exact:
        the store's last_active is up to active_write_every older)."""
        return self.state.seen.get((uid, unit))

    def _mark_active(self, view: rules.View) -> None:
        """grants.last_active follows the watcher's exact memory (state.seen) within active_write_every,
        as the time a process was last seen there: a tick writes its own time for the GPUs busy now, and a
        replay, which sees a job end between its checks, the job's end (not the later check's time, which
        would start the idle clock late)."""
        every = self.active_write_every
        if every is None:
            return
        due: dict[float, list[rules.Slot]] = {}
        for grant in view.grants:
            slot = (grant.uid, grant.unit)
            last_seen = self.state.seen.get(slot)
            if last_seen is not None and last_seen - grant.last_active >= every:
                due.setdefault(last_seen, []).append(slot)
        for last_seen, slots in due.items():
            self.store.mark_active(slots, last_seen)


_uid_of, _unit_of = attrgetter("uid"), attrgetter("unit")


def demand_fields(wanted: rules.Demand) -> dict[str, Any]:
    """The queue's demand as a view's fields (rules.View keeps it field by field)."""
    return {"demand": wanted.short, "useful": wanted.useful, "keep": wanted.keep}


def _demand_of(view: rules.View) -> tuple[object, ...]:
    """The queue's demand a view was made with (_view_fields back), to compare with rules.Demand."""
    return view.demand, view.useful, view.keep


def timing_of(config: Config) -> rules.Timing:
    """The rules' timing from the config (the daemon's watcher and `gpuguard replay` alike)."""
    return rules.Timing(config.watcher.grace, config.watcher.kill_wait, config.scheduler.soft_max_time)


def _log_value(key: str, value: object) -> object:
    if isinstance(value, float):
        return round(value, 3)
    return value
