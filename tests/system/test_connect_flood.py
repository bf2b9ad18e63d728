"""A connect flood of the users' socket by one non-member (issue 35): 120 processes each keeping
64 connections open and connecting again at once when refused, from one uid and from 120 subuids
of a user namespace, with the users' socket's queue full. Throughout, logins through the module
and through the pam_exec hook get their GPU, root's `status` and `revoke` answer, and another
member's `whoami` answers: logins and root come in through root's own door, and the users' door
drains its queue faster than one uid can fill it. Counts only; how long each took against no
flood is bench/flood_bench.py's business."""
from __future__ import annotations

import subprocess
import time
from functools import partial

import pytest
from ssh_harness import PamSession, PamStacks, env_probe, hook_line, module_line, pamtester, probed_devices
from test_floods import FLOOD, NAMESPACE

from gpuguard.daemon.server import USERS_BACKLOG

pytestmark = [pytest.mark.gate, pytest.mark.usefixtures("pam_module")]

PROCS, CONNECTIONS = 120, 64  # the finding's flood: 7,680 connections, more than the queue's 4,096
ROUNDS = 4  # of each kind of call under the flood


def queued(path: str) -> int:
    """Connections waiting in the kernel's listen queue of the socket at path (ss's Recv-Q)."""
    lines = subprocess.run(["ss", "-xlH", "src", path], capture_output=True, text=True, check=True).stdout.split()
    return int(lines[2]) if len(lines) > 2 else 0


@pytest.fixture
def flood(hostile):
    """Start a devtools/floods.py flood as a user (before: argv in front, e.g. unshare); killed at the end."""
    return partial(hostile, script=FLOOD, within=60)


@pytest.fixture
def stacks():
    made = PamStacks()
    yield made
    made.remove_all()


def module_login(d, stacks: PamStacks, sandbox) -> bool:
    """A login through pam_gpuguard.so: did the session's environment get a GPU?"""
    member = d.add_member()
    service = stacks.make(module_line(d.socket), env_probe(sandbox))
    result = pamtester(service, member.name, "open_session", "close_session")
    return result.returncode == 0 and probed_devices(result.stdout) is not None


def hook_login(d, stacks: PamStacks) -> bool:
    """A login through the pam_exec hook: did the user hold a GPU while the session was open?"""
    member = d.add_member()
    service = stacks.make(hook_line("--config", str(d.config_path), stdout=False))
    with PamSession(service, member.name):
        return len(d.grants(member)) == 1


@pytest.mark.parametrize("kind", ["connects", "subconnects"])
def test_a_connect_flood_of_the_users_socket_starves_no_login_admin_or_other_user(
        start_daemon, make_user, flood, stacks, sandbox, kind):
    d = start_daemon(sessions={"grant": "all"})
    bystander = d.add_member()
    assert d.cli_as(bystander, "whoami").returncode == 0
    mallory = make_user()  # not a member: anyone with a shell can do this
    flood(mallory, kind, d.socket, PROCS, CONNECTIONS, before=NAMESPACE if kind == "subconnects" else ())
    outcomes: dict[str, list[bool]] = {"module": [], "hook": [], "status": [], "revoke": [], "whoami": []}
    took: dict[str, list[float]] = {key: [] for key in outcomes}

    def attempt(what: str, call) -> None:
        started = time.monotonic()
        outcomes[what].append(bool(call()))
        took[what].append(time.monotonic() - started)

    deepest = 0
    for _ in range(ROUNDS):
        deepest = max(deepest, *(queued(d.socket) for _ in range(20)))
        attempt("module", lambda: module_login(d, stacks, sandbox))
        attempt("hook", lambda: hook_login(d, stacks))
        attempt("status", lambda: d.cli("status").returncode == 0)
        holder = d.add_member()
        d.open_session(holder)
        attempt("revoke", lambda holder=holder: d.cli("revoke", holder.name).returncode == 0 and d.grants(holder) == [])
        attempt("whoami", lambda: d.cli_as(bystander, "whoami").returncode == 0)
    print(deepest, {what: [f"{seconds:.3f}" for seconds in times] for what, times in took.items()})  # for the docs
    assert all(all(results) for results in outcomes.values()), outcomes
    # The flood was at the door: the kernel's queue of the users' socket stood full.
    assert deepest >= USERS_BACKLOG, deepest
