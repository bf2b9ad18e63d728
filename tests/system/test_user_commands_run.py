"""Scripts and jobs get GPUs (issue 38, 4): `eval "$(gpuguard request --wait)"` in a real bash,
and `gpuguard run -- CMD`: the command sees the user's GPUs, gets the signals meant for it (once,
from a real terminal's ^C too), its exit code is run's, and what run took (only that) goes back
when it ends, after ^C while waiting as well."""
from __future__ import annotations

import fcntl
import os
import shlex
import signal
import subprocess
import termios
import textwrap
from pathlib import Path

import pytest
from conftest import PYTHON, popen_as, run_as
from sim_helpers import gpuguard
from test_queue_daemon import queue_users

from devtools.harness import wait_for

# A command that says what it sees, then (once told it may) waits for a signal and reports every
# one it got within half a second of the first: a ^C passed on twice shows as two.
JOB = textwrap.dedent("""
    import os, signal, sys, time
    got = []
    for signo in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signo, lambda number, frame: got.append(number))
    with open(sys.argv[1] + ".tmp", "w") as ready:
        ready.write(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    while not got:
        time.sleep(0.01)
    time.sleep(0.5)
    print("signals=" + ",".join(str(n) for n in got), flush=True)
    sys.exit(7)
""")


def _daemon(start_daemon):
    """Two GPUs, a quota of two each."""
    return start_daemon(count=2, gate=False, defaults={"gpus": 2})


def _shell(config: Path, *args: str) -> str:
    return shlex.join(gpuguard(config, *args))


def test_eval_of_request_wait_and_env_sets_the_shells_variable(start_daemon):
    d = _daemon(start_daemon)
    alice = d.add_member()
    script = (f'eval "$({_shell(d.config_path, "request", "--wait", "--gpus", "1")})" || exit 9\n'
              'echo "cvd=$CUDA_VISIBLE_DEVICES"\nunset CUDA_VISIBLE_DEVICES\n'
              f'eval "$({_shell(d.config_path, "env")})" || exit 8\necho "env=$CUDA_VISIBLE_DEVICES"\n')
    result = run_as(alice, ["bash", "-c", script])
    (grant,) = d.grants(alice)
    assert result.returncode == 0, result
    assert result.stdout.splitlines() == [f"cvd={grant['uuid']}", f"env={grant['uuid']}"]
    assert result.stderr.startswith(f"gpuguard: GPU {grant['minor']} ")  # the human line, beside the export


def test_run_gives_the_command_the_users_gpus_and_takes_back_only_what_it_took(start_daemon):
    d = _daemon(start_daemon)
    alice = d.add_member()
    (held,) = d.call_as(alice, "request", gpus=1)["granted"]
    result = d.cli_as(alice, "run", "--gpus", "2", "--", "sh", "-c", 'echo "cvd=$CUDA_VISIBLE_DEVICES"; exit 3')
    assert result.returncode == 3, result.stderr
    assert set(result.stdout.strip().removeprefix("cvd=").split(",")) == {d.uuid(0), d.uuid(1)}
    assert d.granted_minors(alice) == [held]  # the one run took went back; hers stayed
    assert f"released GPU {1 - held}" in result.stderr

    plain = d.cli_as(alice, "run", "--", "sh", "-c", 'echo "cvd=$CUDA_VISIBLE_DEVICES"')  # she holds 1: enough
    assert (plain.returncode, plain.stdout) == (0, f"cvd={d.uuid(held)}\n")
    assert d.granted_minors(alice) == [held]


def test_run_says_when_the_command_cannot_start_and_gives_back(start_daemon):
    d = _daemon(start_daemon)
    alice = d.add_member()
    missing = d.cli_as(alice, "run", "--", "ggt-no-such-command")
    assert missing.returncode == 127
    assert "gpuguard: run: ggt-no-such-command: command not found" in missing.stderr
    assert d.granted_minors(alice) == []
    empty = d.cli_as(alice, "run")
    assert (empty.returncode, empty.stderr.count("\n")) == (2, 1)
    assert d.granted_minors(alice) == []


