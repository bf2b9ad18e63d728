"""Notebook kernels start with the user's GPUs (issue 38, 3 and 6): `gpuguard jupyter install-kernel`
as a member, then a real kernel start by jupyter_client (Debian's python3-jupyter-client and
python3-ipykernel, run by /usr/bin/python3: the test venv does not see Debian's packages) as that
member, whose code prints its CUDA_VISIBLE_DEVICES. A user who holds GPUs gets them from the
held-devices file (and the kernel is the process Jupyter started: exec), one who holds none gets
one at start (after waiting in the queue, said on stderr), --release-on-exit gives it back at
shutdown, and with the daemon down the file is used and the service said to be down."""
from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
from conftest import BIN, popen_as, run_as, unique
from conftest import TestUser as Member  # not collected as a test class
from sim_helpers import gpuguard
from test_queue_daemon import queue_users

from devtools.harness import wait_for

JUPYTER_PYTHON = "/usr/bin/python3"  # Debian's, which has jupyter_client and ipykernel
CLIENT = """
import json, os, sys
from jupyter_client.manager import start_new_kernel
km, kc = start_new_kernel(kernel_name=sys.argv[1], startup_timeout=120)
out = []
kc.execute_interactive('import os; print(os.environ.get("CUDA_VISIBLE_DEVICES")); print(os.getpid(), os.getppid())',
                       timeout=60, output_hook=lambda m: out.append(m["content"].get("text", "")))
print("executed", file=sys.stderr, flush=True)
started = km.provisioner.pid  # the process jupyter_client started
sys.stdin.readline()  # the test says when to shut the kernel down
kc.stop_channels()
km.shutdown_kernel()
cvd, pids = "".join(out).splitlines()
pid, ppid = map(int, pids.split())
print(json.dumps({"cvd": cvd, "started": started, "pid": pid, "ppid": ppid}))
"""

# A cell that counts the SIGINTs it gets within half a second of the first: Jupyter's interrupt
# signals the kernel's process group, and a wrapper that passed it on too would make it two (which
# Python's handler may see as one: COUNTER below cannot).
CELL = """
import signal, time
got = []
signal.signal(signal.SIGINT, lambda number, frame: got.append(number))
print("ready", flush=True)
while not got:
    time.sleep(0.01)
time.sleep(0.5)
print("sigints", len(got))
"""
INTERRUPTED = """
import sys
from jupyter_client.manager import start_new_kernel
km, kc = start_new_kernel(kernel_name=sys.argv[1], startup_timeout=120)
msg_id = kc.execute(sys.argv[2])
out = []
while True:
    message = kc.get_iopub_msg(timeout=60)
    if message["parent_header"].get("msg_id") != msg_id:
        continue
    if message["msg_type"] == "stream":
        out.append(message["content"]["text"])
        if out == ["ready\\n"]:
            km.interrupt_kernel()
    if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
        break
kc.stop_channels()
km.shutdown_kernel()
print("".join(out), end="")
"""


