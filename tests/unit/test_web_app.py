"""The web application over HTTP without a browser: a source of canned daemon replies, a password
check standing in for PAM (the real PAM stack, daemon and browser: tests/system/test_web.py)."""
from __future__ import annotations

import asyncio
import re
import time

from aiohttp.test_utils import TestClient, TestServer

from gpuguard.client import DaemonUnreachable
from gpuguard.config import WebConfig
from gpuguard.web.app import CSP, MAX_BODY, Web, build
from gpuguard.web.sessions import Signer
from gpuguard.web.sources import ServerStatus

GiB = 1 << 30


def status(holder: str = "bob") -> dict:
    now = time.time()
    return {"ok": True, "gpus": [{
        "minor": 0, "label": "0", "profile": None, "name": "H100", "memory_total": 80 * GiB, "memory_used": GiB,
        "utilization": 10, "process_list": [],
        "holders": [{"user": holder, "uid": 1002, "granted_at": now, "expires_at": None, "last_active": now,
                     "gpu_memory": None, "memory_used": 0, "shared": False, "origin": "session"}]}],
        "queue": [{"position": 1, "user": "carol", "gpus": 1, "since": now, "priority": 0}]}


class Canned:
    """What a daemon answers, with the calls made."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def servers(self):
        self.calls.append(("status",))
        return [ServerStatus("gpu1", status())]

    async def whoami(self, user):
        self.calls.append(("whoami", user))
        return {"gpu1": {"user": user, "uid": 1001, "member": True, "group": "g", "exempt": False,
                         "quota": {"gpus": 1, "gpu_memory": None, "max_time": None}, "grants": [], "sessions": [],
                         "events": [], "queue": {"position": 1, "waiting": 1, "gpus": 1, "since": 0.0,
                                                 "ahead": [], "estimate": None}}}

    async def fairshare(self):
        self.calls.append(("fairshare",))
        users = [{"user": name, "uid": uid, "usage": usage, "share": 1.0, "priority": 0, "normalized": usage}
                 for name, uid, usage in (("carol", 1003, 60.0), ("alice", 1001, 3600.0), ("bob", 1002, 7200.0))]
        return {"gpu1": {"ok": True, "users": users, "half_life": 86400.0, "now": time.time()}}

    async def report(self, by, since, until, user):
        self.calls.append(("report", by, user))
        row = {"key": {"user": user or "bob", "gpu": 0, "day": "2026-11-30"}[by], "granted_seconds": 7200.0,
               "busy_seconds": 3600.0, "idle_seconds": 3600.0, "kills": {}}
        return {"gpu1": {"rows": [row], "total": {**row, "key": "total"}}}


def run(scenario, **config):
    source = Canned()
    state = Web(WebConfig(secure_cookies=False, admin_group="labadmins", **config), source, Signer(b"k" * 32),
                lambda user, password: password == "right", lambda user: ("labadmins",) if user == "root2" else ())

    async def main():
        async with TestClient(TestServer(build(state))) as client:
            await scenario(client, source)
    asyncio.run(main())


async def log_in(client, user, password="right"):
    form = await (await client.get("/login")).text()
    token = re.search(r'name="?csrf"? value="([^"]+)"', form).group(1)
    return await client.post("/login", data={"user": user, "password": password, "csrf": token},
                             allow_redirects=False)


def test_pages_carry_the_security_headers_and_load_nothing_from_elsewhere():
    async def scenario(client, source):
        reply = await client.get("/")
        text = await reply.text()
        assert reply.status == 200 and reply.headers["Content-Security-Policy"] == CSP
        assert reply.headers["X-Frame-Options"] == "DENY" and reply.headers["X-Content-Type-Options"] == "nosniff"
        assert not re.search(r'(src|href)="(https?:)?//', text)  # nothing from another host
        assert "bob" in text and 'data-state="held"' in text
        assert (await client.get("/fragment/now")).status == 200
        assert len(source.calls) == 1  # two requests within a second: one daemon call
    run(scenario)


def test_show_users_false_hides_names_from_anonymous_viewers():
    async def scenario(client, source):
        now_page, queue = await (await client.get("/")).text(), await (await client.get("/queue")).text()
        assert "bob" not in now_page and "another user" in now_page
        assert "carol" not in queue
        assert not [c for c in source.calls if c[0] == "whoami"]  # reasons only for the lab's members
    run(scenario, show_users=False)


def test_login_refusals_csrf_and_the_rate_limit():
    async def scenario(client, source):
        # no CSRF token (a form posted from another site): refused before PAM is asked
        reply = await client.post("/login", data={"user": "alice", "password": "right"})
        assert reply.status == 403
        for _ in range(5):
            assert (await log_in(client, "alice", "wrong")).status == 401
        limited = await log_in(client, "alice", "right")
        assert limited.status == 429 and "Too many failed logins" in await limited.text()
        assert (await log_in(client, "bob")).status == 303  # another name still gets in
    run(scenario)


def test_me_another_users_page_and_the_admin():
    async def scenario(client, source):
        assert (await client.get("/me", allow_redirects=False)).headers["Location"] == "/login"
        reply = await log_in(client, "alice")
        assert reply.status == 303 and reply.headers["Location"] == "/me"
        cookie = reply.headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        me = await (await client.get("/me")).text()
        assert "My GPUs" in me and "Place 1 of 1" in me
        assert '<span class="hours">1.00</span>' in me and '<span class="rank">2nd of 3</span>' in me
        assert "bob" not in me and "carol" not in me  # the standing is counted, not named
        refused = await client.get("/users/bob")
        assert refused.status == 403 and ("whoami", "bob") not in source.calls
        assert (await client.get("/usage.csv")).status == 200
        assert ("report", "user", "alice") in source.calls  # a user's usage is their own
        client.session.cookie_jar.clear()
        await log_in(client, "root2")
        assert (await client.get("/users/bob")).status == 200
        csv = await (await client.get("/usage.csv?since=2026-11-01&until=2026-11-30")).text()
        assert csv.splitlines()[0] == "by,key,granted_hours,busy_hours,idle_hours,busy_share"
        assert "user,bob,2.000,1.000,1.000,0.500" in csv
        assert ("report", "user", None) in source.calls  # an admin's: everyone's
        assert (await client.get("/usage?since=2026-13-01")).status == 400
        assert (await client.get("/usage?since=2020-01-01&until=2026-01-01")).status == 400
    run(scenario)


def test_me_page_stays_when_fair_share_cannot_be_read():
    async def scenario(client, source):
        async def unreachable():
            raise DaemonUnreachable("gpuguard daemon not reachable")
        source.fairshare = unreachable
        await log_in(client, "alice")
        reply = await client.get("/me")
        page = await reply.text()
        assert reply.status == 200 and "Place 1 of 1" in page and "Not available from this source." in page
    run(scenario)


def test_logout_needs_its_token_and_big_bodies_are_refused():
    async def scenario(client, source):
        await log_in(client, "alice")
        assert (await client.post("/logout", data={"csrf": "forged"})).status == 403
        assert "alice" in await (await client.get("/me")).text()
        page = await (await client.get("/me")).text()
        token = re.search(r'action="/logout".*?name="csrf" value="([^"]+)"', page).group(1)
        out = await client.post("/logout", data={"csrf": token}, allow_redirects=False)
        assert out.status == 303
        assert (await client.get("/me", allow_redirects=False)).status == 303
        big = await client.post("/login", data={"user": "x" * (MAX_BODY * 2), "password": "p"})
        assert big.status == 413
    run(scenario)
