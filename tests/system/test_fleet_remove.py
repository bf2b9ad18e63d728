"""`gpuguard fleet remove NODE` (gpuguard.cli.fleet_cmd, fleetdb.remove_node) on a real PostgreSQL
and the three real daemons of test_fleet_daemons: a decommissioned node's rows go, its ledger rows
stay; a live node is refused unless --force (and comes back by itself); a name nobody has is said;
a database still at the first schema (no host or install columns) does too."""
from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from test_fleet_bad_rows import as_released
from test_fleet_daemons import DaemonFleet, daemon_fleet, member
from test_fleet_db import heartbeat_doc, rows

from devtools.harness import wait_for
from gpuguard.fleet import fleetdb, schema
from gpuguard.fleet.fleetdb import FleetDb, connect, remove_node


@pytest.fixture
def fleet(postgres, make_group, make_user) -> Iterator[DaemonFleet]:
    with daemon_fleet(postgres, make_group(), make_user) as nodes:
        yield nodes


def counts(fleet: DaemonFleet, node: str) -> dict[str, int]:
    return {table: rows(fleet.postgres.conninfo, f"SELECT count(*) FROM gpuguard.{table} WHERE {key} = %s", node)[0][0]
            for table, key in (("nodes", "name"), ("gpus", "node"), ("grants", "node"), ("queue", "node"),
                               ("ledger", "node"))}


def test_a_decommissioned_node_is_removed_and_its_ledger_stays_a_live_one_only_with_force(fleet):
    alice, bob, carol = member(fleet), member(fleet), member(fleet)
    fleet.start(quotas={}, defaults={"gpus": 1})
    gpu1, gpu2, gpu3 = (fleet.nodes[name] for name in ("gpu1", "gpu2", "gpu3"))
    used = fleet.login("gpu3", alice)
    assert used["gpus"]
    gpu3.close_session(alice, used["pid"])  # an ended grant: a ledger row of gpu3's
    assert fleet.login("gpu3", bob)["gpus"] and fleet.login("gpu3", carol)["gpus"]  # gpu3 full (2 GPUs)
    assert fleet.login("gpu3", alice)["gpus"] == []  # she waits in its queue
    assert wait_for(lambda: counts(fleet, "gpu3") == {"nodes": 1, "gpus": 2, "grants": 2, "queue": 1, "ledger": 1})

    # gpu3 is shut down for good: while its grants still count (lease + grace), it is not removed
    gpu3.stop()
    early = gpu1.cli("fleet", "remove", "gpu3")
    assert early.returncode == 1 and "node gpu3 is live" in early.stderr and "--force" in early.stderr, early
    assert counts(fleet, "gpu3")["nodes"] == 1
    assert wait_for(lambda: not fleet.seen("gpu1", "gpu3")["counted"], 30)  # silent past lease + grace
    removed = gpu1.cli("fleet", "remove", "gpu3")
    assert removed.returncode == 0, removed
    assert removed.stdout.startswith("gpuguard: removed node gpu3 from the fleet (seen "), removed.stdout
    assert "2 GPUs, 2 grants and 1 queued request gone; its usage ledger (1 row) stays for fair share" in removed.stdout
    assert counts(fleet, "gpu3") == {"nodes": 0, "gpus": 0, "grants": 0, "queue": 0, "ledger": 1}
    assert wait_for(lambda: fleet.seen("gpu2", "gpu3") is None)
    assert "gpu3" not in gpu2.cli("status", "--fleet").stdout

    # a live node: refused, unless --force; it registers again at its next heartbeat, with its truth
    assert fleet.login("gpu2", alice)["gpus"]
    assert wait_for(lambda: counts(fleet, "gpu2")["grants"] == 1)  # with the heartbeat the grant asked for
    live = gpu1.cli("fleet", "remove", "gpu2")
    assert live.returncode == 1 and "is live (seen" in live.stderr, live
    assert counts(fleet, "gpu2")["grants"] == 1
    forced = gpu1.cli("fleet", "remove", "--force", "gpu2")
    assert forced.returncode == 0 and "was live: if gpuguard still runs there" in forced.stdout, forced
    assert wait_for(lambda: counts(fleet, "gpu2")["nodes"] == 1 and counts(fleet, "gpu2")["grants"] == 1)

    unknown = gpu1.cli("fleet", "remove", "gpu9")
    assert unknown.returncode == 1 and "no node named gpu9 in the fleet database" in unknown.stderr, unknown
    user = gpu1.cli_as(alice, "fleet", "remove", "gpu2")
    assert user.returncode == 1 and "needs root" in user.stderr, user


def test_a_node_is_removed_from_a_database_of_the_first_schema(postgres, monkeypatch):
    as_released(monkeypatch, postgres.conninfo, 1)
    with monkeypatch.context() as patch:  # a node of that release: it migrates to schema 1 only
        patch.setattr(fleetdb, "MIGRATIONS", schema.MIGRATIONS[:1])
        FleetDb(postgres.conninfo, "old").call("heartbeat_v1", heartbeat_doc("old", lease=0.2, grace=0.2, ledger=[
            {"seq": 1, "username": "u1", "minor": 0, "started": time.time() - 60, "ended": time.time()}]))
    assert rows(postgres.conninfo, "SELECT max(version) FROM gpuguard.migrations") == [(1,)]
    with connect(postgres.conninfo, "ggt-admin") as conn:
        assert remove_node(conn, "nobody") is None
        live = remove_node(conn, "old")
        assert live is not None and live["live"] and not live["removed"]
        time.sleep(0.5)  # silent past lease + grace
        gone = remove_node(conn, "old")
        assert gone is not None and gone["removed"] and not gone["live"] and gone["host"] == ""
        assert (gone["gpus"], gone["grants"], gone["queued"], gone["ledger"]) == (8, 0, 0, 1)
    assert rows(postgres.conninfo, "SELECT count(*) FROM gpuguard.nodes") == [(0,)]
    assert rows(postgres.conninfo, "SELECT node, username FROM gpuguard.ledger") == [("old", "u1")]
