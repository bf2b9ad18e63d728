"""Login harness for the PAM and SSH tests: real PAM stacks, a private sshd, a stub daemon.

- `PamStacks`: PAM service files `/etc/pam.d/ggt-xxxxxx`, each removed afterwards.
- `pamtester()`: drive a stack with the real PAM library, as login programs do.
- `Sshd`: a real OpenSSH server on 127.0.0.1 at a free port, run in a private mount
  namespace in which a test PAM stack is bind-mounted over /etc/pam.d/sshd, so the host's
  own /etc/pam.d/sshd is never touched. Stopping it kills every process in that namespace.
- `StubDaemon`: a scripted stand-in for the daemon's socket, for the module's protocol
  edge cases (escaping, odd replies, a daemon that never answers); `UUIDS` and `MESSAGE`
  are what a stub answers a session_open with.
- `pam_module`: a fixture (conftest loads this file as a plugin) that builds pam_gpuguard.so
  once per session.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import BIN, PYTHON, REPO

MODULE = REPO / "pam" / "pam_gpuguard.so"
PAM_DIR = Path("/etc/pam.d")
SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")

# The part of every test stack that is not under test: let everyone in.
PERMIT = """\
auth     required pam_permit.so
account  required pam_permit.so
session  required pam_permit.so
"""


# What a stub daemon answers a session_open with (two GPUs), and the line the user sees.
UUIDS = "GPU-0a1b2c3d-0000-4000-8000-000000000001,GPU-0a1b2c3d-0000-4000-8000-000000000002"
MESSAGE = "gpuguard: GPU 3 (NVIDIA H100 80GB HBM3) is yours until 20:00 - run gpuguard whoami for details"


def build_module() -> Path:
    subprocess.run(["make", "-s", "-C", str(REPO / "pam")], check=True, capture_output=True)
    return MODULE


@pytest.fixture(scope="session")
def pam_module() -> Path:
    """pam_gpuguard.so, built (or found up to date) once per session."""
    return build_module()


def module_line(socket_path: str | os.PathLike, *options: str, control: str = "optional") -> str:
    return " ".join(["session", control, str(MODULE), f"socket={socket_path}", *options])


def hook_line(*hook_args: str, stdout: bool = True, direct: bool = False,
              control: str = "optional") -> str:
    """pam_exec running `gpuguard pam-hook` from the tests' venv (direct: the lighter
    `python -I -m gpuguard.pam_hook` form, which skips loading the whole CLI)."""
    command = [PYTHON, "-I", "-m", "gpuguard.pam_hook"] if direct else [str(BIN / "gpuguard"), "pam-hook"]
    return " ".join(["session", control, "pam_exec.so quiet", *(["stdout"] if stdout else []),
                     *command, *hook_args])


def env_probe(directory: Path) -> str:
    """A pam_exec line, placed after the module, that prints CUDA_VISIBLE_DEVICES as the
    session sees it. pam_exec gives its child the PAM environment, so this is the value
    a login program would copy into the user's shell."""
    script = directory / "ggt-env-probe"
    script.write_text('#!/bin/sh\n[ "$PAM_TYPE" = open_session ] || exit 0\n'
                      'echo "probe: CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}"\n')
    script.chmod(0o755)
    return f"session optional pam_exec.so stdout {script}"


def probed_devices(output: str) -> str | None:
    """What env_probe printed: the value, or None if the variable was unset."""
    for line in output.splitlines():
        if line.startswith("probe: CUDA_VISIBLE_DEVICES="):
            value = line.split("=", 1)[1]
            return None if value == "<unset>" else value
    raise AssertionError(f"the env probe did not run:\n{output}")


class PamStacks:
    """Creates /etc/pam.d/ggt-* service files; remove_all() deletes them."""

    def __init__(self) -> None:
        self.created: list[Path] = []

    def make(self, *session_lines: str, base: str = PERMIT) -> str:
        name = f"ggt-{secrets.token_hex(3)}"
        path = PAM_DIR / name
        path.write_text(base + "".join(line + "\n" for line in session_lines))
        self.created.append(path)
        return name

    def remove_all(self) -> None:
        for path in self.created:
            path.unlink(missing_ok=True)
        self.created.clear()


