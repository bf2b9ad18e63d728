"""MIG slices granted through the real gate: simulated H200s cut into slices by the admin's layout,
a real daemon, real users whose processes open the nodes.

A slice holder needs three nodes: the parent GPU's /dev/nvidia<N> and the slice's GPU-instance and
compute-instance capability nodes (/dev/nvidia-caps/nvidia-cap<M>, minors from the driver's
mig-minors table; simulated major 120). As in test_daemon, each node is opened twice by the
user's own process: through the daemon's node (0660 root:root + ACLs: EACCES when not granted)
and through a bare 0666 node of the same number (only the gate can say no: EPERM). ENXIO means
the kernel let the open through to the absent driver.
"""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import probes
import pytest
import tomlkit
from probes import ALLOWED, FILE_DENIED, GATE_DENIED, opens
from ssh_harness import PamSession, PamStacks, module_line
from test_notify import read_until  # a pty's output up to a needle

from devtools.harness import wait_for
from gpuguard.backends import mig_caps, posix_acl
from gpuguard.backends.devnodes import caps_node
from gpuguard.backends.sim_mig import MIG_MINORS_FILE
from gpuguard.backends.sim_registry import REGISTRY_DIR
from gpuguard.core.model import NVIDIA_MAJOR, slice_place, unit_label

pytestmark = pytest.mark.gate

CAPS_MAJOR = mig_caps.SIMULATED_CAPS_MAJOR
SEVEN = ["1g.18gb"] * 7


def mig_daemon(start_daemon, layout: dict[str, list[str]], count: int = 1, **tables):
    """A daemon over `count` simulated H200s, cut as `layout` says (GPU minor -> profiles)."""
    mig = tomlkit.inline_table()
    mig.update(layout)
    return start_daemon(count=count, simulated={"name": "NVIDIA H200", "mig": mig}, **tables)


def driver_table(d) -> dict[str, int]:
    """The (simulated) driver's mig-minors: capability name -> minor."""
    return mig_caps.read_mig_minors(d.device_dir / REGISTRY_DIR / MIG_MINORS_FILE)


def nodes_of(d, unit: int) -> dict[str, tuple[int, int]]:
    """The devices a slice holder opens, by name."""
    parent, gi, ci = slice_place(unit)
    gi_cap, ci_cap = mig_caps.slice_caps(driver_table(d), parent, gi, ci)
    return {"gpu": (NVIDIA_MAJOR, parent), "gi": (CAPS_MAJOR, gi_cap), "ci": (CAPS_MAJOR, ci_cap)}


def daemon_path(d, device: tuple[int, int]) -> Path:
    major, minor = device
    return d.node(minor) if major == NVIDIA_MAJOR else caps_node(d.device_dir, minor)


def access(d, user, devices: dict[str, tuple[int, int]]) -> dict[str, tuple[str, str]]:
    """name -> (through the daemon's node, through a bare 0666 node)."""
    bare = d.sandbox / "bare"
    bare.mkdir(mode=0o755, exist_ok=True)
    bare_paths = {name: probes.open_node(bare / f"{major}-{minor}", (major, minor))
                  for name, (major, minor) in devices.items()}
    managed = opens(user, {name: daemon_path(d, device) for name, device in devices.items()})
    gate = opens(user, bare_paths)
    return {name: (managed[name], gate[name]) for name in devices}


def burn_on_slice(d, user, uuid: str, *args: str) -> subprocess.CompletedProcess:
    return d.cli_as(user, "sim", "burn", "--slice", uuid, "--mem", "1GiB", *args)


