"""What the benchmarks run in: real users and a group, small C helpers, a busy host, a real daemon.

Everything is named `ggt-bench-*` / `ggt-b<n>-*` (never the tests' `ggt-` + six hex digits, so a
test run's sweep leaves it alone) and removed when the run's ExitStack closes. Every gate the
bench attaches is attached under the tests' gate lock (devtools.harness.gate_test_lock, which
start_daemon takes for a daemon's gate, gate_lock() for the others), for as long as it is
attached: another run's gate would deny this run's users, and this run's gate theirs.
"""
from __future__ import annotations

import grp
import os
import pwd
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from devtools.harness import gate_test_lock, searchable, start_daemon  # noqa: E402

HELPERS = {"pamloop": ["-lpam"], "openloop": [], "sleepers": []}  # bench/<name>.c and its libraries
STORM_USERS = 20


class Bench:
    """One run's users, group, directory and helpers; cleaned up by `stack`."""

    def __init__(self, stack: ExitStack) -> None:
        self.stack = stack
        self.tag = secrets.token_hex(3)
        self.base = Path(f"/tmp/ggt-bench-{self.tag}")
        self.base.mkdir(mode=0o755)
        os.chmod(self.base, 0o755)
        stack.callback(shutil.rmtree, self.base, ignore_errors=True)
        stack.enter_context(searchable(REPO))  # the users run the venv's Python from this checkout
        self.helpers = self._build_helpers()
        self.group = f"ggt-bench-{self.tag}"
        subprocess.run(["groupadd", self.group], check=True)
        stack.callback(subprocess.run, ["groupdel", self.group], check=False)
        self.members = [self._user(f"ggt-b{i}-{self.tag}", member=True) for i in range(STORM_USERS)]
        self.outsider = self._user(f"ggt-bx-{self.tag}", member=False)  # owns the host's sleepers
        self._daemons = 0

    def _build_helpers(self) -> dict[str, Path]:
        out = self.base / "bin"
        out.mkdir(mode=0o755)
        built = {}
        for name, libraries in HELPERS.items():
            built[name] = out / name
            subprocess.run(["gcc", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(built[name]),
                            str(REPO / "bench" / f"{name}.c"), *libraries], check=True)
        return built

    def _user(self, name: str, member: bool) -> str:
        groups = ["--groups", self.group] if member else []
        subprocess.run(["useradd", "--no-create-home", *groups, name], check=True)
        self.stack.callback(subprocess.run, ["userdel", "--force", name], check=False, capture_output=True)
        return name

    def uid(self, name: str) -> int:
        return pwd.getpwnam(name).pw_uid

    def write_config(self, name: str, interval: str = "2s", grace: str = "30s", kill_wait: str = "10s",
                     extra: str = "") -> Path:
        """A daemon config of its own directory under the run's base (8 simulated GPUs)."""
        home = self.base / name
        path = home / "gpuguard.toml"
        home.mkdir(mode=0o755)
        path.write_text(
            f'[access]\ngroup = "{self.group}"\n'
            # Every bench session takes GPUs, terminal or not: what a login costs with its grant.
            f'[sessions]\ngrant = "all"\n'
            f'[watcher]\ninterval = "{interval}"\ngrace = "{grace}"\nkill_wait = "{kill_wait}"\n'
            f'[paths]\nstate_dir = "{home}/state"\nsocket = "{home}/run/gpuguard.sock"\ndevice_dir = "{home}/dev"\n'
            f'[gpu]\nbackend = "simulated"\n[gpu.simulated]\ncount = 8\n{extra}')
        path.chmod(0o644)
        return path

    @contextmanager
    def daemon(self, config: Path) -> Iterator[subprocess.Popen]:
        """A real `gpuguard daemon` on `config`; stopped, and its gate detached, after the block."""
        self._daemons += 1
        with ExitStack() as phase:
            say_if_gate_locked()
            yield start_daemon(phase, config, f"ggt-bench-{self.tag}-{self._daemons}",
                               config.parent / "daemon.log")

    def pam_service(self, kind: str, session_line: str) -> str:
        """A PAM service `ggt-bench-<kind>-<tag>`: pam_permit everywhere, plus `session_line`."""
        service = f"ggt-bench-{kind}-{self.tag}"
        path = Path("/etc/pam.d") / service
        path.write_text("auth required pam_permit.so\naccount required pam_permit.so\n"
                        f"session required pam_permit.so\n{session_line}\n")
        self.stack.callback(path.unlink, missing_ok=True)
        return service


def host_processes() -> int:
    return sum(1 for name in os.listdir("/proc") if name.isdigit())


@contextmanager
def busy_host(bench: Bench, total: int, root: bool = False) -> Iterator[int]:
    """At least `total` processes on the host for the block (sleeping forks, owned by a user with
    no GPUs, like other people's work on a shared server; root: owned by root, like kernel threads
    and root's container processes). Yields the count reached."""
    missing = total - host_processes()
    if missing <= 0:
        yield host_processes()
        return
    owner = {} if root else {"user": bench.uid(bench.outsider), "group": grp.getgrnam(bench.outsider).gr_gid}
    sleepers = subprocess.Popen([str(bench.helpers["sleepers"]), str(missing)], **owner, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        if sleepers.stdout.readline().strip() != "ready":
            raise SystemExit(f"bench: could not start {missing} sleeping processes")
        yield host_processes()
    finally:
        sleepers.stdin.close()
        sleepers.wait(60)
        sleepers.stdout.close()


def say_if_gate_locked() -> None:
    """Say so when another run holds the gate lock: the bench is about to wait for it."""
    import fcntl

    from gpuguard.backends.mounts import cgroup2_root
    probe = os.open(cgroup2_root(), os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("bench: another run has a gate attached: waiting for it (devtools.harness.gate_test_lock)",
              flush=True)
    finally:
        os.close(probe)  # releases the probe's lock, if it got one


@contextmanager
def gate_lock() -> Iterator[None]:
    """The tests' gate lock, for a gate the bench attaches without start_daemon (which takes it)."""
    say_if_gate_locked()
    with gate_test_lock():
        yield
