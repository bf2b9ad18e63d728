"""`postgres`: a private PostgreSQL instance per test (devtools/postgres.py), removed afterwards.

Import the fixture into a test module (`from pg_fixture import postgres`); the instance runs as the
`postgres` system user from Debian's package, on a Unix socket in a temporary directory and a
free loopback port. No mocked database anywhere.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from devtools.postgres import BIN, Postgres


@pytest.fixture
def postgres() -> Iterator[Postgres]:
    if not (BIN / "initdb").exists():
        pytest.fail(f"{BIN}/initdb missing: apt-get install postgresql (make deps does)")
    with Postgres.started() as db:
        yield db
