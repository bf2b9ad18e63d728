"""The watcher end to end: a real daemon, real users, real `gpuguard sim burn` processes.

Timings are short (interval 0.2 s, grace 1 s, kill_wait 1 s) and every wait is a poll with a
generous deadline: the tests check what happens and in which order, never how fast.
"""
from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PYTHON, run_as, unique, wait_for
from gpuguard.store import Store
from sim_helpers import start_burn, stop_burn

pytestmark = pytest.mark.gate

GiB = 1 << 30
INTERVAL, GRACE, KILL_WAIT = 0.2, 1.0, 1.0
MARGIN = 20.0  # seconds of slack on a slow or busy machine; the tests never assert speed
WATCHER = {"interval": f"{INTERVAL}s", "grace": f"{GRACE}s", "kill_wait": f"{KILL_WAIT}s"}
FREEZER = Path("/sys/fs/cgroup/freezer")



def whoami_json(d, user) -> dict:
    """`gpuguard whoami --json` run as the user, as they would."""
    result = d.cli_as(user, "whoami", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def events(d, user, **match) -> list[dict]:
    return [e for e in whoami_json(d, user)["events"] if all(e.get(k) == v for k, v in match.items())]


def open_errno(d, user, minor: int) -> str:
    """What open() of /dev/nvidia<minor> gives the user: ENXIO = allowed (no driver), EPERM/EACCES = denied."""
    code = ("import errno, os, sys\ntry:\n    os.close(os.open(sys.argv[1], os.O_RDWR))\n    print('OK')\n"
            "except OSError as exc:\n    print(errno.errorcode[exc.errno])\n")
    result = run_as(user, [PYTHON, "-c", code, str(d.node(minor))])
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def session_gpu(d, user) -> int:
    opened = d.open_session(user)
    assert len(opened["gpus"]) == 1, opened
    return opened["gpus"][0]


@pytest.fixture
def burns():
    """Burns started in a test are reaped (and killed if need be) at its end."""
    started: list[subprocess.Popen] = []

    def start(*args, **kwargs) -> subprocess.Popen:
        proc = start_burn(*args, **kwargs)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        stop_burn(proc)


def test_over_quota_burn_is_warned_then_terminated(start_daemon, burns):
    d = start_daemon(defaults={"gpus": 1, "gpu_memory": "4GiB"}, watcher=WATCHER)
    alice = d.add_member()
    minor = session_gpu(d, alice)
    started = time.monotonic()
    proc = burns(d.config_path, minor, "6GiB", user=alice)
    status = proc.wait(timeout=INTERVAL + GRACE + KILL_WAIT + MARGIN)
    print(f"over quota -> ended: {time.monotonic() - started:.2f}s (interval {INTERVAL}, grace {GRACE})")
    assert status == -signal.SIGTERM

    mine = [e for e in whoami_json(d, alice)["events"] if e["pid"] == proc.pid]
    assert [(e["kind"], e["rule"], e["action"]) for e in mine] == [("warning", "memory", "warn"),
                                                                  ("kill", "memory", "term")]
    warn, term = mine
    assert warn["minor"] == term["minor"] == minor and warn["command"].startswith("python")
    assert warn["numbers"]["used"] == 6 * GiB and warn["numbers"]["quota"] == 4 * GiB
    assert warn["message"] == (f"gpuguard: your process {proc.pid} ({warn['command']}) on GPU {minor} uses 6GiB, "
                               f"over your 4GiB quota; it will be stopped in 1s unless usage drops - see gpuguard whoami")
    assert term["numbers"]["signal"] == "SIGTERM" and "SIGTERM" in term["message"]
    assert term["time"] - warn["time"] >= GRACE
    # The memory rule stops processes, not grants: the GPU is still alice's.
    assert [g["minor"] for g in whoami_json(d, alice)["grants"]] == [minor]
    assert f"event=term rule=memory user={alice.name}" in d.log()
    wait_for(lambda: any(u["kills"] for u in whoami_json(d, alice)["usage"]), timeout=5)


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


def test_at_quota_unknown_memory_and_exempt_are_left_alone(start_daemon, burns):
    d = start_daemon(defaults={"gpus": 1, "gpu_memory": "4GiB"}, watcher=WATCHER)
    at_quota, unknown, over = d.add_member(), d.add_member(), d.add_member()
    gpus = {user.name: session_gpu(d, user) for user in (at_quota, unknown, over)}
    free = (set(range(4)) - set(gpus.values())).pop()
    exact = burns(d.config_path, gpus[at_quota.name], "4GiB", user=at_quota)
    unknowable = burns(d.config_path, gpus[unknown.name], "unknown", user=unknown)
    root_stray = burns(d.config_path, free, "70GiB")  # root: exempt, and on a GPU nobody holds
    # The control: started last, ended by the watcher; by then the others have been watched longer.
    control = burns(d.config_path, gpus[over.name], "4100MiB", user=over)
    assert control.wait(timeout=INTERVAL + GRACE + KILL_WAIT + MARGIN) == -signal.SIGTERM
    time.sleep(INTERVAL * 3)  # a few more ticks for good measure
    for proc in (exact, unknowable, root_stray):
        assert proc.poll() is None
    assert events(d, at_quota, rule="memory") == [] and events(d, unknown, rule="memory") == []
    assert "event=report rule=stray user=root" in d.log()
    assert f"pid={root_stray.pid}" in d.log() and "event=term rule=stray user=root" not in d.log()


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
    assert open_errno(d, alice, minor) in ("EPERM", "EACCES")
    assert mine["sessions"]  # the session itself is not touched


def test_idle_grant_is_released_and_can_be_requested_again(start_daemon, burns):
    d = start_daemon(defaults={"gpus": 1, "idle_timeout": "2s"}, watcher=WATCHER)
    alice = d.add_member()
    minor = session_gpu(d, alice)
    assert open_errno(d, alice, minor) == "ENXIO"
    # A process keeps the grant in use beyond idle_timeout...
    proc = burns(d.config_path, minor, "1GiB", user=alice, seconds=4)
    time.sleep(3)
    assert [g["minor"] for g in whoami_json(d, alice)["grants"]] == [minor]
    assert proc.wait(timeout=MARGIN) == 0
    # ...and once it is gone, idle_timeout later the grant goes.
    mine = wait_for(lambda: (w := whoami_json(d, alice)) and not w["grants"] and w)
    assert mine and not mine["grants"]
    [release] = [e for e in mine["events"] if e["kind"] == "release" and e["rule"] == "idle"]
    assert "none of your processes used it" in release["message"] and "gpuguard request" in release["message"]
    assert mine["sessions"], "idle release must leave the user's sessions alone"
    assert open_errno(d, alice, minor) in ("EPERM", "EACCES")
    requested = d.cli_as(alice, "request", "--json")
    assert requested.returncode == 0, requested.stderr
    again = json.loads(requested.stdout)["gpus"]
    assert len(again) == 1 and open_errno(d, alice, again[0]) == "ENXIO"
    # Usage is written once a minute and at shutdown: busy while the burn ran, idle after.
    assert d.stop() == 0
    store = Store(d.config.paths.state_dir / "state.db")
    [first] = [u for u in store.usage(alice.uid) if u["minor"] == minor]
    store.close()
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
    fault = d.device_dir / ".gpuguard-sim" / "fail"
    fault.write_text("NVML_ERROR_GPU_IS_LOST\n")
    try:
        proc = burns(d.config_path, minor, "6GiB", user=alice)
        # Long enough for warn + grace + TERM + kill_wait + KILL had the samples been good.
        ticks = int((GRACE + 2 * KILL_WAIT) / INTERVAL) + 5
        assert wait_for(lambda: d.log().count("event=sample_failed") >= ticks, timeout=ticks * INTERVAL + MARGIN)
        assert "GPU is lost" in d.log() or "Gpu is lost" in d.log()
        assert proc.poll() is None
        assert events(d, alice, pid=proc.pid) == []
    finally:
        fault.unlink(missing_ok=True)
    # Healed: the loop went on and now acts.
    assert proc.wait(timeout=INTERVAL + GRACE + KILL_WAIT + MARGIN) == -signal.SIGTERM
    assert [e["action"] for e in events(d, alice, pid=proc.pid)] == ["warn", "term"]


@pytest.mark.skipif(not FREEZER.is_dir(), reason="needs the cgroup v1 freezer to make a process survive SIGKILL")
def test_unkillable_process_is_reported_and_the_loop_goes_on(start_daemon, burns):
    d = start_daemon(defaults={"gpus": 1, "gpu_memory": "4GiB"}, watcher={**WATCHER, "grace": "2s"})
    alice, bob = d.add_member(), d.add_member()
    minor_a, minor_b = session_gpu(d, alice), session_gpu(d, bob)
    cgroup = FREEZER / unique()
    cgroup.mkdir()
    stuck = burns(d.config_path, minor_a, "6GiB", user=alice)
    try:
        (cgroup / "cgroup.procs").write_text(str(stuck.pid))
        (cgroup / "freezer.state").write_text("FROZEN")  # in the kernel's freezer: SIGKILL waits (state D)
        [report] = wait_for(lambda: events(d, alice, pid=stuck.pid, action="unkillable"),
                            timeout=INTERVAL + 2 + 2 * KILL_WAIT + MARGIN)
        assert report["kind"] == "unkillable" and report["numbers"]["state"].startswith("D")
        assert "survives SIGKILL" in report["message"]
        assert stuck.poll() is None
        # The loop goes on: bob's over-quota burn is still handled.
        other = burns(d.config_path, minor_b, "6GiB", user=bob)
        assert other.wait(timeout=INTERVAL + 2 + KILL_WAIT + MARGIN) == -signal.SIGTERM
    finally:
        (cgroup / "freezer.state").write_text("THAWED")
        stuck.wait(timeout=MARGIN)
        wait_for(lambda: not (cgroup / "tasks").read_text().strip())
        cgroup.rmdir()
    assert stuck.returncode == -signal.SIGKILL  # the pending SIGKILL lands once thawed
