"""gpuguard.activation's links: what `gpuguard enable` makes in /etc and `disable` removes (in a
temporary directory standing for /etc and /usr/lib/gpuguard)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuguard import activation


@pytest.fixture
def layout(tmp_path: Path) -> tuple[activation.Link, ...]:
    vendor = tmp_path / "usr/lib/gpuguard"
    for name in ("modprobe.d/gpuguard.conf", "udev/70-gpuguard.rules"):
        (vendor / name).parent.mkdir(parents=True, exist_ok=True)
        (vendor / name).write_text(f"# {name}\n")
    return activation.links(tmp_path / "etc", vendor)


def test_enable_links_each_file_once_and_disable_removes_the_links(layout) -> None:
    assert [link.state() for link in layout] == ["off", "off"]
    assert activation.make_links(layout) == [f"linked {link.path} -> {link.target}" for link in layout]
    assert [(link.state(), os.readlink(link.path)) for link in layout] == [("on", str(link.target)) for link in layout]
    assert [link.path.read_text() for link in layout] == [link.target.read_text() for link in layout]
    assert activation.make_links(layout) == []  # enabled already: nothing to do
    assert activation.remove_links(layout) == [f"removed {link.path}" for link in layout]
    assert not [link for link in layout if os.path.lexists(link.path)]
    assert activation.remove_links(layout) == []


def test_an_admins_own_file_is_never_replaced_nor_removed(layout) -> None:
    modprobe, udev = layout
    modprobe.path.parent.mkdir(parents=True)
    modprobe.path.write_text("options nvidia NVreg_DeviceFileMode=0660\n")
    with pytest.raises(activation.ActivationError, match="exists and is not gpuguard's link"):
        activation.make_links(layout)
    assert not os.path.lexists(udev.path)  # nothing done when one of them cannot be
    assert modprobe.state() == "foreign" and activation.remove_links(layout) == []
    assert modprobe.path.read_text() == "options nvidia NVreg_DeviceFileMode=0660\n"
    # A link elsewhere is someone else's too.
    modprobe.path.unlink()
    modprobe.path.symlink_to(udev.target)
    assert modprobe.state() == "foreign"


def test_enable_refuses_when_the_installed_copies_are_missing(layout) -> None:
    layout[1].target.unlink()
    with pytest.raises(activation.ActivationError, match="missing: install gpuguard"):
        activation.make_links(layout)
    assert not os.path.lexists(layout[0].path)
