"""Beside Slurm and Kubernetes: a real daemon on simulated GPUs, a gres.conf of the test's own,
a stub `scontrol` first on the daemon's PATH, and a real process named slurmd.

The GPUs gres.conf gives this node (and `coexist.k8s_gpus`) are left alone: a user without a grant
opens them with the gate attached, their nodes keep the driver's 0666 and no ACL, nothing is
allocated there and the watcher does not treat their processes as strays; gpuguard's other GPUs
stay closed (EPERM). With no [coexist] slurm set on a Slurm node the daemon refuses to start (exit 6).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import tomlkit
from probes import ALLOWED, GATE_DENIED, bare_nodes, opens
from sim_helpers import cli, gpuguard, stop_burn, write_config

from devtools.harness import wait_for
from gpuguard.backends.mig_caps import SIMULATED_CAPS_MAJOR as CAPS_MAJOR
from gpuguard.backends.posix_acl import acl_users

pytestmark = pytest.mark.gate

NODE = "ggt-node2"  # this host's Slurm NodeName in the test's gres.conf
GRES_CONF = f"""\
# the test's cluster: {NODE} has four GPUs, Slurm owns 0 and 1
AutoDetect=off
NodeName=ggt-node[1-3] Name=gpu Type=h100 File=/dev/nvidia[0-1] Cores=0-15
NodeName=ggt-node4 Name=gpu File=/dev/nvidia[2-3]
"""


def write_root_file(path: Path, text: str, mode: int = 0o644) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def stub_scontrol(directory: Path, gres: str) -> Path:
    """An `scontrol` that answers `show node NODE` as Slurm 23.11 does and records how it was asked."""
    directory.mkdir(mode=0o755, exist_ok=True)
    asked = directory / "asked"
    write_root_file(directory / "scontrol", f"""#!/bin/sh
echo "$*" >> {asked}
if [ "$1 $2 $3" != "show node {NODE}" ]; then echo "Node $3 not found" >&2; exit 1; fi
cat <<EOF
NodeName={NODE} Arch=x86_64 CoresPerSocket=16
   CPUAlloc=0 CPUEfctv=32 CPUTot=32 CPULoad=0.00
   Gres={gres}
   NodeAddr={NODE} NodeHostName={NODE} Version=23.11.4
   State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1
