"""The watcher's pure decisions, boundary by boundary: no processes, no clock, no store."""
from __future__ import annotations

from gpuguard.core import messages, rules
from gpuguard.core.model import Grant, Quota
from gpuguard.core.rules import (
    IDLE,
    KILL,
    MEMORY,
    RELEASE,
    REPORT,
    REVOKE,
    STRAY,
    TERM,
    TIME,
    UNKILLABLE,
    WARN,
    Action,
    Proc,
    State,
    Timing,
    View,
)

GiB = 1 << 30
ALICE, BOB, EXEMPT = 1001, 1002, 1500
T = Timing(grace=30.0, kill_wait=10.0)
NOW = 100_000.0


def grant(uid: int = ALICE, unit: int = 0, granted_at: float = NOW - 50, expires_at: float | None = None,
          last_active: float | None = None) -> Grant:
    return Grant(uid, f"u{uid}", unit, granted_at, expires_at, granted_at if last_active is None else last_active)


def proc(pid: int, memory: int | None, uid: int = ALICE, unit: int = 0, start: int | None = None) -> Proc:
    return Proc(pid, uid, pid * 10 if start is None else start, unit, memory)


DEFAULT_QUOTA = Quota(gpu_memory=20 * GiB)


def view(procs=(), grants=(), quota: Quota | None = DEFAULT_QUOTA, exempt=()) -> View:
    grants = list(grants)
    quotas = {g.uid: quota for g in grants} if quota is not None else {}
    return View(list(procs), grants, quotas, exempt)


def kinds(actions: list[Action]) -> list[tuple[str, str]]:
    return [(a.kind, a.rule) for a in actions]


def run(v: View, state: State, now: float, timing: Timing = T) -> tuple[list[Action], State]:
    """One tick in which every decided action was carried out."""
    actions = rules.decide(v, state, now, timing)
    return actions, rules.advance(v, state, actions, now)


# --- memory

def test_at_quota_is_fine():
    v = view([proc(1, 20 * GiB)], [grant()])
    assert rules.decide(v, State(), NOW, T) == []


def test_one_byte_over_warns_at_once_with_the_numbers():
    v = view([proc(1, 20 * GiB + 1)], [grant()])
    actions = rules.decide(v, State(), NOW, T)
    assert kinds(actions) == [(WARN, MEMORY)]
    assert actions[0].proc == proc(1, 20 * GiB + 1)
    assert actions[0].numbers["used"] == 20 * GiB + 1 and actions[0].numbers["quota"] == 20 * GiB
    assert actions[0].numbers["grace"] == 30.0


def test_sum_over_processes_counts_and_newest_is_named():
    v = view([proc(1, 12 * GiB, start=5), proc(2, 12 * GiB, start=9)], [grant()])
    [warn] = rules.decide(v, State(), NOW, T)
    assert warn.kind == WARN and warn.proc.pid == 2 and warn.numbers["used"] == 24 * GiB


def test_no_quota_means_no_memory_rule():
    v = view([proc(1, 70 * GiB)], [grant()], quota=Quota(gpu_memory=None))
    assert rules.decide(v, State(), NOW, T) == []


def test_warn_once_then_term_only_after_grace():
    v = view([proc(1, 24 * GiB)], [grant()])
    _, state = run(v, State(), NOW)
    assert rules.decide(v, state, NOW + 1, T) == []            # warned already, grace running
    assert rules.decide(v, state, NOW + 29.999, T) == []       # just before grace
    [term] = rules.decide(v, state, NOW + 30, T)                # grace reached: SIGTERM
    assert (term.kind, term.rule, term.proc.pid) == (TERM, MEMORY, 1)
    assert term.signal == "SIGTERM" and term.numbers["kill_wait"] == 10.0


