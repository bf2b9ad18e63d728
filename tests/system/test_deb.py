"""`make deb`'s package, installed with the real dpkg on this machine: install, upgrade, purge.

The package goes into the real root, PAM profile in common-session included. That cannot
disturb another test run on this machine: the tests' PAM services (/etc/pam.d/ggt-*, the sshd and
`su -` stacks of ssh_harness and the demo) never include common-session, and a gpuguard module
there without its daemon lets every session open as before. The test attaches the production
gate (named `gpuguard`, which no test or demo uses) to see the package detach it at removal, under
the gate lock that every gate-attaching test holds. Two runs of this test wait for each other
(a flock on /usr/share/pam-configs). A machine where gpuguard is installed for real is left alone.
"""
from __future__ import annotations

import contextlib
import fcntl
import gzip
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, unique

from devtools.harness import gate_test_lock
from gpuguard import __version__
from gpuguard.backends.gate import PIN_ROOT, Gate

PYTHON = "/usr/bin/python3"  # what `make deb` builds the venv with
PACKAGE_LOCK = Path("/usr/share/pam-configs")
# useradd and groupadd of other test runs hold /etc/passwd.PID, /etc/group.lock and the like for a moment.
SHADOW_LOCK = re.compile(r"\.(\d+|lock)$")
PAM_LINE = re.compile(r"^session\s+optional\s+pam_gpuguard\.so\s*$", re.MULTILINE)
MULTIARCH = subprocess.run(["dpkg-architecture", "-qDEB_HOST_MULTIARCH"], capture_output=True,
                           text=True).stdout.strip()
# Where the package and its scripts put files, and must leave them as they found them: each
# directory walked whole, /etc by its own entries (other runs add and remove users meanwhile).
WATCHED = ["/opt", "/usr/bin", "/usr/lib/systemd/system", "/usr/lib/udev/rules.d", "/usr/lib/modprobe.d",
           f"/usr/lib/{MULTIARCH}/security", "/usr/share/pam-configs", "/usr/share/doc/gpuguard",
           "/usr/share/man/man1", "/usr/share/bash-completion/completions",
           "/etc/pam.d", "/etc/gpuguard", "/etc/systemd/system", "/var/lib/gpuguard", "/var/lib/dpkg/info",
           "/var/lib/pam", "/run/gpuguard"]

pytestmark = [
    pytest.mark.gate,
    pytest.mark.skipif(subprocess.run(["which", "dpkg-deb"], capture_output=True).returncode != 0,
                       reason="not a Debian system"),
]


