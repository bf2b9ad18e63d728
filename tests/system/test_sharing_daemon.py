"""Sharing in a real daemon keeps its promises: sharers' memory quotas never add up to more than
the GPU has, and at most max_sharers users share one GPU; the others queue."""
from __future__ import annotations

import subprocess

from conftest import popen_as
from sim_helpers import gpuguard

from devtools.harness import wait_for


def queue_users(d) -> list[str]:
    return [q["user"] for q in d.call("status")["queue"]]


def test_six_sharers_of_40_gib_on_one_80_gib_gpu_are_two_holders_and_a_queue(start_daemon):
    d = start_daemon(count=1, gate=False, defaults={"sharing": True, "gpu_memory": "40GiB", "max_sharers": 8})
    users = [d.add_member() for _ in range(6)]
    first, second = (d.call_as(user, "request") for user in users[:2])
    assert first["ok"] and second["ok"] and first["granted"] == second["granted"] == [0]
    refused = d.call_as(users[2], "request")  # a third 40 GiB promise would not fit in 80 GiB
    assert not refused["ok"] and "no GPU is free" in refused["error"]
    waiting: list[subprocess.Popen] = []
    try:
        for user in users[2:]:
            waiting.append(popen_as(user, gpuguard(d.config_path, "request", "--wait"), stdout=-1, stderr=-1,
                                    text=True))
            assert wait_for(lambda name=user.name: name in queue_users(d))
        assert queue_users(d) == [u.name for u in users[2:]]
        holders = {g["user"] for g in d.call("status")["gpus"][0]["holders"]}
        assert holders == {users[0].name, users[1].name}

        assert d.cli_as(users[0], "release").returncode == 0  # one promise freed: the first waiter joins
        out, err = waiting[0].communicate(timeout=60)
        assert waiting[0].returncode == 0, err
        assert wait_for(lambda: queue_users(d) == [u.name for u in users[3:]])
        assert d.granted_minors(users[2]) == [0] and d.granted_minors(users[1]) == [0]
    finally:
        for process in waiting:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_max_sharers_caps_a_gpu_even_where_memory_would_fit(start_daemon):
    d = start_daemon(count=1, gate=False, defaults={"sharing": True, "gpu_memory": "10GiB"})  # max_sharers: 2
    users = [d.add_member() for _ in range(3)]
    assert [d.call_as(user, "request")["ok"] for user in users] == [True, True, False]
    assert {g["user"] for g in d.call("status")["gpus"][0]["holders"]} == {users[0].name, users[1].name}
