"""The web view on the fleet database: a real PostgreSQL (Debian's, private: the `postgres`
fixture, tests/system/pg_fixture.py) with the fleet's schema (gpuguard.fleet's migrations), rows
as the nodes' heartbeats leave them, read through FleetSource and served by the app."""
from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gpuguard.config import WebConfig
from gpuguard.fleet import fleetdb
from gpuguard.web.app import Web, build
from gpuguard.web.fleet import FleetSource
from gpuguard.web.sessions import Signer

GiB = 1 << 30


def fill(conn, now: float) -> None:
    """Two nodes as their heartbeats left them (gpu2 silent for an hour), a queue, the ledger."""
    for name, seen in (("gpu1", now), ("gpu2", now - 3600)):
        conn.execute("INSERT INTO gpuguard.nodes (name, heartbeat, lease, grace, first_seen, last_seen)"
                     " VALUES (%s, 10, 30, 60, %s, %s)", (name, seen - 86400, seen))
        for minor in range(2):
            conn.execute("INSERT INTO gpuguard.gpus (node, minor, uuid, name, memory_total, owner)"
                         " VALUES (%s, %s, %s, 'NVIDIA H100', %s, %s)",
                         (name, minor, f"GPU-{name}-{minor}", 80 * GiB, "slurm" if (name, minor) == ("gpu2", 1)
                          else "gpuguard"))
    conn.execute("INSERT INTO gpuguard.grants (node, minor, username, uid, granted_at, expires_at, origin)"
                 " VALUES ('gpu1', 0, '<b>alice</b>', 1001, %s, %s, 'session')", (now - 1800, now + 3600))
    conn.execute("INSERT INTO gpuguard.queue (node, ticket, username, gpus, since, priority)"
                 " VALUES ('gpu1', 1, 'bob', 2, %s, 0)", (now - 60,))
    conn.execute("INSERT INTO gpuguard.ledger (node, incarnation, seq, username, minor, started, ended)"
                 " VALUES ('gpu2', 'x', 1, 'bob', 0, %s, %s)", (now - 7200, now - 3600))


def test_the_fleet_from_the_cluster_database(postgres):
    with fleetdb.connect(postgres.conninfo, "ggt-web") as conn:
        fleetdb.migrate(conn, "ggt-web")
        now = time.time()
        fill(conn, now)
    source = FleetSource(postgres.conninfo)

    servers = {s.name: s for s in asyncio.run(source.servers())}
    assert sorted(servers) == ["gpu1", "gpu2"]
    holders = [[h["user"] for h in g["holders"]] for g in servers["gpu1"].status["gpus"]]
    assert holders == [["<b>alice</b>"], []]
    assert servers["gpu1"].status["queue"][0]["user"] == "bob"
    assert servers["gpu2"].error.startswith("lost")
    mine = asyncio.run(source.whoami("<b>alice</b>"))
    assert [g["uuid"] for g in mine["gpu1"]["grants"]] == ["GPU-gpu1-0"]
    report = asyncio.run(source.report("user", now - 86400, now, None))
    assert report["gpu2"]["rows"] == [{"key": "bob", "granted_seconds": 3600.0, "busy_seconds": None,
                                       "idle_seconds": None, "kills": {}}]
    assert report["gpu1"]["rows"][0]["granted_seconds"] == pytest.approx(1800, abs=60)  # still held

    async def page() -> str:
        state = Web(WebConfig(secure_cookies=False), source, Signer(b"k" * 32), lambda u, p, c: False, lambda u: ())
        async with TestClient(TestServer(build(state))) as client:
            return await (await client.get("/")).text()
    html = asyncio.run(page())
    assert 'data-server="gpu1"' in html and 'data-server="gpu2"' in html
    assert "&lt;b&gt;alice&lt;/b&gt;" in html and "<b>alice" not in html
    assert 'data-state="other"' in html and "lost: last heard from" in html

    postgres.stop("immediate")
    with pytest.raises(Exception, match="fleet database"):  # the database gone: one line, no traceback
        asyncio.run(source.whoami("alice"))
    assert asyncio.run(source.servers())[0].error.startswith("fleet database:")