def pamtester(service: str, user: str, *ops: str, items: dict[str, str] | None = None,
              env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run pamtester (stdout holds pam_info text and pam_exec `stdout` output)."""
    argv = ["pamtester", "-v"]
    for key, value in (items or {}).items():
        argv.append(f"-I{key}={value}")
    for key, value in (env or {}).items():
        argv.append(f"-E{key}={value}")
    argv += [service, user, *(ops or ("open_session", "close_session"))]
    with subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    result = subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)
    result.pid = process.pid  # the PAM caller: what the module and the hook report as "pid"
    return result


# A PAM application that holds its session open, as sshd's [priv] process does: open the
# session, report, wait for a line on stdin, close. python-pam cannot answer a conversation
# after authenticate() has returned, so stacks driven this way must not talk (`quiet`,
# pam_exec without `stdout`); pamtester covers the message line.
_SESSION_SCRIPT = """
import json, os, sys
import pam
service, user = sys.argv[1:3]
handle = pam.pam()
authenticated = handle.authenticate(user, "", service=service, call_end=False, resetcreds=False)
rc = handle.open_session() if authenticated else -1
env = handle.getenvlist() if rc == 0 else {}
print(json.dumps({"pid": os.getpid(), "rc": rc, "reason": str(handle.reason), "env": env}), flush=True)
sys.stdin.readline()
rc = handle.close_session() if rc == 0 else -1
handle.end()
print(json.dumps({"rc": rc}), flush=True)
"""


class PamSession:
    """A PAM session held open by a process of its own (the PAM caller, `pid`), via python-pam."""

    def __init__(self, service: str, user: str, timeout: float = 30):
        self.process = subprocess.Popen(
            [PYTHON, "-c", _SESSION_SCRIPT, service, user],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
        opened = self._read(timeout)
        self.pid: int = opened["pid"]
        self.rc: int = opened["rc"]
        self.env: dict[str, str] = opened["env"]
        self.closed = False
        if self.rc != 0:
            self.process.kill()
            raise AssertionError(f"pam_open_session failed: {opened} {self.process.stderr.read()}")

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        ready = threading.Event()
        line: list[str] = []

        def read() -> None:
            line.append(self.process.stdout.readline())
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout) or not line[0]:
            self.process.kill()
            _, errors = self.process.communicate()
            raise AssertionError(f"PAM session process did not answer: {errors}")
        return json.loads(line[0])

    def close(self, timeout: float = 30) -> int:
        """close_session (returns its PAM status) and let the process exit."""
        if self.closed:
            return 0
        self.closed = True
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        rc = self._read(timeout)["rc"]
        self.process.wait(timeout)
        return rc

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.communicate()

    def __enter__(self) -> PamSession:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        self.kill()


def info_lines(output: str) -> list[str]:
    """The lines a user would see from gpuguard (pam_info or the hook's stdout)."""
    return [line for line in output.splitlines() if line.startswith("gpuguard:")]


# ------------------------------------------------------------------------ sshd

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Sshd:
    """A private sshd: key authentication only, UsePAM yes, our PAM stack as `sshd`."""

    def __init__(self, workdir: Path, pam_stack: str, allow_users: list[str]):
        self.dir = workdir
        self.dir.mkdir(mode=0o700, exist_ok=True)
        self.port = free_port()
        self.host_key = self.dir / "ssh_host_ed25519_key"
        self.client_key = self.dir / "client_ed25519"
        for key in (self.host_key, self.client_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpuguard-test",
                            "-f", str(key)], check=True)
        self.pam_file = self.dir / "pam-sshd"
        self.pam_file.write_text(pam_stack)
        self.config = self.dir / "sshd_config"
        self.config.write_text("\n".join([
            "ListenAddress 127.0.0.1",
            f"Port {self.port}",
            f"HostKey {self.host_key}",
            "PidFile none",
            "UsePAM yes",
            "PubkeyAuthentication yes",
            "AuthenticationMethods publickey",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin no",
            f"AllowUsers {' '.join(allow_users)}",
            "StrictModes yes",
            "UseDNS no",
            "PrintMotd no",
            "PrintLastLog no",
            "X11Forwarding no",
            "LogLevel VERBOSE",
        ]) + "\n")
        self.process: subprocess.Popen | None = None
        self.mount_ns: str | None = None
        self.log: list[str] = []
        self._made_privsep_dir = False

    def authorize(self, home: Path, uid: int, gid: int) -> None:
        """Install the client key as the user's ~/.ssh/authorized_keys (owned by the user)."""
        ssh_dir = home / ".ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        keys = ssh_dir / "authorized_keys"
        keys.write_text(self.client_key.with_suffix(".pub").read_text())
        keys.chmod(0o600)
        for path in (ssh_dir, keys):
            os.chown(path, uid, gid)

    def start(self, timeout: float = 20) -> None:
        if not PRIVSEP_DIR.exists():
            PRIVSEP_DIR.mkdir(mode=0o755)
            self._made_privsep_dir = True
        # unshare gives sshd its own mount namespace (private propagation, so nothing leaks
        # back); the bind mount exists only there and disappears with its last process.
        self.process = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--",
             "sh", "-c", 'mount --bind "$1" /etc/pam.d/sshd && exec "$2" -D -e -f "$3"',
             "sh", str(self.pam_file), SSHD, str(self.config)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ready = threading.Event()
        threading.Thread(target=self._read_log, args=(ready,), daemon=True).start()
        deadline = time.monotonic() + timeout
        while not ready.is_set():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("sshd did not start:\n" + "\n".join(self.log))
            ready.wait(0.05)
        self.mount_ns = os.readlink(f"/proc/{self.process.pid}/ns/mnt")

    def _read_log(self, ready: threading.Event) -> None:
        assert self.process and self.process.stderr
        for line in self.process.stderr:
            self.log.append(line.rstrip("\n"))
            if "Server listening on" in line:
                ready.set()

    def _ssh_argv(self, *extra: str) -> list[str]:
        return ["ssh", "-F", "/dev/null", "-i", str(self.client_key), "-p", str(self.port),
                "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=10",
                *extra]

    def ssh(self, user: str, command: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """`ssh user@host command`: no pty; sshd shows no login messages for a command."""
        return subprocess.run(self._ssh_argv(f"{user}@127.0.0.1", command),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)

    def login(self, user: str, typed: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """An interactive login (pty, login shell) with `typed` as the keyboard input; sshd
        prints the PAM session's messages before the shell starts, as a person would see them."""
        return subprocess.run(self._ssh_argv("-tt", f"{user}@127.0.0.1"), input=typed,
                              capture_output=True, text=True, timeout=timeout)

    def namespace_pids(self) -> list[int]:
        """Every process in sshd's private mount namespace: the listener and all session processes."""
        pids = []
        if not self.mount_ns:
            return pids
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.readlink(f"/proc/{entry}/ns/mnt") == self.mount_ns:
                        pids.append(int(entry))
                except OSError:
                    pass
        return pids

    def stop(self, grace: float = 10) -> None:
        # Let finished connections wind down first (sshd closes the PAM session after the
        # client has gone), so that the listener reaps its children rather than leaving
        # orphans to init.
        if self.process is not None:
            deadline = time.monotonic() + grace
            while (set(self.namespace_pids()) - {self.process.pid}) and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.process.poll() is None:
                self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        for pid in self.namespace_pids():  # connection and session processes still alive
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.mount_ns = None
        if self._made_privsep_dir:
            try:
                PRIVSEP_DIR.rmdir()
            except OSError:
                pass
            self._made_privsep_dir = False


# ------------------------------------------------------------------------ stub daemon

Reply = Callable[[dict[str, Any]], bytes | None]


class StubDaemon:
    """Listens on a unix socket, records each request line, answers with reply(request).

    reply returns the raw bytes to send (None: say nothing and keep the connection open
    until the client gives up, like a daemon that hangs).
    """

    def __init__(self, path: Path, reply: Reply):
        self.path = path
        self.reply = reply
        self.requests: list[dict[str, Any]] = []
        self.raw: list[bytes] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        os.chmod(path, 0o666)
        self._sock.listen(16)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                line = b""
                try:
                    while not line.endswith(b"\n"):
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        line += chunk
                except OSError:
                    continue
                self.raw.append(line)
                request = json.loads(line)
                self.requests.append(request)
                answer = self.reply(request)
                if answer is None:  # hang: hold the connection until the client leaves
                    conn.settimeout(None)
                    while not self._stop.is_set():
                        conn.settimeout(0.1)
                        try:
                            if not conn.recv(1):
                                break
                        except TimeoutError:
                            continue
                        except OSError:
                            break
                    continue
                try:
                    conn.sendall(answer)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(5)
        self.path.unlink(missing_ok=True)


def reply_json(**fields: Any) -> bytes:
    return json.dumps({"v": 1, **fields}).encode() + b"\n"
