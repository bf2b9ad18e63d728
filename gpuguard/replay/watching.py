"""The watcher as a replay drives it. A replay has no ticks: it tells the watcher what the
daemon's ticks between two checks would have seen (a job's process started, or ended: when it
ran, and the idle clocks of the GPUs it left), checks only when a rule may act (at a moment of
the rules', or at an event that makes one due at once: rules.acts_on_arrival,
acts_on_grant_change, acts_on_demand), and asks when one may next (Watcher.next_moment; after a
batch of events that only took things away, the moments of the grants whose jobs left: nothing
else moved earlier). The watcher itself is the daemon's, with no gaps in what it observes (the
sample changes only with the replay's events).
"""
from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import replace

from gpuguard.core import rules
from gpuguard.core.rules import Action
from gpuguard.core.sample import Sample
from gpuguard.services.watcher import demand_fields, timing_of
from gpuguard.services.wiring import Services


class ReplayWatch:
    def __init__(self, services: Services) -> None:
        self.watcher = services.watcher
        self.store, self.accounts, self.exempt = services.store, services.accounts, services.exempt
        self.demand, self.config = services.queue.demand, services.edges.config
        # The processes that started while a check acted (a job given the GPUs an action freed):
        # the check's view had them not, so they are told to the watcher after it.
        self._started_in_check: dict[rules.ProcKey, float] | None = None

    def started(self, key: rules.ProcKey, now: float) -> None:
        """A job's process appeared at `now`: the daemon's next tick would see it from here (soft
        time's work lost counts from it)."""
        if self._started_in_check is not None:
            self._started_in_check[key] = now
            return
        state = self.watcher.state
        self.watcher.state = replace(state, running_since={**state.running_since, key: now})

    def ended(self, key: rules.ProcKey, slots: Iterable[rules.Slot], now: float) -> None:
        """A job's process on these (uid, unit) ended at `now`: the daemon's tick just before saw it
        there, so the idle clocks start here; when it started is forgotten, as the next check would
        forget it (between a replay's rare checks thousands of jobs may start and end)."""
        if self._started_in_check is not None:
            self._started_in_check.pop(key, None)
        state = self.watcher.state
        running_since = dict(state.running_since)
        running_since.pop(key, None)
        self.watcher.state = replace(state, running_since=running_since, seen={**state.seen, **dict.fromkeys(slots, now)})

    async def check(self, sample: Sample, now: float) -> list[Action]:
        self._started_in_check = {}
        try:
            return await self.watcher.check(sample, now)
        finally:
            began, self._started_in_check = self._started_in_check, None
            if began:
                state = self.watcher.state
                self.watcher.state = replace(state, running_since={**began, **state.running_since})

    def next_moment(self, sample: Sample, now: float) -> float | None:
        """The first moment after `now` at which a check of this sample could act."""
        return self.watcher.next_moment(sample, now)

    def next_moment_of(self, slots: Collection[rules.Slot], now: float) -> float | None:
        """The first moment after `now` at which a rule could act on these slots' grants, whose
        processes have just gone (their idle clocks start): rules.next_change over just them."""
        held = [g for uid in {uid for uid, _ in slots} for g in self.store.grants(uid) if (g.uid, g.unit) in slots]
        if not held:
            return None
        view = rules.View((), held, {g.uid: self.accounts.of(g.uid)[1] for g in held}, self.exempt.uids,
                          **demand_fields(self.demand()))
        return rules.next_change(view, self.watcher.state, timing_of(self.config()), now)
