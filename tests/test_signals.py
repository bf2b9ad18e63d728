"""Safe signals on real processes: pidfd, identity re-check, reused pids, root, unkillable."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PYTHON, popen_as, unique, wait_for
from gpuguard.backends import signals
from gpuguard.backends.procfs import ProcessIdentity
from gpuguard.backends.signals import Outcome

FREEZER = Path("/sys/fs/cgroup/freezer")



def identity_of(proc: subprocess.Popen) -> ProcessIdentity:
    info = wait_for(lambda: signals.inspect(proc.pid))
    return info.identity


@pytest.fixture
def user(make_user):
    return make_user()


@pytest.fixture
def spawn(user):
    """Start real processes of the test user; all are killed and reaped afterwards."""
    started: list[subprocess.Popen] = []

    def start(argv: list[str] | None = None) -> subprocess.Popen:
        proc = popen_as(user, argv or ["sleep", "600"])
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_term_reaches_the_process_named(spawn, user):
    proc = spawn()
    identity = identity_of(proc)
    assert identity.uid == user.uid
    assert signals.send(identity, signal.SIGTERM).outcome is Outcome.SENT
    assert proc.wait(timeout=10) == -signal.SIGTERM


def test_exited_process_is_gone(spawn):
    proc = spawn(["true"])
    proc.wait()
    result = signals.send(ProcessIdentity(proc.pid, 1, 1), signal.SIGKILL)
    assert result.outcome is Outcome.GONE


def test_zombie_is_gone_not_signalled(spawn):
    proc = spawn(["true"])
    identity = identity_of(proc)  # read before it exits: a zombie keeps its identity
    wait_for(lambda: (info := signals.inspect(proc.pid)) is None or info.state == "Z")
    assert signals.send(identity, signal.SIGKILL).outcome is Outcome.GONE


def test_recorded_start_time_of_another_process_is_not_signalled(spawn):
    proc = spawn()
    identity = identity_of(proc)
    stale = identity._replace(start_time=identity.start_time - 1)  # what an earlier holder of the pid had
    result = signals.send(stale, signal.SIGKILL)
    assert result.outcome is Outcome.GONE and "another process" in result.detail
    time.sleep(0.2)
    assert proc.poll() is None


def test_wrong_uid_is_not_signalled(spawn):
    proc = spawn()
    identity = identity_of(proc)
    assert signals.send(identity._replace(uid=identity.uid + 1), signal.SIGKILL).outcome is Outcome.GONE
    time.sleep(0.2)
    assert proc.poll() is None


REUSE_SCRIPT = r"""
import json, os, signal, subprocess, sys, time
from gpuguard.backends import signals

uid = int(sys.argv[1])

def spawn(pid=None):
    if pid is not None:  # in this fresh pid namespace nobody else forks: the next pid is pid
        with open("/proc/sys/kernel/ns_last_pid", "w") as handle:
            handle.write(str(pid - 1))
    child = subprocess.Popen(["sleep", "600"], user=uid)
    assert pid is None or child.pid == pid, (child.pid, pid)
    time.sleep(0.05)
    return child

out = {}
# 1. The recorded process exited and its pid went to a newcomer.
a = spawn()
identity_a = signals.inspect(a.pid).identity
a.kill(); a.wait()
time.sleep(0.05)
b = spawn(a.pid)
out["reuse"] = signals.send(identity_a, signal.SIGKILL).outcome.value
out["reuse_pid_same"] = b.pid == a.pid
time.sleep(0.1)
out["newcomer_alive"] = b.poll() is None

# 2. The worst race: the process is replaced between pidfd_open and the /proc check, and the
#    newcomer even looks identical (same uid, started in the same clock tick). Only the pidfd,
#    opened first, can tell them apart.
c = spawn()
info_c = signals.inspect(c.pid)
real_inspect = signals.inspect
replacement = []
def racing_inspect(pid):
    c.kill(); c.wait()
    replacement.append(spawn(c.pid))
    return info_c  # what /proc would say if the newcomer started in the same tick
