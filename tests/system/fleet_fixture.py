"""The fleet's database with its roles, as `gpuguard fleet init` makes them: a fixture for the
tests that log in as a node's, the admin's or the web's role (`fleet`). The owner role and its
database come as the docs make them; TCP logins need their passwords (SCRAM), as on a lab's server."""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
from sim_helpers import cli

from gpuguard.fleet import roles

if TYPE_CHECKING:
    from conftest import TestUser


@dataclass
class Fleet:
    superuser: str  # the instance's superuser, over its Unix socket (trust)
    owner: str      # the schema's owner, over the Unix socket (trust)
    tcp: str        # the database over TCP, where every role needs its password
    credentials: Path
    config: Path
    web: TestUser

    def init(self, *args: str) -> object:
        return cli(self.config, "fleet", "init", "--database", self.owner, "--credentials", str(self.credentials),
                   "--web-account", self.web.name, *args)

    def as_role(self, role: str) -> str:
        return roles.conninfo_as(self.tcp, role, roles.passfile(self.credentials, role))


@pytest.fixture
def fleet(postgres, make_user) -> Iterator[Fleet]:
    with psycopg.connect(postgres.conninfo, autocommit=True) as conn:
        conn.execute("CREATE ROLE gpuguard LOGIN CREATEROLE")  # the owner, as the docs make it
        conn.execute("CREATE DATABASE gpuguard OWNER gpuguard")
    hba = postgres.data / "pg_hba.conf"
    hba.write_text("host all all 127.0.0.1/32 scram-sha-256\n" + hba.read_text())  # first match: passwords on TCP
    with psycopg.connect(postgres.conninfo, autocommit=True) as conn:
        conn.execute("SELECT pg_reload_conf()")
    credentials = Path(tempfile.mkdtemp(prefix="ggt-"))
    credentials.chmod(0o755)  # as /etc/gpuguard: the web's account reaches its file, and only that one
    config = credentials / "gpuguard.toml"
    config.write_text("")
    (credentials / "quotas.toml").write_text("")
    try:
        yield Fleet(postgres.conninfo, f"host={postgres.root} port={postgres.port} user=gpuguard dbname=gpuguard",
                    f"host=127.0.0.1 port={postgres.port} dbname=gpuguard", credentials, config, make_user())
    finally:
        shutil.rmtree(credentials, ignore_errors=True)