def test_largest_first_as_many_as_it_takes_until_under():
    old, mid, new = proc(1, 10 * GiB, start=100), proc(2, 8 * GiB, start=200), proc(3, 8 * GiB, start=300)
    v = view([old, mid, new], [grant()])                        # 26 GiB, quota 20
    _, state = run(v, State(), NOW)
    actions, state = run(v, state, NOW + 30)
    assert [(a.kind, a.proc.pid) for a in actions] == [(TERM, 1)]  # 16 GiB remain: enough
    # The signalled one is still there (exiting): it counts as gone, nobody else is signalled.
    actions, state = run(v, state, NOW + 31)
    assert actions == []
    # It left: 8 + 8 = 16 GiB <= 20, under now, the episode is over.
    v2 = view([mid, new], [grant()])
    actions, state = run(v2, state, NOW + 32)
    assert actions == [] and state.over == {}


def test_memory_split_across_processes_loses_enough_of_them_in_one_tick():
    parts = [proc(pid, 7 * GiB, start=pid) for pid in range(1, 11)]  # 70 GiB in ten pieces, quota 20
    v = view(parts, [grant()])
    _, state = run(v, State(), NOW)
    actions, state = run(v, state, NOW + 30)
    assert [a.kind for a in actions] == [TERM] * 8               # 14 GiB remain
    assert {a.proc.pid for a in actions} == set(range(3, 11))    # equal sizes: the newest first
    assert rules.decide(v, state, NOW + 31, T) == []


def test_decoys_newer_than_the_big_job_never_shield_it():
    big = proc(1, 70 * GiB, start=1)
    decoys = [proc(pid, 1 << 20, start=pid) for pid in (50, 51, 52)]
    v = view([big, *decoys], [grant()])
    _, state = run(v, State(), NOW)
    actions, state = run(v, state, NOW + 30)
    assert [(a.kind, a.proc.pid) for a in actions] == [(TERM, 1)]
    # The big job ignores SIGTERM; the user rotates decoys meanwhile: none of them is signalled,
    # and the big job gets SIGKILL on time.
    for t, pids in ((31, (53, 54, 55)), (35, (56, 57, 58))):
        v = view([big, *(proc(pid, 1 << 20, start=pid) for pid in pids)], [grant()])
        actions, state = run(v, state, NOW + t)
        assert actions == []
    actions, state = run(v, state, NOW + 40)
    assert [(a.kind, a.proc.pid) for a in actions] == [(KILL, 1)]


def test_a_process_started_past_grace_that_keeps_the_user_over_is_stopped_at_once():
    a, b = proc(1, 15 * GiB, start=1), proc(2, 6 * GiB, start=2)
    v = view([a, b], [grant()])                                 # 21 GiB
    _, state = run(v, State(), NOW)
    actions, state = run(v, state, NOW + 30)
    assert [x.proc.pid for x in actions] == [1]
    c = proc(3, 16 * GiB, start=3)                              # 6 + 16 = 22 GiB beside the exiting one
    actions, state = run(view([a, b, c], [grant()]), state, NOW + 31)
    assert [(x.kind, x.proc.pid) for x in actions] == [(TERM, 3)]  # grace already served: at once


def test_dropping_under_resets_the_episode():
    over, under = view([proc(1, 24 * GiB)], [grant()]), view([proc(1, 19 * GiB)], [grant()])
    _, state = run(over, State(), NOW)
    _, state = run(under, state, NOW + 10)
    assert state.over == {}
    actions, _ = run(over, state, NOW + 40)
    assert kinds(actions) == [(WARN, MEMORY)]                   # a new warning, a new grace


def test_unknown_memory_alone_never_acts():
    v = view([proc(1, None), proc(2, None)], [grant()])
    for t in (NOW, NOW + 1000):
        assert rules.decide(v, State(), t, T) == []


def test_unknown_is_not_counted_as_zero_nor_as_over():
    # Known usage exactly at the quota plus an unknown process: no evidence of being over.
    v = view([proc(1, 20 * GiB), proc(2, None)], [grant()])
    assert rules.decide(v, State(), NOW, T) == []


