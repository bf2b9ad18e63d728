"""Rows for several servers sharing one PostgreSQL (gpuguard.fleet), on a private PostgreSQL
(devtools/postgres.py) of the same run:

- socket login with [fleet] against the same login on a daemon without it: the database up
  (no fleet quota: the grant goes with a heartbeat), the same with a fleet quota (each login
  waits for the grant-time check, one round trip); the database down (the first login waits the
  bounded timeout once, then the node decides locally at local speed);
- `status --fleet` for 50 nodes x 8 GPUs (the daemon's query and its grouping into nodes)
  against a bare SELECT of the same rows;
- heartbeat load: the node's own heartbeat (FleetNode.snapshot of a real store, sent by
  FleetDb.heartbeat) under 50, 500 and 2,000 identities at their fleet's rate (one per node
  every 10 s), one heartbeat in 6 with a change: the database's CPU and transactions per second,
  printed as a table; rows for the database CPU per heartbeat at 2,000 nodes against a `SELECT 1`
  sent the same way at the same rate and against 500 nodes, and for the database CPU of 2,000
  nodes' heartbeats against one core.
"""
from __future__ import annotations

import concurrent.futures
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from env import Bench
from rows import p99, row

from devtools.postgres import Postgres
from gpuguard import client
from gpuguard import config as configuration
from gpuguard.core.model import Device, Gpu, Origin
from gpuguard.fleet import ranking
from gpuguard.fleet.fleetdb import FleetDb, connect, migrate, view
from gpuguard.fleet.identity import Identity
from gpuguard.fleet.node import FleetNode
from gpuguard.fleet.outbox import Outbox
from gpuguard.services.grants import Grants
from gpuguard.services.store import Store

LOGINS = 15   # per round, in each of ROUNDS rounds
ROUNDS = 4    # local and cluster daemons take turns (one gate at a time), in the order ABBA: drift hits both alike
TIMEOUT = 0.5  # [fleet] timeout of the bench's node
HEARTBEAT = 10.0
FLEETS = (50, 500, 2000)
LOAD_SECONDS = 10.0
USERS = 500  # the researchers of a 2,000-node fleet's labs
CHANGED = 6  # one heartbeat in 6 carries a change: what a node sends whole once a minute (FULL_EVERY) at least


def run(bench: Bench) -> None:
    with Postgres.started(prefix=f"ggt-bench-{bench.tag}-pg-") as db:
        login_rows(bench, db)
        status_row(db)
        heartbeat_rows(bench, db)


def _logins(sock: str, bench: Bench, caller: int, count: int) -> list[float]:
    times = []
    for i in range(count):
        user = bench.members[i % 4]
        start = time.perf_counter()
        client.call(sock, "session_open", user=user, service="bench", rhost="", tty="", pid=caller)
        times.append(time.perf_counter() - start)
        client.call(sock, "session_close", user=user, service="bench", pid=caller)
        while client.call(sock, "whoami", user=user)["grants"]:  # the release runs after the reply
            time.sleep(0.001)
    return times


