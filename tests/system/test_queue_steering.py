"""Steering the queue in a real daemon (issue 22): leaving it (cancel, request --cancel, release,
^C on request --wait), why a request waits (status's REASON column, whoami in words), release
of the idle GPUs only, and a queue grant told with its own end, not an older grant's."""
from __future__ import annotations

import json
import re
import signal
import sqlite3
import time
from pathlib import Path

from conftest import popen_as
from sim_helpers import gpuguard, start_burn, stop_burn
from test_queue_daemon import queue_users, waiting_request

from devtools.harness import wait_for


def test_a_user_leaves_the_queue_with_cancel_and_request_cancel(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice, bob = d.add_member(), d.add_member()
    d.open_session(alice)
    d.open_session(bob)  # no GPU free: the login queues
    assert queue_users(d) == [bob.name]

    left = d.cli_as(bob, "cancel")

    assert (left.returncode, left.stdout) == (0, "gpuguard: you left the queue (you were number 1 of 1); "
                                                 "your GPUs, if any, stay yours\n")
    assert queue_users(d) == []
    again = d.cli_as(bob, "request", "--cancel")
    assert (again.returncode, again.stderr) == (1, "gpuguard: you are not in the queue "
                                                   "(gpuguard whoami shows your GPUs)\n")
    mixed = d.cli_as(bob, "request", "--cancel", "--wait")
    assert (mixed.returncode, mixed.stderr) == (2, "gpuguard: --cancel goes alone (it leaves the queue)\n")
    with waiting_request(d, bob) as waiting:  # back in the queue, then out with request --cancel from elsewhere
        assert d.cli_as(bob, "request", "--cancel").returncode == 0 and queue_users(d) == []
        _, err = waiting.communicate(timeout=30)
    assert (waiting.returncode, err.splitlines()[-1]) == (1, "gpuguard: you left the queue (gpuguard cancel)")


def test_release_while_queued_leaves_the_queue_and_says_so(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice, bob = d.add_member(), d.add_member()
    d.open_session(alice)
    d.open_session(bob)

    released = d.cli_as(bob, "release")

    assert (released.returncode, released.stdout) == (0, "gpuguard: you held no GPU; you left the queue\n")
    assert queue_users(d) == []


def test_interrupting_request_wait_says_it_left_the_queue(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice, bob = d.add_member(), d.add_member()
    d.call_as(alice, "request")
    with waiting_request(d, bob) as waiting:
        waiting.send_signal(signal.SIGINT)  # ^C
        out, err = waiting.communicate(timeout=30)
    assert waiting.returncode == 130
    assert err.splitlines()[-1] == "gpuguard: interrupted: you left the queue"
    assert wait_for(lambda: queue_users(d) == [])


def test_interrupting_a_wait_on_a_logins_place_says_the_place_stays(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice, bob = d.add_member(), d.add_member()
    d.open_session(alice)
    d.open_session(bob)
    waiting = popen_as(bob, gpuguard(d.config_path, "request", "--wait"), stdout=-1, stderr=-1, text=True)
    try:
        # Its place said (the `request` call is over), then its `wait` call connected: a ^C
        # before that would interrupt the request itself, which is another test's case.
        assert waiting.stderr is not None and "in the queue" in waiting.stderr.readline()
        assert wait_for(lambda: _waiting_on(d, waiting))
        waiting.send_signal(signal.SIGINT)
        _, err = waiting.communicate(timeout=30)
    finally:
        if waiting.poll() is None:
            waiting.kill()
    assert "your login keeps its place in the queue (gpuguard cancel leaves it)" in err
    assert queue_users(d) == [bob.name]


def _waiting_on(d, proc) -> bool:
    """The client has its `wait` call in the daemon: it has a socket connected to the daemon's."""
    return any("socket:" in link for link in _fd_links(proc.pid))


def _fd_links(pid: int) -> list[str]:
    import os
    try:
        return [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return []


def test_release_gives_back_the_idle_gpus_and_names_the_busy_one(start_daemon):
    d = start_daemon(defaults={"gpus": 2}, gate=False)
    alice = d.add_member()
    first, second = json.loads(d.cli_as(alice, "request", "--json").stdout)["gpus"]
    burn = start_burn(d.config_path, first, user=alice)
    try:
        released = d.cli_as(alice, "release")
        assert released.returncode == 0, released.stderr
        assert released.stdout == (f"gpuguard: released GPU {second}; GPU {first} stays, still in use by your "
                                   f"process {burn.pid}: end it (kill {burn.pid}) or let it finish, then gpuguard "
                                   f"release --gpu {first}\n")
        assert d.granted_minors(alice) == [first] and burn.poll() is None
        all_busy = d.cli_as(alice, "release")
        assert all_busy.returncode == 1
        assert (f"GPU {first} is still in use by your process {burn.pid}: end it (kill {burn.pid}) or let it "
                f"finish, then gpuguard release --gpu {first}") in all_busy.stderr
    finally:
        stop_burn(burn)


def test_status_shows_why_each_request_waits_and_for_how_long(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice, bob, carol = d.add_member(), d.add_member(), d.add_member()
    d.write_config(count=1, gate=False, quotas={"users": {carol.name: {"priority": 5}}})
    d.reload()
    d.open_session(alice)
    d.open_session(bob)
    d.open_session(carol)  # later, but ahead of bob by priority

    queue = d.call("status")["queue"]
    assert [(q["user"], q["reason"]) for q in queue] == [(carol.name, "Resources"), (bob.name, "Priority")]
    assert all(q["waited"] >= 0 for q in queue)
    table = d.cli_as(bob, "status").stdout
    header = next(line for line in table.splitlines() if "REASON" in line)
    assert header.split() == ["#", "USER", "GPUS", "SINCE", "WAITED", "PRIORITY", "REASON"]
    assert re.search(rf"2 +{bob.name} +1 +\S+ +<1m +0 +Priority", table), table


def test_whoami_while_queued_says_who_holds_the_gpus_and_what_to_do(start_daemon):
    d = start_daemon(count=1, gate=False, defaults={"gpus": 1, "max_time": "1h"})
    alice, bob = d.add_member(), d.add_member()
    d.open_session(alice)
    d.open_session(bob)

    shown = d.cli_as(bob, "whoami").stdout

    assert "GPUs: none (you are in the queue, below)" in shown and "request --wait queues" not in shown
    assert f"  held: GPU 0 by {alice.name}\n" in shown
    # (a weekday before the time when the hour ahead crosses midnight: messages.clock)
    assert re.search(r"  the first grant to end runs until (\w{3} )?\d\d:\d\d \(in (59m|1h)\)\n", shown), shown
    assert "gpuguard cancel" in shown


def test_a_queue_grant_is_told_with_its_own_end_not_an_older_grants(start_daemon):
    d = start_daemon(count=2, gate=False, defaults={"gpus": 2})
    alice, bob = d.add_member(), d.add_member()
    assert d.cli("grant", bob.name, "--gpu", "0", "--for", "1h").returncode == 0
    d.call_as(alice, "request", gpus=1)  # GPU 1
    with waiting_request(d, bob) as waiting:
        assert d.cli_as(alice, "release").returncode == 0
        _, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 0, err
    told = err.splitlines()[-1]  # the words on stderr, the export alone on stdout
    assert told.startswith("gpuguard: GPU 1 (") and " until " not in told, told  # no time limit of its own
    assert [g["expires_at"] is None for g in d.grants(bob)] == [False, True]


def test_root_takes_a_users_request_out_and_others_may_not(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice, bob = d.add_member(), d.add_member()
    d.open_session(alice)
    d.open_session(bob)

    refused = d.cli_as(alice, "cancel", "--user", bob.name)
    assert (refused.returncode, refused.stderr) == (
        1, "gpuguard: only root may take another user's requests out of the queue\n")
    taken = d.cli("cancel", "--user", bob.name)
    assert (taken.returncode, taken.stdout) == (
        0, f"gpuguard: took {bob.name}'s requests out of the queue (number 1 of 1); they were told\n")
    assert queue_users(d) == []
    again = d.cli("cancel", "--user", bob.name)
    assert (again.returncode, again.stderr) == (1, f"gpuguard: {bob.name} is not in the queue\n")


def test_fairshare_lists_recent_usage_per_share_in_queue_order(start_daemon):
    d = start_daemon(count=2, gate=False)
    alice, bob, carol = d.add_member(), d.add_member(), d.add_member()
    d.write_config(count=2, gate=False, quotas={"users": {bob.name: {"share": 4}, carol.name: {"priority": 1}}})
    d.reload()
    d.call_as(alice, "request")
    d.call_as(bob, "request")  # both hold one GPU from now on: the same usage, bob's divided by 4
    assert wait_for(lambda: all(u["usage"] > 0 for u in d.call_as(carol, "fairshare")["users"]))

    listed = d.call_as(carol, "fairshare")["users"]  # anyone may look, as with sshare

    assert [u["user"] for u in listed] == [bob.name, alice.name]  # carol has no usage: not listed
    by_name = {u["user"]: u for u in listed}
    assert by_name[bob.name]["share"] == 4 and by_name[alice.name]["share"] == 1
    assert by_name[bob.name]["normalized"] == by_name[bob.name]["usage"] / 4
    table = d.cli_as(carol, "fairshare").stdout.splitlines()
    assert table[1].split() == ["USER", "PRIORITY", "SHARE", "GPU-HOURS", "PER", "SHARE"]
    assert table[2].split()[:3] == [bob.name, "0", "4"] and table[3].split()[:3] == [alice.name, "0", "1"]


def test_a_gpu_may_be_named_by_its_uuid_as_nvidia_smi_and_cuda_show_it(start_daemon):
    d = start_daemon(count=2, gate=False, defaults={"gpus": 2})
    alice = d.add_member()
    uuid = d.uuid(1)
    granted = d.cli("grant", alice.name, "--gpu", uuid)
    assert granted.returncode == 0 and d.granted_minors(alice) == [1], granted
    released = d.cli_as(alice, "release", "--gpu", uuid)
    assert (released.returncode, released.stdout) == (0, "gpuguard: released GPU 1\n")
    unknown = d.cli("grant", alice.name, "--gpu", "GPU-00000000-0000-0000-0000-000000000000")
    assert (unknown.returncode, unknown.stderr) == (
        2, "gpuguard: --gpu: no GPU or MIG slice 'GPU-00000000-0000-0000-0000-000000000000' on this machine\n")


def test_root_holds_a_request_it_keeps_its_place_is_not_served_and_survives_a_restart(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice, bob, carol = d.add_member(), d.add_member(), d.add_member()
    d.call_as(alice, "request")
    d.open_session(bob)
    d.open_session(carol)  # behind bob

    held = d.cli("hold", bob.name)

    assert (held.returncode, held.stdout) == (0, f"gpuguard: held {bob.name}'s request in the queue; they were told\n")
    assert [(q["user"], q["reason"]) for q in d.call("status")["queue"]] == [(bob.name, "Held"),
                                                                           (carol.name, "Resources")]
    assert "root holds your request" in d.cli_as(bob, "whoami").stdout
    d.restart()
    assert d.cli_as(alice, "release").returncode == 0
    assert wait_for(lambda: d.granted_minors(carol) == [0])  # bob keeps his place, but carol is served
    assert d.granted_minors(bob) == [] and [q["user"] for q in d.call("status")["queue"]] == [bob.name]
    assert d.cli("hold", bob.name, "--off").returncode == 0
    assert [q["reason"] for q in d.call("status")["queue"]] == ["Resources"]
    refused = d.cli_as(carol, "hold", bob.name)
    assert (refused.returncode, refused.stderr) == (1, "gpuguard: hold is for root only\n")


def read_bytes(d) -> int:
    """What the daemon has read so far (its /proc/PID/io rchar): NSS's files included."""
    with open(f"/proc/{d.proc.pid}/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


def test_fairshare_asks_nss_for_a_user_once_a_minute_not_at_every_call(start_daemon, make_user):
    d = start_daemon(count=1, gate=False)
    d.stop()
    charged = 1000  # users charged once, deleted since (their usage counts until it decays)
    with sqlite3.connect(d.config.paths.state_dir / "state.db") as db:
        db.executemany("INSERT INTO fairshare (uid, value, at) VALUES (?, 3600.0, ?)",
                       [(5_000_000 + i, time.time()) for i in range(charged)])
    db.close()
    d.restart()
    stranger = make_user()  # anyone may ask, no membership needed
    assert len(d.call_as(stranger, "fairshare")["users"]) == charged
    one_pass = charged * Path("/etc/passwd").stat().st_size  # each lookup of a uid reads it all, at least
    before = read_bytes(d)
    for _ in range(3):
        listed = d.call_as(stranger, "fairshare")["users"]
        assert len(listed) == charged and listed[0]["user"] == str(listed[0]["uid"])
    # Before: each call looked up every user again, 7.8 MB of NSS's files read per call for 1,000
    # users (the daemon read none of it for the calls after the first).
    assert read_bytes(d) - before < one_pass, read_bytes(d) - before
