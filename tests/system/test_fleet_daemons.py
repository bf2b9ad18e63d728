"""Three servers sharing one PostgreSQL: real daemons on simulated GPUs (gpu1 with the gate,
gpu2 and gpu3 in acl mode: a gate is machine-wide, so one is attached at a time), real users
in one group, a real PostgreSQL. The fleet quota across servers, fair share counting usage on
all of them, `where` and `status --fleet`, and the faults: the database stopped, a node
SIGKILLed and returning, a node cut off from the database by a TCP proxy."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from conftest import unique
from daemon_fixture import RunningDaemon
from tcp_proxy import TcpProxy

from devtools.harness import gate_test_lock, wait_for
from gpuguard.fleet.ops import CACHE_FOR

NODES = {"gpu1": ("r1", True), "gpu2": ("r1", False), "gpu3": ("r2", False)}
DATA = {"/data/imagenet": ["gpu3"], "/data/shared": ["r1"]}


class DaemonFleet:
    def __init__(self, postgres, group: str, make_user):
        self.postgres = postgres
        self.group = group
        self.make_user = make_user
        self.nodes: dict[str, RunningDaemon] = {}
        self.sandboxes: list[Path] = []
        self.proxy: TcpProxy | None = None

    def start(self, quotas: dict, proxied: str | None = None, database: str | None = None,
              policy: str = "local", **tables) -> None:
        for name, (rack, gate) in NODES.items():
            sandbox = Path("/tmp") / unique()
            sandbox.mkdir(mode=0o755)
            self.sandboxes.append(sandbox)
            conninfo = database or self.postgres.conninfo
            if name == proxied:
                self.proxy = TcpProxy(self.postgres.port)
                self.proxy.start()
                conninfo = self.postgres.tcp_conninfo(self.proxy.port)
            node = RunningDaemon(sandbox, self.group, self.make_user)
            node.write_config(count=2, gate=gate, quotas=quotas, **{"defaults": {"gpus": 2}, **tables},
                              fleet={"database": conninfo, "node": name, "rack": rack, "heartbeat": "1s",
                                       "lease": "2s", "grace": "2s", "data": DATA,
                                       "offline_policy": policy})
            node.start()
            self.nodes[name] = node
        self.wait_online()

    def wait_online(self, *names: str) -> None:
        """Until these nodes are online, and every node's view shows them seen."""
        for name in names or self.nodes:
            assert wait_for(lambda n=name: self.nodes[n].call("fleet_status")["online"]), name
            for viewer in self.nodes:
                assert wait_for(lambda v=viewer, n=name: (seen := self.seen(v, n)) and not seen["lost"]), (viewer, name)

    def seen(self, viewer: str, name: str) -> dict | None:
        """Node `name` in the fleet view of `viewer` (None: not in it)."""
        return next((n for n in self.nodes[viewer].call("fleet_status")["nodes"] if n["name"] == name), None)

    def login(self, node: str, user) -> dict:
        return self.nodes[node].open_session(user)

    def held_in_database(self) -> list[tuple]:
        with psycopg.connect(self.postgres.conninfo, autocommit=True) as conn:
            return conn.execute("SELECT node, username, minor FROM gpuguard.grants ORDER BY 1, 2, 3").fetchall()

    def ledger(self) -> list[tuple]:
        with psycopg.connect(self.postgres.conninfo, autocommit=True) as conn:
            return conn.execute("SELECT node, username FROM gpuguard.ledger ORDER BY 1, 2").fetchall()

    def close(self) -> None:
        for node in self.nodes.values():
            node.cleanup()
            print(f"--- {node.config.fleet.node} log ---\n{node.log()}")
        if self.proxy:
            self.proxy.stop()
        for sandbox in self.sandboxes:
            shutil.rmtree(sandbox, ignore_errors=True)


@contextmanager
def daemon_fleet(postgres, group: str, make_user) -> Iterator[DaemonFleet]:
    """Three daemons (not started yet) under the gate lock, closed after (their logs printed)."""
    with gate_test_lock():  # gpu1's gate is machine-wide
        fleet = DaemonFleet(postgres, group, make_user)
        try:
            yield fleet
        finally:
            fleet.close()


