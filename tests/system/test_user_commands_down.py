"""While the daemon is down (issue 38, 6), `gpuguard env` and `whoami` answer from the held-devices
file the PAM module reads (the grants outlive the daemon: the gate keeps them), and say on stderr
that the service is down; a user the file says nothing for gets the one-line error as before."""
from __future__ import annotations

import json

from conftest import run_as
from sim_helpers import gpuguard


def test_env_and_whoami_fall_back_to_the_held_devices_file(start_daemon):
    d = start_daemon(count=2, gate=False)
    alice, bob = d.add_member(), d.add_member()
    (minor,) = d.call_as(alice, "request", gpus=1)["granted"]
    uuid = d.uuid(minor)
    assert d.stop() == 0

    env = d.cli_as(alice, "env")
    assert (env.returncode, env.stdout) == (0, f"export CUDA_VISIBLE_DEVICES={uuid}\n"), env.stderr
    assert env.stderr.count("\n") == 1 and "service is down" in env.stderr
    shell = run_as(alice, ["bash", "-c", f'eval "$({" ".join(gpuguard(d.config_path, "env"))})" && '
                                         'echo "cvd=$CUDA_VISIBLE_DEVICES"'])
    assert shell.stdout == f"cvd={uuid}\n", shell

    whoami = d.cli_as(alice, "whoami")
    assert whoami.returncode == 3  # the daemon's answer is missing, and says so
    assert f"export CUDA_VISIBLE_DEVICES={uuid}" in whoami.stdout.splitlines()
    assert whoami.stderr.count("\n") == 1 and "service is down" in whoami.stderr
    as_json = d.cli_as(alice, "whoami", "--json")
    assert (as_json.returncode, json.loads(as_json.stdout)["held"]) == (3, [uuid])

    for argv in (["env"], ["whoami"]):  # bob holds nothing: no file, the plain error
        nothing = d.cli_as(bob, *argv)
        assert (nothing.returncode, nothing.stdout, nothing.stderr.count("\n")) == (3, "", 1), nothing
        assert "not reachable" in nothing.stderr
