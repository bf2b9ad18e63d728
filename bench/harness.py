"""What bench/torture and bench/soak set up: a group, members, a daemon on simulated GPUs with a gate
of its own (all named ggt-*, removed on exit), and a Target (tests/system/torture.py) to aim at it."""
from __future__ import annotations

import secrets
import shutil
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "system")]

from torture import Target  # noqa: E402

from devtools.harness import VENV_BIN, bpffs_restored, gate_test_lock  # noqa: E402
from gpuguard import client  # noqa: E402
from gpuguard.backends.gate import Gate  # noqa: E402


class Daemon:
    """`gpuguard daemon` that can be SIGKILLed and started again on the same state."""

    def __init__(self, config: Path, gate: str, socket: str, log: Path):
        self.config, self.gate, self.socket, self.log = config, gate, socket, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([str(VENV_BIN / "gpuguard"), "--config", str(self.config), "daemon",
                                          "--gate-name", self.gate], stdout=out, stderr=out)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.call(self.socket, "status", timeout=1)
                return
            except client.DaemonUnreachable:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the gpuguard daemon did not start; see {self.log}") from None
                time.sleep(0.05)

    def kill_and_restart(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.start()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(15)


def setup(stack: ExitStack, users: int, gpus: int, extra: str = "") -> tuple[Daemon, Target, Path]:
    """A group with `users` members plus an attacker member, a daemon on `gpus` simulated GPUs
    (config `extra` appended), callers for the members; returns the daemon, the target, the directory.
    Holds the test suite's gate lock meanwhile: another attached gate would deny their users."""
    stack.enter_context(gate_test_lock())
    stack.enter_context(bpffs_restored())
    tag = secrets.token_hex(3)
    base = Path(f"/tmp/ggt-torture-{tag}")
    base.mkdir(mode=0o755)
    stack.callback(shutil.rmtree, base, ignore_errors=True)
    group = f"ggt-t-{tag}"
    subprocess.run(["groupadd", group], check=True)
    stack.callback(subprocess.run, ["groupdel", group], check=False)
    names = [f"ggt-t{i}-{tag}" for i in range(users + 1)]
    for name in names:
        subprocess.run(["useradd", "--no-create-home", "--groups", group, name], check=True)
        stack.callback(subprocess.run, ["userdel", "--force", name], check=False, capture_output=True)
    uids = [int(subprocess.run(["id", "-u", name], capture_output=True, text=True, check=True).stdout) for name in names]
    config = base / "gpuguard.toml"
    config.write_text(f'[access]\ngroup = "{group}"\n[paths]\nstate_dir = "{base}/state"\n'
                      f'socket = "{base}/run/gpuguard.sock"\ndevice_dir = "{base}/dev"\n'
                      f'[gpu]\nbackend = "simulated"\n[gpu.simulated]\ncount = {gpus}\n{extra}')
    config.chmod(0o644)
    socket = str(base / "run" / "gpuguard.sock")
    daemon = Daemon(config, f"ggt-torture-{tag}", socket, base / "daemon.log")
    stack.callback(lambda: Gate(daemon.gate).detach())
    stack.callback(daemon.stop)
    daemon.start()
    callers = {}
    for name in names[:-1]:
        caller = subprocess.Popen(["sleep", "infinity"])  # stands in for sshd's [priv] process
        stack.callback(caller.kill)
        callers[name] = caller.pid
    target = Target(socket=socket, store_path=base / "state" / "state.db", device_dir=base / "dev",
                    gate_name=daemon.gate, users=list(zip(names[:-1], uids[:-1], strict=True)), restart=daemon.kill_and_restart,
                    attacker_uid=uids[-1], callers=callers)
    return daemon, target, base