@pytest.fixture
def fleet(postgres, make_group, make_user) -> Iterator[DaemonFleet]:
    with daemon_fleet(postgres, make_group(), make_user) as nodes:
        yield nodes


def member(fleet: DaemonFleet):
    return fleet.make_user(groups=[fleet.group])


def test_a_fleet_quota_holds_across_servers_and_the_queue_follows_a_release_elsewhere(fleet):
    alice, bob = member(fleet), member(fleet)
    fleet.start(quotas={"users": {alice.name: {"fleet_gpus": 2}}})
    first = fleet.login("gpu1", alice)
    assert len(first["gpus"]) == 2
    # her fleet quota is in use on gpu1: gpu2 queues her login instead of granting
    second = fleet.login("gpu2", alice)
    assert second["gpus"] == [] and "queue" in second["message"]
    assert fleet.nodes["gpu2"].grants(alice) == []
    # bob has no fleet quota: gpu2 gives him what is free there
    assert len(fleet.login("gpu2", bob)["gpus"]) == 2
    # his grant with the heartbeat it asked for, hers with her check
    assert wait_for(lambda: sorted(fleet.held_in_database()) == sorted(
        [("gpu1", alice.name, 0), ("gpu1", alice.name, 1), ("gpu2", bob.name, 0), ("gpu2", bob.name, 1)]))
    # alice logs out of gpu1 and bob of gpu2: her place in gpu2's queue is served, within her fleet quota
    fleet.nodes["gpu1"].close_session(alice, first["pid"])
    bob_session = fleet.nodes["gpu2"].whoami(bob)["sessions"][0]
    fleet.nodes["gpu2"].close_session(bob, bob_session["pid"])
    assert wait_for(lambda: len(fleet.nodes["gpu2"].grants(alice)) == 2, timeout=30)
    assert wait_for(lambda: sorted(fleet.held_in_database()) == [("gpu2", alice.name, 0), ("gpu2", alice.name, 1)])
    expected = sorted([("gpu1", alice.name)] * 2 + [("gpu2", bob.name)] * 2)
    assert wait_for(lambda: fleet.ledger() == expected), fleet.ledger()  # the usage of both ended grants


def test_a_user_at_their_fleet_quota_is_told_so_at_login_in_whoami_and_status(fleet):
    alice = member(fleet)
    fleet.start(quotas={"users": {alice.name: {"fleet_gpus": 2}}})
    assert len(fleet.login("gpu1", alice)["gpus"]) == 2
    gpu2 = fleet.nodes["gpu2"]
    # gpu2 has both its GPUs free: what keeps her waiting is her GPUs on gpu1, not this server
    queued = fleet.login("gpu2", alice)
    assert queued["gpus"] == [] and queued["message"].startswith(
        "gpuguard: you hold your fleet quota of 2 GPUs (2 on other servers); you are number 1 of 1 in the queue "
        "here, served once you release one there"), queued["message"]
    assert "no GPU is free" not in queued["message"]
    whoami = gpu2.cli_as(alice, "whoami")
    assert whoami.returncode == 0, whoami.stderr
    assert ", fleet quota 2 GPUs on all servers together" in whoami.stdout
    assert ("you hold all of your fleet quota (2 GPUs on all servers together, 2 of them on other servers): "
            "you are served here once you release one there") in whoami.stdout, whoami.stdout
    assert "free but held for requests ahead" not in whoami.stdout
    assert [q["reason"] for q in gpu2.call("status")["queue"]] == ["FleetQuota"]
    status = gpu2.cli("status")
    assert "FleetQuota" in status.stdout and "Resources" not in status.stdout, status.stdout


