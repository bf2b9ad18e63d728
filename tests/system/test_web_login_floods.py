"""Floods of failed web logins, over real HTTP through the real PAM stack (pam_unix against
/etc/shadow), from other loopback addresses (any user can bind 127.x.y.z): they must neither take
every PAM conversation from the others nor lock a named user out of an address they do not use.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import http.client
import threading
import time

import pytest
from web_harness import FormClient, set_password

pytestmark = pytest.mark.gate

PASSWORD = "ggt correct horse 7"
FLOODERS = 6   # past the 1 conversation and 4 waiters a client may hold
TRIES = 10
FLOOD_START = 60.0  # seconds for the flood's first failures to be answered


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
