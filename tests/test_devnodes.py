"""Driver nodes gpuguard makes itself once nvidia-modprobe is told not to touch /dev."""
import os
import stat
from pathlib import Path

from gpuguard.backends import devnodes


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


def test_missing_nodes_are_made_with_their_modes_and_wrong_ones_replaced(sandbox: Path) -> None:
    dev = sandbox / "dev"
    dev.mkdir()
    os.mknod(dev / "nvidia1", stat.S_IFCHR | 0o666, os.makedev(1, 3))  # wrong device behind the name
    made = devnodes.ensure_driver_nodes(dev, [0, 1])
    assert {p.name for p in made} >= {"nvidiactl", "nvidia-modeset", "nvidia0", "nvidia1"}
    for name, rdev, mode in (("nvidiactl", (195, 255), 0o666), ("nvidia-modeset", (195, 254), 0o666),
                             ("nvidia0", (195, 0), 0o660), ("nvidia1", (195, 1), 0o660)):
        st = os.stat(dev / name)
        assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == rdev
        assert stat.S_IMODE(st.st_mode) == mode and (st.st_uid, st.st_gid) == (0, 0)
    assert devnodes.ensure_driver_nodes(dev, [0, 1]) == []  # all right already: nothing made
