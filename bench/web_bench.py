"""The web view's grid for a fleet of 50 servers x 8 GPUs, against a static file of the same size
served by the same aiohttp server in the same run.

The fleet is 50 status replies as a daemon gives them (every GPU held, half with a process, some
over quota, some idle), from an in-memory source: the row times the web's own work (the views,
the HTML, aiohttp), not the daemons'. The server runs in a child process; the client here sends
sequential keep-alive GETs of the grid fragment's page, then of the static file, and the row is
the ratio of the medians.
"""
from __future__ import annotations

import http.client
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

from rows import row

SERVERS, GPUS = 50, 8
REQUESTS = 200
PAGE_BUDGET = 200 * 1024  # bytes: the page a browser loads
GiB = 1 << 30


def fleet(now: float) -> list:
    from gpuguard.web.sources import ServerStatus

    servers = []
    for s in range(SERVERS):
        gpus = []
        for minor in range(GPUS):
            uid = 2000 + (s * GPUS + minor) % 60
            busy = minor % 2 == 0
            processes = [{"pid": 10_000 + minor, "uid": uid, "user": f"user{uid}", "memory": (minor + 1) * 3 * GiB,
                          "command": "python"}] if busy else []
            gpus.append({"minor": minor, "label": str(minor), "profile": None, "index": minor,
                         "uuid": f"GPU-{s:04d}{minor:04d}-0000-4000-8000-000000000000", "name": "NVIDIA H100 80GB HBM3",
                         "memory_total": 80 * GiB, "memory_used": sum(p["memory"] for p in processes),
                         "utilization": 90 if busy else 0, "process_list": processes, "processes": len(processes),
                         "holders": [{"user": f"user{uid}", "uid": uid, "shared": False, "origin": "session",
                                      "granted_at": now - 7200, "expires_at": now + 3600 * minor or None,
                                      "last_active": now - (0 if busy else 3600), "gpu_memory": 20 * GiB,
                                      "memory_used": sum(p["memory"] for p in processes)}]})
        servers.append(ServerStatus(f"gpu{s:02d}", {"ok": True, "gpus": gpus, "queue": []}))
    return servers


class FakeFleetSource:
    def __init__(self, servers: list) -> None:
        self._servers = servers

    async def servers(self) -> list:
        return self._servers

    async def whoami(self, user: str) -> dict:
        return {}

    async def report(self, by: str, since: float, until: float, user: str | None) -> dict:
        return {}


def _serve(static_dir: str, port_out, memo_age: float) -> None:
    import asyncio
    import socket

    from aiohttp import web

    from gpuguard.config import WebConfig
    from gpuguard.web.app import Web, build
    from gpuguard.web.sessions import Signer
    from gpuguard.web.sources import Memo

    state = Web(WebConfig(secure_cookies=False), FakeFleetSource(fleet(time.time())), Signer(b"b" * 32),
                lambda user, password, client: False, lambda user: (), memo=Memo(memo_age))
    app = build(state)
    app.router.add_static("/bench", static_dir)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port_out.send(sock.getsockname()[1])

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        await asyncio.Event().wait()
    asyncio.run(main())


def _get(connection: http.client.HTTPConnection, path: str) -> tuple[float, bytes]:
    start = time.perf_counter()
    connection.request("GET", path)
    reply = connection.getresponse()
    body = reply.read()
    elapsed = time.perf_counter() - start
    assert reply.status == 200, (path, reply.status)
    return elapsed, body


def web_rows() -> None:
    """The row, as served (rendered once per memo window); and, for docs/admin.md (Web view), what a render for
    every request would cost (printed, not a row: the page is never served that way)."""
    from gpuguard.web.app import MEMO_AGE

    ours, static, size = _timed(MEMO_AGE)
    checks = [] if size <= PAGE_BUDGET else [f"page {size // 1024} KiB > {PAGE_BUDGET // 1024} KiB"]
    row(f"web grid, {SERVERS} servers x {GPUS} GPUs ({size // 1024} KiB page)", ours, static, 5,
        "the same bytes as a static file, same server", failed_checks=checks)
    cold, static, _ = _timed(0.0)
    print(f"bench: (not a row) the grid rendered for every request: {cold * 1000:.2f} ms, "
          f"{cold / static:.3g} x the static file ({static * 1000:.3f} ms)", flush=True)


def _timed(memo_age: float) -> tuple[float, float, int]:
    """Median seconds per GET of the grid page and of a static file of its size, and the size."""
    with tempfile.TemporaryDirectory(prefix="ggt-bench-web-") as static_dir:
        receive, send = multiprocessing.Pipe(duplex=False)
        server = multiprocessing.Process(target=_serve, args=(static_dir, send, memo_age), daemon=True)
        server.start()
        try:
            port = receive.recv()
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            for _ in range(50):  # until it answers
                try:
                    _, page = _get(connection, "/")
                    break
                except (ConnectionRefusedError, http.client.RemoteDisconnected):
                    time.sleep(0.1)
                    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            Path(static_dir, "same-size.html").write_bytes(page)
            ours = statistics.median(_get(connection, "/")[0] for _ in range(REQUESTS))
            static = statistics.median(_get(connection, "/bench/same-size.html")[0] for _ in range(REQUESTS))
        finally:
            server.kill()
            server.join()
    return ours, static, len(page)


if __name__ == "__main__":
    web_rows()