EOF
""", 0o755)
    return asked


def coexist_daemon(start_daemon, sandbox: Path, gres: str = "gpu:h100:2(S:0)", gres_conf_text: str = GRES_CONF,
                   simulated: dict | None = None, count: int = 4, **coexist):
    gres_conf = write_root_file(sandbox / "gres.conf", gres_conf_text)
    asked = stub_scontrol(sandbox / "bin", gres)
    d = start_daemon(count=count, simulated=simulated, watcher={"interval": "0.2s"},
                     coexist={"slurm": "auto", "gres_conf": str(gres_conf), "slurm_node": NODE, **coexist},
                     env={"PATH": f"{sandbox / 'bin'}:{os.environ['PATH']}"})
    return d, asked


def test_slurm_and_k8s_gpus_are_left_open_and_gpuguards_stay_closed(start_daemon, sandbox, burns):
    d, asked = coexist_daemon(start_daemon, sandbox, k8s_gpus=[3])
    assert asked.read_text().splitlines() == [f"show node {NODE}"]  # the cross-check was made
    alice, bob = d.add_member(), d.add_member()

    # No grant: Slurm's 0 and 1 and Kubernetes' 3 open through the gate, gpuguard's 2 does not.
    bare = bare_nodes(sandbox / "bare", range(4))
    assert opens(alice, bare) == {0: ALLOWED, 1: ALLOWED, 2: GATE_DENIED, 3: ALLOWED}
    # Their nodes are as the driver makes them (0666, no ACL); gpuguard's own is 0660 root:root.
    for minor in (0, 1, 3):
        assert stat.S_IMODE(os.stat(d.node(minor)).st_mode) == 0o666 and acl_users(d.node(minor)) == set()
    assert stat.S_IMODE(os.stat(d.node(2)).st_mode) == 0o660
    assert opens(alice, {m: d.node(m) for m in (0, 1, 3)}) == {0: ALLOWED, 1: ALLOWED, 3: ALLOWED}

    # The watcher leaves a Slurm job's process alone: root's process on gpuguard's GPU 2, which
    # nobody holds, is reported as a stray (the control); its twin on Slurm's GPU 0, started
    # first and so seen by every tick that saw the control, never is.
    on_slurm = burns(d.config_path, 0, "1GiB")
    control = burns(d.config_path, 2, "1GiB")
    wait_for(lambda: re.search(rf"event=report .*pid={control.pid}\b", d.log()))
    assert f"pid={on_slurm.pid}" not in d.log() and on_slurm.poll() is None
    stop_burn(control)

    # Allocation knows GPU 2 only: alice gets it, bob waits in the queue.
    assert d.open_session(alice)["gpus"] == [2]
    assert d.open_session(bob)["gpus"] == []
    assert opens(alice, {2: bare[2]}) == {2: ALLOWED} and opens(bob, {2: bare[2]}) == {2: GATE_DENIED}

    status = d.call("status")
    assert [(g["minor"], g["owner"]) for g in status["gpus"]] == [
        (0, "slurm"), (1, "slurm"), (2, "gpuguard"), (3, "k8s")]
    assert [h["user"] for h in status["gpus"][2]["holders"]] == [alice.name]
    text = d.cli("status").stdout
    assert re.search(r"GPU 0 .*slurm's: not managed by gpuguard", text), text
    assert re.search(r"GPU 3 .*k8s's: not managed by gpuguard", text), text
    # doctor judges Slurm's and Kubernetes' nodes by their owners' rules, and the gate as built without them
    doctor = {line.split()[1]: line for line in d.cli("doctor", env={**os.environ, **d.env}).stdout.splitlines()}
    assert doctor["coexist"] == (f"ok    coexist       Slurm: GPUs 0,1 ({sandbox / 'gres.conf'}, node {NODE}); "
                                 "Kubernetes: GPUs 3 (coexist.k8s_gpus); gpuguard manages the other GPUs")
    assert doctor["nodes"].startswith("ok") and doctor["gate"].startswith("ok"), doctor
    # `gate attach` by hand builds the same program, less Slurm's and Kubernetes' GPUs: nothing to swap
    assert d.cli("gate", "attach", "--name", d.gate_name).returncode == 0
    gate = d.cli("gate", "status", "--name", d.gate_name)
    assert gate.returncode == 0 and "problem" not in gate.stdout, gate.stdout
    assert opens(bob, {0: bare[0], 2: bare[2]}) == {0: ALLOWED, 2: GATE_DENIED}
    listed = d.cli("gpus").stdout
    # OWNER, then SHARED (each fraction's holder: none here)
    assert re.search(r"^1 .* slurm\s+-\s*$", listed, re.MULTILINE) and re.search(r"^2 .* gpuguard\s+-\s*$", listed,
                                                                                  re.MULTILINE), listed


def test_the_mig_slices_of_slurms_gpu_stay_open_and_gpuguards_closed(start_daemon, sandbox):
    """A Slurm job on a MIG slice opens the slice's capability nodes too: those of Slurm's GPU 0
    are left out of the gate with it; GPU 1's, and config and monitor, stay managed."""
    layout = tomlkit.inline_table()
    layout.update({"0": ["3g.71gb"], "1": ["3g.71gb"]})
    d, _ = coexist_daemon(start_daemon, sandbox, gres="gpu:1", count=2,
                          gres_conf_text=f"NodeName={NODE} Name=gpu File=/dev/nvidia0\n",
                          simulated={"name": "NVIDIA H200", "mig": layout})
    alice = d.add_member()
    listed = json.loads(d.cli("gpus", "--json").stdout)["gpus"]
    caps = {gpu["minor"]: [cap for piece in gpu["slices"] for cap in piece["caps"]] for gpu in listed}
    assert [gpu["owner"] for gpu in listed] == ["slurm", "gpuguard"] and len(caps[0]) == len(caps[1]) == 2
    bare = bare_nodes(sandbox / "caps", [*caps[0], *caps[1], 1, 2], major=CAPS_MAJOR)
    assert opens(alice, bare) == {**{cap: ALLOWED for cap in caps[0]}, **{cap: GATE_DENIED for cap in caps[1]},
                                  1: GATE_DENIED, 2: GATE_DENIED}  # config and monitor are never anyone's
    # only GPU 1's slice is gpuguard's to hand out; GPU 0 is listed as Slurm's, its slice not at all
    status = [(g["label"], g["owner"]) for g in d.call("status")["gpus"]]
    assert status[0] == ("0", "slurm") and [owner for _, owner in status[1:]] == ["gpuguard"], status
    assert status[1][0].startswith("1/gi"), status


