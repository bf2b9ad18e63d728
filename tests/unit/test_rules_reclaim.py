"""Reclaim on demand and soft max_time (gpuguard.core.rules), and next_change held against decide."""
from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

from gpuguard import config
from gpuguard.core import messages, rules
from gpuguard.core.model import Grant, Quota
from gpuguard.core.rules import RECLAIM, RELEASE, REVOKE, TERM, TIME, WARN, Proc, State, Timing, View

ALICE, BOB = 1001, 1002
T = Timing(grace=30.0, kill_wait=10.0)
SOFT = replace(T, soft_max_time=True)
NOW = 100_000.0
RECLAIMING = Quota(reclaim_after=600.0)


def grant(uid: int, unit: int, last_active: float, expires_at: float | None = None) -> Grant:
    return Grant(uid, f"u{uid}", unit, last_active, expires_at, last_active)


def view(grants, procs=(), demand=0, quota=RECLAIMING) -> View:
    return View(list(procs), list(grants), {g.uid: quota for g in grants}, demand=demand)


def kinds(actions):
    return [(a.kind, a.rule, a.uid, a.unit) for a in actions]


def test_an_idle_grant_is_kept_while_nobody_waits():
    v = view([grant(ALICE, 0, last_active=NOW - 3600)], demand=0)
    assert rules.decide(v, State(), NOW, T) == []


def test_only_as_many_as_the_queue_wants_are_reclaimed_the_longest_idle_first():
    grants = [grant(ALICE, 0, last_active=NOW - 700), grant(BOB, 1, last_active=NOW - 5000),
              grant(ALICE, 2, last_active=NOW - 100)]  # this one not idle long enough
    actions = rules.decide(view(grants, demand=1), State(), NOW, T)
    assert kinds(actions) == [(RELEASE, RECLAIM, BOB, 1)]
    assert "for someone waiting" in messages.action_message(actions[0])
    actions = rules.decide(view(grants, demand=5), State(), NOW, T)
    assert kinds(actions) == [(RELEASE, RECLAIM, BOB, 1), (RELEASE, RECLAIM, ALICE, 0)]


def test_a_grant_in_use_is_never_reclaimed_and_the_boundary_reclaims():
    busy = grant(ALICE, 0, last_active=NOW - 5000)
    v = view([busy], procs=[Proc(7, ALICE, 70, 0, None)], demand=3)
    assert rules.decide(v, State(), NOW, T) == []
    assert kinds(rules.decide(view([grant(BOB, 1, NOW - 600)], demand=1), State(), NOW, T)) == [
        (RELEASE, RECLAIM, BOB, 1)]
    assert rules.decide(view([grant(BOB, 1, NOW - 599)], demand=1), State(), NOW, T) == []


def test_soft_max_time_warns_once_and_revokes_only_when_someone_waits():
    over = grant(ALICE, 0, last_active=NOW, expires_at=NOW - 1)
    running = [Proc(7, ALICE, 70, 0, None)]
    hard = rules.decide(view([over], running, quota=Quota()), State(), NOW, T)
    assert [(a.kind, a.rule) for a in hard] == [(REVOKE, TIME), (TERM, TIME)]
    soft = rules.decide(view([over], running, quota=Quota()), State(), NOW, SOFT)
    assert [(a.kind, a.rule) for a in soft] == [(WARN, TIME)]
    assert "you keep it while nobody waits" in messages.action_message(soft[0])
    state = rules.advance(view([over], running, quota=Quota()), State(), soft, NOW)
    assert rules.decide(view([over], running, quota=Quota()), state, NOW + 5, SOFT) == []  # warned once
    wanted = rules.decide(view([over], running, demand=1, quota=Quota()), state, NOW + 5, SOFT)
    assert [(a.kind, a.rule) for a in wanted] == [(REVOKE, TIME), (TERM, TIME)]


def test_reclaim_goes_before_revoking_an_over_time_grant():
    idle = grant(BOB, 1, last_active=NOW - 5000)
    over = grant(ALICE, 0, last_active=NOW, expires_at=NOW - 1)
    v = View([Proc(7, ALICE, 70, 0, None)], [over, idle], {ALICE: Quota(), BOB: RECLAIMING}, demand=1)
    actions = [a for a in rules.decide(v, State(), NOW, SOFT) if a.kind != WARN]
    assert kinds(actions) == [(RELEASE, RECLAIM, BOB, 1)]