def test_fair_share_counts_usage_on_the_other_servers(fleet):
    heavy, light, holder, other = member(fleet), member(fleet), member(fleet), member(fleet)
    fleet.start(quotas={"users": {name: {"gpus": 1} for name in (heavy.name, light.name, holder.name)}},
                defaults={"gpus": 1})
    assert fleet.login("gpu2", heavy)["gpus"]          # heavy's usage grows on gpu2
    gpu1 = fleet.nodes["gpu1"]
    assert fleet.login("gpu1", holder)["gpus"] and fleet.login("gpu1", other)["gpus"]  # gpu1 is full
    heavy_wait = fleet.login("gpu1", heavy)   # heavy asks first
    time.sleep(0.1)
    fleet.login("gpu1", light)
    assert "queue" in heavy_wait["message"]
    # once gpu1's heartbeat has brought heavy's usage elsewhere, light goes first
    ahead = lambda: [q["user"] for q in gpu1.call("status")["queue"]]  # noqa: E731
    assert wait_for(lambda: ahead() == [light.name, heavy.name], timeout=15), ahead()
    why = gpu1.whoami(heavy)["queue"]["ahead"]
    assert why and why[0]["user"] == light.name and "less recent GPU usage" in why[0]["why"]
    gpu1.close_session(holder, gpu1.whoami(holder)["sessions"][0]["pid"])
    assert wait_for(lambda: gpu1.granted_minors(light), timeout=20)
    assert gpu1.granted_minors(heavy) == []


def test_where_and_status_fleet_show_the_fleet_with_data_locality(fleet):
    alice, bob, carol = member(fleet), member(fleet), member(fleet)
    fleet.start(quotas={"users": {carol.name: {"fleet_gpus": 3}}})
    assert len(fleet.login("gpu1", alice)["gpus"]) == 2  # gpu1 is full
    assert wait_for(lambda: fleet.seen("gpu1", "gpu1")["free"] == 0)  # and the fleet's view says so
    ranked = json.loads(fleet.nodes["gpu1"].cli_as(carol, "where", "--data", "/data/imagenet/train", "--json").stdout)
    assert [c["node"] for c in ranked["choices"]] == ["gpu3", "gpu2", "gpu1"]
    assert ranked["choices"][0]["ssh"] == "ssh gpu3" and ranked["choices"][0]["locality"] == "same node"
    near = fleet.nodes["gpu1"].cli_as(carol, "where", "--data", "/data/shared/x", "--gpus", "2")
    assert near.returncode == 0 and near.stdout.splitlines()[-1] == "ssh gpu2", near.stdout
    # a login queued on the full gpu1 says where GPUs are free for this user now
    time.sleep(1.5)  # a heartbeat of gpu1 since it filled: it brought where GPUs are free
    queued = fleet.login("gpu1", bob)
    assert queued["gpus"] == [] and "GPUs free now on gpu2 (2), gpu3 (2): ssh gpu2" in queued["message"]
    assert wait_for(lambda: fleet.seen("gpu2", "gpu1")["queued"] == 1)  # gpu1's heartbeat sent its queue
    table = fleet.nodes["gpu2"].cli_as(carol, "status", "--fleet")
    assert table.returncode == 0 and table.stderr == "", table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].endswith("up to date")
    gpu1_line = next(line for line in lines if line.startswith("gpu1"))
    assert "r1" in gpu1_line and " ok " in gpu1_line and alice.name in gpu1_line and "1 (2 GPUs)" in gpu1_line
    # the old spelling, for one release: the same answer, and a line on stderr that says the new one
    old = fleet.nodes["gpu3"].cli_as(carol, "status", "--cluster", "--json")
    assert "status --cluster is now status --fleet" in old.stderr, old.stderr
    status = json.loads(old.stdout)
    assert {n["name"]: n["free"] for n in status["nodes"]} == {"gpu1": 0, "gpu2": 2, "gpu3": 2}
    assert {n["name"] for n in fleet.nodes["gpu3"].call("cluster_status")["nodes"]} == {"gpu1", "gpu2", "gpu3"}
    assert fleet.nodes["gpu1"].cli_as(carol, "where", "--data", "/elsewhere").returncode == 2