def test_unknown_process_is_never_the_one_stopped():
    known, unknown = proc(1, 24 * GiB, start=1), proc(2, None, start=99)  # the unknown one is newest
    v = view([known, unknown], [grant()])
    [warn] = rules.decide(v, State(), NOW, T)
    assert warn.proc.pid == 1 and warn.numbers["unknown"] == 1
    _, state = run(v, State(), NOW)
    [term] = rules.decide(v, state, NOW + 30, T)
    assert term.proc.pid == 1


def test_zero_memory_process_is_not_a_candidate():
    v = view([proc(1, 24 * GiB, start=1), proc(2, 0, start=2)], [grant()])
    _, state = run(v, State(), NOW)
    [term] = rules.decide(v, state, NOW + 30, T)
    assert term.proc.pid == 1


def test_memory_is_per_gpu():
    v = view([proc(1, 15 * GiB, unit=0), proc(2, 15 * GiB, unit=1)], [grant(unit=0), grant(unit=1)])
    assert rules.decide(v, State(), NOW, T) == []


def test_memory_is_per_user_on_a_shared_gpu():
    v = view([proc(1, 15 * GiB), proc(2, 15 * GiB, uid=BOB)], [grant(), grant(uid=BOB)])
    assert rules.decide(v, State(), NOW, T) == []


def test_exempt_and_root_are_never_acted_on_for_memory():
    v = view([proc(1, 70 * GiB, uid=EXEMPT), proc(2, 70 * GiB, uid=0)],
             [grant(uid=EXEMPT), grant(uid=0)], exempt={EXEMPT})
    _, state = run(v, State(), NOW)
    assert rules.decide(v, state, NOW + 1000, T) == []


# --- ending: TERM, kill_wait, KILL, unkillable

def test_kill_after_kill_wait_then_unkillable_once():
    p = proc(1, 24 * GiB)
    v = view([p], [grant()])
    _, state = run(v, State(), NOW)
    _, state = run(v, state, NOW + 30)                          # SIGTERM
    assert rules.decide(v, state, NOW + 39.999, T) == []
    actions, state = run(v, state, NOW + 40)
    assert [(a.kind, a.signal) for a in actions] == [(KILL, "SIGKILL")]
    assert rules.decide(v, state, NOW + 49.999, T) == []
    actions, state = run(v, state, NOW + 50)
    assert kinds(actions) == [(UNKILLABLE, MEMORY)]
    assert rules.decide(v, state, NOW + 500, T) == []           # reported once; never a second SIGTERM


def test_unkillable_stops_blocking_the_next_term():
    stuck, other = proc(1, 24 * GiB, start=2), proc(2, 4 * GiB, start=1)
    v = view([stuck, other], [grant()])
    state = State()
    for t in (0, 30, 40, 50):
        _, state = run(v, state, NOW + t)
    assert state.stopping[stuck.key].unkillable
    actions, _ = run(v, state, NOW + 51)
    assert [(a.kind, a.proc.pid) for a in actions] == [(TERM, 2)]


def test_process_gone_is_forgotten():
    p = proc(1, 24 * GiB)
    v = view([p], [grant()])
    _, state = run(v, State(), NOW)
    _, state = run(v, state, NOW + 30)
    _, state = run(view([], [grant()]), state, NOW + 31)
    assert state.stopping == {} and state.over == {}


def test_new_process_with_a_reused_pid_is_not_the_signalled_one():
    first = proc(1, 24 * GiB, start=10)
    _, state = run(view([first], [grant()]), State(), NOW)
    _, state = run(view([first], [grant()]), state, NOW + 30)   # SIGTERM to (1, 10)
    reused = proc(1, 24 * GiB, start=11)                        # same pid, another process
    actions = rules.decide(view([reused], [grant()]), state, NOW + 40, T)
    assert all(a.kind != KILL for a in actions)                 # no SIGKILL for a process never warned


