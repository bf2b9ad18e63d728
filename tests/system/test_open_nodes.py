"""`gpuguard disable` opens the GPU nodes as the driver makes them: real nodes with real ACLs."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from gpuguard import activation
from gpuguard.backends.posix_acl import acl_users, apply_acls


def node(path: Path, minor: int, mode: int, owner: tuple[int, int] = (0, 0)) -> Path:
    path.parent.mkdir(exist_ok=True)
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(195, minor))
    os.chown(path, *owner)
    os.chmod(path, mode)
    return path


def test_open_nodes_gives_gpus_0666_and_capabilities_0444_without_acl_entries(sandbox) -> None:
    dev = sandbox / "dev"
    gpus = [node(dev / f"nvidia{minor}", minor, 0o660) for minor in range(3)]
    apply_acls(gpus[0], [12345, 12346])
    os.chown(gpus[1], 1000, 0)
    cap = node(dev / "nvidia-caps" / "nvidia-cap3", 3, 0o660)
    apply_acls(cap, [12345])
    control = node(dev / "nvidiactl", 255, 0o666)
    other = node(dev / "nvidia-uvm", 0, 0o600)  # not a GPU node: left as it is
    (dev / "nvidia7").write_text("")  # a plain file named like a node: not a device, left alone

    assert activation.open_nodes(dev) == [str(p) for p in [*gpus, cap]]
    for path, mode in [*((g, 0o666) for g in gpus), (cap, 0o444)]:
        st = os.stat(path)
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (mode, 0, 0), path
        assert acl_users(path) == set(), path
    assert stat.S_IMODE(os.stat(control).st_mode) == 0o666 and stat.S_IMODE(os.stat(other).st_mode) == 0o600
    assert (dev / "nvidia7").read_text() == "" and stat.S_ISREG(os.stat(dev / "nvidia7").st_mode)
    assert activation.open_nodes(dev) == []  # open already: nothing changed
    assert activation.open_nodes(sandbox / "absent") == []