def test_pulling_the_database_out_changes_nothing_for_logins_and_the_outbox_catches_up(fleet):
    alice, bob = member(fleet), member(fleet)
    fleet.start(quotas={"users": {alice.name: {"fleet_gpus": 2}}})
    fleet.postgres.stop("immediate")
    gpu1 = fleet.nodes["gpu1"]
    # the first login after the outage waits at most the bounded timeout, then grants locally (offline_policy local)
    assert len(fleet.login("gpu1", alice)["gpus"]) == 2
    opened = fleet.login("gpu2", bob)
    assert len(opened["gpus"]) == 2
    view = gpu1.call("fleet_status")
    assert view["online"] is False and view["stale_since"] is not None
    assert "stale since" in gpu1.cli("status", "--fleet").stdout.splitlines()[0]
    fleet.nodes["gpu2"].close_session(bob, opened["pid"])  # released while offline: kept in gpu2's outbox
    assert wait_for(lambda: fleet.nodes["gpu2"].grants(bob) == [])
    fleet.postgres.start()
    fleet.wait_online()
    # every node re-sent its truth; the ledger has the offline release exactly once
    assert wait_for(lambda: fleet.held_in_database() == [("gpu1", alice.name, 0), ("gpu1", alice.name, 1)])
    time.sleep(2.5)  # more heartbeats: nothing is sent twice
    assert fleet.ledger() == [("gpu2", bob.name), ("gpu2", bob.name)]


def test_a_node_sigkilled_is_lost_its_grants_stop_counting_and_it_returns_with_its_truth(fleet):
    alice = member(fleet)
    fleet.start(quotas={"users": {alice.name: {"fleet_gpus": 2, "gpus": 1}}}, defaults={"gpus": 1})
    gpu2 = fleet.nodes["gpu2"]
    assert fleet.login("gpu2", alice)["gpus"]
    assert fleet.login("gpu1", alice)["gpus"]
    assert fleet.login("gpu3", alice)["gpus"] == []  # 2 of 2 in use
    os.kill(gpu2.proc.pid, signal.SIGKILL)
    gpu2.proc.wait()
    assert wait_for(lambda: fleet.seen("gpu1", "gpu2")["lost"])
    # after lease + grace her grant on gpu2 no longer counts: gpu3's queue serves her
    assert wait_for(lambda: fleet.nodes["gpu3"].granted_minors(alice), timeout=20)
    gpu2.start()  # back, on the same state: its grant is still hers there, and sent again
    fleet.wait_online("gpu2")
    assert gpu2.granted_minors(alice) == [0]
    assert wait_for(lambda: ("gpu2", alice.name, 0) in fleet.held_in_database())
    assert not fleet.seen("gpu1", "gpu2")["lost"]


def test_a_node_cut_off_from_the_database_carries_on_and_so_do_the_others(fleet):
    alice, bob = member(fleet), member(fleet)
    fleet.start(quotas={"users": {bob.name: {"fleet_gpus": 2}}}, proxied="gpu3")
    assert fleet.proxy is not None
    fleet.proxy.stop()
    assert len(fleet.login("gpu3", alice)["gpus"]) == 2  # granted locally, at most the timeout later
    assert wait_for(lambda: fleet.nodes["gpu3"].call("fleet_status")["online"] is False)
    # the others carry on: a fleet-quota check and the view, gpu3 lost there
    assert len(fleet.login("gpu1", bob)["gpus"]) == 2
    assert fleet.login("gpu2", bob)["gpus"] == []
    assert wait_for(lambda: fleet.seen("gpu1", "gpu3")["lost"])
    fleet.proxy.start()
    fleet.wait_online("gpu3")
    assert wait_for(lambda: [(n, m) for n, u, m in fleet.held_in_database() if u == alice.name] ==
                    [("gpu3", 0), ("gpu3", 1)])


