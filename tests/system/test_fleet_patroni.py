"""The fleet on a highly available PostgreSQL, as a lab would run it: Patroni with etcd (Debian's
packages, devtools/patroni.py) managing a leader and a replica on loopback ports, and three real
daemons whose `[fleet] database` lists both members with target_session_attrs=read-write (the
several-servers doc's advice). Logins storm all three nodes through a planned switchover and a
failover (the leader SIGKILLed); the old leader comes back as a replica, rewound by Patroni.
Nothing is lost (every ended grant is in the leader's ledger), nothing is doubled, and no node
writes to a database that is not the leader (each node's fencing memory ends on the leader's
timeline, and the old leader holds no row written after it was demoted)."""
from __future__ import annotations

import json
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from test_fleet_daemons import DaemonFleet, daemon_fleet, member, rows_of

from devtools.harness import wait_for
from devtools.patroni import PatroniCluster
from gpuguard.fleet import LINEAGE_FILE


@pytest.fixture
def cluster() -> Iterator[PatroniCluster]:
    if not (shutil.which("patroni") and shutil.which("etcd")):
        pytest.fail("patroni or etcd missing: apt-get install patroni etcd-server (make deps does)")
    with PatroniCluster.started() as started:
        yield started


@pytest.fixture
def fleet(cluster, make_group, make_user) -> Iterator[DaemonFleet]:
    with daemon_fleet(None, make_group(), make_user) as nodes:  # started on the cluster by the test
        yield nodes


class Storm:
    """One thread per node: a member logs in (2 GPUs) and out again, over and over, until stopped."""

    def __init__(self, fleet: DaemonFleet):
        self.fleet = fleet
        self.users = {name: member(fleet) for name in fleet.nodes}
        self.logins = 0
        self.slowest = 0.0  # seconds: the longest login and logout, what a failover costs a user
        self.failed: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(name,), daemon=True) for name in fleet.nodes]

    def _run(self, name: str) -> None:
        node, user = self.fleet.nodes[name], self.users[name]
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                opened = node.open_session(user)
                node.close_session(user, opened["pid"])
            except Exception as exc:  # a login must never fail, whatever the database does
                self.failed.append(f"{name}: {exc}")
                continue
            with self._lock:
                self.logins += 1
                self.slowest = max(self.slowest, time.monotonic() - started)

    def __enter__(self) -> Storm:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def logins_so_far(self) -> int:
        with self._lock:
            return self.logins


def lineage(node) -> dict:
    return json.loads((Path(node.config.paths.state_dir) / LINEAGE_FILE).read_text())


def timeline(conninfo: str) -> int:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute("SELECT pg_walfile_name(pg_current_wal_lsn())").fetchone()
    assert row is not None
    return int(row[0][:8], 16)


def test_a_switchover_and_a_failover_under_a_login_storm_lose_nothing_and_double_nothing(cluster, fleet):
    fleet.start(quotas={}, database=cluster.conninfo)
    with Storm(fleet) as storm:
        assert wait_for(lambda: storm.logins_so_far() >= 6, 60)
        first = cluster.leader()
        cluster.switchover()  # planned: Patroni stops writes on the leader before the replica takes over
        assert wait_for(lambda: storm.logins_so_far() >= 12 and all(
            n.call("fleet_status")["online"] for n in fleet.nodes.values()), 90)
        killed = cluster.leader()
        assert killed is not None and killed != first
        assert cluster.wait_for(lambda: cluster.following(first), 120), cluster.logs()  # a candidate again
        cluster.kill(killed)  # a crash: Patroni promotes the other member once the leader key expires
        crashed = time.monotonic()
        assert cluster.wait_for(lambda: cluster.leader() not in (None, killed), 120), cluster.logs()
        assert wait_for(lambda: all(n.call("fleet_status")["online"] for n in fleet.nodes.values()), 90)
        print(f"failover: fleet back online {time.monotonic() - crashed:.1f} s after the crash")  # the doc's table
        cluster.start(killed)  # the old leader comes back: rewound, as a replica
        assert cluster.wait_for(lambda: cluster.following(killed), 120), cluster.logs()
        assert wait_for(lambda: all(n.call("fleet_status")["online"] for n in fleet.nodes.values()), 90)
        before = storm.logins_so_far()
        assert wait_for(lambda: storm.logins_so_far() >= before + 6, 60)
    assert storm.failed == []
    print(f"storm: {storm.logins} logins and logouts, the slowest pair {storm.slowest * 1000:.0f} ms")
    # Every ended grant is in the leader's ledger once: the nodes sent again what a failover lost.
    for name, node in fleet.nodes.items():
        assert wait_for(lambda n=node, u=storm.users[name]: n.grants(u) == [], 60), name
    ended = {name: ended_grants(node) for name, node in fleet.nodes.items()}
    leader = cluster.leader()
    assert leader is not None
    on_leader = cluster.member_conninfo(leader)

    def in_ledger() -> dict[str, int]:
        return dict(rows_of(on_leader, "SELECT node, count(*) FROM gpuguard.ledger GROUP BY node"))

    assert wait_for(lambda: in_ledger() == ended, 90), (ended, in_ledger())
    total = sum(ended.values())
    assert rows_of(on_leader, "SELECT count(*) FROM (SELECT DISTINCT node, incarnation, seq FROM gpuguard.ledger) d") \
        == [(total,)]
    # No node wrote anywhere but the leader: each ends fenced to its timeline, and the old leader,
    # now a replica, has exactly the leader's rows (it replays them: it wrote none of its own).
    now = timeline(on_leader)
    assert {lineage(node)["timeline"] for node in fleet.nodes.values()} == {now}
    replica = cluster.member_conninfo(killed)
    assert wait_for(lambda: rows_of(replica, "SELECT count(*) FROM gpuguard.ledger") == [(total,)], 60)
    assert storm.logins > 18 and total > 0  # the storm ran through all of it


def ended_grants(node) -> int:
    """How many ended grants the node has recorded in its outbox, ever (its rows' numbers are never
    reused: the AUTOINCREMENT counter is the count)."""
    with sqlite3.connect(Path(node.config.paths.state_dir) / "fleet.db") as outbox:
        row = outbox.execute("SELECT seq FROM sqlite_sequence WHERE name = 'ledger'").fetchone()
    return int(row[0]) if row else 0

