"""Which kernel uevents make the node watcher re-check every node (node_watcher.is_driver_event)."""
from __future__ import annotations

import pytest

from gpuguard.backends.node_watcher import is_driver_event

MAJORS = {"195"}


def uevent(action: str, devpath: str, **fields: str) -> bytes:
    """A uevent datagram as the kernel sends it: "ACTION@DEVPATH", then KEY=VALUE lines, NUL-separated."""
    pairs = {"ACTION": action, "DEVPATH": devpath, **fields, "SEQNUM": "4242"}
    return "\0".join([f"{action}@{devpath}", *(f"{k}={v}" for k, v in pairs.items())]).encode() + b"\0"


@pytest.mark.parametrize("module", ["nvidia", "nvidia_uvm", "nvidia_modeset"])
def test_a_driver_module_loading_counts(module: str) -> None:
    # nvidia-uvm usually loads after the daemon started: its nodes must be made then.
    assert is_driver_event(uevent("add", f"/module/{module}", SUBSYSTEM="module"), MAJORS)


def test_managed_nodes_and_driver_binds_count() -> None:
    assert is_driver_event(uevent("add", "/devices/virtual/nvidia/nvidia3", MAJOR="195", MINOR="3"), MAJORS)
    assert is_driver_event(uevent("bind", "/devices/pci0000:00/0000:00:18.0", DRIVER="nvidia"), MAJORS)


def test_other_events_do_not() -> None:
    assert not is_driver_event(uevent("add", "/module/nvidia_peermem_x", SUBSYSTEM="module"), MAJORS)
    assert not is_driver_event(uevent("add", "/module/snd_hda_intel", SUBSYSTEM="module"), MAJORS)
    assert not is_driver_event(uevent("change", "/devices/virtual/mem/full", MAJOR="1", MINOR="7"), MAJORS)