def test_offline_budget_keeps_the_fleet_quota_with_what_was_last_seen_elsewhere(fleet):
    alice = member(fleet)
    fleet.start(quotas={"users": {alice.name: {"fleet_gpus": 3}}}, policy="budget")
    assert len(fleet.login("gpu1", alice)["gpus"]) == 2
    gpu2 = fleet.nodes["gpu2"]
    assert len(fleet.login("gpu2", alice)["gpus"]) == 1  # 3 in the fleet, 2 of them on gpu1
    assert gpu2.cli_as(alice, "release").returncode == 0
    fleet.postgres.stop("immediate")
    assert wait_for(lambda: gpu2.call("fleet_status")["online"] is False)
    # offline, gpu2 still allows her only her fleet quota less what gpu1 had: 1, not her local 2
    granted = gpu2.call_as(alice, "request")
    assert granted["ok"] and len(granted["gpus"]) == 1, granted


def test_nodes_follow_the_standby_promoted_under_them(fleet):
    alice, bob = member(fleet), member(fleet)
    standby = fleet.postgres.standby()
    both = (f"host={fleet.postgres.root},{standby.root} port={fleet.postgres.port},{standby.port} user=postgres"
            " dbname=postgres target_session_attrs=read-write")
    fleet.start(quotas={"users": {alice.name: {"fleet_gpus": 2}}}, database=both)
    assert len(fleet.login("gpu1", alice)["gpus"]) == 2
    fleet.postgres.kill()
    standby.promote()
    fleet.wait_online()
    assert wait_for(lambda: fleet.nodes["gpu1"].call("fleet_status")["online"])
    # the fleet quota is still kept, now by the promoted standby
    assert fleet.login("gpu2", alice)["gpus"] == []
    assert len(fleet.login("gpu3", bob)["gpus"]) == 2
    with psycopg.connect(both, autocommit=True) as conn:
        assert conn.execute("SELECT current_setting('port')").fetchone() == (str(standby.port),)
        # bob's, of no fleet quota, with the heartbeat it asked for
        assert wait_for(lambda: conn.execute("SELECT node, username FROM gpuguard.grants ORDER BY 1, 2").fetchall() == [
            ("gpu1", alice.name), ("gpu1", alice.name), ("gpu3", bob.name), ("gpu3", bob.name)])


def test_a_database_link_that_swallows_packets_costs_a_login_the_timeout_at_most(fleet):
    alice = member(fleet)
    fleet.start(quotas={"users": {alice.name: {"fleet_gpus": 2}}}, proxied="gpu3")
    assert fleet.proxy is not None
    assert fleet.nodes["gpu3"].call("fleet_status")["view_stale"] is False  # a pooled connection stays open
    fleet.proxy.freeze()  # the check's query goes out and no answer ever comes back
    opened = fleet.login("gpu3", alice)  # without the bound this would hang (the call's limit is 30 s)
    assert len(opened["gpus"]) == 2
    time.sleep(CACHE_FOR)  # the view read before is no longer shared: the next look reads again
    view = fleet.nodes["gpu3"].call("fleet_status")  # its query on the pooled connection: answered stale
    assert view["online"] is False and view["stale_since"] is not None and view["view_stale"] is True
    fleet.nodes["gpu3"].close_session(alice, opened["pid"])
    assert wait_for(lambda: fleet.nodes["gpu3"].grants(alice) == [])
    fleet.proxy.thaw()  # the stuck call completes, the heartbeats resume and send the truth
    fleet.wait_online("gpu3")
    assert wait_for(lambda: fleet.held_in_database() == [])
    assert wait_for(lambda: fleet.ledger() == [("gpu3", alice.name), ("gpu3", alice.name)])


def _failover_fleet(fleet: DaemonFleet, **start) -> tuple[object, str]:
    """The fleet's nodes on a primary and its streaming standby (the primary listed first, as an
    admin would write it): (the standby, the connection string)."""
    standby = fleet.postgres.standby()
    both = (f"host={fleet.postgres.root},{standby.root} port={fleet.postgres.port},{standby.port} user=postgres"
            " dbname=postgres target_session_attrs=read-write")
    fleet.start(quotas={}, database=both, **start)
    return standby, both


