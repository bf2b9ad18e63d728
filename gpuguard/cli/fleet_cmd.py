"""`gpuguard where`, `gpuguard status --fleet` and `gpuguard fleet remove`: the fleet of servers
sharing one PostgreSQL.

`where` and `status --fleet` ask the local daemon, which reads the fleet database (users hold no
database password). A node silent past its lease shows as lost; a view the daemon could not
refresh says since when. `fleet remove` (root) writes to the database itself, with this node's
connection string: the daemon need not run.
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
from typing import Any

from gpuguard.cli import CommandError, load_config, print_json, print_rows, require_root, summary
from gpuguard.cli.calls import ask
from gpuguard.core.errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE
from gpuguard.core.messages import clock
from gpuguard.core.quantities import format_duration


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    where = subparsers.add_parser(
        "where", help=summary("where"),
        description="The servers of the fleet, best first for you: free GPUs you may take now (within your "
                    "fleet quota), data locality (same node, same rack, another rack), queue depth; and the ssh line. "
                    "Example: gpuguard where --gpus 2 --data /data/imagenet")
    where.add_argument("--gpus", type=int, default=1, metavar="N", help="GPUs you want (default 1)")
    where.add_argument("--data", metavar="PATH", help="your data's path, as [fleet.data] names storage")
    where.add_argument("--json", action="store_true", help="print JSON")
    where.set_defaults(func=show_where)

    fleet = subparsers.add_parser("fleet", help=summary("fleet"))
    actions = fleet.add_subparsers(dest="action", metavar="ACTION", required=True)
    remove = actions.add_parser(
        "remove", help="take a decommissioned node out of the fleet database",
        description="Delete NODE's rows from the fleet database, in one transaction: the node, its GPUs, grants and "
                    "queue (what status --fleet shows of it); its name is then free for another install at once. Its "
                    "usage ledger stays: fair share keeps counting its users' past usage until it decays. Refused, "
                    "changing nothing, while the node's grants still count (seen within its lease + grace), since a "
                    "running node registers again at its next heartbeat: stop gpuguard there first, or pass --force. "
                    "Uses this server's [fleet] database. Example: sudo gpuguard fleet remove gpu7")
    remove.add_argument("node", metavar="NODE", help="the node's name, as status --fleet shows it")
    remove.add_argument("--force", action="store_true",
                        help="remove it even though it was seen within lease + grace (a running node comes back)")
    remove.add_argument("--database", metavar="CONNINFO",
                        help="connect with this connection string (default: [fleet] database, as the admin role when "
                             "fleet init wrote /etc/gpuguard/fleet-admin.pgpass)")
    remove.set_defaults(func=remove_node)

    init = actions.add_parser(
        "init", help="make the fleet database's roles: one per node, an admin's and the web's",
        description="Migrate the fleet database and make its roles, least privilege: for each NODE a login role "
                    "gpuguard_node_NODE that writes only that node's rows, gpuguard_admin (fleet remove, fleet quota "
                    "rows) and gpuguard_web (reads what the web view shows). Connects as the role that owns the "
                    "fleet's schema (CREATEROLE, not a superuser). Each new role's password goes to a passfile in "
                    "DIR, mode 0600: root's for the nodes and the admin, the web account's for the web. Run again "
                    "after an upgrade: it migrates and grants again; existing roles keep their passwords unless "
                    "--new-passwords. Example: sudo gpuguard fleet init --database 'host=db1 dbname=gpuguard "
                    "user=gpuguard passfile=/root/owner.pgpass' --node gpu1 --node gpu2")
    init.add_argument("--database", metavar="CONNINFO",
                      help="the schema owner's connection string (default: [fleet] database)")
    init.add_argument("--node", dest="nodes", action="append", metavar="NODE",
                      help="a node to make a role for; repeat it (default: this server's [fleet] node)")
    init.add_argument("--credentials", metavar="DIR", help="where the passfiles go (default: /etc/gpuguard)")
    init.add_argument("--web-account", metavar="USER",
                      help="the account gpuguard web runs as, the only one that may read its passfile "
                           "(default: [web] user)")
    init.add_argument("--new-passwords", action="store_true",
                      help="draw new passwords for the named roles that exist already (their old passfiles stop working)")
    init.set_defaults(func=init_roles)


def show_where(args: argparse.Namespace) -> int:
    data = os.path.abspath(args.data) if args.data else None
    reply = ask(args, "where", gpus=args.gpus, data=data)
    if args.json:
        print_json(reply)
        return EXIT_OK
    quota = "no fleet quota" if reply["fleet_gpus"] is None else f"fleet quota {reply['fleet_gpus']}"
    print(f"{reply['user']}: {quota}, {reply['held']} held; {staleness(reply)}")
    choices = reply["choices"]
    if not choices:
        print("no server of the fleet is reachable")
        return 1
    rows = [["NODE", "RACK", "FREE", "YOURS NOW", "QUEUE", *(["DATA"] if data else [])]]
    rows += [[c["node"], c["rack"] or "-", str(c["free"]), str(c["may_take"]), str(c["queued"]),
              *([c["locality"]] if data else [])] for c in choices]
    print_rows(rows)
    # A node's ssh line is what that node sent (only its own role may set it): shown as its, never
    # as gpuguard's instruction.
    best = choices[0]
    if best["may_take"] >= reply["wanted"]:
        print(f"\n{best['node']}, as its own ssh line says (set by that node):\n{best['ssh']}")
        return EXIT_OK
    print(f"\nno server has {reply['wanted']} GPU{'s' if reply['wanted'] != 1 else ''} for you now; the shortest queue: "
          f"{best['node']}, whose own ssh line says: {best['ssh']}")
    return 1


def show_fleet(args: argparse.Namespace) -> int:
    """`gpuguard status --fleet`: every server's GPUs, holders, queue and staleness in one table."""
    reply = ask(args, "fleet_status")
    if args.json:
        print_json(reply)
        return EXIT_OK
    print(f"fleet seen from {reply['node']}: {staleness(reply)}")
    if reply.get("name_clash"):  # another server was refused under this one's name (a daemon before: none)
        print(f"warning: {reply['name_clash']}")
    rows = [["NODE", "RACK", "SEEN", "QUEUE", "GPU", "NAME", "OWNER", "HOLDERS"]]
    for node in reply["nodes"]:
        silent = node["silent_for"]
        seen = ("ok" if not node["lost"] else f"lost {format_duration(round(silent))} ago" if math.isfinite(silent) else
                "lost (its last heartbeat's time is not a time)")
        head = [node["name"], node["rack"] or "-", seen,
                f"{node['queued']} ({node['queued_gpus']} GPUs)" if node["queued"] else "0"]
        for i, gpu in enumerate(node["gpus"] or [None]):
            lead = head if i == 0 else ["", "", "", ""]
            if gpu is None:
                rows.append([*lead, "-", "", "", ""])
            else:
                rows.append([*lead, str(gpu["minor"]), gpu["name"], gpu["owner"], " ".join(gpu["holders"]) or "-"])
    print_rows(rows)
    return EXIT_OK