def _started(d, user, directory: Path, *options: str, **kwargs) -> tuple[subprocess.Popen, Path]:
    ready = directory / "ready"
    job = popen_as(user, gpuguard(d.config_path, "run", *options, "--", PYTHON, "-c", JOB, str(ready)),
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    return job, ready


@pytest.mark.parametrize("signo", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_sent_to_run_reaches_the_command_once(start_daemon, signo):
    d = _daemon(start_daemon)
    alice = d.add_member()
    job, ready = _started(d, alice, alice.home)
    try:
        assert wait_for(ready.exists, 30)
        (minor,) = d.granted_minors(alice)
        assert ready.read_text() == d.uuid(minor)
        job.send_signal(signo)
        out, err = job.communicate(timeout=30)
    finally:
        job.kill()
    assert (job.returncode, out) == (7, f"signals={int(signo)}\n"), err
    assert d.granted_minors(alice) == []


def test_a_command_a_signal_ends_gives_128_plus_it_and_its_gpus_back(start_daemon):
    d = _daemon(start_daemon)
    alice = d.add_member()
    job = popen_as(alice, gpuguard(d.config_path, "run", "--", "sleep", "600"), stdout=-1, stderr=-1, text=True)
    try:
        assert wait_for(lambda: d.granted_minors(alice) != [], 30)
        assert wait_for(lambda: any(_command(pid) == "sleep" for pid in _children(job.pid)), 30)
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=30)
    finally:
        job.kill()
    assert job.returncode == 128 + signal.SIGTERM, err
    assert d.granted_minors(alice) == []


def test_ctrl_c_on_a_real_terminal_reaches_the_command_once(start_daemon):
    """^C typed on a terminal goes to its whole foreground group, run and the command both: run
    must not pass on a second one."""
    d = _daemon(start_daemon)
    alice = d.add_member()
    ready = alice.home / "ready"
    master, slave = os.openpty()

    def terminal() -> None:  # runs after setsid: the pty becomes this session's terminal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    argv = gpuguard(d.config_path, "run", "--", PYTHON, "-c", JOB, str(ready))
    job = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, user=alice.uid, group=alice.gid,
                           extra_groups=[_gid(d.group)], cwd="/",
                           start_new_session=True, preexec_fn=terminal)
    os.close(slave)
    try:
        assert wait_for(ready.exists, 30)
        os.write(master, b"\x03")  # ^C
        job.wait(30)
        output = _read_all(master)
    finally:
        job.kill()
        os.close(master)
    assert job.returncode == 7, output
    assert f"signals={int(signal.SIGINT)}" in output.replace("^C", "").splitlines(), output  # one, not two
    assert d.granted_minors(alice) == []


def test_ctrl_c_while_waiting_leaves_the_queue_and_gives_back_the_part_granted(start_daemon):
    d = _daemon(start_daemon)
    alice, bob = d.add_member(), d.add_member()
    d.call_as(alice, "request", gpus=1)
    job, ready = _started(d, bob, bob.home, "--gpus", "2", "--wait")
    try:
        assert wait_for(lambda: queue_users(d) == [bob.name], 30)
        assert len(d.granted_minors(bob)) == 1  # the free one at once, the other waited for
        assert "in the queue" in job.stderr.readline()
        job.send_signal(signal.SIGINT)
        _, err = job.communicate(timeout=30)
    finally:
        job.kill()
    assert job.returncode == 130, err
    assert err.splitlines()[-1] == "gpuguard: interrupted: you left the queue"
    assert not ready.exists()  # the command never ran
    assert queue_users(d) == [] and d.granted_minors(bob) == []


def test_run_wait_timeout_gives_up_with_exit_1_and_gives_back(start_daemon):
    d = _daemon(start_daemon)
    alice, bob = d.add_member(), d.add_member()
    d.call_as(alice, "request", gpus=1)
    result = d.cli_as(bob, "run", "--gpus", "2", "--wait", "--timeout", "1s", "--", "touch", str(bob.home / "ran"))
    assert result.returncode == 1 and "left the queue" in result.stderr, result.stderr
    assert not (bob.home / "ran").exists()
    assert queue_users(d) == [] and d.granted_minors(bob) == []


def _gid(group: str) -> int:
    import grp
    return grp.getgrnam(group).gr_gid


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _read_all(master: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: every slave end is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace").replace("\r", "")
