"""`sudo make demo`: a tour of gpuguard on simulated GPUs, with real users, PAM logins and the gate.

Everything the tour creates is named `ggt-demo-*` (or `ggt-<name>-*` for its users) and removed at
the end, even when a step fails: a group, three users, a sandbox under /tmp with the config and
the simulated device nodes, a daemon with a gate of its own, and a PAM stack. Logins go through
`su -` in a private mount namespace where that stack is bind-mounted over /etc/pam.d/su-l, so the
system's own PAM files are never touched.
"""
from __future__ import annotations

import os
import pwd
import secrets
import shlex
import shutil
import subprocess
import textwrap
import time
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from devtools.harness import (
    VENV_BIN,
    bpffs_restored,
    free_port,
    kill_processes_of,
    searchable,
    start_daemon,
    stop_daemon,
)
from gpuguard import client

REPO = Path(__file__).resolve().parent.parent
PAM_MODULE = REPO / "pam" / "pam_gpuguard.so"


# The lab of the main tour: four simulated H100s in two NVLink pairs, a 20GiB memory quota.
H100_LAB = """\
[defaults]
gpus = 1
gpu_memory = "20GiB"
max_time = "8h"

[gpu.simulated]
count = 4
name = "NVIDIA H100 80GB HBM3"
"""


