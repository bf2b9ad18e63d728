"""What a reload or a login does to grants already given (gpuguard/reload_effects.py), in a real
daemon with real users and groups: a user removed from the GPU group loses grants and queue
place with a notice; a lowered idle_timeout warns before it releases."""
from __future__ import annotations

import subprocess

from devtools.harness import wait_for


def leave_group(user, group: str) -> None:
    subprocess.run(["gpasswd", "-d", user.name, group], check=True, capture_output=True)


def events_of(d, user, rule: str) -> list[dict]:
    return [e for e in d.whoami(user)["events"] if e["rule"] == rule]


def test_a_user_removed_from_the_group_loses_grants_and_queue_place_at_reload(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice, bob = d.add_member(), d.add_member()
    assert d.cli("grant", alice.name, "--gpu", "0").returncode == 0
    d.open_session(bob)  # queued behind alice
    assert [q["user"] for q in d.call("status")["queue"]] == [bob.name]

    leave_group(alice, d.group)
    leave_group(bob, d.group)
    d.reload()

    assert wait_for(lambda: d.grants(alice) == [] and d.call("status")["queue"] == [])
    (revoked,) = events_of(d, alice, "membership")
    assert revoked["kind"] == "revoke" and revoked["message"] == f"no longer in group {d.group}"
    assert f"event=expelled user={alice.name}" in d.log() and f"event=expelled user={bob.name}" in d.log()
    assert d.whoami(alice)["member"] is False


def test_a_user_removed_from_the_group_loses_grants_at_the_next_login(start_daemon):
    d = start_daemon(count=2, gate=False)
    alice = d.add_member()
    assert d.cli("grant", alice.name, "--gpu", "1").returncode == 0
    leave_group(alice, d.group)

    opened = d.open_session(alice)

    assert opened["gpus"] == [] and d.grants(alice) == []
    assert [e["message"] for e in events_of(d, alice, "membership")] == [f"no longer in group {d.group}"]


def test_lowering_idle_timeout_warns_before_it_releases(start_daemon):
    d = start_daemon(count=1, gate=False, defaults={"gpus": 1})
    alice = d.add_member()
    assert d.cli_as(alice, "request").returncode == 0  # no process ever uses it: idle from the start
    assert wait_for(lambda: d.call("status")["now"] - d.grants(alice)[0]["last_active"] >= 3)

    d.write_config(count=1, gate=False, defaults={"gpus": 1, "idle_timeout": "2s"})
    d.reload()

    # Idle 3 s past a 2 s limit: before, the next tick released it without a word. Now the warning
    # comes first, with the time it goes, and the release only after the new limit has run again.
    assert wait_for(lambda: d.grants(alice) == [], 30)
    (warned,) = [e for e in events_of(d, alice, "idle") if e["kind"] == "warning"]
    assert warned["message"].startswith("gpuguard: your idle release is now 2s; GPU 0 has been unused for ")
    released = [e for e in events_of(d, alice, "idle") if e["kind"] == "release"]
    assert len(released) == 1 and released[0]["time"] >= warned["numbers"]["release_at"] - 0.5
