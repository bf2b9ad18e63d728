"""The web application over HTTP without a browser: a source of canned daemon replies, a password
check standing in for PAM (the real PAM stack, daemon and browser: tests/system/test_web.py)."""
from __future__ import annotations

import asyncio
import ipaddress
import re
import time

from aiohttp.test_utils import TestClient, TestServer

from gpuguard.client import DaemonUnreachable
from gpuguard.config import WebConfig
from gpuguard.web import views
from gpuguard.web.app import CSP, MAX_BODY, Web, build, client_address
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
        return {"gpu1": {"user": user, "uid": 1001, "member": user != "dave", "group": "g", "exempt": False,
                         "quota": {"gpus": 1, "gpu_memory": None, "max_time": None, "share": 1.0, "priority": 0},
                         "grants": [], "sessions": [],
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
    run_with_state(lambda client, source, state: scenario(client, source), **config)


def run_with_state(scenario, groups_of=lambda user: ("labadmins",) if user == "root2" else (),
                   ended=lambda users: {}, **config):
    source = Canned()
    now = time.time()
    config = {"secure_cookies": False, **config}
    state = Web(WebConfig(admin_group="labadmins", **config), source, Signer(b"k" * 32),
                lambda user, password, client: password == "right", groups_of, ended,
                clock=lambda: now)  # still: a login delay does not pass while a test runs

    async def main():
        async with TestClient(TestServer(build(state))) as client:
            await scenario(client, source, state)
    asyncio.run(main())


async def log_in(client, user, password="right", headers=None):
    form = await (await client.get("/login")).text()
    token = re.search(r'name="?csrf"? value="([^"]+)"', form).group(1)
    return await client.post("/login", data={"user": user, "password": password, "csrf": token},
                             allow_redirects=False, headers=headers)


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


def test_login_refusals_csrf_and_the_delay(caplog):
    async def scenario(client, source):
        # no CSRF token (a form posted from another site): refused before PAM is asked
        reply = await client.post("/login", data={"user": "alice", "password": "right"})
        assert reply.status == 403
        for _ in range(4):
            assert (await log_in(client, "alice", "wrong")).status == 401
        delayed = await log_in(client, "alice", "right")
        assert delayed.status == 429 and "try again in 1 s" in await delayed.text()
        assert delayed.headers["Retry-After"] == "1"
        assert (await log_in(client, "bob")).status == 303  # another name from the same client gets in
    with caplog.at_level("WARNING", logger="gpuguard"):
        run(scenario)
    failed = [r.getMessage() for r in caplog.records if "web_login_failed" in r.getMessage()]
    assert len(failed) == 4 and "user=alice" in failed[-1] and "client=127.0.0.1" in failed[-1]
    assert "failures=4" in failed[-1] and "delay=1" in failed[-1]
    assert any("event=web_login_delayed" in r.getMessage() and "user=alice" in r.getMessage() for r in caplog.records)


def test_forwarded_for_names_the_client_only_from_a_trusted_proxy():
    def flood_then_log_in(trusted, expected):
        async def scenario(client, source):
            for _ in range(6):
                await log_in(client, "alice", "wrong", headers={"X-Forwarded-For": "10.0.0.66"})
            other = await log_in(client, "alice", headers={"X-Forwarded-For": "10.0.0.7"})
            assert other.status == expected
        run(scenario, trusted_proxies=trusted)
    flood_then_log_in((ipaddress.ip_network("127.0.0.0/8"),), 303)  # behind the proxy: two clients
    flood_then_log_in((), 429)  # without trusted_proxies both are 127.0.0.1, whatever the header says


PROXY = (ipaddress.ip_network("127.0.0.0/8"),)


def test_failures_from_one_ipv6_address_do_not_delay_the_name_from_its_64():
    """The finding: the delay counted a /64 as one, so 6 failures as alice from ::66 delayed
    alice on every host of that campus LAN. Only ::66 waits; the /64 still stands together."""
    async def scenario(client, source, state):
        for _ in range(4):  # the clock stands still: the 4th failure's delay of 1 s does not pass
            assert (await log_in(client, "alice", "wrong", headers={"X-Forwarded-For": "2001:db8::66"})).status == 401
        assert (await log_in(client, "alice", headers={"X-Forwarded-For": "2001:db8::66"})).status == 429
        assert (await log_in(client, "alice", headers={"X-Forwarded-For": "2001:db8::10"})).status == 303
        assert state.delay.standing("2001:db8::99", state.clock()) == 4  # the slots' order: the /64's
    run_with_state(scenario, trusted_proxies=PROXY)


def sign_out(client) -> None:
    """Drop the login cookie, the device cookie kept (a signed-in page's form is the logout's)."""
    client.session.cookie_jar.clear(lambda cookie: cookie.key == "gpuguard")


def test_a_device_cookie_is_set_at_a_login_and_trusted_until_its_own_failures():
    async def scenario(client, source, state):
        nat = {"X-Forwarded-For": "10.0.0.66"}  # one address, the attacker's and alice's
        for _ in range(4):
            assert (await log_in(client, "alice", "wrong", headers=nat)).status == 401
        assert (await log_in(client, "alice", headers=nat)).status == 429  # no cookie yet: the address waits
        reply = await log_in(client, "alice", headers={"X-Forwarded-For": "10.0.0.7"})
        assert reply.status == 303
        device = reply.cookies["gpuguard-device"]
        assert device.value == state.signer.device("alice") and device["max-age"] == str(365 * 86400)
        assert device["httponly"] and device["samesite"] == "Strict" and device["path"] == "/"
        sign_out(client)
        assert (await log_in(client, "alice", headers=nat)).status == 303  # the cookie: the NAT's delay is not hers
        sign_out(client)
        # alice's failures with her cookie (whoever holds it) wear out its trust
        for _ in range(4):
            assert (await log_in(client, "alice", "wrong", headers={"X-Forwarded-For": "10.0.0.8"})).status == 401
        assert state.device_failures.wait("alice", "device", state.clock()) == 1.0
        # not trusted now: the address's delay holds (at the NAT her success forgave the pair)
        assert (await log_in(client, "alice", headers={"X-Forwarded-For": "10.0.0.8"})).status == 429
    run_with_state(scenario, trusted_proxies=PROXY)


def test_a_device_cookie_is_secure_with_the_login_cookie():
    async def scenario(client, source, state):
        form = await client.get("/login")
        seed = form.cookies["__Host-gpuguard-login"].value  # Secure: the jar keeps it off plain HTTP, so by hand
        token = re.search(r'name="?csrf"? value="([^"]+)"', await form.text()).group(1)
        reply = await client.post("/login", data={"user": "alice", "password": "right", "csrf": token},
                                  allow_redirects=False, headers={"Cookie": f"__Host-gpuguard-login={seed}"})
        assert reply.status == 303
        device = reply.cookies["__Host-gpuguard-device"]
        assert device["secure"] and device["httponly"] and device.value == state.signer.device("alice")
    run_with_state(scenario, secure_cookies=True)


def test_the_client_address_from_forwarded_for():
    proxies = (ipaddress.ip_network("10.1.0.0/16"), ipaddress.ip_network("::1"))
    assert client_address("10.1.0.5", "1.2.3.4", proxies) == "1.2.3.4"
    assert client_address("10.1.0.5", "6.6.6.6, 1.2.3.4, 10.1.0.9", proxies) == "1.2.3.4"  # the client wrote 6.6.6.6
    assert client_address("192.0.2.1", "1.2.3.4", proxies) == "192.0.2.1"  # not a proxy: the header is not believed
    assert client_address("10.1.0.5", "junk", proxies) == "10.1.0.5"
    assert client_address("::1", "2001:db8::1", proxies) == "2001:db8::1"
    assert client_address("10.1.0.5", None, proxies) == "10.1.0.5"
    assert client_address(None, "1.2.3.4", proxies) == "?"


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
        out = await client.post("/logout", data={"csrf": logout_token(page)}, allow_redirects=False)
        assert out.status == 303
        assert (await client.get("/me", allow_redirects=False)).status == 303
        big = await client.post("/login", data={"user": "x" * (MAX_BODY * 2), "password": "p"})
        assert big.status == 413
    run(scenario)


def logout_token(page: str) -> str:
    found = re.search(r'action="/logout".*?name="csrf" value="([^"]+)"', page)
    assert found, "no logout form on the page"
    return found.group(1)


def test_a_logout_ends_the_login_on_the_server_and_deletes_the_cookie_as_it_was_set():
    async def scenario(client, source):
        # Over plain http the test client keeps Secure cookies to itself: sent here by hand, as a
        # browser sends them over https or to 127.0.0.1.
        form = await client.get("/login")
        seed = form.cookies["__Host-gpuguard-login"]
        assert seed["secure"] and seed["httponly"] and seed["path"] == "/"
        token = re.search(r'name="?csrf"? value="([^"]+)"', await form.text()).group(1)
        reply = await client.post("/login", data={"user": "alice", "password": "right", "csrf": token},
                                  headers={"Cookie": f"__Host-gpuguard-login={seed.value}"}, allow_redirects=False)
        cookie = reply.cookies["__Host-gpuguard"]
        assert cookie["secure"] and cookie["httponly"] and cookie["samesite"] == "Strict" and cookie["path"] == "/"
        deleted_pre = reply.cookies["__Host-gpuguard-login"]
        assert deleted_pre["max-age"] == "0" and deleted_pre["secure"] and deleted_pre["path"] == "/"
        sent = {"Cookie": f"__Host-gpuguard={cookie.value}"}  # as a browser over https (or loopback) sends it
        page = await (await client.get("/me", headers=sent)).text()
        assert "My GPUs" in page
        out = await client.post("/logout", data={"csrf": logout_token(page)}, headers=sent, allow_redirects=False)
        gone = out.cookies["__Host-gpuguard"]
        assert out.status == 303 and gone.value == "" and gone["max-age"] == "0"
        assert gone["secure"] and gone["httponly"] and gone["samesite"] == "Strict" and gone["path"] == "/"
        # a browser that kept the cookie anyway (or a copy of it) has no login any more
        kept = await client.get("/me", headers=sent, allow_redirects=False)
        assert kept.status == 303 and kept.headers["Location"] == "/login"
        assert kept.headers["X-Gpuguard-Signed-In"] == "0"
    run(scenario, secure_cookies=True)


def test_the_sweep_ends_logins_of_locked_removed_and_former_members_and_changed_admins():
    ended_for = {"alice": "locked"}
    admins = {"root2"}

    async def scenario(client, source, state):
        cookies = {}
        for user in ("alice", "bob", "carol", "root2"):
            cookies[user] = (await log_in(client, user)).cookies["gpuguard"].value
            client.session.cookie_jar.clear()
        whoami = source.whoami

        async def carol_left(user):
            replies = await whoami(user)
            replies["gpu1"]["member"] = user != "carol"
            return replies
        source.whoami = carol_left
        admins.clear()  # root2 left the admin group
        state.memo = type(state.memo)(0.0)
        await state.sweep()
        left = {user for user in cookies
                if (await client.get("/me", headers={"Cookie": f"gpuguard={cookies[user]}"},
                                     allow_redirects=False)).status == 200}
        assert left == {"bob"}
    run_with_state(scenario, ended=lambda users: {u: ended_for[u] for u in users if u in ended_for},
                   groups_of=lambda user: ("labadmins",) if user in admins else ())


def test_an_admin_ends_a_users_logins_and_no_one_else_may():
    async def scenario(client, source):
        alice = (await log_in(client, "alice")).cookies["gpuguard"].value
        page = await (await client.get("/me")).text()
        assert "End " not in page
        refused = await client.post("/users/bob/logout", data={"csrf": logout_token(page)})
        assert refused.status == 403
        client.session.cookie_jar.clear()
        await log_in(client, "root2")
        page = await (await client.get("/users/alice")).text()
        assert 'action="/users/alice/logout"' in page
        forged = await client.post("/users/alice/logout", data={"csrf": "forged"})
        assert forged.status == 403
        done = await client.post("/users/alice/logout", data={"csrf": logout_token(page)})
        assert done.status == 200 and "Ended 1 login of alice." in await done.text()
        client.session.cookie_jar.clear()
        kept = await client.get("/me", headers={"Cookie": f"gpuguard={alice}"}, allow_redirects=False)
        assert kept.status == 303
    run(scenario)


def test_a_non_member_is_told_whom_to_ask_and_gets_no_login():
    async def scenario(client, source):
        reply = await log_in(client, "dave")
        page = await reply.text()
        assert reply.status == 403 and "<h1>Not in the GPU group</h1>" in page
        assert "dave is not in <b>g</b>" in page and "ask room 3.14 to add you" in page
        assert "gpuguard" not in reply.cookies and reply.cookies["gpuguard-login"]["max-age"] == "0"
        main = page.split("<main>")[1]
        assert "Quota" not in main and "request" not in main and "queue" not in main.lower()
        assert (await client.get("/me", allow_redirects=False)).status == 303
    run(scenario, contact="room 3.14")


def test_my_processes_fragment_is_mine_or_an_admins():
    async def scenario(client, source):
        assert (await client.get("/fragment/processes/alice", allow_redirects=False)).status == 303
        await log_in(client, "alice")
        mine = await client.get("/fragment/processes/alice")
        assert mine.status == 200 and "No process on a GPU now." in await mine.text()
        assert (await client.get("/fragment/processes/bob")).status == 403
        assert 'data-refresh="/fragment/processes/alice"' in await (await client.get("/me")).text()
    run(scenario)


def test_processes_of_a_user_across_servers():
    status = {"gpus": [{"minor": 0, "label": "0", "process_list": [
        {"pid": 7, "uid": 1001, "user": "alice", "memory": 1 << 30, "command": "python"},
        {"pid": 8, "uid": 1002, "user": "bob", "memory": 0, "command": "x"}]},
        {"minor": 1, "label": "1", "process_list": None}]}
    found = views.processes_of("alice", [("gpu1", status), ("gpu2", None)])
    assert found == [views.OwnProcess("gpu1", "0", 7, "python", 1 << 30)]
