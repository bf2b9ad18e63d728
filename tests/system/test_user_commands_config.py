"""The users' commands never depend on the admin's files: they read only the config's `socket =`
line and take everything else from the daemon, so a half-edited quotas.toml or gpuguard.toml, or
one readable by root only, stops no user's command while the daemon runs on. And they start light:
checked on the modules a fresh interpreter loaded, not on timings (the bench times them)."""
from __future__ import annotations

import json
import subprocess

import pytest
from conftest import PYTHON

pytestmark = pytest.mark.gate

USER_COMMANDS = (["whoami"], ["status"], ["env"], ["request"], ["release"])

LOADED = """
import json, sys
from gpuguard.cli import main
code = main(sys.argv[1:])
print(json.dumps([code, sorted(m for m in sys.modules if m.startswith("gpuguard") or m in (
    "typing", "tomllib", "dataclasses", "pkgutil", "csv", "argparse", "socket"))]))
"""


def test_user_commands_work_while_the_admins_files_are_broken_or_unreadable(start_daemon):
    d = start_daemon(defaults={"gpus": 1})
    alice = d.add_member()
    quotas = d.sandbox / "quotas.toml"
    with quotas.open("a") as file:
        file.write("gpus = 2 [\n")  # an edit in progress
    quotas.chmod(0o600)
    with d.config_path.open("a") as file:
        file.write('\n[watcher]\ninterval = "soon"\n')  # broken too, below the socket line
    for argv in USER_COMMANDS:
        result = d.cli_as(alice, *argv)
        assert result.returncode == 0, (argv, result.stderr)
    assert d.granted_minors(alice) == []  # request, then release, went through


def test_an_unreadable_config_means_the_default_socket_and_says_so(start_daemon):
    d = start_daemon()
    alice = d.add_member()
    d.config_path.chmod(0o600)
    result = d.cli_as(alice, "whoami")
    assert result.returncode == 3, result.stderr  # this daemon's socket is not the default one
    assert "default socket" in result.stderr and "Permission denied" in result.stderr
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize("argv", [["whoami"], ["status"], ["env"], ["fairshare"], ["events"], ["report"]])
def test_the_users_commands_load_neither_the_config_nor_the_model(start_daemon, argv):
    d = start_daemon()
    result = subprocess.run([PYTHON, "-c", LOADED, "--config", str(d.config_path), *argv], capture_output=True,
                            text=True, timeout=60)
    code, loaded = json.loads(result.stdout.splitlines()[-1])
    assert code == 0, result.stderr
    assert not set(loaded) & {"gpuguard.config", "gpuguard.core.model", "gpuguard.core.rules", "gpuguard.core.policy", "tomllib",
                              "typing", "dataclasses", "pkgutil", "csv", "argparse", "socket"}, loaded
