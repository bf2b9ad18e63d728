"""One role per node, least privilege: the fleet database's roles, as `gpuguard fleet init` makes them.

- the owner (the role `fleet init` connects as, `gpuguard` in the docs): owns the schema and
  applies its migrations; it needs CREATEROLE and must not be a superuser (the nodes' functions
  run with its rights);
- gpuguard_node_<name>, one login role per node, a member of gpuguard_nodes: it may read the
  fleet's tables and call heartbeat_v4 to v6, reserve_v3 and release_v1, which write only the
  rows of the node its role is named for, within bounds (schema.py, migrations 5 to 9); no table
  may it write directly, no other function may it call;
- gpuguard_admin: reads everything, removes nodes (`gpuguard fleet remove`) and may edit the
  fleet_quotas rows; it writes nothing of a node's (its ssh line included);
- gpuguard_web: reads the tables the web view shows, nothing else (no function either).

Each login role holds at most a few connections at once (CONNECTION_LIMITS): root on one node
could otherwise take every one of the server's and put every other node offline. And none may
write outside the schema where the database's owner can stop it: `fleet init` takes TEMPORARY on
the database from PUBLIC, and says what only a superuser can take (creating in schema public,
large objects, which outlive their session).

Each login role's password is drawn here, sent to the server only as a SCRAM verifier, and
written to a passfile (libpq's .pgpass format) that only its reader may read: root for the
nodes and the admin, the web's account for the web's. An existing role keeps its password
(running `fleet init` again migrates and grants again, as an upgrade needs) unless new ones are
asked for.
"""
from __future__ import annotations

import os
import pwd
import re
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from gpuguard.fleet.schema import NAMESPACE, FleetError

NODE_PREFIX = "gpuguard_node_"
NODES = "gpuguard_nodes"  # the group every node role belongs to (no login)
ADMIN = "gpuguard_admin"
WEB = "gpuguard_web"
CREDENTIALS = Path("/etc/gpuguard")  # where `fleet init` writes the passfiles, the web and `fleet remove` read theirs
# A node name a role may carry: PostgreSQL cuts names at 63 bytes, silently; nothing to quote.
NODE_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{62 - len(NODE_PREFIX)}}}")
WEB_TABLES = ("nodes", "gpus", "grants", "queue", "ledger")  # what gpuguard.web.fleet reads
# Connections a login role may hold at once: a node's daemon holds one for its heartbeats (and a
# second while it reconnects) and up to two for the fleet's view (ops.POOL_SIZE), `fleet remove`
# one, the web one per read in flight (asyncio.to_thread, whose default pool has at most 32
# threads). Size the server's max_connections past their sum (docs/several-servers.md).
CONNECTION_LIMITS = {"node": 6, ADMIN: 4, WEB: 32}
NODE_FUNCTIONS = ("heartbeat_v4(jsonb)", "heartbeat_v5(jsonb)", "heartbeat_v6(jsonb)", "reserve_v3(jsonb)",
                  "release_v1(text, integer[], text[])")


class RoleError(FleetError):
    """A role cannot be made as asked (a bad node name, the wrong connecting role)."""


def node_role(node: str) -> str:
    """The login role of node `node`: gpuguard_node_<node>; RoleError for a name no role may carry."""
    if not NODE_NAME.fullmatch(node):
        raise RoleError(f"node name {node!r}: a role needs letters, digits, '.', '_' or '-' (the first a letter or "
                        f"digit), at most {63 - len(NODE_PREFIX)} characters")
    return NODE_PREFIX + node


def passfile(directory: Path, role: str) -> Path:
    """Where `fleet init` writes `role`'s passfile: fleet-node-gpu1.pgpass, fleet-admin.pgpass, fleet-web.pgpass."""
    short = f"node-{role.removeprefix(NODE_PREFIX)}" if role.startswith(NODE_PREFIX) else role.removeprefix("gpuguard_")
    return directory / f"fleet-{short}.pgpass"


