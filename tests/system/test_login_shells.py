"""Any login shell gets the user's GPUs (issue 38, 1): the shipped /etc/profile.d/gpuguard.sh and
its fish and zsh twins set CUDA_VISIBLE_DEVICES from the held-devices file, with no daemon asked,
in every kind of login shell a real sshd starts: an interactive login, `ssh host 'bash -lc ...'`
(what cron's `bash -lc` runs), dash, fish and zsh login shells, a tmux pane; and they say nothing
to a user who holds nothing. The sshd's PAM stack has no gpuguard line: the snippets alone do it.

The snippets are bind-mounted over /etc/profile.d, /etc/fish/conf.d and /etc/zsh inside the
private mount namespace of the test's sshd (copies of the host's directories plus ours), so the
host's own login shells never see them."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import PYTHON
from ssh_harness import PERMIT, Sshd

from devtools.harness import wait_for

pytestmark = pytest.mark.ssh

REPO = Path(__file__).resolve().parents[2]
ZSH_HOOK = "[[ -r /etc/profile.d/gpuguard.zsh ]] && . /etc/profile.d/gpuguard.zsh\n"  # docs/users.md, Any shell
SHOW = 'echo "cvd=${CUDA_VISIBLE_DEVICES-<unset>}"'


def _overlay(sandbox: Path, name: str, host: Path, files: dict[str, Path], append: dict[str, str]) -> Path:
    """A copy of the host's directory `host` with `files` added and `append` written after a file."""
    copy = sandbox / name
    if host.is_dir():
        shutil.copytree(host, copy, symlinks=True)
    else:
        copy.mkdir()
    for target, source in files.items():
        shutil.copy(source, copy / target)
    for target, text in append.items():
        with (copy / target).open("a") as file:
            file.write(text)
    copy.chmod(0o755)
    return copy


@pytest.fixture
def shells_sshd(sandbox, start_daemon):
    """(daemon, sshd): the daemon's users log in through a sshd whose shells have the snippets."""
    d = start_daemon(count=2, gate=False)
    users = [d.add_member(), d.add_member()]
    sshd = Sshd(sandbox / "sshd", PERMIT, [user.name for user in users])
    for user in users:
        sshd.authorize(user.home, user.uid, user.gid)
    held = Path(d.socket).parent / "held"  # where this daemon keeps the files, not /run/gpuguard's
    with sshd.config.open("a") as config:
        config.write(f"SetEnv GPUGUARD_HELD_DIR={held} GPUGUARD_CONFIG={d.config_path}\n"
                     "Subsystem sftp /usr/lib/openssh/sftp-server\n")
    # `gpuguard` on the PATH that /etc/profile sets, as a package puts it there
    command = sandbox / "bin" / "gpuguard"
    command.parent.mkdir()
    command.write_text(f'#!/bin/sh\nexec {PYTHON} -m gpuguard "$@"\n')
    command.chmod(0o755)
    overlays = {
        Path("/usr/local/bin"): _overlay(sandbox, "local-bin", Path("/usr/local/bin"), {"gpuguard": command}, {}),
        Path("/etc/profile.d"): _overlay(sandbox, "profile.d", Path("/etc/profile.d"), {
            "gpuguard.sh": REPO / "etc/profile.d/gpuguard.sh", "gpuguard.zsh": REPO / "etc/profile.d/gpuguard.zsh"}, {}),
        Path("/etc/fish/conf.d"): _overlay(sandbox, "fish-conf.d", Path("/etc/fish/conf.d"),
                                           {"gpuguard.fish": REPO / "etc/fish/conf.d/gpuguard.fish"}, {}),
    }
    if shutil.which("zsh"):
        overlays[Path("/etc/zsh")] = _overlay(sandbox, "zsh", Path("/etc/zsh"), {}, {"zprofile": ZSH_HOOK})
    sshd.start()
    try:
        mounts = " && ".join(f"mount --bind {copy} {target}" for target, copy in overlays.items() if target.is_dir())
        subprocess.run(["nsenter", f"--mount=/proc/{sshd.process.pid}/ns/mnt", "--", "sh", "-c", mounts],
                       check=True, timeout=30)
        yield d, sshd, users
    finally:
        sshd.stop()


def _cvd(result: subprocess.CompletedProcess) -> str:
    (line,) = [line for line in result.stdout.replace("\r", "").splitlines() if line.startswith("cvd=")]
    return line.removeprefix("cvd=")


SHELLS = [
    ("bash -lc", f"bash -lc '{SHOW}'"),
    ("dash -l", f"dash -lc '{SHOW}'"),
    ("fish -l", "fish -l -c 'echo \"cvd=$CUDA_VISIBLE_DEVICES\"'"),
    ("zsh -l", f"zsh -lc '{SHOW}'"),
]