def test_a_process_on_two_gpus_gets_one_signal_per_tick():
    a0, a1 = proc(1, 24 * GiB, unit=0), proc(1, 24 * GiB, unit=1)
    v = view([a0, a1], [grant(unit=0), grant(unit=1)])
    _, state = run(v, State(), NOW)
    actions, state = run(v, state, NOW + 30)
    assert [a.kind for a in actions] == [TERM]
    actions, _ = run(v, state, NOW + 40)
    assert [a.kind for a in actions] == [KILL]


# --- time

def test_time_warnings_at_ten_and_one_minute_once_each():
    g = grant(expires_at=NOW + 3600)
    v = view([], [g], quota=Quota())
    assert rules.decide(v, State(), NOW + 3600 - 600.001, T) == []
    actions, state = run(v, State(), NOW + 3600 - 600)
    assert kinds(actions) == [(WARN, TIME)] and actions[0].numbers["threshold"] == 600
    assert rules.decide(v, state, NOW + 3600 - 61, T) == []
    actions, state = run(v, state, NOW + 3600 - 60)
    assert kinds(actions) == [(WARN, TIME)] and actions[0].numbers["threshold"] == 60
    assert rules.decide(v, state, NOW + 3600 - 1, T) == []


def test_short_grant_gets_only_the_last_warning():
    v = view([], [grant(expires_at=NOW + 5)], quota=Quota())
    actions, state = run(v, State(), NOW)
    assert kinds(actions) == [(WARN, TIME)] and actions[0].numbers["threshold"] == 60
    assert rules.decide(v, state, NOW + 1, T) == []


def test_expiry_revokes_and_terms_every_process_whatever_its_memory():
    g = grant(expires_at=NOW + 10)
    procs = [proc(1, 1 * GiB), proc(2, None), proc(3, 0)]
    v = view(procs, [g], quota=Quota())
    assert all(a.kind != REVOKE for a in rules.decide(v, State(), NOW + 9.999, T))
    actions, state = run(v, State(), NOW + 10)
    assert kinds(actions)[0] == (REVOKE, TIME)
    assert actions[0].numbers["processes"] == 3
    assert sorted(a.proc.pid for a in actions if a.kind == TERM) == [1, 2, 3]
    # Next tick the grant is gone: the processes are being stopped, not new strays.
    nxt = view(procs, [], quota=Quota())
    assert rules.decide(nxt, state, NOW + 11, T) == []
    assert {a.kind for a in rules.decide(nxt, state, NOW + 20, T)} == {KILL}


def test_expiry_never_signals_exempt():
    v = view([proc(1, GiB, uid=EXEMPT)], [grant(uid=EXEMPT, expires_at=NOW)], quota=Quota(), exempt={EXEMPT})
    assert kinds(rules.decide(v, State(), NOW, T)) == [(REVOKE, TIME)]


def test_no_limit_no_time_rule():
    v = view([], [grant(expires_at=None)], quota=Quota())
    assert rules.decide(v, State(), NOW + 10**7, T) == []


# --- idle

def test_idle_release_at_the_boundary():
    g = grant(last_active=NOW - 100)
    v = view([], [g], quota=Quota(idle_timeout=100))
    assert rules.decide(v, State(), NOW - 0.001, T) == []
    [release] = rules.decide(v, State(), NOW, T)
    assert (release.kind, release.rule) == (RELEASE, IDLE) and release.numbers["idle_timeout"] == 100


def test_a_process_keeps_the_grant_active_even_with_unknown_memory():
    g = grant(last_active=NOW - 1000)
    v = view([proc(1, None)], [g], quota=Quota(idle_timeout=100))
    actions, state = run(v, State(), NOW)
    assert actions == [] and state.seen[(ALICE, 0)] == NOW
    # The process left: idle counts from the last tick it was seen, not the stored last_active.
    empty = view([], [g], quota=Quota(idle_timeout=100))
    assert rules.decide(empty, state, NOW + 99, T) == []
    assert kinds(rules.decide(empty, state, NOW + 100, T)) == [(RELEASE, IDLE)]