def conninfo_as(conninfo: str, role: str, path: Path) -> str:
    """`conninfo` (hosts, database, options) logging in as `role` with the password in passfile `path`."""
    params = {key: value for key, value in conninfo_to_dict(conninfo).items()
              if key not in ("password", "passfile") and str(value).strip(",")}  # a URI's hosts without ports: port=,
    return make_conninfo("", **{**params, "user": role, "passfile": str(path)})


def derived(conninfo: str, role: str, directory: Path = CREDENTIALS) -> str | None:
    """`conninfo` as `role` when its passfile is in `directory` (`fleet init` wrote it), else None."""
    path = passfile(directory, role)
    return conninfo_as(conninfo, role, path) if path.exists() else None


@dataclass(frozen=True)
class Made:
    role: str
    password: str | None  # drawn now (None: the role kept its own)


def check_owner(conn: psycopg.Connection) -> str:
    """The connecting role, once it may own the schema and make roles; RoleError otherwise."""
    row = conn.execute("SELECT r.rolname, r.rolsuper, r.rolcreaterole,"
                       " (SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = %s)"
                       " FROM pg_roles r WHERE r.rolname = current_user", (NAMESPACE,)).fetchone()
    assert row is not None
    me, superuser, createrole, owner = row
    if superuser:
        raise RoleError(f"connected as {me}, a superuser: the nodes' functions would run as one; connect as the role "
                        "that owns the fleet's schema (sudo -u postgres createuser --createrole --pwprompt gpuguard)")
    if owner is not None and owner != me:
        raise RoleError(f"the schema {NAMESPACE} is owned by {owner}, not {me}: connect as {owner}")
    if not createrole:
        raise RoleError(f"role {me} may not make roles: sudo -u postgres psql -c 'ALTER ROLE {me} CREATEROLE'")
    return str(me)


def setup(conn: psycopg.Connection, nodes: Iterable[str], keep: Callable[[str], bool]) -> list[Made]:
    """Make (or bring up to date) the roles and their rights, in one transaction, on a database
    migrated by this connection's role (the owner). keep(role): an existing login role keeps its
    password; otherwise (and for a new role) one is drawn and returned."""
    node_roles = [node_role(node) for node in nodes]  # every name checked before anything is made
    made: list[Made] = []
    with conn.transaction():
        _group(conn, NODES)
        for role in [*node_roles, ADMIN, WEB]:
            made.append(_login(conn, role, keep))
        for role in node_roles:
            conn.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(NODES), sql.Identifier(role)))
        schema = sql.Identifier(NAMESPACE)
        every = sql.SQL(", ").join(map(sql.Identifier, (NODES, ADMIN, WEB)))
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(schema, every))
        for role in (NODES, ADMIN):
            conn.execute(sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA {} TO {}").format(schema, sql.Identifier(role)))
        conn.execute(sql.SQL("GRANT SELECT ON {} TO {}").format(
            sql.SQL(", ").join(sql.Identifier(NAMESPACE, table) for table in WEB_TABLES), sql.Identifier(WEB)))
        # what a role may call is only what is granted here (migration 7): a function made since the
        # last run, or granted by hand, is taken back from PUBLIC and from the roles first
        conn.execute(sql.SQL("REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA {} FROM PUBLIC, {}").format(schema, every))
        conn.execute(sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(
            sql.SQL(", ").join(sql.SQL(f"{NAMESPACE}.{function}") for function in NODE_FUNCTIONS),
            sql.Identifier(NODES)))
        # remove_node deletes (its GPUs, grants and queue go by the foreign keys) and locks the row
        # first, which PostgreSQL allows only with an UPDATE right: on `clash` alone, nothing a node says
        conn.execute(sql.SQL("GRANT DELETE, UPDATE (clash) ON {} TO {}").format(
            sql.Identifier(NAMESPACE, "nodes"), sql.Identifier(ADMIN)))
        conn.execute(sql.SQL("GRANT INSERT, UPDATE, DELETE ON {} TO {}").format(
            sql.Identifier(NAMESPACE, "fleet_quotas"), sql.Identifier(ADMIN)))
    return made


def _group(conn: psycopg.Connection, role: str) -> None:
    if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone() is None:
        conn.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(role)))