def test_every_kind_of_login_shell_sees_the_gpus_held_and_no_daemon_is_asked(shells_sshd):
    d, sshd, (alice, bob) = shells_sshd
    (minor,) = d.call_as(alice, "request", gpus=1)["granted"]
    uuid = d.uuid(minor)

    login = sshd.login(alice.name, f"{SHOW}; exit\n")  # an interactive login: bash, a pty
    assert _cvd(login) == uuid, (login, sshd.log)
    plain = sshd.ssh(alice.name, SHOW)  # `ssh host cmd` is no login shell: the snippet is not for it
    assert (plain.returncode, _cvd(plain)) == (0, "<unset>"), plain
    d.stop()  # from here on, no daemon: the file alone says what alice holds
    for name, command in SHELLS:
        if name.startswith("zsh") and not shutil.which("zsh"):
            continue
        result = sshd.ssh(alice.name, command)
        assert (result.returncode, _cvd(result), result.stderr) == (0, uuid, ""), (name, result)
        quiet = sshd.ssh(bob.name, command)  # bob holds nothing: nothing set, nothing said
        assert (quiet.returncode, _cvd(quiet), quiet.stderr) in {(0, "<unset>", ""), (0, "", "")}, (name, quiet)


def test_a_tmux_pane_started_after_the_grant_sees_it(shells_sshd):
    d, sshd, (alice, _) = shells_sshd
    # The tmux server starts before alice holds anything, as one left running from an older login.
    assert sshd.ssh(alice.name, "tmux -L ggt new-session -d -s first").returncode == 0
    try:
        (minor,) = d.call_as(alice, "request", gpus=1)["granted"]
        pane = alice.home / "pane"
        opened = sshd.ssh(alice.name, f"tmux -L ggt new-window -t first && tmux -L ggt send-keys -t first "
                                      f"'{SHOW} > {pane}' Enter")
        assert opened.returncode == 0, opened
        assert wait_for(lambda: pane.exists() and pane.read_text().endswith("\n"), 30)
        assert pane.read_text() == f"cvd={d.uuid(minor)}\n"
    finally:
        sshd.ssh(alice.name, "tmux -L ggt kill-server")


# VS Code Remote-SSH starts its server from an SSH session without a terminal and reads its
# environment from a login shell; `ssh -T host` with a script on stdin is such a session: a
# login shell without a terminal, whose background process (the "server") starts a shell later.
SERVER_LIKE = f"(sleep 0.2; bash -c '{SHOW}') > server.out 2>&1 &\nwait\ncat server.out\n"


def _server_cvd(sshd: Sshd, user) -> str:
    result = subprocess.run(sshd._ssh_argv("-T", f"{user.name}@127.0.0.1"), input=SERVER_LIKE,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result
    return _cvd(result)


def test_a_session_without_a_terminal_takes_gpus_only_when_its_user_asked(shells_sshd):
    d, sshd, (alice, bob) = shells_sshd
    assert _server_cvd(sshd, alice) == "<unset>" and d.granted_minors(alice) == []  # by default: none
    for user in (alice, bob):
        switched = sshd.ssh(user.name, "gpuguard prefs set request-without-terminal on")
        assert switched.returncode == 0 and "request-without-terminal = on" in switched.stdout, switched
    shown = sshd.ssh(alice.name, "gpuguard prefs")
    assert "request-without-terminal = on" in shown.stdout, shown
    # scp (both protocols), sftp and `ssh host cmd` run no login shell: still nothing for bob.
    source = bob.home / "ggt-file"
    source.write_text("data\n")
    os.chown(source, bob.uid, bob.gid)
    key, port = str(sshd.client_key), str(sshd.port)
    common = ["-F", "/dev/null", "-i", key, "-P", port, "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
              "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
    for argv in (["scp", *common, f"{bob.name}@127.0.0.1:ggt-file", str(bob.home / "ggt-copy")],
                 ["scp", "-O", *common, f"{bob.name}@127.0.0.1:ggt-file", str(bob.home / "ggt-copy-legacy")],
                 ["sftp", *common, "-b", "-", f"{bob.name}@127.0.0.1"]):
        copied = subprocess.run(argv, input=f"get ggt-file {bob.home / 'ggt-sftp'}\n", capture_output=True, text=True,
                                timeout=60)
        assert copied.returncode == 0, (argv[0], copied)
    assert sshd.ssh(bob.name, SHOW).returncode == 0
    assert d.granted_minors(bob) == [] and [e for e in d.whoami(bob)["events"] if e["kind"] == "grant"] == []
    # alice's session without a terminal asks once, and the server's shell sees her GPU.
    uuid = _server_cvd(sshd, alice)
    [minor] = d.granted_minors(alice)
    assert uuid == d.uuid(minor)
    assert _server_cvd(sshd, alice) == uuid and d.granted_minors(alice) == [minor]  # held: not asked again