def test_another_users_process_does_not_keep_a_grant_active():
    g = grant(last_active=NOW - 200)
    v = view([proc(1, GiB, uid=BOB)], [g, grant(uid=BOB)], quota=Quota(idle_timeout=100))
    assert (RELEASE, IDLE) in kinds(rules.decide(v, State(), NOW, T))


def test_no_idle_timeout_no_release():
    v = view([], [grant(last_active=0)], quota=Quota(idle_timeout=None))
    assert rules.decide(v, State(), NOW, T) == []


def test_expired_and_idle_is_revoked_not_released():
    v = view([], [grant(expires_at=NOW, last_active=0)], quota=Quota(idle_timeout=1))
    assert kinds(rules.decide(v, State(), NOW, T)) == [(REVOKE, TIME)]


# --- stray

def test_stray_warned_then_termed_after_grace():
    p = proc(1, GiB, uid=BOB)
    v = view([p], [grant()])                                    # only alice holds GPU 0
    actions, state = run(v, State(), NOW)
    assert kinds(actions) == [(WARN, STRAY)] and actions[0].proc == p
    assert rules.decide(v, state, NOW + 29.9, T) == []
    [term] = rules.decide(v, state, NOW + 30, T)
    assert (term.kind, term.rule, term.proc) == (TERM, STRAY, p)


def test_next_deadline_is_the_first_wait_to_end():
    p = proc(1, GiB, uid=BOB)
    v = view([p], [grant()])
    assert rules.next_deadline(State(), T, NOW) is None
    _, state = run(v, State(), NOW)                          # reported: grace runs
    assert rules.next_deadline(state, T, NOW) == NOW + 30
    [term], state = run(v, state, NOW + 30)
    assert term.kind == TERM and rules.next_deadline(state, T, NOW + 30) == NOW + 40  # kill_wait runs
    assert rules.next_deadline(state, T, NOW + 40) is None   # none after that


def test_stray_on_another_gpu_of_a_grant_holder():
    v = view([proc(1, GiB, unit=1)], [grant(unit=0)])
    assert kinds(rules.decide(v, State(), NOW, T)) == [(WARN, STRAY)]


def test_rotating_strays_shorter_than_grace_are_still_stopped():
    # One stray process after another, each gone before grace: the clock runs for bob on GPU 0.
    state, warnings = State(), 0
    for i in range(7):
        p = proc(100 + i, GiB, uid=BOB, start=100 + i)
        actions, state = run(view([p], [grant()]), state, NOW + 5 * i)
        warnings += sum(a.kind == WARN for a in actions)
        if 5 * i < 30:
            assert all(a.kind != TERM for a in actions)
        else:
            assert [(a.kind, a.rule, a.proc) for a in actions] == [(TERM, STRAY, p)]
        _, state = run(view([], [grant()]), state, NOW + 5 * i + 2)   # it left before the next one
    assert warnings == 1


def test_stray_episode_is_forgotten_after_a_quiet_period():
    p = proc(1, GiB, uid=BOB)
    _, state = run(view([p], [grant()]), State(), NOW)
    _, state = run(view([], [grant()]), state, NOW + 1)
    _, kept = run(view([], [grant()]), state, NOW + rules.STRAY_QUIET - 1)   # last seen at NOW
    _, gone = run(view([], [grant()]), state, NOW + rules.STRAY_QUIET)
    assert (BOB, 0) in kept.stray and gone.stray == {}
    actions, _ = run(view([proc(2, GiB, uid=BOB)], [grant()]), gone, NOW + 2 + rules.STRAY_QUIET)
    assert kinds(actions) == [(WARN, STRAY)]                    # a new episode, a new grace


def test_stray_that_gets_a_grant_is_left_alone():
    p = proc(1, GiB, uid=BOB)
    _, state = run(view([p], [grant()]), State(), NOW)
    granted = view([p], [grant(), grant(uid=BOB)])
    actions, state = run(granted, state, NOW + 30)
    assert actions == [] and state.stray == {}


