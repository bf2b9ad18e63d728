"""The aiohttp application: pages, fragments for the live refresh, the PAM login.

Read-only: the only forms are the login and the logout, both POST with a CSRF token, and neither
changes anything outside the browser's cookie. Every response carries a Content-Security-Policy
that allows nothing from elsewhere and no inline script. What one client can make it cost is
bounded: the daemon is asked at most once per second and key however many browsers poll (Memo),
PAM runs at most LOGINS_AT_ONCE logins at a time, one client at most its share of them, a client
of many failures behind the others and a browser's device cookie of an earlier login ahead of all
(slots.LoginSlots), failed logins delay further tries of that name from that address
(sessions.LoginDelay; the client behind `trusted_proxies` from X-Forwarded-For), and request
bodies are small.
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from aiohttp import web

from gpuguard.client import DaemonUnreachable, Refused
from gpuguard.config import IpNetwork, WebConfig
from gpuguard.logs import event
from gpuguard.web import pages, trends, views
from gpuguard.web.assets import ICON, SCRIPT, STYLE
from gpuguard.web.connections import Guard, total_for
from gpuguard.web.counted import Counted
from gpuguard.web.sessions import Login, LoginDelay, Sessions, Signer
from gpuguard.web.slots import Busy, LoginSlots, client_key, group_of
from gpuguard.web.sources import Memo, Source
from gpuguard.web.svg import Sorting, usage_chart

LOGINS_AT_ONCE = 2          # PAM conversations in flight (each a thread; a failure sleeps ~2 s in pam_faildelay)
LOGINS_PER_CLIENT = 1       # of them, one client's (an address, an IPv6 /64, all of loopback)
DEVICE_AGE = 365 * 86400    # seconds a browser keeps the device cookie of its last login's name
DEVICE = "device"           # LoginDelay's "client" of a name's failures with its device cookie
MAX_BODY = 8 * 1024         # a login form is a few hundred bytes
MAX_REASONS = 50            # queue places whose reasons are asked for, per server
MEMO_AGE = 1.0             # seconds a daemon's answer (and the grid made of it) is kept for every browser
# seconds a usage report is kept: the daemon writes usage once a minute, and charges each report
# the web asks for a user to that user's budget (as their own `gpuguard report`)
REPORT_AGE = 30.0
# seconds a span's utilisation and memory (every user's, read once for all viewers) is kept: the
# hour's last point changes with each tick, the rest once a minute
HISTORY_AGE = 10.0
HISTORY_PAGE_AGE = 5.0  # seconds a History page is kept for all who see the same (its 164 lines take ms to draw)
# seconds the queue's reasons (a `whoami` per waiter) are kept while the queue's order stays the same:
# an open Queue page asks every 2 s, 36 waiting cost the daemon 2.6% of a core asked every second
REASONS_AGE = 15.0
SWEEP_EVERY = 15.0          # seconds between checks that each login's account may still log in
SORTED_USAGE = ("user", "gpu")  # the usage charts a reader may order (days stay in order, servers few)
MAX_PERIOD_DAYS = 366
DEFAULT_PERIOD_DAYS = 30
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
           "Referrer-Policy": "no-referrer", "Cross-Origin-Opener-Policy": "same-origin"}

Authenticate = Callable[[str, str, str], bool]  # PAM: user, password, client address -> accepted (blocking)
GroupsOf = Callable[[str], tuple[str, ...]]  # NSS: the user's groups (blocking)
# users -> why each of those whose password login has ended (locked, expired, removed) can no
# longer log in (blocking); the default judges nobody.
Ended = Callable[[Sequence[str]], dict[str, str]]


def _nobody_ended(users: Sequence[str]) -> dict[str, str]:
    return {}


@dataclass
class Web:
    config: WebConfig
    source: Source
    signer: Signer
    authenticate: Authenticate
    groups_of: GroupsOf
    ended: Ended = _nobody_ended
    clock: Callable[[], float] = time.time
    memo: Memo = field(default_factory=lambda: Memo(MEMO_AGE))
    reports: Memo = field(default_factory=lambda: Memo(REPORT_AGE))
    histories: Memo = field(default_factory=lambda: Memo(HISTORY_AGE))
    history_pages: Memo = field(default_factory=lambda: Memo(HISTORY_PAGE_AGE))
    standings: Memo = field(default_factory=lambda: Memo(REASONS_AGE, max_entries=1024))
    sessions: Sessions = field(default_factory=Sessions)
    connections: Guard = field(default_factory=lambda: Guard(total_for(1024)))
    # The delay by the exact address (a campus's /64 is hundreds of hosts: one failing as bob
    # must not delay bob on the others); the standing, the slots' order, by the /64 (one host's
    # 2^64 addresses would otherwise each stand at 0).
    delay: LoginDelay = field(default_factory=lambda: LoginDelay(standing_of=client_key))
    # A name's failures with its device cookie (whoever holds it): past LoginDelay's free ones
    # the cookie is not trusted until its delay passes, so a holder (mallory, of her own name's)
    # cannot flood ahead of everyone.
    device_failures: LoginDelay = field(default_factory=LoginDelay)
    delayed: Counted = field(default_factory=lambda: Counted("web_login_delayed"))
    implausible: Counted = field(default_factory=lambda: Counted("web_login_malformed"))
    busy: Counted = field(default_factory=lambda: Counted("web_login_busy"))
    logins: LoginSlots = field(default_factory=lambda: LoginSlots(LOGINS_AT_ONCE, LOGINS_PER_CLIENT))

    @property
    def cookie(self) -> str:
        # __Host-: the browser keeps it only when Secure, for this host alone and path /.
        return "__Host-gpuguard" if self.config.secure_cookies else "gpuguard"

    @property
    def pre_cookie(self) -> str:
        return "__Host-gpuguard-login" if self.config.secure_cookies else "gpuguard-login"

    @property
    def device_cookie(self) -> str:
        return "__Host-gpuguard-device" if self.config.secure_cookies else "gpuguard-device"

    # --- who looks

    def login_of(self, request: web.Request) -> Login | None:
        return self.sessions.get(request.cookies.get(self.cookie), self.clock())

    async def viewer(self, request: web.Request) -> views.Viewer:
        login = self.login_of(request)
        return views.Viewer() if login is None else views.Viewer(login.user, login.admin)

    async def signed_in(self, request: web.Request) -> tuple[views.Viewer, str]:
        """The viewer and their user name, for the pages only a signed-in user sees: anyone else
        is sent to the login page."""
        viewer = await self.viewer(request)
        if viewer.user is None:
            raise web.HTTPSeeOther("/login")
        return viewer, viewer.user

    def logout_token(self, request: web.Request) -> str:
        login = self.login_of(request)
        return self.signer.csrf("logout:" + login.id) if login else ""

    def page(self, request: web.Request, viewer: views.Viewer, title: str, body: str, status: int = 200) -> web.Response:
        return web.Response(text=pages.layout(title, request.path, viewer, body, self.logout_token(request)),
                            content_type="text/html", status=status, headers={"Cache-Control": "no-store"})

    def cookie_options(self) -> dict[str, Any]:
        """The attributes every cookie is set with, and deleted with: a browser deletes a cookie
        only when the deletion matches them (a __Host- cookie only when Secure)."""
        return {"path": "/", "httponly": True, "samesite": "Strict", "secure": self.config.secure_cookies}

    def forget(self, response: web.StreamResponse, name: str) -> None:
        response.del_cookie(name, **self.cookie_options())

    # --- data, through the memo

    async def servers(self, viewer: views.Viewer) -> tuple[list[views.Server], float]:
        now = self.clock()
        fetched = await self.memo.get("servers", self.source.servers)
        return [views.server_view(s.name, s.status, s.error, now, viewer, self.config.show_users)
                for s in fetched], now

    async def grid(self, viewer: views.Viewer) -> str:
        """The grid's HTML, rendered once per memo window for all who see the same names."""
        key = ("grid",) if self.config.show_users else ("grid", viewer.user, viewer.admin)
        return await self.memo.get(key, lambda: self._render_grid(viewer))

    async def _render_grid(self, viewer: views.Viewer) -> str:
        servers, now = await self.servers(viewer)
        return pages.grid(servers, now)

    async def whoami(self, user: str) -> dict[str, dict[str, Any]]:
        return await self.memo.get(("whoami", user), lambda: self.source.whoami(user))

    async def fairshare(self) -> dict[str, dict[str, Any]]:
        """Server name -> its `fairshare` reply; one that cannot be read is left out (its standing
        shows as not available, the rest of the page stays)."""
        try:
            return await self.memo.get("fairshare", self.source.fairshare)
        except (DaemonUnreachable, Refused):
            return {}

    async def queue(self, viewer: views.Viewer) -> tuple[list[views.Waiting], list[str]]:
        rows: list[views.Waiting] = []
        errors = []
        for server in await self.memo.get("servers", self.source.servers):
            if server.status is None:
                errors.append(f"{server.name}: not read: {server.error}")
                continue
            standings: dict[str, Any] = {}
            if viewer.user is not None:  # the reasons name others' usage: for the lab's members only
                waiting = server.status.get("queue", ())
                order = tuple((e["user"], e["gpus"], e.get("priority", 0)) for e in waiting)
                for entry in waiting[:MAX_REASONS]:
                    standings[entry["user"]] = await self.standings.get(
                        (server.name, entry["user"], order), partial(self._standing, server.name, entry["user"]))
            rows += views.queue_rows(server.name, server.status, standings, viewer, self.config.show_users)
        return rows, errors

    async def _standing(self, server: str, user: str) -> dict[str, Any] | None:
        """The user's place in the queue of `server`, as their `whoami` says it (None: left meanwhile,
        or the account is gone: no reason shown)."""
        try:
            standing: dict[str, Any] | None = (await self.whoami(user)).get(server, {}).get("queue")
        except (DaemonUnreachable, Refused):
            return None
        return standing

    # --- pages

    async def now(self, request: web.Request) -> web.Response:
        viewer = await self.viewer(request)
        return self.page(request, viewer, "Now", pages.now_page(await self.grid(viewer)))

    async def now_fragment(self, request: web.Request) -> web.Response:
        return _fragment(await self.grid(await self.viewer(request)))

    async def queue_page(self, request: web.Request) -> web.Response:
        viewer = await self.viewer(request)
        rows, errors = await self.queue(viewer)
        return self.page(request, viewer, "Queue", pages.queue_page(rows, errors))

    async def queue_fragment(self, request: web.Request) -> web.Response:
        rows, errors = await self.queue(await self.viewer(request))
        return _fragment(pages.queue_table(rows, errors))

    async def me(self, request: web.Request) -> web.Response:
        viewer, user = await self.signed_in(request)
        return await self._user_page(request, viewer, user)

    async def user(self, request: web.Request) -> web.Response:
        viewer, _ = await self.signed_in(request)
        name = request.match_info["name"]
        if name != viewer.user and not viewer.admin:
            return self.page(request, viewer, "Refused", pages.message_page(
                "Refused", "Only admins see other users' pages."), status=403)
        return await self._user_page(request, viewer, name)

    async def _user_page(self, request: web.Request, viewer: views.Viewer, name: str) -> web.Response:
        try:
            replies = await self.whoami(name)
        except Refused as exc:
            return self.page(request, viewer, "Not found", pages.message_page("Not found", str(exc)), status=404)
        except DaemonUnreachable as exc:
            return self.page(request, viewer, "Unavailable", pages.message_page("Unavailable", str(exc)), status=503)
        fairshare = await self.fairshare()
        standings = {server: views.fair_share(name, who.get("quota"), fairshare.get(server))
                     for server, who in replies.items()}
        body = pages.me_page(name, replies, viewer, self.config.show_users, own=name == viewer.user,
                             standings=standings)
        body += pages.processes_section(name, name == viewer.user, await self._processes(name))
        if viewer.admin and name != viewer.user:
            body += pages.end_logins_form(name, self.logout_token(request))
        return self.page(request, viewer, name, body)

    async def processes_fragment(self, request: web.Request) -> web.Response:
        viewer, _ = await self.signed_in(request)
        name = request.match_info["name"]
        if name != viewer.user and not viewer.admin:
            raise web.HTTPForbidden(text="only admins see other users' processes")
        return _fragment(await self._processes(name))

    async def _processes(self, name: str) -> str:
        """The user's processes on the GPUs, from the status every page shares (once a second)."""
        fetched = await self.memo.get("servers", self.source.servers)
        errors = [f"{s.name}: not read: {s.error}" for s in fetched if s.status is None]
        return pages.processes_table(views.processes_of(name, [(s.name, s.status) for s in fetched]), errors)

    async def usage(self, request: web.Request) -> web.Response:
        viewer, _ = await self.signed_in(request)
        try:
            form, tables = await self._asked_usage(request, viewer)
            sort = _usage_sort(request.query)
        except ValueError as exc:
            return self.page(request, viewer, "Bad request", pages.message_page("Bad request", str(exc)), status=400)
        except (DaemonUnreachable, Refused) as exc:
            return self.page(request, viewer, "Unavailable", pages.message_page("Unavailable", str(exc)), status=503)
        charts = [(f"GPU-hours by {by}", usage_chart(f"GPU-hours by {by}", rows, Sorting(
            sort, f"/usage?since={form['since']}&until={form['until']}", "sort" in request.query, f"by-{by}")
            if by in SORTED_USAGE else None)) for by, rows in tables]
        scope = "Everyone's usage (admin)." if viewer.admin else "Your own usage (admins see everyone's)."
        csv_href = f"/usage.csv?since={form['since']}&until={form['until']}"
        return self.page(request, viewer, "Usage", pages.usage_page(form, charts, csv_href, scope))

    async def usage_csv(self, request: web.Request) -> web.Response:
        viewer, _ = await self.signed_in(request)
        try:
            form, tables = await self._asked_usage(request, viewer)
        except ValueError as exc:
            raise web.HTTPBadRequest(text=str(exc)) from None
        except (DaemonUnreachable, Refused) as exc:
            raise web.HTTPServiceUnavailable(text=str(exc)) from None
        name = f"gpuguard-usage-{form['since']}-{form['until']}.csv"
        return web.Response(text=views.usage_csv(tables), content_type="text/csv",
                            headers={"Content-Disposition": f'attachment; filename="{name}"', "Cache-Control": "no-store"})

    async def _asked_usage(self, request: web.Request, viewer: views.Viewer) \
            -> tuple[dict[str, str], list[tuple[str, list[views.Usage]]]]:
        """The period the page or the CSV asks for (its form fields) and the usage tables of it,
        the users' and GPUs' in the order asked for (`sort`, most GPU-hours granted first by default);
        ValueError for a bad period or order, DaemonUnreachable or Refused when the source fails."""
        since, until, form = _period(request.query, self.clock())
        sort = _usage_sort(request.query)
        tables = await self._usage_tables(viewer, since, until)
        first, last = (datetime.date.fromisoformat(form[key]) for key in ("since", "until"))
        return form, [(by, views.by_period(rows, first, last) if by == "day" else
                       views.sorted_usage(rows, sort) if by in SORTED_USAGE else views.largest_first(rows))
                      for by, rows in tables]

    async def _usage_tables(self, viewer: views.Viewer, since: float, until: float) -> list[tuple[str, list[views.Usage]]]:
        user = None if viewer.admin else viewer.user  # as `gpuguard report`: one's own, admins everyone's
        tables = []
        for by in ("user", "gpu", "day"):
            reports = await self._report(by, since, until, user)
            tables.append((by, views.usage_rows(by, reports, viewer, self.config.show_users)))
        tables.insert(2, ("server", views.usage_rows("server", reports, viewer, self.config.show_users)))
        return tables

    async def _report(self, by: str, since: float, until: float, user: str | None) -> dict[str, dict[str, Any]]:
        return await self.reports.get((by, since, until, user), lambda: self.source.report(by, since, until, user))

    async def history(self, request: web.Request) -> web.Response:
        """Utilisation and memory over the last hour, day or week: every GPU's; the viewer's own,
        or an admin's everyone's; one series alone with `server` and `gpu` or `user`."""
        viewer, _ = await self.signed_in(request)
        query = request.query
        span = query.get("span") or "day"
        sort, user_sort = query.get("sort") or "name", query.get("usort") or "util"
        if span not in views.SPANS or sort not in views.TREND_SORTS or user_sort not in views.TREND_SORTS:
            return self.page(request, viewer, "Bad request", pages.message_page(
                "Bad request", f"span is one of {', '.join(views.SPANS)}; sort and usort one of "
                f"{', '.join(views.TREND_SORTS)}"), status=400)
        server, gpu, user = query.get("server"), query.get("gpu"), query.get("user")
        one = None if server is None or (gpu is None and user is None) else \
            (server, "gpu", gpu) if gpu is not None else (server, "user", user)
        # Drawn once per HISTORY_PAGE_AGE for all who see the same: admins alike, anyone else their own.
        seen = ("history", span, sort, user_sort, one, viewer.admin, None if viewer.admin else viewer.user)
        try:
            title, body, status = await self.history_pages.get(
                seen, lambda: self._history_page(viewer, span, sort, user_sort, one))
        except (DaemonUnreachable, Refused) as exc:
            return self.page(request, viewer, "Unavailable", pages.message_page("Unavailable", str(exc)), status=503)
        return self.page(request, viewer, title, body, status=status)

    async def _history_page(self, viewer: views.Viewer, span: str, sort: str, user_sort: str,
                            one: tuple[str, str, str | None] | None) -> tuple[str, str, int]:
        """The History page's title, body and status: every series, or `one` (server, kind, key) alone."""
        replies = await self.histories.get(("use_history", span), lambda: self.source.use_history(span))
        gpus, users = views.trends(replies, viewer)
        if one is None:
            return "History", trends.history_page(span, gpus, users, sort, user_sort, viewer.admin,
                                                  known=bool(replies)), 200
        server, kind, key = one
        found = next((t for t in (gpus if kind == "gpu" else users) if t.server == server and t.key == key), None)
        if found is None:
            return "Not found", pages.message_page("Not found", f"No {'GPU' if kind == 'gpu' else 'user'} {key} on "
                                                   f"{server} that you may see in the last {span}."), 404
        return found.title, trends.detail_page(found, span), 200

    # --- login

    def plain_http_elsewhere(self, request: web.Request) -> bool:
        """Secure cookies over plain HTTP to a name browsers do not treat as secure (not localhost
        or loopback): the browser keeps none of them, so no login can work there."""
        if not self.config.secure_cookies or request.secure:
            return False
        if within(request.remote or "", self.config.trusted_proxies) and \
                request.headers.get("X-Forwarded-Proto", "").lower() == "https":
            return False
        host = request.url.host or ""
        return not (host == "localhost" or host.endswith(".localhost") or _loopback(host))

    def needs_https(self, request: web.Request, viewer: views.Viewer) -> web.Response:
        return self.page(request, viewer, "Log in needs HTTPS", pages.needs_https_page(
            request.url.host or "this host", request.url.port or 80),
                         status=403)

    async def login_form(self, request: web.Request) -> web.Response:
        viewer = await self.viewer(request)
        if self.plain_http_elsewhere(request):
            return self.needs_https(request, viewer)
        seed = request.cookies.get(self.pre_cookie) or secrets.token_urlsafe(16)
        response = self.page(request, viewer, "Log in", pages.login_page(self.signer.csrf("login:" + seed)))
        response.set_cookie(self.pre_cookie, seed, max_age=3600, **self.cookie_options())
        return response

    async def login(self, request: web.Request) -> web.Response:
        form = await request.post()
        seed = request.cookies.get(self.pre_cookie)
        user, password = str(form.get("user", "")), str(form.get("password", ""))
        viewer = views.Viewer()
        if not self.signer.csrf_ok(str(form.get("csrf", "")), "login:" + seed if seed else None):
            if seed is None and self.plain_http_elsewhere(request):  # the cookie was never kept: say why
                return self.needs_https(request, viewer)
            return self.page(request, viewer, "Log in", pages.message_page(
                "Log in", "The form expired or came from another site: load the login page again."), status=403)
        client = client_address(request.remote, request.headers.get("X-Forwarded-For"), self.config.trusted_proxies)

        def again(message: str, status: int) -> web.Response:
            body = pages.login_page(self.signer.csrf("login:" + str(seed)), message, user)
            return self.page(request, viewer, "Log in", body, status=status)

        if not _plausible(user, password):  # no PAM conversation, so nothing guessed and nothing kept
            self.implausible.add(client=client)
            return again("Wrong user name or password.", 401)

        # The browser's device cookie for this name (set by its last login that succeeded): no
        # flood of fresh addresses can forge it, so that login goes ahead of them (LoginSlots) and
        # its address's delay (a NAT's other hosts') does not hold it: its own is device_failures'.
        device = self.signer.device_ok(request.cookies.get(self.device_cookie), user)

        def trusted() -> bool:
            return device and self.device_failures.wait(user, DEVICE, self.clock()) <= 0

        def still_delayed() -> web.Response | None:
            wait = 0.0 if trusted() else self.delay.wait(user, client, self.clock())
            if wait <= 0:
                return None
            self.delayed.add(user=user, client=client, wait=math.ceil(wait))
            refused = again(f"Too many failed logins as {user} from here: try again in {math.ceil(wait)} s.", 429)
            refused.headers["Retry-After"] = str(math.ceil(wait))
            return refused

        if (refused := still_delayed()) is not None:
            return refused
        try:
            async with self.logins.slot(group_of(client), self.delay.standing(client, self.clock()), trusted()):
                if (refused := still_delayed()) is not None:  # a try of the same pair failed while this one waited
                    return refused
                accepted = await asyncio.to_thread(self.authenticate, user, password, client)
        except Busy as exc:
            self.busy.add(client=client, why=str(exc))
            return again("Too many logins at once: try again in a moment.", 503)
        if not accepted:
            failures = self.delay.failed(user, client, self.clock())
            if device:
                self.device_failures.failed(user, DEVICE, self.clock())
            event(logging.WARNING, "web_login_failed", user=user, client=client, failures=failures.count,
                  delay=math.ceil(failures.until - failures.last))
            return again("Wrong user name or password.", 401)
        self.delay.succeeded(user, client)  # not device_failures: a success buys no more failures trusted
        admin = await self.is_admin(user)
        if not admin and await self.membership(user) is False:  # None: no server can say now; the sweep judges later
            event(logging.WARNING, "web_login_refused", user=user, client=client, why="not in the GPU group")
            refused = self.page(request, viewer, "Not in the GPU group", pages.not_member_page(
                user, await self.gpu_group(user), self.config.contact, self.config.admin_group), status=403)
            self.forget(refused, self.pre_cookie)
            return refused
        login = self.sessions.open(user, admin, self.clock() + self.config.session_time)
        response = web.HTTPSeeOther("/me")
        response.set_cookie(self.cookie, login.id, max_age=int(self.config.session_time), **self.cookie_options())
        response.set_cookie(self.device_cookie, self.signer.device(user), max_age=DEVICE_AGE, **self.cookie_options())
        self.forget(response, self.pre_cookie)
        raise response

    async def logout(self, request: web.Request) -> web.Response:
        form = await request.post()
        login = self.login_of(request)
        if login is None or not self.signer.csrf_ok(str(form.get("csrf", "")), "logout:" + login.id):
            raise web.HTTPForbidden(text="logout refused: missing or wrong CSRF token")
        self.sessions.end(login.id)
        response = web.HTTPSeeOther("/")
        self.forget(response, self.cookie)
        raise response

    async def end_logins(self, request: web.Request) -> web.Response:
        """An admin ends every login of a user (POST, with the admin's own logout token)."""
        form = await request.post()
        login = self.login_of(request)
        if login is None or not self.signer.csrf_ok(str(form.get("csrf", "")), "logout:" + login.id):
            raise web.HTTPForbidden(text="refused: missing or wrong CSRF token")
        viewer = views.Viewer(login.user, login.admin)
        if not login.admin:
            return self.page(request, viewer, "Refused", pages.message_page(
                "Refused", "Only admins end other users' logins."), status=403)
        name = request.match_info["name"]
        ended = self.sessions.end_user(name)
        event(logging.WARNING, "web_logins_ended", user=name, why=f"ended by {login.user}", logins=ended)
        return self.page(request, await self.viewer(request), "Logins ended",  # their own, if they ended it
                         pages.message_page("Logins ended", f"Ended {views.plural(ended, 'login')} of {name}."))

    async def session_state(self, request: web.Request) -> web.Response:
        """For the script of an open page: whether it is still signed in (the header)."""
        return _fragment("")

    # --- whether a login may go on

    async def is_admin(self, user: str) -> bool:
        return bool(self.config.admin_group) and self.config.admin_group in await asyncio.to_thread(self.groups_of, user)

    async def gpu_group(self, user: str) -> str | None:
        """The GPU group's name, as the daemon says it (None when it cannot be read)."""
        try:
            return next((str(r["group"]) for r in (await self.whoami(user)).values() if r.get("group")), None)
        except (DaemonUnreachable, Refused):
            return None

    async def membership(self, user: str) -> bool | None:
        """Whether the user is in the GPU group (or exempt) on some server; None when no server
        can say (a daemon down does not end anyone's login)."""
        try:
            replies = await self.whoami(user)
        except (DaemonUnreachable, Refused):
            return None
        return any(bool(r.get("member") or r.get("exempt")) for r in replies.values()) if replies else None

    async def sweep(self) -> None:
        """End the logins of accounts that may no longer log in: locked, expired or removed
        (self.ended), out of the GPU group (admins need not be in it), or moved in or out of the
        admin group since."""
        live = self.sessions.live()
        users = sorted({login.user for login in live})
        if not users:
            return
        reasons = await asyncio.to_thread(self.ended, users)
        for user in users:
            why = reasons.get(user)
            admin = await self.is_admin(user)
            if why is None and not admin and await self.membership(user) is False:
                why = "not in the GPU group"
            if why is not None:
                event(logging.WARNING, "web_logins_ended", user=user, why=why, logins=self.sessions.end_user(user))
                continue
            for login in live:
                if login.user == user and login.admin != admin:
                    self.sessions.end(login.id)
                    event(logging.WARNING, "web_logins_ended", user=user, logins=1,
                          why="joined the admin group" if admin else "left the admin group")

    async def sweeping(self, app: web.Application) -> AsyncIterator[None]:
        """The sweep every SWEEP_EVERY seconds while the app runs (aiohttp's cleanup context)."""
        async def loop() -> None:
            while True:
                await asyncio.sleep(SWEEP_EVERY)
                try:
                    await self.sweep()
                except Exception as exc:  # one bad sweep must not stop the next
                    event(logging.ERROR, "web_sweep_failed", error=str(exc))
        task = asyncio.create_task(loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _fragment(text: str) -> web.Response:
    return web.Response(text=text, content_type="text/html", headers={"Cache-Control": "no-store"})


def client_address(peer: str | None, forwarded: str | None, trusted: Sequence[IpNetwork]) -> str:
    """Who sent a request: the peer, or when the peer is a trusted proxy, the last address in
    X-Forwarded-For that is not one (proxies append the address they saw; what comes before it
    is the client's to write). A header from anyone else, or an entry that is no address, is not
    believed: the peer it is."""
    if peer is None or not forwarded or not within(peer, trusted):
        return peer or "?"
    for entry in reversed(forwarded.split(",")[-16:]):  # a header of thousands of entries: the last 16 judged
        entry = entry.strip()
        if not within(entry, trusted):
            try:
                return str(ipaddress.ip_address(entry))
            except ValueError:
                return peer
    return peer


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def within(text: str, networks: Sequence[IpNetwork]) -> bool:
    """Whether `text` is an address in one of `networks`."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return False
    return any(address in network for network in networks)


def _plausible(user: str, password: str) -> bool:
    """Worth a PAM conversation: a name and a password of sane length, no control characters
    (a NUL would cut the C string PAM gets)."""
    return (0 < len(user) <= 64 and user.isprintable() and 0 < len(password) <= 512
            and "\0" not in password)


def _usage_sort(query: Any) -> str:
    """The usage tables' order asked for (ValueError: none of views.USAGE_SORTS)."""
    sort = query.get("sort") or "granted"
    if sort not in views.USAGE_SORTS:
        raise ValueError(f"sort is one of {', '.join(views.USAGE_SORTS)}")
    return str(sort)


def _period(query: Any, now: float) -> tuple[float, float, dict[str, str]]:
    """since and until (epoch seconds) from the form's local dates, until included; default the
    last DEFAULT_PERIOD_DAYS days. Raises ValueError with the reason."""
    today = datetime.date.fromtimestamp(now)
    try:
        first = datetime.date.fromisoformat(query.get("since") or str(today - datetime.timedelta(DEFAULT_PERIOD_DAYS - 1)))
        last = datetime.date.fromisoformat(query.get("until") or str(today))
    except ValueError:
        raise ValueError("dates are written YYYY-MM-DD") from None
    if last < first:
        raise ValueError("the period ends before it starts")
    if (last - first).days >= MAX_PERIOD_DAYS:
        raise ValueError(f"at most {MAX_PERIOD_DAYS} days at a time")
    since = time.mktime(first.timetuple())
    until = time.mktime((last + datetime.timedelta(days=1)).timetuple())
    return since, until, {"since": first.isoformat(), "until": last.isoformat()}


@web.middleware
async def _headers(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        exc.headers.update(HEADERS)
        raise
    response.headers.update(HEADERS)
    return response


def _asset(text: str, content_type: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def serve(request: web.Request) -> web.Response:
        return web.Response(text=text, content_type=content_type, headers={"Cache-Control": "max-age=3600"})
    return serve


def build(app_state: Web) -> web.Application:
    w = app_state

    @web.middleware
    async def signed_in(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) \
            -> web.StreamResponse:
        """Whether the request's login still holds, for an open page's script: a login ended on
        the server (logout elsewhere, a locked account) sends that page to the login form. The
        connection's request is whole: the guard's time for a first request no longer runs."""
        w.connections.served(request.transport)
        try:
            response = await handler(request)
        except web.HTTPNotFound:  # a page of the site's own, not aiohttp's bare "404: Not Found"
            response = w.page(request, await w.viewer(request), "Not found", pages.message_page(
                "Not found", f"There is no page {request.path} here."), status=404)
        except web.HTTPException as exc:  # a redirect to the login form included
            exc.headers["X-Gpuguard-Signed-In"] = "1" if w.login_of(request) else "0"
            raise
        response.headers["X-Gpuguard-Signed-In"] = "1" if w.login_of(request) else "0"
        return response

    app = web.Application(middlewares=[_headers, signed_in], client_max_size=MAX_BODY)
    app.add_routes([
        web.get("/", w.now), web.get("/fragment/now", w.now_fragment),
        web.get("/queue", w.queue_page), web.get("/fragment/queue", w.queue_fragment),
        web.get("/me", w.me), web.get("/users/{name}", w.user), web.get("/fragment/processes/{name}", w.processes_fragment),
        web.get("/usage", w.usage), web.get("/usage.csv", w.usage_csv), web.get("/history", w.history),
        web.get("/login", w.login_form), web.post("/login", w.login), web.post("/logout", w.logout),
        web.post("/users/{name}/logout", w.end_logins), web.get("/fragment/session", w.session_state),
        web.get("/static/style.css", _asset(STYLE, "text/css")),
        web.get("/static/app.js", _asset(SCRIPT, "text/javascript")),
        web.get("/static/icon.svg", _asset(ICON, "image/svg+xml")), web.get("/favicon.ico", _asset(ICON, "image/svg+xml")),
    ])
    app.cleanup_ctx.append(w.sweeping)
    return app