class Tour:
    def __init__(self, stack: ExitStack, members: tuple[str, ...] = ("alice", "bob"),
                 outsiders: tuple[str, ...] = ("carol",)):
        """members get GPUs (they are in the tour's group); outsiders are users who are not."""
        self.stack = stack
        tag = secrets.token_hex(3)
        self.tag = tag
        self.dir = Path(f"/tmp/ggt-demo-{tag}")
        self.group = f"ggt-demo-{tag}"
        self.gate = f"ggt-demo-{tag}"
        self.config = self.dir / "gpuguard.toml"
        self.socket = self.dir / "run" / "gpuguard.sock"
        self.members = members
        self.users = {name: f"ggt-{name}-{tag}" for name in (*members, *outsiders)}
        self.daemon: subprocess.Popen | None = None
        self.metrics_port = free_port()

    # --- setting the stage

    def setup(self, lab: str = H100_LAB, quotas: str = "") -> None:
        """lab: the config's [defaults] and [gpu.simulated] tables; quotas: quotas.toml."""
        self.dir.mkdir(mode=0o755)
        self.stack.callback(shutil.rmtree, self.dir, ignore_errors=True)
        run(["groupadd", self.group])
        self.stack.callback(run, ["groupdel", self.group], check=False)
        for name, user in self.users.items():
            groups = ["--groups", self.group] if name in self.members else []
            run(["useradd", "--create-home", "--shell", "/bin/bash", *groups, user])
            self.stack.callback(run, ["userdel", "--remove", "--force", user], check=False)
            self.stack.callback(kill_processes_of, pwd.getpwnam(user).pw_uid)
        self.config.write_text(textwrap.dedent(f"""\
            [access]
            group = "{self.group}"

            [sessions]
            # The tour's logins are `su -` reading commands from a pipe: no terminal, so say that
            # this service takes GPUs (a real login on a terminal does anyway).
            services = ["su-l"]

            [watcher]
            interval = "0.5s"
            grace = "3s"
            kill_wait = "2s"

            [paths]
            state_dir = "{self.dir}/state"
            socket = "{self.socket}"
            device_dir = "{self.dir}/dev"

            [metrics]
            listen = "127.0.0.1:{self.metrics_port}"

            [gpu]
            backend = "simulated"
            """) + "\n" + lab)
        (self.dir / "quotas.toml").write_text(quotas)
        for path in (self.config, self.dir / "quotas.toml"):
            path.chmod(0o644)
        helper = self.dir / "bin" / "first-gpu"  # what a user's script would do to find its GPU
        helper.parent.mkdir(mode=0o755)
        helper.write_text("#!/bin/sh\n# The minor number of the first GPU gpuguard granted me.\n"
                          "gpuguard whoami --json | python3 -c 'import json, sys; "
                          "print(json.load(sys.stdin)[\"grants\"][0][\"minor\"])'\n")
        helper.chmod(0o755)
        stack_file = self.dir / "pam-login"
        stack_file.write_text(
            "auth     sufficient pam_rootok.so\n"
            "account  required   pam_permit.so\n"
            "session  required   pam_unix.so\n"
            f"session  optional   {PAM_MODULE} socket={self.socket}\n")
        self.pam_stack = stack_file

    def start_daemon(self) -> None:
        self.daemon = start_daemon(self.stack, self.config, self.gate, self.dir / "daemon.log")

    def stop_daemon(self) -> None:
        stop_daemon(self.daemon)

    # --- acting

    def gpuguard_argv(self, *args: str) -> list[str]:
        return [str(VENV_BIN / "gpuguard"), "--config", str(self.config), *args]

    def admin(self, *args: str) -> str:
        """Run a gpuguard command as root and show it like a terminal would."""
        print(f"root# gpuguard {' '.join(args)}")
        result = subprocess.run(self.gpuguard_argv(*args), capture_output=True, text=True)
        output = (result.stdout + result.stderr).rstrip()
        print(textwrap.indent(output, "  ") if output else "", end="\n" if output else "")
        return result.stdout

    def login(self, name: str, commands: str) -> None:
        """A real PAM login of a demo user (su - through our stack), running `commands`."""
        user = self.users[name]
        print(f"\n{name}$ login  (su - {user}: a PAM session with pam_gpuguard.so in it)")
        script = (f"export PATH={self.dir}/bin:{VENV_BIN}:$PATH GPUGUARD_CONFIG={self.config}\n"
                  + "\n".join(f"echo {shlex.quote(f'{name}$ {line}')}; {line}"
                               for line in commands.strip().splitlines()))
        # The commands come on stdin, as typed: `su -c` would hide PAM's login messages.
        inner = f"mount --bind {self.pam_stack} /etc/pam.d/su-l && exec su - {user}"
        result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
                                input=script, capture_output=True, text=True, timeout=120)
        print(textwrap.indent((result.stdout + result.stderr).rstrip(), "  "))

    def scrape(self, *prefixes: str) -> None:
        """Fetch the metrics endpoint as Prometheus would and show the lines of these metrics."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        print(f"root# curl -s {url} | grep -E '^({'|'.join(prefixes)})'")
        with urllib.request.urlopen(url, timeout=10) as reply:
            lines = reply.read().decode().splitlines()
        for line in lines:
            if line.startswith(prefixes) and not line.endswith(" 0.0"):
                print(f"  {line}")

    def wait_until_free(self, timeout: float = 60) -> None:
        """Until nobody holds a GPU (the jobs ended and their logged-out owners' grants went back)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not any(gpu["holders"] for gpu in client.call(str(self.socket), "status")["gpus"]):
                return
            time.sleep(0.5)

    def wait_for_event(self, name: str, kind: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            events = client.call(str(self.socket), "whoami", user=self.users[name])["events"]
            if any(e["kind"] == kind for e in events):
                return
            time.sleep(0.25)


def run(argv: list[str], check: bool = True) -> None:
    subprocess.run(argv, check=check, capture_output=True)


def step(title: str) -> None:
    print(f"\n=== {title} ===")


def tour(t: Tour) -> None:
    step("1. Configuration: checked before anything runs")
    t.admin("config", "check")
    broken = t.dir / "broken.toml"
    broken.write_text('[defaults]\ngpu_memory = "20 gigs"\n')
    t.admin("config", "check", str(broken))

    step("2. The GPUs (simulated through NVML's own Python bindings)")
    t.admin("gpus")

    step("3. The daemon starts and attaches the kernel gate")
    t.start_daemon()
    t.admin("gate", "status", "--name", t.gate)

    step("4. alice logs in: she gets GPUs (her quota says 2) and her programs see only those")
    t.login("alice", """
echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES
gpuguard whoami
gpu=$(first-gpu)
nohup gpuguard sim burn --gpu $gpu --mem 8GiB --seconds 600 > train.log 2>&1 &
sleep 1; cat train.log
""")
    held = {g["minor"] for g in client.call(str(t.socket), "whoami", user=t.users["alice"])["grants"]}
    other = min({0, 1, 2, 3} - held)

    step("5. bob logs in: a GPU of his own; alice's are closed to him by the kernel")
    t.login("bob", f"""
echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES
gpuguard sim burn --gpu {sorted(held)[0]} --mem 1GiB --seconds 0
""")

    step("6. carol is not in the GPU group: her login works, GPUs stay closed")
    t.login("carol", f"""
echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES
gpuguard sim burn --gpu {other} --mem 1GiB --seconds 0
""")

    step("7. alice logged out, but her nohup job keeps her GPUs; everyone sees who holds what, and uses how much")
    t.admin("status")
    t.admin("status", "--csv")
    t.scrape("gpuguard_gpu_holder", "gpuguard_gpu_memory_used_bytes", "gpuguard_user_gpu_memory_used_bytes")

    step("8. bob goes over his 20GiB memory quota: warned, then stopped after the grace period")
    t.login("bob", """
gpuguard sim burn --gpu $(first-gpu) --mem 30GiB --seconds 60; echo "the job ended with status $?"
gpuguard whoami | tail -n 4
""")

    step("9. The admin revokes alice's GPUs: her running job is warned and ended too")
    t.admin("revoke", t.users["alice"])
    t.wait_for_event("alice", "kill")
    t.admin("whoami", "--user", t.users["alice"])

    step("10. The records: the month's report, the event history, and what Prometheus scrapes")
    t.admin("report")
    t.admin("report", "--by", "gpu")
    t.admin("events", "--rule", "memory")
    t.scrape("gpuguard_warnings_total", "gpuguard_kills_total", "gpuguard_revokes_total",
             "gpuguard_watcher_tick_seconds_count")

    step("11. The daemon stops: the gate stays, so GPU access stays closed (fail closed)")
    t.stop_daemon()
    t.login("bob", "gpuguard sim burn --gpu 0 --mem 1GiB --seconds 0")
    t.admin("gate", "status", "--name", t.gate)


def stage(play: Callable[[ExitStack], None], target: str) -> int:
    """Run a tour as root with everything it made removed at the end, even when a step fails."""
    if os.geteuid() != 0:
        print(f"demo: run as root (sudo make {target}): it adds users, attaches a gate and opens PAM sessions")
        return 2
    if not PAM_MODULE.exists():
        print(f"demo: {PAM_MODULE} is missing: run make pam (sudo make {target} does)")
        return 2
    with ExitStack() as stack:
        stack.enter_context(searchable(REPO))
        stack.enter_context(bpffs_restored())
        play(stack)
        step("Cleaning up: demo users, group, gate, daemon and files removed")
    return 0


def main() -> int:
    def play(stack: ExitStack) -> None:
        t = Tour(stack)
        t.setup(quotas=f'[users.{t.users["alice"]}]\ngpus = 2\n')
        tour(t)
    return stage(play, "demo")


if __name__ == "__main__":
    raise SystemExit(main())