def _have_jupyter() -> bool:
    return subprocess.run([JUPYTER_PYTHON, "-c", "import jupyter_client, ipykernel"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _have_jupyter(), reason="python3-jupyter-client and python3-ipykernel (make deps)")


def _env(user: Member) -> dict[str, str]:
    return {"HOME": str(user.home), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def _install(d, user: Member, *options: str) -> str:
    name = unique("ggt-kernel")
    done = run_as(user, gpuguard(d.config_path, "jupyter", "install-kernel", "--python", JUPYTER_PYTHON, "--name", name,
                                 *options), env=_env(user))
    assert done.returncode == 0, done.stderr
    assert f"{user.home}/.local/share/jupyter/kernels/{name}" in done.stdout
    return name


def _start(user: Member, name: str) -> subprocess.Popen:
    return popen_as(user, [JUPYTER_PYTHON, "-c", CLIENT, name], env=_env(user), stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _executed(kernel: subprocess.Popen) -> list[str]:
    """The client's stderr (the wrapper's and the kernel's lines) up to the executed cell's."""
    lines = []
    while (line := kernel.stderr.readline()) and line != "executed\n":
        lines.append(line.rstrip("\n"))
    assert line, f"the kernel did not run the cell: {lines}"
    return lines


def _shut_down(kernel: subprocess.Popen) -> tuple[dict, str]:
    """Shut the kernel down: what its cell printed and the client's stderr from then on."""
    out, err = kernel.communicate("\n", timeout=120)
    assert kernel.returncode == 0, err
    return json.loads(out), err


def _run(user: Member, name: str) -> tuple[dict, list[str]]:
    kernel = _start(user, name)
    try:
        before = _executed(kernel)
        seen, after = _shut_down(kernel)
    finally:
        kernel.kill()
    return seen, before + after.splitlines()


def test_a_kernel_has_the_gpus_its_user_holds_and_is_the_process_jupyter_started(start_daemon):
    d = start_daemon(count=2, gate=False, defaults={"gpus": 2})
    alice = d.add_member()
    held = d.call_as(alice, "request", gpus=2)["granted"]
    name = _install(d, alice)
    seen, err = _run(alice, name)
    assert set(seen["cvd"].split(",")) == {d.uuid(minor) for minor in held}
    assert seen["pid"] == seen["started"]  # the wrapper became the kernel
    assert not [line for line in err if line.startswith("gpuguard")]  # the file answered: nothing to say
    assert sorted(d.granted_minors(alice)) == sorted(held)


def test_a_user_holding_none_waits_for_one_at_kernel_start_and_release_on_exit_gives_it_back(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice, bob = d.add_member(), d.add_member()
    (minor,) = d.call_as(bob, "request", gpus=1)["granted"]
    name = _install(d, alice, "--release-on-exit")
    kernel = _start(alice, name)
    try:
        assert wait_for(lambda: queue_users(d) == [alice.name], 60)
        waiting = kernel.stderr.readline()
        assert waiting.startswith("gpuguard: no GPU is free right now; you are number 1 of 1 in the queue"), waiting
        d.call_as(bob, "release")
        assert f"GPU {minor}" in _executed(kernel)[0]  # the grant's line, then the kernel's start
        assert d.granted_minors(alice) == [minor]
        seen, err = _shut_down(kernel)
    finally:
        kernel.kill()
    assert seen["cvd"] == d.uuid(minor)
    assert seen["ppid"] == seen["started"]  # the wrapper waited for the kernel, to give back
    assert f"released GPU {minor}" in err
    assert d.granted_minors(alice) == []


def test_without_release_on_exit_the_gpu_taken_stays_held(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice = d.add_member()
    seen, err = _run(alice, _install(d, alice))
    (minor,) = d.granted_minors(alice)
    assert seen["cvd"] == d.uuid(minor) and seen["pid"] == seen["started"]
    assert err[0].startswith(f"gpuguard: GPU {minor} "), err


def test_with_the_daemon_down_the_kernel_has_the_held_gpus_and_says_the_service_is_down(start_daemon):
    d = start_daemon(count=2, gate=False, defaults={"gpus": 2})
    alice, bob = d.add_member(), d.add_member()
    (minor,) = d.call_as(alice, "request", gpus=1)["granted"]
    uuid = d.uuid(minor)
    plain, two = _install(d, alice), _install(d, alice, "--gpus", "2")
    none = _install(d, bob)
    assert d.stop() == 0

    seen, err = _run(alice, plain)  # the file names enough: the daemon is not asked
    assert seen["cvd"] == uuid
    seen, err = _run(alice, two)  # it must ask for a second, and cannot
    assert seen["cvd"] == uuid
    (said,) = [line for line in err if line.startswith("gpuguard")]
    assert "service is down" in said and "the GPUs you hold" in said
    seen, err = _run(bob, none)  # nothing held, nothing to take: a kernel with no GPU, not one that dies
    assert seen["cvd"] == ""
    (said,) = [line for line in err if line.startswith("gpuguard")]
    assert "service is down" in said and "no GPU" in said


def test_an_interrupt_reaches_a_kernel_behind_release_on_exit_once(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice = d.add_member()
    name = _install(d, alice, "--release-on-exit")
    done = run_as(alice, [JUPYTER_PYTHON, "-c", INTERRUPTED, name, CELL], env=_env(alice), timeout=180)
    assert (done.returncode, done.stdout) == (0, "ready\nsigints 1\n"), done.stderr
    assert d.granted_minors(alice) == []  # taken for the kernel, given back at its shutdown


# A single-threaded stand-in kernel that takes each SIGINT by sigwaitinfo, so that two are two (a
# Python handler may see two that come together as one, as the cell above would).
COUNTER = """
import signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
print("ready", flush=True)
senders = [signal.sigwaitinfo({signal.SIGINT}).si_pid]
while (info := signal.sigtimedwait({signal.SIGINT}, 1)) is not None:
    senders.append(info.si_pid)
print("sigints", len(senders), flush=True)
"""


def test_the_wrapper_passes_on_none_of_the_signals_jupyter_sends_its_process_group(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice = d.add_member()
    argv = gpuguard(d.config_path, "jupyter", "kernel", "--release-on-exit", "--", JUPYTER_PYTHON, "-c", COUNTER)
    kernel = popen_as(alice, argv, env=_env(alice), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                      start_new_session=True)  # as jupyter_client starts a kernel
    try:
        assert kernel.stdout.readline() == "ready\n"
        os.killpg(kernel.pid, signal.SIGINT)  # jupyter_client's interrupt
        out, err = kernel.communicate(timeout=60)
    finally:
        kernel.kill()
    assert (kernel.returncode, out) == (0, "sigints 1\n"), err
    assert d.granted_minors(alice) == []


def test_an_interrupt_while_waiting_leaves_the_queue_and_starts_the_kernel_without_a_gpu(start_daemon):
    d = start_daemon(count=1, gate=False)
    alice, bob = d.add_member(), d.add_member()
    d.call_as(bob, "request", gpus=1)
    show = 'import os; print(repr(os.environ["CUDA_VISIBLE_DEVICES"]))'
    argv = gpuguard(d.config_path, "jupyter", "kernel", "--", JUPYTER_PYTHON, "-c", show)
    kernel = popen_as(alice, argv, env={**_env(alice), "CUDA_VISIBLE_DEVICES": "GPU-stale"}, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert wait_for(lambda: queue_users(d) == [alice.name], 60)
        os.killpg(kernel.pid, signal.SIGINT)  # the notebook's interrupt button
        out, err = kernel.communicate(timeout=60)
    finally:
        kernel.kill()
    assert (kernel.returncode, out) == (0, "''\n"), err  # no GPU, and not the stale one it was started with
    assert err.splitlines()[-1] == ("gpuguard: interrupted: you left the queue; this kernel starts with no GPU "
                                    "(restart it to ask again)")
    assert queue_users(d) == [] and d.granted_minors(alice) == []


def test_install_kernel_in_a_shared_directory_runs_none_of_another_users_modules(start_daemon, make_user, sandbox):
    """`-c` puts the working directory first on sys.path: alice installing from /tmp (here a
    sticky directory like it) must not import the json.py mallory left there."""
    d = start_daemon(count=1, gate=False)
    alice, mallory = d.add_member(), make_user()
    shared = sandbox / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    proof = shared / "ggt-ran"
    planted = run_as(mallory, ["sh", "-c", f"printf '%s\\n' \"open('{proof}', 'w').write('ran')\" "
                                           f"'from json_real import *' > {shared}/json.py"])
    assert planted.returncode == 0, planted.stderr
    name = unique("ggt-kernel")
    command = [str(BIN / "gpuguard"), "--config", str(d.config_path)]  # as users run it: `python -m` reads the cwd too
    done = subprocess.run([*command, "jupyter", "install-kernel", "--python", JUPYTER_PYTHON, "--name", name],
                          user=alice.uid, group=alice.gid, cwd=shared, env=_env(alice),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not proof.exists()
    assert json.loads((alice.home / ".local/share/jupyter/kernels" / name / "kernel.json").read_text())["argv"]