def staleness(reply: dict[str, Any]) -> str:
    if reply["stale_since"] is not None:
        why = reply.get("offline_reason") or "unreachable"  # a daemon of a release before sends none
        return f"database not used ({why}), stale since {clock(reply['stale_since'])}"
    if reply["view_stale"]:
        return "the fleet view could not be refreshed; showing the last one"
    return "up to date"


def remove_node(args: argparse.Namespace) -> int:
    """`gpuguard fleet remove NODE [--force]`: the node's rows out of the fleet database (fleetdb.remove_node)."""
    require_root("fleet remove")
    config = load_config(args)
    if config.fleet is None:
        raise CommandError("this server is not part of a fleet (no [fleet] in its gpuguard.toml)", EXIT_USAGE)
    import psycopg

    from gpuguard.fleet import fleetdb, lineage_memory, roles
    from gpuguard.fleet.schema import FleetError
    conninfo = args.database or roles.derived(config.fleet.database, roles.ADMIN) or config.fleet.database
    try:
        with fleetdb.connect(conninfo, f"{config.fleet.node} fleet remove") as conn:
            fleetdb.check_fence(conn, lineage_memory(config))  # not on a standby, an old leader or another database
            found = fleetdb.remove_node(conn, args.node, args.force)
    except psycopg.errors.UndefinedTable:
        raise CommandError("the fleet database has no gpuguard schema yet: no node has joined", EXIT_FAILED) from None
    except psycopg.errors.InsufficientPrivilege as exc:
        raise CommandError(f"fleet database: {_first_line(exc)}: removing a node takes the admin's role "
                           f"({roles.ADMIN}, made by gpuguard fleet init), not a node's", EXIT_FAILED) from None
    except (psycopg.Error, FleetError) as exc:
        raise CommandError(f"fleet database: {_first_line(exc)}", EXIT_FAILED) from None
    if found is None:
        raise CommandError(f"no node named {args.node} in the fleet database (status --fleet lists them)", EXIT_FAILED)
    seen = (f"seen {format_duration(round(found['silent_for']))} ago" if math.isfinite(found["silent_for"]) else
            "its last heartbeat's time is not a time")
    on = f" on {found['host']}" if found["host"] else ""
    if not found["removed"]:
        window = format_duration(round(found["lease"] + found["grace"]))
        raise CommandError(f"node {args.node} is live ({seen}{on}; its grants count until it is silent for {window}, "
                           "lease + grace): a running node registers again at its next heartbeat; stop gpuguard "
                           "there first and wait, or use --force", EXIT_FAILED)
    print(f"gpuguard: removed node {args.node} from the fleet ({seen}{on}): {_count(found['gpus'], 'GPU')}, "
          f"{_count(found['grants'], 'grant')} and {_count(found['queued'], 'queued request')} gone; its usage "
          f"ledger ({_count(found['ledger'], 'row')}) stays for fair share")
    if found["live"]:
        print(f"gpuguard: node {args.node} was live: if gpuguard still runs there, it registers again at its next "
              "heartbeat")
    return EXIT_OK


