"""Shared fixtures: real users, real groups, a world-traversable sandbox directory.

Everything created here carries a `ggt-` prefix and is removed afterwards, so a test
run leaves the machine as it found it.
"""
from __future__ import annotations

import grp
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from devtools.harness import bpffs_restored, kill_processes_of, log_lines, searchable

# Shared fixtures: device_dir / backend, simulated GPUs (tests/sim_helpers.py, first: the others
# import it); start_daemon / gg_daemon, a real daemon (tests/daemon_fixture.py); pam_module
# (tests/ssh_harness.py); postgres, a private PostgreSQL (tests/pg_fixture.py); fleet, its
# database with the roles fleet init makes (tests/fleet_fixture.py); web / browser, `gpuguard web`
# and a headless Chromium (tests/web_harness.py).
pytest_plugins = ["sim_helpers", "daemon_fixture", "ssh_harness", "hostile_fixture", "pg_fixture", "fleet_fixture",
                  "web_harness"]

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable  # the venv's interpreter; users run gpuguard with it too
BIN = Path(PYTHON).parent  # that venv's scripts (`gpuguard`), wherever the Makefile's VENV put it


@dataclass(frozen=True)
class TestUser:
    name: str
    uid: int
    gid: int
    home: Path


def unique(prefix: str = "ggt") -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


@pytest.fixture(scope="session", autouse=True)
def require_root() -> Iterator[None]:
    if os.geteuid() != 0:
        pytest.exit("gpuguard's tests use real users, PAM and BPF: run them as root (sudo make test)", 2)
    # Test users run the venv's Python from this checkout, wherever it was cloned (/root too).
    with searchable(REPO):
        yield


@pytest.fixture(scope="session", autouse=True)
def sweep_leftovers(require_root, request) -> Iterator[None]:
    """At the start of the session, remove what an aborted run left (tests/leftovers.py): ggt- users,
    groups, PAM files, sandboxes and gates. Reported on the terminal, so a leftover does not pass
    unnoticed."""
    import leftovers

    with leftovers.session() as lines:
        if lines:
            report = "\n".join(lines)
            capture = request.config.pluginmanager.get_plugin("capturemanager")
            terminal = request.config.pluginmanager.get_plugin("terminalreporter")
            if capture is not None and terminal is not None:
                with capture.global_and_fixture_disabled():
                    terminal.write_line(report)
            else:
                print(report, file=sys.__stderr__)
        yield


@pytest.fixture(scope="session", autouse=True)
def restore_bpffs() -> Iterator[None]:
    """The gate mounts bpffs when absent; unmount it again if the run left nothing pinned there."""
    with bpffs_restored():
        yield


@pytest.fixture
def make_group() -> Iterator:
    created: list[str] = []

    def make(name: str | None = None) -> str:
        name = name or unique("ggt-g")
        subprocess.run(["groupadd", name], check=True)
        created.append(name)
        return name

    yield make
    for name in created:
        subprocess.run(["groupdel", name], check=False, capture_output=True)


@pytest.fixture
def make_user() -> Iterator:
    """Factory for real login users (`ggt-xxxxxx`, with a home), deleted afterwards."""
    created: list[TestUser] = []

    def make(groups: list[str] | tuple[str, ...] = ()) -> TestUser:
        name = unique()
        cmd = ["useradd", "--create-home", "--shell", "/bin/bash", name]
        if groups:
            cmd[1:1] = ["--groups", ",".join(groups)]
        subprocess.run(cmd, check=True)
        entry = pwd.getpwnam(name)
        created.append(TestUser(name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir)))
        return created[-1]

    yield make
    for user in created:
        kill_processes_of(user.uid)
        subprocess.run(["userdel", "--remove", "--force", user.name], check=False, capture_output=True)


def run_as(user: TestUser, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run argv as a real non-root user (uid, gid and supplementary groups of that user)."""
    groups = [g.gr_gid for g in grp.getgrall() if user.name in g.gr_mem]
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("timeout", 60)
    return subprocess.run(argv, user=user.uid, group=user.gid, extra_groups=groups,
                          cwd="/", **kwargs)


def popen_as(user: TestUser, argv: list[str], **kwargs) -> subprocess.Popen:
    """A command of `user`'s, started as from their terminal: ^C (SIGINT) interrupts it even when
    the tests run where it is ignored (a background job's shell ignores it, and its children with it)."""
    groups = [g.gr_gid for g in grp.getgrall() if user.name in g.gr_mem]
    return subprocess.Popen(argv, user=user.uid, group=user.gid, extra_groups=groups, cwd="/",
                            preexec_fn=_interruptible, **kwargs)


def _interruptible() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def sandbox() -> Iterator[Path]:
    """A directory test users can traverse (pytest's tmp_path is root-only)."""
    path = Path("/tmp") / unique()
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def gpuguard_log() -> Iterator[list[str]]:
    """The gpuguard logger's lines, formatted as the daemon writes them."""
    with log_lines() as lines:
        yield lines
