"""Which PAM sessions take GPUs, through the real module and a real daemon (pamtester sets PAM_TTY
as sshd does: "ssh" without a terminal, /dev/pts/N with one). By default only sessions with a
terminal take GPUs; the others (scp, sftp, `ssh host cmd`) get what the user holds already."""
from __future__ import annotations

import pytest
from ssh_harness import PamStacks, env_probe, module_line, pamtester, probed_devices

pytestmark = pytest.mark.gate


@pytest.fixture
def stacks():
    made = PamStacks()
    yield made
    made.remove_all()


def login(d, stacks, sandbox, user, tty: str, *options: str) -> str | None:
    """One session (opened and closed) with PAM_TTY = tty; CUDA_VISIBLE_DEVICES it got, or None."""
    service = stacks.make(module_line(d.socket, "quiet", *options), env_probe(sandbox))
    result = pamtester(service, user.name, "open_session", items={"tty": tty})
    assert result.returncode == 0, result
    return probed_devices(result.stdout)


def test_only_sessions_with_a_terminal_take_gpus(gg_daemon, stacks, sandbox) -> None:
    d = gg_daemon
    alice = d.add_member()
    assert login(d, stacks, sandbox, alice, "ssh") is None  # scp, sftp, `ssh host cmd`
    assert d.grants(alice) == []
    visible = login(d, stacks, sandbox, alice, "/dev/pts/7")  # an interactive login
    (grant,) = d.grants(alice)
    assert visible == d.uuid(grant["minor"])
    # Now that alice holds a GPU, her non-interactive sessions see it too.
    assert login(d, stacks, sandbox, alice, "ssh") == visible


def test_the_stack_and_the_config_can_say_otherwise(start_daemon, stacks, sandbox) -> None:
    d = start_daemon(sessions={"services": ["ggt-jupyterhub"]})
    alice, bob, carol = d.add_member(), d.add_member(), d.add_member()
    assert login(d, stacks, sandbox, alice, "/dev/pts/7", "grant=never") is None
    assert login(d, stacks, sandbox, alice, "ssh", "grant=always") is not None
    assert d.grants(alice)
    # No terminal (a spawner's session): a listed service takes GPUs, another does not.
    for user, service, takes in ((bob, "ggt-jupyterhub", True), (carol, "ggt-other", False)):
        reply = d.call("session_open", user=user.name, service=service, rhost="", tty="", pid=d.caller().pid)
        assert bool(reply["gpus"]) == takes == bool(d.grants(user)), (service, reply)