def test_slice_holders_open_their_own_slice_and_nothing_else(start_daemon) -> None:
    d = mig_daemon(start_daemon, {"0": SEVEN})
    alice, bob = d.add_member(), d.add_member()
    mine, theirs = d.open_session(alice), d.open_session(bob)
    (a,), (b,) = mine["gpus"], theirs["gpus"]
    assert a != b and slice_place(a)[0] == slice_place(b)[0] == 0  # two slices of one GPU
    (grant,) = d.grants(alice)
    assert mine["cuda_visible_devices"] == grant["uuid"] and grant["uuid"].startswith("MIG-")
    assert "1g.18gb" in mine["message"]

    own, other = nodes_of(d, a), nodes_of(d, b)
    seen = access(d, alice, {**own, "bob_gi": other["gi"], "bob_ci": other["ci"]})
    assert seen == {"gpu": (ALLOWED, ALLOWED), "gi": (ALLOWED, ALLOWED), "ci": (ALLOWED, ALLOWED),
                    "bob_gi": (FILE_DENIED, GATE_DENIED), "bob_ci": (FILE_DENIED, GATE_DENIED)}
    # MIG config (create and destroy slices) and monitor: nobody's to be granted, the gate says no
    table = driver_table(d)
    bare = d.sandbox / "bare"
    admin_caps = {name: probes.open_node(bare / name, (CAPS_MAJOR, table[name])) for name in ("config", "monitor")}
    assert opens(alice, admin_caps) == {"config": GATE_DENIED, "monitor": GATE_DENIED}
    # the parent's node is open to both; each slice's capabilities to its holder only
    assert access(d, bob, {"gpu": own["gpu"], "gi": own["gi"]})["gi"] == (FILE_DENIED, GATE_DENIED)

    # a CUDA program: on her own slice it runs, on bob's the driver's capability check refuses it
    assert burn_on_slice(d, alice, grant["uuid"], "--seconds", "0").returncode == 0
    refused = burn_on_slice(d, alice, d.grants(bob)[0]["uuid"], "--seconds", "0")
    assert refused.returncode == 1 and "no CUDA-capable device" in refused.stderr

    # bob gives his back: alice keeps the parent, bob loses his capabilities
    d.close_session(bob, theirs["pid"])
    assert wait_for(lambda: d.grants(bob) == [])
    assert access(d, bob, other) == {name: (FILE_DENIED, GATE_DENIED) for name in other}
    assert access(d, alice, own) == {name: (ALLOWED, ALLOWED) for name in own}


def test_seven_users_share_one_gpu_cut_in_seven_and_the_eighth_waits(start_daemon) -> None:
    d = mig_daemon(start_daemon, {"0": SEVEN})
    users = [d.add_member() for _ in range(8)]
    replies = [d.open_session(user) for user in users]
    units = [reply["gpus"] for reply in replies]
    assert sorted(u for (u,) in units[:7]) == sorted(g["minor"] for g in d.call("status")["gpus"])
    assert units[7] == [] and replies[7]["queue"]["position"] == 1
    status = d.cli("status")
    assert status.returncode == 0 and "GPU 0/gi" in status.stdout and "MIG slice (bounded in hardware)" in status.stdout
    # the first to leave hands their slice to the one waiting
    d.close_session(users[0], replies[0]["pid"])
    assert wait_for(lambda: d.grants(users[7]) != [])
    assert [g["minor"] for g in d.grants(users[7])] == units[0]


def test_a_layout_change_revokes_the_changed_slices_and_tells_their_users(start_daemon, burns) -> None:
    d = mig_daemon(start_daemon, {"0": ["1g.18gb"], "1": ["3g.71gb"]}, count=2)
    alice, bob = d.add_member(), d.add_member()
    master, slave = os.openpty()  # alice's terminal
    terminal = Path(os.ttyname(slave))
    os.chown(terminal, alice.uid, -1)
    os.set_blocking(master, False)
    d.call("session_open", user=alice.name, service="ggt-test", rhost="127.0.0.1",
           tty=str(terminal.relative_to("/dev")), pid=d.caller().pid)
    d.open_session(bob)
    (grant,), (kept,) = d.grants(alice), d.grants(bob)
    assert slice_place(grant["minor"])[0] == 0 and slice_place(kept["minor"])[0] == 1  # the smallest first
    old = nodes_of(d, grant["minor"])
    # like nvidia-smi, the simulation refuses to destroy a slice a process runs on
    job = burns(d.config_path, None, mig=grant["uuid"], user=alice, seconds=60)
    refused = d.cli("sim", "mig", "0", "1g.18gb", "1g.18gb")
    assert refused.returncode == 1 and f"in use by pids {job.pid}" in refused.stderr
    job.kill()
    job.wait(30)
    # the admin re-cuts GPU 0 (alice's): the GI id comes back, with another slice behind it
    changed = d.cli("sim", "mig", "0", "1g.18gb", "1g.18gb")
    assert changed.returncode == 0, changed.stderr
    assert wait_for(lambda: d.grants(alice) == [])
    event = [e for e in d.whoami(alice)["events"] if e["kind"] == "revoke"][-1]
    assert event["rule"] == "layout" and "MIG layout changed" in event["message"], event
    told = read_until(master, b"gpuguard whoami for details")
    os.close(master)
    os.close(slave)
    assert f"MIG slice {unit_label(grant['minor'])} was re-created as another slice".encode() in told
    # the capability minors of the old place now belong to a new slice nobody holds
    assert access(d, alice, {"gi": old["gi"], "ci": old["ci"]}) == {"gi": (FILE_DENIED, GATE_DENIED),
                                                                     "ci": (FILE_DENIED, GATE_DENIED)}
    # a slice of the other GPU is untouched (its memory_used is the watcher's latest sample: it moves)
    assert [{**g, "memory_used": None} for g in d.grants(bob)] == [{**kept, "memory_used": None}]
    new = {g["uuid"] for g in d.call("status")["gpus"] if g["profile"] is not None and g["label"].startswith("0/")}
    assert len(new) == 2 and grant["uuid"] not in new
    # she asks again: one of the new slices
    again = d.call_as(alice, "request")
    assert again["ok"] and d.grants(alice)[0]["uuid"] in new