def test_exempt_and_root_strays_are_reported_once_never_signalled():
    v = view([proc(1, GiB, uid=EXEMPT), proc(2, GiB, uid=0)], [], exempt={EXEMPT})
    actions, state = run(v, State(), NOW)
    assert kinds(actions) == [(REPORT, STRAY), (REPORT, STRAY)]
    assert rules.decide(v, state, NOW + 1000, T) == []


def test_root_is_exempt_even_when_not_listed():
    v = view([proc(1, GiB, uid=0)], [grant(uid=0, expires_at=NOW)], quota=Quota(gpu_memory=1))
    actions = rules.decide(v, State(), NOW, T)
    assert all(a.kind not in (TERM, KILL) for a in actions)


# --- re-sample, usage, messages

def test_confirmed_keeps_only_what_both_samples_agree_on():
    first = rules.decide(view([proc(1, 24 * GiB), proc(2, GiB, uid=BOB)], [grant()]), State(), NOW, T)
    second = rules.decide(view([proc(1, 23 * GiB)], [grant()]), State(), NOW, T)
    agreed = rules.confirmed(first, second)
    assert kinds(agreed) == [(WARN, MEMORY)] and agreed[0].numbers["used"] == 23 * GiB


def test_usage_splits_busy_and_idle():
    v = view([proc(1, GiB)], [grant(unit=0), grant(unit=1)])
    assert rules.usage(v, 2.0) == {(ALICE, 0): (2.0, 2.0, 0.0), (ALICE, 1): (2.0, 0.0, 2.0)}


def test_messages_say_what_why_and_what_to_do():
    warn = Action(WARN, MEMORY, ALICE, 2, proc(4242, 24 * GiB, unit=2),
                  {"used": 24 * GiB, "quota": 20 * GiB, "grace": 30.0, "processes": 1, "unknown": 0})
    assert messages.action_message(warn, "python") == (
        "gpuguard: your process 4242 (python) on GPU 2 uses 24GiB, over your 20GiB quota; "
        "it will be stopped in 30s unless usage drops - see gpuguard whoami")
    several = Action(WARN, MEMORY, ALICE, 2, proc(7, 4 * GiB, unit=2),
                     {"used": 24 * GiB, "quota": 20 * GiB, "grace": 30.0, "processes": 3, "unknown": 0})
    assert "3 processes on GPU 2 use 24GiB together" in messages.action_message(several, "python")
    term = Action(TERM, MEMORY, ALICE, 2, proc(4242, 24 * GiB, unit=2),
                  {"used": 24 * GiB, "quota": 20 * GiB, "grace": 30.0, "kill_wait": 10.0})
    assert messages.action_message(term, "python").startswith(
        "gpuguard: stopping your process 4242 (python) on GPU 2 with SIGTERM")
    revoke = Action(REVOKE, TIME, ALICE, 2, None, {"max_time": 3600.0, "processes": 2, "expires_at": NOW})
    assert "access is revoked; your 2 processes on it will be stopped" in messages.action_message(revoke)
    release = Action(RELEASE, IDLE, ALICE, 2, None, {"idle_timeout": 3600.0, "idle": 3600.0})
    assert "gpuguard request" in messages.action_message(release) and "sessions are untouched" in messages.action_message(release)
    for action in (Action(KILL, MEMORY, ALICE, 2, proc(1, 1), {"kill_wait": 10.0}),
                   Action(UNKILLABLE, MEMORY, ALICE, 2, proc(1, 1), {}),
                   Action(WARN, TIME, ALICE, 2, None, {"left": 60.0, "expires_at": NOW, "threshold": 60.0}),
                   Action(WARN, STRAY, BOB, 2, proc(1, 1, uid=BOB), {"grace": 30.0}),
                   Action(REPORT, STRAY, 0, 2, proc(1, 1, uid=0), {})):
        assert messages.action_message(action, "x").startswith("gpuguard: ") and "GPU 2" in messages.action_message(action, "x")
