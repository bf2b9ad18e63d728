"""One role per node, least privilege (gpuguard.fleet.roles, `gpuguard fleet init`, schemas 5 to 7) on a
real PostgreSQL that asks every TCP login for its password (SCRAM): the roles log in with the
passfiles fleet init wrote. Node gpu1's role writes its own rows and nothing of gpu2's, nor a node
of another name, nor any table directly; the web's role, from its own passfile that only the web
account can read, reads what the web shows and writes nothing; the admin's removes a node and
sets no node's ssh line. Then two real daemons each under its own role: online, granting and
releasing, and the ssh line `where` and a queued login print is said to be the node's."""
from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import psycopg
import pytest
from conftest import run_as
from daemon_fixture import RunningDaemon
from fleet_fixture import Fleet
from sim_helpers import PYTHON, cli
from test_fleet_db import heartbeat_doc, reserve_doc, rows

from devtools.harness import wait_for
from gpuguard.core.errors import EXIT_FAILED, EXIT_UNREACHABLE, EXIT_USAGE
from gpuguard.fleet import roles, schema
from gpuguard.fleet.fleetdb import FleetDb, connect, remove_node

TABLES = ("nodes", "gpus", "grants", "queue", "ledger", "fleet_quotas", "migrations")
DENIED = psycopg.errors.InsufficientPrivilege