def login_rows(bench: Bench, db: Postgres) -> None:
    caller = subprocess.Popen(["sleep", "600"])  # stands in for sshd's [priv] process
    bench.stack.callback(caller.wait)
    bench.stack.callback(caller.kill)
    def node_config(name: str, node: str, extra: str = "") -> Path:
        return bench.write_config(name, extra=f'[fleet]\ndatabase = "{db.conninfo}"\nnode = "{node}"\n'
                                              f'timeout = "{TIMEOUT}s"\n{extra}')

    def online(sock: str) -> None:
        while not client.call(sock, "fleet_status")["online"]:
            time.sleep(0.1)

    local = bench.write_config("cluster-local")
    fleet = node_config("cluster-node", "bench1")
    # every user of a fleet quota (of more than they take): each login waits for the grant-time check
    checked = node_config("cluster-quota", "bench2", "[defaults]\nfleet_gpus = 8\n")
    samples: dict[str, list[float]] = {"local": [], "up": [], "down": [], "checked": []}
    sock = str(configuration.load(fleet).paths.socket)
    firsts = []

    def local_round() -> None:
        with bench.daemon(local):
            samples["local"] += _logins(str(configuration.load(local).paths.socket), bench, caller.pid, LOGINS)

    def fleet_round() -> None:
        with bench.daemon(fleet):
            online(sock)
            samples["up"] += _logins(sock, bench, caller.pid, LOGINS)
            db.stop("immediate")
            firsts.extend(_logins(sock, bench, caller.pid, 1))
            samples["down"] += _logins(sock, bench, caller.pid, LOGINS)
            db.start()

    def checked_round() -> None:
        checked_sock = str(configuration.load(checked).paths.socket)
        with bench.daemon(checked):
            online(checked_sock)
            samples["checked"] += _logins(checked_sock, bench, caller.pid, LOGINS)

    rounds = (local_round, fleet_round, checked_round)
    for turn in range(ROUNDS):
        for each in rounds if turn % 2 == 0 else rounds[::-1]:
            each()
    first = max(firsts)
    local_median = statistics.median(samples["local"])
    row("login with [fleet], database up", statistics.median(samples["up"]), local_median, 1.2,
        "the same login, no [fleet]")
    row("login with [fleet] and a fleet quota (the grant-time check)", statistics.median(samples["checked"]),
        local_median, 1.2, "the same login, no [fleet]")
    row("login with [fleet], database down (after the first)", statistics.median(samples["down"]), local_median,
        1.1, "the same login, no [fleet]")
    row("first login after the database went down", first, local_median * 1.1 + TIMEOUT, 1.0,
        f"1.1 x local + the {TIMEOUT:g} s timeout")


def _fleet_doc(node: str, gpus: int = 8, held: int = 4) -> dict:
    now = time.time()
    return {"node": node, "rack": f"r{hash(node) % 5}", "ssh": node, "version": "bench", "schema": 1,
            "incarnation": "bench", "heartbeat": HEARTBEAT, "lease": 30.0, "grace": 60.0, "taken_at": now,
            "half_life": 7 * 86400.0,
            "gpus": [{"minor": m, "uuid": f"GPU-{node}-{m}", "name": "NVIDIA H100 80GB HBM3", "memory_total": 80 << 30,
                      "owner": "gpuguard"} for m in range(gpus)],
            "grants": [{"minor": m, "username": f"user{m}", "uid": 2000 + m, "granted_at": now - 60, "expires_at": None,
                        "shared": False, "origin": "session"} for m in range(held)],
            "queue": [], "ledger": [], "usage_for": [], "users": [], "want_free": False}


def status_row(db: Postgres) -> None:
    with connect(db.conninfo, "bench") as conn:
        migrate(conn, "bench")
        conn.execute("DELETE FROM gpuguard.nodes")  # the login rows' node: only the 50 here
        writer = FleetDb(db.conninfo, "bench")
        for i in range(50):
            writer.call("heartbeat_v1", _fleet_doc(f"status{i:02d}"))
        writer.close()
        bare = "SELECT * FROM gpuguard.nodes n LEFT JOIN gpuguard.gpus g ON g.node = n.name"

        def ours() -> None:
            nodes = ranking.nodes(view(conn))
            assert sum(len(n.gpus) for n in nodes) == 400

        def baseline() -> None:
            assert len(conn.execute(bare).fetchall()) == 400

        times: dict[str, list[float]] = {"ours": [], "bare": []}
        for _ in range(30):  # in turns: drift on the shared machine hits both alike
            for kind, fn in (("ours", ours), ("bare", baseline)):
                start = time.perf_counter()
                fn()
                times[kind].append(time.perf_counter() - start)
        conn.execute("DELETE FROM gpuguard.nodes WHERE name LIKE 'status%'")
    row("status --fleet, 50 nodes x 8 GPUs (query + grouping)", statistics.median(times["ours"]),
        statistics.median(times["bare"]), 3, "bare SELECT of the same 400 rows")


