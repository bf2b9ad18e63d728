"""The web view's rows: each against a baseline of the same run.

- The grid for a fleet of 50 servers x 8 GPUs, against a static file of the same size served by
  the same aiohttp server. The fleet is 50 status replies as a daemon gives them (every GPU held,
  half with a process, some over quota, some idle), from an in-memory source: the row times the
  web's own work (the views, the HTML, aiohttp), not the daemons'. The server runs in a child
  process; the client here sends sequential keep-alive GETs of the page, then of the static file,
  and the row is the ratio of the medians.
- Every page at 64 GPUs and 100 users (Now, Queue with 36 waiting, Me, Usage of 30 days, History
  of a day), signed in as an admin (who sees the most), from an in-memory lab in the same way,
  each against a static file of its own bytes.
- The daemon's CPU while an admin keeps the Queue page open with 36 waiting: a real daemon on 8
  simulated GPUs, 8 users holding them and 36 waiting, the web app in a child process as the web's
  own account over the daemon's socket, and a client asking the page's live fragment every 2 s as
  the page's script does; the daemon's CPU time over the window, less its CPU over a window of the
  same length with the page closed, as a share of the window's wall time.
"""
from __future__ import annotations

import http.client
import math
import multiprocessing
import os
import re
import statistics
import subprocess
import tempfile
import time
import urllib.parse
from contextlib import ExitStack
from pathlib import Path

from rows import row

SERVERS, GPUS = 50, 8
REQUESTS = 200
PAGE_BUDGET = 200 * 1024  # bytes: the page a browser loads
GiB = 1 << 30
LAB_GPUS, LAB_USERS, LAB_WAITING = 64, 100, 36
LAB_PAGES = {"Now": "/", "Queue": "/queue", "Me": "/me", "Usage": "/usage", "History": "/history?span=day"}
ADMIN_GROUP = "ggt-bench-admins"
REFRESH = 2.0    # seconds between the open page's fragment requests (assets.SCRIPT's REFRESH)
CPU_WINDOW = 20.0  # seconds of daemon CPU per measurement


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

    async def fairshare(self) -> dict:
        return {}

    async def use_history(self, span: str) -> dict:
        return {}


