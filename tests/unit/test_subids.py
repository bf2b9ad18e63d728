"""subids: the owners of /etc/subuid's ranges, read from a real file as it changes."""
from __future__ import annotations

import os
from pathlib import Path

from gpuguard.backends.subids import CHECK_EVERY, Range, SubuidOwners, parse


def test_a_subuid_file_gives_its_well_formed_ranges():
    text = "alice:100000:65536\n1002:165536:10\nbroken line\nbob:x:5\n:5:5\ncarol:300000:65536:extra\n"
    assert parse(text) == (Range("alice", 100000, 65536), Range("1002", 165536, 10))


def test_the_owner_of_a_uid_is_the_range_holding_it(tmp_path: Path):
    subuid = tmp_path / "subuid"
    subuid.write_text("alice:100000:65536\nbob:165536:65536\n")
    owners = SubuidOwners(subuid)
    assert owners.owner(100000) == "alice" and owners.owner(165535) == "alice"
    assert owners.owner(165536) == "bob" and owners.owner(231071) == "bob"
    assert owners.owner(231072) is None and owners.owner(1000) is None and owners.owner(99999) is None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def alice_owns(tmp_path: Path) -> tuple[SubuidOwners, Path, Clock]:
    """Owners read from a file that gives alice one range, asked once; with the file and the clock."""
    clock, subuid = Clock(), tmp_path / "subuid"
    subuid.write_text("alice:100000:65536\n")
    owners = SubuidOwners(subuid, clock=clock)
    assert owners.owner(100001) == "alice"
    return owners, subuid, clock


def test_a_changed_file_is_read_again_once_looked_at(tmp_path: Path):
    owners, subuid, clock = alice_owns(tmp_path)
    subuid.write_text("carol:100000:65536\n")  # usermod --add-subuids, --del-subuids
    os.utime(subuid, ns=(0, 10**9))  # a new mtime, whatever the file system's granularity
    assert owners.owner(100001) == "alice"  # not looked at again within CHECK_EVERY
    clock.now += CHECK_EVERY
    assert owners.owner(100001) == "carol"
    subuid.unlink()
    clock.now += CHECK_EVERY
    assert owners.owner(100001) is None  # no file: no ranges


def test_a_file_that_cannot_be_read_for_a_moment_keeps_the_ranges_read(tmp_path: Path):
    owners, subuid, clock = alice_owns(tmp_path)
    subuid.unlink()
    subuid.mkdir()  # there, changed, and its read fails (as one would with the descriptors run out)
    clock.now += CHECK_EVERY
    assert owners.owner(100001) == "alice"
