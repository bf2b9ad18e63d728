"""Floods of failed web logins, over real HTTP through the real PAM stack (pam_unix against
/etc/shadow), from other loopback addresses (any user can bind 127.x.y.z) or, through a trusted
proxy (127.0.0.1) and X-Forwarded-For, from fresh addresses: they must neither take every PAM
conversation from the others nor lock a named user out of an address they do not use.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import http.client
import threading
import time

import pytest
from web_harness import FormClient, set_cookie, set_password

pytestmark = pytest.mark.gate

PASSWORD = "ggt correct horse 7"
FLOODERS = 6   # past the 1 conversation and 4 waiters a client may hold
TRIES = 10
FLOOD_START = 60.0  # seconds for the flood's first failures to be answered
FRESH_FLOODERS = 72  # past the 2 conversations and 64 waiters, each try from a fresh /64
PROXY = "127.0.0.1"  # the web's trusted proxy in these tests: X-Forwarded-For names the client


def test_one_clients_made_up_names_leave_everyone_else_their_logins(start_daemon, web):
    """The finding: 4 threads from 127.0.0.2 posting fresh made-up names (3 free failures each,
    each holding one of the 2 PAM conversations ~2 s) got alice's right password 503 on 10 of 10."""
    daemon = start_daemon(web=web.prepare())
    alice = daemon.add_member()
    set_password(alice, PASSWORD)
    site = web.start(daemon)
    stop = threading.Event()
    seen: collections.Counter = collections.Counter()

    def flood(worker: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            with contextlib.suppress(OSError, http.client.HTTPException):
                seen[FormClient(site.url, "127.0.0.2").log_in(f"ggt-nobody{worker}x{n}", "guess").status] += 1

    tries: collections.Counter = collections.Counter()
    with concurrent.futures.ThreadPoolExecutor(FLOODERS) as pool:
        flooders = [pool.submit(flood, worker) for worker in range(FLOODERS)]
        try:
            deadline = time.monotonic() + FLOOD_START
            while seen[401] < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert seen[401] >= 2, dict(seen)  # the flood's failures count against 127.0.0.2 from now on
            for _ in range(TRIES):
                tries[FormClient(site.url, "127.0.0.1").log_in(alice.name, PASSWORD).status] += 1
        finally:
            stop.set()
        for flooder in flooders:
            flooder.result()
    print(f"alice's right password during the flood: {dict(tries)}; the flood's answers: {dict(seen)}")
    assert tries == {303: TRIES}
    assert seen[503] > 0  # the flooder past its share refused, taking no conversation
    assert "event=web_login_busy" in site.log() and "client=127.0.0.2" in site.log()
    assert "Traceback" not in site.log()


def test_failures_as_bob_from_many_addresses_do_not_lock_him_out_elsewhere(start_daemon, web):
    """The finding: after one failure as bob from each of 64 addresses, every new address shared
    one record, so 7 more failures made bob's right password 429 from an address never used."""
    daemon = start_daemon(web=web.prepare(fail_delay=False))  # 76 failures, no 2 s each
    bob = daemon.add_member()
    set_password(bob, PASSWORD)
    site = web.start(daemon)
    attackers = [f"127.7.{i // 250}.{i % 250 + 1}" for i in range(71)]
    statuses = collections.Counter(FormClient(site.url, source).log_in(bob.name, "guess").status
                                   for source in attackers)
    last = FormClient(site.url, attackers[-1])
    while True:  # the last address fails on until told to wait 4 s (failures 4, 5, 6 wait 1, 2, 4 s)
        reply = last.log_in(bob.name, "guess")
        if reply.status != 429:
            statuses[reply.status] += 1
        elif int(reply.getheader("Retry-After")) >= 4:
            break
        else:
            time.sleep(int(reply.getheader("Retry-After")))
    assert statuses == {401: len(attackers) + 5}, statuses
    assert last.log_in(bob.name, PASSWORD).status == 429  # the attacker's own address waits, even so

    for source in ("127.0.0.1", "127.8.0.1"):  # bob, from addresses the attacker never used
        reply = FormClient(site.url, source).log_in(bob.name, PASSWORD)
        assert reply.status == 303, (source, reply.status, reply.text)


def fresh_flood(site, stop: threading.Event, seen: collections.Counter, worker: int) -> None:
    """Failed logins from a fresh /64 each (an IPv6 /48's), through the proxy: standing 0 every one."""
    n = 0
    while not stop.is_set():
        n += 1
        forwarded = {"X-Forwarded-For": f"2001:db8:{worker:x}:{n:x}::1"}
        with contextlib.suppress(OSError, http.client.HTTPException):
            seen[FormClient(site.url, PROXY).log_in(f"ggt-nobody{worker}x{n}", "guess", forwarded).status] += 1


def test_a_flood_from_fresh_addresses_leaves_a_device_cookie_its_login(start_daemon, web):
    """The finding: fresh addresses stand at 0 each and filled the 64 waiters, so carol (0) and
    alice (1 after a typo) got 503 "the queue is full". bob, whose browser logged in before and
    keeps its device cookie, goes ahead of them all."""
    daemon = start_daemon(web=web.prepare(trusted_proxies=[PROXY]))
    bob, carol = daemon.add_member(), daemon.add_member()
    for user in (bob, carol):
        set_password(user, PASSWORD)
    site = web.start(daemon)
    home = {"X-Forwarded-For": "192.0.2.2"}
    first = FormClient(site.url, PROXY).log_in(bob.name, PASSWORD, home)
    assert first.status == 303, first.text
    device = set_cookie(first, "__Host-gpuguard-device")  # kept by bob's browser (HTTPS or loopback)

    stop = threading.Event()
    seen: collections.Counter = collections.Counter()
    tries: dict[str, collections.Counter] = {"bob": collections.Counter(), "carol": collections.Counter()}
    with concurrent.futures.ThreadPoolExecutor(FRESH_FLOODERS) as pool:
        flooders = [pool.submit(fresh_flood, site, stop, seen, worker) for worker in range(FRESH_FLOODERS)]
        try:
            deadline = time.monotonic() + FLOOD_START
            while seen[503] < 20 and time.monotonic() < deadline:  # fresh clients: 503 only when the queue is full
                time.sleep(0.2)
            assert seen[503] >= 20, dict(seen)
            for _ in range(3):
                reply = FormClient(site.url, PROXY).log_in(carol.name, PASSWORD, {"X-Forwarded-For": "192.0.2.3"})
                tries["carol"][reply.status] += 1
                reply = FormClient(site.url, PROXY).log_in(bob.name, PASSWORD, home, cookies=device)
                tries["bob"][reply.status] += 1
        finally:
            stop.set()
        for flooder in flooders:
            flooder.result()
    print(f"during the flood: {tries}; the flood's answers: {dict(seen)}")
    assert tries["bob"] == {303: 3}
    assert tries["carol"][503] > 0  # no cookie: the full queue keeps her out, as it did bob before
    assert "the queue is full" in site.log() and "Traceback" not in site.log()


def test_failures_from_one_ipv6_address_do_not_delay_the_name_from_its_64(start_daemon, web):
    """The finding: the delay counted an IPv6 /64 as one client, so a campus LAN's host failing
    as bob delayed bob on all of its hosts (6 failures from ::66: ::10 waited 3 s, up to 300 s)."""
    daemon = start_daemon(web=web.prepare(fail_delay=False, trusted_proxies=[PROXY]))
    bob = daemon.add_member()
    set_password(bob, PASSWORD)
    site = web.start(daemon)
    guesser = FormClient(site.url, PROXY)
    lan = "2001:db8:5:6::"
    statuses = [guesser.log_in(bob.name, "guess", {"X-Forwarded-For": lan + "66"}).status for _ in range(4)]
    assert statuses == [401] * 4  # the 4th makes ::66 wait 1 s
    delayed = guesser.log_in(bob.name, PASSWORD, {"X-Forwarded-For": lan + "66"})
    assert delayed.status == 429 and "try again in" in delayed.text  # the guesser's own address waits
    reply = FormClient(site.url, PROXY).log_in(bob.name, PASSWORD, {"X-Forwarded-For": lan + "10"})
    assert reply.status == 303, reply.text  # bob, from another host of the /64
    failed = [line for line in site.log().splitlines() if "event=web_login_failed" in line]
    assert len(failed) == 4 and all("client=2001:db8:5:6::66" in line for line in failed)
