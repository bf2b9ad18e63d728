"""The fleet database's rows as the web view reads them (pure: rows in, reply shapes out; the
real PostgreSQL with issue 21's schema: tests/system/test_web_cluster.py)."""
from __future__ import annotations

import datetime

from gpuguard.web import views
from gpuguard.web.fleet import fleet_status, fleet_whoami, ledger_report
from gpuguard.web.svg import usage_chart

NOW = 1_800_000_000.0
GiB = 1 << 30


def node(name, minor, owner="gpuguard", last_seen=NOW - 5, lease=30.0):
    return {"node": name, "last_seen": last_seen, "lease": lease, "now": NOW, "minor": minor,
            "uuid": f"GPU-{name}-{minor}", "gpu_name": "NVIDIA H100", "memory_total": 80 * GiB, "owner": owner}


def grant(name, minor, user, uid=1001):
    return {"node": name, "minor": minor, "username": user, "uid": uid, "granted_at": NOW - 600,
            "expires_at": None, "shared": False, "origin": "session"}


def waiter(name, ticket, user, priority=0, since=NOW - 60):
    return {"node": name, "ticket": ticket, "username": user, "gpus": 1, "since": since, "priority": priority}


NODES = [node("gpu1", 0), node("gpu1", 1, owner="slurm"), node("gpu2", 0, last_seen=NOW - 3600),
         {**node("gpu3", None)}]
GRANTS = [grant("gpu1", 0, "alice"), grant("gpu2", 0, "bob", 1002)]
QUEUE = [waiter("gpu1", 7, "carol", since=NOW - 120), waiter("gpu1", 8, "alice", priority=5), waiter("gpu1", 9, "dave")]


def test_every_node_its_gpus_owners_holders_queue_and_the_lost_one():
    servers = {name: (status, error) for name, status, error in fleet_status(NODES, GRANTS, QUEUE)}
    assert sorted(servers) == ["gpu1", "gpu2", "gpu3"]
    gpu1, error = servers["gpu1"]
    assert error is None and [g["owner"] for g in gpu1["gpus"]] == ["gpuguard", "slurm"]
    cells = [views.cell("gpu1", g, NOW, views.Viewer(), True) for g in gpu1["gpus"]]
    assert [c.state for c in cells] == ["held", "other"]
    assert cells[0].processes is None and cells[0].holders[0].idle_for is None  # unknown, never idle
    assert [(q["position"], q["user"]) for q in gpu1["queue"]] == [(1, "carol"), (2, "alice"), (3, "dave")]
    assert servers["gpu2"][1].startswith("lost: last heard from")
    assert servers["gpu2"][0]["gpus"][0]["holders"][0]["user"] == "bob"  # what it sent last
    assert servers["gpu3"][0]["gpus"] == []


def test_a_users_grants_and_places_across_the_fleet():
    queue = sorted(QUEUE, key=lambda q: (q["node"], -q["priority"], q["since"]))  # as QUEUE's ORDER BY
    replies = fleet_whoami("alice", NODES, [g for g in GRANTS if g["username"] == "alice"], queue)
    assert list(replies) == ["gpu1"]
    (held,) = replies["gpu1"]["grants"]
    assert (held["minor"], held["uuid"]) == (0, "GPU-gpu1-0")
    assert replies["gpu1"]["queue"]["position"] == 1
    dave = fleet_whoami("dave", NODES, [], queue)["gpu1"]["queue"]
    assert dave["position"] == 3 and dave["ahead"] == [{"user": "carol", "why": "asked first"},
                                                       {"user": "alice", "why": "higher priority"}]
    assert fleet_whoami("nobody", NODES, [], queue) == {}


def test_granted_hours_clipped_to_the_period_and_split_at_midnight():
    midnight = datetime.datetime(2026, 11, 30).timestamp()
    entries = [("gpu1", "alice", 0, midnight - 3600, midnight + 7200),   # 1 h on the 29th, 2 h on the 30th
               ("gpu1", "bob", 1, midnight - 7200, midnight - 3600),     # before the period
               ("gpu2", "alice", 0, midnight, midnight + 1800)]
    since, until = midnight - 3600, midnight + 3 * 3600
    by_day = ledger_report("day", entries, since, until)
    assert [(r["key"], r["granted_seconds"]) for r in by_day["gpu1"]["rows"]] == [("2026-11-29", 3600.0),
                                                                                  ("2026-11-30", 7200.0)]
    assert by_day["gpu1"]["rows"][0]["busy_seconds"] is None
    by_user = ledger_report("user", entries, since, until)
    assert {n: [(r["key"], r["granted_seconds"]) for r in rep["rows"]] for n, rep in by_user.items()} == \
        {"gpu1": [("alice", 10800.0)], "gpu2": [("alice", 1800.0)]}
    usage = views.usage_rows("user", by_user, views.Viewer("alice"), True)
    assert [(u.label, u.granted_hours, u.busy_hours, u.busy_share) for u in usage] == [("alice", 3.5, None, None)]
    assert views.usage_csv([("user", usage)]).splitlines()[1] == "user,alice,3.500,,,"
    chart = usage_chart("by user", usage)
    assert 'class="busy"' not in chart and "busy unknown" in chart
