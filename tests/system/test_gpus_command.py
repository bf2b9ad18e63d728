"""`gpuguard gpus` asks the daemon, so every user sees the inventory (NVML itself refuses a user
the GPUs they may not open: "Insufficient Permissions"); root's falls back to NVML without a daemon."""
from __future__ import annotations

import json

import pytest
from sim_helpers import GiB, burn

from devtools.harness import wait_for

pytestmark = pytest.mark.gate


def test_a_user_sees_every_gpu_through_the_daemon_even_those_they_may_not_open(start_daemon, make_user):
    d = start_daemon(simulated={"nvlink_groups": [[0, 1], [2, 3]]})
    stranger = make_user()  # not even a member
    d.node(1).chmod(0o600)  # real NVML could not get a handle to this GPU for them
    with burn(d.config_path, 2, "4GiB"):
        assert wait_for(lambda: any(g["minor"] == 2 and g["processes"] for g in d.call("status")["gpus"]))
        shown = json.loads(d.cli_as(stranger, "gpus", "--json").stdout)
    gpus = {gpu["minor"]: gpu for gpu in shown["gpus"]}
    assert sorted(gpus) == [0, 1, 2, 3]
    assert (gpus[2]["processes"], gpus[2]["memory_used"]) == (1, 4 * GiB)
    assert gpus[1]["uuid"] == d.uuid(1) and {gpu["index"] for gpu in gpus.values()} == {0, 1, 2, 3}
    assert shown["topology"]["0"]["1"] == "NVLINK" and shown["topology"]["1"]["1"] == "X"
    table = d.cli_as(stranger, "gpus")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["GPU", "INDEX", "NAME"] and "GPU0  X     NV" in table.stdout


def test_a_user_without_a_daemon_is_told_it_is_unreachable(start_daemon):
    d = start_daemon()
    alice = d.add_member()
    d.stop()
    result = d.cli_as(alice, "gpus")
    assert result.returncode == 3 and result.stderr.count("\n") == 1, result.stderr
    root = d.cli("gpus", "--json")  # root reads NVML itself
    assert root.returncode == 0 and len(json.loads(root.stdout)["gpus"]) == 4, root.stderr