def init_roles(args: argparse.Namespace) -> int:
    """`gpuguard fleet init`: migrate, make the roles and write their passfiles (gpuguard.fleet.roles)."""
    require_root("fleet init")
    config = load_config(args)
    conninfo = args.database or (config.fleet.database if config.fleet is not None else None)
    nodes = args.nodes or ([config.fleet.node] if config.fleet is not None else [])
    if conninfo is None or not nodes:
        raise CommandError("fleet init: no [fleet] in gpuguard.toml: give --database and --node", EXIT_USAGE)
    import pwd
    from pathlib import Path

    import psycopg

    from gpuguard.fleet import fleetdb, roles
    from gpuguard.fleet.schema import FleetError
    try:
        for node in nodes:
            roles.node_role(node)
    except roles.RoleError as exc:
        raise CommandError(f"fleet init: {exc}", EXIT_USAGE) from None
    reader = args.web_account or config.web.user
    try:
        pwd.getpwnam(reader)
    except KeyError:
        raise CommandError(f"fleet init: no account {reader} (the web's, [web] user): make it, or name another with "
                           "--web-account", EXIT_USAGE) from None
    directory = Path(args.credentials) if args.credentials else roles.CREDENTIALS
    try:
        conn = fleetdb.connect(conninfo, "fleet init")
    except psycopg.OperationalError as exc:
        raise CommandError(f"fleet database unreachable: {_first_line(exc)}", EXIT_UNREACHABLE) from None
    try:
        with conn:
            owner = roles.check_owner(conn)
            version = fleetdb.migrate(conn, "fleet init")
            made = roles.setup(conn, nodes, keep=lambda role: not args.new_passwords)
            left, database = roles.restrict_public(conn), conn.info.dbname
    except (psycopg.Error, FleetError) as exc:
        raise CommandError(f"fleet init: {_first_line(exc)}", EXIT_FAILED) from None
    print(f"gpuguard: the fleet database is at schema {version}; its roles are ready (owner {owner})")
    for what, statement in left:
        print(f"  to do as a superuser, on the database's primary: {what}: "
              f"sudo -u postgres psql -d {shlex.quote(database)} -c {shlex.quote(statement)}")
    readers = {roles.WEB: reader}
    for item in made:
        path = roles.passfile(directory, item.role)
        if item.password is not None:
            roles.write_passfile(path, item.role, item.password, readers.get(item.role, "root"))
        how = (f"new password in {path} (readable by {readers.get(item.role, 'root')} only)" if item.password else
               "kept its password" if path.exists() else
               f"kept its password, but its passfile is not in {directory}: copy {path.name} there from the host "
               "where fleet init wrote it (or run again with --new-passwords, which draws new ones for every role: "
               "each then needs its new file)")
        if item.role.startswith(roles.NODE_PREFIX):
            node = item.role.removeprefix(roles.NODE_PREFIX)
            print(f"  node {node}: {how}; on {node}, with that file there: [fleet] database = "
                  f"\"{roles.conninfo_as(conninfo, item.role, roles.passfile(roles.CREDENTIALS, item.role))}\"")
        else:
            uses = "gpuguard fleet remove" if item.role == roles.ADMIN else "gpuguard web"
            print(f"  {item.role}: {how}; {uses} uses it from {roles.passfile(roles.CREDENTIALS, item.role)}")
    return EXIT_OK


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
