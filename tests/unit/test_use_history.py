"""Utilisation and memory over time (core.use_history, services.use_history): what a sample adds,
the rings of minutes, ten minutes and hours in the store, and the series read back."""
from __future__ import annotations

import sqlite3

import pytest

from gpuguard.core.model import GpuProcess, GpuUse, ProcessIdentity
from gpuguard.core.sample import Sample
from gpuguard.core.use_history import GPU, LEVELS, ROWS_PER_SERIES, USER, Point, Reading, readings
from gpuguard.services.store import Store
from gpuguard.services.use_history import UseHistory

GiB = 1 << 30
T0 = 1_767_225_600  # 2026-01-01 00:00 UTC: a whole hour, so a whole ten minutes too


def sample(at: float, util: dict[int, int | None], procs: list[tuple[int, int, int | None]], mem: int = 4 * GiB) -> Sample:
    """util: unit -> percent; procs: (uid, unit, memory) one process each."""
    processes = tuple(GpuProcess(1000 + i, unit, memory) for i, (_, unit, memory) in enumerate(procs))
    owners = {1000 + i: ProcessIdentity(1000 + i, uid, 1) for i, (uid, _, _) in enumerate(procs)}
    return Sample(at, processes, owners, frozenset(util), use={u: GpuUse(mem, 80 * GiB, p) for u, p in util.items()})


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "state.db")
    yield s
    s.close()


def rows(store: Store, step: int, kind: str = GPU, key: int = 0) -> list[tuple]:
    with sqlite3.connect(store.path) as db:
        return db.execute("SELECT start, n, util_sum, util_peak, mem_sum, mem_peak FROM use_buckets"
                          " WHERE step = ? AND kind = ? AND key = ? ORDER BY start", (step, kind, key)).fetchall()


def test_a_gpu_s_utilisation_is_shared_among_the_users_on_it_and_summed_over_their_gpus():
    use = {0: GpuUse(10 * GiB, 80 * GiB, 80), 1: GpuUse(30 * GiB, 80 * GiB, 100), 7: GpuUse(GiB, 10 * GiB, None)}
    found = readings(use, [(1001, 0, 4 * GiB), (1002, 0, 6 * GiB), (1001, 1, 20 * GiB), (1001, 1, None),
                           (1003, 7, GiB)], holders=[1004, 1001])
    assert found[(GPU, 0)] == Reading(80.0, 10 * GiB, 80 * GiB)
    assert found[(GPU, 7)] == Reading(None, GiB, 10 * GiB)  # a MIG slice: no utilisation from NVML
    assert found[(USER, 1001)] == Reading(40.0 + 100.0, 24 * GiB, 0.0)  # two processes on GPU 1 count it once
    assert found[(USER, 1002)] == Reading(40.0, 6 * GiB, 0.0)
    assert found[(USER, 1003)] == Reading(0.0, GiB, 0.0)
    assert found[(USER, 1004)] == Reading(0.0, 0.0, 0.0)  # holds a GPU, runs nothing there


def test_minutes_ten_minutes_and_hours_are_sums_of_the_samples_and_every_span_ends_now(store):
    history = UseHistory(store)
    # 25 minutes, a sample every 10 s: GPU 0 busy for the first 10 minutes only; alice on it then.
    for i in range(25 * 6):
        at = T0 + 10 * i
        busy = i < 60
        history.add(sample(at, {0: 100 if busy else 0, 1: 50}, [(1001, 0, 2 * GiB)] if busy else []), holders=[1001])
    now = T0 + 25 * 60 - 5

    # Written: the 24 whole minutes, and the two whole ten minutes summed from them.
    assert len(rows(store, 60)) == 24
    assert rows(store, 600) == [(T0, 60, 6000.0, 100.0, 60 * 4.0 * GiB, 4.0 * GiB),
                                (T0 + 600, 60, 0.0, 0.0, 60 * 4.0 * GiB, 4.0 * GiB)]
    assert rows(store, 600, USER, 1001)[0][1:] == (60, 6000.0, 100.0, 60 * 2.0 * GiB, 2.0 * GiB)
    assert rows(store, 3600) == []  # the hour is not whole yet

    hour = history.read("hour", None, now)
    assert hour.step == 60 and len(hour.starts) == 60 and hour.starts[-1] == T0 + 24 * 60  # the minute counted
    gpu = hour.series[(GPU, 0)]
    assert gpu[-25:] == [Point(100.0, 100.0, 4.0 * GiB, 4.0 * GiB)] * 10 + [Point(0.0, 0.0, 4.0 * GiB, 4.0 * GiB)] * 15
    assert gpu[:-25] == [None] * 35  # no samples then: unknown, not idle
    assert hour.series[(USER, 1001)][-16:] == [Point(100.0, 100.0, 2.0 * GiB, 2.0 * GiB)] + [Point(0.0, 0.0, 0.0, 0.0)] * 15
    assert hour.ticks[-1] == 6 and hour.ticks[0] == 0

    day = history.read("day", None, now)
    assert day.starts[-1] == T0 + 1200 and len(day.starts) == 144
    assert day.series[(GPU, 0)][-3:] == [Point(100.0, 100.0, 4.0 * GiB, 4.0 * GiB), Point(0.0, 0.0, 4.0 * GiB, 4.0 * GiB),
                                         Point(0.0, 0.0, 4.0 * GiB, 4.0 * GiB)]  # the last: 4 minutes and the fifth counted
    assert day.ticks[-1] == 30
    assert day.series[(GPU, 1)][-1] == Point(50.0, 50.0, 4.0 * GiB, 4.0 * GiB)

    week = history.read("week", None, now)
    assert week.starts[-1] == T0 and week.ticks[-1] == 150
    util, peak, memory, _ = week.series[(GPU, 0)][-1]
    assert (util, peak, memory) == (pytest.approx(40.0), 100.0, 4.0 * GiB)  # 10 of 25 minutes busy
    alice = week.series[(USER, 1001)][-1]
    assert alice.util == pytest.approx(40.0) and alice.memory == pytest.approx(2.0 * GiB * 60 / 150)


