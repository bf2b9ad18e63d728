"""Where root's door is for a users' socket, which doors a caller tries, and how long it waits
between tries (pure: no socket is opened)."""
from __future__ import annotations

import itertools

import pytest

from gpuguard import client, daemon_socket


@pytest.mark.parametrize(("users", "door"), [
    ("/run/gpuguard/gpuguard.sock", "/run/gpuguard/root/gpuguard.sock"),
    ("/tmp/x/y.sock", "/tmp/x/root/y.sock"),
    ("relative.sock", "root/relative.sock"),
])
def test_roots_door_is_in_a_root_directory_beside_the_users_socket(users, door):
    assert daemon_socket.root_door(users) == door


def test_root_tries_its_door_first_and_nobody_else_tries_it():
    assert client.doors("/run/g.sock", 0) == ["/run/root/g.sock", "/run/g.sock"]
    assert client.doors("/run/g.sock", 1000) == ["/run/g.sock"]


def test_the_waits_between_tries_double_up_to_a_cap():
    waits = list(itertools.islice(client.pauses(), 12))
    assert waits[0] == client.FIRST_PAUSE and waits[1] == 2 * client.FIRST_PAUSE
    assert max(waits) == client.LONGEST_PAUSE == waits[-1]
    assert waits == sorted(waits)
