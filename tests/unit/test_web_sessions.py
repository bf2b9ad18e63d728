"""Server-side sessions, CSRF tokens, the login delay and the key file (pure but for a temporary directory)."""
from __future__ import annotations

import asyncio
import os
import stat

import pytest

from gpuguard.web.sessions import LoginDelay, SessionKeyError, Sessions, Signer, load_key
from gpuguard.web.sources import Memo

KEY = b"k" * 32


def test_a_login_is_found_by_its_id_until_it_ends_or_expires():
    sessions = Sessions(per_user=2)
    login = sessions.open("alice", admin=False, expires=1000.0)
    assert sessions.get(login.id, now=999.0) == login and len(login.id) >= 40
    assert sessions.get(login.id + "x", 0.0) is None and sessions.get(None, 0.0) is None and sessions.get("", 0.0) is None
    assert sessions.get(login.id, now=1000.0) is None
    assert sessions.get(login.id, now=0.0) is None  # dropped when it expired
    again = sessions.open("alice", admin=False, expires=1000.0)
    sessions.end(again.id)
    assert sessions.get(again.id, 0.0) is None


def test_a_users_logins_are_bounded_and_end_together():
    sessions = Sessions(per_user=2)
    first, second, third = (sessions.open("alice", False, 1000.0) for _ in range(3))
    bob = sessions.open("bob", True, 1000.0)
    assert sessions.get(first.id, 0.0) is None  # the oldest gave way
    assert sessions.get(second.id, 0.0) == second and sessions.get(third.id, 0.0) == third
    assert sessions.end_user("alice") == 2
    assert sessions.live() == [bob]


def test_a_csrf_token_is_bound_to_its_key_and_value():
    signer = Signer(KEY)
    token = signer.csrf("login:seed")
    assert signer.csrf_ok(token, "login:seed")
    assert not signer.csrf_ok(token, "login:other")
    assert not signer.csrf_ok(token, None) and not signer.csrf_ok("", "login:seed")
    assert not Signer(b"o" * 32).csrf_ok(token, "login:seed")


def test_failures_delay_that_name_from_that_client_only_growing_and_forgotten():
    delay = LoginDelay(free=3, base=1.0, most=8.0, forget=600.0)
    for i in range(3):
        assert delay.wait("alice", "10.0.0.1", float(i)) == 0
        assert delay.failed("alice", "10.0.0.1", float(i)).until == float(i)  # the first three are free
    waits = [delay.failed("alice", "10.0.0.1", 10.0).until - 10.0 for _ in range(5)]
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0]  # doubled, up to `most`
    assert delay.wait("alice", "10.0.0.1", 12.0) == 6.0
    assert delay.wait("alice", "10.0.0.2", 12.0) == 0  # alice from elsewhere
    assert delay.wait("bob", "10.0.0.1", 12.0) == 0    # another name from there
    assert delay.wait("alice", "10.0.0.1", 610.0) == 0  # forgotten
    assert delay.failed("alice", "10.0.0.1", 611.0).count == 1
    delay.succeeded("alice", "10.0.0.1")
    assert len(delay) == 0


def test_a_flood_of_new_names_or_clients_evicts_no_record_and_delays_itself():
    delay = LoginDelay(free=0, per_user=4, per_client=4, total=20)
    for _ in range(5):
        delay.failed("alice", "10.0.0.1", 0.0)  # the guesser's record (16 s to wait), to be kept
    for i in range(500):  # new addresses for alice, new names from one address, new pairs
        delay.failed("alice", f"127.0.{i // 256}.{i % 256}", 1.0)
        delay.failed(f"junk{i}" * 20, "127.9.9.9", 1.0)
        delay.failed(f"n{i}", f"10.1.{i // 256}.{i % 256}", 1.0)
    assert len(delay) <= 20 + 3  # the bound, and the three shared records past it
    assert delay.wait("alice", "10.0.0.1", 1.0) == 15.0
    assert delay.wait("alice", "127.200.0.1", 1.0) > 0       # a new client for alice: alice's shared record
    assert delay.wait("junkX", "127.9.9.9", 1.0) > 0          # a new name from that client: its shared record
    assert delay.wait("bob", "10.0.0.1", 1.0) > 0             # the table is full: the everyone's record
    assert delay.wait("bob", "10.0.0.1", 1.0 + 3600.0) == 0   # until the flood is forgotten


def test_the_key_file_is_made_once_private_and_checked(tmp_path):
    path = tmp_path / "web" / "session.key"
    key = load_key(path)
    assert len(key) == 32 and load_key(path) == key
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    path.write_bytes(b"short")
    with pytest.raises(SessionKeyError, match="too short"):
        load_key(path)


def test_memo_asks_once_per_window_and_again_after_a_failure():
    calls = []
    clock = [0.0]

    async def make():
        calls.append(clock[0])
        await asyncio.sleep(0)
        if len(calls) == 3:
            raise OSError("down")
        return len(calls)

    async def scenario():
        memo = Memo(1.0, clock=lambda: clock[0])
        together = await asyncio.gather(*(memo.get("k", make) for _ in range(10)))
        assert together == [1] * 10 and len(calls) == 1
        clock[0] = 1.5
        assert await memo.get("k", make) == 2
        clock[0] = 3.0
        with pytest.raises(OSError):
            await memo.get("k", make)
        assert await memo.get("k", make) == 4  # a failure is not kept
    asyncio.run(scenario())