def test_a_user_sees_only_their_own_series_and_every_gpu(store):
    history = UseHistory(store)
    for i in range(3):
        history.add(sample(T0 + 30 * i, {0: 90, 1: 10}, [(1001, 0, GiB), (1002, 1, GiB)]), holders=[1001, 1002])
    for span in ("hour", "day", "week"):
        trace = history.read(span, {1002}, T0 + 90)
        assert set(trace.series) == {(GPU, 0), (GPU, 1), (USER, 1002)}, span


def test_a_restart_keeps_the_rings_and_sums_what_closed_while_no_daemon_ran(store, tmp_path):
    history = UseHistory(store)
    for i in range(6 * 7):  # 7 minutes, then the daemon stops
        history.add(sample(T0 + 10 * i, {0: 60}, []), holders=[])
    history.close()
    assert len(rows(store, 60)) == 7 and rows(store, 600) == []

    again = UseHistory(store)  # back 2 hours later
    again.add(sample(T0 + 7200, {0: 0}, []), holders=[])
    assert rows(store, 600) == [(T0, 42, 42 * 60.0, 60.0, 42 * 4.0 * GiB, 4.0 * GiB)]
    assert rows(store, 3600) == [(T0, 42, 42 * 60.0, 60.0, 42 * 4.0 * GiB, 4.0 * GiB)]
    week = again.read("week", None, T0 + 7200)
    assert week.series[(GPU, 0)][-3:] == [Point(60.0, 60.0, 4.0 * GiB, 4.0 * GiB), None, Point(0.0, 0.0, 4.0 * GiB, 4.0 * GiB)]
    assert again.read("hour", None, T0 + 7200).series[(GPU, 0)][:-1] == [None] * 59  # its ring's minutes are old


def test_each_series_keeps_at_most_its_rings_rows_and_a_series_gone_for_a_week_goes(store):
    history = UseHistory(store)
    at = T0
    while at < T0 + 9 * 86400:  # nine days, a sample a minute; bob only on the first day
        bob = at < T0 + 86400
        history.add(sample(at, {0: 100}, [(1002, 0, GiB)] if bob else []), holders=[1002] if bob else [])
        at += 60
    assert [len(rows(store, level.step)) for level in LEVELS] == [level.length for level in LEVELS]
    assert sum(len(rows(store, level.step)) for level in LEVELS) == ROWS_PER_SERIES
    assert [len(rows(store, level.step, USER, 1002)) for level in LEVELS] == [0, 0, 0]
    assert (USER, 1002) not in history.read("week", None, at).series


def test_the_operation_gives_a_user_their_own_series_and_the_web_everyones(tmp_path):
    from fakes import GROUP, World

    from gpuguard.config import AccessConfig, Config, WebConfig
    from gpuguard.core.model import Quota

    world = World(tmp_path)
    world.config = Config(access=AccessConfig(group=GROUP), defaults=Quota(gpus=1), web=WebConfig(user="ggweb"))
    try:
        alice, bob = world.lookup.add("alice", 1001, GROUP), world.lookup.add("bob", 1002, GROUP)
        world.lookup.add("ggweb", 990, "ggweb")
        world.login(alice)
        world.services.use_history.add(sample(T0, {0: 80, 1: None}, [(1001, 0, 3 * GiB), (1002, 1, GiB)]),
                                       holders=[1001])
        everyone = world.call("use_history", uid=990, span="day")
        assert everyone["ok"] and everyone["step"] == 600 and len(everyone["ticks"]) == 144
        assert [(g["minor"], g["util"][-1], g["memory_peak"][-1]) for g in everyone["gpus"]] == [(0, 80.0, 4 * GiB),
                                                                                              (1, None, 4 * GiB)]
        assert [(u["user"], u["util"][-1], u["memory"][-1]) for u in everyone["users"]] == [
            ("alice", 80.0, 3 * GiB), ("bob", 0.0, GiB)]
        own = world.call("use_history", uid=bob.uid, span="hour")
        assert [u["uid"] for u in own["users"]] == [bob.uid] and len(own["gpus"]) == 2
        bad = world.call("use_history", uid=bob.uid, span="year")
        assert not bad["ok"] and "span" in bad["error"]
    finally:
        world.store.close()
