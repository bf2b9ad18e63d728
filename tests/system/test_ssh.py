"""A real OpenSSH login through a PAM stack with pam_gpuguard.so.

sshd runs on 127.0.0.1 at a free port with its own config (key authentication, UsePAM
yes), inside a private mount namespace in which the test stack is bind-mounted over
/etc/pam.d/sshd; the host's file is never touched (see ssh_harness.Sshd).
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import BIN, REPO
from sim_helpers import gpuguard
from ssh_harness import MESSAGE, PERMIT, UUIDS, Sshd, StubDaemon, hook_line, module_line, reply_json

from devtools.harness import wait_for

pytestmark = [pytest.mark.ssh, pytest.mark.usefixtures("pam_module")]  # tests/ssh_harness.py


@pytest.fixture
def gg_daemon(start_daemon):
    """The test daemon, with every session taking GPUs ([sessions] grant = "all"): these tests are
    about the module and the hook; which sessions take GPUs is test_scoped_sessions'."""
    return start_daemon(sessions={"grant": "all"})


@pytest.fixture
def start_sshd(sandbox):
    """start_sshd(session_lines, users) -> a running Sshd whose PAM stack ends with session_lines."""
    started: list[Sshd] = []

    def start(session_lines: list[str], users) -> Sshd:
        stack = PERMIT + "".join(line + "\n" for line in session_lines)
        sshd = Sshd(sandbox / f"sshd-{len(started)}", stack, [user.name for user in users])
        started.append(sshd)
        for user in users:
            sshd.authorize(user.home, user.uid, user.gid)
        sshd.start()
        return sshd

    yield start
    for sshd in started:
        sshd.stop()


def _fields(output: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in output.splitlines() if "=" in line)


SHOW = ('echo "cvd=${CUDA_VISIBLE_DEVICES-<unset>}"; echo "shell=$$"; echo "parent=$PPID"; '
        'echo "grandparent=$(awk \'/^PPid:/ {print $2}\' /proc/$PPID/status)"')


def test_ssh_login_gets_the_environment_from_the_module(start_sshd, make_user, sandbox):
    """Against a stub daemon: what sshd asks and when, and that the shell sees the value."""
    def reply(request):
        if request["op"] == "session_open":
            return reply_json(ok=True, cuda_visible_devices=UUIDS, message=MESSAGE)
        return reply_json(ok=True)

    daemon = StubDaemon(sandbox / "stub.sock", reply)
    try:
        user = make_user()
        sshd = start_sshd([module_line(daemon.path)], [user])
        result = sshd.ssh(user.name, SHOW)
        assert result.returncode == 0, (result, sshd.log)
        seen = _fields(result.stdout)
        assert seen["cvd"] == UUIDS
        opened = daemon.requests[0]
        assert {k: opened[k] for k in ("op", "user", "service", "rhost", "tty")} == {
            "op": "session_open", "user": user.name, "service": "sshd", "rhost": "127.0.0.1", "tty": "ssh"}
        # sshd opens the PAM session in its privileged monitor before forking the user's
        # side: the session's pid is the shell's grandparent, not the shell.
        assert opened["pid"] == int(seen["grandparent"])
        assert opened["pid"] not in (int(seen["shell"]), int(seen["parent"]))
        assert wait_for(lambda: len(daemon.requests) == 2, 30), sshd.log
        assert daemon.requests[1] == {"v": 1, "op": "session_close", "user": user.name,
                                      "service": "sshd", "pid": opened["pid"]}
    finally:
        daemon.close()


def test_ssh_login_works_without_a_daemon(start_sshd, make_user, sandbox):
    user = make_user()
    sshd = start_sshd([module_line(sandbox / "absent.sock", control="required")], [user])
    result = sshd.ssh(user.name, SHOW)
    assert result.returncode == 0, (result, sshd.log)
    assert _fields(result.stdout)["cvd"] == "<unset>"


# ------------------------------------------------------------------ the real daemon

MARK = "---whoami---"


def _session_script(daemon) -> str:
    """What a user runs over ssh: the environment, a burn on every GPU, then whoami --json."""
    cli = " ".join(gpuguard(daemon.config_path))
    return "; ".join([
        'echo "cvd=${CUDA_VISIBLE_DEVICES-<unset>}"',
        *(f'{cli} sim burn --gpu {n} --mem 1GiB --seconds 1 >/dev/null 2>&1; echo "burn{n}=$?"'
          for n in _gpus(daemon)),
        f"echo {MARK}",
        f"{cli} whoami --json",
    ])


def _run_session(sshd: Sshd, daemon, user) -> tuple[dict[str, str], dict, dict[int, int]]:
    """ssh in as user: (the shell's fields, whoami, {minor: sim burn exit status})."""
    result = sshd.ssh(user.name, _session_script(daemon))
    assert result.returncode == 0, (result, sshd.log, daemon.log())
    head, _, whoami_json = result.stdout.partition(MARK + "\n")
    seen = _fields(head)
    return seen, json.loads(whoami_json), {n: int(seen[f"burn{n}"]) for n in _gpus(daemon)}


def _gpus(daemon) -> range:
    return range(daemon.config.gpu.simulated.count)


def _released(daemon, user) -> bool:
    state = daemon.whoami(user)
    return state["grants"] == [] and state["sessions"] == []


