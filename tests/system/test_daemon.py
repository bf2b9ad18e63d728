"""The daemon end to end: real users, a real daemon subprocess, the real gate on simulated GPUs.

Two views of every GPU, both opened by the test user's own processes:
- the daemon's nodes (`d.node(m)`, 0660 root:root + ACLs): granted -> ENXIO, else EACCES (file permissions);
- bare 0666 nodes of the same numbers outside the daemon's reach: granted -> ENXIO, else EPERM (the gate).
ENXIO means the kernel let the open through to the (absent) driver.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import stat
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import probes
import pytest
from conftest import PYTHON, popen_as
from probes import ALLOWED, FILE_DENIED, GATE_DENIED, opens
from sim_helpers import gpuguard, start_burn, stop_burn

from devtools.harness import wait_for
from gpuguard import client
from gpuguard.backends import posix_acl
from gpuguard.backends.gate import Gate
from gpuguard.core.model import NVIDIA_MAJOR

if TYPE_CHECKING:
    from conftest import TestUser

pytestmark = pytest.mark.gate

def bare_nodes(d) -> dict[int, Path]:
    """0666 nodes for every GPU, where only the gate can say no."""
    return probes.bare_nodes(d.sandbox / "bare", range(d.config.gpu.simulated.count))


def access(d, user: TestUser) -> dict[int, tuple[str, str]]:
    """minor -> (through the daemon's node, through a bare 0666 node)."""
    count = d.config.gpu.simulated.count
    managed = opens(user, {m: d.node(m) for m in range(count)})
    gate = opens(user, bare_nodes(d))
    return {m: (managed[m], gate[m]) for m in range(count)}


def only(d, *granted: int) -> dict[int, tuple[str, str]]:
    return {m: (ALLOWED, ALLOWED) if m in granted else (FILE_DENIED, GATE_DENIED)
            for m in range(d.config.gpu.simulated.count)}


# --- logins

def test_a_member_gets_one_gpu_and_can_open_exactly_that_one(gg_daemon):
    d = gg_daemon
    alice = d.add_member()
    opened = d.open_session(alice)
    (minor,) = opened["gpus"]
    gpu_uuid, index = next((g["uuid"], g["index"]) for g in d.whoami(alice)["grants"])
    assert opened["cuda_visible_devices"] == gpu_uuid
    assert index != minor  # the simulation numbers them apart, as real servers may: the line names both
    assert opened["message"] == (f"gpuguard: GPU {minor} (NVIDIA H100 80GB HBM3, nvidia-smi {index}) is yours - "
                                 "run gpuguard whoami for details")
    assert access(d, alice) == only(d, minor)
    assert (minor,) == tuple(m for m in range(4) if alice.uid in posix_acl.acl_users(d.node(m)))
    assert Gate(d.gate_name).entries() == {(alice.uid, (NVIDIA_MAJOR, minor))}
    # a CUDA program runs on its GPU and is refused on any other
    burn = start_burn(d.config_path, minor, user=alice)
    stop_burn(burn)
    other = (minor + 1) % 4
    refused = d.cli_as(alice, "sim", "burn", "--gpu", str(other), "--mem", "1GiB", "--seconds", "0")
    assert refused.returncode == 1 and "no CUDA-capable device" in refused.stderr


def test_the_login_line_shows_the_time_limit(start_daemon):
    d = start_daemon(defaults={"max_time": "2h"})
    alice = d.add_member()
    opened = d.open_session(alice)
    (grant,) = d.whoami(alice)["grants"]
    assert grant["expires_at"] == pytest.approx(grant["granted_at"] + 7200)
    assert " is yours until " in opened["message"]


def test_a_non_member_gets_nothing_and_no_message(gg_daemon, make_user):
    d = gg_daemon
    bob = make_user()
    opened = d.open_session(bob)
    assert (opened["gpus"], opened["cuda_visible_devices"], opened["message"]) == ([], "", "")
    assert isinstance(opened["session"], int)
    assert access(d, bob) == only(d)
    assert d.whoami(bob)["member"] is False


def test_an_exempt_user_needs_no_grant_and_opens_every_gpu(start_daemon, make_user):
    ops = make_user()
    d = start_daemon(access={"exempt_users": [ops.name]})
    alice = d.add_member()
    opened = d.open_session(ops)
    assert (opened["gpus"], opened["message"]) == ([], "")
    assert Gate(d.gate_name).exempt() == {0, ops.uid}
    # the gate lets them through, and the nodes' ACLs name them: every GPU opens
    assert access(d, ops) == only(d, 0, 1, 2, 3)
    assert access(d, alice) == only(d)  # a member with no grant gets no such entry
    d.write_config(access={"exempt_users": []})
    d.reload()
    assert access(d, ops) == only(d)
    assert not any(ops.uid in posix_acl.acl_users(d.node(m)) for m in range(4))


def test_a_login_exempt_by_its_groups_is_exempt_at_once(start_daemon, make_group, make_user):
    admins = make_group()
    d = start_daemon(access={"exempt_groups": [admins]})
    ops = make_user(groups=[admins])  # joined after the daemon computed the exempt uids
    assert d.open_session(ops)["gpus"] == []
    assert ops.uid in Gate(d.gate_name).exempt() and ops.uid in d.call("status")["exempt"]
    assert access(d, ops) == only(d, 0, 1, 2, 3)


def test_a_second_session_reuses_the_grant_and_the_last_close_releases_it(gg_daemon):
    d = gg_daemon
    alice = d.add_member()
    first = d.open_session(alice)
    second = d.open_session(alice)
    assert second["gpus"] == first["gpus"] and second["session"] != first["session"]
    assert len(d.whoami(alice)["grants"]) == 1
    closed = d.close_session(alice, first["pid"])
    assert (closed["closed"], closed["held"], closed["release_pending"]) == (True, first["gpus"], False)
    closed = d.close_session(alice, second["pid"])
    assert (closed["closed"], closed["held"], closed["release_pending"]) == (True, first["gpus"], True)
    assert wait_for(lambda: not d.granted_minors(alice))  # released in the background, at once
    assert access(d, alice) == only(d)
    kinds = [(e["kind"], e["rule"]) for e in d.whoami(alice)["events"]]
    assert kinds == [("grant", "session"), ("release", "logout")]


def test_a_running_job_keeps_its_gpu_after_logout_until_it_exits(gg_daemon):
    d = gg_daemon
    alice = d.add_member()
    opened = d.open_session(alice)
    (minor,) = opened["gpus"]
    burn = start_burn(d.config_path, minor, user=alice)  # as under nohup or tmux
    try:
        closed = d.close_session(alice, opened["pid"])
        assert (closed["held"], closed["release_pending"]) == ([minor], True)
        assert wait_for(lambda: d.call("status")["gpus"][minor]["processes"] == 1)
        assert d.granted_minors(alice) == [minor]  # seen by the tick, and kept
    finally:
        stop_burn(burn)
    assert wait_for(lambda: not d.granted_minors(alice))
    assert access(d, alice) == only(d)


def test_a_session_whose_pam_caller_died_is_dropped_and_its_grant_released(gg_daemon):
    d = gg_daemon
    alice = d.add_member()
    caller = d.caller()
    opened = d.open_session(alice, pid=caller.pid)
    assert opened["gpus"]
    caller.kill()
    caller.wait()
    assert wait_for(lambda: not d.whoami(alice)["sessions"] and not d.granted_minors(alice))
    assert "event=session_gone" in d.log()


def test_a_caller_is_judged_by_its_start_time_not_the_wall_clock(gg_daemon):
    d = gg_daemon
    alice, bob = d.add_member(), d.add_member()
    stepped = d.open_session(alice)
    reused = d.open_session(bob)
    d.stop()  # the daemon is its store's one writer: the rows are changed while none runs
    with sqlite3.connect(d.config.paths.state_dir / "state.db") as db:
        # alice's session opened while the wall clock read 1970 (stepped back at boot): her caller
        # "started after it", which never mattered. bob's caller pid now names another process.
        db.execute("UPDATE sessions SET opened_at = 0 WHERE id = ?", (stepped["session"],))
        db.execute("UPDATE sessions SET caller_start = caller_start + 1 WHERE id = ?", (reused["session"],))
    db.close()
    d.start()
    assert wait_for(lambda: not d.whoami(bob)["sessions"])  # a tick judged both sessions
    assert [s["id"] for s in d.whoami(alice)["sessions"]] == [stepped["session"]]
    assert d.granted_minors(alice) == stepped["gpus"]


def test_no_free_gpu_still_opens_the_session_queued_and_the_queue_gets_the_next_one(gg_daemon):
    d = gg_daemon
    users = [d.add_member() for _ in range(5)]
    opened = [d.open_session(u) for u in users]
    assert sorted(m for o in opened[:4] for m in o["gpus"]) == [0, 1, 2, 3]
    late = opened[4]
    assert (late["gpus"], late["cuda_visible_devices"]) == ([], "")
    assert late["message"].startswith("gpuguard: no GPU is free right now; you are number 1 of 1 in the queue")
    assert isinstance(late["session"], int)
    refused = d.cli_as(users[4], "request")
    assert refused.returncode == 1 and "no GPU is free right now" in refused.stderr
    d.close_session(users[0], opened[0]["pid"])  # released at logout, and given to the queue first
    assert wait_for(lambda: d.granted_minors(users[4]) == opened[0]["gpus"])
    got = d.cli_as(users[4], "request", "--json")
    assert got.returncode == 0, got.stderr
    reply = json.loads(got.stdout)
    assert reply["granted"] == [] and reply["gpus"] == opened[0]["gpus"]
    assert reply["cuda_visible_devices"] in got.stdout
    assert access(d, users[4]) == only(d, *reply["gpus"])


def test_two_gpu_quota_gets_an_nvlink_pair(start_daemon):
    d = start_daemon(defaults={"gpus": 2}, simulated={"nvlink_groups": [[0, 3], [1, 2]]})
    alice, bob = d.add_member(), d.add_member()
    pairs = [sorted(d.open_session(u)["gpus"]) for u in (alice, bob)]
    assert sorted(pairs) == [[0, 3], [1, 2]]
    assert "GPUs " in d.open_session(alice)["message"] and " are yours" in d.open_session(alice)["message"]


def test_group_quota_and_sharing(start_daemon, make_group):
    sharers = make_group()
    d = start_daemon(quotas={"groups": {sharers: {"sharing": True, "gpu_memory": "20GiB"}}})
    alone = [d.add_member() for _ in range(4)]
    for user in alone:
        d.open_session(user)
    a, b = d.add_member([sharers]), d.add_member([sharers])
    assert "in the queue" in d.open_session(a)["message"]  # exclusive holders everywhere
    d.call("revoke", user=alone[0].name)  # the freed GPU goes to a, who waits for it
    freed = d.open_session(a)["gpus"]
    shared = d.open_session(b)
    assert shared["gpus"] == freed and ", shared)" in shared["message"]
    assert access(d, b)[freed[0]] == (ALLOWED, ALLOWED)
    assert access(d, a)[freed[0]] == (ALLOWED, ALLOWED)


def test_a_login_never_fails_even_when_the_grant_cannot_be_applied(gg_daemon):
    d = gg_daemon
    alice = d.add_member()
    for minor in range(4):  # a node the daemon cannot manage: granting must roll back
        d.node(minor).unlink()
        d.node(minor).mkdir()
    opened = d.open_session(alice)
    assert opened["ok"] and opened["gpus"] == [] and opened["cuda_visible_devices"] == ""
    assert opened["message"] == "gpuguard: no GPU for this session (an internal error, logged for your admin)"
    assert d.granted_minors(alice) == [] and Gate(d.gate_name).entries() == set()
    assert "event=session_open_failed" in d.log()
    for minor in range(4):
        d.node(minor).rmdir()
    (minor,) = d.open_session(alice)["gpus"]  # the daemon recreates the node and carries on
    assert stat.S_ISCHR(os.stat(d.node(minor)).st_mode)
    assert access(d, alice)[minor] == (ALLOWED, ALLOWED)


# --- many at once

def test_fifty_parallel_logins_for_twenty_users_never_share_a_gpu(gg_daemon):
    d = gg_daemon
    users = [d.add_member() for _ in range(20)]
    callers = [d.caller() for _ in range(50)]
    silent = []
    try:
        for _ in range(10):  # clients that connect and never send a byte, during the whole burst
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(d.socket)
            silent.append(sock)
        with ThreadPoolExecutor(50) as pool:
            replies = list(pool.map(lambda i: d.call("session_open", user=users[i % 20].name, service="ggt-burst",
                                                     tty="pts/1", pid=callers[i].pid), range(50)))
    finally:
        for sock in silent:
            sock.close()
    assert len(replies) == 50 and all(r["ok"] for r in replies)
    holders: dict[int, set[str]] = {}
    for i, reply in enumerate(replies):
        for minor in reply["gpus"]:
            holders.setdefault(minor, set()).add(users[i % 20].name)
    assert sorted(holders) == [0, 1, 2, 3]
    assert all(len(names) == 1 for names in holders.values())
    grants = {gpu["minor"]: [h["user"] for h in gpu["holders"]] for gpu in d.call("status")["gpus"]}
    assert all(len(names) == 1 for names in grants.values())
    entries = Gate(d.gate_name).entries()
    assert len(entries) == 4 and {dev for _, dev in entries} == {(NVIDIA_MAJOR, m) for m in range(4)}
    assert sum(1 for r in replies if r["message"].startswith("gpuguard: no GPU is free right now")) == sum(
        1 for i, r in enumerate(replies) if not r["gpus"])


# --- the commands

def test_whoami_and_status_for_users(gg_daemon):
    d = gg_daemon
    alice, bob = d.add_member(), d.add_member()
    (minor,) = d.open_session(alice)["gpus"]
    whoami = d.cli_as(alice, "whoami")
    assert whoami.returncode == 0, whoami.stderr
    assert f"member of {d.group}" in whoami.stdout and "export CUDA_VISIBLE_DEVICES=GPU-" in whoami.stdout
    mine = json.loads(d.cli_as(alice, "whoami", "--json").stdout)
    assert [g["minor"] for g in mine["grants"]] == [minor]
    assert mine["quota"]["gpus"] == 1 and mine["sessions"][0]["service"] == "ggt-test"
    assert [e["kind"] for e in mine["events"]] == ["grant"]
    status = json.loads(d.cli_as(bob, "status", "--json").stdout)
    assert [h["user"] for h in status["gpus"][minor]["holders"]] == [alice.name]
    assert "sessions" not in status  # root's view only
    table = d.cli_as(bob, "status").stdout
    assert alice.name in table and table.count("free") == 3
    assert "sessions" in d.call("status")


def test_request_and_release_by_the_user(start_daemon, make_user):
    d = start_daemon(defaults={"gpus": 2})
    alice = d.add_member()
    got = json.loads(d.cli_as(alice, "request", "--gpus", "1", "--json").stdout)
    assert len(got["granted"]) == 1
    assert d.whoami(alice)["grants"][0]["origin"] == "request"  # asked outside any session: not tied to one
    over = d.cli_as(alice, "request", "--gpus", "3")
    assert over.returncode == 1 and "your quota is 2 GPUs" in over.stderr
    more = json.loads(d.cli_as(alice, "request", "--json").stdout)
    assert len(more["gpus"]) == 2
    first, second = more["gpus"]
    burn = start_burn(d.config_path, first, user=alice)
    try:
        busy = d.cli_as(alice, "release", "--gpu", str(first), "--gpu", str(second))  # named: all or nothing
        assert busy.returncode == 1
        assert (f"GPU {first} is still in use by your process {burn.pid}: end it (kill {burn.pid}) or let it "
                f"finish, then gpuguard release --gpu {first}") in busy.stderr
        assert d.granted_minors(alice) == [first, second]  # nothing released, nothing killed
        assert burn.poll() is None
        partial = d.cli_as(alice, "release", "--gpu", str(second))
        assert partial.returncode == 0 and f"released GPU {second}; you still hold GPU {first}" in partial.stdout
    finally:
        stop_burn(burn)
    assert d.cli_as(alice, "release").returncode == 0
    assert access(d, alice) == only(d)
    nothing = d.cli_as(alice, "release")
    assert nothing.returncode == 1 and "you hold no GPU" in nothing.stderr
    outsider = make_user()
    refused = d.cli_as(outsider, "request")
    assert refused.returncode == 1 and f"only members of group {d.group} get GPUs" in refused.stderr


def test_admin_grant_and_revoke(gg_daemon):
    d = gg_daemon
    alice = d.add_member()
    granted = d.cli("grant", alice.name, "--gpus", "2", "--for", "1h", "--json")
    assert granted.returncode == 0, granted.stderr
    reply = json.loads(granted.stdout)
    assert len(reply["gpus"]) == 2
    grants = d.whoami(alice)["grants"]
    assert {g["origin"] for g in grants} == {"admin"}
    assert all(g["expires_at"] == pytest.approx(g["granted_at"] + 3600) for g in grants)
    assert access(d, alice) == only(d, *reply["gpus"])
    # admin grants outlive sessions: a login and logout leave them
    opened = d.open_session(alice)
    assert opened["gpus"] == reply["gpus"]
    assert d.close_session(alice, opened["pid"])["release_pending"]  # and it keeps them (access below)

    keep, drop = reply["gpus"]
    bob = d.add_member()
    taken = d.cli("grant", bob.name, "--gpu", str(keep))
    assert taken.returncode == 1 and f"GPU {keep} is held by {alice.name}; revoke it first" in taken.stderr
    burn = start_burn(d.config_path, drop, user=alice)  # opened before the revoke
    try:
        revoked = d.cli("revoke", alice.name, "--gpu", str(drop), "--json")
        assert revoked.returncode == 0, revoked.stderr
        reply = json.loads(revoked.stdout)
        assert reply["revoked"] == [drop] and reply["holders"] == [{"pid": burn.pid, "minor": drop}]
        assert f"still open in process {burn.pid}: warned now, stopped in" in reply["message"]
    finally:
        stop_burn(burn)
    assert access(d, alice) == only(d, keep)
    assert d.cli("revoke", alice.name).returncode == 0
    again = d.cli("revoke", alice.name)
    assert again.returncode == 1 and f"{alice.name} holds no GPU" in again.stderr
    kinds = [e["kind"] for e in d.whoami(alice)["events"] if e["kind"] in ("grant", "revoke")]
    assert kinds == ["grant", "grant", "revoke", "revoke"]  # (the watcher adds its warning about the holder)


def test_revoke_stops_processes_that_hold_the_node_without_a_cuda_context(gg_daemon):
    d = gg_daemon
    alice = d.add_member()
    (minor,) = d.open_session(alice)["gpus"]
    # An open descriptor that NVML never lists (the simulated node opens no further than O_PATH).
    code = "import os, sys, time; os.open(sys.argv[1], os.O_PATH); print('held', flush=True); time.sleep(600)"
    holder = popen_as(alice, [PYTHON, "-c", code, str(d.node(minor))], stdout=subprocess.PIPE, text=True)
    bystander = popen_as(alice, ["sleep", "600"])
    try:
        assert holder.stdout.readline() == "held\n"
        reply = d.call("revoke", user=alice.name)
        assert reply["holders"] == [{"pid": holder.pid, "minor": minor}]
        assert reply["message"].endswith(f"; process {holder.pid} held the node open (no CUDA context): sent SIGTERM, "
                                         "SIGKILL in 10s if it still holds it")
        assert holder.wait(10) == -signal.SIGTERM
        assert bystander.poll() is None  # alice's other processes are left alone
    finally:
        for proc in (holder, bystander):
            proc.kill()
            proc.wait()
        holder.stdout.close()


def test_admin_commands_check_their_input(gg_daemon, make_user):
    d = gg_daemon
    alice, outsider = d.add_member(), make_user()
    cases = [
        (("grant", alice.name, "--gpu", "7"), 2, "no GPU 7 on this machine (GPUs: 0,1,2,3)"),
        (("grant", alice.name, "--gpus", "5"), 1, "only 4 more GPUs free"),
        (("grant", alice.name, "--gpus", "1", "--for", "soon"), 2, "--for: not a duration"),
        (("grant", "ggt-nobody-here", "--gpus", "1"), 2, "no such user: ggt-nobody-here"),
        (("grant", outsider.name, "--gpus", "1"), 1, f"is not in group {d.group}"),
        (("revoke", alice.name), 1, "holds no GPU"),
    ]
    for args, code, fragment in cases:
        result = d.cli(*args)
        assert (result.returncode, fragment in result.stderr) == (code, True), (args, result.stderr)


def test_users_cannot_act_for_others_or_as_root(gg_daemon):
    d = gg_daemon
    alice, mallory = d.add_member(), d.add_member()
    d.open_session(alice)
    for op, fields in [("grant", {"user": mallory.name, "gpus": 1}), ("revoke", {"user": alice.name}),
                       ("session_open", {"user": mallory.name, "pid": 1}),
                       ("session_close", {"user": alice.name, "pid": 1}), ("reload", {}), ("sync_nodes", {})]:
        assert d.call_as(mallory, op, **fields) == {"ok": False, "code": 1, "error": f"{op} is for root only"}
    assert d.call_as(mallory, "whoami", user=alice.name) == {
        "ok": False, "code": 1, "error": "only root may look at another user's GPUs"}
    assert d.call_as(mallory, "whoami", user=mallory.name)["user"] == mallory.name
    assert d.granted_minors(mallory) == [] and d.granted_minors(alice) != []
    assert d.cli_as(mallory, "revoke", alice.name).returncode == 1
    assert d.cli_as(mallory, "whoami", "--user", alice.name).returncode == 1


# --- the daemon's life

def test_restart_keeps_grants_and_reconciles_the_gate_and_acls(gg_daemon):
    d = gg_daemon
    alice, bob = d.add_member(), d.add_member()
    (minor,) = d.open_session(alice)["gpus"]
    assert d.stop() == 0
    gate = Gate(d.gate_name)
    assert gate.is_attached()  # access stays closed while no daemon runs
    stray = (minor + 1) % 4
    gate.grant(bob.uid, (NVIDIA_MAJOR, stray))   # derived state that the store does not have ...
    gate.revoke(alice.uid, (NVIDIA_MAJOR, minor))
    posix_acl.apply_acls(d.node(minor), [])            # ... and state that the store has but the nodes lost
    posix_acl.apply_acls(d.node(stray), [bob.uid])
    os.chmod(d.node(stray), 0o666)
    gate.close()
    d.start()
    assert Gate(d.gate_name).entries() == {(alice.uid, (NVIDIA_MAJOR, minor))}
    assert access(d, alice) == only(d, minor) and access(d, bob) == only(d)
    assert stat.S_IMODE(os.stat(d.node(stray)).st_mode) == 0o660
    assert d.granted_minors(alice) == [minor]


def test_a_recreated_node_gets_its_mode_and_acl_back(gg_daemon):
    d = gg_daemon
    alice = d.add_member()
    (minor,) = d.open_session(alice)["gpus"]
    probes.fresh_node(d.node(minor), (NVIDIA_MAJOR, minor))  # what nvidia-modprobe does: no uevent
    assert wait_for(lambda: posix_acl.acl_users(d.node(minor)) == {alice.uid}
                      and stat.S_IMODE(os.stat(d.node(minor)).st_mode) == 0o660)
    assert access(d, alice) == only(d, minor)


def test_acl_apply_remakes_nodes_and_acls_even_while_the_config_is_broken(gg_daemon):
    d = gg_daemon
    alice = d.add_member()
    (minor,) = d.open_session(alice)["gpus"]
    applied = d.cli("acl", "apply")
    assert (applied.returncode, applied.stdout) == (0, "device nodes and ACLs re-applied\n")
    good = d.config_path.read_text()
    d.config_path.write_text(good + "\n[access\n")  # an admin in the middle of an edit
    for m in range(4):
        d.node(m).unlink()  # a removal sends no event the daemon watches
    assert d.call("sync_nodes")["ok"]  # what acl apply asks for: no config involved
    assert access(d, alice) == only(d, minor)
    assert all(stat.S_IMODE(os.stat(d.node(m)).st_mode) == 0o660 for m in range(4))
    with pytest.raises(client.Refused, match="the previous config stays in force"):
        d.reload()
    d.config_path.write_text(good)


def test_sighup_reloads_and_a_broken_config_keeps_the_old_one(gg_daemon):
    d = gg_daemon
    d.write_config(defaults={"gpus": 2})
    d.proc.send_signal(signal.SIGHUP)
    alice = d.add_member()
    assert wait_for(lambda: "event=reload " in d.log())
    assert len(d.open_session(alice)["gpus"]) == 2
    d.config_path.write_text(d.config_path.read_text() + "\n[defaults]\ngpus = 1\n")  # a duplicate table
    d.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: "event=reload_failed" in d.log())
    with pytest.raises(client.Refused, match="the previous config stays in force") as refused:
        d.call("reload")
    assert refused.value.code == 2
    broken = d.cli("reload")  # the command itself reads the config (for the socket) and says what is wrong
    assert broken.returncode == 2 and "not valid TOML" in broken.stderr
    bob = d.add_member()
    assert len(d.open_session(bob)["gpus"]) == 2
    assert d.proc.poll() is None