def test_next_change_is_when_decide_first_acts():
    v = view([grant(ALICE, 0, last_active=NOW)], demand=1, quota=Quota(idle_timeout=3600.0, reclaim_after=600.0))
    at = rules.next_change(v, State(), T, NOW)
    assert at == NOW + 600
    assert rules.decide(v, State(), at - 0.001, T) == []
    assert kinds(rules.decide(v, State(), at, T)) == [(RELEASE, RECLAIM, ALICE, 0)]
    timed = view([grant(ALICE, 0, last_active=NOW, expires_at=NOW + 900)], procs=[Proc(7, ALICE, 70, 0, None)],
                 quota=Quota())
    assert rules.next_change(timed, State(), T, NOW) == NOW + 300  # the 10-minute warning
    assert rules.next_change(view([], quota=Quota()), State(), T, NOW) is None


def test_soft_max_time_stops_a_single_gpu_job_before_a_multi_gpu_one_and_the_least_work_first():
    # alice's 4-GPU job (one process on GPUs 0-3) started long ago; bob's and carol's 1-GPU jobs since.
    carol = 1003
    wide = [Proc(7, ALICE, 70, m, None) for m in range(4)]
    old_single, young_single = Proc(8, BOB, 80, 4, None), Proc(9, carol, 90, 5, None)
    grants = [grant(ALICE, m, NOW, expires_at=NOW - 7200) for m in range(4)]
    grants += [grant(BOB, 4, NOW, expires_at=NOW - 1), grant(carol, 5, NOW, expires_at=NOW - 1)]
    procs = [*wide, old_single, young_single]
    seen = View(procs, grants, {g.uid: Quota() for g in grants})
    state = rules.advance(seen, State(), [], NOW - 3 * 3600)  # all first seen 3 hours ago ...
    state = replace(state, running_since={**state.running_since, young_single.key: NOW - 600})  # ... carol's 10 min
    v = replace(seen, demand=1)
    actions = [a for a in rules.decide(v, state, NOW, SOFT) if a.kind != WARN]
    assert kinds(actions) == [(REVOKE, TIME, carol, 5), (TERM, TIME, carol, 5)]  # 600 GPU-s lost, not 10,800
    actions = [a for a in rules.decide(replace(v, demand=2), state, NOW, SOFT) if a.kind != WARN]
    assert [(a.uid, a.unit) for a in actions if a.kind == REVOKE] == [(carol, 5), (BOB, 4)]
    # the 4-GPU job, the longest over, goes only when stopping single-GPU jobs cannot cover the demand
    actions = [a for a in rules.decide(replace(v, demand=3), state, NOW, SOFT) if a.kind == REVOKE]
    assert [(a.uid, a.unit) for a in actions][:2] == [(carol, 5), (BOB, 4)] and actions[2].uid == ALICE


def test_the_watcher_remembers_when_it_first_saw_each_process():
    proc = Proc(7, ALICE, 70, 0, None)
    v = View([proc], [grant(ALICE, 0, NOW)], {ALICE: Quota()})
    state = rules.advance(v, State(), [], NOW)
    assert rules.advance(v, state, [], NOW + 50).running_since == {proc.key: NOW}
    assert rules.advance(replace(v, procs=[]), state, [], NOW + 50).running_since == {}


def test_the_default_quota_reclaims_a_gpu_unused_for_ten_minutes_only_while_someone_waits():
    shipped = config.load(Path(__file__).resolve().parents[2] / "etc" / "gpuguard.toml")
    assert shipped.defaults.reclaim_after == config.DEFAULT_QUOTA.reclaim_after  # the file shows the default
    default = config.DEFAULT_QUOTA
    idle_ten_minutes = [grant(ALICE, 0, last_active=NOW - 600)]
    assert kinds(rules.decide(view(idle_ten_minutes, demand=1, quota=default), State(), NOW, T)) == [
        (RELEASE, RECLAIM, ALICE, 0)]
    assert rules.decide(view(idle_ten_minutes, demand=0, quota=default), State(), NOW, T) == []
    just_under = [grant(ALICE, 0, last_active=NOW - 599)]
    assert rules.decide(view(just_under, demand=1, quota=default), State(), NOW, T) == []
    in_use = [grant(ALICE, 0, last_active=NOW - 7200)]
    assert rules.decide(view(in_use, [Proc(7, ALICE, 70, 0, None)], demand=1, quota=default), State(), NOW, T) == []


def test_next_change_has_no_reclaim_time_while_nobody_waits_for_the_unit():
    quota = Quota(idle_timeout=3600.0, reclaim_after=600.0)
    idle = [grant(ALICE, 0, last_active=NOW)]
    assert rules.next_change(view(idle, demand=0, quota=quota), State(), T, NOW) == NOW + 3600
    assert rules.next_change(view(idle, demand=1, quota=quota), State(), T, NOW) == NOW + 600
    elsewhere = replace(view(idle, demand=1, quota=quota), useful=frozenset({1}))  # a waiter wants another kind
    assert rules.next_change(elsewhere, State(), T, NOW) == NOW + 3600


