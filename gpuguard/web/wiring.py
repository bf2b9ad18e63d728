"""`gpuguard web`'s composition root: the key, the source, PAM and NSS, then aiohttp's loop.

The source is the fleet database when `[fleet]` is configured (every node of the fleet), else
this server's daemon over its socket.

It runs as its own account (`[web] user`, gpuguard-web in the package's unit), never as root: it
parses what the network sends, and needs no privilege for it. The daemon lets that account read
every user's records and change nothing. PAM (pam_unix) and the sweep read /etc/shadow in this
process where it may; the package's unit gives it no shadow group, and a root helper answers
them instead (login_helper.py says why).
"""
from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import resource
import signal
import socket
import ssl
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from gpuguard.backends import accounts, shadow
from gpuguard.config import Config, WebConfig
from gpuguard.core.errors import NssFailure, UnknownUser
from gpuguard.logs import event
from gpuguard.web.app import Web, build, within
from gpuguard.web.connections import BACKLOG, Guard, Malformed, total_for
from gpuguard.web.counted import Counted
from gpuguard.web.fleet import FleetSource
from gpuguard.web.sessions import Signer, load_key
from gpuguard.web.sources import LocalDaemon, Source


def pam_authenticate(service: str) -> Callable[[str, str, str], bool]:
    """user, password, client address -> whether the PAM service accepts them (authentication and
    account checks), with the client as PAM_RHOST (pam_unix's failure line names it). In this
    process where it may read /etc/shadow; otherwise (the package's unit: no shadow group) by the
    root helper of gpuguard-web-login.socket (login_helper.py says why)."""
    if os.access("/etc/shadow", os.R_OK):
        return in_process_authenticate(service)
    from gpuguard.web.login_helper import ask
    return ask


def in_process_authenticate(service: str) -> Callable[[str, str, str], bool]:
    """pam_authenticate in this process (the login helper's own, as root)."""
    import pam  # python-pam: ctypes over libpam; loaded by `gpuguard web` only

    def authenticate(user: str, password: str, client: str) -> bool:
        authenticator = pam.PamAuthenticator()  # type: ignore[attr-defined]  # typeshed stubs PyPAM, another module named pam
        start = authenticator.pam_authenticate

        # python-pam sets no PAM_RHOST: set on the handle between its pam_start and pam_authenticate.
        def with_rhost(handle: Any, flags: int) -> int:
            authenticator.pam_set_item(handle, pam.PAM_RHOST, ctypes.c_char_p(client.encode()))  # type: ignore[attr-defined]
            return int(start(handle, flags))
        authenticator.pam_authenticate = with_rhost
        return bool(authenticator.authenticate(user, password, service=service, resetcreds=False))
    return authenticate


def groups_of(user: str) -> tuple[str, ...]:
    try:
        return tuple(sorted(accounts.by_name(user).groups))
    except UnknownUser:
        return ()


def ended(users: Sequence[str]) -> dict[str, str]:
    """Why each of `users` whose password login has ended can no longer log in: removed from
    NSS, locked or expired in /etc/shadow (unreadable: logged, and nobody judged by it)."""
    reasons = {}
    for user in users:
        try:
            accounts.by_name(user)
        except NssFailure:  # NSS cannot say: a failure ends nobody
            continue
        except UnknownUser:
            reasons[user] = "removed"
    try:
        if os.access(shadow.SHADOW, os.R_OK):
            return {**shadow.ended(users), **reasons}
        from gpuguard.web import login_helper  # the package's unit: no shadow group (login_helper.py)
        return {**login_helper.ended(users), **reasons}
    except OSError as exc:
        event(logging.WARNING, "web_shadow_unreadable", path=str(shadow.SHADOW), error=exc.strerror or str(exc),
              effect="locked and expired accounts keep their logins until these expire")
        return reasons


def run(config: Config, host: str, port: int) -> None:
    settings = config.web
    fleet = config.fleet  # several servers on one PostgreSQL, when configured
    source: Source = (FleetSource(fleet.database) if fleet is not None
                      else LocalDaemon(config.paths.socket, socket.gethostname()))
    tls = tls_context(settings)  # before anything else: a bad certificate stops the start with its reason
    descriptors = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    trusted = settings.trusted_proxies
    guard = Guard(total_for(descriptors), exempt=lambda peer: within(peer, trusted))
    state = Web(settings, source, Signer(load_key(settings.key_file)), pam_authenticate(settings.pam_service), groups_of,
                ended, connections=guard)
    me = accounts.by_uid(os.geteuid()).name
    if me != settings.user:
        event(logging.WARNING, "web_account", runs_as=me, configured=settings.user,
              effect="the daemon shows this account only its own records")
    event(logging.INFO, "web_started", listen=f"{host}:{port}", user=me, show_users=settings.show_users,
          connections=guard.total, descriptors=descriptors, https=tls is not None)
    logging.getLogger("aiohttp.server").addFilter(Malformed())
    asyncio.run(serve(build(state), host, port, guard, tls))


class _DescriptorsOut:
    """asyncio's report that its accept ran out of descriptors (it stops accepting for a second,
    and reports each time with a traceback) as one counted line; anything else as asyncio would."""

    def __init__(self, otherwise: Callable[[dict[str, Any]], None]):
        self.otherwise = otherwise
        self.counted = Counted("web_descriptors_out")

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            self.counted.add(error=exc.strerror)
        else:
            self.otherwise(context)


def tls_context(settings: WebConfig) -> ssl.SSLContext | None:
    """HTTPS from [web] tls_cert and tls_key, or None for plain HTTP; OSError naming the key."""
    if settings.tls_cert is None and settings.tls_key is None:
        return None
    if settings.tls_cert is None or settings.tls_key is None:
        raise OSError("[web] tls_cert and tls_key go together: set both or neither")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(settings.tls_cert, settings.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise OSError(f"[web] tls_cert {settings.tls_cert} / tls_key {settings.tls_key}: "
                      f"{getattr(exc, 'strerror', None) or exc}") from None
    return context


async def serve(app: web.Application, host: str, port: int, guard: Guard, tls: ssl.SSLContext | None = None) -> None:
    """aiohttp's server behind the connection guard (HTTPS with `tls`), until SIGTERM or SIGINT."""
    # No access log: a line per request (the live refresh polls) would flood the journal.
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=guard.idle)
    await runner.setup()
    server = runner.server
    assert server is not None  # made by setup()
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(_DescriptorsOut(loop.default_exception_handler))
    stop = asyncio.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(number, stop.set)
    listener = await loop.create_server(guard.factory(server), host, port, backlog=BACKLOG, reuse_address=True,
                                        ssl=tls)
    checking = asyncio.create_task(guard.checking())
    try:
        await stop.wait()
    finally:
        checking.cancel()
        listener.close()
        await runner.cleanup()