def _postgres_cpu(db: Postgres) -> float:
    """CPU seconds of every live process of this PostgreSQL so far (postmaster and its children), from
    the scheduler's own count (/proc/PID/schedstat, nanoseconds): utime in /proc/PID/stat is sampled at
    clock ticks and misses a backend's short bursts."""
    pid = int((db.data / "postmaster.pid").read_text().split()[0])
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    total = 0
    for p in [pid, *map(int, children)]:
        try:
            total += int(Path(f"/proc/{p}/schedstat").read_text().split()[0])
        except FileNotFoundError:  # a backend that just ended
            continue
    return total / 1e9


def _commits(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetchone()[0]


def _snapshot(bench: Bench) -> dict:
    """The heartbeat document a real node's code makes: FleetNode.snapshot of a real store with 8 GPUs, 4 held."""
    home = bench.base / "heartbeat-node"
    store = Store(home / "state.db")
    gpus = {m: Gpu(m, m, f"GPU-bench-{m}", "NVIDIA H100 80GB HBM3", f"0000:{m:02x}:00.0", 80 << 30, 0, 0, 0)
            for m in range(8)}

    class NoNodes:  # no device nodes here: the snapshot reads the store and the inventory only
        def sync(self, device: Device, users) -> list[str]:
            return []

    grants = Grants(store, None, NoNodes(), set(gpus), gpus=gpus)
    for m in range(4):
        store.add_grants(2000 + m, f"user{m}", [m], time.time() - 60, None, origin=Origin.SESSION)
    settings = configuration.FleetConfig(database="", node="template", heartbeat=HEARTBEAT)
    cluster = FleetNode(settings, lambda: 7 * 86400.0, store, lambda: grants.gpus, (), Outbox(home / "cluster.db"),
                      FleetDb("", "template"), Identity("bench", "", "bench"))
    doc = cluster.snapshot(time.time())
    cluster.close()
    store.close()
    return doc


def _load(db: Postgres, pool: concurrent.futures.Executor, rate: float,
          send: Callable[[int], float]) -> tuple[int, float, float, list[float]]:
    """send(i) at `rate` a second for LOAD_SECONDS on the pool: (sent, seconds, the database's CPU
    seconds meanwhile, each call's latency)."""
    cpu, started = _postgres_cpu(db), time.monotonic()
    sent, pending = 0, []
    while (elapsed := time.monotonic() - started) < LOAD_SECONDS:
        due = int(elapsed * rate) + 1
        while sent < due:
            pending.append(pool.submit(send, sent))
            sent += 1
        time.sleep(0.002)
    latencies = [f.result() for f in pending]
    seconds = time.monotonic() - started
    return sent, seconds, _postgres_cpu(db) - cpu, latencies  # the senders' backends still live: counted


def heartbeat_rows(bench: Bench, db: Postgres) -> None:
    template = _snapshot(bench)
    per_beat: dict[int, float] = {}
    load: dict[int, float] = {}
    lines = ["| nodes | heartbeats/s wanted | sent | p99 latency | database CPU | transactions/s |",
             "|---:|---:|---:|---:|---:|---:|"]
    local = threading.local()  # each sending thread's own connection, as each node has its own
    # What each simulated node's FleetDb keeps of what it last sent whole (fleetdb.py: a node sends
    # its digest alone while its truth is unchanged), kept per node whichever thread sends for it.
    sent_whole: dict[str, tuple[str, float]] = {}

    def connection() -> FleetDb:
        if not hasattr(local, "db"):
            local.db = FleetDb(db.conninfo, "bench")
            local.db._connection()
            local.db._sent = sent_whole  # the bench's nodes share 8 connections
        return local.db

    with connect(db.conninfo, "bench") as stats, concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        for nodes in FLEETS:
            rate = nodes / HEARTBEAT

            def beat(i: int, nodes: int = nodes) -> float:
                node, turn = i % nodes, i // nodes
                # each node's users differ: 4 of a lab population of USERS, as many grants each as chance gives;
                # one heartbeat in CHANGED carries a change (a grant made or ended since the last), each
                # node's at another turn
                version = (turn + node % CHANGED) // CHANGED
                held = [{**g, "username": f"user{(node * 4 + n) % USERS}", "granted_at": g["granted_at"] + version}
                        for n, g in enumerate(template["grants"])]
                doc = {**template, "node": f"hb{nodes}-{node:04d}", "ssh": f"hb{node}", "taken_at": time.time(),
                       # as under offline_policy = "budget", the dearer: every local user's grants elsewhere asked
                       "grants": held, "budget_users": sorted(g["username"] for g in held)}
                start = time.perf_counter()
                connection().heartbeat(doc)
                return time.perf_counter() - start

            for i in range(nodes):  # every node registered once, as at the fleet's start
                beat(i)
            commits = _commits(stats)
            sent, seconds, used, latencies = _load(db, pool, rate, lambda i, nodes=nodes: beat(i + nodes, nodes))
            per_beat[nodes], load[nodes] = used / sent, used / seconds
            lines.append(f"| {nodes} | {rate:.0f} | {sent / seconds:.0f} | {p99(latencies) * 1000:.1f} ms | "
                         f"{used / seconds * 100:.1f}% of a core | {(_commits(stats) - commits) / seconds:.0f} |")

        def select_1(i: int) -> float:
            start = time.perf_counter()
            connection()._execute("SELECT 1", ()).fetchone()
            return time.perf_counter() - start

        def seen(i: int) -> float:  # what any heartbeat must write: the node's row, seen now
            start = time.perf_counter()
            connection()._execute("UPDATE gpuguard.nodes SET last_seen = extract(epoch FROM clock_timestamp())"
                                  " WHERE name = %s", (f"hb{FLEETS[-1]}-{i % FLEETS[-1]:04d}",))
            return time.perf_counter() - start

        rate = FLEETS[-1] / HEARTBEAT
        per_call = {}
        for name, send in (("SELECT 1", select_1), ("one-row UPDATE", seen)):
            sent, seconds, used, latencies = _load(db, pool, rate, send)
            per_call[name] = used / sent
            lines.append(f"| {name} | {rate:.0f} | {sent / seconds:.0f} | {p99(latencies) * 1000:.1f} ms | "
                         f"{used / seconds * 100:.1f}% of a core | |")
    print("\n".join(["bench: heartbeat load (one PostgreSQL, heartbeat every 10 s)", *lines]), flush=True)
    row(f"database CPU per heartbeat, {FLEETS[-1]} nodes", per_beat[FLEETS[-1]], per_call["SELECT 1"], 3,
        f"a SELECT 1 at the same rate, {rate:.0f}/s")
    # the floor: a heartbeat records that its node was seen, one row written (several-servers.md)
    row(f"database CPU per heartbeat, {FLEETS[-1]} nodes, vs the row it must write", per_beat[FLEETS[-1]],
        per_call["one-row UPDATE"], 2, f"an UPDATE of one node's last_seen at the same rate, {rate:.0f}/s")
    # 50 nodes send few heartbeats in LOAD_SECONDS: 500 is the steadier baseline
    row(f"database CPU per heartbeat, {FLEETS[-1]} vs {FLEETS[1]} nodes", per_beat[FLEETS[-1]], per_beat[FLEETS[1]],
        2, f"the same at {FLEETS[1]} nodes")
    row(f"database CPU of {FLEETS[-1]} nodes' heartbeats, per second", load[FLEETS[-1]], 1.0, 0.25,
        "one core: 1 s of CPU a second")