def dpkg(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["dpkg", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def installed_version() -> str | None:
    result = subprocess.run(["dpkg-query", "-W", "-f=${db:Status-Status} ${Version}", "gpuguard"],
                            capture_output=True, text=True)
    status, _, version = result.stdout.partition(" ")
    return version if result.returncode == 0 and status == "installed" else None


def build(outdir: Path, version: str) -> Path:
    result = subprocess.run([str(REPO / "packaging/build-deb.sh"), PYTHON, str(outdir), version],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    deb = Path(result.stdout.strip().splitlines()[-1])
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True).stdout.strip()
    assert deb.name == f"gpuguard_{version}_{arch}.deb" and deb.is_file()
    return deb


def package_entries(deb: Path) -> dict[str, str]:
    """Path -> `ls -l` type and mode string (or link target) of every entry the package ships."""
    listing = subprocess.run(["dpkg-deb", "--contents", str(deb)], capture_output=True, text=True,
                             check=True).stdout
    entries = {}
    for line in listing.splitlines():
        mode, _owner, _size, _date, _time, name, *link = line.split(maxsplit=6)
        path = name.removeprefix(".").rstrip("/") or "/"
        entries[path] = link[0].removeprefix("-> ") if mode.startswith("l") else mode
    return entries


def snapshot() -> set[str]:
    """Every path under the watched directories; test objects (ggt-*) of any run left out."""
    paths = {f"/etc/{name}" for name in os.listdir("/etc") if "ggt-" not in name and not SHADOW_LOCK.search(name)}
    paths.update(top for top in WATCHED if os.path.lexists(top))
    for top in WATCHED:
        for root, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if "ggt-" not in d and not os.path.ismount(os.path.join(root, d))]
            paths.update(os.path.join(root, name) for name in [*dirs, *files] if "ggt-" not in name)
    return paths


@contextlib.contextmanager
def package_lock() -> Iterator[None]:
    fd = os.open(PACKAGE_LOCK, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@pytest.fixture
def clean_machine() -> Iterator[None]:
    with package_lock():
        if installed_version() or Path("/opt/gpuguard").exists():
            pytest.skip("gpuguard is installed on this machine for real: not touching it")
        try:
            yield
        finally:
            if dpkg("-s", "gpuguard").returncode == 0:  # a failure halfway: purge what is there
                dpkg("--purge", "gpuguard")


def check_installed(deb: Path, version: str) -> None:
    assert installed_version() == version
    for path, expected in package_entries(deb).items():
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            assert os.readlink(path) == expected, path
        else:
            assert stat.filemode(st.st_mode) == expected, path
            assert (st.st_uid, st.st_gid) == (0, 0), path
    for path in ["/opt/gpuguard/bin/gpuguard", "/usr/lib/systemd/system/gpuguard.service",
                 "/usr/lib/udev/rules.d/70-gpuguard.rules", "/usr/lib/modprobe.d/gpuguard.conf",
                 "/usr/share/pam-configs/gpuguard", f"/usr/lib/{MULTIARCH}/security/pam_gpuguard.so"]:
        assert Path(path).is_file(), path
    # The man page (`man gpuguard` finds it by name) and the bash completion, from the argparse definitions.
    page = Path("/usr/share/man/man1/gpuguard.1.gz")
    assert gzip.decompress(page.read_bytes()).decode().startswith(".TH GPUGUARD")
    if shutil.which("man"):
        found = subprocess.run(["man", "-w", "gpuguard"], capture_output=True, text=True)
        assert found.stdout.strip() == str(page), found
    completion = Path("/usr/share/bash-completion/completions/gpuguard").read_text()
    assert "_shtab_gpuguard" in completion and "report" in completion
    conffiles = subprocess.run(["dpkg-query", "-W", "-f=${Conffiles}", "gpuguard"], capture_output=True,
                               text=True, check=True).stdout.split()
    assert {"/etc/gpuguard/gpuguard.toml", "/etc/gpuguard/quotas.toml"} <= set(conffiles)
    # pam-auth-update put the module in the interactive session stack, after pam_systemd, once.
    session = Path("/etc/pam.d/common-session").read_text()
    assert len(PAM_LINE.findall(session)) == 1, session
    assert session.index("pam_systemd.so") < session.index("pam_gpuguard.so")
    assert "pam_gpuguard" not in Path("/etc/pam.d/common-session-noninteractive").read_text()

    version_line = subprocess.run(["/usr/bin/gpuguard", "--version"], capture_output=True, text=True)
    assert version_line.stdout.strip() == f"gpuguard {__version__}", version_line
    check = subprocess.run(["/usr/bin/gpuguard", "config", "check"], capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.startswith("/etc/gpuguard/gpuguard.toml: ok"), check


def check_module_loads_by_name() -> None:
    """PAM finds the installed module by its bare name (the multiarch security directory): a
    `required` line fails the session when the module cannot be loaded."""
    service = Path("/etc/pam.d") / unique()
    service.write_text("auth required pam_permit.so\naccount required pam_permit.so\n"
                       "session required pam_gpuguard.so socket=/nonexistent/ggt.sock\n")
    try:
        result = subprocess.run(["pamtester", service.name, "root", "open_session", "close_session"],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result
    finally:
        service.unlink()


def test_install_upgrade_purge_leaves_nothing(sandbox, clean_machine) -> None:
    common_session = Path("/etc/pam.d/common-session").read_text()
    before = snapshot()
    first, second = "0.0.1~ggt1-1", "0.0.1~ggt2-1"
    deb = build(sandbox, first)

    installed = dpkg("-i", str(deb))
    assert installed.returncode == 0, installed.stderr
    check_installed(deb, first)
    check_module_loads_by_name()

    # State the upgrade must keep: an admin's edit of a conffile, the store, the pinned gate.
    quotas = Path("/etc/gpuguard/quotas.toml")
    quotas.write_text(quotas.read_text() + "\n[users.ggt-admin-edit]\ngpus = 2\n")
    state = Path("/var/lib/gpuguard/ggt-state")
    state.parent.mkdir(mode=0o700, exist_ok=True)
    state.write_text("grants\n")
    with gate_test_lock():
        attached = subprocess.run(["/usr/bin/gpuguard", "gate", "attach"], capture_output=True, text=True)
        try:
            assert attached.returncode == 0, attached.stderr

            rebuilt = build(sandbox, second)
            upgraded = dpkg("-i", str(rebuilt))
            assert upgraded.returncode == 0, upgraded.stderr
            check_installed(rebuilt, second)
            assert "ggt-admin-edit" in quotas.read_text()
            assert state.read_text() == "grants\n"
            assert Gate("gpuguard").find(), "the upgrade detached the gate"

            removed = dpkg("--remove", "gpuguard")
            assert removed.returncode == 0, removed.stderr
        finally:
            gate = Gate("gpuguard")
            still_attached = gate.find()
            if still_attached:
                gate.detach()
        assert not still_attached, "removing the package left the gate attached"
    assert not (PIN_ROOT / "gpuguard").exists()
    assert "pam_gpuguard" not in Path("/etc/pam.d/common-session").read_text()
    assert quotas.exists() and state.exists()  # remove keeps the configuration and the state

    purged = dpkg("--purge", "gpuguard")
    assert purged.returncode == 0, purged.stderr
    assert dpkg("-s", "gpuguard").returncode != 0
    assert Path("/etc/pam.d/common-session").read_text() == common_session
    assert snapshot() ^ before == set()