def test_scontrol_counting_more_gpus_than_gres_conf_names_refuses_to_start(start_daemon, sandbox):
    with pytest.raises(AssertionError, match=r"exit status 6"):
        coexist_daemon(start_daemon, sandbox, gres="gpu:h100:3(S:0)")
    # the fixture's log is the daemon's stderr: one line naming what disagrees
    log = (sandbox / "daemon.log").read_text()
    assert f"scontrol show node {NODE} gives it 3 GPUs but {sandbox / 'gres.conf'} names only 0,1" in log, log


def test_a_hanging_scontrol_delays_the_start_by_its_timeout_only(start_daemon, sandbox):
    """slurmctld unreachable: scontrol hangs (here with a child holding its output open); the
    daemon gives up after SCONTROL_TIMEOUT and gres.conf alone decides."""
    d, asked = coexist_daemon(start_daemon, sandbox)
    d.stop()
    write_root_file(sandbox / "bin" / "scontrol", f"#!/bin/sh\necho \"$*\" >> {asked}\nsleep 6017\n", 0o755)
    d.restart()
    assert asked.read_text().splitlines() == [f"show node {NODE}"] * 2
    assert [(g["minor"], g["owner"]) for g in d.call("status")["gpus"]][:2] == [(0, "slurm"), (1, "slurm")]
    assert subprocess.run(["pgrep", "-f", "sleep 6017$"], capture_output=True).stdout == b""  # none left behind


def test_a_slurm_node_without_coexist_config_refuses_to_start(sandbox):
    """slurmd running (a real root process of that name) and a gres.conf: exit 6 and one line;
    either alone is no Slurm node."""
    gres_conf = write_root_file(sandbox / "gres.conf", GRES_CONF)
    config = write_config(sandbox, count=2, extra=f'[coexist]\ngres_conf = "{gres_conf}"\n')
    shutil.copy("/bin/sleep", sandbox / "slurmd")
    slurmd = subprocess.Popen([str(sandbox / "slurmd"), "600"])
    try:
        result = subprocess.run([*gpuguard(config, "daemon", "--gate-name", "ggt-never")], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 6, result.stderr
        [line] = result.stderr.splitlines()
        assert line.startswith("gpuguard: this is a Slurm node (slurmd runs") and 'slurm = "auto"' in line
        checked = cli(config, "config", "check")
        assert checked.returncode == 6 and "this is a Slurm node" in checked.stderr
        doctor = {line.split()[1]: line for line in cli(config, "doctor").stdout.splitlines()}
        assert doctor["coexist"].startswith("FAIL  coexist       the daemon will not start: this is a Slurm node")
        gres_conf.unlink()
        assert cli(config, "config", "check").returncode == 0  # no gres.conf: not a Slurm node
    finally:
        slurmd.kill()
        slurmd.wait()
    write_root_file(gres_conf, GRES_CONF)
    assert cli(config, "config", "check").returncode == 0  # no slurmd: not a Slurm node either


def test_a_gres_conf_others_can_write_is_not_believed(sandbox):
    gres_conf = write_root_file(sandbox / "gres.conf", GRES_CONF, 0o666)
    config = write_config(sandbox, count=2, extra=f'[coexist]\nslurm = "auto"\ngres_conf = "{gres_conf}"\n'
                                                  f'slurm_node = "{NODE}"\n')
    result = cli(config, "config", "check")
    assert result.returncode == 6
    assert f"{gres_conf}: not believed: it must be a file of root's that only root can write" in result.stderr
