"""Safe signals on real processes: pidfd, identity re-check, reused pids, root, unkillable.

"Not signalled" is never read off a process that merely looks alive after a pause: the test
processes are reporters (REPORTER) that write the number of every signal they get to a pipe.
`received(proc)` sends a probe signal after whatever the test did and reads up to the probe's
line: a signal sent before it is on an earlier line (see REPORTER), and a SIGKILL leaves
the pipe at EOF instead, so the answer is complete however slow the machine.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import PYTHON, popen_as
from freezer import frozen

from devtools.harness import wait_for
from gpuguard.backends import signals
from gpuguard.core.model import ProcessIdentity, SignalOutcome

ANSWER = 60.0  # seconds: a bound on a reporter answering, not an expectation
PROBE = signal.SIGRTMAX

# Reports every signal it gets, by number, one line each on stdout; "ready" once set up. Signal
# numbers given as arguments are ignored (SIG_IGN) instead. All the others are blocked and taken
# with sigwaitinfo(), which returns pending signals lowest number first (the kernel's order; no
# Python handler can run out of turn), so a signal sent before the probe (SIGRTMAX, the highest)
# is reported before it. SIGKILL and SIGSTOP cannot be blocked: they kill or stop it.
REPORTER = r"""
import os, signal, sys
ignored = {int(arg) for arg in sys.argv[1:]}
for sig in ignored:
    signal.signal(sig, signal.SIG_IGN)
watched = signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP} - ignored
signal.pthread_sigmask(signal.SIG_BLOCK, watched)
os.write(1, b"ready\n")
while True:
    os.write(1, b"%d\n" % signal.sigwaitinfo(watched).si_signo)
"""


def read_line(proc: subprocess.Popen) -> str | None:
    """The reporter's next line; "" at EOF (it died), None when it says nothing for ANSWER seconds."""
    if not select.select([proc.stdout], [], [], ANSWER)[0]:
        return None
    return proc.stdout.readline().decode().strip()


def received(proc: subprocess.Popen) -> list[str]:
    """Every signal the reporter got since the last call (numbers, as text); [] if none.
    A reporter that died says so ("died: -9") and one that went silent, "silent"."""
    os.kill(proc.pid, PROBE)
    lines: list[str] = []
    while (line := read_line(proc)) != str(int(PROBE)):
        if line is None:
            return [*lines, "silent"]
        if line == "":
            return [*lines, f"died: {proc.wait(ANSWER)}"]
        lines.append(line)
    return lines


def identity_of(proc: subprocess.Popen) -> ProcessIdentity:
    info = wait_for(lambda: signals.inspect(proc.pid))
    return info.identity


def pending(pid: int) -> set[int]:
    """Signals pending for the process (thread and shared), from /proc/<pid>/status."""
    masks = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")):
            masks |= int(line.split()[1], 16)
    return {bit + 1 for bit in range(64) if masks >> bit & 1}


@pytest.fixture
def user(make_user):
    return make_user()


@pytest.fixture
def spawn(user):
    """Start real processes (the test user's unless as_root); all are killed and reaped afterwards.
    Without argv: a REPORTER, returned once its handlers are in place (ignoring `ignore`)."""
    started: list[subprocess.Popen] = []

    def start(argv: list[str] | None = None, *, as_root: bool = False, ignore: tuple[int, ...] = (),
              **popen) -> subprocess.Popen:
        reporter = argv is None
        if reporter:
            argv = [PYTHON, "-c", REPORTER, *map(str, ignore)]
            popen.update(stdout=subprocess.PIPE, bufsize=0)
        proc = subprocess.Popen(argv, cwd="/", **popen) if as_root else popen_as(user, argv, **popen)
        started.append(proc)
        if reporter:
            assert read_line(proc) == "ready"
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout:
            proc.stdout.close()


def test_term_reaches_the_process_named(spawn, user):
    proc = spawn()
    identity = identity_of(proc)
    assert identity.uid == user.uid
    assert signals.send(identity, signal.SIGTERM).outcome is SignalOutcome.SENT
    assert received(proc) == [str(int(signal.SIGTERM))]


def test_exited_process_is_gone(spawn):
    proc = spawn(["true"])
    proc.wait()
    result = signals.send(ProcessIdentity(proc.pid, 1, 1), signal.SIGKILL)
    assert result.outcome is SignalOutcome.GONE


def test_zombie_is_gone_not_signalled(spawn):
    proc = spawn(["true"])
    identity = identity_of(proc)  # read before it exits: a zombie keeps its identity
    wait_for(lambda: (info := signals.inspect(proc.pid)) is None or info.state == "Z")
    assert signals.send(identity, signal.SIGKILL).outcome is SignalOutcome.GONE


def test_recorded_start_time_of_another_process_is_not_signalled(spawn):
    proc = spawn()
    identity = identity_of(proc)
    stale = identity._replace(start_time=identity.start_time - 1)  # what an earlier holder of the pid had
    result = signals.send(stale, signal.SIGKILL)
    assert result.outcome is SignalOutcome.GONE and "another process" in result.detail
    assert received(proc) == []


def test_wrong_uid_is_not_signalled(spawn):
    proc = spawn()
    identity = identity_of(proc)
    assert signals.send(identity._replace(uid=identity.uid + 1), signal.SIGKILL).outcome is SignalOutcome.GONE
    assert received(proc) == []


