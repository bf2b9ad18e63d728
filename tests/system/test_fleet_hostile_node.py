"""Root on one node, holding that node's role, against everyone else (schema 9, roles.py's limits):
on a real PostgreSQL with SCRAM logins, gpu1's role tries what a review found it could do. It
plants functions in schema public for the admin's and the owner's sessions to run, holds every
connection of the server, writes a 1 MB ssh line and 600 GPUs for every node's view to read,
plants grants through a grant-time check's own list of GPUs, and makes temporary tables and
large objects. Each is refused or left out now, and gpu2 goes on working."""
from __future__ import annotations

import json
from contextlib import ExitStack

import psycopg
import pytest
from fleet_fixture import Fleet
from test_fleet_bad_rows import as_released, execute
from test_fleet_db import heartbeat_doc, reserve_doc, rows

from gpuguard.fleet import roles, schema
from gpuguard.fleet.fleetdb import FleetDb, connect, migrate, remove_node

GPU1, GPU2 = "gpuguard_node_gpu1", "gpuguard_node_gpu2"


def two_nodes(fleet: Fleet, *more: str) -> tuple[FleetDb, FleetDb]:
    made = fleet.init("--node", "gpu1", "--node", "gpu2", *(arg for node in more for arg in ("--node", node)))
    assert made.returncode == 0, made
    gpu1, gpu2 = FleetDb(fleet.as_role(GPU1), "gpu1"), FleetDb(fleet.as_role(GPU2), "gpu2")
    gpu1.heartbeat(heartbeat_doc("gpu1"))
    gpu2.heartbeat(heartbeat_doc("gpu2"))
    return gpu1, gpu2


def as_superuser(fleet: Fleet, statement: str) -> None:
    with psycopg.connect(fleet.superuser.replace("dbname=postgres", "dbname=gpuguard"), autocommit=True) as conn:
        conn.execute(statement)


def test_functions_a_node_plants_in_schema_public_run_in_no_session_of_gpuguards(fleet):
    two_nodes(fleet, "gpu3", "gpu4")
    for node in ("gpu3", "gpu4"):
        FleetDb(fleet.as_role(roles.node_role(node)), node).heartbeat(heartbeat_doc(node))
    as_superuser(fleet, "GRANT CREATE ON SCHEMA public TO PUBLIC")  # PostgreSQL 14 and older, by default
    with psycopg.connect(fleet.as_role(GPU1), autocommit=True) as gpu1:
        # a better match than pg_catalog's to_jsonb(anyelement), run with the rights of whoever calls it
        gpu1.execute("CREATE FUNCTION public.to_jsonb(n gpuguard.nodes) RETURNS jsonb LANGUAGE plpgsql AS $$"
                     " BEGIN DELETE FROM gpuguard.nodes WHERE name = 'gpu2'; RETURN pg_catalog.to_jsonb(n); END $$")
        gpu1.execute("GRANT EXECUTE ON FUNCTION public.to_jsonb(gpuguard.nodes) TO PUBLIC")
    admin = fleet.as_role(roles.ADMIN)
    with psycopg.connect(admin, autocommit=True) as plain:  # a session with the default search_path: it runs
        assert remove_node(plain, "gpu3", force=True)["removed"]
    assert rows(fleet.owner, "SELECT name FROM gpuguard.nodes WHERE name = 'gpu2'") == []  # the attack works there
    FleetDb(fleet.as_role(GPU2), "gpu2").heartbeat(heartbeat_doc("gpu2"))
    with connect(admin, "fleet remove") as conn:  # gpuguard's own session: pg_catalog only
        assert conn.execute("SHOW search_path").fetchone() == ("pg_catalog,pg_temp",)
        assert remove_node(conn, "gpu4", force=True)["removed"]
    assert rows(fleet.owner, "SELECT name FROM gpuguard.nodes ORDER BY name") == [("gpu1",), ("gpu2",)]
    # and fleet init says what a superuser should take back
    again = fleet.init("--node", "gpu1", "--node", "gpu2")
    assert again.returncode == 0, again
    assert "to do as a superuser, on the database's primary: every role may create in schema public" in again.stdout, \
        again.stdout
    assert "REVOKE CREATE ON SCHEMA public FROM PUBLIC" in again.stdout


def test_a_node_holds_at_most_a_few_connections_and_the_others_stay_online(fleet):
    _, gpu2_db = two_nodes(fleet)
    # the server drops its side of a connection a cut network left as soon as the node does, so a
    # dead one does not count against the limit for the kernel's two hours
    with connect(fleet.as_role(GPU1), "gpu1") as conn:
        assert conn.execute("SELECT current_setting('tcp_keepalives_idle'), current_setting('tcp_user_timeout')"
                            ).fetchone() == ("5", "5000")
    with ExitStack() as held:
        with pytest.raises(psycopg.OperationalError, match="too many connections for role"):
            for _ in range(roles.CONNECTION_LIMITS["node"] + 1):
                held.enter_context(psycopg.connect(fleet.as_role(GPU1), autocommit=True))
        assert len(rows(fleet.owner, "SELECT pid FROM pg_stat_activity WHERE usename = %s", GPU1)) \
            == roles.CONNECTION_LIMITS["node"]
        gpu2_db.close()
        assert not gpu2_db.heartbeat(heartbeat_doc("gpu2")).get("refused")  # a new connection: room for it


