"""`gpuguard doctor` on this machine, against a running test daemon on simulated GPUs: all green
when everything is in place, and a failing line (exit 1) for each thing broken on purpose.

The files PAM, udev and kmod read come from a root of the test's own (`--files-root`): a login
service whose session stack has the module after pam_systemd, and the shipped udev rule and
modprobe file. Everything else is the real thing: cgroup v2, bpf(), the daemon's gate, NVML (over
the simulated library), the nodes and their ACLs, the daemon's socket.
"""
from __future__ import annotations

import os
import shutil

import pytest
from conftest import REPO
from ssh_harness import MODULE

from gpuguard.backends.gate import Gate
from gpuguard.core.model import NVIDIA_MAJOR

pytestmark = pytest.mark.gate


@pytest.fixture
def files_root(sandbox, pam_module):
    root = sandbox / "root"
    (root / "etc/pam.d").mkdir(parents=True)
    (root / "etc/pam.d/common-session").write_text(
        "session required pam_unix.so\nsession optional pam_systemd.so\n"
        f"session optional {MODULE}\n")
    (root / "etc/pam.d/sshd").write_text("auth required pam_permit.so\n@include common-session\n")
    for source, target in [("udev/70-gpuguard.rules", "usr/lib/udev/rules.d/70-gpuguard.rules"),
                           ("etc/modprobe.d/gpuguard.conf", "usr/lib/modprobe.d/gpuguard.conf")]:
        (root / target).parent.mkdir(parents=True)
        shutil.copy(REPO / source, root / target)
    return root


def lines(result) -> dict[str, str]:
    """check name -> its whole line."""
    return {line.split()[1]: line for line in result.stdout.splitlines()}


def test_all_green_with_a_running_daemon(gg_daemon, files_root) -> None:
    d = gg_daemon
    d.open_session(d.add_member())  # a grant: the gate map and an ACL entry to compare
    result = d.cli("doctor", "--files-root", str(files_root))
    assert result.returncode == 0, result.stdout + result.stderr
    found = lines(result)
    assert set(found) == {"cgroup", "bpf", "gate", "nvml", "minors", "nodes", "modprobe", "pam", "udev",
                          "persistenced", "daemon", "coexist", "fleet"}, result.stdout
    assert all(line.startswith("ok ") for line in found.values()), result.stdout
    assert f"gate {d.gate_name}: attached" in found["gate"] and "1 grants" in found["gate"]
    assert "4 GPUs (NVIDIA H100 80GB HBM3), simulated" in found["nvml"]


def test_broken_setups_fail_with_a_fix(gg_daemon, files_root) -> None:
    d = gg_daemon
    alice = d.add_member()
    (minor,) = d.open_session(alice)["gpus"]
    Gate(d.gate_name).revoke(alice.uid, (NVIDIA_MAJOR, minor))  # the map lost a grant the store has
    (files_root / "etc/pam.d/common-session").write_text("session optional pam_systemd.so\n")
    (files_root / "usr/lib/udev/rules.d/70-gpuguard.rules").unlink()

    result = d.cli("doctor", "--files-root", str(files_root))
    assert result.returncode == 1
    found = lines(result)
    assert {name for name, line in found.items() if line.startswith("FAIL")} == {"gate", "pam", "udev"}, result.stdout
    assert f"grants are [({alice.uid}, {minor})]" in found["gate"] and "-> systemctl restart gpuguard" in found["gate"]
    assert "-> pam-auth-update --enable gpuguard" in found["pam"]

    # A node someone opened to all, while no daemon is there to take it back.
    assert d.stop() == 0
    os.chmod(d.node(minor), 0o666)
    result = d.cli("doctor", "--files-root", str(files_root))
    found = lines(result)
    assert result.returncode == 1
    assert found["daemon"].startswith("FAIL") and "-> systemctl enable --now gpuguard" in found["daemon"]
    assert found["nodes"].startswith("FAIL") and f"nvidia{minor} is 0o666 0:0 (want 0660 root:root)" in found["nodes"]


def test_the_pam_exec_hook_without_type_open_session_fails(gg_daemon, files_root) -> None:
    """pam/README's fallback line before it said type=open_session: at close_session pam_exec runs
    the hook as root with what pam_env read from the user's ~/.pam_environment (Debian's sshd
    file reads it after common-session), so LD_PRELOAD there ran the user's code as root."""
    d = gg_daemon
    hook = f"session optional pam_exec.so quiet stdout {REPO}/.venv/bin/gpuguard pam-hook\n"
    reads_env = "session required pam_env.so user_readenv=1 envfile=/etc/default/locale\n"
    common = files_root / "etc/pam.d/common-session"
    common.write_text("session required pam_unix.so\nsession optional pam_systemd.so\n" + hook)
    (files_root / "etc/pam.d/sshd").write_text("auth required pam_permit.so\n@include common-session\n" + reads_env)
    found = lines(d.cli("doctor", "--files-root", str(files_root)))
    assert found["pam"].startswith("FAIL") and "user's PAM environment" in found["pam"], found["pam"]
    assert "-> give its line type=open_session" in found["pam"]

    common.write_text(common.read_text().replace("pam_exec.so quiet", "pam_exec.so type=open_session quiet"))
    found = lines(d.cli("doctor", "--files-root", str(files_root)))
    assert found["pam"].startswith("ok ") and "pam_exec hook" in found["pam"], found["pam"]
