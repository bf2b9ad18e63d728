"""The web's connection guard over fake transports and a fake clock (the real listener under a
flood: tests/system/test_web.py)."""
from __future__ import annotations

import logging

from aiohttp.http_exceptions import BadHttpMessage

from gpuguard.web.connections import Guard, Malformed


class Transport:
    def __init__(self, peer: str) -> None:
        self.peer, self.closed = peer, None

    def get_extra_info(self, name):
        return (self.peer, 40000) if name == "peername" else None

    def close(self):
        self.closed = "close"

    def abort(self):
        self.closed = "abort"


def test_per_client_cap_with_trusted_proxies_excepted():
    guard = Guard(total=100, per_client=2, exempt=lambda peer: peer == "10.0.0.9")
    served = []
    for _ in range(2):
        served.append(Transport("192.0.2.2"))
        assert guard.admit(served[-1])
        guard.served(served[-1])
    assert not guard.admit(Transport("192.0.2.2"))  # its two have sent requests: refused
    assert guard.admit(Transport("192.0.2.3"))
    assert all(guard.admit(Transport("10.0.0.9")) for _ in range(5))
    assert guard.refused.total == 1


def test_all_of_loopback_is_one_client_but_a_trusted_proxy_there_is_not_counted_in_it():
    guard = Guard(total=100, per_client=2, exempt=lambda peer: peer == "127.0.0.1")
    assert all(guard.admit(Transport("127.0.0.1")) for _ in range(5))  # the proxy: no cap, not loopback's
    idler, browser = Transport("127.0.0.2"), Transport("::1")
    assert guard.admit(idler) and guard.admit(browser)
    guard.served(browser)
    late = Transport("::ffff:127.9.9.9")
    assert guard.admit(late) and idler.closed == "abort"  # its own idler gave way
    guard.served(late)
    assert not guard.admit(Transport("127.0.0.3"))  # loopback's two have sent requests: refused
    assert guard.admit(Transport("192.0.2.2"))
    assert guard.refused.total == 1


def test_when_full_the_oldest_without_a_request_gives_way_then_new_ones_are_refused():
    guard = Guard(total=3)
    first, second, third = (Transport(f"127.0.0.{i}") for i in range(3))
    for t in (first, second, third):
        assert guard.admit(t)
    guard.served(first)
    browser = Transport("127.0.0.1")
    assert guard.admit(browser) and second.closed == "abort" and first.closed is None
    guard.served(third)
    guard.served(browser)
    assert not guard.admit(Transport("127.0.0.5"))  # every one has sent a request: refused
    assert len(guard) == 3


def test_connections_past_their_time_are_closed():
    now = [0.0]
    guard = Guard(total=10, first_request=10.0, idle=15.0, clock=lambda: now[0])
    silent, talking, served = Transport("a"), Transport("b"), Transport("c")
    for t in (silent, talking, served):
        guard.admit(t)
    guard.served(served)
    now[0] = 9.0
    guard.heard(talking)
    guard.heard(served)
    guard.check()
    assert silent.closed is None
    now[0] = 10.0
    guard.check()
    assert silent.closed == "close" and talking.closed == "close"  # a trickle is no request
    assert served.closed is None
    now[0] = 24.0
    guard.check()
    assert served.closed == "close" and len(guard) == 0


def test_a_malformed_request_is_counted_not_a_traceback(caplog):
    logger = logging.getLogger("ggt-aiohttp-server")
    logger.addFilter(malformed := Malformed())
    with caplog.at_level(logging.DEBUG, logger="ggt-aiohttp-server"):
        for _ in range(50):
            try:
                raise BadHttpMessage("Too many headers")
            except BadHttpMessage:
                logger.exception("Error handling request from %s", "127.0.0.2")
        try:
            raise KeyError("a bug of ours")
        except KeyError:
            logger.exception("Error handling request from %s", "127.0.0.1")
    assert malformed.counted.total == 50
    assert [r.exc_info[0] for r in caplog.records if r.name == "ggt-aiohttp-server"] == [KeyError]