def test_what_one_node_writes_for_every_view_is_bounded_in_size(fleet):
    gpu1, gpu2 = two_nodes(fleet)
    with pytest.raises(psycopg.errors.CheckViolation):
        gpu1.heartbeat({**heartbeat_doc("gpu1"), "ssh": "x" * (1 << 20)})
    gpu1.close()
    many = heartbeat_doc("gpu1")
    many["gpus"] = [{"minor": m, "uuid": f"GPU-{m}", "name": "sim", "memory_total": 1, "owner": "gpuguard"}
                    for m in range(schema.GPUS_PER_NODE + 88)]
    answer = gpu1.heartbeat(many)
    assert [g["minor"] for g in answer["skipped"]["gpus"]] == list(range(schema.GPUS_PER_NODE, schema.GPUS_PER_NODE + 88))
    assert rows(fleet.owner, "SELECT count(*), max(length(n.ssh)) FROM gpuguard.gpus g JOIN gpuguard.nodes n"
                " ON n.name = g.node WHERE g.node = 'gpu1'") == [(schema.GPUS_PER_NODE, len("gpu1"))]
    assert not gpu2.heartbeat(heartbeat_doc("gpu2")).get("refused")


def test_rows_over_the_bound_from_before_schema_9_are_taken_out_by_it(postgres, monkeypatch):
    as_released(monkeypatch, postgres.conninfo, 8)
    execute(postgres.conninfo, "INSERT INTO gpuguard.nodes (name, ssh, heartbeat, lease, grace, first_seen, last_seen)"
            " VALUES ('big', repeat('x', 40000000), 10, 30, 60, 1, 1), ('fine', 'fine', 10, 30, 60, 1, 1)")
    execute(postgres.conninfo, "INSERT INTO gpuguard.gpus (node, minor, uuid, name, memory_total)"
            " VALUES ('fine', 0, 'GPU-0', repeat('n', 1000), 1), ('fine', 1, 'GPU-1', 'sim', 1)")
    with connect(postgres.conninfo, "ggt-upgrade") as conn:
        assert migrate(conn, "ggt-upgrade") == schema.CURRENT
    assert rows(postgres.conninfo, "SELECT name FROM gpuguard.nodes") == [("fine",)]
    assert rows(postgres.conninfo, "SELECT minor FROM gpuguard.gpus") == [(1,)]
    with pytest.raises(psycopg.errors.CheckViolation):
        execute(postgres.conninfo, "UPDATE gpuguard.nodes SET ssh = repeat('x', 256)")


def test_a_grant_time_check_grants_only_on_gpus_the_nodes_rows_list(fleet):
    gpu1, _ = two_nodes(fleet)
    planted = list(range(1000, 1300))
    doc = {**reserve_doc("gpu1", "u7", planted, quota=2),
           "gpus": [{"minor": m, "uuid": f"GPU-{m}", "name": "sim", "memory_total": 1, "owner": "gpuguard"}
                    for m in planted]}
    answer = gpu1.reserve(doc)
    assert answer["skipped"]["minors"] == planted, answer
    assert rows(fleet.owner, "SELECT count(*) FROM gpuguard.grants WHERE username = 'u7'") == [(0,)]
    assert gpu1.reserve(reserve_doc("gpu1", "u7", [0], quota=2))["granted"] == [0]  # a GPU it lists: granted


def test_no_role_of_the_fleet_writes_outside_its_schema_once_init_has_run(fleet):
    two_nodes(fleet)
    for role in (GPU1, roles.WEB):
        with psycopg.connect(fleet.as_role(role), autocommit=True) as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("CREATE TEMP TABLE ggt_t (i integer)")  # taken from PUBLIC by fleet init
    # large objects only a superuser can take back: fleet init says how, and the statement it prints does it
    told = fleet.init("--node", "gpu1", "--node", "gpu2")
    line = next(line for line in told.stdout.splitlines() if "large objects" in line)
    statement = line.split(" -c ", 1)[1].strip("'")
    with psycopg.connect(fleet.as_role(GPU1), autocommit=True) as conn:
        assert conn.execute("SELECT lo_from_bytea(0, 'x'::bytea) > 0").fetchone() == (True,)  # before
    as_superuser(fleet, statement)
    with psycopg.connect(fleet.as_role(GPU1), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT lo_from_bytea(0, %s::bytea)", (json.dumps("x").encode(),))
    assert "to do as a superuser" not in fleet.init("--node", "gpu1", "--node", "gpu2").stdout