def test_the_pam_module_puts_the_mig_uuid_in_cuda_visible_devices(start_daemon, pam_module) -> None:
    d = mig_daemon(start_daemon, {"0": SEVEN}, sessions={"grant": "all"})
    alice = d.add_member()
    stacks = PamStacks()
    try:
        service = stacks.make(module_line(d.socket, "quiet"))
        with PamSession(service, alice.name) as session:
            (grant,) = d.grants(alice)
            assert session.env.get("CUDA_VISIBLE_DEVICES") == grant["uuid"]
            assert grant["uuid"].startswith("MIG-")
    finally:
        stacks.remove_all()


def test_admins_and_users_name_slices_by_label(start_daemon) -> None:
    d = mig_daemon(start_daemon, {"0": ["1g.18gb", "2g.35gb"]},
                   defaults={"whole_gpus": False, "slice_profiles": ["2g.35gb", "1g.18gb"]})
    alice = d.add_member()
    slices = {g["label"]: g for g in d.call("status")["gpus"]}
    label = next(name for name, g in slices.items() if g["profile"] == "2g.35gb")
    granted = d.cli("grant", alice.name, "--gpu", label)
    assert granted.returncode == 0 and f"granted GPU {label} to {alice.name}" in granted.stdout, granted
    shown = d.cli_as(alice, "whoami").stdout
    assert "sharing no, MIG slices only, slice profiles 2g.35gb, 1g.18gb\n" in shown
    assert f"  {label} " in shown and f"export CUDA_VISIBLE_DEVICES={slices[label]['uuid']}" in shown
    rows = d.cli("status", "--csv").stdout.splitlines()
    assert any(row.startswith(f"{label},NVIDIA H200 MIG 2g.35gb,{slices[label]['uuid']},") for row in rows), rows
    bad = d.cli("grant", alice.name, "--gpu", "0/gi99/ci0")
    assert bad.returncode == 2 and "no MIG slice gpu0/gi99/ci0" in bad.stderr
    released = d.cli_as(alice, "release", "--gpu", label)
    assert released.returncode == 0 and f"released GPU {label}" in released.stdout, released


def test_a_recreated_capability_node_gets_its_mode_and_acl_back(start_daemon) -> None:
    d = mig_daemon(start_daemon, {"0": ["1g.18gb", "1g.18gb"]})
    alice = d.add_member()
    (unit,) = d.open_session(alice)["gpus"]
    _, ci = nodes_of(d, unit)["ci"]
    node = caps_node(d.device_dir, ci)
    probes.fresh_node(node, (CAPS_MAJOR, ci))  # what nvidia-modprobe does: open to all, no uevent
    assert wait_for(lambda: posix_acl.acl_users(node) == {alice.uid} and stat.S_IMODE(os.stat(node).st_mode) == 0o660)
