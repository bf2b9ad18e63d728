"""A private PostgreSQL for the tests and the bench: Debian's `postgresql` binaries, initdb and
pg_ctl in a temporary directory, listening on a Unix socket there and on a loopback port, run
as the `postgres` system user (initdb refuses root), removed afterwards. A standby is made with
pg_basebackup (-R: it streams from this one) and can be promoted.

    with Postgres.started() as db:                 # a fresh instance
        psycopg.connect(db.conninfo)
        standby = db.standby()                      # streaming replica, started
        db.kill(); standby.promote()
"""
from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpuguard.backends import procfs

BIN = Path("/usr/lib/postgresql/15/bin")
OWNER = "postgres"  # Debian's package makes this system user


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _as_owner() -> dict:
    """subprocess.run arguments running a command as the postgres user (when we are root)."""
    if os.geteuid() != 0:
        return {"cwd": "/"}
    entry = pwd.getpwnam(OWNER)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": [], "cwd": "/"}


def _chown(path: Path) -> None:
    if os.geteuid() == 0:
        entry = pwd.getpwnam(OWNER)
        os.chown(path, entry.pw_uid, entry.pw_gid)


class Postgres:
    def __init__(self, root: Path, port: int | None = None):
        self.root = root
        self.data = root / "data"
        self.port = port or free_port()
        self.log = root / "server.log"
        self.instances: list[Postgres] = []

    @classmethod
    @contextmanager
    def started(cls, prefix: str = "ggt-") -> Iterator[Postgres]:
        """A fresh instance in /tmp/<prefix><6 hex digits> (the tests' sandbox names: an aborted run's
        is stopped and removed by the next run's sweep, tests/system/leftovers.py)."""
        root = Path(tempfile.gettempdir()) / f"{prefix}{secrets.token_hex(3)}"
        root.mkdir(mode=0o755)
        db = cls(root / "primary")
        db.instances = [db]  # and its standbys: all stopped at the end
        try:
            db.initdb()
            db.start()
            yield db
        finally:
            for instance in db.instances:
                instance.stop("immediate")
            shutil.rmtree(root, ignore_errors=True)

    def _run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        result = subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout,
                                **_as_owner())
        if result.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({result.returncode}): {result.stderr or result.stdout}\n"
                               f"{self.log.read_text() if self.log.exists() else ''}")
        return result

    def initdb(self) -> None:
        self.root.mkdir(parents=True, mode=0o700)
        _chown(self.root)
        _chown(self.root.parent)
        self._run("initdb", "-D", str(self.data), "--auth=trust", "-U", OWNER, "--no-sync", "-E", "UTF8",
                  "--locale=C")
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(f"listen_addresses = '127.0.0.1'\nport = {self.port}\n"
                       f"unix_socket_directories = '{self.root}'\nfsync = off\nmax_connections = 300\n"
                       "wal_level = replica\nmax_wal_senders = 4\nhot_standby = on\n")
        with open(self.data / "pg_hba.conf", "a") as hba:
            hba.write("local replication all trust\nhost replication all 127.0.0.1/32 trust\n")

    @property
    def conninfo(self) -> str:
        """Over the Unix socket, as the superuser (trust)."""
        return f"host={self.root} port={self.port} user={OWNER} dbname=postgres"

    def tcp_conninfo(self, port: int | None = None) -> str:
        """Over TCP on loopback (port: another one, e.g. a proxy's, in front of this instance)."""
        return f"host=127.0.0.1 port={port or self.port} user={OWNER} dbname=postgres"

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        if (self.data / "postmaster.pid").exists():
            subprocess.run([str(BIN / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"],
                           capture_output=True, timeout=60, **_as_owner())

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend (a crash: no shutdown checkpoint). The postmaster
        is stopped first: one that forks a backend for a new connection after its children were
        listed would leave that backend running, holding the shared memory, so that the next start
        refuses ("pre-existing shared memory block is still in use")."""
        pid = int((self.data / "postmaster.pid").read_text().split()[0])
        postmaster = procfs.inspect(pid)
        if postmaster is None or postmaster.comm != "postgres":
            return  # gone already (the pid file is left from a crash): nothing to kill
        children: list[int] = []
        try:
            os.kill(pid, signal.SIGSTOP)  # no fork once it is stopped; SIGKILL still ends it
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (info := procfs.inspect(pid)) and info.state not in ("T", "Z"):
                time.sleep(0.01)  # a signal lands, not at once
            listed = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
            children = list(map(int, listed.stdout.split()))
        finally:  # whatever failed, the postmaster is not left stopped
            for target in [pid, *children]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(target, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in [pid, *children]):
            time.sleep(0.05)

    def standby(self) -> Postgres:
        """A streaming standby of this instance (pg_basebackup -R), started."""
        replica = Postgres(self.root.parent / f"standby-{free_port()}")
        replica.root.mkdir(mode=0o700)
        _chown(replica.root)
        self._run("pg_basebackup", "-D", str(replica.data), "-R", "-X", "stream", "-c", "fast", "-h", str(self.root),
                  "-p", str(self.port), "-U", OWNER)
        with open(replica.data / "postgresql.conf", "a") as conf:
            conf.write(f"port = {replica.port}\nunix_socket_directories = '{replica.root}'\n")
        replica.start()
        self.instances.append(replica)
        return replica

    def promote(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-w", "promote")


def stop_all_under(directory: Path) -> list[Path]:
    """Stop (immediate) every instance whose data directory is below `directory`; returns them."""
    stopped = []
    for pid_file in directory.glob("*/data/postmaster.pid"):
        subprocess.run([str(BIN / "pg_ctl"), "-D", str(pid_file.parent), "-m", "immediate", "-w", "stop"],
                       capture_output=True, timeout=60, **_as_owner())
        stopped.append(pid_file.parent)
    return stopped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
