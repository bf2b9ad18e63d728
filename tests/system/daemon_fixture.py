"""A real gpuguard daemon for tests: `start_daemon(...)` and `gg_daemon`.

    @pytest.mark.gate                       # the daemon attaches a BPF gate of its own
    def test_login(start_daemon):
        d = start_daemon(defaults={"gpus": 2}, quotas={"users": {}})   # or use `gg_daemon`
        alice = d.add_member()                                         # real user in d.group
        opened = d.open_session(alice)         # session_open as PAM would; opened["pid"] = its caller
        assert d.whoami(alice)["grants"]
        with burn(d.config_path, opened["gpus"][0], user=alice):      # tests/sim_helpers
            ...
        d.close_session(alice, opened["pid"])

What it sets up: a unique `ggt-g-*` group (members get GPUs), a sandbox with the config
(4 simulated GPUs, nodes in `d.device_dir`, state and socket inside the sandbox, watcher
interval 0.2 s), then `python -m gpuguard daemon --gate-name ggt-*` as a subprocess, and
waits for its READY=1 (sent to a NOTIFY_SOCKET of ours, as systemd would see it).
Teardown: SIGTERM (the daemon must exit 0), then the test gate is detached; its log is
printed, so pytest shows it with a failure.

start_daemon(count=4, simulated=None, quotas=None, gate=True, wrapper=(), env=None, **tables):
    wrapper: argv run in front of the daemon (e.g. setpriv with a capability bounding set);
    env: more environment (e.g. WATCHDOG_USEC);
    tables: top-level config tables merged over the defaults, e.g. access={"exempt_users": [..]},
    watcher={"interval": "1s"}, defaults={"gpus": 1, "max_time": "1h"};
    simulated: more [gpu.simulated] keys (e.g. {"nvlink_groups": [[0, 1], [2, 3]]});
    quotas: the quotas.toml content as a dict ({"users": {NAME: {...}}, "groups": {...}});
    gate=False: access.mode = "acl" (no BPF program).

The handle (RunningDaemon):
    config_path, config (gpuguard.config.Config), socket, group, sandbox, device_dir, gate_name,
    proc (the Popen), log() -> the daemon's stderr so far
    notifications()               -> every sd_notify datagram it sent so far (READY=1, STATUS=..., WATCHDOG=1)
    call(op, **fields)            -> reply dict, as root (raises gpuguard.client.Refused)
    call_as(user, op, **fields)   -> reply dict, the request sent by a process of `user`
                                     (a refusal comes back as {"ok": False, "error", "code"})
    cli(*args), cli_as(user, *args) -> CompletedProcess of `gpuguard --config ... args`
    add_member(groups=())         -> TestUser in group (and these other groups)
    caller()                      -> Popen of a live stand-in PAM caller (killed at teardown)
    open_session(user, pid=None, service="ggt-test") -> session_open reply + "pid" (of a new
                                     caller() when pid is None)
    close_session(user, pid)      -> session_close reply
    whoami(user)                  -> whoami reply for user (asked as root)
    grants(user)                  -> the user's grants, as whoami lists them (dicts)
    granted_minors(user)          -> the minors of those grants, in order
    uuid(minor)                   -> the UUID of GPU `minor`, as status lists it
    node(minor)                   -> Path of /dev/nvidia<minor> in the sandbox
    write_config(**same as start_daemon) and reload() -> change the config of the running daemon
    stop() -> exit status (SIGTERM; idempotent); restart() -> start it again on the same state
conftest.wait_for(predicate) polls for what the daemon's tick does.
One daemon per test; `paths` and `gpu` are set by the fixture (not overridable).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomlkit
from conftest import PYTHON, TestUser, run_as, unique
from leftovers import sweep_gates
from sim_helpers import cli, gpuguard, write_config

from devtools.harness import gate_test_lock
from gpuguard import client
from gpuguard import config as gpuguard_config
from gpuguard.backends.gate import Gate

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0


class RunningDaemon:
    def __init__(self, sandbox: Path, group: str, make_user):
        self.sandbox = sandbox
        self.group = group
        self.gate_name = unique("ggt")
        self.device_dir = sandbox / "dev"
        self.config_path = sandbox / "gpuguard.toml"
        self.log_path = sandbox / "daemon.log"
        self.proc: subprocess.Popen | None = None
        self._make_user = make_user
        self._callers: list[subprocess.Popen] = []
        self.wrapper: tuple[str, ...] = ()
        self.env: dict[str, str] = {}
        self._notify: socket.socket | None = None
        self._notes: list[str] = []

    # --- configuration

    def write_config(self, count: int = 4, simulated: dict | None = None, quotas: dict | None = None,
                     gate: bool = True, **tables: Any) -> None:
        merged: dict[str, dict] = {"access": {"group": self.group, "mode": "gate" if gate else "acl"},
                                   "watcher": {"interval": "0.2s"}}
        for name, table in tables.items():
            merged[name] = {**merged.get(name, {}), **table}
        sim_keys = tomlkit.dumps(simulated or {})
        write_config(self.sandbox, count=count, extra=sim_keys + "\n" + tomlkit.dumps(merged))
        quotas_path = self.sandbox / "quotas.toml"
        quotas_path.write_text(tomlkit.dumps(quotas or {}))
        quotas_path.chmod(0o644)
        self.config = gpuguard_config.load(self.config_path)
        self.socket = str(self.config.paths.socket)

    def reload(self) -> dict:
        return self.call("reload")

    # --- life cycle

    def start(self) -> None:
        notify_path = self.sandbox / "notify.sock"
        notify_path.unlink(missing_ok=True)
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify.bind(str(notify_path))
        self._notes = []
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.wrapper, *gpuguard(self.config_path, "daemon", "--gate-name", self.gate_name)],
                stdout=log, stderr=log, cwd="/", env={**os.environ, **self.env, "NOTIFY_SOCKET": str(notify_path)})
        deadline = time.monotonic() + READY_TIMEOUT
        while self.proc.poll() is None and time.monotonic() < deadline:
            if "READY=1" in self._receive(0.2):
                return
        status = self.proc.poll()
        self.stop()
        raise AssertionError(f"daemon not ready (exit status {status}):\n{self.log()}")

    def _receive(self, timeout: float) -> list[str]:
        """The assignments of the next datagram ([] after timeout); kept for notifications()."""
        assert self._notify is not None
        self._notify.settimeout(timeout)
        try:
            lines = self._notify.recv(4096).decode().split("\n")
        except (TimeoutError, BlockingIOError):  # nothing within the timeout (0: nothing queued)
            return []
        self._notes += lines
        return lines

    def notifications(self) -> list[str]:
        """Every assignment the daemon sent to its NOTIFY_SOCKET so far, in order."""
        if self._notify is not None:
            while self._receive(0):
                pass
        return list(self._notes)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._notify is not None:
            self.notifications()  # what it said while stopping
            self._notify.close()
            self._notify = None
        return self.proc.returncode

    def restart(self) -> None:
        self.stop()
        self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # --- talking to it

    def call(self, op: str, /, **fields: Any) -> dict:
        return client.call(self.socket, op, timeout=30, **fields)

    def call_as(self, user: TestUser, op: str, /, **fields: Any) -> dict:
        code = ("import json, sys\nfrom gpuguard import client\n"
                "try:\n    print(json.dumps(client.call(sys.argv[1], sys.argv[2], timeout=30, **json.loads(sys.argv[3]))))\n"
                "except client.Refused as exc:\n"
                "    print(json.dumps({'ok': False, 'error': str(exc), 'code': exc.code}))\n")
        result = run_as(user, [PYTHON, "-c", code, self.socket, op, json.dumps(fields)])
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def cli(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess:
        return cli(self.config_path, *args, **kwargs)

    def cli_as(self, user: TestUser, *args: str, **kwargs: Any) -> subprocess.CompletedProcess:
        return cli(self.config_path, *args, user=user, **kwargs)

    # --- people and sessions

    def add_member(self, groups: tuple[str, ...] | list[str] = ()) -> TestUser:
        return self._make_user(groups=[self.group, *groups])

    def caller(self) -> subprocess.Popen:
        """A live process standing in for a PAM caller (sshd's [priv] process); killed at teardown."""
        caller = subprocess.Popen(["sleep", "infinity"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._callers.append(caller)
        return caller

    def open_session(self, user: TestUser, pid: int | None = None, service: str = "ggt-test") -> dict:
        pid = self.caller().pid if pid is None else pid
        reply = self.call("session_open", user=user.name, service=service, rhost="127.0.0.1", tty="pts/9", pid=pid)
        return {**reply, "pid": pid}

    def close_session(self, user: TestUser, pid: int) -> dict:
        return self.call("session_close", user=user.name, service="ggt-test", pid=pid)

    def whoami(self, user: TestUser) -> dict:
        return self.call("whoami", user=user.name)

    def grants(self, user: TestUser) -> list[dict]:
        return self.whoami(user)["grants"]

    def granted_minors(self, user: TestUser) -> list[int]:
        return [grant["minor"] for grant in self.grants(user)]

    def uuid(self, minor: int) -> str:
        (gpu,) = [g for g in self.call("status")["gpus"] if g["minor"] == minor]
        return gpu["uuid"]

    def node(self, minor: int) -> Path:
        return self.device_dir / f"nvidia{minor}"

    def cleanup(self) -> int | None:
        status = self.stop()
        for caller in self._callers:
            caller.kill()
            caller.wait()
        Gate(self.gate_name).detach()
        return status



@pytest.fixture
def start_daemon(sandbox, make_group, make_user) -> Iterator:
    started: list[RunningDaemon] = []

    def start(*, wrapper: tuple[str, ...] = (), env: dict[str, str] | None = None, **config: Any) -> RunningDaemon:
        # One per test: two gates would both have to allow every open.
        assert not started, "start_daemon: one daemon per test (use restart() or write_config() + reload())"
        daemon = RunningDaemon(sandbox, make_group(), make_user)
        daemon.wrapper, daemon.env = tuple(wrapper), dict(env or {})
        started.append(daemon)
        daemon.write_config(**config)
        daemon.start()
        return daemon

    with gate_test_lock():  # any other test's gate would deny our users too
        # The session sweep (conftest) ran at the start; a run aborted since may have left a gate.
        for removed in sweep_gates():
            print(f"removed a leftover: {removed}")
        yield start
        for daemon in started:
            running = daemon.proc is not None and daemon.proc.poll() is None
            status = daemon.cleanup()
            print(f"--- daemon log ({daemon.gate_name}) ---\n{daemon.log()}")
            assert not running or status == 0, f"the daemon exited {status} on SIGTERM (log above)"


@pytest.fixture
def gg_daemon(start_daemon) -> RunningDaemon:
    """A daemon with the default test config (4 GPUs, 1 GPU per member, exclusive)."""
    return start_daemon()