# Runs as root in a fresh pid namespace; argv: the test user's uid, REPORTER, PROBE.
REUSE_SCRIPT = r"""
import json, os, select, signal, subprocess, sys
from gpuguard.backends import signals

(uid, gid), reporter, probe = map(int, sys.argv[1].split(":")), sys.argv[2], int(sys.argv[3])

def line_of(child):
    if not select.select([child.stdout], [], [], 60)[0]:
        return None
    return child.stdout.readline().decode().strip()

def spawn(pid=None):
    if pid is not None:  # in this fresh pid namespace nobody else forks: the next pid is pid
        with open("/proc/sys/kernel/ns_last_pid", "w") as handle:
            handle.write(str(pid - 1))
    # The user's own group, not root's: gid 0 would be denied by group bits on a 0700 /root checkout.
    child = subprocess.Popen([sys.executable, "-c", reporter], user=uid, group=gid, extra_groups=[],
                             stdout=subprocess.PIPE, bufsize=0)
    assert pid is None or child.pid == pid, (child.pid, pid)
    assert line_of(child) == "ready"
    return child

def received(child):  # as in test_signals.received
    os.kill(child.pid, probe)
    lines = []
    while (line := line_of(child)) != str(probe):
        if line is None:
            return lines + ["silent"]
        if line == "":
            return lines + [f"died: {child.wait(60)}"]
        lines.append(line)
    return lines

out = {}
# 1. The recorded process exited and its pid went to a newcomer.
a = spawn()
identity_a = signals.inspect(a.pid).identity
a.kill(); a.wait()
b = spawn(a.pid)
out["reuse"] = signals.send(identity_a, signal.SIGKILL).outcome.value
out["reuse_pid_same"] = b.pid == a.pid
out["newcomer_received"] = received(b)

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
out["race_pid_same"] = replacement[0].pid == c.pid
out["race_newcomer_received"] = received(replacement[0])
for child in (b, *replacement):
    child.kill(); child.wait()
print(json.dumps(out))
"""


def test_reused_pid_is_never_signalled(user, sandbox):
    """Real pid reuse, forced in a private pid namespace (ns_last_pid), so it is deterministic.
    Everything the script starts dies with it: it is the namespace's init."""
    script = sandbox / "reuse.py"
    script.write_text(REUSE_SCRIPT)
    run = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", PYTHON, str(script),
                          f"{user.uid}:{user.gid}", REPORTER, str(int(PROBE))],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out == {"reuse": "gone", "reuse_pid_same": True, "newcomer_received": [],
                   "race": "gone", "race_pid_same": True, "race_newcomer_received": []}


def test_term_ignoring_process_needs_kill(spawn):
    proc = spawn(ignore=(signal.SIGTERM,))  # SIG_IGN is in place once it says "ready"
    identity = identity_of(proc)
    assert signals.send(identity, signal.SIGTERM).sent
    assert received(proc) == []  # ignored: neither caught nor fatal
    assert signals.send(identity, signal.SIGKILL).sent
    assert proc.wait(timeout=ANSWER) == -signal.SIGKILL


def test_root_is_never_signalled(spawn):
    proc = spawn(as_root=True)
    identity = identity_of(proc)
    assert identity.uid == 0
    assert signals.send(identity, signal.SIGKILL).outcome is SignalOutcome.REFUSED
    assert received(proc) == []


def test_exempt_uid_is_never_signalled(spawn, user):
    proc = spawn()
    assert signals.send(identity_of(proc), signal.SIGKILL, exempt={user.uid}).outcome is SignalOutcome.REFUSED
    assert received(proc) == []


def test_setuid_root_process_is_never_signalled(spawn, user):
    # Real uid of the user, effective uid root (a setuid program): still root's business.
    proc = spawn(as_root=True, preexec_fn=lambda: os.setresuid(user.uid, 0, 0))
    info = signals.inspect(proc.pid)
    assert (info.uid, info.euid) == (user.uid, 0)
    assert signals.send(info.identity, signal.SIGKILL).outcome is SignalOutcome.REFUSED
    assert received(proc) == []


def test_process_that_survives_sigkill_shows_uninterruptible(spawn, sandbox):
    proc = spawn()
    identity = identity_of(proc)
    with frozen(proc.pid, sandbox):
        assert signals.send(identity, signal.SIGKILL).sent
        # Delivered (pending: the kernel marks it during the send) and survived: frozen, in state D.
        assert signal.SIGKILL in pending(proc.pid)
        assert proc.poll() is None
        assert signals.state(identity) == "D (uninterruptible sleep)"
    assert proc.wait(timeout=ANSWER) == -signal.SIGKILL  # the pending SIGKILL lands once thawed
    assert signals.state(identity) is None


def test_command_is_printable(spawn, sandbox):
    evil = sandbox / "ev\x1b[31mil"
    evil.symlink_to("/bin/sleep")
    proc = spawn([str(evil), "600"])
    wait_for(lambda: signals.command(proc.pid) not in ("", "python3"))
    assert signals.command(proc.pid) == r"ev\x1b[31mil"  # escaped as everywhere else (escape.printable)
    assert signals.command(2**22 + 1) == ""


def test_inspect_reads_comm_with_parentheses(spawn, sandbox):
    odd = sandbox / "a) b (c"
    odd.symlink_to("/bin/sleep")
    proc = spawn([str(odd), "600"])
    info = wait_for(lambda: (i := signals.inspect(proc.pid)) and i.comm == "a) b (c" and i)
    assert info.state in "SR" and info.start_time > 0
