"""The watcher end to end: a real daemon, real users, real `gpuguard sim burn` processes.

Timings are short (interval 0.2 s, grace 1 s, kill_wait 1 s) and every wait is a poll with a
generous deadline: the tests check what happens and in which order, never how fast. "Later
than X" is read off the daemon itself: `status` shows when its latest tick sampled, and
ticks run one after another, so once a newer sample shows, the tick of the older one is done.
"""
from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
from freezer import frozen
from probes import ALLOWED, FILE_DENIED, GATE_DENIED, bare_nodes, open_result
from sim_helpers import GiB, set_fault, stop_burn

from devtools.harness import wait_for
from gpuguard.services.store import Store

pytestmark = pytest.mark.gate

INTERVAL, GRACE, KILL_WAIT = 0.2, 1.0, 1.0
MARGIN = 20.0  # seconds of slack on a slow or busy machine; the tests never assert speed
WATCHER = {"interval": f"{INTERVAL}s", "grace": f"{GRACE}s", "kill_wait": f"{KILL_WAIT}s"}


def whoami_json(d, user) -> dict:
    """`gpuguard whoami --json` run as the user, as they would."""
    result = d.cli_as(user, "whoami", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def events(d, user, **match) -> list[dict]:
    return [e for e in whoami_json(d, user)["events"] if all(e.get(k) == v for k, v in match.items())]


def log_lines(d, **fields) -> list[str]:
    """The daemon's log lines that carry every one of these key=value fields."""
    patterns = [re.compile(rf"(?:^| ){key}={re.escape(str(value))}(?: |$)") for key, value in fields.items()]
    return [line for line in d.log().splitlines() if all(p.search(line) for p in patterns)]


def bare_node(d, minor: int) -> Path:
    """A 0666 node for GPU `minor` in the sandbox: file permissions let everyone in, only the gate can refuse."""
    return bare_nodes(d.sandbox / "bare", [minor])[minor]


def assert_closed_to(d, user, minor: int) -> None:
    """GPU `minor` is closed to user at both layers: the gate (EPERM) and the node's ACL (EACCES)."""
    assert open_result(user, bare_node(d, minor)) == GATE_DENIED
    assert open_result(user, d.node(minor)) == FILE_DENIED


def usage_after_stop(d, user, minor: int) -> dict:
    """Stop the daemon (which writes its usage counters) and read the user's row for that GPU."""
    assert d.stop() == 0
    store = Store(d.config.paths.state_dir / "state.db")
    try:
        [row] = [u for u in store.usage(user.uid) if u["minor"] == minor]
    finally:
        store.close()
    return row


def session_gpu(d, user) -> int:
    opened = d.open_session(user)
    assert len(opened["gpus"]) == 1, opened
    return opened["gpus"][0]


def sampled_at(d) -> float | None:
    return d.call("status")["sampled_at"]


def await_tick_done_after(d, moment: float, timeout: float) -> None:
    """Wait until a tick whose sample was taken at `moment` or later has finished (the watcher
    decided with `now` >= moment): its sample shows in status, then a newer one does."""
    first = wait_for(lambda: (at := sampled_at(d)) is not None and at >= moment and at, timeout=timeout)
    assert first, f"no tick sampled after {moment} (last: {sampled_at(d)})"
    assert wait_for(lambda: sampled_at(d) > first, timeout=MARGIN), "the daemon stopped ticking"


def test_over_quota_burn_is_warned_then_terminated(start_daemon, burns):
    d = start_daemon(defaults={"gpus": 1, "gpu_memory": "4GiB"}, watcher=WATCHER)
    alice = d.add_member()
    minor = session_gpu(d, alice)
    proc = burns(d.config_path, minor, "6GiB", user=alice)
    assert proc.wait(timeout=INTERVAL + GRACE + KILL_WAIT + MARGIN) == -signal.SIGTERM

    mine = [e for e in whoami_json(d, alice)["events"] if e["pid"] == proc.pid]
    assert [(e["kind"], e["rule"], e["action"]) for e in mine] == [("warning", "memory", "warn"),
                                                                  ("kill", "memory", "term")]
    warn, term = mine
    assert warn["minor"] == term["minor"] == minor and warn["command"].startswith("python")
    assert warn["numbers"]["used"] == 6 * GiB and warn["numbers"]["quota"] == 4 * GiB
    assert warn["message"] == (f"gpuguard: your process {proc.pid} ({warn['command']}) on GPU {minor} uses 6GiB, "
                               f"over your 4GiB quota; it will be stopped in 1s unless usage drops - see gpuguard whoami")
    assert term["numbers"]["signal"] == "SIGTERM" and "SIGTERM" in term["message"]
    assert term["time"] - warn["time"] >= GRACE  # grace was given (a lower bound: slowness cannot break it)
    # The memory rule stops processes, not grants: the GPU is still alice's.
    assert [g["minor"] for g in whoami_json(d, alice)["grants"]] == [minor]
    assert len(log_lines(d, event="term", rule="memory", user=alice.name, pid=proc.pid, gpu=minor)) == 1
    # Usage is written once a minute and when the daemon stops: one kill, for that GPU.
    assert usage_after_stop(d, alice, minor)["kills"] == 1


def test_burn_ignoring_sigterm_gets_sigkill(start_daemon, burns):
    d = start_daemon(defaults={"gpus": 1, "gpu_memory": "4GiB"}, watcher=WATCHER)
    alice = d.add_member()
    minor = session_gpu(d, alice)
    proc = burns(d.config_path, minor, "5GiB", user=alice, ignore_term=True)
    assert proc.wait(timeout=INTERVAL + GRACE + 2 * KILL_WAIT + MARGIN) == -signal.SIGKILL
    actions = [e["action"] for e in events(d, alice, pid=proc.pid)]
    assert actions == ["warn", "term", "kill"]
    [kill] = events(d, alice, pid=proc.pid, action="kill")
    assert kill["kind"] == "kill" and kill["numbers"]["signal"] == "SIGKILL" and "SIGKILL" in kill["message"]


def test_at_quota_unknown_memory_root_and_exempt_users_are_left_alone(start_daemon, make_user, burns):
    exempt = make_user()  # before the daemon: its config names them
    d = start_daemon(defaults={"gpus": 1, "gpu_memory": "4GiB"}, watcher=WATCHER,
                     access={"exempt_users": [exempt.name]})
    at_quota, unknown, over = d.add_member(), d.add_member(), d.add_member()
    gpus = {user.name: session_gpu(d, user) for user in (at_quota, unknown, over)}
    free = (set(range(4)) - set(gpus.values())).pop()
    exact = burns(d.config_path, gpus[at_quota.name], "4GiB", user=at_quota)
    unknowable = burns(d.config_path, gpus[unknown.name], "unknown", user=unknown)
    root_stray = burns(d.config_path, free, "70GiB")  # root: exempt, and on a GPU nobody holds
    # A non-root exempt user: far over any quota on the free GPU, and a stray on someone else's.
    exempt_over = burns(d.config_path, free, "70GiB", user=exempt)
    exempt_stray = burns(d.config_path, gpus[at_quota.name], "1GiB", user=exempt)
    # The control, started last: every tick that saw it saw the others too, so had any of them
    # been acted on, its warning would be as early as the control's, and its SIGTERM too.
    control = burns(d.config_path, gpus[over.name], "4100MiB", user=over)
    assert control.wait(timeout=INTERVAL + GRACE + KILL_WAIT + MARGIN) == -signal.SIGTERM
    for user, proc in ((at_quota, exact), (unknown, unknowable)):  # no warning, no signal
        assert events(d, user, rule="memory") == [] and events(d, user, pid=proc.pid) == []
    for proc in (exact, unknowable, root_stray, exempt_over, exempt_stray):
        assert proc.poll() is None
    # Exempt strays are reported once (log, and whoami for a user), never warned or signalled.
    for proc in (exempt_over, exempt_stray):
        assert [(e["kind"], e["rule"], e["action"]) for e in events(d, exempt, pid=proc.pid)] == [
            ("warning", "stray", "report")]
    for user, proc in ((exempt.name, exempt_over), (exempt.name, exempt_stray), ("root", root_stray)):
        assert len(log_lines(d, event="report", rule="stray", user=user, pid=proc.pid)) == 1, d.log()
        assert log_lines(d, user=user, pid=proc.pid, event="term") == []
        assert log_lines(d, user=user, pid=proc.pid, event="kill") == []


def test_max_time_warns_revokes_and_ends_processes(start_daemon, burns):
    d = start_daemon(defaults={"gpus": 1, "max_time": "5s"}, watcher=WATCHER)
    alice = d.add_member()
    minor = session_gpu(d, alice)
    proc = burns(d.config_path, minor, "1GiB", user=alice)
    assert proc.wait(timeout=5 + INTERVAL + MARGIN) == -signal.SIGTERM
    mine = whoami_json(d, alice)
    assert mine["grants"] == []
    kinds = [(e["kind"], e["rule"]) for e in mine["events"] if e["minor"] == minor]
    assert ("warning", "time") in kinds and ("revoke", "time") in kinds and ("kill", "time") in kinds
    assert kinds.index(("warning", "time")) < kinds.index(("revoke", "time")) < kinds.index(("kill", "time"))
    [revoke] = [e for e in mine["events"] if e["kind"] == "revoke"]
    assert "your time on GPU" in revoke["message"] and "gpuguard request" in revoke["message"]
    assert_closed_to(d, alice, minor)
    assert mine["sessions"]  # the session itself is not touched


def test_time_warnings_ten_and_one_minute_before_the_end(start_daemon):
    d = start_daemon(defaults={"gpus": 1}, watcher=WATCHER)
    alice = d.add_member()
    # 65 s: under ten minutes left at once, one minute left some 5 s later (the thresholds are fixed).
    granted = d.cli("grant", alice.name, "--gpu", "2", "--for", "65s", "--json")
    assert granted.returncode == 0, granted.stderr
    assert json.loads(granted.stdout)["gpus"] == [2]

    def time_warnings() -> list[dict]:
        return events(d, alice, rule="time", kind="warning")

    warnings = wait_for(lambda: (w := time_warnings()) and w[-1]["numbers"]["threshold"] == 60 and w,
                        timeout=65 + MARGIN)
    assert warnings, f"no one-minute warning: {time_warnings()}"
    # A daemon that first looks with a minute or less left gives only the last warning (a slow
    # machine); otherwise both, in order.
    expected = [600, 60] if warnings[0]["numbers"]["left"] > 60 else [60]
    assert [w["numbers"]["threshold"] for w in warnings] == expected, warnings
    for warning in warnings:
        assert 0 < warning["numbers"]["left"] <= min(65, warning["numbers"]["threshold"])
        assert warning["minor"] == 2 and warning["action"] == "warn"
        assert warning["message"].startswith("gpuguard: your grant of GPU 2 ends in ")
        assert "save your work" in warning["message"]
    revoked = d.cli("revoke", alice.name)
    assert revoked.returncode == 0, revoked.stderr
    assert whoami_json(d, alice)["grants"] == []
    assert time_warnings() == warnings  # once each: nothing more came meanwhile


def test_idle_grant_is_released_and_can_be_requested_again(start_daemon, burns):
    idle = 2.0
    # No idle_timeout until the burn runs: however long it takes to start, the grant waits for it.
    d = start_daemon(defaults={"gpus": 1}, watcher=WATCHER)
    alice = d.add_member()
    minor = session_gpu(d, alice)
    assert open_result(alice, d.node(minor)) == ALLOWED
    proc = burns(d.config_path, minor, "1GiB", user=alice)
    d.write_config(defaults={"gpus": 1, "idle_timeout": f"{idle}s"}, watcher=WATCHER)
    d.reload()
    # Without the burn the first tick from now on would release the grant (idle since the login);
    # with it, not even idle_timeout later.
    await_tick_done_after(d, time.time() + idle, timeout=idle + MARGIN)
    assert [g["minor"] for g in whoami_json(d, alice)["grants"]] == [minor]
    assert events(d, alice, kind="release") == []
    assert stop_burn(proc) == -signal.SIGKILL
    # Once it is gone, idle_timeout later the grant goes.
    mine = wait_for(lambda: (w := whoami_json(d, alice)) and not w["grants"] and w, timeout=idle + MARGIN)
    assert mine and not mine["grants"]
    [release] = [e for e in mine["events"] if e["kind"] == "release" and e["rule"] == "idle"]
    assert "none of your processes used it" in release["message"] and "gpuguard request" in release["message"]
    assert mine["sessions"], "idle release must leave the user's sessions alone"
    assert_closed_to(d, alice, minor)
    requested = d.cli_as(alice, "request", "--json")
    assert requested.returncode == 0, requested.stderr
    again = json.loads(requested.stdout)["gpus"]
    assert len(again) == 1 and open_result(alice, d.node(again[0])) == ALLOWED
    # Usage is written once a minute and at shutdown: busy while the burn ran, idle after.
    first = usage_after_stop(d, alice, minor)
    assert first["granted_seconds"] > 0 and first["busy_seconds"] > 0 and first["idle_seconds"] > 0
    assert first["kills"] == 0


def test_admin_revoke_leaves_a_stray_that_is_ended(start_daemon, burns):
    d = start_daemon(defaults={"gpus": 1}, watcher=WATCHER)
    alice = d.add_member()
    minor = session_gpu(d, alice)
    proc = burns(d.config_path, minor, "1GiB", user=alice)
    d.call("revoke", user=alice.name)
    assert proc.wait(timeout=INTERVAL + GRACE + KILL_WAIT + MARGIN) == -signal.SIGTERM
    stray = [(e["kind"], e["action"]) for e in events(d, alice, pid=proc.pid, rule="stray")]
    assert stray == [("warning", "warn"), ("kill", "term")]
    assert "not granted to you" in events(d, alice, pid=proc.pid, rule="stray")[0]["message"]


def test_nvml_error_is_logged_and_nothing_is_done_until_it_heals(start_daemon, burns):
    d = start_daemon(defaults={"gpus": 1, "gpu_memory": "4GiB"}, watcher=WATCHER)
    alice = d.add_member()
    minor = session_gpu(d, alice)
    set_fault(d.device_dir, "NVML_ERROR_GPU_IS_LOST")
    try:
        proc = burns(d.config_path, minor, "6GiB", user=alice)
        # Long enough for warn + grace + TERM + kill_wait + KILL had the samples been good.
        ticks = int((GRACE + 2 * KILL_WAIT) / INTERVAL) + 5
        assert wait_for(lambda: d.log().count("event=sample_failed") >= ticks, timeout=ticks * INTERVAL + MARGIN)
        assert "GPU is lost" in d.log() or "Gpu is lost" in d.log()
        assert proc.poll() is None
        assert events(d, alice, pid=proc.pid) == []
    finally:
        set_fault(d.device_dir, None)
    # Healed: the loop went on and now acts.
    assert proc.wait(timeout=INTERVAL + GRACE + KILL_WAIT + MARGIN) == -signal.SIGTERM
    assert [e["action"] for e in events(d, alice, pid=proc.pid)] == ["warn", "term"]


def test_unkillable_process_is_reported_and_the_loop_goes_on(start_daemon, burns):
    d = start_daemon(defaults={"gpus": 1, "gpu_memory": "4GiB"}, watcher={**WATCHER, "grace": "2s"})
    alice, bob = d.add_member(), d.add_member()
    minor_a, minor_b = session_gpu(d, alice), session_gpu(d, bob)
    stuck = burns(d.config_path, minor_a, "6GiB", user=alice)
    with frozen(stuck.pid, d.sandbox):  # in the kernel's freezer: SIGKILL waits (state D)
        [report] = wait_for(lambda: events(d, alice, pid=stuck.pid, action="unkillable"),
                            timeout=INTERVAL + 2 + 2 * KILL_WAIT + MARGIN)
        assert report["kind"] == "unkillable" and report["numbers"]["state"].startswith("D")
        assert "survives SIGKILL" in report["message"]
        assert stuck.poll() is None
        # The loop goes on: bob's over-quota burn is still handled.
        other = burns(d.config_path, minor_b, "6GiB", user=bob)
        assert other.wait(timeout=INTERVAL + 2 + KILL_WAIT + MARGIN) == -signal.SIGTERM
    assert stuck.wait(timeout=MARGIN) == -signal.SIGKILL  # the pending SIGKILL lands once thawed
