"""The fleet database itself (gpuguard.fleet.schema and fleetdb) on a real PostgreSQL: migrations
under concurrency and across versions, the grant-time check under a storm from five nodes (with
the database killed, or the primary replaced by its promoted standby, mid-storm), the heartbeat's
mirror, the ledger replayed without duplicates, and lost nodes."""
from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from devtools.harness import wait_for
from devtools.postgres import stop_all_under
from gpuguard.fleet import schema
from gpuguard.fleet.fleetdb import FleetDb, connect, migrate
from gpuguard.fleet.schema import FleetError

NODES = [f"node{i}" for i in range(5)]
GPUS = 8


def heartbeat_doc(node: str, grants: list[dict] | None = None, ledger: list[dict] | None = None,
                  taken_at: float | None = None, lease: float = 30.0, grace: float = 60.0,
                  usage_for: list[str] | None = None, users: list[str] | None = None,
                  queue: list[dict] | None = None) -> dict:
    """A heartbeat document as FleetNode.snapshot makes it (its keys; the daemon tests send real ones)."""
    return {"node": node, "rack": "r1" if node < "node3" else "r2", "ssh": node, "version": "test",
            "schema": schema.CURRENT, "incarnation": "inc1", "heartbeat": 10.0, "lease": lease, "grace": grace,
            "taken_at": time.time() if taken_at is None else taken_at, "half_life": 7 * 86400.0,
            "gpus": [{"minor": m, "uuid": f"GPU-{node}-{m}", "name": "sim", "memory_total": 80 << 30,
                      "owner": "gpuguard"} for m in range(GPUS)],
            "grants": grants or [], "queue": queue or [], "ledger": ledger or [], "usage_for": usage_for or [],
            "users": users or [], "want_free": False}


def reserve_doc(node: str, user: str, minors: list[int], quota: int | None, shared: bool = False) -> dict:
    return {"node": node, "user": user, "uid": 1000 + int(user[1:]), "cluster_gpus": quota, "minors": minors,
            "granted_at": time.time(), "expires_at": None, "shared": shared, "origin": "session"}


def rows(conninfo: str, query: str, *params) -> list[tuple]:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return conn.execute(query, params).fetchall()


def register(conninfo: str) -> None:
    for node in NODES:
        db = FleetDb(conninfo, node)
        db.heartbeat(heartbeat_doc(node))
        db.close()


def test_migrations_apply_once_when_nodes_start_together(postgres):
    errors: list[BaseException] = []

    def start(node: str) -> None:
        try:
            with connect(postgres.conninfo, node) as conn:
                migrate(conn, node)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(node,)) for node in NODES]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert rows(postgres.conninfo, "SELECT version FROM gpuguard.migrations") == [(m.version,) for m in schema.MIGRATIONS]
    with connect(postgres.conninfo, "again") as conn:
        assert migrate(conn, "again") == schema.CURRENT


def test_rolling_upgrade_a_newer_additive_schema_is_used_and_a_breaking_one_refused(postgres):
    with connect(postgres.conninfo, "old") as conn:
        migrate(conn, "old")
        # a newer node added a table and said nodes of this version still work: this node goes on
        conn.execute("CREATE TABLE gpuguard.added_later (x integer)")
        conn.execute("INSERT INTO gpuguard.migrations (version, min_node, node) VALUES (%s, 1, 'new')",
                     (schema.CURRENT + 1,))
        assert migrate(conn, "old") == schema.CURRENT + 1
        FleetDb(postgres.conninfo, "old").heartbeat(heartbeat_doc("old"))
        # one that old nodes cannot follow: refused with what to do
        conn.execute("INSERT INTO gpuguard.migrations (version, min_node, node) VALUES (%s, %s, 'newer')",
                     (schema.CURRENT + 2, schema.CURRENT + 1))
        with pytest.raises(FleetError, match="upgrade gpuguard on this node"):
            migrate(conn, "old")


