"""A private highly available PostgreSQL for the tests, as a lab would run one: Patroni (Debian's
package) managing two PostgreSQL 15 instances on loopback ports, with a one-member etcd (Debian's
etcd-server) as its store, all in a temporary directory. Patroni promotes a replica when the leader
is lost, and brings an old leader back as a replica with pg_rewind.

    with PatroniCluster.started() as cluster:      # leader and replica, streaming
        psycopg.connect(cluster.conninfo)          # both hosts, target_session_attrs=read-write
        cluster.switchover()                       # planned: the replica becomes the leader
        cluster.kill(cluster.leader())             # a crash: Patroni fails over after its ttl
        cluster.start(name)                        # the old leader rejoins, rewound, as a replica

Patroni and PostgreSQL run as the `postgres` system user; etcd as root. Every process has the
cluster's directory on its command line, so stop_all_under finds an aborted run's.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from devtools.postgres import BIN, OWNER, _as_owner, _chown, free_port

TTL = 20        # seconds the leader key lives without renewal: Patroni's minimum; a crash fails over after it
LOOP_WAIT = 1   # seconds between Patroni's checks
LEADER = ("master", "primary", "leader")  # the role names Patroni's REST API has used for the leader


@dataclass
class Member:
    name: str
    api_port: int
    pg_port: int
    config: Path
    log: Path
    process: subprocess.Popen | None = None

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"


class PatroniCluster:
    def __init__(self, root: Path, names: tuple[str, ...] = ("pg1", "pg2")):
        self.root = root
        self.scope = root.name
        self.etcd_port, self.etcd_peer = free_port(), free_port()
        self.etcd: subprocess.Popen | None = None
        self.members = {name: Member(name, free_port(), free_port(), root / f"{name}.yml", root / f"{name}.log")
                        for name in names}

    @classmethod
    @contextmanager
    def started(cls, prefix: str = "ggt-") -> Iterator[PatroniCluster]:
        """A cluster in /tmp/<prefix><6 hex digits> (swept by tests/system/leftovers.py if left)."""
        root = Path(tempfile.gettempdir()) / f"{prefix}{secrets.token_hex(3)}"
        root.mkdir(mode=0o755)
        _chown(root)
        cluster = cls(root)
        try:
            cluster._start_etcd()
            for name in cluster.members:
                cluster._write_config(cluster.members[name])
                cluster.start(name)
                cluster.wait_for(lambda n=name: cluster.role(n) is not None and cluster.role(n) != "uninitialized")
            assert cluster.wait_for(lambda: cluster.leader() is not None and len(cluster.replicas()) == 1, 120), \
                cluster.logs()
            yield cluster
        finally:
            stop_all_under(root)
            shutil.rmtree(root, ignore_errors=True)

    # --- the processes

    def _start_etcd(self) -> None:
        peer = f"http://127.0.0.1:{self.etcd_peer}"
        self.etcd = subprocess.Popen(
            ["etcd", "--name", self.scope, "--data-dir", str(self.root / "etcd"),
             "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
             "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"{self.scope}={peer}"],
            stdout=open(self.root / "etcd.log", "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def _write_config(self, member: Member) -> None:
        # JSON is YAML: no YAML writer needed. Trust on loopback and the socket: a test cluster.
        hba = ["local all all trust", "host all all 127.0.0.1/32 trust", "local replication all trust",
               "host replication all 127.0.0.1/32 trust"]
        user = {"username": OWNER}
        config = {
            "scope": self.scope, "name": member.name,
            "restapi": {"listen": f"127.0.0.1:{member.api_port}", "connect_address": f"127.0.0.1:{member.api_port}"},
            "etcd3": {"hosts": f"127.0.0.1:{self.etcd_port}"},
            "bootstrap": {
                # check_timeline: a replica still on the timeline before a switchover is never
                # promoted (it would start a second, different timeline of the same number, which
                # pg_rewind cannot tell apart: Patroni issue 1251), as the several-servers doc advises
                "dcs": {"ttl": TTL, "loop_wait": LOOP_WAIT, "retry_timeout": 5, "check_timeline": True,
                        "postgresql": {"use_pg_rewind": True, "parameters": {"wal_log_hints": "on"}}},
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}], "pg_hba": hba},
            "postgresql": {
                "listen": f"127.0.0.1:{member.pg_port}", "connect_address": f"127.0.0.1:{member.pg_port}",
                "data_dir": str(self.root / member.name), "bin_dir": str(BIN),
                "pgpass": str(self.root / f"pgpass-{member.name}"),
                "authentication": {"replication": user, "superuser": user, "rewind": user},
                "parameters": {"unix_socket_directories": str(self.root), "max_connections": 300, "fsync": "off"},
                "pg_hba": hba},
        }
        member.config.write_text(json.dumps(config, indent=1))
        _chown(member.config)

    def start(self, name: str) -> None:
        member = self.members[name]
        member.process = subprocess.Popen(["patroni", str(member.config)], stdout=open(member.log, "a"),
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **_as_owner())

    def kill(self, name: str) -> None:
        """A crash of a member's host: Patroni and its PostgreSQL SIGKILLed, nothing shut down."""
        member = self.members[name]
        for pid in _pids_with(str(self.root / name)) + ([member.process.pid] if member.process else []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if member.process is not None:
            member.process.wait(30)

    def switchover(self) -> str:
        """A planned switchover through Patroni's REST API; returns the new leader's name."""
        leader = self.leader()
        assert leader is not None
        (candidate,) = self.replicas()
        body = json.dumps({"leader": leader, "candidate": candidate}).encode()
        request = urllib.request.Request(f"{self.members[leader].api}/switchover", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert answer.status == 200, answer.read()
        assert self.wait_for(lambda: self.leader() == candidate, 60), self.logs()
        return candidate

    # --- what it says

    def role(self, name: str) -> str | None:
        """The member's role as its REST API says (None: not answering)."""
        try:
            with urllib.request.urlopen(f"{self.members[name].api}/patroni", timeout=2) as answer:
                return str(json.load(answer).get("role"))
        except (OSError, ValueError, urllib.error.URLError):
            return None

    def following(self, name: str) -> bool:
        """The member is a replica streaming on the leader's timeline (a candidate for a failover)."""
        leader = self.leader()
        if leader is None or self.role(name) != "replica":
            return False
        mine, theirs = self.state(name), self.state(leader)
        return mine.get("state") in ("running", "streaming") and mine.get("timeline") == theirs.get("timeline")

    def leader(self) -> str | None:
        return next((name for name in self.members if self.role(name) in LEADER), None)

    def replicas(self) -> list[str]:
        return [name for name in self.members if self.role(name) == "replica"]

    def state(self, name: str) -> dict:
        with urllib.request.urlopen(f"{self.members[name].api}/patroni", timeout=2) as answer:
            return dict(json.load(answer))

    @property
    def conninfo(self) -> str:
        """Both members, the leader found by libpq (target_session_attrs=read-write), as the docs advise."""
        ports = ",".join(str(m.pg_port) for m in self.members.values())
        hosts = ",".join("127.0.0.1" for _ in self.members)
        return f"host={hosts} port={ports} user={OWNER} dbname=postgres target_session_attrs=read-write"

    def member_conninfo(self, name: str) -> str:
        return f"host=127.0.0.1 port={self.members[name].pg_port} user={OWNER} dbname=postgres"

    def logs(self) -> str:
        return "\n".join(f"--- {path.name} ---\n{path.read_text(errors='replace')[-4000:]}"
                         for path in sorted(self.root.glob("*.log")))

    @staticmethod
    def wait_for(predicate, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.2)
        return bool(predicate())


def _pids_with(text: str) -> list[int]:
    """The processes whose command line holds `text` (a cluster's directory)."""
    found = subprocess.run(["pgrep", "-f", text], capture_output=True, text=True, check=False)
    return [int(pid) for pid in found.stdout.split() if int(pid) != os.getpid()]


def stop_all_under(directory: Path) -> list[int]:
    """SIGKILL every Patroni, PostgreSQL and etcd process of the clusters under `directory` (an
    aborted run's): Patroni first, which would start its PostgreSQL again. Returns the pids."""
    killed = []
    for pattern in (f"patroni {directory}", str(directory)):
        for pid in _pids_with(pattern):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        if killed:
            time.sleep(0.2)  # let the PostgreSQL of a killed Patroni see it gone before its turn
    return killed