def _login(conn: psycopg.Connection, role: str, keep: Callable[[str], bool]) -> Made:
    row = conn.execute("SELECT rolsuper OR rolcreaterole OR rolcreatedb OR rolreplication OR rolbypassrls"
                       " FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
    if row is not None and row[0]:
        raise RoleError(f"role {role} exists with more rights than it should have (superuser, createrole, createdb, "
                        f"replication or bypassrls): drop it (DROP ROLE {role}) and run gpuguard fleet init again")
    limit = CONNECTION_LIMITS["node" if role.startswith(NODE_PREFIX) else role]
    if row is not None and keep(role):
        conn.execute(sql.SQL("ALTER ROLE {} CONNECTION LIMIT {}").format(sql.Identifier(role), sql.Literal(limit)))
        return Made(role, None)
    password = secrets.token_urlsafe(24)  # letters, digits, '-' and '_': nothing to escape in a passfile
    verifier = conn.pgconn.encrypt_password(password.encode(), role.encode(), b"scram-sha-256").decode()
    conn.execute(sql.SQL("{} ROLE {} LOGIN CONNECTION LIMIT {} PASSWORD {}").format(
        sql.SQL("CREATE" if row is None else "ALTER"), sql.Identifier(role), sql.Literal(limit), sql.Literal(verifier)))
    return Made(role, password)


# What PUBLIC (every role, the nodes' and the web's included) may still do outside the schema
# that lets one role harm the others, each with the superuser's statement that stops it.
_PUBLIC_RIGHTS = (
    ("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = 'public')"
     " AND has_schema_privilege('public', 'public', 'CREATE')",
     "every role may create in schema public (PostgreSQL 14 and older): a node's role could put functions there "
     "that other sessions run", "REVOKE CREATE ON SCHEMA public FROM PUBLIC"),
    ("SELECT has_database_privilege('public', current_database(), 'TEMPORARY')",
     "every role may make temporary tables", "REVOKE TEMPORARY ON DATABASE {database} FROM PUBLIC"),
    ("SELECT has_function_privilege('public', 'lo_create(oid)', 'EXECUTE')",
     "every role may make large objects, which outlive its session (a disk to fill)",
     "REVOKE EXECUTE ON FUNCTION lo_create(oid), lo_creat(integer), lo_from_bytea(oid, bytea) FROM PUBLIC"),
)


def restrict_public(conn: psycopg.Connection) -> list[tuple[str, str]]:
    """Take from PUBLIC what the connecting role may (TEMPORARY, when it owns the database);
    what is left, as (what PUBLIC may do, the superuser's statement to stop it)."""
    database = conn.info.dbname
    owns = conn.execute("SELECT pg_get_userbyid(datdba) = current_user FROM pg_database"
                        " WHERE datname = current_database()").fetchone()
    if owns is not None and owns[0]:
        conn.execute(sql.SQL("REVOKE TEMPORARY ON DATABASE {} FROM PUBLIC").format(sql.Identifier(database)))
    left = []
    for question, what, statement in _PUBLIC_RIGHTS:
        answer = conn.execute(question).fetchone()
        if answer is not None and answer[0]:
            left.append((what, statement.format(database=sql.Identifier(database).as_string(conn))))
    return left


def write_passfile(path: Path, role: str, password: str, reader: str = "root") -> None:
    """`role`'s password in libpq's .pgpass format (any host, port and database), mode 0600 and
    owned by account `reader`: written under a temporary name, then renamed over the old one."""
    entry = pwd.getpwnam(reader)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchown(fd, entry.pw_uid, entry.pw_gid)
        os.write(fd, f"*:*:*:{role}:{password}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