@dataclass
class Storm:
    """200 grant attempts from 5 nodes, 20 at a time, for 10 users with fleet quotas of 1 to 3 GPUs."""

    conninfo: str
    granted: int = 0
    over_quota: int = 0
    double: int = 0
    failed: int = 0
    after_fault: int = 0
    fault_done: threading.Event = None  # type: ignore[assignment]
    fault_error: BaseException | None = None  # the fault itself failed (the database did not come back)

    QUOTAS = {f"u{i}": 1 + i % 3 for i in range(10)}

    def run(self, attempts: int = 200, threads: int = 20, fault=None) -> None:
        self.fault_done = threading.Event()
        lock = threading.Lock()
        started = Counter[str]()
        plan = list(range(attempts))
        faults: list[threading.Thread] = []

        def worker(seed: int) -> None:
            chance = random.Random(seed)
            dbs = {node: FleetDb(self.conninfo, node) for node in NODES}
            while True:
                with lock:
                    if not plan or self.fault_error is not None:  # nothing left, or no database to wait for
                        break
                    n = plan.pop()
                    started["n"] += 1
                    if fault is not None and started["n"] == attempts // 2:
                        faults.append(threading.Thread(target=self._fault, args=(fault,)))
                        faults[-1].start()
                node, user = chance.choice(NODES), chance.choice(list(self.QUOTAS))
                minors = chance.sample(range(4), chance.choice([1, 1, 2]))  # few GPUs: collisions on purpose
                try:
                    result = dbs[node].reserve(reserve_doc(node, user, minors, self.QUOTAS[user]))
                    outcome = "granted" if len(result["granted"]) == len(minors) else "over_quota"
                    if result["granted"] and n % 5 == 0:  # some give their GPUs back: quotas free up again
                        with psycopg.connect(self.conninfo, autocommit=True) as conn:
                            conn.execute("DELETE FROM gpuguard.grants WHERE node = %s AND username = %s",
                                         (node, user))
                except psycopg.errors.UniqueViolation:
                    outcome = "double"
                except psycopg.Error:
                    outcome = "failed"  # the database is away: this node tries the attempt again a little later
                    time.sleep(0.1)
                with lock:
                    setattr(self, outcome, getattr(self, outcome) + 1)
                    if outcome == "failed":
                        plan.append(n)
                    elif self.fault_done.is_set():
                        self.after_fault += 1
            for db in dbs.values():
                db.close()

        pool = [threading.Thread(target=worker, args=(seed,)) for seed in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool + faults:
            thread.join()
        if self.fault_error is not None:
            raise self.fault_error

    def _fault(self, fault) -> None:
        try:
            fault()
        except BaseException as error:  # raised by run(), once the workers stopped
            self.fault_error = error
            return
        self.fault_done.set()

    def check(self) -> None:
        """No quota exceeded, no GPU granted twice, in what the database holds now."""
        held = dict(rows(self.conninfo, "SELECT username, count(*) FROM gpuguard.grants GROUP BY username"))
        assert all(held[user] <= self.QUOTAS[user] for user in held), held
        per_gpu = rows(self.conninfo, "SELECT node, minor, count(*) FROM gpuguard.grants GROUP BY node, minor"
                                      " HAVING count(*) > 1")
        assert per_gpu == []


def test_storm_of_200_grant_attempts_from_5_nodes_keeps_quotas_and_grants_each_gpu_once(postgres):
    register(postgres.conninfo)
    storm = Storm(postgres.conninfo)
    storm.run()
    storm.check()
    assert storm.granted + storm.over_quota + storm.double == 200 and storm.failed == 0
    assert storm.granted and storm.over_quota and storm.double  # every path was taken


def test_storm_with_the_database_killed_and_restarted_midway(postgres):
    register(postgres.conninfo)
    storm = Storm(postgres.conninfo)

    def crash() -> None:
        postgres.kill()
        time.sleep(0.5)
        postgres.start()

    storm.run(fault=crash)
    storm.check()
    assert storm.failed  # the outage was seen
    assert storm.after_fault  # and the nodes carried on after it, reconnecting by themselves


def test_storm_follows_the_standby_promoted_midway(postgres):
    register(postgres.conninfo)
    standby = postgres.standby()
    both = (f"host={postgres.root},{standby.root} port={postgres.port},{standby.port} user=postgres dbname=postgres"
            " target_session_attrs=read-write")
    storm = Storm(both)

    def failover() -> None:
        postgres.kill()
        standby.promote()

    storm.run(fault=failover)
    storm.check()
    assert storm.after_fault
    assert rows(both, "SELECT pg_is_in_recovery(), current_setting('port')") == [(False, str(standby.port))]


def test_heartbeat_mirrors_the_nodes_truth_and_replays_the_ledger_once(postgres):
    db = FleetDb(postgres.conninfo, "node0")
    t0 = time.time()
    grant = {"minor": 1, "username": "u1", "uid": 1001, "granted_at": t0 - 100, "expires_at": None, "shared": False,
             "origin": "session"}
    db.heartbeat(heartbeat_doc("node0", grants=[grant]))
    assert rows(postgres.conninfo, "SELECT minor, username FROM gpuguard.grants") == [(1, "u1")]
    # a grant checked (reserve) after the snapshot was taken is not in it: it stays
    late = db.reserve(reserve_doc("node0", "u2", [2], None))
    assert late["granted"] == [2]
    ledger = [{"seq": 1, "username": "u1", "minor": 1, "started": t0 - 100, "ended": t0 - 50}]
    db.heartbeat(heartbeat_doc("node0", ledger=ledger, taken_at=t0 - 1))
    assert rows(postgres.conninfo, "SELECT minor, username FROM gpuguard.grants ORDER BY minor") == [(2, "u2")]
    # the answer to a heartbeat got lost: the node sends the same rows again, and nothing is counted twice
    db.heartbeat(heartbeat_doc("node0", ledger=ledger, taken_at=t0 - 1))
    assert rows(postgres.conninfo, "SELECT node, seq, username FROM gpuguard.ledger") == [("node0", 1, "u1")]
    # fair share: u1's usage on node0 is usage elsewhere for node1, and not for node0 itself
    other = FleetDb(postgres.conninfo, "node1").heartbeat(heartbeat_doc("node1", usage_for=["u1"]))
    assert other["usage"]["u1"] == pytest.approx(50, rel=0.01)
    assert db.heartbeat(heartbeat_doc("node0", usage_for=["u1"]))["usage"]["u1"] == 0


def test_the_first_heartbeat_on_each_connection_says_which_kept_ledger_rows_the_database_has(postgres):
    db = FleetDb(postgres.conninfo, "node0")
    t0 = time.time()
    ledger = [{"seq": seq, "username": "u1", "minor": 1, "started": t0 - 100, "ended": t0 - 50} for seq in (4, 5, 6)]
    first = db.heartbeat(heartbeat_doc("node0", ledger=ledger), kept_from=2)
    assert first["ledger_present"] == [4, 5, 6]  # what it has from seq 2 on, this heartbeat's rows included
    assert "ledger_present" not in db.heartbeat(heartbeat_doc("node0"), kept_from=2)  # the same connection
    with psycopg.connect(postgres.conninfo, autocommit=True) as conn:  # as a promoted replica that lacks it
        conn.execute("DELETE FROM gpuguard.ledger WHERE seq = 5")
    db.close()  # the next call connects anew: asks again, for this node's outbox only
    FleetDb(postgres.conninfo, "node1").heartbeat(heartbeat_doc("node1", ledger=ledger[:1]))  # another node's seq 4
    assert sorted(db.heartbeat(heartbeat_doc("node0"), kept_from=4)["ledger_present"]) == [4, 6]
    assert "ledger_present" not in FleetDb(postgres.conninfo, "node2").heartbeat(heartbeat_doc("node2"))  # none kept


def test_the_grant_check_and_the_release_do_not_wait_for_the_wal_flush_and_the_heartbeat_does(postgres):
    db = FleetDb(postgres.conninfo, "node0")
    db.heartbeat(heartbeat_doc("node0"))
    conn = db._connection()  # the node's own: what a call sets is seen from inside the transaction around it

    def commit_mode(call) -> str:
        with conn.transaction():
            call()
            return conn.execute("SHOW synchronous_commit").fetchone()[0]
    assert commit_mode(lambda: db.reserve(reserve_doc("node0", "u1", [1], 2))) == "off"
    assert rows(postgres.conninfo, "SELECT minor, username FROM gpuguard.grants") == [(1, "u1")]
    db.release([(1, "u1")])  # sent with the next check (test_a_release_goes_with_the_next_heartbeat_or_check)
    assert commit_mode(lambda: db.reserve(reserve_doc("node0", "u2", [1], 2))) == "off"
    assert rows(postgres.conninfo, "SELECT minor, username FROM gpuguard.grants") == [(1, "u2")]
    # for their own transaction only: the heartbeat after them, whose ledger rows the node then
    # deletes, commits once its WAL is flushed
    ledger = [{"seq": 1, "username": "u1", "minor": 1, "started": time.time() - 60, "ended": time.time()}]
    assert commit_mode(lambda: db.heartbeat(heartbeat_doc("node0", ledger=ledger))) == "on"
    assert conn.execute("SHOW synchronous_commit").fetchone()[0] == "on"
    # one that only says "still here" need not (test_a_heartbeat_that_changes_nothing_takes_the_short_way)
    assert commit_mode(lambda: db.heartbeat(heartbeat_doc("node0"))) == "off"
    db.close()


def test_a_heartbeat_that_changes_nothing_takes_the_short_way_and_answers_as_the_long_one(postgres):
    t0 = time.time()
    grant = {"minor": 3, "username": "u1", "uid": 1001, "granted_at": t0 - 100, "expires_at": None, "shared": False,
             "origin": "session"}
    FleetDb(postgres.conninfo, "node1").heartbeat(heartbeat_doc("node1", grants=[grant], ledger=[
        {"seq": 1, "username": "u1", "minor": 3, "started": t0 - 300, "ended": t0 - 200}]))
    db = FleetDb(postgres.conninfo, "node0")
    doc = {**heartbeat_doc("node0", usage_for=["u1"], users=["u1", "u2"]), "want_free": True}
    whole = db.heartbeat(doc)
    conn = db._connection()
    conn.execute("SET track_functions = 'all'")  # pg_stat_xact_user_functions: what this transaction called

    def beat(sent: dict) -> tuple[dict, set[str], str]:
        with conn.transaction():
            answer = db.heartbeat({**sent, "taken_at": time.time()})
            called = {name for (name,) in conn.execute("SELECT funcname FROM pg_stat_xact_user_functions")}
            return answer, called, conn.execute("SHOW synchronous_commit").fetchone()[0]
    (before,), = rows(postgres.conninfo, "SELECT last_seen FROM gpuguard.nodes WHERE name = 'node0'")
    short, called, commit = beat(doc)
    assert "heartbeat_v6" in called and not called & {"heartbeat_v5", "bounded"} and commit == "off"
    assert rows(postgres.conninfo, "SELECT last_seen FROM gpuguard.nodes WHERE name = 'node0'")[0][0] > before
    # 100 s granted, 100 ended; the grant grows by the time between the two
    assert short["usage"] == pytest.approx(whole["usage"], abs=1) and short["usage"]["u1"] > 199
    assert (short["held"], short["free"]) == (whole["held"], whole["free"]) == (
        {"u1": 1, "u2": 0}, [{"node": "node1", "rack": "r1", "ssh": "node1", "free": GPUS - 1}])
    assert set(short) == set(whole)
    # a change goes the long way, bounded and flushed
    changed, called, commit = beat({**doc, "grants": [{**grant, "minor": 0}]})
    assert {"heartbeat_v5", "bounded"} <= called and commit == "on" and "resend" not in changed
    assert rows(postgres.conninfo, "SELECT minor FROM gpuguard.grants WHERE node = 'node0'") == [(0,)]
    db.close()


def test_the_queue_mirror_follows_a_place_that_grew_in_place_and_drops_one_that_left(postgres):
    db = FleetDb(postgres.conninfo, "node0")

    def place(ticket: int, gpus: int) -> dict:
        return {"ticket": ticket, "username": f"u{ticket}", "gpus": gpus, "since": 100.0, "priority": 0}
    db.heartbeat(heartbeat_doc("node0", queue=[place(1, 3), place(2, 1)]))
    # ticket 1 now waits for 4 (a GPU it counted on was taken back), ticket 2 was served
    db.heartbeat(heartbeat_doc("node0", queue=[place(1, 4)]))
    assert rows(postgres.conninfo, "SELECT ticket, gpus FROM gpuguard.queue") == [(1, 4)]


def test_a_lost_nodes_grants_stop_counting_after_its_grace_and_count_again_when_it_returns(postgres):
    lost, other = FleetDb(postgres.conninfo, "node0"), FleetDb(postgres.conninfo, "node1")
    lost.heartbeat(heartbeat_doc("node0", lease=2, grace=1))
    other.heartbeat(heartbeat_doc("node1"))
    assert lost.reserve(reserve_doc("node0", "u1", [0, 1], 2))["granted"] == [0, 1]
    assert other.reserve(reserve_doc("node1", "u1", [0], 2))["granted"] == []  # quota in use on node0
    # node0 falls silent: 4 s later (past lease + grace) its grants no longer count
    with psycopg.connect(postgres.conninfo, autocommit=True) as conn:
        conn.execute("UPDATE gpuguard.nodes SET last_seen = last_seen - 4 WHERE name = 'node0'")
    assert other.reserve(reserve_doc("node1", "u1", [0], 2))["granted"] == [0]
    # node0 comes back and sends its truth: its grants count again (u1 is over until one ends)
    held = [{"minor": m, "username": "u1", "uid": 1001, "granted_at": time.time() - 10, "expires_at": None,
             "shared": False, "origin": "session"} for m in (0, 1)]
    lost.heartbeat(heartbeat_doc("node0", grants=held, lease=2, grace=1))
    assert other.reserve(reserve_doc("node1", "u1", [1], 2))["granted"] == []
    assert rows(postgres.conninfo, "SELECT count(*) FROM gpuguard.grants WHERE username = 'u1'") == [(3,)]


def test_an_aborted_runs_postgresql_is_stopped_by_the_sweep(postgres):
    pid = int((postgres.data / "postmaster.pid").read_text().split()[0])
    assert stop_all_under(postgres.root.parent) == [postgres.data]  # what leftovers.py calls for a sandbox
    assert wait_for(lambda: not Path(f"/proc/{pid}").exists())