def random_case(rng: random.Random) -> tuple[View, State, Timing]:
    """A view of up to 8 grants of two users on 12 GPUs, half of them busy (some by a stranger),
    with quotas, demand and timing drawn at random, and the state a tick before."""
    units = rng.sample(range(12), rng.randint(0, 8))
    grants = [Grant(uid, f"u{uid}", unit, NOW - rng.uniform(0, 4000),
                    rng.choice([None, NOW + rng.uniform(-100, 1500)]), NOW - rng.uniform(0, 4000))
              for unit in units for uid in [rng.choice([ALICE, BOB])]]
    procs = [Proc(100 + unit, g.uid if rng.random() < 0.8 else 3000, 7, unit, rng.choice([None, 1 << 30]))
             for g in grants for unit in [g.unit] if rng.random() < 0.5]
    quotas = {uid: Quota(idle_timeout=rng.choice([None, 900.0, 3600.0]), reclaim_after=rng.choice([None, 60.0, 600.0]),
                         gpu_memory=rng.choice([None, 1 << 29]))
              for uid in (ALICE, BOB)}
    v = View(procs, grants, quotas, demand=rng.randint(0, 2),
             useful=rng.choice([None, frozenset(rng.sample(range(12), 6))]))
    return v, rules.advance(v, State(), [], NOW - rng.uniform(0, 50)), rng.choice([T, SOFT])


def test_decide_acts_alike_at_every_moment_before_next_change():
    """next_change held against decide on random views: between now and the moment it names,
    decide's actions are those it takes now (a replay that sleeps until then misses nothing)."""
    rng = random.Random(20)
    for _ in range(300):
        v, state, timing = random_case(rng)
        at = rules.next_change(v, state, timing, NOW)
        now_keys = [a.key for a in rules.decide(v, state, NOW, timing)]
        end = at if at is not None else NOW + 10_000
        for moment in sorted(rng.uniform(NOW, end) for _ in range(5)):
            if moment < end:
                assert [a.key for a in rules.decide(v, state, moment, timing)] == now_keys, (v, state, moment, at)


def test_a_process_arriving_on_a_held_gpu_is_acted_on_at_once_only_under_a_memory_quota():
    """acts_on_arrival held against decide on random views: where nothing is due, a new process
    on an idle grant is acted on only where acts_on_arrival says a rule may (a replay checks only
    then), and where it says so, some are (over a memory quota, or on a grant past its time)."""
    rng = random.Random(21)
    added = 0
    for _ in range(400):
        v, state, timing = random_case(rng)
        idle = [g for g in v.grants if (g.uid, g.unit) not in v.on_slot]
        if not idle:
            continue
        held = rng.choice(idle)
        arrived = replace(v, procs=[*v.procs, Proc(900, held.uid, 9, held.unit, rng.choice([None, 1 << 30]))])
        if rules.decide(v, state, NOW, timing):
            continue  # something is due already: a replay checks then anyway
        new = rules.decide(arrived, state, NOW, timing)
        if not rules.acts_on_arrival(held, v.quotas[held.uid], NOW):
            assert not new, (v, held)
        added += bool(new)
    assert added  # some arrivals were acted on at once: the test can tell


def test_processes_leaving_move_no_time_earlier_but_their_own_gpus_idle_clocks():
    """Processes that end (their GPUs' idle clocks start now), grants given back and demand that
    shrinks: the next moment a rule may act is no earlier than the earlier of the one before and
    next_change over just the grants the processes left (ReplayWatch.next_moment_of, a replay's batch
    of ends)."""
    rng = random.Random(22)
    for _ in range(400):
        v, state, timing = random_case(rng)
        before = rules.next_change(v, state, timing, NOW)
        left = {slot for slot in v.on_slot if rng.random() < 0.5}
        kept = [g for g in v.grants if (g.uid, g.unit) in left or rng.random() < 0.8]
        after = replace(v, procs=[p for p in v.procs if (p.uid, p.unit) not in left], grants=kept,
                        demand=rng.randint(0, v.demand))
        seen = replace(state, seen={**state.seen, **dict.fromkeys(left, NOW)})
        alone = replace(after, procs=[], grants=[g for g in kept if (g.uid, g.unit) in left])
        bound = min(t for t in (before, rules.next_change(alone, seen, timing, NOW), float("inf")) if t is not None)
        exact = rules.next_change(after, seen, timing, NOW)
        assert (exact if exact is not None else float("inf")) >= bound, (v, left)
