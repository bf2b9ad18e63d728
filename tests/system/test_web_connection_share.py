"""One host's connections to a real `gpuguard web`, whatever addresses it takes: any local user
can bind every address of 127/8, so loopback is one client of the connection guard, and a flood
of kept-alive connections from thousands of its addresses leaves room for a user from elsewhere."""
from __future__ import annotations

import contextlib
import http.client
import resource
import socket

import pytest

pytestmark = pytest.mark.gate

FLOOD = 300          # kept-alive connections, each from a loopback address of its own
DESCRIPTORS = 512    # the web's RLIMIT_NOFILE: total_for(512) = 128 connections, fewer than FLOOD
ELSEWHERE = "192.0.2.2"  # an address of this machine's that is not loopback: a user on the LAN


def other_address() -> str | None:
    """An address of this machine's outside loopback that a socket can bind (None: there is none)."""
    with socket.socket() as probe:
        try:
            probe.bind((ELSEWHERE, 0))
        except OSError:
            return None
    return ELSEWHERE


def test_a_loopback_flood_of_served_connections_leaves_room_for_others(start_daemon, web):
    source = other_address()
    if source is None:
        pytest.skip(f"no address {ELSEWHERE} on this machine to come from")
    daemon = start_daemon(web=web.prepare())
    site = web.start(daemon, descriptors=DESCRIPTORS, host="0.0.0.0")
    port = int(site.url.rsplit(":", 1)[1])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, FLOOD + 256), hard))
    held = []
    try:
        for i in range(FLOOD):  # a whole request each (served: never pushed out), then kept alive
            flooder = socket.socket()
            held.append(flooder)
            flooder.settimeout(5)
            flooder.bind((f"127.6.{i // 250}.{i % 250 + 1}", 0))
            with contextlib.suppress(OSError):
                flooder.connect(("127.0.0.1", port))
                flooder.sendall(b"GET /static/icon.svg HTTP/1.1\r\nHost: x\r\n\r\n")
                flooder.recv(65536)  # the answer: the request was whole, the connection stays open
        connection = http.client.HTTPConnection(source, port, timeout=10, source_address=(source, 0))
        try:
            connection.request("GET", "/")
            response = connection.getresponse()
            status, body = response.status, response.read().decode(errors="replace")
        except OSError as exc:
            status, body = None, repr(exc)
        finally:
            connection.close()
    finally:
        for flooder in held:
            flooder.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert status == 200, body
    assert "GPUs now" in body
    log = site.log()
    assert "why=per_client" in log and "client=loopback" in log  # the flood's, counted as one client's
    assert "why=total" not in log
    assert site.proc.poll() is None
