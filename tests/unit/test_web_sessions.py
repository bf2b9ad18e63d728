"""Server-side sessions, CSRF tokens, the login delay and the key file (pure but for a temporary directory)."""
from __future__ import annotations

import asyncio
import os
import stat

import pytest

from gpuguard.web.sessions import LoginDelay, SessionKeyError, Sessions, Signer, load_key
from gpuguard.web.slots import client_key
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


def test_failures_from_many_addresses_never_delay_the_name_from_a_new_one():
    """The finding: after 64 addresses had failed for bob, every new address shared one record, so
    65 addresses locked bob out from everywhere. Now the oldest of bob's records gives way."""
    delay = LoginDelay(free=3, per_user=4, per_client=4, total=100)
    for i in range(40):  # 40 addresses, each past its free tries
        for _ in range(6):
            delay.failed("bob", f"10.7.0.{i}", 1.0)
    assert delay.wait("bob", "10.7.0.39", 1.0) > 0   # the newest attacker's address still waits
    assert delay.wait("bob", "10.7.0.0", 1.0) == 0   # the oldest gave way
    assert delay.wait("bob", "192.0.2.9", 1.0) == 0  # bob, from anywhere else
    assert delay.failed("bob", "192.0.2.9", 1.0).count == 1  # a record of its own, no shared one
    assert len(delay) == 4


def test_a_clients_names_past_its_bound_share_that_clients_record_only():
    delay = LoginDelay(free=3, per_user=4, per_client=4, total=100)
    for i in range(50):  # made-up names from one address
        delay.failed(f"junk{i}", "127.9.9.9", 1.0)
    assert delay.wait("newname", "127.9.9.9", 1.0) > 0   # that address's next made-up name waits
    assert delay.wait("junk49", "10.0.0.1", 1.0) == 0    # the same name from elsewhere does not
    assert delay.wait("alice", "10.0.0.1", 1.0) == 0
    assert len(delay) == 4 + 1  # its four names and its shared record


def test_a_full_table_gives_way_oldest_first_and_no_new_pair_waits():
    delay = LoginDelay(free=0, per_user=4, per_client=4, total=20, forget=600.0)
    for _ in range(5):
        delay.failed("alice", "10.0.0.1", 0.0)  # the guesser's record (16 s to wait)
    for i in range(10):  # pairs of a later failure fill the table past its bound
        delay.failed(f"n{i}", f"10.1.0.{i}", 1.0)
    assert delay.wait("alice", "10.0.0.1", 1.0) == 15.0  # room enough: kept
    for i in range(500):
        delay.failed(f"n{i}", f"10.1.{i // 256}.{i % 256}", 2.0)
    assert len(delay) == 20
    assert delay.wait("bob", "10.0.0.1", 2.0) == 0   # no everyone's record that would delay bob
    assert delay.wait("n499", "10.1.1.243", 2.0) > 0  # the newest kept
    assert delay.wait("alice", "10.0.0.1", 2.0) == 0  # the oldest gave way
    assert delay.wait("n499", "10.1.1.243", 602.0) == 0  # forgotten


def test_a_clients_failures_over_all_names_are_its_standing_and_forgotten():
    delay = LoginDelay(free=3, forget=600.0, total=3)
    for i in range(7):
        delay.failed(f"made-up-{i}", "127.0.0.2", float(i))
    delay.failed("alice", "127.0.0.1", 7.0)
    assert delay.standing("127.0.0.2", 7.0) == 7 and delay.standing("127.0.0.1", 7.0) == 1
    assert delay.standing("10.0.0.1", 7.0) == 0
    delay.succeeded("alice", "127.0.0.1")  # a success forgives the pair, not the client's standing
    assert delay.standing("127.0.0.1", 7.0) == 1
    assert delay.standing("127.0.0.2", 607.0) == 0  # forgotten
    for i in range(5):  # bounded: the oldest client gives way
        delay.failed("x", f"10.0.0.{i}", 700.0 + i)
    assert delay.standing("10.0.0.0", 704.0) == 0 and delay.standing("10.0.0.4", 704.0) == 1


def test_the_delay_is_the_addresss_and_the_standing_its_groups():
    """The finding: keyed by the /64, 6 failures as bob from ::66 made bob wait from ::10, a
    host of the same campus LAN. The delay is the exact address's; the standing is the /64's."""
    delay = LoginDelay(free=3, standing_of=client_key)
    for i in range(6):
        delay.failed("bob", "2001:db8::66", float(i))
    assert delay.wait("bob", "2001:db8::66", 5.0) == 4.0
    assert delay.wait("bob", "2001:db8::10", 5.0) == 0  # another host of the /64
    assert delay.standing("2001:db8::10", 5.0) == 6     # but it stands with its /64
    assert delay.standing("2001:db8:0:1::10", 5.0) == 0
    assert LoginDelay().standing_of("2001:db8::66") == "2001:db8::66"  # by default the client as named


def test_a_device_cookie_is_the_names_and_the_keys_only():
    signer = Signer(KEY)
    cookie = signer.device("bob")
    assert signer.device_ok(cookie, "bob") and cookie == Signer(KEY).device("bob")
    assert not signer.device_ok(cookie, "alice") and not signer.device_ok(None, "bob")
    assert not signer.device_ok("", "bob") and not Signer(b"j" * 32).device_ok(cookie, "bob")
    assert cookie != signer.csrf("bob")  # a purpose of its own: no CSRF token is a device cookie


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
