"""Fair share across servers as `gpuguard fairshare` shows it, the heartbeat that sends only its
digest while the node's truth is unchanged (schema 6), and a release lost to a reconnect: real
PostgreSQL, real daemons (test_fleet_daemons.DaemonFleet) where the daemon is what is tested."""
from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest
from test_fleet_daemons import DaemonFleet, daemon_fleet, member
from test_fleet_db import GPUS, heartbeat_doc, reserve_doc, rows

from devtools.harness import wait_for
from gpuguard.fleet.fleetdb import FleetDb


@pytest.fixture
def fleet(postgres, make_group, make_user) -> Iterator[DaemonFleet]:
    with daemon_fleet(postgres, make_group(), make_user) as nodes:
        yield nodes


def test_fairshare_shows_usage_here_elsewhere_and_the_sum_the_queue_orders_by(fleet):
    heavy, light, holder = member(fleet), member(fleet), member(fleet)
    fleet.start(quotas={"users": {}}, defaults={"gpus": 1})
    assert fleet.login("gpu2", heavy)["gpus"]  # heavy's usage grows on gpu2 only
    gpu1 = fleet.nodes["gpu1"]
    assert fleet.login("gpu1", light)["gpus"]  # light's grows here
    # gpu1 knows heavy from the fleet's usage only: listed, with nothing here

    def standing(name: str) -> dict | None:
        return next((u for u in gpu1.call("fairshare")["users"] if u["user"] == name), None)
    assert wait_for(lambda: (found := standing(heavy.name)) and found["elsewhere"] > 0), gpu1.call("fairshare")
    found = standing(heavy.name)
    assert found["here"] == 0 and found["usage"] == found["elsewhere"] and found["normalized"] == found["usage"]
    mine = standing(light.name)
    assert mine["here"] > 0 and mine["elsewhere"] == 0
    reply = gpu1.call("fairshare")
    assert reply["fleet"] is True and reply["elsewhere_at"] is not None
    shown = gpu1.cli_as(light, "fairshare")
    assert shown.returncode == 0, shown.stderr
    assert "HERE" in shown.stdout and "ELSEWHERE" in shown.stdout and heavy.name in shown.stdout, shown.stdout
    assert "usage on the other servers: as of" in shown.stdout
    # once heavy waits here, the number fairshare shows is the one the queue orders by
    assert fleet.login("gpu1", holder)["gpus"]  # gpu1 is full
    assert "queue" in fleet.login("gpu1", heavy)["message"]

    def same() -> bool:
        queued = gpu1.whoami(heavy)["queue"]
        return queued is not None and abs(queued["usage"] - standing(heavy.name)["normalized"]) < 1e-6
    assert wait_for(same, timeout=15), (gpu1.whoami(heavy)["queue"], standing(heavy.name))


def test_a_heartbeat_sends_what_changed_and_the_database_asks_for_the_rest_when_it_lacks_it(postgres):
    db = FleetDb(postgres.conninfo, "gpu1")
    doc = heartbeat_doc("gpu1", grants=[{"minor": 0, "username": "u1", "uid": 1001, "granted_at": time.time() - 5,
                                         "expires_at": None, "shared": False, "origin": "session"}])
    first = db.heartbeat(doc)
    assert "refused" not in first
    (digest,) = rows(postgres.conninfo, "SELECT digest FROM gpuguard.nodes WHERE name = 'gpu1'")[0]
    assert digest
    # a row changed behind the node's back stays while the node's truth is the same: nothing but
    # last_seen was written
    with psycopg.connect(postgres.conninfo, autocommit=True) as conn:
        conn.execute("DELETE FROM gpuguard.gpus WHERE node = 'gpu1' AND minor = 1")
    seen = rows(postgres.conninfo, "SELECT last_seen FROM gpuguard.nodes")[0][0]
    answer = db.heartbeat({**doc, "taken_at": time.time()})
    assert set(answer) >= {"at", "usage", "held", "free"} and "resend" not in answer
    assert rows(postgres.conninfo, "SELECT last_seen > %s FROM gpuguard.nodes", seen) == [(True,)]
    assert rows(postgres.conninfo, "SELECT count(*) FROM gpuguard.gpus") == [(GPUS - 1,)]
    # a grant more: the grants are written, the rest is not sent
    doc["grants"] = [*doc["grants"], {**doc["grants"][0], "minor": 2, "username": "u3"}]
    assert "resend" not in db.heartbeat({**doc, "taken_at": time.time()})
    assert rows(postgres.conninfo, "SELECT minor, username FROM gpuguard.grants ORDER BY 1") == [(0, "u1"), (2, "u3")]
    assert rows(postgres.conninfo, "SELECT count(*) FROM gpuguard.gpus") == [(GPUS - 1,)]
    # the node removed (`fleet remove --force`): the database asks, and has the whole truth again
    with psycopg.connect(postgres.conninfo, autocommit=True) as conn:
        conn.execute("DELETE FROM gpuguard.nodes WHERE name = 'gpu1'")
    assert "resend" not in db.heartbeat({**doc, "taken_at": time.time()})
    assert rows(postgres.conninfo, "SELECT count(*) FROM gpuguard.gpus") == [(GPUS,)]
    assert rows(postgres.conninfo, "SELECT minor, username FROM gpuguard.grants ORDER BY 1") == [(0, "u1"), (2, "u3")]
    # after the node's own grant-time check the whole truth goes: a grant the node did not make is gone
    db.reserve(reserve_doc("gpu1", "u2", [1], None))
    assert "resend" not in db.heartbeat({**doc, "taken_at": time.time() + 1})
    assert rows(postgres.conninfo, "SELECT minor, username FROM gpuguard.grants ORDER BY 1") == [(0, "u1"), (2, "u3")]
    db.close()