@pytest.mark.gate
def test_ssh_login_sees_exactly_its_gpus(gg_daemon, start_sshd, make_user):
    """`ssh alice@server`: she sees one line, her shell has CUDA_VISIBLE_DEVICES, whoami lists
    the grant, her program runs on her GPU and is denied every other one; logout releases it."""
    alice = gg_daemon.add_member()
    bob = make_user()  # not a member
    sshd = start_sshd([module_line(gg_daemon.socket)], [alice, bob])

    # An interactive login: the one line alice sees, and her shell's environment.
    result = sshd.login(alice.name, 'echo "cvd=$CUDA_VISIBLE_DEVICES"; exit\n')
    assert result.returncode == 0, (result, sshd.log, gg_daemon.log())
    lines = [line.strip() for line in result.stdout.replace("\r", "").splitlines()]
    (message,) = [line for line in lines if line.startswith("gpuguard:")]
    assert message.startswith("gpuguard: GPU ") and message.endswith("run gpuguard whoami for details")
    minor = int(message.split()[2])
    (cvd,) = [line for line in lines if line.startswith("cvd=")]
    assert cvd == f"cvd={gg_daemon.uuid(minor)}"
    assert wait_for(lambda: _released(gg_daemon, alice), 30), sshd.log

    # A command over ssh: environment, whoami and the gate, all in one session.
    seen, whoami, burns = _run_session(sshd, gg_daemon, alice)
    (grant,) = whoami["grants"]
    assert seen["cvd"] == grant["uuid"]
    assert whoami["user"] == alice.name and whoami["member"] is True
    assert [s["service"] for s in whoami["sessions"]] == ["sshd"]
    assert burns == {n: 0 if n == grant["minor"] else 1 for n in _gpus(gg_daemon)}
    # sshd closes the PAM session when the connection ends; nothing of alice's runs: released
    assert wait_for(lambda: _released(gg_daemon, alice), 30), sshd.log

    seen, whoami, burns = _run_session(sshd, gg_daemon, bob)  # a non-member: in, with nothing
    assert seen["cvd"] == "<unset>"
    assert whoami["grants"] == []
    assert set(burns.values()) == {1}


@pytest.mark.gate
def test_ssh_login_through_the_pam_exec_hook(gg_daemon, start_sshd):
    """The fallback: the same grant and the same gate, but no CUDA_VISIBLE_DEVICES."""
    alice = gg_daemon.add_member()
    sshd = start_sshd([hook_line("--config", str(gg_daemon.config_path))], [alice])
    seen, whoami, burns = _run_session(sshd, gg_daemon, alice)
    (grant,) = whoami["grants"]
    assert seen["cvd"] == "<unset>"
    assert [s["service"] for s in whoami["sessions"]] == ["sshd"]
    assert burns == {n: 0 if n == grant["minor"] else 1 for n in _gpus(gg_daemon)}
    assert wait_for(lambda: _released(gg_daemon, alice), 30), sshd.log


# Built into the user's own library: it leaves a file only when root runs it.
PRELOAD = r"""#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void proof(void) {
    FILE *file;
    if (getuid() == 0 && (file = fopen(PROOF, "a")) != NULL) {
        fputs("root ran the user's library\n", file);
        fclose(file);
    }
}
"""


def _documented_hook_line(config) -> str:
    """pam/README's pam_exec line, run from the tests' venv with the test daemon's config."""
    (line,) = [line.strip() for line in (REPO / "pam" / "README").read_text().splitlines()
               if line.strip().startswith("session") and "pam_exec.so" in line]
    return line.replace("/usr/bin/gpuguard pam-hook", f"{BIN / 'gpuguard'} pam-hook --config {config}")


@pytest.mark.gate
def test_documented_pam_exec_hook_never_runs_with_the_users_pam_environment(gg_daemon, start_sshd, sandbox):
    """Debian's /etc/pam.d/sshd reads ~/.pam_environment (pam_env user_readenv=1) after
    common-session; pam_exec gives its child the PAM environment, which at close_session holds
    the user's variables. The hook as pam/README installs it must not run then: with
    LD_PRELOAD (or PYTHONPATH) there, root would run the user's code at every logout."""
    alice = gg_daemon.add_member()
    proof = sandbox / "ggt-root-ran-alice-code"
    source = sandbox / "ggt-preload.c"
    source.write_text(PRELOAD.replace("PROOF", json.dumps(str(proof))))
    library = alice.home / "ggt-preload.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    pam_environment = alice.home / ".pam_environment"
    pam_environment.write_text(f"LD_PRELOAD DEFAULT={library}\nPYTHONPATH DEFAULT={alice.home}\n")
    (alice.home / "sitecustomize.py").write_text(
        f"import os\nif os.getuid() == 0:\n    open({str(proof)!r}, 'a').write('root ran sitecustomize')\n")
    for path in (library, pam_environment, alice.home / "sitecustomize.py"):
        os.chown(path, alice.uid, alice.gid)
    sshd = start_sshd([_documented_hook_line(gg_daemon.config_path),
                       "session required pam_env.so user_readenv=1 envfile=/etc/default/locale"], [alice])
    seen, whoami, _ = _run_session(sshd, gg_daemon, alice)
    assert len(whoami["grants"]) == 1  # granted at open_session, as before
    assert seen["cvd"] == "<unset>"
    assert wait_for(lambda: _released(gg_daemon, alice), 30), (sshd.log, gg_daemon.log())  # the caller gone
    sshd.stop()  # every close_session done
    assert not proof.exists(), proof.read_text()