def test_acl_mode_runs_without_a_gate(start_daemon):
    d = start_daemon(gate=False)
    alice = d.add_member()
    (minor,) = d.open_session(alice)["gpus"]
    assert not Gate(d.gate_name).is_attached()
    managed = opens(alice, {m: d.node(m) for m in range(4)})
    assert managed == {m: ALLOWED if m == minor else FILE_DENIED for m in range(4)}
    assert d.call("status")["gate"] is None


def test_acl_mode_refuses_to_start_while_a_gate_from_gate_mode_is_attached(start_daemon):
    d = start_daemon()
    assert d.stop() == 0  # the gate stays attached, enforcing grants
    d.write_config(gate=False)
    refused = d.cli("daemon", "--gate-name", d.gate_name)
    assert refused.returncode == 1
    assert refused.stderr == (f"gpuguard: cannot start: gate {d.gate_name} is still attached from gate mode: "
                              "run gpuguard gate detach, or set access.mode = gate\n")
    Gate(d.gate_name).detach()
    d.start()
    assert d.call("status")["gate"] is None


def test_start_failures_are_one_clear_line(start_daemon, sandbox):
    d = start_daemon()
    second = d.cli("daemon", "--gate-name", d.gate_name)
    assert second.returncode == 1
    assert second.stderr == f"gpuguard: cannot start: another gpuguard daemon is serving on {d.socket}\n"
    broken = sandbox / "broken.toml"
    broken.write_text("[access]\ngroup = 3\n")
    bad = subprocess.run(gpuguard(broken, "daemon"), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr == f"gpuguard: {broken}: access.group: expected a non-empty string, got 3\n"


def test_a_client_of_the_release_before_still_names_gpus_by_minors(gg_daemon):
    """The wire's `units` was `minors` until this release; the daemon reads both for one release."""
    d = gg_daemon
    alice = d.add_member()
    assert d.call("grant", user=alice.name, minors=[2])["gpus"] == [2]
    assert d.call_as(alice, "release", minors=[2])["released"] == [2]
    assert d.call("grant", user=alice.name, units=[3])["gpus"] == [3] == d.granted_minors(alice)