def test_a_restarted_node_never_writes_to_the_old_leader_started_again(fleet):
    alice = member(fleet)
    standby, both = _failover_fleet(fleet)
    fleet.postgres.kill()
    standby.promote()
    fleet.wait_online()  # every node has written on the promoted standby's timeline now
    fleet.postgres.start()  # the old primary comes back read-write, first in the string, as a rebooted host does
    old = fleet.postgres.conninfo
    before = rows_of(old, "SELECT name, last_seen FROM gpuguard.nodes ORDER BY name")
    gpu2 = fleet.nodes["gpu2"]
    gpu2.restart()
    reason = wait_for(lambda: (s := gpu2.call("fleet_status")) and not s["online"] and s["offline_reason"], 30)
    assert reason and "old leader" in reason and "timeline 1" in reason, gpu2.call("fleet_status")
    assert fleet.login("gpu2", alice)["gpus"], "a login must still get its GPU (offline policy: local)"
    shown = gpu2.cli("status", "--fleet")
    assert "fenced: the fleet database is an old leader" in shown.stdout, shown
    doctor = gpu2.cli("doctor")
    assert any(line.startswith("FAIL") and "fleet" in line and "old leader" in line
               for line in doctor.stdout.splitlines()), doctor.stdout
    time.sleep(3)  # a few heartbeats of gpu2 (1 s apart): none of them may reach the old primary
    assert rows_of(old, "SELECT name, last_seen FROM gpuguard.nodes ORDER BY name") == before
    assert rows_of(old, "SELECT count(*) FROM gpuguard.grants WHERE node = 'gpu2'") == [(0,)]


def test_a_switchover_done_in_the_wrong_order_loses_no_ledger_row(fleet):
    alice = member(fleet)
    standby, both = _failover_fleet(fleet)
    released = 0

    def use_and_give_back(rounds: int) -> None:
        nonlocal released
        for _ in range(rounds):
            for name in fleet.nodes:
                assert fleet.nodes[name].call_as(alice, "request", gpus=1)["granted"]
                assert fleet.nodes[name].call_as(alice, "release")["released"]
                released += 1

    use_and_give_back(2)
    # Wrong order: the standby is promoted while the primary still runs and the nodes still write
    # to it; what they send it from now on never reaches the new leader.
    assert wait_for(lambda: len(rows_of(both, "SELECT 1 FROM gpuguard.ledger")) == released, 30)
    standby.promote()
    use_and_give_back(2)
    assert wait_for(lambda: len(rows_of(fleet.postgres.conninfo, "SELECT 1 FROM gpuguard.ledger")) == released, 30)
    fleet.postgres.stop()  # only now the old primary goes: the nodes move to the new leader
    new = standby.conninfo
    assert wait_for(lambda: len(rows_of(new, "SELECT 1 FROM gpuguard.ledger")) == released, 30), (
        released, rows_of(new, "SELECT node, username FROM gpuguard.ledger"))
    assert rows_of(new, "SELECT count(*) FROM (SELECT DISTINCT node, incarnation, seq FROM gpuguard.ledger) d") == [
        (released,)]  # nothing doubled either


def rows_of(conninfo: str, query: str) -> list[tuple]:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return conn.execute(query).fetchall()


def test_nodes_make_the_schema_again_when_it_is_dropped_under_them(fleet):
    alice = member(fleet)
    fleet.start(quotas={"users": {alice.name: {"fleet_gpus": 1}}})
    with psycopg.connect(fleet.postgres.conninfo, autocommit=True) as conn:
        conn.execute("DROP SCHEMA gpuguard CASCADE")  # an admin's mistake, or a restore of an older dump
    names = sorted(fleet.nodes)

    def back() -> bool:
        try:
            return [name for (name,) in rows_of(fleet.postgres.conninfo, "SELECT name FROM gpuguard.nodes"
                                                                         " ORDER BY name")] == names
        except psycopg.Error:
            return False  # not made again yet

    assert wait_for(back, 30), "the nodes did not make the schema again"
    fleet.wait_online()
    assert len(fleet.login("gpu1", alice)["gpus"]) == 1
    assert fleet.login("gpu2", alice)["gpus"] == []  # the fleet quota is kept again