class Lab:
    """One server of LAB_GPUS GPUs and LAB_USERS users, as its daemon answers: every GPU held by
    a user of its own, half of them with a process, the other LAB_WAITING users in the queue, 30
    days of usage, a day of utilisation and memory for every GPU and user."""

    NAME = "gpu01"

    def __init__(self, now: float) -> None:
        self.now = now
        self.users = [f"user{n:03d}" for n in range(LAB_USERS)]

    def _status(self) -> dict:
        now, gpus = self.now, []
        for minor in range(LAB_GPUS):
            user, uid = self.users[minor], 2000 + minor
            busy = minor % 2 == 0
            processes = [{"pid": 10_000 + minor, "uid": uid, "user": user, "memory": (minor % 8 + 1) * 3 * GiB,
                          "command": "python train.py"}] if busy else []
            gpus.append({"minor": minor, "label": str(minor), "profile": None, "index": minor,
                         "uuid": f"GPU-{minor:08d}-0000-4000-8000-000000000000", "name": "NVIDIA H100 80GB HBM3",
                         "memory_total": 80 * GiB, "memory_used": sum(p["memory"] for p in processes),
                         "utilization": 90 if busy else 0, "process_list": processes, "processes": len(processes),
                         "holders": [{"user": user, "uid": uid, "shared": False, "origin": "session",
                                      "granted_at": now - 7200, "expires_at": now + 600 * (minor + 1),
                                      "last_active": now - (0 if busy else 3600), "gpu_memory": 20 * GiB,
                                      "memory_used": sum(p["memory"] for p in processes)}]})
        queue = [{"position": i + 1, "user": user, "gpus": 1, "since": now - 60 * (LAB_WAITING - i), "priority": 0,
                  "waited": 60.0 * (LAB_WAITING - i), "reason": "waits for a GPU"}
                 for i, user in enumerate(self.users[LAB_GPUS:LAB_GPUS + LAB_WAITING])]
        return {"ok": True, "gpus": gpus, "queue": queue, "sampled_at": now, "now": now, "group": "lab"}

    async def servers(self) -> list:
        from gpuguard.web.sources import ServerStatus
        return [ServerStatus(self.NAME, self._status())]

    async def whoami(self, user: str) -> dict:
        n = self.users.index(user) if user in self.users else 0
        now = self.now
        waiting = n >= LAB_GPUS
        position = n - LAB_GPUS + 1
        queue = {"position": position, "waiting": LAB_WAITING, "gpus": 1, "since": now - 60.0,
                 "ahead": [{"user": self.users[LAB_GPUS + i], "why": "less recent GPU usage (1.2 < 3.4 GPU-hours)"}
                           for i in reversed(range(position - 1))], "estimate": now + 600} if waiting else None
        grants = [] if waiting else [{"minor": n, "name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-{n:08d}",
                                      "granted_at": now - 7200, "expires_at": now + 3600, "origin": "session"}]
        return {self.NAME: {
            "user": user, "uid": 2000 + n, "member": True, "group": "lab", "exempt": False,
            "quota": {"gpus": 1, "gpu_memory": 20 * GiB, "max_time": 86400.0, "share": 1.0, "priority": 0},
            "grants": grants, "sessions": [{"opened_at": now - 3600, "service": "sshd", "tty": f"pts/{i}",
                                            "rhost": "10.0.0.7"} for i in range(3)],
            "events": [{"time": now - 60 * i, "kind": "warn", "rule": "memory", "minor": n,
                        "message": "over your GPU memory quota"} for i in range(20)],
            "queue": queue}}

    async def report(self, by: str, since: float, until: float, user: str | None) -> dict:
        import datetime
        if by == "user":
            keys: list = self.users if user is None else [user]
        elif by == "gpu":
            keys = list(range(LAB_GPUS))
        else:
            first = datetime.date.fromtimestamp(since)
            keys = [str(first + datetime.timedelta(days=d)) for d in range(int((until - since) // 86400))]
        rows = [{"key": key, "granted_seconds": 3600.0 * (i % 17 + 1), "busy_seconds": 1800.0 * (i % 13 + 1),
                 "idle_seconds": 600.0, "kills": {}} for i, key in enumerate(keys)]
        total = {"key": "total", **{k: sum(r[k] for r in rows) for k in ("granted_seconds", "busy_seconds",
                                                                           "idle_seconds")}, "kills": {}}
        return {self.NAME: {"rows": rows, "total": total}}

    async def fairshare(self) -> dict:
        users = [{"user": user, "uid": 2000 + n, "usage": 3600.0 * n, "share": 1.0, "priority": 0,
                  "normalized": 3600.0 * n} for n, user in enumerate(self.users)]
        return {self.NAME: {"ok": True, "users": users, "half_life": 86400.0, "now": self.now}}

    async def use_history(self, span: str) -> dict:
        from gpuguard.core.use_history import level_of
        level = level_of(span)
        points = level.length

        def entry(n: int) -> dict:
            util = [round(50 + 45 * math.sin((i + n) / 7), 1) for i in range(points)]
            memory = [int((20 + 10 * math.sin((i + 3 * n) / 11)) * GiB) for i in range(points)]
            return {"util": util, "util_peak": [min(100.0, u + 5) for u in util], "memory": memory,
                    "memory_peak": [m + GiB for m in memory]}
        return {self.NAME: {
            "ok": True, "span": span, "step": level.step, "start": level.start_of(self.now) - level.seconds + level.step,
            "ticks": [level.step // 2] * points,
            "gpus": [{"minor": m, "label": str(m), "name": "NVIDIA H100 80GB HBM3", "memory_total": 80 * GiB,
                      **entry(m)} for m in range(LAB_GPUS)],
            "users": [{"uid": 2000 + n, "user": user, **entry(n)} for n, user in enumerate(self.users)]}}


def _serve(static_dir: str, port_out, memo_age: float, lab: bool = False) -> None:
    import asyncio
    import socket

    from aiohttp import web

    from gpuguard.config import WebConfig
    from gpuguard.web.app import Web, build
    from gpuguard.web.sessions import Signer
    from gpuguard.web.sources import Memo

    source = Lab(time.time()) if lab else FakeFleetSource(fleet(time.time()))
    state = Web(WebConfig(secure_cookies=False, admin_group=ADMIN_GROUP), source, Signer(b"b" * 32),
                lambda user, password, client: lab, lambda user: (ADMIN_GROUP,), memo=Memo(memo_age))
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


def _get(connection: http.client.HTTPConnection, path: str, cookie: str = "") -> tuple[float, bytes]:
    start = time.perf_counter()
    connection.request("GET", path, headers={"Cookie": cookie} if cookie else {})
    reply = connection.getresponse()
    body = reply.read()
    elapsed = time.perf_counter() - start
    assert reply.status == 200, (path, reply.status)
    return elapsed, body


def log_in(connection: http.client.HTTPConnection, user: str) -> str:
    """The cookie of a login (the form's CSRF token and pre-login cookie, then the POST)."""
    connection.request("GET", "/login")
    form = connection.getresponse()
    text = form.read().decode()
    seed = form.getheader("Set-Cookie").split(";")[0]
    token = re.search(r'name=csrf value="([^"]+)"', text).group(1)
    connection.request("POST", "/login", body=urllib.parse.urlencode({"user": user, "password": "x", "csrf": token}),
                       headers={"Cookie": seed, "Content-Type": "application/x-www-form-urlencoded"})
    reply = connection.getresponse()
    reply.read()
    cookie = next(value.split(";")[0] for name, value in reply.getheaders()
                  if name.lower() == "set-cookie" and value.startswith("gpuguard="))
    assert reply.status == 303, reply.status
    return cookie


def web_rows(bench) -> None:
    grid_rows()
    page_rows()
    queue_cpu_row(bench)


def grid_rows() -> None:
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
    ((ours, static, size),) = _pages(memo_age, ["/"]).values()
    return ours, static, size


def _pages(memo_age: float, paths: list[str], lab: bool = False) -> dict[str, tuple[float, float, int]]:
    """path -> median seconds per GET of the page (signed in as an admin, for the lab) and of a
    static file of its bytes from the same server, and its size."""
    found = {}
    with tempfile.TemporaryDirectory(prefix="ggt-bench-web-") as static_dir:
        receive, send = multiprocessing.Pipe(duplex=False)
        server = multiprocessing.Process(target=_serve, args=(static_dir, send, memo_age, lab), daemon=True)
        server.start()
        try:
            port = receive.recv()
            connection = _connected(port)
            cookie = log_in(connection, "user000") if lab else ""
            for n, path in enumerate(paths):
                _, page = _get(connection, path, cookie)
                Path(static_dir, f"same-size-{n}.html").write_bytes(page)
                ours = statistics.median(_get(connection, path, cookie)[0] for _ in range(REQUESTS))
                static = statistics.median(_get(connection, f"/bench/same-size-{n}.html")[0] for _ in range(REQUESTS))
                found[path] = (ours, static, len(page))
        finally:
            server.kill()
            server.join()
    return found


def _connected(port: int) -> http.client.HTTPConnection:
    for _ in range(50):  # until it answers
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            _get(connection, "/static/style.css")
            return connection
        except (ConnectionRefusedError, http.client.RemoteDisconnected):
            time.sleep(0.1)
    raise SystemExit("bench: the web did not answer")


def page_rows() -> None:
    """Every page at 64 GPUs and 100 users, as served to an admin, against its bytes as a static file."""
    from gpuguard.web.app import MEMO_AGE

    timed = _pages(MEMO_AGE, list(LAB_PAGES.values()), lab=True)
    for name, path in LAB_PAGES.items():
        ours, static, size = timed[path]
        checks = [] if size <= PAGE_BUDGET else [f"page {size // 1024} KiB > {PAGE_BUDGET // 1024} KiB"]
        row(f"web {name} page, {LAB_GPUS} GPUs x {LAB_USERS} users, admin ({size // 1024} KiB)", ours, static,
            PAGE_TARGETS[name], "the same bytes as a static file, same server", failed_checks=checks)
    drawn = _history_render()
    print(f"bench: (not a row) the History page drawn for every request: {drawn * 1000:.2f} ms, "
          f"{drawn / timed[LAB_PAGES['History']][1]:.3g} x the static file", flush=True)


def _history_render() -> float:
    """Seconds to draw the lab's History page (the views and the HTML, no HTTP), median of 5."""
    import asyncio

    from rows import per_call

    from gpuguard.web import trends, views

    replies = asyncio.run(Lab(time.time()).use_history("day"))
    viewer = views.Viewer("user000", admin=True)

    def draw() -> str:
        gpus, users = views.trends(replies, viewer)
        return trends.history_page("day", gpus, users, "name", "util", True, known=True)
    return per_call(draw, 3)


# ours / the static file: the grid once a second for all, History once in 5 s for all who see the
# same; Queue, Me and Usage for each request (Usage: 100 users' and 64 GPUs' bars and tables)
PAGE_TARGETS = {"Now": 5, "Queue": 5, "Me": 5, "Usage": 10, "History": 5}


def _as_web_account(uid: int, gid: int, socket_path: str, port_out, admin: str) -> None:
    """The web app as the web's own account over the daemon's socket (gpuguard web's composition,
    less PAM: every password is right, `admin` is in the admin group)."""
    import asyncio
    import socket

    from aiohttp import web

    from gpuguard.config import WebConfig
    from gpuguard.web.app import Web, build
    from gpuguard.web.sessions import Signer
    from gpuguard.web.sources import LocalDaemon

    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    state = Web(WebConfig(secure_cookies=False, admin_group=ADMIN_GROUP), LocalDaemon(socket_path, "bench"),
                Signer(b"b" * 32), lambda user, password, client: True,
                lambda user: (ADMIN_GROUP,) if user == admin else ())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port_out.send(sock.getsockname()[1])

    async def main() -> None:
        runner = web.AppRunner(build(state), access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        await asyncio.Event().wait()
    asyncio.run(main())


def queue_cpu_row(bench) -> None:
    """The daemon's CPU while an admin's Queue page is open (its fragment every REFRESH s), 36 waiting."""
    import pwd

    from watcher_bench import cpu_seconds

    from gpuguard import client

    waiting = [bench._user(f"ggt-bq{i}-{bench.tag}", member=True) for i in range(LAB_WAITING + 8 - len(bench.members))]
    account = bench._user(f"ggt-bw-{bench.tag}", member=False)
    entry = pwd.getpwnam(account)
    config = bench.write_config("web", extra=f'[web]\nuser = "{account}"\n')
    sock = str(bench.base / "web" / "run" / "gpuguard.sock")
    with bench.daemon(config) as daemon, ExitStack() as stack:
        caller = subprocess.Popen(["sleep", "3600"])
        stack.callback(caller.kill)
        for user in [*bench.members, *waiting]:  # 8 hold the GPUs, the other 36 wait
            client.call(sock, "session_open", user=user, service="bench", rhost="", tty="", pid=caller.pid)
        queued = len(client.call(sock, "status")["queue"])
        receive, send = multiprocessing.Pipe(duplex=False)
        server = multiprocessing.Process(target=_as_web_account, args=(entry.pw_uid, entry.pw_gid, sock, send,
                                                                       bench.members[0]), daemon=True)
        server.start()
        stack.callback(server.join)
        stack.callback(server.kill)
        connection = _connected(receive.recv())
        cookie = log_in(connection, bench.members[0])
        _, page = _get(connection, "/queue", cookie)
        reasons = page.count(b"<td>behind ")
        time.sleep(REFRESH)
        start = cpu_seconds(daemon.pid)
        time.sleep(CPU_WINDOW)  # the page closed: the daemon's own ticks, the web's sweep
        closed = cpu_seconds(daemon.pid) - start
        start, began = cpu_seconds(daemon.pid), time.monotonic()
        while time.monotonic() - began < CPU_WINDOW:
            _get(connection, "/fragment/queue", cookie)
            time.sleep(max(0.0, REFRESH - (time.monotonic() - began) % REFRESH))
        opened = cpu_seconds(daemon.pid) - start
        wall = time.monotonic() - began
    checks = [] if queued == LAB_WAITING and reasons == LAB_WAITING - 1 else [
        f"{queued} waiting, {reasons} reasons shown (want {LAB_WAITING}, {LAB_WAITING - 1})"]
    row(f"daemon CPU, an admin's Queue page open ({LAB_WAITING} waiting, fragment every {REFRESH:g} s)",
        max(0.0, opened - closed * wall / CPU_WINDOW), wall, 0.02,
        f"the window's wall time; the daemon's CPU with the page closed, {closed / CPU_WINDOW:.2%} of a core, "
        "subtracted", failed_checks=checks)


if __name__ == "__main__":
    grid_rows()
    page_rows()