signals.inspect = racing_inspect
out["race"] = signals.send(info_c.identity, signal.SIGKILL).outcome.value
signals.inspect = real_inspect
time.sleep(0.1)
out["race_pid_same"] = replacement[0].pid == c.pid
out["race_newcomer_alive"] = replacement[0].poll() is None
for child in (b, *replacement):
    child.kill(); child.wait()
print(json.dumps(out))
"""


def test_reused_pid_is_never_signalled(user, sandbox):
    """Real pid reuse, forced in a private pid namespace (ns_last_pid), so it is deterministic."""
    script = sandbox / "reuse.py"
    script.write_text(REUSE_SCRIPT)
    run = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", PYTHON, str(script), str(user.uid)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out == {"reuse": "gone", "reuse_pid_same": True, "newcomer_alive": True,
                   "race": "gone", "race_pid_same": True, "race_newcomer_alive": True}


def test_term_ignoring_process_needs_kill(spawn):
    proc = spawn([PYTHON, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                "print('ready', flush=True); time.sleep(600)"])
    identity = identity_of(proc)
    time.sleep(0.5)  # let it install the handler
    assert signals.send(identity, signal.SIGTERM).sent
    time.sleep(0.3)
    assert proc.poll() is None
    assert signals.send(identity, signal.SIGKILL).sent
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_root_is_never_signalled():
    proc = subprocess.Popen(["sleep", "600"])
    try:
        identity = identity_of(proc)
        assert identity.uid == 0
        assert signals.send(identity, signal.SIGKILL).outcome is Outcome.REFUSED
        time.sleep(0.2)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_exempt_uid_is_never_signalled(spawn, user):
    proc = spawn()
    assert signals.send(identity_of(proc), signal.SIGKILL, exempt={user.uid}).outcome is Outcome.REFUSED
    time.sleep(0.2)
    assert proc.poll() is None


def test_setuid_root_process_is_never_signalled(spawn):
    # Real uid of the user, effective uid root (a setuid program): still root's business.
    proc = subprocess.Popen([PYTHON, "-c", "import os, time; os.setresuid(os.getuid(), 0, 0); time.sleep(600)"],
                            preexec_fn=lambda: os.setresuid(54321, 0, 0))
    try:
        info = wait_for(lambda: (i := signals.inspect(proc.pid)) and i.uid == 54321 and i)
        assert info.euid == 0
        assert signals.send(info.identity, signal.SIGKILL).outcome is Outcome.REFUSED
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not FREEZER.is_dir(),
                    reason="needs the cgroup v1 freezer (a frozen task survives SIGKILL until thawed)")
def test_process_that_survives_sigkill_shows_uninterruptible(spawn):
    cgroup = FREEZER / unique()
    cgroup.mkdir()
    proc = spawn()
    try:
        identity = identity_of(proc)
        (cgroup / "cgroup.procs").write_text(str(proc.pid))
        (cgroup / "freezer.state").write_text("FROZEN")
        wait_for(lambda: (cgroup / "freezer.state").read_text().strip() == "FROZEN")
        assert signals.send(identity, signal.SIGKILL).sent
        time.sleep(0.5)
        assert proc.poll() is None
        assert signals.state(identity) == "D (uninterruptible sleep)"
    finally:
        (cgroup / "freezer.state").write_text("THAWED")
        proc.kill()
        proc.wait(timeout=10)
        wait_for(lambda: not (cgroup / "tasks").read_text().strip())
        cgroup.rmdir()
    assert signals.state(identity) is None


def test_command_is_printable(spawn, sandbox):
    evil = sandbox / "ev\x1b[31mil"
    evil.symlink_to("/bin/sleep")
    proc = spawn([str(evil), "600"])
    wait_for(lambda: signals.command(proc.pid) not in ("", "python3"))
    assert signals.command(proc.pid) == "ev?[31mil"
    assert signals.command(2**22 + 1) == ""


def test_inspect_reads_comm_with_parentheses(spawn, sandbox):
    odd = sandbox / "a) b (c"
    odd.symlink_to("/bin/sleep")
    proc = spawn([str(odd), "600"])
    info = wait_for(lambda: (i := signals.inspect(proc.pid)) and i.comm == "a) b (c" and i)
    assert info.state in "SR" and info.start_time > 0
