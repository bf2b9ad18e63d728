"""Server-side sessions, CSRF tokens, the login limit and the key file (pure but for a temporary directory)."""
from __future__ import annotations

import asyncio
import os
import stat

import pytest

from gpuguard.web.sessions import LoginLimit, SessionKeyError, Sessions, Signer, load_key
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


def test_the_login_limit_per_user_and_per_address():
    limit = LoginLimit(per_user=3, per_address=5, window=60.0)
    for i in range(3):
        assert limit.allowed("alice", "10.0.0.1", float(i))
        limit.failed("alice", "10.0.0.1", float(i))
    assert not limit.allowed("alice", "10.0.0.2", 3.0)  # the name, from anywhere
    assert limit.allowed("bob", "10.0.0.1", 3.0)
    limit.failed("bob", "10.0.0.1", 3.0)
    limit.failed("carol", "10.0.0.1", 3.0)
    assert not limit.allowed("dave", "10.0.0.1", 4.0)  # the address, for any name
    assert limit.allowed("alice", "10.0.0.2", 61.0)    # the window passed


def test_the_login_limit_memory_is_bounded():
    limit = LoginLimit(max_keys=100)
    for i in range(1000):
        limit.failed(f"user{i}", f"10.0.{i // 256}.{i % 256}", 0.0)
    assert len(limit._failures) <= 100


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
