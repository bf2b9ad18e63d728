"""report, events and status through Api with fakes (tests/unit/fakes.py); usage counted per hour by the watcher."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from fakes import GROUP, World

from gpuguard.core.model import Event, GpuUse
from gpuguard.services.store import HOUR

DAY = 1_700_006_400  # a UTC midnight


def check(world: World, now: float) -> None:
    asyncio.run(world.watcher.check(world.sampler.last, now))


def test_the_watcher_counts_granted_busy_and_idle_seconds_in_the_hour_they_happen(world):
    alice = world.lookup.add("alice", 1001, GROUP)
    (unit,) = world.login(alice)["gpus"]
    interval = world.config.watcher.interval
    world.sampler.set([(321, 1001, unit, 1 << 30)])
    for tick in range(1, 6):  # busy across the hour's end
        check(world, DAY + HOUR - 3 * interval + tick * interval)
    world.sampler.set([])
    check(world, DAY + HOUR + 3 * interval)  # idle, in the next hour
    world.services.usage.flush()
    rows = {r["key"]: r for r in world.store.usage_by("day", since=DAY, until=DAY + 2 * HOUR)}
    (day,) = rows.values()
    assert day["granted_seconds"] == pytest.approx(5 * interval)
    assert (day["busy_seconds"], day["idle_seconds"]) == (pytest.approx(4 * interval), pytest.approx(interval))
    first_hour = world.store.usage_by("user", since=DAY, until=DAY + HOUR)
    # Ticks at the hour's end minus 2, minus 1 intervals, then on it: the first counts nothing (no tick
    # before it), the second one interval in the old hour, the one on the hour in the new one.
    assert first_hour[0]["busy_seconds"] == pytest.approx(interval)
    assert world.store.usage(1001)[0]["granted_seconds"] == pytest.approx(5 * interval)  # the totals go on


def add_usage(world: World) -> None:
    world.store.add_usage(1001, "alice", 0, DAY, granted=3600.0, busy=2700.0, idle=900.0)
    world.store.add_usage(1002, "bob", 1, DAY, granted=7200.0, busy=0.0, idle=7200.0)
    world.store.add_kill(1001, "alice", 0, DAY, "memory")


def test_root_reports_everyone_and_a_user_only_themself(world):
    world.lookup.add("alice", 1001, GROUP)
    world.lookup.add("bob", 1002, GROUP)
    add_usage(world)
    period = {"since": DAY, "until": DAY + 86400}
    everyone = world.call("report", **period)
    assert [(r["key"], r["busy_share"], r["kills"]) for r in everyone["rows"]] == [
        ("alice", 0.75, {"memory": 1}), ("bob", 0.0, {})]
    assert everyone["total"]["granted_seconds"] == 10800.0 and everyone["total"]["kills_total"] == 1
    own = world.call("report", uid=1001, by="gpu", **period)
    assert [(r["key"], r["granted_seconds"]) for r in own["rows"]] == [(0, 3600.0)]
    assert world.call("report", uid=1001, user="alice", **period)["ok"]
    refused = world.call("report", uid=1001, user="bob", **period)
    assert (refused["ok"], refused["code"]) == (False, 1) and "only root" in refused["error"]
    assert world.call("report", user="bob", **period)["total"]["granted_seconds"] == 7200.0


def test_root_can_report_on_an_account_deleted_since(world):
    add_usage(world)  # no NSS entry for alice or bob any more
    reply = world.call("report", user="alice", since=DAY, until=DAY + 86400)
    assert [r["key"] for r in reply["rows"]] == ["alice"]
    assert world.call("report", user="ghost", since=DAY, until=DAY + 86400)["code"] == 2


@pytest.mark.parametrize("fields, fragment", [
    ({"by": "week"}, "field 'by'"),
    ({"since": DAY + 10, "until": DAY}, "since must be before until"),
    ({"since": "yesterday"}, "field 'since': expected a number"),
])
def test_a_bad_report_request_is_refused_as_usage(world, fields, fragment):
    reply = world.call("report", **{"since": DAY, **fields})
    assert (reply["ok"], reply["code"]) == (False, 2) and fragment in reply["error"]


def test_events_are_filtered_and_a_user_sees_only_their_own(world):
    world.lookup.add("alice", 1001, GROUP)
    for t, uid, rule in [(10.0, 1001, "memory"), (20.0, 1002, "memory"), (30.0, 1001, "idle")]:
        world.store.add_event(Event(t, uid, f"u{uid}", "warning", "m", rule=rule))
    assert [e["time"] for e in world.call("events")["events"]] == [10.0, 20.0, 30.0]
    assert [e["time"] for e in world.call("events", rule="memory", since=15.0)["events"]] == [20.0]
    assert [e["time"] for e in world.call("events", uid=1001)["events"]] == [10.0, 30.0]
    assert world.call("events", uid=1001, user="u1002")["code"] == 1
    assert world.call("events", limit=0)["code"] == 2


def test_status_lists_processes_holders_quota_and_gpu_numbers(world):
    world.quota(gpu_memory=4 << 30, max_time=3600.0)
    alice = world.lookup.add("alice", 1001, GROUP)
    world.lookup.add("bob", 1002, GROUP)
    (unit,) = world.login(alice)["gpus"]
    sample = world.sampler.set([(321, 1001, unit, 3 << 30), (322, 1002, unit, None)], units={0, 1, 2})
    world.sampler.last = replace(sample, use={unit: GpuUse(3 << 30, 80 << 30, 55)})
    world.sampler.names = {321: "python"}
    check(world, 1000.0)  # the watcher resolves names and quotas; status reuses them without NSS
    gpus = {g["minor"]: g for g in world.call("status", uid=1002)["gpus"]}
    gpu = gpus[unit]
    assert (gpu["memory_used"], gpu["utilization"], gpu["processes"]) == (3 << 30, 55, 2)
    assert [(p["pid"], p["user"], p["memory"], p["command"]) for p in gpu["process_list"]] == [
        (321, "alice", 3 << 30, "python"), (322, "bob", None, "")]
    (holder,) = gpu["holders"]
    assert (holder["user"], holder["gpu_memory"], holder["memory_used"]) == ("alice", 4 << 30, 3 << 30)
    assert holder["expires_at"] == holder["granted_at"] + 3600.0
    assert gpus[3]["process_list"] is None and gpus[3]["processes"] is None  # not read: unknown, not empty