def denied(conninfo: str, statement: str, *params) -> bool:
    """Whether `statement`, in a transaction, is refused for want of a privilege (anything else raises)."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        try:
            with conn.transaction():
                conn.execute(statement, params or None)
        except DENIED:
            return True
    return False


def grant(minor: int, user: str) -> dict:
    return {"minor": minor, "username": user, "uid": 1001, "granted_at": time.time() - 5, "expires_at": None,
            "shared": False, "origin": "session"}


def test_a_nodes_role_writes_its_own_rows_only(fleet):
    made = fleet.init("--node", "gpu1", "--node", "gpu2")
    assert made.returncode == 0, made
    assert made.stdout.startswith(f"gpuguard: the fleet database is at schema {schema.CURRENT}; its roles are ready "
                                  "(owner gpuguard)")
    for role, reader in (("gpuguard_node_gpu1", "root"), ("gpuguard_node_gpu2", "root"), (roles.ADMIN, "root"),
                         (roles.WEB, fleet.web.name)):
        path = roles.passfile(fleet.credentials, role)
        info = path.stat()
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == (0 if reader == "root" else fleet.web.uid)
        assert f"new password in {path} (readable by {reader} only)" in made.stdout
    assert f'node gpu2: new password in {roles.passfile(fleet.credentials, "gpuguard_node_gpu2")}' in made.stdout
    gpu1, gpu2 = FleetDb(fleet.as_role("gpuguard_node_gpu1"), "gpu1"), FleetDb(fleet.as_role("gpuguard_node_gpu2"), "gpu2")
    assert gpu1.heartbeat(heartbeat_doc("gpu1")) and gpu2.heartbeat({**heartbeat_doc("gpu2", grants=[grant(0, "u2")]),
                                                                   "ssh": "gpu2.lab"})
    assert gpu1.reserve(reserve_doc("gpu1", "u1", [1], 4))["granted"] == [1]
    gpu1.release([(1, "u1")])
    assert gpu1.heartbeat(heartbeat_doc("gpu1"))  # which takes it out
    assert rows(fleet.owner, "SELECT count(*) FROM gpuguard.grants WHERE node = 'gpu1'") == [(0,)]
    before = rows(fleet.owner, "SELECT * FROM gpuguard.nodes ORDER BY name"), rows(
        fleet.owner, "SELECT * FROM gpuguard.grants ORDER BY node, minor")

    # gpu1's role: nothing of gpu2's, no node of another name, through the functions or around them
    for function, doc in (("heartbeat_v4", {**heartbeat_doc("gpu2"), "ssh": "evil.example.org"}),
                          ("heartbeat_v5", {**heartbeat_doc("gpu2"), "ssh": "evil.example.org"}),
                          ("heartbeat_v6", {**heartbeat_doc("gpu2"), "ssh": "evil.example.org"}),
                          ("heartbeat_v4", heartbeat_doc("gpu9")), ("reserve_v3", reserve_doc("gpu2", "u1", [1], None)),
                          ("heartbeat_v3", heartbeat_doc("gpu1")), ("heartbeat_v1", heartbeat_doc("gpu1")),
                          ("reserve_v2", reserve_doc("gpu1", "u1", [1], None))):
        with pytest.raises(DENIED):
            FleetDb(fleet.as_role("gpuguard_node_gpu1"), "gpu1").call(function, doc)
    posing = FleetDb(fleet.as_role("gpuguard_node_gpu1"), "gpu2")
    posing.release([(0, "u2")])  # sent before its next check
    with pytest.raises(DENIED, match="role gpuguard_node_gpu1 may not write the rows of node gpu2"):
        posing.reserve(reserve_doc("gpu2", "u1", [1], None))
    # nor with gpu2's digest, as a heartbeat that sends only what changed: asked to send it all, nothing written
    (digest,) = rows(fleet.owner, "SELECT digest FROM gpuguard.nodes WHERE name = 'gpu2'")[0]
    sneaky = {**heartbeat_doc("gpu2"), "since": digest, "digest": "forged"}
    assert FleetDb(fleet.as_role("gpuguard_node_gpu1"), "gpu1").call("heartbeat_v5", sneaky)["resend"] is True
    # nor as one that only says "still here" (heartbeat_v6's short way: no part, no ledger row)
    seen = {key: sneaky[key] for key in ("node", "incarnation", "taken_at", "half_life", "ledger", "usage_for",
                                         "users", "want_free")}
    short = {**seen, "since": digest, "digest": digest}
    assert FleetDb(fleet.as_role("gpuguard_node_gpu1"), "gpu1").call("heartbeat_v6", short)["resend"] is True
    node = fleet.as_role("gpuguard_node_gpu1")
    for statement in ("UPDATE gpuguard.nodes SET ssh = 'evil.example.org' WHERE name = 'gpu2'",
                      "DELETE FROM gpuguard.grants WHERE node = 'gpu2'",
                      "INSERT INTO gpuguard.nodes (name, heartbeat, lease, grace, first_seen, last_seen)"
                      " VALUES ('gpu9', 10, 30, 60, 0, 0)",
                      "UPDATE gpuguard.nodes SET last_seen = 0 WHERE name = 'gpu1'",
                      "INSERT INTO gpuguard.fleet_quotas VALUES ('u2', 0, 0)",
                      "LOCK TABLE gpuguard.fleet_quotas IN EXCLUSIVE MODE",
                      "DROP SCHEMA gpuguard CASCADE"):
        assert denied(node, statement), statement
    with connect(node, "ggt-node") as conn, pytest.raises(DENIED):
        remove_node(conn, "gpu2", force=True)
    assert (rows(fleet.owner, "SELECT * FROM gpuguard.nodes ORDER BY name"),
            rows(fleet.owner, "SELECT * FROM gpuguard.grants ORDER BY node, minor")) == before
    assert rows(fleet.owner, "SELECT name, ssh FROM gpuguard.nodes ORDER BY name") == [("gpu1", "gpu1"),
                                                                                        ("gpu2", "gpu2.lab")]

    # the admin's role removes a node and edits fleet quota rows, and sets no node's ssh line
    admin = fleet.as_role(roles.ADMIN)
    assert denied(admin, "UPDATE gpuguard.nodes SET ssh = 'evil.example.org' WHERE name = 'gpu2'")
    assert denied(admin, "SELECT gpuguard.heartbeat_v4(%s)", json.dumps({**heartbeat_doc("gpu2"), "ssh": "evil"}))
    assert not denied(admin, "INSERT INTO gpuguard.fleet_quotas VALUES ('u2', 1, 0)")
    on_gpu1 = fleet.credentials / "gpu1.toml"  # gpu1's config: its own role
    on_gpu1.write_text(f'[paths]\nstate_dir = "{fleet.credentials / "state"}"\n'
                       f'[fleet]\ndatabase = "{fleet.as_role("gpuguard_node_gpu1")}"\nnode = "gpu1"\n')
    refused = cli(on_gpu1, "fleet", "remove", "--force", "gpu2")
    assert refused.returncode == EXIT_FAILED and "removing a node takes the admin's role (gpuguard_admin" in \
        refused.stderr, refused
    removed = cli(on_gpu1, "fleet", "remove", "--force", "--database", admin, "gpu2")
    assert removed.returncode == 0 and "1 grant" in removed.stdout, removed
    assert rows(fleet.owner, "SELECT name FROM gpuguard.nodes") == [("gpu1",)]

    # again (an upgrade): the roles keep their passwords, and the nodes their logins
    again = fleet.init("--node", "gpu1")
    assert again.returncode == 0 and "node gpu1: kept its password" in again.stdout, again
    assert gpu1.heartbeat(heartbeat_doc("gpu1"))


# every function of the schema, and whether PUBLIC may call it (no ACL: the default, which grants it to PUBLIC)
FUNCTIONS = ("SELECT p.oid::regprocedure::text, p.proacl IS NULL OR EXISTS ("
             " SELECT 1 FROM aclexplode(p.proacl) a WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE')"
             " FROM pg_proc p JOIN pg_namespace s ON s.oid = p.pronamespace WHERE s.nspname = 'gpuguard' ORDER BY 1")
CALLABLE = ("SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace s ON s.oid = p.pronamespace"
            " WHERE s.nspname = 'gpuguard' AND has_function_privilege(%s, p.oid, 'EXECUTE') ORDER BY 1")


def catalog(fleet: Fleet, query: str, *params) -> list[tuple]:
    """rows(), as the owner with nothing but pg_catalog on its search_path (regprocedure names their schema)."""
    return rows(f"{fleet.owner} options='-c search_path=pg_catalog'", query, *params)


def owner_runs(fleet: Fleet, statement: str) -> None:
    with psycopg.connect(fleet.owner, autocommit=True) as conn:
        conn.execute(statement)


def test_no_role_calls_a_function_it_is_not_granted_later_ones_included(fleet):
    assert fleet.init("--node", "gpu1").returncode == 0
    # a function the owner makes after fleet init (a later migration's): PUBLIC may not call it either
    owner_runs(fleet, "CREATE FUNCTION gpuguard.ggt_later() RETURNS integer LANGUAGE sql SECURITY DEFINER"
                      " AS 'SELECT 1'")
    functions = catalog(fleet, FUNCTIONS)
    assert len(functions) > 15 and [name for name, public in functions if public] == [], functions
    web, admin = fleet.as_role(roles.WEB), fleet.as_role(roles.ADMIN)
    nodes = sorted(f"gpuguard.{function}".replace(", ", ",") for function in roles.NODE_FUNCTIONS)
    for role, may in ((roles.WEB, []), (roles.ADMIN, []), ("gpuguard_node_gpu1", nodes)):
        assert catalog(fleet, CALLABLE, role) == [(name,) for name in may], role
    for name, _ in functions:
        call = f"SELECT {name.split('(')[0]}({', '.join(['NULL'] * (name.count(',') + ('()' not in name)))})"
        assert denied(web, call) and denied(admin, call), call
    # fleet init again grants what is the nodes' now, and takes back what was granted by hand
    owner_runs(fleet, "GRANT EXECUTE ON FUNCTION gpuguard.ggt_later(), gpuguard.heartbeat_v3(jsonb) TO PUBLIC,"
                      " gpuguard_nodes")
    assert fleet.init("--node", "gpu1").returncode == 0
    assert [name for name, public in catalog(fleet, FUNCTIONS) if public] == []
    assert catalog(fleet, CALLABLE, "gpuguard_node_gpu1") == [(name,) for name in nodes]
    assert catalog(fleet, CALLABLE, roles.WEB) == []


def test_a_nodes_role_writes_rows_within_bounds_and_the_rest_of_its_heartbeat(fleet):
    assert fleet.init("--node", "gpu1").returncode == 0
    node = fleet.as_role("gpuguard_node_gpu1")
    gpu1 = FleetDb(node, "gpu1")
    assert "skipped" not in gpu1.heartbeat(heartbeat_doc("gpu1"))
    (first_seen,) = rows(fleet.owner, "SELECT first_seen FROM gpuguard.nodes WHERE name = 'gpu1'")[0]
    now = time.time()
    sharers = [{**grant(1, f"u{i}"), "shared": True} for i in range(49)]  # one past what a GPU may have
    elsewhere = grant(99, "u2")  # a GPU gpu1 does not list
    ledger = [{"seq": 1, "username": "u1", "minor": 0, "started": now - 100, "ended": now - 10},
              {"seq": 2, "username": "victim", "minor": 0, "started": now - 100, "ended": 1e11},
              {"seq": 3, "username": "victim", "minor": 0, "started": first_seen - 86400, "ended": now - 10},
              {"seq": 4, "username": "victim", "minor": 0, "started": now - 10, "ended": now - 100}]
    answer = gpu1.heartbeat(heartbeat_doc("gpu1", grants=[grant(0, "u1"), *sharers, elsewhere], ledger=ledger))
    assert answer["skipped"]["grants"] == [sharers[-1], elsewhere], answer
    assert [row["seq"] for row in answer["skipped"]["ledger"]] == [2, 3, 4]
    assert rows(fleet.owner, "SELECT minor, count(*) FROM gpuguard.grants GROUP BY minor ORDER BY minor") == [
        (0, 1), (1, 48)]
    assert rows(fleet.owner, "SELECT seq, username FROM gpuguard.ledger") == [(1, "u1")]
    assert rows(fleet.owner, "SELECT last_seen > %s FROM gpuguard.nodes", first_seen) == [(True,)]
    # what changed only (heartbeat_v5 with `since`), the grant-time check, and a node of schema 5 (heartbeat_v4)
    stray = grant(98, "u3")
    again = gpu1.heartbeat(heartbeat_doc("gpu1", grants=[grant(0, "u1"), *sharers[:48], stray]))
    assert again["skipped"] == {"grants": [stray]}, again
    reserved = gpu1.reserve(reserve_doc("gpu1", "u4", [2, 97, 1], None, shared=True))
    assert reserved["granted"] == [2] and reserved["skipped"] == {"minors": [97, 1]}, reserved
    old = gpu1.call("heartbeat_v4", heartbeat_doc("gpu1", grants=[grant(96, "u5")],
                                                  ledger=[{**ledger[1], "seq": 5}]))
    assert old["skipped"]["grants"][0]["minor"] == 96 and old["skipped"]["ledger"][0]["seq"] == 5, old
    assert rows(fleet.owner, "SELECT count(*) FROM gpuguard.grants WHERE minor > 90 OR username = 'u5'") == [(0,)]
    assert rows(fleet.owner, "SELECT count(*) FROM gpuguard.ledger WHERE username = 'victim'") == [(0,)]
    # the owner's role (a fleet before roles) may write the tables anyway: not bounded
    assert "skipped" not in FleetDb(fleet.owner, "gpu1").call("heartbeat_v5", heartbeat_doc("gpu1", grants=[elsewhere]))


def test_fleet_init_on_another_host_says_the_passfiles_are_not_there(fleet):
    assert fleet.init("--node", "gpu1").returncode == 0
    elsewhere = Path(tempfile.mkdtemp(prefix="ggt-"))
    try:
        again = cli(fleet.config, "fleet", "init", "--database", fleet.owner, "--credentials", str(elsewhere),
                    "--web-account", fleet.web.name, "--node", "gpu1")
        assert again.returncode == 0, again
        for role in ("gpuguard_node_gpu1", roles.ADMIN, roles.WEB):
            name = roles.passfile(elsewhere, role).name
            assert f"kept its password, but its passfile is not in {elsewhere}: copy {name} there" in again.stdout
        assert not any(elsewhere.iterdir())
        here = fleet.init("--node", "gpu1")  # where the files are: nothing to say
        assert here.returncode == 0 and "not in" not in here.stdout and here.stdout.count("kept its password") == 3
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)


READ = """
import asyncio, json, sys
from pathlib import Path
from gpuguard.web.fleet import FleetSource
servers = asyncio.run(FleetSource(sys.argv[1], Path(sys.argv[2])).servers())
print(json.dumps([[s.name, s.error] for s in servers]))
"""


def test_the_web_reads_with_its_own_role_and_writes_nothing(fleet, make_user):
    assert fleet.init("--node", "gpu1").returncode == 0
    FleetDb(fleet.as_role("gpuguard_node_gpu1"), "gpu1").heartbeat(heartbeat_doc("gpu1", grants=[grant(0, "u1")]))
    # the web's account: [fleet] database names the owner (whose password it does not have): its own role is used
    seen = run_as(fleet.web, [PYTHON, "-c", READ, f"{fleet.tcp} user=gpuguard", str(fleet.credentials)])
    assert seen.returncode == 0 and json.loads(seen.stdout) == [["gpu1", None]], seen
    other = run_as(make_user(), [PYTHON, "-c", READ, f"{fleet.tcp} user=gpuguard", str(fleet.credentials)])
    assert other.returncode == 0 and "password" in json.loads(other.stdout)[0][1], other  # its file: the web's only

    web = fleet.as_role(roles.WEB)
    assert rows(web, "SELECT name FROM gpuguard.nodes") == [("gpu1",)]
    for table in TABLES:
        assert denied(web, f"DELETE FROM gpuguard.{table}"), table
        assert denied(web, f"UPDATE gpuguard.{table} SET {'name' if table == 'nodes' else 'node'} = 'x'"
                      if table not in ("fleet_quotas", "migrations") else f"TRUNCATE gpuguard.{table}"), table
    assert denied(web, "INSERT INTO gpuguard.nodes (name, heartbeat, lease, grace, first_seen, last_seen)"
                       " VALUES ('gpu9', 10, 30, 60, 0, 0)")
    assert denied(web, "SELECT * FROM gpuguard.fleet_quotas")  # nothing the web does not show
    for call, doc in (("heartbeat_v4", heartbeat_doc("gpu1")), ("heartbeat_v5", heartbeat_doc("gpu1")),
                      ("reserve_v3", reserve_doc("gpu1", "u1", [1], None)),
                      ("heartbeat_v1", heartbeat_doc("gpu1")), ("reserve_v1", reserve_doc("gpu1", "u1", [1], None))):
        assert denied(web, f"SELECT gpuguard.{call}(%s)", json.dumps(doc)), call
    assert denied(web, "SELECT gpuguard.release_v1('gpu1', ARRAY[0], ARRAY['u1'])")
    assert denied(web, "CREATE TABLE gpuguard.x (a int)")
    assert rows(fleet.owner, "SELECT node, minor, username FROM gpuguard.grants") == [("gpu1", 0, "u1")]


def test_bad_input_is_one_line_with_its_own_exit_code(fleet):
    bad = fleet.init("--node", "gpu1; DROP ROLE gpuguard")
    assert bad.returncode == EXIT_USAGE and bad.stderr.count("\n") == 1, bad
    assert "node name 'gpu1; DROP ROLE gpuguard': a role needs letters, digits" in bad.stderr
    long = fleet.init("--node", "g" * 50)
    assert long.returncode == EXIT_USAGE and "at most 49 characters" in long.stderr, long
    nobody = cli(fleet.config, "fleet", "init", "--database", fleet.owner, "--node", "gpu1", "--web-account",
                 "ggt-nobody-here")
    assert nobody.returncode == EXIT_USAGE and "no account ggt-nobody-here" in nobody.stderr, nobody
    assert cli(fleet.config, "fleet", "init").returncode == EXIT_USAGE  # no [fleet], no --database
    superuser = cli(fleet.config, "fleet", "init", "--database", fleet.superuser, "--node", "gpu1",
                    "--credentials", str(fleet.credentials), "--web-account", fleet.web.name)
    assert superuser.returncode == EXIT_FAILED and "a superuser" in superuser.stderr, superuser
    away = cli(fleet.config, "fleet", "init", "--database", "host=127.0.0.1 port=1 dbname=x connect_timeout=2",
               "--node", "gpu1", "--web-account", fleet.web.name)
    assert away.returncode == EXIT_UNREACHABLE and away.stderr.startswith("gpuguard: fleet database unreachable"), away
    assert not any(fleet.credentials.glob("*.pgpass"))  # nothing written by any of them
    assert rows(fleet.superuser, "SELECT count(*) FROM pg_roles WHERE rolname LIKE 'gpuguard\\_%%'") == [(0,)]


def test_two_daemons_each_under_its_own_role_and_the_ssh_line_said_to_be_the_nodes(fleet, make_group, make_user):
    assert fleet.init("--node", "gpu1", "--node", "gpu2").returncode == 0
    group = make_group()
    nodes: dict[str, RunningDaemon] = {}
    sandboxes = []
    try:
        for name in ("gpu1", "gpu2"):
            sandbox = Path(tempfile.mkdtemp(prefix="ggt-"))
            sandbox.chmod(0o755)
            sandboxes.append(sandbox)
            nodes[name] = RunningDaemon(sandbox, group, make_user)
            nodes[name].write_config(count=2, gate=False, defaults={"gpus": 2}, fleet={
                "database": fleet.as_role(f"gpuguard_node_{name}"), "node": name, "ssh": f"{name}.lab",
                "heartbeat": "1s", "lease": "2s", "grace": "2s"})
            nodes[name].start()
        gpu1 = nodes["gpu1"]
        for name in nodes:
            assert wait_for(lambda n=name: (seen := next((s for s in gpu1.call("fleet_status")["nodes"]
                                                          if s["name"] == n), None)) and not seen["lost"]), name
        alice, bob, carol = (make_user(groups=[group]) for _ in range(3))
        held = gpu1.open_session(alice)
        assert len(held["gpus"]) == 2  # reserve_v3 under gpu1's role
        assert wait_for(lambda: next(s for s in gpu1.call("fleet_status")["nodes"] if s["name"] == "gpu1")["free"] == 0)
        assert wait_for(lambda: rows(fleet.owner, "SELECT count(*) FROM gpuguard.grants WHERE node = 'gpu1'") == [(2,)])
        where = gpu1.cli_as(carol, "where")
        assert where.returncode == 0, where
        assert where.stdout.splitlines()[-2:] == ["gpu2, as its own ssh line says (set by that node):", "ssh gpu2.lab"]
        time.sleep(1.5)  # a heartbeat of gpu1 since it filled: it brought where GPUs are free
        queued = gpu1.open_session(bob)
        assert queued["gpus"] == [] and "GPUs free now on gpu2 (2): ssh gpu2.lab (gpu2's own ssh line)" in \
            queued["message"], queued
        gpu1.close_session(alice, held["pid"])  # release_v1, and the ledger through heartbeat_v4
        assert wait_for(lambda: rows(fleet.owner, "SELECT count(*) FROM gpuguard.ledger WHERE node = 'gpu1'") == [(2,)])
    finally:
        for node in nodes.values():
            node.cleanup()
            print(f"--- {node.config.fleet.node} log ---\n{node.log()}")
        for sandbox in sandboxes:
            shutil.rmtree(sandbox, ignore_errors=True)
    assert os.path.exists(fleet.credentials)