def test_usage_all_brings_every_users_usage_elsewhere(postgres):
    gpu1, gpu2 = FleetDb(postgres.conninfo, "gpu1"), FleetDb(postgres.conninfo, "gpu2")
    now = time.time()
    gpu2.heartbeat(heartbeat_doc("gpu2", ledger=[{"seq": 1, "username": "u7", "minor": 0, "started": now - 7200,
                                                  "ended": now - 3600}]))
    gpu1.heartbeat(heartbeat_doc("gpu1"))
    answer = gpu1.heartbeat({**heartbeat_doc("gpu1"), "usage_all": True})
    assert answer["usage_all"].keys() == {"u7"} and 3500 < answer["usage_all"]["u7"] < 3600, answer
    assert gpu2.heartbeat({**heartbeat_doc("gpu2"), "usage_all": True})["usage_all"] == {}  # its own: not elsewhere
    gpu1.close()
    gpu2.close()


def test_a_release_goes_in_front_of_the_next_heartbeat_or_check(postgres):
    db = FleetDb(postgres.conninfo, "gpu1")
    db.heartbeat(heartbeat_doc("gpu1"))
    assert db.reserve(reserve_doc("gpu1", "u1", [0], 1))["granted"] == [0]
    db.release([(0, "u1")])  # kept for what comes next: no round trip of its own
    assert rows(postgres.conninfo, "SELECT node, minor, username FROM gpuguard.grants") == [("gpu1", 0, "u1")]
    # the node's connection dropped under it (a switchover) meanwhile
    with psycopg.connect(postgres.conninfo, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'gpuguard gpu1'")
    with pytest.raises(psycopg.Error):  # the call that finds it dropped fails (the node goes offline)...
        db.reserve(reserve_doc("gpu1", "u1", [0], 1))
    # ...and the next, on a new connection, finds GPU 0 free there and u1 under quota: the release went first
    assert db.reserve(reserve_doc("gpu1", "u1", [0], 1))["granted"] == [0]
    assert rows(postgres.conninfo, "SELECT node, minor, username FROM gpuguard.grants") == [("gpu1", 0, "u1")]
    # taken back again, then a heartbeat: gone, and nothing left to send
    db.release([(0, "u1")])
    db.heartbeat(heartbeat_doc("gpu1"))
    assert rows(postgres.conninfo, "SELECT node, minor, username FROM gpuguard.grants") == []
    assert db._unreleased == []
    # granted while the node's clock ran an hour ahead, taken back after it was set right: the
    # heartbeat's mirror keeps a grant newer than its snapshot, the release takes it out all the same
    assert db.reserve({**reserve_doc("gpu1", "u1", [1], 1), "granted_at": time.time() + 3600})["granted"] == [1]
    db.release([(1, "u1")])
    db.heartbeat(heartbeat_doc("gpu1"))
    assert rows(postgres.conninfo, "SELECT node, minor, username FROM gpuguard.grants") == []
    db.close()


def test_a_gpu_given_again_to_its_user_before_the_heartbeat_is_mirrored_as_the_new_grant(postgres):
    gpu1, other = FleetDb(postgres.conninfo, "gpu1"), FleetDb(postgres.conninfo, "gpu2")
    gpu1.heartbeat(heartbeat_doc("gpu1"))
    other.heartbeat(heartbeat_doc("gpu2"))
    t = time.time()
    assert gpu1.reserve({**reserve_doc("gpu1", "u1", [0], None), "granted_at": t - 1000})["granted"] == [0]
    gpu1.release([(0, "u1")])  # she logs out 500 s later...
    again = {"minor": 0, "username": "u1", "uid": 1001, "granted_at": t - 10, "expires_at": None, "shared": True,
             "origin": "session"}  # ...and in again on the same GPU, with no check to wait for
    gpu1.heartbeat(heartbeat_doc("gpu1", grants=[again], ledger=[
        {"seq": 1, "username": "u1", "minor": 0, "started": t - 1000, "ended": t - 500}]))
    (granted_at, shared), = rows(postgres.conninfo, "SELECT granted_at, shared FROM gpuguard.grants")
    assert (granted_at, shared) == (pytest.approx(t - 10), True)  # the new grant, not the old one kept
    # her usage counted once: 500 s ended, 10 s of the grant now (not again from the old grant's start)
    assert other.heartbeat(heartbeat_doc("gpu2", usage_for=["u1"]))["usage"]["u1"] == pytest.approx(510, abs=5)
    gpu1.close()
    other.close()


def test_a_grant_the_database_still_has_is_logged_as_what_it_is_not_as_a_second_node_name(fleet):
    alice = member(fleet)
    fleet.start(quotas={"users": {alice.name: {"fleet_gpus": 2}}})
    # a grant of gpu1's GPUs the database kept after gpu1 took it back (a release it lost in a
    # failover); made to look newer than gpu1's heartbeats, which would otherwise take it out
    with psycopg.connect(fleet.postgres.conninfo, autocommit=True) as conn:
        for minor in (0, 1):
            conn.execute("INSERT INTO gpuguard.grants (node, minor, username, uid, granted_at, shared, origin)"
                         " VALUES ('gpu1', %s, 'ggt-gone', 1, %s, false, 'session')", (minor, time.time() + 3600))
    gpu1 = fleet.nodes["gpu1"]
    assert fleet.login("gpu1", alice)["gpus"] == []
    assert wait_for(lambda: "fleet_grant_conflict" in gpu1.log())
    assert "a release or heartbeat it has not received yet" in gpu1.log()
    assert "named the same" not in gpu1.log()
