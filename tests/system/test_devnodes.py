"""Driver nodes gpuguard makes itself once nvidia-modprobe is told not to touch /dev."""
import os
import stat
import subprocess
from pathlib import Path

import pytest
from sim_helpers import cli, run_with_proc_devices

from gpuguard.backends import devnodes
from gpuguard.backends.posix_acl import acl_users


def fake_driver(root: Path, minors: dict[str, int]) -> Path:
    """A /proc/driver/nvidia/gpus look-alike: one directory per PCI address with its information file."""
    for pci, minor in minors.items():
        (root / pci).mkdir(parents=True)
        (root / pci / "information").write_text(
            f"Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 42\nGPU UUID: \t GPU-x\nDevice Minor: \t {minor}\n")
    return root


def test_driver_minors_come_from_proc_not_order(sandbox: Path) -> None:
    gpus = fake_driver(sandbox / "gpus", {"0000:1b:00.0": 2, "0000:07:00.0": 0, "0000:9a:00.0": 5})
    assert devnodes.driver_minors(gpus) == [0, 2, 5]
    assert devnodes.driver_minors(sandbox / "absent") == []


LOADED = "Character devices:\n  1 mem\n195 nvidia-frontend\n508 nvidia-uvm\n\nBlock devices:\n  7 loop\n"
UNLOADED = "Character devices:\n  1 mem\n  4 tty\n\nBlock devices:\n  7 loop\n"


def ensure_with(devices: str, dev: Path, minors: list[int], sandbox: Path) -> list[str]:
    """ensure_driver_nodes where /proc/devices reads `devices`; the names of the nodes made."""
    code = ("import json\nfrom pathlib import Path\nfrom gpuguard.backends import devnodes\n"
            f"made = devnodes.ensure_driver_nodes(Path({str(dev)!r}), {minors!r})\n"
            "print(json.dumps(sorted(p.name for p in made)))")
    return run_with_proc_devices(devices, code, sandbox)


def test_missing_nodes_are_made_with_their_modes_and_wrong_ones_replaced(sandbox: Path) -> None:
    dev = sandbox / "dev"
    dev.mkdir()
    os.mknod(dev / "nvidia1", stat.S_IFCHR | 0o666, os.makedev(1, 3))  # wrong device behind the name
    expected = [("nvidiactl", (195, 255), 0o666), ("nvidia-modeset", (195, 254), 0o666),
                ("nvidia-uvm", (508, 0), 0o666), ("nvidia-uvm-tools", (508, 1), 0o666),
                ("nvidia0", (195, 0), 0o660), ("nvidia1", (195, 1), 0o660)]
    assert ensure_with(LOADED, dev, [0, 1], sandbox) == sorted(name for name, _, _ in expected)
    assert sorted(p.name for p in dev.iterdir()) == sorted(name for name, _, _ in expected)
    for name, rdev, mode in expected:
        st = os.stat(dev / name)
        assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == rdev
        assert stat.S_IMODE(st.st_mode) == mode and (st.st_uid, st.st_gid) == (0, 0)
    assert ensure_with(LOADED, dev, [0, 1], sandbox) == []  # all right already: nothing made


def test_no_node_is_made_without_the_driver(sandbox: Path) -> None:
    dev = sandbox / "dev"
    dev.mkdir()
    assert ensure_with(UNLOADED, dev, [0, 1], sandbox) == []
    assert list(dev.iterdir()) == []


def test_acl_apply_makes_no_node_without_the_driver(sandbox: Path) -> None:
    """`gpuguard acl apply` with no daemon to ask makes the nodes itself: none, with no driver."""
    if devnodes.driver_loaded():
        pytest.skip("the nvidia driver is loaded here")
    dev = sandbox / "dev"
    dev.mkdir()
    config = sandbox / "gpuguard.toml"
    config.write_text(f'[paths]\ndevice_dir = "{dev}"\nsocket = "{sandbox}/none.sock"\nstate_dir = "{sandbox}"\n')
    result = cli(config, "acl", "apply")
    assert result.returncode == 0, result.stderr
    assert "created" not in result.stdout and list(dev.iterdir()) == []


def test_uvm_nodes_are_made_only_while_its_module_is_loaded(sandbox: Path) -> None:
    """nvidia-uvm's major is dynamic: it is read from /proc/devices."""
    dev = sandbox / "dev"
    dev.mkdir()
    without_uvm = LOADED.replace("508 nvidia-uvm\n", "")
    assert ensure_with(without_uvm, dev, [3], sandbox) == ["nvidia-modeset", "nvidia3", "nvidiactl"]
    assert ensure_with(LOADED, dev, [3], sandbox) == ["nvidia-uvm", "nvidia-uvm-tools"]


def test_sync_gpu_node_reports_and_repairs_what_was_changed_by_hand(sandbox: Path) -> None:
    node = sandbox / "nvidia2"
    assert devnodes.sync_gpu_node(node, (195, 2), {2001}) == [f"{node}: missing or not the device"]
    assert devnodes.sync_gpu_node(node, (195, 2), {2001}) == []  # right: nothing to say, nothing written

    # An admin's chown, chmod and setfacl, each reported with what it was, and undone.
    os.chown(node, 2001, 2001)
    os.chmod(node, 0o666)
    subprocess.run(["setfacl", "-m", "u:2009:rw", str(node)], check=True)
    assert devnodes.sync_gpu_node(node, (195, 2), {2001}) == [
        f"{node}: owner 2001:2001", f"{node}: mode 0666", f"{node}: ACL users [2001, 2009] instead of [2001]"]
    st = os.stat(node)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o660, 0, 0)
    assert acl_users(node) == {2001}
    assert devnodes.sync_gpu_node(node, (195, 2), {2001}) == []
